"""``ravnest-swarm`` commands run to their end, as ``subprocess.run`` would, but forked from the session's one
launcher (``ravnest_swarm/launcher.py``): a command that fails on its input answers in a fraction of a second
instead of importing torch and hivemind first. ``conftest.py``'s ``processes`` fixture forks from the same one."""

import atexit
import os
import subprocess
import sys
import tempfile
from typing import Optional

from ravnest_swarm.launcher import Launcher
from ravnest_swarm.processes import PeerProcess

_shared: Optional[Launcher] = None


def shared_launcher() -> Launcher:
    """The session's launcher, started on first use and stopped when the test process exits."""
    global _shared
    if _shared is None:
        _shared = Launcher()
        atexit.register(_shared.close)
    return _shared


def ravnest(*args: str, timeout: float = 120, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """Run ``ravnest-swarm args`` (stdin /dev/null, output captured, rich's default width of 80 columns) to its
    end; raise :class:`subprocess.TimeoutExpired`, its processes stopped, if it runs past ``timeout``."""
    with tempfile.TemporaryDirectory(prefix="ravnest-command-") as folder:
        process = PeerProcess(list(args), folder, "command", {"COLUMNS": os.environ.get("COLUMNS", "80"), **(env or {})},
                              launcher=shared_launcher())
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill_group()
            raise
        return subprocess.CompletedProcess([sys.executable, "-m", "ravnest_swarm", *args], code, process.stdout(),
                                           process.stderr())
