"""Showing a plan: a rich table and a one-line summary, or one JSON document."""

from __future__ import annotations

import time
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ravnest_swarm.planning.plan import Plan


def print_plan(plan: Plan, console: Console) -> None:
    table = Table(title=f"{len(plan.clusters)} cluster(s), {len(plan.standby)} standby", expand=False)
    for column in ("cluster", "samples/s", "stage", "peer", "fraction", "layers"):
        table.add_column(column)
    for number, (throughput, stages) in enumerate(plan.clusters):
        for placed in stages:
            first = placed.stage == 0
            table.add_row(str(number) if first else "", f"{throughput:.4g}" if first else "", str(placed.stage),
                          placed.peer_id, f"{placed.fraction:.3f}", f"{placed.layers[0]}-{placed.layers[1]}")
    console.print(table)
    slowest = min(t for t, _ in plan.clusters)
    console.print(
        f"swarm throughput {plan.swarm_throughput:.4g} samples/s = {len(plan.clusters)} clusters x slowest "
        f"{slowest:.4g}; greedy plan {plan.details.get('greedy_throughput', 0):.4g}; "
        f"{plan.details.get('generations', 0)} generations; standby: {', '.join(plan.standby) or 'none'}",
        highlight=False,
    )


@contextmanager
def progress_bar(time_limit: float):
    """A progress bar on stderr over the GA's time budget; yields the GA's per-generation callback."""
    with Progress(TextColumn("GA"), BarColumn(), TextColumn("generation {task.fields[generation]}"),
                  TextColumn("best {task.fields[best]:.4g} samples/s"), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("GA", total=max(time_limit, 1e-3), generation=0, best=0.0)
        started = time.perf_counter()

        def on_generation(generation: int, best: float) -> None:
            progress.update(task, completed=time.perf_counter() - started, generation=generation, best=best)

        yield on_generation
