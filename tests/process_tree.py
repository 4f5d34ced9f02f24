"""The processes a command started (their own sessions included), for tests that check nothing is left."""

import os
import signal
import time

import psutil


def descendants(pid):
    """Pids of every live descendant of ``pid``."""
    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return set()


def alive(pids):
    """The pids still running (zombies excluded)."""
    running = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.add(pid)
        except psutil.NoSuchProcess:
            pass
    return running


def signal_session(process, sig):
    """``sig`` to every process of a started peer's session (the peer and its p2pd): SIGSTOP freezes it whole."""
    from ravnest_swarm.processes import session_members

    for pid in session_members(process.pid):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_pids(pids):
    """SIGKILL each pid's process group and the pid itself (teardown after a failed test)."""
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def exits_leaving_nothing(process, timeout):
    """Wait up to ``timeout`` seconds for ``process`` (a ``ProcessGroup`` process) to exit, noting every process it
    starts meanwhile; assert that it exited with 0 and that none of those is left running (they are killed if so)."""
    started = set()
    deadline = time.monotonic() + timeout
    while process.popen.poll() is None and time.monotonic() < deadline:
        started |= descendants(process.pid)
        time.sleep(0.5)
    try:
        assert process.popen.poll() == 0, process.stderr()[-3000:]
        assert not alive(started), f"left running: {alive(started)}"
    finally:
        kill_pids(alive(started))
