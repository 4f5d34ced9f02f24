"""``bench codecs``: the frontier of bytes against loss: one byte-level GPT trained in a real pipeline with each codec.

The same stages (``--stages`` processes, a host each of a :class:`~ravnest_swarm.bench.netlab.NetLab`: ``tc tbf``
rate, the relay's one-way delay, a CPU quota each) train the same model from the same seed on the same samples
(``microbatches`` x ``microbatch_size``, the asynchronous schedule) once per codec, in turn. Per codec:

- bytes per sample: every stage's sent messages (activations forward, gradients back, as encoded: metadata,
  headers and scales included; resends too), counted by the stages themselves (``Counters.bytes_sent``), over
  the samples stage 0 completed; and the ratio of float32's (``none``) to it;
- held-out loss and accuracy of the whole model assembled from the stages' final weights, and its ratio to
  float32's;
- samples/s in the steady state and each stage's busy share (``bench pipeline``'s figures).

Samples are equal, not wall time, so a faster codec does not also train longer. The async schedule's order of
arrivals varies from run to run; ``repeats`` runs each codec that many times with the same seed and reports the
mean and the spread of its held-out loss, so a difference smaller than the spread reads as one.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ravnest_swarm.bench.lr_scaling import heldout_loss
from ravnest_swarm.bench.pipeline import _run_schedule, bytes_per_sample, summarise
from ravnest_swarm.errors import UserError
from ravnest_swarm.membership.backbone import BackboneOptions, run_backbone_process

FRONTIER = ("none", "float16", "int8", "int6", "int4", "int3")


@dataclass
class CodecBenchOptions:
    codecs: Sequence[str] = FRONTIER
    model: str = "gpt"
    model_config: str = "layers=4,width=64,heads=4,context=64"
    stages: int = 2
    microbatches: int = 600
    microbatch_size: int = 16
    max_in_flight: int = 4
    optimizer: str = "adamw"
    lr: float = 0.003
    mbps: float = 100.0
    delay_ms: float = 20.0
    cpus_per_stage: Optional[float] = None
    repeats: int = 1


def assembled_figures(spec, paths: List[str]) -> Dict[str, float]:
    """Held-out loss and accuracy of the model whose layers are the stages' saved weights."""
    from safetensors.torch import load_file

    model = spec.build_full()
    state = {}
    for path in paths:
        state.update(load_file(path))
    missing = set(model.state_dict()) - set(state)
    if missing:
        raise UserError(f"the stages saved no weights for {sorted(missing)[:3]}", 1)
    model.load_state_dict(state)
    model.eval()
    return dict(heldout_loss=round(heldout_loss(spec, model), 5), heldout_accuracy=round(spec.evaluate(model), 5))


