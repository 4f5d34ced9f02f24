"""``bench quality``: the swarm's held-out accuracy beside a single process that sees as many samples.

One run: a ``local`` swarm (real processes) trains for ``steps`` optimizer steps per stage; then, in
this process, the same model is trained with the same optimizer, learning rate and microbatch size on
the same number of samples (steps x microbatch size x clusters), drawn in order from one shard.
Both are evaluated on the held-out split. Also reported: the largest share of the model (parameters
and optimizer state, in bytes of tensors held) that any peer holds, relative to 1/stages.
"""

from __future__ import annotations

import json

import torch
from rich.console import Console
from rich.progress import Progress

from ravnest_swarm.models import ShardedSampler, get_model
from ravnest_swarm.swarm.local import LocalOptions, LocalSwarm
from ravnest_swarm.swarm.spec import RunSpec


def train_single_process(spec: RunSpec, microbatches: int, seed: int = 0, progress=None) -> float:
    """Held-out accuracy of one process trained on ``microbatches`` microbatches of the run's settings."""
    model = get_model(spec.model)
    data = model.dataset()
    full = model.build_full()
    optimizer = torch.optim.SGD(full.parameters(), lr=spec.lr)
    sampler = ShardedSampler(data.size, 0, 1, spec.microbatch_size, seed)
    for microbatch in range(microbatches):
        inputs, targets = data.get(sampler.sample_ids(microbatch))
        optimizer.zero_grad()
        model.loss(full(inputs), targets).backward()
        optimizer.step()
        if progress is not None:
            progress()
    return model.evaluate(full)


async def bench_quality(peers: int, steps: int, model: str, as_json: bool) -> int:
    console = Console(stderr=True)
    spec = RunSpec(model=model)
    swarm = LocalSwarm(LocalOptions(peers=peers, steps=steps, model=model, spec=spec, dashboard=False), console)
    console.print(f"training the swarm: {peers} peers, {steps} steps per stage", highlight=False)
    swarm_result = await swarm.run()
    clusters = swarm_result["clusters"] or 1
    microbatches = steps * clusters
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("single-process baseline", total=microbatches)
        baseline = train_single_process(spec, microbatches, progress=lambda: bar.advance(task))
    result = {
        "benchmark": "quality",
        "model": model,
        "swarm_accuracy": swarm_result["metric"],
        "baseline_accuracy": round(baseline, 4),
        "accuracy_gap_points": None if swarm_result["metric"] is None
        else round(100 * (baseline - swarm_result["metric"]), 2),
        "samples": microbatches * spec.microbatch_size,
        "clusters": swarm_result["clusters"],
        "averaging_rounds": swarm_result["averaging_rounds"],
        "max_peer_memory_fraction": swarm_result["max_peer_memory_fraction"],
        "peer_memory_fraction": swarm_result["peer_memory_fraction"],
        "swarm": swarm_result,
    }
    if as_json:
        print(json.dumps(result), flush=True)
    else:
        console.print_json(json.dumps(result))
    return 0
