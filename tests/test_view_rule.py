"""The view rule (``membership/view.py``) and bucket choice (``membership/buckets.py``), exactly, without a network;
``test_membership.py`` shows the same rule with real processes."""

from ravnest_swarm.membership.buckets import (
    MAX_BUCKETS, PEERS_PER_BUCKET, add_up, bucket_count_for, bucket_field, bucket_of, confirmed, counts_named,
    next_bucket_count, summarize, totals, writes_summary)
from ravnest_swarm.membership.view import LIFETIME_HEARTBEATS, MAX_RECORD_LIFETIME_S, PeerView, timing_for


def record(peer_id, time, state="training", name=None):
    return dict(peer_id=peer_id, name=name or peer_id, state=state, time=time)


def test_a_peer_stays_until_its_record_expires_though_reads_miss_it():
    view = PeerView()
    view.merge([("key-a", record("a", time=100.0), 115.0), ("key-b", record("b", time=100.0), 115.0)])
    view.merge([("key-a", record("a", time=105.0), 120.0)])  # a read that missed b's record
    assert [r["peer_id"] for r in view.members(now=110.0)] == ["a", "b"]
    assert [r["peer_id"] for r in view.members(now=116.0)] == ["a"]  # b's record expired: b is gone
    assert view.members(now=120.0) == []


def test_a_renewal_that_comes_late_removes_nobody_and_an_older_copy_never_wins():
    timing = timing_for(10, base_heartbeat=5.0)
    assert timing.lifetime == LIFETIME_HEARTBEATS * timing.heartbeat == 15.0
    view = PeerView()
    view.merge([("key-a", record("a", time=0.0), 0.0 + timing.lifetime)])
    # the renewal due at 5 s was lost and the one due at 10 s came 3 s late: a is in every view in between
    for now in (4.0, 9.0, 12.0):
        assert [r["peer_id"] for r in view.members(now)] == ["a"]
    view.merge([("key-a", record("a", time=13.0), 13.0 + timing.lifetime)])
    view.merge([("key-a", record("a", time=0.0), 15.0)])  # a slow DHT node's old copy
    [shown] = view.records(now=14.0)
    assert shown["time"] == 13.0 and shown["expires_in"] == 14.0


def test_leaving_removes_a_peer_at_once_and_an_older_copy_cannot_bring_it_back():
    view = PeerView()
    view.merge([("key-a", record("a", time=10.0), 25.0)])
    view.merge([("key-a", record("a", time=12.0, state="leaving"), 27.5)])
    assert view.members(now=13.0) == []
    assert [r["state"] for r in view.records(now=13.0)] == ["leaving"]  # shown as leaving until it expires
    view.merge([("key-a", record("a", time=10.0), 25.0)])  # the training record, from a node that missed the leave
    assert view.members(now=14.0) == []


def test_a_peer_that_comes_back_with_the_same_identity_is_back_once_and_shown_by_its_newest_record():
    view = PeerView()
    view.merge([("key-a", record("a", time=10.0, state="leaving"), 25.0)])
    # restarted with the same identity (peer id): a new process, so a new record key
    view.merge([("key-a2", record("a", time=20.0, state="joining"), 35.0)])
    [shown] = view.members(now=21.0)
    assert shown["state"] == "joining" and shown["time"] == 20.0
    # and after a crash (no leaving): the old record counts until it expires, shown once, by the newest record
    view.merge([("key-a3", record("a", time=30.0, state="standby"), 45.0)])
    assert [r["state"] for r in view.records(now=31.0)] == ["standby"]


def test_a_strangers_leaving_record_naming_an_honest_peer_does_not_remove_it():
    view = PeerView()
    view.merge([("key-a", record("a", time=10.0), 25.0)])
    view.merge([("stranger", record("a", time=11.0, state="leaving"), 26.0)])
    assert [r["peer_id"] for r in view.members(now=12.0)] == ["a"]


def test_alive_at_keeps_only_records_valid_at_that_time():
    view = PeerView()
    view.merge([("key-a", record("a", time=0.0), 10.0), ("key-b", record("b", time=0.0), 30.0)])
    assert [r["peer_id"] for r in view.records(now=5.0, alive_at=20.0)] == ["b"]


def test_the_heartbeat_slows_beyond_five_hundred_peers_so_each_nodes_load_stays_bounded():
    assert timing_for(100, 5.0).heartbeat == timing_for(500, 5.0).heartbeat == 5.0
    assert timing_for(1_000, 5.0).heartbeat == 10.0
    assert timing_for(10_000, 5.0).heartbeat == 100.0


