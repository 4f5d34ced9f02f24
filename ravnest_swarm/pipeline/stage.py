"""The ``stage`` verb: one process serves one layer range of one cluster's pipeline, until the run finishes.

A stage is made of (docs/pipeline.md): ``config.py`` (what it does), ``worker.py`` (start to shutdown),
``scheduler.py`` (which microbatch next), ``compute.py`` (forward, backward, step), ``messaging.py``
(handlers and sends) on ``wire.py`` (schemas and framing), ``channel.py`` (long-lived streams) and
``endpoints.py`` (where each stage is). The names others use are importable from here.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from hivemind.dht.node import DHTNode

from ravnest_swarm.pipeline.config import MODES, SCHEDULES, StageConfig
from ravnest_swarm.pipeline.worker import StageWorker

__all__ = ["MODES", "SCHEDULES", "StageConfig", "StageProcessOptions", "StageWorker", "run_stage", "run_stage_process",
           "serve_stage"]


async def run_stage(config: StageConfig, node: DHTNode, stop: asyncio.Event, report_path: Optional[str] = None,
                    save_path: Optional[str] = None) -> Dict:
    """Serve one stage until the run finishes (or ``stop``); write the report and weights if asked."""
    worker = StageWorker(config, node)
    worker.print_progress = True
    await worker.start()
    worker.busy.wall_time.count(True)  # a stage process is placed from its start: its report says where its time went
    print(f"stage {config.stage} of cluster {config.cluster} serving layers {config.layers[0]}:{config.layers[1]} "
          f"as {node.peer_id}", flush=True)
    waiters = [asyncio.create_task(worker.finished.wait()), asyncio.create_task(stop.wait())]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for waiter in waiters:
        waiter.cancel()
    await worker.shutdown()
    report = worker.report()
    if report_path:
        with open(report_path, "w") as f:
            json.dump(report, f)
    if save_path:
        worker.save(save_path)
    print(f"stage {config.stage} finished: " + json.dumps(worker.status()), flush=True)
    return report


async def serve_stage(config: StageConfig, initial_peers, host_maddrs, announce_maddrs, timeout: float,
                      report_path: Optional[str], save_path: Optional[str], identity_path: Optional[str] = None) -> int:
    """The ``stage`` verb: one torch thread, a DHT node with the run's validators, then :func:`run_stage`.
    ``identity_path``: a private key file, so the stage's peer id is known before it starts (its neighbours
    name it)."""
    from ravnest_swarm.lifecycle import install_stop_signals
    from ravnest_swarm.membership.records import start_peer_node
    from ravnest_swarm.net.node import stop_node

    # stages share a volunteer's cores with p2pd and their neighbours; one thread each keeps timings honest
    torch.set_num_threads(1)
    stop = install_stop_signals()
    # our endpoint names our peer id: signed by our identity's key
    node = await start_peer_node(initial_peers, config.run, identity_path=identity_path, host_maddrs=host_maddrs,
                                 announce_maddrs=announce_maddrs, timeout=timeout)
    try:
        await run_stage(config, node, stop, report_path, save_path)
    finally:
        await stop_node(node)
    return 0


@dataclass
class StageProcessOptions:
    """A ``stage`` process: what the stage does, and where its node listens and reports; ``identity``: its
    private key file (its peer id, which the neighbours named in ``config.neighbours`` name in turn)."""

    config: StageConfig
    initial_peers: List[str]
    host_maddrs: List[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    announce_maddrs: Optional[List[str]] = None
    timeout: float = 15.0
    report: Optional[str] = None
    save: Optional[str] = None
    identity: Optional[str] = None


def run_stage_process(options: StageProcessOptions) -> int:
    """A stage as a process started from its options (``ProcessGroup.start_library``); returns its exit code."""
    from ravnest_swarm.lifecycle import configure_logging, run_async
    from ravnest_swarm.net.node import parse_maddrs

    configure_logging(False)
    return run_async(serve_stage(options.config, parse_maddrs(options.initial_peers), options.host_maddrs,
                                 options.announce_maddrs, options.timeout, options.report, options.save,
                                 options.identity))
