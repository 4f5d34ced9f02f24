"""What a stage counts (its ``status`` answer and report), the wall time it is busy, and where a placed
volunteer's wall time goes (:class:`WallTime`)."""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field as dataclass_field
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from ravnest_swarm.membership.progress import TIME_USES

# Where a placed stage's wall time goes, each moment charged to one of TIME_USES (the record's): work, or idle by cause
WORKING = TIME_USES[:2]  # computing, sending
IDLE_CAUSES = TIME_USES[2:-1]  # in precedence: a download during a plan's move is a download; the last is "other"


@dataclass
class Counters:
    forwards: int = 0
    backwards: int = 0
    injected: int = 0
    completed: int = 0
    dropped: int = 0
    rejected: int = 0  # messages refused for what they hold: malformed or poisoned
    last_rejected: Optional[str] = None  # what the last of them was and why
    turned_away: int = 0  # messages refused for when or where they arrived (messaging.TURNED_AWAY)
    failed: int = 0  # microbatches whose forward, loss or backward raised here (dropped too)
    last_failed: Optional[str] = None  # which the last of them was and why
    skipped: int = 0  # steps the divergence guard skipped: a loss far above the stage's level (pipeline/guard.py)
    divergences: int = 0  # restores after a divergence, this stage's own or its cluster's (told by a later stage)
    last_divergence: Optional[str] = None  # what the last of them was and what the stage went back to
    resends: int = 0
    # bytes of the messages this stage handed to its links, by handler (``forward``, ``backward``): the frames as
    # encoded, metadata and every tensor included, once per attempt
    bytes_sent: Dict[str, int] = dataclass_field(default_factory=lambda: {"forward": 0, "backward": 0})
    codec_switches: List[Tuple[float, str, str]] = dataclass_field(default_factory=list)  # (time, handler, codec)
    max_staleness: int = 0
    losses: List[Tuple[int, float]] = dataclass_field(default_factory=list)
    inject_times: List[float] = dataclass_field(default_factory=list)
    complete_times: List[float] = dataclass_field(default_factory=list)
    busy: List[Tuple[float, float]] = dataclass_field(default_factory=list)
    compute: List[Tuple[float, float]] = dataclass_field(default_factory=list)  # forwards and backwards only
    compute_seconds: float = 0.0  # their total
    trace: List[Tuple[float, str, int]] = dataclass_field(default_factory=list)  # (time, event, microbatch)

    @contextmanager
    def computing(self) -> Iterator[None]:
        """Record a forward's or backward's wall time in ``compute`` (the compute thread runs one at a time)."""
        started = time.time()
        try:
            yield
        finally:
            ended = time.time()
            self.compute.append((started, ended))
            self.compute_seconds += ended - started


class WallTime:
    """Where a volunteer's wall time goes while it is placed (``counting``): seconds per use of :data:`TIME_USES`.

    Each moment counts once, for the first that holds: a forward or backward computes; a message of ours is on its
    way (written, its reply awaited; not a send's waits between attempts); an idle cause is in force
    (:data:`IDLE_CAUSES`, in their precedence: the volunteer downloads layers, moves for a plan, or averages; the
    scheduler waits for a microbatch or a gradient from a neighbour); else ``other`` (the loop between tasks, a
    checkpoint). Overlapping uses and causes are counted, not stacked, so the tasks that
    enter and leave them need not nest. A few additions per change, nothing per microbatch kept.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.seconds: Dict[str, float] = dict.fromkeys(TIME_USES, 0.0)
        self.counting = False
        self._in_force: Counter = Counter()  # uses and causes entered and not yet left
        self._since = clock()

    def current(self) -> str:
        """The use the moment counts for now."""
        return next((use for use in WORKING + IDLE_CAUSES if self._in_force[use] > 0), "other")

    def _charge(self) -> None:
        now = self.clock()
        if self.counting:
            self.seconds[self.current()] += now - self._since
        self._since = now

    def count(self, counting: bool) -> None:
        """Start (a placement) or stop (a standby) counting: only a placed volunteer's time is a stage's."""
        self._charge()
        self.counting = counting

    @contextmanager
    def using(self, use: str) -> Iterator[None]:
        """Charge the time within to ``use`` (of :data:`TIME_USES` but ``other``), where nothing before it holds."""
        if use not in WORKING + IDLE_CAUSES:
            raise ValueError(f"not a use of wall time: {use!r}")
        self._charge()
        self._in_force[use] += 1
        try:
            yield
        finally:
            self._charge()
            self._in_force[use] -= 1

    def total(self) -> float:
        self._charge()
        return sum(self.seconds.values())

    def shares(self) -> Optional[Dict[str, float]]:
        """Each use's share of the time counted so far (they sum to 1); None before any was counted."""
        total = self.total()
        return None if total <= 0 else {use: seconds / total for use, seconds in self.seconds.items()}


def utilisation(shares: Dict[str, float]) -> float:
    """The share of the time a stage worked (computed or sent), downloads of the layers it moved to left out: they
    are the cost of a move, reported apart (issue 33)."""
    placed = 1.0 - shares.get("download", 0.0)
    return 0.0 if placed <= 0 else min(1.0, sum(shares.get(use, 0.0) for use in WORKING) / placed)


class BusyTime:
    """Wall time during which a forward, backward or send is in progress (overlaps count once): ``counters.busy``;
    each is charged to ``wall_time`` too (its volunteer's, across stage workers)."""

    def __init__(self, counters: Counters, wall_time: Optional[WallTime] = None):
        self.counters = counters
        self.wall_time = wall_time if wall_time is not None else WallTime()
        self._active, self._since = 0, 0.0

    @contextmanager
    def measure(self, use: Optional[str] = None) -> Iterator[None]:
        """``use``: what ``wall_time`` charges the time within to (``computing``), if anything: a send charges only
        its attempts (``Outbox.send``), not its waits between them."""
        if self._active == 0:
            self._since = time.time()
        self._active += 1
        try:
            with self.wall_time.using(use) if use is not None else nullcontext():
                yield
        finally:
            self._active -= 1
            if self._active == 0:
                self.counters.busy.append((self._since, time.time()))
