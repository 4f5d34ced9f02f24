"""``bench neighbours``: what a trainer reads to find its stage neighbours and its ring partners, in the layout
before issue #20 and in today's, side by side in one DHT.

Before: every peer record under one ``{run}_peers`` key and every stage endpoint under one ``{run}_stages`` key;
a trainer read each whole. Now: peer records in buckets with a summary (``membership/buckets.py``), a trainer
reading its partners' buckets at the bucket counts its announcer knows (``reader.read_peers(peer_ids=...,
bucket_counts=...)``, one key in a run of one bucket), and endpoints under
``{run}_stages_{cluster mod 64}`` (``pipeline.endpoints.read_endpoints``). The same records are written in both
layouts, under two run names, onto a backbone and ``nodes`` DHT nodes on 127.0.0.1; then the reads of both
layouts alternate, each for a random cluster and three random ring partners (the same stage in other clusters),
so load and noise fall on both alike. Every process it starts is stopped by pid.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from typing import Dict, List

from rich.console import Console
from rich.progress import Progress

from ravnest_swarm.bench.records import STAGES, peer_id_of, write_run_records, write_stage_endpoints
from ravnest_swarm.membership.backbone import BackboneOptions, run_backbone_process
from ravnest_swarm.membership.reader import read_peers
from ravnest_swarm.membership.records import RunSchemaValidator, make_validators, peers_key, stages_key
from ravnest_swarm.net.node import parse_maddrs, start_node, stop_node
from ravnest_swarm.pipeline.endpoints import read_endpoints
from ravnest_swarm.processes import ProcessGroup

BEFORE, NOW = "before", "now"
PARTNERS = 3


def _figures(seconds: List[float]) -> Dict:
    ordered = sorted(seconds)
    return {"median_ms": round(1000 * statistics.median(ordered), 1),
            "p95_ms": round(1000 * ordered[int(0.95 * (len(ordered) - 1))], 1), "reads": len(ordered)}


async def _timed(reads: Dict[str, List[float]], name: str, read) -> None:
    began = time.perf_counter()
    found = await read
    if not found:
        raise RuntimeError(f"the {name} read found nothing")
    reads[name].append(time.perf_counter() - began)


async def bench_neighbours(peers: int, nodes: int, reads: int, as_json: bool, seed: int = 0) -> int:
    console = Console(stderr=True)
    rng = random.Random(seed)
    group, dht_nodes, reader = ProcessGroup(), [], None
    clusters = max(1, peers // STAGES)
    took = {name: [] for name in ("endpoints_before", "endpoints_now", "partners_before", "partners_now")}
    try:
        backbone = group.start_library(run_backbone_process,
                                       BackboneOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"], runs=[NOW]), "backbone")
        maddr = backbone.maddrs(60)[0]
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task(f"{nodes} DHT nodes, {peers} records in both layouts", total=None)
            for _ in range(nodes):
                dht_nodes.append(await start_node(parse_maddrs([maddr]), record_validators=make_validators(NOW),
                                                  host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
            buckets = await write_run_records(maddr, NOW, peers)
            await write_run_records(maddr, BEFORE, peers, buckets=1)
            await write_stage_endpoints(maddr, clusters, lambda cluster: stages_key(NOW, cluster))
            await write_stage_endpoints(maddr, clusters, lambda cluster: f"{BEFORE}_stages")
            reader = await start_node(parse_maddrs([maddr]), record_validators=[*make_validators(NOW),
                                                                                RunSchemaValidator(BEFORE)],
                                      host_maddrs=["/ip4/127.0.0.1/tcp/0"], client_mode=True)
            progress.update(task, visible=False)
            task = progress.add_task("reads, both layouts in turn", total=reads)
            for _ in range(reads):
                cluster, stage = rng.randrange(clusters), rng.randrange(STAGES)
                others = [c for c in range(clusters) if c != cluster] or [cluster]
                partners = [peer_id_of(c, stage) for c in rng.sample(others, min(PARTNERS, len(others)))]
                await _timed(took, "endpoints_before", reader.get(f"{BEFORE}_stages", latest=True))
                await _timed(took, "endpoints_now", read_endpoints(reader, NOW, cluster))
                await _timed(took, "partners_before", reader.get(peers_key(BEFORE), latest=True))
                await _timed(took, "partners_now", read_peers(reader, NOW, peer_ids=partners,
                                                                        bucket_counts=[buckets]))
                progress.advance(task)
    finally:
        for node in ([reader] if reader is not None else []) + dht_nodes:
            await stop_node(node)
        group.stop_all()
    figures = {name: _figures(seconds) for name, seconds in took.items()}
    result = {"benchmark": "neighbours", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "peers": peers,
              "clusters": clusters, "buckets_now": buckets, "dht_nodes": nodes + 1, **figures,
              "endpoints_now_over_before": round(figures["endpoints_now"]["median_ms"]
                                                 / figures["endpoints_before"]["median_ms"], 2),
              "partners_now_over_before": round(figures["partners_now"]["median_ms"]
                                                / figures["partners_before"]["median_ms"], 2)}
    if as_json:
        print(json.dumps(result), flush=True)
    else:
        console.print_json(json.dumps(result))
    return 0
