"""Reading a run's records from the DHT: the one place each kind of record is read.

Every node of a run installs the run's validators (``membership/records.py``), which check records as
they are fetched, so what these functions return passed the schemas and the signatures. Each read asks
for the newest value of every subkey (``latest=True``): a DHT node holding an older copy does not win.

:func:`read_snapshot` is what the dashboard is fed (peers and plan at one moment); with the environment
variable ``RAVNEST_RECORD_SNAPSHOTS=FILE`` every snapshot is also appended to FILE as a JSON line, the
recording the dashboard test replays (docs/dashboard.md).
"""

from __future__ import annotations

import json
import os
import time
from typing import Dict, List, Optional

from hivemind.dht.node import DHTNode
from hivemind.utils.timed_storage import get_dht_time

from ravnest_swarm.membership.records import peers_key, plan_key, round_key

RECORD_SNAPSHOTS_ENV = "RAVNEST_RECORD_SNAPSHOTS"


async def read_peers(node: DHTNode, run: str, alive_at: Optional[float] = None) -> List[Dict]:
    """Every live peer record of ``run``, sorted by name, each with ``expires_in`` (seconds until it expires).

    :param alive_at: only records still valid at this DHT time (a planning round's view of who is alive)
    """
    found = await node.get(peers_key(run), latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    now = get_dht_time()
    peers = []
    for item in found.value.values():
        if alive_at is not None and item.expiration_time <= alive_at:
            continue
        peers.append(dict(item.value, expires_in=round(item.expiration_time - now, 1)))
    return sorted(peers, key=lambda record: (record["name"], record["peer_id"]))


async def read_peers_settled(node: DHTNode, run: str, looks: int = 2) -> List[Dict]:
    """Every live peer record that any of ``looks`` reads finds, the newest copy of each, sorted by name.

    One read can miss the records held by a DHT node that did not answer in time (a busy machine makes
    that common); for a one-shot view (``status``) a second look is cheaper than a peer shown as gone.
    """
    found: Dict[str, Dict] = {}
    for _ in range(looks):
        for record in await read_peers(node, run):
            known = found.get(record["peer_id"])
            if known is None or record["time"] > known["time"]:
                found[record["peer_id"]] = record
    return sorted(found.values(), key=lambda record: (record["name"], record["peer_id"]))


def adopted_plan(plans: List[Dict], peers: List[Dict], live_round: Optional[int] = None) -> Optional[Dict]:
    """The newest of ``plans`` that the peers it places follow, or None.

    Anyone can write a plan record, for any round; what a stranger cannot write is the signed peer records of
    the peers a plan places. So a plan counts once more than half of its stages are confirmed by a live record
    of the peer placed there that names the plan's round and the same cluster, stage and layers.

    :param peers: the live peer records (:func:`read_peers`)
    :param live_round: the round the caller adopted itself, if any: plans more than one round ahead of it are
        ignored (a real round opens only after the previous one was adopted)
    """
    placed = {}
    for record in peers:
        if record.get("plan_round") is not None:
            placed.setdefault(record["peer_id"], []).append(record)

    def confirmed(plan: Dict, cluster: int, stage: int, entry: Dict) -> bool:
        return any(r["plan_round"] == plan["round"] and r.get("cluster") == cluster and r.get("stage") == stage
                   and r.get("layers") == entry["layers"] for r in placed.get(entry["peer_id"], ()))

    for plan in sorted(plans, key=lambda p: p["round"], reverse=True):
        if live_round is not None and plan["round"] > live_round + 1:
            continue
        stages = [(c, s, entry) for c, cluster in enumerate(plan["clusters"]) for s, entry in enumerate(cluster)]
        if 2 * sum(confirmed(plan, c, s, entry) for c, s, entry in stages) > len(stages):
            return plan
    return None


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
