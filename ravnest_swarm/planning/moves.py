"""What a new plan is worth once its moves are paid: the one estimate a round's trigger and its adoption share.

The plan in force places peers on layers; a new plan moves some of them (``cost.move_cost``), and is worth its
throughput over the spec's move horizon after that pause (``cost.horizon_throughput``). A round adopts its best
proposal only if that beats the plan in force (``cost.pays_back``), and a round is opened for standbys only if
the plans it is sure to consider (:func:`candidate_plans`) already do (:func:`improvement`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ravnest_swarm.membership.records import MAX_ROUND_PEERS
from ravnest_swarm.planning.cost import (MoveCost, MovePrice, Peer, Workload, cluster_throughput, horizon_throughput,
                                        move_cost, swarm_throughput)
from ravnest_swarm.planning.ga import SwarmArrays
from ravnest_swarm.planning.greedy import greedy_plan
from ravnest_swarm.planning.plan import Plan, assignment_clusters, build_plan


@dataclass(frozen=True)
class Pricing:
    """How plans are built and priced: the workload, the layers stages are cut from, what moving costs."""

    workload: Workload
    layer_profile: Tuple[Sequence[float], Sequence[float]]
    price: MovePrice


@dataclass
class PricedPlan:
    """A plan as every adopter builds it, what moving to it from the plan in force costs, and its throughput
    over the move horizon (``cost.horizon_throughput``: its own throughput when no plan is in force)."""

    plan: Plan
    cost: MoveCost
    value: float

    @property
    def throughput(self) -> float:
        return self.plan.swarm_throughput


def in_force_stages(plan: dict) -> List[List[Tuple[str, Tuple[int, int]]]]:
    """A plan record's clusters as ``cost.Stages``."""
    return [[(stage["peer_id"], tuple(stage["layers"])) for stage in cluster] for cluster in plan["clusters"]]


def price_plan(clusters: Sequence[Sequence[str]], peers: Dict[str, Peer], in_force: Optional[dict],
               pricing: Pricing) -> PricedPlan:
    """``clusters`` (peer ids) built into a plan over ``peers`` and priced against the plan ``in_force``."""
    ordered = list(peers.values())
    index = {p.peer_id: i for i, p in enumerate(ordered)}
    held = None if in_force is None else {stage["peer_id"]: number for cluster in in_force["clusters"]
                                          for number, stage in enumerate(cluster)}
    plan = build_plan(ordered, [[index[i] for i in c] for c in clusters], pricing.workload, pricing.layer_profile,
                      held)
    if in_force is None:  # nothing is held yet: the first plan's stages start from the run's holders or fresh
        return PricedPlan(plan, MoveCost(0.0, 0.0, 0), plan.swarm_throughput)
    cost = move_cost(in_force_stages(in_force), [[(s.peer_id, s.layers) for s in stages] for _, stages in plan.clusters],
                     {i: p.bandwidth_mbps for i, p in peers.items()}, pricing.price)
    return PricedPlan(plan, cost, horizon_throughput(plan.swarm_throughput, cost.seconds, pricing.price.horizon_s))


def in_force_throughput(plan: Optional[dict], peers: Dict[str, Peer], workload: Workload) -> Optional[float]:
    """The throughput of the plan in force with ``peers``' capabilities, or None when there is none to keep:
    no plan yet, or one of its peers is gone (its cluster cannot train: any valid plan beats it)."""
    if plan is None or any(stage["peer_id"] not in peers for cluster in plan["clusters"] for stage in cluster):
        return None
    return swarm_throughput([[peers[stage["peer_id"]] for stage in cluster] for cluster in plan["clusters"]], workload)


