"""A graceful leave hands the leaver's work over: real `join` processes, SIGINT, the standby takes the layers."""

import os
import re
import signal
import time

import pytest
import torch

from test_swarm import RUN, checkpoint_layers, placed, swarm  # noqa: F401 (the fixture)


@pytest.mark.timeout(300)
def test_sigint_hands_the_layers_over_to_the_standby_at_the_leavers_step(swarm):
    # two stages at most per cluster and RAM for 0.6 of the model each: one cluster of two and a standby
    extra = ("--min-peers", "3", "--max-stages", "2", "--checkpoint-every", "100000")
    volunteers = {f"p{i}": swarm(f"p{i}", steps=100_000, extra=extra, gflops=20 + 5 * i) for i in range(3)}
    peers = swarm.watcher.wait_for(lambda peers: len(peers) == 3 and len(placed(peers)) == 2 and
                                   all((p.get("step") or 0) >= 30 for p in placed(peers).values()),
                                   200, "one cluster of two past step 30 and a standby")
    (standby,) = [n for n in peers if n not in placed(peers)]
    leaver = sorted(placed(peers))[0]
    # Ctrl-C in a terminal: the signal reaches the peer's whole process group, its p2pd too (which once died of
    # it at once, so the leaver had no network left to hand its layers over with)
    os.killpg(volunteers[leaver].pid, signal.SIGINT)

    volunteers[leaver].wait_for_output(rf"{leaver}: stopping\.\.\.", 5, stream="stderr")
    handed = volunteers[leaver].wait_for_output(
        rf"{leaver}: layers \d+:\d+ handed over at step (\d+) to (.+)$", 150, stream="stderr")
    assert volunteers[leaver].wait(30) == 0
    step = int(handed.group(1))
    assert standby in handed.group(2).split(", ")
    assert step >= peers[leaver]["step"] >= 30
    # the standby continues from the leaver's step, not from 0, with the leaver's own weights
    volunteers[standby].wait_for_output(rf"{standby}: training cluster \d+ stage \d+/2 layers \d+:\d+ from step {step}\b",
                                        5, stream="stderr")
    assert "nobody took" not in volunteers[leaver].stderr()
    left, left_step = checkpoint_layers(swarm.checkpoints / f"{RUN}-{leaver}.safetensors")
    taken, taken_step = checkpoint_layers(swarm.checkpoints / f"{RUN}-{standby}.safetensors")
    assert left_step == taken_step == step
    common = set(left) & set(taken)
    assert common, (sorted(left), sorted(taken))
    for layer in common:
        for key, tensor in left[layer].items():
            assert torch.equal(tensor, taken[layer][key]), (layer, key)
    swarm.watcher.wait_for(lambda peers: leaver not in peers and peers[standby].get("step", 0) > step + 10,
                           90, "the cluster trains on past the hand-over")


