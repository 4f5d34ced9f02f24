"""``bench speedup``: the same stages trained by K = 1, 2 and 4 clusters, side by side, on the lab's links and CPUs,
in each of several training schemes (``--schemes``: today's and the new one by default).

For each K a fresh :class:`~ravnest_swarm.bench.netlab.NetLab` gives every peer a host of its own: the same access
link (``tc tbf`` rate, the relay's one-way delay) and the same CPU quota (a cgroup) for every K, as if each
peer were a separate computer. K x S real ``join`` processes and a backbone train one run. Every peer offers
RAM for 1.2 / S of the model (the planner's stage share limit), so S - 1 peers cannot hold it and S can, and
all offer the same compute and bandwidth: the plan is K clusters of S stages (checked; anything else is an
error). Each K trains the same number of samples (``samples``): a stage's length is samples / (K x microbatch
size) steps, so at K = 4 each cluster trains a quarter of the steps of K = 1 (at the run's lr as its
``lr_scaling`` scales it for K: ``docs/swarm.md``).

A scheme is a named set of run-spec settings (``speedup_schemes.py``: today's, the new one, or the user's own):
every (K, scheme) trains in a lab of its own, K by K, the schemes of one K one after the other. The first scheme is
the reference: its K = 1's held-out loss at the end (or at ``target_samples``, where every K trains on past it to show
the samples it needs) is the target every run is timed to.

Throughput: the samples every cluster's stage 0 completed, over the time from the first injection of any
cluster to the last completion of any (the peers' reports, ``join --report``): averaging rounds, and a
cluster that starts or ends late, count against it. Held-out loss: the clusters' final weights averaged layer
by layer (what the next averaging round would give every cluster), on the model's held-out split. Along the way:
every peer checkpoints ``CURVE_POINTS`` times in the run, a watcher keeps a copy of each checkpoint as it is
written, and each step at which every peer's copy exists is a point of the held-out curve, at the samples the
clusters trained by then and the wall time since the first injection at which the last of those checkpoints was
written: what a user waits for to reach the target loss (``speedup_curve.py``).

What bounds it, measured per K over that window: each peer's CPU use (its process tree, p2pd included)
against its quota, the share of quota periods in which its host was throttled, the machine's CPU busy share
(every process on it, other work included), each stage's busy share, the time averaging rounds took, and the share
of its time each stage stood still for averaging (its wall time's ``averaging`` use: with ``averaging_overlap`` a
round runs beside training, and only the wait for a round still running counts).
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import time
from bisect import bisect_left
from typing import Any, Dict, List, Optional, Sequence, Tuple

import psutil
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from ravnest_swarm.checkpoint import read_stage
from ravnest_swarm.errors import UserError
from ravnest_swarm.models import ModelSpec, get_model
from ravnest_swarm.bench.pipeline import busy_fraction
from ravnest_swarm.bench.speedup_curve import (CheckpointHistory, check_target_samples, checkpoint_every,
                                                heldout_figures, layer_states, target_loss)
from ravnest_swarm.bench.speedup_schemes import SCHEME_KEYS, compare, parse_schemes, stood_still_share, summary_table
from ravnest_swarm.membership.backbone import BackboneOptions, run_backbone_process
from ravnest_swarm.swarm.join import JoinOptions, run_join
from ravnest_swarm.swarm.placement import MAX_STAGE_SHARE, model_workload
from ravnest_swarm.swarm.spec import RunSpec

RUN = "speedup"
PLACED_RE = re.compile(r"^(peer\d+): training cluster (\d+) stage (\d+)/(\d+) layers (\d+):(\d+)", re.MULTILINE)
# a plan that dropped a cluster renumbered this one in place: a later plan all the same
RENUMBERED_RE = re.compile(r"^peer\d+: plan round \d+ keeps us in place: cluster \d+ \(cluster \d+ before\)",
                           re.MULTILINE)
GFLOPS = 20.0  # every peer claims the same compute: the plan must not favour one
POLL_S = 0.5


def parse_clusters(text: str) -> List[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``; K = 1 must be among them, as the ratios are to it."""
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise UserError(f"--clusters must be whole numbers separated by commas, like 1,2,4, not {text!r}")
    if not values or values[0] != 1 or values[-1] > 16:
        raise UserError(f"--clusters must include 1 (the ratios are to K = 1) and stay within 1-16, not {text!r}")
    return values


