"""Waiting for something to happen, with a deadline, instead of sleeping for a guess of how long it takes."""

import asyncio
import os
import stat
import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, what: str, period: float = 0.25) -> T:
    """Call ``predicate`` every ``period`` seconds until it returns something true, and return that; fail with
    ``what`` if ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g}s"
        time.sleep(period)


async def wait_until_async(predicate: Callable[[], T], timeout: float, what: str, period: float = 0.1) -> T:
    """:func:`wait_until` inside an event loop: sleeps with ``asyncio.sleep``, so the loop's other tasks (the
    stages under test) run while it waits."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g}s"
        await asyncio.sleep(period)


def output_of(pid: int, stream: int) -> str:
    """What process ``pid`` wrote so far to its stdout (1) or stderr (2), when that is a file ('' otherwise):
    for a process a command under test started with its own log files."""
    path = f"/proc/{pid}/fd/{stream}"
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return ""  # a pipe or a terminal: opening it would take the output from its reader
        with open(path, errors="replace") as file:
            return file.read()
    except OSError:  # the process is gone
        return ""
