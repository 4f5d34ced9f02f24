"""``doctor``: a volunteer's preflight. Each check prints one line; the last line is the verdict."""

from __future__ import annotations

import asyncio
from typing import List, Sequence

from hivemind.p2p import P2P, P2PDaemonError
from hivemind.utils.multiaddr import Multiaddr
from rich.console import Console

from ravnest_swarm.errors import UserError
from ravnest_swarm.membership.capabilities import measure_gflops, measure_ram_gb
from ravnest_swarm.membership.services import check_reachability, failure_reason, measure_bandwidth, ping, retried
from ravnest_swarm.net.node import peer_id_of, start_node, stop_node


async def run_doctor(initial_peers: Sequence[Multiaddr], timeout: float, console: Console) -> int:
    """Check p2pd, each initial peer, reachability and capabilities; return 0 if this machine can join."""
    problems: List[str] = []

    def report(ok: bool, what: str, detail: str) -> None:
        mark = "[green]ok  [/]" if ok else "[red]FAIL[/]"
        console.print(f"{mark} {what}: {detail}", highlight=False, soft_wrap=True)

    try:
        p2p = await P2P.create(startup_timeout=timeout)
        await p2p.shutdown()
        report(True, "p2pd", "starts")
    except P2PDaemonError as e:
        report(False, "p2pd", str(e))
        console.print("verdict: cannot join (p2pd does not start; reinstall hivemind)")
        return 1

    try:
        node = await start_node(initial_peers, client_mode=True, timeout=timeout)
    except UserError as e:
        report(False, "initial peers", str(e))
        console.print("verdict: cannot join (no initial peer answers)")
        return 1
    try:
        answering = []
        for maddr in initial_peers:
            try:
                rtt = await ping(node.p2p, peer_id_of(maddr), timeout)
                answering.append(maddr)
                report(True, f"initial peer {maddr}", f"answers, round trip {rtt * 1000:.1f} ms")
            except Exception as e:
                problems.append(f"{maddr} does not answer")
                report(False, f"initial peer {maddr}", f"no answer within {timeout:.0f}s ({type(e).__name__})")
        if not answering:
            console.print("verdict: cannot join (no initial peer answers)")
            return 1
        backbone = peer_id_of(answering[0])
        try:
            reachability = await retried(lambda: check_reachability(node.routes, backbone, timeout))
        except Exception as e:
            problems.append("reachability unknown")
            report(False, "reachability", f"the backbone's dial-back check failed ({failure_reason(e, timeout)})")
        else:
            if reachability == "direct":
                relay_note = "others can dial this peer; no relay is used"
            else:
                # the relay is the backbone this peer stays connected to: see reversal.py for both paths
                relay_note = (f"a backbone could not dial this peer back; relay: backbone {backbone} at "
                              f"{answering[0]} (through it this peer is asked to dial senders that can be dialled; "
                              f"a sender behind NAT too has its streams forwarded by it)")
            report(True, "reachability", f"{reachability} ({relay_note})")
        ram = measure_ram_gb()
        gflops = await asyncio.get_running_loop().run_in_executor(None, measure_gflops)
        try:
            mbps = await retried(lambda: measure_bandwidth(node.p2p, backbone, 4 * 2**20, timeout))
            bandwidth = f"{mbps:.0f} Mbit/s to the backbone"
        except Exception as e:
            problems.append("bandwidth not measured")
            bandwidth = f"bandwidth not measured: the probe to the backbone failed ({failure_reason(e, timeout)})"
        report(True, "capabilities", f"{ram:.1f} GB RAM, {gflops:.1f} GFLOP/s, {bandwidth}")
    finally:
        await stop_node(node)
    if problems:
        console.print(f"verdict: can join ({'; '.join(problems)})")
    else:
        console.print("verdict: can join")
    return 0