def steps_per_cluster(samples: int, clusters: Sequence[int], microbatch_size: int) -> Dict[int, int]:
    """Each K's run length in optimizer steps, so that every K trains exactly ``samples`` samples."""
    unit = math.lcm(*clusters) * microbatch_size
    if samples % unit:
        raise UserError(f"--samples {samples} does not split into whole {microbatch_size}-sample steps for every K: "
                        f"use a multiple of {unit}, e.g. {max(unit, samples // unit * unit)}")
    return {k: samples // (k * microbatch_size) for k in clusters}


def default_cpus_per_peer(clusters: Sequence[int], stages: int) -> float:
    """What the largest K fits in: 90 % of the machine's cores over its peers and the backbone (the rest is for
    the delay relay and this process), at most one core (a peer computes on one)."""
    hosts = max(clusters) * stages + 1
    return round(min(1.0, 0.9 * (os.cpu_count() or 1) / hosts), 3)


def tree_cpu_seconds(pid: int) -> Optional[float]:
    """User + system CPU seconds of a process and its children (a peer and its p2pd); None once it is gone."""
    try:
        process = psutil.Process(pid)
        tree = [process] + process.children(recursive=True)
    except psutil.Error:
        return None
    total = 0.0
    for member in tree:
        try:
            total += sum(member.cpu_times()[:2])  # user + system
        except psutil.Error:
            continue
    return total


def machine_busy_seconds() -> Tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, every core and process counted."""
    times = psutil.cpu_times()
    total = sum(times)
    return total - times.idle - getattr(times, "iowait", 0.0), total


def rate_between(samples: List[Tuple[float, float]], start: float, end: float) -> Optional[float]:
    """Per second of wall time, how much a cumulative counter sampled as (time, value) grew over [start, end],
    from the samples nearest inside the window (None if it holds fewer than two)."""
    times = [t for t, _ in samples]
    first, last = bisect_left(times, start), bisect_left(times, end) - 1
    if last <= first:
        return None
    return (samples[last][1] - samples[first][1]) / (samples[last][0] - samples[first][0])


def quota_periods(cgroup: str) -> Optional[Tuple[int, int]]:
    """(periods in which the host had work, periods in which it ran out of quota): cgroup v1 ``cpu.stat``."""
    try:
        with open(os.path.join(cgroup, "cpu.stat")) as f:
            stat = dict(line.split() for line in f if line.strip())
    except OSError:
        return None
    return int(stat.get("nr_periods", 0)), int(stat.get("nr_throttled", 0))


class SpeedupRun:
    """One K in one scheme: its lab, processes and figures. ``train`` leaves nothing running, even when
    interrupted."""

    def __init__(self, clusters: int, stages: int, steps: int, spec: RunSpec, scheme: str, model_gb: float,
                 mbps: float, delay_ms: float, cpus: Optional[float], workdir: str, time_limit: float):
        self.k, self.stages, self.steps, self.spec, self.scheme = clusters, stages, steps, spec, scheme
        self.model_gb, self.mbps, self.delay_ms, self.cpus = model_gb, mbps, delay_ms, cpus
        self.workdir = os.path.join(workdir, f"{scheme}-k{clusters}")
        self.checkpoints = os.path.join(self.workdir, "checkpoints")
        self.history = CheckpointHistory(self.checkpoints, os.path.join(self.workdir, "history"), RUN)
        self.time_limit = time_limit
        self.names = [f"peer{i}" for i in range(clusters * stages)]
        self.cpu_samples: Dict[str, List[Tuple[float, float]]] = {name: [] for name in self.names}
        self.machine_samples: List[Tuple[float, float, float]] = []  # (time, busy, total)
        # per peer, (time, quota periods with work so far) and (time, periods out of quota so far)
        self.periods: Dict[str, List[Tuple[float, float]]] = {name: [] for name in self.names}
        self.throttled: Dict[str, List[Tuple[float, float]]] = {name: [] for name in self.names}
        self.lab_description: Dict = {}
        self.window_start = 0.0  # wall time of the first injection of any cluster (``_figures``)
        # when the last state was reached: the last completion or averaging round of any peer (``_figures``)
        self.trained_until = 0.0

    def _join_options(self, lab, host: int, initial: str) -> JoinOptions:
        # RAM for 1.2 / S of the model: S peers hold it, S - 1 cannot (for S <= 5), and the planner's stage share
        # limit keeps a stage within it whichever layers it cuts at
        ram_gb = self.model_gb * min(MAX_STAGE_SHARE / self.stages, 1.0) * 1.001
        return JoinOptions(
            initial_peers=[initial], run=RUN, name=self.names[host], dashboard=False, model=self.spec.model,
            steps=self.steps, microbatch_size=self.spec.microbatch_size,
            **{key: getattr(self.spec, key) for key in SCHEME_KEYS},
            ram_gb=ram_gb, gflops=GFLOPS, bandwidth_mbps=self.mbps,
            host_maddrs=[lab.host_maddr(host)], announce_maddrs=[lab.announce_maddr(host)],
            report=self.report_path(self.names[host]),
            # when records lived two heartbeats, at 2 s a peer on a 0.2-core quota of a machine at load 20 missed its
            # renewal, and the plan, made without it, had a cluster of 3 stages; 4 s as `local` uses
            min_peers=len(self.names), heartbeat=4.0, handover_timeout=0.0, checkpoint_dir=self.checkpoints,
            checkpoint_every=checkpoint_every(self.steps),
            # RAM alone leaves the GA free to make fewer, longer clusters where the peers could hold the model in
            # fewer stages (at --stages 1 it twice made two clusters of two of the GPT, and the bench refused them)
            max_stages=self.stages)

    def report_path(self, name: str) -> str:
        return os.path.join(self.workdir, f"{name}.report.json")

    def train(self, on_progress) -> Dict:
        """Run the swarm to the end of its steps; ``on_progress(text, microbatches done)``; return the figures."""
        from ravnest_swarm.bench.netlab import NetLab
        from ravnest_swarm.processes import ProcessGroup

        os.makedirs(self.checkpoints)
        backbone_host = len(self.names)
        with NetLab(backbone_host + 1, mbps=self.mbps, delay_ms=self.delay_ms, cpus=self.cpus) as lab:
            self.lab_description = lab.describe()
            group = ProcessGroup(self.workdir)
            try:
                self.history.start()
                on_progress(f"starting {backbone_host} peers and a backbone", 0)
                backbone = group.start_library(run_backbone_process, BackboneOptions(
                    host_maddrs=[lab.host_maddr(backbone_host)], announce_maddrs=[lab.announce_maddr(backbone_host)],
                    runs=[RUN]), "backbone", lab_host=lab.lab_host(backbone_host))
                initial = next(m for m in backbone.maddrs(120) if m.startswith(lab.announce_maddr(backbone_host)))
                peers = {name: group.start_library(run_join, self._join_options(lab, host, initial), name,
                                                   lab_host=lab.lab_host(host))
                         for host, name in enumerate(self.names)}
                cgroups = {name: lab.cgroup(host) for host, name in enumerate(self.names)} if lab.cpus else {}
                placements = self._watch(peers, cgroups, on_progress)
            except (RuntimeError, TimeoutError, StopIteration) as e:
                raise UserError(f"{self.scheme}, K = {self.k}: a bench process failed ({e}); logs in {self.workdir}", exit_code=1)
            finally:
                group.stop_all(grace=20)
                self.history.stop()
        return self._figures(placements)

    def _watch(self, peers: Dict, cgroups: Dict[str, str], on_progress) -> Dict[str, Tuple[int, int, Tuple[int, int]]]:
        """Wait for every peer's report; sample CPU and quota meanwhile; return each peer's (cluster, stage,
        layers). ``cgroups``: each peer's host's CPU cgroup (empty without a quota)."""
        deadline = time.monotonic() + self.time_limit
        placements: Dict[str, Tuple[int, int, Tuple[int, int]]] = {}
        replans = 0
        while not all(os.path.exists(self.report_path(name)) for name in self.names):
            if time.monotonic() > deadline:
                raise TimeoutError(f"not finished within --time-limit {self.time_limit:.0f}s")
            for name, process in peers.items():
                if process.popen.poll() is not None:
                    raise RuntimeError(f"{name} exited with {process.popen.returncode}: "
                                       f"{process.stderr().strip()[-500:]}")
            now = time.time()
            for name, process in peers.items():
                used = tree_cpu_seconds(process.pid)
                if used is not None:
                    self.cpu_samples[name].append((now, used))
                periods = quota_periods(cgroups[name]) if name in cgroups else None
                if periods is not None:
                    self.periods[name].append((now, periods[0]))
                    self.throttled[name].append((now, periods[1]))
            self.machine_samples.append((now, *machine_busy_seconds()))
            logs = [process.stderr() for process in peers.values()]  # each read once a look
            found = [match for log in logs for match in PLACED_RE.finditer(log)]
            renumbered = sum(len(RENUMBERED_RE.findall(log)) for log in logs)
            replans = max(replans, len(found) - len(self.names) + renumbered)
            for name, cluster, stage, stages, first, last in (match.groups() for match in found):
                placements[name] = (int(cluster), int(stage), (int(first), int(last)))
                if int(stages) != self.stages:
                    raise RuntimeError(f"the plan made a cluster of {stages} stages, not {self.stages}")
            if replans:
                raise RuntimeError(f"a later plan moved {replans} peer(s): the clusters' figures would mix plans")
            if len(placements) == len(self.names):
                on_progress("training", self._steps_done(placements))
            else:
                on_progress(f"{len(placements)} of {len(self.names)} peers placed", 0)
            time.sleep(POLL_S)
        if len({cluster for cluster, _, _ in placements.values()}) != self.k:
            raise RuntimeError(f"the plan made {len({c for c, _, _ in placements.values()})} clusters, not {self.k}")
        on_progress("done", self.k * self.steps)
        return placements

    def _steps_done(self, placements: Dict[str, Tuple[int, int, Tuple[int, int]]]) -> int:
        """Microbatches the clusters trained so far, from their first stages' latest checkpoints."""
        done = 0
        for name, (_, stage, _) in placements.items():
            path = os.path.join(self.checkpoints, f"{RUN}-{name}.safetensors")
            if stage == 0 and os.path.exists(path):
                try:
                    done += int(read_stage(path)[1]["info"]["step"])
                except (UserError, OSError, KeyError):
                    pass  # a checkpoint being replaced: the next look reads it
        return done

    def _figures(self, placements: Dict[str, Tuple[int, int, Tuple[int, int]]]) -> Dict:
        reports = {}
        for name in self.names:
            with open(self.report_path(name)) as f:
                reports[name] = json.load(f)
        firsts = {placements[name][0]: reports[name] for name in self.names if placements[name][1] == 0}
        start = min(report["inject_times"][0] for report in firsts.values())
        end = max(report["complete_times"][-1] for report in firsts.values())
        window = end - start
        self.window_start = start
        self.trained_until = max([end] + [b for report in reports.values() for _, b in report["averaging"]])
        completed = {c: len(report["complete_times"]) * report["microbatch_size"] for c, report in firsts.items()}
        cluster_rates = {c: round(completed[c] / (r["complete_times"][-1] - r["inject_times"][0]), 2)
                         for c, r in sorted(firsts.items())}
        rounds = [b - a for report in reports.values() for a, b in report["averaging"]]
        averaging_in_window = [sum(max(0.0, min(b, end) - max(a, start)) for a, b in report["averaging"]) / window
                               for report in reports.values()]
        cores = {name: rate_between(self.cpu_samples[name], start, end) for name in self.names}
        throttled = {name: (rate_between(self.throttled[name], start, end), rate_between(self.periods[name], start, end))
                     for name in self.names}
        machine = [(t, busy) for t, busy, _ in self.machine_samples]
        totals = [(t, total) for t, _, total in self.machine_samples]
        machine_busy, machine_total = rate_between(machine, start, end), rate_between(totals, start, end)
        ordered = sorted(self.names, key=lambda name: placements[name][:2])
        return dict(
            clusters=self.k, steps_per_cluster=self.steps,
            samples=sum(completed.values()),
            samples_per_s=round(sum(completed.values()) / window, 2),
            window_s=round(window, 2),
            cluster_samples_per_s=list(cluster_rates.values()),
            plan=[[list(placements[name][2]) for name in ordered if placements[name][0] == c] for c in range(self.k)],
            averaging_rounds=min(report["averaging_rounds"] for report in reports.values()),
            averaging_failures=sum(report["averaging_failures"] for report in reports.values()),
            averaging_round_s=round(sum(rounds) / len(rounds), 3) if rounds else None,
            averaging_share=round(sum(averaging_in_window) / len(averaging_in_window), 3),
            # each stage's share of its training time (downloads and plans left out) it stood still for averaging
            stood_still_share=[stood_still_share(reports[name].get("time_shares")) for name in ordered],
            busy_fraction=[round(busy_fraction(reports[name]["busy"], start, end), 3) for name in ordered],
            compute_fraction=[round(busy_fraction(reports[name]["compute"], start, end), 3) for name in ordered],
            peer_cores=[None if cores[name] is None else round(cores[name], 3) for name in ordered],
            peer_quota_used=[None if cores[name] is None or not self.cpus else round(cores[name] / self.cpus, 3)
                             for name in ordered],
            # of the quota periods in which the peer had work, the share in which it ran out of quota
            throttled_share=[round(throttled[name][0] / throttled[name][1], 3) if throttled[name][1] else None
                             for name in ordered],
            # busy cores of the whole machine over the window (psutil sums CPU time over every core)
            machine_busy_cores=None if machine_busy is None or not machine_total else
            round(machine_busy / machine_total * (os.cpu_count() or 1), 3),
            dropped=sum(report["dropped"] for report in reports.values()),
            peers_order=ordered,
        )

    def evaluate(self, model: ModelSpec) -> Dict:
        """The held-out loss and accuracy at the end (the peers' last checkpoints), and the held-out curve:
        [samples, seconds since the first injection, loss] at each step every peer checkpointed."""
        loss, accuracy = heldout_figures(model, layer_states(
            [os.path.join(self.checkpoints, f"{RUN}-{name}.safetensors") for name in self.names]))
        # a peer writes its last checkpoint as it leaves, seconds after its state was reached: that point is timed
        # at the end of the training (and of the rounds) instead
        curve = [[step * self.k * self.spec.microbatch_size,
                  round(min(written, self.trained_until) - self.window_start, 2),
                  heldout_figures(model, layer_states(paths))[0]]
                 for step, paths, written in self.history.by_step(self.names)]
        return dict(heldout_loss=loss, heldout_accuracy=accuracy, curve=curve)


def bench_speedup(clusters: Sequence[int], stages: int, model_name: str, samples: int, mbps: float, delay_ms: float,
                  averaging_period: int, cpus_per_peer: Optional[float], time_limit: float, as_json: bool,
                  schemes: Optional[Dict[str, Dict[str, Any]]] = None, target_samples: Optional[int] = None) -> int:
    from ravnest_swarm.bench.netlab import cpu_quota_unavailable

    schemes = schemes or parse_schemes("today,new")
    try:
        model = get_model(model_name)
    except ValueError as e:
        raise UserError(str(e))
    if stages > len(model.layers):
        raise UserError(f"{model_name} has {len(model.layers)} layers: at most that many --stages")
    specs = {name: RunSpec(model=model_name, **{"averaging_period": averaging_period, **settings})
             for name, settings in schemes.items()}
    microbatch_size = RunSpec(model=model_name).microbatch_size
    steps = steps_per_cluster(samples, clusters, microbatch_size)
    reference = next(iter(schemes))
    check_target_samples(target_samples, samples, steps[1], microbatch_size, specs[reference].lr_schedule)
    console = Console(stderr=True)
    no_quota = cpu_quota_unavailable()
    if cpus_per_peer is None:
        cpus_per_peer = 0.0 if no_quota else default_cpus_per_peer(clusters, stages)
        if no_quota:
            console.print(f"[yellow]no CPU quota per peer ({no_quota}): the peers share the machine's cores[/]")
    elif cpus_per_peer and no_quota:
        raise UserError(f"--cpus-per-peer is not possible here: {no_quota}; pass 0 to share the cores")
    workdir = tempfile.mkdtemp(prefix="ravnest-bench-speedup-")
    runs: Dict[str, Dict[int, Dict]] = {name: {} for name in schemes}
    description: Dict = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=not as_json) as progress:
        tasks = {(name, k): progress.add_task(f"{name}, K = {k}: waiting", total=steps[k] * k)
                 for k in clusters for name in schemes}
        for k in clusters:  # the schemes of one K one after the other: they meet the most similar load
            for name, spec in specs.items():
                # the model's memory in the planner's model of this scheme (AdamW's state is two more copies)
                model_gb = model_workload(model, spec, len(model.layers))[0].model_gb
                run = SpeedupRun(k, stages, steps[k], spec, name, model_gb, mbps, delay_ms, cpus_per_peer or None,
                                 workdir, time_limit)
                figures = run.train(lambda text, done, task=tasks[name, k], label=f"{name}, K = {k}":
                                    progress.update(task, description=f"{label}: {text}", completed=done))
                runs[name][k] = dict(figures, **run.evaluate(model))
                description = run.lab_description
    if description.get("mode") != "netns":
        console.print("[yellow]no network namespaces: the links were NOT rate-limited[/]")
    target = target_loss(runs[reference][1], target_samples)
    start_loss, start_accuracy = heldout_figures(model, None)
    report = dict(
        benchmark="speedup", model=model_name, stages=stages, clusters=list(clusters), samples=samples,
        microbatch_size=microbatch_size, averaging_period=averaging_period,
        schemes={name: {key: getattr(spec, key) for key in SCHEME_KEYS} for name, spec in specs.items()},
        reference=reference, target_samples=target_samples or samples, target_loss=target,
        heldout_loss_start=start_loss, heldout_accuracy_start=start_accuracy,
        results=compare(runs, reference, target),
        cpus_per_peer=cpus_per_peer or None, link=description,
        runs={name: {str(k): run for k, run in by_k.items()} for name, by_k in runs.items()},
        cpu_count=os.cpu_count(), load_avg=[round(x, 2) for x in os.getloadavg()], logs=workdir,
    )
    if as_json:
        print(json.dumps(report), flush=True)
    else:
        console.print(summary_table(report))
    return 0
