"""Process plumbing shared by every verb: stop signals, and turning user errors into one line."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Awaitable

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
    """Run a verb's coroutine; a :class:`UserError` becomes ``error: ...`` on stderr and its exit code."""
    try:
        result = asyncio.run(coroutine)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    return int(result or 0)
