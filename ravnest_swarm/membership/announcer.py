"""Publishing and reading peer records under ``{run}_peers``."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Dict, List, Optional

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.utils.timed_storage import get_dht_time

from ravnest_swarm import __version__
from ravnest_swarm.membership.capabilities import Capabilities
from ravnest_swarm.membership.records import PeerRecord, peers_key
from ravnest_swarm.transport import store_on_backbones, store_record

logger = logging.getLogger(__name__)


class PeerAnnouncer:
    """Keeps this peer's signed record alive in the DHT.

    The record expires ``2 * heartbeat`` seconds after each renewal, so a peer that dies vanishes from
    everyone's view within two heartbeats without anyone having to notice.

    :param node: this peer's DHT node (its validators must include the run's)
    :param run: run name
    :param name: human-readable peer name
    :param capabilities: measured or overridden capabilities
    :param heartbeat: seconds between renewals
    """

    def __init__(self, node: DHTNode, run: str, name: str, capabilities: Capabilities, heartbeat: float = 5.0):
        self.node, self.run, self.heartbeat = node, run, heartbeat
        self.subkey = RSASignatureValidator().local_public_key
        self.record: Dict = dict(
            peer_id=node.peer_id.to_base58(),
            name=name,
            state="joining",
            version=__version__,
            maddrs=[],
            **capabilities.as_dict(),
        )
        self._backbone_copy: Optional[asyncio.Task] = None

    def update(self, **fields) -> None:
        self.record.update(fields)

    async def publish(self, lifetime: Optional[float] = None, wait_for_backbones: bool = True) -> bool:
        """Store the record now; returns whether at least one DHT node accepted it.

        :param wait_for_backbones: wait for the copy on our backbones too (see ``store_record``); a heartbeat
          does not: its record lives two heartbeats, less than a loaded backbone may take to answer
        """
        self.record["time"] = time.time()
        # the schema validator compares the stored dict with its parsed form, so absent optionals go as None
        value = PeerRecord.parse_obj(self.record).dict()
        expiration = get_dht_time() + (lifetime if lifetime is not None else 2 * self.heartbeat)
        if self._backbone_copy is not None:
            self._backbone_copy.cancel()  # an older copy still under way: this record supersedes it
            self._backbone_copy = None
        key = peers_key(self.run)
        if wait_for_backbones:
            return await store_record(self.node, key, value, expiration, subkey=self.subkey)
        self._backbone_copy = asyncio.create_task(store_on_backbones(self.node, key, value, expiration, self.subkey))
        self._backbone_copy.add_done_callback(_log_failed_copy)
        return bool(await self.node.store(key, value, expiration, subkey=self.subkey))

    async def heartbeat_forever(self) -> None:
        while True:
            try:
                if not await self.publish(wait_for_backbones=False):
                    logger.warning("no DHT node accepted our peer record; retrying next heartbeat")
            except Exception as e:  # a transient DHT error must not stop the heartbeats
                logger.warning(f"publishing the peer record failed: {e}")
            await asyncio.sleep(self.heartbeat)

    async def leave(self) -> None:
        """Say ``leaving`` so others see a graceful exit, not a disappearance.

        A DHT value is only replaced by one that expires later, so this record must outlive the last
        heartbeat's; it still vanishes two heartbeats after we go.
        """
        self.update(state="leaving")
        await self.publish(lifetime=2 * self.heartbeat + 0.5)


def _log_failed_copy(copy: asyncio.Task) -> None:
    if not copy.cancelled() and copy.exception() is not None:
        logger.debug(f"copying our peer record to a backbone failed: {copy.exception()}")


async def read_peers(node: DHTNode, run: str) -> List[Dict]:
    """Every live peer record of ``run`` (already validated by the node), sorted by name."""
    found = await node.get(peers_key(run), latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    peers = []
    for subkey, item in found.value.items():
        record = dict(item.value)
        record["expires_in"] = round(item.expiration_time - get_dht_time(), 1)
        peers.append(record)
    return sorted(peers, key=lambda record: (record["name"], record["peer_id"]))
