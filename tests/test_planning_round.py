"""The distributed planning round with real volunteer processes on a real DHT (backbone + 5 `join`s)."""

import asyncio
import json
import re
import time

import pytest
from hivemind.utils.timed_storage import get_dht_time
from rich.console import Console

from commands import ravnest
from ravnest_swarm.membership.announcer import PeerAnnouncer
from ravnest_swarm.membership.capabilities import Capabilities
from ravnest_swarm.membership.reader import (adopted_plan, followed_by_its_peers, plan_digest, read_adopted_plan,
                                            read_plans)
from ravnest_swarm.membership.records import PlanRecord, make_validators, signing_validator, start_peer_node
from ravnest_swarm.net.node import start_node, stop_node
from ravnest_swarm.planning.cost import MoveCost, Peer, Workload
from ravnest_swarm.planning.moves import candidate_plans, improvement, kept_cluster_numbers, price_plan
from ravnest_swarm.planning.plan import plan_swarm
from ravnest_swarm.membership.reader import read_proposals
from ravnest_swarm.planning.round import (GONE_POLLS, HANDOVER_WAIT_S, MAX_CLOCK_AHEAD_S, deadline_in_reach,
                                         PlanningRounds, RoundOptions, RoundTriggers, _fresh, canonical,
                                         decided_by_most, followed_deadline, plan_shape_problem, standby_reason)

pytestmark = pytest.mark.timeout(150)

# M=10 GB, F=20 GFLOP, A=4 MB: links cap any multi-peer cluster at 9.4-12.5 samples/s, so two clusters
# {v4,v3} + {v0,v1,v2} (7.5 each, 15 in all) beat one (9.4); without v4 the best is one cluster of four (9)
CAPABILITIES = {"v0": (6, 50, 400), "v1": (6, 40, 400), "v2": (5, 60, 300), "v3": (5, 30, 400), "v4": (12, 120, 400)}
WORKLOAD = Workload(10.0, 20.0, 4.0, 8)
ADOPTED = r"adopted plan round (\d+) fitness (\S+) hash (\S+) clusters (\d+) members (\S+)"


def start_volunteers(processes, backbone, run):
    volunteers = {}
    for name, (ram, gflops, bandwidth) in CAPABILITIES.items():
        volunteers[name] = processes.start([
            "join", "--initial-peers", backbone, "--run", run, "--name", name, "--ram-gb", str(ram),
            "--gflops", str(gflops), "--bandwidth-mbps", str(bandwidth), "--heartbeat", "2", "--no-dashboard",
            "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--model-gb", "10", "--gflop-per-sample", "20",
            "--activation-mb", "4", "--min-peers", "5", "--round-seconds", "12",
        ], name)
    return volunteers


def adopted(process):
    match = process.wait_for_output(ADOPTED, 90, stream="stderr")
    return match.groups()


def offline_optimum(names):
    peers = [Peer(n, *map(float, CAPABILITIES[n])) for n in names]
    return plan_swarm(peers, WORKLOAD, seed=0, time_limit=None)


def test_five_peers_adopt_the_identical_plan(processes, backbone):
    volunteers = start_volunteers(processes, backbone, "round5")
    results = {name: adopted(process) for name, process in volunteers.items()}
    assert len(set(results.values())) == 1, results
    round_number, fitness, _, clusters, members = results["v0"]
    assert round_number == "1" and clusters == "2"
    assert sorted(members.split(",")) == sorted(CAPABILITIES)
    assert float(fitness) == pytest.approx(offline_optimum(CAPABILITIES).swarm_throughput, rel=1e-9)
    assert float(fitness) == pytest.approx(15.0, rel=1e-9)

    # each volunteer wrote its placement into its own peer record
    deadline = time.monotonic() + 30
    while True:
        out = ravnest("status", "--initial-peers", backbone, "--run", "round5", "--json", timeout=60)
        assert out.returncode == 0, out.stderr
        records = {p["name"]: p for p in json.loads(out.stdout.strip().splitlines()[-1])["peers"]}
        if all(records.get(n, {}).get("layers") for n in CAPABILITIES) or time.monotonic() > deadline:
            break
        time.sleep(1)
    placements = sorted((r["cluster"], r["stage"], tuple(r["layers"])) for r in records.values())
    assert sorted({c for c, _, _ in placements}) == [0, 1]
    for cluster in (0, 1):
        ranges = sorted(layers for c, _, layers in placements if c == cluster)
        assert ranges[0][0] == 0 and ranges[-1][1] == 32
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


@pytest.mark.timeout(120)
def test_a_first_volunteer_alone_says_how_many_more_peers_the_first_round_waits_for(processes, backbone):
    # a walkthrough's first join showed only "waiting for a planning round", for ever, with --min-peers at 2
    lone = processes.start(["join", "--initial-peers", backbone, "--run", "alone", "--name", "first",
                            "--model", "mlp-digits", "--gflops", "20", "--heartbeat", "2", "--no-dashboard",
                            "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--min-peers", "3"], "first")
    lone.wait_for_output(r"^1 live peer\(s\): the first planning round opens once 3 are live \(--min-peers\); "
                         r"waiting for 2 more$", 90, stream="stderr")
    time.sleep(3)  # a few more polls: said once while the count stays
    assert lone.stderr().count("the first planning round opens once") == 1, lone.stderr()[-2000:]


def test_peer_killed_mid_round_does_not_block_it(processes, backbone):
    volunteers = start_volunteers(processes, backbone, "roundkill")
    deadline = time.monotonic() + 90
    while not any(re.search(r"round 1 (opened|joined)", p.stderr()) for p in volunteers.values()):
        assert time.monotonic() < deadline, {n: p.stderr()[-500:] for n, p in volunteers.items()}
        time.sleep(0.1)
    volunteers["v4"].kill_group()
    survivors = [n for n in CAPABILITIES if n != "v4"]
    results = {name: adopted(volunteers[name]) for name in survivors}
    assert len(set(results.values())) == 1, results
    round_number, fitness, _, _, members = results["v0"]
    assert round_number == "1"
    assert "v4" not in members.split(",")
    assert float(fitness) == pytest.approx(offline_optimum(survivors).swarm_throughput, rel=1e-9)
    assert float(fitness) == pytest.approx(9.0, rel=1e-9)


def planned(names, options, round_number=1):
    """The plan record a round adopts for one cluster of ``names``, as the round builds it."""
    peers = {name: Peer(name, *map(float, CAPABILITIES[name])) for name in names}
    priced = price_plan([sorted(peers)], peers, None, options.pricing())
    return {"round": round_number, "time": time.time(),
            "clusters": [[{"peer_id": s.peer_id, "layers": list(s.layers)} for s in stages]
                         for _, stages in priced.plan.clusters]}


