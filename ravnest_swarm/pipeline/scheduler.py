"""A stage's scheduling: which microbatch the compute thread takes next, and the bookkeeping of each one.

Rule (docs/pipeline.md): backward work first (oldest first), then forward work, then, on stage 0 only, a
new microbatch while fewer than ``max_in_flight`` are in flight (async; bounded staleness) or while the
current synchronous step still has room (sync, GPipe-style). Sends run as background tasks, so compute
and transfers overlap. A microbatch leaves this stage's books by completing, or by being dropped and
counted (a failed send, no gradient within ``microbatch_timeout``, the end of the run, its own compute
raising: bad targets, a loss that fails, anything): never silently, and the loop goes on.

A loss the divergence guard judges diverged (``pipeline/guard.py``) restores the last stage's layers, and a backward
message with a zero gradient and ``diverged`` set makes every stage before it restore its own in turn; a microbatch
a later stage drops (a skipped step, a failed compute) goes back as ``dropped``, so stage 0 need not wait for it.

Over 400 lines because the rule, each microbatch's books and what a neighbour may change of them (the steps it
names, a finish, a drop) are one state that the compute thread and the message handlers share.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Awaitable, Callable, Deque, Dict, List, Optional, Set, Tuple

import torch

from ravnest_swarm.membership.text import CONTROL_CHARACTER_RE
from ravnest_swarm.models import Dataset, ShardedSampler
from ravnest_swarm.pipeline import wire
from ravnest_swarm.pipeline.compute import Pending, StageCompute
from ravnest_swarm.pipeline.config import StageConfig
from ravnest_swarm.pipeline.counters import BusyTime, Counters
from ravnest_swarm.pipeline.guard import Diverged, SkippedStep

logger = logging.getLogger(__name__)

PROGRESS_EVERY = 10


# sends one message to a neighbour stage, retrying as messaging.Outbox does: None once delivered, else why not
# (handler, stage, message, tensors, microbatch, the peer it is for: None for whoever the plan names at the stage)
Send = Callable[[str, int, wire.Message, List[torch.Tensor], Optional[int], Optional[str]], Awaitable[Optional[str]]]


class Scheduler:
    """The forward and backward queues, the microbatches in flight, and the loop that feeds the compute thread.

    :param config: the stage's settings
    :param compute: the stage's layers and compute thread
    :param counters: the stage's counters (shared with its messaging)
    :param busy: the stage's busy time (sends count too)
    :param send: delivers a message to a neighbour stage (``messaging.Outbox.send``)
    :param dataset: stage 0's data (None on later stages, which receive their inputs)
    :param sampler: which samples each microbatch holds
    """

    def __init__(self, config: StageConfig, compute: StageCompute, counters: Counters, busy: BusyTime, send: Send,
                 dataset: Optional[Dataset], sampler: ShardedSampler):
        self.config, self.compute, self.counters, self.busy, self.send = config, compute, counters, busy, send
        self.dataset, self.sampler = dataset, sampler
        self.is_first, self.is_last = config.stage == 0, config.stage == config.stages - 1
        # awaited whenever the weights changed since its last call, while no compute runs: the volunteer
        # averages and checkpoints here without a cluster-wide barrier
        self.between_steps: Optional[Callable[[int], Awaitable[None]]] = None
        self.hooked_version = 0
        self.forward_queue: Deque[Tuple[int, List[int], torch.Tensor, torch.Tensor]] = deque()
        # (microbatch, gradient, and a later stage's word: why the cluster diverged, or why it dropped the microbatch)
        self.backward_queue: Deque[Tuple[int, torch.Tensor, Optional[str], Optional[str]]] = deque()
        self.queued_forward: Set[int] = set()
        self.pending: Dict[int, Pending] = {}
        self.queued_backward: Set[int] = set()
        # every microbatch id ever accepted, so a resend whose first copy arrived is acknowledged, not redone
        self.seen_forward: Set[int] = set()
        self.seen_backward: Set[int] = set()
        self.senders_replaced = 0  # how many times a new plan put another peer before us (sender_replaced)
        self.in_flight = 0
        self.step_open = True  # sync schedule: stage 0 may still inject into the current step
        self.finish_received = False
        self.final_step: Optional[int] = None  # the step stage 0 ended the run at, from its finish message
        self.paused_since: Optional[float] = None  # while the between_steps hook runs (see watchdog)
        self.finished = asyncio.Event()
        self.wakeup = asyncio.Event()
        self.sends: Set[asyncio.Task] = set()
        # "progress N/M" lines on stdout, which `bench pipeline` reads from its `stage` processes; a volunteer
        # shows its progress in its peer record instead (printed, they would scroll under its live view)
        self.print_progress = False

    # ---------------------------------------------------------------- what arrives (from messaging)

    def holding(self) -> int:
        """Microbatches this stage holds: queued for their forward, or awaiting their gradient."""
        return len(self.queued_forward) + len(self.pending)

    def queue_forward(self, microbatch: int, sample_ids: List[int], inputs: torch.Tensor, targets: torch.Tensor,
                      version: int) -> int:
        """Take a checked forward message; how many wait in the forward queue now."""
        if not self.seen_forward:
            self.follow_sender_steps(version)
        self.queued_forward.add(microbatch)
        self.seen_forward.add(microbatch)
        self.forward_queue.append((microbatch, sample_ids, inputs, targets))
        self.trace("forward_arrived", microbatch)
        self.wakeup.set()
        return len(self.forward_queue)

    def queue_backward(self, microbatch: int, grad: torch.Tensor, diverged: Optional[str] = None,
                       dropped: Optional[str] = None) -> int:
        """Take a checked gradient for a pending microbatch; how many wait in the backward queue now."""
        self.queued_backward.add(microbatch)
        self.seen_backward.add(microbatch)
        self.backward_queue.append((microbatch, grad, diverged, dropped))
        self.trace("backward_arrived", microbatch)
        self.wakeup.set()
        return len(self.backward_queue)

    def receive_finish(self, final_step: int) -> None:
        # a final step past the run's length is no stage 0's (a hostile neighbour's 2**53), unless it is within our
        # own count, which an owner who cut the length below it leaves past the length: that one is followed
        self.finish_received = True
        limit = max(self.config.microbatches, self.compute.version + self.config.max_in_flight)
        self.final_step = None if 0 < self.config.microbatches and final_step > limit else final_step
        self.wakeup.set()

    def follow_sender_steps(self, version: int) -> None:
        """Count optimizer steps from the step of the stage before us, as its first microbatch names it.

        Stages checkpoint separately, so after a resume (or when this stage replaces one) our own step can
        differ from the rest of the cluster's; stage 0 injects microbatches until its count reaches the
        run's steps, so a stage counting from elsewhere would end short of them (or past them), and
        checkpoint and average under step numbers its cluster does not use. Runs before our first compute. Not
        past the run's length: a hostile neighbour's 2**53 put our rounds beyond our partners' window.
        """
        if 0 < self.config.microbatches < version:
            logger.warning(f"stage {self.config.stage}: stage {self.config.stage - 1} counts from step {version}, "
                           f"past the run's {self.config.microbatches}: counting from our own")
            return
        if version != self.compute.version:
            logger.info(f"stage {self.config.stage}: counting steps from {version}, as stage "
                        f"{self.config.stage - 1} does (this stage's weights came from step {self.compute.version})")
            self.compute.version = self.hooked_version = version

    def sender_replaced(self) -> None:
        """A new plan put another peer before us. What the old one sent cannot complete: its gradient would go
        to a stage 0 that never sent that microbatch, or that sends the same id anew and would take a gradient
        of other activations for it. Dropped now; the new sender's first microbatch sets our step count."""
        self.senders_replaced += 1  # a gradient being computed now is dropped once done (_backward_to)
        for microbatch in list(self.queued_forward) + list(self.pending):
            self.drop(microbatch, "the stage before us was replaced")
        self.forward_queue.clear()
        self.queued_forward.clear()
        self.seen_forward.clear()

    def receiver_replaced(self) -> None:
        """A new plan put another peer after us, and we take gradients only from it now: a microbatch the old
        one took will never complete, so it is dropped now rather than after ``microbatch_timeout`` (stage 0
        draws another in its place). One still being sent goes to the new peer."""
        for microbatch in [m for m, p in self.pending.items() if p.since is not None and m not in self.queued_backward]:
            self.drop(microbatch, "the stage after us was replaced before its gradient came back")

    # ---------------------------------------------------------------- the loop

    async def run(self) -> None:
        """Backward work first, then forward work, then (stage 0) a new microbatch if the bound allows."""
        while True:
            if self.between_steps is not None and self.compute.version != self.hooked_version:
                self.hooked_version = self.compute.version
                await self._between_steps()
            if self.backward_queue:
                await self.run_backward(*self.backward_queue.popleft())
            elif self.forward_queue:
                await self.run_forward(*self.forward_queue.popleft())
            elif self._can_inject():
                await self.run_forward(*self._draw())
            elif self._done():
                await self._finish()
                return
            else:
                self.wakeup.clear()
                with self.busy.wall_time.using("neighbour"):  # no microbatch or gradient to work on
                    await self.wakeup.wait()

    async def _between_steps(self) -> None:
        """Run the hook (the volunteer averages there, which can wait long for a slower cluster). Our neighbours
        average at the same step, so a gradient cannot be expected back while we pause: the wait for it
        (``microbatch_timeout``) resumes with us, or every microbatch in flight would be dropped for it."""
        self.paused_since = time.time()
        try:
            await self.between_steps(self.compute.version)
        finally:
            paused, self.paused_since = time.time() - self.paused_since, None
            for pending in self.pending.values():
                if pending.since is not None:
                    pending.since += paused

    def _can_inject(self) -> bool:
        config = self.config
        if not self.is_first:
            return False
        if config.schedule == "async":
            # the run's length counts steps, not microbatches drawn: a dropped one made no step here, so another
            # takes its place (the data stream goes on) and the cluster still reaches the run's length
            return (self.in_flight < config.max_in_flight and
                    self.compute.version + self.in_flight < config.microbatches)
        return self.counters.injected < config.microbatches and self.step_open

    def _draw(self) -> Tuple[int, List[int], torch.Tensor, torch.Tensor]:
        microbatch = self.counters.injected
        sample_ids = self.sampler.sample_ids(microbatch)
        inputs, targets = self.dataset.get(sample_ids)
        self.counters.injected += 1
        self.counters.inject_times.append(time.time())
        self.trace("forward_arrived", microbatch)
        self.in_flight += 1
        if self.config.schedule == "sync" and self.counters.injected % self.config.microbatches_per_step == 0:
            self.step_open = False
        return microbatch, sample_ids, inputs, targets

    def _done(self) -> bool:
        if self.sends or self.in_flight:
            return False
        if not self.is_first:
            return self.finish_received
        # async: the steps taken (see _can_inject); sync: the microbatches drawn
        done = self.compute.version if self.config.schedule == "async" else self.counters.injected
        return done >= self.config.microbatches

    async def _finish(self) -> None:
        for microbatch in list(self.pending):
            self.drop(microbatch, "the run finished before its gradient came back")
        if self.final_step is not None and self.final_step != self.compute.version:
            # a microbatch we stepped on whose gradient stage 0 dropped (late, or refused) is a step we took and
            # it did not: the cluster's step is stage 0's count (as in follow_sender_steps)
            logger.info(f"stage {self.config.stage}: ends at step {self.final_step}, as stage 0 counts (its own "
                        f"count was {self.compute.version})")
            self.compute.version = self.hooked_version = self.final_step
        if not self.is_last:
            message = wire.FinishRequest(**self._address(self.config.stage + 1), op="finish",
                                         completed=self.counters.completed, step=self.compute.version)
            await self._send(wire.FORWARD, self.config.stage + 1, message, [], None, None)
        self.finished.set()

    async def run_forward(self, microbatch: int, sample_ids: List[int], inputs: torch.Tensor,
                          targets: torch.Tensor) -> None:
        self.queued_forward.discard(microbatch)
        compute = self.compute
        sender = self._forward_sender()
        self.trace("forward_started", microbatch)
        with self.busy.measure("computing"), self.counters.computing():
            try:
                if self.is_last:
                    loss, input_grad = await compute.run(compute.forward_backward_last, inputs, targets)
                else:
                    pending, output = await compute.run(compute.forward, inputs)
            except Diverged as e:
                self._diverged(microbatch, str(e), inputs if self.is_last else None)
                return
            except Exception as e:  # a skipped step (a loss spike), a compute that failed: dropped here and before
                self.counters.skipped += isinstance(e, SkippedStep)
                self._fail(microbatch, "step" if isinstance(e, SkippedStep) else "forward", e)
                self._tell_previous(microbatch, inputs, dropped=str(e)[-wire.MAX_REASON_LEN:])
                return
        self.counters.forwards += 1
        self.trace("forward_done", microbatch)
        if self.is_last:
            self.counters.backwards += 1
            self.counters.losses.append((microbatch, loss))
            if self.is_first:
                self._complete(microbatch, compute.version - 1)
            else:
                self._backward_to(sender, microbatch, input_grad)
            return
        self.pending[microbatch] = pending
        message = wire.ForwardRequest(**self._address(self.config.stage + 1), microbatch=microbatch,
                                      sample_ids=sample_ids, version=compute.version)
        self.spawn(wire.FORWARD, self.config.stage + 1, message, [output, targets], microbatch)

    async def run_backward(self, microbatch: int, grad: torch.Tensor, diverged: Optional[str] = None,
                           dropped: Optional[str] = None) -> None:
        self.queued_backward.discard(microbatch)
        pending = self.pending.pop(microbatch, None)
        if pending is None:
            return  # dropped by the watchdog while queued
        sender = self._forward_sender()  # whose forward it was: still ours, or the replacement dropped it
        if dropped is not None:
            self._fail(microbatch, "step at a later stage", RuntimeError(dropped))
            self._tell_previous(microbatch, pending.inputs, dropped=dropped)
            return
        self.trace("backward_started", microbatch)
        with self.busy.measure("computing"), self.counters.computing():
            try:
                if diverged is not None:
                    await self.compute.run(self.compute.restore, f"a later stage: {diverged}")
                input_grad = await self.compute.run(self.compute.backward, pending, grad)
            except Diverged as e:
                self._diverged(microbatch, str(e), pending.inputs)
                return
            except Exception as e:
                self._fail(microbatch, "backward", e)
                return
        self.counters.backwards += 1
        self.trace("backward_done", microbatch)
        if self.is_first:
            self._complete(microbatch, pending.version)
        else:
            self._backward_to(sender, microbatch, input_grad)

    def _complete(self, microbatch: int, version_at_forward: int) -> None:
        self.counters.completed += 1
        self.counters.complete_times.append(time.time())
        # weight versions that passed between this microbatch's forward and its update: the staleness
        self.counters.max_staleness = max(self.counters.max_staleness, self.compute.version - 1 - version_at_forward)
        if self.print_progress and self.counters.completed % PROGRESS_EVERY == 0:
            print(f"progress {self.counters.completed}/{self.config.microbatches}", flush=True)
        self._release_slot()

    def _backward_to(self, sender: Tuple[int, Optional[str]], microbatch: int, input_grad: torch.Tensor) -> None:
        """Send a gradient to the peer that sent its forward (``sender``: :attr:`senders_replaced` and the peer
        named before us when the compute began), unless a new plan replaced it meanwhile: the stage before us
        now may use the same id anew (it counts from the same step), and would take the gradient for its own."""
        if self.senders_replaced != sender[0]:
            self.drop(microbatch, "the stage before us was replaced while its gradient was computed")
            return
        message = wire.BackwardRequest(**self._address(self.config.stage - 1), microbatch=microbatch,
                                       version=self.compute.version)
        self.spawn(wire.BACKWARD, self.config.stage - 1, message, [input_grad], microbatch, sender[1])

    def _address(self, stage: int) -> Dict:
        return dict(run=self.config.run, cluster=self.config.cluster, stage=stage)

    def _forward_sender(self) -> Tuple[int, Optional[str]]:
        """Who sends our forwards now, as :meth:`_backward_to` checks it once the gradient is computed: the count
        of :meth:`sender_replaced` and the peer the plan names before us."""
        return self.senders_replaced, self.config.neighbours.named_peer(self.config.stage, self.config.stage - 1)

    # ---------------------------------------------------------------- sends and drops

    def spawn(self, handler: str, stage: int, message: wire.Message, tensors: List[torch.Tensor],
              microbatch: int, to: Optional[str] = None) -> None:
        """Send in the background; the loop wakes when it is done (the run ends only after its last send). ``to``: the
        peer a gradient is for (the one that sent its forward), else whoever the plan names at ``stage`` then."""
        task = asyncio.create_task(self._send(handler, stage, message, tensors, microbatch, to))
        self.sends.add(task)

        def forget(done: asyncio.Task) -> None:
            self.sends.discard(done)
            self.wakeup.set()

        task.add_done_callback(forget)

    async def _send(self, handler: str, stage: int, message: wire.Message, tensors: List[torch.Tensor],
                    microbatch: Optional[int], to: Optional[str]) -> None:
        failure = await self.send(handler, stage, message, tensors, microbatch, to)
        if failure is None:
            if handler == wire.FORWARD and microbatch in self.pending:
                self.pending[microbatch].since = time.time()  # the wait for its gradient starts now
        elif microbatch is not None:
            self.drop(microbatch, failure)
        else:
            logger.warning(f"send {failure}")

    async def watchdog(self) -> None:
        """Drop microbatches whose gradient never came back, so a lost one frees its slot and is counted."""
        while True:
            await asyncio.sleep(min(1.0, self.config.microbatch_timeout / 4))
            if self.paused_since is not None:
                continue  # the wait resumes with us (_between_steps)
            deadline = time.time() - self.config.microbatch_timeout
            # a send still retrying has its own deadline: the wait for a gradient starts at delivery
            for microbatch in [m for m, p in self.pending.items()
                               if p.since is not None and p.since < deadline and m not in self.queued_backward]:
                self.drop(microbatch, f"no gradient within {self.config.microbatch_timeout:.0f}s")

    def drop(self, microbatch: int, reason: str) -> None:
        was_pending = self.pending.pop(microbatch, None) is not None
        # its forward may come again (stage 0 restarted by a new plan injects it anew): then it is new work, not
        # a resend to acknowledge, or the microbatch, and the run's step it makes, would be lost for good
        self.seen_forward.discard(microbatch)
        self.counters.dropped += 1
        logger.warning(f"stage {self.config.stage}: dropped microbatch {microbatch}: {reason}")
        if self.is_first and was_pending:
            self._release_slot()

    def _fail(self, microbatch: int, what: str, error: Exception) -> None:
        """A microbatch whose compute raised (out-of-range targets, a loss that failed, anything): counted, named
        (a volunteer's note shows ``last_failed``) and dropped; the loop goes on with the next. Left to the
        exception, it would end this stage's scheduler and its stage would stop training without a word."""
        reason = f"its {what} failed: {type(error).__name__}: {error}"
        self.counters.failed += 1
        self.counters.last_failed = f"microbatch {microbatch} at stage {self.config.stage}: {reason}"
        self.drop(microbatch, reason)
        if self.is_first:
            self._release_slot()  # stage 0 injected it, and it was out of `pending` while it computed

    def _diverged(self, microbatch: int, reason: str, inputs: Optional[torch.Tensor]) -> None:
        """Our compute restored the stage (``StageCompute.restore``): counted, said, the microbatch dropped, and the
        stage before us told to restore too where we had its input (the last stage, or one a later stage told)."""
        self.counters.divergences += 1
        self.counters.last_divergence = f"at step {self.compute.version}: {reason}"
        logger.warning(f"stage {self.config.stage}: diverged at microbatch {microbatch}: {reason}")
        self.counters.dropped += 1
        self.seen_forward.discard(microbatch)
        if self.is_first:
            self._release_slot()  # stage 0 injected it; it is out of ``pending`` while it computes
        if inputs is not None:
            self._tell_previous(microbatch, inputs, diverged=reason[-wire.MAX_REASON_LEN:])

    def _tell_previous(self, microbatch: int, inputs: torch.Tensor, **word: str) -> None:
        """A backward message with a zero gradient and a word (``diverged`` or ``dropped``) for the stage before us,
        on one line (an error's text, a user model's or CUDA's, spans lines: the schema refused it, and the
        scheduler ended with that error)."""
        if not self.is_first:
            said = {key: CONTROL_CHARACTER_RE.sub(" ", text)[-wire.MAX_REASON_LEN:] for key, text in word.items()}
            message = wire.BackwardRequest(**self._address(self.config.stage - 1), microbatch=microbatch,
                                           version=self.compute.version, **said)
            self.spawn(wire.BACKWARD, self.config.stage - 1, message, [torch.zeros(inputs.shape, dtype=inputs.dtype)],
                       microbatch, self._forward_sender()[1])

    def _release_slot(self) -> None:
        self.in_flight -= 1
        if self.config.schedule == "sync" and self.in_flight == 0:
            self.step_open = True
        self.wakeup.set()

    # ---------------------------------------------------------------- accounting

    def trace(self, event: str, microbatch: int) -> None:
        if self.config.trace:
            self.counters.trace.append((time.time(), event, microbatch))
