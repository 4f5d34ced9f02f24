"""The volunteer's whole lifecycle: placed by a planning round, fetch state, train a stage, average, leave.

Over 400 lines because :class:`Volunteer` is one state machine (plan, stage worker, layers, progress) whose steps
share the worker, the layer cache and the plan; its pure rules are in ``placement.py``, its averaging rounds in
``stage_averaging.py`` and its graceful leave in ``hand_over.py``.

``join`` = membership (measure, advertise, heartbeat) + this :class:`Volunteer`:

1. It takes part in planning rounds (``planning.round``). Whenever an adopted plan gives it a new
   placement (cluster, stage, layer range), it stops its old stage worker, keeps that worker's
   layers in a local cache, and starts a new one.
2. Before the new worker trains, every layer it owns is filled from the freshest source: a peer whose
   record says it holds that layer (``state_transfer.fill_layer``: holders the plan names, two agreeing where
   two count, over ``ravnest.layer_state``), else its own
   cache or checkpoint, else a ``--init-from`` snapshot's (an export, at its step), else the model's seeded initial
   weights (identical on every peer). The
   worker starts counting optimizer steps from that source's step, so clusters stay aligned. The stages of a
   cluster take downloaded layers from one averaging round, the one its first stage took (:meth:`_download`).
3. Between optimizer steps, every ``averaging_period`` steps, the stage averages its layers with the
   peers of other clusters that hold the same parameters (``stage_averaging.py``: rings from the adopted plan,
   the round named by the step); every ``checkpoint_every`` steps and on exit it writes a checkpoint.
4. A stage that dies makes its neighbours' sends fail; its record expires; the next planning round
   (triggered by "a planned peer gone") places a standby in its slot, or re-forms the clusters, and
   the peers whose layers changed fetch them as in step 2.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import shutil
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Awaitable, Callable, Collection, Deque, Dict, FrozenSet, List, Optional, Set, Tuple

import torch
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import get_dht_time
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn

from ravnest_swarm.errors import UserError
from ravnest_swarm.lifecycle import until_set
from ravnest_swarm.checkpoint import (OUTER_STATE_KEYS, load_optimizer_state, load_outer_state, load_stage_layers,
                                     remove_unfinished_writes, save_stage, write_atomically)
from ravnest_swarm.dashboard.state import DIVERGED_NOTE, REFUSAL_NOTE, SwarmState
from ravnest_swarm.membership.progress import run_finished
from ravnest_swarm.membership.reader import plan_digest
from ravnest_swarm.membership.capabilities import measure_layer_gflops
from ravnest_swarm.membership.records import CONTROL_CHARACTER_RE, MAX_NOTE_LEN, RunAddress, make_validators
from ravnest_swarm.membership.volunteer import Membership
from ravnest_swarm.models import ModelSpec, first_difference, model_layout
from ravnest_swarm.pipeline.counters import WallTime, utilisation
from ravnest_swarm.pipeline.stage import StageConfig, StageWorker
from ravnest_swarm.planning.cost import Workload
from ravnest_swarm.planning.plan import memory
from ravnest_swarm.planning.round import PlanningRounds, RoundOptions, standby_reason
from ravnest_swarm.swarm.placement import (Placement, holders_before_round, kept_in_place, layer_offers,
                                           model_workload, neighbours_in, offered_step, place_taken_over, placement_in,
                                           round_for_cluster)
from ravnest_swarm.optimizers.inner import make_inner_optimizer, scheduled_lr
from ravnest_swarm.swarm.admission import enter, follow_admission
from ravnest_swarm.swarm.hand_over import hand_over, new_takers, only_held_here
from ravnest_swarm.swarm.export import export_with
from ravnest_swarm.swarm.exported import newest_export, read_export
from ravnest_swarm.swarm.metrics import append_figures, run_figures
from ravnest_swarm.swarm.spec import (FOLLOWED, SPEC_RENEW_BEFORE, RunSpec, choose_spec, cluster_lr, keep_spec_alive,
                                      read_specs, run_length)
from ravnest_swarm.swarm.spec_versions import publish_spec_version
from ravnest_swarm.membership.owner import fingerprint, load_owner_key, owner_key_path
from ravnest_swarm.swarm.stage_averaging import Following, LastRound, StageAveraging
from ravnest_swarm.swarm.stage_state import (StageStateServer, StoppedStage, TrainingStage, carry_layer_states,
                                             fetch_stage_state, stage_giver)
from ravnest_swarm.swarm.state_transfer import (KEPT_ROUNDS, LAYER_STATE, LAYER_STATE_MESSAGE, LayerFill,
                                                LayerOffer, LayerStateServer, agreed_step, counted_offers, fill_again,
                                                fill_layer, offered_layers, offers_of, seeded_only)
from ravnest_swarm.net.node import maddrs_without_peer_id, start_node, stop_node

logger = logging.getLogger(__name__)

HOLDER_LOOKUPS = 5
SNAPSHOTS_KEPT = 3  # --snapshot-every: the newest snapshots kept in --snapshot-dir
RATE_WINDOW = 30.0  # a published samples/s is the mean over this many seconds: a 2 s look flickers to 0 and back
STALL_SECONDS = 15.0  # a stage that has not stepped this long says what its cluster waits for
# a leave that has not stepped this long looks whether a peer of its cluster stops first (``_mate_stops_first``): a
# pipeline waits a step's time for its neighbours, and a leaving neighbour's last round some seconds
MATE_LEAVING_STALL_SECONDS = 3.0
SPEC_RENEW_CHECK_SECONDS = 600.0  # how often a peer looks whether the spec it follows needs storing again
DIVERGING_REPEATS, DIVERGING_STEPS = 3, 500  # this many restores within so many steps: a cluster that keeps diverging


@dataclass
class VolunteerOptions:
    """How this volunteer trains (beyond the run's spec, which sets the run's length).

    :param checkpoint_dir: where this peer's checkpoint lives (None: no checkpoints, except the one a leave
        that nobody took the layers from writes to ``hand_over.LEAVE_CHECKPOINT_DIR``)
    :param checkpoint_every: steps between checkpoints
    :param resume: start from this peer's checkpoint
    :param min_peers: open the first planning round once this many peers are live
    :param round_seconds: a planning round's length
    :param round_period: seconds after which a plan is revised anyway (0: never)
    :param max_stages: most stages per cluster
    :param averaging_timeout: seconds a ring waits for its members
    :param transfer_timeout: seconds to fetch one layer from one holder
    :param handover_timeout: seconds a leaving peer keeps serving its layers for someone to take them
    :param data: this peer's copy of the run's ``--data`` (None: the model's own data)
    :param report: when the run is finished, write our stage worker's report (``pipeline/stage.py``) and the
        start and end of each averaging round here, as JSON (``bench speedup`` times the clusters with it)
    :param owner_key: the run owner's key file, for a run we start (default ``membership.owner.owner_key_path``)
    :param snapshot_dir: append the run's figures, as we see them, to ``metrics.jsonl`` here every heartbeat
        (``swarm/metrics.py``; ``ravnest-swarm plot``), and keep the snapshots of ``snapshot_every`` here
    :param snapshot_every: export the run (``swarm/export.py``) to ``snapshot_dir/snapshot-STEP`` every this many
        steps of the run, keeping the last :data:`SNAPSHOTS_KEPT` (0: never)
    :param init_from: an export (a snapshot) whose layers, at their steps, fill the layers no peer serves and no
        cache or checkpoint of ours holds, instead of the seeded weights: a new run from a snapshot, or a stage
        restarted after every holder of it left
    :param ticket: our admission ticket to an invite-only run (``join --ticket``; ``membership/tickets.py``)
    """

    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 50
    resume: bool = False
    min_peers: int = 2
    round_seconds: float = 8.0
    round_period: float = 600.0
    max_stages: int = 8
    averaging_timeout: float = 20.0
    transfer_timeout: float = 30.0
    handover_timeout: float = 90.0
    data: Optional[str] = None
    report: Optional[str] = None
    owner_key: Optional[str] = None
    snapshot_dir: Optional[str] = None
    snapshot_every: int = 0
    init_from: Optional[str] = None
    ticket: Optional[str] = None


class Volunteer:
    """Trains one stage at a time for the plan in force.

    :param membership: a started :class:`Membership` (node, announcer, heartbeats)
    :param run_spec: the run's spec
    :param model: its model, built here (``RunSpec.build_model``)
    :param options: training options
    :param console: where progress and events go
    :param owner: the fingerprint of the run's owner, whose newer spec versions we follow
    """

    def __init__(self, membership: Membership, run_spec: RunSpec, model: ModelSpec, options: VolunteerOptions,
                 console: Console, owner: Optional[str] = None):
        self.membership, self.spec, self.options, self.console = membership, run_spec, options, console
        self.owner = owner
        self.node, self.announcer = membership.node, membership.announcer
        self.run = membership.options.run
        self.name = membership.options.name
        self.peer_id = self.node.peer_id.to_base58()
        self.model = model
        self.layer_sizes = [layer.param_count for layer in model.layers]
        self.worker: Optional[StageWorker] = None
        self.stopped_worker: Optional[StageWorker] = None  # the last worker stopped: what a leave hands over
        self._finished = False  # the run reached its length (said once)
        self._history_at = -math.inf  # when we last appended the run's figures (_record_history)
        self._seen_step = 0  # the highest step of the run's peers we last saw (_record_history)
        self._snapshot_mark, self._snapshot_task = 0, None  # the last multiple of --snapshot-every exported, and its task
        self._init_export = None  # the --init-from export last read (_init_source)
        self._checkpoint_problem: Optional[str] = None  # why the last checkpoint write failed, as said
        self._init_source()  # one that is of another model is one line before anything trains
        self.held: Optional[Tuple[int, torch.nn.Sequential, int]] = None  # layers of the last stopped worker
        self.placement: Optional[Placement] = None
        # the plan we follow (our placement is in it), and the newest one adopted, which we follow next: read
        # together with our placement, a newer plan of fewer clusters than ours was an IndexError (issue 29)
        self.plan: Optional[dict] = None
        self.adopted: Optional[dict] = None
        # the plan in force before ``plan`` (that its round replaced, else the one we followed): the peers it placed
        # on a layer hold the layer's latest copy (``offers_of``); and the one ``adopted`` replaced
        self.plan_before: Optional[dict] = None
        self.adopted_over: Optional[dict] = None
        self.cache: Dict[int, Tuple[Dict[str, torch.Tensor], int]] = {}  # layer -> (state_dict, step)
        # poisoned or malformed input refused: by averaging, and by stage workers already stopped
        self.rejected_before = 0
        self.state_server = LayerStateServer(self.node.routes, self.run, self._offered_layers)
        # the optimizer state of the stage we stopped last, for the peer that takes its layers over (stage_state.py)
        self.stopped_stage: Optional[StoppedStage] = None
        # the spec's renewal (_follow_spec): each peer at its own point, so one renews and the rest see its copy
        self._spec_renewal_due, self._spec_renew_before = 0.0, SPEC_RENEW_BEFORE * random.uniform(0.5, 1.0)
        self.rounds: Optional[PlanningRounds] = None  # our planning rounds, once they start
        self.stage_state_server = StageStateServer(self.node.routes, self.run, lambda: self.stopped_stage,
                                                   training=self._training_stage)
        self.averaging = StageAveraging(self.announcer, self.state_server,
                                        self._following,
                                        self.layer_sizes, run_spec.averaging_period, run_spec.microbatch_size,
                                        membership.options.heartbeat, options.averaging_timeout, run_spec.aggregation,
                                        say=lambda text: self.say(f"{self.name}: {text}"), note=self._note,
                                        on_rejected=self._count_rejected,
                                        outer=(run_spec.outer_optimizer, run_spec.outer_lr, run_spec.outer_momentum),
                                        compression=run_spec.averaging_compression)
        self._adopted = asyncio.Event()
        # (time, step) looks at the running worker over the last RATE_WINDOW seconds: the samples/s it publishes
        self._progress: Deque[Tuple[float, int]] = deque()
        self._rate_worker: Optional[StageWorker] = None
        self._noted_rejection: Optional[str] = None  # the stage refusal our note last told of
        self._noted_failure: Optional[str] = None  # the microbatch our note last told had failed in our stage
        self._progress_seen = (time.monotonic(), -1)  # when our worker's step last changed, and to what
        self._stall_said: Optional[tuple] = None  # the stall we last explained (said once per situation)
        self._precision_said: Optional[str] = None  # what our device runs of the run's precision, said once
        self.announcer.on_renewal_problem = self._renewal_problem
        self.node.routes.on_gate_refusal = self._gate_refusal  # an invite-only run's messages from the unadmitted
        # ((first, last), step, state, where from) of the inner and the outer optimizer, kept by our checkpoint or
        # our last stage worker: a stage that starts on those layers at that step goes on with them
        self.kept_optimizer: Optional[tuple] = None
        self.kept_outer: Optional[tuple] = None
        self.divergences_before = 0  # restores of stage workers already stopped
        self._noted_divergence: Optional[str] = None
        self._divergence_looks: List[Tuple[int, int]] = []  # (step, restores) each time we saw a new one
        self._diverging_said = 0  # the restores counted when we last said the cluster keeps diverging
        # where our wall time goes while we are placed, across our stage workers (pipeline/counters.py), and
        # (time, bytes sent, bytes received) looks at our node's traffic over the last RATE_WINDOW seconds
        self.wall_time = WallTime()
        self._traffic_looks: Deque[Tuple[float, int, int]] = deque()
        self.moved_bytes = 0  # of the layers we downloaded to take our places
        self.layers_came_from = ""  # of the layers we downloaded last: their round(s) or step(s) (_download)
        self.layer_holders: Dict[int, List[Dict]] = {}  # the records of who served each layer we downloaded last
        # a graceful leave's last round (_train_to_round): set while we train on to it, then the round
        self._last_round: Optional[asyncio.Future] = None

    @property
    def checkpoint_path(self) -> Optional[str]:
        if self.options.checkpoint_dir is None:
            return None
        return os.path.join(self.options.checkpoint_dir, f"{self.run}-{self.name}.safetensors")

    def say(self, text: str) -> None:
        """One line for the volunteer, literal (names come from the network) and never wrapped mid-line."""
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    # ------------------------------------------------------------------ main loop
    async def run_until(self, stop: asyncio.Event, leave_now: Optional[asyncio.Event] = None) -> None:
        """Train until ``stop`` is set, or until the run is finished while we are a standby; then leave.

        :param leave_now: set (a second Ctrl-C) to cut a graceful leave's hand-over short
        """
        await self.averaging.start()
        await self.state_server.start()
        await self.stage_state_server.start()
        if self.checkpoint_path is not None and os.path.isdir(self.options.checkpoint_dir):
            # a write of ours that a kill cut short; other peers may share the directory and write now
            remove_unfinished_writes(self.options.checkpoint_dir, os.path.basename(self.checkpoint_path))
        if self.options.resume:
            self._load_checkpoint_into_cache()
        # the model's first uses import torch's reference ops and the data set's loader: seconds on a busy
        # machine, which on the event loop would hold back our heartbeats until our record expired
        workload, profile, gflops = await asyncio.get_running_loop().run_in_executor(None, self._prepare_model)
        self.layer_memory_gb = profile[0]
        if gflops is not None:  # before the first planning round, which plans with it
            # renewed at once: a round opened meanwhile weighs us at the join-time figure of a generic matmul (75
            # GFLOP/s in a walkthrough, 7 on mlp-digits' layers), which put us alone in round 1 and the owner, already
            # measured, on standby as "a standby would slow its cluster down"; 10 s later the trigger saw the
            # owner double the throughput and opened round 2, which moved us both
            self.announcer.update(gflops=gflops)
            await self.announcer.renew()
        self.rounds = PlanningRounds(self.node, self.run, self.announcer,
                                     RoundOptions(workload, self.options.min_peers, self.options.round_period,
                                                  self.options.round_seconds, len(self.model.layers),
                                                  layer_profile=profile, move_horizon_s=self.spec.move_horizon_s,
                                                  # a moved stage downloads its new layers' parameters
                                                  layer_download_gb=[layer.param_bytes / 1e9
                                                                     for layer in self.model.layers]),
                                     self.console, on_adopt=self._on_adopt)
        planner = asyncio.create_task(self.rounds.run_forever(stop))
        graceful = False
        try:
            while not stop.is_set():
                if self._adopted.is_set():
                    self._adopted.clear()
                    if not await self._run_finished():  # a plan adopted as the run ended would only move layers
                        # a placement may download for a while: a stop must not wait for it
                        await until_set(self._follow_plan(self.adopted), stop)
                    continue
                await until_set(self._adopted.wait(), stop, timeout=2.0)
                if self.worker is not None and self.worker.failure is not None:
                    raise self.worker.failure  # one line, and an exit that says so: not a stage that stands still
                await self._follow_spec()
                self._publish_progress()
                self._publish_use()
                await self._record_history()
                self._maybe_snapshot()
                await self._explain_stall()
                if await self._run_finished():
                    planner.cancel()  # a finished run has nothing left to place: its peers stay where they are
                    self._adopted.clear()
                    if self.worker is None:
                        break  # a standby of a finished run has nothing to train and nothing to hold
            graceful = True
        finally:
            planner.cancel()
            leave_now = leave_now or asyncio.Event()
            last_round = None
            try:
                if graceful:
                    last_round = await self._train_to_round(leave_now)
            except Exception as e:  # the leave goes on: our layers are handed over as without a last round
                self.say(f"{self.name}: leaving without a last averaging round ({type(e).__name__}: {e})")
            finally:
                await self._stop_worker()
            if graceful:
                await self._hand_over(leave_now, last_round)
            await self.averaging.shutdown()

    async def _follow_spec(self) -> None:
        """Follow the owner's newest spec version: its learning rate applies from our next optimizer step. Every
        :data:`SPEC_RENEW_CHECK_SECONDS`, keep the one we follow stored (``spec.keep_spec_alive``)."""
        try:
            record = choose_spec(await read_specs(self.node, self.run), RunAddress(self.run, self.owner))
        except UserError:
            return  # only an address without an owner can be ambiguous, and we always know ours
        spec = None if record is None else RunSpec.from_record(record)
        if spec is not None and spec.origin == self.spec.origin and spec.version >= self.spec.version \
                and time.monotonic() >= self._spec_renewal_due:
            self._spec_renewal_due = time.monotonic() + SPEC_RENEW_CHECK_SECONDS
            try:
                if await keep_spec_alive(self.node, self.run, record, self._spec_renew_before):
                    logger.info(f"stored run {self.run}'s spec version {spec.version} again (it would expire)")
            except Exception as e:  # the next check tries again; the spec has days left
                logger.warning(f"storing the run's spec again failed: {type(e).__name__}: {e}")
        # a version of the run we follow (another origin is a run started anew under the address: not ours)
        if spec is None or spec.origin != self.spec.origin or spec.version <= self.spec.version:
            return
        shown = {"steps": run_length}
        changed = [f"{name} {shown.get(name, str)(getattr(self.spec, name))} -> {shown.get(name, str)(getattr(spec, name))}"
                   for name in FOLLOWED if getattr(spec, name) != getattr(self.spec, name)]
        self.say(f"{self.name}: run {self.run} spec version {spec.version} from its owner: {', '.join(changed) or 'same'}")
        await follow_admission(self.membership, spec, self.owner, self.options.owner_key)  # revoked: we leave here
        worker = self.worker
        steps = self.spec.steps if worker is not None and worker.finished.is_set() else spec.steps  # done stays done
        self.spec = replace(self.spec, version=spec.version, lr=spec.lr, steps=steps, finished=spec.finished,
                            invite_only=spec.invite_only, revoked=spec.revoked)
        if worker is not None:
            self._set_lr(worker)  # the compute thread reads it at its next step
            # the scheduler reads its length at every injection: a longer run goes on, an ended one stops at the next
            worker.config.microbatches = worker.version if self.spec.finished else self.spec.steps

    def _prepare_model(self) -> Tuple[Workload, Tuple[List[float], List[float]], Optional[float]]:
        """The planner's view of the model, its data set loaded (cached for the stage workers), and our compute
        measured on the run's largest layer on our device in the run's precision (None: ``--gflops`` set it)."""
        self.model.dataset()
        gflops = None
        if self.membership.options.gflops is None:
            gflops = measure_layer_gflops(self.model, self.membership.options.device, self.spec.microbatch_size,
                                          self.spec.precision)
        return model_workload(self.model, self.spec, self.options.max_stages) + (gflops,)

    def _on_adopt(self, plan: dict, replaced: Optional[dict]) -> None:
        self.adopted, self.adopted_over = plan, replaced
        self._adopted.set()

    async def _follow_plan(self, plan: dict) -> None:
        placement = placement_in(plan, self.peer_id)
        self.announcer.update(plan_round=plan["round"], plan_digest=plan_digest(plan))
        if plan is self.adopted and self.adopted_over is not None:
            # the round's own: a peer that skipped plans (it followed only the latest) or joined since agrees on it
            self.plan_before = self.adopted_over
        elif self.plan is not None and self.plan["round"] != plan["round"]:
            self.plan_before = self.plan
        if self.worker is not None and kept_in_place(self.plan, plan, self.peer_id):
            # kept in place: the worker goes on without a pause, taking messages from (and sending to) whoever the plan
            # now puts beside it, such as a standby that replaced a dead neighbour, averaging in the new plan's
            # rings, and with the lr rule and data share of its cluster's number and number of clusters from its
            # next step (a plan that drops a cluster renumbers the one it moves into the gap: it trains on)
            before, self.plan, self.placement = self.placement, plan, placement
            cluster, stage, stages, layers, clusters = placement
            self.worker.follow_neighbours(neighbours_in(plan, cluster, stage, self._known_peers()))
            self.announcer.update(cluster=cluster)  # with the plan round above, before the endpoint's publish
            await self.worker.follow_clusters(cluster, clusters)
            changed = f"; {before[4]} -> {clusters} clusters from its next step" if clusters != before[4] else ""
            renumbered = f" (cluster {before[0]} before)" if cluster != before[0] else ""
            self.say(f"{self.name}: plan round {plan['round']} keeps us in place: cluster {cluster}{renumbered} stage "
                     f"{stage}/{stages} layers {layers[0]}:{layers[1]} trains on{changed}")
            await self.announcer.renew()
            return
        # a new place: the averaging round our layers come from is said anew (:meth:`_download`)
        self.announcer.update(start_round=None)
        if placement is None:
            await self._stop_worker()
            self.wall_time.count(False)  # a standby's time is no stage's
            self.plan, self.placement = plan, placement
            # a standby keeps offering the layers it last trained, so others can still fetch them
            held = dict(layers=[self.held[0], self.held[0] + len(self.held[1])], step=self.held[2]) if self.held \
                else dict(layers=None, step=None)
            self.announcer.update(state="standby", cluster=-1, stage=None, loss=None, samples_per_s=None, **held)
            await self.announcer.renew()
            self.say(f"{self.name}: standby in plan round {plan['round']}: {await self._standby_reason(plan)}")
            return
        self.wall_time.count(True)  # from the plan that places us: the move to our place is our stage's time
        with self.wall_time.using("plan"):
            await self._stop_worker()
            self.plan, self.placement = plan, placement
            await self._start_worker(placement, plan)

    async def _standby_reason(self, plan: dict) -> str:
        """Why we have no slot, and what would give us one (a round opens for each of these by itself)."""
        reason = standby_reason(plan, await self.rounds.read_alive(get_dht_time()), self.rounds.options.workload)
        when = "when a placed peer leaves or joiners allow a plan that pays back its moves"
        if self.options.round_period > 0:
            revision = max(0.0, plan["time"] + self.options.round_period - time.time())
            when += f", or at the latest in {revision:.0f}s when the plan is revised"
        return f"{reason}; a round opens {when}"

    # ------------------------------------------------------------------ stage workers
    async def _start_worker(self, placement: Placement, plan: dict) -> None:
        cluster, stage, stages, layers, clusters = placement
        config = StageConfig(run=self.run, stage=stage, stages=stages, model=self.spec.model, layers=layers,
                             model_config=self.spec.model_config, data=self.options.data,
                             cluster=cluster, clusters=clusters, microbatch_size=self.spec.microbatch_size,
                             microbatches=self.spec.steps, max_in_flight=self.spec.max_in_flight,
                             compression=self.spec.pipeline_compression,
                             link_bound_compression=self.spec.link_bound_compression,
                             device=self.membership.options.device, precision=self.spec.precision,
                             mode=self.spec.backward,
                             lr=cluster_lr(self.spec.lr, clusters, self.spec.lr_scaling, 0),
                             optimizer=self.spec.optimizer, weight_decay=self.spec.weight_decay,
                             divergence_factor=self.spec.divergence_factor,
                             heartbeat=self.membership.options.heartbeat,
                             neighbours=neighbours_in(plan, cluster, stage, self._known_peers()))
        worker = StageWorker(config, self.node, self.wall_time)
        if worker.precision_note is not None and worker.precision_note != self._precision_said:
            self._precision_said = worker.precision_note
            self.say(f"{self.name}: {worker.precision_note}")
        step, downloaded = await self._fill_layers(worker.module, layers, plan, cluster, stage)
        came_from = f"; {self.layers_came_from}" if downloaded else ""
        # a checkpoint's optimizer states go with its layers at their step, also where the cluster counts on from
        # the run's step below: they belong to the parameters, not to the count
        await self._take_handed_state(worker, tuple(layers), step, plan)
        if downloaded:
            await self._carry_optimizer_state(worker, tuple(layers), step)
        self._take_optimizer_state(worker, tuple(layers), step)
        self._take_outer_state(worker, tuple(layers), step)
        run_step = await self._run_step(plan, cluster) if stage == 0 else None
        if run_step is not None and run_step > step:
            # the other clusters trained on while we downloaded: the run's length and lr schedule count on their
            # step, not our layers' (averaging rounds meet on the run's count of rounds either way: round_to_join)
            self.say(f"{self.name}: cluster {cluster} counts from step {run_step}, where the run's other clusters "
                     f"are (its layers are of step {step}): the run's length and lr schedule count on it")
            step = run_step
        worker.resume_at(step)
        self._set_lr(worker)
        if downloaded:
            self._save_checkpoint(worker)  # fetched layers are work a crash before the next checkpoint would lose
        worker.between_steps = self._between_steps
        self.worker = worker
        self._divergence_looks, self._diverging_said = [], 0  # its restores count from 0
        await worker.start()
        # said before it is published: a reader who sees the record (a test, an operator's `status`) then finds the
        # line in the log too; published first, the record's step came before the line that says where it started
        precision = f" with {worker.autocast_dtype} autocast".replace("torch.", "") if worker.autocast_dtype else ""
        self.say(f"{self.name}: training cluster {cluster} stage {stage}/{stages} layers "
                 f"{layers[0]}:{layers[1]} from step {step} on {worker.device}{precision}{came_from}")
        self.announcer.update(state="training", cluster=cluster, stage=stage, layers=list(layers), step=step,
                              kept_rounds=self.state_server.kept_rounds(*layers))
        await self.announcer.renew()

    async def _run_step(self, plan: dict, cluster: int) -> Optional[int]:
        """The step the run's other clusters are at: the highest their first stages' records say (a stage 0 counts
        its cluster's steps); None when no other cluster trains, or their records cannot be read now."""
        others = [stages[0]["peer_id"] for index, stages in enumerate(plan["clusters"]) if index != cluster]
        if not others:
            return None
        try:
            records = await self.announcer.read_peers(peer_ids=others)
        except Exception as e:  # no news of them: we count from our layers' step, as before
            logger.warning(f"reading the other clusters' records failed: {e}")
            return None
        steps = [r["step"] for r in records if r["peer_id"] in others and r["state"] in ("training", "averaging")
                 and r.get("stage") == 0 and r.get("step") is not None]
        return max(steps) if steps else None

    async def _take_handed_state(self, worker: StageWorker, layers: Tuple[int, int], step: int, plan: dict) -> None:
        """Where a peer stopped training our very layers (it leaves, or a plan moved it) and keeps its stage's
        optimizer state, take its inner and outer state as ours (``stage_state.py``): its place in the run is ours
        now (of several leavers, the one whose place ``plan`` gives us, whose layers we took: ``place_taken_over``).
        Not where we keep our own for them (our cache or checkpoint, at this step); a failure is said, and the state
        then starts afresh as before."""
        if any(kept is not None and kept[0] == layers and kept[1] == step
               for kept in (self.kept_optimizer, self.kept_outer)):
            return
        try:
            peers = await self.announcer.read_peers()
            giver = stage_giver(peers, self.peer_id, layers, place_taken_over(peers, self.plan_before, plan,
                                                                              self.peer_id))
        except Exception as e:  # no news of a giver: the state starts afresh, as _take_optimizer_state says
            logger.warning(f"reading the peer records for a stage's optimizer state failed: {e}")
            return
        if giver is None:
            return
        holder, links = PeerID.from_base58(giver["peer_id"]), self.node.routes
        try:
            await links.connect(holder, maddrs_without_peer_id(giver["maddrs"], holder), giver.get("reachability"))
            inner, outer, its_step = await fetch_stage_state(links, self.run, holder, layers, worker.module,
                                                             worker.optimizer, self.options.transfer_timeout)
        except Exception as e:
            timed_out = isinstance(e, asyncio.TimeoutError)
            reason = "no answer in time" if timed_out else CONTROL_CHARACTER_RE.sub(" ", str(e))
            self.say(f"{self.name}: could not take the optimizer state of layers {layers[0]}:{layers[1]} from "
                     f"{giver['name']}: {reason}")
            return
        source = f"{giver['name']}, which stopped training them at step {its_step}"
        self.kept_optimizer = (layers, step, inner, source) if inner else None
        self.kept_outer = (layers, step, outer, source) if outer else None

    async def _carry_optimizer_state(self, worker: StageWorker, layers: Tuple[int, int], step: int) -> None:
        """Where no state of ours or a giver's goes with our layers, take a copy of the inner state (AdamW's moments,
        momentum) of the holders that served our downloaded layers (``stage_state.carry_layer_states``): `bench
        diloco --reform-every` measured a re-formed cluster better with it than starting afresh."""
        kept = self.kept_optimizer
        if self.spec.optimizer == "sgd" or not self.layer_holders or (kept is not None and kept[:2] == (layers, step)):
            return
        records = {r["peer_id"]: r for its_holders in self.layer_holders.values() for r in its_holders}
        holders = {layer: [PeerID.from_base58(r["peer_id"]) for r in its_holders]
                   for layer, its_holders in self.layer_holders.items()}
        state, givers = await carry_layer_states(self.node.routes, self.run, worker.module, layers[0],
                                                 worker.optimizer, holders, self.options.transfer_timeout,
                                                 self._reach(records))
        if state:
            whose = sorted({records[giver.to_base58()]["name"] for giver in givers.values()})
            self.kept_optimizer = (layers, step, state, f"the holders of its downloaded layers ({len(givers)} of "
                                                        f"{len(self.layer_holders)}: {', '.join(whose)}), a copy")

    def _reach(self, records: Dict[str, Dict]) -> Callable[[PeerID], Awaitable[str]]:
        """Connects to a holder among ``records`` (peer id -> record) before it is asked, and returns the route: its
        record's addresses and reachability choose it (a holder behind NAT dials us back)."""
        links = self.node.routes

        async def reach(holder: PeerID) -> str:
            record = records[holder.to_base58()]
            return await links.connect(holder, maddrs_without_peer_id(record["maddrs"], holder),
                                       record.get("reachability"))
        return reach

    def _training_stage(self) -> Optional[TrainingStage]:
        worker = self.worker
        return None if worker is None else TrainingStage(worker.start_layer, worker.module, worker.optimizer,
                                                         worker.version)

    async def _state_awaited(self, peers: List[Dict], placed: Optional[Set[str]]) -> bool:
        """Whether our graceful leave waits on for the stage's optimizer state to be taken (``hand_over``): we have
        some, no peer in ``placed`` (``_planned_peers``, as the hand-over read it; a stranger's fetch takes nothing
        over; None: any peer) took it, and a standby is there that a new plan may put in our place, unless the plan
        adopted since we left puts none there (a walkthrough's Ctrl-C waited out the whole hand-over timeout, 90 s,
        for a standby that the plan made for our leave had left where it was, too slow to be worth a place)."""
        stage = self.stopped_stage
        if stage is None or not (stage.optimizer.state or stage.outer):
            return False
        if any(placed is None or taker in placed for taker, layers, step in self.stage_state_server.served
               if (layers, step) == (stage.layers, stage.step)):
            return False
        if not any(p["state"] in ("standby", "joining") for p in peers):
            return False
        return not await self._placed_nobody_on(stage.layers, peers)

    async def _placed_nobody_on(self, layers: Tuple[int, int], peers: List[Dict]) -> bool:
        """Whether a plan adopted after the one we left is in force and puts no peer on ``layers`` that did not
        train them already (:func:`new_takers`)."""
        left_in = None if self.plan is None else self.plan["round"]
        if left_in is None or self.rounds is None or not any(
                (p.get("plan_round") or 0) > left_in for p in peers if p["state"] != "leaving"):
            return False
        try:
            plan = await self.rounds.current_plan()
        except Exception as e:  # no plan read: wait on, the timeout still bounds it
            logger.warning(f"reading the plan in force while handing over failed: {e}")
            return False
        if plan is None or plan["round"] <= left_in:
            return False
        return not new_takers(plan, layers, peers, self.peer_id)

    def _take_optimizer_state(self, worker: StageWorker, layers: Tuple[int, int], step: int) -> None:
        """A resumed stage goes on with the optimizer state its checkpoint kept (AdamW's moments, momentum), a
        stage placed back on the layers of the one we stopped last, at its step, with that one's, and a stage that
        takes over the layers of a peer that stopped training them with that peer's (:meth:`_take_handed_state`);
        otherwise it starts afresh, which we say."""
        if self.spec.optimizer == "sgd":
            return  # no state to keep
        kept, self.kept_optimizer = self.kept_optimizer, None
        if kept is not None and kept[0] == layers and kept[1] == step:
            worker.optimizer.load_state_dict({"state": kept[2],
                                              "param_groups": worker.optimizer.state_dict()["param_groups"]})
            self.say(f"{self.name}: {self.spec.optimizer} state resumed from {kept[3]}")
        elif step > 0:  # at a run's start there is no state to speak of
            self.say(f"{self.name}: {self.spec.optimizer} state of layers {layers[0]}:{layers[1]} starts afresh at "
                     f"step {step} (no peer that stopped training them handed theirs over)")
            self._note(f"{self.spec.optimizer} state reset at step {step}: layers {layers[0]}:{layers[1]} came "
                       f"without it")

    def _take_outer_state(self, worker: StageWorker, layers: Tuple[int, int], step: int) -> None:
        """A resumed stage goes on with the outer optimizer's state its checkpoint kept (the last round's anchor, the
        momentum, the error feedback), and a stage placed back on the layers of the one we stopped last with that
        one's: its first round then compresses again where its ring's members kept the same anchor. Also where the
        layers came from a holder at a later step: the anchor is the state of a round, the same on every member
        that took it, not of the layers; and each ring compares its members' anchors before it compresses, so a
        stale one costs one round of parameters in float32, while one the holders share keeps the round compressed
        (two clusters resumed together: the one placed first trained on alone, and the other then took its layers).
        Other layers start it at their first round, which we say."""
        kept, self.kept_outer = self.kept_outer, None
        if kept is None:
            return
        if kept[0] == layers and self.averaging.resume_outer(worker, kept[2]):
            names = ", ".join(key for key in OUTER_STATE_KEYS if key in kept[2])
            layers_from = "" if kept[1] == step else f" (its layers are of step {step})"
            self.say(f"{self.name}: outer state ({names}) resumed from {kept[3]}{layers_from}")
        else:
            self.say(f"{self.name}: the outer state of {kept[3]} (layers {kept[0][0]}:{kept[0][1]}) is not this "
                     f"stage's (layers {layers[0]}:{layers[1]}, step {step}, outer optimizer "
                     f"{self.spec.outer_optimizer}): it starts at the stage's first round")

    async def _stop_worker(self) -> None:
        """Stop the stage worker; its layers stay in the cache, on offer to others, and in the checkpoint."""
        worker = self.worker
        if worker is None:
            return
        # hand the layers to the state server first: others may be fetching them while the worker stops
        self.held, self.worker = (worker.start_layer, worker.module, worker.version), None
        self.stopped_worker = worker
        self.averaging.cancel()  # a round beside training (averaging_overlap) was for the layers it trained
        await worker.shutdown()
        # an update in flight may have finished while the worker stopped: offer the final step with the weights
        self.held = (worker.start_layer, worker.module, worker.version)
        # say so: a peer placed on these layers in the same round finds them here, not only in the cache
        self.announcer.update(held=[worker.start_layer, worker.end_layer, worker.version])
        self.rejected_before += worker.counters.rejected
        self.divergences_before += worker.counters.divergences
        for offset, layer in enumerate(worker.module):
            self.cache[worker.start_layer + offset] = (
                {k: v.detach().to("cpu", copy=True) for k, v in layer.state_dict().items()}, worker.version)
        self._keep_optimizer_states(worker)
        self._save_checkpoint(worker)

    def _keep_optimizer_states(self, worker: StageWorker) -> None:
        """Keep a stopped worker's inner and outer optimizer state: a plan that places us back on its layers, which
        then come from our cache at its step, goes on with them (AdamW's moments and the outer anchor belong to
        these very parameters)."""
        layers, source = (worker.start_layer, worker.end_layer), f"its stage stopped at step {worker.version}"
        self.kept_optimizer = (layers, worker.version, worker.optimizer.state_dict()["state"], source)
        outer = self.averaging.outer_state(worker)
        self.kept_outer = (layers, worker.version, outer, source) if outer else None
        self.stopped_stage = StoppedStage(layers, worker.version, worker.optimizer, outer, worker.module)

    async def _fill_layers(self, module: torch.nn.Sequential, layers: Tuple[int, int], plan: Optional[dict] = None,
                           cluster: int = 0, stage: int = 0) -> Tuple[int, bool]:
        """Load every owned layer from the freshest source; return the step training continues from, and
        whether any layer came from another peer (then :attr:`layers_came_from` says from which round or step).
        ``plan``, ``cluster``, ``stage``: where the plan we follow puts us (the stages of our cluster take their
        layers from one averaging round, :meth:`_download`)."""
        start, end = layers
        for attempt in range(HOLDER_LOOKUPS):
            # a leaving peer counts: it serves the layers it trained until someone has them (_hand_over)
            peers = [p for p in await self.announcer.read_peers()
                     if p["peer_id"] != self.peer_id and layer_offers(p)]
            covered = all(layer in self.cache or any(offered_step(p, layer) is not None for p in peers)
                          for layer in range(start, end))
            # in a run's first plan nobody has trained yet and the seeded weights are the state, unless a peer
            # offers a trained layer: a swarm restarted from its checkpoints, whose holders are worth waiting for
            trained = any(step > 0 for p in peers for _, _, step in layer_offers(p))
            if covered or self.plan is None or (self.plan["round"] == 1 and not trained):
                break
            await asyncio.sleep(1.0)  # holders re-publish what they hold right after adopting a plan
        step = 0
        remote: Dict[int, List[LayerOffer]] = {}
        snapshot = []  # the layers nobody serves and we never held, filled from --init-from
        init = False  # looked up only for such a layer
        leaver = None if plan is None else place_taken_over(peers, self.plan_before, plan, self.peer_id)
        for layer in range(start, end):
            offers = offers_of(peers, self.plan, layer, self.plan_before)
            # the leaver whose place we take: its copy, if it still serves it (else the others', fill_again)
            offers = [offer for offer in offers if offer.leaving and offer.holder.to_base58() == leaver] or offers
            cached = self.cache.get(layer)
            untrained = cached is None and self.options.init_from is None and seeded_only(offers)
            if offers and not untrained and (cached is None or agreed_step(counted_offers(offers)) > cached[1]):
                remote[layer] = offers
            elif cached is not None:
                module[layer - start].load_state_dict(cached[0])
                step = max(step, cached[1])
            elif (init := self._init_or_none() if init is False else init) is not None:
                try:
                    module[layer - start].load_state_dict(init.layer_state(layer))
                except UserError as e:  # a damaged snapshot: the seeded weights, as for one that does not read
                    self.say(f"{self.name}: {e}; layer {layer} starts from the seeded weights")
                    continue
                snapshot.append((layer, init.manifest["layers"][layer]["step"]))
                step = max(step, snapshot[-1][1])
        if snapshot:
            self.say(f"{self.name}: layers {snapshot[0][0]}:{snapshot[-1][0] + 1} from the snapshot {init.path} (step "
                     f"{max(s for _, s in snapshot)}): nobody serves them")
        if remote:
            # a cluster that trains on has no round to start from: the leaver's stage goes on as it was
            first_stage = plan["clusters"][cluster][0] if plan is not None and stage > 0 and leaver is None else None
            records = {p["peer_id"]: p for p in peers}
            cluster_round = self._round_for_cluster(peers, records, plan, cluster, self.plan_before) \
                if plan is not None and stage == 0 and leaver is None else None
            step = max(step, await self._download(module, start, remote, records, first_stage, plan, cluster_round))
            if leaver is not None and self.layer_holders and all(
                    [r["peer_id"] for r in holders] == [leaver] for holders in self.layer_holders.values()):
                self.layers_came_from += f" of {records[leaver]['name']}, whose place it takes"
        return step, bool(remote)

    @staticmethod
    def _round_for_cluster(peers: List[Dict], records: Dict[str, Dict], plan: dict, cluster: int,
                           before: Optional[dict]) -> Optional[int]:
        """The averaging round whose state every layer of ``cluster`` in ``plan`` can be had of, as its holders'
        records (``peers``, by peer id in ``records``; ``before``: the plan followed before) say
        (``placement.round_for_cluster``), or None."""
        stages = plan["clusters"][cluster]
        return round_for_cluster({layer: [records[offer.holder.to_base58()]
                                          for offer in counted_offers(offers_of(peers, plan, layer, before))]
                                  for layer in range(stages[0]["layers"][0], stages[-1]["layers"][1])})

    async def _download(self, module: torch.nn.Sequential, start: int, remote: Dict[int, List[LayerOffer]],
                        records: Dict[str, Dict], first_stage: Optional[Dict] = None,
                        plan: Optional[dict] = None, cluster_round: Optional[int] = None) -> int:
        """Fetch the layers in ``remote`` from the holders that offer them (``fill_layer``), with a progress bar.

        All from one step: the state of one averaging round, the same on every cluster. The first stage of a
        cluster takes ``cluster_round`` (the latest round the holders of all the cluster's layers keep:
        :meth:`_round_for_cluster`), or where none is known the last round its holders agree on, and says which
        in its record (``start_round``); a later stage (``first_stage``: where the plan puts its cluster's first
        stage) takes the round that record names, so a new or re-formed cluster does not start with stages from
        different steps (issue 33: 1,879 and 3,100). :attr:`layers_came_from` says which round (or step) the layers
        came from.

        A layer no holder gives, or whose holders disagree, keeps its local weights (said in our log and note),
        but the step still follows the holders': the rest of the cluster is there, and a stage that restarted
        its count at 0 would wait for microbatches its neighbours, done with their steps, never send.
        ``records``: the holders' peer records, whose addresses and reachability choose the route (a holder
        behind NAT dials us back).
        """
        links = self.node.routes
        reach = self._reach(records)
        step = 0
        traffic = links.traffic.received
        before = traffic[LAYER_STATE] + traffic[LAYER_STATE_MESSAGE]
        with self.wall_time.using("download"), \
                Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                         console=self.console, transient=False) as progress:
            round_step = None if first_stage is None or plan is None else \
                await self._start_round_of(first_stage, plan)
            if first_stage is None and cluster_round is not None:
                round_step = cluster_round  # said before the download: the later stages need not wait for it
                self.announcer.update(start_round=round_step)
                await self.announcer.renew()
            wanted = round_step
            if first_stage is not None and round_step is not None:
                await self._await_round(round_step, {offer.holder.to_base58() for offers in remote.values()
                                                     for offer in offers})
            task = progress.add_task(f"{self.name}: downloading layers {sorted(remote)}", total=len(remote))
            copy_steps = []  # each layer's, and whether it was an averaged round's
            self.layer_holders = {}
            failed: Dict[int, LayerFill] = {}
            for layer, offers in sorted(remote.items()):
                filled = await fill_layer(links, self.run, module[layer - start], layer, offers,
                                          self.options.transfer_timeout, reach=reach, round_step=round_step)
                if not filled.loaded and filled.unanswered:
                    failed[layer] = filled  # asked again below, of the holders records name by then
                    continue
                step = max(step, self._took(filled, layer, records, copy_steps))
                if round_step is None and first_stage is None and filled.averaged:
                    # we decide our cluster's round: the rest of our layers, and its other stages, take the same
                    round_step = filled.copy_step
                    self.announcer.update(start_round=round_step)
                    await self.announcer.renew()
                progress.advance(task)

            async def read_offers() -> Callable[[int], List[LayerOffer]]:
                peers = [p for p in await self.announcer.read_peers() if p["peer_id"] != self.peer_id]
                records.update({p["peer_id"]: p for p in peers})  # the route to a new holder: reach reads it
                return lambda layer: offers_of(peers, self.plan, layer, self.plan_before)

            refilled = await fill_again(links, self.run, module, start, failed, read_offers,
                                        self.options.transfer_timeout, reach, round_step, HOLDER_LOOKUPS)
            for layer, filled in sorted(refilled.items()):
                step = max(step, self._took(filled, layer, records, copy_steps))
                progress.advance(task)
        self.moved_bytes += traffic[LAYER_STATE] + traffic[LAYER_STATE_MESSAGE] - before
        if copy_steps and len(set(copy_steps)) == 1 and copy_steps[0][1]:  # one averaging round's state
            self.announcer.update(start_round=copy_steps[0][0])
        self.layers_came_from = _came_from(copy_steps, wanted)
        return step

    def _took(self, filled: LayerFill, layer: int, records: Dict[str, Dict], copy_steps: List[Tuple[int, bool]]) -> int:
        """Say and keep what one layer's download did (``filled``: its :class:`LayerFill`; ``copy_steps``: each
        loaded layer's step and whether it was averaged); the step training goes on from."""
        if not filled.loaded:
            self.say(f"{self.name}: {filled.problem}; keeping this layer's local weights")
            self._note(f"kept the local weights of {filled.problem}")
        elif filled.problem:
            self.say(f"{self.name}: {filled.problem}")
        if filled.loaded:
            copy_steps.append((filled.copy_step, filled.averaged))
            self.layer_holders[layer] = [records[holder] for holder in filled.holders]
        return filled.step

    async def _await_round(self, round_step: int, holders: Set[str]) -> None:
        """Wait, within ``transfer_timeout``, until every holder of our layers that will take averaging round
        ``round_step`` has (``placement.holders_before_round``); what they serve then is asked for as it is."""
        deadline = time.monotonic() + self.options.transfer_timeout
        while time.monotonic() < deadline:
            try:
                records = [r for r in await self.announcer.read_peers(peer_ids=sorted(holders))
                           if r["peer_id"] in holders]
            except Exception as e:  # no news of them: ask for the round as it is
                logger.warning(f"reading the records of our layers' holders failed: {e}")
                return
            behind = holders_before_round(records, round_step)
            if not behind:
                return
            logger.info(f"waiting for {', '.join(sorted(behind))} to take the round of step {round_step}")
            await asyncio.sleep(0.5)

    async def _start_round_of(self, first_stage: Dict, plan: dict) -> Optional[int]:
        """The averaging round (its step) whose state our cluster's first stage took its layers from, as its record
        says under ``plan``; None when it started without one (it kept its layers, or took live ones), follows
        another plan (a newer one, or another of the same round: ``plan_digest``), or says nothing within
        ``transfer_timeout``."""
        plan_round, digest = plan["round"], plan_digest(plan)
        deadline = time.monotonic() + self.options.transfer_timeout
        while time.monotonic() < deadline:
            try:
                records = await self.announcer.read_peers(peer_ids=[first_stage["peer_id"]])
            except Exception as e:  # no news of it yet: ask again
                logger.warning(f"reading our first stage's record failed: {e}")
                records = []
            for record in records:
                if record["peer_id"] != first_stage["peer_id"] or record.get("plan_round") is None:
                    continue
                if record["plan_round"] > plan_round:
                    return None  # a newer plan: the one we follow is over
                if record["plan_round"] == plan_round and record.get("plan_digest") not in (None, digest):
                    return None  # the other side of a split round (docs/planning.md): not our cluster's first stage
                start_round = record.get("start_round")
                if record["plan_round"] == plan_round and start_round is not None:
                    # a first stage that kept its place took its round long ago, which holders no longer keep. Its
                    # next round says so on the run's count; its step does not (a cluster ahead of the rounds, or a
                    # first stage that just downloaded and has not aligned its count yet, is far past the round)
                    next_round = record.get("next_round")
                    kept = next_round is None or \
                        next_round - start_round <= (KEPT_ROUNDS + 1) * self.spec.averaging_period
                    return start_round if kept else None
                started = record["state"] in ("training", "averaging", "done") and record.get("stage") == 0 and \
                    record.get("layers") == list(first_stage["layers"])
                if record["plan_round"] == plan_round and started:
                    return None
            await asyncio.sleep(0.5)
        self.say(f"{self.name}: our first stage said no averaging round to start from within "
                 f"{self.options.transfer_timeout:.0f}s; taking each layer's latest")
        return None

    def _offered_layers(self) -> Dict[int, Tuple[Dict[str, torch.Tensor], int]]:
        """Every layer this peer can give, freshest copy of each: the cache (stopped workers, checkpoint),
        then the last stopped worker's, then the running worker's. A peer that just moved to other layers
        still answers for its old ones, which others may be fetching on the strength of its older record."""
        offered = dict(self.cache)
        if self.held is not None:
            offered.update(offered_layers(*self.held))
        worker = self.worker
        if worker is not None:
            offered.update(offered_layers(worker.start_layer, worker.module, worker.version))
        return offered

    # ------------------------------------------------------------------ between optimizer steps
    def _set_lr(self, worker: StageWorker) -> None:
        """Our stage's lr: the run's, as the spec's rule scales it with the clusters (``spec.cluster_lr``;
        docs/swarm.md, "The learning rate across clusters"), ``warmup`` counting from our worker's start or its last
        change of the number of clusters, along the spec's schedule at the run's step (``optimizers.inner.scheduled_lr``)."""
        lr = scheduled_lr(cluster_lr(self.spec.lr, worker.config.clusters, self.spec.lr_scaling,
                                     worker.version - worker.clusters_since),
                          worker.version, self.spec.steps, self.spec.lr_schedule, self.spec.warmup_steps)
        for group in worker.optimizer.param_groups:
            group["lr"] = lr

    async def _between_steps(self, step: int) -> None:
        worker = self.worker  # the one calling: a new plan may stop it (self.worker None) while we await a round
        if worker is None:
            return  # our worker is stopping (a new plan, a leave): nothing of it to average, keep or save
        self._set_lr(worker)  # the schedule moves with the step
        if self._last_round is not None and not self._last_round.done():
            with self.wall_time.using("averaging"):
                taken = await self.averaging.leave_round(worker, self.plan, step)
            if taken is not None and not self._last_round.done():
                self._last_round.set_result(taken)
                self.announcer.update(leaving_after_round=taken.label)
                # the stage stands still at the round's step until it stops: a step more would be work that the
                # round's average lacks, and the checkpoint and the hand-over would hold it alone
                await asyncio.get_running_loop().create_future()
        elif not self.spec.averaging_period:
            pass
        elif self.spec.averaging_overlap:
            averaged = self.averaging.take_finished(worker)  # a round beside training ended: applied at this boundary
            if self.averaging.holds_up(worker, step):
                with self.wall_time.using("averaging"):  # the next round is due and this one moves its parts
                    averaged = await self.averaging.finish_in_flight(worker)
            due = self.averaging.due(worker, self.plan, step) if self._averages_now() else None
            if due is not None:
                self.averaging.begin(worker, self.plan, step, due)  # the stage never waits for a round
            if averaged is not None:
                worker.mark_restore_point("the averaged state" if averaged else "its own state")
        elif self._averages_now():
            due = self.averaging.due(worker, self.plan, step)
            if due is not None:
                with self.wall_time.using("averaging"):  # the stage stands still meanwhile (the scheduler awaits us)
                    averaged = await self.averaging.average(worker, self.plan, step, due)
                # what a divergence goes back to (pipeline/guard.py): the averaged state, or where there is none (a
                # failed round) our own, kept only while the loss is at its level
                worker.mark_restore_point("the averaged state" if averaged else "its own state")
        elif step % self.spec.averaging_period == 0:
            worker.mark_restore_point("its own state")  # one cluster: its own state, kept while the loss is at its level
        if self.checkpoint_path and step % self.options.checkpoint_every == 0:
            self._save_checkpoint(worker)

    def _averages_now(self) -> bool:
        """Whether our stage has partners to average with in the plan we follow (clusters with a gone peer left
        out: ``StageAveraging.partners``)."""
        if self.plan is None or not self.averaging.partners(self.plan):
            return False
        # the plan just adopted moves us: this worker stops next, and its partners moved too
        return self.adopted is self.plan or kept_in_place(self.plan, self.adopted, self.peer_id)

    def _count_rejected(self, count: int) -> None:
        self.rejected_before += count

    def _gate_refusal(self, reason: str) -> None:
        """A message the routes' gate refused (a sender not admitted to our invite-only run): counted in our record,
        and named in its note, as a standby too."""
        self._count_rejected(1)
        self.announcer.update(rejected=self.rejected_before + (self.worker.counters.rejected if self.worker else 0))
        self._note(f"{REFUSAL_NOTE} {reason}")

    def _renewal_problem(self, problem: Optional[str]) -> None:
        """Say when our record stops being renewed (others lose us from their view once it expires) and when it
        is renewed again: the heartbeat keeps trying every second meanwhile."""
        if problem is None:
            self.say(f"{self.name}: our peer record is renewed again ({self.announcer.renewal_failures} renewal(s) "
                     f"failed)")
            self._note(f"record renewal failed {self.announcer.renewal_failures} time(s), renewed again")
        else:
            self.say(f"{self.name}: error: our peer record could not be renewed ({problem}); others lose us from "
                     f"their view if this lasts; trying again every second")

    def _gone(self) -> FrozenSet[str]:
        """Peers of the plan we follow that our planning rounds found gone (none before the rounds start)."""
        return self.rounds.triggers.gone() if self.rounds is not None else frozenset()

    def _following(self) -> Following:
        """What the averaging of our stage follows: our worker and plan, the gone peers (:meth:`_gone`), the peers
        whose records, still valid, say they left gracefully, and the peers of the run we have read records of."""
        if self.rounds is None:
            return Following(self.worker, self.plan)
        return Following(self.worker, self.plan, self._gone(), self.rounds.leaving, self._known_peers())

    def _known_peers(self) -> Collection[str]:
        """Every peer of the run whose record our planning rounds have read, as they read more (a live view): a
        ring member or pipeline neighbour that names or is one of them while we disagree on the plan is honest
        timing, refused but not counted as hostile."""
        return self.rounds.names.keys() if self.rounds is not None else ()

    def _note(self, text: str) -> None:
        """The record's note: the last failure or refusal, with its cause (``status --json``, the dashboard).
        A cause quotes error messages and other peers' input, so control characters become spaces: the record
        refuses them, and a record that fails validation would stop our heartbeats."""
        self.announcer.update(note=CONTROL_CHARACTER_RE.sub(" ", text)[:MAX_NOTE_LEN])

    # ------------------------------------------------------------------ progress and checkpoints
    def _publish_progress(self) -> None:
        worker = self.worker
        if worker is None:
            return
        now, version = time.monotonic(), worker.version
        if self._rate_worker is not worker:  # a new worker starts from the step of the layers it got
            self._rate_worker, self._progress = worker, deque()
        self._progress.append((now, version))
        while len(self._progress) > 2 and self._progress[1][0] <= now - RATE_WINDOW:
            self._progress.popleft()  # keeps one look at or before the window's start
        first_time, first_version = self._progress[0]
        rate = (version - first_version) * self.spec.microbatch_size / (now - first_time) if now > first_time else None
        losses = worker.counters.losses
        self.announcer.update(step=version, samples_per_s=None if rate is None else round(rate, 3),
                              loss=round(losses[-1][1], 6) if losses else None,
                              rejected=self.rejected_before + worker.counters.rejected)
        if worker.counters.last_rejected != self._noted_rejection:
            self._noted_rejection = worker.counters.last_rejected
            self._note(f"{REFUSAL_NOTE} {worker.counters.last_rejected}")
        if worker.counters.last_failed != self._noted_failure:
            self._noted_failure = worker.counters.last_failed
            self._note(f"dropped {worker.counters.last_failed}")
        self._report_divergences(worker)
        self.announcer.update(codecs={handler.rsplit(".", 1)[-1]: link.current
                                      for handler, link in worker.outbox.codecs.items()})
        if (worker.finished.is_set() or worker.resumed_at >= self.spec.steps) and \
                self.announcer.record["state"] != "averaging":
            # a stage placed after its cluster already trained its steps has nothing left to do; one still in
            # its last averaging round is done when that round is (its record then counts it). A later stage
            # whose count reached the run's length is not done before the finish: it may be ahead of stage 0
            # (a step on a microbatch stage 0 dropped), which draws another in its place (docs/pipeline.md)
            self.announcer.update(state="done", samples_per_s=0.0)  # still serving its layers to others
            self.wall_time.count(False)  # nothing left to train: the time after is no stage's

    def _publish_use(self) -> None:
        """Where our wall time went while placed, and our traffic: bytes/s out and in over the last RATE_WINDOW
        seconds, the layers we downloaded to move, and the codecs in use (the pipeline's are ``codecs``)."""
        now = time.monotonic()
        up, down = self.node.routes.traffic.totals()
        looks = self._traffic_looks
        looks.append((now, up, down))
        while len(looks) > 2 and looks[1][0] <= now - RATE_WINDOW:
            looks.popleft()  # keeps one look at or before the window's start
        since, up_then, down_then = looks[0]
        rates = dict(bytes_up_per_s=round((up - up_then) / (now - since), 1),
                     bytes_down_per_s=round((down - down_then) / (now - since), 1)) if now > since else {}
        shares = self.wall_time.shares()
        use = dict(utilisation=round(utilisation(shares), 4), window_s=round(self.wall_time.total(), 1),
                   time_shares={name: round(share, 4) for name, share in shares.items()}) if shares else {}
        self.announcer.update(**rates, **use, moved_bytes=self.moved_bytes, averaging_codec=self.spec.averaging_compression)

    async def _record_history(self) -> None:
        """With ``--snapshot-dir``, one line of the run's figures as our view of it holds them, every heartbeat."""
        now = time.monotonic()
        if self.options.snapshot_dir is None or now - self._history_at < self.membership.options.heartbeat:
            return
        self._history_at = now
        state = SwarmState(self.run)
        state.feed(dict(run=self.run, at=time.time(), peers=await self.announcer.read_peers(), plan=self.plan))
        figures = run_figures(state, own=self.announcer.record)
        self._seen_step = max(self._seen_step, figures["step"])
        append_figures(self.options.snapshot_dir, figures)

    def _maybe_snapshot(self) -> None:
        """With ``--snapshot-every N``, start an export of the run each time its step passes a multiple of N."""
        every = self.options.snapshot_every
        if not every or self.options.snapshot_dir is None or self._seen_step // every <= self._snapshot_mark or \
                (self._snapshot_task is not None and not self._snapshot_task.done()):
            return
        self._snapshot_mark = self._seen_step // every
        self._snapshot_task = asyncio.create_task(self._snapshot(self._seen_step))

    async def _snapshot(self, step: int) -> None:
        """Export the run to ``snapshot-STEP`` as ``ravnest-swarm export`` does, then keep the newest few.

        Through a DHT client node of its own, with a new peer id each time: our own layers are asked from our own
        server like anyone's (a node cannot call itself), and a holder serves this download a fresh copy (a holder
        keeps one copy per requester for a whole download, ``state_transfer._held_copy``)."""
        out = os.path.join(self.options.snapshot_dir, f"snapshot-{step:010d}")
        ours = not os.path.exists(out)  # one of an earlier session at this step is never removed for our failure
        try:
            node = await start_node(self.membership.options.initial_peers, client_mode=True,
                                    record_validators=make_validators(self.run, self.owner))
            try:
                manifest = await export_with(node, RunAddress(self.run, self.owner), out, self.options.transfer_timeout,
                                             None)
            finally:
                await stop_node(node)
        except Exception as e:  # a holder that left mid-download: the next multiple tries again
            if ours:
                shutil.rmtree(out, ignore_errors=True)
            self.say(f"{self.name}: no snapshot at step {step}: {e if isinstance(e, UserError) else repr(e)}")
            return
        steps = sorted({layer["step"] for layer in manifest["layers"]})
        self.say(f"{self.name}: snapshot of run {self.run} at step {step} in {out} (layers at steps "
                 f"{', '.join(map(str, steps))})")
        kept = sorted(name for name in os.listdir(self.options.snapshot_dir) if name.startswith("snapshot-"))
        for name in kept[:-SNAPSHOTS_KEPT]:
            shutil.rmtree(os.path.join(self.options.snapshot_dir, name), ignore_errors=True)

    def _init_or_none(self):
        """:meth:`_init_source`, where a snapshot written meanwhile does not read: None (the seeded weights), said."""
        try:
            return self._init_source()
        except UserError as e:
            self.say(f"{self.name}: {e}")
            return None

    def _init_source(self):
        """The ``--init-from`` export (the newest snapshot, where it names a ``--snapshot-dir``: snapshots taken since we
        started count), checked against the run's model (one line if it is another's), or None."""
        path = newest_export(self.options.init_from) if self.options.init_from is not None else None
        if path is None:
            return None
        if self._init_export is None or self._init_export.path != path:
            export = read_export(path)
            difference = first_difference(export.spec["layout"], model_layout(self.model))  # "yours": the export's
            if difference is not None:
                raise UserError(f"--init-from {path} is an export of another model than this run's {self.spec.model}: "
                                f"{difference}", exit_code=1)
            self._init_export = export
        return self._init_export

    def _report_divergences(self, worker: StageWorker) -> None:
        """Our record counts the times our stage diverged and restored; its note and our log say the last; a
        stage with :data:`DIVERGING_REPEATS` restores within :data:`DIVERGING_STEPS` steps says its cluster keeps
        diverging (its learning rate is likely too high for it: the owner lowers it with ``update-spec``)."""
        total = worker.counters.divergences
        self.announcer.update(divergences=self.divergences_before + total)
        last = worker.counters.last_divergence
        if last is None or last == self._noted_divergence:
            return
        self._noted_divergence = last
        cluster = self.placement[0] if self.placement else "?"
        # a round taken within its period before: what it did, for whoever reads why (the lab run's open divergence)
        applied = self.averaging.taken_within_period(worker)
        after = "" if applied is None else f"; {worker.version - applied.at} step(s) after it took {applied}"
        self.say(f"{self.name}: cluster {cluster} stage {worker.config.stage} diverged {last} ({total} so far){after}")
        self._note(f"{DIVERGED_NOTE} {last}")
        # (step, restores so far) at each look: the restores within the window are those since the last look before it
        self._divergence_looks = [(step, count) for step, count in self._divergence_looks if count >= self._diverging_said]
        before = [count for step, count in self._divergence_looks if step < worker.version - DIVERGING_STEPS]
        self._divergence_looks.append((worker.version, total))
        recent = total - max(before + [self._diverging_said])
        if recent >= DIVERGING_REPEATS:
            self._diverging_said = total
            self.say(f"{self.name}: error: cluster {cluster} keeps diverging ({recent} restores within "
                     f"{DIVERGING_STEPS} steps, at lr {worker.optimizer.param_groups[0]['lr']:g}): the run's owner "
                     f"may lower its lr (`ravnest-swarm update-spec --lr ...`)")

    async def _explain_stall(self) -> None:
        """When our stage has not stepped for STALL_SECONDS, say what the cluster waits for: the slots of the
        plan whose peer is gone, and what a peer needs to take them (a round places one as soon as it can)."""
        worker, plan = self.worker, self.plan
        if worker is None or plan is None or self.placement is None or worker.version >= self.spec.steps:
            return
        now = time.monotonic()
        if worker.version != self._progress_seen[1]:
            self._progress_seen = (now, worker.version)
            return
        if now - self._progress_seen[0] < STALL_SECONDS:
            return
        alive = await self.rounds.read_alive(get_dht_time())
        cluster = plan["clusters"][self.placement[0]]
        vacant = [(index, stage) for index, stage in enumerate(cluster) if stage["peer_id"] not in alive]
        situation = (plan["round"], tuple(index for index, _ in vacant))
        if not vacant or situation == self._stall_said:
            return
        self._stall_said = situation
        needs = "; ".join(f"stage {index} (layers {stage['layers'][0]}:{stage['layers'][1]}) needs a peer with "
                          f"{memory(sum(self.layer_memory_gb[stage['layers'][0]:stage['layers'][1]]))}"
                          for index, stage in vacant)
        self.say(f"{self.name}: cluster {self.placement[0]} is waiting at step {worker.version}: {needs} "
                 f"(its peer is gone; a round places a standby or a new volunteer as soon as one can hold it)")

    async def _run_finished(self) -> bool:
        """Whether the run reached its length (:func:`run_finished`); says so once, when it first sees it."""
        if self._finished:
            return True
        if self.worker is not None and self.announcer.record.get("state") != "done":
            return False  # we still train: the run cannot be finished
        if not self.spec.finished and not run_finished(await self.announcer.read_peers(), self.spec.steps):
            return False
        self._finished = True
        await self._mark_finished()
        if self.worker is None:
            self.say(f"{self.name}: run {self.run} is finished (its stages reached step {self.spec.steps}, "
                     f"the run's length): nothing left to train, leaving")
        else:
            where = f"; checkpoint {self.checkpoint_path}" if self.checkpoint_path else ""
            self._save_checkpoint(self.worker)
            self._write_report(self.worker)
            self.say(f"{self.name}: run {self.run} is finished: layers {self.worker.start_layer}:"
                     f"{self.worker.end_layer} trained to step {self.worker.version}{where}; they stay on "
                     f"offer to others until you stop (Ctrl-C)")
        return True

    async def _mark_finished(self) -> None:
        """As the run's owner (its key is on this machine), sign the run's end into its spec, so that ``status`` says
        it is finished even after every peer has left."""
        key = load_owner_key(self.options.owner_key or owner_key_path(self.run))
        if key is None or self.spec.finished or fingerprint(key.get_public_key().to_bytes()) != self.owner:
            return
        try:
            self.spec = await publish_spec_version(self.node, RunAddress(self.run, self.owner), {"finished": True}, key)
            self.say(f"{self.name}: signed the end of run {self.run} into its spec (version {self.spec.version})")
        except UserError as e:
            self.say(f"{self.name}: could not sign the end of run {self.run} into its spec: {e}")

    # ------------------------------------------------------------------ leaving
    async def _train_to_round(self, leave_now: asyncio.Event) -> Optional[LastRound]:
        """A graceful leave of a stage that averages with other clusters trains on to the stage's next round and
        takes it standing still (``StageAveraging.leave_round``), then stands still at that step until it stops, so
        that the run's average holds every step we trained: the partners of that round that kept its average
        hold our work whatever their own step, and take our layers (``hand_over``). Without it a Ctrl-C stopped at
        once, and where no peer held its layers at its own step (another cluster behind it, counting its own steps)
        what it trained since its last round stayed in its checkpoint (a soak: two of five Ctrl-Cs). Our record
        says ``leaving_after_round`` meanwhile: a partner leaving in the same round is no holder of our layers, nor
        we of its. Bounded by half the hand-over timeout (the rest is the hand-over's), a second Ctrl-C, the run's
        end, and a stage that has not stepped for :data:`STALL_SECONDS` outside its step hook (its cluster lost a
        peer); an error here leaves as without a last round (:meth:`run_until`). The round, or None where none
        averaged."""
        worker, timeout = self.worker, self.options.handover_timeout / 2
        if worker is None or self._finished or timeout <= 0 or not self.spec.averaging_period \
                or not self._averages_now():
            return None
        started = time.monotonic()
        why = None
        self._last_round = asyncio.get_running_loop().create_future()
        # the round we expect (0 where we do not know it yet), then the one taken: a partner's ring waits for us in
        # no round after it (``RecordPatience.never_coming``), and no leaver counts us as a holder
        self.announcer.update(leaving_after_round=self.averaging.next_round or 0)
        self.say(f"{self.name}: leaving after our stage's next averaging round, so that the run's average holds what "
                 f"it trained since the last one (Ctrl-C again to leave now)")
        await until_set(self.announcer.renew(), leave_now, timeout=timeout)
        step, seen, looked = worker.version, time.monotonic(), 0.0  # the renewal may have taken seconds
        while not self._last_round.done() and not leave_now.is_set():
            now = time.monotonic()
            if worker.failure is not None or worker.finished.is_set():
                break
            if worker.version != step or worker.scheduler.paused_since is not None:  # in its hook: a round
                seen, step = now, worker.version
            if now - started >= timeout or now - seen >= STALL_SECONDS:
                break
            if now - seen >= MATE_LEAVING_STALL_SECONDS and now - looked >= MATE_LEAVING_STALL_SECONDS:
                looked = now
                why = await self._mate_stops_first()
                # a step or our round that began during the read: the wait goes on
                if why is not None and worker.version == step and worker.scheduler.paused_since is None:
                    break
                why = None
            self._publish_progress()  # partners gauge from our step how long we take to reach the round
            await until_set(asyncio.shield(self._last_round), leave_now, timeout=1.0)
        if not self._last_round.done():
            self._last_round.cancel()
            why = (why if why is not None else "a second Ctrl-C" if leave_now.is_set()
                   else f"{worker.failure}" if worker.failure is not None
                   else "its stage reached the run's length" if worker.finished.is_set()
                   else f"none within {time.monotonic() - started:.0f}s")
            self.say(f"{self.name}: leaving without a last averaging round ({why})")
            return None
        last = self._last_round.result()
        if not last.averaged:
            self.say(f"{self.name}: our last averaging round (round {last.label}) did not average (where a ring "
                     f"failed, said above): what we trained since the round before is in our layers alone")
            return None
        self.say(f"{self.name}: our last averaging round (round {last.label}, our step {last.step}) averaged: the "
                 f"run's average holds what we trained")
        return last

    async def _mate_stops_first(self) -> Optional[str]:
        """Why our stage cannot reach our last round, if a peer of our cluster stops before it: one that is leaving
        (it stopped its stage), that our planning rounds found gone, or that leaves after its own last round at a
        step before our round's (its ``leaving_after_round`` plus its ``round_offset``, against ours: a count's
        offset can differ by a few steps within a cluster, and every peer stopped at once at a soak's or
        ``local``'s end waited for a round it never reached). None where none does, or its record is not read
        within :data:`MATE_LEAVING_STALL_SECONDS` (the other bounds still hold)."""
        averaging = self.averaging
        if self.plan is None or self.placement is None or averaging.next_round is None:
            return None
        mates = {stage["peer_id"] for stage in self.plan["clusters"][self.placement[0]]} - {self.peer_id}
        gone = mates & self._gone()
        if gone:
            return f"a peer of our cluster is gone ({', '.join(sorted(p[-8:] for p in gone))})"
        try:
            records = await asyncio.wait_for(self.announcer.read_peers(peer_ids=mates), MATE_LEAVING_STALL_SECONDS) \
                if mates else []
        except Exception as e:  # a DHT hiccup or a slow read: the stall bound still ends the wait
            logger.info(f"reading our cluster's records while leaving failed: {type(e).__name__}: {e}")
            return None
        ours = averaging.next_round + averaging.offset
        for record in records:
            if record["peer_id"] not in mates:
                continue
            if record["state"] == "leaving":
                return f"{record['name']} of our cluster stopped its stage"
            last = record.get("leaving_after_round") or 0
            if last and last + (record.get("round_offset") or 0) < ours:
                return f"{record['name']} of our cluster stands still at its own last round, before ours"
        return None

    async def _hand_over(self, leave_now: asyncio.Event, last_round: Optional[LastRound]) -> None:
        """Serve the layers we trained until another peer holds them (``hand_over.py``), unless we trained nothing
        since we started (a resumed checkpoint stays on disk) or the run is finished (nothing to keep).
        ``last_round``: the round our leave took (:meth:`_train_to_round`), whose partners that kept it hold our
        work at their own step."""
        worker = self.stopped_worker
        if worker is None or self._finished:
            return
        # _stop_worker wrote our checkpoint where we have a --checkpoint-dir
        # where a last round was waited for, it had half the timeout
        timeout = self.options.handover_timeout / (1 if self._last_round is None else 2)
        await hand_over(self.announcer, worker, self.name, self.console, timeout, leave_now,
                        self.checkpoint_path if self._checkpoint_problem is None else None, self._save_checkpoint,
                        str(RunAddress(self.run, self.owner)),
                        self._state_awaited, lambda: self.state_server.served,
                        only_held_here(self.plan, worker.start_layer, worker.end_layer, self.peer_id),
                        self._planned_peers, last_round)

    async def _planned_peers(self) -> Set[str]:
        """The peers that the plan we left or the plan in force places: who may take our layers at a leave."""
        plans = [self.plan, None if self.rounds is None else await self.rounds.current_plan()]
        return {stage["peer_id"] for plan in plans if plan is not None for cluster in plan["clusters"]
                for stage in cluster}

    def _save_checkpoint(self, worker: Optional[StageWorker], path: Optional[str] = None) -> bool:
        """Write ``worker``'s checkpoint (to ``path``, else our --checkpoint-dir's); whether it was written."""
        path = path or self.checkpoint_path
        if worker is None or path is None:
            return False
        try:
            save_stage(path, worker.module, worker.optimizer,
                       {"step": worker.version, "layers": [worker.start_layer, worker.end_layer], "run": self.run,
                        "model": self.spec.model, "model_config": self.spec.model_config,
                        "data_hash": self.spec.data_hash}, outer=self.averaging.outer_state(worker))
        except OSError as e:
            # a full disk or an unwritable --checkpoint-dir must not stop training, nor a leave's hand-over (which
            # needs no disk); the last whole checkpoint stays (writes are atomic). Said once per cause
            problem = f"{self.name}: could not write the checkpoint {path} ({e.strerror or e}); training goes on"
            if problem != self._checkpoint_problem:
                self.say(problem)
            self._checkpoint_problem = problem
            return False
        self._checkpoint_problem = None
        return True

    def _write_report(self, worker: StageWorker) -> None:
        if self.options.report is None:
            return
        report = dict(worker.report(), averaging=self.averaging.times, averaging_rounds=self.averaging.rounds,
                      averaging_failures=self.averaging.failures)
        # whole or not at all: a bench reads the file as soon as it appears
        write_atomically(self.options.report, json.dumps(report).encode())

    def _load_checkpoint_into_cache(self) -> None:
        """A resumed peer offers its checkpoint's layers as a cache entry at the checkpoint's step."""
        path = self.checkpoint_path
        # a corrupt file, or one of other layers than the run's model has, is a one-line UserError
        info, module = load_stage_layers(path, self.model.build_stage)
        start, end = info["layers"]
        for offset, layer in enumerate(module):
            self.cache[start + offset] = ({k: v.detach().clone() for k, v in layer.state_dict().items()},
                                          int(info["step"]))
        # offer them at once: after a restart of the whole swarm, the checkpoints are the only state left. As held
        # layers too: a plan that puts us on other layers changes our record's ``layers``, and a peer placed on
        # these then found nobody offering them and started them from step 0 (test_swarm, kill and resume)
        self.held = (start, module, int(info["step"]))
        optimizer = make_inner_optimizer(module.parameters(), self.spec.optimizer, self.spec.lr)
        source = f"the checkpoint of step {info['step']}"
        if load_optimizer_state(path, optimizer):  # read now: our next checkpoint rewrites the file
            self.kept_optimizer = ((start, end), int(info["step"]), optimizer.state_dict()["state"], source)
        outer = load_outer_state(path, sum(parameter.numel() for parameter in module.parameters()))
        if outer:
            self.kept_outer = ((start, end), int(info["step"]), outer, source)
        if self.kept_optimizer is not None or outer:
            # and give them to whoever a plan puts on these layers, as the peer that stopped training them: a
            # resumed swarm that re-plans puts others there, who started AdamW and the outer state afresh
            self.stopped_stage = StoppedStage((start, end), int(info["step"]), optimizer, outer, module)
        self.announcer.update(layers=[start, end], step=int(info["step"]), held=[start, end, int(info["step"])])
        self.say(f"{self.name}: resuming layers {start}:{end} from step {info['step']} ({path})")


async def take_part(membership: Membership, requested: Dict, options: VolunteerOptions, stop: asyncio.Event,
                    console: Console, leave_now: Optional[asyncio.Event] = None, facts: Optional[Dict] = None) -> None:
    """Follow the run's spec (creating it from ``requested`` and ``facts``, ``spec.model_facts``, if the run is
    new) and train until ``stop`` (``leave_now``: cut the hand-over of a graceful leave short) or the end of
    the run."""
    from ravnest_swarm.swarm.spec import ensure_spec

    run = membership.options.run
    address = RunAddress(run, membership.options.owner)
    found = await ensure_spec(membership.node, address, requested, stop,
                              on_wait=lambda: console.print(f"waiting as standby: run {address} has no spec yet "
                                                            f"(its owner starts it with --model)", highlight=False),
                              facts=facts, owner_key_file=options.owner_key,
                              on_start=lambda full: console.print(f"started run {full}: give joiners this address "
                                                                  f"(--run {full})", markup=False, highlight=False))
    if found is None:
        return
    spec, owner = found
    # in an invite-only run, one without a ticket that admits it leaves here, in one line
    await enter(membership, spec, owner, options.ticket, options.owner_key,
                say=lambda text: console.print(f"{membership.options.name}: {text}", markup=False, highlight=False,
                                               soft_wrap=True))
    # a user's model imports their code: off the event loop, which must keep our record renewed meanwhile
    model = await asyncio.get_running_loop().run_in_executor(None, spec.build_model, options.data)
    if spec.finished or run_finished(await membership.announcer.read_peers(), spec.steps):
        why = "its owner ended it" if spec.finished else f"its stages reached step {spec.steps}, the run's length"
        console.print(f"run {run} is finished: {why}; nothing left "
                      f"to train (`ravnest-swarm status` shows who still holds its layers)", markup=False,
                      highlight=False, soft_wrap=True)
        return
    await Volunteer(membership, spec, model, options, console, owner).run_until(stop, leave_now)


def _came_from(copy_steps: List[Tuple[int, bool]], wanted: Optional[int]) -> str:
    """What a stage's start line says of the layers it downloaded: of which round(s) of the run's count (averaged)
    or its holders' step(s) (live), given each loaded layer's ``(step or round, averaged)``, and whether that is the
    round its first stage took (``wanted``). The line names the stage's own step first, which is another count: a
    cluster that joined late counts steps from where the run's first stages are, not from the rounds."""
    steps = sorted({step for step, _ in copy_steps})
    if not steps:
        return "none of its downloaded layers could be loaded"
    averaged = [kind for _, kind in copy_steps]
    kind = "the run's averaged state" if all(averaged) else "live weights" if not any(averaged) else \
        "averaged and live weights"
    plural = "s" if len(steps) > 1 else ""
    unit = f"round{plural}" if all(averaged) else f"step{plural}" if not any(averaged) else "rounds and steps"
    said = f"its layers are {kind} of {unit} {', '.join(map(str, steps))}"
    if wanted is not None and steps != [wanted]:
        said += f", not all of round {wanted} that its first stage took (no longer served)"
    return said
