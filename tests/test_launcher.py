"""The fork server (ravnest_swarm/launcher.py): a forked peer is a process of its own, as a fresh interpreter
would be; a request it cannot serve as one starts a fresh interpreter; it outlives nobody."""

import os
import signal
import subprocess
import sys

import psutil
import pytest

from process_tree import alive, kill_pids
from ravnest_swarm import __version__
from ravnest_swarm.bench.netlab import NetLab, cpu_quota_unavailable
from ravnest_swarm.launcher import NETNS_DIR, LabHost
from ravnest_swarm.processes import FRESH_PROCESSES_ENV, ProcessGroup, session_members
from waiting import wait_until

BACKBONE = ["backbone", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]


@pytest.mark.timeout(120)
def test_a_forked_peer_has_its_own_session_files_and_exit_code_and_the_launcher_stops_with_its_group(tmp_path):
    group = ProcessGroup(str(tmp_path))  # with a launcher of its own, as `local` and the benches have
    try:
        backbone = group.start(BACKBONE, "backbone")
        backbone.maddrs()  # its stdout is the file its starter opened
        launcher = group.launcher.process.pid
        assert psutil.Process(backbone.pid).ppid() == launcher  # forked, not a fresh interpreter
        assert os.getsid(backbone.pid) == backbone.pid  # a session of its own, as start_new_session gives
        assert os.getpgid(backbone.pid) == backbone.pid

        version = group.start(["--version"], "version")
        assert version.wait(30) == 0 and version.stdout() == f"ravnest-swarm {__version__}\n"
        usage = group.start(["join", "--run", "r"], "usage")
        fresh = subprocess.run([sys.executable, "-m", "ravnest_swarm", "join", "--run", "r"], capture_output=True,
                               text=True, timeout=60)
        assert usage.wait(30) == fresh.returncode == 2
        assert usage.stderr() == fresh.stderr  # the program's name in the hint included: `python -m ravnest_swarm`

        os.kill(launcher, signal.SIGINT)  # a terminal's Ctrl-C reaches the starter's group: it is the starter's
        second = group.start(BACKBONE, "second")
        second.maddrs()
        second.signal(signal.SIGKILL)
        assert second.wait(30) == -signal.SIGKILL  # as subprocess.Popen reports a signal
        assert backbone.stop(grace=20) == 0  # SIGTERM: the backbone's own graceful stop
    finally:
        group.stop_all()
    assert group.launcher is None
    wait_until(lambda: not alive({launcher}), 10, "the launcher exits when its group stops")


@pytest.mark.timeout(120)
def test_what_the_launcher_cannot_start_as_a_fresh_interpreter_would_starts_a_fresh_one(tmp_path, monkeypatch):
    group = ProcessGroup(str(tmp_path))
    try:
        forked = group.start(BACKBONE, "forked")
        forked.maddrs()
        # interpreter start-up reads PYTHONPATH into sys.path: a child forked after start-up could not
        fresh = group.start(BACKBONE, "fresh", env={"PYTHONPATH": str(tmp_path)})
        fresh.maddrs()
        assert psutil.Process(fresh.pid).ppid() == os.getpid()
        assert "ravnest_swarm" in psutil.Process(fresh.pid).cmdline()
        monkeypatch.setenv(FRESH_PROCESSES_ENV, "1")
        asked = group.start(["--version"], "asked")
        assert psutil.Process(asked.pid).ppid() == os.getpid() and asked.wait(30) == 0
        assert asked.stdout() == f"ravnest-swarm {__version__}\n"
        assert psutil.Process(forked.pid).ppid() == group.launcher.process.pid
    finally:
        group.stop_all()


@pytest.mark.timeout(120)
@pytest.mark.netns
def test_a_peer_forked_onto_a_lab_host_runs_in_its_namespace_and_cgroup_with_its_p2pd(tmp_path):
    """The NAT tests and lab benches fork their peers too: the child enters the host as `ip netns exec` would
    have put a fresh interpreter there (and the host's CPU cgroup, where this machine has cgroup v1's)."""
    quota = cpu_quota_unavailable() is None
    group = ProcessGroup(str(tmp_path))
    try:
        with NetLab(1, cpus=0.5 if quota else None) as lab:
            host = lab.lab_host(0)
            backbone = group.start(["backbone", "--host-maddrs", lab.host_maddr(0)], "backbone", lab_host=host)
            assert all(maddr.startswith(lab.host_maddr(0)) for maddr in backbone.maddrs())  # bound inside the host
            assert psutil.Process(backbone.pid).ppid() == group.launcher.process.pid
            namespace = os.stat(os.path.join(NETNS_DIR, host.netns)).st_ino
            members = session_members(backbone.pid)
            assert any(psutil.Process(pid).name() == "p2pd" for pid in members), members
            for pid in members:  # the peer and its p2pd
                assert os.stat(f"/proc/{pid}/ns/net").st_ino == namespace, psutil.Process(pid).cmdline()
                if quota:
                    with open(f"/proc/{pid}/cgroup") as f:
                        assert os.path.basename(host.cgroup) in f.read()
            assert backbone.stop(grace=20) == 0

            nowhere = group.start(["--version"], "nowhere", lab_host=LabHost(netns=f"{host.netns}-missing"))
            assert nowhere.wait(30) == 1 and nowhere.stdout() == ""
            assert nowhere.stderr().strip().splitlines() == [
                f"error: [Errno 2] No such file or directory: '{NETNS_DIR}/{host.netns}-missing'"]
    finally:
        group.stop_all()


STARTER = """
import sys, time
from ravnest_swarm.launcher import Launcher
launcher = Launcher()
print(launcher.process.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(60)
def test_the_launcher_exits_when_its_starter_dies_without_stopping_it():
    starter = subprocess.Popen([sys.executable, "-c", STARTER], stdout=subprocess.PIPE, text=True)
    launcher = int(starter.stdout.readline())
    try:
        starter.kill()
        starter.wait(10)
        wait_until(lambda: not alive({launcher}), 30, "the launcher exits once its starter is gone")
    finally:
        starter.kill()
        kill_pids(alive({launcher}))
