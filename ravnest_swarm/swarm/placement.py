"""Pure rules a volunteer follows, tested without a network: the planner's view of a model, where a plan
puts a peer and who its stage's neighbours are, which records offer which layers, who holds a leaver's layers,
and how long a ring waits."""

from __future__ import annotations

import math

from typing import Collection, Dict, List, Optional, Sequence, Tuple

import torch

from ravnest_swarm.models import ModelSpec
from ravnest_swarm.optimizers.inner import STATE_COPIES
from ravnest_swarm.optimizers.outer import state_copies as outer_state_copies
from ravnest_swarm.pipeline.config import Neighbours
from ravnest_swarm.planning.cost import Workload, kept_places
from ravnest_swarm.planning.moves import in_force_stages
from ravnest_swarm.swarm.spec import RunSpec

Placement = Tuple[int, int, int, Tuple[int, int], int]  # cluster, stage, stages, layers, clusters
# a stage holds at most 20 % more than an even split of the model: a volunteer's footprint stays
# predictable, and losing one peer never costs a cluster much more than its share of the model
MAX_STAGE_SHARE = 1.2


def model_workload(spec: ModelSpec, run_spec: RunSpec, max_stages: int) -> Tuple[Workload, Tuple[List[float], List[float]]]:
    """The planner's view of a model: memory M, FLOPs F (forward + backward = 3x forward) and activations A (the
    largest layer input, what crosses a link), per layer and total, and the run's microbatches in flight W.

    M is what a stage holds per layer: parameters, gradients, its inner optimizer's state, its outer optimizer's
    state (``optimizers.outer.state_copies``), and with ``stash`` a copy of the weights in flight;
    plus the activations its forward keeps for the backward, for every microbatch in flight with ``stash``
    and for the one being recomputed with ``recompute``. For a transformer at a useful microbatch, activations
    outweigh the weights (docs/models.md)."""
    copies, microbatches = (3, run_spec.max_in_flight) if run_spec.backward == "stash" else (2, 1)
    copies += STATE_COPIES[run_spec.optimizer]  # the inner optimizer's state: AdamW two more copies
    # the outer optimizer's state (anchor, momentum, error) is in host memory: a CPU peer's device memory, and for a
    # GPU peer a count that errs on the safe side (the planner has one memory per peer)
    copies += outer_state_copies(run_spec.outer_optimizer, run_spec.averaging_compression)
    layer_memory_gb = [(copies * layer.param_bytes + microbatches * run_spec.microbatch_size * layer.activation_bytes)
                       / 1e9 for layer in spec.layers]
    layer_gflop = [3 * layer.flops_per_sample / 1e9 for layer in spec.layers]
    activation_mb = max(4 * int(torch.tensor(layer.input_shape).prod()) for layer in spec.layers) / 1e6
    workload = Workload(sum(layer_memory_gb), sum(layer_gflop), activation_mb, min(max_stages, len(spec.layers)),
                        max_stage_share=MAX_STAGE_SHARE, max_in_flight=run_spec.max_in_flight)
    return workload, (layer_memory_gb, layer_gflop)


def layer_offers(record: Dict) -> List[Tuple[int, int, int]]:
    """``(first, last, step)`` of each layer range a peer's record says it gives: its stage's (``layers`` at
    ``step``) and the stage it stopped last (``held``), which it still serves after moving to other layers."""
    offers = []
    if record.get("layers") and record.get("step") is not None:
        offers.append((record["layers"][0], record["layers"][1], record["step"]))
    if record.get("held"):
        offers.append(tuple(record["held"]))
    return offers


def offered_step(record: Dict, layer: int) -> Optional[int]:
    """The freshest step at which a peer's record offers ``layer``, or None."""
    return max((step for first, last, step in layer_offers(record) if first <= layer < last), default=None)


def placement_in(plan: dict, peer_id: str) -> Optional[Placement]:
    """Where ``plan`` puts ``peer_id``: (cluster, stage, stages, layers, clusters), or None (standby)."""
    for cluster_index, cluster in enumerate(plan["clusters"]):
        for stage_index, stage in enumerate(cluster):
            if stage["peer_id"] == peer_id:
                return cluster_index, stage_index, len(cluster), tuple(stage["layers"]), len(plan["clusters"])
    return None


def kept_in_place(before: Optional[dict], after: dict, peer_id: str) -> bool:
    """Whether plan ``after`` keeps the stage ``peer_id`` trains in plan ``before`` where it is (``cost.kept_places``:
    the same layers, in a cluster of the same peers but for ones ``after`` no longer places). The cluster's number and
    the number of clusters may differ: a running stage worker follows both in place (its share of the data, its lr
    rule, its endpoint's key: ``StageWorker.follow_clusters``), so a plan that adds or drops a cluster stops none of
    the stages it keeps, the cluster it renumbers into a dropped one's gap neither; the round prices it so."""
    return before is not None and peer_id in kept_places(in_force_stages(before), in_force_stages(after))


