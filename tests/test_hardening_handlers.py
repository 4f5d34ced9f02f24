"""Fuzzing every P2P handler of the project with random, mutated and hostile messages.

One in-process peer serves them all on a real p2pd: the backbone's ping, bandwidth probe, dial-back and
NAT relay (reverse_connect, forward), every node's NAT handlers (dial_me, forwarded, probe), the
averaging ring, the layer-state server and a pipeline stage (stage 1 of 3 of ``mlp-digits``; stage 2
never exists, so its sends fail and are dropped). A second P2P plays the attacker; it also plays a
volunteer behind the victim's relay (it serves dial_me, forwarded and probe, so forwarded streams reach
it) and one of the victim's backbones (so dial_me and forwarded are fuzzed past their backbone check).
Each test states its attack; after each fuzz batch the peer must still answer a valid request, and the
test process's memory must not have grown past a bound.
"""

import asyncio
import math
from types import SimpleNamespace

import msgpack
import psutil
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from hivemind.compression import serialize_torch_tensor
from hivemind.p2p import P2P, P2PHandlerError
from hivemind.proto import runtime_pb2

from ravnest_swarm.averaging.averager import RING_HANDLER, MultiRingAverager
from ravnest_swarm.averaging.mailbox import OVER_SHARE, PART_OVERHEAD_BYTES
from ravnest_swarm.averaging.segments import Ring
from ravnest_swarm.membership.records import start_peer_node
from ravnest_swarm.membership.services import BANDWIDTH_PROBE, DIAL_BACK, PING, BackboneServices
from ravnest_swarm.pipeline import wire
from ravnest_swarm.pipeline.config import Neighbours
from ravnest_swarm.pipeline.messaging import NOT_A_NEIGHBOUR
from ravnest_swarm.pipeline.stage import StageConfig, StageWorker
from ravnest_swarm.swarm.stage_state import STAGE_STATE, StageStateServer, StoppedStage, TrainingStage
from ravnest_swarm.swarm.state_transfer import LAYER_STATE, LAYER_STATE_MESSAGE, LayerStateServer, offered_layers
from ravnest_swarm.net.node import stop_node
from ravnest_swarm.net.relay import RelayServices
from ravnest_swarm.net.routes import (DIAL_ME, FORWARD, FORWARDED, HEADER_TIMEOUT, PROBE, PROBE_CHUNK_BYTES,
                                      REVERSE_CONNECT, start_routes)
from ravnest_swarm.net.transport import make_request, unpack_metadata
from stream_helpers import END_OF_STREAM, frames_bytes

RUN = "fuzz"
LOCAL = ["/ip4/127.0.0.1/tcp/0"]
LIMIT = 1024 * 1024  # every stream handler here refuses messages over 1 MiB
RING_BUFFER = 8 * LIMIT  # ring chunks the averager holds for rounds it has not started
TIMEOUT = 4.0  # ... and streams that stay silent this long
MAX_RSS_GROWTH = 300 * 1024**2
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
STREAM_HANDLERS = (wire.FORWARD, wire.BACKWARD, RING_HANDLER, BANDWIDTH_PROBE, LAYER_STATE_MESSAGE, STAGE_STATE)
UNARY_HANDLERS = (PING, DIAL_BACK, wire.STATUS)
# the probe is fuzzed as the backbone's bandwidth probe (the same handler with a shorter timeout): its own 120 s
# timeout would hold every stalled example that long
NAT_STREAM_HANDLERS = (FORWARD, FORWARDED)
NAT_UNARY_HANDLERS = (REVERSE_CONNECT, DIAL_ME)
CLOSED_PORT = "/ip4/127.0.0.1/tcp/1"  # a dial to it fails at once; fuzzed dials never leave this machine


