"""Robust aggregates of a ring's contributions to one chunk: what its owner computes instead of their mean.

Pure: tensors in, a tensor out; no network (``robust_ring.py`` runs them inside a ring). ``contributions`` is a
``[members, elements]`` float32 tensor, one row per ring member, every value already checked finite and within
the scale check (``ring.py``). Both aggregates equal the mean when every row is the same, and with two members
(nobody can tell which of two is the hostile one).

* ``trimmed_mean``: per coordinate, drop the ``trimmed_count`` largest and as many smallest values and average
  the rest. One hostile row of four moves no coordinate outside the range of the honest values there.
* ``centered_clip`` (Karimireddy, He, Jaggi 2021, as used by BTARD: Gorbunov et al., arXiv 2106.11257):
  ``v <- v + mean_i (x_i - v) min(1, tau / ||x_i - v||)`` from the trimmed mean, to a fixed point. A row far
  from the others pulls ``v`` by at most ``tau`` per iteration, shared among all rows. ``tau`` is the median
  distance of the rows from the start, so it scales with how far honest members differ (their drift since
  the last round) and needs no setting. Its norms are over the rows it is given: the ring hands it one part
  of a chunk at a time (``PART_BYTES``, 131072 coordinates), as BTARD clips each peer's partition on its own.
"""

from __future__ import annotations

from typing import Callable, Dict

import torch

MEAN, TRIMMED_MEAN, CENTERED_CLIP = "mean", "trimmed_mean", "centered_clip"
AGGREGATIONS = (MEAN, TRIMMED_MEAN, CENTERED_CLIP)  # the run spec's `aggregation`; mean is the ring's own sum

CLIP_ITERATIONS = 20  # at most; measured: with one plausibly scaled row of four it stops after 10
CLIP_TOLERANCE = 1e-6  # stop once an iteration moves v by less than this fraction of tau


def trimmed_count(members: int) -> int:
    """How many of the largest, and as many of the smallest, values per coordinate a trimmed mean drops: a
    quarter of the members, at least one from three on (three: the median), none with two."""
    return 0 if members < 3 else max(1, members // 4)


def trimmed_mean(contributions: torch.Tensor) -> torch.Tensor:
    """Per coordinate, the mean of the values left once ``trimmed_count`` from each end are dropped."""
    members = contributions.shape[0]
    drop = trimmed_count(members)
    if drop == 0:
        return contributions.mean(0)
    return contributions.sort(dim=0).values[drop:members - drop].mean(0)


def centered_clip(contributions: torch.Tensor) -> torch.Tensor:
    """The CenteredClip fixed point from the trimmed mean, with ``tau`` the rows' median distance from it."""
    centre = trimmed_mean(contributions)
    distances = torch.linalg.vector_norm(contributions - centre, dim=1)
    tau = distances.sort().values[(contributions.shape[0] - 1) // 2]  # the lower median: an honest row's, with
    if tau == 0:  # fewer than half hostile; 0: at least half the rows sit on the centre already
        return centre
    for _ in range(CLIP_ITERATIONS):
        offsets = contributions - centre
        norms = torch.linalg.vector_norm(offsets, dim=1)
        weights = torch.where(norms > tau, tau / norms, torch.ones_like(norms))
        move = (offsets * weights[:, None]).mean(0)
        centre = centre + move
        if torch.linalg.vector_norm(move) <= CLIP_TOLERANCE * tau:
            break
    return centre


# aggregates computed per coordinate, so a sample of coordinates can be recomputed from the members' values
# there (robust_ring.py checks chunk owners so); CenteredClip's norms span a whole part
PER_COORDINATE = frozenset({TRIMMED_MEAN})

ROBUST_AGGREGATES: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    TRIMMED_MEAN: trimmed_mean,
    CENTERED_CLIP: centered_clip,
}
