"""``bench membership``: many real volunteers on one backbone, then churn; how fast views converge.

Reports, in one run:
* ``converge_s``: from the first volunteer's start until every volunteer's own view lists all of them
  (each volunteer logs ``sees N peer(s)`` whenever its view changes);
* ``get_latency_ms``: median and p95 of ``get({run}_peers, latest=True)`` from an observer node;
* ``backbone_pss_mb``: the backbone's process tree at full load;
* ``errors``: lines with ``error``/``Traceback`` in any process's stderr;
* churn: every ``churn_period`` seconds one volunteer is SIGKILLed and a fresh one joins, for
  ``churn_seconds``; then ``churn_converge_s`` is how long until the observer's view equals the set
  of live volunteers exactly (killed ones expired, new ones present).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import statistics
import time
from typing import Dict

from rich.console import Console
from rich.progress import Progress

from ravnest_swarm.errors import UserError
from ravnest_swarm.membership.reader import read_peers
from ravnest_swarm.bench.membership import tree_memory_mb
from ravnest_swarm.membership.backbone import BackboneOptions, run_backbone_process
from ravnest_swarm.membership.records import make_validators
from ravnest_swarm.swarm.join import JoinOptions, run_join
from ravnest_swarm.processes import PeerProcess, ProcessGroup
from ravnest_swarm.net.node import parse_maddrs, start_node, stop_node

RUN = "load"
ERROR_RE = re.compile(r"^(error:|Traceback)", re.MULTILINE)


def _join_options(maddr: str, name: str, heartbeat: float) -> JoinOptions:
    return JoinOptions(initial_peers=[maddr], run=RUN, name=name, ram_gb=4.0, gflops=10.0, bandwidth_mbps=100.0,
                       heartbeat=heartbeat, dashboard=False, host_maddrs=["/ip4/127.0.0.1/tcp/0"])


def _sees_all(process: PeerProcess, count: int) -> bool:
    return re.search(rf"sees {count} peer\(s\)", process.stderr()) is not None


def _view_sizes(processes, count: int) -> str:
    """How far the views got: ``"20 of 24 have seen all 24; the others at most 21, 23, 23, 23"``."""
    best = []
    for process in processes:
        best.append(max(map(int, re.findall(r"sees (\d+) peer\(s\)", process.stderr())), default=0))
    behind = sorted(size for size in best if size < count)
    return (f"{len(best) - len(behind)} of {len(best)} have seen all {count}; "
            f"the others at most {', '.join(map(str, behind))}")


async def _observed_names(node) -> set:
    return {peer["name"] for peer in await read_peers(node, RUN) if peer["state"] != "leaving"}


async def bench_membership(peers: int, heartbeat: float, churn_seconds: float, churn_period: float,
                           as_json: bool, seed: int = 0) -> int:
    console = Console(stderr=True)
    rng = random.Random(seed)
    group = ProcessGroup()
    observer = None
    try:
        backbone = group.start_library(run_backbone_process, BackboneOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                                                             runs=[RUN]), "backbone")
        maddr = backbone.maddrs()[0]
        live: Dict[str, PeerProcess] = {}
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task(f"{peers} volunteers joining", total=peers)
            started = time.monotonic()
            for index in range(peers):
                name = f"v{index:02d}"
                live[name] = group.start_library(run_join, _join_options(maddr, name, heartbeat), name)
            while sum(_sees_all(p, peers) for p in live.values()) < peers:
                progress.update(task, completed=sum(_sees_all(p, peers) for p in live.values()))
                if time.monotonic() - started > 60 + 10 * peers:
                    raise UserError(f"views did not converge within {60 + 10 * peers} s: "
                                    f"{_view_sizes(live.values(), peers)} (logs in {group.log_dir})", 1)
                await asyncio.sleep(0.2)
            converge_s = time.monotonic() - started

        observer = await start_node(parse_maddrs([maddr]), record_validators=make_validators(RUN), client_mode=True)
        latencies = []
        for _ in range(50):
            began = time.perf_counter()
            await read_peers(observer, RUN)
            latencies.append((time.perf_counter() - began) * 1000)
        backbone_memory = tree_memory_mb(backbone.pid)

        kills = 0
        if churn_seconds > 0:
            with Progress(console=console, transient=True) as progress:
                task = progress.add_task("churn: kill one, start one", total=churn_seconds)
                churn_started = time.monotonic()
                while time.monotonic() - churn_started < churn_seconds:
                    victim = rng.choice(sorted(live))
                    live.pop(victim).kill_group()
                    kills += 1
                    name = f"c{kills:03d}"
                    live[name] = group.start_library(run_join, _join_options(maddr, name, heartbeat), name)
                    await asyncio.sleep(churn_period)
                    progress.update(task, completed=min(churn_seconds, time.monotonic() - churn_started))
            churn_stopped = time.monotonic()
            while await _observed_names(observer) != set(live):
                if time.monotonic() - churn_stopped > 120:
                    raise UserError(f"after churn the view never matched the {len(live)} live volunteers within 120 s "
                                    f"(logs in {group.log_dir})", 1)
                await asyncio.sleep(0.25)
            churn_converge_s = time.monotonic() - churn_stopped
        errors = sum(len(ERROR_RE.findall(p.stderr())) for p in group.processes)
    finally:
        if observer is not None:
            await stop_node(observer)
        group.stop_all()

    latencies.sort()
    result = {
        "benchmark": "membership",
        "peers": peers,
        "heartbeat_s": heartbeat,
        "converge_s": round(converge_s, 2),
        "get_latency_ms": {"median": round(statistics.median(latencies), 2),
                           "p95": round(latencies[int(0.95 * (len(latencies) - 1))], 2)},
        "backbone_pss_mb": backbone_memory["pss"],
        "errors": errors,
        "churn": {"seconds": churn_seconds, "period_s": churn_period, "kills": kills,
                  "converge_s": round(churn_converge_s, 2) if churn_seconds > 0 else None},
    }
    if as_json:
        print(json.dumps(result), flush=True)
    else:
        console.print_json(json.dumps(result))
    return 0
