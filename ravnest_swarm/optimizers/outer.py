"""The outer optimizer: what a stage does with the mean its averaging round returns (DiLoCo, arXiv 2311.08105).

The rings average the clusters' parameters, as they always did (the wire and the robust aggregations are
unchanged). With ``average`` a stage takes that mean. With ``nesterov`` the mean ``M`` gives the averaged
pseudo-gradient ``anchor - M``, where ``anchor`` is the stage's parameters after the last round (the same on every
member that took part in it: each ended it with the same parameters), and the stage steps from the anchor with
Nesterov momentum and the outer lr:

    momentum = mu * momentum + delta;   parameters = anchor - lr * (delta + mu * momentum);   anchor = parameters

With lr 1 and mu 0 that is the plain average. A stage without an anchor (its first round since its worker
started, or since a divergence restored it) takes the mean and starts its momentum at zero: what it joins with.
Members with the same anchor and momentum end a round with the same parameters, bit for bit (``tests``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

OUTER_OPTIMIZERS = ("average", "nesterov")


@dataclass
class OuterOptimizer:
    """One stage's outer state over its flat parameter vector (host memory, float32)."""

    name: str = "average"
    lr: float = 0.7
    momentum_factor: float = 0.9
    anchor: Optional[torch.Tensor] = None
    momentum: Optional[torch.Tensor] = None

    def step(self, mean: torch.Tensor) -> torch.Tensor:
        """The stage's parameters after a round whose mean is ``mean``; the state moves to them."""
        if self.name == "average":
            return mean  # no state to keep: copying the vector every round would be work for nothing
        if self.anchor is None or self.anchor.shape != mean.shape:
            self.anchor, self.momentum = mean.clone(), torch.zeros_like(mean)
            return mean
        delta = self.anchor - mean
        self.momentum.mul_(self.momentum_factor).add_(delta)
        parameters = self.anchor - self.lr * (delta + self.momentum_factor * self.momentum)
        self.anchor = parameters.clone()
        return parameters

    def forget(self) -> None:
        """No anchor any more (a divergence restored the stage to another state): the next round takes the mean."""
        self.anchor = self.momentum = None
