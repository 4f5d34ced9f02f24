"""Multi-ring all-reduce with real peer processes over real P2P on 127.0.0.1.

Each cluster splits the same synthetic model at its own layer boundaries; every peer averages its range
with its owners in the other clusters, and the test compares each peer's result with the exact mean
computed here from the same seeds.
"""

import asyncio
import dataclasses
import gc
import json
import time

import pytest
import torch
from safetensors.torch import load_file

from ravnest_swarm.averaging.averager import RingsChanged
from ravnest_swarm.bench.synthetic import synthetic_layer
from ravnest_swarm.averaging.ring import NEVER_COMING_LOOK_S, cancel_until_ended
from ravnest_swarm.averaging.segments import Ring
from ravnest_swarm.swarm.placement import arrival_wait, holders_before_round, round_for_cluster, round_to_join
from ravnest_swarm.swarm.stage_averaging import RoundStalled, StageAveraging, within_limit
from ring_helpers import connected_averagers, identities_in_ring_order

LAYER_SIZES = [300, 500, 200, 700, 400, 600]
SEED = 7


def start_swarm(processes, backbone, layouts, run, tmp_path, timeout=20.0, extra=None):
    """One peer per stage; ``layouts[k]`` are cluster k's layer boundaries, e.g. ``[0, 2, 6]``. Every ring runs in
    cluster order (a ring orders its members by peer id: cluster k's peers get lower ids than cluster k + 1's), so
    a test knows who owns which chunk."""
    peers = {}
    expected = sum(len(cuts) - 1 for cuts in layouts)
    identities = identities_in_ring_order(tmp_path, expected)
    for k, cuts in enumerate(layouts):
        for s, (first, last) in enumerate(zip(cuts, cuts[1:])):
            name = f"c{k}s{s}"
            args = ["averaging-peer", "--initial-peers", backbone, "--run", run, "--cluster", str(k), "--stage", str(s),
                    "--layer-sizes", ",".join(map(str, LAYER_SIZES)), "--layers", f"{first},{last}",
                    "--seed", str(SEED), "--step", "3", "--timeout", str(timeout),
                    "--out", str(tmp_path / f"{name}.safetensors"), "--identity", identities[len(peers)].path]
            if not peers:
                args += ["--publish-plan", str(expected)]
            args += (extra or {}).get(name, [])
            peers[name] = processes.start(args, name)
    return peers


def finish(peer, timeout=90.0):
    assert peer.wait(timeout) == 0, peer.stderr()[-3000:]
    return json.loads(peer.stdout().strip().splitlines()[-1])


def exact_mean(clusters):
    values = [torch.cat([synthetic_layer(SEED, k, j, n) for j, n in enumerate(LAYER_SIZES)]).double() for k in clusters]
    return torch.stack(values).mean(0)


def local_values(cluster, start, end):
    return torch.cat([synthetic_layer(SEED, cluster, j, n) for j, n in enumerate(LAYER_SIZES)])[start:end]


def averaged(tmp_path, name):
    return load_file(str(tmp_path / f"{name}.safetensors"))["values"].double()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("layouts", [
    [[0, 2, 6], [0, 4, 6]],
    [[0, 2, 6], [0, 3, 5, 6], [0, 1, 6]],
    [[0, 3, 6], [0, 6], [0, 1, 4, 6], [0, 5, 6]],
], ids=["2-clusters", "3-clusters", "4-clusters"])
def test_every_peer_ends_with_the_exact_mean(processes, backbone, tmp_path, layouts):
    peers = start_swarm(processes, backbone, layouts, f"avg{len(layouts)}", tmp_path)
    mean = exact_mean(range(len(layouts)))
    cuts = sorted({c for cuts in layouts for c in cuts})
    for name, peer in peers.items():
        result = finish(peer)
        assert result["ok"], result
        # a peer serves one ring per segment of its range: the union of every cluster's cuts inside it
        assert len(result["segments"]) == sum(1 for c in cuts[:-1] if result["start"] <= sum(LAYER_SIZES[:c]) < result["end"])
        assert all(segment["members"] == len(layouts) for segment in result["segments"])
        error = (averaged(tmp_path, name) - mean[result["start"]:result["end"]]).abs().max().item()
        assert error <= 1e-5, (name, error)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("codec, bound", [("int8", 0.05), ("int4", 0.9)])