@pytest.mark.timeout(330)
def test_the_standby_in_a_leavers_place_in_a_cluster_that_trains_on_takes_the_leavers_layers_at_its_step(swarm):
    """Two clusters of two stages and a standby (all alike: the plan then moves nobody else; with compute of 20 to
    40 GFLOP/s, one re-formed both clusters around the standby); a later stage leaves by Ctrl-C, and the standby
    takes its place beside a first stage that trains on. It takes the leaver's own layers at the leaver's step, bit
    for bit, which its neighbour is at and which the leaver's optimizer state goes with. Before, it took the freshest
    copy: a walkthrough's taker loaded the other cluster's live weights, 20,000 steps on, with the leaver's AdamW
    moments."""
    extra = ("--min-peers", "5", "--max-stages", "2", "--checkpoint-every", "100000")
    volunteers = {f"p{i}": swarm(f"p{i}", steps=100_000, extra=extra) for i in range(5)}
    peers = swarm.watcher.wait_for(lambda peers: len(peers) == 5 and len(placed(peers)) == 4 and
                                   len({p["cluster"] for p in placed(peers).values()}) == 2 and
                                   all((p.get("averaging_rounds") or 0) >= 2 for p in placed(peers).values()),
                                   240, "two clusters of two that averaged twice, and a standby")
    (standby,) = [n for n in peers if n not in placed(peers)]
    leaver = min(n for n, p in placed(peers).items() if p["stage"] == 1)
    os.killpg(volunteers[leaver].pid, signal.SIGINT)
    handed = volunteers[leaver].wait_for_output(rf"{leaver}: layers \d+:\d+ handed over at step (\d+) to (.+)$", 150,
                                                stream="stderr")
    step = int(handed.group(1))
    volunteers[standby].wait_for_output(rf"^{standby}: training cluster {peers[leaver]['cluster']} stage 1/2 layers "
                                        rf"\d+:\d+ from step {step} on cpu; its layers are live weights of step {step} "
                                        rf"of {leaver}, whose place it takes$", 60, stream="stderr")
    assert volunteers[leaver].wait(30) == 0
    left, left_step = checkpoint_layers(swarm.checkpoints / f"{RUN}-{leaver}.safetensors")
    assert left_step == step
    # the standby's checkpoint right after its download holds the leaver's weights
    taken, taken_step = checkpoint_layers(swarm.checkpoints / f"{RUN}-{standby}.safetensors")
    assert taken_step == step and set(taken) == set(left), (taken_step, sorted(taken), sorted(left))
    for layer in left:
        for key, tensor in left[layer].items():
            assert torch.equal(tensor, taken[layer][key]), (layer, key)
    for name in volunteers:
        assert "Traceback" not in volunteers[name].stderr() and "unexpected" not in volunteers[name].stderr(), name
        # the run's first stages start from the seeded weights, not from a neighbour's copy of them at step 0
        assert "its layers are live weights of step 0" not in volunteers[name].stderr(), name


@pytest.mark.timeout(200)
def test_a_leaver_nobody_can_replace_keeps_its_layers_in_a_checkpoint_and_the_cluster_says_what_it_waits_for(swarm):
    extra = ("--min-peers", "2", "--max-stages", "2", "--handover-timeout", "10")
    volunteers = {f"p{i}": swarm(f"p{i}", steps=100_000, extra=extra) for i in range(2)}
    swarm.watcher.wait_for(lambda peers: len(placed(peers)) == 2 and
                           all((p.get("step") or 0) >= 10 for p in placed(peers).values()), 150, "a cluster of two")
    volunteers["p0"].signal(signal.SIGINT)
    assert volunteers["p0"].wait(40) == 0
    said = volunteers["p0"].stderr()
    match = re.search(r"p0: nobody took layers \d+:\d+ \(step (\d+)\); they are saved in (\S+): bring them back with "
                      r"`ravnest-swarm join \.\.\. --run " + RUN + r"@[0-9a-f]{16} --name p0 --checkpoint-dir \S+ --resume`",
                      said)  # the run's address names its owner, as a joiner gives it
    assert match, said[-2000:]
    assert match.group(2) == str(swarm.checkpoints / f"{RUN}-p0.safetensors")
    assert checkpoint_layers(match.group(2))[1] == int(match.group(1))
    # the stage left behind says what its cluster waits for, once, instead of stalling in silence
    volunteers["p1"].wait_for_output(r"^p1: cluster 0 is waiting at step \d+: stage \d+ \(layers \d+:\d+\) needs a "
                                     r"peer with [\d.]+ MB \(its peer is gone", 60, stream="stderr")


