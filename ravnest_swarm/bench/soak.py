"""``bench soak``: real ``join`` volunteers in the network lab for a long run, with churn on a schedule: did any
peer hit an unexpected error?

Over 400 lines because the soak is one run whose parts share its lab, processes and clock: starting, churning,
looking, and the report of what the peers and their logs said.

Each volunteer has a lab host of its own (link, delay, CPU quota) and offers RAM for 1.2 / S of the model, as in
``bench speedup``: clusters of S stages that average with each other. The first one starts the run (a length no
soak reaches); the soak's minutes count from the first one placed. Every ``churn_every`` seconds a random placed
volunteer gets, alternately, Ctrl-C (SIGINT to its process group: it hands its layers over and must exit within
:data:`EXIT_BOUND`) or SIGKILL (its session, p2pd included), and a new one joins on a free host. ``status --json``,
from a lab host of its own, records the peers every :data:`STATUS_EVERY` seconds. At the end everything is stopped
by pid (on Ctrl-C and errors too) and every log under ``--out`` is scanned for ``unexpected`` and ``Traceback``: a
table, then one JSON object on stdout's last line (``survived``: none found; ``time_s``: since the bench started).

Where the placed stages' time went comes from the peers' own records (``time_shares`` over ``window_s``, their
whole time placed: ``pipeline/counters.py``), each volunteer's as its last look saw it, added up by seconds
(:func:`stage_use`); the planning rounds opened and adopted, and the volunteers each adopted round moved, from the
logs (:func:`round_figures`).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn
from rich.table import Table

from ravnest_swarm.bench.speedup import GFLOPS, default_cpus_per_peer
from ravnest_swarm.bench.speedup_schemes import parse_scheme
from ravnest_swarm.checkpoint import read_stage
from ravnest_swarm.errors import UserError
from ravnest_swarm.membership.backbone import BackboneOptions, run_backbone_process
from ravnest_swarm.membership.owner import fingerprint, load_or_create_owner_key
from ravnest_swarm.membership.progress import TIME_USES
from ravnest_swarm.models import get_model
from ravnest_swarm.pipeline.counters import utilisation
from ravnest_swarm.swarm.join import JoinOptions, run_join
from ravnest_swarm.swarm.placement import MAX_STAGE_SHARE, model_workload
from ravnest_swarm.swarm.spec import RunSpec

RUN = "soak"
BACKBONE_HOST, OBSERVER_HOST, FIRST_PEER_HOST = 0, 1, 2  # lab hosts; spare hosts for joiners follow the peers'
MAX_SPARE_HOSTS = 16  # beyond, a joiner takes the host freed longest ago
POLL_S = 1.0
STARTUP_LIMIT = 600.0  # seconds for the first volunteer to be placed
STATUS_EVERY = 30.0  # seconds between `status --json` looks
STATUS_LIMIT = 90.0  # a look still running after this long is stopped, and noted in the timeline
HANDOVER_S = 60.0  # a Ctrl-C'd volunteer waits this long for a peer to take its layers (join --handover-timeout)
EXIT_BOUND = HANDOVER_S + 30.0  # then it must have exited
MAX_ERRORS, MAX_LINE = 200, 500  # error lines kept in the report (all are counted), and their length
KINDS = ("ctrl-c", "sigkill")
RECORD_FIELDS = ("state", "cluster", "stage", "step", "loss", "averaging_rounds", "averaging_failures", "utilisation",
                 "time_shares", "window_s", "moved_bytes", "bytes_up_per_s", "bytes_down_per_s", "layers",
                 "round_offset", "rejected")
STEP_RE = re.compile(r"\bstep (\d+)")
# the averager's line for each round (``averaging.averager``): its step, and how many of its segments averaged
AVERAGED_RE = re.compile(r"\baveraging step (\d+): (\d+)/(\d+) segments averaged\b")
# a graceful leave's lines (``swarm.hand_over``, ``Volunteer._train_to_round``): its layers taken, its work averaged
HANDED_OVER_RE = re.compile(r"^\S+: layers \d+:\d+ handed over at step \d+ to ", re.MULTILINE)
LAST_ROUND_RE = re.compile(r"^\S+: our last averaging round \(round \d+, our step (\d+)\) averaged\b", re.MULTILINE)
OPENED_RE, ADOPTED_RE = re.compile(r"\bround (\d+) opened\b"), re.compile(r"\badopted plan round (\d+) ")


@dataclass
class SoakOptions:
    """What ``bench soak`` runs (``ravnest-swarm bench soak -h`` says what each is)."""

    peers: int = 8
    minutes: float = 30.0
    churn_every: float = 180.0
    mbps: float = 100.0
    delay_ms: float = 20.0
    model: str = "mlp-digits"
    stages: int = 2
    steps: int = 10**9
    averaging_period: int = 25
    cpus_per_peer: Optional[float] = None
    out: Optional[str] = None
    seed: int = 0
    scheme: str = "today"  # a scheme of bench speedup's (``speedup_schemes.parse_scheme``): the run's spec settings


def placed_now(log: str, name: str) -> bool:
    """Whether a volunteer's last placement line is "training cluster ..." (not standby, not leaving)."""
    lines = re.findall(rf"^{re.escape(name)}: (training cluster|standby in plan round|handing over|nobody took)",
                       log, re.MULTILINE)
    return bool(lines) and lines[-1] == "training cluster"