def test_rings_in_a_blockwise_codec_leave_every_member_the_same_values_near_the_mean(processes, backbone, tmp_path,
                                                                                     codec, bound):
    """The ring's chunks travel in the codec (codecs/blockwise.py): a reduced chunk's owner keeps the value the
    others decoded, so the members agree exactly, and each value is within a few steps of the codec's grid of
    the exact mean (synthetic values are unit normal: a block's largest magnitude is about 2.5, int4's step
    2 x 2.5 / 15 = 0.33, int8's 0.02, and a ring quantizes a chunk at each of its steps)."""
    layouts = [[0, 2, 6], [0, 3, 5, 6], [0, 1, 6]]
    extra = {f"c{k}s{s}": ["--compression", codec] for k, cuts in enumerate(layouts) for s in range(len(cuts) - 1)}
    peers = start_swarm(processes, backbone, layouts, f"avg-{codec}", tmp_path, extra=extra)
    mean = exact_mean(range(len(layouts)))
    result_values = torch.zeros(len(layouts), sum(LAYER_SIZES), dtype=torch.float64)
    for name, peer in peers.items():
        result = finish(peer)
        assert result["ok"], result
        result_values[int(name[1]), result["start"]:result["end"]] = averaged(tmp_path, name)
    assert torch.equal(result_values[0], result_values[1]) and torch.equal(result_values[0], result_values[2])
    error = (result_values[0] - mean).abs().max().item()
    assert 0 < error <= bound, error


@pytest.mark.timeout(120)
def test_a_killed_peer_is_left_out_of_its_rings_and_the_others_average_without_it(processes, backbone, tmp_path):
    """c1s0 owns layers 0-3: the rings of segments 0-1 (c0s0) and 2 (c0s1) include it; segment 3 does not. It is
    killed before it reaches the round, while the others wait for it: once their wait runs out, the two members
    of each of its rings that came, a majority of three, vote it out and average without it (they used to keep their
    local values: in a soak most failed rounds were a member that never came). Nothing outlives the wait and one
    ring timeout."""
    layouts = [[0, 2, 6], [0, 3, 6], [0, 1, 6]]
    ring_timeout = 6.0
    peers = start_swarm(processes, backbone, layouts, "avgkill", tmp_path, timeout=ring_timeout,
                        extra={"c1s0": ["--delay-start", "60"]})
    victim = peers.pop("c1s0")
    victim.wait_for_output("^plan adopted", 60)
    for peer in peers.values():
        peer.wait_for_output("^round started", 60)
    victim.kill_group()  # mid-round: the others are already waiting on its rings
    killed_at = time.monotonic()
    everyone, without_victim = exact_mean(range(3)), exact_mean([0, 2])
    boundary = sum(LAYER_SIZES[:3])  # end of the victim's range
    for name, peer in peers.items():
        result = finish(peer, timeout=2 * ring_timeout + 30)
        assert result["seconds"] <= 2 * ring_timeout + 3, result  # the wait for it, then one ring timeout at most
        assert result["ok"], result
        values = averaged(tmp_path, name)
        for segment in result["segments"]:
            lo, hi = segment["start"] - result["start"], segment["end"] - result["start"]
            assert segment["status"] == "ok", (name, segment)
            mean = without_victim if segment["start"] < boundary else everyone
            assert segment["members"] == (2 if segment["start"] < boundary else 3), (name, segment)
            assert (values[lo:hi] - mean[segment["start"]:segment["end"]]).abs().max() <= 1e-5, (name, segment)
        if result["start"] < boundary:
            assert "did not come; voting to average without it" in peer.stderr(), peer.stderr()[-2000:]
    assert time.monotonic() - killed_at < 2 * ring_timeout + 30


@pytest.mark.timeout(120)
def test_nan_contribution_is_rejected_and_the_others_average(processes, backbone, tmp_path):
    # c2s1 holds layers 1-6 and puts a NaN in the middle of them (element 1700, layer 3 = segment of c0s1/c1s1)
    layouts = [[0, 2, 6], [0, 3, 6], [0, 1, 6]]
    # a ring that times out on a loaded machine never sees the NaN (CI saw no report at all once): the rings get
    # twice the usual patience, and a failure shows every segment's status
    peers = start_swarm(processes, backbone, layouts, "avgnan", tmp_path, timeout=40.0,
                        extra={"c2s1": ["--poison", "nan"]})
    results = {name: finish(peer) for name, peer in peers.items()}
    poisoned_at = sum(LAYER_SIZES[1:]) // 2 + LAYER_SIZES[0]
    culprit = results["c2s1"]["peer_id"]
    mean_all, mean_honest = exact_mean(range(3)), exact_mean([0, 1])
    reports = [r for result in results.values() for r in result["rejected"]]
    assert reports and all(r["peer"] == culprit for r in reports), {name: r["segments"] for name, r in results.items()}
    for name, result in results.items():
        values = averaged(tmp_path, name)
        assert torch.isfinite(values).all() or name == "c2s1", name
        for segment in result["segments"]:
            lo, hi = segment["start"] - result["start"], segment["end"] - result["start"]
            hit = segment["start"] <= poisoned_at < segment["end"]
            if name == "c2s1":
                assert segment["status"] == ("excluded" if hit else "ok"), segment
                continue
            assert segment["status"] == "ok", (name, segment)
            expected = (mean_honest if hit else mean_all)[segment["start"]:segment["end"]]
            assert segment["members"] == (2 if hit else 3)
            assert (values[lo:hi] - expected).abs().max() <= 1e-5, (name, segment)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("abort", ["exclude", "fail"])
