"""The cluster-formation objective as plain functions (units: GB, GFLOP, MB, Mbit/s, seconds).

A cluster is a set of peers that holds one copy of the model as a pipeline. Peer ``i`` offers
``ram_gb`` r_i, ``gflops`` f_i and ``bandwidth_mbps`` b_i; the model needs M GB, F GFLOP per sample
(forward+backward) and sends A MB of activations per sample between neighbouring stages.

- a peer's cap c_i is r_i / M, and with a stage share limit q also at most q / S in a cluster of S peers
  (so no stage holds more than q times an even split of the model);
- feasible: 1..D peers and sum c_i >= 1;
- fractions x_i (0 <= x_i <= c_i, sum x_i = 1) minimise max_i x_i F / f_i; the optimum is the
  smallest t with sum_i min(c_i, t f_i / F) >= 1 (water-filling), and x_i = min(c_i, t f_i / F);
- time per sample t_k = max(t, 8 A / min_i b_i, R / W), the last two terms only with two or more peers: with at
  most W microbatches in flight (the run's ``max_in_flight``, the pipeline's bounded staleness) at most W stages
  compute at once, and one microbatch's round trip R per sample is every stage's forward and backward,
  sum_i x_i F / f_i, plus its 2 (S - 1) transfers, 8 A / min_i b_i each (Little's law: a 3-stage cluster with 2
  in flight keeps at most 2 of its 3 peers busy, as measured);
- the swarm's throughput is K x min_k (1 / t_k) over its K feasible clusters.

These functions are the reference: the genetic algorithm's vectorised evaluation must agree with them,
and every plan the CLI prints is re-evaluated here before its figures are reported.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

# sums of fractions are compared with 1 with this slack, so a cluster whose RAM is exactly M stays feasible
FEASIBILITY_SLACK = 1e-12


@dataclass(frozen=True)
class Workload:
    """What the model asks of a cluster.

    :param model_gb: memory the whole model needs, M (GB)
    :param gflop_per_sample: forward+backward compute per sample, F (GFLOP)
    :param activation_mb: activations sent between neighbouring stages per sample, A (MB)
    :param max_stages: most peers (pipeline stages) in one cluster, D
    :param max_stage_share: q, the most a stage may hold relative to an even split (1.2: 20 % over
        1 / stages); None for no limit beyond RAM
    :param max_in_flight: W, the most microbatches in flight in a cluster; None for no bound (every stage busy)
    """

    model_gb: float
    gflop_per_sample: float
    activation_mb: float
    max_stages: int = 8
    max_stage_share: Optional[float] = None
    max_in_flight: Optional[int] = None

    def __post_init__(self):
        for name in ("model_gb", "gflop_per_sample"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive finite number, got {value}")
        if not (math.isfinite(self.activation_mb) and self.activation_mb >= 0):
            raise ValueError(f"activation_mb must be a non-negative finite number, got {self.activation_mb}")
        if not 1 <= self.max_stages <= 64:
            raise ValueError(f"max_stages must be 1..64, got {self.max_stages}")
        if self.max_stage_share is not None and not (math.isfinite(self.max_stage_share) and self.max_stage_share >= 1):
            raise ValueError(f"max_stage_share must be a finite number >= 1, got {self.max_stage_share}")
        if self.max_in_flight is not None and not (isinstance(self.max_in_flight, int) and self.max_in_flight >= 1):
            raise ValueError(f"max_in_flight must be a whole number >= 1, got {self.max_in_flight}")

    def stage_cap(self, stages: int) -> float:
        """The largest fraction of the model one stage of a ``stages``-peer cluster may hold (RAM aside)."""
        return math.inf if self.max_stage_share is None else self.max_stage_share / stages


@dataclass(frozen=True)
class Peer:
    """One volunteer's capabilities.

    :param peer_id: its libp2p id (or any unique label offline)
    :param ram_gb: memory offered, GB
    :param gflops: forward+backward throughput, GFLOP/s
    :param bandwidth_mbps: upload rate, Mbit/s
    """

    peer_id: str
    ram_gb: float
    gflops: float
    bandwidth_mbps: float


def water_fill(peers: Sequence[Peer], workload: Workload) -> Tuple[float, List[float]]:
    """The slowest stage's compute time per sample and the fractions that achieve it.

    The fraction a peer takes at stage time t is min(c_i, t f_i / F): it fills up to its compute
    share until its cap (memory, or the stage share limit) stops it. Sorting peers by the time at which
    their cap stops them (c_i F / f_i) makes the total a piecewise linear function of t whose root is found in one pass.
    Returns ``(inf, [])`` for a cluster that cannot hold the model.
    """
    limit = workload.stage_cap(len(peers))
    caps = [min(p.ram_gb / workload.model_gb, limit) for p in peers]
    speeds = [p.gflops / workload.gflop_per_sample for p in peers]
    if sum(c for c, s in zip(caps, speeds) if s > 0) < 1 - FEASIBILITY_SLACK:
        return math.inf, []
    order = sorted(range(len(peers)), key=lambda i: caps[i] / speeds[i] if speeds[i] > 0 else math.inf)
    capped, remaining_speed = 0.0, sum(speeds)
    # if no breakpoint is passed (only within FEASIBILITY_SLACK), every computing peer is memory-capped
    stage_time = max(caps[i] / speeds[i] for i in order if speeds[i] > 0)
    for i in order:
        if remaining_speed <= 0:
            break
        # below peer i's breakpoint, every earlier peer is memory-capped and i and the later ones are not
        candidate = (1 - capped) / remaining_speed
        if candidate <= caps[i] / speeds[i]:
            stage_time = max(candidate, 0.0)
            break
        capped += caps[i]
        remaining_speed -= speeds[i]
    fractions = [min(c, stage_time * s) for c, s in zip(caps, speeds)]
    total = sum(fractions)
    return stage_time, [x / total for x in fractions]


def cluster_time(peers: Sequence[Peer], workload: Workload) -> float:
    """Seconds per sample of a cluster (inf when infeasible): max(water-filled stage time, 8 A / min b, R / W)."""
    if not 1 <= len(peers) <= workload.max_stages:
        return math.inf
    stage_time, fractions = water_fill(peers, workload)
    if len(peers) >= 2 and stage_time < math.inf:
        slowest_link = min(p.bandwidth_mbps for p in peers)
        transfer = 8 * workload.activation_mb / slowest_link if slowest_link > 0 else math.inf
        stage_time = max(stage_time, transfer)
        if workload.max_in_flight is not None:
            compute = sum(x * workload.gflop_per_sample / p.gflops for x, p in zip(fractions, peers) if x > 0)
            stage_time = max(stage_time, (compute + 2 * (len(peers) - 1) * transfer) / workload.max_in_flight)
    return stage_time


def cluster_throughput(peers: Sequence[Peer], workload: Workload) -> float:
    """Samples per second of one cluster; 0 when it is infeasible."""
    seconds = cluster_time(peers, workload)
    return 0.0 if seconds == math.inf or seconds <= 0 else 1.0 / seconds


def swarm_throughput(clusters: Sequence[Sequence[Peer]], workload: Workload) -> float:
    """K x min_k T_k over the feasible clusters among ``clusters`` (infeasible ones count as standby)."""
    throughputs = [t for t in (cluster_throughput(c, workload) for c in clusters) if t > 0]
    return len(throughputs) * min(throughputs) if throughputs else 0.0


def stage_split(order: Sequence[int], fractions: Sequence[float], ram_gb: Sequence[float],
                layer_memory_gb: Sequence[float], layer_gflop: Sequence[float],
                ram_alone_gb: Optional[Sequence[float]] = None) -> Tuple[List[int], List[Tuple[int, int]]]:
    """A cluster's stage order (indices into its peers) and each stage's contiguous half-open layer range.

    A layer's weight is the mean of its share of the model's memory and of its FLOPs, so a stage's
    share of whole layers tracks both what it must hold and what it must compute. The cuts minimise
    the summed distance of each stage's end from the cumulative fraction x_1 + ... + x_j, among cuts
    that keep every stage's layers within its peer's RAM (the fractions respect RAM, but whole layers
    can overshoot them by up to one layer); every stage keeps at least one layer.

    ``order`` is the preferred order (e.g. by falling fraction). With coarse layers (a model of at most
    :data:`COARSE_LAYERS` layers, where one layer can be a third of the model) the order decides how
    close whole layers come to the fractions and whether they fit each peer's RAM, so clusters of up to
    :data:`REORDERED_STAGES` peers try every order and take the fitting one closest to the fractions,
    ``order`` first among equals. With fine layers, ``order`` is kept unless it does not fit, then the
    same search. If no order fits, the same with ``ram_alone_gb`` (each peer's RAM without the stage share limit
    that ``ram_gb`` adds: whole layers can make that limit unreachable, RAM is what must hold), and failing that
    too, ``order`` with its nearest cut all the same.
    """
    profile = _LayerProfile(layer_memory_gb, layer_gflop, len(order))

    def fit(candidate):
        return profile.cuts([fractions[j] for j in candidate], [ram_gb[j] for j in candidate])

    found = fit(order)
    if found is not None and profile.layers > COARSE_LAYERS:
        return list(order), found[1]
    if len(order) <= REORDERED_STAGES:
        fitting = [(result[0], rank, candidate, result[1])
                   for rank, candidate in enumerate(itertools.permutations(order))
                   if (result := fit(candidate)) is not None]
        if fitting:
            _, _, candidate, ranges = min(fitting)
            return list(candidate), ranges
    if found is not None:
        return list(order), found[1]
    if ram_alone_gb is not None:
        return stage_split(order, fractions, ram_alone_gb, layer_memory_gb, layer_gflop)
    return list(order), profile.cuts([fractions[j] for j in order], None)[1]


REORDERED_STAGES = 4  # 4! orders at most: a cluster split is rebuilt by every peer at every adoption
COARSE_LAYERS = 16


class _LayerProfile:
    """Prefix sums of a model's layer weights and memory, for choosing cuts for ``stages`` stages."""

    def __init__(self, layer_memory_gb: Sequence[float], layer_gflop: Sequence[float], stages: int):
        layers = len(layer_memory_gb)
        if layers < stages:
            raise ValueError(f"{stages} stages need at least {stages} layers, the model has {layers}")
        memory_total, flop_total = sum(layer_memory_gb) or 1.0, sum(layer_gflop) or 1.0
        self.cumulative, self.memory = [0.0], [0.0]
        for m, f in zip(layer_memory_gb, layer_gflop):
            self.cumulative.append(self.cumulative[-1] + (m / memory_total + f / flop_total) / 2)
            self.memory.append(self.memory[-1] + m)
        self.stages, self.layers = stages, layers

    def cuts(self, fractions: Sequence[float], ram: Optional[Sequence[float]]) -> Optional[Tuple[float, List[Tuple[int, int]]]]:
        """``(distance, ranges)`` of the best cuts, each stage within ``ram`` (None: no limit), or None if none fit.

        Dynamic programme over cut positions: best[j][e] is the least distance of stages 0..j ending at e.
        """
        stages, layers, cumulative, memory = self.stages, self.layers, self.cumulative, self.memory
        targets = [sum(fractions[:j + 1]) for j in range(stages)]

        def fits(stage: int, start: int, end: int) -> bool:
            return ram is None or memory[end] - memory[start] <= ram[stage] * (1 + FEASIBILITY_SLACK)

        best = [[math.inf] * (layers + 1) for _ in range(stages)]
        previous = [[0] * (layers + 1) for _ in range(stages)]
        for end in range(1, layers - stages + 2):
            if fits(0, 0, end):
                best[0][end] = abs(cumulative[end] - targets[0])
        for stage in range(1, stages):
            for end in range(stage + 1, layers - (stages - stage - 1) + 1):
                distance = 0.0 if stage == stages - 1 else abs(cumulative[end] - targets[stage])
                for start in range(stage, end):
                    cost = best[stage - 1][start] + distance
                    if cost < best[stage][end] and fits(stage, start, end):
                        best[stage][end], previous[stage][end] = cost, start
        if best[stages - 1][layers] == math.inf:
            return None
        ranges, end = [], layers
        for stage in range(stages - 1, -1, -1):
            start = previous[stage][end] if stage > 0 else 0
            ranges.append((start, end))
            end = start
        return best[stages - 1][layers], ranges[::-1]


