"""An island genetic algorithm over cluster assignments, vectorised in numpy.

Over 400 lines because the population's array layout, its evaluation and the operators that mutate it
are one design: each part indexes the same arrays.

A chromosome gives each peer a cluster id (0..K_max-1) or -1 (standby). A whole population, every
island at once, is one ``(individuals, peers)`` int array, and one call of :meth:`SwarmArrays.evaluate`
scores all of it: a stable sort groups each individual's peers by cluster, segmented sums give every
cluster's RAM, slowest link and water-filled stage time at once (see :func:`_segment_stage_times`).

Evaluation also repairs (Lamarckian: the repaired chromosome replaces the original): peers beyond the
D-th of a cluster go to standby, clusters short of RAM are dissolved, and clusters slower than the best
cut are dropped, since K x min T is maximised over the fastest k clusters for the best k. Surviving
clusters are renumbered 0..K-1 by falling throughput, so id K-1 is always the bottleneck, which the
targeted mutations aim at.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from ravnest_swarm.planning.cost import FEASIBILITY_SLACK, MovePrice, Peer, Workload

STANDBY = -1


class SwarmArrays:
    """The usable peers of a swarm as arrays, in the order the vectorised evaluation needs.

    Peers that can hold no part of the model (no RAM or no compute) are left out; they are always
    standby. The rest are sorted by their water-filling breakpoint r_i F / (M f_i), the stage time at
    which their memory caps them, so that grouping a chromosome by cluster with a stable sort yields
    each cluster's members already in breakpoint order.

    :param peers: the swarm
    :param workload: the model's needs and the stage limit
    """

    def __init__(self, peers: Sequence[Peer], workload: Workload):
        self.workload = workload
        # as ``cost.water_fill`` counts them: a claim of 5e-324 GFLOP/s is > 0, but its speed (over the model's
        # GFLOP a sample) is 0, and the GA took that peer's RAM for free room in every island's best plan
        usable = [i for i, p in enumerate(peers)
                  if p.ram_gb / workload.model_gb > 0 and 0 < p.gflops / workload.gflop_per_sample < math.inf]
        caps = np.array([peers[i].ram_gb / workload.model_gb for i in usable], dtype=np.float64)
        speeds = np.array([peers[i].gflops / workload.gflop_per_sample for i in usable], dtype=np.float64)
        order = np.argsort(caps / speeds, kind="stable") if usable else np.zeros(0, dtype=np.int64)
        self.peer_index = np.array(usable, dtype=np.int64)[order]  # column -> index into ``peers``
        self.caps, self.speeds = caps[order], speeds[order]
        self.bandwidth = np.array([peers[i].bandwidth_mbps for i in self.peer_index], dtype=np.float64)
        self.size = len(self.peer_index)
        # no more clusters can be feasible than the total RAM holds copies of the model
        self.max_clusters = max(1, min(self.size, int(math.floor(self.caps.sum() + FEASIBILITY_SLACK))))
        self.moves: Optional[MovePrice] = None  # weigh_moves: the price, each column's cluster in force, their sizes
        self.held, self.held_sizes = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)

    def weigh_moves(self, in_force: Sequence[Tuple[Sequence[int], int]], price: MovePrice) -> None:
        """Score plans by their throughput over ``price.horizon_s`` after moving from the plan in force.

        ``in_force`` lists that plan's clusters as (columns of their live members, their size in the plan): a
        cluster that lost a member can never be kept. A cluster is kept when a plan has exactly its members;
        every member of any other cluster moves and, as an estimate, downloads an even share of the model's
        bytes over its link; any move pauses the swarm for the slowest download plus ``price.pause_s``, and a plan
        that only drops clusters costs nothing (the kept ones train on, renumbered or not)
        (``cost.move_cost`` is the exact figure the round adopts by; this is its vectorised estimate).
        """
        self.held = np.full(self.size, STANDBY, dtype=np.int64)
        for cluster, (columns, _) in enumerate(in_force):
            self.held[list(columns)] = cluster
        self.held_sizes = np.array([size for _, size in in_force], dtype=np.int64)
        self.moves = price

    def evaluate(self, population: np.ndarray):
        """Score and repair a population in place; returns ``(fitness, bottleneck_margin, clusters)``.

        ``fitness`` is K x min T per individual (with :meth:`weigh_moves`, its share of the horizon left
        after the moves); ``bottleneck_margin`` is the throughput of its
        second-slowest kept cluster (0 with fewer than two), used to break ties in selection in favour
        of plans whose next bottleneck is already faster; ``clusters`` is K per individual.
        """
        individuals, size = population.shape
        slots = self.max_clusters
        workload = self.workload
        if size == 0:
            zeros = np.zeros(individuals)
            return zeros, zeros, np.zeros(individuals, dtype=np.int64)
        order = np.argsort(population, axis=1, kind="stable")
        sorted_ids = np.take_along_axis(population, order, axis=1).ravel()
        rows = np.repeat(np.arange(individuals), size)
        group = rows * (slots + 1) + sorted_ids + 1
        boundary = np.empty(len(group), dtype=bool)
        boundary[0] = True
        np.not_equal(group[1:], group[:-1], out=boundary[1:])
        starts = np.flatnonzero(boundary)
        segment_of = np.cumsum(boundary) - 1
        rank = np.arange(len(group)) - starts[segment_of]
        member = (rank < workload.max_stages) & (sorted_ids >= 0)
        peer = order.ravel()
        caps = np.where(member, self.caps[peer], 0.0)
        speeds = np.where(member, self.speeds[peer], 0.0)
        links = np.where(member, self.bandwidth[peer], np.inf)

        count = np.minimum(np.diff(np.append(starts, len(group))), workload.max_stages)
        share = workload.max_stage_share
        limit = None if share is None else (share / count)[segment_of]  # q / S, per member
        stage_time, ram = _segment_stage_times(caps, speeds, starts, segment_of, limit)
        slowest_link = np.minimum.reduceat(links, starts)
        with np.errstate(divide="ignore"):
            transfer = np.where(count >= 2, 8 * workload.activation_mb / slowest_link, 0.0)
            seconds = np.maximum(stage_time, transfer)
        if workload.max_in_flight is not None:
            seconds = np.maximum(seconds, _round_trip(caps, speeds, limit, stage_time, starts, segment_of, count,
                                                      transfer) / workload.max_in_flight)
        with np.errstate(divide="ignore"):
            throughput = np.where(np.isfinite(seconds) & (seconds > 0), 1.0 / seconds, 0.0)
        segment_ids = sorted_ids[starts]
        feasible = (segment_ids >= 0) & (ram >= 1 - FEASIBILITY_SLACK) & (throughput > 0)

        by_slot = np.zeros((individuals, slots))
        by_slot[rows[starts][feasible], segment_ids[feasible]] = throughput[feasible]
        ranking = np.argsort(-by_slot, axis=1, kind="stable")
        ranked = np.take_along_axis(by_slot, ranking, axis=1)
        scores = ranked * np.arange(1, slots + 1)
        best = np.argmax(scores, axis=1)
        everyone = np.arange(individuals)
        fitness = scores[everyone, best]
        clusters = np.where(fitness > 0, best + 1, 0)
        margin = np.where(best >= 1, ranked[everyone, np.maximum(best - 1, 0)], 0.0)

        # renumber kept clusters by falling throughput; everything else (and peers past D) to standby
        new_id = np.full((individuals, slots + 1), STANDBY, dtype=population.dtype)
        position = np.empty_like(ranking)
        position[everyone[:, None], ranking] = np.arange(slots)
        kept = position < clusters[:, None]
        new_id[:, :slots] = np.where(kept, position, STANDBY)
        if self.moves is not None and len(self.held_sizes):
            row_of = rows[starts]
            in_plan = feasible & (position[row_of, np.maximum(segment_ids, 0)] < clusters[row_of])
            fitness = fitness * self._horizon_share(individuals, member, peer, rows, starts, segment_of, count,
                                                    in_plan)
        relabelled = new_id[everyone[:, None], np.where(population >= 0, population, slots)]
        excess = (sorted_ids >= 0) & ~member
        relabelled[rows[excess], peer[excess]] = STANDBY
        population[:] = relabelled
        return fitness, margin, clusters

    def _horizon_share(self, individuals, member, peer, rows, starts, segment_of, count, in_plan):
        """Per individual, the share of the horizon left after its moves (see :meth:`weigh_moves`). The sorted
        members are ``individuals`` rows of ``size`` each, so per-row figures are maxima over a reshape."""
        price = self.moves
        held = np.where(member, self.held[peer], STANDBY)
        lowest = np.minimum.reduceat(np.where(member, held, np.iinfo(np.int64).max), starts)
        highest = np.maximum.reduceat(held, starts)
        unchanged = (lowest == highest) & (highest >= 0) & (count == self.held_sizes[np.maximum(highest, 0)])
        moved = member & (in_plan & ~unchanged)[segment_of]
        with np.errstate(divide="ignore"):
            download = np.where(moved, 8000 * price.download_gb / count[segment_of] / self.bandwidth[peer], 0.0)
        slowest = download.reshape(individuals, self.size).max(axis=1)
        changed = moved.reshape(individuals, self.size).any(axis=1)
        seconds = np.where(changed, price.pause_s + slowest, 0.0)
        return np.maximum(0.0, price.horizon_s - seconds) / price.horizon_s


def _exchange(population: np.ndarray, rows: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """In each of ``rows``, swap the cluster ids of columns ``a`` and ``b`` (one pair per row)."""
    population[rows, a], population[rows, b] = population[rows, b], population[rows, a].copy()


def _segment_stage_times(caps, speeds, starts, segment_of, limit):
    """Water-filled stage time and total capped share of every segment (cluster) of sorted members.

    ``limit`` is each member's stage share limit (None: no limit, one pass). Members that reach it are
    pinned at it and the rest filled again: the pinned set only grows, and it ends within as many passes as a
    cluster has members. The stage time is the level of the rest or a pinned member's own time, the larger.
    """
    if limit is None:
        return _water_level(caps, speeds, starts, segment_of, np.ones(len(starts))), np.add.reduceat(caps, starts)
    ram = np.add.reduceat(np.minimum(caps, limit), starts)
    pinned = np.zeros(len(caps), dtype=bool)
    while True:
        target = 1 - np.add.reduceat(np.where(pinned, limit, 0.0), starts)
        stage_time = _water_level(np.where(pinned, 0.0, caps), np.where(pinned, 0.0, speeds), starts, segment_of,
                                  target)
        with np.errstate(invalid="ignore"):
            reached = ~pinned & (np.minimum(caps, stage_time[segment_of] * speeds) > limit * (1 + FEASIBILITY_SLACK))
        if not reached.any():
            # a pinned member's own time counts too: where the others all end at their memory caps the level of
            # the rest falls below it (a 1e4 speed ratio and caps summing to exactly the model made the GA score a
            # cluster 300x too fast: a helper's review)
            with np.errstate(divide="ignore", invalid="ignore"):
                pinned_time = np.maximum.reduceat(np.where(pinned & (speeds > 0), limit / speeds, -np.inf), starts)
            return np.maximum(stage_time, pinned_time), ram
        pinned |= reached


def _round_trip(caps, speeds, limit, stage_time, starts, segment_of, count, transfer):
    """Per segment (cluster), one microbatch's round trip per sample as ``cost.cluster_time`` counts it: every
    stage's forward and backward of its water-filled fraction, plus 2 (S - 1) transfers; 0 for one stage."""
    capped = caps if limit is None else np.minimum(caps, limit)
    with np.errstate(divide="ignore", invalid="ignore"):
        fraction = np.where(speeds > 0, np.minimum(capped, stage_time[segment_of] * speeds), 0.0)
        compute = (np.add.reduceat(np.where(fraction > 0, fraction / speeds, 0.0), starts) /
                   np.add.reduceat(fraction, starts))
        return np.where(count >= 2, compute + 2 * (count - 1) * transfer, 0.0)