def bench_codecs(options: CodecBenchOptions, as_json: bool) -> int:
    from ravnest_swarm.bench.netlab import NetLab, cpu_quota_unavailable
    from ravnest_swarm.models import balanced_split, load_model
    from ravnest_swarm.processes import ProcessGroup

    try:
        spec = load_model(options.model, options.model_config)
        ranges = balanced_split(spec, options.stages)
    except ValueError as e:
        raise UserError(str(e))
    console = Console(stderr=True)
    workdir = tempfile.mkdtemp(prefix="ravnest-bench-codecs-")
    group = ProcessGroup(workdir)
    no_quota = cpu_quota_unavailable()
    cpus = options.cpus_per_stage
    if cpus is None:
        cpus = 0.0 if no_quota else min(1.0, (os.cpu_count() or 1) / options.stages)
    runs: Dict[str, List[Dict]] = {codec: [] for codec in options.codecs}
    with NetLab(options.stages + 1, mbps=options.mbps, delay_ms=options.delay_ms, ports=(40000, 40001),
                cpus=cpus or None) as lab, Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(), console=console, transient=not as_json,
    ) as progress:
        if lab.mode == "loopback":
            console.print(f"[yellow]no network namespaces ({lab.loopback_reason}): running on loopback, links NOT "
                          f"rate-limited: samples/s are not the lab's[/]")
        try:
            backbone_host = options.stages
            backbone = group.start_library(run_backbone_process, BackboneOptions(
                host_maddrs=[lab.host_maddr(backbone_host)], announce_maddrs=[lab.announce_maddr(backbone_host)]),
                "backbone", lab_host=lab.lab_host(backbone_host))
            initial = next(m for m in backbone.maddrs(120) if m.startswith(lab.announce_maddr(backbone_host)))
            for repeat in range(options.repeats):
                for codec in options.codecs:
                    label = f"{codec.replace('/', '-')}-{repeat}"
                    task = progress.add_task(f"{codec}" + (f" (run {repeat + 1})" if options.repeats > 1 else ""),
                                             total=options.microbatches)
                    reports = _run_schedule(
                        group, lab, initial, options.model, ranges, "async", options.microbatches,
                        options.microbatch_size, options.max_in_flight, "stash", options.lr, codec, workdir,
                        lambda done, task=task: progress.update(task, completed=done), model_config=options.model_config,
                        label=label, optimizer=options.optimizer, save=True)
                    figures = summarise(reports, options.max_in_flight, options.microbatch_size)
                    runs[codec].append(dict(
                        assembled_figures(spec, [os.path.join(workdir, f"{label}-stage{index}.safetensors")
                                                 for index in range(len(ranges))]),
                        bytes_per_sample=bytes_per_sample(reports), samples_per_s=figures["samples_per_s"],
                        busy_fraction=figures["busy_fraction"], completed=reports[0]["completed"],
                        dropped=figures["dropped"]))
        except (RuntimeError, TimeoutError) as e:
            raise UserError(f"a bench process failed ({e}); logs in {workdir}", exit_code=1)
        finally:
            group.stop_all()
        link = lab.describe()
    report = dict(frontier=frontier(runs), model=options.model, model_config=options.model_config,
                  stages=options.stages, layer_ranges=ranges, microbatches=options.microbatches,
                  microbatch_size=options.microbatch_size, max_in_flight=options.max_in_flight,
                  optimizer=options.optimizer, lr=options.lr, repeats=options.repeats, link=link,
                  cpu_count=os.cpu_count(), load_avg=[round(x, 2) for x in os.getloadavg()])
    show(console, report["frontier"])
    if as_json:
        print(json.dumps(report), flush=True)
    return 0


def frontier(runs: Dict[str, List[Dict]]) -> Dict[str, Dict]:
    """Each codec's means over its runs, and its ratios to float32 (``none``) where it ran."""
    table = {}
    for codec, results in runs.items():
        losses = [r["heldout_loss"] for r in results]
        table[codec] = dict(
            heldout_loss=round(statistics.mean(losses), 5),
            heldout_loss_spread=round(max(losses) - min(losses), 5),
            heldout_accuracy=round(statistics.mean(r["heldout_accuracy"] for r in results), 5),
            bytes_per_sample=round(statistics.mean(r["bytes_per_sample"] for r in results), 1),
            samples_per_s=round(statistics.mean(r["samples_per_s"] for r in results), 2),
            busy_fraction=[round(statistics.mean(share), 3) for share in zip(*(r["busy_fraction"] for r in results))],
            dropped=sum(r["dropped"] for r in results), runs=results)
    if "none" in table:
        base = table["none"]
        for figures in table.values():
            figures["bytes_ratio"] = round(base["bytes_per_sample"] / figures["bytes_per_sample"], 2)
            figures["loss_ratio"] = round(figures["heldout_loss"] / base["heldout_loss"], 4)
            figures["samples_per_s_ratio"] = round(figures["samples_per_s"] / base["samples_per_s"], 3)
    return table


def show(console: Console, table: Dict[str, Dict]) -> None:
    view = Table(title="codecs: equal samples, the async pipeline")
    for column in ("codec", "bytes/sample", "x fewer", "held-out loss", "x float32", "accuracy", "samples/s", "busy"):
        view.add_column(column)
    for codec, f in table.items():
        view.add_row(codec, f"{f['bytes_per_sample']:,.0f}", str(f.get("bytes_ratio", "")),
                     f"{f['heldout_loss']:.4f} ± {f['heldout_loss_spread'] / 2:.4f}", str(f.get("loss_ratio", "")),
                     f"{f['heldout_accuracy']:.3f}", f"{f['samples_per_s']:.1f}", str(f["busy_fraction"]))
    console.print(view)