class Peer:
    """The victim peer (every handler) and an attacker P2P, on one event loop driven by the tests."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self._start())

    async def _start(self):
        self.node = await start_peer_node((), RUN, host_maddrs=LOCAL)
        p2p = self.node.p2p
        self.relay = RelayServices(p2p, max_forward_bytes=LIMIT, forward_timeout=3 * TIMEOUT)
        await BackboneServices(p2p, probe_timeout=TIMEOUT, relay=self.relay).add_handlers()
        self.averager = MultiRingAverager(self.node.routes, RUN, timeout=TIMEOUT, max_message_bytes=LIMIT,
                                          max_buffered_bytes=RING_BUFFER)
        await self.averager.start()
        config = StageConfig(run=RUN, stage=1, stages=3, model="mlp-digits", layers=(1, 3), max_in_flight=4,
                             send_timeout=TIMEOUT, microbatch_timeout=60.0, max_message_bytes=LIMIT)
        self.stage = StageWorker(config, self.node)
        await self.stage.start()
        await LayerStateServer(self.node.routes, RUN, lambda: offered_layers(1, self.stage.module, self.stage.version),
                               request_timeout=TIMEOUT).start()
        # the optimizer state of a stage this peer stopped (layers 1:3, with AdamW's moments after one step)
        adamw = torch.optim.AdamW(self.stage.module.parameters())
        sum(p.sum() for p in self.stage.module.parameters()).backward()
        adamw.step()
        stopped = StoppedStage((1, 3), 7, adamw, {}, self.stage.module)
        # ... and, live, of the stage it trains (the same moments: a copy of layer 2's is asked below)
        training = TrainingStage(1, self.stage.module, adamw, 9)
        await StageStateServer(self.node.routes, RUN, lambda: stopped, request_timeout=TIMEOUT,
                               training=lambda: training).start()
        self.attacker = await P2P.create(initial_peers=await p2p.get_visible_maddrs(), host_maddrs=LOCAL)
        self.peer_id = p2p.peer_id
        # the attacker is the victim's partner in ring 0 of round 5: the ring handler takes its messages
        self.averager.expect([Ring(0, 0, 10, (self.peer_id.to_base58(), self.attacker.peer_id.to_base58()))], 5)
        # the attacker as a volunteer behind the victim's relay (serving layers, so that forwarded streams reach
        # a handler that reads them), and as one of the victim's backbones
        attacker_routes = await start_routes(self.attacker, [self.peer_id])
        await LayerStateServer(attacker_routes, RUN, lambda: offered_layers(1, self.stage.module, 0),
                               request_timeout=TIMEOUT).start()
        self.node.routes.backbones.append(self.attacker.peer_id)
        self.attacker_maddrs = [str(m).split("/p2p/")[0] for m in await self.attacker.get_visible_maddrs()]
        # values that make some random NAT requests valid: our ids, handler names, loopback addresses
        self.known = [self.peer_id.to_base58(), self.attacker.peer_id.to_base58(), FORWARDED, FORWARD,
                      LAYER_STATE_MESSAGE, wire.FORWARD, RING_HANDLER, CLOSED_PORT, *self.attacker_maddrs]

    def run(self, coroutine, timeout=60.0):
        return self.loop.run_until_complete(asyncio.wait_for(coroutine, timeout))

    def parameters(self):
        return [p.detach().clone() for p in self.stage.module.parameters()]

    def close(self):
        async def stop():
            await self.attacker.shutdown()
            await self.averager.shutdown()
            await self.stage.shutdown()
            await stop_node(self.node)

        self.loop.run_until_complete(stop())
        self.loop.close()

    # ---- calls as the attacker --------------------------------------------------------------------

    async def raw(self, handler: str, payload: bytes, read_timeout: float = TIMEOUT + 10, caller: P2P = None) -> str:
        """Write raw bytes to a stream handler (as ``caller``, by default the attacker); return its reply: ``ok``
        or the error's text."""
        return (await self.raw_reply(handler, payload, read_timeout, caller))[0]

    async def raw_reply(self, handler: str, payload: bytes, read_timeout: float = TIMEOUT + 10, caller: P2P = None):
        """:meth:`raw`, and the reply's metadata (None after an error)."""
        caller = caller or self.attacker
        _, reader, writer = await caller.call_binary_stream_handler(self.peer_id, handler)
        try:
            writer.write(payload)
            try:
                await writer.drain()
            except ConnectionError:
                pass  # the peer may answer and close before our last byte is out; its answer is still there
            response, error = await asyncio.wait_for(P2P.receive_protobuf(runtime_pb2.ExpertResponse, reader),
                                                     read_timeout)
            return ("ok", unpack_metadata(response.metadata)) if error is None else (error.message, None)
        finally:
            writer.close()

    async def unary(self, handler: str, request: runtime_pb2.ExpertRequest) -> str:
        try:
            await self.attacker.call_protobuf_handler(self.peer_id, handler, request, runtime_pb2.ExpertResponse)
            return "ok"
        except P2PHandlerError as e:
            return str(e)

    async def layer_state(self, request: runtime_pb2.ExpertRequest) -> str:
        try:
            stream = await self.attacker.iterate_protobuf_handler(self.peer_id, LAYER_STATE, request,
                                                                  runtime_pb2.ExpertResponse)
            async for _ in stream:
                pass
            return "ok"
        except P2PHandlerError as e:
            return str(e)

    async def still_serving(self):
        """Valid requests to every handler still get valid answers."""
        assert await self.unary(PING, make_request({})) == "ok"
        assert await self.unary(DIAL_BACK, make_request({"ports": []})) == "ok"
        status = unpack_metadata((await self.attacker.call_protobuf_handler(
            self.peer_id, wire.STATUS, make_request({}), runtime_pb2.ExpertResponse)).metadata)
        assert status["stage"] == 1
        assert await self.layer_state(make_request({"run": RUN, "layers": [1]})) == "ok"
        layer_request = make_request({"run": RUN, "layers": [1]})
        assert await self.raw(LAYER_STATE_MESSAGE, frames_bytes([layer_request]) + END_OF_STREAM) == "ok"
        stage_request = make_request({"run": RUN, "layers": [1, 3]})
        assert await self.raw_reply(STAGE_STATE, frames_bytes([stage_request]) + END_OF_STREAM) == (
            "ok", {"names": [f"optim.{i}.{key}" for i in range(4) for key in ("exp_avg", "exp_avg_sq")],
                   "scalars": {str(i): {"step": 1.0} for i in range(4)}, "step": 7})
        live_request = make_request({"run": RUN, "layers": [2, 3], "live": True})  # layer 2: parameters 2 and 3
        assert await self.raw_reply(STAGE_STATE, frames_bytes([live_request]) + END_OF_STREAM) == (
            "ok", {"names": [f"optim.{i}.{key}" for i in range(2) for key in ("exp_avg", "exp_avg_sq")],
                   "scalars": {str(i): {"step": 1.0} for i in range(2)}, "step": 9})
        probe = runtime_pb2.ExpertRequest(tensors=[runtime_pb2.Tensor(buffer=bytes(1000))])
        assert await self.raw(BANDWIDTH_PROBE, frames_bytes([probe]) + END_OF_STREAM) == "ok"
        abort = make_request(dict(run=RUN, step=5, ring=0, phase="abort", position=0, attempt=[]))
        assert await self.raw(RING_HANDLER, frames_bytes([abort]) + END_OF_STREAM) == "ok"
        await self.nat_still_serving(probe)
        return status

    async def nat_still_serving(self, probe: runtime_pb2.ExpertRequest):
        """Valid requests to every NAT handler get valid answers: a reversal towards a peer that is connected and
        one that is not, a probe forwarded to the attacker, dial_me and forwarded (the attacker being a
        backbone of the victim), and a direct probe."""
        attacker, stranger = self.attacker.peer_id.to_base58(), "QmXoypizjW3WknFiJnKLwHCnL72vedxjQkDDP1mXWo6uco"
        for target, connected in ((attacker, True), (stranger, False)):
            request = make_request({"peer": target, "maddrs": self.attacker_maddrs[:1]})
            reply = unpack_metadata((await self.attacker.call_protobuf_handler(
                self.peer_id, REVERSE_CONNECT, request, runtime_pb2.ExpertResponse)).metadata)
            assert reply["connected"] is connected, reply
        forwarded = frames_bytes([make_request({"to": attacker, "handler": PROBE}), probe]) + END_OF_STREAM
        assert await self.raw_reply(FORWARD, forwarded) == ("ok", {"bytes": 1000})
        dial = unpack_metadata((await self.attacker.call_protobuf_handler(self.peer_id, DIAL_ME, make_request(
            {"peer": attacker, "maddrs": self.attacker_maddrs}), runtime_pb2.ExpertResponse)).metadata)
        assert dial["dialed"] is True, dial
        piped = frames_bytes([make_request({"from": attacker, "handler": PROBE}), probe]) + END_OF_STREAM
        assert await self.raw_reply(FORWARDED, piped) == ("ok", {"bytes": 1000})
        assert await self.raw_reply(PROBE, frames_bytes([probe]) + END_OF_STREAM) == ("ok", {"bytes": 1000})