@pytest.mark.timeout(300)
def test_a_standby_that_joined_after_the_round_replaces_a_leaver_in_the_next_round_with_the_others(swarm):
    """The standby joins after the cluster formed, as in a real run: it took part in no round, so what it knows of
    the plan is what it sees its peers follow. Half of a cluster of two that leaves is no majority of the plan's
    stages; the standby once took that for no plan at all and opened rounds numbered 1 while the remaining peer
    opened round 2, each alone, for good: nobody took the leaver's layers and the cluster waited forever. One
    round now follows the leave, numbered after the plan the cluster followed; both adopt it and train on."""
    extra = ("--min-peers", "2", "--max-stages", "2", "--checkpoint-every", "100000")
    volunteers = {f"p{i}": swarm(f"p{i}", steps=100_000, extra=extra, gflops=20 + 5 * i) for i in range(2)}
    swarm.watcher.wait_for(lambda peers: len(placed(peers)) == 2, 200, "one cluster of two")
    volunteers["p2"] = swarm("p2", steps=100_000, extra=extra, gflops=30)
    peers = swarm.watcher.wait_for(lambda peers: len(peers) == 3 and len(placed(peers)) == 2 and
                                   all((p.get("step") or 0) >= 30 for p in placed(peers).values()),
                                   200, "one cluster of two past step 30 and a standby")
    (standby,) = [n for n in peers if n not in placed(peers)]
    leaver, stayer = sorted(placed(peers))
    followed = peers[stayer]["plan_round"]
    os.killpg(volunteers[leaver].pid, signal.SIGINT)
    handed = volunteers[leaver].wait_for_output(rf"{leaver}: layers \d+:\d+ handed over at step (\d+) to (.+)$", 150,
                                                stream="stderr")
    assert set(handed.group(2).split(", ")) <= {standby, stayer}
    step = int(handed.group(1))
    swarm.watcher.wait_for(lambda peers: leaver not in peers and len(placed(peers)) == 2 and
                           all((p.get("step") or 0) > step + 10 for p in placed(peers).values()),
                           90, "the standby and the stayer train on past the hand-over")

    def adopted_rounds(name):
        said = volunteers[name].stdout() + volunteers[name].stderr()
        return {int(r) for r in re.findall(r"adopted plan round (\d+)", said)}

    after = adopted_rounds(stayer) - set(range(followed + 1))
    assert after and adopted_rounds(standby) == after, (followed, adopted_rounds(stayer), adopted_rounds(standby))


@pytest.mark.timeout(300)
def test_a_ctrl_c_in_a_run_of_two_clusters_averages_the_leavers_work_into_the_run_before_it_goes(swarm):
    """Two clusters of one stage. The leaver trains on to its stage's next round and takes it with the other cluster
    before it stops: that round's average, which the stayer took, holds every step the leaver trained, and the
    stayer holds its layers (nothing of them is the leaver's alone), so it hands over at once and exits 0.
    Before, it stopped at once: what it trained since its last round went nowhere but its checkpoint."""
    extra = ("--min-peers", "2", "--max-stages", "1", "--checkpoint-every", "100000")
    volunteers = {f"p{i}": swarm(f"p{i}", ram_fraction=1.2, steps=100_000, extra=extra) for i in range(2)}
    swarm.watcher.wait_for(lambda peers: len(placed(peers)) == 2 and
                           all((p.get("averaging_rounds") or 0) >= 2 for p in placed(peers).values()),
                           200, "two clusters of one stage that averaged twice")
    os.killpg(volunteers["p1"].pid, signal.SIGINT)
    last = volunteers["p1"].wait_for_output(r"^p1: our last averaging round \(round (\d+), our step (\d+)\) averaged: "
                                            r"the run's average holds what we trained$", 60, stream="stderr")
    label, step = int(last.group(1)), int(last.group(2))
    volunteers["p1"].wait_for_output(rf"^p1: layers 0:\d+ handed over at step {step} to p0$", 30, stream="stderr")
    assert volunteers["p1"].wait(30) == 0
    # the stayer took the same round: every segment of it averaged, with the leaver's values in it
    volunteers["p0"].wait_for_output(rf"averaging step {label}: 1/1 segments averaged", 10, stream="stderr")
    said = volunteers["p1"].stderr()
    assert "nobody took" not in said and "without a last averaging round" not in said, said[-2000:]
    assert said.index("leaving after our stage's next averaging round") < said.index("handing over layers")
    left, left_step = checkpoint_layers(swarm.checkpoints / f"{RUN}-p1.safetensors")
    assert left_step == step  # the checkpoint it kept is of the round's step, as the state it handed over
    for name in volunteers:
        assert "Traceback" not in volunteers[name].stderr() and "unexpected" not in volunteers[name].stderr(), name