def test_a_peer_that_missed_a_round_is_weighed_against_the_plan_it_missed():
    """A peer seen when round 1 opened whose proposal was not live at the deadline (a slow start under
    load) must not stay standby for good: as a standby of the new plan it is weighed once, and opens a round
    because a second cluster pays back its moves; it is not weighed again until a plan is adopted."""
    options = RoundOptions(WORKLOAD, min_peers=4, round_period=0.0)
    triggers = RoundTriggers(options)
    alive = {name: Peer(name, *map(float, CAPABILITIES[name])) for name in ("v0", "v1", "v2", "v3")}
    assert triggers.reason(None, alive) == "4 live peers"
    triggers.adopted()
    plan = planned(("v1", "v2"), options)
    assert triggers.reason(plan, alive) == ("2 standby peer(s) can raise the swarm's throughput from 4 to 7.5 "
                                            "samples/s, moving 2 peer(s) in 129s")
    assert triggers.reason(plan, alive) is None  # weighed once
    triggers.adopted()
    assert triggers.reason(plan, alive) is not None


def test_a_planned_peer_is_called_gone_only_after_several_looks():
    triggers = RoundTriggers(RoundOptions(WORKLOAD, round_period=0.0))
    alive = {name: Peer(name, *map(float, CAPABILITIES[name])) for name in ("v0", "v1")}
    plan = {"round": 1, "time": time.time(), "clusters": [[{"peer_id": "v0", "layers": [0, 16]},
                                                           {"peer_id": "v1", "layers": [16, 32]}]]}
    without_v1 = {"v0": alive["v0"]}
    looks = [triggers.reason(plan, without_v1) for _ in range(GONE_POLLS)]
    assert looks[:-1] == [None] * (GONE_POLLS - 1) and looks[-1] == "1 planned peer(s) gone"
    assert triggers.reason(plan, alive) is None


def two_clusters_of_two(options):
    """Four equal peers planned as two clusters of two (equal peers: a joiner like them fits any place)."""
    peers = {name: Peer(name, 6.0, 50.0, 400.0) for name in ("w0", "w1", "w2", "w3", "w4")}
    planned_peers = {name: peers[name] for name in ("w0", "w1", "w2", "w3")}
    priced = price_plan([["w0", "w1"], ["w2", "w3"]], planned_peers, None, options.pricing())
    plan = {"round": 2, "time": time.time(), "clusters": [[{"peer_id": s.peer_id, "layers": list(s.layers)}
                                                           for s in stages] for _, stages in priced.plan.clusters]}
    return peers, plan


def test_a_gone_peer_beside_a_whole_cluster_waits_for_a_joiner_and_one_round_puts_it_in_the_hole():
    """Issue 33's soak adopted two plans per churn event: one without the leaver (its cluster dropped), one with
    the joiner that followed a second later (the cluster made whole again), each moving peers. While another cluster
    is whole the swarm trains on, so a gone peer with no standby in sight now waits up to ``hole_wait`` for a
    joiner; the joiner opens the round at once, and the plan that puts it in the gone peer's place, moving only
    the joiner, is among the plans every island starts from."""
    options = RoundOptions(WORKLOAD, round_period=0.0, hole_wait=30.0)
    peers, plan = two_clusters_of_two(options)
    without_w3 = {name: peers[name] for name in ("w0", "w1", "w2")}
    triggers = RoundTriggers(options, "w0")
    assert [triggers.reason(plan, without_w3) for _ in range(GONE_POLLS + 3)] == [None] * (GONE_POLLS + 3)
    assert triggers.hole_since is not None
    joined = dict(without_w3, w4=peers["w4"])
    # the joiner opens the round (it surely takes part in it); a placed peer goes on waiting for it
    assert triggers.reason(plan, joined) is None
    joiner = RoundTriggers(options, "w4")
    looks = [joiner.reason(plan, joined) for _ in range(GONE_POLLS)]
    assert looks[-1] == "1 planned peer(s) gone, 1 standby peer(s) to take their place"

    filled = [["w0", "w1"], ["w2", "w4"]]
    assert filled in candidate_plans(plan, joined, WORKLOAD)
    priced = price_plan(filled, joined, plan, options.pricing())
    assert priced.cost.moved == 1 and priced.cost.download_gb == 5.0 and priced.throughput == price_plan([["w0", "w1"], ["w2", "w3"]], peers, None,
                                                                      options.pricing()).throughput

    # the joiner's cluster keeps its number, so w2 keeps its slot (same cluster, stage and layers) and trains on
    record = [[dict(peer_id=s.peer_id, layers=list(s.layers)) for s in stages] for _, stages in priced.plan.clusters]
    assert [[s["peer_id"] for s in c] for c in kept_cluster_numbers(list(reversed(record)), plan)] == filled

    triggers.hole_since -= 31  # no joiner within the wait: re-plan without the gone peer
    assert triggers.reason(plan, without_w3) == "1 planned peer(s) gone"
    triggers.adopted()
    assert triggers.hole_since is None


def test_the_wait_for_a_joiner_counts_from_the_end_of_a_leavers_hand_over():
    """A soak's Ctrl-C handed its layers over for 51 s; the 30 s wait for a joiner ran out meanwhile, and a round
    re-planned without its cluster (5 moves) just before the joiner came, whose round then moved them back: two plans
    for one event. While the gone peer's record says ``leaving`` its place is no hole yet, up to HANDOVER_WAIT_S."""
    options = RoundOptions(WORKLOAD, round_period=0.0, hole_wait=30.0)
    peers, plan = two_clusters_of_two(options)
    without_w3 = {name: peers[name] for name in ("w0", "w1", "w2")}
    triggers = RoundTriggers(options, "w0")
    looks = [triggers.reason(plan, without_w3, leaving=frozenset({"w3"})) for _ in range(GONE_POLLS + 3)]
    assert looks == [None] * (GONE_POLLS + 3)
    assert triggers.hole_since is None and triggers.handover_since is not None
    triggers.handover_since -= 60  # past the 30 s wait, but w3 still hands over
    assert triggers.reason(plan, without_w3, leaving=frozenset({"w3"})) is None and triggers.hole_since is None
    # its hand-over over (no leaving record), the 30 s for a joiner count from now
    assert triggers.reason(plan, without_w3) is None and triggers.hole_since is not None
    triggers.hole_since -= 31
    assert triggers.reason(plan, without_w3) == "1 planned peer(s) gone"
    triggers.adopted()
    assert triggers.hole_since is None and triggers.handover_since is None

    # a leaving record that stays for ever keeps the place at most HANDOVER_WAIT_S, then the usual wait
    stuck = RoundTriggers(options, "w0")
    [stuck.reason(plan, without_w3, leaving=frozenset({"w3"})) for _ in range(GONE_POLLS)]
    stuck.handover_since -= HANDOVER_WAIT_S + 1
    assert stuck.reason(plan, without_w3, leaving=frozenset({"w3"})) is None and stuck.hole_since is not None
    stuck.hole_since -= 31
    assert stuck.reason(plan, without_w3, leaving=frozenset({"w3"})) == "1 planned peer(s) gone"

    # a second leaver of the same broken cluster has a hand-over wait of its own (a review)
    both = RoundTriggers(options, "w0")
    without_w2_w3 = {name: peers[name] for name in ("w0", "w1")}
    [both.reason(plan, without_w3, leaving=frozenset({"w3"})) for _ in range(GONE_POLLS)]
    both.handover_since -= HANDOVER_WAIT_S + 1
    assert [both.reason(plan, without_w2_w3, leaving=frozenset({"w2", "w3"})) for _ in range(GONE_POLLS)] == \
        [None] * GONE_POLLS
    assert both.handing_over == {"w2", "w3"} and both.hole_since is None