@pytest.fixture
def peer():
    victim = Peer()
    try:
        yield victim
    finally:
        victim.close()


def rss() -> int:
    return psutil.Process().memory_info().rss


# ---- strategies ---------------------------------------------------------------------------------------

FIELD_NAMES = ["run", "cluster", "stage", "microbatch", "sample_ids", "version", "op", "step", "ring", "phase",
               "position", "attempt", "excluded", "failure", "layers", "ports", "peer", "maddrs", "to", "handler",
               "from"]


def fuzz_strategies(known=()):
    """Random requests, and the bytes of random stream messages (well-framed random requests, truncated
    protobufs, bad markers, flipped bytes, lying lengths). ``known``: values (peer ids, handler names,
    addresses) drawn among the random ones, so that some requests get past the schema; a first frame whose
    metadata is a forwarding header of them comes up often, so the rest of a stream is what gets fuzzed."""
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(), st.text(max_size=40),
                        st.binary(max_size=40),
                        st.sampled_from([RUN, "reduce", "gather", "abort", "finish", 0, 1, *known]))
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=6) | st.dictionaries(
        st.text(max_size=8), inner, max_size=4), max_leaves=12)
    packed = st.one_of(
        st.dictionaries(st.sampled_from(FIELD_NAMES), values, max_size=8).map(
            lambda d: msgpack.packb(d, use_bin_type=True)),
        st.binary(max_size=300),  # not msgpack, or msgpack of something other than a map
        st.builds(lambda d: msgpack.packb(d, use_bin_type=True), values),
    )
    tensors = st.builds(
        lambda buffer, dtype, size, chunks, compression: runtime_pb2.Tensor(
            buffer=buffer, dtype=dtype, size=size, chunks=chunks, compression=compression),
        st.binary(max_size=2048), st.sampled_from(["float32", "float64", "int64", "uint8", "bfloat16", "bogus", ""]),
        st.lists(st.integers(0, 2**31 - 1), max_size=4), st.integers(0, 2**31 - 1), st.integers(0, 12))
    requests = st.builds(lambda m, t: runtime_pb2.ExpertRequest(metadata=m, tensors=t), packed,
                         st.lists(tensors, max_size=3))
    headers = st.builds(lambda key, peer, handler: make_request({key: peer, "handler": handler}),
                        st.sampled_from(["to", "from"]), st.sampled_from(known or [RUN]),
                        st.sampled_from(known or [RUN]))

    @st.composite
    def streams(draw):
        frames = draw(st.lists(requests, min_size=0, max_size=4))
        if known and draw(st.booleans()):
            frames = [draw(headers)] + frames
        payload = frames_bytes(frames)
        mutation = draw(st.sampled_from(["none", "truncate protobuf", "bad marker", "flip bytes", "lying length"]))
        if mutation == "truncate protobuf" and frames:
            data = frames[0].SerializeToString()
            cut = data[:draw(st.integers(0, max(0, len(data) - 1)))] + b"\xff\xff"
            payload = frames_bytes([cut])
        elif mutation == "bad marker":
            payload = draw(st.sampled_from([b"\x07", b"\xff", b"\x02"])) + payload
        elif mutation == "flip bytes" and payload:
            index = draw(st.integers(0, len(payload) - 1))
            payload = payload[:index] + bytes([payload[index] ^ 0xFF]) + payload[index + 1:]
        elif mutation == "lying length":
            payload += P2P.MESSAGE_MARKER + draw(st.integers(LIMIT + 1, 2**63)).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)
        return payload + END_OF_STREAM

    return requests, streams()


requests, streams = fuzz_strategies()


# ---- tests --------------------------------------------------------------------------------------------

