"""The records of a large run, written through one client node: what ``status`` and the dashboard read at 1,000
peers and more, without hosting a p2pd per peer (this machine holds about 200: ``docs/benchmarks.md``).

Every record is a training peer's, laid out as a run of that many peers lays it out: the bucket count
``buckets.bucket_count_for`` gives, each record in its peer id's bucket, and each bucket's summary. A record that
names a peer counts only when signed by that peer's identity (``membership/identity.py``), so each made-up peer
has a key of its own (:func:`peer_key`), its peer id that key's, and the client node signs each record with the
key its subkey names (:class:`ManyPeersSigner`). Their keys are 1,024-bit, a fifth of the time of 2,048 to make
(50 ms each here): they never start a p2pd, and the records they sign are as valid.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from ravnest_swarm.membership.buckets import bucket_count_for, bucket_of, summarize
from ravnest_swarm.membership.records import (PeerRecord, StageEndpoint, peers_key, stage_subkey_prefix, summary_key,
                                              summary_subkey_prefix)
from ravnest_swarm.net.identity import peer_id_of_owner
from ravnest_swarm.net.node import parse_maddrs, start_node, stop_node, store_record

STAGES = 4  # peers of one cluster: a record's cluster is its index // STAGES
STORES_AT_ONCE = 40


_peer_keys: List[RSAPrivateKey] = []  # made once per process: tests and benches write the same peers several times


def peer_key(index: int) -> RSAPrivateKey:
    """The identity of the ``index``-th made-up peer."""
    while len(_peer_keys) <= index:
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        key._private_key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
        _peer_keys.append(key)
    return _peer_keys[index]


def peer_id_of(cluster: int, stage: int) -> str:
    """The peer id :func:`training_records` gives the peer of ``cluster``'s ``stage``: its key's."""
    return peer_id_of_owner(peer_key(cluster * STAGES + stage).get_public_key().to_bytes())


class ManyPeersSigner(RSASignatureValidator):
    """hivemind's signature validator with many keys: it signs a record with the key whose public half its subkey
    embeds (``[owner:...]``), as each of those peers would itself."""

    def __init__(self, keys: Sequence[RSAPrivateKey]):
        super().__init__(keys[0])
        self._signers = {RSASignatureValidator(key).local_public_key: RSASignatureValidator(key) for key in keys}

    def sign_value(self, record: DHTRecord) -> bytes:
        owners = self._PUBLIC_KEY_RE.findall(record.subkey)
        marker = self.PUBLIC_KEY_FORMAT.replace(b"_key_", owners[0]) if len(owners) == 1 else None
        return self._signers[marker].sign_value(record) if marker in self._signers else record.value


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
    client node of the DHT at ``maddr`` that signs with a key of its own, ``STORES_AT_ONCE`` at a time: records that
    name no peer, or a stranger's."""
    await store_as_signers(maddr, [(key, value, prefix, None) for key, value, prefix in items], lifetime)


async def store_as_signers(maddr: str, items: Sequence[Tuple[str, Dict, bytes, Optional[RSAPrivateKey]]],
                           lifetime: float = 600.0) -> None:
    """Store each ``(key, value, subkey prefix, signer)`` of ``items`` through a client node of the DHT at ``maddr``,
    signed by its signer (None: the node's own key), ``STORES_AT_ONCE`` at a time."""
    own = RSAPrivateKey()
    signature = ManyPeersSigner([own] + list({id(k): k for _, _, _, k in items if k is not None}.values()))
    node = await start_node(parse_maddrs([maddr]), record_validators=[signature],
                            host_maddrs=["/ip4/127.0.0.1/tcp/0"], client_mode=True)
    try:
        expiration = get_dht_time() + lifetime
        for start in range(0, len(items), STORES_AT_ONCE):
            stored = await asyncio.gather(*(
                store_record(node, key, value, expiration,
                             subkey=prefix + RSASignatureValidator(signer or own).local_public_key)
                for key, value, prefix, signer in items[start:start + STORES_AT_ONCE]))
            if not all(stored):
                raise RuntimeError(f"no DHT node took {stored.count(False)} of {len(stored)} records")
    finally:
        await stop_node(node)


async def write_stage_endpoints(maddr: str, clusters: int, key_of: Callable[[int], str]) -> None:
    """The endpoint of every stage of ``clusters`` clusters, each under ``key_of(cluster)``, each by its peer."""
    await store_as_signers(maddr, [
        (key_of(cluster), StageEndpoint(peer_id=peer_id_of(cluster, stage), maddrs=["/ip4/127.0.0.1/tcp/40000"],
                                        model="mlp-digits", layers=[stage * 4, stage * 4 + 4], version=5,
                                        time=get_dht_time()).dict(), stage_subkey_prefix(cluster, stage),
         peer_key(cluster * STAGES + stage))
        for cluster in range(clusters) for stage in range(STAGES)])


async def write_run_records(maddr: str, run: str, peers: int, buckets: int = 0) -> int:
    """Write ``peers`` training records of ``run`` in ``buckets`` buckets (0: as many as a run of that size has)
    and each bucket's summary, each by its peer (the summary by its bucket's smallest peer id, as in a run);
    returns the bucket count."""
    buckets = buckets or bucket_count_for(peers)
    records = training_records(peers)
    by_bucket = {bucket: [] for bucket in range(buckets)}
    for record in records:
        by_bucket[bucket_of(record["peer_id"], buckets)].append(record)
    key_of = {record["peer_id"]: peer_key(index) for index, record in enumerate(records)}
    await store_as_signers(maddr, [(peers_key(run, buckets, bucket_of(record["peer_id"], buckets)), record, b"",
                                    key_of[record["peer_id"]]) for record in records])
    writers = {bucket: min(r["peer_id"] for r in members) for bucket, members in by_bucket.items() if members}
    await store_as_signers(maddr, [(summary_key(run), summarize(buckets, bucket, members, get_dht_time(), writer),
                                    summary_subkey_prefix(buckets, bucket), key_of[writer])
                                   for bucket, members in by_bucket.items() for writer in [writers.get(bucket)]
                                   if writer is not None])
    return buckets
