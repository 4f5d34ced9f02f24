"""Reading a run's records from the DHT: the one place each kind of record is read.

Every node of a run installs the run's validators (``membership/records.py``), which check records as
they are fetched, so what these functions return passed the schemas and the signatures. Each read asks
for the newest value of every subkey (``latest=True``): a DHT node holding an older copy does not win.

:func:`read_snapshot` is what the dashboard is fed (peers and plan at one moment); with the environment
variable ``RAVNEST_RECORD_SNAPSHOTS=FILE`` every snapshot is also appended to FILE as a JSON line, the
recording the dashboard test replays (docs/dashboard.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any, Dict, Iterable, List, Optional, Tuple

from hivemind.dht.node import DHTNode
from hivemind.utils.timed_storage import get_dht_time

from ravnest_swarm.membership.buckets import add_up, bucket_of, counts_named
from ravnest_swarm.membership.progress import run_finished
from ravnest_swarm.membership.records import peers_key, plan_key, round_key, summary_key
from ravnest_swarm.membership.tickets import admitted
from ravnest_swarm.membership.view import PeerView

RECORD_SNAPSHOTS_ENV = "RAVNEST_RECORD_SNAPSHOTS"


def _entries(found) -> List[Tuple[Any, Dict, float]]:
    """``(subkey, value, expiration)`` of every subkey of a dictionary value ``node.get`` returned (None: none)."""
    if found is None or not isinstance(found.value, dict):
        return []
    return [(subkey, item.value, item.expiration_time) for subkey, item in found.value.items()]


async def read_buckets(node: DHTNode, run: str, buckets: int,
                       only: Optional[Iterable[int]] = None) -> List[Tuple[Any, Dict, float]]:
    """``(writer, record, expiration)`` of every peer record in the run's buckets at ``buckets`` (or in ``only``)."""
    return (await read_bucket_counts(node, run, {buckets: only}, with_summaries=False))[1]


async def read_bucket_counts(node: DHTNode, run: str, wanted: Dict[int, Optional[Iterable[int]]],
                             with_summaries: bool = True) -> Tuple[List[Dict], List[Tuple[Any, Dict, float]]]:
    """One read of the run's bucket summaries (where ``with_summaries``) and, for each bucket count in ``wanted``,
    its buckets (all where None, else those listed): ``(summaries, (writer, record, expiration) of each record)``."""
    keys = [peers_key(run, count, bucket) for count, only in wanted.items()
            for bucket in (range(count) if only is None else sorted(set(only)))]
    asked = [summary_key(run)] + keys if with_summaries else keys
    found = await node.get_many(asked, sufficient_expiration_time=float("inf"))
    summaries = [value for _, value, _ in _entries(found.get(summary_key(run)))] if with_summaries else []
    return summaries, [entry for key in keys for entry in _entries(found.get(key))]


async def read_summary(node: DHTNode, run: str, now: Optional[float] = None) -> Optional[Dict]:
    """The run's totals, added up from its buckets' summaries (``membership.buckets.add_up``), or None: anyone's
    summaries, so a guess (a joiner's first bucket count), never a count to show (:func:`read_summaries`).
    ``now``: the DHT time the summaries are dated against (the reader's clock; a simulation's runs ahead)."""
    return add_up(await read_summaries(node, run), now)


async def read_summaries(node: DHTNode, run: str) -> List[Dict]:
    """Every bucket summary of ``{run}_summary``, whoever wrote it (``buckets.confirmed`` says which count)."""
    return [value for _, value, _ in _entries(await node.get(summary_key(run), latest=True))]


async def read_peers(node: DHTNode, run: str, alive_at: Optional[float] = None,
                     view: Optional[PeerView] = None, peer_ids: Optional[Iterable[str]] = None,
                     bucket_counts: Optional[Iterable[int]] = None) -> List[Dict]:
    """Every live peer record of ``run``, sorted by name, each with ``expires_in`` (seconds until it expires); in an
    invite-only run, those of peers with a valid ticket (the node's ``admission``, ``membership/tickets.py``).

    Reads the summaries and the one-bucket key at once; then the buckets of every other bucket count a summary
    names (only the buckets of ``peer_ids`` where given: a trainer needs only its neighbours). Every count named, not
    the one the summaries add up to: anyone can write summaries, and a stranger's for 256 buckets made readers read
    256 empty buckets and none of the run's.

    :param alive_at: only records still valid at this DHT time (a planning round's view of who is alive)
    :param view: a view kept between reads (``membership.view``): the read is merged into it and its records
        returned, so a peer a read missed stays until its record expires
    :param peer_ids: only these peers are needed (others may be returned too)
    :param bucket_counts: the bucket counts the run's records are at, where the caller knows them (a peer's
        announcer reads them every heartbeat, ``PeerAnnouncer.bucket_counts_in_use``): their buckets are read
        without the summary, one key in a run of one bucket. The summary beside it made a trainer's read of its
        ring partners 1.5 times as slow as the single key before buckets (``bench neighbours``, 64 peers).
    """
    entries = []
    if bucket_counts is None:
        found = await node.get_many([summary_key(run), peers_key(run)], sufficient_expiration_time=float("inf"))
        entries = _entries(found.get(peers_key(run)))
        bucket_counts = [count for count in counts_named(value for _, value, _ in _entries(found.get(summary_key(run))))
                         if count > 1]
    wanted = {count: None if peer_ids is None else [bucket_of(peer_id, count) for peer_id in peer_ids]
              for count in bucket_counts}
    if wanted:
        entries += (await read_bucket_counts(node, run, wanted, with_summaries=False))[1]
    view = view if view is not None else PeerView()
    view.merge(entries)
    return admitted(node, view.records(get_dht_time(), alive_at))  # an invite-only run counts ticket holders only


