"""Where peer records live: buckets by a hash of the peer id, as many as the swarm's size needs; and the summary.

One key for every peer of a run would, at 10,000 peers, be a multi-megabyte value that every reader fetches from
the same few DHT nodes. So a run's peer records spread over ``B`` keys (a power of two, about
:data:`PEERS_PER_BUCKET` peers in each): ``{run}_peers`` while ``B = 1`` (a small run: one key, as before), else
``{run}_peers_{B}_{b}`` with ``b = hash(peer id) mod B``. Because ``B`` is a power of two, a bucket of ``2B``
splits one of ``B`` in two, and a reader that knows a peer's id knows which key holds its record: a trainer reads
only its neighbours' buckets.

Each peer chooses ``B`` from what it sees (:func:`next_bucket_count`): its own bucket's size times ``B`` estimates
the swarm; a joiner starts from the run's summary. While it moves from one ``B`` to another it writes to both, for
one record lifetime, so a reader still at the old ``B`` does not lose it.

The summary (``{run}_summary``): the peer with the smallest id in each bucket writes the bucket's counts (peers by
state and cluster, throughput). Anyone can write a summary for any bucket, so a summary says only where to look
(:func:`counts_named`); its counts are added up (:func:`add_up`) only once its writer's own record was found in the
bucket it summarizes (:func:`confirmed`): a dashboard of a large run, which reads part of the run's records, counts
the rest so. ``status`` reads every record and counts those (:func:`totals`). Pure: no network
(``membership/reader.py`` does the reading).
"""

from __future__ import annotations

import hashlib
from collections import Counter
import time
from typing import Dict, Iterable, List, Optional, Tuple

from ravnest_swarm.membership.view import MAX_CLOCK_LEAD_S

PEERS_PER_BUCKET = 64
MAX_BUCKETS = 256  # 16,384 peers at PEERS_PER_BUCKET; a bucket holds more beyond that, the values grow
BUCKET_COUNTS = tuple(2 ** level for level in range(MAX_BUCKETS.bit_length()))  # 1, 2, 4, ..., 256
# a bucket splits when it holds more than PEERS_PER_BUCKET and merges back when it and its sibling together hold
# fewer than a quarter of that: the gap keeps a swarm near a boundary from moving to and fro
MERGE_BELOW = PEERS_PER_BUCKET // 4
MAX_SUMMARY_CLUSTERS = 64  # a bucket's summary names at most this many clusters (a bucket holds about 64 peers)


