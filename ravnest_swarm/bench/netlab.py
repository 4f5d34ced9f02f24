"""A network lab on one machine: hosts in network namespaces with rate-limited, delayed links.

Over 400 lines because namespaces, links, shaping, the delay relay and CPU quotas are one lab whose
teardown must undo every one of them.

Topology (root needed; addresses only inside 198.18.0.0/15)::

    host i (netns)  eth0 198.18.i.2/24 ──veth── hub (netns) veth{i} 198.18.i.1/24
                                                └── delay relay: 198.18.i.1:relay_port -> 198.18.i.2:port

* Each host has one access link to the hub. ``tc tbf`` on both ends limits it to ``mbps`` in each
  direction (like a home connection). The hub does not forward between hosts (``ip_forward`` stays 0),
  so hosts reach each other only through the hub's delay relays.
* The kernel here has no ``netem``, so latency comes from a userspace TCP relay in the hub: it holds
  every chunk for ``delay_ms`` before passing it on, in each direction. A host announces the relay's
  address (``announce_maddrs``), so every connection into it crosses the relay: ``delay_ms`` is the
  one-way delay between two hosts, the round trip is twice that.
* Without root (or without ``ip``), the lab runs on 127.0.0.1 with the same relays and no rate limit,
  and :attr:`NetLab.mode` says ``"loopback"``.
* Optionally each host also gets its own CPU (``cpus``): a cgroup with a CFS quota of that many cores,
  which every process started on :meth:`NetLab.lab_host` (and its children, such as p2pd) joins.
  Hosts on one machine otherwise share its cores, so a host that idles lends its CPU to the others,
  which separate computers cannot do. The relays stay outside: they are the network.

Everything is removed on exit, even after a failure; namespaces left by a killed earlier lab (its pid
gone) are removed on the next start.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import deque
from typing import List, Optional, Sequence

from ravnest_swarm.launcher import LabHost

LAB_PREFIX = "rvlab"
HUB_SUFFIX = "hub"
LISTEN_PORT = 40000
RELAY_PORT = 41000
CPU_CGROUP = "/sys/fs/cgroup/cpu"  # cgroup v1's cpu controller, as mounted here
CPU_PERIOD_US = 10_000  # a short period: a host over its quota waits at most one period minus its share


def namespaces_unavailable() -> Optional[str]:
    """None if the lab can create namespaces (root, iproute2's ``ip`` and ``tc``), else why it cannot."""
    if os.geteuid() != 0:
        return "not root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (apt-get install iproute2)"
    return None


def namespaces_available() -> bool:
    return namespaces_unavailable() is None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {result.stderr.strip()}")
    return result


def cpu_quota_unavailable() -> Optional[str]:
    """None if hosts can get a CPU quota each (root, a writable cgroup v1 cpu controller), else why not."""
    if os.geteuid() != 0:
        return "not root"
    if not os.access(os.path.join(CPU_CGROUP, "cpu.cfs_quota_us"), os.W_OK):
        only_v2 = os.path.exists("/sys/fs/cgroup/cgroup.controllers")  # the unified hierarchy's root file
        return f"no cgroup v1 cpu controller at {CPU_CGROUP}" + (", only cgroup v2" if only_v2 else "")
    return None


def cpu_quota_available() -> bool:
    return cpu_quota_unavailable() is None


def remove_stale_labs() -> None:
    """Delete namespaces and CPU cgroups of labs whose owning process no longer exists."""
    listing = _run("ip", "netns", "list", check=False).stdout
    for name in re.findall(rf"^({LAB_PREFIX}(\d+)-\S+)", listing, re.MULTILINE):
        namespace, pid = name
        if not os.path.exists(f"/proc/{pid}"):
            _run("ip", "netns", "del", namespace, check=False)
    if os.path.isdir(CPU_CGROUP):
        for name in os.listdir(CPU_CGROUP):
            found = re.match(rf"{LAB_PREFIX}(\d+)-", name)
            if found and not os.path.exists(f"/proc/{found.group(1)}"):
                _remove_cgroup(os.path.join(CPU_CGROUP, name))


def _remove_cgroup(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:  # processes still in it (a test that failed to stop them): leave it to the next start
        pass


class NetLab:
    """Hosts on emulated links; use as a context manager.

    :param hosts: number of hosts
    :param mbps: access-link rate of every host in Mbit/s, each direction (None: unlimited)
    :param delay_ms: one-way delay between any two hosts, added by the hub's relays
    :param ports: the TCP ports each host listens on that others should reach (each gets a relay)
    :param use_namespaces: None = namespaces when possible, else loopback; False forces loopback
    :param cpus: CPU cores each host may use (a cgroup quota; needs root), or None for no limit
    """

    def __init__(self, hosts: int, mbps: Optional[float] = None, delay_ms: float = 0.0,
                 ports: Sequence[int] = (LISTEN_PORT, LISTEN_PORT + 1), use_namespaces: Optional[bool] = None,
                 cpus: Optional[float] = None):
        if hosts < 1 or hosts > 250:
            raise ValueError("a lab has 1-250 hosts")
        no_quota = cpu_quota_unavailable() if cpus is not None else None
        if no_quota:
            raise RuntimeError(f"a CPU quota per host is not possible here: {no_quota}")
        self.hosts, self.mbps, self.delay_ms, self.ports, self.cpus = hosts, mbps, delay_ms, list(ports), cpus
        #: why the lab runs on loopback (None when it has namespaces)
        self.loopback_reason = namespaces_unavailable() if use_namespaces is not False else "asked for loopback"
        if use_namespaces and self.loopback_reason:
            raise RuntimeError(f"network namespaces are not possible here: {self.loopback_reason}")
        self.mode = "loopback" if self.loopback_reason else "netns"
        self.tag = f"{LAB_PREFIX}{os.getpid()}-{random.randrange(16**4):04x}"
        self._loopback_base = random.randrange(20000, 50000, 100)
        self._relay: Optional[subprocess.Popen] = None
        self._relay_log = None  # the relay's stderr: a file, since a pipe nobody reads would stall it when full
        self._namespaces: List[str] = []
        self._cgroups: List[str] = []

    # addresses -------------------------------------------------------------------------------
    @property
    def hub(self) -> str:
        return f"{self.tag}-{HUB_SUFFIX}"

    def namespace(self, host: int) -> str:
        return f"{self.tag}-h{host}"

    def host_ip(self, host: int) -> str:
        return f"198.18.{host + 1}.2" if self.mode == "netns" else "127.0.0.1"

    def hub_ip(self, host: int) -> str:
        return f"198.18.{host + 1}.1" if self.mode == "netns" else "127.0.0.1"

    def listen_port(self, host: int, index: int = 0) -> int:
        if self.mode == "netns":
            return self.ports[index]
        return self._loopback_base + 10 * host + index

    def relay_port(self, host: int, index: int = 0) -> int:
        if self.mode == "netns":
            return RELAY_PORT + 10 * host + index
        return self._loopback_base + 5000 + 10 * host + index

    def host_maddr(self, host: int, index: int = 0) -> str:
        """Where host's process should listen (``--host-maddrs``)."""
        return f"/ip4/{self.host_ip(host)}/tcp/{self.listen_port(host, index)}"

    def announce_maddr(self, host: int, index: int = 0) -> str:
        """What host's process should announce (``--announce-maddrs``): its relay in the hub."""
        return f"/ip4/{self.hub_ip(host)}/tcp/{self.relay_port(host, index)}"

    def cgroup(self, host: int) -> str:
        return os.path.join(CPU_CGROUP, f"{self.tag}-{host}")

    def lab_host(self, host: int) -> LabHost:
        """Where a process of ``host`` runs (``ProcessGroup.start(lab_host=...)``; ``.prefix()`` for a command):
        its namespace and CPU cgroup, neither on loopback without a CPU quota."""
        return LabHost(netns=self.namespace(host) if self.mode == "netns" else None,
                       cgroup=self.cgroup(host) if self.cpus is not None else None)

    def describe(self) -> dict:
        description = {"mode": self.mode, "hosts": self.hosts, "mbps": self.mbps, "delay_ms": self.delay_ms,
                       "delay_is": "one-way, per host pair, userspace relay", "rate_is": "tc tbf, each direction"}
        if self.cpus is not None:
            description.update(cpus_per_host=self.cpus, cpu_is=f"cgroup CFS quota, {CPU_PERIOD_US} us period")
        return description

    # lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> "NetLab":
        try:
            if self.mode == "netns":
                self._create_namespaces()
            if self.cpus is not None:
                self._create_cgroups()
            self._start_relays()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _create_namespaces(self) -> None:
        remove_stale_labs()
        for namespace in [self.hub] + [self.namespace(h) for h in range(self.hosts)]:
            _run("ip", "netns", "add", namespace)
            self._namespaces.append(namespace)
            _run("ip", "-n", namespace, "link", "set", "lo", "up")
        for host in range(self.hosts):
            namespace, port = self.namespace(host), f"veth{host}"
            _run("ip", "-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", namespace)
            _run("ip", "-n", self.hub, "addr", "add", f"{self.hub_ip(host)}/24", "dev", port)
            _run("ip", "-n", self.hub, "link", "set", port, "up")
            _run("ip", "-n", namespace, "addr", "add", f"{self.host_ip(host)}/24", "dev", "eth0")
            _run("ip", "-n", namespace, "link", "set", "eth0", "up")
            _run("ip", "-n", namespace, "route", "add", "default", "via", self.hub_ip(host))
            if self.mbps:
                for ns, dev in ((namespace, "eth0"), (self.hub, port)):
                    _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *tbf_args(self.mbps))

    def _create_cgroups(self) -> None:
        if self.mode != "netns":
            remove_stale_labs()
        for host in range(self.hosts):
            path = self.cgroup(host)
            os.mkdir(path)
            self._cgroups.append(path)
            quota_us = int(self.cpus * CPU_PERIOD_US)  # above the period for more than one core
            for name, value in (("cpu.cfs_period_us", CPU_PERIOD_US), ("cpu.cfs_quota_us", quota_us)):
                with open(os.path.join(path, name), "w") as f:
                    f.write(str(value))

    def _start_relays(self) -> None:
        routes = []
        for host in range(self.hosts):
            for index in range(len(self.ports)):
                # in the hub, listen on every address: a host's dial-back may arrive on any hub link
                listen_ip = "0.0.0.0" if self.mode == "netns" else "127.0.0.1"
                routes.append(f"{listen_ip}:{self.relay_port(host, index)}="
                              f"{self.host_ip(host)}:{self.listen_port(host, index)}")
        prefix = ["ip", "netns", "exec", self.hub] if self.mode == "netns" else []
        self._relay_log = tempfile.TemporaryFile("w+")
        self._relay = subprocess.Popen(
            [*prefix, sys.executable, "-m", "ravnest_swarm.bench.netlab", "--delay-ms", str(self.delay_ms), *routes],
            stdout=subprocess.PIPE, stderr=self._relay_log, text=True, start_new_session=True,
        )
        line = self._relay.stdout.readline()
        if not line.startswith("relays ready"):
            self._relay.wait()
            self._relay_log.seek(0)
            last_line = (self._relay_log.read().strip().splitlines() or [line or "no output"])[-1]
            raise RuntimeError(f"delay relays failed to start: {last_line}")

    def close(self) -> None:
        if self._relay is not None and self._relay.poll() is None:
            os.killpg(self._relay.pid, signal.SIGKILL)
            self._relay.wait()
        if self._relay_log is not None:
            self._relay_log.close()
            self._relay_log = None
        for namespace in reversed(self._namespaces):
            _run("ip", "netns", "del", namespace, check=False)
        self._namespaces.clear()
        for path in self._cgroups:
            _remove_cgroup(path)
        self._cgroups.clear()


# the largest packet the kernel hands a qdisc with segmentation offload (GSO) is 64 KiB
GSO_MAX_BYTES = 64 * 1024


def tbf_args(mbps: float) -> List[str]:
    """``tc tbf`` for ``mbps``: a burst of at least one 4 ms slice and a queue deep enough for TCP.

    The burst also holds two of the largest offloaded packets: tbf cuts a packet bigger than its burst
    into MTU-sized ones in software, and at 50 KB (4 ms of 100 Mbit/s) that took a third of this
    machine's 2 cores during ``bench averaging``, CPU a real link never charges to its hosts. Over a
    transfer of seconds, 128 KiB of burst moves the average rate by well under 1 %.
    """
    burst = max(2 * GSO_MAX_BYTES, int(mbps * 1e6 / 8 / 250))
    return ["tbf", "rate", f"{mbps}mbit", "burst", str(burst), "latency", "200ms"]


# the delay relay process ---------------------------------------------------------------------
# It copies every byte of the lab, so it is written for little CPU per byte: protocol callbacks instead
# of stream coroutines and queues, whatever the kernel hands over in one read (up to 256 KiB), one timer
# per delay line, and every chunk that is due written in one call. Each chunk is still held exactly
# ``delay`` seconds after it arrived, never less, in order.
class _DelayLine:
    """Bytes one way through the relay: each chunk is written ``delay`` s after it was read (order kept)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, delay: float, on_finished):
        self.loop, self.delay, self.on_finished = loop, delay, on_finished
        self.target: Optional[asyncio.Transport] = None
        self.chunks: deque = deque()  # (due, bytes); b"" marks the end of stream
        self.timer: Optional[asyncio.TimerHandle] = None
        self.finished = False

    def push(self, data: bytes) -> None:
        if self.finished:
            return
        self.chunks.append((self.loop.time() + self.delay, data))
        if self.timer is None and self.target is not None:
            self._arm()

    def attach(self, target: asyncio.Transport) -> None:
        self.target = target
        if self.chunks and self.timer is None:
            self._arm()

    def _arm(self) -> None:
        self.timer = self.loop.call_at(self.chunks[0][0], self._flush)

    def _flush(self) -> None:
        self.timer = None
        now, batch, end = self.loop.time(), [], False
        while self.chunks and self.chunks[0][0] <= now:
            data = self.chunks.popleft()[1]
            if not data:
                end = True
                break
            batch.append(data)
        if batch and not self.target.is_closing():
            self.target.write(batch[0] if len(batch) == 1 else b"".join(batch))
        if end:
            # half-close: the other direction may still be sending
            if not self.target.is_closing() and self.target.can_write_eof():
                self.target.write_eof()
            self.finish()
        elif self.chunks:
            self._arm()

    def finish(self) -> None:
        if not self.finished:
            self.finished = True
            self.chunks.clear()
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            self.on_finished()


class _RelaySide(asyncio.Protocol):
    """One socket of a relayed connection: what it reads goes into ``outgoing``."""

    def __init__(self, connection: "_RelayConnection", outgoing: _DelayLine):
        self.connection, self.outgoing = connection, outgoing
        self.transport: Optional[asyncio.Transport] = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.outgoing.push(data)

    def eof_received(self) -> bool:
        self.outgoing.push(b"")
        return True  # keep the socket open for the other direction

    def connection_lost(self, exc: Optional[Exception]) -> None:
        if exc is not None:
            self.connection.abort()  # a reset on one side resets the other
        else:
            self.outgoing.push(b"")
            self.connection.lost(self)


class _RelayConnection:
    """A client connection to a relay port and its upstream connection to the target host."""

    def __init__(self, loop: asyncio.AbstractEventLoop, delay: float, target_host: str, target_port: int):
        self.loop = loop
        self.upward = _DelayLine(loop, delay, self._maybe_close)  # client -> target
        self.downward = _DelayLine(loop, delay, self._maybe_close)  # target -> client
        self.client = _RelaySide(self, self.upward)
        self.upstream = _RelaySide(self, self.downward)
        loop.create_task(self._connect(target_host, target_port))

    async def _connect(self, host: str, port: int) -> None:
        try:
            await self.loop.create_connection(lambda: self.upstream, host, port)
        except OSError:
            self.abort()
            return
        self.upward.attach(self.upstream.transport)
        if self.client.transport is not None and not self.client.transport.is_closing():
            self.downward.attach(self.client.transport)
        else:
            self.abort()

    def lost(self, side: _RelaySide) -> None:
        # nothing more can be written to a closed socket
        (self.downward if side is self.client else self.upward).finish()

    def _maybe_close(self) -> None:
        if self.upward.finished and self.downward.finished:
            for side in (self.client, self.upstream):
                if side.transport is not None:
                    side.transport.close()

    def abort(self) -> None:
        for line in (self.upward, self.downward):
            line.finished = True
            line.chunks.clear()
            if line.timer is not None:
                line.timer.cancel()
        for side in (self.client, self.upstream):
            if side.transport is not None:
                side.transport.abort()


async def _serve_relays(routes: List[str], delay: float) -> None:
    loop = asyncio.get_running_loop()
    servers = []
    for route in routes:
        listen, target = route.split("=")
        listen_host, listen_port = listen.rsplit(":", 1)
        target_host, target_port = target.rsplit(":", 1)

        def accept(target_host=target_host, target_port=int(target_port)) -> asyncio.Protocol:
            return _RelayConnection(loop, delay, target_host, target_port).client

        servers.append(await loop.create_server(accept, listen_host, int(listen_port)))
    print("relays ready", flush=True)
    await asyncio.gather(*(server.serve_forever() for server in servers))


def main() -> None:
    parser = argparse.ArgumentParser(description="TCP relays that add a fixed one-way delay (no netem here)")
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("routes", nargs="+", help="LISTEN_HOST:PORT=TARGET_HOST:PORT")
    args = parser.parse_args()
    try:
        import uvloop  # hivemind depends on it; its event loop costs less CPU per relayed chunk

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    asyncio.run(_serve_relays(args.routes, args.delay_ms / 1000))


if __name__ == "__main__":
    main()
