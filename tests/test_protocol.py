"""docs/protocol.md against the handler registry, and the message schemas refusing bad metadata in one line.

No network: the modules that serve handlers are imported (which registers them), and schemas are fed
msgpack bytes as a handler receives them.
"""

import asyncio
import importlib
import re
from pathlib import Path
from types import SimpleNamespace

import msgpack
import pytest
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from ravnest_swarm.bench.transfer import TransferProbeRequest
from ravnest_swarm.membership.services import DialBackReply, DialBackRequest, PingReply, PingRequest
from ravnest_swarm.net.messages import HANDLERS, MessageError, decode_message
from ravnest_swarm.net.routes import (DialMeReply, DialRequest, ForwardedHeader, ForwardHeader, ProbeFrame, ProbeReply,
                                      Relayed, ReverseConnectReply, probe_handler)
from ravnest_swarm.swarm.state_transfer import (LayerStateMessageReply, LayerStateMessageRequest, LayerStateRequest,
                                                LayerStateTensorHeader)
from stream_helpers import END_OF_STREAM, frames_bytes

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ravnest_swarm"
PROTOCOL_DOC = ROOT / "docs" / "protocol.md"
# a handler's name is a module-level constant: NAME = "ravnest.something"
HANDLER_NAME_CONSTANT = re.compile(r'^[A-Z_]+ = "(ravnest\.[a-z0-9_.]+)"', re.MULTILINE)


def serving_modules():
    """Every module that registers a handler, found in the source (so a new one is imported without a list)."""
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "messages.py" and "register_handler(" in path.read_text():
            yield ".".join(path.relative_to(ROOT).with_suffix("").parts)


for module in serving_modules():
    importlib.import_module(module)


def handler_names_in_code():
    return {name: path.relative_to(ROOT) for path in PACKAGE.rglob("*.py")
            for name in HANDLER_NAME_CONSTANT.findall(path.read_text())}


def doc_sections():
    """docs/protocol.md's handler sections: each starts with a heading "### `name`"."""
    sections = re.split(r"^### ", PROTOCOL_DOC.read_text(), flags=re.MULTILINE)[1:]
    return {re.match(r"`([^`]+)`", section).group(1): section for section in sections}


def test_every_handler_named_in_the_code_is_registered():
    unregistered = {name: str(path) for name, path in handler_names_in_code().items() if name not in HANDLERS}
    assert not unregistered, f"handler names with no register_handler: {unregistered}"


def test_every_registered_handler_is_in_the_protocol_doc_with_its_size_limit():
    sections = doc_sections()
    assert HANDLERS, "no handler registered"
    for name, handler in HANDLERS.items():
        assert name in sections, f"docs/protocol.md has no section for {name}"
        assert f"{handler.max_bytes:,}" in sections[name], f"docs/protocol.md: {name} without max bytes {handler.max_bytes:,}"
        for schema in (handler.request, handler.reply):
            assert schema.__name__ in sections[name], f"docs/protocol.md: {name} does not name {schema.__name__}"
    assert not set(sections) - set(HANDLERS), f"docs/protocol.md lists unregistered handlers: {set(sections) - set(HANDLERS)}"


# ---- the schemas of the handlers outside the pipeline and averaging ---------------------------------------

PEER = "QmXoypizjW3WknFiJnKLwHCnL72vedxjQkDDP1mXWo6uco"
MADDR = "/ip4/10.0.0.2/tcp/4000"

# schema, valid metadata, (field, value of the wrong type), (field, value out of range) or None for a bool
SCHEMAS = [
    (DialRequest, {"peer": PEER, "maddrs": [MADDR]}, ("peer", 5), ("maddrs", [MADDR] * 9)),
    (DialMeReply, {"dialed": False, "error": "OSError: refused"}, ("dialed", 1), ("error", "x" * 301)),
    (ReverseConnectReply, {"connected": True, "dialed": True}, ("connected", "yes"), ("error", "x" * 301)),
    (ForwardHeader, {"to": PEER, "handler": "ravnest.probe"}, ("to", PEER.encode()), ("handler", "ravnest." + "x" * 100)),
    (ForwardedHeader, {"from": PEER, "handler": "ravnest.probe"}, ("from", 7), ("from", "Q" * 129)),
    (ProbeReply, {"bytes": 1024}, ("bytes", "1024"), ("bytes", -1)),
    (PingReply, {"time": 1.7e9, "relay": {"reversals": 2}}, ("relay", [2]), ("time", -1.0)),
    (DialBackRequest, {"ports": [4000]}, ("ports", [True]), ("ports", [65536])),
    (DialBackReply, {"reachable": False, "tried": ["10.0.0.2:4000"]}, ("reachable", None), ("tried", ["a:1"] * 257)),
    (LayerStateRequest, {"run": "demo", "layers": [0, 1]}, ("layers", [0.5]), ("layers", [-1])),
    (LayerStateMessageRequest, {"run": "demo", "layers": [3]}, ("run", 3), ("layers", [3, 4])),
    (LayerStateTensorHeader, {"layer": 0, "name": "weight", "parts": 2, "step": 7}, ("parts", "2"), ("parts", 65537)),
    (LayerStateMessageReply, {"layer": 0, "names": ["weight", "bias"], "step": 7}, ("names", "weight"), ("step", -1)),
    (TransferProbeRequest, {"probe": True}, ("probe", 1), None),
]
EMPTY_SCHEMAS = [ProbeFrame, PingRequest, Relayed]


