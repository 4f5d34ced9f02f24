"""Starting and stopping real ``ravnest-swarm`` processes (used by ``local``, the benchmarks and the tests).

A process is described either by the library's own option object (:meth:`ProcessGroup.start_library`:
``python -m ravnest_swarm.processes`` calls ``function(options)``, the options sent as JSON), or, for
the tests of the command line itself, by ``ravnest-swarm`` arguments (:meth:`ProcessGroup.start`).

Each process starts in its own session, and its p2pd stays in that session (in a process group of its
own, so that a terminal's Ctrl-C does not reach it: ``net.node.spare_p2pd_from_ctrl_c``): killing every
process of the session, found by its id (the leader's pid), stops p2pd too, even when the peer itself was
killed with SIGKILL and could not clean up.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, List, Optional, Sequence, get_origin, get_type_hints

import psutil

from ravnest_swarm.launcher import ENTRY_POINTS, LabHost, LaunchedProcess, Launcher
from ravnest_swarm.lifecycle import unexpected_error_as_one_line

MADDR_RE = re.compile(r"^/ip[46]/\S+/p2p/\S+$")
FRESH_PROCESSES_ENV = "RAVNEST_FRESH_PROCESSES"  # "1": every process a fresh interpreter, none forked (launcher.py)


class PeerProcess:
    """One ``ravnest-swarm`` subprocess whose output goes to files that can be read while it runs.

    :param args: arguments after ``ravnest-swarm``
    :param log_dir: where ``<name>.out`` and ``<name>.err`` are written
    :param name: a label for the log files
    :param env: extra environment variables
    :param prefix: a command to run it under (e.g. a terminal); such a process is never forked
    :param lab_host: the lab host it runs on (``NetLab.lab_host(host)``: a namespace, a cgroup)
    :param python_args: what the interpreter runs; ``ravnest-swarm`` unless a script is given
    :param stdin_pipe: give it a pipe on stdin, for commands sent with :meth:`send` (else /dev/null)
    :param launcher: fork it from this :class:`~ravnest_swarm.launcher.Launcher` where the launcher can start
        it as a fresh interpreter would (``python -m`` of an entry point, no prefix); else a fresh interpreter
    """

    def __init__(self, args: Sequence[str], log_dir: str, name: str, env: Optional[dict] = None,
                 prefix: Sequence[str] = (), python_args: Sequence[str] = ("-m", "ravnest_swarm"),
                 stdin_pipe: bool = False, launcher: Optional[Launcher] = None, lab_host: Optional[LabHost] = None):
        self.args, self.name = list(args), name
        self.stdout_path = os.path.join(log_dir, f"{name}.out")
        self.stderr_path = os.path.join(log_dir, f"{name}.err")
        environment = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120", **(env or {})}
        forked = (launcher is not None and not prefix and python_args[0] == "-m" and python_args[1] in ENTRY_POINTS
                  and launcher.can_start(environment))
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            if forked:
                self.popen = self._fork(launcher, python_args[1], environment, out, err, stdin_pipe, lab_host)
            else:
                self.popen = subprocess.Popen(
                    [*prefix, *(lab_host.prefix() if lab_host else ()), sys.executable, *python_args, *self.args],
                    stdout=out, stderr=err, stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
                    env=environment, start_new_session=True,
                )
        self.pid = self.popen.pid

    def _fork(self, launcher: Launcher, module: str, environment: dict, out, err, stdin_pipe: bool,
              lab_host: Optional[LabHost]) -> LaunchedProcess:
        if stdin_pipe:
            child_stdin, ours = os.pipe()
            stdin = os.fdopen(ours, "wb")
        else:
            child_stdin, stdin = os.open(os.devnull, os.O_RDONLY), None
        try:
            pid = launcher.start(module, self.args, environment, child_stdin, out.fileno(), err.fileno(), lab_host)
        finally:
            os.close(child_stdin)
        return LaunchedProcess(launcher, pid, [sys.executable, "-m", module, *self.args], stdin)

    def stdout(self) -> str:
        with open(self.stdout_path, errors="replace") as f:
            return f.read()

    def stderr(self) -> str:
        with open(self.stderr_path, errors="replace") as f:
            return f.read()

    def wait_for_output(self, pattern: str, timeout: float, stream: str = "stdout") -> re.Match:
        """Wait until ``pattern`` appears in the process's output; raise with its stderr if it exits first."""
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern, re.MULTILINE)
        while time.monotonic() < deadline:
            match = regex.search(self.stdout() if stream == "stdout" else self.stderr())
            if match:
                return match
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}: {self.stderr()[-2000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"{self.name}: no {pattern!r} within {timeout}s; stderr: {self.stderr()[-2000:]}")

    def maddrs(self, timeout: float = 30.0) -> List[str]:
        """The full multiaddrs a backbone prints on start, one per line."""
        self.wait_for_output(r"^/ip[46]/\S+/p2p/\S+$", timeout)
        return [line for line in self.stdout().splitlines() if MADDR_RE.match(line)]

    def send(self, line: str) -> bool:
        """Write one command line to its stdin (started with ``stdin_pipe``); False if it is no longer reading."""
        try:
            self.popen.stdin.write((line + "\n").encode())
            self.popen.stdin.flush()
            return True
        except (BrokenPipeError, ValueError):  # exited, or its pipe already closed
            return False

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.kill(self.pid, sig)

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout)

    def kill_group(self) -> None:
        """SIGKILL every process of the peer's session (the peer and its p2pd), by the leader's pid."""
        for pid in session_members(self.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass
        if self.popen.stdin is not None:
            try:
                self.popen.stdin.close()
            except BrokenPipeError:
                pass

    def stop(self, grace: float = 10.0) -> Optional[int]:
        """SIGTERM, wait up to ``grace`` seconds, then SIGKILL the group; return the exit code if it exited."""
        code = None
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                code = self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        else:
            code = self.popen.returncode
        self.kill_group()
        return code


def session_members(session_id: int) -> List[int]:
    """The pids of every process in the session ``session_id``, its leader's orphans included."""
    members = []
    for pid in psutil.pids():
        try:
            if os.getsid(pid) == session_id:
                members.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return members


class ProcessGroup:
    """Every process a test, benchmark or ``local`` run starts; :meth:`stop_all` stops each by pid."""

    def __init__(self, log_dir: Optional[str] = None, launcher: Optional[Launcher] = None):
        """:param launcher: fork the processes from this launcher, which the caller stops; without one the group
            starts its own with its first process and stops it in :meth:`stop_all`"""
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="ravnest-")
        self.processes: List[PeerProcess] = []
        self.launcher, self.owns_launcher = launcher, launcher is None

    def _launcher(self, prefix: Sequence[str]) -> Optional[Launcher]:
        """The launcher to fork from, started on first use; None where the process runs under a command prefix
        (the launcher cannot fork it into another command) or every process is to be a fresh interpreter."""
        if prefix or os.environ.get(FRESH_PROCESSES_ENV) == "1":
            return None
        if self.launcher is None:
            self.launcher = Launcher()
        return self.launcher

    def start(self, args: Sequence[str], name: str, env: Optional[dict] = None,
              prefix: Sequence[str] = (), lab_host: Optional[LabHost] = None) -> PeerProcess:
        return self._add(PeerProcess(args, self.log_dir, name, env, prefix, launcher=self._launcher(prefix),
                                     lab_host=lab_host))

    def _add(self, process: PeerProcess) -> PeerProcess:
        self.processes.append(process)
        return process

    def start_library(self, function: Callable[[Any], int], options: Any, name: str, env: Optional[dict] = None,
                      lab_host: Optional[LabHost] = None, stdin_pipe: bool = False) -> PeerProcess:
        """A process that runs ``function(options)`` and exits with its return value; ``options`` is a
        dataclass of plain values (it travels as JSON), the type of ``function``'s one parameter."""
        call = {"function": f"{function.__module__}:{function.__qualname__}", "options": dataclasses.asdict(options)}
        return self._add(PeerProcess([json.dumps(call)], self.log_dir, name, env,
                                     python_args=("-m", "ravnest_swarm.processes"), stdin_pipe=stdin_pipe,
                                     launcher=self._launcher(()), lab_host=lab_host))

    def start_python(self, script: str, args: Sequence[str], name: str) -> PeerProcess:
        """A process running a Python script given as text (e.g. a plain hivemind peer to compare with)."""
        process = PeerProcess(args, self.log_dir, name, python_args=("-c", script))
        self.processes.append(process)
        return process

    def stop_all(self, grace: float = 10.0) -> None:
        for process in self.processes:
            if process.popen.poll() is None:
                process.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        try:
            for process in self.processes:
                try:
                    process.popen.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        finally:  # then, or at a second Ctrl-C during the grace: nothing we started outlives us
            for process in self.processes:
                process.kill_group()
        if self.owns_launcher and self.launcher is not None:
            self.launcher.close()
            self.launcher = None


def run_library_call(text: str) -> int:
    """The child's side of :meth:`ProcessGroup.start_library`: rebuild the options and make the call."""
    call = json.loads(text)
    module_name, function_name = call["function"].split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    options_type = next(hint for name, hint in get_type_hints(function).items() if name != "return")
    return function(options_from_json(options_type, call["options"]))


def options_from_json(options_type: type, values: dict) -> Any:
    """A dataclass from its ``asdict`` as JSON gave it back: nested dataclasses rebuilt, lists made tuples
    where the field is a tuple."""
    hints = get_type_hints(options_type)
    fields = {}
    for field in dataclasses.fields(options_type):
        value, hint = values[field.name], hints[field.name]
        if dataclasses.is_dataclass(hint) and isinstance(value, dict):
            value = options_from_json(hint, value)
        elif get_origin(hint) is tuple and isinstance(value, list):
            value = tuple(value)
        fields[field.name] = value
    return options_type(**fields)


def main() -> None:
    try:
        sys.exit(run_library_call(sys.argv[1]))
    except Exception as error:
        sys.exit(unexpected_error_as_one_line(error))


if __name__ == "__main__":
    main()