@pytest.mark.timeout(240)
def test_random_and_mutated_stream_messages_get_an_answer_and_the_peer_keeps_serving(peer):
    """Attack: random, mutated and malformed messages to every streaming handler (pipeline forward and
    backward, averaging ring, bandwidth probe, one-message layer state, a stopped stage's optimizer state):
    garbage metadata, wrong shapes/dtypes/chunk counts, truncated protobufs, bad frame markers, flipped bytes, frame
    headers announcing huge lengths. Each must get an answer (a reply or an error with a reason), never a hang,
    and the peer keeps serving."""
    before = rss()

    @FUZZ
    @given(handler=st.sampled_from(STREAM_HANDLERS), payload=streams)
    def fuzz(handler, payload):
        reply = peer.run(peer.raw(handler, payload))
        assert reply == "ok" or len(reply) > 0

    fuzz()
    peer.run(peer.still_serving())
    assert rss() - before < MAX_RSS_GROWTH


@pytest.mark.timeout(240)
def test_a_stage_gives_a_copy_of_its_inner_state_only_for_layers_it_trains(peer):
    async def ask(layers):
        request = make_request({"run": RUN, "layers": layers, "live": True})
        return await peer.raw(STAGE_STATE, frames_bytes([request]) + END_OF_STREAM)

    assert peer.run(ask([1, 3])) == "ok"
    for layers in ([3, 4], [0, 2], [2, 2]):
        assert f"trains no stage with layers {layers[0]}:{layers[1]}" in peer.run(ask(layers)), layers
    peer.run(peer.still_serving())


def test_random_unary_requests_get_an_answer_and_the_peer_keeps_serving(peer):
    """Attack: random requests (random metadata, tensors, raw bytes as metadata) to every unary handler
    (ping, dial-back, stage status) and the layer-state server: each gets a response or an error."""
    before = rss()

    @FUZZ
    @given(handler=st.sampled_from(UNARY_HANDLERS + (LAYER_STATE,)), request=requests)
    def fuzz(handler, request):
        call = peer.layer_state(request) if handler == LAYER_STATE else peer.unary(handler, request)
        reply = peer.run(call)
        assert reply == "ok" or len(reply) > 0

    fuzz()
    peer.run(peer.still_serving())
    assert rss() - before < MAX_RSS_GROWTH


def nat_refusals(peer) -> int:
    return peer.relay.stats["refused"] + peer.node.routes.counts["refused"]


@pytest.mark.timeout(300)
def test_random_and_mutated_messages_to_the_nat_handlers_get_an_answer_and_the_peer_keeps_serving(peer):
    """Attack: random and mutated messages to every NAT handler: streams to the relay's forward and to
    forwarded (random headers, or a valid header naming a peer and a handler followed by garbage, which the
    relay pipes on to that handler), and random requests to reverse_connect and dial_me. Peer ids, handler
    names and loopback addresses are among the random values, so some requests pass the schema and make
    the victim pass a reversal on, dial, or pipe. Each gets an answer, the refusals are counted, and the
    peer keeps serving with bounded memory."""
    nat_requests, nat_streams = fuzz_strategies(peer.known)
    before, refusals = rss(), nat_refusals(peer)

    @FUZZ
    @given(handler=st.sampled_from(NAT_STREAM_HANDLERS), payload=nat_streams)
    def fuzz_streams(handler, payload):
        reply = peer.run(peer.raw(handler, payload))
        assert reply == "ok" or len(reply) > 0

    @FUZZ
    @given(handler=st.sampled_from(NAT_UNARY_HANDLERS), request=nat_requests)
    def fuzz_unary(handler, request):
        reply = peer.run(peer.unary(handler, request))
        assert reply == "ok" or len(reply) > 0

    fuzz_streams()
    fuzz_unary()
    assert nat_refusals(peer) > refusals
    peer.run(peer.still_serving())
    assert rss() - before < MAX_RSS_GROWTH


@pytest.mark.timeout(120)
def test_one_caller_cannot_take_every_forwarding_slot(peer):
    """Attack: one caller opens more forwarding streams than its share and holds them open (a valid header,
    then silence). The stream over its share is refused with one line and counted, while a second caller
    still gets a whole stream forwarded; once the first caller lets go, it can forward again."""
    peer.relay.max_forward_streams, peer.relay.max_forward_streams_per_caller = 4, 2
    attacker = peer.attacker.peer_id.to_base58()
    header = frames_bytes([make_request({"to": attacker, "handler": PROBE})])
    probe = runtime_pb2.ExpertRequest(tensors=[runtime_pb2.Tensor(buffer=bytes(1000))])
    whole = header + frames_bytes([probe]) + END_OF_STREAM

    async def attack():
        second = await P2P.create(initial_peers=await peer.node.p2p.get_visible_maddrs(), host_maddrs=LOCAL)
        held = []
        try:
            forwarded = peer.relay.stats["forwarded_streams"]
            for _ in range(2):  # its share, held open
                _, _, writer = await peer.attacker.call_binary_stream_handler(peer.peer_id, FORWARD)
                writer.write(header)
                await writer.drain()
                held.append(writer)
            for _ in range(100):
                if peer.relay.stats["forwarded_streams"] == forwarded + 2:
                    break
                await asyncio.sleep(0.05)
            refused = peer.relay.stats["refused"]
            replies = {"over its share": await peer.raw(FORWARD, whole),
                       "second caller": await peer.raw_reply(FORWARD, whole, caller=second)}
            replies["refusals counted"] = peer.relay.stats["refused"] - refused
            for writer in held:
                writer.close()
            held = []
            # a relay whose caller went away closes the target's side and frees the slot at once; wait a moment
            deadline = asyncio.get_running_loop().time() + 3  # not the forward timeout: the slot is not held to it
            while asyncio.get_running_loop().time() < deadline:
                replies["after letting go"] = await peer.raw_reply(FORWARD, whole)
                if replies["after letting go"][0] == "ok":
                    break
                await asyncio.sleep(0.2)
            return replies
        finally:
            for writer in held:
                writer.close()
            await second.shutdown()

    replies = peer.run(attack())
    assert "this backbone forwards at most 2 streams at once for one caller" in replies["over its share"], replies
    assert replies["second caller"] == ("ok", {"bytes": 1000}), replies
    assert replies["refusals counted"] == 1
    assert replies["after letting go"] == ("ok", {"bytes": 1000}), replies
    peer.run(peer.still_serving())


