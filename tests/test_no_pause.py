"""No pause for planning (issue 33): a plan that keeps a peer's stage where it was (same cluster, stage and layers)
leaves its stage worker running. Before, a placed peer stopped and restarted its worker whenever the adopted plan
changed anything about it, such as the number of clusters when a joiner formed one more."""

import asyncio
import re
import time
from types import SimpleNamespace as Request
import pytest

from ravnest_swarm.models.data import ShardedSampler
from ravnest_swarm.pipeline.config import StageConfig
from ravnest_swarm.pipeline.messaging import MessageError
from ravnest_swarm.pipeline.worker import StageWorker
from ravnest_swarm.planning.moves import kept_cluster_numbers
from ravnest_swarm.swarm.placement import kept_in_place
from ravnest_swarm.swarm.spec import cluster_lr
from test_swarm import placed, swarm  # noqa: F401 (a fixture)

KEPT = ("p0", "p1")
ROUND_SECONDS = 6  # test_swarm's join


def test_a_stage_is_kept_in_place_by_a_plan_of_more_or_fewer_clusters_whatever_its_number():
    def plan(*clusters):
        return dict(round=1, clusters=stages(*clusters))

    ab, c, d = [("a", 0, 4), ("b", 4, 9)], [("c", 0, 9)], [("d", 0, 9)]
    assert kept_in_place(plan(ab), plan(ab, c), "a")  # one cluster more
    assert kept_in_place(plan(c, ab), plan(ab), "b")  # cluster 1 is cluster 0 now: it trains on
    assert kept_in_place(plan(ab, c), plan([("a", 0, 4), ("d", 4, 9)], c), "a")  # d takes gone b's place
    # c, placed before, took gone b's place: it brings a step of its own, so the re-formed cluster starts anew
    assert not kept_in_place(plan(ab, c), plan([("a", 0, 4), ("c", 4, 9)]), "a")
    assert not kept_in_place(plan(ab, c), plan([("a", 0, 4), ("c", 4, 9)], [("b", 0, 9)]), "a")  # mates swapped
    assert not kept_in_place(plan(ab), plan([("a", 0, 5), ("b", 5, 9)]), "a")  # other layers
    assert not kept_in_place(plan(ab), plan(c, d), "a") and not kept_in_place(None, plan(ab), "a")


def test_a_running_worker_follows_a_new_number_of_clusters_and_its_own_new_number_from_its_next_step():
    # not started: following the clusters touches neither the network nor the compute thread
    worker = StageWorker(StageConfig(run="r", stage=0, stages=1, model="mlp-digits", layers=(0, 1), cluster=1,
                                     clusters=2), node=None)
    try:
        worker.resume_at(50)
        worker.compute.version = 70  # it trained 20 steps among 2 clusters
        asyncio.run(worker.follow_clusters(1, 3))
        assert worker.config.clusters == 3 and worker.clusters_since == 70  # warmup's lr rule counts from here
        # stage 0 draws cluster 1's share among 3 from its next microbatch
        assert worker.scheduler.sampler.sample_ids(71) == ShardedSampler(worker.scheduler.sampler.size, 1, 3,
                                                                         16).sample_ids(71)
        assert cluster_lr(0.1, 3, "warmup", worker.version - worker.clusters_since) == 0.1  # the ramp starts again
        # cluster 0 dropped: ours is cluster 0 of 2 now, its share of the data that one, its sends name it, and a
        # neighbour's message that still names cluster 1 is taken
        worker.compute.version = 90
        asyncio.run(worker.follow_clusters(0, 2))
        assert (worker.config.cluster, worker.config.clusters, worker.clusters_since) == (0, 2, 90)
        assert worker.outbox.resolver.cluster == 0
        assert worker.scheduler.sampler.sample_ids(91) == ShardedSampler(worker.scheduler.sampler.size, 0, 2,
                                                                         16).sample_ids(91)
        for cluster in (0, 1):
            worker.inbox._check_address(Request(run="r", cluster=cluster, stage=0))
        with pytest.raises(MessageError, match="cluster 2 stage 0, but this is run 'r' cluster 0 stage 0"):
            worker.inbox._check_address(Request(run="r", cluster=2, stage=0))
    finally:
        worker.compute.close()


def stages(*clusters):
    return [[dict(peer_id=peer, layers=[first, last]) for peer, first, last in cluster] for cluster in clusters]


def test_a_kept_cluster_keeps_its_number_in_a_new_plan():
    in_force = dict(round=1, clusters=stages([("a", 0, 9)], [("b", 0, 4), ("c", 4, 9)]))
    # the planner put the joiner's cluster first: the kept ones keep numbers 0 and 1, the new one takes 2
    new = stages([("d", 0, 9)], [("b", 0, 5), ("c", 5, 9)], [("a", 0, 9)])
    assert kept_cluster_numbers(new, in_force) == [new[2], new[1], new[0]]
    # a plan of fewer clusters: a kept cluster whose number is gone takes one left free
    in_force = dict(round=1, clusters=stages([("a", 0, 9)], [("b", 0, 9)], [("c", 0, 9)]))
    new = stages([("b", 0, 9)], [("d", 0, 9)])
    assert kept_cluster_numbers(new, in_force) == [new[1], new[0]]
    new = stages([("d", 0, 9)], [("c", 0, 9)])  # c's number 2 is gone
    assert kept_cluster_numbers(new, in_force) == new
    assert kept_cluster_numbers(new, None) == new  # the first plan has nothing to keep


