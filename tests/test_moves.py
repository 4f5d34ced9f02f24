"""Plans that weigh moves: the move-cost model, the payback rule, the GA's objective counting the cost, and a
joiner that cannot pay back its moves opening no round among real `join` processes."""

import json
import re
import time

import numpy as np
import pydantic.v1 as pydantic
import pytest
from hivemind.utils.crypto import RSAPrivateKey

from commands import ravnest
from ravnest_swarm.membership.records import RunSpecRecord
from ravnest_swarm.planning.cost import (
    MOVE_PAUSE_S, MoveCost, MovePrice, Peer, Workload, horizon_throughput, kept_places, move_cost, pays_back,
    swarm_throughput,
)
from ravnest_swarm.planning.ga import GAConfig, IslandGA, SwarmArrays
from ravnest_swarm.planning.greedy import greedy_plan
from ravnest_swarm.planning.moves import Pricing, in_force_throughput, price_plan
from ravnest_swarm.planning.plan import assignment_clusters, uniform_layers
from ravnest_swarm.swarm.spec import RunSpec

# M = 10 GB in 32 layers of 0.3125 GB; four equal peers of 5 GB: two clusters of two, 20 GFLOP/s each
WORKLOAD = Workload(10.0, 20.0, 0.0, 8)
PRICE = MovePrice(tuple([10.0 / 32] * 32), horizon_s=600.0)
EQUAL = {name: Peer(name, 5.0, 20.0, 400.0) for name in "abcd"}


def test_a_peer_downloads_only_the_layers_its_old_range_lacked_over_its_own_link():
    in_force = [[("a", (0, 16)), ("b", (16, 32))]]
    # a keeps its place; b shifts to 12:32 (4 layers more, 1.25 GB); c joins with 0:12 (3.75 GB)
    proposed = [[("a", (0, 16)), ("b", (16, 32))], [("c", (0, 12)), ("b2", (12, 32))]]
    links = {"a": 400.0, "b": 400.0, "c": 100.0, "b2": 1000.0}
    cost = move_cost(in_force, proposed, links, PRICE)
    assert cost.moved == 2 and cost.download_gb == pytest.approx(3.75 + 6.25)
    # the slowest download: c's 3.75 GB over 100 Mbit/s is 300 s (b2's 6.25 GB over 1000 Mbit/s, 50 s)
    assert cost.seconds == pytest.approx(MOVE_PAUSE_S + 300.0)

    shifted = [[("a", (0, 12)), ("b", (12, 32))]]
    cost = move_cost(in_force, shifted, links, PRICE)
    # both change place; a holds 0:12 already, b downloads 12:16
    assert (cost.moved, cost.download_gb) == (2, pytest.approx(4 * 10.0 / 32))
    assert cost.seconds == pytest.approx(MOVE_PAUSE_S + 8000 * 1.25 / 400)


def test_the_plan_in_force_costs_nothing_and_so_does_dropping_a_cluster():
    in_force = [[("a", (0, 16)), ("b", (16, 32))], [("c", (0, 16)), ("d", (16, 32))]]
    links = {name: 400.0 for name in "abcd"}
    assert move_cost(in_force, in_force, links, PRICE) == MoveCost(0.0, 0.0, 0)
    # the kept cluster trains on, the last one or renumbered into the dropped one's gap (``follow_clusters``)
    assert move_cost(in_force, in_force[:1], links, PRICE) == MoveCost(0.0, 0.0, 0)
    assert move_cost(in_force, in_force[1:], links, PRICE) == MoveCost(0.0, 0.0, 0)
    # the same layers in a cluster of other stages is another place: its neighbours change
    swapped = [[("a", (0, 16)), ("d", (16, 32))], [("c", (0, 16)), ("b", (16, 32))]]
    assert move_cost(in_force, swapped, links, PRICE) == MoveCost(MOVE_PAUSE_S, 0.0, 4)
    # a peer without a link never finishes its download
    assert move_cost([], in_force[:1], {"a": 0.0, "b": 400.0}, PRICE).seconds == float("inf")


def test_a_plan_is_adopted_only_when_its_gain_pays_back_the_samples_its_moves_lose():
    # (new - current) x horizon > new x move seconds
    assert pays_back(current=9.0, proposed=12.0, move_seconds=210.0, horizon_s=3600.0)  # 10800 > 2520
    assert not pays_back(current=9.0, proposed=12.0, move_seconds=210.0, horizon_s=600.0)  # 1800 < 2520
    assert horizon_throughput(12.0, 210.0, 600.0) == pytest.approx(7.8)
    assert horizon_throughput(12.0, 900.0, 600.0) == 0.0  # a move longer than the horizon is worth nothing
    assert not pays_back(current=9.0, proposed=9.0, move_seconds=0.0, horizon_s=600.0)  # no gain, no change
    assert not pays_back(current=9.0, proposed=9.0 * (1 + 1e-12), move_seconds=0.0, horizon_s=600.0)  # round-off
    with pytest.raises(ValueError, match="move horizon"):
        MovePrice((1.0,), horizon_s=0.0)