def test_one_hostile_members_abort_does_not_end_the_ring_for_the_others(processes, backbone, tmp_path, abort):
    """Attack (issue #34): c2s0, a member of the only ring (three members), takes part in nothing and, once the
    others' attempt runs, tells them it refused its successor's contribution (``exclude``: an honest member), or
    that the ring failed (``fail``). One vote of the two a ring of three needs excludes nobody, and a member
    ends the ring only for itself: both honest members average their two contributions exactly. (Before,
    ``exclude`` left the successor excluded and the other alone; ``fail`` failed the ring for everyone.)"""
    layouts = [[0, 6], [0, 6], [0, 6]]
    peers = start_swarm(processes, backbone, layouts, f"avghostile{abort}", tmp_path,
                        extra={"c2s0": ["--hostile-abort", abort, "--timeout", "8"]})
    results = {name: finish(peer) for name, peer in peers.items()}
    mean_honest = exact_mean([0, 1])
    for name in ("c0s0", "c1s0"):
        [segment] = results[name]["segments"]
        assert (segment["status"], segment["members"]) == ("ok", 2), (name, segment)
        assert results[name]["seconds"] < 8, results[name]  # went on at once, without waiting out the hostile one
        assert (averaged(tmp_path, name) - mean_honest).abs().max() <= 1e-5, name


@pytest.mark.timeout(120)
def test_lost_replies_and_broken_streams_are_resent_and_counted_once(processes, backbone, tmp_path):
    # small parts so every ring message is several parts: c1s1 closes its first two ring streams after reading
    # them in full without replying; c2s1 breaks its first two longer streams partway through their second part
    layouts = [[0, 2, 6], [0, 3, 5, 6], [0, 1, 6]]
    small = ["--part-bytes", "256"]
    peers = start_swarm(processes, backbone, layouts, "avglossy", tmp_path, extra={
        **{f"c{k}s{s}": small for k, cuts in enumerate(layouts) for s in range(len(cuts) - 1)},
        "c1s1": small + ["--lose-replies", "2"], "c2s1": small + ["--cut-streams", "2"]})
    mean = exact_mean(range(3))
    results = {name: finish(peer) for name, peer in peers.items()}
    # each of the four lost messages went out again at least once, and its first copy of every part counted once
    assert sum(result["resends"] for result in results.values()) >= 4, results
    for name, result in results.items():
        assert result["ok"], result
        error = (averaged(tmp_path, name) - mean[result["start"]:result["end"]]).abs().max().item()
        assert error <= 1e-5, (name, error)


async def average_without_the_last(backbone, members: int, name: str, patience_for):
    """One ring of ``members`` averagers over real P2P (20 s ring timeout) whose last never reaches round 5; the
    others average 0, 1, ... with the patience ``patience_for(ids, started)`` gives: their results, values, ids."""
    async with connected_averagers(backbone, members, name, timeout=20.0) as (averagers, ids):
        ring = Ring(0, 0, 1000, tuple(ids))
        came = averagers[:-1]
        for averager in came:
            averager.expect([ring], 5)
        values = [torch.full((1000,), float(k)) for k in range(len(came))]
        patience = patience_for(ids, time.monotonic())
        results = await asyncio.gather(*(averager.average(5, value, 0, [ring], patience)
                                         for averager, value in zip(came, values)))
        return results, values, ids


@pytest.mark.timeout(90)
def test_a_member_whose_record_says_it_finished_the_run_is_not_waited_for(backbone):
    """Averagers over real P2P, one ring with a 20 s timeout, and a member that never reaches round 5: its cluster
    trained the run's length, and from 4 s on its record says ``done``. Those that came ask their patience every
    ``NEVER_COMING_LOOK_S`` while they wait, and learn so within a look, not at the timeout. In a ring of three, the
    two that came average without it, with no vote (a majority of a ring of four is three: two clusters behind two
    that finished could never vote them out). In a ring of two, the one that came ends it ``finished``: nobody is
    left to average with, nobody failed, and it keeps its values. A ring whose wait is shorter than a look is asked
    nothing of the sort (the test below)."""
    async def scenario(members: int):
        asked = []

        def finished_after_four(ids, started):
            class FinishedAfterFour:
                async def more(self, step, missing):
                    raise AssertionError("asked for more before the timeout")

                def gone(self, missing):
                    return []

                async def never_coming(self, step, missing):
                    asked.append((step, list(missing)))
                    return list(missing) if time.monotonic() - started >= 4.0 else []
            return FinishedAfterFour()

        results, values, ids = await average_without_the_last(backbone, members, f"finished{members}",
                                                               finished_after_four)
        return results, values, asked, ids

    results, values, asked, ids = asyncio.run(scenario(3))
    assert all(result.ok for result in results), [result.summary() for result in results]
    assert all(torch.equal(value, torch.full((1000,), 0.5)) for value in values)
    assert all(4.0 <= result.seconds < 4.0 + NEVER_COMING_LOOK_S + 1.5 for result in results)
    assert {step for step, _ in asked} == {5} and all(missing == [ids[2]] for _, missing in asked)

    (result,), (value,), asked, ids = asyncio.run(scenario(2))
    assert result.segments[0].status == "finished" and "will never reach round 5" in result.segments[0].detail
    assert 4.0 <= result.seconds < 4.0 + NEVER_COMING_LOOK_S + 1.5, result.summary()
    assert {step for step, _ in asked} == {5} and all(missing == [ids[1]] for _, missing in asked)
    assert 2 <= len(asked) <= 3, asked
    assert torch.equal(value, torch.zeros(1000))


