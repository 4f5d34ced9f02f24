"""The asynchronous pipeline over real P2P between real stage processes on 127.0.0.1."""

import pytest
import torch

from pipeline_helpers import losses, read_report, read_weights, start_stages, wait_all
from ravnest_swarm.models import ShardedSampler, get_model
from ravnest_swarm.bench.pipeline import round_trip_breakdown

STEPS = 8
MICROBATCH = 8
LR = 0.1


def reference_weights(model: str) -> dict:
    """The same model trained in this process: same samples, same SGD, one microbatch at a time."""
    torch.set_num_threads(1)
    spec = get_model(model)
    full = spec.build_full()
    dataset = spec.dataset()
    sampler = ShardedSampler(dataset.size, 0, 1, MICROBATCH)
    optimizer = torch.optim.SGD(full.parameters(), lr=LR)
    for microbatch in range(STEPS):
        inputs, targets = dataset.get(sampler.sample_ids(microbatch))
        optimizer.zero_grad()
        spec.loss(full(inputs), targets).backward()
        optimizer.step()
    return {name: p.detach() for name, p in full.named_parameters()}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model, ranges, mode", [
    ("mlp-digits", [(0, 3), (3, 6), (6, 9)], "stash"),
    ("gpt-tiny", [(0, 3), (3, 6)], "recompute"),
])
def test_one_in_flight_equals_single_process_training(processes, backbone, tmp_path, model, ranges, mode):
    stages = start_stages(processes, backbone, model, ranges, str(tmp_path), extra=[
        "--microbatches", str(STEPS), "--microbatch-size", str(MICROBATCH), "--max-in-flight", "1",
        "--lr", str(LR), "--mode", mode, "--trace"])
    wait_all(stages, 200)
    pipelined = read_weights(str(tmp_path), len(ranges))
    expected = reference_weights(model)
    assert set(pipelined) == set(expected)
    worst = max((pipelined[name] - expected[name]).abs().max().item() for name in expected)
    assert worst <= 1e-5, f"max abs difference {worst}"
    first, last = read_report(str(tmp_path), 0), read_report(str(tmp_path), len(ranges) - 1)
    assert first["completed"] == STEPS and first["dropped"] == 0 and first["max_staleness"] == 0
    assert len(last["losses"]) == STEPS and all(r["version"] == STEPS for r in (first, last))
    # every stage traced every microbatch: the bench's round-trip breakdown has each part of each one
    breakdown = round_trip_breakdown([read_report(str(tmp_path), i) for i in range(len(ranges))], 0, float("inf"))
    parts = [value for name, values in breakdown.items() if isinstance(values, list) for value in values]
    assert breakdown["microbatches"] == STEPS and len(parts) == 6 * len(ranges) - 4
    assert all(value is not None and 0 <= value <= breakdown["round_trip"] for value in parts)
    # the weights did move: the test would pass trivially if nothing trained
    initial = {name: p.detach() for name, p in get_model(model).build_full().named_parameters()}
    assert max((expected[name] - initial[name]).abs().max().item() for name in expected) > 1e-3


@pytest.mark.timeout(240)
def test_three_stages_with_many_in_flight_halve_the_loss(processes, backbone, tmp_path):
    ranges = [(0, 3), (3, 6), (6, 9)]
    # stage 0 sends plain floats, stage 1 float16, stage 2 meanstd16 gradients: each receiver takes all three
    stages = start_stages(processes, backbone, "mlp-digits", ranges, str(tmp_path), extra=[
        "--microbatches", "160", "--microbatch-size", "32", "--max-in-flight", "6", "--lr", "0.1"],
        stage_extra={1: ["--compression", "float16"], 2: ["--compression", "meanstd16"]})
    wait_all(stages, 200)
    first, last = read_report(str(tmp_path), 0), read_report(str(tmp_path), 2)
    curve = losses(last)
    start, end = sum(curve[:10]) / 10, sum(curve[-10:]) / 10
    assert end < start / 2, f"loss went from {start:.3f} to {end:.3f}"
    assert first["completed"] == 160 and first["dropped"] == 0
    # many microbatches really were in flight at once: later ones were forwarded on older weights
    assert first["max_staleness"] >= 3
    # each stage said where its time went, and counted the bytes its streams carried: stage 0 sent activations
    # and received gradients, the middle stage both
    middle = read_report(str(tmp_path), 1)
    for report in (first, middle, last):
        assert sum(report["time_shares"].values()) == pytest.approx(1.0) and report["time_shares"]["computing"] > 0
    forward, backward = "ravnest.pipeline.forward", "ravnest.pipeline.backward"
    assert first["traffic"]["sent"][forward] > 0 and first["traffic"]["received"][backward] > 0
    assert middle["traffic"]["received"][forward] > 0 and middle["traffic"]["sent"][backward] > 0
