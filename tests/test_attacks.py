"""Attacks on an open run by strangers (issue #19), each against one run of real `join` processes.

The module starts one run (a backbone and two volunteers that form one cluster of two stages) and every
test attacks it from outside with its own hostile process (a stock hivemind DHT client or a raw libp2p
peer), then shows that the run keeps training and that what it attacked is unchanged. The last test
shows that a peer joining after all the attacks is placed and trains. Tests run in file order; keep the
late joiner last.
"""

import asyncio
import json
import os
import threading
import time
from typing import Callable, Dict, List, Tuple

import psutil
import pytest
import torch
from safetensors.torch import load_file
from hivemind.compression import serialize_torch_tensor
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from run_observer import RunObserver
from commands import ravnest
from ravnest_swarm.averaging.mailbox import NOT_A_MEMBER
from ravnest_swarm.averaging.wire import RING_HANDLER
from ravnest_swarm.membership.reader import read_adopted_plan, read_peers
from ravnest_swarm.membership.owner import OWNER_KEYS_ENV, fingerprint, load_or_create_owner_key
from ravnest_swarm.membership.identity import NOT_THE_NAMED_PEER
from ravnest_swarm.membership.records import (PeerRecord, PlanRecord, StageEndpoint, make_validators, peers_key,
                                           parse_run_address, plan_key, plan_subkey_prefix, signing_validator, spec_key,
                                           stage_subkey_prefix, stages_key, start_peer_node)
from ravnest_swarm.net.identity import peer_id_of_owner
from ravnest_swarm.models import get_model
from ravnest_swarm.net.node import maddrs_without_peer_id, parse_maddrs, start_node, stop_node
from ravnest_swarm.net.transport import make_request, unpack_metadata
from ravnest_swarm.pipeline import wire
from ravnest_swarm.pipeline.config import Neighbours
from ravnest_swarm.pipeline.endpoints import EndpointResolver, read_endpoints
from ravnest_swarm.pipeline.messaging import NOT_A_NEIGHBOUR
from ravnest_swarm.processes import ProcessGroup
from ravnest_swarm.swarm.export import export_with
from ravnest_swarm.swarm.placement import model_workload
from ravnest_swarm.swarm.spec import RunSpec, read_specs
from ravnest_swarm.swarm.state_transfer import LayerStateServer, fill_layer, offered_layers, offers_of
from test_hardening_handlers import END_OF_STREAM, frames_bytes

RUN = "attacked"
MODEL_GB = model_workload(get_model("mlp-digits"), RunSpec("mlp-digits"), 8)[0].model_gb