@pytest.mark.timeout(90)
def test_a_member_found_gone_is_voted_out_at_the_next_look_not_waited_for_to_the_timeout(backbone):
    """Averagers over real P2P, one ring with a 20 s timeout, and a member that never reaches round 5: it crashed,
    and from 3 s on the caller's planning finds it gone (its record, which said it trained on, expired). Those that
    came ask every ``NEVER_COMING_LOOK_S`` and vote it out as they learn it: in a ring of three the two average
    without it, within a look; in a ring of two nobody is left to vote, and the one that came fails the ring at once
    (a crash is a failure, unlike a member that finished the run), keeping its values. Before, the ring waited for
    it, and the caller gave the whole round up: one failed round at every partner of each crash."""
    async def scenario(members: int):
        def gone_after_three(ids, started):
            class GoneAfterThree:
                async def more(self, step, missing):
                    raise AssertionError("asked for more before the timeout")

                def gone(self, missing):
                    return [m for m in missing if m == ids[-1]] if time.monotonic() - started >= 3.0 else []

                async def never_coming(self, step, missing):
                    return []
            return GoneAfterThree()

        results, values, _ = await average_without_the_last(backbone, members, f"gone{members}", gone_after_three)
        return results, values

    results, values = asyncio.run(scenario(3))
    assert all(result.ok for result in results), [result.summary() for result in results]
    assert all(torch.equal(value, torch.full((1000,), 0.5)) for value in values)
    assert all(3.0 <= result.seconds < 3.0 + NEVER_COMING_LOOK_S + 1.5 for result in results)

    (result,), (value,) = asyncio.run(scenario(2))
    assert not result.ok and result.segments[0].status == "timeout", result.summary()
    assert "did not reach round 5" in result.segments[0].detail
    assert 3.0 <= result.seconds < 3.0 + NEVER_COMING_LOOK_S + 1.5, result.summary()
    assert torch.equal(value, torch.zeros(1000))


@pytest.mark.timeout(90)
def test_a_member_found_gone_before_the_others_came_is_voted_out_once_they_do(backbone):
    """A ring of three: one member crashed, the caller finds it gone 1 s in, and the second member comes 4 s late.
    Too few are here to vote at first, but enough may still come: the first waits, not fails the ring (a review:
    it failed at once, and so did the latecomer, finding it gone), and both vote it out and average once the
    second is here."""
    late_by = 4.0

    async def scenario():
        async with connected_averagers(backbone, 3, "gone-late", timeout=20.0) as (averagers, ids):
            ring = Ring(0, 0, 1000, tuple(ids))
            for averager in averagers[:2]:
                averager.expect([ring], 5)
            values = [torch.full((1000,), float(k)) for k in range(2)]
            started = time.monotonic()

            class GoneAfterOne:
                async def more(self, step, missing):
                    raise AssertionError("asked for more before the timeout")

                def gone(self, missing):
                    return [m for m in missing if m == ids[2]] if time.monotonic() - started >= 1.0 else []

                async def never_coming(self, step, missing):
                    return []

            async def late():
                await asyncio.sleep(late_by)
                return await averagers[1].average(5, values[1], 0, [ring], GoneAfterOne())

            return await asyncio.gather(averagers[0].average(5, values[0], 0, [ring], GoneAfterOne()), late()), values

    results, values = asyncio.run(scenario())
    assert all(result.ok for result in results), [result.summary() for result in results]
    assert all(torch.equal(value, torch.full((1000,), 0.5)) for value in values)
    # within two looks of the latecomer's coming (a loaded machine took 8 s), far from the ring's 20 s timeout
    assert results[0].seconds < late_by + 2 * NEVER_COMING_LOOK_S + 3.0, results[0].summary()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("members", [5, 2])
