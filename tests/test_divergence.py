"""A run that survives its own training (issue 29): the divergence guard, a stage that restores and goes on, and a
peer record that publishes whatever the peer's own figures did."""

import asyncio
import math
import os
import re
import time
from types import SimpleNamespace

import numpy as np

import pytest
import torch
from hivemind.utils.timed_storage import get_dht_time

from ravnest_swarm.averaging.mailbox import RingState
from ravnest_swarm.averaging.segments import Ring, flatten
from ravnest_swarm.membership.announcer import PeerAnnouncer
from ravnest_swarm.membership.capabilities import Capabilities
from ravnest_swarm.membership.own_record import RecordError, publishable
from ravnest_swarm.membership.reader import read_peers
from ravnest_swarm.membership.records import make_validators, start_peer_node
from ravnest_swarm.net.node import start_node, stop_node
from ravnest_swarm.pipeline.compute import StageCompute
from ravnest_swarm.pipeline.config import StageConfig
from ravnest_swarm.pipeline.guard import LEVEL_FLOOR, LEVEL_WINDOW, PATIENCE, Diverged, DivergenceGuard, SkippedStep
from ravnest_swarm.models import ShardedSampler, get_model
from ravnest_swarm.swarm.spec import cluster_lr
from ravnest_swarm.swarm.stage_averaging import AppliedRound, InFlightRound, StageAveraging
from run_observer import RunObserver
from test_checkpoint import stage_worker, train
from test_swarm import placed, swarm  # noqa: F401 (a fixture)
from test_user_models import USER_MODELS, features_dir

LOCAL = ["/ip4/127.0.0.1/tcp/0"]
RUN = "diverge"


def settled_guard(factor=10.0, level=2.0):
    guard = DivergenceGuard(factor)
    for _ in range(LEVEL_WINDOW):
        assert guard.judge(level).kind == "ok"
    assert guard.level == level
    return guard


def test_a_loss_that_is_not_finite_diverges_at_once_even_before_the_level_is_known():
    guard = DivergenceGuard(10.0)
    for value in (math.nan, math.inf):
        verdict = guard.judge(value)
        assert verdict.kind == "diverged" and "not finite" not in verdict.reason and str(value) in verdict.reason


def test_a_spike_skips_its_step_and_only_a_run_of_them_diverges():
    guard = settled_guard()
    assert guard.judge(19.9).kind == "ok"
    assert guard.judge(25.0).kind == "spike"
    assert guard.judge(1.0).kind == "ok"  # one spike, then back at the level: nothing to restore
    kinds = [guard.judge(1e4).kind for _ in range(PATIENCE)]
    assert kinds == ["spike"] * (PATIENCE - 1) + ["diverged"]


def test_a_loss_that_grows_a_little_each_step_diverges_once_far_above_where_it_started():
    """Issue 29's lab run: the loss passed 10^6 in 7 s, growing a few percent a step. A trailing level would follow it
    up; the stage's starting level does not."""
    guard = settled_guard(level=2.3)
    loss, verdicts = 2.3, []
    while not verdicts or verdicts[-1] != "diverged":
        loss *= 1.02
        verdicts.append(guard.judge(loss).kind)
        assert loss < 1e3
    assert loss > 10 * 2.3 and loss < 10 * 2.3 * 1.02 ** PATIENCE


def test_a_stage_that_starts_on_layers_fit_to_a_loss_of_zero_skips_no_step_for_an_ordinary_loss():
    """A standby placed on layers trained to an underflowing cross-entropy (0.0) once had a level of 0, and took
    every loss above 0 for a spike: it skipped every step. The level has a floor; a real blow-up still counts."""
    guard = DivergenceGuard(10.0)
    for _ in range(LEVEL_WINDOW):
        assert guard.judge(0.0).kind == "ok"
    assert guard.level == LEVEL_FLOOR
    # a misclassified sample of an overfit classifier is not a blow-up (seen: 0.78, 1.53, 3.53)
    assert [guard.judge(loss).kind for loss in (0.78, 1.53, 3.53)] == ["ok"] * 3
    assert guard.judge(12.0).kind == "spike"


