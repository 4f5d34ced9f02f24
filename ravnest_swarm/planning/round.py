"""The distributed planning round: every volunteer runs a GA island and all adopt the same plan.

Over 400 lines because opening, evolving, freezing and adopting are one protocol over the same proposals;
what a plan is worth after its moves lives apart, in ``moves.py``.

No coordinator. Round r is 1 + the newest adopted plan's round. A peer opens it when it sees a
trigger (see :class:`RoundTriggers`) by publishing a proposal whose deadline is ``round_seconds``
ahead; any peer that sees a proposal of round r joins it, and the round's deadline is the earliest
deadline any proposal names. Until shortly before the deadline each participant evolves its own
island (seed from run, round and peer id), republishes its best plan under ``{run}_round`` and
migrates the others' best plans into its population. Shortly after the deadline every peer reads all
proposals of round r and adopts the best one whose clustered peers are all alive at the deadline
(its throughput over the move horizon recomputed from the proposals, ties by hash) if it pays back its moves
from the plan in force (``cost.pays_back``), updates its peer record, and writes the plan
under ``{run}_plan`` if it is one of the first three participants or finds no copy (``keep_plan_copy``).
A peer dying mid-round only drops out: the others exclude it, and proposals that still use it lose.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import zlib
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

import numpy as np
from hivemind.dht.node import DHTNode
from hivemind.utils.timed_storage import get_dht_time
from rich.console import Console

from ravnest_swarm.errors import UserError
from ravnest_swarm.membership.announcer import PeerAnnouncer
from ravnest_swarm.membership.reader import (adopted_plan, followed_by_its_peers, plan_digest, read_plans,
                                            read_proposals)
from ravnest_swarm.membership.records import (
    MAX_ROUND_PEERS, PlanRecord, RoundProposal, plan_key, plan_subkey_prefix, planning_memory_gb, round_key,
    signing_validator,
)
from ravnest_swarm.planning.cost import (DEFAULT_MOVE_HORIZON_S, MovePrice, Peer, Workload, cluster_throughput,
                                         pays_back, swarm_throughput)
from ravnest_swarm.planning.ga import STANDBY, GAConfig, IslandGA, SwarmArrays
from ravnest_swarm.planning.greedy import greedy_plan
from ravnest_swarm.planning.moves import (PricedPlan, Pricing, candidate_plans, improvement, in_force_throughput,
                                         kept_cluster_numbers, price_plan)
from ravnest_swarm.planning.plan import assignment_clusters, check_feasible, memory, uniform_layers

logger = logging.getLogger(__name__)

GONE_POLLS = 3
PLAN_COPIES = 3  # adopters that write a copy of each round's plan; the others only where none is readable
# an island whose best stood this many generations rests until the deadline (IslandGA.evolve_for); `local`'s
# swarms found their best plan within 1000 generations whatever the seed, after plateaus of up to 608 (7 peers)
ROUND_GA = GAConfig(islands=2, population=16, max_generations=10**9, stall_generations=1000)


@dataclass
class RoundOptions:
    """How a volunteer takes part in planning rounds.

    :param workload: the model's needs (M, F, A, D)
    :param min_peers: open the first round once this many peers are live
    :param round_period: seconds after which a plan is revised anyway (0: never)
    :param round_seconds: how long a round runs from its opening to its deadline
    :param num_layers: identical layers the stages' layer ranges are cut from
    :param poll: seconds between looks at the DHT
    :param settle: seconds before the deadline after which proposals no longer change, and after it
        before the final read, so every peer reads the same proposals
    :param fresh_within: a participant counts as alive if its proposal was renewed this many seconds
        before the proposals freeze (they renew about every half second); default half the round
    :param layer_profile: the real model's per-layer memory (GB) and GFLOP, to cut stages at its layer
        boundaries; None cuts ``num_layers`` identical layers
    :param move_horizon_s: a new plan must pay back its moves within this many seconds (the spec's
        ``move_horizon_s``, ``cost.pays_back``)
    :param layer_download_gb: what a peer downloads per layer it lacks (GB); None: the layers' memory
    :param plan_wait: seconds a peer that reads no plan in force, while live peers' records say they follow
        one, waits for that plan's record before it opens a first round of its own
    :param hole_wait: seconds a placed peer waits, once planned peers are gone, for a standby or joiner to open
        the round that fills their places before it opens one itself (with no standby in sight, only where one
        cluster is broken and another whole); 0: at once. It counts from when a gone peer stopped handing its
        layers over (its record says ``leaving`` until then, and for one record lifetime after it exits), or
        :data:`HANDOVER_WAIT_S` after it began
    """

    workload: Workload
    min_peers: int = 2
    round_period: float = 600.0
    round_seconds: float = 10.0
    num_layers: int = 32
    poll: float = 1.0
    settle: float = 1.5
    fresh_within: Optional[float] = None
    layer_profile: Optional[Tuple[Sequence[float], Sequence[float]]] = None
    move_horizon_s: float = DEFAULT_MOVE_HORIZON_S
    layer_download_gb: Optional[Sequence[float]] = None
    plan_wait: float = 60.0
    hole_wait: float = 30.0

    def pricing(self) -> Pricing:
        """How a round builds and prices plans: stages cut from the real model's layers or ``num_layers`` identical
        ones, moves priced by the layers' download size or, without one, their memory."""
        profile = self.layer_profile or uniform_layers(max(self.num_layers, self.workload.max_stages), self.workload)
        return Pricing(self.workload, profile, MovePrice(tuple(self.layer_download_gb or profile[0]),
                                                         self.move_horizon_s))


