"""``bench plan``: the GA's plan time and quality on generated swarms, beside greedy and random restarts.

Each swarm size runs three planners on the same peers in this one process: the deterministic greedy
plan, the GA seeded from it (``plan_swarm``, its wall time measured end to end), and a random-restart
baseline given the same wall time as the GA: greedy's fill rule on randomly shuffled peers, many
restarts scored at once by the vectorised evaluation, the best kept.
"""

from __future__ import annotations

import json
import time
from typing import Dict, List, Sequence

import numpy as np
from rich.console import Console
from rich.table import Table

from ravnest_swarm.planning.cost import FEASIBILITY_SLACK, Peer, Workload, swarm_throughput
from ravnest_swarm.planning.ga import STANDBY, SwarmArrays
from ravnest_swarm.planning.greedy import greedy_plan
from ravnest_swarm.planning.plan import assignment_clusters, plan_swarm

BENCH_WORKLOAD = Workload(model_gb=20.0, gflop_per_sample=50.0, activation_mb=2.0, max_stages=8)
RAM_CHOICES_GB = (2.0, 4.0, 8.0, 16.0, 24.0, 32.0, 64.0)


def generate_swarm(size: int, seed: int = 0) -> List[Peer]:
    """Volunteers as they come: RAM in common sizes, log-normal compute (~55 GFLOP/s median) and bandwidth (~150 Mbit/s)."""
    rng = np.random.default_rng(seed)
    ram = rng.choice(RAM_CHOICES_GB, size=size)
    gflops = rng.lognormal(4.0, 0.8, size=size)
    bandwidth = rng.lognormal(5.0, 1.0, size=size)
    return [Peer(f"peer-{i}", float(ram[i]), float(gflops[i]), float(bandwidth[i])) for i in range(size)]


def random_restarts(arrays: SwarmArrays, seconds: float, seed: int = 0, batch: int = 16) -> np.ndarray:
    """Best of greedy's fill rule over random peer orders, restarts scored ``batch`` at a time for ``seconds``."""
    rng = np.random.default_rng(seed)
    best, best_fitness = None, -1.0
    started = time.perf_counter()
    while best is None or time.perf_counter() - started < seconds:
        population = np.stack([_fill_in_order(arrays, rng.permutation(arrays.size)) for _ in range(batch)])
        fitness, _, _ = arrays.evaluate(population)
        leader = int(np.argmax(fitness))
        if fitness[leader] > best_fitness:
            best, best_fitness = population[leader].copy(), float(fitness[leader])
    return best


def _fill_in_order(arrays: SwarmArrays, order: Sequence[int]) -> np.ndarray:
    """Consecutive peers of ``order`` form clusters, each closed once its RAM holds the model (at most D)."""
    caps = arrays.caps[order]
    assignment = np.full(arrays.size, STANDBY, dtype=np.int32)
    cluster, ram, members = 0, 0.0, []
    for column, cap in zip(order, caps):
        members.append(column)
        ram += cap
        if ram >= 1 - FEASIBILITY_SLACK:
            assignment[members] = cluster
            cluster, ram, members = cluster + 1, 0.0, []
            if cluster == arrays.max_clusters:
                break
        elif len(members) == arrays.workload.max_stages:
            ram, members = 0.0, []
    return assignment


def objective(peers: Sequence[Peer], arrays: SwarmArrays, assignment: np.ndarray, workload: Workload) -> float:
    return swarm_throughput([[peers[i] for i in m] for m in assignment_clusters(arrays, assignment)], workload)


def bench_plan(sizes: Sequence[int] = (100, 1_000, 10_000), time_limit: float = 15.0, seed: int = 0) -> List[Dict]:
    """One row per swarm size: seconds and swarm throughput of greedy, GA and random restarts."""
    rows = []
    for size in sizes:
        peers = generate_swarm(size, seed)
        started = time.perf_counter()
        arrays = SwarmArrays(peers, BENCH_WORKLOAD)
        greedy = greedy_plan(arrays)
        greedy_seconds = time.perf_counter() - started
        greedy_throughput = objective(peers, arrays, greedy, BENCH_WORKLOAD)

        started = time.perf_counter()
        plan = plan_swarm(peers, BENCH_WORKLOAD, seed=seed, time_limit=time_limit)
        ga_seconds = time.perf_counter() - started

        restarts = random_restarts(arrays, ga_seconds, seed)
        rows.append({
            "peers": size,
            "greedy": {"seconds": round(greedy_seconds, 3), "swarm_throughput": greedy_throughput},
            "ga": {"seconds": round(ga_seconds, 3), "swarm_throughput": plan.swarm_throughput,
                   "clusters": len(plan.clusters), "standby": len(plan.standby),
                   "generations": plan.details["generations"]},
            "random_restarts": {"seconds": round(ga_seconds, 3),
                                "swarm_throughput": objective(peers, arrays, restarts, BENCH_WORKLOAD)},
            "ga_over_greedy": plan.swarm_throughput / greedy_throughput,
        })
    return rows


def run_bench_plan(time_limit: float, as_json: bool) -> int:
    rows = bench_plan(time_limit=time_limit)
    workload = BENCH_WORKLOAD
    if as_json:
        print(json.dumps({"bench": "plan", "time_limit": time_limit, "model_gb": workload.model_gb,
                          "gflop_per_sample": workload.gflop_per_sample, "activation_mb": workload.activation_mb,
                          "max_stages": workload.max_stages, "rows": rows}), flush=True)
        return 0
    table = Table(title=f"bench plan (M={workload.model_gb} GB, F={workload.gflop_per_sample} GFLOP, "
                        f"A={workload.activation_mb} MB, D={workload.max_stages}); samples/s")
    for column in ("peers", "greedy", "GA", "GA s", "random restarts", "GA/greedy"):
        table.add_column(column)
    for row in rows:
        table.add_row(str(row["peers"]), f"{row['greedy']['swarm_throughput']:.1f}",
                      f"{row['ga']['swarm_throughput']:.1f}", f"{row['ga']['seconds']:.1f}",
                      f"{row['random_restarts']['swarm_throughput']:.1f}", f"{row['ga_over_greedy']:.3f}")
    Console().print(table)
    return 0