def test_factor_zero_judges_only_finiteness():
    guard = settled_guard(factor=0.0)
    assert guard.judge(1e9).kind == "ok" and guard.judge(math.nan).kind == "diverged"


def single_stage(lr=0.05):
    model = get_model("mlp-digits")
    config = StageConfig(run=RUN, stage=0, stages=1, model="mlp-digits", layers=(0, len(model.layers)), lr=lr)
    return StageCompute(config, model), model


def test_a_stage_fed_a_microbatch_whose_loss_is_nan_restores_its_last_good_state_and_trains_on():
    compute, model = single_stage()
    data = model.dataset()
    sampler = ShardedSampler(data.size, 0, 1, 32)
    for microbatch in range(30):
        compute.forward_backward_last(*data.get(sampler.sample_ids(microbatch)))
    compute.mark_restore_point("the averaged state")
    good = {k: v.clone() for k, v in compute.module.state_dict().items()}
    version = compute.version
    inputs, targets = data.get(sampler.sample_ids(30))
    poisoned = inputs.clone()
    poisoned[0, 0] = math.nan  # one sample with a NaN feature: the loss is NaN
    with pytest.raises(Diverged) as raised:
        compute.forward_backward_last(poisoned, targets)
    assert "the loss is nan" in str(raised.value) and f"the averaged state of step {version}" in str(raised.value)
    assert compute.divergences == 1 and compute.version == version
    assert all(torch.equal(good[k], v) for k, v in compute.module.state_dict().items())
    loss, _ = compute.forward_backward_last(inputs, targets)  # the next microbatch trains as before
    assert math.isfinite(loss) and compute.version == version + 1


def test_a_gradient_that_is_not_finite_restores_instead_of_stepping():
    model = get_model("mlp-digits")
    compute = StageCompute(StageConfig(run=RUN, stage=0, stages=2, model="mlp-digits", layers=(0, 4)), model)
    inputs, _ = model.dataset().get(range(32))
    compute.mark_restore_point("its checkpoint")
    before = {k: v.clone() for k, v in compute.module.state_dict().items()}
    pending, output = compute.forward(inputs)
    with pytest.raises(Diverged, match="its gradient is not finite; restored layers 0:4 from its checkpoint of step 0"):
        compute.backward(pending, torch.full_like(output, 3e38))  # finite (the wire's bound aside), its products not
    assert compute.version == 0
    assert all(torch.equal(before[k], v) for k, v in compute.module.state_dict().items())


def test_a_loss_spike_skips_the_step_and_leaves_the_weights():
    compute, model = single_stage()
    data = model.dataset()
    for microbatch in range(LEVEL_WINDOW):
        compute.forward_backward_last(*data.get(range(32 * microbatch, 32 * microbatch + 32)))
    weights = {k: v.clone() for k, v in compute.module.state_dict().items()}
    inputs, targets = data.get(range(32))
    with pytest.raises(SkippedStep, match="step skipped"):
        compute.forward_backward_last(inputs * 1e3, targets)
    assert all(torch.equal(weights[k], v) for k, v in compute.module.state_dict().items())


def test_a_restore_point_is_never_a_state_that_is_not_finite():
    compute, _ = single_stage()
    compute.mark_restore_point("the layers it started from")
    first = compute.restore_point
    with torch.no_grad():
        next(compute.module.parameters())[0] = math.inf
    compute.mark_restore_point("the averaged state")
    assert compute.restore_point is first


def test_the_lr_rules():
    assert cluster_lr(0.05, 4, "none", 0) == 0.05
    assert cluster_lr(0.05, 4, "linear", 0) == pytest.approx(0.2)
    assert cluster_lr(0.05, 4, "sqrt", 0) == pytest.approx(0.1)
    assert [cluster_lr(0.05, 4, "warmup", s, 200) for s in (0, 100, 200, 900)] == pytest.approx([0.05, 0.125, 0.2, 0.2])
    assert cluster_lr(0.05, 1, "linear", 0) == 0.05


