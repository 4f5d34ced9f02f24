"""The live dashboard: take a snapshot of the run every period and redraw, until asked to stop.

The snapshots come from the caller (``swarm.observe.SnapshotReader`` reads them from the DHT):
the dashboard draws plain records and never touches the network.

While a live view is up, log records must not be written to the terminal it redraws (each one would
scroll it or draw over it): :func:`logs_below` hands them to a :class:`LogPanel`, which the view draws
below the dashboard, a repeated warning as one line with a count.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import OrderedDict
from contextlib import contextmanager
from typing import Awaitable, Callable, Dict, Iterator, List, Optional, Tuple

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.rule import Rule
from rich.text import Text

from ravnest_swarm.dashboard.state import SwarmState
from ravnest_swarm.dashboard.view import render
from ravnest_swarm.membership.text import CONTROL_CHARACTER_RE

logger = logging.getLogger(__name__)


class LogPanel(logging.Handler):
    """Warnings and errors logged while a live view is up, drawn below it.

    A warning that repeats (same logger, same text but for its numbers: a stage retrying a send every
    half second) is one line with a count (``x12``) and its latest text and time, so a flood cannot push
    the dashboard off the screen; only the ``lines`` most recent kinds are drawn.

    :param lines: log lines drawn below the view
    :param kept: kinds of warnings remembered (oldest forgotten first)
    """

    def __init__(self, lines: int = 3, kept: int = 64):
        super().__init__(logging.WARNING)
        self.lines, self.kept = lines, kept
        self.entries: "OrderedDict[Tuple[str, str], List]" = OrderedDict()  # kind -> [at, level, text, count]

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # a bad format string: still say something
            text = str(record.msg)
        # the first line only (a traceback goes to --log-file), and literal: it may quote other peers' input
        text = CONTROL_CHARACTER_RE.sub(" ", (text.splitlines() or [""])[0])
        kind = (record.name, re.sub(r"\d+", "#", text))
        previous = self.entries.pop(kind, None)
        self.entries[kind] = [record.created, record.levelname, text, previous[3] + 1 if previous else 1]
        while len(self.entries) > self.kept:
            self.entries.popitem(last=False)

    def height(self) -> int:
        """Rows :meth:`render` takes."""
        return min(len(self.entries), self.lines) + 1 if self.entries else 0

    def render(self, width: int) -> List[RenderableType]:
        with self.lock:  # records arrive from other threads too (the stage's compute thread)
            entries = list(self.entries.values())[-self.lines:]
        if not entries:
            return []
        parts: List[RenderableType] = [Rule("log (warnings, repeats counted; --log-file keeps every line)",
                                            style="dim")]
        for at, level, text, count in entries:
            line = Text(time.strftime("%H:%M:%S ", time.localtime(at)), style="dim")
            line.append(f"{level[:4]:<5}", style="bold red" if level in ("ERROR", "CRITICAL") else "yellow")
            if count > 1:  # before the text, which the width may cut
                line.append(f"x{count} ", style="bold")
            line.append(text)
            line.truncate(width, overflow="ellipsis")
            parts.append(line)
        return parts


@contextmanager
def logs_below(panel: LogPanel) -> Iterator[LogPanel]:
    """While inside, log records go to ``panel`` instead of the terminal: every handler that writes to a
    stream (stderr) is set aside, ours and hivemind's, which does not propagate to ours. A handler that
    writes to a file (``--log-file``) stays and gets every line."""
    loggers = [logging.getLogger(), logging.getLogger("hivemind")]
    set_aside = []
    for each in loggers:
        for handler in list(each.handlers):
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                each.removeHandler(handler)
                set_aside.append((each, handler))
        each.addHandler(panel)
    try:
        yield panel
    finally:
        for each in loggers:
            each.removeHandler(panel)
        for each, handler in set_aside:
            each.addHandler(handler)


def render_with_logs(state: SwarmState, panel: LogPanel, console: Console, me: Optional[str] = None) -> Group:
    """The dashboard for the console's size, with the log panel below it."""
    height = console.height - panel.height()
    return Group(render(state, console.width, height, me), *panel.render(console.width))


async def watch_swarm(read_snapshot: Callable[[], Awaitable[Dict]], run: str, stop: asyncio.Event, period: float,
                      console: Console, me: Optional[str] = None, steps: Optional[int] = None) -> SwarmState:
    """Redraw the dashboard of ``run`` every ``period`` seconds until ``stop`` is set; returns the last state.

    :param read_snapshot: returns the run's next snapshot (:meth:`SwarmState.feed` says what one holds)
    :param run: run name
    :param stop: set by a signal handler to end the view
    :param period: seconds between snapshots
    :param console: where to draw (its width and height are read at every redraw, so resizing works)
    :param me: the volunteer's own name, highlighted
    :param steps: the run's length (its spec's), so the title says when the run is finished
    """
    state = SwarmState(run, steps=steps)
    with Live(console=console, auto_refresh=False, vertical_overflow="ellipsis") as view, \
            logs_below(LogPanel()) as panel:
        while not stop.is_set():
            try:
                state.feed(await read_snapshot())
            except Exception as e:  # one failed DHT read must not end the view; the next period retries
                logger.warning(f"reading the swarm's records failed: {e}")
            view.update(render_with_logs(state, panel, console, me), refresh=True)
            try:
                await asyncio.wait_for(stop.wait(), period)
            except asyncio.TimeoutError:
                pass
    return state