FAILED_ROUND = re.compile(r"averaging at step \d+ failed: (.*)$", re.M)


@pytest.mark.timeout(300)
def test_the_partners_of_a_graceful_leaver_lose_no_averaging_round_to_its_leave(swarm):
    """Three clusters of one stage, rounds beside training. A Ctrl-C of cluster 0's peer: after its last round, the
    others begin the next with it still in their rings; once it has gone, their rings go on without it (its record
    says it leaves), and no round fails. Before, planning's finding it gone gave up that round at each of them: one
    failed round per partner per leave (both walkthroughs, and every soak's Ctrl-C). The plan that drops its cluster
    renumbers cluster 2 into the gap, and that one trains on under its new number: before, it restarted its stage,
    and a partner's round failed against it meanwhile."""
    extra = ("--min-peers", "3", "--max-stages", "1", "--checkpoint-every", "100000")
    volunteers = {f"p{i}": swarm(f"p{i}", ram_fraction=1.2, steps=100_000, extra=extra) for i in range(3)}
    peers = swarm.watcher.wait_for(lambda peers: len(placed(peers)) == 3 and
                                   all((p.get("averaging_rounds") or 0) >= 3 for p in placed(peers).values()),
                                   200, "three clusters of one stage that averaged three times")
    (leaver,) = [name for name, peer in placed(peers).items() if peer["cluster"] == 0]
    (last,) = [name for name, peer in placed(peers).items() if peer["cluster"] == 2]
    stayers = sorted(set(volunteers) - {leaver})
    plan_before = peers[last]["plan_round"]
    failed_before = {name: len(FAILED_ROUND.findall(volunteers[name].stderr())) for name in stayers}
    os.killpg(volunteers[leaver].pid, signal.SIGINT)
    volunteers[leaver].wait_for_output(rf"^{leaver}: our last averaging round \(round \d+, our step \d+\) averaged", 60,
                                       stream="stderr")
    assert volunteers[leaver].wait(30) == 0
    # planning finds the leaver gone within a few polls, while a round beside training is in flight at nearly every
    # moment; then a plan round drops its cluster, the others train on: ten rounds each after that cover both
    volunteers[last].wait_for_output(rf"^{last}: plan round {plan_before + 1} keeps us in place: cluster 0 \(cluster 2 "
                                     r"before\) stage 0/1 layers 0:\d+ trains on; 3 -> 2 clusters", 90, stream="stderr")
    averaged_then = {name: volunteers[name].stderr().count("segments averaged") for name in stayers}
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and any(volunteers[name].stderr().count("segments averaged") <
                                              averaged_then[name] + 10 for name in stayers):
        time.sleep(0.5)
    for name in stayers:
        said = volunteers[name].stderr()
        assert said.count("segments averaged") >= averaged_then[name] + 10, (name, said[-3000:])
        assert FAILED_ROUND.findall(said)[failed_before[name]:] == [], (name, said[-3000:])
        assert f"round {plan_before + 1} moves nobody: the clusters it keeps train on" in said, name
        assert "Traceback" not in said and "unexpected" not in said, name
    assert f"{last}: training cluster" not in volunteers[last].stderr().split("keeps us in place")[-1]


