"""``bench diloco``: inner and outer optimizers side by side in one process, K clusters against one (issue 30).

Each configuration trains the run's model as K replicas (clusters of one stage, each on its shard of the data)
for ``samples`` samples in all, averaging every ``averaging_period`` steps through the outer optimizer
(``optimizers.outer``: ``average`` or DiLoCo's ``nesterov``), each replica stepping with the inner optimizer
(``optimizers.inner``) at its lr; K = 1 with the same inner optimizer is the reference. Reported: the held-out loss
at the end (equal samples) and the samples each needed to first reach the target (K = 1 ``sgd``'s loss at the end),
evaluated every ``eval_every`` steps. A pipeline's stages compose the same function, so only the optimizers differ.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from rich.console import Console
from rich.progress import Progress

from ravnest_swarm.bench.lr_scaling import DIVERGED_LOSS, heldout_loss
from ravnest_swarm.models import ShardedSampler, get_model
from ravnest_swarm.optimizers.inner import make_inner_optimizer
from ravnest_swarm.optimizers.outer import OuterOptimizer

# (inner optimizer, its lr, outer optimizer): today's scheme first
CONFIGURATIONS = (("sgd", 0.05, "average"), ("sgd", 0.05, "nesterov"), ("momentum", 0.05, "average"),
                  ("momentum", 0.05, "nesterov"), ("adamw", 0.002, "average"), ("adamw", 0.002, "nesterov"))


@dataclass
class DilocoOptions:
    model: str = "mlp-digits"
    clusters: Sequence[int] = (1, 4)
    samples: int = 19_200  # bench speedup's
    microbatch_size: int = 32
    averaging_period: int = 25
    eval_every: int = 25
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    seed: int = 0


def train(options: DilocoOptions, inner: str, lr: float, outer: str, k: int, progress=None) -> Dict:
    spec = get_model(options.model)
    data = spec.dataset()
    torch.manual_seed(options.seed)
    start = spec.build_full()
    replicas = [copy.deepcopy(start) for _ in range(k)]
    optimizers = [make_inner_optimizer(r.parameters(), inner, lr) for r in replicas]
    samplers = [ShardedSampler(data.size, c, k, options.microbatch_size, options.seed) for c in range(k)]
    state = OuterOptimizer(outer, options.outer_lr, options.outer_momentum)
    state.step(torch.nn.utils.parameters_to_vector(start.parameters()).detach())  # the shared start is the anchor
    steps = options.samples // (k * options.microbatch_size)
    curve: List[Tuple[int, float]] = []
    diverged = False
    for step in range(steps):
        for replica, optimizer, sampler in zip(replicas, optimizers, samplers):
            inputs, targets = data.get(sampler.sample_ids(step))
            optimizer.zero_grad()
            loss = spec.loss(replica(inputs), targets)
            if not math.isfinite(float(loss.detach())) or float(loss.detach()) > DIVERGED_LOSS:
                diverged = True
                break
            loss.backward()
            optimizer.step()
        if diverged:
            break
        if k > 1 and (step + 1) % options.averaging_period == 0:
            with torch.no_grad():
                mean = torch.stack([torch.nn.utils.parameters_to_vector(r.parameters()) for r in replicas]).mean(0)
                after = state.step(mean)
                for replica in replicas:
                    torch.nn.utils.vector_to_parameters(after, replica.parameters())
        if (step + 1) % options.eval_every == 0 or step == steps - 1:
            with torch.no_grad():
                model = copy.deepcopy(replicas[0])
                mean = torch.stack([torch.nn.utils.parameters_to_vector(r.parameters()) for r in replicas]).mean(0)
                torch.nn.utils.vector_to_parameters(mean, model.parameters())
            curve.append(((step + 1) * k * options.microbatch_size, heldout_loss(spec, model)))
        if progress is not None:
            progress()
    return dict(inner=inner, lr=lr, outer=outer, clusters=k, diverged=diverged,
                heldout_loss=None if diverged or not curve else round(curve[-1][1], 4), curve=curve)


def samples_to(curve: List[Tuple[int, float]], target: float) -> Optional[int]:
    return next((samples for samples, loss in curve if loss <= target), None)


def bench_diloco(options: DilocoOptions, as_json: bool,
                 configurations: Sequence[Tuple[str, float, str]] = CONFIGURATIONS) -> int:
    console = Console(stderr=True)
    runs = [(inner, lr, outer, k) for inner, lr, outer in configurations for k in options.clusters
            if k > 1 or outer == "average"]  # one cluster has no round: its outer optimizer does nothing
    total = sum(options.samples // (k * options.microbatch_size) for *_, k in runs)
    results = []
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("configurations", total=total)
        for inner, lr, outer, k in runs:
            results.append(train(options, inner, lr, outer, k, progress=lambda: bar.advance(task)))
    reference = next(r for r in results if r["clusters"] == 1 and r["inner"] == configurations[0][0])
    target = reference["heldout_loss"]
    for r in results:
        r["samples_to_target"] = samples_to(r["curve"], target)
        r["loss_vs_one_sgd_cluster"] = None if r["heldout_loss"] is None else round(r["heldout_loss"] / target, 3)
        console.print(f"K={r['clusters']} {r['inner']:<8} lr {r['lr']:<6g} {r['outer']:<8} held-out loss "
                      f"{r['heldout_loss']} ({r['loss_vs_one_sgd_cluster']}x), samples to {target:.4f}: "
                      f"{r['samples_to_target']}", highlight=False)
        r["curve"] = [[s, round(v, 4)] for s, v in r["curve"]]
    output = dict(benchmark="diloco", model=options.model, samples=options.samples,
                  averaging_period=options.averaging_period, outer_lr=options.outer_lr,
                  outer_momentum=options.outer_momentum, target_loss=target, results=results)
    print(json.dumps(output) if as_json else json.dumps(output, indent=1), flush=True)
    return 0