def test_the_spec_carries_the_horizon_and_refuses_one_out_of_bounds():
    key = RSAPrivateKey()
    assert RunSpec("mlp-digits").record(key, "demo")["move_horizon_s"] == 600.0
    assert RunSpec.from_record(RunSpec("mlp-digits", move_horizon_s=3600.0).record(key, "demo")).move_horizon_s == 3600.0
    for bad in (0.0, float("nan"), 1e8, "600"):
        with pytest.raises(pydantic.ValidationError):
            RunSpecRecord.parse_obj(dict(RunSpec("mlp-digits").record(key, "demo"), move_horizon_s=bad))


def test_a_plan_in_force_that_lost_a_peer_has_no_throughput_to_keep():
    plan = {"round": 1, "time": 0.0, "clusters": [[{"peer_id": "a", "layers": [0, 16]},
                                                   {"peer_id": "b", "layers": [16, 32]}]]}
    assert in_force_throughput(plan, EQUAL, WORKLOAD) == swarm_throughput([[EQUAL["a"], EQUAL["b"]]], WORKLOAD)
    assert in_force_throughput(plan, {"a": EQUAL["a"]}, WORKLOAD) is None
    assert in_force_throughput(None, EQUAL, WORKLOAD) is None


def _columns(arrays, clusters):
    """An assignment (cluster id per column) of clusters given as peer ids."""
    column_of = {EQUAL_IDS[i]: column for column, i in enumerate(arrays.peer_index)}
    assignment = np.full(arrays.size, -1, dtype=np.int32)
    for number, cluster in enumerate(clusters):
        assignment[[column_of[i] for i in cluster]] = number
    return assignment


EQUAL_IDS = sorted(EQUAL)


def _weighed_arrays(in_force):
    arrays = SwarmArrays([EQUAL[i] for i in EQUAL_IDS], WORKLOAD)
    column_of = {EQUAL_IDS[i]: column for column, i in enumerate(arrays.peer_index)}
    arrays.weigh_moves([([column_of[i] for i in cluster], len(cluster)) for cluster in in_force], PRICE)
    return arrays


def test_the_ga_objective_counts_moves_so_keeping_placed_peers_wins_a_tie():
    """{a,b}+{c,d} and {a,c}+{b,d} have the same throughput; with {a,b}+{c,d} in force only the latter moves
    anyone (an even share, 5 GB each over 400 Mbit/s: 100 s, plus the pause), and the vectorised estimate
    agrees with the exact ``move_cost`` here, where every moved peer downloads half of the model."""
    in_force = [["a", "b"], ["c", "d"]]
    plain = SwarmArrays([EQUAL[i] for i in EQUAL_IDS], WORKLOAD)
    arrays = _weighed_arrays(in_force)
    population = np.stack([_columns(arrays, in_force), _columns(arrays, [["a", "c"], ["b", "d"]]),
                           _columns(arrays, [["a", "b"]])])
    raw, _, _ = plain.evaluate(population.copy())
    assert raw[0] == pytest.approx(raw[1])
    weighed, _, _ = arrays.evaluate(population.copy())
    assert weighed[0] == pytest.approx(raw[0])
    assert weighed[1] == pytest.approx(raw[1] * (600.0 - MOVE_PAUSE_S - 100.0) / 600.0)
    assert weighed[2] == pytest.approx(raw[2])  # dropping a cluster stops nobody

    pricing = Pricing(WORKLOAD, uniform_layers(32, WORKLOAD), PRICE)
    record = {"round": 1, "time": 0.0, "clusters": [
        [{"peer_id": s.peer_id, "layers": list(s.layers)} for s in stages]
        for _, stages in price_plan(in_force, EQUAL, None, pricing).plan.clusters]}
    swapped = price_plan([["a", "c"], ["b", "d"]], EQUAL, record, pricing)
    assert swapped.value == pytest.approx(weighed[1])


def test_weighing_moves_only_lowers_fitness_and_never_that_of_the_plan_in_force():
    rng = np.random.default_rng(3)
    peers = [Peer(f"p{i}", float(rng.uniform(2, 8)), float(rng.uniform(10, 80)), float(rng.uniform(50, 500)))
             for i in range(9)]
    plain = SwarmArrays(peers, WORKLOAD)
    in_force = greedy_plan(plain)  # a plan the evaluation keeps whole
    clusters = [np.flatnonzero(in_force == k).tolist() for k in range(in_force.max() + 1)]
    assert len(clusters) >= 2
    weighed = SwarmArrays(peers, WORKLOAD)
    weighed.weigh_moves([(cluster, len(cluster)) for cluster in clusters], PRICE)
    population = rng.integers(-1, plain.max_clusters, size=(200, plain.size)).astype(np.int32)
    population[0] = in_force
    raw, _, _ = plain.evaluate(population.copy())
    priced, _, _ = weighed.evaluate(population.copy())
    assert priced[0] == raw[0] > 0
    assert np.all(priced <= raw) and np.any((priced < raw) & (raw > 0))


