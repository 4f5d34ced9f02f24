"""A fork server for ``ravnest-swarm`` processes: one process imports torch, hivemind and the peer's modules
once, then forks a child for each process a :class:`~ravnest_swarm.processes.ProcessGroup` starts.

Why: importing torch and hivemind costs a fresh interpreter 3-4 CPU-seconds, more than most short peer
processes spend on anything else. ``local`` starts a backbone and N peers at once, so on a 2-core machine
its peers spent their first 10-20 seconds importing; a forked child starts with every module in place.

A child is a real process: its own pid and session (like ``start_new_session``), the stdin, stdout and
stderr its starter opened (passed over the socket), the starter's environment and working directory, the
default signal handlers, its own random seeds; it runs the command line as ``python -m`` would, and exits
through the normal interpreter shutdown (atexit handlers, non-daemon threads). What differs from a fresh
interpreter is only what interpreter start-up reads: ``PYTHON*`` variables and the working directory in
``sys.path``. :meth:`Launcher.can_start` refuses a request where those differ from the launcher's own,
and the starter falls back to a fresh interpreter (so does anything run under a command prefix). A lab's
host (:class:`LabHost`: a network namespace, a CPU cgroup) the child enters itself, as ``ip netns exec``
would have put it there. ``ps`` shows a child under the launcher's command line.

The launcher serves one starter over a socket pair: requests in, ``started``/``exited`` notices out. It
reaps its children and reports each exit code (``-N`` for a signal, as :class:`subprocess.Popen`), ignores
the terminal's Ctrl-C (its starter stops it), and exits when its starter closes the socket.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import importlib.util
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

import psutil

# every module a peer process imports on its way to training, averaging or serving as a backbone; scikit-learn's
# datasets too, for mlp-digits' data: its import cost each training peer a CPU-second after the others
PRELOAD = ("torch", "hivemind", "numpy", "ravnest_swarm.cli", "ravnest_swarm.processes", "ravnest_swarm.swarm.join",
           "ravnest_swarm.membership.volunteer", "ravnest_swarm.membership.backbone", "ravnest_swarm.planning.round",
           "ravnest_swarm.swarm.volunteer", "ravnest_swarm.swarm.status", "ravnest_swarm.swarm.local",
           "sklearn.datasets")
ENTRY_POINTS = {"ravnest_swarm": "ravnest_swarm.cli:main", "ravnest_swarm.processes": "ravnest_swarm.processes:main"}
MAX_REQUEST_BYTES = 1 << 20
REAP_PERIOD = 0.02  # seconds between looks for exited children
NETNS_DIR = "/var/run/netns"  # where `ip netns add` binds a namespace
CLONE_NEWNET = 0x40000000


@dataclasses.dataclass(frozen=True)
class LabHost:
    """Where a network lab runs a process: inside a network namespace (``ip netns add``), and in a CPU
    cgroup that it and its children (p2pd) join."""

    netns: Optional[str] = None
    cgroup: Optional[str] = None  # a cgroup v1 directory, e.g. /sys/fs/cgroup/cpu/<lab>-<host>

    def prefix(self) -> List[str]:
        """The command prefix that puts a fresh process there (an empty list for no namespace and no cgroup)."""
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        if self.cgroup:
            # a shell joins the cgroup, then becomes the command, whose children stay in the cgroup; it goes
            # first because `ip netns exec` mounts a /sys of the namespace's own, without the cgroups
            prefix = ["sh", "-c", f'echo $$ > {self.cgroup}/cgroup.procs && exec "$@"', "sh"] + prefix
        return prefix

    def enter(self) -> None:
        """Move this process there (a forked child, before it starts anything)."""
        if self.cgroup:
            with open(os.path.join(self.cgroup, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        if self.netns:
            # os.setns is Python 3.12's; the network namespace is all `ip netns exec` changes that a peer sees
            descriptor = os.open(os.path.join(NETNS_DIR, self.netns), os.O_RDONLY)
            try:
                if ctypes.CDLL(None, use_errno=True).setns(descriptor, CLONE_NEWNET) != 0:
                    error = ctypes.get_errno()
                    raise OSError(error, f"cannot enter network namespace {self.netns}: {os.strerror(error)}")
            finally:
                os.close(descriptor)


class LaunchedProcess:
    """A forked child as the starter sees it: the parts of :class:`subprocess.Popen` that processes.py uses."""

    def __init__(self, launcher: "Launcher", pid: int, args: List[str], stdin):
        self.launcher, self.pid, self.args, self.stdin = launcher, pid, args, stdin
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self.launcher.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(REAP_PERIOD)
        return self.returncode


class Launcher:
    """The starter's side: starts the launcher process, then asks it for children."""

    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.startup_environment = startup_variables(os.environ)
        self.cwd = os.getcwd()
        self.process = subprocess.Popen([sys.executable, "-u", "-m", "ravnest_swarm.launcher", str(theirs.fileno())],
                                        pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
        theirs.close()
        self.socket = ours
        self.lock = threading.Lock()
        self.exits: Dict[int, int] = {}
        self.closed = False

    def can_start(self, env: dict) -> bool:
        """Whether a child would start as a fresh interpreter would: same ``PYTHON*`` variables, same directory."""
        return (startup_variables(env) == self.startup_environment and os.getcwd() == self.cwd
                and self.process.poll() is None)

    def start(self, module: str, args: Sequence[str], env: dict, stdin: int, stdout: int, stderr: int,
              lab_host: Optional[LabHost] = None) -> int:
        """Fork a child that runs ``python -m module args`` (on ``lab_host`` if given); returns its pid."""
        request = json.dumps({"module": module, "args": list(args), "env": env, "cwd": os.getcwd(),
                              "lab_host": dataclasses.asdict(lab_host) if lab_host else None}).encode()
        with self.lock:
            socket.send_fds(self.socket, [request], [stdin, stdout, stderr])
            while True:
                notice = self._read(block=True)
                if "started" in notice:
                    return notice["started"]

    def exit_code(self, pid: int) -> Optional[int]:
        """A child's exit code, or None while it runs."""
        with self.lock:
            try:
                while pid not in self.exits and not self.closed and self._read(block=False) is not None:
                    pass
            except LauncherGone:  # killed: its children live on, orphaned
                pass
            if pid in self.exits:
                return self.exits[pid]
            if self.closed and not psutil.pid_exists(pid):
                return -signal.SIGKILL  # it outlived the launcher, which could not tell how it ended
            return None

    def _read(self, block: bool) -> Optional[dict]:
        if not block and not select.select([self.socket], [], [], 0)[0]:
            return None
        data = self.socket.recv(MAX_REQUEST_BYTES)
        if not data:
            self.closed = True
            raise LauncherGone(f"the process launcher (pid {self.process.pid}) exited with {self.process.wait()}")
        notice = json.loads(data)
        if "exited" in notice:
            self.exits[notice["exited"]] = notice["code"]
        return notice

    def close(self, timeout: float = 10.0) -> None:
        """Stop the launcher, keeping the exit codes it reports last; children still running are their
        starters' to stop."""
        with self.lock:
            if not self.closed:
                self.socket.settimeout(timeout)
                try:
                    self.socket.shutdown(socket.SHUT_WR)
                    while True:
                        self._read(block=True)
                except (LauncherGone, OSError):  # gone, or no answer within the timeout (killed below)
                    self.closed = True
            self.socket.close()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class LauncherGone(RuntimeError):
    """The launcher process exited (its starter closed it, or it was killed)."""


def startup_variables(env: dict) -> dict:
    """The variables interpreter start-up reads (PYTHONUNBUFFERED aside: the launcher and every child run unbuffered)."""
    return {key: value for key, value in env.items() if key.startswith("PYTHON") and key != "PYTHONUNBUFFERED"}


def serve(channel: socket.socket) -> Optional[dict]:
    """The launcher's loop; returns (in a forked child only) the request that child is to run."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the starter, which stops us
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    for module in PRELOAD:
        importlib.import_module(module)
    children = set()
    while True:
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            channel.send(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode())
        if not select.select([channel], [], [], REAP_PERIOD)[0]:
            continue
        data, fds, _, _ = socket.recv_fds(channel, MAX_REQUEST_BYTES, 3)
        if not data:  # the starter closed its end: it is done with us
            channel.close()
            return None
        pid = os.fork()
        if pid == 0:
            channel.close()
            request = json.loads(data)
            request["fds"] = fds
            return request
        for fd in fds:
            os.close(fd)
        children.add(pid)
        channel.send(json.dumps({"started": pid}).encode())


def become(request: dict) -> None:
    """In the forked child: take the session, files, environment and signal handlers a fresh process has."""
    import tempfile

    import numpy

    os.setsid()
    for target, fd in enumerate(request["fds"]):
        os.dup2(fd, target)
        os.close(fd)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    numpy.random.seed()  # a fresh interpreter seeds numpy from the OS; `random` reseeds itself after a fork
    sys.argv = [main_file(request["module"]), *request["args"]]
    if request["lab_host"]:
        LabHost(**request["lab_host"]).enter()


def main_file(module: str) -> str:
    """What ``python -m module`` puts in ``sys.argv[0]`` (click names the program from it)."""
    spec = importlib.util.find_spec(module)
    if spec.submodule_search_locations is not None:  # a package runs as its __main__
        spec = importlib.util.find_spec(f"{module}.__main__")
    return spec.origin


def main() -> None:
    request = serve(socket.socket(fileno=int(sys.argv[1])))
    if request is None:
        return
    try:
        become(request)
    except OSError as error:  # a lab host it cannot enter: what `ip netns exec` would have said, in one line
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
    module, function = ENTRY_POINTS[request["module"]].split(":")
    getattr(importlib.import_module(module), function)()


if __name__ == "__main__":
    main()