def log_figures(log: str, name: str) -> Dict:
    """From a volunteer's own lines: the highest step any names, its placements, its failed averaging rounds."""
    own = [line for line in log.splitlines() if line.startswith(f"{name}: ")]
    return dict(step=max((int(step) for line in own for step in STEP_RE.findall(line)), default=None),
                placements=sum(line.startswith(f"{name}: training cluster ") for line in own),
                averaging_failures=sum(line.startswith(f"{name}: averaging at step ") and " failed: " in line
                                       for line in own))


def last_averaged_step(log: str) -> Optional[int]:
    """The step of the last averaging round in the volunteer's log in which every segment of its stage averaged:
    its layers' state as of that step is in every member of its rings."""
    return next((int(step) for step, done, total in reversed(AVERAGED_RE.findall(log)) if done == total != "0"), None)


def held_elsewhere(peers: Dict[str, Dict], victim: str) -> Optional[bool]:
    """Whether, in one look's records (by name), every layer ``victim`` trains is also trained by another placed
    peer (another cluster's copy, which a replacement downloads); None where the look did not see ``victim`` placed."""
    layers = (peers.get(victim) or {}).get("layers")
    if not layers:
        return None
    others = [p["layers"] for name, p in peers.items() if name != victim and p.get("layers")
              and p.get("state") in ("training", "averaging") and (p.get("cluster") or 0) >= 0]
    return all(any(first <= layer < last for first, last in others) for layer in range(*layers))


def unaveraged_steps(event: Dict, final_step: Optional[int]) -> Optional[int]:
    """A SIGKILLed or Ctrl-C'd stage's steps since the last round it averaged (its cluster's work that no other peer
    has, lost with it unless a taker downloaded its layers): its final step (the highest its log, its last record and
    its checkpoint say) less its step at a leave's last round; else, on the run's count of rounds, less the last round
    it averaged; None where either is unknown."""
    if final_step is None:
        return None
    if event.get("last_round_step") is not None:
        return max(0, final_step - event["last_round_step"])
    averaged = event.get("averaged_at_kill", event.get("averaged_at_exit"))
    if averaged is None:
        return None
    return max(0, final_step - (event.get("round_offset") or 0) - averaged)


def steps_lost(event: Dict) -> Optional[int]:
    """What a churn event lost of the run's work: a SIGKILL its stage's unaveraged steps; a Ctrl-C whose last round
    averaged, its steps after that round (none: it stands still from there); one that handed over without one, none
    (a taker holds its layers at its step); else its unaveraged steps (kept in its checkpoint, not in the run)."""
    if event["kind"] == "ctrl-c" and event.get("handed_over") and event.get("last_round_step") is None:
        return 0
    return event.get("unaveraged_steps")


