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

Compressed pseudo-gradients (a run's ``averaging_compression``; docs/averaging.md). The rings then average
each member's pseudo-gradient ``anchor - parameters + error`` in the codec (:meth:`OuterOptimizer.pseudo_gradient`)
wherever a ring's members share the outer state over its segment (:meth:`OuterOptimizer.digest`), and the step
above runs on their mean (:meth:`OuterOptimizer.step_segments`; ``average`` is lr 1, mu 0, so it keeps an anchor
too). ``error`` is what the codec dropped of what we sent, ``sent - decoded(encoded(sent))`` (error feedback,
``codecs.codec.compression_residual``), added to the next round's pseudo-gradient: over rounds what is sent adds up to
the pseudo-gradients, less the last error. A segment whose ring averaged parameters instead (members' outer
states differed) takes their mean, and its outer state starts there: momentum and error at zero.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch

OUTER_OPTIMIZERS = ("average", "nesterov")


def state_copies(name: str, compression: str) -> int:
    """Copies of the stage's parameters its outer state holds, what the planner's memory model adds: an anchor
    wherever there is one (``nesterov``, or any compressing ``averaging_compression``), nesterov's momentum one
    more, compression's error feedback one more; none for plain ``average`` in float32 (it takes the mean)."""
    compressing = compression != "none"
    return (name == "nesterov" or compressing) + (name == "nesterov") + compressing


@dataclass
class OuterOptimizer:
    """One stage's outer state over its flat parameter vector (host memory, float32)."""

    name: str = "average"
    lr: float = 0.7
    momentum_factor: float = 0.9
    anchor: Optional[torch.Tensor] = None
    momentum: Optional[torch.Tensor] = None
    error: Optional[torch.Tensor] = None  # error feedback of compressed pseudo-gradients: what the codec dropped

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

    def state_tensors(self) -> Dict[str, torch.Tensor]:
        """The state a checkpoint keeps (``checkpoint.OUTER_STATE_KEYS``): those of anchor, momentum and error it has;
        empty without an anchor (nothing to keep: the next round starts the state anew)."""
        if self.anchor is None:
            return {}
        return {key: value for key, value in (("anchor", self.anchor), ("momentum", self.momentum),
                                              ("error", self.error)) if value is not None}

    def restore(self, state: Dict[str, torch.Tensor]) -> bool:
        """Take ``state`` (:meth:`state_tensors` of a stage of the same layers, from its checkpoint) as ours; whether
        it fits this optimizer: ``nesterov`` needs its momentum, ``average`` keeps none. One that does not fit
        leaves us without an anchor, as a new stage is."""
        fits = "anchor" in state and ("momentum" in state) == (self.name == "nesterov") and all(
            value.shape == state["anchor"].shape for value in state.values())
        if fits:
            self.anchor, self.momentum, self.error = state["anchor"], state.get("momentum"), state.get("error")
        return fits

    def forget(self) -> None:
        """No anchor any more (a divergence restored the stage to another state): the next round takes the mean."""
        self.anchor = self.momentum = self.error = None

    # ---- compressed pseudo-gradients -------------------------------------------------------------------

    def has_anchor(self, parameters: torch.Tensor) -> bool:
        return self.anchor is not None and self.anchor.shape == parameters.shape

    def digest(self, lo: int, hi: int) -> Optional[str]:
        """Of the outer state over ``[lo, hi)`` (anchor and momentum), which ring members compare: equal digests,
        equal state, so the same mean takes every member to the same parameters; None without an anchor."""
        if self.anchor is None:
            return None
        digest = hashlib.blake2b(self.anchor[lo:hi].numpy().tobytes(), digest_size=16)
        if self.momentum is not None:
            digest.update(self.momentum[lo:hi].numpy().tobytes())
        return digest.hexdigest()

    def pseudo_gradient(self, parameters: torch.Tensor) -> torch.Tensor:
        """What this stage sends where its ring agrees: ``anchor - parameters`` plus the error kept from the last round."""
        delta = self.anchor - parameters
        return delta if self.error is None else delta.add_(self.error)

    def step_segments(self, parameters: torch.Tensor, mean: torch.Tensor,
                      pseudo_segments: Sequence[Tuple[int, int]], residual: torch.Tensor) -> torch.Tensor:
        """The stage's parameters after a round in which every ring completed: along ``pseudo_segments`` (ranges of
        the vector) the rings averaged pseudo-gradients, whose mean is in ``mean``, and the step runs from the
        anchor; elsewhere ``parameters`` hold their ring's mean of the parameters (or are in no ring), which they
        keep, and the outer state starts there. ``residual``: what our codec dropped of what we sent, the error
        kept for the next round where the pseudo-gradient was averaged."""
        if not self.has_anchor(parameters):
            self.anchor, self.error = parameters.clone(), torch.zeros_like(parameters)
            self.momentum = None if self.name == "average" else torch.zeros_like(parameters)
            return parameters
        lr, mu = (1.0, 0.0) if self.name == "average" else (self.lr, self.momentum_factor)
        stepped = parameters.clone()
        error = torch.zeros_like(parameters)
        momentum = torch.zeros_like(parameters) if self.momentum is not None else None
        for lo, hi in pseudo_segments:
            delta = mean[lo:hi]
            if momentum is None:
                update = delta
            else:
                momentum[lo:hi] = self.momentum[lo:hi].mul(mu).add_(delta)
                update = delta + mu * momentum[lo:hi]
            stepped[lo:hi] = self.anchor[lo:hi] - lr * update
            error[lo:hi] = residual[lo:hi]
        self.anchor, self.momentum, self.error = stepped.clone(), momentum, error
        return stepped
