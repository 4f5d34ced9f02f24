"""A stranger's bucket summaries steer no peer of the run: anyone can write a summary for any bucket, and a reader
that took the bucket count from the summaries alone read where the stranger said. Real DHT nodes on 127.0.0.1."""

import asyncio

import pytest
from hivemind.utils.timed_storage import get_dht_time

from ravnest_swarm.bench.light import CAPABILITIES
from ravnest_swarm.bench.records import peer_id_of, store_as_one_signer, write_run_records
from ravnest_swarm.membership.announcer import PeerAnnouncer
from ravnest_swarm.membership.buckets import summarize
from ravnest_swarm.membership.reader import read_peers, read_summary
from ravnest_swarm.membership.records import make_validators, summary_key, summary_subkey_prefix
from ravnest_swarm.net.node import parse_maddrs, start_node, stop_node

RUN = "forged-summaries"
PEERS = 80  # two buckets of records
FORGED_BUCKETS = 256


def forged_summaries():
    """Every bucket of 256 "summarized", 40 training peers each: a run of 10,240 peers that does not exist."""
    now = get_dht_time()
    return [(summary_key(RUN), dict(summarize(FORGED_BUCKETS, bucket, [], now), peers=40, states={"training": 40}),
             summary_subkey_prefix(FORGED_BUCKETS, bucket)) for bucket in range(FORGED_BUCKETS)]


async def scenario(maddr: str):
    assert await write_run_records(maddr, RUN, PEERS) == 2  # the run's own records and summaries
    run_ids = {peer_id_of(cluster, stage) for cluster in range(PEERS // 4) for stage in range(4)}
    nodes = [await start_node(parse_maddrs([maddr]), record_validators=make_validators(RUN),
                              host_maddrs=["/ip4/127.0.0.1/tcp/0"]) for _ in range(2)]
    try:
        member = PeerAnnouncer(nodes[0], RUN, "member", CAPABILITIES, heartbeat=5.0)
        await member.find_bucket_count()  # a peer of the run before the forgery: 2 buckets, as the run
        assert member.buckets == 2

        await store_as_one_signer(maddr, forged_summaries())
        assert (await read_summary(nodes[1], RUN))["buckets"] == FORGED_BUCKETS  # the forgery wins add_up's tie
        # a reader that takes the bucket count from the summaries reads 256 empty buckets and none of the run's
        assert {p["peer_id"] for p in await read_peers(nodes[1], RUN)} & run_ids == set()

        # a peer of the run reads at its own bucket count and the counts in use: all of the run
        await member.refresh_view()
        assert member.bucket_counts_in_use() == [2, FORGED_BUCKETS]
        assert {p["peer_id"] for p in await member.read_peers()} >= run_ids
        assert {p["peer_id"] for p in await member.read_peers(alive_at=get_dht_time() + 1)} >= run_ids

        # a joiner starts at the forged count, but its heartbeat does not follow the claimed 10,240 peers (it was
        # 100 s); its first read of its own bucket finds the run at the counts in use
        joiner = PeerAnnouncer(nodes[1], RUN, "joiner", CAPABILITIES, heartbeat=5.0)
        await joiner.find_bucket_count()
        assert joiner.buckets == FORGED_BUCKETS and joiner.heartbeat == 5.0
        await joiner.refresh_view()
        assert joiner.heartbeat == 5.0
        assert {p["peer_id"] for p in await joiner.read_peers()} >= run_ids
    finally:
        for node in nodes:
            await stop_node(node)


@pytest.mark.timeout(180)
def test_forged_summaries_hide_no_peer_from_the_runs_peers_and_slow_no_joiner(processes):
    maddr = processes.start(["backbone", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], "backbone").maddrs()[0]
    asyncio.run(scenario(maddr))
