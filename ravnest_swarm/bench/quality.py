"""``bench quality``: the swarm's held-out accuracy beside a single process that sees as many samples.

One run: a ``local`` swarm (real processes) trains for ``steps`` optimizer steps per stage; then, in
this process, the same model is trained with the same optimizer, learning rate and microbatch size on
the same number of samples (steps x microbatch size x clusters), drawn in order from one shard; and
once more at the learning rate the swarm's stages use (the run's, scaled by its ``lr_scaling``: ``spec.cluster_lr``).
Both are evaluated on the held-out split. ``--scheme`` sets the run's optimizers and averaging as ``bench
speedup`` names them (``today``, ``new``); the single process trains with the same inner optimizer and schedule. Also reported: the largest share of the model (parameters
and optimizer state, in bytes of tensors held) that any peer holds, relative to 1/stages.

The held-out split of ``mlp-digits`` is 300 digits, so one run's accuracy has a standard error of
about 1.4 points at 94%: more than the 1-point target. ``repeats`` runs the swarm that many times and
the baseline with as many data-order seeds, and the gap is judged on the means.
"""

from __future__ import annotations

import dataclasses
import json
import statistics

from rich.console import Console
from rich.progress import Progress

from ravnest_swarm.bench.speedup_schemes import parse_scheme
from ravnest_swarm.errors import UserError
from ravnest_swarm.models import ShardedSampler, get_model
from ravnest_swarm.optimizers.inner import make_inner_optimizer, scheduled_lr
from ravnest_swarm.swarm.local import LocalOptions, LocalSwarm
from ravnest_swarm.swarm.spec import RunSpec, cluster_lr


def train_single_process(spec: RunSpec, microbatches: int, seed: int = 0, progress=None) -> float:
    """Held-out accuracy of one process trained on ``microbatches`` microbatches of the run's settings."""
    model = get_model(spec.model)
    data = model.dataset()
    full = model.build_full()
    # the stages' own inner optimizer and schedule, over the same number of steps
    optimizer = make_inner_optimizer(full.parameters(), spec.optimizer, spec.lr, spec.weight_decay)
    sampler = ShardedSampler(data.size, 0, 1, spec.microbatch_size, seed)
    for microbatch in range(microbatches):
        inputs, targets = data.get(sampler.sample_ids(microbatch))
        for group in optimizer.param_groups:
            group["lr"] = scheduled_lr(spec.lr, microbatch, microbatches, spec.lr_schedule, spec.warmup_steps)
        optimizer.zero_grad()
        model.loss(full(inputs), targets).backward()
        optimizer.step()
        if progress is not None:
            progress()
    return model.evaluate(full)


async def bench_quality(peers: int, steps: int, model: str, as_json: bool, repeats: int = 1,
                        scheme_text: str = "today") -> int:
    console = Console(stderr=True)
    scheme = parse_scheme(scheme_text)
    spec = RunSpec(model=model, **scheme[1])
    swarm_results, baselines, scaled_baselines = [], [], []
    for repeat in range(repeats):
        swarm = LocalSwarm(LocalOptions(peers=peers, steps=steps, model=model, spec=spec, dashboard=False), console)
        console.print(f"training the swarm ({repeat + 1}/{repeats}): {peers} peers, {steps} steps per stage",
                      highlight=False)
        swarm_result = await swarm.run()
        if not swarm_result["finished"]:
            why = swarm_result["peers_exited"] or "a stop signal, or its time limit"
            raise UserError(f"the swarm stopped before its {steps} steps ({why}): its accuracy would not compare "
                            f"with the baseline's, so nothing is reported", exit_code=1)
        clusters = swarm_result["clusters"] or 1
        microbatches = steps * clusters
        scaled = dataclasses.replace(spec, lr=cluster_lr(spec.lr, clusters, spec.lr_scaling, steps))
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task(f"single-process baselines, seed {repeat}", total=2 * microbatches)
            baselines.append(train_single_process(spec, microbatches, seed=repeat,
                                                  progress=lambda: bar.advance(task)))
            scaled_baselines.append(train_single_process(scaled, microbatches, seed=repeat,
                                                         progress=lambda: bar.advance(task)))
        swarm_results.append(swarm_result)
    accuracies = [r["metric"] for r in swarm_results]
    swarm_accuracy = None if None in accuracies else statistics.fmean(accuracies)
    baseline_accuracy = statistics.fmean(baselines)
    memory = max(swarm_results, key=lambda r: r["max_peer_memory_fraction"] or 0.0)
    result = {
        "benchmark": "quality",
        "model": model,
        "scheme": scheme[0],
        "settings": scheme[1],
        "repeats": repeats,
        "swarm_accuracy": None if swarm_accuracy is None else round(swarm_accuracy, 4),
        "baseline_accuracy": round(baseline_accuracy, 4),
        "accuracy_gap_points": None if swarm_accuracy is None else round(100 * (baseline_accuracy - swarm_accuracy), 2),
        "swarm_accuracies": accuracies,
        "baseline_accuracies": [round(b, 4) for b in baselines],
        # the swarm's stages run at the run's lr scaled for the clusters (spec.cluster_lr): the single process too
        "baseline_scaled_lr_accuracy": round(statistics.fmean(scaled_baselines), 4),
        "samples": microbatches * spec.microbatch_size,
        "clusters": [r["clusters"] for r in swarm_results],
        "averaging_rounds": [r["averaging_rounds"] for r in swarm_results],
        "max_peer_memory_fraction": memory["max_peer_memory_fraction"],
        "peer_memory_fraction": memory["peer_memory_fraction"],
        "swarm": swarm_results if repeats > 1 else swarm_results[0],
    }
    if as_json:
        print(json.dumps(result), flush=True)
    else:
        console.print_json(json.dumps(result))
    return 0
