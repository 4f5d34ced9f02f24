"""``probe``: send a tensor to another peer of a run over the route a stage would use, and time the reply.

It resolves the peer's record (name or peer id) in ``{run}_peers``, connects the way the pipeline and
the averager do (:meth:`~ravnest_swarm.net.routes.Routes.connect`: direct, connection reversal or
forwarding through a backbone), streams ``bytes`` to the peer's ``ravnest.probe`` handler, and reports
the route, the bytes the peer counted, the rate, and the backbones' NAT-traversal counters afterwards.
``bench nat`` and the NAT lab tests run it inside network namespaces.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from ravnest_swarm.errors import UserError
from ravnest_swarm.lifecycle import configure_logging, run_async
from ravnest_swarm.membership.reader import read_peers
from ravnest_swarm.membership.records import make_validators, parse_run_address
from ravnest_swarm.membership.services import check_reachability, relay_stats, retried
from ravnest_swarm.net.routes import probe_peer
from ravnest_swarm.net.node import maddrs_without_peer_id, parse_maddrs, peer_id_of, start_node, stop_node


@dataclass
class ProbeOptions:
    """What ``ravnest-swarm probe`` was asked to do (its flags)."""

    initial_peers: List[str]
    run: str
    peer: str
    mb: float = 4.0
    timeout: float = 15.0
    host_maddrs: List[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce_maddrs: Optional[List[str]] = None
    verbose: bool = False


def run_probe_process(options: ProbeOptions) -> int:
    """A probe as a process: checks, one probe, its figures as one JSON line on stdout; returns the exit code."""
    configure_logging(options.verbose)

    async def main() -> int:
        run = parse_run_address(options.run).name  # a run's address works as well as its name
        parse_maddrs(options.host_maddrs, what="--host-maddrs", need_peer_id=False)
        result = await run_probe(parse_maddrs(options.initial_peers), run, options.peer,
                                 int(options.mb * 2**20), options.host_maddrs, options.announce_maddrs, options.timeout)
        print(json.dumps(result), flush=True)
        return 0

    return run_async(main())


async def run_probe(initial_peers: Sequence[Multiaddr], run: str, peer: str, total_bytes: int,
                    host_maddrs: Sequence[str], announce_maddrs: Optional[Sequence[str]], timeout: float,
                    record_timeout: float = 30.0) -> Dict:
    """Probe ``peer`` (a record's name or peer id) and return the figures as a dict."""
    node = await start_node(initial_peers, record_validators=make_validators(run), host_maddrs=host_maddrs,
                            announce_maddrs=announce_maddrs, timeout=timeout)
    try:
        backbones = [peer_id_of(m) for m in initial_peers]
        # our own verdict decides whether a NATed target is asked to dial us or the backbone forwards
        reachability = "unknown"
        if backbones:  # a lost reply is tried again, as join's own check is (membership.services.retried)
            reachability = await retried(lambda: check_reachability(node.routes, backbones[0], timeout))
        deadline = time.monotonic() + record_timeout
        record = None
        while record is None:
            record = next((r for r in await read_peers(node, run) if peer in (r["name"], r["peer_id"])), None)
            if record is None:
                if time.monotonic() > deadline:
                    raise UserError(f"no peer {peer!r} in run {run!r} within {record_timeout:.0f}s", exit_code=1)
                await asyncio.sleep(0.5)
        peer_id = PeerID.from_base58(record["peer_id"])
        maddrs = maddrs_without_peer_id(record["maddrs"], peer_id)
        links = node.routes
        started = time.perf_counter()
        route = await links.connect(peer_id, maddrs, record.get("reachability"))
        connect_seconds = time.perf_counter() - started
        # a reply p2pd lost on the way costs a try, not the probe (CI once lost one through a NAT lab's reversal)
        received, seconds = await retried(lambda: probe_peer(node.routes, peer_id, total_bytes,
                                                             timeout=max(timeout, 120.0)))
        return dict(peer=record["name"], peer_id=record["peer_id"], peer_reachability=record["reachability"],
                    our_reachability=reachability, route=route, connect_seconds=round(connect_seconds, 4),
                    bytes=received, seconds=round(seconds, 4), mbytes_per_s=round(received / 2**20 / seconds, 1),
                    backbones={str(b): await retried(lambda b=b: relay_stats(node.p2p, b, timeout)) for b in backbones})
    finally:
        await stop_node(node)