# at most this long a placed peer counts a planned peer's graceful leave as no hole yet (``join --handover-timeout``'s
# default): a leaving record that stays for ever must not keep its cluster broken for ever
HANDOVER_WAIT_S = 90.0


def counting_peers(alive: Dict[str, Peer], joining: FrozenSet[str]) -> int:
    """The live peers that count for a first round's ``--min-peers``: those whose planning rounds began."""
    return len(set(alive) - joining)


def plan_hash(clusters: Sequence[Sequence[str]]) -> str:
    """Hash of a plan's canonical form (clusters as sorted id lists, sorted): the same plan, the same hash."""
    canonical = sorted(sorted(c) for c in clusters)
    return hashlib.sha256(json.dumps(canonical).encode()).hexdigest()[:16]


def plan_shape_problem(record: dict, num_layers: int, max_stages: int) -> Optional[str]:
    """What no adopter's plan record has, or None: a peer placed twice, a cluster of more than ``max_stages`` stages,
    or one whose stages' layers are not contiguous ranges that cover ``[0, num_layers)`` in order."""
    members = [stage["peer_id"] for cluster in record["clusters"] for stage in cluster]
    if len(set(members)) != len(members):
        return "it places a peer twice"
    for number, cluster in enumerate(record["clusters"]):
        if len(cluster) > max_stages:
            return f"its cluster {number} has {len(cluster)} stages, more than {max_stages}"
        bounds = [0] + [stage["layers"][1] for stage in cluster]
        if [stage["layers"][0] for stage in cluster] != bounds[:-1] or bounds[-1] != num_layers or \
                any(low >= high for low, high in zip(bounds, bounds[1:])):
            return f"its cluster {number}'s layers are not the model's {num_layers} in order"
    return None


def canonical(clusters: Sequence[Sequence[str]]) -> List[List[str]]:
    return sorted(sorted(c) for c in clusters)