def test_a_forwarded_reply_is_capped_as_the_request_is(peer):
    """Attack (a hostile review): two peers in league, the target answering without end; the backbone's cap held
    only towards the target, and it relayed unlimited bytes back to the caller for the forward timeout. The reply
    is cut at a cap of its own (1 GiB by default: a stage's optimizer state comes back in one reply), and the
    refusal counted against the target."""
    peer.relay.max_forward_reply_bytes = LIMIT

    async def attack():
        endless = await P2P.create(initial_peers=await peer.node.p2p.get_visible_maddrs(), host_maddrs=LOCAL)

        async def answer_without_end(info, reader, writer):
            try:
                while True:
                    writer.write(bytes(1 << 16))
                    await writer.drain()
            except ConnectionError:
                pass

        await endless.add_binary_stream_handler(FORWARDED, answer_without_end)
        refused, got = peer.relay.stats["refused"], 0
        try:
            _, reader, writer = await peer.attacker.call_binary_stream_handler(peer.peer_id, FORWARD)
            writer.write(frames_bytes([make_request({"to": endless.peer_id.to_base58(), "handler": PROBE})]))
            await writer.drain()
            try:
                while data := await asyncio.wait_for(reader.read(1 << 16), 20):
                    got += len(data)
            except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
                pass
            writer.close()
            return got, peer.relay.stats["refused"] - refused
        finally:
            await endless.shutdown()

    got, refusals = peer.run(attack(), timeout=60)
    assert 0 < got <= LIMIT + (1 << 16) and refusals == 1, (got, refusals)
    peer.run(peer.still_serving())


@pytest.mark.timeout(120)
def test_a_silent_caller_holds_no_forwarding_slot_past_the_header_timeout(peer):
    """Attack: a slowloris caller opens streams to the relay's forward and to forwarded and never writes a
    header. Each is refused with a reason after the header timeout, its forwarding slot freed and the refusal
    counted."""

    async def attack():
        started = asyncio.get_running_loop().time()
        replies = await asyncio.gather(*(peer.raw(handler, b"") for handler in (FORWARD, FORWARDED)))
        return replies, asyncio.get_running_loop().time() - started

    refusals = nat_refusals(peer)
    replies, seconds = peer.run(attack())
    assert all(f"no header within {HEADER_TIMEOUT:.0f}s" in reply for reply in replies), replies
    assert HEADER_TIMEOUT <= seconds < HEADER_TIMEOUT + 8
    assert nat_refusals(peer) == refusals + 2 and peer.relay.stats["forwarded_streams"] == 0
    peer.run(peer.still_serving())


def forward_metadata(microbatch, count=4, **overrides):
    return dict(dict(run=RUN, cluster=0, stage=1, microbatch=microbatch, sample_ids=list(range(count)), version=0),
                **overrides)


def backward_metadata(microbatch):
    return dict(run=RUN, cluster=0, stage=1, microbatch=microbatch, version=0)


async def send(peer, handler, metadata, tensors):
    return await peer.raw(handler, frames_bytes(wire.encode(metadata, tensors)) + END_OF_STREAM)


