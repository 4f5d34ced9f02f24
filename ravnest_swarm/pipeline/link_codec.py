"""Which codec one stage boundary sends in: the run's, or the stronger one its spec allows while the link is the
bottleneck. Pure: it is told how long its messages took on the link and how long the stage computed, and answers
with the codec.

A link is the bottleneck when a message takes longer on it than the stage takes to compute a microbatch: over a
``window`` of seconds, the messages' times on the link (first byte to last as their receiver measured them: each
reply's ``read_ms``) reach ``switch_at`` times the stage's compute time. Each microbatch sends one message
each way, so that is link time per message against compute per microbatch: the stage cannot go faster than
its link lets its messages through, and each hop's time is also part of every microbatch's round trip, which
bounds the pipeline at ``max_in_flight`` microbatches per round trip. (Measured in the lab at 2 Mbit/s: links
carrying bytes half the time, yet every hop 10 times a stage's compute: utilisation does not tell.) Back to the
run's codec when, measured under the strong codec, the run's codec's bytes (the ratio of their bytes per value)
would take less than ``back_below`` of the compute: a margin, so a boundary near the line does not flap.
A link that carries bytes less than ``min_link_share`` of the window is not the bottleneck whatever the ratio:
on loopback a small message's "time on the link" is the receiver's event loop, and a lossy codec there would
cost accuracy for nothing.
"""

from __future__ import annotations

from typing import Optional

from ravnest_swarm.codecs.codec import CODECS

WINDOW_S = 5.0
SWITCH_AT = 1.0
BACK_BELOW = 0.6
MIN_LINK_SHARE = 0.2


class LinkCodec:
    """:param base: the run's codec (``pipeline_compression``); :param strong: its ``link_bound_compression``
    ("", or the base itself, never switches)."""

    def __init__(self, base: str, strong: str = "", window: float = WINDOW_S, switch_at: float = SWITCH_AT,
                 back_below: float = BACK_BELOW, min_link_share: float = MIN_LINK_SHARE):
        self.base, self.strong, self.current = base, "" if strong == base else strong, base
        self.window, self.switch_at, self.back_below = window, switch_at, back_below
        self.min_link_share = min_link_share
        self.link_per_compute: Optional[float] = None  # the last window's
        self._start: Optional[float] = None
        self._totals = (0.0, 0.0)

    def observe(self, now: float, link_seconds: float, compute_seconds: float) -> Optional[str]:
        """Totals so far: our messages' seconds on the link, the stage's compute seconds; the new codec if it
        changes now."""
        if not self.strong:
            return None
        if self._start is None or link_seconds < self._totals[0] or compute_seconds < self._totals[1]:
            self._start, self._totals = now, (link_seconds, compute_seconds)  # a total that went back: a new count
            return None
        if now - self._start < self.window:
            return None
        link, compute = link_seconds - self._totals[0], compute_seconds - self._totals[1]
        elapsed = now - self._start
        self._start, self._totals = now, (link_seconds, compute_seconds)
        if compute <= 0:
            return None  # nothing computed: nothing to weigh the link against
        self.link_per_compute = link / compute
        if self.current == self.base and self.link_per_compute >= self.switch_at and link >= self.min_link_share * elapsed:
            self.current = self.strong
            return self.current
        ratio = CODECS[self.base].bytes_per_value / CODECS[self.strong].bytes_per_value
        if self.current == self.strong and self.link_per_compute * ratio < self.back_below:
            self.current = self.base
            return self.current
        return None
