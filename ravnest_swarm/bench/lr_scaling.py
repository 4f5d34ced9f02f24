"""``bench lr-scaling``: the learning-rate rules across clusters, side by side in one process (issue 29).

The scenario of issue 29's lab run, without the network: one cluster trains alone for ``solo`` steps, then a
re-plan makes K clusters that all start from its state (one consistent step), each training its shard of the
data and averaging its parameters with the others every ``averaging_period`` steps (the swarm's rings give every
cluster the mean), until the swarm has seen ``samples`` more samples. Each rule sets the clusters' lr from the
run's: ``none`` (the run's lr), ``sqrt`` (x sqrt K), ``linear`` (x K, the rule the swarm had) and ``warmup``
(from x 1 to x K over ``warmup_steps`` steps after the re-plan), at each base lr given. Every cluster is a whole
model in this process (a pipeline's stages compose the same function), so what differs is only the rule.

Reported per rule and lr: the held-out loss and accuracy at the end, the worst training loss after the re-plan,
and whether it diverged (a loss not finite or above 10^3, the issue's bound for what a peer may report).
"""

from __future__ import annotations

import copy
import json
import math
import statistics
from dataclasses import dataclass
from typing import Dict, List, Sequence

import torch
from rich.console import Console
from rich.progress import Progress

from ravnest_swarm.errors import UserError
from ravnest_swarm.models import ShardedSampler, get_model
from ravnest_swarm.swarm.spec import LR_SCALINGS, cluster_lr

DIVERGED_LOSS = 1e3


@dataclass
class LrScalingOptions:
    model: str = "mlp-digits"
    clusters: int = 4
    lrs: Sequence[float] = (0.05, 0.1, 0.2)
    rules: Sequence[str] = LR_SCALINGS
    solo: int = 1800  # steps the first cluster trains alone (issue 29: holders were at step 1,818-1,825)
    samples: int = 96_000  # samples the K clusters train on after the re-plan, all together
    microbatch_size: int = 32
    averaging_period: int = 25
    warmup_steps: int = 200
    seed: int = 0


def heldout_loss(model_spec, model: torch.nn.Module, batch: int = 256) -> float:
    data = model_spec.heldout()
    total, count = 0.0, 0
    with torch.no_grad():
        for begin in range(0, data.size, batch):
            inputs, targets = data.get(range(begin, min(begin + batch, data.size)))
            total += float(model_spec.loss(model(inputs), targets)) * len(inputs)
            count += len(inputs)
    return total / count


def run_rule(options: LrScalingOptions, rule: str, lr: float, progress=None) -> Dict:
    """One rule at one base lr: the solo phase, the re-plan, the K clusters; the figures at the end."""
    spec = get_model(options.model)
    data = spec.dataset()
    torch.manual_seed(options.seed)
    solo = spec.build_full()
    optimizer = torch.optim.SGD(solo.parameters(), lr=lr)
    sampler = ShardedSampler(data.size, 0, 1, options.microbatch_size, options.seed)
    for step in range(options.solo):
        inputs, targets = data.get(sampler.sample_ids(step))
        optimizer.zero_grad()
        spec.loss(solo(inputs), targets).backward()
        optimizer.step()
    k = options.clusters
    replicas = [copy.deepcopy(solo) for _ in range(k)]
    optimizers = [torch.optim.SGD(r.parameters(), lr=lr) for r in replicas]
    samplers = [ShardedSampler(data.size, c, k, options.microbatch_size, options.seed + 1) for c in range(k)]
    steps = options.samples // (k * options.microbatch_size)
    worst, diverged_at = 0.0, None
    for step in range(steps):
        scaled = cluster_lr(lr, k, rule, step, options.warmup_steps)
        for replica, optimizer, sampler in zip(replicas, optimizers, samplers):
            for group in optimizer.param_groups:
                group["lr"] = scaled
            inputs, targets = data.get(sampler.sample_ids(step))
            optimizer.zero_grad()
            loss = spec.loss(replica(inputs), targets)
            value = float(loss.detach())
            worst = max(worst, value) if math.isfinite(value) else math.inf
            if not math.isfinite(value) or value > DIVERGED_LOSS:
                diverged_at = step
                break
            loss.backward()
            optimizer.step()
        if diverged_at is not None:
            break
        if (step + 1) % options.averaging_period == 0:
            with torch.no_grad():
                for tensors in zip(*(r.parameters() for r in replicas)):
                    mean = torch.stack([t.detach() for t in tensors]).mean(dim=0)
                    for t in tensors:
                        t.copy_(mean)
        if progress is not None:
            progress()
    result = dict(rule=rule, lr=lr, cluster_lr_after_warmup=cluster_lr(lr, k, rule, steps, options.warmup_steps),
                  diverged=diverged_at is not None, diverged_at_step=diverged_at,
                  worst_training_loss=None if not math.isfinite(worst) else round(worst, 4))
    if diverged_at is None:
        final = replicas[0]  # all equal after the last averaging but for < one period of local steps: average them
        with torch.no_grad():
            for tensors in zip(*(r.parameters() for r in replicas)):
                tensors[0].copy_(torch.stack([t.detach() for t in tensors]).mean(dim=0))
        result.update(heldout_loss=round(heldout_loss(spec, final), 4), heldout_accuracy=round(spec.evaluate(final), 4))
    return result


def bench_lr_scaling(options: LrScalingOptions, as_json: bool) -> int:
    console = Console(stderr=True)
    for rule in options.rules:
        if rule not in LR_SCALINGS:
            raise UserError(f"--rules: {rule!r} is not one of {', '.join(LR_SCALINGS)}")
    if options.clusters < 1:
        raise UserError("--clusters must be at least 1")
    steps = options.samples // (options.clusters * options.microbatch_size)
    results: List[Dict] = []
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("rules x lrs", total=len(options.rules) * len(options.lrs) * steps)
        for lr in options.lrs:
            for rule in options.rules:
                results.append(run_rule(options, rule, lr, progress=lambda: bar.advance(task)))
    best = {}
    for lr in options.lrs:
        trained = [r for r in results if r["lr"] == lr and not r["diverged"]]
        best[str(lr)] = min(trained, key=lambda r: r["heldout_loss"])["rule"] if trained else None
    summary = {rule: dict(diverged=sum(r["diverged"] for r in results if r["rule"] == rule),
                          meanheldout_loss=_mean([r.get("heldout_loss") for r in results if r["rule"] == rule]))
               for rule in options.rules}
    output = dict(benchmark="lr-scaling", model=options.model, clusters=options.clusters, solo_steps=options.solo,
                  samples_after_replan=options.samples, averaging_period=options.averaging_period,
                  results=results, best_rule_per_lr=best, per_rule=summary)
    for r in results:
        console.print(f"lr {r['lr']:<5g} {r['rule']:<7} " + (f"diverged at step {r['diverged_at_step']}" if r["diverged"]
                      else f"held-out loss {r['heldout_loss']:.4f} accuracy {r['heldout_accuracy']:.4f} "
                           f"worst loss {r['worst_training_loss']:.3g}"), highlight=False)
    print(json.dumps(output) if as_json else json.dumps(output, indent=1), flush=True)
    return 0


def _mean(values) -> float:
    values = [v for v in values if v is not None]
    return round(statistics.fmean(values), 4) if values else None
