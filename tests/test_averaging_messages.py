"""The ring's message schemas (averaging/wire.py): what honest members send parses, on the wire as the same
msgpack maps as before the schemas, and every bound the hand checks had refuses in one line naming the field.

No network: metadata is fed as msgpack bytes, as the handler reads it.
"""

import msgpack
import pytest

from ravnest_swarm.averaging.wire import (FAILURE_CHARS, MAX_STRIPES, RING_HANDLER, RingAbort, RingArrive, RingPart,
                                          RingReply, RingRequest, decode_ring_message)
from ravnest_swarm.net.messages import HANDLERS, MessageError

PEER = "QmXoypizjW3WknFiJnKLwHCnL72vedxjQkDDP1mXWo6uco"
BASE = dict(run="demo", step=3, ring=1, position=0, attempt=[])


def refusal(metadata) -> str:
    with pytest.raises(MessageError) as refused:
        decode_ring_message(msgpack.packb(metadata, use_bin_type=True))
    reason = str(refused.value)
    assert "\n" not in reason and reason.startswith("ring message: "), reason
    return reason


def test_what_members_send_parses_as_its_kind_and_goes_on_the_wire_as_the_same_map():
    part = dict(BASE, phase="gather", position=1, attempt=[PEER], stripe=1, stripes=2)
    arrive = dict(BASE, phase="arrive")
    excluded = dict(BASE, phase="abort", excluded=[PEER])
    failed = dict(BASE, phase="abort", failure="no chunk within the ring timeout")
    for metadata, kind in [(part, RingPart), (arrive, RingArrive), (excluded, RingAbort), (failed, RingAbort)]:
        message = decode_ring_message(msgpack.packb(metadata, use_bin_type=True))
        assert type(message) is kind
        assert message.as_metadata() == metadata  # the keys the hand-built dicts had, no more
    # a message without stripe/stripes is one stream
    assert decode_ring_message(msgpack.packb(dict(BASE, phase="reduce"))).stripes == 1
    assert RingReply().as_metadata() == {}


def test_the_ring_handler_is_registered_with_its_schemas():
    handler = HANDLERS[RING_HANDLER]
    assert (handler.request, handler.reply, handler.owner) == (RingRequest, RingReply, "ravnest_swarm.averaging.wire")


@pytest.mark.parametrize("metadata, field", [
    (dict(BASE, phase="finish"), "(message)"),
    (dict(BASE, phase="a\nb"), "(message)"),  # refused in one line: the phase it got is not quoted
    ({k: v for k, v in BASE.items() if k != "step"} | dict(phase="reduce"), "part.step"),
    (dict(BASE, phase="reduce", step=True), "part.step"),
    (dict(BASE, phase="reduce", step=-1), "part.step"),
    (dict(BASE, phase="reduce", ring="0"), "part.ring"),
    (dict(BASE, phase="reduce", run=7), "part.run"),
    (dict(BASE, phase="reduce", attempt=PEER), "part.attempt"),
    (dict(BASE, phase="reduce", attempt=[7]), "part.attempt.0"),
    (dict(BASE, phase="reduce", attempt=["Q" * 129]), "part.attempt.0"),
    (dict(BASE, phase="reduce", stripe=0, stripes=MAX_STRIPES + 1), "part.stripes"),
    (dict(BASE, phase="reduce", stripe=2, stripes=2), "part"),
    (dict(BASE, phase="gather", stripe=-1), "part.stripe"),
    (dict(BASE, phase="arrive", stripe=0), "arrive.stripe"),
    (dict(BASE, phase="abort", excluded=[PEER, 3]), "abort.excluded.1"),
    (dict(BASE, phase="abort", failure="x" * (FAILURE_CHARS + 1)), "abort.failure"),
    (dict(BASE, phase="abort", surplus=1), "abort.surplus"),
])
def test_a_ring_message_outside_its_schema_is_refused_naming_the_field(metadata, field):
    assert f"field '{field}'" in refusal(metadata)


def test_metadata_that_is_not_a_map_is_refused():
    assert "metadata must be a msgpack map" in refusal([1, 2])
