"""One averaging peer as a real process (``ravnest-swarm averaging-peer``), for the tests and the benchmark.

It holds a synthetic model: layers of given sizes whose values come from a seed, the cluster and the
layer index (:func:`synthetic_layer`), so a test can compute the exact mean in its own process. It
joins the DHT, announces its cluster, stage and layer range in its peer record, reads the adopted plan
from ``{run}_plan`` (one peer, ``--publish-plan N``, stands in for the planner and writes it once it
sees N placed peers), builds the rings, averages one round named by ``--step``, and prints the round's
result as one JSON line. ``--out`` writes the averaged range as safetensors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from hivemind.dht.node import DHTNode
from hivemind.proto import runtime_pb2
from hivemind.utils.timed_storage import get_dht_time

from ravnest_swarm import __version__
from ravnest_swarm.averaging.averager import PART_BYTES, MultiRingAverager
from ravnest_swarm.averaging.partners import connect_members
from ravnest_swarm.averaging.ring import RingRound, largest
from ravnest_swarm.averaging.robust import AGGREGATIONS, MEAN, PER_COORDINATE, ROBUST_AGGREGATES
from ravnest_swarm.averaging.robust_ring import RobustRingAttempt
from ravnest_swarm.averaging.segments import element_range, plan_rings, rings_of
from ravnest_swarm.bench.averaging_phases import run_bench_phases, run_robust_phases
from ravnest_swarm.bench.synthetic import codec_by_name, synthetic_range
from ravnest_swarm.errors import UserError
from ravnest_swarm.lifecycle import configure_logging, run_async
from ravnest_swarm.membership.reader import read_adopted_plan, read_peers
from ravnest_swarm.membership.records import (
    PeerRecord, PlanRecord, peers_key, plan_key, plan_subkey_prefix, signing_validator, start_peer_node,
)
from ravnest_swarm.membership.services import check_reachability, retried
from ravnest_swarm.net.node import parse_maddrs, peer_id_of, stop_node, store_record

logger = logging.getLogger(__name__)

RECORD_LIFETIME = 300.0
POLL_SECONDS = 0.2
PEERS_DONE_QUIET = 3.0  # at the end: how long without a ring message before the peer stops (see the end) ...
PEERS_DONE_AT_MOST = 10.0  # ... and at most how long it waits for that (its notes to a member gone may run on)
LEFT_EARLY_QUIET = 10.0  # the same for a peer whose rings did not all complete; it waits at most a ring timeout


def parse_ints(text: str, what: str) -> List[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"{what} must be comma-separated integers, got {text!r}")
    if not values:
        raise UserError(f"{what} is empty")
    return values


@dataclass
class AveragingPeerOptions:
    """Flags of ``averaging-peer``; see ``cli.averaging_peer`` for their help. ``initial_peers``: parsed
    multiaddrs for :func:`run_averaging_peer`, their text for :func:`run_averaging_peer_process`."""

    initial_peers: list
    run: str
    cluster: int
    stage: int
    layer_sizes: List[int]
    layers: Tuple[int, int]
    seed: int = 0
    step: int = 1
    timeout: float = 30.0
    compression: str = "none"
    aggregation: str = MEAN
    poison: Optional[str] = None
    hostile_abort: Optional[str] = None
    alter_aggregate: float = 0.0
    out: Optional[str] = None
    publish_plan: int = 0
    plan_timeout: float = 60.0
    delay_start: float = 0.0
    part_bytes: int = PART_BYTES
    lose_replies: int = 0
    cut_streams: int = 0
    host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",)
    announce_maddrs: Optional[Sequence[str]] = None
    bench_config: Optional[str] = None
    identity: Optional[str] = None  # a key file: a test that needs a ring order (by peer id) picks its peers' ids


async def publish_placement(node: DHTNode, options: AveragingPeerOptions, note: Optional[str] = None,
                            rejected: Optional[int] = None) -> None:
    """Our signed peer record with cluster, stage and layers; ``note`` carries the last round's summary and
    ``rejected`` how many contributions we refused as poisoned (both shown by ``status`` and the dashboard)."""
    maddrs = [str(m) for m in await node.p2p.get_visible_maddrs()][:16]
    record = dict(
        peer_id=node.peer_id.to_base58(), name=f"avg-c{options.cluster}s{options.stage}", state="averaging",
        ram_gb=0.0, bandwidth_mbps=0.0, gflops=0.0, reachability=node.routes.reachability, maddrs=maddrs,
        version=__version__,
        time=time.time(), cluster=options.cluster, stage=options.stage, layers=list(options.layers), note=note,
        rejected=rejected, plan_round=0,  # the plan of round 0 that the peers' placements form (below)
    )
    await store_record(node, peers_key(options.run), PeerRecord.parse_obj(record).dict(),
                       get_dht_time() + RECORD_LIFETIME, subkey=signing_validator(node).local_public_key)


async def publish_plan_when_placed(node: DHTNode, run: str, expected: int, deadline: float) -> dict:
    """Planner stand-in: once ``expected`` peers are placed, store the plan they form as round 0."""
    while True:
        placed = [record for record in await read_peers(node, run)
                  if record.get("cluster") is not None and record.get("layers") is not None]
        if len(placed) >= expected:
            break
        if time.monotonic() > deadline:
            raise UserError(f"only {len(placed)} of {expected} peers announced a placement in time", exit_code=1)
        await asyncio.sleep(POLL_SECONDS)
    clusters: Dict[int, list] = {}
    for record in placed:
        clusters.setdefault(record["cluster"], []).append(record)
    plan = PlanRecord(round=0, time=time.time(), clusters=[
        [dict(peer_id=r["peer_id"], layers=r["layers"]) for r in sorted(clusters[k], key=lambda r: r["stage"])]
        for k in sorted(clusters)
    ]).dict()
    if not await node.store(plan_key(run), plan, get_dht_time() + RECORD_LIFETIME,
                            subkey=plan_subkey_prefix(0) + signing_validator(node).local_public_key):
        raise UserError("no DHT node accepted the plan record", exit_code=1)
    return plan


async def read_plan(node: DHTNode, run: str, deadline: float) -> dict:
    while True:
        plan = await read_adopted_plan(node, run)
        if plan is not None:
            return plan
        if time.monotonic() > deadline:
            raise UserError(f"no plan record {plan_key(run)} appeared in the DHT in time", exit_code=1)
        await asyncio.sleep(POLL_SECONDS)


class LossyRingAverager(MultiRingAverager):
    """Fault injection for the tests, on the receiving side of real streams: the first ``lose_replies``
    ring streams that carry a message's tensor parts (its stripes, not the notes a ring sends) are read and
    filed in full, then close with no reply (what p2pd did under load in the benchmark); the first
    ``cut_streams`` streams longer than two parts are closed partway through the second part. Both senders
    must send that stripe again."""

    def __init__(self, *args, lose_replies: int = 0, cut_streams: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.replies_to_lose, self.streams_to_cut = lose_replies, cut_streams

    async def _serve(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.streams_to_cut:
            reader = _CuttingReader(reader, 2 * self.part_bytes, self._cut)
        await super()._serve(stream_info, reader, writer)

    async def _read_message(self, reader: asyncio.StreamReader, sender: str,
                            filling: List) -> runtime_pb2.ExpertResponse:
        response = await super()._read_message(reader, sender, filling)
        if filling and self.replies_to_lose:  # it filed tensor parts: a note fills no inbox
            self.replies_to_lose -= 1
            raise ConnectionError("fault injection: the reply is lost")  # the handler closes without replying
        return response

    def _cut(self) -> bool:
        if self.streams_to_cut:
            self.streams_to_cut -= 1
            return True
        return False


class _CuttingReader:
    """Reads a stream until ``limit`` bytes, then reports it broken off if ``cut()`` still agrees."""

    def __init__(self, reader: asyncio.StreamReader, limit: int, cut):
        self.reader, self.limit, self.cut, self.count = reader, limit, cut, 0

    async def readexactly(self, n: int) -> bytes:
        if self.count <= self.limit < self.count + n and self.cut():
            raise asyncio.IncompleteReadError(b"", n)
        self.count += n
        return await self.reader.readexactly(n)

    async def read(self, n: int = -1) -> bytes:
        return await self.reader.read(n)


HOSTILE_ABORTS = ("exclude", "fail")
HOSTILE_DELAY = 0.5  # after every member arrived: the others' attempts are running, waiting for our chunks


class HostileAttempt:
    """A hostile ring member's attempt (``--hostile-abort``): it sends nothing; ``HOSTILE_DELAY`` after the ring
    started it tells every other member, as an honest member's note would, that it refused its successor's
    contribution (``exclude``: an honest member) or that the ring failed (``fail``); then it stays silent until
    the ring's deadline and keeps its local values."""

    checking = False  # an attempt's interface (``ring.RingAttempt``): it never checks chunk owners

    def __init__(self, ring_round: RingRound, members: List[str], deadline: float, kind: str):
        self.round, self.members, self.deadline, self.kind = ring_round, members, deadline, kind

    async def run(self) -> torch.Tensor:
        await asyncio.sleep(HOSTILE_DELAY)
        me = self.members.index(self.round.peer.peer_id)
        if self.kind == "exclude":
            self.round._tell_ring(excluded=[self.members[(me + 1) % len(self.members)]])
        else:
            self.round._tell_ring(failure="hostile: no chunk within the ring timeout")
        await asyncio.sleep(max(0.0, self.deadline - time.monotonic()))
        return self.round.segment.clone()