@pytest.mark.timeout(120)
def test_oversize_replayed_unknown_and_flooding_messages_are_refused_with_bounded_memory(peer):
    """Attack: oversize payloads (one huge tensor; a frame header announcing 2^40 bytes), replays of the
    same forward microbatch and of the same ring message, gradients for unknown microbatch ids, and a flood
    of distinct microbatches (more than the stage may ever hold). Each is refused with its reason (a
    replay is acknowledged but not processed or kept twice); memory stays bounded and the peer keeps serving."""
    x, targets = torch.randn(4, 64), torch.zeros(4, dtype=torch.long)
    before = rss()

    async def attack():
        replies = {}
        replies["huge tensor"] = await send(peer, wire.FORWARD, forward_metadata(1), [torch.randn(4, 300_000), targets])
        lying = P2P.MESSAGE_MARKER + (2**40).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"\x00" * 1000
        for handler in STREAM_HANDLERS:
            replies[f"lying header {handler}"] = await peer.raw(handler, lying)
        replies["first"] = await send(peer, wire.FORWARD, forward_metadata(7), [x, targets])
        replies["replay"] = await send(peer, wire.FORWARD, forward_metadata(7), [x, targets])
        await asyncio.sleep(1.0)  # time enough for the compute thread to run a second forward, were one queued
        replies["forwards after replay"] = peer.stage.counters.forwards
        replies["unknown id"] = await send(peer, wire.BACKWARD, backward_metadata(999), [torch.randn(4, 64)])
        ring = dict(run=RUN, step=5, ring=0, phase="reduce", position=0, attempt=[])
        ring_frames = frames_bytes(wire.encode(ring, [torch.ones(10)])) + END_OF_STREAM
        replies["ring first"] = await peer.raw(RING_HANDLER, ring_frames)
        replies["ring replay"] = await peer.raw(RING_HANDLER, ring_frames)
        replies["ring parts kept"] = [len(inbox.parts) for key, inbox in peer.averager.mailbox.inboxes.items()
                                      if key[0] == 5]
        flood = [await send(peer, wire.FORWARD, forward_metadata(100 + i), [x, targets]) for i in range(12)]
        # a probe is counted frame by frame and held by none: a frame takes at most a few of the senders' parts
        part = runtime_pb2.ExpertRequest(tensors=[runtime_pb2.Tensor(buffer=bytes(PROBE_CHUNK_BYTES))])
        replies["probe of 40 parts"] = await peer.raw_reply(PROBE, frames_bytes([part] * 40) + END_OF_STREAM)
        giant = runtime_pb2.ExpertRequest(tensors=[runtime_pb2.Tensor(buffer=bytes(8 * PROBE_CHUNK_BYTES))])
        replies["probe frame of 2 MiB"] = await peer.raw(PROBE, frames_bytes([giant]) + END_OF_STREAM)
        return replies, flood

    replies, flood = peer.run(attack(), timeout=90)
    assert "exceeds the 1048576-byte limit" in replies["huge tensor"]
    for handler in STREAM_HANDLERS:
        # the frame's marker and length header count too
        assert "-byte limit (at least 1099511627785 bytes)" in replies[f"lying header {handler}"], handler
    # a replay is acknowledged (delivery is at-least-once) but processed once
    assert replies["first"] == "ok" and replies["replay"] == "ok" and replies["forwards after replay"] == 1
    assert "unknown microbatch id 999" in replies["unknown id"]
    # a resent ring message is acknowledged (its sender lost our reply) and its part kept once
    assert replies["ring first"] == "ok" and replies["ring replay"] == "ok" and replies["ring parts kept"] == [1]
    # stage 0 keeps at most max_in_flight=4 in the pipeline; this stage holds twice that, then refuses
    assert flood.count("ok") <= 8 and all(r == "ok" or "too many microbatches" in r for r in flood)
    assert any("too many microbatches" in r for r in flood)
    assert replies["probe of 40 parts"] == ("ok", {"bytes": 40 * PROBE_CHUNK_BYTES})
    assert f"over the {4 * PROBE_CHUNK_BYTES} a frame takes" in replies["probe frame of 2 MiB"]
    peer.run(peer.still_serving())
    assert rss() - before < MAX_RSS_GROWTH


@pytest.mark.timeout(120)
def test_empty_frames_and_empty_tensors_that_a_stage_would_hold_are_refused_by_their_count(peer):
    """Attack: a stage holds every frame of a message until it is whole, and counted only their payloads: a million
    empty frames (9 MB on the wire) held 550 MB, one frame of 30 million empty tensors (57 MB) 2.3 GB, before the
    message was read as anyone's. A message takes the frames and chunks ``wire.encode`` sends: one chunk a frame,
    as many frames as its bytes of tensors need."""
    before = rss()
    header = frames_bytes([make_request(forward_metadata(3))])
    empty = P2P.MESSAGE_MARKER + (0).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)
    empty_tensors = runtime_pb2.ExpertRequest(tensors=[runtime_pb2.Tensor()] * 350_000).SerializeToString()

    async def attack():
        return [await peer.raw(wire.FORWARD, header + empty * 100_000 + END_OF_STREAM),
                await peer.raw(wire.FORWARD, header + frames_bytes([empty_tensors]) + END_OF_STREAM),
                await peer.raw(wire.FORWARD, header + frames_bytes([runtime_pb2.ExpertRequest(
                    tensors=[runtime_pb2.Tensor()] * 2)]) + END_OF_STREAM)]

    replies = peer.run(attack(), timeout=60)
    assert f"message of more than {LIMIT // wire.CHUNK_BYTES + wire.MAX_TENSORS + 1} frames" in replies[0], replies[0]
    assert "frame 1 of 700000 bytes is over the" in replies[1], replies[1]
    assert "a frame holds more than one chunk" in replies[2], replies[2]
    peer.run(peer.still_serving())
    assert rss() - before < MAX_RSS_GROWTH


@pytest.mark.timeout(120)
def test_a_ring_member_flooding_the_mailbox_gets_its_share_and_the_other_member_keeps_its_own(peer):
    """Attack: a member of one of the victim's rings (the attacker) floods its averaging handler with chunks for
    a round the victim has not started, each a new message of 256 KiB. Past its share (the victim's buffer for
    early chunks, divided between its two partners in the ring) every further one is refused in one line and
    counted in the averager's ``rejected``; the other partner's chunk still fits, and memory stays bounded."""
    chunk = serialize_torch_tensor(torch.ones(64 * 1024))
    share = RING_BUFFER // 2

    def message(position):
        metadata = dict(run=RUN, step=5, ring=0, phase="reduce", position=position, attempt=[])
        return frames_bytes([make_request(metadata), runtime_pb2.ExpertRequest(tensors=[chunk])]) + END_OF_STREAM

    async def send_as(caller, payload):
        _, reader, writer = await caller.call_binary_stream_handler(peer.peer_id, RING_HANDLER)
        try:
            writer.write(payload)
            await writer.drain()
            _, error = await asyncio.wait_for(P2P.receive_protobuf(runtime_pb2.ExpertResponse, reader), TIMEOUT + 10)
            return "ok" if error is None else error.message
        finally:
            writer.close()

    async def attack():
        partner = await P2P.create(initial_peers=await peer.node.p2p.get_visible_maddrs(), host_maddrs=LOCAL)
        try:
            members = (peer.peer_id.to_base58(), peer.attacker.peer_id.to_base58(), partner.peer_id.to_base58())
            peer.averager.expect([Ring(0, 0, 10**6, members)], 5)
            flood = [await send_as(peer.attacker, message(position)) for position in range(40)]
            return flood, await send_as(partner, message(0))
        finally:
            await partner.shutdown()

    before = rss()
    flood, partner_reply = peer.run(attack(), timeout=90)
    # each filed part counts its bytes, its decoded values and PART_OVERHEAD_BYTES: what it holds
    kept = share // (chunk.ByteSize() + 64 * 1024 * 4 + PART_OVERHEAD_BYTES)
    assert flood[:kept] == ["ok"] * kept, flood
    assert all(OVER_SHARE in reply for reply in flood[kept:]), flood
    assert partner_reply == "ok"
    assert peer.averager.rejected == len(flood) - kept and OVER_SHARE in peer.averager.last_rejected
    assert rss() - before < MAX_RSS_GROWTH
    peer.run(peer.still_serving())