def test_the_ga_started_from_a_reshuffled_plan_returns_to_the_placed_peers_places():
    in_force = [["a", "b"], ["c", "d"]]
    arrays = _weighed_arrays(in_force)
    ga = IslandGA(arrays, _columns(arrays, [["a", "c"], ["b", "d"]]), seed=0,
                  config=GAConfig(islands=2, population=16, max_generations=300, stall_generations=100))
    best = ga.run()
    found = sorted(sorted(EQUAL_IDS[i] for i in cluster) for cluster in assignment_clusters(arrays, best))
    assert found == in_force


# real processes: planning-only volunteers (docs/planning.md), the model of tests/test_planning_round.py
CAPABILITIES = {"v0": (6, 50, 400), "v1": (6, 40, 400), "v2": (5, 60, 300), "v3": (5, 30, 400), "v4": (12, 120, 400)}


def start_planner(processes, backbone, run, name):
    ram, gflops, bandwidth = CAPABILITIES[name]
    return processes.start([
        "join", "--initial-peers", backbone, "--run", run, "--name", name, "--ram-gb", str(ram),
        "--gflops", str(gflops), "--bandwidth-mbps", str(bandwidth), "--heartbeat", "2", "--no-dashboard",
        "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--model-gb", "10", "--gflop-per-sample", "20",
        "--activation-mb", "4", "--min-peers", "4", "--round-seconds", "8", "--move-horizon", "600",
    ], name)


def placements(backbone, run):
    out = ravnest("status", "--initial-peers", backbone, "--run", run, "--json", timeout=60)
    return {p["name"]: (p.get("plan_round"), p.get("cluster"), p.get("stage"), tuple(p.get("layers") or ()))
            for p in json.loads(out.stdout.strip().splitlines()[-1])["peers"]}


@pytest.mark.timeout(180)
def test_a_joiner_that_cannot_pay_back_its_moves_opens_no_round_and_moves_nobody(processes, backbone):
    """v0..v3 plan one cluster (9 samples/s). v4 could add a cluster (12 samples/s) only by downloading its
    10 GB over 400 Mbit/s (200 s) plus the pause, which a 600 s horizon does not pay back (7.8 < 9): every
    peer weighs it once and says so, no round 2 opens, and every placed peer keeps its place."""
    run = "moves"
    planners = {name: start_planner(processes, backbone, run, name) for name in ("v0", "v1", "v2", "v3")}
    for process in planners.values():
        process.wait_for_output(r"adopted plan round 1 fitness \S+ hash \S+ clusters 1 ", 90, stream="stderr")
    deadline = time.monotonic() + 30
    while True:
        before = placements(backbone, run)
        if all(before.get(name, (None,))[0] == 1 for name in planners) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert all(before[name][0] == 1 and before[name][1] == 0 for name in planners), before

    planners["v4"] = start_planner(processes, backbone, run, "v4")
    for name, process in planners.items():
        process.wait_for_output(r"standby v4 opened no round: their best plan \(1\.2\d*e\+01 samples/s\) would move "
                                r"1 peer\(s\) for 210\.0s and not pay that back within 600s over the plan in force "
                                r"\(9\.0+e\+00\)", 60, stream="stderr")
    time.sleep(6)  # three more looks of every peer's trigger
    for name, process in planners.items():
        assert not re.search(r"round 2 (opened|joined)|adopted plan round 2", process.stderr()), name
    after = placements(backbone, run)
    assert {name: after[name] for name in before} == before
    assert after["v4"][0] is None and after["v4"][3] == ()  # placed by no plan: a standby with no layers


def test_the_peers_a_plan_keeps_in_place_are_those_of_kept_clusters_whatever_their_number():
    """A plan that drops a cluster keeps every other where it is, the one renumbered into its gap too: its stages
    follow the new number in place (``StageWorker.follow_clusters``). Before, a renumbered cluster restarted its
    stages, and a walkthrough's drop said '10.0s without training'. The volunteer (``placement.kept_in_place``),
    the round's price (``move_cost``) and the GA's estimate agree on it."""
    ab, cd, ef = [("a", (0, 16)), ("b", (16, 32))], [("c", (0, 16)), ("d", (16, 32))], [("e", (0, 32))]
    assert kept_places([ab, cd], [ab]) == {"a", "b"}
    assert kept_places([ab, cd, ef], [ab, ef]) == {"a", "b", "e"}  # e: cluster 2 is cluster 1 now
    # a joiner in a gone peer's place: the others keep theirs; a peer moved in from another cluster: they restart
    assert kept_places([ab, cd], [ab, [("c", (0, 16)), ("x", (16, 32))]]) == {"a", "b", "c"}
    assert kept_places([ab, cd], [[("c", (0, 16)), ("b", (16, 32))]]) == set()
    # mates swapped, or other layers: those stages move (restart, or download), they do not train on
    assert kept_places([ab, cd], [[("a", (0, 16)), ("d", (16, 32))], [("c", (0, 16)), ("b", (16, 32))]]) == set()
    assert kept_places([ab], [[("a", (0, 12)), ("b", (12, 32))]]) == set()
