"""``bench backbone``: memory of a backbone beside a plain ``hivemind.DHT``, measured in one run.

Both serve the same volunteers: the volunteers join our backbone, and the plain DHT joins the
backbone too, so both sit in the same DHT. Memory is PSS (proportional set size: shared pages split
among the processes sharing them) summed over each process tree, p2pd included.
"""

from __future__ import annotations

import asyncio
import json
import time

import psutil
from rich.console import Console
from rich.progress import Progress

from ravnest_swarm.membership.backbone import BackboneOptions, run_backbone_process
from ravnest_swarm.processes import ProcessGroup
from ravnest_swarm.swarm.join import JoinOptions, run_join

PLAIN_DHT_SCRIPT = """
import sys, time, hivemind
dht = hivemind.DHT(initial_peers=[sys.argv[1]], host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
print("ready", flush=True)
time.sleep(3600)
"""


def tree_memory_mb(pid: int) -> dict:
    """PSS, USS and RSS of a process and all its descendants, in MB (2**20 bytes).

    PSS is the goal's measure; USS (pages no other process maps) and RSS (every mapped page, counted
    in full) bound it from below and above, since PSS depends on what else maps the same libraries.
    """
    root = psutil.Process(pid)
    totals = {"pss": 0, "uss": 0, "rss": 0}
    for process in [root] + root.children(recursive=True):
        try:
            info = process.memory_full_info()
        except psutil.Error:
            continue  # a child that exited between listing and reading holds no memory
        for field in totals:
            totals[field] += getattr(info, field)
    return {field: round(value / 2**20, 1) for field, value in totals.items()}


async def bench_backbone(settle_seconds: float, volunteers: int, as_json: bool) -> int:
    console = Console(stderr=True)
    group = ProcessGroup()
    try:
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("starting backbone, volunteers and a plain hivemind.DHT", total=3 + volunteers)
            backbone = group.start_library(run_backbone_process, BackboneOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]),
                                           "backbone")
            maddr = backbone.maddrs()[0]
            progress.advance(task)
            plain = group.start_python(PLAIN_DHT_SCRIPT, [maddr], "plain-dht")
            plain.wait_for_output("^ready$", 60)
            progress.advance(task)
            joined = []
            for index in range(volunteers):
                joined.append(group.start_library(run_join, JoinOptions(
                    initial_peers=[maddr], run="bench", name=f"v{index}", ram_gb=4.0, gflops=10.0,
                    bandwidth_mbps=100.0, dashboard=False, heartbeat=2.0), f"volunteer{index}"))
            for index, process in enumerate(joined):
                process.wait_for_output(rf"sees {volunteers} peer", 120, stream="stderr")
                progress.advance(task)
            progress.update(task, description=f"settling {settle_seconds:.0f}s")
            await asyncio.sleep(settle_seconds)
            progress.advance(task)
        backbone_memory, plain_memory = tree_memory_mb(backbone.pid), tree_memory_mb(plain.pid)
    finally:
        group.stop_all()
    backbone_mb, plain_mb = backbone_memory["pss"], plain_memory["pss"]
    result = {
        "benchmark": "backbone",
        "backbone_pss_mb": backbone_mb,
        "hivemind_dht_pss_mb": plain_mb,
        "backbone_uss_mb": backbone_memory["uss"],
        "backbone_rss_mb": backbone_memory["rss"],
        "hivemind_dht_uss_mb": plain_memory["uss"],
        "hivemind_dht_rss_mb": plain_memory["rss"],
        "ratio_backbone_to_hivemind": round(backbone_mb / plain_mb, 3),
        "goal_mb": 300,
        "meets_goal": backbone_mb <= 300,
        "volunteers": volunteers,
        "settle_seconds": settle_seconds,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if as_json:
        print(json.dumps(result), flush=True)
    else:
        console.print(f"backbone: {backbone_mb:.1f} MB PSS; plain hivemind.DHT: {plain_mb:.1f} MB PSS "
                      f"(ratio {result['ratio_backbone_to_hivemind']}); goal <= 300 MB", highlight=False)
    return 0