@pytest.mark.timeout(300)
def test_training_goes_on_during_a_round_that_keeps_the_placed_peers(swarm):
    # each can hold the whole model: clusters of one stage, and a joiner forms a third cluster
    kept = {name: swarm(name, ram_fraction=1.5, steps=100_000, extra=("--min-peers", "2")) for name in KEPT}
    swarm.watcher.wait_for(lambda peers: len(placed(peers)) == 2 and
                           all((p.get("step") or 0) >= 100 for p in placed(peers).values()),
                           150, "two clusters past step 100")
    first_round = {name: swarm.watcher.peers()[name]["plan_round"] for name in KEPT}
    # what each kept peer's record says, read every half second from before the joiner until the new plan is followed
    looks = {name: [] for name in KEPT}

    def followed(peers):
        for name in KEPT:
            if name in peers:
                looks[name].append((peers[name]["state"], peers[name].get("step") or 0, peers[name].get("plan_round"),
                                    time.monotonic()))
        return all(looks[n] and looks[n][-1][2] > first_round[n] and
                   looks[n][-1][1] > min(step for _, step, round_, _ in looks[n] if round_ > first_round[n]) for n in KEPT)

    swarm("late", ram_fraction=1.5, steps=100_000, extra=("--min-peers", "2"))
    try:
        peers = swarm.watcher.wait_for(followed, 150, "the kept peers follow a new plan and train on", period=0.5)
    except TimeoutError as e:
        pytest.fail(f"{e}: {first_round} {looks} {kept['p0'].stderr()[-3000:]}")
    for name in KEPT:
        assert peers[name]["state"] in ("training", "averaging"), peers[name]
        seen = looks[name]
        # the record never left training (a restart says "training" again only after its download) and its step
        # never went back (a restarted worker counts from its layers' step)
        assert all(state in ("training", "averaging") for state, _, _, _ in seen), seen
        steps = [step for _, step, _, _ in seen]
        assert steps == sorted(steps), seen
        # it trained through the round: its step rose over the round's length (--round-seconds 6) before the plan
        adopted_at = next(at for _, _, plan_round, at in seen if plan_round > first_round[name])
        during = [step for _, step, _, at in seen if adopted_at - ROUND_SECONDS <= at < adopted_at]
        assert during and during[-1] > during[0], seen
        log = kept[name].stderr()
        assert len(re.findall(rf"{name}: training cluster", log)) == 1, log[-3000:]
        assert re.search(rf"{name}: plan round \d+ keeps us in place: cluster \d+ stage 0/1 layers \S+ trains on; "
                         rf"2 -> 3 clusters from its next step", log), log[-3000:]
        assert "Traceback" not in log


@pytest.mark.timeout(300)
def test_a_cluster_of_two_stages_renumbered_by_a_drop_trains_on_under_its_new_number(swarm):
    """Three clusters of two stages; SIGKILL of a stage of cluster 0. The plan that drops that cluster moves cluster
    2 into its gap: both of its stages follow the new number in place (one adopts it a moment before the other:
    messages naming either number get through) and train on, neither restarting nor losing a step. Before, both
    restarted (a renumbered cluster was another slot)."""
    extra = ("--min-peers", "6", "--max-stages", "2", "--checkpoint-every", "100000")
    volunteers = {f"p{i}": swarm(f"p{i}", steps=100_000, extra=extra) for i in range(6)}
    peers = swarm.watcher.wait_for(lambda peers: len(placed(peers)) == 6 and
                                   all((p.get("step") or 0) >= 30 for p in placed(peers).values()),
                                   200, "three clusters of two stages past step 30")
    assert sorted(p["cluster"] for p in placed(peers).values()) == [0, 0, 1, 1, 2, 2], peers
    killed = next(name for name, peer in placed(peers).items() if peer["cluster"] == 0)
    renumbered = sorted(name for name, peer in placed(peers).items() if peer["cluster"] == 2)
    plan_before = peers[renumbered[0]]["plan_round"]
    volunteers[killed].kill_group()
    for name in renumbered:
        volunteers[name].wait_for_output(rf"^{name}: plan round {plan_before + 1} keeps us in place: cluster 0 "
                                         rf"\(cluster 2 before\) stage [01]/2 layers \d+:\d+ trains on; "
                                         r"3 -> 2 clusters",
                                         120, stream="stderr")
    steps_then = {name: swarm.watcher.peers()[name]["step"] for name in renumbered}
    swarm.watcher.wait_for(lambda peers: all(peers[name]["cluster"] == 0 and peers[name]["step"] > steps_then[name] + 50
                                             for name in renumbered), 90, "the renumbered cluster trains on")
    for name in renumbered:
        log = volunteers[name].stderr()
        assert len(re.findall(rf"{name}: training cluster", log)) == 1, log[-3000:]  # its first start, no other
        assert "Traceback" not in log and "unexpected" not in log, name