def test_a_joiner_in_a_gone_first_stage_takes_that_stage_and_the_survivor_keeps_its_own():
    """Stages of equal shares are ordered by peer id; a soak's joiner in a gone stage 0 sorted after the survivor,
    which then moved to stage 0 and the joiner took stage 1: two moves. Of equal shares a peer keeps the stage
    it held."""
    options = RoundOptions(WORKLOAD, round_period=0.0)
    peers, plan = two_clusters_of_two(options)
    joined = {name: peers[name] for name in ("w0", "w1", "w3", "w4")}  # w2, stage 0 of cluster 1, is gone
    priced = price_plan([["w0", "w1"], ["w3", "w4"]], joined, plan, options.pricing())
    stages = {s.peer_id: (s.stage, s.layers) for _, cluster in priced.plan.clusters for s in cluster}
    assert stages["w4"] == (0, tuple(plan["clusters"][1][0]["layers"]))
    assert stages["w3"] == (1, tuple(plan["clusters"][1][1]["layers"]))
    assert priced.cost.moved == 1


def test_a_gone_peer_with_no_whole_cluster_left_or_no_wait_re_plans_at_once():
    options = RoundOptions(WORKLOAD, round_period=0.0, hole_wait=30.0)
    peers, plan = two_clusters_of_two(options)
    one_of_each = {name: peers[name] for name in ("w0", "w2")}  # both clusters broken: nothing trains
    triggers = RoundTriggers(options, "w0")
    assert [triggers.reason(plan, one_of_each) for _ in range(GONE_POLLS)][-1] == "2 planned peer(s) gone"
    triggers = RoundTriggers(RoundOptions(WORKLOAD, round_period=0.0, hole_wait=0.0), "w0")
    without_w3 = {name: peers[name] for name in ("w0", "w1", "w2")}
    assert [triggers.reason(plan, without_w3) for _ in range(GONE_POLLS)][-1] == "1 planned peer(s) gone"
    # with no standby, the candidate keeps the whole cluster and leaves the broken one out
    assert candidate_plans(plan, without_w3, WORKLOAD)[1] == [["w0", "w1"]]


def test_of_proposals_worth_the_same_the_round_adopts_the_one_that_moves_fewest_peers():
    """A soak's round after a kill adopted a plan that moved 6 peers: the layers downloaded in no time, so every
    plan cost the same pause and the tie went by hash. The plan that fills the hole competes even where no island
    proposed it, and of equal values the fewer moves win."""
    options = RoundOptions(WORKLOAD, round_period=0.0)
    peers, plan = two_clusters_of_two(options)
    joined = {name: peers[name] for name in ("w0", "w1", "w2", "w4")}
    rounds = PlanningRounds.__new__(PlanningRounds)
    rounds.options = options
    reshuffled = {"clusters": [["w0", "w2"], ["w1", "w4"]]}  # as fast, but moves three peers
    value, _, clusters, priced = rounds.choose([reshuffled], joined, plan)
    assert canonical(clusters) == canonical([["w0", "w1"], ["w2", "w4"]]) and priced.cost.moved == 1
    assert value == pytest.approx(price_plan([["w0", "w2"], ["w1", "w4"]], joined, plan, options.pricing()).value)


def test_the_round_period_counts_from_a_round_that_kept_the_plan_too():
    """A round opened because the period elapsed may keep the plan in force (nothing paid back its moves):
    the next revision waits a period from then, rather than opening a round at every look."""
    options = RoundOptions(WORKLOAD, round_period=60.0)
    triggers = RoundTriggers(options)
    plan = dict(planned(("v0", "v1", "v2", "v3"), options), time=time.time() - 61)
    alive = {name: Peer(name, *map(float, CAPABILITIES[name])) for name in ("v0", "v1", "v2", "v3")}
    assert triggers.reason(plan, alive) == "round period elapsed"
    triggers.declined()
    assert triggers.reason(plan, alive) is None
    triggers.declined_at -= 61
    assert triggers.reason(plan, alive) == "round period elapsed"


def test_one_new_standby_opens_a_round_only_when_its_gain_pays_back_the_moves():
    """With v0..v3 planned as one cluster of four (9 samples/s, the best without v4), v4 alone joining can
    form a second cluster (12 samples/s with the plan in force kept) if it downloads its 10 GB over its
    400 Mbit/s (200 s) plus the pause: within an hour's horizon that pays back, within 10 minutes it does not
    (12 x 390 / 600 = 7.8 < 9), so no round opens; either way a set of standbys is weighed once, and a
    standby that adds nothing is told why."""
    four = {name: Peer(name, *map(float, CAPABILITIES[name])) for name in ("v0", "v1", "v2", "v3")}
    everyone = dict(four, v4=Peer("v4", *map(float, CAPABILITIES["v4"])))
    hour = RoundOptions(WORKLOAD, round_period=0.0, move_horizon_s=3600.0)
    plan = planned(four, hour)
    triggers = RoundTriggers(hour)
    assert triggers.reason(plan, four) is None
    assert triggers.reason(plan, everyone) == ("1 standby peer(s) can raise the swarm's throughput from 9 to 12 "
                                               "samples/s, moving 1 peer(s) in 210s")
    assert triggers.reason(plan, everyone) is None  # weighed once: a round that finds no better plan is not retried
    current, possible = improvement(plan, everyone, hour.pricing())
    assert (current, possible.throughput, possible.cost) == (9.0, 12.0, MoveCost(210.0, 10.0, 1))

    triggers = RoundTriggers(RoundOptions(WORKLOAD, round_period=0.0, move_horizon_s=600.0))
    assert triggers.reason(plan, everyone) is None
    standbys, current, possible = triggers.unpaid
    assert standbys == {"v4"} and current == 9.0 and possible.value == pytest.approx(7.8)

    slow = dict(four, v5=Peer("v5", 1.0, 1.0, 10.0))  # too little RAM for a cluster of its own
    assert triggers.reason(plan, slow) is None
    # a placed peer whose record came to offer no RAM (a hostile review): building the plan in force with the
    # standby added raised an IndexError in every peer's poll, and the standby's round was lost; it is no candidate
    emptied = dict(everyone, **{name: Peer(name, 0.0 if name == "v0" else 2.0, *map(float, CAPABILITIES[name][1:]))
                                for name in four})  # the other three cannot hold the model without it
    current, possible = improvement(plan, emptied, hour.pricing())
    assert possible is not None and possible.throughput > current, (current, possible)
    assert RoundTriggers(hour).reason(plan, emptied).startswith("1 standby peer(s) can raise the swarm's throughput")
    assert standby_reason(plan, slow, WORKLOAD) == ("the 1 cluster(s) are full and the standbys offer 1.00 GB "
                                                   "together, 9.00 GB short of a new cluster's 10.00 GB")