def round_figures(logs: Dict[str, str]) -> Dict:
    """From every volunteer's log (by name): the planning rounds opened and adopted (each round once, however many
    took part), and the moves: placements of a volunteer that had been placed before (a joiner's first is none), per
    adopted round after the first (which places everyone)."""
    opened = {int(n) for log in logs.values() for n in OPENED_RE.findall(log)}
    adopted = {int(n) for log in logs.values() for n in ADOPTED_RE.findall(log)}
    moves = sum(max(0, log_figures(log, name)["placements"] - 1) for name, log in logs.items())
    return dict(rounds_opened=len(opened), rounds_adopted=len(adopted), moves=moves,
                moves_per_adopted_round=round(moves / (len(adopted) - 1), 2) if len(adopted) > 1 else None)


def stage_use(volunteers: List[Dict]) -> Optional[Dict]:
    """Where the placed stages' time went, every volunteer's ``time_shares`` weighted by its ``window_s``: the
    share of each use, the seconds counted, and the utilisation (computing or sending outside downloads); None
    where no record said."""
    counted = [v for v in volunteers if v.get("time_shares") and v.get("window_s")]
    seconds = sum(v["window_s"] for v in counted)
    if not seconds:
        return None
    shares = {use: sum(v["time_shares"].get(use, 0.0) * v["window_s"] for v in counted) / seconds for use in TIME_USES}
    return dict(stage_seconds=round(seconds, 1), utilisation=round(utilisation(shares), 4),
                time_shares={use: round(share, 4) for use, share in shares.items()},
                moved_bytes=sum(v.get("moved_bytes") or 0 for v in volunteers))


class LogScan:
    """Reads logs as they grow and keeps the lines with ``unexpected`` (any case) or ``Traceback``; a traceback
    is one entry, with its last line (the exception)."""

    def __init__(self):
        self.offsets: Dict[str, int] = {}
        self.tracebacks: Dict[str, str] = {}  # path -> the first line of a traceback still being read
        self.found = []  # {peer, line, after_stop}

    def scan(self, label: str, path: str, after_stop: bool, to_end: bool = False) -> None:
        try:
            with open(path, "rb") as f:
                f.seek(self.offsets.get(path, 0))
                data = f.read()
        except OSError:
            return
        end = len(data) if to_end else data.rfind(b"\n") + 1  # a line still being written waits for the next look
        self.offsets[path] = self.offsets.get(path, 0) + end
        found = []
        for line in data[:end].decode(errors="replace").splitlines():
            if path in self.tracebacks:
                if line.strip() and not line.startswith((" ", "\t")):  # past its frames: the exception
                    del self.tracebacks[path]
                    found.append(f"Traceback: {line.strip()}")
            elif "Traceback" in line:
                self.tracebacks[path] = line.strip()
            elif "unexpected" in line.lower():
                found.append(line.strip())
        if to_end and path in self.tracebacks:
            found.append(self.tracebacks.pop(path))
        self.found += [dict(peer=label, line=line[:MAX_LINE], after_stop=after_stop) for line in found]