class AlteringRingAttempt(RobustRingAttempt):
    """A hostile chunk owner (``--alter-aggregate X``): it adds X to the robust aggregate of its chunk before
    gathering it, and otherwise follows the protocol (it checks the other owners with the true aggregate)."""

    def __init__(self, *args, alteration: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.true_aggregate = self.aggregate
        self.aggregate = lambda contributions: self.true_aggregate(contributions) + alteration

    async def _check_owners(self, work: torch.Tensor) -> None:
        self.aggregate = self.true_aggregate  # our own chunk is aggregated and gathered by now
        await super()._check_owners(work)


POISONS = ("nan", "inf", "scale", "plausible")
PLAUSIBLE_SHARE = 0.99  # of the scale check's limit: the most a contribution can be scaled and still pass


def poison_(local: torch.Tensor, kind: str, max_scale: float) -> None:
    """``nan``/``inf``: one such value in the middle of our range (a peer whose training diverged);
    ``scale``: every value times 1e6 (a peer trying to drag the average its way); ``plausible``: every value
    scaled so the largest magnitude is just under ``max_scale``, which passes every receiver's scale check
    (a receiver allows ``max_scale`` times its own scale, and counts that scale as at least 1)."""
    if kind == "scale":
        local *= 1e6
    elif kind == "plausible":
        local *= PLAUSIBLE_SHARE * max_scale / max(largest(local), 1e-30)
    else:
        local[local.numel() // 2] = {"nan": float("nan"), "inf": float("inf")}[kind]


def run_averaging_peer_process(options: AveragingPeerOptions) -> int:
    """An averaging peer as a process started from its options (``ProcessGroup.start_library``)."""
    configure_logging(False)
    return run_async(run_averaging_peer(dataclasses.replace(
        options, initial_peers=parse_maddrs(options.initial_peers), layers=tuple(options.layers))))


async def run_averaging_peer(options: AveragingPeerOptions) -> int:
    if options.poison not in (None, *POISONS):
        raise UserError(f"--poison must be one of {', '.join(POISONS)}")
    if options.hostile_abort not in (None, *HOSTILE_ABORTS):
        raise UserError(f"--hostile-abort must be one of {', '.join(HOSTILE_ABORTS)}")
    if options.aggregation not in AGGREGATIONS:
        raise UserError(f"--aggregation must be one of {', '.join(AGGREGATIONS)}")
    compression = codec_by_name(options.compression)
    # one torch thread, as in a volunteer's stage process: the ring sums 512 KiB parts as they arrive, and
    # on shared cores intra-op threads cost more in synchronisation than such small operations gain
    torch.set_num_threads(1)
    try:
        start, end = element_range(options.layer_sizes, options.layers)
    except ValueError as e:
        raise UserError(f"--layers: {e}")
    # our record names our peer id: signed by our identity's key
    node = await start_peer_node(options.initial_peers, options.run, identity_path=options.identity,
                                 host_maddrs=options.host_maddrs, announce_maddrs=options.announce_maddrs)
    if options.initial_peers:
        # our record says whether partners can dial us; a peer behind NAT is then reached through the backbone.
        # Tried again on a lost reply: a bench starts every peer at once against one backbone
        backbone = peer_id_of(options.initial_peers[0])
        await retried(lambda: check_reachability(node.routes, backbone, options.timeout))
    if options.lose_replies or options.cut_streams:
        averager = LossyRingAverager(node.routes, options.run, timeout=options.timeout, compression=compression,
                                     part_bytes=options.part_bytes, aggregation=options.aggregation,
                                     lose_replies=options.lose_replies, cut_streams=options.cut_streams)
    else:
        averager = MultiRingAverager(node.routes, options.run, timeout=options.timeout, compression=compression,
                                     part_bytes=options.part_bytes, aggregation=options.aggregation)
    if options.alter_aggregate:
        if options.aggregation not in PER_COORDINATE:
            raise UserError(f"--alter-aggregate needs an --aggregation whose owners are checked: {', '.join(PER_COORDINATE)}")
        averager.ring_peer = dataclasses.replace(averager.ring_peer, attempt=functools.partial(
            AlteringRingAttempt, aggregate=ROBUST_AGGREGATES[options.aggregation], checked=True,
            alteration=options.alter_aggregate))
    if options.hostile_abort:
        averager.ring_peer = dataclasses.replace(
            averager.ring_peer, attempt=functools.partial(HostileAttempt, kind=options.hostile_abort))
    left_early = False  # its round left a ring before the ring completed (see the end)
    try:
        await averager.start()
        await publish_placement(node, options)
        deadline = time.monotonic() + options.plan_timeout
        if options.publish_plan:
            await publish_plan_when_placed(node, options.run, options.publish_plan, deadline)
        plan = await read_plan(node, options.run, deadline)
        me = node.peer_id.to_base58()
        every_ring = plan_rings(plan, options.layer_sizes)
        rings = rings_of(me, every_ring)
        averager.expect(every_ring, options.step)  # before the others reach the round: their notes count here
        await connect_members(node, options.run, rings)
        local = synthetic_range(options.seed, options.cluster, options.layer_sizes, options.layers)
        if options.poison:
            poison_(local, options.poison, averager.ring_peer.max_scale)
        print(f"plan adopted: {len(rings)} ring(s), elements {start}-{end}", flush=True)
        if options.bench_config:
            with open(options.bench_config) as f:
                config = json.load(f)
            if config.get("robust"):
                attacked = local.clone()
                if options.cluster == config["attacker"]:
                    poison_(attacked, "plausible", averager.ring_peer.max_scale)
                report = await run_robust_phases(node, averager, options, plan, local, start, config, attacked)
            else:
                report = await run_bench_phases(node, averager, options, plan, local, start, config)
            print(json.dumps(dict(peer_id=me, cluster=options.cluster, stage=options.stage, bench=report)), flush=True)
            return 0
        await asyncio.sleep(options.delay_start)
        print("round started", flush=True)
        result = await averager.average(options.step, local, start, rings)
        left_early = not result.ok
        await publish_placement(node, options, note=f"averaging {result.summary()}"[:200],
                                rejected=len(result.rejected))
        if options.out:
            from safetensors.torch import save_file

            save_file({"values": local.contiguous()}, options.out, metadata={"start": str(start), "end": str(end)})
        print(json.dumps(dict(peer_id=me, cluster=options.cluster, stage=options.stage, start=start, end=end,
                              reachability=node.routes.reachability, routes=dict(node.routes.counts),
                              **result.as_dict())), flush=True)
        return 0
    finally:
        # a peer that ends its round before the others (a hostile one whose own attempt completed, while the
        # others refuse it and go on without it) stays until they stop writing to it: gone, it could not answer
        # that its round is over, and a member still sending to it would fail the ring on a dial that never
        # succeeds (CI saw this on a loaded machine, where the averager's own half-second quiet was too short).
        # One that left a ring before it completed waits longer: the others' attempts may still reach it after
        # 3 s of quiet on a loaded machine (CI saw the NaN test's honest member dial its gone poisoner until the
        # ring timed out); a volunteer stays, to answer that its round is over
        await averager.shutdown(quiet_for=LEFT_EARLY_QUIET if left_early else PEERS_DONE_QUIET,
                                at_most=max(PEERS_DONE_AT_MOST, options.timeout) if left_early else PEERS_DONE_AT_MOST)
        await stop_node(node)
