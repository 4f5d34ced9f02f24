"""The swarm end to end with real processes: clusters form, train and average; failures heal; state moves."""

import os
import re
import time

import pytest
import torch

from run_observer import RunObserver
from ravnest_swarm.checkpoint import TEMPORARY_PREFIX, TEMPORARY_SUFFIX, read_stage
from ravnest_swarm.models import get_model
from ravnest_swarm.swarm.spec import RunSpec
from ravnest_swarm.swarm.placement import model_workload

RUN = "swarm-test"
MODEL_GB = model_workload(get_model("mlp-digits"), RunSpec("mlp-digits"), 8)[0].model_gb


@pytest.fixture
def swarm(processes, tmp_path):
    backbone = processes.start(["backbone", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--run", RUN], "backbone")
    maddr = backbone.maddrs()[0]
    watcher = RunObserver(maddr, RUN, period=1.0)

    def join(name, ram_fraction=0.6, gflops=20.0, steps=120, extra=()):
        args = ["join", "--initial-peers", maddr, "--run", RUN, "--name", name, "--no-dashboard",
                "--model", "mlp-digits", "--steps", str(steps), "--averaging-period", "20", "--heartbeat", "2",
                "--round-seconds", "6", "--ram-gb", f"{MODEL_GB * ram_fraction:.9f}", "--gflops", str(gflops),
                "--bandwidth-mbps", "100", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                "--checkpoint-dir", str(tmp_path / "checkpoints"), *extra]
        return processes.start(args, name)

    join.watcher, join.maddr, join.checkpoints = watcher, maddr, tmp_path / "checkpoints"
    try:
        yield join
    finally:
        watcher.close()


def placed(peers):
    return {n: p for n, p in peers.items() if p.get("cluster") is not None and p["cluster"] >= 0}


def checkpoint_layers(path):
    """{layer index: {name: tensor}} and the step of one peer's checkpoint."""
    tensors, metadata = read_stage(str(path))
    start, end = metadata["info"]["layers"]
    layers = {}
    for layer in range(start, end):
        prefix = f"param.{layer - start}."
        layers[layer] = {k[len(prefix):]: t for k, t in tensors.items() if k.startswith(prefix)}
    return layers, metadata["info"]["step"]


@pytest.mark.timeout(300)
def test_five_peers_form_clusters_train_and_average(swarm):
    # 600 steps, not the fixture's 120: a cluster that starts a second before the other trains on while its first
    # round waits for it (averaging beside training), and here 120 steps take about half a second
    for index in range(5):
        swarm(f"p{index}", steps=600, extra=("--min-peers", "5"), gflops=20 + 5 * index)
    peers = swarm.watcher.wait_for(
        lambda peers: len(placed(peers)) >= 4 and all(p["state"] == "done" for p in placed(peers).values()),
        240, "every placed peer trained its 600 steps")
    clusters = {p["cluster"] for p in placed(peers).values()}
    assert len(clusters) >= 2, peers
    # the spares wait as standbys, and leave once the run is finished (nothing left for them to train)
    assert all(p["state"] in ("standby", "leaving") for n, p in peers.items() if n not in placed(peers))
    assert min(p.get("averaging_rounds") or 0 for p in placed(peers).values()) >= 2
    last_losses = [p["loss"] for p in placed(peers).values() if p.get("loss") is not None]
    assert last_losses and max(last_losses) < 1.0  # cross-entropy starts near ln(10) = 2.3


@pytest.mark.timeout(360)
def test_sigkilled_stage_is_replaced_by_a_standby_and_training_goes_on(swarm):
    volunteers = {f"p{i}": swarm(f"p{i}", steps=100_000, extra=("--min-peers", "5"), gflops=20 + 5 * i)
                  for i in range(5)}
    peers = swarm.watcher.wait_for(lambda peers: len(peers) == 5 and 2 <= len(placed(peers)) < 5 and
                                   all((p.get("step") or 0) >= 30 for p in placed(peers).values()),
                                   200, "placed peers past step 30 and a standby")
    standbys = [n for n in peers if n not in placed(peers)]
    victim = sorted(placed(peers))[0]
    victim_step = peers[victim]["step"]
    volunteers[victim].kill_group()

    peers = swarm.watcher.wait_for(
        lambda peers: victim not in peers and any(n in placed(peers) and (peers[n].get("step") or 0) > 0
                                                  for n in standbys),
        150, f"a standby of {standbys} takes a slot after {victim} was killed")
    # it started from the state of the layers it took over (downloaded), not from scratch
    assert any(re.search(rf"{n}: training cluster \d+ stage \d+/\d+ layers \d+:\d+ from step [1-9]\d*",
                         volunteers[n].stderr()) for n in standbys)
    before = {n: p["step"] for n, p in placed(peers).items()}
    peers = swarm.watcher.wait_for(lambda peers: all((peers.get(n, {}).get("step") or 0) > before[n] + 20
                                                     for n in before), 120, "training goes on after the repair")
    assert max(p["step"] for p in placed(peers).values()) > victim_step


@pytest.mark.timeout(300)
def test_late_joiner_is_placed_mid_run_with_the_holders_parameters_and_step(swarm):
    for i in range(2):  # the fixture stops the holders
        swarm(f"p{i}", steps=100_000, extra=("--min-peers", "2", "--checkpoint-every", "100000"))
    swarm.watcher.wait_for(lambda peers: len(placed(peers)) == 2 and
                           all((p.get("step") or 0) >= 40 for p in placed(peers).values()), 150,
                           "two peers past step 40")
    # a strong late joiner: it can hold the whole model, so the next plan gives it a cluster of its own
    late = swarm("late", ram_fraction=1.5, gflops=200, steps=100_000, extra=("--min-peers", "1",
                                                                            "--checkpoint-every", "100000"))
    started = late.wait_for_output(r"late: training cluster \d+ stage 0/1 layers 0:(\d+) from step (\d+)", 150,
                                   stream="stderr")
    step = int(started.group(2))
    assert step >= 40
    every_layer = list(range(len(get_model("mlp-digits").layers)))
    assert int(started.group(1)) == len(every_layer)
    assert f"late: downloading layers {every_layer}" in late.stderr(), late.stderr()[-2000:]
    # what it downloaded is the holders' state at that step, not the seeded initial weights: its checkpoint,
    # written right after the download, differs from the initial model in every layer
    late_layers, late_step = checkpoint_layers(swarm.checkpoints / f"{RUN}-late.safetensors")
    assert late_step == step
    initial = get_model("mlp-digits").build_stage(0, len(every_layer))
    for layer in every_layer:
        seeded = initial[layer].state_dict()
        assert any(not torch.equal(tensor, seeded[key]) for key, tensor in late_layers[layer].items()), layer


@pytest.mark.timeout(360)
def test_kill_everything_then_resume_continues_from_the_checkpoints(swarm):
    names = [f"p{i}" for i in range(4)]
    common = ("--min-peers", "4", "--checkpoint-every", "10")
    first = {n: swarm(n, steps=100_000, extra=common, gflops=20 + 5 * i) for i, n in enumerate(names)}
    swarm.watcher.wait_for(lambda peers: len(placed(peers)) >= 2 and
                           all((p.get("step") or 0) >= 35 for p in placed(peers).values()), 200, "past step 35")
    for process in first.values():
        process.kill_group()  # kill -9 every peer mid-training: no chance to write anything more
    # written atomically: a write the kill cut short left only its hidden temporary file, never a
    # half-written checkpoint (every checkpoint is read in full below)
    leftovers = [f for f in os.listdir(swarm.checkpoints) if not f.endswith((".safetensors", ".key"))
                 and not (f.startswith(TEMPORARY_PREFIX) and f.endswith(TEMPORARY_SUFFIX))]
    assert leftovers == []
    saved = {n: checkpoint_layers(swarm.checkpoints / f"{RUN}-{n}.safetensors")[1] for n in names
             if (swarm.checkpoints / f"{RUN}-{n}.safetensors").exists()}  # peers left standby never trained
    assert len(saved) >= 2 and all(step >= 10 for step in saved.values()), saved

    # the restart plans afresh only once the killed peers' records expired (2 heartbeats)
    swarm.watcher.wait_for(lambda peers: not set(names) & set(peers), 60, "the killed peers' records expired")
    second = {n: swarm(n, steps=100_000, extra=(*common, "--resume") if n in saved else common, gflops=20 + 5 * i)
              for i, n in enumerate(names)}
    for name in saved:
        second[name].wait_for_output(rf"{name}: resuming layers \d+:\d+ from step {saved[name]}\b", 120,
                                     stream="stderr")
    deadline = time.monotonic() + 200
    while time.monotonic() < deadline:
        training = {n: re.search(rf"{n}: training cluster \d+ stage .* from step (\d+)", p.stderr())
                    for n, p in second.items()}
        training = {n: int(match.group(1)) for n, match in training.items() if match}
        if len(training) >= 2:
            break
        time.sleep(2)
    else:
        raise AssertionError("no cluster formed again after the restart")
    # nothing trained is lost: every resumed stage starts at least where the checkpoints left off
    for name, started in training.items():
        assert started >= min(saved.values()) > 0, (name, started, saved)
