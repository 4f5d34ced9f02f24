"""Light peers: many membership peers in one OS process, so that ``bench membership`` can run a hundred and more.

A light peer is what ``join`` is up to its heartbeat, and nothing more: a real hivemind DHT node on its own p2pd
(``net.node.start_node_patiently``, with the run's validators, ``records.make_validators``, under its own identity:
one RSA key for its p2pd and its records, ``net/identity.py``), running the real :class:`~ravnest_swarm.membership.announcer.PeerAnnouncer` (publish and refresh_view every
heartbeat, ``heartbeat_forever``). It has no trainer and measures nothing: its capabilities are given. hivemind
imports torch, so the host process imports it too; it does no torch work.

Each light peer signs with a key of its own: peers sharing a process would otherwise write under one subkey and
replace one another's records. The peers of a process share the digests of the records their validators accepted
(``net.node.ValidRecords``): a record that one of them checked, the others take without a second RSA check, as a
peer on a machine of its own would pay for its own reads only.

A host process (:func:`run_light_host`, started by :class:`LightHosts` with ``ProcessGroup.start_library``)
writes JSON lines on stdout:

* ``{"event": "started", "peer": NAME, "peer_id": ..., "t": ...}`` once its first record is published;
* ``{"event": "views", "t": ..., "views": {NAME: [names of its members], ...}, "record_ages": {NAME: seconds}}``
  every report period (at most a heartbeat): each peer's ``announcer.members()`` at that moment, and how long ago
  it last renewed its own record;
* ``{"event": "killed", "peer": ..., "last_publish": ..., "lifetime": ...}``, ``{"event": "left", ...}``,
  ``{"event": "failed", "peer": ..., "error": ...}``;

and reads commands on stdin, one a line: ``kill NAME`` (stop that peer abruptly: no ``leaving`` record; its node
and p2pd stop), ``start NAME`` (a fresh peer). SIGTERM or SIGINT: every peer leaves (a ``leaving`` record), then
the process exits; so does the end of stdin (whoever sent the commands is gone). Every p2pd it started is
stopped; the host runs in its own session, so ``ProcessGroup`` stopping it by pid stops them even after SIGKILL.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

from hivemind.utils.timed_storage import get_dht_time

from ravnest_swarm.lifecycle import configure_logging, install_stop_signals, run_async
from ravnest_swarm.membership.announcer import PeerAnnouncer
from ravnest_swarm.membership.capabilities import Capabilities
from ravnest_swarm.membership.records import make_validators
from ravnest_swarm.net.identity import open_identity
from ravnest_swarm.net.node import ValidRecords, parse_maddrs, start_node_patiently, stop_node
from ravnest_swarm.processes import PeerProcess, ProcessGroup

logger = logging.getLogger(__name__)

CAPABILITIES = Capabilities(ram_gb=4.0, gflops=10.0, bandwidth_mbps=100.0, reachability="direct", device="cpu",
                            device_memory_gb=4.0)


@dataclass
class LightHostOptions:
    """One host process of light peers.

    :param initial_peers: the backbone(s) every peer bootstraps from
    :param names: the peers it starts at once
    :param report_period: seconds between reports of every peer's view (at most a heartbeat)
    :param concurrency: peers starting at the same time (each starts a p2pd and bootstraps)
    """

    initial_peers: List[str]
    run: str
    names: List[str]
    heartbeat: float = 5.0
    report_period: float = 2.5
    host: str = "127.0.0.1"
    timeout: float = 15.0
    patience: float = 300.0
    concurrency: int = 2
    verbose: bool = False


class LightPeer:
    """One membership peer: its node, its announcer and the task that renews its record."""

    def __init__(self, name: str):
        self.name = name
        self.node = None
        self.announcer: Optional[PeerAnnouncer] = None
        self.ready = False  # its first record is published and its heartbeats run
        self._heartbeats: Optional[asyncio.Task] = None

    async def start(self, options: LightHostOptions, valid_records: ValidRecords) -> None:
        """As ``Membership.start`` does, without measuring: node, record, bucket count, first publish, heartbeats."""
        def waiting(reason: str, attempt: int, wait: float, left: float) -> None:
            logger.info(f"{self.name}: waiting for the initial peers (attempt {attempt}: {reason}); again in {wait:.0f}s")

        identity = open_identity(None)  # each light peer its own, for p2pd and its records, as a volunteer's
        self.node = await start_node_patiently(
            parse_maddrs(options.initial_peers), options.patience, waiting,
            record_validators=make_validators(options.run, signing_key=identity.key), valid_records=valid_records,
            host_maddrs=[f"/ip4/{options.host}/tcp/0"], identity=identity, timeout=options.timeout)
        self.announcer = PeerAnnouncer(self.node, options.run, self.name, CAPABILITIES, options.heartbeat)
        maddrs = [str(m) for m in await self.node.p2p.get_visible_maddrs()]
        self.announcer.update(state="standby", maddrs=maddrs[:16])
        await self.announcer.find_bucket_count()
        await self.announcer.publish()
        self._heartbeats = asyncio.create_task(self.announcer.heartbeat_forever())
        self.ready = True

    async def _stop_heartbeats(self) -> None:
        if self._heartbeats is not None:
            self._heartbeats.cancel()
            await asyncio.gather(self._heartbeats, return_exceptions=True)

    async def kill(self) -> None:
        """Stop abruptly: no ``leaving`` record, so it stays in views until its last record expires."""
        await self._stop_heartbeats()
        if self.node is not None:
            await stop_node(self.node)

    async def leave(self, timeout: float) -> None:
        await self._stop_heartbeats()
        if self.announcer is not None:
            try:
                await asyncio.wait_for(self.announcer.leave(), timeout)
            except Exception as e:
                logger.warning(f"{self.name}: could not publish 'leaving': {e}")
        if self.node is not None:
            await stop_node(self.node)


def _say(event: str, **fields) -> None:
    print(json.dumps(dict(event=event, t=time.time(), **fields)), flush=True)


class LightHost:
    """The peers of one host process, the commands it takes and the views it reports."""

    def __init__(self, options: LightHostOptions):
        self.options = options
        self.peers: Dict[str, LightPeer] = {}
        self._starting = asyncio.Semaphore(options.concurrency)
        self._tasks: Set[asyncio.Task] = set()
        # one run's validators, alike but for the signing key: a record one peer here checked, the others take
        # without checking it again (on the internet each peer has a CPU of its own for its reads)
        self.valid_records = ValidRecords()

    def start_peer(self, name: str) -> None:
        if name in self.peers:
            _say("failed", peer=name, error="a peer of this name already runs here")
            return
        peer = self.peers[name] = LightPeer(name)
        task = asyncio.create_task(self._start(peer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _start(self, peer: LightPeer) -> None:
        async with self._starting:
            try:
                await peer.start(self.options, self.valid_records)
            except Exception as e:  # one peer that cannot start is reported; the others go on
                self.peers.pop(peer.name, None)
                await peer.kill()
                _say("failed", peer=peer.name, error=str(e) or type(e).__name__)
                return
        _say("started", peer=peer.name, peer_id=peer.announcer.peer_id, pid=os.getpid(),
             p2pd_pid=_p2pd_pid(peer.node))

    async def kill_peer(self, name: str) -> None:
        peer = self.peers.get(name)
        if peer is None or not peer.ready:
            # one still starting is not killed half-way: its start would go on and publish after the kill
            _say("failed", peer=name, error="no such peer here" if peer is None else "still starting")
            return
        del self.peers[name]
        last_publish, lifetime = peer.announcer.record.get("time"), peer.announcer.timing.lifetime
        await peer.kill()
        _say("killed", peer=name, last_publish=last_publish, lifetime=lifetime)

    async def report_forever(self) -> None:
        while True:
            await asyncio.sleep(self.options.report_period)
            ready = {name: peer for name, peer in self.peers.items() if peer.ready}
            views = {name: sorted(record["name"] for record in peer.announcer.members()) for name, peer in ready.items()}
            # how long ago each peer last renewed its record: past a lifetime, a busy machine has let it expire
            now = get_dht_time()
            ages = {name: round(now - peer.announcer.record["time"], 1) for name, peer in ready.items()}
            _say("views", views=views, record_ages=ages)

    async def read_commands(self, stop: asyncio.Event) -> None:
        reader = asyncio.StreamReader()
        await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while True:
            line = (await reader.readline()).decode(errors="replace")
            if not line:
                break
            verb, _, name = line.strip().partition(" ")
            if verb == "start" and name:
                self.start_peer(name)
            elif verb == "kill" and name:
                await self.kill_peer(name)
            else:
                _say("failed", peer=None, error=f"unknown command {line.strip()!r}: 'start NAME' or 'kill NAME'")
        stop.set()

    async def leave_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        peers = list(self.peers.values())
        await asyncio.gather(*(peer.leave(self.options.timeout) for peer in peers), return_exceptions=True)
        for peer in peers:
            _say("left", peer=peer.name)


def _p2pd_pid(node) -> Optional[int]:
    child = getattr(node.p2p, "_child", None)  # hivemind keeps the daemon's subprocess there
    return getattr(child, "pid", None)


def run_light_host(options: LightHostOptions) -> int:
    """A host process's whole life: start its peers, obey commands, report views; leave on SIGTERM or end of stdin."""
    configure_logging(options.verbose)

    async def main():
        stop = install_stop_signals()
        host = LightHost(options)
        for name in options.names:
            host.start_peer(name)
        workers = [asyncio.create_task(host.report_forever()), asyncio.create_task(host.read_commands(stop))]
        try:
            await stop.wait()
        finally:
            for worker in workers:
                worker.cancel()
            await host.leave_all()

    return run_async(main())


