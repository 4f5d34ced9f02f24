"""``bench diloco``: inner and outer optimizers side by side in one process, K clusters against one (issue 30).

Each configuration trains the run's model as K replicas (clusters of one stage, each on its shard of the data)
for ``samples`` samples in all, averaging every ``averaging_period`` steps through the outer optimizer
(``optimizers.outer``: ``average`` or DiLoCo's ``nesterov``), each replica stepping with the inner optimizer
(``optimizers.inner``) at its lr; K = 1 with the same inner optimizer is the reference. Reported: the held-out loss
at the end (equal samples) and the samples each needed to first reach the target (the first configuration's K = 1
loss at the end: ``sgd``'s of the built-in ones, or with ``--target-samples`` at those samples, so that the others
can train on to reach it), evaluated every ``eval_every`` steps. A pipeline's stages compose the same function, so
only the optimizers differ.

``--reform-every R`` measures what a cluster re-formed mid-run should do with its inner optimizer's state (issue 30:
it goes with the layers, or is reset where carrying it is measured to be worse): every R-th round one cluster in
turn is re-formed, as when a new cluster downloads its layers from another's holders. Its parameters are the
round's result either way; its inner state is ``reset`` (what a run did: a new optimizer) or ``carry``-ied (a copy
of the state of the cluster it downloads from, as a holder could serve it), beside the run where no cluster is
re-formed (``none``).

``--synchronous`` adds, beside each configuration's K > 1, one replica trained on K times the microbatch for the
same samples: the gradient K clusters would average at every step (synchronous data parallelism), the usual
reference for what K clusters can gain, which local steps approach from below as a rule. Where it too needs far
more samples than K = 1 to reach a loss, what bounds the clusters' time to that loss is the model's own use of a
larger batch, not their averaging.

``--averaging-compression none,int8,int4`` runs each configuration of K > 1 in each ring codec: ``none`` averages
parameters as above, a compressing codec averages the replicas' pseudo-gradients with error feedback, as a run's
``averaging_compression`` does (``optimizers.outer``). Each round's mean comes from :func:`ring_mean`, the ring's
own arithmetic over encoded parts, and its bytes are those of the messages the ring would send, built as it builds
them (metadata and parts as encoded, one stripe per ``STREAMS_PER_STEP``, and the arrive notes): bytes per member
per round, reported beside the held-out loss.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from rich.console import Console
from rich.progress import Progress

from ravnest_swarm.averaging.segments import chunk_bounds
from ravnest_swarm.averaging.wire import GATHER, PART_BYTES, REDUCE, STREAMS_PER_STEP, RingArrive, RingPart
from ravnest_swarm.bench.lr_scaling import DIVERGED_LOSS, heldout_loss
from ravnest_swarm.codecs.codec import CODECS, RAW, Codec, compression_residual
from ravnest_swarm.errors import UserError
from ravnest_swarm.models import ShardedSampler, get_model
from ravnest_swarm.net.transport import make_request
from ravnest_swarm.optimizers.inner import INNER_OPTIMIZERS, make_inner_optimizer
from ravnest_swarm.optimizers.outer import OUTER_OPTIMIZERS, OuterOptimizer

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
    compressions: Sequence[str] = ("none",)  # the ring codecs each configuration of K > 1 runs in
    reform_every: Optional[int] = None  # rounds between re-formed clusters (module docstring); None: none re-formed
    synchronous: bool = False  # beside each K > 1: one replica on K x the microbatch (module docstring)
    target_samples: Optional[int] = None  # the target is the reference's loss at these samples (None: at the end)


def ring_mean(values: Sequence[torch.Tensor], codec: Codec, run: str = "bench") -> Tuple[torch.Tensor, int]:
    """The mean a ring of ``len(values)`` members computes of their flat ``values`` in ``codec`` (``ring.RingAttempt``:
    chunk c starts at member c as its own encoded part, each next member adds its own to the decoded partial sum
    and encodes it again, the last divides and keeps what it sends; the gather forwards that), and the bytes one
    member sends in the round, on average: every message's requests as ``RingSender`` counts them."""
    count, length = len(values), values[0].numel()
    part_elements = max(1, PART_BYTES // 4)
    mean = torch.empty(length)
    sent = 0
    note = RingArrive(run=run, step=1, ring=0, position=0, attempt=[])
    sent += count * (count - 1) * make_request(note.as_metadata()).ByteSize()
    for phase, position in [(REDUCE, t) for t in range(count - 1)] + [(GATHER, t) for t in range(count - 1)]:
        metadata = RingPart(run=run, step=1, ring=0, position=position, attempt=[], phase=phase, codec=codec.name,
                            stripes=STREAMS_PER_STEP)
        sent += count * STREAMS_PER_STEP * make_request(metadata.as_metadata()).ByteSize()
    for chunk, (lo, hi) in enumerate(chunk_bounds(length, count)):
        for start in range(lo, hi, part_elements) if hi > lo else [lo]:
            part = slice(start, min(start + part_elements, hi))
            encoded = codec.encode(values[chunk][part])
            sent += make_request({}, [encoded]).ByteSize() - make_request({}).ByteSize()
            partial = codec.decode(encoded, "part", None)
            for step in range(1, count):
                partial = partial + values[(chunk + step) % count][part]
                if step == count - 1:
                    partial /= count
                encoded = codec.encode(partial)
                size = make_request({}, [encoded]).ByteSize() - make_request({}).ByteSize()
                sent += size if step < count - 1 else size * (count - 1)  # the owner's is forwarded around
                partial = codec.decode(encoded, "part", None) if codec is not RAW else partial
            mean[part] = partial
    return mean, sent // count


def train(options: DilocoOptions, inner: str, lr: float, outer: str, k: int, progress=None,
          compression: str = "none", reform: str = "none", synchronous_of: Optional[int] = None) -> Dict:
    """One configuration: ``k`` replicas, or with ``synchronous_of`` = K one replica on K x the microbatch."""
    if synchronous_of is not None:
        options = dataclasses.replace(options, microbatch_size=options.microbatch_size * synchronous_of)
    spec = get_model(options.model)
    data = spec.dataset()
    torch.manual_seed(options.seed)
    start = spec.build_full()
    replicas = [copy.deepcopy(start) for _ in range(k)]
    optimizers = [make_inner_optimizer(r.parameters(), inner, lr) for r in replicas]
    samplers = [ShardedSampler(data.size, c, k, options.microbatch_size, options.seed) for c in range(k)]
    state = OuterOptimizer(outer, options.outer_lr, options.outer_momentum)
    start_vector = torch.nn.utils.parameters_to_vector(start.parameters()).detach()
    codec = CODECS[compression]
    if codec is RAW:
        state.step(start_vector)  # the shared start is the anchor
    else:  # the shared start is the anchor of every replica's pseudo-gradient; each keeps its own error
        state.step_segments(start_vector, start_vector, [], torch.zeros_like(start_vector))
    errors = [torch.zeros_like(start_vector) for _ in range(k)]
    round_bytes: List[int] = []
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
                vectors = [torch.nn.utils.parameters_to_vector(r.parameters()) for r in replicas]
                if codec is RAW:
                    after = state.step(torch.stack(vectors).mean(0))  # today's mean; the ring's bytes beside it
                    round_bytes.append(ring_mean(vectors, codec)[1])
                else:
                    sent = [state.anchor - vector + error for vector, error in zip(vectors, errors)]
                    errors = [compression_residual(values, codec, [(0, values.numel())]) for values in sent]
                    mean, size = ring_mean(sent, codec)
                    round_bytes.append(size)
                    after = state.step_segments(vectors[0], mean, [(0, mean.numel())], errors[0])
                    state.error = None  # the bench keeps each replica's error itself, in ``errors``
                for replica in replicas:
                    torch.nn.utils.vector_to_parameters(after, replica.parameters())
            rounds = (step + 1) // options.averaging_period
            if reform != "none" and rounds % options.reform_every == 0:
                optimizers[(rounds // options.reform_every) % k] = reformed(
                    replicas, optimizers, (rounds // options.reform_every) % k, inner, lr, reform)
        if (step + 1) % options.eval_every == 0 or step == steps - 1:
            with torch.no_grad():
                model = copy.deepcopy(replicas[0])
                mean = torch.stack([torch.nn.utils.parameters_to_vector(r.parameters()) for r in replicas]).mean(0)
                torch.nn.utils.vector_to_parameters(mean, model.parameters())
            curve.append(((step + 1) * k * options.microbatch_size, heldout_loss(spec, model)))
        if progress is not None:
            progress()
    return dict(inner=inner, lr=lr, outer=outer, clusters=k, synchronous_of=synchronous_of,
                microbatch_size=options.microbatch_size, compression=compression, reform=reform, diverged=diverged,
                heldout_loss=None if diverged or not curve else round(curve[-1][1], 4), curve=curve,
                bytes_per_round=round(sum(round_bytes) / len(round_bytes)) if round_bytes else None)


def reformed(replicas: List[torch.nn.Module], optimizers: List[torch.optim.Optimizer], cluster: int, inner: str,
             lr: float, reform: str) -> torch.optim.Optimizer:
    """The inner optimizer of ``cluster``, re-formed after a round: a new one (``reset``), or one with a copy of the
    state of the next cluster's, the one its layers come from (``carry``)."""
    optimizer = make_inner_optimizer(replicas[cluster].parameters(), inner, lr)
    if reform == "carry":
        optimizer.load_state_dict(copy.deepcopy(optimizers[(cluster + 1) % len(optimizers)].state_dict()))
    return optimizer


def parse_configurations(text: str) -> Tuple[Tuple[str, float, str], ...]:
    """``inner:lr:outer,...`` (``adamw:0.008:average``) as configurations; the first one's K = 1 is the target."""
    configurations = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        fields = item.split(":")
        if len(fields) != 3 or fields[0] not in INNER_OPTIMIZERS or fields[2] not in OUTER_OPTIMIZERS:
            raise UserError(f"--configurations: {item!r} is not inner:lr:outer (inner one of "
                            f"{', '.join(INNER_OPTIMIZERS)}, outer one of {', '.join(OUTER_OPTIMIZERS)})")
        try:
            lr = float(fields[1])
        except ValueError:
            lr = math.nan
        if not 0 < lr < math.inf:
            raise UserError(f"--configurations: the lr of {item!r} must be a positive number")
        configurations.append((fields[0], lr, fields[2]))
    if not configurations:
        raise UserError("--configurations names no configuration (inner:lr:outer,...)")
    return tuple(configurations)


def samples_to(curve: List[Tuple[int, float]], target: float) -> Optional[int]:
    return next((samples for samples, loss in curve if loss <= target), None)


def bench_diloco(options: DilocoOptions, as_json: bool,
                 configurations: Sequence[Tuple[str, float, str]] = CONFIGURATIONS) -> int:
    console = Console(stderr=True)
    reforms = ("none", "reset", "carry") if options.reform_every else ("none",)
    runs = [(inner, lr, outer, k, compression, reform, None) for inner, lr, outer in configurations
            for k in options.clusters for compression in (options.compressions if k > 1 else ("none",))
            for reform in (reforms if k > 1 else ("none",))
            if k > 1 or outer == "average"]  # one cluster has no round: its outer optimizer does nothing
    if options.synchronous:  # one per inner optimizer and K: it has no round, so no outer optimizer
        runs += [(inner, lr, "average", 1, "none", "none", k) for inner, lr in dict.fromkeys(
            (inner, lr) for inner, lr, _ in configurations) for k in options.clusters if k > 1]
    total = sum(options.samples // (run[3] * (run[6] or 1) * options.microbatch_size) for run in runs)
    results = []
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("configurations", total=total)
        for inner, lr, outer, k, compression, reform, synchronous_of in runs:
            results.append(train(options, inner, lr, outer, k, progress=lambda: bar.advance(task),
                                 compression=compression, reform=reform, synchronous_of=synchronous_of))
    reference = next(r for r in results if r["clusters"] == 1 and r["synchronous_of"] is None
                     and (r["inner"], r["lr"]) == configurations[0][:2])
    # the reference's loss at the end, or at --target-samples: with a constant lr its curve to there is that of a run
    # of that length, so the others may train on past it to show the samples they need to reach it
    target = reference["heldout_loss"] if options.target_samples is None else next(
        (loss for samples, loss in reference["curve"] if samples >= options.target_samples), reference["heldout_loss"])
    for r in results:
        r["samples_to_target"] = samples_to(r["curve"], target)
        r["loss_vs_target"] = None if r["heldout_loss"] is None else round(r["heldout_loss"] / target, 3)
        # against the same configuration averaged in float32: bytes and held-out loss
        float32 = next(f for f in results if f["compression"] == "none" and
                       (f["inner"], f["lr"], f["outer"], f["clusters"], f["reform"], f["synchronous_of"]) ==
                       (r["inner"], r["lr"], r["outer"], r["clusters"], r["reform"], r["synchronous_of"]))
        r["fewer_bytes_than_float32"] = (round(float32["bytes_per_round"] / r["bytes_per_round"], 2)
                                         if r["bytes_per_round"] and float32["bytes_per_round"] else None)
        r["loss_vs_float32"] = (round(r["heldout_loss"] / float32["heldout_loss"], 4)
                                if r["heldout_loss"] is not None and float32["heldout_loss"] else None)
        traffic = (f", {r['bytes_per_round']} B/round ({r['fewer_bytes_than_float32']}x fewer, loss "
                   f"{r['loss_vs_float32']}x of float32's)" if r["bytes_per_round"] else "")
        reform = f"re-formed: {r['reform']:<5} " if options.reform_every else ""
        who = f"K={r['clusters']}" if r["synchronous_of"] is None else f"sync {r['synchronous_of']}"
        console.print(f"{who:<6} {r['inner']:<8} lr {r['lr']:<6g} {r['outer']:<8} {r['compression']:<7} {reform}"
                      f"held-out loss {r['heldout_loss']} ({r['loss_vs_target']}x), samples to "
                      f"{target:.4f}: {r['samples_to_target']}{traffic}", highlight=False)
        r["curve"] = [[s, round(v, 4)] for s, v in r["curve"]]
    output = dict(benchmark="diloco", model=options.model, samples=options.samples,
                  averaging_period=options.averaging_period, outer_lr=options.outer_lr,
                  outer_momentum=options.outer_momentum, compressions=list(options.compressions),
                  reform_every=options.reform_every, synchronous=options.synchronous,
                  target_samples=options.target_samples, target_loss=target,
                  results=results)
    print(json.dumps(output) if as_json else json.dumps(output, indent=1), flush=True)
    return 0
