"""The live dashboard: read the run's records every period and redraw, until asked to stop."""

from __future__ import annotations

import asyncio
import logging
from typing import Dict, Optional

from hivemind.dht.node import DHTNode
from rich.console import Console
from rich.live import Live

from ravnest_swarm.dashboard.state import SwarmState
from ravnest_swarm.dashboard.view import render
from ravnest_swarm.membership.announcer import read_peers
from ravnest_swarm.membership.records import plan_key

logger = logging.getLogger(__name__)


async def read_adopted_plan(node: DHTNode, run: str) -> Optional[Dict]:
    """The newest round of ``{run}_plan``, or None while no plan has been adopted."""
    found = await node.get(plan_key(run), latest=True)
    if found is None or not isinstance(found.value, dict) or not found.value:
        return None
    return found.value[max(found.value)].value


async def watch_swarm(node: DHTNode, run: str, stop: asyncio.Event, period: float, console: Console,
                      me: Optional[str] = None) -> SwarmState:
    """Redraw the dashboard of ``run`` every ``period`` seconds until ``stop`` is set; returns the last state.

    :param node: a DHT node that validates the run's records
    :param run: run name
    :param stop: set by a signal handler to end the view
    :param period: seconds between snapshots
    :param console: where to draw (its width and height are read at every redraw, so resizing works)
    :param me: the volunteer's own name, highlighted
    """
    state = SwarmState(run)
    with Live(console=console, auto_refresh=False, vertical_overflow="ellipsis") as view:
        while not stop.is_set():
            try:
                state.update(await read_peers(node, run), await read_adopted_plan(node, run))
            except Exception as e:  # one failed DHT read must not end the view; the next period retries
                logger.warning(f"reading the swarm's records failed: {e}")
            view.update(render(state, console.width, console.height, me), refresh=True)
            try:
                await asyncio.wait_for(stop.wait(), period)
            except asyncio.TimeoutError:
                pass
    return state