def test_a_joiner_still_preparing_its_model_opens_no_round_and_counts_for_no_first_round():
    """A joiner's record says ``joining`` from the moment it is published until its planning rounds begin, seconds
    later (its model's first use, the measure of its compute). A round opened for it meanwhile froze its proposals
    before it looked: it planned without it, and a second round placed it (a CI run's NAT lab: at the end of the
    run). Now a joining peer opens no round, is not counted for the first, and is weighed once it is a standby."""
    options = RoundOptions(WORKLOAD, min_peers=2, round_period=0.0, move_horizon_s=3600.0)
    triggers = RoundTriggers(options)
    pair = {name: Peer(name, *map(float, CAPABILITIES[name])) for name in ("v0", "v1")}
    assert triggers.reason(None, pair, joining=frozenset({"v1"})) is None
    assert triggers.reason(None, pair) == "2 live peers"

    four = {name: Peer(name, *map(float, CAPABILITIES[name])) for name in ("v0", "v1", "v2", "v3")}
    everyone = dict(four, v4=Peer("v4", *map(float, CAPABILITIES["v4"])))
    plan = planned(four, options)
    triggers = RoundTriggers(options)
    assert triggers.reason(plan, everyone, joining=frozenset({"v4"})) is None
    assert triggers.reason(plan, everyone) == ("1 standby peer(s) can raise the swarm's throughput from 9 to 12 "
                                               "samples/s, moving 1 peer(s) in 210s")