RECORD = dict(peer_id="12D3KooWOwn", name="own", state="training", ram_gb=8.0, bandwidth_mbps=100.0, gflops=20.0,
              reachability="direct", maddrs=[], version="0.1.0", time=1.0, layers=[0, 9], step=1825)


def test_figures_out_of_the_schema_publish_clamped_and_flagged():
    value = publishable(dict(RECORD, loss=3.2e7, samples_per_s=math.nan, note="diverged\nat step 3"))
    assert value["loss"] == 1e6 and value["samples_per_s"] is None
    assert value["out_of_range"] == ["loss", "samples_per_s"] and value["note"] == "diverged at step 3"
    assert publishable(dict(RECORD, loss=0.5))["out_of_range"] is None
    with pytest.raises(RecordError, match="state"):
        publishable(dict(RECORD, state="exploding"))  # no figure of ours: our own bug, said in one line


def test_a_record_with_an_out_of_range_loss_publishes_and_others_read_it():
    """The peer of issue 29 whose loss passed 10^6 failed every renewal and vanished from everyone's view; through
    a real DHT node that validates the run's records, its record is stored and read back, flagged."""

    async def scenario():
        server = await start_node(record_validators=make_validators(RUN), host_maddrs=LOCAL)
        peer = await start_peer_node(await server.get_visible_maddrs(), RUN, host_maddrs=LOCAL, client_mode=True)
        try:
            announcer = PeerAnnouncer(peer, RUN, "own", Capabilities(ram_gb=8.0, gflops=20.0, bandwidth_mbps=100.0))
            problems = []
            announcer.on_renewal_problem = problems.append
            announcer.update(state="training", loss=5.7e8, samples_per_s=float("inf"), step=1825)
            assert await announcer.renew()
            assert announcer.renewal_failures == 0 and problems == []
            records = await read_peers(server, RUN, alive_at=get_dht_time())
            assert [(r["name"], r["loss"], r["samples_per_s"], r["out_of_range"]) for r in records] == \
                [("own", 1e6, None, ["loss", "samples_per_s"])]
            announcer.update(state="exploding")  # a record that cannot be valid: counted and said, never raised
            assert not await announcer.renew()
            assert announcer.renewal_failures == 1 and "state" in problems[-1]
            announcer.update(state="training")
            assert await announcer.renew() and problems[-1] is None
        finally:
            await stop_node(peer)
            await stop_node(server)

    asyncio.run(scenario())


def test_a_divergence_soon_after_a_round_beside_training_says_what_the_round_did():
    """What a stage's divergence line adds when it came within an averaging period of a round it took: the round,
    where it was taken, and how far it and the training during it moved the parameters."""
    applied = AppliedRound(step=1800, at=3764, moved=0.4213, trained=1.873, parameters=23.19)
    assert str(applied) == ("averaging round 1800, taken at step 3764, moved the parameters by 0.421 (L2) beside 1.87 "
                            "trained during it, to a norm of 23.2")


def test_a_round_taken_beside_training_keeps_the_training_on_top_and_says_what_it_moved():
    """``take_finished`` at a step boundary: the round's values replace those sent, what the stage trained since
    stays on top, and what it did is what a divergence within the next period says (not another worker's, nor
    one more than a period old)."""
    worker = stage_worker()
    sent = flatten([p.detach().clone() for p in worker.module.parameters()])
    train(worker, [torch.randn(4, 64) for _ in range(2)])
    worker.resume_at(107)
    trained = flatten([p.detach().clone() for p in worker.module.parameters()]) - sent
    values = sent + 0.01
    loop = asyncio.new_event_loop()
    finished = loop.create_future()
    finished.set_result((True, values.clone()))
    loop.close()
    averaging = StageAveraging.__new__(StageAveraging)
    averaging.period, averaging._last_applied = 25, None
    averaging.state_server = SimpleNamespace(keep_averaged=lambda layers: None, kept_rounds=lambda start, end: [100])
    renewed = []

    async def renew():
        renewed.append(True)
        return True

    averaging.announcer = SimpleNamespace(update=lambda **fields: None, renew=renew)
    averaging._renewing, averaging._record_changed = None, False
    averaging.in_flight = InFlightRound(worker, 100, sent, {}, [], frozenset(), finished, 0.0)

    async def at_the_boundary():
        taken = averaging.take_finished(worker)
        await averaging._renewing
        return taken

    assert asyncio.run(at_the_boundary()) is True and averaging.in_flight is None
    # the round's kept state is said at once: a leaver that took it with us counts us then (hand_over)
    assert renewed == [True]
    now = flatten([p.detach() for p in worker.module.parameters()])
    assert torch.allclose(now, values + trained)
    applied = averaging.taken_within_period(worker)
    assert (applied.step, applied.at) == (100, 107)
    assert applied.moved == pytest.approx(float((values - sent).norm()), rel=1e-5)
    assert applied.trained == pytest.approx(float(trained.norm()), rel=1e-5)
    assert averaging.taken_within_period(stage_worker()) is None
    worker.resume_at(107 + 26)
    assert averaging.taken_within_period(worker) is None


