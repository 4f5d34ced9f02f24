"""hivemind's msgpack decoding, bounded in depth.

``MSGPackSerializer`` decodes a tuple (and each of its extension types) by calling msgpack again from its
extension hook: msgpack's own limit on nesting counts one call, so a value of tuples nested a few hundred deep, about
1 KB, overflowed the C stack and killed the process (SIGSEGV, no exception). hivemind's DHT decodes every stored value
before any validator sees it, so one store by anyone who reaches a node's DHT port killed it, and a ticket of such a
value in one peer record killed every peer that read it. :func:`bound_extension_depth` makes the hook refuse a value
nested deeper than :data:`MAX_EXTENSION_DEPTH` with a ValueError, which the DHT and our validators treat as any
malformed value. ``ravnest_swarm.net`` installs it on import: before any node starts or any record is read.
"""

from __future__ import annotations

import threading

from hivemind.utils.serializer import MSGPackSerializer

# our records nest a tuple or two; a few hundred levels overflow the C stack
MAX_EXTENSION_DEPTH = 32

_depth = threading.local()  # the extension hook's nesting in this thread's decode


def bound_extension_depth() -> None:
    """Make ``MSGPackSerializer`` refuse values of extension types nested deeper than :data:`MAX_EXTENSION_DEPTH`
    (once per process; the hook calls itself through the class, so the nested calls are bounded too)."""
    decode = MSGPackSerializer.__dict__["_decode_ext_types"].__func__
    if getattr(decode, "bounded", False):
        return

    def bounded(cls, type_code: int, data: bytes):
        depth = getattr(_depth, "value", 0)
        if depth >= MAX_EXTENSION_DEPTH:
            raise ValueError(f"msgpack value nested deeper than {MAX_EXTENSION_DEPTH} extension types")
        _depth.value = depth + 1
        try:
            return decode(cls, type_code, data)
        finally:
            _depth.value = depth

    bounded.bounded = True
    MSGPackSerializer._decode_ext_types = classmethod(bounded)
