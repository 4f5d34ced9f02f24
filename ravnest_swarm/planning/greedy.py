"""The deterministic greedy plan: the GA's seed and the baseline it must never fall below."""

from __future__ import annotations

import numpy as np

from ravnest_swarm.planning.cost import FEASIBILITY_SLACK
from ravnest_swarm.planning.ga import STANDBY, SwarmArrays


def greedy_plan(arrays: SwarmArrays) -> np.ndarray:
    """Fastest peers first, each cluster closed as soon as its capped RAM holds the model.

    Walking peers by falling GFLOP/s keeps fast peers together, so the clusters come out roughly by
    falling throughput. A cluster that reaches D peers short of RAM sends its smallest-RAM member to
    standby and keeps filling. Evaluation then keeps the fastest k clusters for the best k x T_k.
    Returns an assignment per column of ``arrays``.
    """
    assignment = np.full(arrays.size, STANDBY, dtype=np.int32)
    members, cluster = [], 0
    for column in np.argsort(-arrays.speeds, kind="stable"):
        members.append(int(column))
        limit = arrays.workload.stage_cap(len(members))
        if sum(min(arrays.caps[c], limit) for c in members) >= 1 - FEASIBILITY_SLACK:
            assignment[members] = cluster
            cluster, members = cluster + 1, []
            if cluster == arrays.max_clusters:
                break
        elif len(members) == arrays.workload.max_stages:
            members.remove(min(members, key=lambda c: arrays.caps[c]))
    population = assignment[None, :].copy()
    arrays.evaluate(population)
    return population[0]
