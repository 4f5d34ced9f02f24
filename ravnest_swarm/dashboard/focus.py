"""What a large run's dashboard shows: the clusters that matter to the viewer, and the run in numbers.

Beyond :data:`LARGE_SWARM` peers (or in a run of more than :data:`FULL_READ_BUCKETS` buckets, whose snapshots hold
only part of its records: :func:`sees_part`), a map of every cluster would scroll off any terminal. The dashboard
then shows one row of clusters, chosen in this order (:func:`focus`): the viewer's own, its ring neighbours (the
clusters just before and after it: averaging rings run through the clusters in order), the failing ones (a slot
its plan has that no live peer serves, or a peer leaving it), then the slowest (the least samples/s); and one line
for the rest. The figures of a run read in part come from its summary (:func:`run_figures`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ravnest_swarm.dashboard.state import SwarmState, placement

LARGE_SWARM = 64
# a run of more than this many buckets (256 peers) is read in part (swarm/observe.py: the viewer's buckets and some
# in turn), and its summary gives its figures; a smaller one is read whole at every snapshot
FULL_READ_BUCKETS = 4


def sees_part(state: SwarmState) -> bool:
    """Whether the snapshots hold only part of the run's records: its summary names more than
    :data:`FULL_READ_BUCKETS` buckets."""
    return state.summary is not None and state.summary["buckets"] > FULL_READ_BUCKETS


def is_large(state: SwarmState) -> bool:
    """Whether the dashboard shows the clusters that matter rather than every one."""
    return len(state.peers) > LARGE_SWARM or sees_part(state)


@dataclass(frozen=True)
class RunFigures:
    """The whole run in numbers, from its summary where there is one (else from the records known).

    :param peers: peers in the run, leaving ones left out
    :param states: peers by state
    :param clusters: the adopted plan's clusters, else the most the summary or the records name
    :param samples_per_s: the summary's (each cluster's first stage, ``buckets.run_samples_per_s``) where the
        records known are only part of the run; else the dashboard's own figure (each cluster's last stage,
        ``SwarmState.totals``): in step, every stage of a pipeline trains at its pipeline's rate
    :param read: peer records in the snapshot (the rest are counted by the summary only)
    """

    peers: int
    states: Dict[str, int]
    clusters: int
    samples_per_s: float
    read: int


def run_figures(state: SwarmState) -> RunFigures:
    totals, summary = state.totals(), state.summary
    part = sees_part(state)
    if summary is not None and part:
        peers, states = summary["peers"], dict(summary["states"])
    else:
        live = [p for p in state.peers if p["state"] != "leaving"]
        peers, states = len(live), dict(Counter(p["state"] for p in live))
    clusters = totals.clusters
    if state.plan is None and summary is not None:
        clusters = max(clusters, summary["clusters"])
    rate = summary["samples_per_s"] if summary is not None and part else totals.samples_per_s
    return RunFigures(peers=peers, states=states, clusters=clusters, samples_per_s=rate, read=len(state.peers))


def own_cluster(state: SwarmState, me: Optional[str]) -> Optional[int]:
    """The cluster the viewer (named ``me``) serves, or None."""
    mine = next((p for p in state.peers if me is not None and p["name"] == me), None)
    slot = None if mine is None else placement(mine)
    return None if slot is None else slot[0]


def trouble(stages: Dict[int, List[Dict]]) -> int:
    """How badly a cluster fails: its slots that no live peer serves, and its peers leaving."""
    return sum(not holders for holders in stages.values()) + sum(
        holders[0]["state"] == "leaving" for holders in stages.values() if holders)


@dataclass(frozen=True)
class Focus:
    """What the map of a large run shows, worked out once per redraw.

    :param shown: the clusters drawn, in cluster order
    :param failing: those left out that fail, with how many of their slots are down, worst first
    :param slowest: those left out that report samples/s, with it, slowest first
    :param hidden: clusters left out, those the summary counts but no record read names included
    """

    shown: List[int]
    failing: List[Tuple[int, int]]
    slowest: List[Tuple[int, float]]
    hidden: int


def focus(state: SwarmState, me: Optional[str], limit: int) -> Focus:
    """At most ``limit`` clusters, in the module's order: the viewer's, its ring neighbours, failing, slowest."""
    clusters = state.clusters()
    keys = list(clusters)
    troubles = {k: trouble(stages) for k, stages in clusters.items()}
    rates = {k: state.cluster_samples_per_s(stages) for k, stages in clusters.items()}
    failing = sorted((k for k in keys if troubles[k]), key=lambda k: (-troubles[k], k))
    # clusters whose last stage reports no rate yet come last
    slowest = sorted(keys, key=lambda k: (rates[k] is None, rates[k] or 0.0, k))
    chosen: List[int] = []
    mine = own_cluster(state, me)
    if mine is not None and mine in clusters:
        at = keys.index(mine)
        chosen += [mine] + [keys[(at + step) % len(keys)] for step in (-1, 1)]
    shown = list(dict.fromkeys(chosen + failing + slowest))[:limit]
    left = set(shown)
    return Focus(shown=sorted(shown), failing=[(k, troubles[k]) for k in failing if k not in left],
                 slowest=[(k, rates[k]) for k in slowest if k not in left and rates[k] is not None],
                 hidden=max(len(keys), run_figures(state).clusters) - len(shown))