def test_a_round_given_up_beside_training_leaves_its_outer_state_to_it():
    """A round given up at a step boundary (a partner gone past its grace, which had reached our running ring: it
    died amid an attempt that its ring could not vote it out of) is cancelled and left to end by itself; should it
    outlast the cancel, its outer step would move the anchor under our next round. So the outer state it was given
    is its own, and our next round starts ours anew, as after a stalled round."""
    worker = stage_worker()
    loop = asyncio.new_event_loop()
    running = loop.create_future()  # still running
    averaging = StageAveraging.__new__(StageAveraging)
    given_to_the_round = object()
    averaging._outer_worker, averaging.outer = worker, given_to_the_round
    averaging.following = lambda: SimpleNamespace(gone=frozenset({"partner"}), left=frozenset(), plan=None)
    ring, state = Ring(0, 0, 10, ("me", "partner")), RingState()
    state.arrive("partner")
    averaging.averager = SimpleNamespace(last_finished_step=99, timeout=20.0, mailbox=SimpleNamespace(
        ring_state_if_any=lambda step, index: state if (step, index) == (100, 0) else None))
    averaging.peer_id, averaging.heartbeat = "me", 2.0
    averaging._gone_since = {"partner": time.monotonic() - 1000.0}  # found gone long ago: past gone_grace and a timeout
    failed = []
    averaging._failed = lambda step, why: failed.append((step, why))
    sent = flatten([p.detach().clone() for p in worker.module.parameters()])
    averaging.in_flight = InFlightRound(worker, 100, sent, {}, [ring], frozenset({"partner"}), running,
                                        time.monotonic())
    assert averaging.take_finished(worker) is False and averaging.in_flight is None
    assert running.cancelled() and averaging.outer is None and averaging._outer_worker is None
    assert failed and failed[0][0] == 100 and "gone" in failed[0][1]
    loop.close()


@pytest.mark.timeout(60)
def test_a_renewal_that_fails_is_an_error_only_once_renewals_failed_for_a_heartbeat():
    """Through a real DHT node that refuses our renewals (each expires before the one it holds: a node keeps the
    value that expires last): the first renewal that no node accepts is counted and logged, not said (the retry a
    second later mends most, and the record lives three heartbeats); once renewals have failed for a heartbeat, the
    problem is passed on, as it was at once before."""

    async def scenario():
        server = await start_node(record_validators=make_validators(RUN), host_maddrs=LOCAL)
        peer = await start_peer_node(await server.get_visible_maddrs(), RUN, host_maddrs=LOCAL, client_mode=True)
        try:
            # a short heartbeat: after a second, a node here at times took the earlier-expiring renewal (the test
            # failed that way at commits before and after 2026-12-05's changes, about one run in two)
            announcer = PeerAnnouncer(peer, RUN, "own", Capabilities(ram_gb=8.0, gflops=20.0, bandwidth_mbps=100.0),
                                      heartbeat=0.2)
            problems = []
            announcer.on_renewal_problem = problems.append
            assert await announcer.renew(lifetime=60) and problems == []
            assert not await announcer.renew(lifetime=1)
            first = (announcer.renewal_failures, list(problems))
            await asyncio.sleep(announcer.heartbeat)
            assert not await announcer.renew(lifetime=1)
            return first, announcer.renewal_failures, problems
        finally:
            await stop_node(peer)
            await stop_node(server)

    first, failures, problems = asyncio.run(scenario())
    assert first == (1, []) and failures == 2 and problems == ["no DHT node accepted it"]


