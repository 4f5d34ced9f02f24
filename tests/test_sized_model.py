"""A sized GPT bigger than any peer's RAM offer trains in `local`, and each peer's measured memory is about
its share of the model: at most 1/stages of one process training the whole model, plus 20 %, plus the
runtime a peer needs with no model at all. All three figures are measured here, and printed."""

import json
import subprocess
import sys

import pytest
from test_user_runs import local

from ravnest_swarm.models import load_model

pytestmark = pytest.mark.timeout(600)

MODEL, CONFIG = "gpt", "layers=6,width=384,heads=6,context=32"
MICROBATCH, LR, STEPS = 4, 0.05, 60
NO_MODEL_CONFIG = "layers=1,width=8,heads=1,context=32"  # 5 k parameters: the same peers with no model to speak of
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


def peak_mb_of_peers(summary) -> dict:
    return {name: round(record["peak_memory_gb"] * 1e3) for name, record in summary["peer_records"].items()
            if record["stage"] is not None}


def swarm(config: str) -> dict:
    return local("--peers", "3", "--steps", str(STEPS), "--model", MODEL, "--model-config", config,
                 "--microbatch-size", str(MICROBATCH), "--optimizer", "sgd", "--lr", str(LR),
                 # no outer state either: the peers' memory is held against one SGD process's
                 "--outer-optimizer", "average", "--averaging-compression", "none", "--max-ram-gb", str(OFFER_GB))


def test_a_gpt_bigger_than_any_peers_offer_trains_and_each_peer_holds_about_its_share():
    spec = load_model(MODEL, CONFIG)
    training_state_gb = 2 * sum(layer.param_bytes for layer in spec.layers) / 1e9  # parameters and gradients
    assert training_state_gb > OFFER_GB

    # the runtime: the same swarm training a model of a few thousand parameters, so each peer runs everything a
    # peer runs (torch, hivemind, its DHT node and p2p handlers, the compute thread, averaging) but holds no model
    runtime = max(peak_mb_of_peers(swarm(NO_MODEL_CONFIG)).values()) * 1e6
    whole = int(subprocess.run([sys.executable, "-c", WHOLE_MODEL], capture_output=True, text=True, check=True,
                               timeout=300).stdout.split()[-1])
    summary = swarm(CONFIG)
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
