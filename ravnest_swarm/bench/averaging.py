"""``ravnest-swarm bench averaging``: multi-ring all-reduce beside hivemind and a single ring, in one run.

Real peer processes (``averaging-peer --bench-config``), one per stage, each in its own host of a
:class:`~ravnest_swarm.bench.netlab.NetLab` (tbf rate limit on every access link, userspace delay relay), plus
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

With ``--robust KIND`` the phases are instead the plain mean and the robust aggregate KIND on the same rings,
first on honest values, then with the last cluster's peers attacking: every value they contribute scaled so
its largest magnitude is just under the scale check (``averaging_peer.poison_``, ``plausible``). Each peer
reports how far its result lies from the exact mean of the unscaled values.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Dict, List, Optional

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from ravnest_swarm.averaging.robust import AGGREGATIONS, MEAN
from ravnest_swarm.averaging.segments import build_rings, element_range, ring_bytes_per_peer
from ravnest_swarm.bench.averaging_peer import AveragingPeerOptions, run_averaging_peer_process
from ravnest_swarm.bench.averaging_phases import ROBUST_PHASES
from ravnest_swarm.bench.synthetic import codec_by_name, compression_by_name
from ravnest_swarm.membership.backbone import BackboneOptions, run_backbone_process
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
                    compression: str = "none", timeout: float = 300.0, robust: Optional[str] = None) -> int:
    from ravnest_swarm.bench.netlab import NetLab
    from ravnest_swarm.processes import ProcessGroup

    if clusters < 2:
        raise UserError("--clusters must be at least 2 (averaging needs two copies)")
    if robust is not None and robust not in set(AGGREGATIONS) - {MEAN}:
        raise UserError(f"--robust must be one of {', '.join(a for a in AGGREGATIONS if a != MEAN)}, not {robust!r}")
    codec_by_name(compression)  # here, not as each of the peers it starts exits on it
    if robust is None:
        compression_by_name(compression)  # the hivemind phase's
    phases = ROBUST_PHASES if robust else PHASES
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
            backbone = group.start_library(run_backbone_process, BackboneOptions(
                host_maddrs=[lab.host_maddr(0)], announce_maddrs=[lab.announce_maddr(0)]), "backbone",
                lab_host=lab.lab_host(0))
            initial = next(m for m in backbone.maddrs(60) if m.startswith(lab.announce_maddr(0)))
            host = 1
            for k, cuts in enumerate(layouts):
                for s, (first, last) in enumerate(zip(cuts, cuts[1:])):
                    name = f"c{k}s{s}"
                    config = os.path.join(workdir, f"{name}.json")
                    with open(config, "w") as f:
                        json.dump(dict(dir=workdir, hivemind_host_maddr=lab.host_maddr(host, 1),
                                       hivemind_announce_maddr=lab.announce_maddr(host, 1), clusters=clusters,
                                       peers=clusters * stages, robust=robust, attacker=clusters - 1), f)
                    options = AveragingPeerOptions(
                        initial_peers=[initial], run="benchavg", cluster=k, stage=s, layer_sizes=list(sizes),
                        layers=(first, last), timeout=timeout, compression=compression, bench_config=config,
                        host_maddrs=[lab.host_maddr(host)], announce_maddrs=[lab.announce_maddr(host)],
                        plan_timeout=120.0, publish_plan=0 if peers else clusters * stages)
                    peers[name] = group.start_library(run_averaging_peer_process, options, name,
                                                      lab_host=lab.lab_host(host))
                    host += 1
            times = {}
            for phase in phases:
                for peer in peers.values():
                    peer.wait_for_output(f"^ready {phase}$", 300)
                    if phase == phases[0]:
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
                peer.wait(60)  # its result line comes after its last "done": read it once the peer exited
            results = [json.loads(peer.stdout().strip().splitlines()[-1]) for peer in peers.values()]
        except (RuntimeError, TimeoutError) as e:
            raise UserError(f"a bench peer failed ({e}); logs in {workdir}", exit_code=1)
        finally:
            group.stop_all()
    if robust:
        report = robust_report(robust, times, results, clusters)
        report.update(clusters=clusters, stages=stages, size_mb=size_mb, largest_peer_bytes=largest, layer_cuts=layouts,
                      compression=compression, network=lab.describe(), cpu_count=os.cpu_count(),
                      load_avg=[round(x, 2) for x in os.getloadavg()], peer_results=len(results))
        shown = [key for key in report if key.endswith(("_s", "_deviation", "_spread"))]
        return print_report(report, as_json, shown + ["robust_vs_mean", "rejected", "failed_segments"])
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
    return print_report(report, as_json, ["multiring_s", "hivemind_s", "single_ring_s", "bound_s", "ratio_vs_hivemind",
                                          "ratio_vs_bound", "max_abs_error", "failed_segments"])


def robust_report(robust: str, times: Dict[str, dict], results: List[dict], clusters: int) -> dict:
    """Each phase's time (the last peer's end), and the largest deviation from the exact mean among the honest
    peers (the attacker's own values are its business), beside how far honest values lie from that mean."""
    honest = [r["bench"] for r in results if r["cluster"] != clusters - 1]
    report = dict(robust=robust, attacked_share=f"1/{clusters}")
    for phase in ROBUST_PHASES:
        report[f"{phase}_s"] = round(times[phase]["seconds"], 3)
    report["robust_vs_mean"] = round(times["robust"]["seconds"] / times["mean"]["seconds"], 3)
    for phase in ROBUST_PHASES:
        report[f"{phase}_deviation"] = max(peer[phase]["max_abs_deviation"] for peer in honest)
    report["honest_spread"] = max(peer["spread"] for peer in honest)
    report["rejected"] = sum(p.get("rejected", 0) for phase in ROBUST_PHASES for p in times[phase]["peers"])
    report["failed_segments"] = sorted({i for phase in ROBUST_PHASES for p in times[phase]["peers"]
                                        for i in p.get("failed_segments", [])})
    return report


def print_report(report: dict, as_json: bool, shown: List[str]) -> int:
    if as_json:
        print(json.dumps(report), flush=True)
    else:
        console = Console(stderr=True)
        for key in shown:
            console.print(f"{key:>20}: {report[key]}")
    return 0


# ---- the peer side: run inside ``averaging-peer --bench-config`` -------------------------------------------

def signal_peers(directory: str, name: str, at: float) -> None:
    """Tell every peer to go on at ``at`` (a file they poll for, written whole)."""
    with open(os.path.join(directory, f"{name}.tmp"), "w") as f:
        f.write(json.dumps({"time": at}))
    os.rename(os.path.join(directory, f"{name}.tmp"), os.path.join(directory, name))