class AttackedRun:
    """The run under attack: its backbone's multiaddr, its address (``attacked@<owner>``), the environment that
    holds its owner's key, its processes and an observer of its peer records."""

    def __init__(self, processes: ProcessGroup, maddr: str, address: str, owner_env: dict, observer: RunObserver):
        self.processes, self.maddr, self.address, self.owner_env = processes, maddr, address, owner_env
        self.observer, self.owner = observer, address.split("@")[1]
        self.volunteers = {}

    def join(self, name: str, ram_fraction: float = 0.6, extra=()):
        """Start a volunteer; at 0.6 of the model's memory two of them form a cluster of two stages."""
        self.volunteers[name] = self.processes.start(
            ["join", "--initial-peers", self.maddr, "--run", self.address, "--name", name, "--no-dashboard",
             "--model", "mlp-digits", "--steps", "100000", "--averaging-period", "20", "--heartbeat", "2",
             "--round-seconds", "6", "--min-peers", "2", "--ram-gb", f"{MODEL_GB * ram_fraction:.9f}",
             "--gflops", "20", "--bandwidth-mbps", "100", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", *extra], name,
            env=self.owner_env)
        return self.volunteers[name]

    def owner_spec(self) -> dict:
        """The run's spec record as its owner signed it (read by an observer that knows the address)."""
        specs = self.observer.call(read_specs(self.observer.node, RUN))
        return specs[self.owner]

    def training(self) -> Dict[str, dict]:
        """The records of the peers placed and training, by name."""
        return self.training_in(self.observer.peers())

    @staticmethod
    def training_in(peers: Dict[str, dict]) -> Dict[str, dict]:
        """Of ``peers`` (records by name), those placed and training."""
        return {name: p for name, p in peers.items()
                if p["state"] == "training" and p.get("cluster") is not None and p["cluster"] >= 0}

    def wait_for(self, predicate: Callable[[Dict[str, dict]], bool], timeout: float, what: str) -> Dict[str, dict]:
        return self.observer.wait_for(predicate, timeout, what, period=1.0)

    def keeps_training(self, names=("v0", "v1"), steps: int = 5, timeout: float = 90) -> Dict[str, dict]:
        """Wait until each of ``names`` is placed and has trained ``steps`` more steps than now."""
        before = {name: (self.training().get(name) or {}).get("step") or 0 for name in names}
        return self.wait_for(lambda peers: all(
            peers.get(name, {}).get("state") == "training" and (peers[name].get("step") or 0) >= before[name] + steps
            for name in names), timeout, f"{', '.join(names)} train {steps} more steps after the attack")


@pytest.fixture(scope="module")
def attacked_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("attacked")
    processes = ProcessGroup(str(folder))
    # the owner's key, made before the run starts, so the backbone can be told the run's full address
    owner_env = {OWNER_KEYS_ENV: str(folder / "owners")}
    key = load_or_create_owner_key(os.path.join(owner_env[OWNER_KEYS_ENV], f"{RUN}.key"))
    address = f"{RUN}@{fingerprint(key.get_public_key().to_bytes())}"
    observer = None
    try:
        backbone = processes.start(["backbone", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--run", address],
                                   "backbone")
        maddr = backbone.maddrs()[0]
        observer = RunObserver(maddr, RUN)
        run = AttackedRun(processes, maddr, address, owner_env, observer)
        run.join("v0")
        run.join("v1")
        run.wait_for(lambda peers: {"v0", "v1"} <= set(run.training()) and
                     all((p.get("step") or 0) > 0 for p in run.training().values()),
                     150, "v0 and v1 placed in one cluster and training")
        yield run
    finally:
        if observer is not None:
            observer.close()
        processes.stop_all()


@pytest.mark.timeout(180)
def test_spec_signed_by_a_stranger_is_ignored_and_the_owners_new_version_is_followed(attacked_run):
    """Attack: a stock hivemind DHT client (no validators of ours) signs a spec of its own for the run, created
    an hour earlier and with another learning rate (the old rule, "the earliest created spec wins", made
    it the run's), and one naming the owner's public key with its own signature. The backbone and the
    volunteers (who know the run's address) refuse to store either, and nobody follows them. Then the owner
    publishes version 2 with a new lr (`update-spec`): both volunteers follow it within a few seconds."""
    spec = RunSpec("mlp-digits", lr=9.0)
    stranger_key = RSAPrivateKey()
    hijack = dict(spec.record(stranger_key, RUN), created=time.time() - 3600)
    owners_key = attacked_run.owner_spec()["owner"]  # read before the attack's event loop runs

    async def attack():
        client = await start_node(parse_maddrs([attacked_run.maddr]), record_validators=[RSASignatureValidator()],
                                  client_mode=True)
        try:
            own = RSASignatureValidator().local_public_key
            stored = [await client.store(spec_key(RUN), value, get_dht_time() + 600, subkey=own)
                      for value in (hijack, dict(hijack, owner=owners_key))]
            return stored
        finally:
            await stop_node(client)

    stored = asyncio.run(attack())
    assert stored == [False, False], stored  # no node of the run took either
    # an observer that knows only the run's name (it would take any self-signed spec) finds the owner's alone
    assert list(attacked_run.observer.call(read_specs(attacked_run.observer.node, RUN))) == [attacked_run.owner]
    attacked_run.keeps_training()
    for name in ("v0", "v1"):
        assert "spec version" not in attacked_run.volunteers[name].stderr() + attacked_run.volunteers[name].stdout()

    result = ravnest("update-spec", "--initial-peers", attacked_run.maddr, "--run", attacked_run.address, "--lr", "0.001",
                     timeout=60, env=attacked_run.owner_env)
    assert result.returncode == 0 and "spec version 2" in result.stdout, result.stderr
    published = time.monotonic()
    for name in ("v0", "v1"):
        attacked_run.volunteers[name].wait_for_output(r"spec version 2 from its owner: lr 0\.002 -> 0\.001", 30,
                                                      stream="stderr")
    assert time.monotonic() - published < 4 * 2 + 10  # a heartbeat or two (2 s here), on a loaded 2-core machine
    attacked_run.keeps_training()

    stranger = ravnest("update-spec", "--initial-peers", attacked_run.maddr, "--run", attacked_run.address, "--lr", "0.5",
                       timeout=60, env={OWNER_KEYS_ENV: attacked_run.owner_env[OWNER_KEYS_ENV] + "-none"})
    assert stranger.returncode != 0 and "no run owner key" in stranger.stderr and "Traceback" not in stranger.stderr


def stage_peer(run: AttackedRun, stage: int) -> dict:
    """The record of the volunteer training ``stage`` of the run's cluster."""
    return next(p for p in run.training().values() if p.get("stage") == stage)


async def open_stranger(victim: dict) -> P2P:
    """A stock hivemind P2P of the test's own, in no plan, connected to ``victim``."""
    return await P2P.create(initial_peers=victim["maddrs"], host_maddrs=["/ip4/127.0.0.1/tcp/0"])


async def send_as(p2p: P2P, victim: dict, handler: str, metadata: dict, tensors) -> str:
    """One pipeline message to ``victim``'s handler, framed as a neighbour frames it; its reply: ``ok`` or the
    refusal's line."""
    _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(victim["peer_id"]), handler)
    try:
        writer.write(frames_bytes(wire.encode(metadata, list(tensors))) + END_OF_STREAM)
        try:
            await writer.drain()
        except ConnectionError:
            pass  # the stage may answer and close before our last byte is out; its answer is still there
        _, error = await asyncio.wait_for(P2P.receive_protobuf(runtime_pb2.ExpertResponse, reader), 30)
        return "ok" if error is None else error.message
    finally:
        writer.close()


async def stage_status(p2p: P2P, victim: dict) -> dict:
    """The counters of ``victim``'s stage (its status handler answers anyone)."""
    response = await p2p.call_protobuf_handler(PeerID.from_base58(victim["peer_id"]), wire.STATUS, make_request({}),
                                               runtime_pb2.ExpertResponse)
    return unpack_metadata(response.metadata)


def wait_for_refusals(run: AttackedRun, victim: dict, count: int, stranger: str) -> dict:
    """Wait until ``victim``'s record counts ``count`` more refusals and its note names ``stranger``'s."""
    before = victim.get("rejected") or 0
    return run.wait_for(lambda peers: (peers[victim["name"]].get("rejected") or 0) >= before + count
                        and stranger in (peers[victim["name"]].get("note") or ""), 60,
                        f"{victim['name']}'s record counts {count} refusals of {stranger}")[victim["name"]]


@pytest.mark.timeout(180)
def test_forward_from_a_stranger(attacked_run):
    """Attack: a stranger (a stock hivemind P2P in no plan) sends the cluster's last stage a forward addressed
    to its run, cluster and stage, with well-formed activations and targets, then the finish message that ends
    a stage's run. The stage takes forwards only from the peer the plan puts before it: it refuses both in one
    line, its record counts them (``rejected``) and its note names the stranger, and it goes on training
    (before, it trained on the stranger's microbatch, and the finish ended its run)."""
    victim = stage_peer(attacked_run, 1)
    (width,) = get_model("mlp-digits").layers[victim["layers"][0]].input_shape
    address = dict(run=RUN, cluster=victim["cluster"], stage=1)

    async def attack():
        stranger = await open_stranger(victim)
        try:
            forward = dict(address, microbatch=10**6, sample_ids=list(range(4)), version=victim["step"])
            replies = [await send_as(stranger, victim, wire.FORWARD, forward,
                                     [torch.randn(4, width), torch.zeros(4, dtype=torch.long)]),
                       await send_as(stranger, victim, wire.FORWARD,
                                     dict(address, op="finish", completed=0, step=victim["step"]), [])]
            return stranger.peer_id.to_base58(), replies
        finally:
            await stranger.shutdown()

    stranger, replies = asyncio.run(attack())
    assert all(NOT_A_NEIGHBOUR in reply and "\n" not in reply for reply in replies), replies
    record = wait_for_refusals(attacked_run, victim, 2, stranger)
    assert NOT_A_NEIGHBOUR in record["note"], record["note"]
    attacked_run.keeps_training()


@pytest.mark.timeout(180)
def test_backward_from_a_stranger(attacked_run):
    """Attack: a stranger sends the cluster's stage 0 gradients, scaled by 1e3 (under the 1e6 poisoning
    check), for every microbatch id around the ones it has in flight, so some name a microbatch that awaits
    its gradient (before, those were applied to its parameters). Stage 0 takes gradients only from the peer
    the plan puts after it: it refuses each in one line, before decoding it, counts them in its record, names
    the stranger in its note, and goes on training."""
    victim = stage_peer(attacked_run, 0)

    async def attack():
        stranger = await open_stranger(victim)
        try:
            # between averaging rounds the stage has microbatches in flight; during one it may have none
            status = await stage_status(stranger, victim)
            deadline = time.monotonic() + 30
            while status["pending"] == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
                status = await stage_status(stranger, victim)
            ids = range(max(0, status["injected"] - 8), status["injected"] + 8)
            replies = [await send_as(stranger, victim, wire.BACKWARD,
                                     dict(run=RUN, cluster=victim["cluster"], stage=0, microbatch=microbatch,
                                          version=status["version"]), [torch.randn(16, 64) * 1e3])
                       for microbatch in ids]
            return stranger.peer_id.to_base58(), status, replies
        finally:
            await stranger.shutdown()

    stranger, status, replies = asyncio.run(attack())
    assert status["pending"] > 0, status  # some of the ids were awaiting their gradient
    assert len(replies) == 16 and all(NOT_A_NEIGHBOUR in reply for reply in replies), replies
    wait_for_refusals(attacked_run, victim, 16, stranger)
    attacked_run.keeps_training()


async def serve_a_hostile_endpoint(node, run: str, slot: Tuple[int, int], holder: Dict) -> Tuple[bool, List[str]]:
    """A stranger's ``node`` writes a well-formed endpoint record for ``slot`` (the cluster's stage held by
    ``holder``), signed with its own identity and naming itself, so it is stored (it speaks for itself), dated far
    ahead, so it is the slot's newest, and serves the forward handler to catch what reaches it. Whether a node
    stored the record, and the senders caught (filled as forwards arrive)."""
    caught = []

    async def catch(info, reader, writer):
        caught.append(info.peer_id.to_base58())
        writer.close()

    await node.p2p.add_binary_stream_handler(wire.FORWARD, catch)
    hostile = StageEndpoint(peer_id=node.peer_id.to_base58(), model="mlp-digits",
                            maddrs=[str(m) for m in await node.p2p.get_visible_maddrs()],
                            layers=list(holder["layers"]), version=holder["step"], time=time.time() + 10**6).dict()
    stored = await node.store(stages_key(run, slot[0]), hostile, get_dht_time() + 600,
                              subkey=stage_subkey_prefix(*slot) + signing_validator(node).local_public_key)
    return stored, caught


@pytest.mark.timeout(180)
def test_endpoint_record_for_a_slot_from_a_peer_the_plan_does_not_name(attacked_run):
    """Attack: a stranger's DHT node writes a well-formed endpoint record, signed with its own identity, for the
    slot of the cluster's stage 1, naming itself and dated far ahead, so it is the newest record for that slot
    (the old rule, the newest ``time`` wins, gave it the slot: stage 0 would have sent its activations there at
    its next resolve), and serves the forward handler to catch them. A slot resolves only to the peer the plan
    names for it: a resolver that names it, as stage 0's does, still finds the real stage 1; no forward reaches
    the stranger while the run trains on."""
    first, second = stage_peer(attacked_run, 0), stage_peer(attacked_run, 1)
    slot = (second["cluster"], 1)

    async def attack():
        node = await start_peer_node(parse_maddrs([attacked_run.maddr]), RUN, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            # it outlives this test, so the late joiner's placement meets it too
            stored, caught = await serve_a_hostile_endpoint(node, RUN, slot, second)
            newest = (await read_endpoints(node, RUN, slot[0])).get(slot)
            named = (await read_endpoints(node, RUN, slot[0], {slot: second["peer_id"]})).get(slot)
            resolver = EndpointResolver(node, RUN, slot[0], 0, lambda: Neighbours(next=second["peer_id"]))
            resolved = (await resolver.resolve(1, refresh=True)).to_base58()
            steps = {}
            for _ in range(90):  # the run trains on while the record stands; the stranger listens meanwhile
                steps = {p["name"]: p.get("step") or 0 for p in await read_peers(node, RUN)}
                if all(steps.get(p["name"], 0) >= (p["step"] or 0) + 5 for p in (first, second)):
                    break
                await asyncio.sleep(1.0)
            return node.peer_id.to_base58(), stored, newest, named, resolved, steps, caught
        finally:
            await stop_node(node)

    stranger, stored, newest, named, resolved, steps, caught = asyncio.run(attack())
    assert stored and newest["peer_id"] == stranger  # the hostile record stands, and is the slot's newest
    assert named["peer_id"] == resolved == second["peer_id"]
    assert all(steps.get(p["name"], 0) >= (p["step"] or 0) + 5 for p in (first, second)), steps
    assert caught == []
    attacked_run.keeps_training()


@pytest.mark.timeout(180)
def test_out_of_range_targets(attacked_run):
    """Attack: a stranger sends the cluster's last stage a forward whose targets lie far outside the model's 10
    classes (before, the loss raised inside the stage's scheduler, which ended without a word: the stage never
    trained again). The stage refuses it as not from its neighbour before decoding its tensors; nothing fails in
    its compute (``failed`` stays as it was) and it trains on. Targets from a hostile neighbour are range-checked
    at the loss, and the microbatch dropped and counted (test_pipeline_faults.py)."""
    victim = stage_peer(attacked_run, 1)
    (width,) = get_model("mlp-digits").layers[victim["layers"][0]].input_shape

    async def attack():
        stranger = await open_stranger(victim)
        try:
            before = await stage_status(stranger, victim)
            forward = dict(run=RUN, cluster=victim["cluster"], stage=1, microbatch=10**6 + 1,
                           sample_ids=list(range(4)), version=victim["step"])
            reply = await send_as(stranger, victim, wire.FORWARD, forward,
                                  [torch.randn(4, width), torch.full((4,), 10**9, dtype=torch.long)])
            return stranger.peer_id.to_base58(), before, reply
        finally:
            await stranger.shutdown()

    stranger, before, reply = asyncio.run(attack())
    assert NOT_A_NEIGHBOUR in reply, reply
    wait_for_refusals(attacked_run, victim, 1, stranger)
    attacked_run.keeps_training()

    async def after():
        observer = await open_stranger(victim)
        try:
            return await stage_status(observer, victim)
        finally:
            await observer.shutdown()

    status = asyncio.run(after())
    assert status["failed"] == before["failed"] and status["forwards"] > before["forwards"], (before, status)


def next_round(record: dict) -> int:
    """The averaging round ``record`` says its peer takes part in next (on the run's count, every 20 steps here):
    one in the peer's window of rounds."""
    return record.get("next_round") or ((record.get("step") or 0) // 20 + 1) * 20


async def send_ring_messages(victim: dict, messages) -> Tuple[str, List[str]]:
    """Each (metadata, tensors) of ``messages`` to ``victim``'s averaging handler, framed as a ring member frames
    a message (metadata, then a part per frame), from a stock hivemind P2P in no plan. The stranger's id and the
    replies: ``ok`` or the refusal's line."""
    stranger = await P2P.create(initial_peers=victim["maddrs"], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    replies = []
    try:
        for metadata, tensors in messages:
            frames = [make_request(metadata)] + [runtime_pb2.ExpertRequest(tensors=[serialize_torch_tensor(tensor)])
                                                 for tensor in tensors]
            _, reader, writer = await stranger.call_binary_stream_handler(PeerID.from_base58(victim["peer_id"]),
                                                                          RING_HANDLER)
            # read while writing: a refusal at the first frame closes the stream, and the write of the unread rest
            # that fails then sets its error on the reader, which a read begun only after the write raises (a CI
            # run's BrokenPipeError) although the reply had come
            reply = asyncio.create_task(P2P.receive_protobuf(runtime_pb2.ExpertResponse, reader))
            try:
                writer.write(frames_bytes(frames) + END_OF_STREAM)
                try:
                    await writer.drain()
                except ConnectionError:
                    pass  # refused at its first frame, the rest unread: the reply is there all the same
                _, error = await asyncio.wait_for(reply, 30)
                replies.append("ok" if error is None else error.message)
            finally:
                reply.cancel()
                writer.close()
        return stranger.peer_id.to_base58(), replies
    finally:
        await stranger.shutdown()


def wait_for_ring_refusals(run: AttackedRun, victim: dict, count: int, stranger: str) -> dict:
    """Wait until ``victim``'s record counts ``count`` more refusals and its note names ``stranger``'s."""
    before = victim.get("rejected") or 0
    return run.wait_for(lambda peers: (peers[victim["name"]].get("rejected") or 0) >= before + count
                        and f"ring message from {stranger[-8:]}" in (peers[victim["name"]].get("note") or ""),
                        60, f"{victim['name']}'s record counts {count} ring messages of {stranger}")[victim["name"]]


@pytest.mark.timeout(180)
def test_abort_from_a_stranger_excludes_an_honest_member(attacked_run):
    """Attack: a stranger (a stock hivemind P2P in no plan) sends each volunteer's averaging handler two abort
    notes for ring 0 of its next round: one that excludes the other volunteer, one that ends the ring (before,
    an abort was filed from any sender: the ring went on without the honest member, or ended). Ring notes count
    only from members of the ring they name: each is refused in one line, each volunteer's record counts both and
    its note names the stranger, and the run trains on, each volunteer in its slot, no averaging round failed."""
    before = attacked_run.training()
    results = {}
    for name, other in (("v0", "v1"), ("v1", "v0")):
        note = dict(run=RUN, step=next_round(before[name]), ring=0, phase="abort", position=0, attempt=[])
        results[name] = asyncio.run(send_ring_messages(before[name], [
            (dict(note, excluded=[before[other]["peer_id"]]), []), (dict(note, failure="ended by a stranger"), [])]))
    for name, (stranger, replies) in results.items():
        assert len(replies) == 2 and all(NOT_A_MEMBER in reply and "\n" not in reply for reply in replies), replies
        wait_for_ring_refusals(attacked_run, before[name], 2, stranger)
    after = attacked_run.keeps_training()
    for name in ("v0", "v1"):
        assert (after[name]["cluster"], after[name]["stage"]) == (before[name]["cluster"], before[name]["stage"])
        assert (after[name].get("averaging_failures") or 0) == (before[name].get("averaging_failures") or 0)


@pytest.mark.timeout(180)
def test_far_future_ring_messages_fill_the_mailbox(attacked_run):
    """Attack: a stranger sends a volunteer's averaging handler 96 chunks of 1 MiB, each a new message: 64 for
    rounds far in the future (steps from 10^9: before, each was kept until its round ended, which never came, so
    a stranger could fill the peer's memory) and 32 for its next round. Only members of a ring may send it: each
    is refused at its first frame, before its chunk is read, in one line, and counted in the record; the
    volunteer's memory does not grow by what was sent, and it trains on."""
    victim = attacked_run.training()["v0"]
    process = psutil.Process(next(p.pid for p in attacked_run.processes.processes if p.name == "v0"))
    chunk = torch.ones(256 * 1024)
    far = [dict(run=RUN, step=10**9 + k, ring=0, phase="reduce", position=0, attempt=[]) for k in range(64)]
    near = [dict(run=RUN, step=next_round(victim), ring=0, phase="reduce", position=k, attempt=[]) for k in range(32)]
    memory_before = process.memory_info().rss
    stranger, replies = asyncio.run(send_ring_messages(victim, [(metadata, [chunk]) for metadata in far + near]))
    grown = process.memory_info().rss - memory_before
    print(f"v0's memory while refusing 96 MiB of ring chunks: {grown / 1024**2:+.1f} MiB")
    assert len(replies) == 96 and all(NOT_A_MEMBER in reply for reply in replies), set(replies)
    assert grown < 32 * 1024**2, f"the victim grew by {grown / 1024**2:.0f} MiB while refusing 96 MiB"
    wait_for_ring_refusals(attacked_run, victim, 96, stranger)
    attacked_run.keeps_training()


HUGE_STEP = 10**15


class HostileHolder(LayerStateServer):
    """A holder of every layer that serves them altered; counts the requests it gets."""

    asked = 0

    def _snapshot(self, *args):
        self.asked += 1
        return super()._snapshot(*args)


@pytest.mark.timeout(240)
def test_a_holder_claiming_a_huge_step_with_altered_layers_is_not_trusted(attacked_run, tmp_path):
    """Attack: a raw libp2p peer of the test's own writes a peer record (its own, under its identity) offering every
    layer of the model at step 10^15 (as a peer that hands its layers over as it leaves, so that no planner places it)
    and serves ``ravnest.layer_state`` with every tensor altered, live and as an averaged copy. A joiner that
    fills the model's layers from the run's holders as ``join`` does (``state_transfer.fill_layer`` with the
    run's records and adopted plan) sees the offer, yet takes each layer from v0 or v1, which the plan
    names, at their step: the hostile is never asked, no layer holds its values, and v0 and v1 train on. An export of
    the run meanwhile (``swarm.export.export_with``, what ``ravnest-swarm export`` runs) is no different: every layer
    served by v0 or v1, named in model.json, none of the hostile's values."""
    model = get_model("mlp-digits")
    layers = len(model.layers)
    altered = model.build_stage(0, layers)
    with torch.no_grad():
        for parameter in altered.parameters():
            parameter.fill_(1000.0)
    local = ["/ip4/127.0.0.1/tcp/0"]

    async def attack():
        # under its own identity: its record names itself, as any peer's may
        hostile = await start_peer_node(parse_maddrs([attacked_run.maddr]), RUN, host_maddrs=local)
        signer = signing_validator(hostile)
        joiner = None
        try:
            server = HostileHolder(hostile.routes, RUN, lambda: offered_layers(0, altered, HUGE_STEP))
            server.keep_averaged(offered_layers(0, altered, HUGE_STEP))
            await server.start()
            record = PeerRecord.parse_obj(dict(
                peer_id=hostile.peer_id.to_base58(), name="hostile-holder", state="leaving", ram_gb=1.0,
                bandwidth_mbps=100.0, gflops=20.0, reachability="direct", version="0",
                maddrs=[str(m) for m in await hostile.p2p.get_visible_maddrs()], time=time.time(), layers=None,
                held=[0, layers, HUGE_STEP])).dict()
            assert await hostile.store(peers_key(RUN), record, get_dht_time() + 30, subkey=signer.local_public_key)

            joiner = await start_node(parse_maddrs([attacked_run.maddr]), host_maddrs=local, client_mode=True,
                                      record_validators=make_validators(RUN))
            for _ in range(20):
                records = await read_peers(joiner, RUN)
                if any(r["name"] == "hostile-holder" for r in records):
                    break
                await asyncio.sleep(0.5)
            plan = await read_adopted_plan(joiner, RUN)
            by_id = {r["peer_id"]: r for r in records}

            async def reach(holder: PeerID) -> str:
                found = by_id[holder.to_base58()]
                return await joiner.routes.connect(holder, maddrs_without_peer_id(found["maddrs"], holder),
                                                   found.get("reachability"))

            fresh = model.build_stage(0, layers)
            offers = [offers_of(records, plan, layer) for layer in range(layers)]
            filled = [await fill_layer(joiner.routes, RUN, fresh[layer], layer, offers[layer], 30.0, reach=reach)
                      for layer in range(layers)]
            manifest = await export_with(joiner, parse_run_address(attacked_run.address), str(tmp_path / "export"),
                                         30.0, None)
            return offers, filled, fresh, server.asked, hostile.peer_id, manifest
        finally:
            for node in (joiner, hostile):
                if node is not None:
                    await stop_node(node)

    before = attacked_run.training()
    offers, filled, fresh, asked, hostile_id, manifest = asyncio.run(attack())
    # the attack was in view: every layer was offered by the hostile at its huge step
    assert all(any(o.holder == hostile_id and o.step == HUGE_STEP and not o.planned for o in layer_offers)
               for layer_offers in offers), offers
    assert all(f.loaded and f.step > 0 for f in filled), [(f.step, f.problem) for f in filled]
    assert asked == 0
    # each step is one that v0 or v1 reached (their records, renewed every heartbeat, catch up with it)
    attacked_run.wait_for(lambda peers: max(peers[name].get("step") or 0 for name in ("v0", "v1")) >=
                          max(f.step for f in filled), 60, "v0's or v1's record reaches the steps the joiner took")
    seeded = model.build_stage(0, layers)
    for layer in range(layers):
        for name, tensor in fresh[layer].state_dict().items():
            assert not torch.equal(tensor, altered[layer].state_dict()[name]), (layer, name)
            if tensor.is_floating_point() and name.endswith("weight"):
                assert not torch.equal(tensor, seeded[layer].state_dict()[name]), (layer, name)  # v0's or v1's
    after = attacked_run.keeps_training()
    assert all(after[name]["cluster"] == before[name]["cluster"] for name in ("v0", "v1"))
    honest = {after[name]["peer_id"] for name in ("v0", "v1")}
    assert all(set(entry["served_by"]) <= honest and entry["served_by"] for entry in manifest["layers"]), manifest
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert not any(torch.equal(tensor, torch.full_like(tensor, 1000.0)) for tensor in exported.values()
                   if tensor.is_floating_point())


@pytest.mark.timeout(180)
def test_plan_for_a_far_future_round_is_ignored(attacked_run):
    """Attack: a stock hivemind DHT client writes well-formed plan records under its own signed subkey: the
    run's own placement under round 10^15 (which used to stop planning for good: "none of 0 proposal(s) is
    valid", round after round), and the next round placing a made-up peer. Neither counts: the peers keep
    their plan round and train, readers still see the honest plan, and the late joiner below is placed by
    a round numbered after the honest one."""
    before = attacked_run.training()
    honest_round = before["v0"]["plan_round"]
    honest = attacked_run.observer.call(read_adopted_plan(attacked_run.observer.node, RUN))
    assert honest is not None and honest["round"] == honest_round

    async def attack():
        client = await start_node(parse_maddrs([attacked_run.maddr]), record_validators=[RSASignatureValidator()],
                                  client_mode=True)
        try:
            own = RSASignatureValidator().local_public_key
            for round_number, clusters in ((10**15, honest["clusters"]),
                                           (honest_round + 1, [[dict(peer_id="12D3KooWMallory", layers=[0, 9])]])):
                value = PlanRecord(round=round_number, time=time.time(), clusters=clusters).dict()
                assert await client.store(plan_key(RUN), value, get_dht_time() + 600,
                                          subkey=plan_subkey_prefix(round_number) + own)
        finally:
            await stop_node(client)

    asyncio.run(attack())
    peers = attacked_run.keeps_training()
    assert all(peers[name]["plan_round"] == honest_round for name in ("v0", "v1")), peers
    assert attacked_run.observer.call(read_adopted_plan(attacked_run.observer.node, RUN))["round"] == honest_round


class LaxStranger:
    """A stranger's stock hivemind DHT server in the run's DHT: it signs with its own key and checks nothing of
    ours, so it stores whatever it writes and serves it to every reader that asks it: the readers are the guard.
    Its event loop runs in a thread of its own, so it answers while the test waits; :meth:`close` stops it."""

    def __init__(self, run: AttackedRun):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.node = self.call(start_node(parse_maddrs([run.maddr]),
                                         record_validators=[RSASignatureValidator(RSAPrivateKey())],
                                         host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
        self.own = signing_validator(self.node).local_public_key

    def call(self, coroutine, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def store(self, key: str, value: dict, subkey: bytes) -> bool:
        """Store the record; whether this node holds it now (``store`` answers with the last replica's reply)."""
        self.call(self.node.store(key, value, get_dht_time() + 600, subkey=subkey))
        held = self.node.protocol.storage.get(DHTID.generate(source=key))
        return held is not None and isinstance(held.value, DictionaryDHTValue) and subkey in held.value

    def close(self) -> None:
        try:
            self.call(stop_node(self.node))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


def status_document(run: AttackedRun) -> dict:
    result = ravnest("status", "--initial-peers", run.maddr, "--run", run.address, "--json", timeout=90)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(240)
def test_a_strangers_copy_of_an_honest_peers_record_saying_leaving_or_standby(attacked_run):
    """Attack: a stranger copies v1's peer record, dated ahead, once as ``leaving`` and once as ``standby``, and
    writes both under its own signed subkeys from a DHT server that stores them (the view rule keeps records per
    writer, but a copy that named v1 still counted as a record of v1: a newer ``standby`` one was shown, and a
    ``leaving`` one removed v1 once v1's own expired). Each record names a peer that is not its writer: no node of
    the run stores them, every reader refuses them from the stranger's node, and ``status`` says so. Everyone
    still sees v1 training in the plan it followed, and planning goes on as before."""
    before = attacked_run.training()
    victim = {name: value for name, value in before["v1"].items() if name != "expires_in"}

    stranger = LaxStranger(attacked_run)
    try:
        stored = [stranger.store(peers_key(RUN), PeerRecord.parse_obj(dict(victim, state=state,
                                                                           time=time.time() + 3600)).dict(),
                                 subkey=prefix + stranger.own)
                  for prefix, state in ((b"", "leaving"), (b"s.", "standby"))]
        assert all(stored)  # the stranger's own node holds them
        for _ in range(3):  # reads over a few heartbeats: the copies never show
            peers = attacked_run.observer.peers()
            assert peers["v1"]["state"] == "training" and peers["v1"]["time"] < victim["time"] + 3000, peers["v1"]
            time.sleep(2.0)
        document = status_document(attacked_run)
        by_name = {p["name"]: p for p in document["peers"]}
        assert by_name["v1"]["state"] == "training" and by_name["v1"]["time"] < victim["time"] + 3000
        assert document["summary"]["states"].get("standby", 0) == 0, document["summary"]
        assert document["refused"].get(NOT_THE_NAMED_PEER, 0) >= 1, document["refused"]
        peers = attacked_run.keeps_training()
        assert all(peers[name]["plan_round"] == before[name]["plan_round"] for name in ("v0", "v1")), peers
    finally:
        stranger.close()


@pytest.mark.timeout(240)
def test_records_of_made_up_peers_confirming_a_plan(attacked_run):
    """Attack: a stranger writes a plan for the round after the honest one that places two made-up peers (ids of
    keys it made and threw away), and a training record of each at its slot, naming that plan's round, all signed
    with its own key from a DHT server that stores them: once more than half of a plan's stages were confirmed by
    a record naming the peer placed there, the plan counted, and the run would have moved to it. The records name
    peers that are not their writer: refused by every reader, so the plan is confirmed by nobody, nobody follows
    it, and the made-up peers appear nowhere."""
    before = attacked_run.training()
    honest_round = before["v0"]["plan_round"]
    made_up = [peer_id_of_owner(RSAPrivateKey().get_public_key().to_bytes()) for _ in range(2)]
    template = {name: value for name, value in before["v0"].items() if name != "expires_in"}

    round_number = honest_round + 1
    stranger = LaxStranger(attacked_run)
    try:
        plan = PlanRecord(round=round_number, time=time.time(),
                          clusters=[[dict(peer_id=peer_id, layers=[0, 9])] for peer_id in made_up]).dict()
        stored = [stranger.store(plan_key(RUN), plan, subkey=plan_subkey_prefix(round_number) + stranger.own)]
        for cluster, peer_id in enumerate(made_up):
            record = PeerRecord.parse_obj(dict(template, peer_id=peer_id, name=f"made-up-{cluster}", cluster=cluster,
                                               stage=0, layers=[0, 9], plan_round=round_number,
                                               time=time.time())).dict()
            stored.append(stranger.store(peers_key(RUN), record, subkey=f"{cluster}.".encode() + stranger.own))
        assert all(stored)
        observer = attacked_run.observer
        for _ in range(3):
            assert observer.call(read_adopted_plan(observer.node, RUN))["round"] == honest_round
            assert not {p["peer_id"] for p in observer.peers().values()} & set(made_up)
            time.sleep(2.0)
        document = status_document(attacked_run)
        assert not {p["peer_id"] for p in document["peers"]} & set(made_up)
        peers = attacked_run.keeps_training()
        assert all(peers[name]["plan_round"] == honest_round for name in ("v0", "v1")), peers
    finally:
        stranger.close()


# --- attacks go above this line, each a test named after its attack ---


@pytest.mark.timeout(240)
def test_a_peer_joining_after_the_attacks_is_placed_and_trains(attacked_run):
    """After every attack above, a newcomer that can hold the whole model is placed by a new planning round
    (numbered after the honest plan, not after any round a stranger wrote) and trains. The planner may move
    v0 and v1 to standby (one peer that holds the whole model is as fast as their cluster of two), so only
    the newcomer's training is required of it."""
    # the honest peers' rounds: the newcomer's must come after theirs
    rounds_before = {p["plan_round"] for name, p in attacked_run.training().items()
                     if name in ("v0", "v1") and p.get("plan_round") is not None}
    assert rounds_before, attacked_run.training()
    attacked_run.join("late", ram_fraction=1.3)
    # judged on the very records it returns: a predicate that read the records again passed on a newer read, while
    # the records returned, an older one, still had the late joiner as a standby of no round (plan_round None: two
    # CI failures)
    peers = attacked_run.wait_for(lambda peers: (AttackedRun.training_in(peers).get("late", {}).get("step") or 0) > 0,
                                  180, "the late joiner placed and training")
    assert max(rounds_before) < peers["late"]["plan_round"] <= max(rounds_before) + 3, (rounds_before, peers["late"])
    attacked_run.keeps_training(("late",))