class RoundTriggers:
    """Decides, from the plan in force and the live peers, whether a new round should open.

    A round is opened only when it can adopt something: before the first plan, once ``min_peers`` peers are
    live; when a planned peer is gone (the plan cannot be followed): by a standby at once, by a placed peer once
    ``hole_wait`` passed, or at once where no standby is in sight and more than one cluster (or every cluster) is
    broken; when standbys can raise the swarm's throughput enough to pay back the moves (:func:`improvement`, the
    same estimate the round adopts by), weighed once per set of standbys until a plan is adopted; and every
    ``round_period`` seconds.

    :param options: the round options: ``min_peers``, ``round_period``, and the workload and move price that
        weigh the standbys
    :param peer_id: whose triggers these are (a standby opens a round for gone peers at once)
    """

    def __init__(self, options: RoundOptions, peer_id: Optional[str] = None):
        self.options, self.peer_id = options, peer_id
        self.considered: set = set()  # standbys already weighed against the plan in force
        self.missing: Dict[str, int] = {}  # planned peer id -> consecutive polls without its record
        self.declined_at = 0.0  # when a round last adopted nothing: the round period counts from then too
        # standbys last weighed that could not pay back their moves, the plan in force's throughput and their best
        # plan: PlanningRounds tells the volunteers once why no round opened
        self.unpaid: Optional[Tuple[set, float, PricedPlan]] = None
        # since when live peers say they follow a plan whose record we cannot read (None: we can, or none do)
        self.unread_plan_since: Optional[float] = None
        # since when a planned peer is gone and we wait for a standby to open the round that fills its place
        self.hole_since: Optional[float] = None
        # since when gone planned peers still hand their layers over (the hole wait counts from its end), and which
        self.handover_since: Optional[float] = None
        self.handing_over: FrozenSet[str] = frozenset()

    def gone(self) -> FrozenSet[str]:
        """Planned peers whose records we missed :data:`GONE_POLLS` looks in a row."""
        return frozenset(peer for peer, polls in self.missing.items() if polls >= GONE_POLLS)

    def adopted(self) -> None:
        """A round adopted a plan: every standby is weighed against it anew (one that missed the round too)."""
        self.considered = set()
        self.hole_since = self.handover_since = None
        self.handing_over = frozenset()

    def declined(self) -> None:
        """A round kept the plan in force (nothing paid back its moves)."""
        self.declined_at = time.time()

    def reason(self, plan: Optional[dict], alive: Dict[str, Peer], followed: Optional[Dict[str, int]] = None,
               joining: FrozenSet[str] = frozenset(), leaving: FrozenSet[str] = frozenset()) -> Optional[str]:
        """Why a new round should open now, or None.

        :param followed: the plan round each live placed peer's record names (``PlanningRounds.followed``)
        :param joining: live peers whose records say ``joining``: their planning rounds have not started (they
            still prepare their model), so they count for no round's opening; one opened for them went by before
            they looked, and they were placed a round later (``PlanningRounds.run_forever``)
        :param leaving: peers whose valid records say ``leaving``: they still hand their layers over
        """
        if plan is None:
            # peers follow a plan we cannot read (yet): a round 1 of our own would start a second swarm beside
            # theirs that never averages with it (a soak's joiner did, and later joiners followed it); wait for
            # their plan, as its adopters write it again where it is missing, but not for ever: anyone can write
            # a record that says it follows a plan
            if followed:
                self.unread_plan_since = self.unread_plan_since or time.time()
                if time.time() - self.unread_plan_since < self.options.plan_wait:
                    return None
            else:
                self.unread_plan_since = None
            ready = counting_peers(alive, joining)
            return f"{ready} live peers" if ready >= self.options.min_peers else None
        self.unread_plan_since = None
        members = {stage["peer_id"] for cluster in plan["clusters"] for stage in cluster}
        # a record can miss one renewal on a loaded machine: call a peer gone only after GONE_POLLS looks
        self.missing = {peer: self.missing.get(peer, 0) + 1 for peer in members - set(alive)}
        gone = [peer for peer, polls in self.missing.items() if polls >= GONE_POLLS]
        # a peer that follows a newer plan than ours is in a round we have not seen yet: no standby of ours (the
        # soak's second swarm weighed the first's six peers of round 10, again and again, in rounds they never
        # joined). One that follows an older plan, or another plan of our round (two sides that each opened a
        # round 1, a NAT lab run), is: every reader names the same plan in force (``reader.adopted_plan``), so
        # both sides join the round it opens, which merges them
        elsewhere = {peer for peer, round_number in (followed or {}).items()
                     if round_number > plan["round"] and peer not in members}
        alive = {peer: capabilities for peer, capabilities in alive.items() if peer not in elsewhere}
        standbys = set(alive) - members - joining
        if gone:
            return self._gone_reason(plan, alive, gone, standbys, leaving)
        self.hole_since = self.handover_since = None
        self.handing_over = frozenset()
        if standbys - self.considered and members <= set(alive):
            # weigh each set once: a joiner that cannot pay back the moves opens no round, now or next poll
            self.considered |= standbys
            current, possible = improvement(plan, alive, self.options.pricing())
            if possible is not None and pays_back(current, possible.throughput, possible.cost.seconds,
                                                  self.options.move_horizon_s):
                return (f"{len(standbys)} standby peer(s) can raise the swarm's throughput from {current:.3g} to "
                        f"{possible.throughput:.3g} samples/s, moving {possible.cost.moved} peer(s) in "
                        f"{possible.cost.seconds:.0f}s")
            if possible is not None:
                self.unpaid = (standbys, current, possible)
        period = self.options.round_period
        if period > 0 and time.time() - max(plan["time"], self.declined_at) >= period:
            return "round period elapsed"
        return None

    def _gone_reason(self, plan: dict, alive: Dict[str, Peer], gone: List[str], standbys: set,
                     leaving: FrozenSet[str]) -> Optional[str]:
        """Open a round for gone planned peers now, or wait for a joiner to take their place. Under churn a leave
        is followed by a join: re-planning without the gone peer, then again with the joiner, adopted two plans
        per churn event and moved peers twice (issue 33's soak); while another cluster is whole the swarm trains
        on, and one round that puts the joiner in the hole moves only the joiner (``moves.candidate_plans``).
        The standby opens that round: it surely takes part in it. A round a placed peer opened as soon as it saw
        a joiner's record came before the joiner's planner ran, and placed nobody in the hole (a soak). The wait counts
        from the end of a leaver's hand-over: a soak's Ctrl-C handed over for 51 s, the wait ran out meanwhile, and a
        round re-planned without its cluster (moving 5 peers) a few seconds before the joiner came."""
        if self.peer_id in standbys:
            return f"{len(gone)} planned peer(s) gone, {len(standbys)} standby peer(s) to take their place"
        whole = sum(all(stage["peer_id"] in alive for stage in cluster) for cluster in plan["clusters"])
        # one broken cluster is a churn event; more at once (a network split, a crash of several) re-plan now
        churn = whole == len(plan["clusters"]) - 1 and whole > 0
        if (standbys or churn) and self.options.hole_wait > 0:
            now = time.time()
            handing_over = frozenset(gone) & leaving
            if handing_over != self.handing_over:  # another leaver's hand-over has a wait of its own
                self.handing_over, self.handover_since = handing_over, None
            if handing_over and now - (self.handover_since or now) < HANDOVER_WAIT_S:
                self.handover_since = self.handover_since or now
                self.hole_since = None  # its layers are still served: its place is no hole yet
                return None
            self.hole_since = self.hole_since or now
            if now - self.hole_since < self.options.hole_wait:
                return None
        return f"{len(gone)} planned peer(s) gone"


def standby_reason(plan: dict, alive: Dict[str, Peer], workload: Workload) -> str:
    """Why the live standbys have no slot in ``plan``, in words a volunteer understands."""
    members = {stage["peer_id"] for cluster in plan["clusters"] for stage in cluster}
    spare_gb = sum(p.ram_gb for i, p in alive.items() if i not in members)
    clusters = len(plan["clusters"])
    if spare_gb < workload.model_gb:
        return (f"the {clusters} cluster(s) are full and the standbys offer {memory(spare_gb)} together, "
                f"{memory(workload.model_gb - spare_gb)} short of a new cluster's {memory(workload.model_gb)}")
    return f"the swarm is fastest with {clusters} cluster(s) as planned; a standby would slow its cluster down"


