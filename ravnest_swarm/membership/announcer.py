"""Publishing this peer's record under ``{run}_peers`` (``membership.reader`` reads them)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Dict, Optional

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.utils.timed_storage import get_dht_time

from ravnest_swarm import __version__
from ravnest_swarm.devices import peak_memory
from ravnest_swarm.membership.capabilities import Capabilities
from ravnest_swarm.membership.records import PeerRecord, peers_key
from ravnest_swarm.net.node import store_record

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

    def update(self, **fields) -> None:
        self.record.update(fields)

    async def publish(self, lifetime: Optional[float] = None) -> bool:
        """Store the record now; returns whether at least one DHT node accepted it."""
        self.record["time"] = time.time()
        # measured, not declared: what this process has taken at most so far, renewed with every record
        self.record["peak_memory_gb"], self.record["device_peak_gb"] = peak_memory(self.record.get("device") or "cpu")
        # the schema validator compares the stored dict with its parsed form, so absent optionals go as None
        value = PeerRecord.parse_obj(self.record).dict()
        expiration = get_dht_time() + (lifetime if lifetime is not None else 2 * self.heartbeat)
        return await store_record(self.node, peers_key(self.run), value, expiration, subkey=self.subkey)

    async def heartbeat_forever(self) -> None:
        while True:
            started = time.monotonic()
            try:
                if not await self.publish():
                    logger.warning("no DHT node accepted our peer record; retrying next heartbeat")
            except Exception as e:  # a transient DHT error must not stop the heartbeats
                logger.warning(f"publishing the peer record failed: {e}")
            # every heartbeat from the last one's start: a store that took seconds (a busy machine, a slow DHT
            # node) must not stretch the gap between renewals past the record's lifetime of two heartbeats
            await asyncio.sleep(max(0.0, self.heartbeat - (time.monotonic() - started)))

    async def leave(self) -> None:
        """Say ``leaving`` so others see a graceful exit, not a disappearance.

        A DHT value is only replaced by one that expires later, so this record must outlive the last
        heartbeat's; it still vanishes two heartbeats after we go.
        """
        self.update(state="leaving")
        await self.publish(lifetime=2 * self.heartbeat + 0.5)

