"""The records of a large run, written by one signer: what ``status`` and the dashboard read at 1,000 peers and
more, without hosting a p2pd per peer (this machine holds about 200: ``docs/benchmarks.md``).

Every record is a training peer's, laid out as a run of that many peers lays it out: the bucket count
``buckets.bucket_count_for`` gives, each record in its peer id's bucket, and each bucket's summary. One signer
may own many subkeys (a prefix of its own, then its public key), so one client node writes them all.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Dict, List

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from ravnest_swarm.membership.buckets import bucket_count_for, bucket_of, summarize
from ravnest_swarm.membership.records import (PeerRecord, StageEndpoint, peers_key, stage_subkey_prefix, summary_key,
                                              summary_subkey_prefix)
from ravnest_swarm.net.node import parse_maddrs, start_node, stop_node, store_record

STAGES = 4  # peers of one cluster: a record's cluster is its index // STAGES
STORES_AT_ONCE = 40


def training_records(peers: int) -> List[Dict]:
    """``peers`` training peers' records, ``STAGES`` to a cluster."""
    return [PeerRecord(peer_id=peer_id_of(index // STAGES, index % STAGES), name=f"w{index // STAGES}-{index % STAGES}", state="training",
                       ram_gb=8.0, bandwidth_mbps=100.0, gflops=500.0, reachability="direct", maddrs=[],
                       version="0.1.0", time=get_dht_time(), cluster=index // STAGES, stage=index % STAGES,
                       layers=[index % STAGES * 4, index % STAGES * 4 + 4], step=5, samples_per_s=10.0).dict()
            for index in range(peers)]


def peer_id_of(cluster: int, stage: int) -> str:
    """The peer id :func:`training_records` gives the peer of ``cluster``'s ``stage``."""
    return f"QmPeer{cluster}x{stage}"


async def write_stage_endpoints(maddr: str, clusters: int, key_of: Callable[[int], str], lifetime: float = 600.0):
    """The endpoint of every stage of ``clusters`` clusters, each under ``key_of(cluster)``, by one signer."""
    signature = RSASignatureValidator(RSAPrivateKey())
    node = await start_node(parse_maddrs([maddr]), record_validators=[signature],
                            host_maddrs=["/ip4/127.0.0.1/tcp/0"], client_mode=True)
    try:
        own, expiration = signature.local_public_key, get_dht_time() + lifetime
        slots = [(cluster, stage) for cluster in range(clusters) for stage in range(STAGES)]
        for start in range(0, len(slots), STORES_AT_ONCE):
            stored = await asyncio.gather(*(
                store_record(node, key_of(cluster), StageEndpoint(
                    peer_id=peer_id_of(cluster, stage), maddrs=[f"/ip4/127.0.0.1/tcp/{40000 + stage}"],
                    model="mlp-digits", layers=[stage * 4, stage * 4 + 4], version=5, time=get_dht_time()).dict(),
                    expiration, subkey=stage_subkey_prefix(cluster, stage) + own)
                for cluster, stage in slots[start:start + STORES_AT_ONCE]))
            if not all(stored):
                raise RuntimeError(f"no DHT node took {stored.count(False)} stage endpoints")
    finally:
        await stop_node(node)


async def write_run_records(maddr: str, run: str, peers: int, buckets: int = 0, lifetime: float = 600.0) -> int:
    """Write ``peers`` training records of ``run`` in ``buckets`` buckets (0: as many as a run of that size has)
    and each bucket's summary, through a client node of the DHT at ``maddr``; returns the bucket count."""
    buckets = buckets or bucket_count_for(peers)
    signature = RSASignatureValidator(RSAPrivateKey())
    node = await start_node(parse_maddrs([maddr]), record_validators=[signature],
                            host_maddrs=["/ip4/127.0.0.1/tcp/0"], client_mode=True)
    try:
        own, expiration = signature.local_public_key, get_dht_time() + lifetime
        records = training_records(peers)
        for start in range(0, len(records), STORES_AT_ONCE):
            stored = await asyncio.gather(*(
                store_record(node, peers_key(run, buckets, bucket_of(record["peer_id"], buckets)), record,
                             expiration, subkey=f"{start + index}.".encode() + own)
                for index, record in enumerate(records[start:start + STORES_AT_ONCE])))
            if not all(stored):
                raise RuntimeError(f"no DHT node took {stored.count(False)} of the records of {run}")
        for bucket in range(buckets):
            members = [record for record in records if bucket_of(record["peer_id"], buckets) == bucket]
            if not await store_record(node, summary_key(run), summarize(buckets, bucket, members, get_dht_time()),
                                      expiration, subkey=summary_subkey_prefix(buckets, bucket) + own):
                raise RuntimeError(f"no DHT node took the summary of bucket {bucket} of {run}")
    finally:
        await stop_node(node)
    return buckets