def test_a_member_killed_amid_an_attempt_is_voted_out_once_the_attempt_fails(backbone, members):
    """A ring of ``members`` averagers over real P2P (6 s ring timeout). The last reaches round 5 and starts the
    attempt like the others, then its p2pd is killed (SIGKILL) before it sends a part: a crash amid the round. The
    others' planning finds it gone 2, 4, 8 and 14 s after the kill, each at its own moment. Their attempts fail (a
    member they could not reach, a chunk that never came); each asks the others whether they are there, and
    whether the one that does not answer is gone, and votes it out; the last, whose planning is slowest, is
    outvoted first and joins the others' next attempt with a whole timeout of its own. The four average without it.
    Before, each attempt's failure failed the ring at every partner of a crash amid a round. In a ring of two nobody
    is left to vote: the one left fails the ring as before, within its timeout, keeping its values."""
    ring_timeout = 6.0

    async def scenario():
        async with connected_averagers(backbone, members, f"gone-amid{members}", timeout=ring_timeout) as (averagers,
                                                                                                        ids):
            ring = Ring(0, 0, 1000, tuple(ids))
            for averager in averagers:
                averager.expect([ring], 5)
            values = [torch.full((1000,), float(k)) for k in range(members)]
            victim, attempt_began, killed_at = averagers[-1], asyncio.Event(), []

            class SendsNothing:  # the victim's attempt: it began, and the kill comes before its first part
                checking = False

                async def run(self):
                    attempt_began.set()
                    await asyncio.Event().wait()

            victim.ring_peer = dataclasses.replace(victim.ring_peer, attempt=lambda *_: SendsNothing())

            class GoneAfterTheKill:
                def __init__(self, after: float):
                    self.after = after

                async def more(self, step, missing):
                    return 0.0

                def gone(self, missing):
                    return [m for m in missing
                            if m == ids[-1] and killed_at and time.monotonic() - killed_at[0] >= self.after]

                async def never_coming(self, step, missing):
                    return []

            async def kill_amid():
                await attempt_began.wait()
                victim.p2p._child.kill()
                killed_at.append(time.monotonic())
                averagers.remove(victim)  # nothing of it is left to shut down; its node is stopped on the way out

            survivors = [averager.average(5, value, 0, [ring], GoneAfterTheKill(after))
                         for averager, value, after in zip(averagers[:-1], values, (2.0, 4.0, 8.0, 14.0))]
            victim_round = asyncio.create_task(victim.average(5, values[-1], 0, [ring]))
            results = await asyncio.gather(*survivors, kill_amid())
            await cancel_until_ended([victim_round])
            return results[:-1], values[:-1], time.monotonic() - killed_at[0]

    results, values, since_the_kill = asyncio.run(scenario())
    # the killed p2pd's client left tasks and finalizers in reference cycles: collected here, not amid a later import
    # (pytest's assertion rewriting then failed with "AST constructor recursion depth mismatch", CPython 3.11)
    gc.collect()
    if members == 2:
        [result] = results
        assert not result.ok and result.segments[0].status in ("timeout", "failed"), result.summary()
        assert torch.equal(values[0], torch.zeros(1000))
        assert since_the_kill < ring_timeout + 2.0, result.summary()  # not a wait for a vote nobody can cast
        return
    assert all(result.ok and result.segments[0].members == members - 1 for result in results), \
        [result.summary() for result in results]
    mean = sum(range(members - 1)) / (members - 1)
    assert all(torch.equal(value, torch.full((1000,), mean)) for value in values)
    # the third vote: planning at 8 s and its question to the silent member (2 s); not the slowest planning's 14 s
    assert since_the_kill < 13.0, since_the_kill


@pytest.mark.timeout(60)
def test_a_round_in_rings_a_plan_changed_fails_with_one_line_that_says_so(backbone):
    """A round whose rings are not those the averager follows now (a plan adopted as it began put another member in
    its ring) fails at once with :class:`RingsChanged`, whose line says why, and sends nothing."""
    async def scenario():
        async with connected_averagers(backbone, 3, "changed") as (averagers, ids):
            averagers[0].expect([Ring(0, 0, 10, (ids[0], ids[1]))], 5)
            with pytest.raises(RingsChanged) as refusal:
                await averagers[0].average(5, torch.zeros(10), 0, [Ring(0, 0, 10, (ids[0], ids[2]))])
            return str(refusal.value), averagers[0].sender.bytes_sent

    line, sent = asyncio.run(scenario())
    assert line == ("ring 0 of round 5 is not among those this peer takes messages for now: a plan adopted as the "
                    "round began changed its rings") and sent == 0