@pytest.mark.timeout(120)
def test_a_slow_peer_that_opens_a_stream_and_never_writes_is_timed_out(peer):
    """Attack: a slowloris peer opens a stream to every streaming handler (and one that sends half a frame)
    and then neither writes nor closes. Each handler answers with a timeout error after its limit instead of
    holding the stream (and its memory) forever."""

    async def attack():
        started = asyncio.get_running_loop().time()
        silent = [peer.raw(handler, b"") for handler in STREAM_HANDLERS]
        half = P2P.MESSAGE_MARKER + (1000).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"\x00" * 10
        stalled = [peer.raw(handler, half) for handler in STREAM_HANDLERS]
        replies = await asyncio.gather(*silent, *stalled)
        return replies, asyncio.get_running_loop().time() - started

    replies, seconds = peer.run(attack())
    assert all("no end of stream" in reply for reply in replies), replies
    assert seconds < TIMEOUT + 8
    peer.run(peer.still_serving())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("poison", ["nan", "inf", "scale"])
def test_poisoned_activations_and_gradients_are_refused_and_parameters_unaffected(peer, poison):
    """Attack: a neighbour stage sends activations, then a gradient for a real pending microbatch, holding
    NaN, Inf, or values scaled by 1e9. The stage refuses each with its reason and counts it in ``rejected``
    (its status); its parameters are bit-for-bit unchanged, and an honest gradient afterwards still trains."""
    x, targets = torch.randn(4, 64), torch.zeros(4, dtype=torch.long)

    def poisoned(tensor):
        tensor = tensor.clone()
        if poison == "scale":
            return tensor * 1e9
        tensor[0, 0] = math.nan if poison == "nan" else math.inf
        return tensor

    async def attack():
        replies = {"activations": await send(peer, wire.FORWARD, forward_metadata(1), [poisoned(x), targets])}
        assert await send(peer, wire.FORWARD, forward_metadata(2), [x, targets]) == "ok"
        for _ in range(100):  # the honest forward runs on the compute thread; then its gradient is awaited
            if 2 in peer.stage.pending:
                break
            await asyncio.sleep(0.05)
        before = peer.parameters()
        shape = peer.stage.pending[2].output_shape
        replies["gradient"] = await send(peer, wire.BACKWARD, backward_metadata(2), [poisoned(torch.randn(shape))])
        after_poison = peer.parameters()
        status = await peer.still_serving()
        assert await send(peer, wire.BACKWARD, backward_metadata(2), [torch.randn(shape) * 0.1]) == "ok"
        for _ in range(100):
            if peer.stage.version > 0:
                break
            await asyncio.sleep(0.05)
        return replies, before, after_poison, status

    replies, before, after_poison, status = peer.run(attack())
    expected = "above the 1e+06 limit" if poison == "scale" else "holds NaN or Inf"
    assert expected in replies["activations"] and expected in replies["gradient"], replies
    assert all(torch.equal(a, b) for a, b in zip(before, after_poison))
    assert status["rejected"] == 2 and status["forwards"] == 1
    assert peer.stage.version == 1 and not all(torch.equal(a, b) for a, b in zip(before, peer.parameters()))


@pytest.mark.timeout(120)
def test_a_stage_takes_messages_only_from_the_neighbours_its_plan_names(peer):
    """Attack: a stranger to the slot it sends for (the attacker) sends a stage that names its neighbours, as
    every volunteer's stage does, a gradient for a microbatch that really awaits one (the attacker is its
    stage 0, not its stage 2), then, after a new plan names other peers on both sides, the finish that ends a
    stage's run. Each is refused in one line as not from the neighbour, counted in ``rejected``; the stage's
    parameters are bit-for-bit unchanged and it has not finished. A new plan that names the same peer as the
    stage's next neighbour (a standby replacing a dead one) makes its gradient count at once."""
    x, targets = torch.randn(4, 64), torch.zeros(4, dtype=torch.long)
    attacker, elsewhere = peer.attacker.peer_id.to_base58(), peer.peer_id.to_base58()
    stage = peer.stage

    async def forward(microbatch):
        assert await send(peer, wire.FORWARD, forward_metadata(microbatch), [x, targets]) == "ok"
        for _ in range(100):
            if microbatch in stage.pending:
                return stage.pending[microbatch].output_shape
            await asyncio.sleep(0.05)
        raise AssertionError(f"microbatch {microbatch} never reached the stage's pending ones")

    async def attack():
        stage.follow_neighbours(Neighbours(previous=attacker, next=elsewhere))  # it plays stage 0 for a moment
        shape = await forward(3)
        before = peer.parameters()
        replies = {"gradient": await send(peer, wire.BACKWARD, backward_metadata(3), [torch.randn(shape) * 0.1])}
        # a new plan: now a stranger on both sides (microbatch 3, from the stage 0 it replaced, is dropped)
        stage.follow_neighbours(Neighbours(previous=elsewhere, next=elsewhere))
        replies["finish"] = await send(peer, wire.FORWARD, dict(run=RUN, cluster=0, stage=1, op="finish",
                                                                completed=0, step=0), [])
        unchanged = all(torch.equal(a, b) for a, b in zip(before, peer.parameters()))
        stage.follow_neighbours(Neighbours(previous=attacker, next=attacker))  # the plan after: its neighbour
        shape = await forward(4)
        replies["as neighbour"] = await send(peer, wire.BACKWARD, backward_metadata(4), [torch.randn(shape) * 0.1])
        for _ in range(100):
            if stage.version > 0:
                break
            await asyncio.sleep(0.05)
        return replies, unchanged, await peer.still_serving()

    replies, unchanged, status = peer.run(attack())
    for what in ("gradient", "finish"):
        assert NOT_A_NEIGHBOUR in replies[what] and attacker not in replies[what], replies
    assert f"takes gradients only from {peer.peer_id.to_base58()} (stage 2)" in replies["gradient"]
    assert unchanged and status["rejected"] == 2 and not stage.scheduler.finish_received
    assert replies["as neighbour"] == "ok" and stage.version == 1


