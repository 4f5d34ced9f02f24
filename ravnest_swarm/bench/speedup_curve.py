"""``bench speedup``'s held-out curve: the loss of the clusters' averaged layers as the run goes, from copies of the
peers' checkpoints (each overwrites its one file), and the point at which it first reaches a target."""

from __future__ import annotations

import os
import re
import shutil
import threading
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ravnest_swarm.checkpoint import read_stage
from ravnest_swarm.errors import UserError
from ravnest_swarm.models import ModelSpec

CHECKPOINT_POLL_S = 0.05  # how often the watcher looks for a new checkpoint: well under the time between two
CURVE_POINTS = 16  # checkpoints per peer in a run: the held-out curve's points, each 1/16 of the samples apart


def layer_states(paths: Sequence[str]) -> Dict[int, List[Dict[str, torch.Tensor]]]:
    """Every layer's weights in the stage checkpoints at ``paths``: one state per cluster that trained it."""
    layers: Dict[int, List[Dict[str, torch.Tensor]]] = {}
    for path in paths:
        tensors, metadata = read_stage(path)
        start, end = metadata["info"]["layers"]
        for layer in range(start, end):
            prefix = f"param.{layer - start}."
            layers.setdefault(layer, []).append(
                {key[len(prefix):]: value for key, value in tensors.items() if key.startswith(prefix)})
    return layers


class CheckpointHistory:
    """Keeps a copy of every checkpoint the peers of ``run`` write into ``directory`` (each overwrites its one
    file), with the wall time it was written, until :meth:`stop`. A thread looks every :data:`CHECKPOINT_POLL_S`:
    a peer writes its checkpoints by renaming a whole file into place, so a copy is always one whole checkpoint."""

    def __init__(self, directory: str, copies: str, run: str):
        self.directory, self.copies, self.run = directory, copies, run
        self.kept: List[Tuple[str, str, float]] = []  # (peer, copy's path, when its checkpoint was written)
        self._seen: Dict[str, Tuple[int, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="checkpoint-history", daemon=True)

    def start(self) -> "CheckpointHistory":
        os.makedirs(self.copies, exist_ok=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._look()  # what the peers wrote as they left

    def _watch(self) -> None:
        while not self._stop.wait(CHECKPOINT_POLL_S):
            self._look()

    def _look(self) -> None:
        for entry in os.scandir(self.directory):
            match = re.fullmatch(rf"{re.escape(self.run)}-(peer\d+)\.safetensors", entry.name)
            if match is None:
                continue
            try:
                stat = entry.stat()
                if self._seen.get(entry.name) == (stat.st_ino, stat.st_mtime_ns):
                    continue
                copy = os.path.join(self.copies, f"{match.group(1)}-{len(self.kept)}.safetensors")
                shutil.copyfile(entry.path, copy)
            except OSError:
                continue  # replaced between the look and the copy: the next look copies the new one
            self._seen[entry.name] = (stat.st_ino, stat.st_mtime_ns)
            self.kept.append((match.group(1), copy, stat.st_mtime))

    def by_step(self, peers: Sequence[str]) -> List[Tuple[int, List[str], float]]:
        """(step, every peer's copy at that step, when the last of them was written), for each step at which every
        peer of ``peers`` wrote a checkpoint, in order; a peer's first copy at a step counts."""
        found: Dict[int, Dict[str, Tuple[str, float]]] = {}
        for peer, path, written in self.kept:
            try:
                step = int(read_stage(path)[1]["info"]["step"])
            except (UserError, KeyError, ValueError):
                continue
            found.setdefault(step, {}).setdefault(peer, (path, written))
        return [(step, [found[step][peer][0] for peer in peers], max(found[step][peer][1] for peer in peers))
                for step in sorted(found) if all(peer in found[step] for peer in peers)]


def time_to_target(curve: Sequence[Sequence[float]], target: float) -> Tuple[Optional[float], Optional[int]]:
    """(seconds, samples) at the first point of ``curve`` ([samples, seconds, loss], in order) whose held-out loss
    is at most ``target``; (None, None) if none is."""
    for samples, seconds, loss in curve:
        if loss <= target:
            return seconds, int(samples)
    return None, None


def checkpoint_every(steps: int) -> int:
    """Steps between a peer's checkpoints in a run of ``steps``: :data:`CURVE_POINTS` a run, the held-out curve's."""
    return max(1, steps // CURVE_POINTS)


def check_target_samples(target_samples: Optional[int], samples: int, k1_steps: int, microbatch_size: int,
                         lr_schedule: str) -> None:
    """``--target-samples`` must fall on a point of K = 1's held-out curve within the run, and the reference's lr be
    constant, so that its curve up to there is that of a run of ``target_samples`` (a cosine decay over the longer
    run would not be): one line where not."""
    if target_samples is None:
        return
    every = checkpoint_every(k1_steps) * microbatch_size
    if target_samples > samples or target_samples % every:
        raise UserError(f"--target-samples {target_samples} must be a point of K = 1's held-out curve: a multiple of "
                        f"{every} samples, at most --samples {samples}")
    if lr_schedule != "constant":
        raise UserError(f"--target-samples needs the reference scheme's lr constant, not {lr_schedule}: with a decay "
                        "over --samples its curve to the target is not that of a run of --target-samples")


def target_loss(run: Dict, target_samples: Optional[int]) -> float:
    """The reference K = 1 run's held-out loss the others are timed to: at its end, or at the point of its curve at
    ``target_samples`` (``check_target_samples`` made sure it has one)."""
    if target_samples is None:
        return run["heldout_loss"]
    at = [loss for samples, _, loss in run["curve"] if samples == target_samples]
    if not at:  # every peer checkpoints there, but the watcher may miss a copy on an overloaded machine
        raise UserError(f"K = 1's held-out curve has no point at --target-samples {target_samples}: no copy of "
                        "every peer's checkpoint there was kept")
    return at[0]


def heldout_figures(model: ModelSpec, states: Optional[Dict[int, List[Dict[str, torch.Tensor]]]],
                    batch: int = 256) -> Tuple[float, float]:
    """(loss, accuracy) on the held-out split of the model whose layers are the mean of ``states`` (the
    clusters' copies; None: the seeded start every peer trains from)."""
    full = model.build_full()
    if states is not None:
        for layer, copies in states.items():
            full[layer].load_state_dict({key: torch.stack([copy[key] for copy in copies]).mean(dim=0)
                                         for key in copies[0]})
    data = model.heldout()
    total = 0.0
    with torch.no_grad():
        for start in range(0, data.size, batch):
            inputs, targets = data.get(range(start, min(start + batch, data.size)))
            total += float(model.loss(full(inputs), targets)) * len(inputs)
    return round(total / data.size, 5), round(model.evaluate(full), 4)