def packed(metadata) -> bytes:
    return msgpack.packb(metadata, use_bin_type=True)


def refusal(schema, metadata) -> str:
    with pytest.raises(MessageError) as refused:
        decode_message(schema, packed(metadata), "ravnest.test")
    reason = str(refused.value)
    assert "\n" not in reason and reason.startswith("ravnest.test: "), reason
    return reason


@pytest.mark.parametrize("schema, valid, wrong_type, out_of_range", SCHEMAS, ids=[s[0].__name__ for s in SCHEMAS])
def test_a_schema_takes_what_honest_peers_send_and_refuses_in_one_line_naming_the_field(
        schema, valid, wrong_type, out_of_range):
    parsed = decode_message(schema, packed(valid))
    assert decode_message(schema, parsed.pack()) == parsed
    for field, value in [wrong_type] + ([out_of_range] if out_of_range else []):
        assert f"field '{field}" in refusal(schema, {**valid, field: value})
    assert "field 'surplus': Extra inputs are not permitted" in refusal(schema, {**valid, "surplus": 1})


@pytest.mark.parametrize("schema", EMPTY_SCHEMAS, ids=[s.__name__ for s in EMPTY_SCHEMAS])
def test_a_message_without_fields_is_an_empty_map_and_refuses_any_field(schema):
    assert decode_message(schema, packed({})) == schema()
    assert "field 'surplus': Extra inputs are not permitted" in refusal(schema, {"surplus": 1})


def test_an_unknown_field_of_a_name_no_schema_uses_is_not_quoted_in_the_refusal():
    """The sender chooses an unknown field's name: one that spelled a marker of a stage's own refusals ("; retry
    later") had its garbage counted as a busy neighbour's (``turned_away``), never as ``rejected``."""
    from ravnest_swarm.pipeline import wire
    from ravnest_swarm.pipeline.messaging import TURNED_AWAY

    valid = dict(run="r", cluster=0, stage=1, microbatch=0, sample_ids=[0], version=0)
    for name in ("poison; retry later", "x, but this is run y", "unknown microbatch id 7", "\x1b[31m"):
        reason = refusal(wire.ForwardRequest, {**valid, name: 1})
        assert "field '(a field of another name)': Extra inputs are not permitted" in reason, reason
        assert not any(marker in reason for marker in TURNED_AWAY), reason


def test_metadata_that_is_not_a_msgpack_map_is_refused_in_one_line():
    assert "metadata must be a msgpack map" in refusal(DialBackRequest, [4000])
    with pytest.raises(MessageError, match="metadata is not valid msgpack"):
        decode_message(DialBackRequest, b"\xc1", "ravnest.test")


def test_messages_go_on_the_wire_with_the_field_names_peers_read():
    assert ForwardedHeader(**{"from": PEER, "handler": "ravnest.probe"}).as_metadata() == \
        {"from": PEER, "handler": "ravnest.probe"}
    assert DialBackRequest(ports=[4000]).as_metadata() == {"ports": [4000]}


def test_a_probe_counts_tensor_bytes_and_refuses_a_frame_whose_metadata_is_not_empty():
    serve = probe_handler("ravnest.probe", 1 << 20, 10.0)
    tensor = runtime_pb2.Tensor(buffer=bytes(1000), dtype="uint8", size=[1000])

    def probe(*frames):
        """What the handler answers to ``frames`` and hivemind's end of stream: its reply, or its error."""
        async def exchange():
            reader, written = asyncio.StreamReader(), []
            reader.feed_data(frames_bytes(frames) + END_OF_STREAM)
            reader.feed_eof()
            writer = SimpleNamespace(write=written.append, drain=lambda: asyncio.sleep(0), close=lambda: None)
            await serve(SimpleNamespace(peer_id=PeerID(b"\x12\x20" + bytes(32))), reader, writer)
            reply = asyncio.StreamReader()
            reply.feed_data(b"".join(written))
            reply.feed_eof()
            return await P2P.receive_protobuf(runtime_pb2.ExpertResponse, reply)

        return asyncio.run(exchange())

    response, error = probe(*[runtime_pb2.ExpertRequest(tensors=[tensor])] * 3)
    assert error is None and decode_message(ProbeReply, response.metadata).bytes == 3000
    bad = runtime_pb2.ExpertRequest(metadata=packed({"bytes": 1}), tensors=[tensor])
    _, error = probe(bad)
    assert error.message == "ravnest.probe: field 'bytes': Extra inputs are not permitted", error
