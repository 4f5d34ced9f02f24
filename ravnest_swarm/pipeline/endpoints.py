"""Publishing a stage's endpoint under its cluster's ``{run}_stages_{k}`` key and resolving neighbours there."""

from __future__ import annotations

import logging
import time
from typing import Callable, Dict, Optional, Tuple

from hivemind.dht.node import DHTNode
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import get_dht_time

from ravnest_swarm.membership.records import StageEndpoint, signing_validator, stage_subkey_prefix, stages_key
from ravnest_swarm.membership.tickets import admission_of
from ravnest_swarm.net.node import maddrs_without_peer_id
from ravnest_swarm.pipeline.config import Neighbours

logger = logging.getLogger(__name__)


async def publish_endpoint(node: DHTNode, run: str, cluster: int, stage: int, model: str,
                           layers: Tuple[int, int], version: int, lifetime: float) -> bool:
    """Store (or renew) this stage's signed endpoint; True if a DHT node accepted it."""
    maddrs = [str(m) for m in await node.p2p.get_visible_maddrs()]
    # the schema validator compares the stored dict with its parsed form, so store the parsed dict
    value = StageEndpoint(peer_id=node.peer_id.to_base58(), maddrs=maddrs, model=model, layers=list(layers),
                          version=version, time=time.time()).dict()
    subkey = stage_subkey_prefix(cluster, stage) + signing_validator(node).local_public_key
    return bool(await node.store(stages_key(run, cluster), value, get_dht_time() + lifetime, subkey=subkey))


async def read_endpoints(node: DHTNode, run: str, cluster: int, named: Optional[Dict[Tuple[int, int], str]] = None
                         ) -> Dict[Tuple[int, int], Dict]:
    """The endpoint of every stage of ``cluster`` (records are validated by the node): the newest by its
    ``time``, except that a slot in ``named`` counts only records from the peer named for it there. A record's
    subkey binds it to its writer's RSA key, not to a slot's peer, and its ``time`` is what the writer says: anyone
    could otherwise take a slot by writing a newer record for it. In an invite-only run, records of peers without a
    valid ticket do not count at all (the node's ``admission``, ``membership/tickets.py``)."""
    named = named or {}
    admission = admission_of(node)
    newest: Dict[Tuple[int, int], Dict] = {}
    found = await node.get(stages_key(run, cluster), latest=True)
    if found is None or not isinstance(found.value, dict):
        return newest
    for subkey, item in found.value.items():
        if not isinstance(subkey, bytes) or b"[" not in subkey:
            continue
        try:
            slot = tuple(int(part) for part in subkey.split(b"[", 1)[0].decode().split("."))
        except ValueError:
            continue
        if len(slot) != 2 or slot[0] != cluster:
            continue  # malformed, or a stage of another cluster sharing the key
        if slot in named and item.value["peer_id"] != named[slot]:
            continue
        if admission is not None and not admission.admits_peer(item.value["peer_id"]):
            continue
        if slot not in newest or item.value["time"] > newest[slot]["time"]:
            newest[slot] = item.value
    return newest


class EndpointResolver:
    """Finds the peer serving a stage of our cluster and keeps it until a send to it fails.

    :param node: our DHT node (its P2P dials the stage)
    :param run: run name
    :param cluster: our cluster; we only talk to stages of our own cluster
    :param stage: our own stage, and ``neighbours()`` who serves the stages beside it (read at each resolve, so a
        new plan's neighbours count at once): a neighbour's slot resolves only to its named peer
    """

    def __init__(self, node: DHTNode, run: str, cluster: int, stage: Optional[int] = None,
                 neighbours: Callable[[], Neighbours] = lambda: Neighbours(named=False)):
        self.node, self.run, self.cluster, self.stage, self.neighbours = node, run, cluster, stage, neighbours
        self._cache: Dict[int, PeerID] = {}

    async def resolve(self, stage: int, refresh: bool = False) -> PeerID:
        """The stage's peer id, connected; with ``refresh`` read the DHT again (after a failed send)."""
        neighbours = self.neighbours()
        named = neighbours.named and self.stage is not None
        expected = neighbours.peer_of(self.stage, stage) if named else None
        if named and expected is None:
            raise LookupError(f"no peer is named for stage {stage} of cluster {self.cluster} beside our stage "
                              f"{self.stage}")
        cached = self._cache.get(stage)
        if not refresh and cached is not None and expected in (None, cached.to_base58()):
            return cached
        slot = (self.cluster, stage)
        endpoint = (await read_endpoints(self.node, self.run, self.cluster,
                                         {slot: expected} if expected else None)).get(slot)
        if endpoint is None:
            whose = f" from {expected}, the peer named for it," if expected else ""
            raise LookupError(f"no endpoint{whose} for stage {stage} of cluster {self.cluster} under "
                              f"{stages_key(self.run, self.cluster)}")
        peer_id = PeerID.from_base58(endpoint["peer_id"])
        # dial the announced addresses explicitly (p2pd's own routing does not know them); a stage behind NAT
        # is reached through a backbone instead (reversal or forwarding, see net/routes.py)
        links = self.node.routes
        if refresh:
            links.forget(peer_id)
        await links.connect(peer_id, maddrs_without_peer_id(endpoint["maddrs"], peer_id))
        if self._cache.get(stage) not in (None, peer_id):
            logger.info(f"stage {stage} moved to {peer_id}")
        self._cache[stage] = peer_id
        return peer_id