# What a change of plan costs: the stages whose place changes stop while they download the layers they lack
# and build their new stage, and their clusters' other stages wait for them. MOVE_PAUSE_S is the part that
# does not depend on bytes: a round's length (``RoundOptions.round_seconds``, 10 s) of stopping, rebuilding
# and finding new neighbours, about what `local`'s re-plans took before their first step.
MOVE_PAUSE_S = 10.0
# The spec's default ``move_horizon_s``: a plan must pay for its moves within the time it is likely to stay in
# force. Plans are revised anyway every ``--round-period`` (600 s by default), and with a tenth of a swarm of
# ten changing every hour a change comes about every 6 minutes: 600 s is the horizon both point to.
DEFAULT_MOVE_HORIZON_S = 600.0
# a gain smaller than this share of the throughput is round-off of the same plan recomputed, not a gain
GAIN_ROUND_OFF = 1e-9

@dataclass(frozen=True)
class MovePrice:
    """What moving layers costs a run.

    :param layer_download_gb: the bytes a peer downloads per layer it lacks (its parameters), GB
    :param horizon_s: seconds within which a new plan must pay back its moves (the spec's ``move_horizon_s``)
    :param pause_s: seconds a change of plan stops training besides the downloads
    """

    layer_download_gb: Tuple[float, ...]
    horizon_s: float = DEFAULT_MOVE_HORIZON_S
    pause_s: float = MOVE_PAUSE_S

    def __post_init__(self):
        if not (math.isfinite(self.horizon_s) and self.horizon_s > 0):
            raise ValueError(f"the move horizon must be a positive number of seconds, got {self.horizon_s}")

    @property
    def download_gb(self) -> float:
        return sum(self.layer_download_gb)


