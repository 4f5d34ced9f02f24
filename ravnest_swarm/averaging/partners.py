"""Reaching our ring partners before a round: p2pd's own routing cannot find peers at non-public addresses."""

from __future__ import annotations

import logging
from typing import Iterable, Optional, Sequence

from hivemind.dht.node import DHTNode
from hivemind.p2p import PeerID

from ravnest_swarm.averaging.segments import Ring
from ravnest_swarm.membership.reader import read_peers
from ravnest_swarm.net.node import maddrs_without_peer_id

logger = logging.getLogger(__name__)


async def connect_members(node: DHTNode, run: str, rings: Sequence[Ring],
                          bucket_counts: Optional[Iterable[int]] = None) -> None:
    """Dial our ring partners at the addresses in their peer records.

    p2pd's own routing cannot find peers whose addresses it treats as non-public (a LAN, the bench's
    198.18.0.0/15 lab), so we connect explicitly, as the pipeline does for its neighbours; a partner
    behind NAT is reached through a backbone (reversal or forwarding, see reversal.py).

    :param bucket_counts: the run's bucket counts as our announcer knows them (``read_peers``)
    """
    me = node.peer_id.to_base58()
    wanted = {member for ring in rings for member in ring.members if member != me}
    # only our partners' buckets in a large run
    for record in await read_peers(node, run, peer_ids=wanted, bucket_counts=bucket_counts):
        if record.get("peer_id") in wanted and record.get("maddrs"):
            try:  # one partner's record, however it came to be, fails the dial of its own ring at most
                peer_id = PeerID.from_base58(record["peer_id"])
                maddrs = maddrs_without_peer_id(record["maddrs"], peer_id)
                await node.routes.connect(peer_id, maddrs, record.get("reachability"))
            except Exception as e:  # the ring's own timeout reports a partner we cannot reach
                logger.warning(f"could not connect to ring partner {record['peer_id'][-8:]}: {e}")