def kept_cluster_numbers(clusters: List[List[dict]], in_force: Optional[dict]) -> List[List[dict]]:
    """A new plan record's ``clusters`` (stages as ``dict(peer_id, layers)``) in the order that lets a cluster of
    the plan ``in_force`` (the same peers in the same order, but for gone peers' places) keep its number where the
    new plan has that many: its stages keep their endpoints' keys and their shares of the data. A kept cluster whose
    number is gone takes one left free, and trains on under it (``StageWorker.follow_clusters``); the other clusters
    take the numbers left, in their order. Every adopter orders the same, having the same plan in force."""
    if in_force is None:
        return clusters
    placed = {stage["peer_id"] for cluster in clusters for stage in cluster}

    def number_of(cluster: List[dict]) -> Optional[int]:
        # the same peers in the same order, but for the places of peers the new plan no longer places: a joiner
        # that took a gone peer's place (``filled_holes``) keeps its cluster's number, so the others train on
        peers = [stage["peer_id"] for stage in cluster]
        for number, old in enumerate(in_force["clusters"]):
            if len(old) == len(peers) and all(o["peer_id"] == p or o["peer_id"] not in placed
                                              for o, p in zip(old, peers)) and any(o["peer_id"] in peers for o in old):
                return number
        return None

    ordered: List[Optional[List[dict]]] = [None] * len(clusters)
    others = []
    for cluster in clusters:
        number = number_of(cluster)
        if number is not None and number < len(clusters) and ordered[number] is None:
            ordered[number] = cluster
        else:
            others.append(cluster)
    free = iter(number for number, cluster in enumerate(ordered) if cluster is None)
    for cluster in others:
        ordered[next(free)] = cluster
    return ordered


def filled_holes(plan: dict, standbys: List[Peer], alive: Dict[str, Peer]) -> Tuple[List[List[str]], List[Peer]]:
    """The plan in force's clusters with each gone peer's place taken by a standby, most RAM first (ties by peer
    id), so that only the standby moves; a cluster with more places than standbys is left out. Also the standbys
    left over."""
    spare = sorted(standbys, key=lambda p: (-p.ram_gb, p.peer_id))
    clusters = []
    for cluster in plan["clusters"]:
        holes = sum(stage["peer_id"] not in alive for stage in cluster)
        if holes > len(spare):
            continue
        taking, spare = spare[:holes], spare[holes:]
        takers = iter(taking)
        clusters.append([stage["peer_id"] if stage["peer_id"] in alive else next(takers).peer_id
                         for stage in cluster])
    return clusters, spare


def candidate_plans(plan: dict, alive: Dict[str, Peer], workload: Workload) -> List[List[List[str]]]:
    """Plans a round is sure to consider (its islands start from them): the greedy plan over every live peer,
    and the plan in force, gone peers' places taken by standbys (:func:`filled_holes`), with greedy clusters of
    the other standbys added, which moves only the standbys."""
    peers = [alive[i] for i in sorted(alive)[:MAX_ROUND_PEERS]]
    arrays = SwarmArrays(peers, workload)
    everyone = [[peers[i].peer_id for i in members] for members in assignment_clusters(arrays, greedy_plan(arrays))]
    placed = {stage["peer_id"] for cluster in plan["clusters"] for stage in cluster}
    kept, standbys = filled_holes(plan, [p for p in peers if p.peer_id not in placed], alive)
    added = []
    if standbys:
        spare = SwarmArrays(standbys, workload)
        added = [[standbys[i].peer_id for i in members] for members in assignment_clusters(spare, greedy_plan(spare))]
    return [everyone, kept + added]


def improvement(plan: dict, alive: Dict[str, Peer], pricing: Pricing) -> Tuple[float, Optional[PricedPlan]]:
    """The plan in force's throughput and the best of :func:`candidate_plans` priced by its moves: a lower bound
    of what a round would adopt, so a round is worth opening when the second pays back (``cost.pays_back``);
    None where no candidate can train. Every peer of ``plan`` must be in ``alive`` (the plan in force is then among
    the candidates). A cluster that cannot hold the model is left out of its candidate, its peers standbys: a placed
    peer whose record came to offer no RAM made building it fail, and the round for the standbys was lost on every
    peer (a review)."""
    current = in_force_throughput(plan, alive, pricing.workload)
    trainable = [[cluster for cluster in c if cluster_throughput([alive[i] for i in cluster], pricing.workload) > 0]
                 for c in candidate_plans(plan, alive, pricing.workload)]
    priced = [price_plan(c, alive, plan, pricing) for c in trainable if c]
    return current or 0.0, max(priced, key=lambda p: p.value, default=None)