def plan_digest(plan: Dict) -> str:
    """A short hash of a plan record's round and placement (each cluster's peers and layers, in order). A peer
    record names it beside ``plan_round``: two plans of one round can place a peer alike, and only its digest says
    which of them the peer follows."""
    placement = [[[entry["peer_id"], list(entry["layers"])] for entry in cluster] for cluster in plan["clusters"]]
    return hashlib.sha256(json.dumps([plan["round"], placement]).encode()).hexdigest()[:16]


def holds_place(record: Dict, plan: Dict, cluster: int, stage: int, entry: Dict) -> bool:
    """Whether a peer's ``record`` names ``plan``'s round and the place ``entry`` it gives that peer: cluster
    ``cluster``, stage ``stage`` and the entry's layers; which plan of that round it follows, ``plan_digest`` says."""
    return (record.get("plan_round") == plan["round"] and record.get("cluster") == cluster
            and record.get("stage") == stage and record.get("layers") == entry["layers"])


def adopted_plan(plans: List[Dict], peers: List[Dict], live_round: Optional[int] = None) -> Optional[Dict]:
    """The newest of ``plans`` that the peers it places follow, or None.

    Anyone can write a plan record, for any round; what a stranger cannot write is the signed peer records of
    the peers a plan places. So a plan counts once more than half of its stages whose peers are still live are
    confirmed by a live record of the peer placed there that names the plan's round and the same cluster, stage
    and layers. Stages whose peers are gone or leaving confirm nothing either way: half of a cluster of two that left is
    still the plan its other half follows, and a standby that joined after the round must see it as its peers do
    (it once saw no plan at all, opened a round 1 of its own while the others opened round 2, and they never met).
    A stranger's plan gains nothing from this: the live peers it places follow their own plan, not the stranger's.
    A plan whose every placed peer is gone or leaving counts while most of the leaving ones' records still name it.
    A record that names the digest of the plan it follows (:func:`plan_digest`) confirms that plan only.
    Of the plans that count, one more than a round past the one the most peers confirm is ignored.

    :param peers: the live peer records (:func:`read_peers`)
    :param live_round: the round the caller adopted itself, if any: plans more than one round ahead of it are
        ignored (a real round opens only after the previous one was adopted), as are plans more than one round
        past the plan in force that the most peers confirm
    """
    # a leaving peer is gone already: its record says cluster -1 while it hands its layers over
    placed, live = {}, {record["peer_id"] for record in peers if record.get("state") != "leaving"}
    leaving = {record["peer_id"]: record for record in peers if record.get("state") == "leaving"}
    for record in peers:
        if record.get("plan_round") is not None:
            placed.setdefault(record["peer_id"], []).append(record)

    # a record that names the digest of the plan it follows confirms that plan alone, not another of its round that
    # places it alike (a stranger's copy of the honest plan with clusters of its own added outranked the honest one)
    digests: Dict[int, str] = {}

    def names(record: Dict, plan: Dict) -> bool:
        if record.get("plan_digest") is None:
            return True
        if id(plan) not in digests:  # once per plan: a reader's look at 256 stages hashed each one's plan again
            digests[id(plan)] = plan_digest(plan)
        return record["plan_digest"] == digests[id(plan)]

    def confirmed(plan: Dict, cluster: int, stage: int, entry: Dict) -> bool:
        return any(holds_place(r, plan, cluster, stage, entry) and names(r, plan)
                   for r in placed.get(entry["peer_id"], ()))

    def handed_over_by(plan: Dict, entry: Dict) -> bool:
        # a leaving record names no cluster or stage any more, but still its plan round and its layers
        record = leaving.get(entry["peer_id"])
        return (record is not None and record.get("plan_round") == plan["round"]
                and record.get("layers") == entry["layers"] and names(record, plan))

    counted = []  # (plan, its confirming stages, its stages whose peers are live), of the plans in force
    for plan in plans:
        if live_round is not None and plan["round"] > live_round + 1:
            continue
        stages = [(c, s, entry) for c, cluster in enumerate(plan["clusters"]) for s, entry in enumerate(cluster)
                  if entry["peer_id"] in live]
        confirming = sum(confirmed(plan, c, s, entry) for c, s, entry in stages)
        if stages:
            in_force = 2 * confirming > len(stages)
        else:
            # every peer it places is gone or leaving: while they hand their layers over the plan is still the run's,
            # and its next round re-places them (a walkthrough's joiner came while the only placed peer handed over,
            # read no plan in force, opened a round 1 of its own and trained a second lineage that never averaged
            # with the run). It ranks below a plan of its round that live peers confirm (``confirming`` is 0)
            leavers = [entry for cluster in plan["clusters"] for entry in cluster if entry["peer_id"] in leaving]
            in_force = 2 * sum(handed_over_by(plan, entry) for entry in leavers) > len(leavers)
        if in_force:
            counted.append((plan, confirming, len(stages)))
    if not counted:
        return None
    # one key can confirm a plan with its own record: its plan of round 2**53 placing itself alone was the run's for
    # joiners, observers and exports (a hostile review). The plan the most peers confirm (of those, the oldest)
    # anchors the rounds: one more than one round past it is ignored, as a round opens only after one is adopted
    anchor = max(counted, key=lambda item: (item[1], -item[0]["round"]))[0]["round"]
    best = None
    for plan, confirming, live_stages in counted:
        if plan["round"] <= anchor + 1:
            # two plans of one round can both be followed: peers that read no plan opened a round 1 of their own
            # (a NAT lab run). Every reader must name the same one in force, or each side counts the other's peers
            # as placed elsewhere and the two never meet. The more confirmed stages win, then the fewer places of
            # peers not live (a stranger's copy of the honest plan plus made-up peers ties on the first), then the
            # canonical form
            places = sum(len(cluster) for cluster in plan["clusters"])
            key = (plan["round"], confirming, live_stages - places,
                   json.dumps(sorted(sorted(entry["peer_id"] for entry in cluster) for cluster in plan["clusters"])))
            if best is None or key > best[0]:
                best = (key, plan)
    return None if best is None else best[1]