def test_a_peers_record_says_standby_once_its_planning_rounds_begin():
    """``joining`` ends where the planning rounds begin (real DHT: a storage node, and the peer's record as
    another peer reads it)."""
    run = "ready"

    async def scenario():
        server = await start_node(record_validators=make_validators(run), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        peer = await start_peer_node(await server.get_visible_maddrs(), run, client_mode=True,
                                     host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        stop = asyncio.Event()
        try:
            announcer = PeerAnnouncer(peer, run, "v0", Capabilities(ram_gb=16.0, gflops=50.0, bandwidth_mbps=100.0))
            assert await announcer.renew()
            before = [r["state"] for r in await announcer.read_peers()]
            rounds = PlanningRounds(peer, run, announcer, RoundOptions(WORKLOAD, min_peers=2), Console(quiet=True))
            task = asyncio.create_task(rounds.run_forever(stop))
            await asyncio.sleep(1.0)
            after = [r["state"] for r in await announcer.read_peers()]
            stop.set()
            await task
            return before, after
        finally:
            stop.set()
            for node in (peer, server):
                await stop_node(node)

    before, after = asyncio.run(scenario())
    assert (before, after) == (["joining"], ["standby"])


def test_a_joiner_that_reads_no_plan_its_live_peers_follow_waits_for_it_before_a_round_of_its_own():
    """Soak (30 min, 8 volunteers, churn): peer12 joined while six peers trained plan round 10, read no copy of it,
    and opened a round 1 of its own, 14 times, until peer13 joined and the two adopted a plan round 1 that later
    joiners followed: two swarms that never averaged. While live peers' records say they follow a plan, a peer
    that reads none waits ``plan_wait`` for it; only then (anyone can write such a record) does it open one."""
    options = RoundOptions(WORKLOAD, min_peers=2, plan_wait=60.0)
    triggers = RoundTriggers(options)
    alive = {name: Peer(name, *map(float, CAPABILITIES[name])) for name in ("v0", "v1", "v2")}
    followed = {"v0": 10, "v1": 10}  # v2 joined: a standby
    assert triggers.reason(None, alive, followed) is None
    assert triggers.reason(None, alive, followed) is None
    triggers.unread_plan_since -= 61
    assert triggers.reason(None, alive, followed) == "3 live peers"
    assert triggers.reason(None, alive, {}) == "3 live peers"  # a new run: nobody follows a plan yet
    assert triggers.unread_plan_since is None


def test_a_plan_in_force_without_a_readable_copy_is_written_again_by_its_adopters():
    """The other half of the soak's split: the copies of a plan are written once, by its first adopters, and a
    store that failed on a loaded machine, nodes that left with them or their expiry left a joiner nothing to read.
    An adopter whose poll reads no copy of the plan it follows writes its own again: a joiner then finds it in
    force (real DHT: a storage node, the adopter and a joiner)."""
    run = "rewrite"

    async def scenario():
        server = await start_node(record_validators=make_validators(run), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        maddrs = await server.get_visible_maddrs()
        adopter = await start_peer_node(maddrs, run, client_mode=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        joiner = await start_node(maddrs, record_validators=make_validators(run), client_mode=True,
                                  host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            announcer = PeerAnnouncer(adopter, run, "adopter", Capabilities(ram_gb=8.0, gflops=50.0,
                                                                            bandwidth_mbps=100.0))
            rounds = PlanningRounds(adopter, run, announcer, RoundOptions(WORKLOAD), Console(quiet=True))
            plan = PlanRecord(round=3, time=time.time(), clusters=[[dict(peer_id=rounds.peer_id, layers=[0, 8])]]).dict()
            rounds.adopted = plan  # its copy's store failed: nobody can read it
            announcer.update(state="training", plan_round=3, cluster=0, stage=0, layers=[0, 8])
            assert await announcer.renew()
            assert await read_plans(joiner, run) == [] and await read_adopted_plan(joiner, run) is None

            assert await rounds.current_plan() == plan
            assert await read_adopted_plan(joiner, run) == plan
            assert len(await read_plans(joiner, run)) == 1
            await rounds.current_plan()  # a copy is readable now: none is written again
            assert len(await read_plans(joiner, run)) == 1
        finally:
            for node in (joiner, adopter, server):
                await stop_node(node)

    asyncio.run(scenario())


def test_a_peer_that_sees_a_round_after_its_proposals_froze_says_that_the_round_plans_without_it():
    """A loaded machine's placed peer saw a standby's round 1.5 s before its deadline, as its proposals froze
    (``--round-seconds 3``, settle 1.5 s): it never published, the round placed the standby alone and put the peer
    on standby, and it said only "round 2 joined". Now it says why (real DHT: a storage node and the late peer)."""
    run = "late-round"

    async def scenario():
        server = await start_node(record_validators=make_validators(run), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        late = await start_peer_node(await server.get_visible_maddrs(), run, client_mode=True,
                                     host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            announcer = PeerAnnouncer(late, run, "late", Capabilities(ram_gb=16.0, gflops=50.0, bandwidth_mbps=100.0))
            assert await announcer.renew()
            console = Console(record=True, width=300)
            options = RoundOptions(WORKLOAD, round_seconds=3.0, settle=1.5)
            rounds = PlanningRounds(late, run, announcer, options, console)
            await rounds.take_part(2, get_dht_time() + 1.0, "joined", None)
            return console.export_text()
        finally:
            for node in (late, server):
                await stop_node(node)

    said = asyncio.run(scenario())
    assert "round 2: seen after its proposals froze, so it plans without us" in said, said
    assert "--round-seconds" in said and "none of 0 proposal(s) is valid" in said, said


async def storage_and_peer_nodes(run: str, count: int):
    """A storage node with the run's validators and ``count`` peers' client nodes on it, each its own identity."""
    server = await start_node(record_validators=make_validators(run), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    maddrs = await server.get_visible_maddrs()
    return server, [await start_peer_node(maddrs, run, client_mode=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
                    for _ in range(count)]


def test_a_peer_that_joins_a_round_at_a_strangers_near_deadline_adopts_nothing():
    """The join path of the hostile deadline: a peer that finds round 2 open joins it at the earliest deadline any
    proposal names, here a stranger's a moment away beside two honest proposals of a later one. It never publishes
    in time, and the only proposal at that deadline is the stranger's, dated honestly: it adopted the stranger's
    one-peer plan. The participants it joined on were three, one is alive at that deadline: nothing is adopted.
    Real DHT: a storage node, the two honest proposers, the stranger and the joiner, each its own identity."""
    run = "near-deadline"

    async def scenario():
        server, nodes = await storage_and_peer_nodes(run, 4)
        try:
            *honest, stranger, joiner = nodes
            now = get_dht_time()
            for node, deadline in [(honest[0], now + 30), (honest[1], now + 30), (stranger, now + 1.2)]:
                peer_id = node.peer_id.to_base58()
                proposal = dict(round=2, deadline=deadline, peer_id=peer_id, ram_gb=16.0, gflops=50.0,
                                bandwidth_mbps=100.0, fitness=1.0, clusters=[[peer_id]], time=time.time())
                assert await node.store(f"{run}_round", proposal, now + 120,
                                        subkey=signing_validator(node).local_public_key)
            announcer = PeerAnnouncer(joiner, run, "joiner", Capabilities(ram_gb=16.0, gflops=50.0,
                                                                          bandwidth_mbps=100.0))
            assert await announcer.renew()
            console = Console(record=True, width=300)
            rounds = PlanningRounds(joiner, run, announcer, RoundOptions(WORKLOAD, round_seconds=3.0, settle=1.5),
                                    console)
            assert await rounds._joined_open_round(2, None)
            return console.export_text(), rounds.adopted
        finally:
            for node in nodes + [server]:
                await stop_node(node)

    said, adopted = asyncio.run(scenario())
    assert adopted is None and "round 2: only 1 of the 3 participants we saw have a live proposal" in said, said


def test_a_strangers_far_future_deadline_opens_no_round_for_anyone():
    """A stranger's proposal of deadline 1e11 (within the record's bounds): every honest peer joined its round,
    renewed that deadline in proposals of its own and never adopted a plan again. A deadline further ahead than a
    round lasts is no round's: a peer that finds only it joins nothing (and opens its own round as it would)."""
    run = "far-deadline"
    assert deadline_in_reach(dict(deadline=130.0), 100.0, 3.0) and not deadline_in_reach(dict(deadline=1e11), 100.0,
                                                                                             3.0)

    async def scenario():
        server, nodes = await storage_and_peer_nodes(run, 2)
        try:
            stranger, joiner = nodes
            peer_id = stranger.peer_id.to_base58()
            proposal = dict(round=1, deadline=1e11, peer_id=peer_id, ram_gb=16.0, gflops=50.0, bandwidth_mbps=100.0,
                            fitness=1.0, clusters=[[peer_id]], time=time.time())
            assert await stranger.store(f"{run}_round", proposal, get_dht_time() + 120,
                                        subkey=signing_validator(stranger).local_public_key)
            announcer = PeerAnnouncer(joiner, run, "joiner", Capabilities(ram_gb=16.0, gflops=50.0,
                                                                          bandwidth_mbps=100.0))
            rounds = PlanningRounds(joiner, run, announcer, RoundOptions(WORKLOAD, round_seconds=3.0, settle=1.5),
                                    Console(record=True, width=300))
            # the stranger's proposal is there to read: what follows is the planner's choice, not a missed read
            assert [p["peer_id"] for p in await read_proposals(joiner, run)] == [peer_id]
            return await asyncio.wait_for(rounds._joined_open_round(1, None), 20)
        finally:
            for node in nodes + [server]:
                await stop_node(node)

    assert asyncio.run(scenario()) is False


def test_peers_placed_by_a_newer_plan_are_no_standbys_of_ours():
    """The soak's second swarm (peer12's plan rounds) counted the first swarm's six placed peers as standbys
    that could raise its throughput, opened a round, and kept its plan, as they never took part: again and again.
    Peers whose records follow a newer plan round are not weighed; a real standby still is."""
    options = RoundOptions(WORKLOAD, round_period=0.0)
    plan = planned(("v1", "v2"), options)  # round 1
    alive = {name: Peer(name, *map(float, CAPABILITIES[name])) for name in ("v0", "v1", "v2", "v3")}
    triggers = RoundTriggers(options)
    assert triggers.reason(plan, alive, {"v1": 1, "v2": 1, "v0": 11, "v3": 11}) is None
    assert triggers.unpaid is None and triggers.considered == set()
    assert triggers.reason(plan, alive, {"v1": 1, "v2": 1}) == (
        "2 standby peer(s) can raise the swarm's throughput from 4 to 7.5 samples/s, moving 2 peer(s) in 129s")


def placed_records(plan: dict) -> list:
    """The live records of the peers ``plan`` places, each naming its round and its slot."""
    return [dict(peer_id=stage["peer_id"], state="training", plan_round=plan["round"], cluster=c, stage=s,
                 layers=stage["layers"]) for c, cluster in enumerate(plan["clusters"]) for s, stage in enumerate(cluster)]


def test_two_plans_of_one_round_every_reader_names_the_same_and_the_other_sides_peers_are_its_standbys():
    """A NAT lab run split in two: two joiners read no plan while the first peer's round 1 was being published,
    opened a round 1 of their own, and each side then counted the other's peers as placed elsewhere (another plan,
    though of the same round): two swarms that never averaged with each other. Whatever order a reader gets the
    two plans in, it names the same one in force, and to that plan the other side's peers are standbys, so the
    round its peers open merges the two. A stranger's copy of that plan with a made-up peer added is not it."""
    options = RoundOptions(WORKLOAD, round_period=0.0)
    first, home = planned(("v1", "v2"), options), planned(("v0", "v3"), options)
    peers = placed_records(first) + placed_records(home)
    in_force = adopted_plan([first, home], peers)
    assert in_force is not None and adopted_plan([home, first], peers) == in_force
    made_up = dict(in_force, clusters=in_force["clusters"] + [[{"peer_id": "12D3KooWMadeUp", "layers": [0, 8]}]])
    assert adopted_plan([made_up, first, home], peers) == in_force == adopted_plan([first, home, made_up], peers)
    others = ("v0", "v3") if in_force is first else ("v1", "v2")
    alive = {name: Peer(name, *map(float, CAPABILITIES[name])) for name in ("v0", "v1", "v2", "v3")}
    reason = RoundTriggers(options).reason(in_force, alive, {p["peer_id"]: 1 for p in peers})
    assert reason is not None and reason.startswith(f"{len(others)} standby peer(s) can raise"), reason
    # one side went on to a round 2 of its own first (the lab run's): the other's peers, on round 1, are its standbys
    ahead = dict(in_force, round=2)
    followed = {p["peer_id"]: 2 if p["peer_id"] not in others else 1 for p in peers}
    reason = RoundTriggers(options).reason(ahead, alive, followed)
    assert reason is not None and reason.startswith(f"{len(others)} standby peer(s) can raise"), reason


def test_a_plan_whose_placed_peers_all_hand_over_stays_in_force_for_a_joiner():
    """A walkthrough's joiner came while the only placed peer handed its layers over: that peer's record said
    ``leaving`` (no cluster), so the joiner read no plan in force, opened a round 1 of its own and trained a second
    lineage beside the run's, never averaging with it. While most of its leaving peers' records still name it, the
    plan is in force: the joiner is its standby, and the round it opens at once re-places the gone peers' layers.
    A stranger's plan naming the leaver in another round is not; a plan its live peers confirm ranks above it."""
    options = RoundOptions(WORKLOAD, round_period=0.0, hole_wait=30.0)
    plan = planned(("v1", "v2"), options, round_number=2)
    leaving = [dict(record, state="leaving", cluster=-1, stage=None) for record in placed_records(plan)]
    joiner = [dict(peer_id="v4", state="standby", plan_round=None, cluster=-1, stage=None, layers=None)]
    assert adopted_plan([plan], joiner) is None  # the leaver's record expired: no plan anyone follows
    assert adopted_plan([plan], leaving + joiner) == plan
    stranger = dict(plan, round=3)  # the round after: only the leavers' records naming round 2 keep it out
    assert adopted_plan([stranger], leaving + joiner) is None
    assert adopted_plan([stranger, plan], leaving + joiner) == plan
    other_layers = dict(plan, clusters=[[dict(entry, layers=[0, 1]) for entry in plan["clusters"][0]]])
    assert adopted_plan([other_layers], leaving + joiner) is None
    followed = dict(planned(("v0", "v3"), options, round_number=2), time=plan["time"])
    assert adopted_plan([plan, followed], leaving + joiner + placed_records(followed)) == followed
    # the joiner, a standby of that plan, opens the round that re-places the leaver once it is gone
    alive = {"v4": Peer("v4", *map(float, CAPABILITIES["v4"]))}
    triggers = RoundTriggers(options, "v4")
    looks = [triggers.reason(plan, alive, leaving=frozenset({"v1", "v2"})) for _ in range(GONE_POLLS)]
    assert looks[-1] == "2 planned peer(s) gone, 1 standby peer(s) to take their place", looks


def test_a_plan_one_key_confirms_itself_far_ahead_of_the_rounds_peers_follow_is_not_the_runs():
    """A hostile review: a stranger wrote a plan of round 2**53 placing itself alone, and its own record confirming
    it; joiners, observers and exports (no round of their own) took it for the run's, a joiner's next round failed
    validation for good, and an export took the stranger's weights. A plan more than one round past the plan the
    most peers confirm is ignored; the next honest round is not, nor is the plan hidden by records of standbys."""
    options = RoundOptions(WORKLOAD, round_period=0.0)
    honest = planned(("v1", "v2"), options, round_number=4)
    mine = {"round": 2**53, "time": time.time(), "clusters": [[{"peer_id": "v0", "layers": [0, 8]}]]}
    peers = placed_records(honest) + placed_records(mine)
    assert adopted_plan([honest, mine], peers) == honest
    assert adopted_plan([mine, honest], peers + [dict(peer_id="v3", state="standby", plan_round=4)]) == honest
    leaving = [dict(record, state="leaving", cluster=-1, stage=None) for record in placed_records(mine)]
    assert adopted_plan([honest, mine], placed_records(honest) + leaving) == honest
    following = dict(planned(("v1", "v2"), options, round_number=5), time=honest["time"] + 1)
    behind = [dict(peer_id=name, state="standby", plan_round=4) for name in ("v3", "v4")]  # not renewed yet
    assert adopted_plan([honest, following], placed_records(following) + behind) == following
    made_up = [dict(peer_id=f"sybil{i}", state="standby", plan_round=0) for i in range(5)]
    assert adopted_plan([honest, mine], peers + made_up) == honest


# the split tests' rounds: short, never revised by time, no wait for a joiner, and moves that always pay back
SIDES_OPTIONS = RoundOptions(WORKLOAD, min_peers=2, round_period=0.0, round_seconds=4.0, poll=0.5, hole_wait=0.0,
                             move_horizon_s=10**6)


def planning_rounds(nodes, run: str, names) -> list:
    """Each node's planning rounds as ``join`` runs them, its announcer offering ``CAPABILITIES[name]``."""
    peers = []
    for node, name in zip(nodes, names):
        ram, gflops, mbps = map(float, CAPABILITIES[name])
        announcer = PeerAnnouncer(node, run, name, Capabilities(ram_gb=ram, gflops=gflops, bandwidth_mbps=mbps),
                                  heartbeat=1.0)
        peers.append(PlanningRounds(node, run, announcer, SIDES_OPTIONS, Console(quiet=True)))
    return peers


def plan_of(peers, round_number: int) -> dict:
    """The plan record of round ``round_number`` that puts ``peers`` in one cluster, as an adoption writes it."""
    alive = {p.peer_id: Peer(p.peer_id, *map(float, CAPABILITIES[p.announcer.record["name"]])) for p in peers}
    priced = price_plan([sorted(alive)], alive, None, SIDES_OPTIONS.pricing())
    return PlanRecord(round=round_number, time=time.time(), clusters=[
        [dict(peer_id=s.peer_id, layers=list(s.layers)) for s in stages] for _, stages in priced.plan.clusters]).dict()


async def follow(rounds, plan: dict, **digest) -> None:
    """``rounds`` adopted ``plan`` (of one cluster) and its record names its slot; ``digest``: the plan's digest
    where the record names it (``plan_digest=...``)."""
    rounds.adopted = plan
    stage = next(i for i, s in enumerate(plan["clusters"][0]) if s["peer_id"] == rounds.peer_id)
    rounds.announcer.update(state="training", plan_round=plan["round"], cluster=0, stage=stage,
                            layers=plan["clusters"][0][stage]["layers"], **digest)
    assert await rounds.announcer.renew()


async def plan_until(peers, done, seconds: float, then: float = 0.0) -> None:
    """Run every peer's planning rounds, renewing its record each second, until ``done()`` or ``seconds`` pass,
    and ``then`` seconds more."""
    stop = asyncio.Event()

    async def keep_renewing(rounds):
        while not stop.is_set():
            await rounds.announcer.renew()
            await asyncio.sleep(1.0)

    tasks = [asyncio.create_task(rounds.run_forever(stop)) for rounds in peers]
    tasks += [asyncio.create_task(keep_renewing(rounds)) for rounds in peers]
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not done():
            await asyncio.sleep(0.5)
        await asyncio.sleep(then)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)


def test_two_sides_a_round_apart_merge_in_the_next_round():
    """The NAT lab run's split, on a real DHT: two joiners adopted a round 1 of their own beside the first peers'
    round 1, and the first side went on to a round 2 among themselves. So v0, v1 follow a plan of round 2 and v2,
    v3 one of round 1 (each plan's copy written, each peer's record naming its slot). Before, each side counted
    the other's peers as placed by another plan, no standbys of its own, and no round ever opened: two swarms.
    Each runs its planning rounds as ``join`` does: every peer names the round-2 plan in force, to which v2 and v3
    are standbys, so a round 3 opens that all four join, and all four adopt one plan."""
    run = "split"

    async def scenario():
        server, nodes = await storage_and_peer_nodes(run, 4)
        try:
            peers = planning_rounds(nodes, run, ("v0", "v1", "v2", "v3"))
            for side, round_number in ((peers[:2], 2), (peers[2:], 1)):
                plan = plan_of(side, round_number)
                for rounds in side:
                    await follow(rounds, plan)
                assert await side[0].store_plan_copy(plan)
            await plan_until(peers, lambda: all(r.adopted["round"] >= 3 for r in peers), 60)
            adopted = [r.adopted for r in peers]
            assert all(plan["round"] == 3 for plan in adopted), [p["round"] for p in adopted]
            assert all(plan["clusters"] == adopted[0]["clusters"] for plan in adopted), adopted
            placed = {stage["peer_id"] for cluster in adopted[0]["clusters"] for stage in cluster}
            # one plan for the four: both sides have a peer in it (the best plan may leave a slow one out)
            assert placed & {r.peer_id for r in peers[:2]} and placed & {r.peer_id for r in peers[2:]}, adopted[0]
        finally:
            for node in nodes + [server]:
                await stop_node(node)

    asyncio.run(scenario())


def test_a_peer_placed_by_the_plan_in_force_follows_it_over_its_own_sides_plan_of_the_same_round():
    """An 8-volunteer soak's split: three joiners each adopted a plan of their round that only they followed, while
    the others adopted another plan of that round that placed the joiners too. Every reader named theirs in force,
    so nobody took a joiner for a standby and no round opened to merge the two; each stood still for two to three
    minutes, never fed by its stage 0. On a real DHT: v0 and v1 follow plan P of round 2 (their records name its
    digest), which places v2 as well; v2 follows a plan of round 2 of its own. v2 follows P within a few polls, its
    record names P's slot and digest, and no round opens."""
    run = "sides"

    async def scenario():
        server, nodes = await storage_and_peer_nodes(run, 3)
        try:
            peers = planning_rounds(nodes, run, ("v0", "v1", "v2"))
            theirs = plan_of(peers, 2)
            own = PlanRecord(round=2, time=time.time(),
                             clusters=[[dict(peer_id=peers[2].peer_id, layers=[0, 8])]]).dict()
            for rounds, plan in ((peers[0], theirs), (peers[1], theirs), (peers[2], own)):
                await follow(rounds, plan, plan_digest=plan_digest(plan))
            assert await peers[0].store_plan_copy(theirs) and await peers[2].store_plan_copy(own)
            # then a few more polls: nothing opens a round
            await plan_until(peers, lambda: peers[2].adopted["clusters"] == theirs["clusters"], 30, then=3.0)
            assert peers[2].adopted["clusters"] == theirs["clusters"], peers[2].adopted
            assert [r.adopted["round"] for r in peers] == [2, 2, 2]
            assert [r.adopted["clusters"] for r in peers[:2]] == [theirs["clusters"]] * 2
            slot = next(s for s in theirs["clusters"][0] if s["peer_id"] == peers[2].peer_id)
            record = peers[2].announcer.record
            assert (record["plan_round"], record["plan_digest"], record["cluster"], record["layers"]) == \
                (2, plan_digest(theirs), 0, slot["layers"]), record
        finally:
            for node in nodes + [server]:
                await stop_node(node)

    asyncio.run(scenario())


def test_a_plan_counts_as_followed_only_where_its_peers_name_that_very_plan():
    """The rule that lets a peer stranded on the losing side of a split round follow the other side's plan, and
    what it refuses: a stranger's copy of the honest plan with a cluster of its own identities added (which
    outranks the honest plan in ``adopted_plan``: more confirmed stages) or with our layers changed, records that
    name the round and the place but no digest (written before records named one), and peers still moving."""
    def entry(peer, layers):
        return dict(peer_id=peer, layers=layers)

    honest = dict(round=2, time=1.0, clusters=[[entry("a", [0, 4]), entry("b", [4, 8])],
                                               [entry("c", [0, 4]), entry("d", [4, 8])]])

    def follower(peer, plan, **changes):
        place = next((c, s, e["layers"]) for c, cluster in enumerate(plan["clusters"])
                     for s, e in enumerate(cluster) if e["peer_id"] == peer)
        return dict(dict(peer_id=peer, state="training", plan_round=plan["round"], plan_digest=plan_digest(plan),
                         cluster=place[0], stage=place[1], layers=list(place[2])), **changes)

    peers = [follower(p, honest) for p in "abc"] + [dict(peer_id="d", state="training", plan_round=2)]
    assert followed_by_its_peers(honest, peers, "d")
    assert followed_by_its_peers(honest, peers[:2] + [dict(peers[2], plan_digest=None)], "d")  # 2 of 3 follow
    # a stranger's copy with a cluster of its identities x and y, whose records confirm that copy
    padded = dict(honest, clusters=honest["clusters"] + [[entry("x", [0, 4]), entry("y", [4, 8])]])
    strangers = [follower("x", padded), follower("y", padded)]
    records = peers[:3] + strangers + [follower("d", honest)]
    assert adopted_plan([honest, padded], records) == honest
    # where the records name no digest (as before digests) the padded copy outranks the honest plan
    assert adopted_plan([honest, padded], [dict(r, plan_digest=None) for r in records]) == padded
    assert not followed_by_its_peers(padded, peers + strangers, "d")
    # ... or with our layers changed: no honest peer names it
    shifted = dict(honest, clusters=[honest["clusters"][0], [entry("c", [0, 4]), entry("d", [4, 9])]])
    assert not followed_by_its_peers(shifted, peers, "d")
    # records without a digest say nothing about which plan of the round they follow
    assert not followed_by_its_peers(honest, [dict(p, plan_digest=None) for p in peers], "d")
    # two of the three others still name their old place while they move: one of three follows
    moving = [dict(peers[0], stage=None, cluster=-1), dict(peers[1], layers=[0, 2]), peers[2], peers[3]]
    assert not followed_by_its_peers(honest, moving, "d")
    # a leaving peer counts for neither side; a plan that places nobody else is followed by nobody
    assert followed_by_its_peers(honest, [dict(peers[0], state="leaving")] + peers[1:], "d")
    assert not followed_by_its_peers(dict(honest, clusters=[[entry("d", [0, 8])]]), peers, "d")
    # a plan that enough identities follow is still followed only if an adoption could have written it
    assert plan_shape_problem(honest, 8, 2) is None
    assert plan_shape_problem(shifted, 8, 2) == "its cluster 1's layers are not the model's 8 in order"
    assert plan_shape_problem(dict(honest, clusters=[[entry("a", [0, 4]), entry("b", [4, 4]), entry("c", [4, 8])]]),
                              8, 4) == "its cluster 0's layers are not the model's 8 in order"
    assert plan_shape_problem(padded, 8, 1) == "its cluster 0 has 2 stages, more than 1"
    assert plan_shape_problem(dict(honest, clusters=honest["clusters"] + [[entry("a", [0, 8])]]), 8, 2) == \
        "it places a peer twice"


def test_a_strangers_round_deadline_a_moment_away_or_renewal_dated_ahead_decides_nothing():
    """A hostile peer of the run opened round r+1 with a deadline a moment away and a proposal dated 1e11: every
    participant lowered its deadline to it, stopped renewing before it could publish with it, and adopted from the
    stranger's proposal alone (the only one at that deadline, and "fresh" at any freeze). A deadline is followed only
    where it leaves time to renew; a proposal dated ahead of the reader is not fresh; and a round in which fewer than
    half of the participants seen are alive at the deadline adopts nothing."""
    now, settle, poll = 1000.0, 1.5, 1.0
    honest, hostile, co_opener = dict(deadline=now + 10), dict(deadline=now + 2), dict(deadline=now + 8)
    assert followed_deadline(now + 10, [honest, hostile], now + settle + poll) == now + 10
    assert followed_deadline(now + 10, [honest, co_opener, hostile], now + settle + poll) == now + 8
    assert _fresh(dict(time=now - 1), now, 5.0) and not _fresh(dict(time=1e11), now, 5.0)
    assert not _fresh(dict(time=now + MAX_CLOCK_AHEAD_S + 1), now, 5.0) and not _fresh(dict(time=now - 6), now, 5.0)
    peer = Peer("H", 8.0, 50.0, 100.0)
    assert not decided_by_most({"H": peer}, {"A", "B", "C", "D", "H"})
    assert decided_by_most({i: peer for i in "ABCD"}, {"A", "B", "C", "D", "H"})
    assert decided_by_most({"A": peer}, {"A", "B"})  # a round of two where one died still decides


def test_a_plan_with_a_cluster_that_cannot_train_is_never_chosen_and_a_zero_speed_peer_is_no_room():
    """One feasible cluster beside one that cannot hold the model (a hostile proposal, or a standby short of RAM filled
    into a hole) made building the plan raise for every peer, round after round; a claim of 5e-324 GFLOP/s is above
    0 but computes nothing, and the GA took its RAM for room in every island's best plan."""
    from ravnest_swarm.planning.ga import SwarmArrays

    workload = Workload(model_gb=1.0, gflop_per_sample=1.0, activation_mb=0.0, max_stages=8)
    rounds = PlanningRounds.__new__(PlanningRounds)
    rounds.options = RoundOptions(workload=workload)
    alive = {"A": Peer("A", 2.0, 10.0, 100.0), "B": Peer("B", 2.0, 10.0, 100.0), "H": Peer("H", 0.5, 1.0, 100.0)}
    chosen = rounds.choose([{"clusters": [["A"], ["H"]]}, {"clusters": [["A"], ["B"]]}], alive, None)
    assert chosen[2] == [["A"], ["B"]]
    assert rounds.choose([{"clusters": [["A"], ["H"]]}], alive, None) is None
    arrays = SwarmArrays([Peer("A", 0.5, 10.0, 100.0), Peer("H", 4096.0, 5e-324, 100.0)],
                         Workload(model_gb=1.0, gflop_per_sample=10.0, activation_mb=0.0, max_stages=8))
    assert list(arrays.peer_index) == [0]


def test_a_summary_names_only_bucket_counts_the_run_has():
    """A summary naming 65,536 buckets made every planner poll read 65,537 keys, none of which the validators knew: a
    forged peer record there, unvalidated, confirmed a hostile plan. A count is a power of two up to 256, and the
    bucket one of it."""
    from ravnest_swarm.membership.buckets import counts_named
    from ravnest_swarm.membership.records import BucketSummary

    summary = dict(peer_id="QmX", buckets=4, bucket=3, peers=1, states={"training": 1}, clusters={}, samples_per_s=0.0,
                   time=1.0)
    assert BucketSummary.parse_obj(summary).buckets == 4
    for fields in (dict(buckets=65536, bucket=7), dict(buckets=3, bucket=0), dict(buckets=4, bucket=4)):
        with pytest.raises(ValueError):
            BucketSummary.parse_obj(dict(summary, **fields))
    assert counts_named([dict(buckets=65536), dict(buckets=4)]) == [1, 4]
