"""Starting a whole pipeline of real stage processes for the pipeline tests."""

import json
import os
from typing import Dict, List, Sequence, Tuple


def start_stages(processes, backbone: str, model: str, ranges: Sequence[Tuple[int, int]], out_dir: str,
                 run: str = "pipe", extra: Sequence[str] = (), stage_extra: Dict[int, Sequence[str]] = None,
                 skip: Sequence[int] = ()) -> Dict[int, object]:
    """One ``ravnest-swarm stage`` process per range (except ``skip``); each writes a report and its weights."""
    started = {}
    for index, (start, end) in enumerate(ranges):
        if index in skip:
            continue
        args = ["stage", "--initial-peers", backbone, "--run", run, "--stage", str(index), "--stages", str(len(ranges)),
                "--model", model, "--layers", f"{start}:{end}",
                "--report", os.path.join(out_dir, f"report{index}.json"),
                "--save", os.path.join(out_dir, f"stage{index}.safetensors"), *extra,
                *((stage_extra or {}).get(index, ()))]
        started[index] = processes.start(args, f"stage{index}")
    return started


def wait_all(stages: Dict[int, object], timeout: float) -> None:
    for index, process in stages.items():
        code = process.wait(timeout)
        assert code == 0, f"stage {index} exited with {code}: {process.stderr()[-2000:]}"


def read_report(out_dir: str, index: int) -> Dict:
    with open(os.path.join(out_dir, f"report{index}.json")) as f:
        return json.load(f)


def read_weights(out_dir: str, count: int) -> Dict:
    from safetensors.torch import load_file

    weights = {}
    for index in range(count):
        weights.update(load_file(os.path.join(out_dir, f"stage{index}.safetensors")))
    return weights


def losses(report: Dict) -> List[float]:
    return [loss for _, loss in sorted(report["losses"])]
