"""``bench backbone``: memory of a backbone beside a plain ``hivemind.DHT``, measured in one run.

Both serve the same volunteers: the volunteers join our backbone, and the plain DHT joins the
backbone too, so both sit in the same DHT. Memory is PSS (proportional set size: shared pages split
among the processes sharing them) summed over each process tree, p2pd included.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import psutil
from rich.console import Console
from rich.progress import Progress

from ravnest_swarm.processes import ProcessGroup

PLAIN_DHT_SCRIPT = """
import sys, time, hivemind
dht = hivemind.DHT(initial_peers=[sys.argv[1]], host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
print("ready", flush=True)
time.sleep(3600)
"""


def tree_pss_mb(pid: int) -> float:
    """PSS of a process and all its descendants, in MB (2**20 bytes)."""
    root = psutil.Process(pid)
    total = 0
    for process in [root] + root.children(recursive=True):
        try:
            total += process.memory_full_info().pss
        except psutil.Error:
            pass  # a child that exited between listing and reading holds no memory
    return total / 2**20


async def bench_backbone(settle_seconds: float, volunteers: int, as_json: bool) -> int:
    console = Console(stderr=True)
    group = ProcessGroup()
    try:
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("starting backbone, volunteers and a plain hivemind.DHT", total=3 + volunteers)
            backbone = group.start(["backbone", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], "backbone")
            maddr = backbone.maddrs()[0]
            progress.advance(task)
            plain = group.start_python(PLAIN_DHT_SCRIPT, [maddr], "plain-dht")
            plain.wait_for_output("^ready$", 60)
            progress.advance(task)
            joined = []
            for index in range(volunteers):
                joined.append(group.start(
                    ["join", "--initial-peers", maddr, "--run", "bench", "--name", f"v{index}", "--ram-gb", "4",
                     "--gflops", "10", "--bandwidth-mbps", "100", "--no-dashboard", "--heartbeat", "2"],
                    f"volunteer{index}"))
            for index, process in enumerate(joined):
                process.wait_for_output(rf"sees {volunteers} peer", 120, stream="stderr")
                progress.advance(task)
            progress.update(task, description=f"settling {settle_seconds:.0f}s")
            await asyncio.sleep(settle_seconds)
            progress.advance(task)
        backbone_mb, plain_mb = tree_pss_mb(backbone.pid), tree_pss_mb(plain.pid)
    finally:
        group.stop_all()
    result = {
        "benchmark": "backbone",
        "backbone_pss_mb": round(backbone_mb, 1),
        "hivemind_dht_pss_mb": round(plain_mb, 1),
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
