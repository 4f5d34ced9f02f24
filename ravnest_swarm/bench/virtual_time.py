"""An asyncio event loop on virtual time: when nothing is ready, its clock jumps to the next scheduled callback.

The membership simulation (``bench/simulation.py``) runs thousands of real heartbeat loops (``asyncio.sleep``,
``loop.time``) through it: an hour of a swarm takes the CPU time of its callbacks, not an hour. Nothing here may wait
on real I/O: a loop with no callback scheduled and none ready has nothing that could ever wake it, and says so.
"""

from __future__ import annotations

import asyncio
import selectors


class _VirtualSelector:
    """The loop's selector, but a wait of ``timeout`` seconds advances the virtual clock instead of sleeping."""

    def __init__(self, selector: selectors.BaseSelector, loop: "VirtualTimeLoop"):
        self._selector, self._loop = selector, loop

    def select(self, timeout=None):
        if timeout is None:
            raise RuntimeError("the virtual-time loop has nothing scheduled and nothing ready: it would wait forever")
        self._loop.advance(timeout)
        return self._selector.select(0)

    def __getattr__(self, name):
        return getattr(self._selector, name)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """``loop.time()`` starts at 0 and moves only when every ready callback has run (small magnitudes keep float
    sums exact enough for asyncio's scheduling)."""

    def __init__(self):
        super().__init__()
        self._now = 0.0
        self._selector = _VirtualSelector(self._selector, self)
        # a callback scheduled for t runs when the clock is within this of t (float sums of sampled latencies)
        self._clock_resolution = 1e-6

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds > 0:
            self._now += seconds


def run_virtual(coroutine):
    """Run ``coroutine`` to completion on a fresh :class:`VirtualTimeLoop`, then close it."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coroutine)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
