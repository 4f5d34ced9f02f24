"""Typed message metadata: every handler's request and reply metadata is a pydantic schema, validated here.

A message's metadata travels as a msgpack map (:func:`~ravnest_swarm.net.transport.unpack_metadata`
bounds its size and checks that it is a map); :func:`parse_message` then checks it against the
handler's schema, strictly (no coercion, no unknown fields), and turns any violation into one line
naming the field. Handlers never read a raw dict. :data:`HANDLERS` lists every handler the project
registers, with its schemas, size limit and who may call it; ``docs/protocol.md`` is checked against it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, Optional, Type, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from ravnest_swarm.net.transport import pack_metadata, unpack_metadata

MessageT = TypeVar("MessageT", bound="Message")
FIELD_NAME_RE = re.compile(r"^[A-Za-z0-9_]{1,64}\Z")  # what a schema's field (or a map's key of digits) is called


class MessageError(ValueError):
    """Metadata that does not fit its schema; the text is one line and goes back to the sender."""


class Message(BaseModel):
    """Base of every message schema: strict types, unknown fields refused, immutable once parsed."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    def pack(self) -> bytes:
        return pack_metadata(self.as_metadata())

    def as_metadata(self) -> Dict[str, Any]:
        return self.model_dump(mode="python")


def parse_message(schema: Type[MessageT], metadata: Any, what: Optional[str] = None) -> MessageT:
    """``metadata`` (a decoded msgpack value) as ``schema``, or :class:`MessageError` naming the first bad field."""
    what = what or schema.__name__
    if not isinstance(metadata, dict):
        raise MessageError(f"{what}: metadata must be a map, got {type(metadata).__name__}")
    try:
        return schema.model_validate(metadata)
    except ValidationError as e:
        error = e.errors()[0]
        where = ".".join(_field_name(part) for part in error["loc"]) or "(message)"
        raise MessageError(f"{what}: field {where!r}: {error['msg']}") from None


def _field_name(part: Any) -> str:
    """A field's name as a refusal says it: the sender chose the names of unknown fields, and a name that spelled a
    marker of the receiver's own refusals ("; retry later") had its garbage counted as a busy neighbour's."""
    return str(part) if isinstance(part, int) or FIELD_NAME_RE.match(str(part)) else "(a field of another name)"


def decode_message(schema: Type[MessageT], raw: bytes, what: Optional[str] = None) -> MessageT:
    """Raw msgpack metadata, bounded (:func:`unpack_metadata`) and parsed as ``schema``."""
    try:
        metadata = unpack_metadata(raw)
    except ValueError as e:
        raise MessageError(f"{what or schema.__name__}: {e}") from None
    return parse_message(schema, metadata, what)


@dataclass(frozen=True)
class Handler:
    """One RPC handler as the project registers it, for validation and for ``docs/protocol.md``.

    :param name: the p2pd handler name
    :param request: schema of the request's metadata (of the first frame, for streamed messages)
    :param reply: schema of the reply's metadata
    :param max_bytes: the largest request the handler reads (frames and tensors included)
    :param callers: who may call it, in words (the check itself is the handler's)
    :param owner: the module that registers it
    """

    name: str
    request: Type[Message]
    reply: Type[Message]
    max_bytes: int
    callers: str
    owner: str


HANDLERS: Dict[str, Handler] = {}


def register_handler(handler: Handler) -> Handler:
    """Declare a handler (at import time of the module that serves it); names are unique."""
    if handler.name in HANDLERS and HANDLERS[handler.name] != handler:
        raise ValueError(f"handler {handler.name!r} is declared twice")
    HANDLERS[handler.name] = handler
    return handler
