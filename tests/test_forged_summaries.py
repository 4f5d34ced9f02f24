"""A stranger's bucket summaries steer no peer of the run, and blind no observer: anyone can write a summary for any
bucket, and a reader that took the bucket count from the summaries alone read where the stranger said, while
``status`` showed the stranger's counts. Real DHT nodes on 127.0.0.1, and ``status`` as a process."""

import asyncio
import json

import pytest
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from commands import ravnest
from ravnest_swarm.bench.light import CAPABILITIES
from ravnest_swarm.bench.records import peer_id_of, store_as_signers, write_run_records
from ravnest_swarm.membership.announcer import PeerAnnouncer
from ravnest_swarm.membership.buckets import summarize
from ravnest_swarm.membership.reader import read_peers, read_summary
from ravnest_swarm.membership.records import make_validators, summary_key, summary_subkey_prefix
from ravnest_swarm.net.identity import peer_id_of_owner
from ravnest_swarm.net.node import parse_maddrs, start_node, stop_node

RUN = "forged-summaries"
PEERS = 80  # two buckets of records
FORGED_BUCKETS = 256
STRANGER = RSAPrivateKey()  # a key of its own: its summaries name its own peer id, so every node stores them


def forged_summaries():
    """Every bucket of 256 "summarized", 40 training peers each, by the stranger: a run of 10,240 peers that does
    not exist."""
    now, stranger = get_dht_time(), peer_id_of_owner(STRANGER.get_public_key().to_bytes())
    return [(summary_key(RUN), dict(summarize(FORGED_BUCKETS, bucket, [], now, stranger), peers=40,
                                    states={"training": 40}), summary_subkey_prefix(FORGED_BUCKETS, bucket), STRANGER)
            for bucket in range(FORGED_BUCKETS)]


def status(maddr: str) -> dict:
    result = ravnest("status", "--initial-peers", maddr, "--run", RUN, "--json", timeout=90)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def shown(document: dict):
    """What ``status`` shows of the run: every peer and its state, and the totals."""
    totals = {name: document["summary"][name] for name in ("peers", "states", "clusters", "samples_per_s")}
    return sorted((p["peer_id"], p["state"]) for p in document["peers"]), totals


async def scenario(maddr: str):
    assert await write_run_records(maddr, RUN, PEERS) == 2  # the run's own records and summaries
    run_ids = {peer_id_of(cluster, stage) for cluster in range(PEERS // 4) for stage in range(4)}
    before = await asyncio.to_thread(status, maddr)
    assert {peer_id for peer_id, _ in shown(before)[0]} == run_ids and shown(before)[1]["peers"] == PEERS
    nodes = [await start_node(parse_maddrs([maddr]), record_validators=make_validators(RUN),
                              host_maddrs=["/ip4/127.0.0.1/tcp/0"]) for _ in range(2)]
    try:
        member = PeerAnnouncer(nodes[0], RUN, "member", CAPABILITIES, heartbeat=5.0)
        await member.find_bucket_count()  # a peer of the run before the forgery: 2 buckets, as the run
        assert member.buckets == 2

        await store_as_signers(maddr, forged_summaries())
        assert (await read_summary(nodes[1], RUN))["buckets"] == FORGED_BUCKETS  # the forgery wins add_up's tie
        # a reader reads every bucket count a summary names, the run's too (reading the forged count alone, it read
        # 256 empty buckets and none of the run's)
        assert {p["peer_id"] for p in await read_peers(nodes[1], RUN)} >= run_ids

        # status shows what it showed before: the run's records, counted; the forged summaries ignored, and said so
        after = await asyncio.to_thread(status, maddr)
        assert shown(after) == shown(before)
        assert after["summary"]["ignored_summaries"] == FORGED_BUCKETS and before["summary"]["ignored_summaries"] == 0

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
def test_forged_summaries_hide_no_peer_from_the_runs_peers_or_status_and_slow_no_joiner(processes):
    maddr = processes.start(["backbone", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], "backbone").maddrs()[0]
    asyncio.run(scenario(maddr))
