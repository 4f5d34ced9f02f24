"""``ravnest-swarm status``: a DHT client that reads a run and shows it (a table, JSON, or the live dashboard)."""

from __future__ import annotations

import json
from typing import List

from rich.console import Console

from ravnest_swarm.errors import UserError
from ravnest_swarm.lifecycle import install_stop_signals


async def show_status(initial_peers: List[str], run: str, as_json: bool, watch: bool, timeout: float) -> None:
    """Print the run's peers once (a table, or one JSON document), or watch it until Ctrl-C."""
    from ravnest_swarm.dashboard.peers_table import peers_table
    from ravnest_swarm.membership.progress import run_finished
    from ravnest_swarm.membership.reader import read_peers_settled
    from ravnest_swarm.membership.records import make_validators, parse_run_address
    from ravnest_swarm.net.node import parse_maddrs, start_node, stop_node
    from ravnest_swarm.swarm.join import watch_peers
    from ravnest_swarm.swarm.spec import read_spec

    address = parse_run_address(run)
    run = address.name
    node = await start_node(parse_maddrs(initial_peers), record_validators=make_validators(run, address.owner),
                            client_mode=True, timeout=timeout)
    try:
        try:
            spec = await read_spec(node, address)
        except UserError:
            spec = None  # a name that several owners signed specs for: the peers are shown, the run's length is not
        if watch:
            await watch_peers(node, run, install_stop_signals(), 2.0, live=True, console=Console(),
                              steps=spec.steps if spec else None)
            return
        peers = await read_peers_settled(node, run)
        finished = spec is not None and run_finished(peers, spec.steps)
        if as_json:
            print(json.dumps({"run": run, "steps": spec.steps if spec else None, "finished": finished,
                              "peers": peers}), flush=True)
            return
        if not peers:
            # an empty table looked like a healthy run, and a mistyped --run looks the same
            why = ("it was started (its spec is in the DHT) but every peer has left" if spec is not None
                   else "nobody has started it: check the name (it is case-sensitive) and the backbone")
            raise UserError(f"no peer of run {run} is live: {why}", exit_code=1)
        Console().print(peers_table(run, peers))
        if finished:
            Console().print(f"run {run} is finished: its stages reached step {spec.steps}, the run's length",
                            markup=False, highlight=False)
    finally:
        await stop_node(node)
