"""What a stage counts (its ``status`` answer and report) and the wall time it is busy."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field as dataclass_field
from typing import Dict, Iterator, List, Optional, Tuple


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


class BusyTime:
    """Wall time during which a forward, backward or send is in progress (overlaps count once): ``counters.busy``."""

    def __init__(self, counters: Counters):
        self.counters = counters
        self._active, self._since = 0, 0.0

    @contextmanager
    def measure(self) -> Iterator[None]:
        if self._active == 0:
            self._since = time.time()
        self._active += 1
        try:
            yield
        finally:
            self._active -= 1
            if self._active == 0:
                self.counters.busy.append((self._since, time.time()))