def place_taken_over(records: Sequence[Dict], before: Optional[dict], plan: dict, peer_id: str) -> Optional[str]:
    """The leaver whose place ``plan`` gives ``peer_id`` in a cluster that trains on, or None: a peer ``before`` placed
    at our stage of a cluster of as many stages, on exactly our layers, whose record (among ``records``) says it is
    leaving with them, where ``plan`` keeps every other stage of our cluster in place (``kept_in_place``) and we
    were placed nowhere before (a standby or a joiner). Its layers are ours to take, at its step (our
    neighbours'), with the AdamW and outer state it hands over: the freshest copy, another cluster's live weights (a
    walkthrough's step 29,465 for the leaver's 8,896), paired the leaver's moments and anchor with parameters they do
    not belong to, and said the other cluster's step. A new or re-formed cluster takes one averaging round for all
    its stages instead (``Volunteer._download``)."""
    placement = placement_in(plan, peer_id)
    if before is None or placement is None or placement_in(before, peer_id) is not None:
        return None  # a peer the plan moved here brings layers and a step of its own (kept_places)
    cluster, stage, stages, layers, _ = placement
    mates = {place["peer_id"] for place in plan["clusters"][cluster]} - {peer_id}
    if not mates <= kept_places(in_force_stages(before), in_force_stages(plan)):
        return None
    leaving = {r["peer_id"] for r in records if r.get("state") == "leaving" and r.get("layers") == list(layers)}
    # the cluster of the same number first: of two one-stage clusters whose peers both leave, each taker its own
    ordered = sorted(enumerate(before["clusters"]), key=lambda numbered: numbered[0] != cluster)
    for _, old in ordered:
        if len(old) == stages and mates <= {place["peer_id"] for place in old} and \
                old[stage]["peer_id"] in leaving and tuple(old[stage]["layers"]) == layers:
            return old[stage]["peer_id"]
    return None


def neighbours_in(plan: dict, cluster: int, stage: int, known: Collection[str] = ()) -> Neighbours:
    """The peers ``plan`` puts beside ``stage`` of ``cluster``: the only ones that stage takes pipeline messages
    from, and the only ones its sends resolve those slots to (``known``: the other peers of the run we know of,
    whose messages are refused as honest timing, not as hostile input)."""
    stages = plan["clusters"][cluster]
    return Neighbours(previous=stages[stage - 1]["peer_id"] if stage > 0 else None,
                      next=stages[stage + 1]["peer_id"] if stage + 1 < len(stages) else None, known=known)


def round_step_of(record: Dict) -> int:
    """Where a stage's record says it is on the run's count of averaging rounds: its step less its
    ``round_offset`` (how far its cluster ran ahead of the rounds it took part in; 0 for a record without one)."""
    return record["step"] - (record.get("round_offset") or 0)


