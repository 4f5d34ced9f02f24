"""A stage's compute: its layers on its device, the forward, the backward and the optimizer step.

Everything here runs in the stage's one compute thread (:meth:`StageCompute.run`), one call at a time.
Tensors arrive from the wire (or stage 0's data) in host memory and move to the device here; what goes
back to the wire is copied to the host here too (a GPU copy waits for the GPU's work, which must not hold
up the event loop). On a CPU device both are no-ops.

Weight versions (``mode``): ``stash`` clones the parameters at forward time and runs the forward on the
clone, so the backward uses exactly the weights of its forward (PipeDream weight stashing); ``recompute``
keeps only the input and recomputes the forward with the current weights at backward time.
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple, TypeVar

import torch
from torch.func import functional_call

from ravnest_swarm.devices import autocast, autocast_dtype
from ravnest_swarm.models import IGNORED_TARGET, ModelSpec, class_dim
from ravnest_swarm.pipeline.config import StageConfig
from ravnest_swarm.optimizers.inner import make_inner_optimizer
from ravnest_swarm.pipeline.guard import Diverged, DivergenceGuard, RestorePoint, SkippedStep

Result = TypeVar("Result")


@dataclass
class Pending:
    """A microbatch this stage sent forward and whose gradient it awaits."""

    inputs: torch.Tensor
    output: torch.Tensor  # with its autograd graph when stashing
    output_shape: List[int]
    params: Optional[Dict[str, torch.Tensor]]  # the stashed weights (stash mode)
    since: Optional[float]  # when the forward message was delivered; None while its send is still retrying
    version: int
    # recompute mode: the random state its forward ran with, so the recompute draws the same dropout masks
    rng: Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]] = None


class StageCompute:
    """The stage's layers ``[a, b)`` of ``spec`` on ``config.device``, their optimizer and its step count.

    :param config: the stage's settings (layers, device, precision, mode, schedule, learning rate)
    :param spec: the run's model
    """

    def __init__(self, config: StageConfig, spec: ModelSpec):
        self.config, self.spec = config, spec
        self.device = torch.device(config.device)
        # built on the host from per-layer seeds (identical on every peer and device), then moved: the optimizer
        # made after the move keeps its state beside the parameters
        self.module = spec.build_stage(*config.layers).to(self.device)
        self.optimizer = make_inner_optimizer(self.module.parameters(), config.optimizer, config.lr, config.weight_decay)
        self.autocast_dtype, self.precision_note = autocast_dtype(config.precision, config.device)
        self.is_first = config.stage == 0
        end_layer = config.layers[1]
        # what the next stage's first layer takes: an output autocast left in 16 bits is sent cast back to it
        self.output_dtype = None if config.stage == config.stages - 1 else spec.layers[end_layer].input_dtype
        self.version = 0  # optimizer steps taken (or counted from, see Scheduler.follow_sender_steps)
        self.gradients = 0  # gradients this stage applied or accumulated (the sync schedule steps on every n-th)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-compute")
        self.guard = DivergenceGuard(config.divergence_factor)  # judges the loss on the last stage
        self.restore_point: Optional[RestorePoint] = None  # what a divergence goes back to (mark_restore_point)
        self.divergences = 0  # restores after a divergence

    async def run(self, function: Callable[..., Result], *args) -> Result:
        """``function(*args)`` in the compute thread, awaited from the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, function, *args)

    def close(self) -> None:
        self.executor.shutdown(wait=True)

    def forward(self, inputs: torch.Tensor) -> Tuple[Pending, torch.Tensor]:
        """The stage's output for the next stage, kept with what its backward needs; and its host copy."""
        x = self._as_leaf(inputs)
        if self.config.mode == "stash":
            params = {name: p.detach().clone().requires_grad_() for name, p in self.module.named_parameters()}
            output = self._compute(x, params)
            rng = None
        else:
            params, rng = None, self._rng_state()
            with torch.no_grad():
                output = self._compute(x)
        if not torch.isfinite(output.detach()).all():
            # finite inputs (the wire refuses others) and an output that is not: our own weights are poisoned
            self.restore("its output is not finite")
        return Pending(x, output, list(output.shape), params, None, self.version, rng), to_host(output)

    def backward(self, pending: Pending, grad: torch.Tensor) -> Optional[torch.Tensor]:
        """Apply the gradient of ``pending``'s output; the gradient of its input on the host (None on stage 0)."""
        grad = grad.to(self.device)
        if pending.params is not None:
            torch.autograd.backward(pending.output, grad)
            for name, p in self.module.named_parameters():
                stashed = pending.params[name].grad
                p.grad = stashed if p.grad is None else p.grad + stashed
            x = pending.inputs
        else:
            x = self._as_leaf(pending.inputs.detach())
            with self._as_its_forward(pending.rng):
                self._compute(x).backward(grad)
        self._apply_gradients()
        return to_host(x.grad) if x.requires_grad else None

    def forward_backward_last(self, inputs: torch.Tensor, targets: torch.Tensor) -> Tuple[float, Optional[torch.Tensor]]:
        """The last stage's whole step: forward, loss, backward and update; the loss and the input's gradient.
        Raises (before any gradient is taken) for targets out of range or a loss that is not finite."""
        x = self._as_leaf(inputs)
        with autocast(self.config.device, self.autocast_dtype):
            output = self.module(x)
            check_targets(targets, output.shape[class_dim(output, targets)])
            loss = self.spec.loss(output, targets.to(self.device))
        verdict = self.guard.judge(loss.item())  # before any gradient: a bad one would poison the weights
        if verdict.kind == "spike":
            raise SkippedStep(verdict.reason)
        if verdict.kind == "diverged":
            self.restore(verdict.reason)
        loss.backward()  # outside autocast, as torch advises: each op's backward runs in its forward's dtype
        self._apply_gradients()
        return loss.item(), (to_host(x.grad) if x.requires_grad else None)

    def _compute(self, x: torch.Tensor, params: Optional[Dict[str, torch.Tensor]] = None) -> torch.Tensor:
        """The layers' forward (with the stashed ``params`` if given) under the run's autocast; the output in
        the dtype the next stage's first layer takes (a differentiable cast, so its gradient comes back in it)."""
        with autocast(self.config.device, self.autocast_dtype):
            output = self.module(x) if params is None else functional_call(self.module, params, (x,))
        return output.to(self.output_dtype) if self.output_dtype is not None else output

    def _rng_state(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    @contextlib.contextmanager
    def _as_its_forward(self, rng: Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]]) -> Iterator[None]:
        """Where a microbatch's forward runs again, for its backward: with the random state of the first (dropout
        draws the masks that made the output the next stage used, else the gradient is of another function), and
        leaving the buffers as the first left them (batch norm's running statistics counted each microbatch
        twice); restored after the backward, which needs what the recompute saved."""
        buffers = [(buffer, buffer.clone()) for buffer in self.module.buffers()]
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            if rng is not None:
                torch.set_rng_state(rng[0])
                if rng[1] is not None:
                    torch.cuda.set_rng_state(rng[1], self.device)
            yield
        with torch.no_grad():
            for buffer, before in buffers:
                buffer.copy_(before)

    def _as_leaf(self, inputs: torch.Tensor) -> torch.Tensor:
        # stage 0's inputs are data (token ids need no gradient); later stages send theirs back
        inputs = inputs.to(self.device)
        return inputs if self.is_first else inputs.detach().requires_grad_()

    def mark_restore_point(self, source: str) -> None:
        """Keep a copy of the layers as they are now, to go back to on a divergence (kept only when finite, and
        only while the loss is at its level: a state taken during a spike is no better than the one before)."""
        if self.guard.spikes:
            return
        point = RestorePoint.of(self.module, self.version, source)
        if point is not None:
            self.restore_point = point

    def restore(self, reason: str) -> None:
        """Go back to the restore point (the optimizer's state goes too: it was built on the diverged weights);
        raises :class:`Diverged`, which says what happened, so the microbatch that showed it is dropped."""
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer.state.clear()
        self.guard.reset()
        self.divergences += 1
        point = self.restore_point
        if point is None:
            raise Diverged(f"{reason}; no good state to go back to (none marked yet)")
        point.load_into(self.module)
        raise Diverged(f"{reason}; restored layers {self.config.layers[0]}:{self.config.layers[1]} from "
                       f"{point.source} of step {point.step}")

    def _apply_gradients(self) -> None:
        """Async: step on every gradient. Sync: step once per ``microbatches_per_step`` on the mean."""
        if not all(torch.isfinite(p.grad).all() for p in self.module.parameters() if p.grad is not None):
            self.restore("its gradient is not finite")
        self.gradients += 1
        if self.config.schedule == "sync":
            if self.gradients % self.config.microbatches_per_step:
                return
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad /= self.config.microbatches_per_step
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1

    def save(self, path: str) -> None:
        """The stage's parameters as safetensors, named by their layer index in the whole model."""
        from safetensors.torch import save_file

        tensors = {}
        for name, p in self.module.named_parameters():
            local, rest = name.split(".", 1)
            tensors[f"{self.config.layers[0] + int(local)}.{rest}"] = to_host(p).contiguous()
        save_file(tensors, path)


def check_targets(targets: torch.Tensor, classes: int) -> None:
    """Integer targets are class labels or token ids: each must index the model's output classes (``classes``: the
    output's class dimension, :func:`~ravnest_swarm.models.class_dim`: the digits' 10, a language model's
    vocabulary), or be ``IGNORED_TARGET``.
    Stages before the last pass targets on unread, so they come from any earlier stage's sender; cross-entropy
    raises on one out of range on a CPU and can fail the device on a GPU. Float targets are the loss's to judge."""
    if targets.is_floating_point() or targets.dtype == torch.bool or targets.numel() == 0:
        return
    bad = targets[((targets < 0) | (targets >= classes)) & (targets != IGNORED_TARGET)]
    if bad.numel():
        raise ValueError(f"{bad.numel()} target(s) out of range (e.g. {int(bad[0])}): class labels and token ids "
                         f"must lie in [0, {classes}), the model's output classes")
    if bool((targets == IGNORED_TARGET).all()):  # cross-entropy's mean over no target is NaN: no divergence, no step
        raise ValueError(f"every target is {IGNORED_TARGET} (ignored): the microbatch has nothing to learn from")


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` without its autograd graph, in host memory (the same tensor if it is there already)."""
    return tensor.detach().cpu()
