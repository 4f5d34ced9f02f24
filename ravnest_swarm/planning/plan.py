"""From a list of peers to a checked plan: input validation, greedy seed, GA, layer ranges, figures.

Every figure a plan reports is recomputed from its listed clusters with the reference functions of
:mod:`ravnest_swarm.planning.cost`, so ``swarm_throughput`` is exactly the objective of what is shown.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ravnest_swarm.errors import UserError
from ravnest_swarm.planning.cost import (
    FEASIBILITY_SLACK, Peer, Workload, cluster_throughput, stage_split, swarm_throughput, water_fill,
)
from ravnest_swarm.planning.ga import STANDBY, GAConfig, IslandGA, SwarmArrays
from ravnest_swarm.planning.greedy import greedy_plan

PEER_FIELDS = ("peer_id", "ram_gb", "gflops", "bandwidth_mbps")


@dataclass
class PlacedPeer:
    """One stage of a cluster: who, which share of the model, which position and which layers."""

    peer_id: str
    fraction: float
    stage: int
    layers: Tuple[int, int]


@dataclass
class Plan:
    """Clusters (each a pipeline of stages) and standby peers, with the objective they achieve.

    :param clusters: per cluster, its throughput (samples/s) and its stages in pipeline order
    :param standby: ids of peers in no cluster
    :param swarm_throughput: K x min_k T_k of ``clusters``
    """

    clusters: List[Tuple[float, List[PlacedPeer]]]
    standby: List[str]
    swarm_throughput: float
    details: Dict = field(default_factory=dict)

    def to_json(self) -> Dict:
        return {
            "swarm_throughput": self.swarm_throughput,
            "clusters": [
                {"throughput": throughput,
                 "peers": [{"peer_id": p.peer_id, "fraction": p.fraction, "stage": p.stage, "layers": list(p.layers)}
                           for p in stages]}
                for throughput, stages in self.clusters
            ],
            "standby": list(self.standby),
        }


def make_workload(model_gb: float, gflop_per_sample: float, activation_mb: float, max_stages: int = 8,
                  max_in_flight: Optional[int] = None) -> Workload:
    """A :class:`Workload` from CLI flags; a bad value becomes one :class:`UserError` line."""
    try:
        return Workload(model_gb, gflop_per_sample, activation_mb, max_stages, max_in_flight=max_in_flight)
    except ValueError as e:
        raise UserError(f"bad model figures: {e}")


def load_peers(path: str) -> List[Peer]:
    """Read and check PEERS.json; any problem becomes one :class:`UserError` line (exit 2)."""
    if not os.path.isfile(path):
        raise UserError(f"peers file {path} is a directory, not a JSON file" if os.path.isdir(path) else
                        f"peers file {path} does not exist")
    try:
        with open(path) as f:
            entries = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"peers file {path} is not valid JSON: {e}")
    if not isinstance(entries, list) or not entries:
        raise UserError(f"peers file {path} must hold a non-empty JSON list of peers")
    return parse_peers(entries, source=path)


def parse_peers(entries: Sequence, source: str = "peers") -> List[Peer]:
    """Check each entry has the four fields, a unique string id and finite non-negative numbers."""
    peers, seen = [], set()
    for number, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise UserError(f"{source}: peer #{number} is not a JSON object")
        missing = [name for name in PEER_FIELDS if name not in entry]
        if missing:
            raise UserError(f"{source}: peer #{number} lacks field(s) {', '.join(missing)} "
                            f"(each peer needs {', '.join(PEER_FIELDS)})")
        peer_id = entry["peer_id"]
        if not isinstance(peer_id, str) or not peer_id:
            raise UserError(f"{source}: peer #{number} has peer_id {peer_id!r}, expected a non-empty string")
        if peer_id in seen:
            raise UserError(f"{source}: duplicate peer_id {peer_id!r} (peer #{number})")
        seen.add(peer_id)
        values = {}
        for name in PEER_FIELDS[1:]:
            value = entry[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise UserError(f"{source}: peer {peer_id!r} has {name}={value!r}, expected a finite number >= 0")
            values[name] = float(value)
        peers.append(Peer(peer_id=peer_id, **values))
    return peers


def memory(gb: float) -> str:
    """A memory size people read at a glance: GB for real models, MB for the small built-in ones."""
    return f"{gb:.2f} GB" if gb >= 0.1 else f"{gb * 1000:.2f} MB"


def check_feasible(peers: Sequence[Peer], workload: Workload) -> None:
    """Raise (exit 1) naming the RAM shortfall when not even the D largest-RAM peers can hold the model."""
    usable = sorted((p.ram_gb for p in peers if p.gflops > 0), reverse=True)[: workload.max_stages]
    offered = sum(usable)
    if offered < workload.model_gb:
        raise UserError(
            f"no feasible cluster: the {len(usable)} computing peer(s) with the most RAM offer {memory(offered)} "
            f"together, {memory(workload.model_gb - offered)} short of the model's {memory(workload.model_gb)} "
            f"(at most {workload.max_stages} stages per cluster)",
            exit_code=1,
        )
    shares = [ram / workload.model_gb for ram in usable]
    if not any(sum(min(share, workload.stage_cap(stages)) for share in shares[:stages]) >= 1 - FEASIBILITY_SLACK
               for stages in range(1, len(shares) + 1)):
        raise UserError(
            f"no feasible cluster: the {len(usable)} computing peer(s) with the most RAM hold the model only if a "
            f"stage takes more than {workload.max_stage_share} x an even split, the limit",
            exit_code=1,
        )


def uniform_layers(num_layers: int, workload: Workload) -> Tuple[List[float], List[float]]:
    """A layer profile of ``num_layers`` identical layers (memory GB and GFLOP per layer)."""
    return [workload.model_gb / num_layers] * num_layers, [workload.gflop_per_sample / num_layers] * num_layers


def keeping_held_stages(falling: List[int], fractions: Sequence[float], ids: Sequence[str],
                        held: Dict[str, int]) -> List[int]:
    """``falling`` (a cluster's peers by falling fraction, ties by peer id) with each run of equal fractions
    rearranged so that a peer keeps the stage index it ``held`` where that index lies in its run: of equal
    shares, the peer that trained a stage stays on it (a joiner in a gone peer's place moves alone)."""
    order = list(falling)
    start = 0
    while start < len(order):
        end = start
        while end < len(order) and fractions[order[end]] == fractions[order[start]]:
            end += 1
        run, slots = order[start:end], [None] * (end - start)
        for j in run:
            index = held.get(ids[j])
            if index is not None and start <= index < end and slots[index - start] is None:
                slots[index - start] = j
        rest = iter(j for j in run if j not in slots)
        order[start:end] = [j if j is not None else next(rest) for j in slots]
        start = end
    return order


def build_plan(peers: Sequence[Peer], clusters: Sequence[Sequence[int]], workload: Workload,
               layer_profile: Tuple[Sequence[float], Sequence[float]], held: Optional[Dict[str, int]] = None) -> Plan:
    """A :class:`Plan` from clusters given as lists of indices into ``peers``, its figures recomputed.

    Stages are ordered by falling fraction (ties by peer id, or by the stage index each peer ``held`` in the
    plan in force: :func:`keeping_held_stages`), so the largest share comes first and the order is the same
    wherever the plan is rebuilt, unless only another order lets whole layers keep every peer within its RAM and
    the stage share limit (:func:`stage_split`).
    """
    placed, clustered = [], set()
    for members in clusters:
        group = [peers[i] for i in members]
        _, fractions = water_fill(group, workload)
        falling = sorted(range(len(group)), key=lambda j: (-fractions[j], group[j].peer_id))
        if held:
            falling = keeping_held_stages(falling, fractions, [p.peer_id for p in group], held)
        limit_gb = workload.stage_cap(len(group)) * workload.model_gb
        order, ranges = stage_split(falling, fractions, [min(p.ram_gb, limit_gb) for p in group], *layer_profile,
                                    ram_alone_gb=[p.ram_gb for p in group])
        stages = [PlacedPeer(group[j].peer_id, fractions[j], stage, ranges[stage]) for stage, j in enumerate(order)]
        placed.append((cluster_throughput(group, workload), stages))
        clustered.update(members)
    standby = [p.peer_id for i, p in enumerate(peers) if i not in clustered]
    throughput = swarm_throughput([[peers[i] for i in members] for members in clusters], workload)
    return Plan(placed, standby, throughput)


def assignment_clusters(arrays: SwarmArrays, assignment: np.ndarray) -> List[List[int]]:
    """Clusters of a GA assignment as lists of indices into the original peer list, fastest first."""
    clusters: Dict[int, List[int]] = {}
    for column, cluster in enumerate(assignment):
        if cluster != STANDBY:
            clusters.setdefault(int(cluster), []).append(int(arrays.peer_index[column]))
    return [sorted(clusters[k]) for k in sorted(clusters)]


def ga_config_for(size: int) -> GAConfig:
    """Smaller populations on big swarms buy more generations of the targeted mutations per second."""
    if size <= 64:
        return GAConfig(islands=4, population=32, max_generations=400, stall_generations=120)
    if size <= 2000:
        return GAConfig(islands=4, population=16, max_generations=4000, stall_generations=400)
    return GAConfig(islands=2, population=12, max_generations=100_000, stall_generations=2000)


def plan_swarm(peers: Sequence[Peer], workload: Workload, seed: int = 0, time_limit: Optional[float] = 10.0,
               num_layers: int = 32, layer_profile: Optional[Tuple[Sequence[float], Sequence[float]]] = None,
               on_generation: Optional[Callable[[int, float], None]] = None,
               config: Optional[GAConfig] = None) -> Plan:
    """The GA's plan for ``peers`` (raises :class:`UserError` exit 1 if no cluster is feasible).

    ``plan.details`` holds the greedy seed's objective, the generations run and the GA's own estimate.
    """
    check_feasible(peers, workload)
    arrays = SwarmArrays(peers, workload)
    seed_plan = greedy_plan(arrays)
    greedy_fitness = swarm_throughput(
        [[peers[i] for i in members] for members in assignment_clusters(arrays, seed_plan)], workload)
    ga = IslandGA(arrays, seed_plan, seed=seed, config=config or ga_config_for(arrays.size))
    best = ga.run(time_limit=time_limit, on_generation=on_generation)
    profile = layer_profile or uniform_layers(max(num_layers, workload.max_stages), workload)
    plan = build_plan(peers, assignment_clusters(arrays, best), workload, profile)
    plan.details = {"greedy_throughput": greedy_fitness, "generations": ga.generation}
    return plan
