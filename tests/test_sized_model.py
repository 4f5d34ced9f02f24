"""A sized GPT bigger than any peer's RAM offer trains in `local`, and each peer's measured memory is about
its share of the model: at most 1/stages of one process training the whole model, plus 20 %, plus the
runtime a peer needs with no model at all. All three figures are measured here, and printed."""

import json
import subprocess
import sys
import time

import pytest
from test_user_runs import local

from ravnest_swarm.models import load_model

pytestmark = pytest.mark.timeout(600)

MODEL, CONFIG = "gpt", "layers=6,width=384,heads=6,context=64"
MICROBATCH, LR, STEPS = 16, 0.05, 30
OFFER_GB = 0.06  # every peer's RAM offer: below the model's training state, so it needs several peers

# one process training the whole model with the run's optimizer, microbatch and data, as a user without the swarm
WHOLE_MODEL = f"""
import resource, torch
from ravnest_swarm.models import load_model
spec = load_model({MODEL!r}, {CONFIG!r})
model = spec.build_full()
optimizer = torch.optim.SGD(model.parameters(), lr={LR})
data = spec.dataset()
for step in range(8):
    inputs, targets = data.get(range(step * {MICROBATCH}, (step + 1) * {MICROBATCH}))
    spec.loss(model(inputs), targets).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def peak_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def no_model_runtime_bytes(processes, backbone) -> int:
    """The peak memory of a `join` that has everything but a model: torch, hivemind, its DHT node and records,
    waiting for a run that has no spec."""
    idle = processes.start(["join", "--initial-peers", backbone, "--run", "no-model", "--name", "idle",
                            "--no-dashboard", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], "idle")
    idle.wait_for_output("waiting as standby", timeout=90, stream="stderr")
    time.sleep(3)  # a few heartbeats and DHT reads
    return peak_rss_bytes(idle.popen.pid)


def test_a_gpt_bigger_than_any_peers_offer_trains_and_each_peer_holds_about_its_share(processes, backbone):
    spec = load_model(MODEL, CONFIG)
    training_state_gb = 2 * sum(layer.param_bytes for layer in spec.layers) / 1e9  # parameters and gradients
    assert training_state_gb > OFFER_GB

    runtime = no_model_runtime_bytes(processes, backbone)
    whole = int(subprocess.run([sys.executable, "-c", WHOLE_MODEL], capture_output=True, text=True, check=True,
                               timeout=300).stdout.split()[-1])
    summary = local("--peers", "3", "--steps", str(STEPS), "--model", MODEL, "--model-config", CONFIG,
                    "--microbatch-size", str(MICROBATCH), "--lr", str(LR), "--max-ram-gb", str(OFFER_GB))
    assert summary["finished"], summary["stopped"]
    assert summary["loss_end"] < summary["loss_start"] - 1.0, (summary["loss_start"], summary["loss_end"])

    placed = {name: record for name, record in summary["peer_records"].items() if record["stage"] is not None}
    stages = {}
    for record in placed.values():
        stages[record["cluster"]] = stages.get(record["cluster"], 0) + 1
    assert min(stages.values()) >= 2, stages  # no peer could hold the whole model
    figures = {"no_model_runtime_mb": round(runtime / 1e6), "whole_model_process_mb": round(whole / 1e6),
               "training_state_mb": round(training_state_gb * 1e3), "offer_mb": round(OFFER_GB * 1e3)}
    for name, record in placed.items():
        share = stages[record["cluster"]]
        bound = whole / share * 1.2 + runtime
        figures[name] = {"stages": share, "peak_mb": round(record["peak_memory_gb"] * 1e3),
                         "bound_mb": round(bound / 1e6)}
    print(json.dumps(figures))
    for name, record in placed.items():
        assert record["peak_memory_gb"] * 1e9 <= figures[name]["bound_mb"] * 1e6, figures