@pytest.mark.timeout(120)
def test_a_late_member_is_waited_for_while_it_is_on_its_way_and_only_then(backbone):
    """Two averagers over real P2P in this process, one ring. The second reaches the round 6 s after the first,
    three times the ring timeout (its cluster trains slower). Asked for patience while it is on its way, the
    first waits and both average; without patience, the first gives up at the timeout and the late one learns at
    once that the round is over instead of waiting out a timeout of its own."""
    ring_timeout, late_by = 2.0, 6.0

    async def scenario(patient: bool):
        async with connected_averagers(backbone, 2, "late", timeout=ring_timeout) as (averagers, ids):
            ring = Ring(0, 0, 1000, tuple(ids))
            for averager in averagers:
                averager.expect([ring], 5)
            values = [torch.full((1000,), float(k)) for k in range(2)]
            started = time.monotonic()
            asked = []

            class OnItsWay:
                async def more(self, step, missing):
                    asked.append(list(missing))
                    return 1.0 if time.monotonic() - started < late_by + 5 else 0.0

                def gone(self, missing):
                    return []

                async def never_coming(self, step, missing):
                    return []

            async def late():
                await asyncio.sleep(late_by)
                return await averagers[1].average(5, values[1], 0, [ring])

            first, second = await asyncio.gather(
                averagers[0].average(5, values[0], 0, [ring], OnItsWay() if patient else None), late())
            return first, second, values, asked, ids

    first, second, values, asked, ids = asyncio.run(scenario(patient=True))
    assert first.ok and second.ok, (first.summary(), second.summary())
    assert all(torch.equal(v, torch.full((1000,), 0.5)) for v in values)
    assert asked and all(missing == [ids[1]] for missing in asked)
    assert first.seconds >= late_by - 0.5 and second.seconds < ring_timeout  # the late one found everyone there

    first, second, values, asked, ids = asyncio.run(scenario(patient=False))
    assert first.segments[0].status == "timeout" and "did not reach round 5" in first.segments[0].detail
    assert ring_timeout - 0.5 <= first.seconds < ring_timeout + 1.5
    # the first left the ring (its note, or its answer that round 5 is over for it): nobody is left with the second
    assert second.segments[0].status == "alone" and second.seconds < ring_timeout, second.summary()
    assert "round 5" in second.segments[0].detail, second.summary()
    assert torch.equal(values[0], torch.zeros(1000)) and torch.equal(values[1], torch.ones(1000))  # kept local


@pytest.mark.timeout(120)
def test_members_that_disagree_on_a_rings_members_fail_it_without_voting_against_each_other(backbone):
    """Three averagers over real P2P in this process, one ring: two count three members in it, the third counts
    two (it saw the third member's cluster gone a moment before the others, or follows another plan: a soak saw
    it at plan changes). Their attempts have one name and chunks of different sizes. The one that gets a chunk of
    another size fails its ring and says why, and votes against nobody: before, it refused the sender's honest
    contribution as poisoned, and the dashboard counted hostile input."""
    ring_timeout = 3.0

    async def scenario():
        async with connected_averagers(backbone, 3, "disagree", timeout=ring_timeout) as (averagers, ids):
            three, two = Ring(0, 0, 1200, tuple(ids)), Ring(0, 0, 1200, tuple(ids[:2]))
            rings = [three, two, three]
            for averager, ring in zip(averagers, rings):
                averager.expect([ring], 5)
            values = [torch.full((1200,), float(k)) for k in range(3)]
            return await asyncio.gather(*(averager.average(5, value, 0, [ring])
                                          for averager, value, ring in zip(averagers, values, rings)))

    results = asyncio.run(scenario())
    summaries = [result.summary() for result in results]
    assert all(not result.rejected for result in results), summaries  # nobody refused as poisoned
    counted_two = results[1].segments[0]
    assert counted_two.status == "failed" and "runs the ring with other members" in counted_two.detail, summaries
    # (the two others go on without it once its note that the ring ended for it comes: in time or not, by the timing)


def test_a_volunteer_waits_for_a_member_while_its_record_shows_it_coming():
    """``arrival_wait``: the patience a volunteer gives a ring: the slowest missing member's steps left at its
    recent pace, doubled, plus a heartbeat; nothing for a member gone, idle, finished, or past the round."""
    def record(state="training", step=90, rate=320.0):
        return dict(state=state, step=step, samples_per_s=rate)

    members = {"a": record(step=90), "b": record(step=60, rate=160.0)}
    # a: 10 steps x 32 samples at 320/s = 1 s; b: 40 x 32 at 160/s = 8 s -> 2 x 8 + 4
    assert arrival_wait(100, ["a", "b"], members, 32, 4.0) == pytest.approx(20.0)
    assert arrival_wait(100, ["a"], members, 32, 4.0) == pytest.approx(6.0)
    for gone in ({}, {"a": record(state="done")}, {"a": record(step=100)}, {"a": record(rate=0.0)},
                 {"a": record(state="standby")}):
        assert arrival_wait(100, ["a"], gone, 32, 4.0) == 0.0, gone
    # a stage that just started has no pace yet: a heartbeat for its next record, doubled, plus the heartbeat
    assert arrival_wait(100, ["a"], {"a": record(rate=None)}, 32, 4.0) == pytest.approx(12.0)
    # a member that by its own pace cannot come within the round's limit is not waited for (a hostile record's
    # pace of 1e-300 samples/s held every round of its rings to the limit); one that can still is
    assert arrival_wait(100, ["a"], {"a": record(rate=1e-300)}, 32, 4.0, limit=120.0) == 0.0
    assert arrival_wait(100, ["a", "b"], members, 32, 4.0, limit=11.0) == 0.0  # b needs 8 s and a heartbeat: 12
    assert arrival_wait(100, ["a", "b"], members, 32, 4.0, limit=13.0) == pytest.approx(13.0)  # the margin is cut
    assert arrival_wait(100, ["a", "b"], members, 32, 4.0, limit=120.0) == pytest.approx(20.0)