def next_round_of(record: Dict, period: int) -> int:
    """The averaging round a stage's record says it takes part in next (``next_round``); a record without one (a
    stage that has not aligned yet) is at its step's next multiple of ``period``, as rounds were always named."""
    given = record.get("next_round")
    return given if given is not None else (round_step_of(record) // period + 1) * period


def holders_before_round(records: Sequence[Dict], round_step: int) -> List[str]:
    """The peers among ``records`` (holders of layers a stage downloads) that have not yet taken averaging round
    ``round_step`` and will: training ones whose record names it or an earlier one as their next round. A new
    cluster's later stage asks its holders for the round its first stage took, and the rounds of one stage's rings
    may come a moment after another's (a stage behind in its pipeline, or its count behind: rounds are counted per
    ring), so it waits for them (``Volunteer._download``) rather than take another round's state."""
    return [r["name"] for r in records if r.get("state") in ("training", "averaging") and
            r.get("next_round") is not None and r["next_round"] <= round_step]


def copies_to_agree(holders: int) -> int:
    """How many of a layer's ``holders`` (those that count) must serve the same averaged copy for a download to
    take it: two, so that no single holder's word is believed, or the only one."""
    return 2 if holders > 1 else 1


def round_for_cluster(layer_holders: Dict[int, Sequence[Dict]]) -> Optional[int]:
    """The averaging round (its step) a new cluster's stages all take their layers from: the latest one of which,
    for every layer of the cluster, as many holders keep the averaged state as a download asks to agree (two, or
    the only one), by their records' ``kept_rounds`` (the rounds whose state of their stage's ``layers`` they keep).
    ``layer_holders``: each layer's holders that count, their peer records. None where no round is kept for every
    layer, or a layer's holders do not say which they keep (a client from before ``kept_rounds``).

    A round is one ring's: the rings of one stage can fail a round that another stage's rings averaged, or take it
    a moment later, so the latest round of the first stage's holders may not be kept by a later stage's."""
    common: Optional[set] = None
    for layer, holders in layer_holders.items():
        keeping = [set(r["kept_rounds"]) for r in holders if r.get("kept_rounds") is not None and r.get("layers")
                   and r["layers"][0] <= layer < r["layers"][1]]
        if not keeping:
            return None
        needed = copies_to_agree(len(holders))
        kept = {step for step in set().union(*keeping) if sum(step in rounds for rounds in keeping) >= needed}
        common = kept if common is None else common & kept
    return max(common) if common else None


def round_to_join(step: int, period: int, own: Optional[Tuple[int, Optional[int]]],
                  partners: Sequence[Dict]) -> Tuple[int, int]:
    """Which averaging round a stage at ``step`` takes part in next, and its offset (its step less the run's
    round step): ``(next_round, offset)`` (docs/averaging.md, "Rounds the run counts").

    Rounds are named on one count for the whole run, not by each cluster's own step, so a cluster that runs ahead
    (a faster one, one that did not wait for a round still running) still meets the others at the next round. A
    stage aligns when it starts or follows a new plan, and after a failed round: to the round its ring partners
    (their peer ``records``: training ones that count rounds) say they take next, at their round step (the upper
    median of their claims: the furthest of one or two); or,
    where it is
    already there (``own``: its next round and, for the same worker, its offset), it keeps its own count. Never
    back: a round this stage took part in is over for it. Without partners' word, rounds fall on the step's
    multiples of ``period``, as before.
    """
    # only partners that counted rounds already say where the run is: a record without ``next_round`` is of a stage
    # that is aligning too, or still downloading, whose step is not yet the one it trains from
    counting = [r for r in partners if r.get("state") in ("training", "averaging") and r.get("step") is not None
                and r.get("next_round") is not None]
    # the upper median, not the furthest: of three partners or more, one record alone (a stranger's next_round of
    # 2**53, a hostile review) moves nobody's count; of one or two, the furthest, as a record can be a round behind
    claims = sorted((r["next_round"], round_step_of(r)) for r in counting)
    best = claims[len(claims) // 2] if claims else None
    by_step = (step // period + 1) * period  # the next round where our step is the round step (offset 0)
    if own is not None and (best is None or own[0] >= best[0]):
        own_next, own_offset = own
        if own_offset is not None:
            return own_next, own_offset
        # a new worker (a new place, a new count of steps): at its step's round if that is the one, else a period on
        return own_next, 0 if own_next == by_step else step - (own_next - period)
    if best is None:
        return by_step, 0
    if best[0] == by_step:
        return by_step, 0  # in step with them (a run's first clusters): our own step, not their record's older one
    return best[0], step - min(best[1], best[0])


def arrival_wait(step: int, missing: List[str], records: Dict[str, Dict], microbatch_size: int,
                 heartbeat: float, period: Optional[int] = None, limit: float = math.inf) -> float:
    """Seconds to keep waiting for ring members that have not reached averaging round ``step``: what the
    slowest of them still has to train to reach it at its recent pace, doubled (paces vary, more so on a busy
    machine), plus a heartbeat (its record is that old at most). A member whose stage just started has no pace
    yet (``samples_per_s`` null): a heartbeat more, when its next record says it. 0, give up, when one of them is
    gone, not training, already at or past the round without arriving (it moved on without us, or its round
    before still runs: the ring's own ``timeout`` waited for it already), or not moving.
    Steps count on the run's round count (:func:`round_step_of`); with ``period``, a record's ``next_round``
    says whether it is past the round. 0 too where the wait would pass ``limit`` (the round's): a member that by its
    own pace cannot come in time is left out now (a record claiming a pace of 1e-300 samples/s held every round
    of its rings to its limit, a hostile review)."""
    wait = 0.0
    for member in missing:
        record = records.get(member)
        if record is None or record["state"] not in ("training", "averaging") or record.get("step") is None:
            return 0.0
        behind, rate = step - round_step_of(record), record.get("samples_per_s")
        if behind <= 0 or rate == 0:
            return 0.0
        if period is not None and next_round_of(record, period) > step:
            return 0.0
        # a cluster formed mid-run starts its stage a moment after the others passed where it counts from
        wait = max(wait, heartbeat if rate is None else behind * microbatch_size / rate)
    # the estimate itself past the limit: it cannot come in time. The doubling is only a margin, cut at the limit
    return min(2 * wait + heartbeat, limit) if wait + heartbeat <= limit else 0.0


def staying(record: Dict) -> bool:
    """Whether a peer's record says it stays: not leaving, nor about to (``leaving_after_round``: it trains on to
    its last averaging round, then leaves). Only such a peer can take a leaver's layers."""
    return record["state"] != "leaving" and record.get("leaving_after_round") is None


def holders_of(peers: List[Dict], start: int, end: int, step: int) -> Optional[List[str]]:
    """Names of peers that stay (:func:`staying`) whose records together hold every layer of ``start:end`` at
    ``step`` or later, or None while some layer has no such holder: then a leaving peer's work would be lost."""
    names = set()
    for layer in range(start, end):
        holders = [p["name"] for p in peers if staying(p) and p.get("layers")
                   and p["layers"][0] <= layer < p["layers"][1] and (p.get("step") or 0) >= step]
        if not holders:
            return None
        names.update(holders)
    return sorted(names)
