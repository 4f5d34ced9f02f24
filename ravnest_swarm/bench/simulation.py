"""Membership at scale, simulated (issue #20, item 4): the real heartbeat, record and view code of N peers against a
simulated DHT (``bench/simulated_dht.py``: latency, loss, replicas, hops) on virtual time (``bench/virtual_time.py``).

Each simulated peer is a real :class:`~ravnest_swarm.membership.announcer.PeerAnnouncer` (its ``publish``,
``refresh_view`` and ``heartbeat_forever``, so :class:`PeerView`, the buckets, the summary and ``timing_for`` are
the production code), given the simulated DHT as its node and store function and the virtual clock as its clock.
Records are the real ``PeerRecord`` dicts (validated by the schema in every ``publish``); their sizes on the wire are
msgpack's plus a real RSA subkey and signature.

A run, in heartbeats ``H`` (``timing_for(N, --heartbeat)``): N peers start at random times over the first H; the
views settle until 3 H (5 H from a cold start), and at least 30 s after the last start; the steady state is
measured for ``--seconds`` (default 3 H); then ``--churn-fraction`` of the peers are killed (no ``leaving``: their
DHT nodes and what they stored vanish) and as many new ones start; the run ends when every view equals the live
set (or 8 H after the churn). A few figures are also taken over the heartbeat after the churn (``churn_*``: the
joiners' reads of the summary, their stores). A view "equals the live set" when its
members are exactly the live peers it should know: everyone while the run has at most ``FULL_VIEW_BUCKETS``
buckets, else the live peers of its own bucket. The swarm starts from what a running swarm of N leaves in the DHT
(every peer's record, renewed within the last heartbeat, and the buckets' summaries), so the steady state is that
of a swarm of N; ``cold_start`` starts it from nothing instead, as a new run whose N peers all start at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import statistics
from dataclasses import asdict, dataclass, replace
from typing import Callable, Dict, List, Optional, Tuple

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ravnest_swarm.bench.simulated_dht import (NetworkModel, SimulatedDHT, SimulatedNode,
                                               store_on_simulated_dht)
from ravnest_swarm.bench.virtual_time import run_virtual
from ravnest_swarm.errors import UserError
from ravnest_swarm.membership import announcer as announcer_module
from ravnest_swarm.membership.announcer import FULL_VIEW_BUCKETS, PeerAnnouncer
from ravnest_swarm.membership.buckets import bucket_count_for, bucket_of, summarize
from ravnest_swarm.membership.capabilities import Capabilities
from ravnest_swarm.membership.records import BucketSummary, PeerRecord, peers_key, summary_key, summary_subkey_prefix
from ravnest_swarm.membership.view import timing_for

RUN = "sim"
EPOCH = 1.8e9  # DHT time when a simulation starts (in 2027): valid record times, and runs that repeat exactly
# the steady state is measured from here (the last peer started before 1): a swarm started from nothing moves
# through bucket counts first
SETTLE_HEARTBEATS, COLD_SETTLE_HEARTBEATS = 3.0, 5.0
# and at least this long after the last start: a joiner's first view takes four lookups in a row (the summary, two
# publishes, the read), each of which may wait out a 3 s timeout
STARTUP_SECONDS = 30.0
CONVERGE_LIMIT_HEARTBEATS = 8.0  # after churn, give up waiting for the views after this many heartbeats
# the figures of the heartbeat after the churn: the joiners' first reads (the summary) and stores
CHURN_FIGURES = ("hottest_node_gets_s", "hottest_node_stores_s", "hottest_key", "hottest_key_rpcs_s",
                 "download_kb_per_peer_min", "backbone0_stores_s")
BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


@dataclass(frozen=True)
class SimulationConfig:
    peers: int
    heartbeat: float = 5.0  # the base heartbeat (``join --heartbeat``); timing_for slows it beyond 500 peers
    seconds: Optional[float] = None  # the steady-state window; None: 3 heartbeats
    churn_fraction: float = 0.1
    loss: float = 0.02
    latency_ms: float = 100.0
    seed: int = 0
    backbones: int = 1
    # start from nothing, as a new run does, instead of from what a running swarm of this size leaves
    cold_start: bool = False
    cache_nearest: int = 0  # as net/node.py sets it; 1 is hivemind's default


def signature_sizes() -> Tuple[int, int]:
    """Bytes of a real subkey (a writer's RSA public key, msgpack'd) and of the signature hivemind appends."""
    validator = RSASignatureValidator()
    subkey = MSGPackSerializer.dumps(validator.local_public_key)
    record = DHTRecord(b"key", subkey, b"value", EPOCH)
    return len(subkey), len(validator.sign_value(record)) - len(record.value)


class _Peer:
    def __init__(self, index: int, dht: SimulatedDHT, config: SimulationConfig, rng: random.Random,
                 clock: Callable[[], float]):
        self.load = dht.add_node()
        self.peer_id = "Qm" + "".join(rng.choice(BASE58) for _ in range(44))  # a libp2p id's length
        self.node = SimulatedNode(dht, self.load, self.peer_id)
        capabilities = Capabilities(ram_gb=16.0, gflops=150.0, bandwidth_mbps=100.0, reachability="direct",
                                    device="cpu", device_memory_gb=16.0)
        self.announcer = PeerAnnouncer(self.node, RUN, f"peer-{index:05d}", capabilities, config.heartbeat,
                                       store=store_on_simulated_dht, clock=clock)
        self.announcer.subkey = f"[owner:simulated-{index}]".encode()  # a writer's own key (sized as a real one)
        self.announcer.update(state="standby", maddrs=[f"/ip4/198.51.100.{index % 250}/tcp/31337/p2p/{self.peer_id}",
                                                       f"/ip6/2001:db8::{index:x}/tcp/31337/p2p/{self.peer_id}"])
        self.task: Optional[asyncio.Task] = None

    async def run(self) -> None:
        """What ``join`` does once its node is up (``membership/volunteer.py``)."""
        await self.announcer.find_bucket_count()
        await self.announcer.publish()
        await self.announcer.heartbeat_forever()


class Swarm:
    """The simulated peers, the live ones in ``live``, and the simulated DHT; run inside a virtual-time loop."""

    def __init__(self, config: SimulationConfig, sizes: Tuple[int, int]):
        self.config = config
        self.loop = asyncio.get_running_loop()
        self.rng = random.Random(config.seed)
        network = NetworkModel(latency=config.latency_ms / 1000.0, loss=config.loss,
                               cache_nearest=config.cache_nearest)
        self.dht = SimulatedDHT(network, self.rng, self.clock, *sizes)
        for _ in range(config.backbones):
            self.dht.add_node(backbone=True)
        self.timing = timing_for(config.peers, config.heartbeat)
        self.live: List[_Peer] = []
        self.started = 0

    def clock(self) -> float:
        return EPOCH + self.loop.time()

    def add_peer(self) -> _Peer:
        peer = _Peer(self.started, self.dht, self.config, self.rng, self.clock)
        self.started += 1
        self.live.append(peer)
        return peer

    def start(self, peer: _Peer) -> None:
        peer.task = self.loop.create_task(peer.run())

    def kill(self, peer: _Peer) -> None:
        peer.task.cancel()
        self.dht.kill_node(peer.load)
        self.live.remove(peer)

    def seed_running_swarm(self) -> None:
        """What a running swarm of this size leaves in the DHT: each peer's record, renewed some time within the
        last heartbeat, and each bucket's summary (the real ``summarize``). Placed, not stored: no RPC counted."""
        buckets, now = bucket_count_for(self.config.peers + 1), self.clock()
        members: Dict[int, List[_Peer]] = {}
        for peer in self.live:
            bucket = bucket_of(peer.peer_id, buckets)
            members.setdefault(bucket, []).append(peer)
            renewed = now - self.rng.uniform(0, self.timing.heartbeat)
            record = PeerRecord.parse_obj(dict(peer.announcer.record, time=renewed, peak_memory_gb=0.2,
                                               device_peak_gb=None)).dict()
            self.dht.place(peers_key(RUN, buckets, bucket), record, renewed + self.timing.lifetime,
                           peer.announcer.subkey)
        for bucket, peers in members.items():
            writer = min(peers, key=lambda peer: peer.peer_id)
            value = BucketSummary.parse_obj(summarize(buckets, bucket, [p.announcer.record for p in peers],
                                                      now, writer.peer_id)).dict()
            self.dht.place(summary_key(RUN), value, now + self.timing.lifetime,
                           summary_subkey_prefix(buckets, bucket) + writer.announcer.subkey)

    def expected(self) -> Callable[[_Peer], set]:
        """Who each live peer's view should hold: everyone, or its own bucket's live peers."""
        everyone = {peer.peer_id for peer in self.live}
        by_bucket: Dict[Tuple[int, int], set] = {}
        for count in {peer.announcer.buckets for peer in self.live if peer.announcer.buckets > FULL_VIEW_BUCKETS}:
            for peer in self.live:
                by_bucket.setdefault((count, bucket_of(peer.peer_id, count)), set()).add(peer.peer_id)

        def of(peer: _Peer) -> set:
            count = peer.announcer.buckets
            return everyone if count <= FULL_VIEW_BUCKETS else by_bucket[(count, bucket_of(peer.peer_id, count))]
        return of

    def converged(self) -> bool:
        expected = self.expected()
        return all({r["peer_id"] for r in peer.announcer.members()} == expected(peer) for peer in self.live)

    def completeness(self) -> Tuple[float, float, float]:
        """(the share of the peers it should know that the views hold, the smallest share any view holds, the share
        that views holding only their last read would hold)"""
        expected, held, should_total, worst, last_read = self.expected(), 0, 0, 1.0, 0
        for peer in self.live:
            should = expected(peer)
            found = len(should & {r["peer_id"] for r in peer.announcer.members()})
            held, should_total, worst = held + found, should_total + len(should), min(worst, found / len(should))
            last_read += len(should & peer.node.last_read)
        return held / should_total, worst, last_read / should_total

    def counters(self) -> Dict[int, Tuple[int, ...]]:
        return {node_id: (n.finds, n.stores, n.sent, n.received, n.served, n.taken)
                for node_id, n in self.dht.nodes.items()}


