"""Averagers over real P2P (p2pd) in the test's own process, for ring tests that set up rounds by hand."""

from contextlib import asynccontextmanager
from typing import AsyncIterator, List, Tuple

from hivemind.p2p import PeerID

from ravnest_swarm.averaging.averager import MultiRingAverager
from ravnest_swarm.net.identity import PeerIdentity, load_identity
from ravnest_swarm.net.node import parse_maddrs, start_node, stop_node


def identities_in_ring_order(directory, count: int) -> List[PeerIdentity]:
    """``count`` identity files made in ``directory``, by rising peer id: a ring orders its members by peer id, so
    peers given them in this order run every ring they share in that order (``averaging-peer --identity``)."""
    identities = [load_identity(str(directory / f"identity{i}.key")) for i in range(count)]
    return sorted(identities, key=lambda identity: identity.peer_id)


@asynccontextmanager
async def connected_averagers(backbone: str, count: int, run: str,
                              **options) -> AsyncIterator[Tuple[List[MultiRingAverager], List[str]]]:
    """``count`` started averagers of ``run`` (``options`` go to each), every pair connected directly, and their
    peer ids; each averager and node is stopped on the way out, also when the test fails."""
    nodes, averagers = [], []
    try:
        for _ in range(count):
            nodes.append(await start_node(parse_maddrs([backbone]), host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
        averagers = [MultiRingAverager(node.routes, run, **options) for node in nodes]
        for averager in averagers:
            await averager.start()
        ids = [node.peer_id.to_base58() for node in nodes]
        for i, node in enumerate(nodes):
            for j in range(i + 1, count):
                await node.routes.connect(PeerID.from_base58(ids[j]), await nodes[j].p2p.get_visible_maddrs(),
                                          "direct")
        yield averagers, ids
    finally:
        for averager in averagers:
            await averager.shutdown()
        for node in nodes:
            await stop_node(node)
