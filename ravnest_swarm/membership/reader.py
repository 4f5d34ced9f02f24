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


async def read_newest_plan(node: DHTNode, run: str) -> Optional[Dict]:
    """The newest adopted round of ``{run}_plan`` (its subkey is the round), or None while none was adopted."""
    found = await node.get(plan_key(run), latest=True)
    if found is None or not isinstance(found.value, dict) or not found.value:
        return None
    return found.value[max(found.value)].value


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
    snapshot = dict(run=run, at=time.time(), peers=peers, plan=await read_newest_plan(node, run))
    recording = os.environ.get(RECORD_SNAPSHOTS_ENV)
    if recording:
        with open(recording, "a") as f:
            f.write(json.dumps(snapshot) + "\n")
    return snapshot
