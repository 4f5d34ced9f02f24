"""The inner optimizer of a stage (the run spec's ``optimizer``) and the learning rate it steps at.

- ``sgd``: plain SGD, no state (what the swarm had);
- ``momentum``: SGD with momentum 0.9, one buffer per parameter;
- ``adamw``: AdamW with betas (0.9, 0.95) and the spec's ``weight_decay``, two buffers per parameter (what one
  trains a transformer with; DiLoCo's inner optimizer).

The schedule (spec ``lr_schedule``) is a function of the run's step, so every stage of every cluster, a late
joiner included, steps at the same lr at the same step: ``constant``, or ``cosine``: a linear warm-up over
``warmup_steps`` and a cosine decay to a tenth of the lr at the run's length.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

INNER_OPTIMIZERS = ("sgd", "momentum", "adamw")
LR_SCHEDULES = ("constant", "cosine")
# per-parameter state an optimizer keeps, in copies of the parameters: what the planner's memory model adds
STATE_COPIES = {"sgd": 0, "momentum": 1, "adamw": 2}
MOMENTUM = 0.9
ADAMW_BETAS = (0.9, 0.95)
FINAL_LR_FRACTION = 0.1  # where the cosine schedule ends, as a fraction of the lr


def make_inner_optimizer(parameters: Iterable[torch.nn.Parameter], name: str, lr: float,
                         weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """The stage's optimizer, built on its parameters where they live (its state goes beside them). As one parameter
    group: torch refuses an empty list of parameters, not an empty group (a stage of parameter-free layers)."""
    parameters = [{"params": list(parameters)}]
    if name == "sgd":
        return torch.optim.SGD(parameters, lr=lr, weight_decay=weight_decay)
    if name == "momentum":
        return torch.optim.SGD(parameters, lr=lr, momentum=MOMENTUM, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(parameters, lr=lr, betas=ADAMW_BETAS, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}: one of {', '.join(INNER_OPTIMIZERS)}")


def scheduled_lr(lr: float, step: int, steps: int, schedule: str, warmup_steps: int = 0) -> float:
    """The lr at the run's ``step`` of ``steps``: warmed up linearly over ``warmup_steps``, then constant or
    decayed along a cosine to :data:`FINAL_LR_FRACTION` of ``lr`` at the run's length."""
    warm = min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
    if schedule == "constant" or steps <= 0:
        return lr * warm
    progress = min(1.0, max(0.0, (step - warmup_steps) / max(1, steps - warmup_steps)))
    decay = FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress))
    return lr * warm * decay
