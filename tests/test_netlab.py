"""The network lab's hosts: their own namespace and, when asked, their own share of the CPU."""

import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

from ravnest_swarm.bench.netlab import NetLab, cpu_quota_unavailable, namespaces_unavailable

# burns half a second of CPU, then prints the share of a core it got and its addresses
BURN = """
import subprocess, time
cpu, wall = time.process_time(), time.time()
while time.process_time() - cpu < 0.5:
    pass
print(0.5 / (time.time() - wall))
print(subprocess.run(["ip", "-4", "addr", "show", "eth0"], capture_output=True, text=True).stdout)
"""


CPU_QUOTA_UNAVAILABLE = namespaces_unavailable() or cpu_quota_unavailable()


# Not marked netns, whose skip is a failure in CI: a CI host with iproute2 and iptables may have only
# cgroup v2, where no host can get a quota; the netns tests already fail there if namespaces do not work.
@pytest.mark.timeout(60)
@pytest.mark.skipif(CPU_QUOTA_UNAVAILABLE is not None, reason=f"needs namespaces and a cgroup v1 cpu controller: {CPU_QUOTA_UNAVAILABLE}")
def test_a_host_with_a_cpu_quota_gets_that_share_and_nothing_is_left_behind():
    with NetLab(2, cpus=0.25) as lab:
        done = subprocess.run(lab.lab_host(1).prefix() + [sys.executable, "-c", BURN], capture_output=True, text=True,
                              timeout=30)
        cgroup = lab.cgroup(1)
        assert os.path.isdir(cgroup)
    assert done.returncode == 0, done.stderr
    share, addresses = done.stdout.split("\n", 1)
    # the quota is a ceiling: a loaded machine may give less, never more (10 ms periods, so little slack)
    assert 0.02 < float(share) < 0.32, share
    assert lab.host_ip(1) in addresses
    assert not os.path.exists(cgroup)


@pytest.mark.timeout(60)
def test_the_delay_relay_holds_each_direction_for_the_delay_and_keeps_every_byte():
    delay_ms, payload = 100, os.urandom(4 << 20)
    with NetLab(1, delay_ms=delay_ms, ports=[0], use_namespaces=False) as lab:
        with socket.create_server(("127.0.0.1", lab.listen_port(0))) as server:
            echo = threading.Thread(target=_echo_once, args=(server, len(payload)), daemon=True)
            echo.start()
            started = time.monotonic()
            with socket.create_connection(("127.0.0.1", lab.relay_port(0)), timeout=30) as client:
                client.sendall(payload)
                received = _receive(client, len(payload))
            elapsed = time.monotonic() - started
        relay = lab._relay
    assert received == payload
    assert elapsed >= 2 * delay_ms / 1000, elapsed  # there and back, each held the full delay
    assert relay.poll() is not None  # closing the lab stopped the relay


def test_a_relay_that_cannot_listen_says_why():
    lab = NetLab(1, delay_ms=10, ports=[0], use_namespaces=False)
    with socket.create_server(("127.0.0.1", lab.relay_port(0))):  # the relay's port, taken
        with pytest.raises(RuntimeError, match=r"delay relays failed to start: OSError: \[Errno 98\].*in use"):
            lab.__enter__()
    assert lab._relay.poll() is not None


def test_without_iproute2_the_lab_says_why_and_runs_on_loopback(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no ip, no tc
    reason = namespaces_unavailable()
    assert reason == ("ip and tc not found (apt-get install iproute2)" if os.geteuid() == 0 else "not root")
    lab = NetLab(1, ports=[0])  # nothing starts before the lab is entered
    assert lab.mode == "loopback" and lab.loopback_reason == reason
    with pytest.raises(RuntimeError, match=f"network namespaces are not possible here: {re.escape(reason)}"):
        NetLab(1, ports=[0], use_namespaces=True)


def _echo_once(server: socket.socket, size: int) -> None:
    connection, _ = server.accept()
    with connection:
        connection.sendall(_receive(connection, size))


def _receive(connection: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = connection.recv(min(left, 1 << 20))
        assert chunk, "connection closed early"
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
