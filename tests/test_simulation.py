"""The membership simulation (``bench/simulation.py``): the real heartbeat and view code of 100 peers on a simulated
DHT under virtual time; no network, no process. docs/benchmarks.md, "Membership at scale: simulation", has its
projections to 10,000 peers."""

import asyncio

import pytest

from ravnest_swarm.bench.simulation import SimulationConfig, Swarm, parse_peer_counts, signature_sizes, simulate
from ravnest_swarm.bench.virtual_time import run_virtual
from ravnest_swarm.errors import UserError


@pytest.fixture(scope="module")
def sizes():
    return signature_sizes()


def test_a_hundred_peers_converge_and_the_load_is_what_the_protocol_sends(sizes):
    # seed 3: the two buckets hold 50 peers each, far from the split at 64 (see the next test for one near it)
    result = simulate(SimulationConfig(peers=100, loss=0.0, seconds=10.0, seed=3), sizes=sizes)
    heartbeat, lifetime = result["heartbeat_s"], result["lifetime_s"]
    assert (heartbeat, lifetime) == (5.0, 15.0)
    assert result["buckets"] == [2]  # 100 peers: two buckets of about 50, each peer reads both
    assert result["initial_converge_s"] is not None and result["initial_converge_s"] <= 2 * heartbeat
    assert result["view_share"] == result["worst_view_share"] == 1.0
    # a killed peer leaves the views when its record expires: within one lifetime of the kill, and a heartbeat
    # for the replacements' first records to be read
    assert result["killed"] == 10
    assert result["churn_converge_s"] is not None and result["churn_converge_s"] <= lifetime + heartbeat
    # every record renewal also goes straight to the backbone: 100 peers / 5 s, and two bucket summaries
    assert 100 / heartbeat <= result["backbone0_stores_s"] <= 1.5 * 100 / heartbeat
    # a peer's node serves the lookups that pass it: a few dozen RPCs per second at most at this size
    assert 0 < result["gets_per_node_s"] <= result["hottest_node_gets_s"] <= 60
    assert 0 < result["stores_per_node_s"] <= result["hottest_node_stores_s"] <= 60
    assert 0 < result["get_latency_median_s"] <= result["get_latency_p95_s"] < 3.0  # no loss: no timeout


def test_churn_beside_a_nearly_full_bucket_keeps_one_swarm(sizes):
    # seed 0: one bucket of 60 peers and one of 40; 10 % churn takes the first past 64 in its members' views while
    # the dead are still there; before peers read every bucket count the summaries name, the half that split read
    # buckets nobody else wrote, and the swarm fell in two
    result = simulate(SimulationConfig(peers=100, loss=0.0, seconds=5.0, seed=0), sizes=sizes)
    # a split counts fresh records only, and only once the bucket has been over for a lifetime: no split
    assert result["buckets"] == [2]
    assert result["view_share"] == result["worst_view_share"] == 1.0
    assert result["churn_converge_s"] is not None


def test_a_read_that_finds_nothing_removes_nobody_from_a_view(sizes):
    """Every DHT node loses the records at once (all restart): until the peers' next renewals are stored, reads
    find few records, and with 20 % of RPCs lost (each a 3 s timeout) renewals come late. A view of the last read
    alone loses about a third of the peers; the view rule keeps each one until the record it holds expires, so
    the views still hold 99 % of them over the heartbeat that follows (the few that drop out are peers whose
    renewal took longer than what their record had left: docs/benchmarks.md)."""
    config = SimulationConfig(peers=100, loss=0.2, heartbeat=20.0)

    async def scenario():
        swarm = Swarm(config, sizes)
        heartbeat = swarm.timing.heartbeat
        for _ in range(config.peers):
            swarm.add_peer()
        swarm.seed_running_swarm()
        for peer in list(swarm.live):
            swarm.loop.call_at(swarm.rng.uniform(0, heartbeat), swarm.start, peer)
        await asyncio.sleep(3 * heartbeat)
        before = swarm.completeness()
        swarm.dht.forget_everything()
        after = []
        for _ in range(10):
            await asyncio.sleep(heartbeat / 10)
            after.append(swarm.completeness())
        for peer in swarm.live:
            peer.task.cancel()
        await asyncio.gather(*(peer.task for peer in swarm.live), return_exceptions=True)
        return before, after

    before, after = run_virtual(scenario())
    assert before == (1.0, 1.0, 1.0)
    assert after[0][:2] == (1.0, 1.0)
    assert min(share for share, _, _ in after) >= 0.98
    assert min(last_read for _, _, last_read in after) < 0.8


def test_peer_counts_are_a_list_or_repeated_and_bad_ones_are_one_line():
    assert parse_peer_counts(["100,1000", "10000"]) == [100, 1000, 10000]
    with pytest.raises(UserError, match="whole numbers from 2"):
        parse_peer_counts(["100,ten"])


def test_a_bucket_that_reads_thin_is_left_only_after_a_lifetime(sizes):
    """A joiner's first reads can come back thin (lost RPCs; a region whose peers write at another count): merging
    at once, 9 of the 100 joiners after churn at 1,000 simulated peers fell from 16 or 32 buckets to 8 and 4. A move
    waits until the bucket has called for it for a record lifetime, as a split does."""
    async def scenario():
        swarm = Swarm(SimulationConfig(peers=1, loss=0.0), sizes)
        announcer = swarm.add_peer().announcer
        announcer.buckets = 16  # a joiner of a run at 16 buckets whose bucket holds nobody else
        await announcer.publish()
        started, counts = swarm.loop.time(), []
        while swarm.loop.time() - started <= announcer.timing.lifetime + announcer.heartbeat:
            await announcer.refresh_view()
            counts.append((swarm.loop.time() - started, announcer.buckets))
            await asyncio.sleep(announcer.heartbeat)
        return counts, announcer.timing.lifetime

    counts, lifetime = run_virtual(scenario())
    assert len(counts) >= 4 and all(buckets == 16 for at, buckets in counts if at < lifetime), counts
    assert counts[-1][1] == 8, counts  # one step down after a lifetime, not one a heartbeat