def followed_by_its_peers(plan: Dict, peers: List[Dict], me: str) -> bool:
    """Whether more than half of the live peers that ``plan`` places, ``me`` aside, follow this very plan: their
    records name its round and digest (:func:`plan_digest`) and the cluster, stage and layers it gives them.

    What lets a peer on the losing side of a split round (docs/planning.md) follow the other side's plan, which
    places it too. Counting by digest keeps a stranger's copy out: one that adds clusters of its own identities to
    the honest plan (outranking it in :func:`adopted_plan`) or gives us other layers is named by none of the honest
    peers it places, so it counts only where the stranger's identities outnumber them. A mover's record names its
    new round while it still names its old place: it counts for neither side until it has moved."""
    digest = plan_digest(plan)
    records = {r["peer_id"]: r for r in peers if r.get("state") != "leaving"}
    others = [(c, s, entry) for c, cluster in enumerate(plan["clusters"]) for s, entry in enumerate(cluster)
              if entry["peer_id"] != me and entry["peer_id"] in records]
    following = sum(holds_place(records[entry["peer_id"]], plan, c, s, entry)
                    and records[entry["peer_id"]].get("plan_digest") == digest for c, s, entry in others)
    return 2 * following > len(others)


async def read_plans(node: DHTNode, run: str) -> List[Dict]:
    """Every plan record of ``{run}_plan``: each adopter's copy of each round, and whatever strangers wrote."""
    found = await node.get(plan_key(run), latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    return [item.value for item in found.value.values()]


async def read_adopted_plan(node: DHTNode, run: str, peers: Optional[List[Dict]] = None,
                            live_round: Optional[int] = None) -> Optional[Dict]:
    """The newest plan the run follows (:func:`adopted_plan`), or None while none is.

    :param peers: the live peer records, if the caller has just read them
    """
    if peers is None:
        peers = await read_peers(node, run)
    return adopted_plan(await read_plans(node, run), peers, live_round)


async def read_proposals(node: DHTNode, run: str) -> List[Dict]:
    """Every live planning-round proposal of ``{run}_round``, of any round."""
    found = await node.get(round_key(run), latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    return [item.value for item in found.value.values()]


async def read_snapshot(node: DHTNode, run: str) -> Dict:
    """What the dashboard is fed: ``{"run", "at", "peers", "plan"}`` (``at``: wall-clock time after the reads).

    Appended to the file named by ``RAVNEST_RECORD_SNAPSHOTS`` when it is set.
    """
    peers = await read_peers(node, run)
    snapshot = dict(run=run, at=time.time(), peers=peers, plan=await read_adopted_plan(node, run, peers))
    recording = os.environ.get(RECORD_SNAPSHOTS_ENV)
    if recording:
        with open(recording, "a") as f:
            f.write(json.dumps(snapshot) + "\n")
    return snapshot


async def why_finished(node: DHTNode, run: str, spec: Dict) -> Optional[str]:
    """Why the run whose current spec record is ``spec`` is finished: its owner signed its end, or every placed peer
    reached its length (:func:`run_finished`); None while it trains."""
    if spec.get("finished"):
        return f"its owner signed its end (spec version {spec['version']})"
    if run_finished(await read_peers(node, run), spec["steps"]):
        return f"every placed peer reached its length, step {spec['steps']}"
    return None
