"""``ravnest-swarm local``: a whole swarm on this machine — a backbone and N real ``join`` processes.

Peers get varied capability overrides (RAM below the model's needs, so clusters need several stages;
different compute and bandwidth, so clusters differ). The dashboard shows the swarm live; at the end
every process is stopped (SIGTERM, so each writes its checkpoint), the model is assembled from one
cluster's checkpoints and evaluated on held-out data, and a few sentences say what trained, how well,
how long and what failed (``--json`` adds the summary as one JSON object on stdout's last line).
``--chaos`` SIGKILLs a training stage partway and starts one more peer late.
``--resume`` restarts the same named peers, each from its checkpoint in ``--checkpoint-dir``, with the same
peer id (an identity file beside the checkpoints), so the same plan is likely.

Over 400 lines because :class:`LocalSwarm` both runs the swarm and sums it up from the same observations
(plans, samples trained, losses, memory); the closing sentences are :func:`describe`'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import random
import re
import shlex
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

import torch
from hivemind.utils.timed_storage import get_dht_time
from rich.console import Console
from rich.live import Live
from rich.markup import escape

from ravnest_swarm.checkpoint import read_stage, remove_unfinished_writes
from ravnest_swarm.dashboard.live import LogPanel, logs_below, render_with_logs
from ravnest_swarm.dashboard.state import AVERAGING_NOTE, REFUSAL_NOTE, TRAINING_STATES, SwarmState
from ravnest_swarm.devices import device_kind
from ravnest_swarm.errors import UserError
from ravnest_swarm.lifecycle import install_stop_signals
from ravnest_swarm.membership.reader import read_proposals, read_snapshot
from ravnest_swarm.membership.records import make_validators
from ravnest_swarm.membership.backbone import BackboneOptions, run_backbone_process
from ravnest_swarm.models import load_model, model_layout
from ravnest_swarm.models.loading import parse_model_config
from ravnest_swarm.processes import PeerProcess, ProcessGroup
from ravnest_swarm.swarm.export import (check_export_dir, checkpoint_layer_state, export_checkpoints,
                                        freshest_checkpoint_layers)
from ravnest_swarm.swarm.exported import model_figures
from ravnest_swarm.swarm.join import JoinOptions, run_join
from ravnest_swarm.swarm.metrics import append_figures, run_figures
from ravnest_swarm.swarm.spec import RunSpec
from ravnest_swarm.swarm.spec_checks import check_spec_values
from ravnest_swarm.swarm.placement import model_workload
from ravnest_swarm.net.node import parse_maddrs, start_node, stop_node

logger = logging.getLogger(__name__)

RUN = "local"
# what the summary's peer_records keep of each peer's last record
PEER_RECORD_FIELDS = ("state", "cluster", "stage", "step", "averaging_rounds", "averaging_failures", "rejected", "note",
                      "device", "device_memory_gb", "peak_memory_gb", "device_peak_gb", "codecs", "averaging_bytes_sent")
CHECKPOINT_NAME = re.compile(rf"^{RUN}-(peer\d+)\.safetensors$")
# at the end every peer stops at once, each taking its stage's last averaging round and then handing over (to
# nobody: all are leaving) within LEAVE_S, before the SIGKILL at STOP_GRACE_S; its checkpoint is written then
LEAVE_S, STOP_GRACE_S = 16.0, 20.0


@dataclass
class LocalOptions:
    """What ``local`` runs.

    :param peers: volunteers started at once
    :param steps: optimizer steps every stage trains for
    :param model: zoo model
    :param chaos: SIGKILL one training stage partway and start one more peer late
    :param time_limit: stop after this many seconds even if training is not done
    :param spec: the run's hyper-parameters
    :param seed: capability variation and chaos victim
    :param dashboard: show the live dashboard (on stderr)
    :param checkpoint_dir: where the peers write their checkpoints (None: a temporary directory, removed after)
    :param checkpoint_every: steps between a stage's checkpoints
    :param resume: restart every peer that left a checkpoint in ``checkpoint_dir`` from it
    :param device: where every peer computes (resolved: ``cpu``, ``cuda:0``)
    :param data: the directory every peer trains on (``--data``; None: the model's own data)
    :param max_ram_gb: every peer offers the RAM it measures, capped at this (None: varied offers below the model)
    :param export: write the trained model here at the end (``swarm/exported.py``), from the peers' checkpoints
    :param snapshot_dir: append the run's figures to ``metrics.jsonl`` here at every look (``ravnest-swarm plot``)
    """

    peers: int = 6
    steps: int = 300
    model: str = "mlp-digits"
    chaos: bool = False
    time_limit: float = 900.0
    spec: Optional[RunSpec] = None
    seed: int = 0
    dashboard: bool = True
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 50
    resume: bool = False
    device: str = "cpu"
    data: Optional[str] = None
    max_ram_gb: Optional[float] = None
    export: Optional[str] = None
    snapshot_dir: Optional[str] = None


def checkpoint_steps(directory: str, model: str, model_config: str = "", data_hash: str = "") -> Dict[str, int]:
    """The step of each checkpoint a ``local`` run's peers left in ``directory``, by peer name.

    Every file is read in full, so a corrupt one, or one of another model, model config or data (``data_hash``:
    the sha256 of ``--data``; empty: the model's own), is a one-line :class:`UserError` before any process starts,
    not a peer dying later (a resume with another ``--model-config`` stood silent for the whole time limit while
    every peer had died) or a run that goes on, without a word, on data its layers never saw. A checkpoint from
    before the config and data were written in it is checked for its model only.
    """
    steps = {}
    for file in sorted(os.listdir(directory)):
        match = CHECKPOINT_NAME.match(file)
        if match is None:
            continue
        path = os.path.join(directory, file)
        info = read_stage(path)[1]["info"]
        if info.get("model") != model:
            raise UserError(f"checkpoint {path} is of model {info.get('model')!r}, not {model!r}: "
                            f"pass --model {info.get('model')} to continue it", exit_code=1)
        if not same_model_config(info.get("model_config", model_config), model_config):
            raise UserError(f"checkpoint {path} is of --model-config {info['model_config']!r}, not "
                            f"{model_config!r}: pass --model-config {shlex.quote(info['model_config'] or '')} "
                            f"to continue it", exit_code=1)
        if info.get("data_hash", data_hash) != data_hash:
            said = lambda digest: f"sha256 {digest[:12]}" if digest else "the model's own data"  # noqa: E731
            raise UserError(f"checkpoint {path} trained on other data ({said(info['data_hash'])}) than this run's "
                            f"({said(data_hash)}): pass the --data it trained on to continue it", exit_code=1)
        steps[match.group(1)] = int(info["step"])
    return steps


def same_model_config(saved: str, given: str) -> bool:
    """Whether two ``--model-config`` texts set the same values: ``hidden = 128`` is ``hidden=128``, and the order of
    the settings does not matter (a review); one that does not parse is no match."""
    try:
        return saved == given or parse_model_config(saved) == parse_model_config(given)
    except ValueError:
        return False


def capability_overrides(index: int, model_gb: float, largest_layer_gb: float = 0.0) -> Dict[str, float]:
    """Varied, deterministic capabilities: RAM 0.55-0.7 of the model (2+ stages per cluster), mixed compute,
    and links fast enough (1-1.4 Gbit/s) that compute, not a slow link, sets each cluster's pace. Any two peers
    hold ``mlp-digits`` in whole layers within its stage share limit (4 of its 9 layers are 0.49 of it, 5 are
    0.61: a peer offering less than 0.51 beside one offering 0.6 holds the model only in fractions). Each
    offers a little more than the model's largest layer (``largest_layer_gb``): a model of one layer, or of one
    big one, was never placed."""
    return dict(ram_gb=max(model_gb * (0.55 + 0.05 * (index % 4)), 1.05 * largest_layer_gb),
                gflops=20.0 + 10 * (index % 3), bandwidth_mbps=1000.0 + 100 * (index % 5))


class LocalSwarm:
    """Runs and watches the local swarm; see the module docstring.

    :param options: what to run
    :param console: where the dashboard and messages go
    """

    def __init__(self, options: LocalOptions, console: Console):
        self.options, self.console = options, console
        self.spec = options.spec or RunSpec(model=options.model)
        try:
            self.model = load_model(self.spec.model, self.spec.model_config, options.data)
        except ValueError as e:
            raise UserError(str(e))
        if options.export is not None:  # checked now, not after the training it would export
            replaced = check_export_dir(options.export, "--export")
            if replaced is not None:
                console.print(f"--export {escape(options.export)} holds an export of run {escape(replaced)}: this "
                              f"run's replaces it at the end", highlight=False, soft_wrap=True)
        if options.checkpoint_dir is not None and os.path.exists(options.checkpoint_dir) and \
                not os.path.isdir(options.checkpoint_dir):
            raise UserError(f"--checkpoint-dir {options.checkpoint_dir} is a file, not a directory", 1)
        # out of the spec record's bounds, every peer died publishing it while we waited out the time limit
        check_spec_values(dict(dataclasses.asdict(self.spec), steps=options.steps, layout=model_layout(self.model)))
        self.workload, (self.layer_memory_gb, _) = model_workload(self.model, self.spec, 8)
        self.checkpoint_steps: Dict[str, int] = {}  # peer name -> step of the checkpoint it resumes from
        if options.resume:
            if options.checkpoint_dir is None:
                raise UserError("--resume needs --checkpoint-dir: the directory of the run to continue")
            if not os.path.isdir(options.checkpoint_dir):
                raise UserError(f"--checkpoint-dir {options.checkpoint_dir} does not exist: nothing to resume", 1)
            from ravnest_swarm.models.user_data import scan_data

            data_hash = scan_data(options.data).digest if options.data is not None else ""
            self.checkpoint_steps = checkpoint_steps(options.checkpoint_dir, self.spec.model, self.spec.model_config,
                                                     data_hash)
            if not self.checkpoint_steps:
                raise UserError(f"{options.checkpoint_dir} holds no checkpoints of a local run "
                                f"({RUN}-peerN.safetensors): nothing to resume", exit_code=1)
            started = options.peers + int(options.chaos)  # --chaos starts one more peer late
            left_out = sorted(set(self.checkpoint_steps) - {f"peer{i}" for i in range(started)})
            if left_out:  # their layers' progress would be silently dropped
                raise UserError(f"{options.checkpoint_dir} holds checkpoints of {', '.join(left_out)}, which "
                                f"--peers {options.peers} does not start: pass a --peers that does", exit_code=1)
            unfinished = remove_unfinished_writes(options.checkpoint_dir)  # no peer writes there yet
            console.print(f"resuming {', '.join(f'{n} from step {s}' for n, s in self.checkpoint_steps.items())}"
                          + (f"; removed {len(unfinished)} unfinished write(s)" if unfinished else ""), highlight=False)
        elif options.checkpoint_dir is not None and os.path.isdir(options.checkpoint_dir):
            # a run's checkpoints there would be overwritten, and the others taken into this run's summary and
            # export: layers of another run beside ours, at its steps, or of another model, "in no checkpoint"
            earlier = sorted(name for name in os.listdir(options.checkpoint_dir) if CHECKPOINT_NAME.match(name))
            if earlier:
                raise UserError(f"--checkpoint-dir {options.checkpoint_dir} holds an earlier local run's checkpoints "
                                f"({', '.join(earlier)}): --resume continues it; a new run needs a directory of "
                                f"its own", exit_code=1)
        self.group = ProcessGroup()
        self.checkpoint_dir = options.checkpoint_dir or tempfile.mkdtemp(prefix="ravnest-local-ckpt-")
        os.makedirs(self.checkpoint_dir, exist_ok=True)
        # the run's length lets the events tell a standby leaving at the run's end from one leaving mid-run
        self.state = SwarmState(RUN, steps=options.steps)
        self.volunteers: Dict[str, PeerProcess] = {}
        self.loss_history: List[float] = []
        # the highest peak RSS any peer's record reported (GB, each peer's own high-water mark): the figure the
        # dashboard shows per peer; sampling the processes' RSS here missed spikes and said MiB as "MB"
        self.peak_memory_gb = 0.0
        # (time, steps the clusters' last stages report in all) at the first look with a training stage and the
        # last look at which those steps grew: the samples trained over the time they took
        self.trained: List[Tuple[float, int]] = []
        self.chaos_done = self.late_done = False
        self.final_loss: Optional[float] = None
        self.chaos_victim: Optional[str] = None  # None with --chaos: training ended before the late peer waited
        self.plans: Dict[int, dict] = {}  # round -> adopted plan, as seen
        self.peer_ids: Dict[str, str] = {}  # name -> peer id, as seen
        self.finished = False  # every placed peer trained its steps before the time limit or a stop
        self.timed_out = False  # the time limit ended the run (else it finished, or a signal stopped it)
        self.peers_exited: Optional[str] = None  # every peer exited before the run finished: the first one's error
        self.exit_order: List[str] = []  # volunteers by the look that first saw them exited
        self.sources: Dict[int, Tuple[str, int, int]] = {}  # layer -> its freshest checkpoint (evaluate)

    def _join(self, maddr: str, index: int) -> None:
        name = f"peer{index}"
        offer = capability_overrides(index, self.workload.model_gb, max(self.layer_memory_gb))
        if device_kind(self.options.device) == "cuda":
            # the peers share this machine's GPU: each offers what it offers of RAM, not the whole GPU, so the plan
            # splits the model into stages as it does on the CPU (where the RAM offer is the device's memory)
            offer["device_memory_gb"] = offer["ram_gb"]
        if self.options.max_ram_gb is not None:  # peers measure their RAM and offer at most this
            offer["max_ram_gb"] = self.options.max_ram_gb
            offer["ram_gb"] = None
        # every field of our spec that a joiner may ask for (the optimizers too, which once went missing here)
        spec = {name: getattr(self.spec, name) for name in JoinOptions.SPEC_FIELDS if name != "steps"}
        options = JoinOptions(
            initial_peers=[maddr], run=RUN, name=name, dashboard=False, steps=self.options.steps, **spec,
            device=self.options.device, heartbeat=4.0, handover_timeout=LEAVE_S,
            min_peers=self.options.peers, checkpoint_dir=self.checkpoint_dir,
            checkpoint_every=self.options.checkpoint_every,
            identity=os.path.join(self.checkpoint_dir, f"{RUN}-{name}.key"), host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            data=os.path.abspath(self.options.data) if self.options.data is not None else None,
            # a peer that never trained (a standby) has no checkpoint and starts fresh
            resume=name in self.checkpoint_steps, **offer)
        self.volunteers[name] = self.group.start_library(run_join, options, name)

    async def run(self) -> dict:
        try:
            return await self._run()
        finally:  # a checkpoint directory nobody asked for goes, also where the run or its summary failed
            if self.options.checkpoint_dir is None:
                shutil.rmtree(self.checkpoint_dir, ignore_errors=True)

    async def _run(self) -> dict:
        stop = install_stop_signals()
        started = time.monotonic()
        observer = None
        try:
            backbone = self.group.start_library(run_backbone_process, BackboneOptions(
                host_maddrs=["/ip4/127.0.0.1/tcp/0"], runs=[RUN]), "backbone")
            maddr = backbone.maddrs()[0]
            for index in range(self.options.peers):
                self._join(maddr, index)
            observer = await start_node(parse_maddrs([maddr]), record_validators=make_validators(RUN),
                                        client_mode=True)
            if self.options.dashboard:
                with Live(console=self.console, auto_refresh=False, transient=False) as live, \
                        logs_below(LogPanel()) as panel:
                    await self._watch(observer, maddr, stop, started, lambda: live.update(
                        render_with_logs(self.state, panel, self.console), refresh=True))
            else:
                await self._watch(observer, maddr, stop, started, None)
        finally:
            if observer is not None:
                await stop_node(observer)
            self.group.stop_all(grace=STOP_GRACE_S)
        return self.summary(time.monotonic() - started)

    async def _watch(self, observer, maddr: str, stop: asyncio.Event, started: float, redraw) -> None:
        while not stop.is_set() and time.monotonic() - started < self.options.time_limit:
            # the dashboard's state merges each read into what is known: a read that missed records (a DHT node
            # that did not answer in time) neither drops them nor ends the run early
            try:
                self.state.feed(await read_snapshot(observer, RUN))
            except Exception as e:  # one failed DHT read must not end the run; the next look retries
                logger.warning(f"reading the swarm's records failed: {e}")
            peers, plan = self.state.peers, self.state.plan
            if self.options.snapshot_dir is not None and peers:
                append_figures(self.options.snapshot_dir, run_figures(self.state))
            self.peer_ids.update({p["name"]: p["peer_id"] for p in peers})
            if plan is not None:
                self.plans.setdefault(plan["round"], plan)
            round_open = await self._round_open(observer, plan)
            self._sample(peers)
            if redraw is not None:
                redraw()
            await self._maybe_chaos(peers, plan, maddr)
            if not round_open and self._finished(peers, plan):
                self.finished = True
                break
            self.peers_exited = self._every_peer_exited()
            if self.peers_exited is not None:
                break  # nothing can train on: waiting out the time limit said nothing for minutes (a user's review)
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
        self.timed_out = not self.finished and not stop.is_set() and self.peers_exited is None

    def _every_peer_exited(self) -> Optional[str]:
        """Where every volunteer has exited (the one --chaos killed aside) before the run finished: the last error
        line of the first to exit that said one, or the first's exit code; else None. A peer that trained its steps
        stays to serve its layers, so even all of them gone with exit 0 (stopped from outside) is a run that cannot
        finish: waiting out the time limit said nothing for as long."""
        for name, process in self.volunteers.items():
            if name not in self.exit_order and process.popen.poll() is not None:
                self.exit_order.append(name)
        started = [name for name in self.volunteers if name != self.chaos_victim]
        if not started or set(started) - set(self.exit_order):
            return None
        exited = [name for name in self.exit_order if name in started]
        for name in exited:
            said = [line for line in self.volunteers[name].stderr().splitlines() if line.startswith("error: ")]
            if said:
                return f"{name}: {said[-1][len('error: '):]}"
        return f"{exited[0]} exited with {self.volunteers[exited[0]].popen.poll()}"

    def _sample(self, peers: List[dict]) -> None:
        # training peers only: a finished one keeps its last loss in its record
        training = [p for p in peers if p.get("loss") is not None and p.get("stage") is not None
                    and p["state"] in TRAINING_STATES]
        last = [p for p in training if p["stage"] == max(q["stage"] for q in training if q["cluster"] == p["cluster"])]
        if last:
            self.loss_history.append(sum(p["loss"] for p in last) / len(last))
        # every sample passes a cluster's last stage once: its step counts the microbatches the cluster trained
        holders = self.state.slot_holders()
        steps = sum(holder.get("step") or 0 for (cluster, stage), holder in holders.items()
                    if stage == max(s for c, s in holders if c == cluster))
        if not self.trained and any(p["state"] in TRAINING_STATES for p in peers):
            self.trained = [(time.monotonic(), steps)] * 2
        elif self.trained and steps > self.trained[1][1]:
            self.trained[1] = (time.monotonic(), steps)
        self.peak_memory_gb = max([self.peak_memory_gb, *(p.get("peak_memory_gb") or 0.0 for p in peers)])

    async def _maybe_chaos(self, peers: List[dict], plan: Optional[dict], maddr: str) -> None:
        """One more peer joins as soon as the first plan is adopted (so it is late); once training is a
        third done and some peer waits as a standby (the late one, or one the plan left out), a training
        stage is SIGKILLed, so the next planning round hands the dead stage's layers to a standby. Not
        waiting for the late peer in particular matters: its start-up can outlast the whole training."""
        if not self.options.chaos or self.chaos_done or plan is None:
            return
        if not self.late_done:
            self._join(maddr, self.options.peers)
            self.late_done = True
            return
        training = [p for p in peers if p["state"] in ("training", "averaging") and p.get("step") is not None]
        progress = max((p["step"] for p in training), default=0)
        if training and progress >= self.options.steps // 3 and any(p["state"] == "standby" for p in peers):
            victim = random.Random(self.options.seed).choice(sorted(p["name"] for p in training))
            self.console.print(f"chaos: SIGKILL {victim} at step {progress}", highlight=False)
            self.volunteers[victim].kill_group()
            self.chaos_done = True
            self.chaos_victim = victim

    @staticmethod
    async def _round_open(observer, plan: Optional[dict]) -> bool:
        """Whether a planning round after ``plan`` is under way: its plan may still put standby peers to work."""
        after = plan["round"] if plan is not None else 0
        # a round's adoption reads the proposals a little after their deadline
        return any(proposal["round"] > after and proposal["deadline"] > get_dht_time() - 5
                   for proposal in await read_proposals(observer, RUN))

    def _finished(self, peers: List[dict], plan: Optional[dict]) -> bool:
        """Every peer of the plan in force has trained its steps (its stage worker finished)."""
        if plan is None:
            return False
        placed = {stage["peer_id"] for cluster in plan["clusters"] for stage in cluster}
        states = {p["peer_id"]: p["state"] for p in peers}
        return bool(placed) and all(states.get(peer) == "done" for peer in placed)

    # ------------------------------------------------------------------ summary
    def peers_replaced(self) -> int:
        """Stages whose peer died and whose layers a peer that held no stage before took over.

        Counted per pair of consecutive plans as min(placed peers gone, peers newly placed).
        """
        replaced = 0
        rounds = sorted(self.plans)
        for before, after in zip(rounds, rounds[1:]):
            placed_before = {s["peer_id"] for c in self.plans[before]["clusters"] for s in c}
            placed_after = {s["peer_id"] for c in self.plans[after]["clusters"] for s in c}
            replaced += min(len(placed_before - placed_after), len(placed_after - placed_before))
        return replaced

    def memory_fractions(self, memory: Dict[str, int]) -> Dict[str, float]:
        """Per peer: tensor bytes it holds / (the whole model's bytes / stages in its cluster), in the last plan."""
        if not self.plans:
            return {}
        model_bytes = sum(layer.param_bytes for layer in self.model.layers)  # SGD keeps no per-parameter state
        stages = {stage["peer_id"]: len(cluster) for cluster in self.plans[max(self.plans)]["clusters"]
                  for stage in cluster}
        return {name: round(held / (model_bytes / stages[self.peer_ids[name]]), 3)
                for name, held in memory.items() if self.peer_ids.get(name) in stages}

    def summary(self, seconds: float) -> dict:
        figures, memory = self.evaluate()
        accuracy = figures["heldout_accuracy"] if figures else None
        fractions = self.memory_fractions(memory)
        totals = self.state.totals()
        result = {
            "clusters": max((len(plan["clusters"]) for plan in self.plans.values()), default=0),
            "averaging_rounds": totals.averaging_done,
            # the seeded initial model (every peer starts from it) and the model assembled from the checkpoints
            "loss_start": self.training_loss(None),
            "loss_end": self.final_loss,
            "observed_loss_first": round(self.loss_history[0], 4) if self.loss_history else None,
            "observed_loss_last": round(self.loss_history[-1], 4) if self.loss_history else None,
            "metric_name": "heldout_accuracy",
            "metric": accuracy,
            "heldout_loss": figures["heldout_loss"] if figures else None,
            "export": self.export(),
            "peers_replaced": self.peers_replaced(),
            "plan_rounds": sorted(self.plans),
            "samples_per_s": self.training_rate(),
            "peak_peer_memory_mb": round(self.peak_memory_gb * 1000, 1),
            "peer_tensor_bytes": memory,
            "peer_memory_fraction": fractions,
            "max_peer_memory_fraction": max(fractions.values(), default=None),
            "seconds": round(seconds, 1),
            "peers": self.options.peers,
            "steps": self.options.steps,
            "chaos": self.options.chaos,
            "chaos_victim": self.chaos_victim,
            "finished": self.finished,
            "resumed_from": self.resumed_from(),
            "training_from": self.training_from(),
            "stopped": "finished" if self.finished else "time limit" if self.timed_out else
            "peers exited" if self.peers_exited is not None else "stopped by signal",
            "peers_exited": self.peers_exited,
            "averaging_failed": totals.averaging_failures,
            "rejected": sum(p.get("rejected") or 0 for p in self.state.peers),
            "peer_records": {p["name"]: {field: p.get(field) for field in PEER_RECORD_FIELDS} for p in self.state.peers},
            "events": [asdict(event) for event in self.state.events],
            "log_dir": self.group.log_dir,
        }
        return result

    def training_rate(self) -> float:
        """Samples per second over the run's training: the samples the clusters' last stages trained, over the
        time between the first look at a training stage and the last look at which they had trained more."""
        if not self.trained or self.trained[1][0] <= self.trained[0][0]:
            return 0.0
        (start, first), (end, last) = self.trained
        return round((last - first) * self.spec.microbatch_size / (end - start), 2)

    def resumed_from(self) -> Dict[str, int]:
        """Per peer started with ``--resume``: the step it says it loaded ("resuming layers a:b from step N")."""
        steps = {}
        for name in self.checkpoint_steps:
            process = self.volunteers.get(name)  # None: --chaos's late peer, when training ended before it joined
            found = process and re.search(rf"^{name}: resuming layers \d+:\d+ from step (\d+)", process.stderr(),
                                          re.MULTILINE)
            if found:
                steps[name] = int(found.group(1))
        return steps

    def training_from(self) -> Dict[str, int]:
        """Per peer placed on a stage: the step its first stage worker started at, as its
        "training cluster c stage s/S layers a:b from step N" line says."""
        steps = {}
        for name, process in self.volunteers.items():
            found = re.search(rf"^{name}: training cluster \d+ stage .* from step (\d+)", process.stderr(),
                              re.MULTILINE)
            if found:
                steps[name] = int(found.group(1))
        return steps

    def evaluate(self) -> Tuple[Optional[dict], Dict[str, int]]:
        """The figures (``exported.model_figures``: held-out loss and accuracy, training loss) of the model assembled
        from checkpoints covering every layer (freshest first), read one layer at a time; and the tensor bytes of
        each peer's checkpoint. None for the figures when some layer is in no checkpoint."""
        memory = {}
        for file in sorted(os.listdir(self.checkpoint_dir)):
            match = CHECKPOINT_NAME.match(file)
            if match is None:
                continue  # identity keys, a killed writer's temporary file
            try:
                tensors, _ = read_stage(os.path.join(self.checkpoint_dir, file))
            except Exception:
                continue
            memory[match.group(1)] = sum(t.numel() * t.element_size() for t in tensors.values())
            del tensors
        self.sources = freshest_checkpoint_layers(self.checkpoint_dir, CHECKPOINT_NAME)
        if len(self.sources) != len(self.model.layers):
            return None, memory
        figures = model_figures(self.model, CheckpointStates(self.sources))
        self.final_loss = figures["train_loss"]
        return figures, memory

    def export(self) -> Optional[str]:
        """With ``--export``, the model assembled from the checkpoints written there (``swarm/export.py``)."""
        if self.options.export is None or len(self.sources) != len(self.model.layers):
            return None
        from ravnest_swarm.models import model_layout
        from ravnest_swarm.models.user_data import scan_data

        source = scan_data(self.options.data) if self.options.data is not None else None
        spec = dict(asdict(self.spec), layout=[list(layer) for layer in model_layout(self.model)],
                    data_hash=source.digest if source else "", data_bytes=source.size if source else 0,
                    steps=self.options.steps)
        export_checkpoints(self.sources, spec, RUN, self.options.export)
        return self.options.export

    def training_loss(self, states: Optional[Dict[int, Dict[str, torch.Tensor]]]) -> float:
        """Mean loss over the first training samples: the same yardstick for the seeded start (``states``
        None) and the trained end; layer by layer, so a model bigger than any peer is evaluated too."""
        inputs, targets = self.model.yardstick("train")
        return round(float(self.model.loss(self.model.run_layers(inputs, states), targets)), 4)


class CheckpointStates(Mapping):
    """The layers of a ``local`` run's checkpoints by index (``export.freshest_checkpoint_layers``), each read when
    asked for: the model is evaluated with one layer in memory at a time."""

    def __init__(self, sources: Dict[int, Tuple[str, int, int]]):
        self.sources = sources

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        return checkpoint_layer_state(self.sources[index])

    def __iter__(self):
        return iter(sorted(self.sources))

    def __len__(self) -> int:
        return len(self.sources)


def describe(summary: dict, model: str) -> List[str]:
    """The end of a ``local`` run in a few plain sentences: what trained, how well, how long, what failed."""
    steps, clusters = summary["steps"], summary["clusters"]
    ended = {"finished": f"every stage trained its {steps} steps",
             "time limit": f"the time limit stopped it before every stage trained its {steps} steps",
             "stopped by signal": f"you stopped it before every stage trained its {steps} steps",
             "peers exited": f"every peer exited before every stage trained its {steps} steps (the first said: "
                             f"{summary['peers_exited']})"}[summary["stopped"]]
    lines = [f"Trained {model} with {summary['peers']} peers in {clusters} cluster(s) for "
             f"{_duration(summary['seconds'])}: {ended}."]
    if summary["heldout_loss"] is None:
        lines.append("No model to evaluate: some layer was in no peer's checkpoint.")
    else:
        accuracy = "" if summary["metric"] is None else f", held-out accuracy {summary['metric']:.1%}"
        lines.append(f"Held-out loss {summary['heldout_loss']:.4g}{accuracy}; mean training loss "
                     f"{summary['loss_start']:.3g} at the start, {summary['loss_end']:.3g} at the end (the model "
                     f"assembled from the peers' checkpoints).")
    if summary["export"]:
        lines.append(f"The trained model is exported to {summary['export']} (`ravnest-swarm evaluate "
                     f"{shlex.quote(summary['export'])}`).")
    lines.append(f"{summary['samples_per_s']:,.0f} samples/s on average while training; peak peer memory "
                 f"{summary['peak_peer_memory_mb']:.0f} MB.")
    records = summary["peer_records"]
    rounds, failed = summary["averaging_rounds"], summary["averaging_failed"]
    if clusters == 0:
        if summary["stopped"] == "stopped by signal":  # not the planner's fault (a user's review)
            lines.append("You stopped it before any plan placed a peer.")
        elif summary["stopped"] != "peers exited":  # they said why, above
            lines.append(f"No plan placed any peer{unplaced_reason(summary['log_dir'])}.")
    elif clusters < 2:
        lines.append("No averaging: one cluster held the whole model.")
    elif not failed:
        lines.append(f"Averaging: {rounds} round(s), every one averaged.")
    else:
        causes = [f"{name}: {record['note']}" for name, record in records.items()
                  if record["averaging_failures"] and (record["note"] or "").startswith(AVERAGING_NOTE)]
        lines.append(f"Averaging: {rounds} round(s) averaged, {failed} failed"
                     + (f" (last cause, {causes[-1]})." if causes else "."))
    problems = [event["text"] for event in summary["events"] if event["kind"] == "left" and "vanished" in event["text"]]
    problems += [f"{name} refused {record['rejected']} poisoned or malformed input(s)"
                 + (f" ({record['note']})" if (record["note"] or "").startswith(REFUSAL_NOTE) else "")
                 for name, record in records.items() if record["rejected"]]
    if summary["chaos_victim"]:
        problems.append(f"--chaos SIGKILLed {summary['chaos_victim']}; {summary['peers_replaced']} stage(s) were "
                        f"taken over by standbys")
    lines.append("Nothing else failed." if not problems else f"What failed: {'; '.join(problems)}.")
    lines.append(f"Every process's log: {summary['log_dir']}")
    return lines


def unplaced_reason(log_dir: str) -> str:
    """Why the planners placed nobody, as the first peer's log says it (its last ``no feasible cluster`` line)."""
    try:
        with open(os.path.join(log_dir, "peer0.err"), errors="replace") as log:
            said = [line.strip() for line in log if "no feasible cluster: " in line]
    except OSError:
        said = []
    return f", as no cluster is feasible: {said[-1].split('no feasible cluster: ', 1)[1]}" if said else \
        f": the peers' logs say why ({log_dir})"


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


async def run_local(options: LocalOptions, as_json: bool) -> int:
    console = Console(stderr=True)
    swarm = LocalSwarm(options, console)
    result = await swarm.run()
    lines = describe(result, swarm.spec.model)
    unexported = options.export is not None and not result["export"]
    if unexported:  # asked for, and an exit 0 without it let a script go on to a model that is not there
        kept = f" (checkpoints are in {options.checkpoint_dir})" if options.checkpoint_dir is not None else ""
        lines.append(f"The model was NOT exported to {options.export}: some layer was in no peer's checkpoint{kept}.")
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if as_json:
        print(json.dumps(result), flush=True)
    if result["stopped"] == "stopped by signal":
        return 130 if result["clusters"] == 0 else 0  # a stop before anything trained: a script must not go on
    if result["stopped"] == "peers exited":
        return 1
    return 1 if result["clusters"] == 0 or unexported else 0  # nothing trained, or no model where it was asked