class PlanningRounds:
    """Takes part in planning rounds for one volunteer until stopped.

    :param node: this peer's DHT node (with the run's validators)
    :param run: run name
    :param announcer: this peer's record publisher; the adopted placement is written into its record
    :param options: round options
    :param console: where the one-line round events go
    :param on_adopt: called with the plan record each time this peer adopts a plan, and the plan in force that the
        round priced it against (None: the run's first)
    """

    def __init__(self, node: DHTNode, run: str, announcer: PeerAnnouncer, options: RoundOptions, console: Console,
                 on_adopt: Optional[Callable[[dict, Optional[dict]], None]] = None):
        self.node, self.run, self.announcer, self.options, self.console = node, run, announcer, options, console
        self.on_adopt = on_adopt
        self.peer_id = node.peer_id.to_base58()
        self.subkey = signing_validator(node).local_public_key  # our identity's: records name us
        self.triggers = RoundTriggers(options, self.peer_id)
        self._last_note: Optional[str] = None
        self._said_live: Optional[int] = None  # live peers we said we had while short of ``min_peers`` before a plan
        self.fresh_within = options.fresh_within or options.round_seconds / 2
        self.names: Dict[str, str] = {}  # peer id -> name, for log lines people and tests can read
        self.adopted: Optional[dict] = None  # the plan we adopted last: we trust our own adoption over any record
        self.seen: Optional[dict] = None  # the newest plan we saw its peers follow (a standby adopts none)
        self.followed: Dict[str, int] = {}  # live placed peer id -> the plan round its record names
        # the live peer records and the plan copies the last look at the plan in force read
        self.peers_read: List[dict] = []
        self.plans_read: List[dict] = []
        self.replaced: Optional[dict] = None  # the plan in force that the plan we follow replaced
        self.joining: FrozenSet[str] = frozenset()  # live peers whose planning rounds have not begun (read_alive)
        self.leaving: FrozenSet[str] = frozenset()  # peers whose valid records say leaving (read_alive)
        self.rewritten_at = 0.0  # when we last wrote again a copy of the plan in force that no read found

    def say(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    async def run_forever(self, stop: asyncio.Event) -> None:
        if self.announcer.record["state"] == "joining":
            # from now on we take part in rounds; until now our record said we could not (``RoundTriggers.reason``).
            # A joiner's record went out seconds before its rounds began (its model's first use, the measure of its
            # compute), a round opened for it froze its proposals before it looked, and it was placed a round later:
            # in CI, one NAT lab volunteer at the very end of the run
            self.announcer.update(state="standby")
            await self.announcer.renew()
        while not stop.is_set():
            try:
                await self.poll_once()
            except Exception as e:  # a DHT hiccup must not end the volunteer's membership
                logger.warning(f"planning round step failed: {type(e).__name__}: {e}")
            try:
                await asyncio.wait_for(stop.wait(), self.options.poll)
            except asyncio.TimeoutError:
                pass

    async def read_alive(self, at: float) -> Dict[str, Peer]:
        """Peers whose records are still valid at DHT time ``at`` and not leaving, by peer id; ``joining`` says which
        of them have not begun their planning rounds yet."""
        alive, joining, leaving = {}, set(), set()
        for record in await self.announcer.read_peers(alive_at=at):
            if record["state"] == "joining":
                joining.add(record["peer_id"])
            if record["state"] == "leaving":
                leaving.add(record["peer_id"])
            if record["state"] != "leaving":
                self.names[record["peer_id"]] = record["name"]
                # stages are sized by the memory of the device that holds them: a GPU peer's is its GPU's
                alive[record["peer_id"]] = Peer(record["peer_id"], planning_memory_gb(record), record["gflops"],
                                                record["bandwidth_mbps"])
        self.joining, self.leaving = frozenset(joining), frozenset(leaving)
        return alive

    async def read_proposals(self, round_number: int, deadline_after: float = 0.0) -> List[dict]:
        """Proposals of ``round_number`` whose deadline is after ``deadline_after`` (older attempts failed) and no
        further ahead than a round lasts (:func:`deadline_in_reach`)."""
        now = get_dht_time()
        return [proposal for proposal in await read_proposals(self.node, self.run)
                if proposal["round"] == round_number and proposal["deadline"] > deadline_after
                and deadline_in_reach(proposal, now, self.options.round_seconds)]

    async def current_plan(self) -> Optional[dict]:
        """The plan in force: the newest that its peers follow (``reader.adopted_plan``: a plan record anyone
        wrote, for any round, does not count by itself), or the one we adopted or last saw in force if newer."""
        live_round = None if self.adopted is None else self.adopted["round"]
        peers, plans = await self.announcer.read_peers(), await read_plans(self.node, self.run)
        self.peers_read, self.plans_read = peers, plans
        plan = adopted_plan(plans, peers, live_round)
        self.followed = {record["peer_id"]: record["plan_round"] for record in peers
                         if record.get("plan_round") is not None and isinstance(record.get("cluster"), int)
                         and record["cluster"] >= 0 and record.get("state") != "leaving"}
        known = max((p for p in (self.adopted, self.seen) if p is not None), key=lambda p: p["round"], default=None)
        if known is not None and (plan is None or plan["round"] < known["round"]):
            await self.keep_readable(known, plans)
            return known  # its peers may have left since: it stays in force until a round adopts the next
        self.seen = plan
        return plan

    async def keep_readable(self, plan: dict, plans: List[dict]) -> None:
        """Write our copy of the plan in force again where no copy of it is readable (at most once a round's
        length): a joiner that reads no plan opens a round 1 of its own. Copies are written once, by the first
        adopters, and their stores can fail on a loaded machine, the nodes holding them leave, and they expire."""
        if any(p["round"] == plan["round"] and p["clusters"] == plan["clusters"] for p in plans):
            return
        if time.monotonic() - self.rewritten_at < self.options.round_seconds:
            return
        self.rewritten_at = time.monotonic()
        stored = await self.store_plan_copy(plan)
        self.say(f"plan round {plan['round']} in force had no readable copy: wrote ours again"
                 f"{'' if stored else ', but no node stored it'}")

    async def poll_once(self) -> None:
        plan = await self.current_plan()
        if await self._followed_the_other_side(plan):
            return
        round_number = plan["round"] + 1 if plan is not None else 1
        now = get_dht_time()
        if await self._joined_open_round(round_number, plan):
            return
        alive = await self.read_alive(now)
        triggers = self.triggers
        waiting, hole, handover = triggers.unread_plan_since, triggers.hole_since, triggers.handover_since
        reason = self.triggers.reason(plan, alive, self.followed, self.joining, self.leaving)
        if waiting is None and self.triggers.unread_plan_since is not None:
            rounds = ",".join(str(r) for r in sorted(set(self.followed.values())))
            self.say(f"no plan in force is readable, but {len(self.followed)} live peer(s) follow plan round "
                     f"{rounds}: waiting up to {self.options.plan_wait:g}s for it before opening a round of our own")
        if handover is None and self.triggers.handover_since is not None:
            leavers = ",".join(sorted(self.names.get(i, i) for i in triggers.handing_over))
            self.say(f"planned peer(s) {leavers} hand their layers over: their places wait until they are gone (at "
                     f"most {HANDOVER_WAIT_S:g}s), then up to {self.options.hole_wait:g}s for a joiner")
        if hole is None and self.triggers.hole_since is not None:
            self.say(f"planned peer(s) {self._gone_names()} gone: the other clusters train on; waiting up to "
                     f"{self.options.hole_wait:g}s for a joiner to take their place before re-planning without them")
        if self.triggers.unpaid is not None:
            self._say_unpaid(*self.triggers.unpaid)
            self.triggers.unpaid = None
        ready = counting_peers(alive, self.joining)
        short = self.options.min_peers - ready if plan is None and not self.followed else 0
        if short > 0 and ready != self._said_live:
            # a first volunteer alone (a walkthrough's) saw only "waiting for a planning round", for ever
            self.say(f"{ready} live peer(s): the first planning round opens once {self.options.min_peers} are live "
                     f"(--min-peers); waiting for {short} more")
        self._said_live = ready if short > 0 else None
        # a DHT read that reached none of the key's holders reads as no proposals: look once more before we open a
        # round another peer may have opened (a NAT lab peer whose relay lost the first read opened a round 1 of its
        # own beside one, and the two plans merged only two rounds later)
        if reason is not None and not await self._joined_open_round(round_number, plan):
            await self.take_part(round_number, now + self.options.round_seconds, f"opened ({reason})", plan)

    async def _joined_open_round(self, round_number: int, plan: Optional[dict]) -> bool:
        """Take part in round ``round_number`` if a peer opened it (its proposals are readable); whether we did."""
        proposals = await self.read_proposals(round_number, deadline_after=get_dht_time() - self.options.settle)
        if not proposals:
            return False
        await self.take_part(round_number, min(p["deadline"] for p in proposals), "joined", plan,
                             seen={p["peer_id"] for p in proposals})
        return True

    def _gone_names(self) -> str:
        return ",".join(sorted(self.names.get(i, i) for i in self.triggers.gone()))

    def _say_unpaid(self, standbys: set, current: float, possible: PricedPlan) -> None:
        names = ",".join(sorted(self.names.get(i, i) for i in standbys))
        if possible.throughput <= current:
            self.say(f"standby {names} opened no round: their best plan ({possible.throughput:.9e} samples/s) is no "
                     f"faster than the plan in force ({current:.9e})")
            return
        self.say(f"standby {names} opened no round: their best plan ({possible.throughput:.9e} samples/s) would move "
                 f"{possible.cost.moved} peer(s) for {possible.cost.seconds:.1f}s and not pay that back within "
                 f"{self.options.move_horizon_s:g}s over the plan in force ({current:.9e})")

    async def take_part(self, round_number: int, deadline: float, how: str, in_force: Optional[dict],
                        seen: Set[str] = frozenset()) -> None:
        """Run our island until shortly before the deadline, then adopt the round's plan if it pays back its moves
        from the plan ``in_force``. ``seen``: the participants whose proposals made us join (``adopt``)."""
        options = self.options
        alive = await self.read_alive(get_dht_time())
        snapshot = [alive[i] for i in sorted(alive)[:MAX_ROUND_PEERS]]
        try:
            check_feasible(snapshot, options.workload)
        except UserError as e:
            if str(e) != self._last_note:
                self.say(f"round {round_number}: {e}")
                self._last_note = str(e)
            return
        left = deadline - get_dht_time()
        self.say(f"round {round_number} {how}: {len(snapshot)} peers, deadline in {left:.1f}s")
        if left <= options.settle:
            # our proposal can no longer count: the others freeze theirs now and plan without us, as we do
            self.say(f"round {round_number}: seen after its proposals froze, so it plans without us (a round runs "
                     f"{options.round_seconds:g}s, --round-seconds; our look at the DHT took longer)")
        arrays = SwarmArrays(snapshot, options.workload)
        column_of = {snapshot[i].peer_id: column for column, i in enumerate(arrays.peer_index)}
        joined = get_dht_time()
        seed = zlib.crc32(f"{self.run}/{round_number}/{self.peer_id}".encode())
        if in_force is not None:
            arrays.weigh_moves([([column_of[stage["peer_id"]] for stage in cluster if stage["peer_id"] in column_of],
                                 len(cluster)) for cluster in in_force["clusters"]], options.pricing().price)
        ga = IslandGA(arrays, greedy_plan(arrays), seed=seed, config=ROUND_GA)
        if in_force is not None:  # keeping the plan in force, or adding standby clusters to it, moves nobody
            seeds = [_as_assignment(c, column_of, arrays.max_clusters, arrays.size)
                     for c in candidate_plans(in_force, {p.peer_id: p for p in snapshot}, options.workload)]
            ga.inject([a for a in seeds if a is not None])
        loop = asyncio.get_running_loop()
        # ``seen``: every participant whose proposal for this round we read or published, whatever its deadline (adopt)
        state = {"deadline": deadline, "seen": set(seen)}
        # proposals are renewed by their own task: a DHT call that waits on a dead peer's timeout must
        # not keep our proposal from looking alive
        publisher = asyncio.create_task(self._keep_publishing(round_number, state, snapshot, arrays, ga))
        try:
            while get_dht_time() < state["deadline"] - options.settle:
                chunk = min(0.5, state["deadline"] - options.settle - get_dht_time())
                await loop.run_in_executor(None, ga.evolve_for, chunk)
                now = get_dht_time()
                others = await self.read_proposals(round_number, deadline_after=now)
                state["seen"].update(p["peer_id"] for p in others)
                state["deadline"] = followed_deadline(state["deadline"], others, now + options.settle + options.poll)
                if now - joined > self.fresh_within:
                    # a participant that stopped renewing its proposal has died or left: plan without it
                    fresh = {p["peer_id"] for p in others if _fresh(p, time.time(), self.fresh_within)}
                    gone = [column_of[p.peer_id] for p in snapshot
                            if p.peer_id not in fresh | {self.peer_id} and p.peer_id in column_of]
                    if gone and not ga.excluded[gone].all():
                        ga.exclude(gone)
                migrants = [_as_assignment(p["clusters"], column_of, arrays.max_clusters, arrays.size)
                            for p in others if p["peer_id"] != self.peer_id]
                migrants = [m for m in migrants if m is not None]
                if migrants:
                    ga.inject(migrants)
        finally:
            publisher.cancel()
        deadline = state["deadline"]
        await asyncio.sleep(max(0.0, deadline - get_dht_time()) + options.settle)
        await self.adopt(round_number, deadline, in_force, state["seen"])

    async def _keep_publishing(self, round_number: int, state: dict, snapshot: List[Peer], arrays: SwarmArrays,
                               ga: IslandGA) -> None:
        """Renew our best proposal about every half second until the proposals freeze."""
        while get_dht_time() < state["deadline"] - self.options.settle:
            await self.publish(round_number, state["deadline"], snapshot, arrays, ga.best)
            state["seen"].add(self.peer_id)
            await asyncio.sleep(0.5)

    async def publish(self, round_number: int, deadline: float, snapshot: List[Peer], arrays: SwarmArrays,
                      assignment: np.ndarray) -> None:
        clusters = canonical([[snapshot[i].peer_id for i in members]
                              for members in assignment_clusters(arrays, assignment)])
        by_id = {p.peer_id: p for p in snapshot}
        fitness = swarm_throughput([[by_id[i] for i in c] for c in clusters], self.options.workload)
        me = self.announcer.record
        value = RoundProposal(round=round_number, deadline=float(deadline), peer_id=self.peer_id,
                              ram_gb=planning_memory_gb(me), gflops=me["gflops"], bandwidth_mbps=me["bandwidth_mbps"],
                              fitness=float(fitness), clusters=clusters, time=time.time()).dict()
        # the DHT replaces a subkey's value only by one that expires later, so each renewal must; the
        # first replica's ack is enough: waiting for a slow replica would space our renewals out until
        # the others call our proposal stale and plan without us
        await self.node.store(round_key(self.run), value, get_dht_time() + 2 * self.options.round_seconds + 60,
                              subkey=self.subkey, await_all_replicas=False)

    def choose(self, proposals: List[dict], alive: Dict[str, Peer],
               in_force: Optional[dict]) -> Optional[Tuple[float, str, List[List[str]], PricedPlan]]:
        """The best valid proposal as ``(value, hash, clusters, priced plan)``, the value being its throughput over
        the move horizon after moving from the plan ``in_force``, then fewer peers moved: every peer given the same
        inputs picks the same. The plans every island started from (``moves.candidate_plans``) compete too: the
        GA's estimate scores every change of a broken cluster alike, so with layers that download in no time an
        island's best could move six peers where the plan that fills the hole moves one (a soak)."""
        workload, pricing, best, seen = self.options.workload, self.options.pricing(), None, set()
        candidates = [] if in_force is None else candidate_plans(in_force, alive, workload)
        for proposed in [p["clusters"] for p in proposals] + candidates:
            clusters = canonical(proposed)
            members = [i for c in clusters for i in c]
            if not clusters or len(set(members)) != len(members) or not set(members) <= set(alive):
                continue
            groups = [[alive[i] for i in c] for c in clusters]
            digest = plan_hash(clusters)
            # every cluster must be able to train: one that cannot (a member short of RAM, a hostile proposal or a
            # standby filled into a hole) made building the plan fail for every peer, round after round
            if digest in seen or any(cluster_throughput(group, workload) <= 0 for group in groups) or any(
                    len(c) > workload.max_stages for c in clusters):
                continue
            seen.add(digest)
            # claims are recomputed, never trusted; a round-off-sized disagreement is no tie-breaker
            priced = price_plan(clusters, alive, in_force, pricing)
            key = (-float(f"{priced.value:.9e}"), priced.cost.moved, digest)
            if best is None or key < best[0]:
                best = (key, clusters, priced)
        return None if best is None else (-best[0][0], best[0][2], best[1], best[2])

    async def adopt(self, round_number: int, deadline: float, in_force: Optional[dict],
                    seen: Set[str] = frozenset()) -> None:
        """Read the frozen proposals of this round and adopt the best valid one, if it pays back its moves.

        Liveness comes from the proposals themselves, not from peer records: they stop changing before
        the deadline, so every peer decides on the same inputs. Alive means a proposal renewed within
        ``fresh_within`` seconds of the freeze (and not dated ahead of it); capabilities are each participant's own
        signed claim. ``seen``: the participants whose proposals we read during the round; where fewer than half of
        them are alive at its deadline, the round is no decision of theirs (a stranger's deadline that the others
        could not follow in time), and nothing is adopted.
        """
        frozen_at = deadline - self.options.settle
        proposals = [p for p in await self.read_proposals(round_number) if p["deadline"] == deadline]
        alive = {p["peer_id"]: Peer(p["peer_id"], p["ram_gb"], p["gflops"], p["bandwidth_mbps"])
                 for p in proposals if _fresh(p, frozen_at, self.fresh_within)}
        if not decided_by_most(alive, seen):
            self.say(f"round {round_number}: only {len(alive.keys() & seen)} of the {len(seen)} participants we saw "
                     f"have a live proposal at its deadline; keeping the previous plan")
            return
        chosen = self.choose(proposals, alive, in_force)
        if chosen is None:
            fresh, kept = ",".join(sorted(self.names.get(i, i) for i in alive)), "keeping the previous plan"
            self.say(f"round {round_number}: none of {len(proposals)} proposal(s) is valid at the deadline "
                     f"(live participants: {fresh or 'none'}); {kept if round_number > 1 else 'no plan yet'}")
            return
        _, digest, clusters, priced = chosen
        plan, cost = priced.plan, priced.cost
        current = in_force_throughput(in_force, alive, self.options.workload)
        if current is not None and not pays_back(current, plan.swarm_throughput, cost.seconds,
                                                 self.options.move_horizon_s):
            self.triggers.declined()
            self.say(f"round {round_number}: keeping plan round {in_force['round']} ({current:.9e} samples/s): the "
                     f"best plan ({plan.swarm_throughput:.9e}) would move {cost.moved} peer(s) for {cost.seconds:.1f}s "
                     f"and not pay that back within {self.options.move_horizon_s:g}s")
            return
        # a cluster kept from the plan in force keeps its number: its stages train on through the change
        record = PlanRecord(round=round_number, time=time.time(), clusters=kept_cluster_numbers([
            [dict(peer_id=s.peer_id, layers=list(s.layers)) for s in stages] for _, stages in plan.clusters
        ], in_force)).dict()
        await self._follow(record, in_force)
        member_names = ",".join(sorted(self.names.get(i, i) for c in clusters for i in c))
        self.say(f"adopted plan round {round_number} fitness {plan.swarm_throughput:.9e} hash {digest} "
                 f"clusters {len(clusters)} members {member_names}")
        if in_force is not None and cost.moved == 0:
            self.say(f"round {round_number} moves nobody: the clusters it keeps train on")
        elif in_force is not None:
            self.say(f"round {round_number} moves {cost.moved} peer(s): {memory(cost.download_gb)} to download, "
                     f"{cost.seconds:.1f}s without training")
        await self.keep_plan_copy(record, sorted(alive))

    async def _follow(self, record: dict, in_force: Optional[dict]) -> None:
        """Take ``record`` as the plan we follow, replacing ``in_force``: place ourselves by it."""
        self.adopted, self.replaced = record, in_force
        placement = dict(cluster=-1, stage=None, layers=None)
        for number, stages in enumerate(record["clusters"]):
            for index, stage in enumerate(stages):
                if stage["peer_id"] == self.peer_id:
                    placement = dict(cluster=number, stage=index, layers=list(stage["layers"]))
        if self.on_adopt is not None:
            self.on_adopt(record, in_force)  # a training volunteer places itself: it knows what layers it holds
        else:
            self.announcer.update(plan_round=record["round"], plan_digest=plan_digest(record), **placement)
            await self.announcer.renew()
        self.triggers.adopted()

    async def _followed_the_other_side(self, plan: Optional[dict]) -> bool:
        """Two sides of one round (docs/planning.md): where the plan in force is another plan of the round we
        adopted, places us too, and most of the other peers it places follow that very plan (their records name its
        digest: ``reader.followed_by_its_peers``), we follow it; whether we did. An 8-volunteer soak's joiners each
        adopted a plan of their round that only they followed and stood still for two to three minutes: the plan in
        force placed them as well, so nobody weighed them as standbys, and no round opened to merge the two."""
        mine = self.adopted
        if plan is None or mine is None or plan["round"] != mine["round"] or plan["clusters"] == mine["clusters"]:
            return False
        if not any(stage["peer_id"] == self.peer_id for cluster in plan["clusters"] for stage in cluster):
            return False  # we are its standby: we open the round that merges the two sides (``RoundTriggers.reason``)
        if not followed_by_its_peers(plan, self.peers_read, self.peer_id):
            return False
        # where no copy of ours was read, ours would still be in force over it: its peers have not left it
        weighed = adopted_plan(self.plans_read + [mine], self.peers_read, mine["round"])
        if weighed is None or weighed["clusters"] != plan["clusters"]:
            return False
        pricing = self.options.pricing()
        problem = plan_shape_problem(plan, len(pricing.layer_profile[0]), pricing.workload.max_stages)
        if problem is not None:  # nobody's adoption writes such a plan: a majority of identities made it up
            self.say(f"plan round {plan['round']} in force is not the one we adopted, and its peers follow it, but "
                     f"{problem}: keeping ours")
            return False
        self.say(f"plan round {plan['round']} in force is not the one we adopted (two sides of one round), and the "
                 f"peers it places follow it: following it")
        await self._follow(plan, self.replaced)  # both sides' plans replaced the same plan in force
        return True

    async def keep_plan_copy(self, record: dict, participants: List[str]) -> None:
        """Write our copy of the plan (own signed subkey) if we are one of the first :data:`PLAN_COPIES` participants,
        or find no equal copy after ``settle`` s: a plan counts by the records confirming it (docs/planning.md)."""
        if self.peer_id not in participants[:PLAN_COPIES]:
            await asyncio.sleep(self.options.settle)  # the first participants' copies
            if any(p["round"] == record["round"] and p["clusters"] == record["clusters"]
                   for p in await read_plans(self.node, self.run)):
                return
        await self.store_plan_copy(record)

    async def store_plan_copy(self, record: dict) -> bool:
        """Store ``record`` under our own signed subkey of its round; whether any node took it."""
        return bool(await self.node.store(plan_key(self.run), record, get_dht_time() + 3600,
                                          subkey=plan_subkey_prefix(record["round"]) + self.subkey))


# how far ahead of the reader's clock a proposal may be dated: a renewal dated far ahead (a stranger's, 1e11) counted
# as fresh at any freeze
MAX_CLOCK_AHEAD_S = 30.0


def _fresh(proposal: dict, at: float, within: float) -> bool:
    """Whether ``proposal`` was renewed within ``within`` seconds before ``at``, and is not dated ahead of it."""
    return at - within <= proposal["time"] <= at + MAX_CLOCK_AHEAD_S


def deadline_in_reach(proposal: dict, at: float, round_seconds: float) -> bool:
    """Whether a proposal's deadline is at most a round (and a clock's lead) ahead of ``at``: a round's deadline is set
    when it opens, ``round_seconds`` ahead. A stranger's deadline of 1e11 was joined by every peer, which renewed it
    in proposals of its own and never adopted a plan again (a review)."""
    return proposal["deadline"] <= at + round_seconds + MAX_CLOCK_AHEAD_S


def followed_deadline(deadline: float, proposals: Sequence[dict], earliest: float) -> float:
    """A round's deadline as a participant follows it: the earliest of ours and ``proposals``', among those no sooner
    than ``earliest`` (now, the settle and a poll: time to renew our proposal with it). Two peers that open a round
    at once end on one deadline; a stranger's deadline a moment away made every peer stop renewing and adopt from
    its proposal alone."""
    return min([deadline] + [p["deadline"] for p in proposals if p["deadline"] >= earliest])


def decided_by_most(alive: Dict[str, Peer], seen: Set[str]) -> bool:
    """Whether at least half of the participants ``seen`` during a round are ``alive`` at its deadline."""
    return 2 * len(alive.keys() & seen) >= len(seen)


def _as_assignment(clusters: Sequence[Sequence[str]], column_of: Dict[str, int], slots: int,
                   size: int) -> Optional[np.ndarray]:
    """Another peer's plan in our island's columns; its clusters with peers we do not plan for are dropped."""
    assignment = np.full(size, STANDBY, dtype=np.int32)
    kept = 0
    for cluster in clusters:
        if kept < slots and all(i in column_of for i in cluster):
            assignment[[column_of[i] for i in cluster]] = kept
            kept += 1
    return assignment if kept else None