def _water_level(caps, speeds, starts, segment_of, target):
    """The smallest stage time t at which each segment's sum of min(cap, t speed) reaches ``target``.

    With members in breakpoint order, the total fraction at stage time t below member j's breakpoint
    is at most C_j + t S_j, C_j being the caps of the members before j and S_j the speeds of j and
    after; equality holds on j's segment of the piecewise linear total. So the optimum is the
    largest root (target - C_j) / S_j over the members: one segmented maximum, no search. Pinned
    members (cap and speed 0) add nothing and leave the others' order intact.
    """
    cap_before = np.cumsum(caps) - caps
    cap_before -= cap_before[starts][segment_of]
    speed_before = np.cumsum(speeds) - speeds
    speed_before -= speed_before[starts][segment_of]
    speed_total = np.add.reduceat(speeds, starts)
    speed_rest = speed_total[segment_of] - speed_before
    with np.errstate(divide="ignore", invalid="ignore"):
        roots = np.where(speed_rest > 0, (target[segment_of] - cap_before) / speed_rest, -np.inf)
    return np.maximum.reduceat(roots, starts)


@dataclass
class GAConfig:
    """Knobs of the island GA.

    :param islands: populations evolving apart, exchanging their best every ``migration_every`` generations
    :param population: individuals per island
    :param elites: best individuals of an island copied unchanged into its next generation
    :param crossover: probability that a child is a cluster-preserving crossover of two parents
    :param max_generations: stop after this many generations
    :param stall_generations: stop after this many generations without a better best
    :param migration_every: generations between migrations
    """

    islands: int = 4
    population: int = 24
    elites: int = 2
    crossover: float = 0.3
    max_generations: int = 400
    stall_generations: int = 60
    migration_every: int = 10