@pytest.mark.timeout(300)
def test_standbys_placed_when_the_only_cluster_leaves_go_on_from_its_step_not_from_their_old_copies(swarm):
    """Two clusters of one stage; a third peer whose claimed compute makes it the only cluster, so the two stand by
    with copies of the step they stopped at. A Ctrl-C of it: the next plan places the two again, and both take the
    leaver's layers at its step. Before, they took their own copies (the plans vouched for them, and not for the
    leaver, which the new plan no longer names): a walkthrough lost 17,000 steps so, and the leaver said nobody
    took its layers."""
    extra = ("--min-peers", "2", "--max-stages", "1", "--checkpoint-every", "100000")
    volunteers = {f"p{i}": swarm(f"p{i}", ram_fraction=1.2, steps=100_000, extra=extra) for i in range(2)}
    swarm.watcher.wait_for(lambda peers: len(placed(peers)) == 2 and
                           all((p.get("step") or 0) >= 30 for p in placed(peers).values()), 200, "two clusters")
    volunteers["p2"] = swarm("p2", ram_fraction=1.2, steps=100_000, extra=extra, gflops=2000)
    peers = swarm.watcher.wait_for(lambda peers: set(placed(peers)) == {"p2"} and all(
        peers[name].get("state") == "standby" for name in ("p0", "p1")) and (peers["p2"].get("step") or 0) >= max(
        peers[name].get("step") or 0 for name in ("p0", "p1")) + 300, 200, "p2 alone 300 steps past the standbys")
    stale = max(peers[name]["step"] for name in ("p0", "p1"))
    os.killpg(volunteers["p2"].pid, signal.SIGINT)
    handed = volunteers["p2"].wait_for_output(r"p2: layers \d+:\d+ handed over at step (\d+) to (.+)$", 150,
                                              stream="stderr")
    assert volunteers["p2"].wait(30) == 0
    step = int(handed.group(1))
    assert step >= stale + 300 and set(handed.group(2).split(", ")) <= {"p0", "p1"}, handed.group(0)
    assert "nobody took" not in volunteers["p2"].stderr()
    for name in set(handed.group(2).split(", ")):
        volunteers[name].wait_for_output(rf"{name}: training cluster \d+ stage 0/1 layers 0:\d+ from step {step}\b",
                                         5, stream="stderr")


@pytest.mark.timeout(300)
def test_a_leave_whose_cluster_mate_already_stands_still_at_its_last_round_stops_waiting_for_its_own(swarm):
    """Two clusters of two stages. A Ctrl-C of one cluster's first stage: it takes its last round and stands still,
    so its cluster-mate never steps again. Ctrl-C of the mate then: its next round is out of reach, and its records
    say why; it leaves within seconds, not after the 15 s stall bound (at a soak's end every peer is stopped at once,
    and such a wait plus a hand-over once ran past the bench's grace)."""
    extra = ("--min-peers", "4", "--max-stages", "2", "--checkpoint-every", "100000", "--handover-timeout", "30")
    volunteers = {f"p{i}": swarm(f"p{i}", steps=100_000, extra=extra) for i in range(4)}
    peers = swarm.watcher.wait_for(lambda peers: len(placed(peers)) == 4 and
                                   all((p.get("averaging_rounds") or 0) >= 2 for p in placed(peers).values()),
                                   200, "two clusters of two stages that averaged twice")
    first, mate = sorted((n for n, p in placed(peers).items() if p["cluster"] == 0), key=lambda n: peers[n]["stage"])
    os.killpg(volunteers[first].pid, signal.SIGINT)
    volunteers[first].wait_for_output(rf"^{first}: our last averaging round \(round \d+, our step \d+\) averaged",
                                      60, stream="stderr")
    os.killpg(volunteers[mate].pid, signal.SIGINT)
    asked = time.monotonic()
    volunteers[mate].wait_for_output(rf"^{mate}: leaving without a last averaging round \({first} of our cluster "
                                     r"(stands still at its own last round, before ours|stopped its stage)\)$", 12,
                                     stream="stderr")
    assert time.monotonic() - asked < 12
    for name in (first, mate):
        assert volunteers[name].wait(40) == 0, name
        assert "Traceback" not in volunteers[name].stderr(), name


# ---- the leaver's rule, without a network ---------------------------------------------------------------------

