"""The run's history: its figures appended to ``metrics.jsonl`` as it runs, and ``ravnest-swarm plot`` of them.

A peer given ``--snapshot-dir DIR`` (``join``, or ``local`` for its whole swarm) appends one JSON line to
``DIR/metrics.jsonl`` at every heartbeat (every look, for ``local``): the time, the run's mean loss over the clusters'
last stages, its samples/s, the live peers, the placed ones, the clusters, the averaging rounds done and failed, the
highest step, and, for a ``join`` peer, its own step and loss. Appending keeps a run's whole history whatever stops
the peer; a line cut short by a crash is skipped on reading.

``ravnest-swarm plot DIR`` draws the loss and the samples/s against the time since the first line to ``DIR/run.png``
(matplotlib, without a display) and returns the series it drew.
"""

from __future__ import annotations

import json
import os
import time
from typing import Dict, List, Optional

from ravnest_swarm.dashboard.state import TRAINING_STATES, SwarmState
from ravnest_swarm.errors import UserError

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "run.png"


def run_figures(state: SwarmState, own: Optional[Dict] = None) -> Dict:
    """One line of the history from the swarm as ``state`` sees it (peers and plan); ``own``: the writer's own
    record, whose step and loss are added."""
    peers = state.peers
    training = [p for p in peers if p.get("loss") is not None and p.get("stage") is not None
                and p["state"] in TRAINING_STATES]
    last = [p for p in training if p["stage"] == max(q["stage"] for q in training if q["cluster"] == p["cluster"])]
    totals = state.totals()
    figures = dict(time=round(time.time(), 3),
                   loss=round(sum(p["loss"] for p in last) / len(last), 6) if last else None,
                   samples_per_s=round(totals.samples_per_s, 3), peers=totals.peers, placed=totals.placed,
                   clusters=totals.clusters, averaging_rounds=totals.averaging_done,
                   averaging_failures=totals.averaging_failures,
                   step=max((p.get("step") or 0 for p in peers), default=0))
    if own is not None:
        figures.update(own_step=own.get("step"), own_loss=own.get("loss"), own_state=own.get("state"))
    return figures


def append_figures(directory: str, figures: Dict) -> None:
    """Add one line to ``directory/metrics.jsonl`` (the directory is created)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, METRICS_FILE), "a") as file:
        file.write(json.dumps(figures) + "\n")


def read_figures(directory: str) -> List[Dict]:
    """Every whole line of ``directory/metrics.jsonl``; a missing file is a one-line :class:`UserError`."""
    path = os.path.join(directory, METRICS_FILE)
    if not os.path.isfile(path):
        raise UserError(f"no run history at {path}: give a peer --snapshot-dir {directory} (join or local)", 1)
    lines = []
    with open(path) as file:
        for line in file:
            try:
                figures = json.loads(line)
            except ValueError:
                continue  # a line cut short by a crash
            if isinstance(figures, dict) and isinstance(figures.get("time"), (int, float)):
                lines.append(figures)
    if not lines:
        raise UserError(f"{path} holds no figures yet", 1)
    return lines


def plot_run(directory: str, out: Optional[str] = None) -> Dict:
    """Draw the loss and the samples/s of the history in ``directory`` to ``out`` (default ``directory/run.png``);
    returns what was drawn: ``{"png", "seconds", "loss", "samples_per_s"}`` (each a list of ``[seconds, value]``)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    lines = read_figures(directory)
    start = lines[0]["time"]
    loss = [[round(f["time"] - start, 3), f["loss"]] for f in lines if f.get("loss") is not None]
    rate = [[round(f["time"] - start, 3), f["samples_per_s"]] for f in lines if f.get("samples_per_s") is not None]
    out = out or os.path.join(directory, PLOT_FILE)
    if os.path.isdir(out):
        out = os.path.join(out, PLOT_FILE)
    elif not os.path.splitext(out)[1]:
        out += ".png"  # what matplotlib writes for a name without one: we say the path it wrote
    if not os.path.isdir(os.path.dirname(os.path.abspath(out))):
        raise UserError(f"--out {out}: no such directory {os.path.dirname(os.path.abspath(out))}", 1)
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    try:
        top.plot([t for t, _ in loss], [v for _, v in loss], color="tab:blue")
        top.set_ylabel("loss (clusters' last stages)")
        top.set_title(f"run history: {len(lines)} looks, {lines[-1].get('averaging_rounds') or 0} averaging rounds")
        top.grid(alpha=0.3)
        bottom.plot([t for t, _ in rate], [v for _, v in rate], color="tab:green")
        bottom.set_ylabel("samples/s")
        bottom.set_xlabel("seconds since the first look")
        bottom.grid(alpha=0.3)
        figure.tight_layout()
        try:
            figure.savefig(out, dpi=100)
        except ValueError as e:  # a suffix matplotlib writes no format for (.txt): its words, one line
            raise UserError(f"--out {out}: {e}", 2)
    finally:
        plt.close(figure)
    return dict(png=out, seconds=round(lines[-1]["time"] - start, 3), loss=loss, samples_per_s=rate)


def run_plot(directory: str, out: Optional[str], as_json: bool) -> int:
    """``ravnest-swarm plot``: draw, then say where (or print what was drawn as JSON)."""
    drawn = plot_run(directory, out)
    if as_json:
        print(json.dumps(drawn), flush=True)
    else:
        losses = [v for _, v in drawn["loss"]]
        said = f"; loss {losses[0]:.4g} -> {losses[-1]:.4g}" if losses else ""
        print(f"wrote {drawn['png']}: {drawn['seconds']:.0f} s of the run{said}", flush=True)
    return 0