def bucket_of(peer_id: str, buckets: int) -> int:
    """The bucket that holds ``peer_id``'s record when the run has ``buckets`` of them."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:8], "big") % buckets


def bucket_field(buckets: int, bucket: int) -> str:
    """The field of ``RunRecords`` (the DHT key without the run's prefix) of one bucket."""
    return "peers" if buckets == 1 else f"peers_{buckets}_{bucket}"


def bucket_fields() -> List[str]:
    """Every bucket field of every bucket count (the schema names them all)."""
    return [bucket_field(buckets, bucket) for buckets in BUCKET_COUNTS for bucket in range(buckets)]


def bucket_count_for(peers: int) -> int:
    """The bucket count for a swarm of ``peers``: the smallest power of two that keeps a bucket at about
    :data:`PEERS_PER_BUCKET` peers, at most :data:`MAX_BUCKETS`."""
    for buckets in BUCKET_COUNTS:
        if peers <= buckets * PEERS_PER_BUCKET:
            return buckets
    return MAX_BUCKETS


def next_bucket_count(buckets: int, own_bucket_peers: int, fresh_peers: Optional[int] = None) -> int:
    """The bucket count a peer moves to, given how many live peers its own bucket holds at ``buckets``.

    :param fresh_peers: how many of them renewed their record lately (by default all): a split counts only those.
        Peers killed a moment ago stay in views until their records expire, while their replacements are in at
        once; counted together, churn took a bucket of 60 past 64 and split it for no growth at all.
    """
    if (own_bucket_peers if fresh_peers is None else fresh_peers) > PEERS_PER_BUCKET and buckets < MAX_BUCKETS:
        return buckets * 2
    # own bucket below a quarter of its share: the swarm shrank (its sibling is about the same size)
    if buckets > 1 and 2 * own_bucket_peers < MERGE_BELOW:
        return buckets // 2
    return buckets


def summarize(buckets: int, bucket: int, records: Iterable[Dict], now: float, writer: str) -> Dict:
    """A bucket's summary (``records.BucketSummary``) by the peer ``writer``, from its members' records (``leaving``
    ones excluded). Its samples/s is the sum of its first stages' (:func:`run_samples_per_s`)."""
    members = [r for r in records if r["state"] != "leaving"]
    clusters = Counter(str(r["cluster"]) for r in members if r.get("cluster") is not None and r["cluster"] >= 0)
    return dict(peer_id=writer, buckets=buckets, bucket=bucket, peers=len(members),
                states=dict(Counter(r["state"] for r in members)),
                clusters=dict(clusters.most_common(MAX_SUMMARY_CLUSTERS)),
                samples_per_s=run_samples_per_s(members), time=now)


def run_samples_per_s(records: Iterable[Dict]) -> float:
    """The samples a second that ``records`` train, counted once per cluster: every stage of a pipeline reports its
    pipeline's rate (steps times the microbatch), so a sum over every peer was the rate times the stage count; each
    cluster has one first stage, and a sum over those adds up the clusters, bucket by bucket."""
    return float(sum(r.get("samples_per_s") or 0.0 for r in records
                     if r.get("stage") == 0 and r.get("cluster") is not None and r["cluster"] >= 0))


def writes_summary(peer_id: str, bucket_members: Iterable[Dict]) -> bool:
    """Whether ``peer_id`` writes its bucket's summary: the smallest id of the bucket's live members does."""
    ids = [r["peer_id"] for r in bucket_members if r["state"] != "leaving"]
    return bool(ids) and peer_id == min(ids)


def counts_named(summaries: Iterable[Dict]) -> List[int]:
    """The bucket counts ``summaries`` name (1 always): where a reader looks for a run's records. A stranger's
    summary can add a count, which costs a read of its buckets, never hide the others; only counts the run's keys
    have (the records' schema refuses others, this is the reader's own check)."""
    return sorted({1} | {summary["buckets"] for summary in summaries if summary["buckets"] in BUCKET_COUNTS})


def confirmed(summaries: Iterable[Dict], records: Iterable[Dict]) -> List[Dict]:
    """The summaries whose writer has a live record (one of ``records``, not ``leaving``) in the bucket it summarizes;
    the rest, anyone's, count nothing."""
    members = {r["peer_id"] for r in records if r["state"] != "leaving"}
    return [summary for summary in summaries if summary["peer_id"] in members
            and bucket_of(summary["peer_id"], summary["buckets"]) == summary["bucket"]]


def totals(records: Iterable[Dict], buckets: int, now: float) -> Dict:
    """:func:`add_up`'s totals counted from ``records`` themselves (``leaving`` ones excluded, every cluster named),
    every bucket of a run of ``buckets`` read."""
    members = [r for r in records if r["state"] != "leaving"]
    clusters = Counter(str(r["cluster"]) for r in members if r.get("cluster") is not None and r["cluster"] >= 0)
    return dict(buckets=buckets, buckets_summarized=buckets, peers=len(members),
                states=dict(Counter(r["state"] for r in members)), clusters=len(clusters),
                peers_by_cluster=dict(clusters), samples_per_s=run_samples_per_s(members), time=now)


def add_up(summaries: Iterable[Dict], now: Optional[float] = None) -> Optional[Dict]:
    """The run's totals from its buckets' summaries, or None without any.

    Summaries of several bucket counts coexist while a swarm moves between them; the count whose buckets are all
    summarized wins (the largest such), else the one that covers the most of its buckets. Per bucket, the newest,
    of those not dated more than MAX_CLOCK_LEAD_S past ``now`` (DHT time, the clock's): a stranger's summary of its
    own bucket dated 1e11 would have stayed the newest for good (a hostile review), as for peer records (``view.py``).
    """
    now = time.time() if now is None else now
    newest: Dict[Tuple[int, int], Dict] = {}
    for summary in summaries:
        if summary["time"] > now + MAX_CLOCK_LEAD_S:
            continue
        slot = (summary["buckets"], summary["bucket"])
        if slot not in newest or summary["time"] > newest[slot]["time"]:
            newest[slot] = summary
    if not newest:
        return None
    found = Counter(buckets for buckets, _ in newest)
    buckets = max(found, key=lambda count: (found[count] / count, count))
    chosen = [summary for (count, _), summary in newest.items() if count == buckets]
    states, clusters = Counter(), Counter()
    for summary in chosen:
        states.update(summary["states"])
        clusters.update(summary["clusters"])
    return dict(buckets=buckets, buckets_summarized=len(chosen), peers=sum(s["peers"] for s in chosen),
                states=dict(states), clusters=len(clusters), peers_by_cluster=dict(clusters),
                samples_per_s=sum(s["samples_per_s"] for s in chosen), time=min(s["time"] for s in chosen))
