"""Process plumbing shared by every verb: stop signals, and turning user errors into one line."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Awaitable, Callable, Optional

from ravnest_swarm.errors import UserError


def install_stop_signals() -> asyncio.Event:
    """SIGINT and SIGTERM set the returned event, so the caller can leave cleanly and exit 0."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def configure_logging(verbose: bool = False) -> None:
    """Our own log lines at INFO; hivemind's chatter only at WARNING unless ``--verbose``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    if not verbose:
        logging.getLogger("hivemind").setLevel(logging.ERROR)


def run_async(coroutine: Awaitable) -> int:
    """Run a verb's coroutine; a :class:`UserError` becomes ``error: ...`` on stderr and its exit code.

    SIGTERM cancels it as Ctrl-C does (its ``finally`` blocks stop what it started; exit code 130), unless
    the verb handles SIGTERM itself (:func:`install_stop_signals`). Python's default would end the process
    at once and orphan every process and namespace it started.
    """
    return _exit_code(lambda: asyncio.run(_cancelled_by_sigterm(coroutine)))


async def _cancelled_by_sigterm(coroutine: Awaitable):
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    return await coroutine


def run_blocking(verb: Callable[[], Optional[int]]) -> int:
    """Run a verb that blocks instead of awaiting (the benches that start processes and wait for them).

    Not under ``asyncio.run``, whose Ctrl-C only cancels the main task at its next await: a verb that never
    awaits would ignore Ctrl-C until done. Here Ctrl-C, and SIGTERM too, interrupt it wherever it waits, its
    cleanup (``finally``, context managers: the processes it started, the lab's namespaces) runs, and the
    exit code is 130. Python's default SIGTERM would end the process at once and orphan all of that.
    """
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _exit_code(verb)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
    raise KeyboardInterrupt


def _exit_code(verb: Callable[[], Optional[int]]) -> int:
    try:
        result = verb()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 130
    return int(result or 0)
