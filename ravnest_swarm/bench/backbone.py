"""``bench membership``: a hundred light peers on one backbone, then churn; how fast and how exactly views follow.

The peers are light peers (``bench/light.py``): real DHT nodes on their own p2pd running the real
``PeerAnnouncer``, many to an OS process, no trainer. Every host reports each peer's view (its ``members()``)
at least once a heartbeat; the bench compares every view with the set of live peers. It measures, in one run:

* ``converge``: from the last peer's start (its first record published) until every peer's view lists all of
  them (target: 2 heartbeats);
* ``stable``: for ``stable_seconds`` after that, every report of a view that missed a live peer (count, worst);
* ``churn``: every ``churn_every`` seconds ``churn_fraction`` of the peers are killed (no ``leaving`` record)
  and as many fresh ones started, ``churn_seconds / churn_every`` rounds, the first at once; the churn stops
  with the last round. From then: when every view lists every live peer (``new_seen_s``), when no view lists a
  killed one (``killed_gone_s``) and when every view equals the live set exactly (``exact_s``). A killed peer's
  record lives a full lifetime (three heartbeats) after its last renewal, and the view rule keeps it until then
  (``membership/view.py``), so ``killed_gone_s`` cannot be less than that record's remaining lifetime
  (``last_killed_expiry_s``, from the hosts' report of each killed peer's last renewal): the exact target of
  2 heartbeats is below what the rule allows, and the figures say by how much;
* the backbone's and the hosts' memory (PSS of each process tree, p2pd included), p2pd RSS per peer, the load
  average, the latency of ``read_peers`` from an observer node through the run, and ``status --json``'s wall time;
* ``status --json``'s wall time against a run of ``records`` peers (1,000 by default), whose records and
  summaries one signer writes into the light peers' DHT (``bench/records.py``): this machine hosts about 200 light
  peers, not a thousand, and ``status`` reads a large run's records, not its nodes.

Every process it starts (backbone, hosts and their p2pd) is stopped by pid, on failure and Ctrl-C too.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

import psutil
from rich.console import Console
from rich.progress import Progress

from ravnest_swarm.bench.light import LightHosts
from ravnest_swarm.bench.membership import tree_memory_mb
from ravnest_swarm.bench.records import write_run_records
from ravnest_swarm.errors import UserError
from ravnest_swarm.membership.announcer import FULL_VIEW_BUCKETS
from ravnest_swarm.membership.backbone import BackboneOptions, run_backbone_process
from ravnest_swarm.membership.buckets import PEERS_PER_BUCKET
from ravnest_swarm.membership.reader import read_peers
from ravnest_swarm.membership.records import make_validators
from ravnest_swarm.membership.view import LIFETIME_HEARTBEATS
from ravnest_swarm.net.node import parse_maddrs, start_node, stop_node
from ravnest_swarm.processes import ProcessGroup

RUN = "load"
RECORDS_RUN = "recorded"  # the run of ``records`` written records, beside the light peers' own
ERROR_RE = re.compile(r"^(error:|Traceback)", re.MULTILINE)
# beyond this many peers a peer reads only its own bucket (membership/announcer.py): no view lists everyone
FULL_VIEW_PEERS = FULL_VIEW_BUCKETS * PEERS_PER_BUCKET
POLL_PERIOD = 0.5


@dataclass
class MembershipBenchOptions:
    peers: int = 100
    peers_per_process: int = 20
    heartbeat: float = 5.0
    stable_seconds: float = 300.0
    churn_seconds: float = 300.0
    churn_every: float = 60.0
    churn_fraction: float = 0.1
    records: int = 1000
    seed: int = 0


def _percentiles(values: List[float]) -> Optional[Dict]:
    if not values:
        return None
    ordered = sorted(values)
    return {"median": round(statistics.median(ordered), 1), "p95": round(ordered[int(0.95 * (len(ordered) - 1))], 1),
            "max": round(ordered[-1], 1), "samples": len(ordered)}


@dataclass
class Samples:
    """What the background tasks measure through the run."""

    get_ms: List[float] = field(default_factory=list)
    get_failures: int = 0
    load: List[float] = field(default_factory=list)


class MembershipBench:
    def __init__(self, options: MembershipBenchOptions, console: Console):
        self.options, self.console = options, console
        self.group = ProcessGroup()
        self.rng = random.Random(options.seed)
        self.samples = Samples()
        self.hosts: Optional[LightHosts] = None
        self.backbone = None
        self.result: Dict = {}

    async def run(self) -> Dict:
        options = self.options
        observer, samplers = None, []
        try:
            self.backbone = self.group.start_library(
                run_backbone_process, BackboneOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"], runs=[RUN]), "backbone")
            maddr = self.backbone.maddrs(60)[0]
            self.hosts = LightHosts(self.group, [maddr], RUN, options.heartbeat,
                                    report_period=min(options.heartbeat / 2, 2.5))
            observer = await start_node(parse_maddrs([maddr]), record_validators=make_validators(RUN),
                                        client_mode=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            samplers = [asyncio.create_task(self._sample_gets(observer)), asyncio.create_task(self._sample_load())]
            with Progress(console=self.console, transient=True) as progress:
                self.progress = progress
                await self._start_all()
                await self._stable()
                self.result["status"] = await self._time_status(maddr, RUN)
                if options.records > 0:
                    self.result["status_of_records"] = await self._time_status_of_records(maddr)
                self.result["memory"] = self._memory()
                if options.churn_seconds > 0 and options.churn_fraction > 0:
                    await self._churn()
            self.result["errors_in_stderr"] = sum(len(ERROR_RE.findall(p.stderr())) for p in self.group.processes)
        finally:
            for task in samplers:
                task.cancel()
            await asyncio.gather(*samplers, return_exceptions=True)
            if observer is not None:
                await stop_node(observer)
            self.group.stop_all(grace=30.0)  # hosts publish 'leaving' for each peer, then stop their p2pd
        self.result["dht_read_peers_ms"] = dict(_percentiles(self.samples.get_ms) or {},
                                                failures=self.samples.get_failures)
        self.result["load_average_1min"] = _percentiles(self.samples.load)
        return self.result

    async def _poll_until(self, deadline: float, on_report=None, done=None) -> Optional[float]:
        """Read the hosts' reports until ``done()`` (then return the report time at which it became true) or
        ``deadline`` (wall clock; returns None)."""
        while time.time() < deadline:
            for report in self.hosts.poll():
                if on_report is not None:
                    on_report(report)
                if done is not None and done():
                    return report["t"]
            await asyncio.sleep(POLL_PERIOD)
        return None

    def _views_equal_live(self, exact: bool) -> bool:
        live = self.hosts.live()
        for name in live:
            view = self.hosts.peers[name].view
            if view is None or not (view == live if exact else view >= live):
                return False
        return True

    def _how_far(self) -> Dict:
        live = self.hosts.live()
        sizes = [len(self.hosts.peers[name].view or ()) for name in live]
        return {"views_complete": sum(size >= len(live) for size in sizes), "of": len(live),
                "smallest_view": min(sizes, default=0)}

    async def _start_all(self) -> None:
        options = self.options
        names = [f"p{index:04d}" for index in range(options.peers)]
        task = self.progress.add_task(f"starting {options.peers} light peers", total=options.peers)
        issued = time.time()
        for first in range(0, len(names), options.peers_per_process):
            self.hosts.start_host(names[first:first + options.peers_per_process])

        def started():
            peers = self.hosts.peers.values()
            self.progress.update(task, completed=sum(p.started is not None or p.failed is not None for p in peers))
            return all(p.started is not None or p.failed is not None for p in peers)

        if await self._poll_until(issued + 120 + 5 * options.peers, done=started) is None:
            raise UserError(f"not every light peer started within {120 + 5 * options.peers} s "
                            f"(logs in {self.group.log_dir})", 1)
        failed = {name: peer.failed for name, peer in self.hosts.peers.items() if peer.failed is not None}
        last_start = max(peer.started for peer in self.hosts.peers.values() if peer.started is not None)
        self.result.update(peers=options.peers, peers_per_process=options.peers_per_process,
                           heartbeat_s=options.heartbeat, start_s=round(last_start - issued, 1),
                           failed_to_start=len(failed), first_start_failure=next(iter(failed.values()), None))
        self.progress.update(task, visible=False)
        if options.peers > FULL_VIEW_PEERS:
            self.result["converge"] = {"note": f"beyond {FULL_VIEW_PEERS} peers a peer's view is its own bucket"}
            return
        task = self.progress.add_task("until every view lists every peer", total=None)
        limit = max(120.0, 20 * options.heartbeat)
        converged = await self._poll_until(last_start + limit, done=lambda: self._views_equal_live(exact=False))
        self.progress.update(task, visible=False)
        self.result["converge"] = {
            "from_last_start_s": None if converged is None else round(converged - last_start, 1),
            "heartbeats": None if converged is None else round((converged - last_start) / options.heartbeat, 2),
            "target_heartbeats": 2, "limit_s": limit, **({} if converged is not None else self._how_far())}

    async def _stable(self) -> None:
        options = self.options
        if options.stable_seconds <= 0:
            return
        task = self.progress.add_task(f"stable for {options.stable_seconds:.0f} s", total=options.stable_seconds)
        began = time.time()
        self.hosts.record_ages.clear()
        misses = dict(reports=0, reports_with_a_miss=0, missing_entries=0, worst_missing_in_one_view=0,
                      phantom_entries=0)
        missed: Set[str] = set()

        def on_report(report):
            live = self.hosts.live()
            self.progress.update(task, completed=min(options.stable_seconds, time.time() - began))
            for viewer, members in report["views"].items():
                if viewer not in live or report["t"] < began:
                    continue
                missing, phantoms = live - set(members), set(members) - live
                misses["reports"] += 1
                misses["phantom_entries"] += len(phantoms)
                if missing:
                    misses["reports_with_a_miss"] += 1
                    misses["missing_entries"] += len(missing)
                    misses["worst_missing_in_one_view"] = max(misses["worst_missing_in_one_view"], len(missing))
                    missed.update(missing)

        await self._poll_until(began + options.stable_seconds, on_report=on_report)
        self.progress.update(task, visible=False)
        # a peer's own record older than its lifetime has expired: the machine could not keep up with the heartbeats
        self.result["stable"] = dict(seconds=options.stable_seconds, peers_ever_missed=len(missed), **misses,
                                     own_record_age_s=_percentiles(self.hosts.record_ages),
                                     record_lifetime_s=LIFETIME_HEARTBEATS * options.heartbeat)

    async def _churn(self) -> None:
        options = self.options
        rounds = max(1, int(options.churn_seconds // options.churn_every))
        per_round = max(1, round(options.churn_fraction * options.peers))
        task = self.progress.add_task(f"churn: {rounds} round(s) of {per_round} killed and replaced", total=rounds)
        began, started_count = time.time(), 0
        last_killed: List[str] = []
        for number in range(rounds):
            await self._poll_until(began + number * options.churn_every)
            running = sorted(self.hosts.running())  # one still starting cannot be killed yet
            victims = self.rng.sample(running, min(per_round, len(running)))
            for victim in victims:
                host = self.hosts.peers[victim].host
                self.hosts.kill_peer(victim)
                self.hosts.start_peer(f"c{started_count:04d}", host)  # on the same host: hosts stay as loaded
                started_count += 1
            last_killed = victims
            self.progress.update(task, completed=number + 1)
        stopped = time.time()
        self.progress.update(task, visible=False)
        task = self.progress.add_task("after churn: until every view equals the live set", total=None)
        killed = set(self.hosts.killed) | set(last_killed)
        marks: Dict[str, Optional[float]] = {"new_seen": None, "killed_gone": None}

        def fresh_views():
            # only reports made after the churn stopped count, and every live peer must have started
            return all(peer.started is not None and peer.view_time is not None and peer.view_time >= stopped
                       for peer in (self.hosts.peers[name] for name in self.hosts.live()))

        def on_report(report):
            if not fresh_views():
                return
            live = self.hosts.live()
            views = [self.hosts.peers[name].view for name in live]
            if marks["new_seen"] is None and all(view >= live for view in views):
                marks["new_seen"] = report["t"]
            if marks["killed_gone"] is None and not any(view & killed for view in views):
                marks["killed_gone"] = report["t"]

        limit = max(120.0, 20 * options.heartbeat)
        exact = await self._poll_until(stopped + limit, on_report=on_report,
                                       done=lambda: fresh_views() and self._views_equal_live(exact=True))
        self.progress.update(task, visible=False)
        self.hosts.poll()
        expiries = [publish + lifetime for name, (publish, lifetime) in self.hosts.killed.items()
                    if name in last_killed and publish is not None]

        def since_stop(moment):
            return None if moment is None else round(moment - stopped, 1)

        self.result["churn"] = dict(
            rounds=rounds, killed_per_round=per_round, every_s=options.churn_every, kills=started_count,
            failed_to_start=sum(1 for name, peer in self.hosts.peers.items()
                                if name.startswith("c") and peer.failed is not None),
            new_seen_s=since_stop(marks["new_seen"]), killed_gone_s=since_stop(marks["killed_gone"]),
            exact_s=since_stop(exact), exact_heartbeats=None if exact is None else
            round((exact - stopped) / options.heartbeat, 2),
            last_killed_expiry_s=since_stop(max(expiries)) if expiries else None,
            target_heartbeats=2, limit_s=limit, **({} if exact is not None else self._how_far()))

    async def _time_status(self, maddr: str, run: str) -> Dict:
        """``ravnest-swarm status --json`` against ``run``: its wall time and how many peers it listed. Awaited, not
        run blocking: a Ctrl-C meanwhile stops it and the bench at once, not after its 120 s."""
        began = time.monotonic()
        status = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "ravnest_swarm", "status", "--initial-peers", maddr, "--run", run, "--json",
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            stdout, stderr = await asyncio.wait_for(status.communicate(), 120)
        except asyncio.TimeoutError:
            return {"wall_s": None, "error": "no answer within 120 s"}
        finally:
            if status.returncode is None:
                status.kill()
                await status.wait()
        wall = round(time.monotonic() - began, 2)
        try:
            document = json.loads(stdout)
        except ValueError:
            return {"wall_s": wall, "error": stderr.decode(errors="replace").strip()[-300:]}
        summary = document.get("summary") or {}
        return {"wall_s": wall, "peers_listed": len(document["peers"]), "summary_peers": summary.get("peers"),
                "summary_buckets": summary.get("buckets"), "target_s": 10}

    async def _time_status_of_records(self, maddr: str) -> Dict:
        """``status --json``'s wall time on a run of ``records`` written records (see the module's docstring)."""
        try:
            buckets = await write_run_records(maddr, RECORDS_RUN, self.options.records)
        except Exception as e:  # the light peers' figures stand without this one
            return {"error": f"writing {self.options.records} records failed: {e}"}
        return dict(await self._time_status(maddr, RECORDS_RUN), records=self.options.records, buckets=buckets)

    def _memory(self) -> Dict:
        """At full load: the backbone's and each host's process tree (PSS, p2pd included), p2pd RSS per peer."""
        hosts = [tree_memory_mb(host.pid) for host in self.hosts.hosts if host.popen.poll() is None]
        p2pd_rss = []
        for peer in self.hosts.peers.values():
            try:
                p2pd_rss.append(psutil.Process(peer.p2pd_pid).memory_info().rss / 2**20)
            except (psutil.Error, TypeError, ValueError):
                continue  # gone, or never started
        host_python_rss = []
        for host in self.hosts.hosts:
            try:
                host_python_rss.append(psutil.Process(host.pid).memory_info().rss / 2**20)
            except psutil.Error:
                continue
        return {"backbone_mb": tree_memory_mb(self.backbone.pid),
                "hosts_pss_mb_total": round(sum(h["pss"] for h in hosts), 1),
                "host_processes": len(hosts),
                "host_python_rss_mb": _percentiles(host_python_rss),
                "p2pd_rss_mb_per_peer": _percentiles(p2pd_rss),
                "machine_used_mb": round((psutil.virtual_memory().total - psutil.virtual_memory().available) / 2**20)}

    async def _sample_gets(self, observer) -> None:
        while True:
            began = time.perf_counter()
            try:
                await asyncio.wait_for(read_peers(observer, RUN), 30)
                self.samples.get_ms.append((time.perf_counter() - began) * 1000)
            except Exception:  # a read that fails or hangs is counted, and the next one tried
                self.samples.get_failures += 1
            await asyncio.sleep(2.0)

    async def _sample_load(self) -> None:
        while True:
            self.samples.load.append(os.getloadavg()[0])
            await asyncio.sleep(5.0)


async def bench_membership(options: MembershipBenchOptions, as_json: bool) -> int:
    console = Console(stderr=True)
    result = await MembershipBench(options, console).run()
    result = {"benchmark": "membership", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **result}
    if as_json:
        print(json.dumps(result), flush=True)
    else:
        console.print_json(json.dumps(result))
    return 0
