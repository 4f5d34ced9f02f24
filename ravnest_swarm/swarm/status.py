"""``ravnest-swarm status``: a DHT client that reads a run and shows it (a table, JSON, or the live dashboard)."""

from __future__ import annotations

import asyncio
import json
from typing import List

from rich.console import Console

from ravnest_swarm.errors import UserError
from ravnest_swarm.lifecycle import install_stop_signals


async def show_status(initial_peers: List[str], run: str, as_json: bool, watch: bool, timeout: float,
                      show_all: bool = False) -> None:
    """Print the run's summary and peers once (a table of the peers that matter, every one with ``show_all``, or
    one JSON document), or watch it until Ctrl-C."""
    from ravnest_swarm.dashboard.peers_table import (SCREENFUL_ROWS, peers_that_matter, status_document, status_view,
                                                     use_table)
    from ravnest_swarm.membership.identity import refusals, refusals_line
    from ravnest_swarm.membership.progress import run_finished
    from ravnest_swarm.membership.records import make_validators, parse_run_address
    from ravnest_swarm.net.node import parse_maddrs, start_node, stop_node
    from ravnest_swarm.dashboard.live import watch_swarm

    if as_json and watch:  # the live view drew and --json was dropped: a script waiting for its document hung
        raise UserError("--json prints one document and exits, --watch draws until Ctrl-C: give one of them")
    from ravnest_swarm.swarm.observe import SnapshotReader, read_status
    from ravnest_swarm.swarm.spec import read_spec

    address = parse_run_address(run)
    run = address.name
    validators = make_validators(run, address.owner)
    node = await start_node(parse_maddrs(initial_peers), record_validators=validators,
                            client_mode=True, timeout=timeout, rpc_timeout=timeout)

    async def spec_or_none():
        try:
            return await read_spec(node, address)
        except UserError:
            return None  # a name that several owners signed specs for: the peers are shown, the run's length is not

    try:
        if watch:
            reader, spec = SnapshotReader(node, run), await spec_or_none()

            async def snapshot():
                nonlocal spec
                # the owner may publish it after we started, and change its length or end it while we watch
                spec = await spec_or_none() or spec
                return dict(await reader.snapshot(), steps=spec.steps if spec else None,
                            finished=bool(spec and spec.finished))

            await watch_swarm(snapshot, run, install_stop_signals(), 2.0, Console())
            return
        # every read at once: the spec, the summary and every bucket of peer records (twice: one read can miss some)
        spec, (summary, peers) = await asyncio.gather(spec_or_none(), read_status(node, run))
        # signed by the owner (update-spec --finish, or its peer at the end), or seen in the records of the peers
        finished = spec is not None and (spec.finished or run_finished(peers, spec.steps))
        refused = refusals(validators)
        if as_json:
            print(json.dumps(status_document(run, spec.steps if spec else None, finished, summary, peers, refused)),
                  flush=True)
            return
        # what a stranger tried is said, not dropped in silence: the table and totals below hold none of it
        ignored = (summary or {}).get("ignored_summaries", 0)
        notes = [refusals_line(refused)] if refused else []
        notes += [f"ignored {ignored} bucket summar{'ies' if ignored != 1 else 'y'} not written by a peer of the "
                  f"bucket summarized"] if ignored else []
        if notes:
            Console().print("; ".join(notes), markup=False, highlight=False)
        if not peers and finished:
            Console().print(f"run {run} is finished (its owner signed its end into its spec, version {spec.version}); "
                            f"every peer has left", markup=False, highlight=False)
            return
        if not peers:
            # an empty table looked like a healthy run, and a mistyped --run looks the same
            why = ("it was started (its spec is in the DHT) but every peer has left" if spec is not None
                   else "nobody has started it: check the name (it is case-sensitive) and the backbone")
            raise UserError(f"no peer of run {run} is live: {why}", exit_code=1)
        line, table = status_view(run, summary, peers, show_all)
        Console().print(line)
        Console().print(table)
        use = use_table(peers if show_all or len(peers) <= SCREENFUL_ROWS else peers_that_matter(peers, SCREENFUL_ROWS))
        if use is not None:
            Console().print(use)
        if finished:
            Console().print(f"run {run} is finished: " + ("its owner ended it" if spec.finished and not
                                                           run_finished(peers, spec.steps) else
                                                           f"its stages reached step {spec.steps}, the run's length"),
                            markup=False, highlight=False)
    finally:
        await stop_node(node)