def test_a_member_ahead_on_its_own_steps_is_waited_for_on_the_run_count_of_rounds():
    """``arrival_wait`` on the run's count of rounds (issue 30's item 0): a member's steps count less its
    ``round_offset``, and its ``next_round`` says whether it is past the round; one at the round's step that has not
    arrived (its round before still runs) is not waited for beyond the ring's own timeout."""
    def record(step, offset, next_round, rate=320.0):
        return dict(state="training", step=step, round_offset=offset, next_round=next_round, samples_per_s=rate)

    # 1,090 of its own steps, 1,000 ahead of the rounds: at round step 90, 10 steps from round 100 -> 2 x 1 + 4
    assert arrival_wait(100, ["a"], {"a": record(1090, 1000, 100)}, 32, 4.0, period=20) == pytest.approx(6.0)
    # past round 100 on the run's count, though its own step is far behind 100 + its offset
    assert arrival_wait(100, ["a"], {"a": record(1050, 900, 120)}, 32, 4.0, period=20) == 0.0
    # at round step 110 but still in round 80 beside training: the ring's timeout waited for it already
    assert arrival_wait(100, ["a"], {"a": record(1110, 1000, 100)}, 32, 4.0, period=20) == 0.0


def test_a_round_that_outlives_every_deadline_is_given_up_and_says_where_it_waited(caplog):
    """``within_limit``: a round still running at its limit is given up at once, not waited for, and its log line
    names where its tasks wait. The stall a GPT soak saw (a round beside training for 3 minutes, no ring timeout
    logged, its partners failing every round meanwhile) had two suspects of this kind: a step that swallows its
    cancellation, which ``cancel_until_ended`` then cancels for ever. Pure: no network."""
    release = asyncio.Event()

    async def swallows_cancellation():  # as a library call that drops the cancellation it is sent
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if release.is_set():
                    raise

    async def scenario():
        stubborn = asyncio.create_task(swallows_cancellation())
        await asyncio.sleep(0)

        async def ring_step():
            await cancel_until_ended([stubborn])

        started = time.monotonic()
        with pytest.raises(RoundStalled, match="round 625 still running after"):
            await within_limit(ring_step(), 0.5, 625)
        took = time.monotonic() - started
        assert await within_limit(asyncio.sleep(0.01, result="done"), 0.5, 650) == "done"  # in time: its result
        release.set()  # the test's own loop must end
        stubborn.cancel()
        await asyncio.gather(stubborn, return_exceptions=True)
        return took

    with caplog.at_level("WARNING"):
        took = asyncio.run(scenario())
    assert took < 1.5, took
    stalled = [r.getMessage() for r in caplog.records if "round 625 stalled" in r.getMessage()]
    assert len(stalled) == 1 and "ring.py" in stalled[0] and "cancel_until_ended" in stalled[0], stalled


def test_a_stage_aligns_its_count_of_rounds_only_once_its_round_in_flight_ended():
    """``StageAveraging.due``: while a round runs beside training, a new plan does not align the stage's count (a
    read of its partners' records, then its record's ``next_round``): until the round ends its record names that
    round, so partners that align meanwhile join it. Aligned during the GPT soak's stalled round, the record named
    the next one, and partners gave up on it at once in every round. Pure: no network, no event loop needed."""
    averaging = StageAveraging.__new__(StageAveraging)
    worker, plan = object(), {"round": 3}
    averaging.in_flight, averaging._aligned, averaging._aligning = object(), (worker, {"round": 2}), None
    averaging.next_round, averaging.offset = 650, 0
    assert averaging.due(worker, plan, 700) is None
    assert averaging._aligning is None and averaging._aligned[1] == {"round": 2}  # no alignment was started


def test_a_new_cluster_takes_the_latest_round_the_holders_of_all_its_layers_keep():
    """``round_for_cluster``: the round a new cluster's first stage names for all its stages. CI saw a stage-1
    ring fail round 820 at a plan change that the stage-0 ring averaged: the first stage took 820 (its holders'
    latest), and the later stage's holders, which kept 800 and 840 but not 820, could not give it. Pure: no
    network."""
    def holder(layers, kept):
        return dict(layers=layers, kept_rounds=kept)

    stage0 = [holder([0, 4], [780, 800, 820]), holder([0, 4], [780, 800, 820])]
    stage1 = [holder([4, 9], [780, 800, 840]), holder([4, 9], [760, 780, 800, 840])]
    layers = {**{layer: stage0 for layer in range(4)}, **{layer: stage1 for layer in range(4, 9)}}
    assert round_for_cluster(layers) == 800
    # two holders of a layer must both keep it (a download asks two to agree); the only holder alone will do
    assert round_for_cluster({0: stage0, 4: [stage1[0], holder([4, 9], [760])]}) is None
    assert round_for_cluster({0: stage0, 4: [stage1[0]]}) == 800
    # a holder's rounds are of its stage's layers: one that offers a layer it no longer trains keeps none of it
    assert round_for_cluster({0: stage0, 4: [holder([0, 4], [800])]}) is None
    # a layer whose holders do not say (a client from before kept_rounds): the download's own choice
    assert round_for_cluster({0: stage0, 4: [dict(layers=[4, 9])]}) is None