def test_buckets_split_a_full_bucket_in_two_and_merge_back_with_a_gap():
    assert [bucket_count_for(n) for n in (1, 64, 65, 100, 1_000, 10_000, 10**6)] == [1, 1, 2, 2, 16, 256, MAX_BUCKETS]
    assert bucket_field(1, 0) == "peers" and bucket_field(4, 3) == "peers_4_3"
    # 2B buckets split each of B in two: a record's bucket at 2B is its bucket at B, or that plus B
    for peer_id in ("12D3KooWA", "12D3KooWB", "x"):
        assert bucket_of(peer_id, 8) % 4 == bucket_of(peer_id, 4)
    assert next_bucket_count(1, PEERS_PER_BUCKET + 1) == 2
    assert next_bucket_count(2, PEERS_PER_BUCKET) == 2  # full, not over
    assert next_bucket_count(2, 10) == 2  # a quarter of a bucket, with its sibling: stays
    assert next_bucket_count(2, 7) == 1
    assert next_bucket_count(MAX_BUCKETS, 10_000) == MAX_BUCKETS
    # a split counts the peers renewed lately only: the killed ones whose records live on are not counted
    assert next_bucket_count(2, PEERS_PER_BUCKET + 6, fresh_peers=PEERS_PER_BUCKET) == 2
    assert next_bucket_count(2, PEERS_PER_BUCKET + 6, fresh_peers=PEERS_PER_BUCKET + 1) == 4


def test_a_buckets_smallest_peer_writes_its_summary_and_the_run_adds_them_up():
    # two pipelines: p0, p2, p4 are cluster 0's stages 0-2, p1 and p3 cluster 1's stages 0-1; each at 2 samples/s
    members = [dict(record(f"p{i}", 1.0), cluster=i % 2, stage=i // 2, samples_per_s=2.0) for i in range(5)]
    members.append(record("p9", 1.0, state="leaving"))
    assert writes_summary("p0", members) and not writes_summary("p1", members)
    first = summarize(2, 0, members, now=50.0, writer="p0")
    assert first["peer_id"] == "p0"
    assert first["peers"] == 5 and first["states"] == {"training": 5} and first["clusters"] == {"0": 3, "1": 2}
    assert first["samples_per_s"] == 4.0  # each pipeline counted once (its first stage), not once per stage
    second = summarize(2, 1, [dict(record("q", 1.0), cluster=1, stage=0, samples_per_s=1.0)], now=51.0, writer="q")
    older = dict(second, peers=0, time=40.0)
    stale_level = summarize(1, 0, members[:2], now=30.0, writer="p0")  # from before the swarm split in two buckets
    totals = add_up([first, older, second, stale_level])
    assert totals["buckets"] == 2 and totals["peers"] == 6 and totals["clusters"] == 2
    assert totals["peers_by_cluster"] == {"0": 3, "1": 3} and totals["samples_per_s"] == 5.0
    assert add_up([]) is None
    # a summary dated far ahead (1e11: a stranger's of its own bucket) would stay the newest for good: not read
    ahead = dict(second, peers=1000, time=1e11)
    assert add_up([first, second, ahead], now=60.0)["peers"] == 6


def test_a_summary_counts_only_where_its_writers_own_record_is_in_the_bucket_it_summarizes():
    """Anyone can write a summary: one counts (``confirmed``) only when its writer is a live member of the bucket
    it names; every count named is still read (``counts_named``), and ``status``'s totals come from the records."""
    writer = next(f"p{i}" for i in range(100) if bucket_of(f"p{i}", 2) == 0)
    elsewhere = next(f"p{i}" for i in range(100) if bucket_of(f"p{i}", 2) == 1)
    members = [dict(record(writer, 1.0), cluster=0, stage=0, samples_per_s=3.0), record(elsewhere, 1.0)]
    own = summarize(2, 0, members[:1], now=50.0, writer=writer)
    forged = [dict(summarize(256, bucket, [], now=60.0, writer="stranger"), peers=40) for bucket in range(256)]
    misplaced = summarize(2, 0, members, now=50.0, writer=elsewhere)  # a member, but of the other bucket
    gone = summarize(2, 0, members, now=50.0, writer=writer)
    assert confirmed([own, misplaced, *forged], members) == [own]
    assert confirmed([gone], [record(writer, 1.0, state="leaving")]) == []
    assert counts_named(forged) == [1, 256] and counts_named([]) == [1]
    counted = totals(members, 2, now=70.0)
    assert counted["peers"] == 2 and counted["buckets"] == counted["buckets_summarized"] == 2
    assert counted["samples_per_s"] == 3.0 and counted["states"] == {"training": 2}


def test_a_record_counts_six_hours_after_its_time_at_most_and_never_while_dated_ahead():
    """A peer's record stored to expire in a year kept it in every view and plan after it had gone; one dated far
    ahead would have outlived any cap that counts from its time (a review)."""
    view = PeerView()
    view.merge([("key-a", record("a", time=100.0), 100.0 + 365 * 86400), ("key-b", record("b", time=1e9), 2e9)])
    assert [r["peer_id"] for r in view.members(now=120.0)] == ["a"]  # b: dated ahead of the reader's clock
    assert timing_for(2000, 600.0).lifetime < MAX_RECORD_LIFETIME_S  # an honest renewal is never cut
    assert [r["peer_id"] for r in view.members(now=100.0 + MAX_RECORD_LIFETIME_S - 1)] == ["a"]
    assert view.members(now=100.0 + MAX_RECORD_LIFETIME_S + 1) == []
