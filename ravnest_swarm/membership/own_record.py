"""Our own peer record made publishable, whatever our figures did (``publishable``): the schema (``records.py``)
refuses a record with a figure out of its bounds, and a peer whose loss passed 10^6 failed every renewal and
vanished from everyone's view while it ran (issue 29)."""

from __future__ import annotations

import math
from typing import Dict

import pydantic.v1 as pydantic

from ravnest_swarm.membership.records import MAX_NOTE_LEN, PeerRecord
from ravnest_swarm.membership.text import CONTROL_CHARACTER_RE


def publishable(record: Dict) -> Dict:
    """``record`` as a valid :class:`PeerRecord` dict, whatever the peer's own figures did: a number out of its
    field's bounds is clamped to the bound, a number that is not finite becomes None, and either is named in
    ``out_of_range``; a note loses control characters and is cut to its length. A record that still fails (a
    field no figure fills: a bug of ours) raises :class:`RecordError` with the reason in one line."""
    fixed, flagged = dict(record), []
    for name, field in PeerRecord.__fields__.items():
        value = fixed.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        lo, hi = getattr(field.type_, "ge", None), getattr(field.type_, "le", None)
        if isinstance(value, float) and not math.isfinite(value):
            fixed[name] = None if not field.required else (lo if value < 0 else hi)
        elif lo is not None and value < lo:
            fixed[name] = type(value)(lo)
        elif hi is not None and value > hi:
            fixed[name] = type(value)(hi)
        else:
            continue
        flagged.append(name)
    if isinstance(fixed.get("note"), str):
        fixed["note"] = CONTROL_CHARACTER_RE.sub(" ", fixed["note"])[:MAX_NOTE_LEN]
    fixed["out_of_range"] = flagged or None
    try:
        return PeerRecord.parse_obj(fixed).dict()
    except pydantic.ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, error['loc']))}: {error['msg']}" for error in e.errors())
        raise RecordError(f"our peer record does not pass its schema ({problems})") from None


class RecordError(Exception):
    """Our own peer record cannot be made valid (:func:`publishable`)."""
