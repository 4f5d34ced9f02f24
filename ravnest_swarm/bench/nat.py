"""``bench nat``: the same tensor over the three paths to a peer, in the NAT lab (:mod:`ravnest_swarm.bench.natlab`).

A backbone and a public volunteer on the public segment, a volunteer behind NAT, and a prober that runs
``ravnest-swarm probe`` three ways: from the public side to the public volunteer (direct), from the
public side to the NATed volunteer (connection reversal), and from behind a second NAT to the NATed
volunteer (forwarded by the backbone). Each figure is the time from the first byte sent to the
receiver's reply counting them all; every process is real and runs in its own namespace.
"""

from __future__ import annotations

import json
import time
from typing import Dict, List, Optional

from ravnest_swarm.processes import ProcessGroup
from ravnest_swarm.membership.backbone import BackboneOptions, run_backbone_process
from ravnest_swarm.membership.probe import ProbeOptions, run_probe_process
from ravnest_swarm.swarm.join import JoinOptions, run_join

RUN = "natbench"


def bench_nat(size_mb: float, repeats: int, mbps: Optional[float], as_json: bool) -> int:
    from ravnest_swarm.bench.natlab import NatLab

    group = ProcessGroup()
    results: Dict[str, List[dict]] = {"direct": [], "reversed": [], "forward": []}
    try:
        with NatLab(public=3, homes=2, mbps=mbps) as lab:
            backbone = group.start_library(run_backbone_process, BackboneOptions(host_maddrs=[lab.public_maddr(0)]),
                                           "backbone", lab_host=lab.public_host(0)).maddrs()[0]
            volunteers = (("public", lab.public_maddr(2), lab.public_host(2)),
                          ("home", lab.home_maddr(0), lab.home_host(0)))
            for name, maddr, host in volunteers:
                group.start_library(run_join, JoinOptions(
                    initial_peers=[backbone], run=RUN, name=name, host_maddrs=[maddr], model_gb=1.0, min_peers=50,
                    dashboard=False, ram_gb=4.0, gflops=10.0, bandwidth_mbps=100.0), name, lab_host=host)
            paths = (("direct", "public", lab.public_maddr(1), lab.public_host(1)),
                     ("reversed", "home", lab.public_maddr(1), lab.public_host(1)),
                     ("forward", "home", lab.home_maddr(1), lab.home_host(1)))
            for repeat in range(repeats):
                for path, target, maddr, host in paths:
                    # a fresh prober each time: the route is chosen from scratch, as by a new neighbour
                    probe = group.start_library(run_probe_process, ProbeOptions(
                        initial_peers=[backbone], run=RUN, peer=target, mb=size_mb, host_maddrs=[maddr], timeout=30.0),
                        f"probe-{path}-{repeat}", lab_host=host)
                    if probe.wait(240) != 0:
                        raise RuntimeError(f"probe over {path} failed: {probe.stderr()[-2000:]}")
                    result = json.loads(probe.stdout().strip().splitlines()[-1])
                    if result["route"] != path:
                        raise RuntimeError(f"expected the {path} path, the probe took {result['route']}")
                    results[path].append(result)
            report = dict(lab=lab.describe(), size_mib=size_mb, repeats=repeats, time=time.time(), paths={
                path: dict(mbytes_per_s=[r["mbytes_per_s"] for r in runs], seconds=[r["seconds"] for r in runs],
                           connect_seconds=[r["connect_seconds"] for r in runs])
                for path, runs in results.items()})
            report["backbone_relay_counters"] = results["forward"][-1]["backbones"]
    finally:
        group.stop_all()
    if as_json:
        print(json.dumps(report), flush=True)
    else:
        for path, figures in report["paths"].items():
            print(f"{path:9s} {size_mb:g} MiB: {', '.join(f'{v:.1f}' for v in figures['mbytes_per_s'])} MiB/s; "
                  f"route set up in {', '.join(f'{1000 * v:.0f}' for v in figures['connect_seconds'])} ms")
    return 0
