"""``ravnest-swarm bench averaging``: multi-ring all-reduce beside hivemind and a single ring, in one run.

Real peer processes (``averaging-peer --bench-config``), one per stage, each in its own host of a
:class:`~ravnest_swarm.netlab.NetLab` (tbf rate limit on every access link, userspace delay relay), plus
a backbone host. Every cluster splits the same synthetic model at different layers (heterogeneous).
Three phases on the same peers, the same parameters and the same links, each started by a go-file at a
common wall-clock time once every peer says it is ready (all processes share this machine's clock):

* ``multiring``: :class:`MultiRingAverager` over the adopted plan's rings (step 1);
* ``hivemind``: hivemind's ``DecentralizedAverager`` on the same data with the fairest grouping it
  supports: averagers need equal tensors in a group, so there is one averager per segment (prefix
  ``{run}_seg{i}``, group size C), i.e. exactly the peers that hold the same parameters, as in the
  multi-ring. Groups are matched *before* the go time (``require_trigger``), so its time is the
  all-reduce alone, like ours (which also formed its rings beforehand, from the plan);
* ``single_ring``: one ring over the whole vector, held by the first-stage peer of each cluster (the
  classic data-parallel ring; the other peers idle).
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from typing import Dict, List

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from ravnest_swarm.averaging.segments import build_rings, element_range, ring_bytes_per_peer
from ravnest_swarm.errors import UserError

PHASES = ("multiring", "hivemind", "single_ring")
GO_LEAD_SECONDS = 1.0
POLL_SECONDS = 0.02


def bench_layout(clusters: int, stages: int, size_mb: float) -> tuple:
    """Layer sizes and each cluster's stage boundaries (layer indices), shifted per cluster.

    The model has ``8 x stages`` layers of slightly different sizes; cluster k cuts its stages up to
    three layers earlier or later than the even split, so the clusters' boundaries differ (as when
    their peers differ in RAM).
    """
    layers = 8 * stages
    total = int(size_mb * 2**20 / 4)
    weights = [1.0 + 0.25 * ((7 * j) % 5 - 2) / 2 for j in range(layers)]
    sizes = [max(1, int(total * w / sum(weights))) for w in weights]
    sizes[-1] += total - sum(sizes)
    layouts = []
    for k in range(clusters):
        shift = round(-3 + 6 * k / (clusters - 1))  # -3 .. +3 layers, so no two clusters cut alike
        layouts.append([0] + [8 * s + shift for s in range(1, stages)] + [layers])
    return sizes, layouts


def bound_seconds(sizes: List[int], layouts: List[List[int]], mbps: float) -> tuple:
    """2(C-1)/C x the largest bytes a peer holds / its link rate, and those bytes."""
    clusters = [[(f"{k}.{s}", *element_range(sizes, (lo, hi))) for s, (lo, hi) in enumerate(zip(cuts, cuts[1:]))]
                for k, cuts in enumerate(layouts)]
    held = ring_bytes_per_peer(build_rings(clusters, sum(sizes)))
    largest = max(held.values())
    count = len(layouts)
    return 2 * (count - 1) / count * largest * 8 / (mbps * 1e6), largest


def bench_averaging(clusters: int, stages: int, mbps: float, delay_ms: float, size_mb: float, as_json: bool,
                    compression: str = "none", timeout: float = 300.0) -> int:
    from ravnest_swarm.netlab import NetLab
    from ravnest_swarm.processes import ProcessGroup

    if clusters < 2:
        raise UserError("--clusters must be at least 2 (averaging needs two copies)")
    sizes, layouts = bench_layout(clusters, stages, size_mb)
    bound, largest = bound_seconds(sizes, layouts, mbps)
    console = Console(stderr=True)
    workdir = tempfile.mkdtemp(prefix="ravnest-bench-avg-")
    group = ProcessGroup(workdir)
    peers: Dict[str, object] = {}
    hosts = clusters * stages + 1
    with NetLab(hosts, mbps=mbps, delay_ms=delay_ms) as lab, Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(), console=console, transient=not as_json,
    ) as progress:
        if lab.mode == "loopback":
            console.print(f"[yellow]no network namespaces ({lab.loopback_reason}): running on loopback, links NOT "
                          f"rate-limited or delayed[/]")
        try:
            started = progress.add_task("starting peers", total=clusters * stages)
            backbone = group.start(["backbone", "--host-maddrs", lab.host_maddr(0),
                                    "--announce-maddrs", lab.announce_maddr(0)], "backbone", prefix=lab.exec_prefix(0))
            initial = next(m for m in backbone.maddrs(60) if m.startswith(lab.announce_maddr(0)))
            host = 1
            for k, cuts in enumerate(layouts):
                for s, (first, last) in enumerate(zip(cuts, cuts[1:])):
                    name = f"c{k}s{s}"
                    config = os.path.join(workdir, f"{name}.json")
                    with open(config, "w") as f:
                        json.dump(dict(dir=workdir, hivemind_host_maddr=lab.host_maddr(host, 1),
                                       hivemind_announce_maddr=lab.announce_maddr(host, 1), clusters=clusters,
                                       peers=clusters * stages), f)
                    args = ["averaging-peer", "--initial-peers", initial, "--run", "benchavg", "--cluster", str(k),
                            "--stage", str(s), "--layer-sizes", ",".join(map(str, sizes)), "--layers", f"{first},{last}",
                            "--timeout", str(timeout), "--compression", compression, "--bench-config", config,
                            "--host-maddrs", lab.host_maddr(host), "--announce-maddrs", lab.announce_maddr(host),
                            "--plan-timeout", "120"]
                    if not peers:
                        args += ["--publish-plan", str(clusters * stages)]
                    peers[name] = group.start(args, name, prefix=lab.exec_prefix(host))
                    host += 1
            times = {}
            for phase in PHASES:
                for peer in peers.values():
                    peer.wait_for_output(f"^ready {phase}$", 300)
                    if phase == PHASES[0]:
                        progress.advance(started)
                task = progress.add_task(phase, total=len(peers))
                go = time.time() + GO_LEAD_SECONDS
                signal_peers(workdir, f"go-{phase}", go)
                ends = []
                for peer in peers.values():
                    line = peer.wait_for_output(f"^done {phase} (.*)$", timeout + 120)
                    ends.append(json.loads(line.group(1)))
                    progress.advance(task)
                times[phase] = dict(seconds=max(e["end"] for e in ends) - go, peers=ends)
                signal_peers(workdir, f"over-{phase}", time.time())
            for peer in peers.values():
                peer.wait(60)  # its result line comes after "done single_ring": read it once the peer exited
            results = [json.loads(peer.stdout().strip().splitlines()[-1]) for peer in peers.values()]
        except (RuntimeError, TimeoutError) as e:
            raise UserError(f"a bench peer failed ({e}); logs in {workdir}", exit_code=1)
        finally:
            group.stop_all()
    multiring = times["multiring"]
    errors = [r["bench"]["multiring"]["max_abs_error"] for r in results]
    report = dict(
        multiring_s=round(multiring["seconds"], 3),
        hivemind_s=round(times["hivemind"]["seconds"], 3),
        single_ring_s=round(times["single_ring"]["seconds"], 3),
        bound_s=round(bound, 3),
        ratio_vs_hivemind=round(multiring["seconds"] / times["hivemind"]["seconds"], 3),
        ratio_vs_bound=round(multiring["seconds"] / bound, 3),
        max_abs_error=max(errors) if errors else None,
        failed_segments=sorted({i for p in multiring["peers"] for i in p.get("failed_segments", [])}),
        resends=sum(p.get("resends", 0) for p in multiring["peers"]),
        hivemind_ok=all(p.get("ok", False) for p in times["hivemind"]["peers"]),
        single_ring_ok=all(p.get("ok", True) for p in times["single_ring"]["peers"]),
        clusters=clusters, stages=stages, size_mb=size_mb, largest_peer_bytes=largest, layer_cuts=layouts,
        compression=compression, network=lab.describe(), cpu_count=os.cpu_count(),
        load_avg=[round(x, 2) for x in os.getloadavg()], peer_results=len(results),
    )
    if not as_json:
        for key in ("multiring_s", "hivemind_s", "single_ring_s", "bound_s", "ratio_vs_hivemind", "ratio_vs_bound",
                    "max_abs_error", "failed_segments"):
            console.print(f"{key:>20}: {report[key]}")
    else:
        print(json.dumps(report), flush=True)
    return 0


# ---- the peer side: run inside ``averaging-peer --bench-config`` -------------------------------------------

def signal_peers(directory: str, name: str, at: float) -> None:
    """Tell every peer to go on at ``at`` (a file they poll for, written whole)."""
    with open(os.path.join(directory, f"{name}.tmp"), "w") as f:
        f.write(json.dumps({"time": at}))
    os.rename(os.path.join(directory, f"{name}.tmp"), os.path.join(directory, name))


def wait_for_signal(directory: str, name: str) -> float:
    """Block until the bench writes the file ``name``, then until its time; return that time."""
    path = os.path.join(directory, name)
    while not os.path.exists(path):
        time.sleep(POLL_SECONDS)
    with open(path) as f:
        go = json.load(f)["time"]
    time.sleep(max(0.0, go - time.time()))
    return go


async def run_bench_phases(node, averager, options, plan: dict, local: torch.Tensor, start: int, config: dict) -> dict:
    """The three timed phases of one bench peer; prints ``ready``/``done`` lines the bench waits on.

    After its ``done`` line a peer waits until every peer is done (``over-{phase}``) before it does anything
    else, so no peer's checking, teardown or set-up of the next phase (hivemind's DHT process, forked from
    this one) runs on the shared cores while another peer is still in a timed phase.
    """
    from ravnest_swarm.averaging.peer import connect_members, plan_rings, single_ring_plan, synthetic_range
    from ravnest_swarm.averaging.segments import rings_of

    me = node.peer_id.to_base58()
    directory, report = config["dir"], {}
    exact = torch.stack([synthetic_range(options.seed, k, options.layer_sizes, options.layers).double()
                         for k in range(config["clusters"])]).mean(0)
    original = local.clone()

    rings = rings_of(me, plan_rings(plan, options.layer_sizes))
    print("ready multiring", flush=True)
    await asyncio.to_thread(wait_for_signal, directory, "go-multiring")
    result = await averager.average(1, local, start, rings)
    report["multiring"] = dict(end=time.time(), ok=result.ok, failed_segments=result.failed_segments(),
                               seconds=result.seconds, resends=result.resends)
    print(f"done multiring {json.dumps(report['multiring'])}", flush=True)
    await asyncio.to_thread(wait_for_signal, directory, "over-multiring")
    report["multiring"]["max_abs_error"] = (local.double() - exact).abs().max().item()

    report["hivemind"] = await _hivemind_phase(options, plan, original.clone(), start, config)

    single = rings_of(me, plan_rings(single_ring_plan(plan, options.layer_sizes), options.layer_sizes))
    whole = synthetic_range(options.seed, options.cluster, options.layer_sizes, (0, len(options.layer_sizes))) \
        if single else None
    await connect_members(node, options.run, single)
    print("ready single_ring", flush=True)
    await asyncio.to_thread(wait_for_signal, directory, "go-single_ring")
    if single:
        result = await averager.average(2, whole, 0, single)
        report["single_ring"] = dict(end=time.time(), ok=result.ok, seconds=result.seconds)
    else:
        report["single_ring"] = dict(end=time.time(), ok=True, idle=True)
    print(f"done single_ring {json.dumps(report['single_ring'])}", flush=True)
    await asyncio.to_thread(wait_for_signal, directory, "over-single_ring")
    return report


async def _hivemind_phase(options, plan: dict, local: torch.Tensor, start: int, config: dict) -> dict:
    """One ``DecentralizedAverager`` per segment we own, matched before the go time, triggered at it."""
    from hivemind.averaging import DecentralizedAverager
    from hivemind.averaging.control import AveragingStage
    from hivemind.dht import DHT
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    from ravnest_swarm.averaging.peer import compression_by_name, plan_rings

    # hivemind's DHT starts its own process and p2pd; created on the main thread (it installs signal handlers)
    dht = DHT(initial_peers=[str(m) for m in options.initial_peers], start=True,
              host_maddrs=[config["hivemind_host_maddr"]], announce_maddrs=[config["hivemind_announce_maddr"]])
    directory = config["dir"]
    path = os.path.join(directory, f"hivemind-c{options.cluster}s{options.stage}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(dict(peer_id=dht.peer_id.to_base58(), maddr=config["hivemind_announce_maddr"]), f)
    os.rename(path + ".tmp", path)  # others list this directory: they must never read a half-written file
    # p2pd's routing cannot resolve lab (non-public) addresses: dial every other hivemind peer first,
    # through a client of this DHT's daemon, which the averagers share
    p2p = await dht.replicate_p2p()
    deadline = time.monotonic() + 120
    while len([n for n in os.listdir(directory) if n.startswith("hivemind-") and n.endswith(".json")]) < config["peers"]:
        if time.monotonic() > deadline:
            raise UserError("not every bench peer started its hivemind DHT in time", exit_code=1)
        await asyncio.sleep(POLL_SECONDS)
    for name in os.listdir(directory):
        if name.startswith("hivemind-") and name.endswith(".json"):
            with open(os.path.join(directory, name)) as f:
                other = json.load(f)
            if other["peer_id"] != dht.peer_id.to_base58():
                await p2p._client.connect(PeerID.from_base58(other["peer_id"]), [Multiaddr(other["maddr"])])
    # our rings by our position in the plan: this DHT has an identity of its own
    me = _my_multiring_id(plan, options)
    rings = [ring for ring in plan_rings(plan, options.layer_sizes) if ring.members[options.cluster] == me]
    averagers = [
        DecentralizedAverager(
            [local[ring.start - start:ring.end - start].clone()], dht, start=True,
            prefix=f"{options.run}_seg{ring.index}", target_group_size=config["clusters"],
            min_group_size=config["clusters"], min_matchmaking_time=2.0, request_timeout=5.0,
            compression=compression_by_name(options.compression), allreduce_timeout=options.timeout,
        )
        for ring in rings
    ]
    controls = [averager.step(require_trigger=True, wait=False, timeout=options.timeout + 60) for averager in averagers]
    deadline = time.monotonic() + 120
    while not all(c.stage == AveragingStage.AWAITING_TRIGGER or c.done() for c in controls):
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(POLL_SECONDS)
    matched = all(c.stage == AveragingStage.AWAITING_TRIGGER for c in controls)
    print("ready hivemind", flush=True)
    await asyncio.to_thread(wait_for_signal, directory, "go-hivemind")

    def run() -> bool:
        for control in controls:
            control.allow_allreduce()
        ok = True
        for control in controls:
            try:
                ok = control.result() is not None and ok
            except Exception:
                ok = False
        return ok

    ok = await asyncio.to_thread(run) if matched else False
    report = dict(end=time.time(), ok=ok and matched, matched=matched, segments=len(controls))
    print(f"done hivemind {json.dumps(report)}", flush=True)
    await asyncio.to_thread(wait_for_signal, directory, "over-hivemind")
    for averager in averagers:
        averager.shutdown()
    await p2p.shutdown()
    dht.shutdown()
    return report


def _my_multiring_id(plan: dict, options) -> str:
    return next(stage["peer_id"] for stage in plan["clusters"][options.cluster]
                if list(stage["layers"]) == list(options.layers))