def _rates(swarm: Swarm, before: Dict, after: Dict, seconds: float, keys_before: Dict, gets_from: int,
           renewals_from: int) -> Dict:
    """Per-node RPC rates, per-peer bytes and the hottest key over a window."""
    backbone_ids = {node.node_id for node in swarm.dht.backbones}
    delta = {node_id: tuple(a - b for a, b in zip(after[node_id], before[node_id]))
             for node_id in before if node_id in after and swarm.dht.nodes[node_id].alive}
    volunteers = [d for node_id, d in delta.items() if node_id not in backbone_ids]
    finds = [d[0] / seconds for d in volunteers]
    stores = [d[1] / seconds for d in volunteers]
    upload = [(d[2] + d[4]) * 60 / seconds for d in volunteers]
    download = [(d[3] + d[5]) * 60 / seconds for d in volunteers]
    hottest = max(volunteers, key=lambda d: d[0] + d[1])
    keys = {key: (count - keys_before.get(key, 0)) / seconds for key, count in swarm.dht.rpcs_by_key.items()}
    hot_key = max(keys, key=keys.get)
    gets = sorted(swarm.dht.get_durations[gets_from:])
    gaps = sorted(swarm.dht.renewal_gaps[renewals_from:])
    result = dict(
        gets_per_node_s=round(statistics.mean(finds), 3), stores_per_node_s=round(statistics.mean(stores), 3),
        hottest_node_gets_s=round(hottest[0] / seconds, 3), hottest_node_stores_s=round(hottest[1] / seconds, 3),
        upload_kb_per_peer_min=round(statistics.mean(upload) / 1000, 1),
        download_kb_per_peer_min=round(statistics.mean(download) / 1000, 1),
        max_upload_kb_per_peer_min=round(max(upload) / 1000, 1),
        hottest_key=hot_key.removeprefix(RUN + "_"), hottest_key_rpcs_s=round(keys[hot_key], 2),
        get_latency_median_s=round(gets[len(gets) // 2], 3) if gets else None,
        get_latency_p95_s=round(gets[int(len(gets) * 0.95)], 3) if gets else None,
        renewal_gap_p95_s=round(gaps[int(len(gaps) * 0.95)], 2) if gaps else None,
        renewal_gap_max_s=round(gaps[-1], 2) if gaps else None)
    for index, node_id in enumerate(sorted(backbone_ids)):
        d = delta[node_id]
        result[f"backbone{index}_gets_s"] = round(d[0] / seconds, 3)
        result[f"backbone{index}_stores_s"] = round(d[1] / seconds, 3)
    return result


async def _simulate(config: SimulationConfig, sizes: Tuple[int, int],
                    on_progress: Callable[[float], None]) -> Dict:
    swarm = Swarm(config, sizes)
    loop, heartbeat = swarm.loop, swarm.timing.heartbeat
    settle = COLD_SETTLE_HEARTBEATS if config.cold_start else SETTLE_HEARTBEATS
    steady_from = max(settle * heartbeat, heartbeat + STARTUP_SECONDS)
    window = config.seconds if config.seconds is not None else 3 * heartbeat
    churn_at = steady_from + window
    total = churn_at + 4 * heartbeat  # for the progress bar: convergence usually takes about a lifetime

    async def until(t: float) -> None:
        await asyncio.sleep(max(0.0, t - loop.time()))
        on_progress(min(1.0, loop.time() / total))

    initial = [swarm.add_peer() for _ in range(config.peers)]
    if not config.cold_start:
        swarm.seed_running_swarm()
    starts = sorted(swarm.rng.uniform(0, heartbeat) for _ in initial)
    for peer, at in zip(initial, starts):
        loop.call_at(at, swarm.start, peer)
    last_start = starts[-1]

    initial_converge = None
    t = heartbeat
    while t < steady_from:  # how long after the last start until every view lists everyone
        await until(t)
        if swarm.converged():
            initial_converge = loop.time() - last_start
            break
        t += heartbeat / 10

    await until(steady_from)
    before, keys_before, gets_from = swarm.counters(), dict(swarm.dht.rpcs_by_key), len(swarm.dht.get_durations)
    renewals_from = len(swarm.dht.renewal_gaps)
    shares, worst, last_read_shares = [], 1.0, []
    t = steady_from
    while t < churn_at:
        await until(t)
        share, smallest, last_read = swarm.completeness()
        shares.append(share), last_read_shares.append(last_read)
        worst = min(worst, smallest)
        t += heartbeat / 2
    await until(churn_at)
    steady = _rates(swarm, before, swarm.counters(), window, keys_before, gets_from, renewals_from)

    killed = swarm.rng.sample(swarm.live, round(config.churn_fraction * len(swarm.live)))
    for peer in killed:
        swarm.kill(peer)
    for _ in killed:
        swarm.start(swarm.add_peer())
    before, keys_before, gets_from = swarm.counters(), dict(swarm.dht.rpcs_by_key), len(swarm.dht.get_durations)
    renewals_from = len(swarm.dht.renewal_gaps)
    churn_converge, churn = None, None
    t = churn_at
    while t <= churn_at + CONVERGE_LIMIT_HEARTBEATS * heartbeat:
        await until(t)
        if churn is None and loop.time() >= churn_at + heartbeat:
            churn = _rates(swarm, before, swarm.counters(), loop.time() - churn_at, keys_before, gets_from,
                           renewals_from)
        if swarm.converged():
            churn_converge = loop.time() - churn_at
            break
        t += heartbeat / 10
    if churn is None:
        churn = _rates(swarm, before, swarm.counters(), loop.time() - churn_at, keys_before, gets_from,
                       renewals_from)
    for peer in swarm.live:
        peer.task.cancel()
    await asyncio.gather(*(peer.task for peer in swarm.live), return_exceptions=True)
    on_progress(1.0)

    buckets = sorted({peer.announcer.buckets for peer in swarm.live})
    return dict(
        peers=config.peers, heartbeat_s=round(heartbeat, 2), lifetime_s=round(swarm.timing.lifetime, 2),
        buckets=buckets, initial_converge_s=None if initial_converge is None else round(initial_converge, 1),
        steady_seconds=round(window, 1), view_share=round(statistics.mean(shares), 4),
        worst_view_share=round(worst, 4), last_read_share=round(statistics.mean(last_read_shares), 4),
        **steady, killed=len(killed), **{f"churn_{name}": churn[name] for name in CHURN_FIGURES},
        churn_converge_s=None if churn_converge is None else round(churn_converge, 1),
        churn_converge_heartbeats=None if churn_converge is None else round(churn_converge / heartbeat, 2),
        simulated_s=round(loop.time(), 1))


def simulate(config: SimulationConfig, on_progress: Callable[[float], None] = lambda share: None,
             sizes: Optional[Tuple[int, int]] = None) -> Dict:
    """Run one simulation; its figures as a dict (see docs/benchmarks.md, "Membership at scale: simulation").

    :param on_progress: called with the share of the run done (virtual time)
    :param sizes: bytes of a subkey and of a signature (:func:`signature_sizes`), measured once per process
    """
    logger = logging.getLogger(announcer_module.__name__)
    level = logger.level
    # a simulated peer whose store was lost says so, as join would; thousands of peers would flood the terminal,
    # and the result counts what matters
    logger.setLevel(logging.ERROR)
    try:
        return run_virtual(_simulate(config, sizes or signature_sizes(), on_progress))
    finally:
        logger.setLevel(level)


def parse_peer_counts(values: List[str]) -> List[int]:
    """``--peers 100 --peers 1000`` or ``--peers 100,1000,10000``; a bad count is a one-line :class:`UserError`."""
    counts = []
    for text in (part.strip() for value in values for part in value.split(",")):
        if not text.isdigit() or not 2 <= int(text) <= 100_000:
            raise UserError(f"--peers takes whole numbers from 2 to 100000, separated by commas; got {text!r}")
        counts.append(int(text))
    return counts


def run_bench_simulate(counts: List[int], base: SimulationConfig, as_json: bool) -> int:
    """``bench simulate``: one simulation per peer count, a progress bar over virtual time, then a table or JSON."""
    sizes = signature_sizes()
    results = []
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  TimeElapsedColumn(), transient=as_json) as progress:
        for count in counts:
            task = progress.add_task(f"{count:,} peers (simulated time)", total=1.0)
            results.append(simulate(replace(base, peers=count),
                                    lambda share, task=task: progress.update(task, completed=share), sizes))
    if as_json:
        print(json.dumps(dict(bench="simulate", config={k: v for k, v in asdict(base).items() if k != "peers"},
                              results=results)))
        return 0
    table = Table(title=f"bench simulate: latency {base.latency_ms:g} ms, loss {base.loss:.0%}, base heartbeat "
                        f"{base.heartbeat:g} s, churn {base.churn_fraction:.0%}")
    rows = [("heartbeat / lifetime (s)", lambda r: f"{r['heartbeat_s']:g} / {r['lifetime_s']:g}"),
            ("bucket counts at the end", lambda r: ", ".join(map(str, r["buckets"]))),
            ("gets / stores per node per s, mean", lambda r: f"{r['gets_per_node_s']:.1f} / "
                                                            f"{r['stores_per_node_s']:.1f}"),
            ("gets / stores per s, hottest node", lambda r: f"{r['hottest_node_gets_s']:.1f} / "
                                                           f"{r['hottest_node_stores_s']:.1f}"),
            ("gets / stores per s, backbone", lambda r: f"{r['backbone0_gets_s']:.1f} / {r['backbone0_stores_s']:.1f}"),
            ("hottest key (RPCs per s)", lambda r: f"{r['hottest_key']} ({r['hottest_key_rpcs_s']:.0f})"),
            ("upload / download per peer (kB/min)", lambda r: f"{r['upload_kb_per_peer_min']:,.0f} / "
                                                             f"{r['download_kb_per_peer_min']:,.0f}"),
            ("get latency median / p95 (s)", lambda r: f"{r['get_latency_median_s']} / {r['get_latency_p95_s']}"),
            ("record renewed every, p95 / max (s)", lambda r: f"{r.get('renewal_gap_p95_s')} / "
                                                             f"{r.get('renewal_gap_max_s')}"),
            ("views: share held, worst view", lambda r: f"{r['view_share']:.2%}, {r['worst_view_share']:.0%}"),
            ("views complete after the last start (s)", lambda r: str(r["initial_converge_s"])),
            ("views equal the live set after churn (s)", lambda r: str(r["churn_converge_s"]))]
    table.add_column("figure")
    for result in results:
        table.add_column(f"{result['peers']:,} peers", justify="right")
    for name, shown in rows:
        table.add_row(name, *(shown(result) for result in results))
    Console().print(table)
    return 0