def frames_then_a_promised_giant(*frames: runtime_pb2.ExpertRequest) -> asyncio.StreamReader:
    """A stream of ``frames`` and then the header of a 100 MiB frame whose bytes never come: a reader that waits
    for them (to hold them) hangs; one that refuses by what came before, or by the header, answers at once."""
    reader = asyncio.StreamReader()
    for frame in frames:
        data = frame.SerializeToString()
        reader.feed_data(P2P.MESSAGE_MARKER + len(data).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + data)
    reader.feed_data(P2P.MESSAGE_MARKER + (100 << 20).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
    return reader


def test_a_message_is_refused_by_its_metadata_and_frame_headers_before_its_bytes_are_read():
    """A stranger's forward of 64 MiB was read whole before its sender was checked, and a ring frame of up to
    512 MiB before its metadata was looked at (a review held 1 GiB a stream): the pipeline vets a message's
    metadata before its tensors, and a ring frame is at most a part."""
    async def scenario():
        def vet(metadata):
            raise wire.MessageError(f"the sender {NOT_A_NEIGHBOUR}")

        first = make_request(dict(run="r", cluster=0, stage=1))
        with pytest.raises(wire.MessageError, match=NOT_A_NEIGHBOUR):
            await asyncio.wait_for(wire.read_message(frames_then_a_promised_giant(first), 200 << 20, vet=vet), 5)

        averager = MultiRingAverager.__new__(MultiRingAverager)  # only what reading a message needs
        averager.part_bytes, averager.max_message_bytes = 512 * 1024, 512 << 20
        averager._decode = lambda metadata: None
        with pytest.raises(ValueError, match="over the .* a frame takes"):
            await asyncio.wait_for(averager._read_message(frames_then_a_promised_giant(), "QmStranger", []), 5)

    asyncio.run(scenario())


def test_an_end_of_stream_frame_is_bounded_before_it_is_read():
    """A frame header marked end-of-stream declared up to the message's limit and was read whole (512 MiB on the
    ring) before anything was checked; an end of stream is empty, or one line of error."""
    from ravnest_swarm.net.transport import SMALL_REPLY_BYTES, read_frames

    async def scenario():
        reader = asyncio.StreamReader()
        reader.feed_data(P2P.ERROR_MARKER + (100 << 20).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
        with pytest.raises(ValueError, match=f"at most {SMALL_REPLY_BYTES}"):
            await asyncio.wait_for(read_frames(reader, 512 << 20), 5)

    asyncio.run(scenario())


def test_a_large_reply_nobody_reads_holds_its_slot_only_until_its_write_deadline():
    """A hostile review: a ~100-byte stage_state request made a reply of twice the stage's parameters, and a caller
    that never read it kept it in memory for good (the write had no deadline), as many times as it asked. Such
    replies are made a few at a time, and each goes out within the handler's timeout or is dropped."""
    from hivemind.p2p import PeerID

    from ravnest_swarm.net.transport import bounded_stream_handler, make_request, make_response

    class NeverRead:  # a writer whose peer reads nothing: its buffer never drains
        def write(self, data):
            pass

        async def drain(self):
            await asyncio.Event().wait()

        def close(self):
            pass

    async def scenario():
        made = []

        async def handle(frames, context):
            made.append(asyncio.get_running_loop().time())
            return make_response({"ok": True})

        serve = bounded_stream_handler("big", PeerID(b"\x12\x20" + bytes(32)), handle, 1 << 16, 2.0,
                                       replies=asyncio.Semaphore(1))

        def stream():
            reader = asyncio.StreamReader()
            reader.feed_data(frames_bytes([make_request({})]) + END_OF_STREAM)
            reader.feed_eof()
            return asyncio.create_task(serve(SimpleNamespace(peer_id=PeerID(b"\x12\x20" + bytes(32))), reader,
                                             NeverRead()))

        first = stream()
        await asyncio.sleep(1.0)
        second = stream()  # its reply waits for the first's slot, given up at the first's write deadline
        await asyncio.wait_for(asyncio.gather(first, second), 10)
        return made

    made = asyncio.run(scenario())
    assert len(made) == 2 and made[1] - made[0] >= 1.8, made
