"""What asyncio would print as a traceback reaches a volunteer's terminal as one line at most (issue #20: hivemind's
p2pd reader raised ``InvalidStateError`` at a hundred peers and printed a traceback)."""

import os
import subprocess
import sys

import pytest

FAILING_TASKS = """
import asyncio, gc
from ravnest_swarm.lifecycle import run_async

async def fails(exception):
    raise exception

async def main():
    for exception in (asyncio.InvalidStateError("invalid state"), ValueError("something odd")):
        task = asyncio.ensure_future(fails(exception))
        await asyncio.sleep(0.05)
        del task  # never awaited: asyncio reports its exception when it is collected
        gc.collect()
    await asyncio.sleep(0.05)

raise SystemExit(run_async(main()))
"""


@pytest.mark.timeout(60)
def test_an_unretrieved_task_exception_is_one_line_and_the_p2pd_readers_invalid_state_is_not_shown():
    result = subprocess.run([sys.executable, "-c", FAILING_TASKS], capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "invalid state" not in result.stderr
    [line] = [line for line in result.stderr.splitlines() if "something odd" in line]
    assert "RAVNEST_DEBUG=1" in line
    debug = subprocess.run([sys.executable, "-c", FAILING_TASKS], capture_output=True, text=True, timeout=50,
                           env={**os.environ, "RAVNEST_DEBUG": "1"})
    assert "Traceback" in debug.stderr  # the traceback is there for whoever asks for it