class IslandGA:
    """Evolves cluster assignments for one swarm, starting from a given seed plan (normally the greedy one).

    The seed plan is an elite of every island from the first generation on, and elites are never
    replaced by worse individuals, so the result is never worse than the seed. Given the same seed and
    no time limit, the run is deterministic.

    :param arrays: the swarm as :class:`SwarmArrays`
    :param seed_plan: an assignment (cluster id or -1 per column of ``arrays``)
    :param seed: random seed
    :param config: GA knobs
    """

    def __init__(self, arrays: SwarmArrays, seed_plan: np.ndarray, seed: int = 0, config: Optional[GAConfig] = None):
        self.arrays, self.config = arrays, config or GAConfig()
        self.rng = np.random.default_rng(seed)
        self.generation = 0
        cfg = self.config
        total = cfg.islands * cfg.population
        size, slots = arrays.size, arrays.max_clusters
        population = np.empty((total, size), dtype=np.int32)
        population[:] = seed_plan
        # half of each island explores from random assignments, half from perturbed copies of the seed
        randomised = self.rng.random(total) < 0.5
        randomised[:: cfg.population] = False
        population[randomised] = self.rng.integers(-1, slots, size=(int(randomised.sum()), size))
        perturbed = ~randomised
        perturbed[:: cfg.population] = False
        for _ in range(max(1, size // 20)):
            self._reassign(population, perturbed)
        self.population = population
        self.excluded = np.zeros(size, dtype=bool)
        self.fitness, self.margin, self.clusters = arrays.evaluate(population)
        self.best_fitness = -1.0
        self.best = population[0].copy()
        self.stalled = 0  # generations since the best last improved
        self._record_best()

    def _record_best(self) -> bool:
        leader = int(np.lexsort((-self.margin, -self.fitness))[0])
        if self.fitness[leader] > self.best_fitness:
            self.best_fitness = float(self.fitness[leader])
            self.best = self.population[leader].copy()
            self.stalled = 0
            return True
        return False

    def inject(self, plans: Sequence[np.ndarray]) -> None:
        """Migrate plans from elsewhere (other peers' islands) in place of each island's worst individuals."""
        cfg = self.config
        for i, plan in enumerate(plans):
            island = i % cfg.islands
            rows = slice(island * cfg.population, (island + 1) * cfg.population)
            worst = island * cfg.population + int(np.lexsort((self.margin[rows], self.fitness[rows]))[0])
            self.population[worst] = plan
        self.population[:, self.excluded] = STANDBY
        self.fitness, self.margin, self.clusters = self.arrays.evaluate(self.population)
        self._record_best()

    def exclude(self, columns: Sequence[int]) -> None:
        """Keep these peers (columns) on standby from now on, e.g. peers that died mid-round.

        The best plan so far may have used them, so the best is re-chosen from the repaired population.
        """
        self.excluded[list(columns)] = True
        self.population[:, self.excluded] = STANDBY
        self.fitness, self.margin, self.clusters = self.arrays.evaluate(self.population)
        self.best_fitness = -1.0
        self._record_best()

    def step(self) -> bool:
        """One generation on every island; returns whether the overall best improved."""
        cfg, rng = self.config, self.rng
        pop, size = cfg.population, self.arrays.size
        children = np.empty_like(self.population)
        # each child's parent's cluster count: its bottleneck id is that minus one
        child_clusters = np.empty_like(self.clusters)
        for island in range(cfg.islands):
            lo = island * pop
            fitness, margin = self.fitness[lo:lo + pop], self.margin[lo:lo + pop]
            ranking = np.lexsort((-margin, -fitness))  # best first
            children[lo:lo + cfg.elites] = self.population[lo + ranking[:cfg.elites]]
            child_clusters[lo:lo + cfg.elites] = self.clusters[lo + ranking[:cfg.elites]]
            # binary tournaments on rank
            rank_of = np.empty(pop, dtype=np.int64)
            rank_of[ranking] = np.arange(pop)
            picks = rng.integers(0, pop, size=(2, pop - cfg.elites, 2))
            winners = np.where(rank_of[picks[:, :, 0]] <= rank_of[picks[:, :, 1]], picks[:, :, 0], picks[:, :, 1])
            children[lo + cfg.elites:lo + pop] = self.population[lo + winners[0]]
            child_clusters[lo + cfg.elites:lo + pop] = self.clusters[lo + winners[0]]
            mates = self.population[lo + winners[1]]
            crossed = rng.random(pop - cfg.elites) < cfg.crossover
            if crossed.any():
                block = children[lo + cfg.elites:lo + pop]
                block[crossed] = self._crossover(block[crossed], mates[crossed],
                                                 self.clusters[lo + winners[0][crossed]])
        offspring = np.ones(len(children), dtype=bool)
        offspring[np.arange(cfg.islands)[:, None] * pop + np.arange(cfg.elites)] = False
        self._mutate(children, offspring, child_clusters)
        children[:, self.excluded] = STANDBY
        self.population = children
        self.fitness, self.margin, self.clusters = self.arrays.evaluate(children)
        self.generation += 1
        if cfg.islands > 1 and self.generation % cfg.migration_every == 0:
            self._migrate()
        improved = self._record_best() if size else False
        self.stalled = 0 if improved else self.stalled + 1
        return improved

    def _crossover(self, parents: np.ndarray, mates: np.ndarray, parent_clusters: np.ndarray) -> np.ndarray:
        """Keep a parent's fastest ``cut`` clusters whole and fill in the mate's clusters ranked ``cut`` or slower."""
        cut = (self.rng.random(len(parents)) * (parent_clusters + 1)).astype(np.int64)[:, None]
        from_parent = (parents >= 0) & (parents < cut)
        return np.where(from_parent, parents, np.where(mates >= cut, mates, STANDBY)).astype(parents.dtype)

    def _mutate(self, population: np.ndarray, rows: np.ndarray, clusters: np.ndarray) -> None:
        """One operator per offspring: reassign, swap, boost the bottleneck, move a peer into it, or found a cluster.

        ``clusters`` is each row's parent's cluster count K, so id K-1 is the parent's bottleneck.
        """
        choice = self.rng.integers(0, 5, size=len(population))
        self._reassign(population, rows & (choice == 0))
        self._swap(population, rows & (choice == 1))
        self._boost_bottleneck(population, rows & (choice == 2) & (clusters > 0), clusters)
        self._steal_for_bottleneck(population, rows & (choice == 3) & (clusters > 0), clusters)
        self._found_cluster(population, rows & (choice == 4) & (clusters < self.arrays.max_clusters), clusters)

    def _reassign(self, population: np.ndarray, rows: np.ndarray) -> None:
        """Give one peer per chosen row another peer's cluster, standby, or a fresh cluster id."""
        index = np.flatnonzero(rows)
        if not len(index) or not self.arrays.size:
            return
        size, slots = self.arrays.size, self.arrays.max_clusters
        peer = self.rng.integers(0, size, len(index))
        other = population[index, self.rng.integers(0, size, len(index))]
        kind = self.rng.random(len(index))
        value = np.where(kind < 0.6, other, np.where(kind < 0.8, STANDBY, self.rng.integers(0, slots, len(index))))
        population[index, peer] = value

    def _swap(self, population: np.ndarray, rows: np.ndarray) -> None:
        index = np.flatnonzero(rows)
        if not len(index) or not self.arrays.size:
            return
        a = self.rng.integers(0, self.arrays.size, len(index))
        b = self.rng.integers(0, self.arrays.size, len(index))
        _exchange(population, index, a, b)

    def _standby_candidates(self, population: np.ndarray, index: np.ndarray, samples: int = 6):
        """Per row, the fastest standby peer among a few sampled ones (or -1 if none was standby)."""
        peers = self.rng.integers(0, self.arrays.size, size=(len(index), samples))
        standby = population[index[:, None], peers] == STANDBY
        score = np.where(standby, self.arrays.speeds[peers], -1.0)
        best = np.argmax(score, axis=1)
        chosen = peers[np.arange(len(index)), best]
        return np.where(standby[np.arange(len(index)), best], chosen, -1)

    def _boost_bottleneck(self, population: np.ndarray, rows: np.ndarray, clusters: np.ndarray) -> None:
        """Add a fast standby peer to each of the slowest m clusters (ids K-1, K-2, ... after renumbering).

        On a big swarm thousands of clusters sit just above the bottleneck, so lifting one at a time
        would take as many generations; m is drawn per generation from powers of two.
        """
        index = np.flatnonzero(rows)
        if not len(index):
            return
        for lift in range(int(self.rng.choice([1, 1, 2, 4, 8, 16, 32]))):
            target = clusters[index] - 1 - lift
            chosen = self._standby_candidates(population, index)
            ok = (chosen >= 0) & (target >= 0)
            population[index[ok], chosen[ok]] = target[ok]

    def _steal_for_bottleneck(self, population: np.ndarray, rows: np.ndarray, clusters: np.ndarray) -> None:
        """Move a random peer into the slowest cluster (its old cluster may dissolve in repair)."""
        index = np.flatnonzero(rows)
        if not len(index):
            return
        peer = self.rng.integers(0, self.arrays.size, len(index))
        population[index, peer] = clusters[index] - 1

    def _found_cluster(self, population: np.ndarray, rows: np.ndarray, clusters: np.ndarray) -> None:
        """Put 2..D fast standby peers (one where D = 1) together under the unused id K, then swap one of them with a
        random peer.

        A lone peer rarely holds the model, and repair dissolves a cluster short of RAM, so a new cluster
        can only appear when several standby peers join it in one move. Standby peers are the slow
        ones, and repair drops a new cluster slower than the cut, so the swap lets a faster peer into
        it in the same move: without both, 4 peers planned as one cluster + 2 standby never reach the
        better 2 x 2.
        """
        index = np.flatnonzero(rows)
        if not len(index):
            return
        first, most = None, self.arrays.workload.max_stages
        for _ in range(int(self.rng.integers(min(2, most), most + 1))):  # D = 1: clusters of one peer each
            chosen = self._standby_candidates(population, index)
            ok = chosen >= 0
            population[index[ok], chosen[ok]] = clusters[index[ok]]
            first = chosen if first is None else first
        ok = first >= 0
        rows_ok = index[ok]
        _exchange(population, rows_ok, first[ok], self.rng.integers(0, self.arrays.size, len(rows_ok)))

    def _migrate(self) -> None:
        """Ring migration: each island's best replaces the next island's worst."""
        cfg, pop = self.config, self.config.population
        bests, worsts = [], []
        for island in range(cfg.islands):
            lo = island * pop
            order = np.lexsort((-self.margin[lo:lo + pop], -self.fitness[lo:lo + pop]))
            bests.append(lo + order[0])
            worsts.append(lo + order[-1])
        migrants = self.population[bests].copy()
        for island in range(cfg.islands):
            target = worsts[(island + 1) % cfg.islands]
            self.population[target] = migrants[island]
            self.fitness[target] = self.fitness[bests[island]]
            self.margin[target] = self.margin[bests[island]]
            self.clusters[target] = self.clusters[bests[island]]

    def run(self, time_limit: Optional[float] = None,
            on_generation: Optional[Callable[[int, float], None]] = None) -> np.ndarray:
        """Evolve until the generation budget, the stall limit or ``time_limit`` seconds; return the best plan."""
        cfg = self.config
        started = time.perf_counter()
        while self.generation < cfg.max_generations and self.stalled < cfg.stall_generations:
            if time_limit is not None and time.perf_counter() - started >= time_limit:
                break
            self.step()
            if on_generation is not None:
                on_generation(self.generation, self.best_fitness)
        return self.best

    def evolve_for(self, seconds: float) -> None:
        """Evolve for ``seconds`` (a planning round's slice); once the best has stood for the stall limit, rest
        for the rest of it instead: a migrant better than our best, or peers excluded, start it again. Every peer
        of a round evolved until the deadline, so a round of a few peers kept every core busy for its 10 s."""
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            if self.stalled >= self.config.stall_generations:
                time.sleep(max(0.0, seconds - (time.perf_counter() - started)))
                return
            self.step()
