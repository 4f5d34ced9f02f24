"""``lifecycle``'s process plumbing. What asyncio would print as a traceback reaches a volunteer's terminal as one
line at most (issue #20: hivemind's p2pd reader raised ``InvalidStateError`` at a hundred peers and printed a
traceback); a closed terminal stops a peer as Ctrl-C does, and its output is dropped, not raised."""

import io
import os
import pty
import subprocess
import sys

import pytest

from ravnest_swarm.lifecycle import OutputOutlivingItsReader

FAILING_TASKS = """
import asyncio, gc
from ravnest_swarm.lifecycle import run_async

async def fails(exception):
    raise exception

async def waits_forever(future):
    await future

async def main():
    for exception in (asyncio.InvalidStateError("invalid state"), ValueError("something odd")):
        task = asyncio.ensure_future(fails(exception))
        await asyncio.sleep(0.05)
        del task  # never awaited: asyncio reports its exception when it is collected
        gc.collect()
    waited_for = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(waits_forever(waited_for))
    await asyncio.sleep(0.05)
    del task, waited_for  # collected while pending: asyncio says so, with no exception to name
    gc.collect()
    await asyncio.sleep(0.05)

raise SystemExit(run_async(main()))
"""


@pytest.mark.timeout(60)
def test_an_unretrieved_task_exception_is_one_line_and_the_p2pd_readers_invalid_state_is_not_shown():
    """Also a task collected while pending: one line naming its coroutine."""
    result = subprocess.run([sys.executable, "-c", FAILING_TASKS], capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "invalid state" not in result.stderr
    [line] = [line for line in result.stderr.splitlines() if "something odd" in line]
    assert "RAVNEST_DEBUG=1" in line
    # a task collected while pending names its coroutine (a walkthrough's line said only "None")
    [line] = [line for line in result.stderr.splitlines() if "destroyed but it is pending" in line]
    assert "waits_forever (<string>:" in line and "None" not in line, line
    debug = subprocess.run([sys.executable, "-c", FAILING_TASKS], capture_output=True, text=True, timeout=50,
                           env={**os.environ, "RAVNEST_DEBUG": "1"})
    assert "Traceback" in debug.stderr  # the traceback is there for whoever asks for it


CLOSED_TERMINAL = """
import asyncio, os, signal
from ravnest_swarm.lifecycle import install_stop_signals, run_async

async def main():
    stop = install_stop_signals(lambda: print("stopping...", flush=True))
    os.kill(os.getpid(), signal.SIGHUP)
    await asyncio.wait_for(stop.wait(), 5)
    print("left cleanly", flush=True)

raise SystemExit(run_async(main()))
"""


@pytest.mark.timeout(60)
def test_a_closed_terminals_sighup_is_a_stop_like_ctrl_c():
    """A terminal's SIGHUP no longer reaches p2pd (a process group of its own), so the peer must stop it: SIGHUP
    is a graceful stop, not Python's default death that would orphan p2pd."""
    result = subprocess.run([sys.executable, "-c", CLOSED_TERMINAL], capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["stopping...", "left cleanly"]


def test_output_to_a_closed_terminal_is_dropped_not_raised():
    """After a terminal closes, a write to it fails with EIO; the peer's leave must go on (as with a closed pipe)."""
    controller, terminal = pty.openpty()
    stream = OutputOutlivingItsReader(io.TextIOWrapper(io.FileIO(terminal, "w", closefd=False), line_buffering=True))
    stream.write("before\n")
    os.close(controller)
    stream.write("after the terminal closed\n")  # EIO, dropped
    stream.flush()
    assert os.readlink(f"/proc/self/fd/{terminal}") == os.devnull
    os.close(terminal)
