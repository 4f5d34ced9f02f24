"""The records of a large run, written by one signer: what ``status`` and the dashboard read at 1,000 peers and
more, without hosting a p2pd per peer (this machine holds about 200: ``docs/benchmarks.md``).

Every record is a training peer's, laid out as a run of that many peers lays it out: the bucket count
``buckets.bucket_count_for`` gives, each record in its peer id's bucket, and each bucket's summary. One signer
may own many subkeys (a prefix of its own, then its public key), so one client node writes all the records of a
kind.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Dict, List, Sequence, Tuple

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from ravnest_swarm.membership.buckets import bucket_count_for, bucket_of, summarize
from ravnest_swarm.membership.records import (PeerRecord, StageEndpoint, peers_key, stage_subkey_prefix, summary_key,
                                              summary_subkey_prefix)
from ravnest_swarm.net.node import parse_maddrs, start_node, stop_node, store_record

STAGES = 4  # peers of one cluster: a record's cluster is its index // STAGES
STORES_AT_ONCE = 40


def peer_id_of(cluster: int, stage: int) -> str:
    """The peer id :func:`training_records` gives the peer of ``cluster``'s ``stage``."""
    return f"QmPeer{cluster}x{stage}"


def training_records(peers: int) -> List[Dict]:
    """``peers`` training peers' records, ``STAGES`` to a cluster."""
    return [PeerRecord(peer_id=peer_id_of(index // STAGES, index % STAGES),
                       name=f"w{index // STAGES}-{index % STAGES}", state="training", ram_gb=8.0,
                       bandwidth_mbps=100.0, gflops=500.0, reachability="direct", maddrs=[], version="0.1.0",
                       time=get_dht_time(), cluster=index // STAGES, stage=index % STAGES,
                       layers=[index % STAGES * 4, index % STAGES * 4 + 4], step=5, samples_per_s=10.0).dict()
            for index in range(peers)]


async def store_as_one_signer(maddr: str, items: Sequence[Tuple[str, Dict, bytes]], lifetime: float = 600.0) -> None:
    """Store each ``(key, value, subkey prefix)`` of ``items`` (the signer's public key ends each subkey) through a
    client node of the DHT at ``maddr`` that signs with a key of its own, ``STORES_AT_ONCE`` at a time."""
    signature = RSASignatureValidator(RSAPrivateKey())
    node = await start_node(parse_maddrs([maddr]), record_validators=[signature],
                            host_maddrs=["/ip4/127.0.0.1/tcp/0"], client_mode=True)
    try:
        own, expiration = signature.local_public_key, get_dht_time() + lifetime
        for start in range(0, len(items), STORES_AT_ONCE):
            stored = await asyncio.gather(*(store_record(node, key, value, expiration, subkey=prefix + own)
                                            for key, value, prefix in items[start:start + STORES_AT_ONCE]))
            if not all(stored):
                raise RuntimeError(f"no DHT node took {stored.count(False)} of {len(stored)} records")
    finally:
        await stop_node(node)


async def write_stage_endpoints(maddr: str, clusters: int, key_of: Callable[[int], str]) -> None:
    """The endpoint of every stage of ``clusters`` clusters, each under ``key_of(cluster)``, by one signer."""
    await store_as_one_signer(maddr, [
        (key_of(cluster), StageEndpoint(peer_id=peer_id_of(cluster, stage), maddrs=["/ip4/127.0.0.1/tcp/40000"],
                                        model="mlp-digits", layers=[stage * 4, stage * 4 + 4], version=5,
                                        time=get_dht_time()).dict(), stage_subkey_prefix(cluster, stage))
        for cluster in range(clusters) for stage in range(STAGES)])


async def write_run_records(maddr: str, run: str, peers: int, buckets: int = 0) -> int:
    """Write ``peers`` training records of ``run`` in ``buckets`` buckets (0: as many as a run of that size has)
    and each bucket's summary, by one signer; returns the bucket count."""
    buckets = buckets or bucket_count_for(peers)
    records = training_records(peers)
    by_bucket = {bucket: [] for bucket in range(buckets)}
    for record in records:
        by_bucket[bucket_of(record["peer_id"], buckets)].append(record)
    # one signer owns many subkeys: a prefix of its own (the record's index), then its public key
    await store_as_one_signer(maddr, [(peers_key(run, buckets, bucket_of(record["peer_id"], buckets)), record,
                                       f"{index}.".encode()) for index, record in enumerate(records)])
    await store_as_one_signer(maddr, [(summary_key(run), summarize(buckets, bucket, members, get_dht_time()),
                                       summary_subkey_prefix(buckets, bucket))
                                      for bucket, members in by_bucket.items()])
    return buckets
