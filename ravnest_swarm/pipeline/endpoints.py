"""Publishing a stage's endpoint under ``{run}_stages`` and resolving neighbours there."""

from __future__ import annotations

import logging
import time
from typing import Dict, Tuple

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import get_dht_time

from ravnest_swarm.membership.records import StageEndpoint, stage_subkey_prefix, stages_key
from ravnest_swarm.net.node import maddrs_without_peer_id

logger = logging.getLogger(__name__)


async def publish_endpoint(node: DHTNode, run: str, cluster: int, stage: int, model: str,
                           layers: Tuple[int, int], version: int, lifetime: float) -> bool:
    """Store (or renew) this stage's signed endpoint; True if a DHT node accepted it."""
    maddrs = [str(m) for m in await node.p2p.get_visible_maddrs()]
    # the schema validator compares the stored dict with its parsed form, so store the parsed dict
    value = StageEndpoint(peer_id=node.peer_id.to_base58(), maddrs=maddrs, model=model, layers=list(layers),
                          version=version, time=time.time()).dict()
    subkey = stage_subkey_prefix(cluster, stage) + RSASignatureValidator().local_public_key
    return bool(await node.store(stages_key(run), value, get_dht_time() + lifetime, subkey=subkey))


async def read_endpoints(node: DHTNode, run: str) -> Dict[Tuple[int, int], Dict]:
    """The newest endpoint of every ``(cluster, stage)`` of ``run`` (records are validated by the node)."""
    found = await node.get(stages_key(run), latest=True)
    newest: Dict[Tuple[int, int], Dict] = {}
    if found is None or not isinstance(found.value, dict):
        return newest
    for subkey, item in found.value.items():
        if not isinstance(subkey, bytes) or b"[" not in subkey:
            continue
        try:
            cluster, stage = (int(part) for part in subkey.split(b"[", 1)[0].decode().split("."))
        except ValueError:
            continue
        if (cluster, stage) not in newest or item.value["time"] > newest[(cluster, stage)]["time"]:
            newest[(cluster, stage)] = item.value
    return newest


class EndpointResolver:
    """Finds the peer serving a stage of our cluster and keeps it until a send to it fails.

    :param node: our DHT node (its P2P dials the stage)
    :param run: run name
    :param cluster: our cluster; we only talk to stages of our own cluster
    """

    def __init__(self, node: DHTNode, run: str, cluster: int):
        self.node, self.run, self.cluster = node, run, cluster
        self._cache: Dict[int, PeerID] = {}

    async def resolve(self, stage: int, refresh: bool = False) -> PeerID:
        """The stage's peer id, connected; with ``refresh`` read the DHT again (after a failed send)."""
        if not refresh and stage in self._cache:
            return self._cache[stage]
        endpoint = (await read_endpoints(self.node, self.run)).get((self.cluster, stage))
        if endpoint is None:
            raise LookupError(f"no endpoint for stage {stage} of cluster {self.cluster} under {stages_key(self.run)}")
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