@pytest.mark.timeout(240)
def test_a_volunteer_whose_data_drives_its_loss_to_nan_restores_says_so_and_trains_to_the_end(tmp_path, processes,
                                                                                            backbone):
    """A real ``join`` of a user's model whose data holds samples whose features, finite, are past what float32
    sums hold (a NaN itself is refused as the data is read): each time a microbatch draws one, the loss is NaN, the
    stage restores its last good state, its log and its record's note say so, its record counts it; and the run
    still trains to its length."""
    data = features_dir(tmp_path / "data")
    inputs = np.load(os.path.join(data, "inputs.npy"))
    inputs[[1, 2], :] = 3e38  # two training samples (the held-out ones are the last of every HELDOUT_EVERY)
    np.save(os.path.join(data, "inputs.npy"), inputs)
    peer = processes.start(["join", "--initial-peers", backbone, "--run", RUN, "--name", "nan", "--no-dashboard",
                            "--model", "tabular:build", "--data", data, "--steps", "300", "--min-peers", "1",
                            "--round-seconds", "3", "--heartbeat", "2", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"],
                           "nan", env={"PYTHONPATH": USER_MODELS})
    observer = RunObserver(backbone, RUN, period=1.0)
    try:
        record = observer.wait_for(lambda peers: peers.get("nan", {}).get("state") == "done", 200,
                                   "the volunteer trained its 300 steps")["nan"]
    finally:
        observer.close()
    assert record["step"] == 300 and record["divergences"] >= 1, record
    assert record["note"].startswith("diverged at step ") and "the loss is nan; restored layers 0:4 from" in \
        record["note"], record
    assert record["loss"] is not None and math.isfinite(record["loss"]) and record["loss"] < 2.0
    log = peer.stderr()
    assert re.search(r"nan: cluster 0 stage 0 diverged at step \d+: the loss is nan; restored layers 0:4 from", log)
    assert "keeps diverging" in log  # a NaN sample in every epoch: reported, not hidden
    assert "unexpected" not in log and "Traceback" not in log, log[-3000:]


@pytest.mark.timeout(240)
def test_a_cluster_restores_every_stage_when_its_last_stage_diverges(swarm):
    """A cluster of two stages (real ``join`` processes) whose guard is set so tight (``--divergence-factor 0.5``:
    three losses in a row above half the stage's starting level) that its last stage diverges again and again:
    each time, the first stage is told with the backward message and restores its own layers too, and the
    cluster still trains to the run's length."""
    extra = ("--min-peers", "2", "--divergence-factor", "0.5")
    volunteers = {name: swarm(name, steps=300, extra=extra) for name in ("p0", "p1")}
    peers = swarm.watcher.wait_for(lambda peers: len(placed(peers)) == 2 and
                                   all(p["state"] == "done" for p in placed(peers).values()), 200,
                                   "the cluster of two trained its 300 steps")
    first_name, first = next((n, p) for n, p in peers.items() if p.get("stage") == 0)
    last_name, last = next((n, p) for n, p in peers.items() if p.get("stage") == 1)
    assert last["divergences"] >= 1 and first["divergences"] >= 1, peers
    # the notes say what happened last, which may be a skipped step since: the logs keep every restore
    assert "stayed above 0.5 x its level" in volunteers[last_name].stderr(), last
    assert re.search(rf"^{first_name}: cluster 0 stage 0 diverged at step \d+: a later stage: the loss stayed above",
                     volunteers[first_name].stderr(), re.M), first
    for volunteer in volunteers.values():
        assert "unexpected" not in volunteer.stderr() and "Traceback" not in volunteer.stderr()
