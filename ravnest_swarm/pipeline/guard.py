"""A stage's divergence guard: when its loss says training went wrong, and the state it goes back to. Pure.

The last stage judges every microbatch's loss before its gradient is taken (``StageCompute``):

- not finite: the stage **diverged** (its weights, or its input, are already poisoned);
- above ``factor`` x the stage's *level* (the median of its first :data:`LEVEL_WINDOW` losses since it started or
  last restored, at least :data:`LEVEL_FLOOR`): a **spike**, whose step is skipped; :data:`PATIENCE` spikes in a
  row are a divergence.

The level is where this stage's training started, not a trailing mean: a loss that grows by a few percent a step
(a learning rate too high for the cluster, as in issue 29's lab run, where two clusters passed 10^6 in 7 s)
drags a trailing mean along with it and is never "far above" it. A diverged stage restores the
:class:`RestorePoint` it last marked (the last averaged state, its last checkpoint, or the layers it started
from) and tells the stages before it, which restore theirs (``pipeline/scheduler.py``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

LEVEL_WINDOW = 20  # losses that set a stage's level
# the lowest level a spike is measured against: a stage that starts on layers trained to a loss near 0 (a classifier
# fit to its training set, whose cross-entropy underflows to 0.0) took every loss above 0 for a spike and skipped
# every step (seen: a standby placed on mlp-digits' layers after 15,000 AdamW steps), and at a floor of 0.05 still
# skipped the microbatches of misclassified samples (losses 0.8-3.5); the guard is there for blow-ups
LEVEL_FLOOR = 1.0
PATIENCE = 3  # spikes in a row that make a divergence


class Diverged(Exception):
    """This stage diverged and restored its restore point; the text says why and what it went back to."""


class SkippedStep(Exception):
    """A loss spike: this microbatch's step is skipped (:class:`DivergenceGuard`)."""


@dataclass
class Verdict:
    """What the guard made of one loss: ``ok``, ``spike`` (skip this step) or ``diverged`` (restore)."""

    kind: str
    reason: str = ""


class DivergenceGuard:
    """Judges a stage's losses (:func:`judge`); ``factor`` 0 judges only whether they are finite."""

    def __init__(self, factor: float, window: int = LEVEL_WINDOW, patience: int = PATIENCE):
        self.factor, self.window, self.patience = factor, window, patience
        self.reset()

    def reset(self) -> None:
        """Learn the level anew (a restored stage's, or a new worker's)."""
        self.first: List[float] = []
        self.level: Optional[float] = None
        self.spikes = 0

    def judge(self, loss: float) -> Verdict:
        if not math.isfinite(loss):
            return Verdict("diverged", f"the loss is {loss}")
        if self.level is None:
            self.first.append(loss)
            if len(self.first) >= self.window:
                self.level = max(LEVEL_FLOOR, statistics.median(self.first))
            return Verdict("ok")
        if self.factor <= 0 or loss <= self.factor * self.level:
            self.spikes = 0
            return Verdict("ok")
        self.spikes += 1
        if self.spikes >= self.patience:
            return Verdict("diverged", f"the loss stayed above {self.factor:g} x its level {self.level:.3g} for "
                                       f"{self.spikes} microbatches (last {loss:.3g})")
        return Verdict("spike", f"the loss {loss:.3g} is above {self.factor:g} x its level {self.level:.3g}: "
                                f"step skipped")


@dataclass
class RestorePoint:
    """A copy of a stage's parameters known to be good, the step they are from, and where they came from
    (``the averaged state``, ``its checkpoint``, ``the layers it started from``)."""

    tensors: Dict[str, torch.Tensor]
    step: int
    source: str

    @classmethod
    def of(cls, module: torch.nn.Module, step: int, source: str) -> Optional["RestorePoint"]:
        """A copy of ``module``'s state, or None when any of it is not finite (no state to go back to)."""
        tensors = {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}
        if not all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point()):
            return None
        return cls(tensors, step, source)

    def load_into(self, module: torch.nn.Module) -> None:
        module.load_state_dict(self.tensors)
