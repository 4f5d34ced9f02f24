"""The stage worker: one process serves one layer range of one cluster's pipeline.

Scheduling rule (see docs/pipeline.md): one compute thread takes backward work first, then forward
work; stage 0 injects a new microbatch only while fewer than ``max_in_flight`` are in flight (bounded
staleness). The asynchronous schedule steps the optimizer after every backward; the synchronous one
(GPipe-style, for comparison) lets ``microbatches_per_step`` through, waits until all came back, and
steps once on their averaged gradients. Sends run as background tasks, so compute and transfers
overlap; a failed send re-resolves the neighbour and retries until ``send_timeout``, then the
microbatch is dropped and counted, never silently lost.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing, contextmanager
from dataclasses import dataclass, field as dataclass_field
from typing import Awaitable, Callable, Deque, Dict, Iterator, List, Optional, Set, Tuple

import torch
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2PContext, P2PHandlerError
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError
from torch.func import functional_call

from ravnest_swarm.devices import autocast, autocast_dtype
from ravnest_swarm.models import ShardedSampler, load_model
from ravnest_swarm.pipeline import wire
from ravnest_swarm.pipeline.channel import MessageChannel
from ravnest_swarm.pipeline.endpoints import EndpointResolver, publish_endpoint
from ravnest_swarm.pipeline.wire import MessageError, field
from ravnest_swarm.net.transport import INCOMPLETE, make_response, message_reply, send_reply

logger = logging.getLogger(__name__)

SCHEDULES = ("async", "sync")
MODES = ("stash", "recompute")
PROGRESS_EVERY = 10
# refusals a sender answers by sending again: a message meant for another stage (the sender's endpoint for
# it is stale: re-resolve), and one a stage has no room for yet (its stale microbatches are about to be dropped)
MISADDRESSED = ", but this is run"
BUSY = "; retry later"
UNKNOWN_MICROBATCH = "unknown microbatch id"
# refusals for when or where a message arrived, not for what it holds: honest neighbours cause them (an endpoint
# gone stale in a new plan, no room yet, a gradient that came after its microbatch was dropped, a stream stalled
# on a busy machine), so they are counted apart from the malformed or poisoned input that `rejected` counts
TURNED_AWAY = (MISADDRESSED, BUSY, UNKNOWN_MICROBATCH, INCOMPLETE)


@dataclass
class StageConfig:
    """What one stage process does.

    :param run: run name (prefix of the DHT keys)
    :param cluster: this stage's cluster; it only talks to stages of the same cluster
    :param clusters: number of clusters (for sharding the data by sample id)
    :param stage: this stage's index in the pipeline
    :param stages: number of stages
    :param model: the run's model (``models.load_model``: a zoo name or a user's ``module:function``)
    :param model_config: its settings (``layers=12,width=768``)
    :param data: this peer's copy of the run's ``--data`` (None: the model's own data)
    :param layers: the layer range ``[a, b)`` this stage builds
    :param microbatch_size: samples per microbatch (stage 0 draws them)
    :param microbatches: how many microbatches stage 0 injects before finishing the run
    :param max_in_flight: microbatches in flight per cluster (async schedule)
    :param schedule: ``async`` (step on every gradient) or ``sync`` (GPipe-style flush every step)
    :param microbatches_per_step: microbatches of one synchronous step
    :param lr: SGD learning rate
    :param mode: ``stash`` (backward uses the weights of its forward) or ``recompute`` (current weights)
    :param seed: data shuffling seed
    :param microbatch_timeout: seconds after which a microbatch with no gradient back is dropped
    :param send_timeout: seconds a send keeps retrying (re-resolving the neighbour) before dropping
    :param heartbeat: seconds between endpoint renewals
    :param max_message_bytes: larger incoming messages are refused
    :param max_abs_value: activations or gradients with a larger magnitude (or NaN/Inf) are refused as poisoned
    :param compression: how this stage sends activations and gradients: ``none``, or rounded to 16 bits for
      half the bytes, as ``float16`` or ``meanstd16`` (scaled by the tensor's mean and std first, so small
      gradients keep their precision); receivers accept all three
    :param device: the torch device that holds this stage's layers, gradients and optimizer state (``cpu``,
      ``cuda:0``); what it sends and receives is on the host, so its neighbours' devices do not matter
    :param precision: the run's ``fp32``, ``bf16`` or ``fp16``: 16 bits run the forward under ``torch.autocast``
      (``devices.autocast_dtype``); weights, gradients and what travels stay in their own dtypes
    :param trace: record when each microbatch arrives and when its forward and backward start and end
      (``bench pipeline`` splits a round trip into queueing, compute and transit with it; off otherwise, as it
      grows with the run)
    """

    run: str
    stage: int
    stages: int
    model: str
    layers: Tuple[int, int]
    model_config: str = ""
    data: Optional[str] = None
    cluster: int = 0
    clusters: int = 1
    microbatch_size: int = 16
    microbatches: int = 0
    max_in_flight: int = 4
    schedule: str = "async"
    microbatches_per_step: int = 4
    lr: float = 0.05
    mode: str = "stash"
    seed: int = 0
    microbatch_timeout: float = 30.0
    send_timeout: float = 30.0
    heartbeat: float = 2.0
    max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES
    max_abs_value: float = 1e6
    compression: str = "none"
    device: str = "cpu"
    precision: str = "fp32"
    trace: bool = False


@dataclass
class Pending:
    """A microbatch this stage sent forward and whose gradient it awaits."""

    inputs: torch.Tensor
    output: torch.Tensor  # with its autograd graph when stashing
    output_shape: List[int]
    params: Optional[Dict[str, torch.Tensor]]  # the stashed weights (stash mode)
    since: Optional[float]  # when the forward message was delivered; None while its send is still retrying
    version: int


@dataclass
class Counters:
    forwards: int = 0
    backwards: int = 0
    injected: int = 0
    completed: int = 0
    dropped: int = 0
    rejected: int = 0  # messages refused for what they hold: malformed or poisoned
    last_rejected: Optional[str] = None  # what the last of them was and why
    turned_away: int = 0  # messages refused for when or where they arrived (TURNED_AWAY)
    resends: int = 0
    max_staleness: int = 0
    losses: List[Tuple[int, float]] = dataclass_field(default_factory=list)
    inject_times: List[float] = dataclass_field(default_factory=list)
    complete_times: List[float] = dataclass_field(default_factory=list)
    busy: List[Tuple[float, float]] = dataclass_field(default_factory=list)
    compute: List[Tuple[float, float]] = dataclass_field(default_factory=list)  # forwards and backwards only
    trace: List[Tuple[float, str, int]] = dataclass_field(default_factory=list)  # (time, event, microbatch)


class StageWorker:
    """Serves one stage: P2P handlers, a forward and a backward queue, one compute thread, background sends.

    :param config: the stage's settings
    :param node: a started DHT node with the run's validators
    """

    def __init__(self, config: StageConfig, node: DHTNode):
        if config.schedule not in SCHEDULES or config.mode not in MODES or config.compression not in wire.COMPRESSIONS:
            raise ValueError(f"schedule must be one of {SCHEDULES}, mode one of {MODES} and compression one of "
                             f"{tuple(wire.COMPRESSIONS)}")
        self.config, self.node, self.p2p = config, node, node.p2p
        self.spec = load_model(config.model, config.model_config, config.data)
        self.start_layer, self.end_layer = config.layers
        self.device = torch.device(config.device)
        # built on the host from per-layer seeds (identical on every peer and device), then moved: the optimizer
        # made after the move keeps its state beside the parameters
        self.module = self.spec.build_stage(*config.layers).to(self.device)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=config.lr)
        self.autocast_dtype, self.precision_note = autocast_dtype(config.precision, config.device)
        self.is_first, self.is_last = config.stage == 0, config.stage == config.stages - 1
        # what the next stage's first layer takes: an output autocast left in 16 bits is sent cast back to it
        self.output_dtype = None if self.is_last else self.spec.layers[self.end_layer].input_dtype
        self.input_spec = self.spec.layers[self.start_layer]
        dataset = self.spec.dataset()
        self.target_shape, self.target_dtype = list(dataset.targets.shape[1:]), dataset.targets.dtype
        self.dataset = dataset if self.is_first else None
        self.sampler = ShardedSampler(dataset.size, config.cluster, config.clusters, config.microbatch_size,
                                      config.seed)
        self.resolver = EndpointResolver(node, config.run, config.cluster)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-compute")
        self.version = 0
        # awaited by the scheduler whenever the weights changed since its last call, while no compute runs:
        # the volunteer averages and checkpoints here without a cluster-wide barrier
        self.between_steps: Optional[Callable[[int], Awaitable[None]]] = None
        self._hooked_version = 0
        self.counters = Counters()
        self.forward_queue: Deque[Tuple[int, List[int], torch.Tensor, torch.Tensor]] = deque()
        self.backward_queue: Deque[Tuple[int, torch.Tensor]] = deque()
        self.queued_forward: Set[int] = set()
        self.pending: Dict[int, Pending] = {}
        self.queued_backward: Set[int] = set()
        # every microbatch id ever accepted, so a resend whose first copy arrived is acknowledged, not redone
        self.seen_forward: Set[int] = set()
        self.seen_backward: Set[int] = set()
        self.in_flight = 0
        self.step_open = True  # sync schedule: stage 0 may still inject into the current step
        self.finish_received = False
        self.finished = asyncio.Event()
        self._wakeup = asyncio.Event()
        self._sends: Set[asyncio.Task] = set()
        self._channels: Dict[Tuple[str, int], MessageChannel] = {}  # (handler, stage) -> its long-lived stream
        self._tasks: List[asyncio.Task] = []
        self._serving: Set[asyncio.Task] = set()  # one per inbound stream we answer on
        self._stopped = False
        self._active, self._busy_since = 0, 0.0
        # "progress N/M" lines on stdout, which `bench pipeline` reads from its `stage` processes; a volunteer
        # shows its progress in its peer record instead (printed, they would scroll under its live view)
        self.print_progress = False

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        # forwardable: a neighbour behind another NAT reaches these through a backbone (reversal.py)
        links = self.node.routes
        await links.add_forwardable_handler(wire.FORWARD, self._stream_handler(wire.FORWARD, self._on_forward))
        await links.add_forwardable_handler(wire.BACKWARD, self._stream_handler(wire.BACKWARD, self._on_backward))
        await self.p2p.add_protobuf_handler(wire.STATUS, self._on_status, runtime_pb2.ExpertRequest)
        await self._publish()
        self._tasks = [asyncio.create_task(coroutine) for coroutine in
                       (self._heartbeat(), self._schedule(), self._watchdog())]

    def resume_at(self, step: int) -> None:
        """Continue a run at optimizer step ``step`` (weights loaded by the caller): stage 0 goes on with the
        data stream where that step left it and injects only the microbatches still to train."""
        self.version = self._hooked_version = step
        if self.is_first:
            self.counters.injected = min(step, self.config.microbatches)

    async def shutdown(self) -> None:
        # inbound streams outlive their handler's removal: left open, a sender's long-lived stream would go
        # on delivering into this stopped worker (the volunteer starts another worker on the same peer when a
        # plan moves it); closed, the sender re-resolves the stage and resends
        self._stopped = True
        tasks = self._tasks + list(self._sends) + list(self._serving)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(channel.aclose() for channel in self._channels.values()))
        # a volunteer moved to another slot starts a new worker on the same P2P: free the handler names
        for name in (wire.FORWARD, wire.BACKWARD):
            await self.p2p.remove_binary_stream_handler(name)
        await self.p2p.remove_protobuf_handler(wire.STATUS)
        self.executor.shutdown(wait=True)

    async def _publish(self) -> None:
        config = self.config
        if not await publish_endpoint(self.node, config.run, config.cluster, config.stage, config.model,
                                      config.layers, self.version, 3 * config.heartbeat):
            logger.warning("no DHT node accepted our stage endpoint; retrying next heartbeat")

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat)
            try:
                await self._publish()
            except Exception as e:  # a transient DHT error must not stop the renewals
                logger.warning(f"renewing the stage endpoint failed: {e}")

    async def _watchdog(self) -> None:
        """Drop microbatches whose gradient never came back, so a lost one frees its slot and is counted."""
        while True:
            await asyncio.sleep(min(1.0, self.config.microbatch_timeout / 4))
            deadline = time.time() - self.config.microbatch_timeout
            # a send still retrying has its own deadline: the wait for a gradient starts at delivery
            for microbatch in [m for m, p in self.pending.items()
                               if p.since is not None and p.since < deadline and m not in self.queued_backward]:
                self._drop(microbatch, f"no gradient within {self.config.microbatch_timeout:.0f}s")

    def _drop(self, microbatch: int, reason: str) -> None:
        was_pending = self.pending.pop(microbatch, None) is not None
        self.counters.dropped += 1
        logger.warning(f"stage {self.config.stage}: dropped microbatch {microbatch}: {reason}")
        if self.is_first and was_pending:
            self._release_slot()

    def _release_slot(self) -> None:
        self.in_flight -= 1
        if self.config.schedule == "sync" and self.in_flight == 0:
            self.step_open = True
        self._wakeup.set()

    # ---------------------------------------------------------------- scheduling

    def _can_inject(self) -> bool:
        config = self.config
        if not self.is_first or self.counters.injected >= config.microbatches:
            return False
        if config.schedule == "async":
            return self.in_flight < config.max_in_flight
        return self.step_open

    async def _schedule(self) -> None:
        """Backward work first, then forward work, then (stage 0) a new microbatch if the bound allows."""
        while True:
            if self.between_steps is not None and self.version != self._hooked_version:
                self._hooked_version = self.version
                await self.between_steps(self.version)
            if self.backward_queue:
                await self._run_backward(*self.backward_queue.popleft())
            elif self.forward_queue:
                await self._run_forward(*self.forward_queue.popleft())
            elif self._can_inject():
                await self._run_forward(*self._draw())
            elif self._done():
                await self._finish()
                return
            else:
                self._wakeup.clear()
                await self._wakeup.wait()

    def _draw(self) -> Tuple[int, List[int], torch.Tensor, torch.Tensor]:
        microbatch = self.counters.injected
        sample_ids = self.sampler.sample_ids(microbatch)
        inputs, targets = self.dataset.get(sample_ids)
        self.counters.injected += 1
        self.counters.inject_times.append(time.time())
        self._trace("forward_arrived", microbatch)
        self.in_flight += 1
        if self.config.schedule == "sync" and self.counters.injected % self.config.microbatches_per_step == 0:
            self.step_open = False
        return microbatch, sample_ids, inputs, targets

    def _done(self) -> bool:
        if self._sends:
            return False
        if self.is_first:
            return self.counters.injected >= self.config.microbatches and self.in_flight == 0
        return self.finish_received

    async def _finish(self) -> None:
        for microbatch in list(self.pending):
            self._drop(microbatch, "the run finished before its gradient came back")
        if not self.is_last:
            metadata = self._address(self.config.stage + 1, op="finish", completed=self.counters.completed)
            await self._send(wire.FORWARD, self.config.stage + 1, metadata, [], microbatch=None)
        self.finished.set()

    async def _run_forward(self, microbatch: int, sample_ids: List[int], inputs: torch.Tensor,
                           targets: torch.Tensor) -> None:
        self.queued_forward.discard(microbatch)
        loop = asyncio.get_running_loop()
        self._trace("forward_started", microbatch)
        with self._busy(), self._computing():
            if self.is_last:
                loss, input_grad = await loop.run_in_executor(self.executor, self._forward_backward_last, inputs, targets)
            else:
                pending, output = await loop.run_in_executor(self.executor, self._forward, inputs)
        self.counters.forwards += 1
        self._trace("forward_done", microbatch)
        if self.is_last:
            self.counters.backwards += 1
            self.counters.losses.append((microbatch, loss))
            if self.is_first:
                self._complete(microbatch, self.version - 1)
            else:
                self._spawn_backward(microbatch, input_grad)
            return
        self.pending[microbatch] = pending
        metadata = self._address(self.config.stage + 1, microbatch=microbatch, sample_ids=sample_ids,
                                 version=self.version)
        self._spawn(wire.FORWARD, self.config.stage + 1, metadata, [output, targets], microbatch)

    async def _run_backward(self, microbatch: int, grad: torch.Tensor) -> None:
        self.queued_backward.discard(microbatch)
        pending = self.pending.pop(microbatch, None)
        if pending is None:
            return  # dropped by the watchdog while queued
        self._trace("backward_started", microbatch)
        with self._busy(), self._computing():
            input_grad = await asyncio.get_running_loop().run_in_executor(self.executor, self._backward, pending, grad)
        self.counters.backwards += 1
        self._trace("backward_done", microbatch)
        if self.is_first:
            self._complete(microbatch, pending.version)
        else:
            self._spawn_backward(microbatch, input_grad)

    def _complete(self, microbatch: int, version_at_forward: int) -> None:
        self.counters.completed += 1
        self.counters.complete_times.append(time.time())
        # weight versions that passed between this microbatch's forward and its update: the staleness
        self.counters.max_staleness = max(self.counters.max_staleness, self.version - 1 - version_at_forward)
        if self.print_progress and self.counters.completed % PROGRESS_EVERY == 0:
            print(f"progress {self.counters.completed}/{self.config.microbatches}", flush=True)
        self._release_slot()

    def _spawn_backward(self, microbatch: int, input_grad: torch.Tensor) -> None:
        metadata = self._address(self.config.stage - 1, microbatch=microbatch, version=self.version)
        self._spawn(wire.BACKWARD, self.config.stage - 1, metadata, [input_grad], microbatch)

    def _address(self, stage: int, **fields) -> Dict:
        return dict(run=self.config.run, cluster=self.config.cluster, stage=stage, **fields)

    # ---------------------------------------------------------------- compute (the one compute thread)

    # Tensors arrive from the wire (or stage 0's data) in host memory and move to the device here, in the compute
    # thread; what goes back to the wire is copied to the host here too (a GPU copy waits for the GPU's work,
    # which must not hold up the event loop). On a CPU device both are no-ops.

    def _forward(self, inputs: torch.Tensor) -> Tuple[Pending, torch.Tensor]:
        """The stage's output for the next stage, kept with what its backward needs; and its host copy."""
        x = self._as_leaf(inputs)
        if self.config.mode == "stash":
            params = {name: p.detach().clone().requires_grad_() for name, p in self.module.named_parameters()}
            output = self._compute(x, params)
        else:
            params = None
            with torch.no_grad():
                output = self._compute(x)
        return Pending(x, output, list(output.shape), params, None, self.version), _to_host(output)

    def _backward(self, pending: Pending, grad: torch.Tensor) -> Optional[torch.Tensor]:
        grad = grad.to(self.device)
        if pending.params is not None:
            torch.autograd.backward(pending.output, grad)
            for name, p in self.module.named_parameters():
                stashed = pending.params[name].grad
                p.grad = stashed if p.grad is None else p.grad + stashed
            x = pending.inputs
        else:
            x = self._as_leaf(pending.inputs.detach())
            self._compute(x).backward(grad)
        self._apply_gradients()
        return _to_host(x.grad) if x.requires_grad else None

    def _forward_backward_last(self, inputs: torch.Tensor, targets: torch.Tensor) -> Tuple[float, Optional[torch.Tensor]]:
        x = self._as_leaf(inputs)
        with autocast(self.config.device, self.autocast_dtype):
            loss = self.spec.loss(self.module(x), targets.to(self.device))
        loss.backward()  # outside autocast, as torch advises: each op's backward runs in its forward's dtype
        self._apply_gradients()
        return loss.item(), (_to_host(x.grad) if x.requires_grad else None)

    def _compute(self, x: torch.Tensor, params: Optional[Dict[str, torch.Tensor]] = None) -> torch.Tensor:
        """The layers' forward (with the stashed ``params`` if given) under the run's autocast; the output in
        the dtype the next stage's first layer takes (a differentiable cast, so its gradient comes back in it)."""
        with autocast(self.config.device, self.autocast_dtype):
            output = self.module(x) if params is None else functional_call(self.module, params, (x,))
        return output.to(self.output_dtype) if self.output_dtype is not None else output

    def _as_leaf(self, inputs: torch.Tensor) -> torch.Tensor:
        # stage 0's inputs are data (token ids need no gradient); later stages send theirs back
        inputs = inputs.to(self.device)
        return inputs if self.is_first else inputs.detach().requires_grad_()

    def _apply_gradients(self) -> None:
        """Async: step on every gradient. Sync: step once per ``microbatches_per_step`` on the mean."""
        done = self.counters.backwards + 1
        if self.config.schedule == "sync":
            if done % self.config.microbatches_per_step:
                return
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad /= self.config.microbatches_per_step
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1

    # ---------------------------------------------------------------- sending

    def _trace(self, event: str, microbatch: int) -> None:
        if self.config.trace:
            self.counters.trace.append((time.time(), event, microbatch))

    def _spawn(self, handler: str, stage: int, metadata: Dict, tensors: List[torch.Tensor], microbatch: int) -> None:
        task = asyncio.create_task(self._send(handler, stage, metadata, tensors, microbatch))
        self._sends.add(task)

        def forget(done: asyncio.Task) -> None:
            self._sends.discard(done)
            self._wakeup.set()

        task.add_done_callback(forget)

    async def _send(self, handler: str, stage: int, metadata: Dict, tensors: List[torch.Tensor],
                    microbatch: Optional[int]) -> bool:
        """Deliver one message; on failure re-resolve the neighbour and retry, then drop and count it."""
        frames = wire.encode(metadata, tensors, self.config.compression)
        deadline = time.monotonic() + self.config.send_timeout
        what = f"{metadata.get('op', handler.rsplit('.', 1)[-1])} of microbatch {microbatch} to stage {stage}"
        attempt = 0
        with self._busy():
            while True:
                try:
                    peer_id = await self.resolver.resolve(stage, refresh=attempt > 0)
                    await asyncio.wait_for(self._deliver(handler, stage, peer_id, frames),
                                           max(1.0, deadline - time.monotonic()))
                    if handler == wire.FORWARD and microbatch in self.pending:
                        self.pending[microbatch].since = time.time()
                    return True
                except P2PHandlerError as e:
                    # the neighbour read the message and refused it: sending it again cannot help, unless it
                    # refused it for not serving that stage any more (it moved in a new plan while we kept its
                    # endpoint: the stage's current peer is found as after a failed send) or for lack of room
                    reason = f"refused: {str(e).rsplit(': ', 1)[-1]}"
                    retry = MISADDRESSED in str(e) or BUSY in str(e)
                except Exception as e:
                    reason = f"{type(e).__name__}: {e}"
                    retry = True
                if retry:
                    self._close_channel(handler, stage)
                    if time.monotonic() < deadline:
                        attempt += 1
                        self.counters.resends += 1
                        logger.warning(f"send {what} failed ({reason}); re-resolving the endpoint and retrying")
                        await asyncio.sleep(min(0.2 * attempt, 1.0))
                        continue
                if microbatch is not None:
                    self._drop(microbatch, f"{what} {reason}")
                else:
                    logger.warning(f"send {what} {reason}")
                return False

    async def _deliver(self, handler: str, stage: int, peer_id, frames: List[runtime_pb2.ExpertRequest]):
        """One message to ``stage``: on our long-lived stream to it, or on a stream of its own when a backbone
        forwards our traffic (a forwarding backbone caps the bytes of every stream it pipes)."""
        links = self.node.routes
        if links.route(peer_id) == "forward":
            return await links.call(peer_id, handler, wire.as_stream(frames), runtime_pb2.ExpertResponse)
        channel = self._channels.get((handler, stage))
        if channel is None or channel.closed or channel.peer_id != peer_id:
            self._close_channel(handler, stage)
            channel = self._channels[(handler, stage)] = MessageChannel(self.p2p, peer_id, handler)
        return await channel.call(frames)

    def _close_channel(self, handler: str, stage: int) -> None:
        channel = self._channels.pop((handler, stage), None)
        if channel is not None:
            channel.close()

    # ---------------------------------------------------------------- receiving

    def _stream_handler(self, name: str, handle):
        async def serve(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            """Answer message after message on one stream (see channel.py), each within the send timeout."""
            first_marker: Optional[bytes] = None

            async def respond() -> runtime_pb2.ExpertResponse:
                metadata, tensors = await wire.read_message(reader, self.config.max_message_bytes, first_marker)
                if self._stopped:  # shutdown's cancel can be lost (asyncio.wait_for returns a result it raced)
                    raise ConnectionError("this stage worker stopped")  # no reply: the sender resends elsewhere
                self._check_address(metadata)
                return make_response(await handle(metadata, tensors))

            def refused(reason: str) -> None:
                if any(marker in reason for marker in TURNED_AWAY):
                    self.counters.turned_away += 1
                else:
                    self.counters.rejected += 1
                    self.counters.last_rejected = f"{name.rsplit('.', 1)[-1]} from {stream_info.peer_id}: {reason}"
                logger.warning(f"stage {self.config.stage}: rejected {name} from {stream_info.peer_id}: {reason}")

            def broken() -> None:
                if not self._stopped:
                    logger.warning(f"stage {self.config.stage}: {name} from {stream_info.peer_id} ended early")

            task = asyncio.current_task()  # this stream's own: p2pd hands each stream to a new task
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)
            with closing(writer):
                while not self._stopped:  # a stream opened after shutdown (through a backbone) is just closed
                    reply = await message_reply(name, stream_info.peer_id, respond, self.config.send_timeout,
                                                refused, broken)
                    if reply is None:
                        return
                    await send_reply(reply, reader, writer)
                    if isinstance(reply, RPCError):
                        return  # a refused message may have been cut short: what follows cannot be framed
                    try:
                        # between messages the stream may idle (no deadline runs); one idle for a whole send
                        # timeout is closed, and its sender opens a new one for its next message
                        first_marker = await asyncio.wait_for(reader.readexactly(1), self.config.send_timeout)
                    except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
                        return  # the sender closed the stream, or left it idle

        return serve

    def _check_address(self, metadata: Dict) -> None:
        config = self.config
        if metadata.get("run") != config.run or metadata.get("cluster") != config.cluster \
                or metadata.get("stage") != config.stage:
            raise MessageError(
                f"addressed to run {metadata.get('run')!r} cluster {metadata.get('cluster')!r} stage "
                f"{metadata.get('stage')!r}{MISADDRESSED} {config.run!r} cluster {config.cluster} stage {config.stage}")

    async def _on_forward(self, metadata: Dict, tensors: List[runtime_pb2.Tensor]) -> Dict:
        if metadata.get("op") == "finish":
            self.finish_received = True
            self._wakeup.set()
            return {"ok": True}
        if self.is_first:
            raise MessageError("stage 0 takes no forward messages: it draws its own microbatches")
        microbatch = field(metadata, "microbatch", int)
        sample_ids = wire.sample_ids_field(metadata)
        version = field(metadata, "version", int)
        if microbatch in self.seen_forward:
            # a resend after our reply was lost: delivery is at-least-once, processing exactly once
            return {"ok": True, "duplicate": True}
        # stage 0 keeps at most max_in_flight microbatches in the pipeline; twice that leaves room for ones
        # a watchdog is about to drop, and anything beyond is a flood that would hold unbounded memory
        if len(self.queued_forward) + len(self.pending) >= 2 * self.config.max_in_flight:
            raise MessageError(f"too many microbatches in flight here ({2 * self.config.max_in_flight}){BUSY}")
        if len(tensors) != 2:
            raise MessageError(f"a forward message carries 2 tensors (activations, targets), got {len(tensors)}")
        count = len(sample_ids)
        inputs = wire.check_values(wire.decode_tensor(tensors[0], "activations", [count, *self.input_spec.input_shape],
                                                      self.input_spec.input_dtype), "activations", self.config.max_abs_value)
        targets = wire.decode_tensor(tensors[1], "targets", [count, *self.target_shape], self.target_dtype)
        if not self.seen_forward:
            self._follow_sender_steps(version)
        self.queued_forward.add(microbatch)
        self.seen_forward.add(microbatch)
        self.forward_queue.append((microbatch, sample_ids, inputs, targets))
        self._trace("forward_arrived", microbatch)
        self._wakeup.set()
        return {"ok": True, "queued": len(self.forward_queue)}

    def _follow_sender_steps(self, version: int) -> None:
        """Count optimizer steps from the step of the stage before us, as its first microbatch names it.

        Stages checkpoint separately, so after a resume (or when this stage replaces one) our own step can
        differ from the rest of the cluster's; stage 0 injects microbatches until its count reaches the
        run's steps, so a stage counting from elsewhere would end short of them (or past them), and
        checkpoint and average under step numbers its cluster does not use. Runs before our first compute.
        """
        if version != self.version:
            logger.info(f"stage {self.config.stage}: counting steps from {version}, as stage "
                        f"{self.config.stage - 1} does (this stage's weights came from step {self.version})")
            self.version = self._hooked_version = version

    async def _on_backward(self, metadata: Dict, tensors: List[runtime_pb2.Tensor]) -> Dict:
        microbatch = field(metadata, "microbatch", int)
        field(metadata, "version", int)
        if microbatch in self.seen_backward:
            return {"ok": True, "duplicate": True}
        pending = self.pending.get(microbatch)
        if pending is None:
            raise MessageError(f"{UNKNOWN_MICROBATCH} {microbatch}: this stage did not send it forward "
                               f"(or already dropped it)")
        if len(tensors) != 1:
            raise MessageError(f"a backward message carries 1 tensor (the gradient), got {len(tensors)}")
        grad = wire.check_values(wire.decode_tensor(tensors[0], "gradient", pending.output_shape, pending.output.dtype),
                                 "gradient", self.config.max_abs_value)
        self.queued_backward.add(microbatch)
        self.seen_backward.add(microbatch)
        self.backward_queue.append((microbatch, grad))
        self._trace("backward_arrived", microbatch)
        self._wakeup.set()
        return {"ok": True, "queued": len(self.backward_queue)}

    async def _on_status(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return make_response(self.status())

    def status(self) -> Dict:
        c = self.counters
        return dict(stage=self.config.stage, version=self.version, forwards=c.forwards, backwards=c.backwards,
                    injected=c.injected, completed=c.completed, dropped=c.dropped, rejected=c.rejected,
                    turned_away=c.turned_away, resends=c.resends, max_staleness=c.max_staleness, in_flight=self.in_flight,
                    pending=len(self.pending))

    # ---------------------------------------------------------------- accounting

    @contextmanager
    def _busy(self) -> Iterator[None]:
        """Count wall time during which a forward, backward or send is in progress (overlaps count once)."""
        if self._active == 0:
            self._busy_since = time.time()
        self._active += 1
        try:
            yield
        finally:
            self._active -= 1
            if self._active == 0:
                self.counters.busy.append((self._busy_since, time.time()))

    @contextmanager
    def _computing(self) -> Iterator[None]:
        """Record a forward's or backward's wall time (the compute thread runs one at a time)."""
        started = time.time()
        try:
            yield
        finally:
            self.counters.compute.append((started, time.time()))

    def report(self) -> Dict:
        c = self.counters
        return dict(self.status(), layers=list(self.config.layers), schedule=self.config.schedule,
                    mode=self.config.mode, microbatch_size=self.config.microbatch_size, losses=c.losses,
                    routes=dict(self.node.routes.counts),
                    inject_times=c.inject_times, complete_times=c.complete_times, busy=c.busy,
                    compute=c.compute, trace=c.trace)

    def save(self, path: str) -> None:
        """The stage's parameters as safetensors, named by their layer index in the whole model."""
        from safetensors.torch import save_file

        tensors = {}
        for name, p in self.module.named_parameters():
            local, rest = name.split(".", 1)
            tensors[f"{self.start_layer + int(local)}.{rest}"] = _to_host(p).contiguous()
        save_file(tensors, path)



def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` without its autograd graph, in host memory (the same tensor if it is there already)."""
    return tensor.detach().cpu()


async def run_stage(config: StageConfig, node: DHTNode, stop: asyncio.Event, report_path: Optional[str] = None,
                    save_path: Optional[str] = None) -> Dict:
    """Serve one stage until the run finishes (or ``stop``); write the report and weights if asked."""
    worker = StageWorker(config, node)
    worker.print_progress = True
    await worker.start()
    print(f"stage {config.stage} of cluster {config.cluster} serving layers {config.layers[0]}:{config.layers[1]} "
          f"as {node.peer_id}", flush=True)
    waiters = [asyncio.create_task(worker.finished.wait()), asyncio.create_task(stop.wait())]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for waiter in waiters:
        waiter.cancel()
    await worker.shutdown()
    report = worker.report()
    if report_path:
        with open(report_path, "w") as f:
            json.dump(report, f)
    if save_path:
        worker.save(save_path)
    print(f"stage {config.stage} finished: " + json.dumps(worker.status()), flush=True)
    return report


async def serve_stage(config: StageConfig, initial_peers, host_maddrs, announce_maddrs, timeout: float,
                      report_path: Optional[str], save_path: Optional[str]) -> int:
    """The ``stage`` verb: one torch thread, a DHT node with the run's validators, then :func:`run_stage`."""
    from ravnest_swarm.lifecycle import install_stop_signals
    from ravnest_swarm.membership.records import make_validators
    from ravnest_swarm.net.node import start_node, stop_node

    # stages share a volunteer's cores with p2pd and their neighbours; one thread each keeps timings honest
    torch.set_num_threads(1)
    stop = install_stop_signals()
    node = await start_node(initial_peers, record_validators=make_validators(config.run), host_maddrs=host_maddrs,
                            announce_maddrs=announce_maddrs, timeout=timeout)
    try:
        await run_stage(config, node, stop, report_path, save_path)
    finally:
        await stop_node(node)
    return 0
