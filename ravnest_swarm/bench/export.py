"""``bench export``: the peak memory of exporting a big model, against the size of its stages (issue 31).

The bench writes the checkpoints a ``local`` run of ``--model`` split into ``--stages`` stages leaves behind
(``local-peerN.safetensors``, each a stage of seeded layers, written one stage at a time), then exports them in a
fresh process (``swarm.export.export_checkpoints``, what ``local --export`` runs) and reports that process's peak
RSS during the export (``VmHWM`` after resetting it at the start, so the imports' own peak does not count) beside its
RSS before the export (the interpreter, torch, the package) and the bytes of the model's stages. The export holds about one layer at a time, so its peak stays below two stages whatever the
model's size; a whole model in memory would be above it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Dict, Optional

import torch

from ravnest_swarm.checkpoint import save_stage
from ravnest_swarm.errors import UserError
from ravnest_swarm.models import balanced_split, load_model, model_layout
from ravnest_swarm.swarm.spec import RunSpec


def write_local_checkpoints(model_name: str, stages: int, directory: str) -> Dict:
    """The checkpoints of a ``local`` run of ``model_name`` in ``stages`` stages, seeded weights at step 100; returns
    the model's facts (parameters, bytes, each stage's bytes) and its spec as an export keeps it."""
    model = load_model(model_name)
    ranges = balanced_split(model, stages)
    stage_bytes = []
    for index, (start, end) in enumerate(ranges):
        module = model.build_stage(start, end)
        save_stage(os.path.join(directory, f"local-peer{index}.safetensors"), module,
                   torch.optim.SGD(module.parameters(), lr=0.05),
                   {"step": 100, "layers": [start, end], "run": "local", "model": model_name})
        stage_bytes.append(sum(p.numel() * p.element_size() for p in module.parameters()))
        del module
    spec = dict(asdict(RunSpec(model=model_name)), layout=[list(layer) for layer in model_layout(model)])
    return dict(parameters=sum(layer.param_count for layer in model.layers), model_bytes=sum(stage_bytes),
                stage_bytes=stage_bytes, ranges=ranges, spec=spec)


def export_in_this_process(directory: str, spec_file: str, out: str) -> None:
    """The measured side, run in a fresh process: the export of ``directory``'s checkpoints, then one JSON line."""
    from ravnest_swarm.swarm.export import export_checkpoints, freshest_checkpoint_layers
    from ravnest_swarm.swarm.local import CHECKPOINT_NAME

    import psutil

    with open(spec_file) as file:
        spec = json.load(file)
    before = psutil.Process().memory_info().rss
    # the process's high-water mark so far is its imports': start it again from here (Linux, /proc/PID/clear_refs)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    started = time.monotonic()
    export_checkpoints(freshest_checkpoint_layers(directory, CHECKPOINT_NAME), spec, "local", out)
    seconds = time.monotonic() - started
    with open("/proc/self/status") as status:
        peak = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))  # kB
    # not ru_maxrss: Linux carries it over exec from the forked parent (the bench, which built the stages)
    print(json.dumps(dict(rss_before=before, peak_rss=peak, seconds=round(seconds, 2))), flush=True)


def bench_export(model: str, stages: int, as_json: bool, workdir: Optional[str] = None) -> int:
    """Write the checkpoints, export them in a fresh process, and compare its peak RSS with two stages."""
    try:
        load_model(model)  # an unknown model is one line, before any file is written
    except ValueError as e:
        raise UserError(str(e))
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="ravnest-bench-export-")
    try:
        checkpoints, out = os.path.join(workdir, "checkpoints"), os.path.join(workdir, "export")
        os.makedirs(checkpoints, exist_ok=True)
        started = time.monotonic()
        facts = write_local_checkpoints(model, stages, checkpoints)
        written = time.monotonic() - started
        spec_file = os.path.join(workdir, "spec.json")
        with open(spec_file, "w") as file:
            json.dump(facts.pop("spec"), file)
        child = subprocess.run([sys.executable, "-c", "import sys; from ravnest_swarm.bench.export import "
                                "export_in_this_process as e; e(*sys.argv[1:])", checkpoints, spec_file, out],
                               capture_output=True, text=True, check=False)
        if child.returncode != 0:
            print(child.stderr[-3000:], file=sys.stderr)
            return 1
        measured = json.loads(child.stdout.strip().splitlines()[-1])
        two_stages = sum(sorted(facts["stage_bytes"])[:2])  # the two smallest: the strictest bound
        result = dict(model=model, stages=stages, **facts, checkpoints_seconds=round(written, 1), **measured,
                      two_smallest_stages_bytes=two_stages, export_bytes=os.path.getsize(os.path.join(out,
                                                                                                     "model.safetensors")),
                      peak_below_two_stages=measured["peak_rss"] < two_stages,
                      peak_above_start_bytes=measured["peak_rss"] - measured["rss_before"])
        mb = 1e6
        print(f"{model}: {facts['parameters'] / 1e6:.0f} M parameters, {facts['model_bytes'] / mb:.0f} MB in {stages} "
              f"stages of {', '.join(f'{b / mb:.0f}' for b in facts['stage_bytes'])} MB; export in "
              f"{measured['seconds']:.1f} s, peak RSS {measured['peak_rss'] / mb:.0f} MB ({measured['rss_before'] / mb:.0f} "
              f"MB before it) against {two_stages / mb:.0f} MB for two stages", file=sys.stderr, flush=True)
        if as_json:
            print(json.dumps(result), flush=True)
        return 0 if result["peak_below_two_stages"] else 1
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