def leave(peers, served_over_time, tmp_path, ours_alone=frozenset(range(4)), timeout=2.5, planned=None,
          last_round=None):
    """Run ``hand_over`` for a stage of layers 0:4 at step 10 against fixed peer records, our state server having
    served each layer whole as ``served_over_time`` says, one dict per second (layer -> times, to "taker"; or
    (requester, layer) -> times), the plans placing ``planned`` (anyone where None); what it said and saved."""
    import asyncio
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from ravnest_swarm.swarm.hand_over import hand_over

    async def no_renewal():
        return True

    async def read_peers():
        return peers

    started = []

    def served():
        elapsed = asyncio.get_running_loop().time() - started[0]
        counts = served_over_time[min(int(elapsed), len(served_over_time) - 1)]
        return {key if isinstance(key, tuple) else ("taker", key): count for key, count in counts.items()}

    async def placed():
        return set(planned)

    announcer = SimpleNamespace(peer_id="me", run=RUN, update=lambda **fields: None, renew=no_renewal,
                                read_peers=read_peers)
    worker = SimpleNamespace(start_layer=0, end_layer=4, version=10)
    output, saved = io.StringIO(), []

    async def scenario():
        started.append(asyncio.get_running_loop().time())
        await hand_over(announcer, worker, "leaver", Console(file=output), timeout, asyncio.Event(),
                        str(tmp_path / "stage.safetensors"), lambda w, path: saved.append(path) or True, RUN,
                        served=served, ours_alone=ours_alone, planned=None if planned is None else placed,
                        last_round=last_round)

    asyncio.run(scenario())
    return output.getvalue(), saved


def record(peer_id, layers, step, state="training"):
    return dict(peer_id=peer_id, name=peer_id, state=state, layers=layers, step=step)


def test_a_leaver_that_alone_held_its_layers_goes_only_once_a_copy_of_each_went_out_whole(tmp_path):
    """A taker whose download failed says it holds our layers at our step all the same (it keeps in step with its
    cluster, training on from its own weights): the leaver, the run's only holder, went with the layers."""
    taker = [record("taker", [0, 4], 10)]
    said, _ = leave(taker, [{}], tmp_path)  # nothing went out whole: its record is not enough
    assert "nobody took layers 0:4" in said, said
    said, _ = leave(taker, [{}, {0: 1, 1: 1, 2: 1, 3: 1}], tmp_path)  # each layer served whole after a second
    assert "handed over at step 10 to taker" in said, said
    said, _ = leave(taker, [{}, {0: 1, 1: 1, 2: 1}], tmp_path)  # layer 3 never went out
    assert "nobody took layers 0:4" in said, said


def test_a_strangers_record_and_download_take_no_leave_over(tmp_path):
    """A hostile review: a stranger published its own record claiming every layer at step 2**53 and downloaded each
    of the leaver's layers whole; the leaver said it handed over to the stranger and went with the run's only copy.
    Only a peer a plan places takes a leave over, and only its downloads count."""
    stranger = record("stranger", [0, 100000], 2**53, state="standby")
    said, saved = leave([stranger], [{("stranger", layer): 1 for layer in range(4)}], tmp_path, planned={"me"})
    assert "nobody took layers 0:4" in said and saved == [], said
    taker = record("taker", [0, 4], 10)
    said, _ = leave([stranger, taker], [{}, {("stranger", layer): 1 for layer in range(4)}], tmp_path,
                    planned={"me", "taker"})
    assert "nobody took layers 0:4" in said, said  # the taker's record, but only the stranger's download went out
    said, _ = leave([stranger, taker], [{}, {0: 1, 1: 1, 2: 1, 3: 1}], tmp_path, planned={"me", "taker"})
    assert "handed over at step 10 to taker" in said and "stranger" not in said, said


def test_a_leaver_whose_layers_another_cluster_holds_goes_once_the_taker_holds_them(tmp_path):
    """Another cluster holds averaged copies of our layers: nothing is ours alone, and the taker's record is enough."""
    said, _ = leave([record("other-cluster", [0, 4], 9), record("taker", [0, 4], 10)], [{}], tmp_path,
                    ours_alone=frozenset())
    assert "handed over at step 10 to" in said, said