@dataclass
class HostedPeer:
    """What the bench knows of one light peer, from its host's lines."""

    host: PeerProcess
    started: Optional[float] = None  # wall-clock time its first record was published
    view: Optional[Set[str]] = None  # its latest reported members
    view_time: Optional[float] = None
    p2pd_pid: Optional[int] = None
    failed: Optional[str] = None


@dataclass
class LightHosts:
    """The bench's side: host processes of light peers, the commands it sends them and what they report."""

    group: ProcessGroup
    initial_peers: List[str]
    run: str
    heartbeat: float
    report_period: float
    peers: Dict[str, HostedPeer] = field(default_factory=dict)
    hosts: List[PeerProcess] = field(default_factory=list)
    killed: Dict[str, Tuple[float, float]] = field(default_factory=dict)  # name: (last publish, lifetime)
    record_ages: List[float] = field(default_factory=list)  # every reported age of a peer's own record
    _offsets: Dict[int, int] = field(default_factory=dict)
    _partial: Dict[int, bytes] = field(default_factory=dict)

    def start_host(self, names: List[str]) -> PeerProcess:
        options = LightHostOptions(initial_peers=self.initial_peers, run=self.run, names=list(names),
                                   heartbeat=self.heartbeat, report_period=self.report_period)
        host = self.group.start_library(run_light_host, options, f"light-host{len(self.hosts)}", stdin_pipe=True)
        self.hosts.append(host)
        for name in names:
            self.peers[name] = HostedPeer(host)
        return host

    def start_peer(self, name: str, host: PeerProcess) -> None:
        self.peers[name] = HostedPeer(host)
        host.send(f"start {name}")

    def kill_peer(self, name: str) -> None:
        self.peers.pop(name).host.send(f"kill {name}")

    def live(self) -> Set[str]:
        """Peers started and not killed (by the bench's commands; failed ones excluded)."""
        return {name for name, peer in self.peers.items() if peer.failed is None}

    def running(self) -> Set[str]:
        """Live peers whose first record is published (those a ``kill`` can stop)."""
        return {name for name in self.live() if self.peers[name].started is not None}

    def poll(self) -> List[Dict]:
        """Read what the hosts wrote since the last poll; update the peers; return the new ``views`` lines."""
        reports = []
        for host in self.hosts:
            for line in self._new_lines(host):
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # a line that is not ours (a library printing to stdout)
                name = event.get("peer")
                peer = self.peers.get(name)
                if event["event"] == "views":
                    reports.append(event)
                    self.record_ages.extend(event.get("record_ages", {}).values())
                    for viewer, members in event["views"].items():
                        if viewer in self.peers:
                            self.peers[viewer].view, self.peers[viewer].view_time = set(members), event["t"]
                elif event["event"] == "started" and peer is not None:
                    peer.started, peer.p2pd_pid = event["t"], event.get("p2pd_pid")
                elif event["event"] == "failed" and peer is not None:
                    peer.failed = event["error"]
                elif event["event"] == "killed":
                    self.killed[name] = (event["last_publish"], event["lifetime"])
        return reports

    def _new_lines(self, host: PeerProcess) -> List[str]:
        with open(host.stdout_path, "rb") as f:
            f.seek(self._offsets.get(host.pid, 0))
            data = self._partial.pop(host.pid, b"") + f.read()
            self._offsets[host.pid] = f.tell()
        *lines, rest = data.split(b"\n")
        if rest:
            self._partial[host.pid] = rest  # a line still being written
        return [line.decode(errors="replace") for line in lines if line]