Stages = Sequence[Tuple[str, Tuple[int, int]]]  # a cluster: (peer id, half-open layer range) per stage, in order


@dataclass(frozen=True)
class MoveCost:
    """What adopting a plan instead of the one in force costs.

    :param seconds: how long training stops: the slowest download plus :data:`MOVE_PAUSE_S`, 0 if no place changes
    :param download_gb: layer bytes all moved peers download together, GB
    :param moved: peers whose place (cluster, stage neighbours or layers) changes; a peer sent to standby is not one
    """

    seconds: float
    download_gb: float
    moved: int


def kept_places(in_force: Sequence[Stages], proposed: Sequence[Stages]) -> FrozenSet[str]:
    """The peers ``proposed`` keeps where ``in_force`` placed them: on the same layers in a cluster of as many stages,
    with the same peer at each of its stages but for peers ``proposed`` no longer places, whose places a peer
    ``in_force`` placed nowhere may take (a joiner, or a standby, taking a gone peer's place: it downloads its layers
    at its neighbours' step; a peer moved in from another cluster would bring a step of its own). Their stages train
    on through the change (``swarm.placement.kept_in_place``), whatever number their cluster has now and however
    many clusters there are: a plan that drops a cluster renumbers the one it moves into the gap, and that one
    trains on too (``StageWorker.follow_clusters``)."""
    def places(clusters: Sequence[Stages]) -> Dict[str, Tuple[Tuple[str, ...], Tuple[int, int]]]:
        return {peer: (tuple(p for p, _ in cluster), tuple(layers)) for cluster in clusters for peer, layers in cluster}

    before, after = places(in_force), places(proposed)

    def kept(peer: str, stages: Tuple[str, ...], layers: Tuple[int, int]) -> bool:
        if peer not in before or before[peer][1] != layers or len(before[peer][0]) != len(stages):
            return False
        return all(old == new or (old not in after and new not in before)
                   for old, new in zip(before[peer][0], stages))

    return frozenset(peer for peer, (stages, layers) in after.items() if kept(peer, stages, layers))