def test_the_partners_that_kept_a_leavers_last_round_hold_its_work_whatever_their_own_step(tmp_path):
    """Another cluster counts its own steps: behind ours, its record once never held our layers "at our step", and a
    soak's Ctrl-C kept its work in its checkpoint. A partner of our last round holds our work in its average, once
    its record keeps that round on the layers the round's plan gave it, and it is not leaving after it too."""
    from ravnest_swarm.swarm.stage_averaging import LastRound

    last = LastRound(label=100, step=10, averaged=True, partners={"other-cluster": (0, 4)})

    def partner(layers=(0, 4), kept=(75, 100), **more):
        return dict(record("other-cluster", list(layers), 7), kept_rounds=list(kept), **more)

    said, _ = leave([partner()], [{}], tmp_path, ours_alone=frozenset())
    assert "nobody took layers 0:4" in said, said  # behind our step, and no last round of ours
    said, _ = leave([partner()], [{}], tmp_path, ours_alone=frozenset(), last_round=last)
    assert "handed over at step 10 to other-cluster" in said, said
    for taken_no_part in (partner(kept=(75,)),  # its rings did not all average in round 100
                          partner(leaving_after_round=100),  # it leaves after the same round: nobody keeps ours
                          partner(layers=(0, 2))):  # moved since: the round's average was of other layers
        said, _ = leave([taken_no_part], [{}], tmp_path, ours_alone=frozenset(), last_round=last)
        assert "nobody took layers 0:4" in said, (taken_no_part, said)
    # a layer nobody else trains still waits for a whole copy of it to go out: no round averaged it
    wider = LastRound(label=100, step=10, averaged=True, partners={"other-cluster": (0, 4)})
    said, _ = leave([partner()], [{}], tmp_path, ours_alone=frozenset({3}), last_round=wider)
    assert "nobody took layers 0:4" in said, said
    said, _ = leave([partner()], [{}, {3: 1}], tmp_path, ours_alone=frozenset({3}), last_round=wider)
    assert "handed over at step 10 to other-cluster" in said, said


def test_a_leaver_among_peers_that_all_leave_goes_at_once_with_its_layers_in_a_checkpoint(tmp_path):
    """A whole swarm stopped at once (a soak's end): peers that train on to their last round before they leave
    (``leaving_after_round``) take nothing over, as leaving peers do not. Counted as staying, they kept each
    hand-over waiting, and the soak's end once killed a volunteer past its grace."""
    import time as clock

    others = [dict(record("mate", [4, 8], 12), leaving_after_round=100), record("partner", [0, 4], 9, "leaving")]
    started = clock.monotonic()
    said, _ = leave(others, [{}], tmp_path, timeout=30.0)
    assert f"nobody took layers 0:4 (step 10); they are saved in {tmp_path / 'stage.safetensors'}" in said, said
    assert clock.monotonic() - started < 10  # its first look, not the 30 s timeout
    # one peer that stays is one that may yet take them: the leaver waits for it
    said, _ = leave(others + [record("stayer", [0, 2], 3)], [{}], tmp_path, timeout=2.5)
    assert "nobody took layers 0:4" in said, said


def test_the_layers_a_leaver_alone_holds_are_those_no_other_peer_of_its_plan_trains():
    from ravnest_swarm.swarm.hand_over import only_held_here

    plan = dict(round=4, clusters=[[dict(peer_id="me", layers=[0, 4]), dict(peer_id="b", layers=[4, 9])],
                                   [dict(peer_id="c", layers=[0, 2]), dict(peer_id="d", layers=[2, 9])]])
    assert only_held_here(plan, 0, 4, "me") == set()  # the other cluster splits them differently, but holds them all
    assert only_held_here(dict(round=4, clusters=plan["clusters"][:1]), 0, 4, "me") == {0, 1, 2, 3}
    assert only_held_here(dict(round=4, clusters=[plan["clusters"][0], [dict(peer_id="c", layers=[0, 3])]]),
                          0, 4, "me") == {3}
    assert only_held_here(None, 0, 2, "me") == {0, 1}