class Soak:
    """One soak: its lab, processes, churn and observations. ``run`` leaves nothing running, even when interrupted."""

    def __init__(self, options: SoakOptions, settings: Dict, ram_gb: float, cpus: Optional[float], out: str):
        self.options, self.settings, self.ram_gb, self.cpus, self.out = options, settings, ram_gb, cpus, out
        self.rng = random.Random(options.seed)
        self.total = options.minutes * 60
        spares = max(1, min(int(self.total // options.churn_every), MAX_SPARE_HOSTS, 248 - options.peers))
        self.hosts_in_lab = FIRST_PEER_HOST + options.peers + spares
        self.owner_key = os.path.join(out, "owner.key")  # the first volunteer starts the run with it
        key = load_or_create_owner_key(self.owner_key)
        self.address = f"{RUN}@{fingerprint(key.get_public_key().to_bytes())}"
        self.t0, self.soak_from = time.monotonic(), None  # when the bench started, when the soak's minutes did
        self.lab = self.group = self.initial = self.look = self.pending = None
        # by name: every volunteer started, those running now (a Ctrl-C'd one leaves at once), their hosts, how and
        # when each ended, and each one's record in the latest look that had it
        self.processes, self.live, self.hosts, self.ended, self.records = {}, {}, {}, {}, {}
        self.free_hosts: deque = deque()
        # churn events, joins, volunteers that exited by themselves, status looks
        self.churn, self.joins, self.exits, self.timeline = [], [], [], []
        self.looks, self.scan, self.interrupted, self.link = 0, LogScan(), False, {}

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    def soaked(self) -> float:
        return 0.0 if self.soak_from is None else self.now() - self.soak_from

    def run(self, on_progress: Callable[[float, str], None]) -> Dict:
        from ravnest_swarm.bench.netlab import NetLab
        from ravnest_swarm.processes import ProcessGroup

        with NetLab(self.hosts_in_lab, mbps=self.options.mbps, delay_ms=self.options.delay_ms, cpus=self.cpus) as lab:
            self.lab, self.link = lab, lab.describe()
            self.group = ProcessGroup(self.out)
            try:
                self._start(on_progress)
                self._soak(on_progress)
            except KeyboardInterrupt:  # Ctrl-C of the bench: stop, and report what ran
                self.interrupted = True
            except (RuntimeError, TimeoutError, StopIteration) as e:
                raise UserError(f"a soak process failed ({e}); logs in {self.out}", exit_code=1)
            finally:
                try:
                    on_progress(self.soaked(), "stopping every process")
                    self._scan_logs(after_stop=False)
                finally:
                    self.group.stop_all(grace=EXIT_BOUND)  # as a Ctrl-C of the churn: its whole hand-over
        self._scan_logs(after_stop=True, to_end=True)
        return self.report()

    def _start(self, on_progress) -> None:
        """The backbone, then every volunteer at once; returns once one is placed on a stage."""
        lab = self.lab
        backbone = self.group.start_library(run_backbone_process, BackboneOptions(
            host_maddrs=[lab.host_maddr(BACKBONE_HOST)], announce_maddrs=[lab.announce_maddr(BACKBONE_HOST)],
            runs=[self.address]), "backbone", lab_host=lab.lab_host(BACKBONE_HOST))
        self.initial = next(m for m in backbone.maddrs(120) if m.startswith(lab.announce_maddr(BACKBONE_HOST)))
        for host in range(FIRST_PEER_HOST, FIRST_PEER_HOST + self.options.peers):
            self._join(host)
        self.free_hosts = deque(range(FIRST_PEER_HOST + self.options.peers, lab.hosts))
        while not any(placed_now(process.stderr(), name) for name, process in self.live.items()):
            if self.now() > STARTUP_LIMIT:
                raise TimeoutError(f"no volunteer was placed on a stage within {STARTUP_LIMIT:.0f}s")
            self._reap()
            on_progress(0, f"{len(self.live)} volunteers joining, none placed yet ({self.now():.0f}s)")
            time.sleep(POLL_S)
        self.soak_from = self.now()

    def _join(self, host: int, replaces: Optional[str] = None):
        name = f"peer{len(self.processes)}"
        options = JoinOptions(
            initial_peers=[self.initial], run=self.address, name=name, dashboard=False, ram_gb=self.ram_gb,
            gflops=GFLOPS, bandwidth_mbps=self.options.mbps, host_maddrs=[self.lab.host_maddr(host)],
            announce_maddrs=[self.lab.announce_maddr(host)], min_peers=self.options.peers, heartbeat=4.0,
            handover_timeout=HANDOVER_S, checkpoint_dir=os.path.join(self.out, "checkpoints", name))
        if not self.processes:  # the first starts the run (the others wait for its spec)
            options.model, options.steps = self.options.model, self.options.steps
            options.averaging_period, options.owner_key = self.options.averaging_period, self.owner_key
            for key, value in self.settings.items():
                setattr(options, key, value)
        process = self.group.start_library(run_join, options, name, lab_host=self.lab.lab_host(host))
        self.processes[name] = self.live[name] = process
        self.hosts[name] = host
        self.joins.append(dict(time_s=self.now(), peer=name, host=host, replaces=replaces))
        return process

    def _soak(self, on_progress) -> None:
        next_churn, next_look = self.options.churn_every, 0.0
        while self.soaked() < self.total:
            self._reap()
            self._finish_ctrl_c(replace=True)
            if self.pending is None and self.soaked() >= next_churn and self._churn():
                next_churn += self.options.churn_every  # postponed while no volunteer is placed
            if self.look is None and self.soaked() >= next_look:
                self._start_look()
                next_look += STATUS_EVERY
            self._collect_look()
            self._scan_logs(after_stop=False)
            on_progress(self.soaked(), f"{len(self.live)} volunteers live, {len(self.churn)} churn event(s), "
                        f"{len(self.scan.found) or 'no'} error line(s)")
            time.sleep(POLL_S)
        on_progress(self.total, "the last look")
        while self.pending is not None:  # a Ctrl-C'd volunteer still handing over: bounded by EXIT_BOUND
            self._finish_ctrl_c(replace=False)
            time.sleep(POLL_S)
        self._collect_look(wait=True)  # the look under way, then one more
        self._start_look()
        self._collect_look(wait=True)

    def _reap(self) -> None:
        """Volunteers that exited by themselves (no churn asked them to): noted, not replaced."""
        for name in [name for name, process in self.live.items() if process.popen.poll() is not None]:
            self.exits.append(dict(time_s=self.now(), peer=name, exit_code=self.live.pop(name).popen.poll()))
            self._end(name, "exited", self.exits[-1]["exit_code"])

    def _end(self, name: str, how: str, code: Optional[int]) -> None:
        self.ended[name] = dict(ended_s=self.now(), ended_by=how, exit_code=code)
        self.free_hosts.append(self.hosts[name])  # taken again only once the spare hosts are all used

    def _churn(self) -> bool:
        """Ctrl-C or SIGKILL a random placed volunteer (False while none is placed); a SIGKILLed one is replaced
        at once, a Ctrl-C'd one once it exited (:meth:`_finish_ctrl_c`)."""
        placed = sorted(name for name, process in self.live.items() if placed_now(process.stderr(), name))
        if not placed:
            return False
        victim = self.rng.choice(placed)
        process, kind, since = self.live.pop(victim), KINDS[len(self.churn) % len(KINDS)], time.monotonic()
        event = dict(time_s=self.now(), kind=kind, peer=victim, exit_code=None, exit_s=None, replacement=None)
        self.churn.append(event)
        if kind == "ctrl-c":
            event["round_offset"] = (self.records.get(victim) or {}).get("round_offset")  # the last look's
            with contextlib.suppress(ProcessLookupError):  # a terminal's Ctrl-C: the peer's group (p2pd has its own)
                os.killpg(process.pid, signal.SIGINT)
            self.pending = (event, process, since)
            return True
        # what a crash loses: looked at right before it (a look takes seconds; the victim trains on meanwhile, so
        # its log is read as the look ends, where the record's step is from)
        peers = self._look_now()
        log = process.stderr()
        since, event["time_s"] = time.monotonic(), self.now()
        process.kill_group()  # its whole session: the peer and its p2pd
        event.update(exit_code=process.popen.poll(), exit_s=round(time.monotonic() - since, 1))
        event.update(self._crash_loss(victim, peers, log))
        self._end(victim, kind, event["exit_code"])
        event["replacement"] = self._join(self.free_hosts.popleft(), replaces=victim).name
        return True

    def _finish_ctrl_c(self, replace: bool) -> None:
        if self.pending is None:
            return
        event, process, since = self.pending
        code, waited = process.popen.poll(), time.monotonic() - since
        if code is None and waited < EXIT_BOUND:
            return
        if code is None:  # still handing over, or stuck: the bound is part of the verdict
            event["timed_out"] = True
            process.kill_group()
            code = process.popen.poll()
        log = process.stderr()
        last_round = LAST_ROUND_RE.search(log)
        event.update(exit_code=code, exit_s=round(waited, 1), averaged_at_exit=last_averaged_step(log),
                     handed_over=HANDED_OVER_RE.search(log) is not None, last_round_averaged=last_round is not None,
                     last_round_step=None if last_round is None else int(last_round.group(1)))
        self._end(event["peer"], event["kind"], code)
        self.pending = None
        if replace:
            event["replacement"] = self._join(self.free_hosts.popleft(), replaces=event["peer"]).name

    def _start_look(self) -> None:
        self.looks += 1
        args = ["status", "--initial-peers", self.initial, "--run", self.address, "--json", "--timeout", "15"]
        process = self.group.start(args, f"status-{self.looks:03d}", lab_host=self.lab.lab_host(OBSERVER_HOST))
        self.look = (process, time.monotonic(), self.now())

    def _look_now(self) -> Dict[str, Dict]:
        """The peers' records (by name) as a look started now reads them; the look joins the timeline."""
        self._collect_look(wait=True)
        self._start_look()
        self._collect_look(wait=True)
        return self.timeline[-1].get("peers") or {}

    @staticmethod
    def _crash_loss(victim: str, peers: Dict[str, Dict], log: str) -> Dict:
        """What a SIGKILL of ``victim`` loses, from the look right before it (``peers``) and its log then: its step
        in its record, its step less the run's round count (``round_offset``: a cluster's steps run apart from the
        run's count of rounds, 325 steps in a soak), the last round its stage averaged, on the run's count, and
        whether another cluster trains its layers (the run's state of them lives on). The steps lost with it are
        counted at the end, from its final step (:func:`unaveraged_steps`)."""
        record = peers.get(victim) or {}
        return dict(step_at_kill=record.get("step"), round_offset=record.get("round_offset"),
                    averaged_at_kill=last_averaged_step(log), layers_held_elsewhere=held_elsewhere(peers, victim))

    def _collect_look(self, wait: bool = False) -> None:
        """Put the finished look into the timeline (``wait``: wait for it, within STATUS_LIMIT)."""
        if self.look is None:
            return
        process, since, at = self.look
        while wait and process.popen.poll() is None and time.monotonic() - since < STATUS_LIMIT:
            time.sleep(0.2)
        code = process.popen.poll()
        if code is None and time.monotonic() - since < STATUS_LIMIT:
            return
        self.look = None
        if code is None:
            process.kill_group()
        try:
            document = json.loads(process.stdout().strip().splitlines()[-1]) if code == 0 else None
        except (ValueError, IndexError):
            document = None
        if document is None:
            said = (process.stderr().strip().splitlines() or ["no output"])[-1]
            self.timeline.append(dict(time_s=at, error=f"status exited with {code}: {said[:MAX_LINE]}"))
            return
        peers = {p["name"]: {k: p[k] for k in RECORD_FIELDS if p.get(k) is not None} for p in document["peers"]}
        self.records.update(peers)
        rate = (document.get("summary") or {}).get("samples_per_s")  # the run's, every bucket's counts added up
        self.timeline.append(dict(time_s=at, samples_per_s=None if rate is None else round(rate, 1), peers=peers))

    def _scan_logs(self, after_stop: bool, to_end: bool = False) -> None:
        for process in self.group.processes if self.group is not None else []:
            for path in (process.stdout_path, process.stderr_path):
                self.scan.scan(process.name, path, after_stop, to_end)

    def _volunteer(self, name: str) -> Dict:
        process, record = self.processes[name], self.records.get(name, {})
        from_log = log_figures(process.stderr(), name)
        try:
            checkpoint = read_stage(os.path.join(self.out, "checkpoints", name, f"{RUN}-{name}.safetensors"))
            saved = int(checkpoint[1]["info"]["step"])
        except (UserError, KeyError, ValueError):
            saved = None  # never placed, or killed before its first checkpoint
        steps = [step for step in (from_log["step"], record.get("step"), saved) if step is not None]
        ended = self.ended.get(name) or dict(ended_s=None, ended_by="stopped at the end",
                                             exit_code=process.popen.poll())
        joined = next(join["time_s"] for join in self.joins if join["peer"] == name)
        return dict(name=name, host=self.hosts[name], joined_s=joined, **ended, final_step=max(steps, default=None),
                    checkpoint_step=saved, placements=from_log["placements"], last_state=record.get("state"),
                    averaging_rounds=record.get("averaging_rounds"),
                    averaging_failures=max(record.get("averaging_failures") or 0, from_log["averaging_failures"]),
                    utilisation=record.get("utilisation"), time_shares=record.get("time_shares"),
                    window_s=record.get("window_s"), moved_bytes=record.get("moved_bytes"),
                    # input it refused as hostile, as its record last said: an honest soak has none
                    rejected=record.get("rejected") or 0,
                    unexpected_errors=sum(error["peer"] == name for error in self.scan.found))

    def report(self) -> Dict:
        errors = self.scan.found
        volunteers = [self._volunteer(name) for name in self.processes]
        final = {volunteer["name"]: volunteer["final_step"] for volunteer in volunteers}
        for event in self.churn:
            event["unaveraged_steps"] = unaveraged_steps(event, final.get(event["peer"]))
            event["steps_lost"] = steps_lost(event)
        return dict(
            benchmark="soak", model=self.options.model, stages=self.options.stages, minutes=self.options.minutes,
            minutes_run=round(min(self.soaked(), self.total) / 60, 2), startup_s=self.soak_from, seconds=self.now(),
            interrupted=self.interrupted, peers=self.options.peers, churn_every_s=self.options.churn_every,
            seed=self.options.seed, steps=self.options.steps, averaging_period=self.options.averaging_period,
            scheme=self.options.scheme, settings=self.settings,
            run=self.address, churn_events=self.churn, joins=self.joins, exits=self.exits,
            volunteers=volunteers, timeline=self.timeline, use=stage_use(volunteers),
            rounds=round_figures({name: process.stderr() for name, process in self.processes.items()}),
            unexpected_errors=errors[:MAX_ERRORS], unexpected_error_count=len(errors), survived=not errors,
            cpus_per_peer=self.cpus, link=self.link, out=self.out, cpu_count=os.cpu_count(),
            load_avg=[round(x, 2) for x in os.getloadavg()])


def bench_soak(options: SoakOptions) -> int:
    from ravnest_swarm.bench.netlab import cpu_quota_unavailable

    try:
        model = get_model(options.model)
    except ValueError as e:
        raise UserError(str(e))
    if options.stages > len(model.layers) or options.churn_every > options.minutes * 60:
        raise UserError(f"at most {len(model.layers)} --stages ({options.model}'s layers), and a --churn-every within "
                        f"the soak's --minutes ({options.minutes:g}), or no churn would happen")
    # the scheme's settings win over --averaging-period, as in the run its first volunteer starts
    settings = parse_scheme(options.scheme)[1]
    spec = RunSpec(model=options.model, **{"averaging_period": options.averaging_period, **settings})
    model_gb = model_workload(model, spec, len(model.layers))[0].model_gb  # AdamW's state is two more copies
    console = Console(stderr=True)
    no_quota, cpus = cpu_quota_unavailable(), options.cpus_per_peer
    if cpus is None:
        cpus = 0.0 if no_quota else default_cpus_per_peer([options.peers], 1)  # the peers and the backbone
        if no_quota:
            console.print(f"[yellow]no CPU quota per peer ({no_quota}): the peers share the machine's cores[/]")
    elif cpus and no_quota:
        raise UserError(f"--cpus-per-peer is not possible here: {no_quota}; pass 0 to share the cores")
    out = os.path.abspath(options.out) if options.out else tempfile.mkdtemp(prefix="ravnest-bench-soak-")
    if os.path.isdir(out) and os.listdir(out):
        raise UserError(f"--out {out} is not empty: give a new directory (the soak keeps every peer's log there)")
    os.makedirs(out, exist_ok=True)
    console.print(f"logs and checkpoints in {out}", markup=False, highlight=False)
    # RAM for 1.2 / S of the model, as bench speedup's: S peers hold it, S - 1 cannot
    soak = Soak(options, settings, model_gb * min(MAX_STAGE_SHARE / options.stages, 1.0) * 1.001, cpus or None, out)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[clock]}"),
                  console=console) as progress:
        task = progress.add_task("soak: starting", total=soak.total, clock="")
        report = soak.run(lambda soaked, text: progress.update(
            task, completed=min(soaked, soak.total), description=f"soak: {text}",
            clock=f"{min(soaked, soak.total) / 60:.1f}/{soak.total / 60:g} min"))
    if report["link"].get("mode") != "netns":
        console.print("[yellow]no network namespaces: the links were NOT rate-limited[/]")
    shown = Console(width=None if sys.stdout.isatty() else 120)
    shown.print(summary_table(report))
    shown.print(use_lines(report), markup=False, highlight=False)
    print(json.dumps(report), flush=True)
    return 130 if report["interrupted"] else 0


def summary_table(report: Dict) -> Table:
    verdict = "survived" if report["survived"] else f"NOT survived: {report['unexpected_error_count']} error line(s)"
    columns = ("peer", "joined s", "ended", "exit", "final step", "placed", "averaging ok / failed", "last state",
               "busy", "rejected", "errors")
    table = Table(*columns, title=f"bench soak: {report['model']}, {report['peers']} volunteers, "
                  f"{report['minutes_run']} min, {len(report['churn_events'])} churn event(s); {verdict}")
    for peer in report["volunteers"]:
        ended = f"{peer['ended_by']} at {peer['ended_s']} s" if peer["ended_s"] is not None else peer["ended_by"]
        table.add_row(peer["name"], str(peer["joined_s"]), ended, str(peer["exit_code"]), str(peer["final_step"]),
                      str(peer["placements"]), f"{peer['averaging_rounds']} / {peer['averaging_failures']}",
                      str(peer["last_state"]), "-" if peer["utilisation"] is None else f"{peer['utilisation']:.0%}",
                      str(peer["rejected"]), str(peer["unexpected_errors"]))
    return table


def use_lines(report: Dict) -> str:
    """Where the placed stages' time went (the peers' own counts) and the planning rounds, in two lines, and a third
    on what each SIGKILL lost where there was one."""
    use, rounds = report["use"], report["rounds"]
    if use is None:
        where = "placed stages: no peer record said where their time went"
    else:
        shares = use["time_shares"]
        idle = ", ".join(f"{use_name} {shares[use_name]:.1%}" for use_name in TIME_USES[2:])
        where = (f"placed stages ({use['stage_seconds'] / 60:.1f} stage-minutes): computing {shares['computing']:.1%}, "
                 f"sending {shares['sending']:.1%}, so {use['utilisation']:.1%} busy outside layer downloads; idle: "
                 f"{idle}; {use['moved_bytes'] / 1e6:.1f} MB of layers downloaded for moves")
    per_round = rounds["moves_per_adopted_round"]
    lines = (f"{where}\nplanning rounds: {rounds['rounds_opened']} opened, {rounds['rounds_adopted']} adopted; "
             f"{rounds['moves']} move(s) of placed volunteers"
             f"{'' if per_round is None else f', {per_round} per adopted round after the first'}")
    said = lambda value: "?" if value is None else str(value)  # noqa: E731
    kills = [event for event in report.get("churn_events", []) if event["kind"] == "sigkill"]
    if kills:
        held = {True: "yes", False: "NO", None: "?"}
        lines += (f"\nSIGKILLs: {len(kills)}; the killed stage's steps since its last averaged round (lost with it): "
                  f"{', '.join(said(event.get('unaveraged_steps')) for event in kills)}; its layers trained by "
                  f"another cluster then: {', '.join(held[event.get('layers_held_elsewhere')] for event in kills)}")
    leaves = [event for event in report.get("churn_events", []) if event["kind"] == "ctrl-c"]
    if leaves:
        lines += (f"\nCtrl-Cs: {len(leaves)}; steps lost (0 where it handed over): "
                  f"{', '.join(said(event.get('steps_lost')) for event in leaves)}; its last round averaged: "
                  f"{', '.join('yes' if event.get('last_round_averaged') else 'no' for event in leaves)}")
    return lines