def test_a_new_clusters_later_stage_waits_for_the_holders_that_have_not_taken_its_round_yet():
    """``holders_before_round``: the holders a later stage of a new cluster waits for before it asks them for the
    round its first stage took (CI saw a stage-1 holder, a moment behind, refuse round 660 and the stage take 640).
    Pure: no network."""
    def holder(name, next_round, state="training"):
        return dict(name=name, state=state, next_round=next_round)

    records = [holder("ahead", 680), holder("running", 660), holder("behind", 640), holder("aligning", None),
               holder("standby", 600, state="standby")]
    # its round still runs (its record names it) or is still to come: waited for; past it, aligning or not
    # training: asked as they are
    assert holders_before_round(records, 660) == ["running", "behind"]
    assert holders_before_round(records, 600) == []


def test_a_stage_joins_the_round_its_partners_take_next_and_never_goes_back():
    """``round_to_join``: the next round and offset a stage takes when it starts, follows a new plan, or failed a
    round. Pure: no network."""
    def partner(step, offset=None, next_round=None, state="training"):
        return dict(state=state, step=step, round_offset=offset, next_round=next_round)

    # nobody's word: rounds fall on the step's multiples of the period, as they always did
    assert round_to_join(1234, 20, None, []) == (1240, 0)
    assert round_to_join(1234, 20, None, [partner(55, state="standby")]) == (1240, 0)
    # in step with its partners (a run's first clusters): its own step is the round step, not their older record's
    assert round_to_join(15, 20, None, [partner(3, 0, 20), partner(0)]) == (20, 0)
    assert round_to_join(15, 20, (20, None), [partner(3, 0, 20)]) == (20, 0)
    # partners that count no rounds yet (aligning too, or downloading: their step is not the one they train from)
    # say nothing: a run's first plan with four new clusters started them at one record's stale step (a lab run)
    assert round_to_join(1833, 20, None, [partner(1690), partner(1748, None, None)]) == (1840, 0)
    # a cluster formed mid-run at step 5,000 meets partners whose next round is 700 (round step 690): it is as far
    # from that round as they are, so its first round is theirs, whatever its own count of steps
    next_round, offset = round_to_join(5000, 20, None, [partner(3690, 3000, 700), partner(2000, 1320, 680)])
    assert (next_round, 5000 - offset) == (700, 690)
    # a partner whose round 700 still runs beside training (its round step is past it) is joined at once
    assert round_to_join(5000, 20, None, [partner(3725, 3000, 700)]) == (700, 5000 - 700)
    # a stage already at or past its partners' next round keeps its own count (same worker: its own offset) ...
    assert round_to_join(5000, 20, (720, 4290), [partner(3690, 3000, 700)]) == (720, 4290)
    # ... or, for a new worker (a new place, another count of steps), starts it a period from now
    assert round_to_join(100, 20, (720, None), [partner(3690, 3000, 700)]) == (720, 100 - 700)
    # behind its partners (a failed round, another side's plan): it jumps to theirs
    assert round_to_join(5000, 20, (660, 4350), [partner(3690, 3000, 700)]) == (700, 5000 - 690)
    # one partner of three claiming a round far ahead (a hostile review: 2**53, and every partner's rounds stopped
    # for good) moves nobody: the upper median of the claims
    honest = [partner(3690, 3000, 700), partner(3695, 3000, 700)]
    assert round_to_join(5000, 20, None, honest + [partner(2**53, 0, 2**53)]) == (700, 5000 - 695)


def test_a_ring_waits_no_longer_for_a_member_that_finished_left_or_leaves_after_an_earlier_round():
    """A graceful leave takes one last round and then stands still (``Volunteer._train_to_round``); its record says
    the round (``leaving_after_round``). Its partners, which did not know yet, waited for it in the round after and
    failed it (a walkthrough: one failed round at each partner per Ctrl-C). 0 is a leaver that did not know its
    next round: it takes the first one due, so it is still awaited."""
    from types import SimpleNamespace

    from ravnest_swarm.swarm.stage_averaging import RecordPatience

    records = [dict(peer_id="done", state="done"), dict(peer_id="gone-on", state="leaving"),
               dict(peer_id="left-at-100", state="training", leaving_after_round=100),
               dict(peer_id="leaves-at-125", state="training", leaving_after_round=125),
               dict(peer_id="leaves-next", state="training", leaving_after_round=0),
               dict(peer_id="stays", state="training")]

    async def read_peers(peer_ids=None):
        return [r for r in records if peer_ids is None or r["peer_id"] in peer_ids]

    patience = RecordPatience(SimpleNamespace(read_peers=read_peers), 8, 2.0, 25)
    missing = [r["peer_id"] for r in records] + ["unread"]
    ended = asyncio.run(patience.never_coming(125, missing))
    assert sorted(ended) == ["done", "gone-on", "left-at-100"] and patience.finished == {"done"}