def move_cost(in_force: Sequence[Stages], proposed: Sequence[Stages], bandwidth_mbps: Dict[str, float],
              price: MovePrice) -> MoveCost:
    """The cost of going from the plan ``in_force`` to ``proposed`` (both as clusters of :data:`Stages`).

    A peer :func:`kept_places` keeps trains on; any other placed peer moves and downloads the layers of its new
    range that its old range lacked (all of them if it was standby), over its advertised link (``bandwidth_mbps``; a
    peer without one never finishes: inf). The swarm waits for the slowest download plus ``price.pause_s``: every
    cluster averages with the others, and a moved stage's cluster cannot train without it. A plan that only drops
    clusters moves nobody and costs nothing: the clusters it keeps train on, renumbered or not.
    """
    held = {peer: tuple(layers) for cluster in in_force for peer, layers in cluster}
    kept = kept_places(in_force, proposed)
    prefix = [0.0]
    for gb in price.layer_download_gb:
        prefix.append(prefix[-1] + gb)
    moved, slowest, total = 0, 0.0, 0.0
    for peer, (first, last) in ((peer, tuple(layers)) for cluster in proposed for peer, layers in cluster):
        if peer in kept:
            continue
        moved += 1
        held_first, held_last = held.get(peer, (0, 0))
        kept_first, kept_last = max(first, held_first), min(last, held_last)  # layers it holds already
        gb = prefix[last] - prefix[first] - (prefix[kept_last] - prefix[kept_first] if kept_last > kept_first else 0)
        total += gb
        link = bandwidth_mbps.get(peer, 0.0)
        slowest = max(slowest, 8000 * gb / link if link > 0 else (math.inf if gb > 0 else 0.0))
    return MoveCost(price.pause_s + slowest if moved else 0.0, total, moved)


def horizon_throughput(throughput: float, move_seconds: float, horizon_s: float) -> float:
    """Samples per second over the horizon of a plan that first stops ``move_seconds`` to move layers."""
    return throughput * max(0.0, horizon_s - move_seconds) / horizon_s


def pays_back(current: float, proposed: float, move_seconds: float, horizon_s: float) -> bool:
    """The payback rule: adopt a plan only if its gain over the horizon beats the samples its moves lose,
    (proposed - current) x horizon > proposed x move_seconds, i.e. its horizon throughput beats the plan in force."""
    return horizon_throughput(proposed, move_seconds, horizon_s) > current * (1 + GAIN_ROUND_OFF)
