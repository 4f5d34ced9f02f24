"""Averaging a volunteer's stage with the other clusters, between the stage's optimizer steps.

Over 400 lines because the run's count of rounds (when a round is due, aligning it with the partners', whether
to wait for the round in flight) and the round itself (rings, outer step, the result applied beside training)
share one state: the round in flight, the offset and the averager.

At each step boundary the volunteer's hook (``Volunteer._between_steps``) asks :meth:`StageAveraging.due` whether
a round is due, and if so calls :meth:`StageAveraging.average` with its running worker and the plan it follows: the
rings are the plan's (``averaging.segments``), and the averaged vector is written back into the stage's parameters.
A round never stops training: what fails keeps the local values, is counted, said and noted; one that outlives
every deadline it has is given up at ``round_limit`` (:func:`within_limit`), and the log says where it waited.

Rounds are named on the run's count, not by each cluster's own step (issue 30's item 0; docs/averaging.md,
"Rounds the run counts"): round ``r`` is due once the stage's step less its ``offset`` reaches ``r``, and the next is
``r + averaging_period``. A stage that took round ``r`` at its step ``s`` has offset ``s - r``: a cluster that
runs ahead, or went on training while a round still ran, keeps meeting the others at the same round names. A
stage aligns (:func:`placement.round_to_join`, from its partners' records) when it starts or follows a new plan,
and after a failed round; its record says its ``next_round`` and ``round_offset``.

With a compressing ``averaging_compression`` the rings average pseudo-gradients with error feedback where their
members share the outer state, parameters in float32 where they do not (``optimizers.outer``, ``ring.RingRound``;
docs/averaging.md, "Compressed pseudo-gradients"). Either way the bytes each round put on ring streams are
counted (``bytes_sent_last_round``, ``bytes_sent``, and the record's ``averaging_bytes_sent``).

With the run spec's ``averaging_overlap`` the stage does not stand still for a round: the hook starts it
(:meth:`StageAveraging.begin`) with the values of that step and returns, and at every later step boundary asks
whether it ended (:meth:`StageAveraging.take_finished`). Its result is applied one round late, as Streaming
DiLoCo (arXiv 2501.18512) and eager outer updates do: the result, the same on every member, takes the place of the
values sent, and the steps trained since are kept on top of it. So members agree on each round's result (what
``keep_averaged`` offers joiners, and the outer optimizer's state), not on their live weights.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Collection, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple, TypeVar

import torch

from ravnest_swarm.averaging.averager import MultiRingAverager, RingsChanged, RoundResult, waiting_at
from ravnest_swarm.averaging.mailbox import Expected
from ravnest_swarm.averaging.partners import connect_members
from ravnest_swarm.averaging.ring import NEVER_COMING_LOOK_S, PSEUDO_GRADIENTS, Patience
from ravnest_swarm.averaging.segments import (Ring, element_range, flatten, own_encoded_parts, plan_rings, rings_of,
                                             unflatten_into)
from ravnest_swarm.codecs.codec import RAW, codec, compression_residual
from ravnest_swarm.dashboard.state import AVERAGING_NOTE, REFUSAL_NOTE
from ravnest_swarm.membership.announcer import PeerAnnouncer
from ravnest_swarm.optimizers.outer import OuterOptimizer
from ravnest_swarm.pipeline.stage import StageWorker
from ravnest_swarm.swarm.placement import arrival_wait, round_to_join
from ravnest_swarm.swarm.state_transfer import LayerStateServer, offered_layers

logger = logging.getLogger(__name__)

GONE_CHECK_S = 0.5  # how often a stage waiting for its round in flight looks whether a partner of it is gone
# A round still running after this many ring timeouts is stalled, and given up: a ring waits a timeout for its
# members, as long again as its ``RecordPatience`` says a slow one is on its way, and a timeout for its attempts. A
# soak on the GPT saw one round run 3 minutes beside training, no ring timeout in its log, while its partners failed
# every round they waited for it in.
ROUND_LIMIT_TIMEOUTS, ROUND_LIMIT_MIN_S = 6, 120.0
CANCELLED_ROUND_WAIT_S = 5.0  # how long a cancelled round (we stop, or leave the stage) is given to end


Result = TypeVar("Result")


class RoundStalled(Exception):
    """A round ran past ``StageAveraging.round_limit`` and was given up."""


@dataclass
class Following:
    """What the volunteer trains now: its running worker (None: none), the plan it follows (None: none yet), the
    peers of that plan its planning rounds found gone (their clusters average no more: ``plan_rings``), the peers
    whose records, still valid, say they left gracefully (a ring reads that itself: ``RecordPatience``), and every
    peer of the run whose record it has read (``Expected``'s ``known``)."""

    worker: Optional[StageWorker]
    plan: Optional[dict]
    gone: FrozenSet[str] = frozenset()
    left: FrozenSet[str] = frozenset()
    known: Collection[str] = ()


@dataclass
class InFlightRound:
    """A round that runs while the stage trains on (``averaging_overlap``): whose layers, its step, the values
    we sent, and the task that returns what :meth:`StageAveraging._round` does."""

    worker: StageWorker
    step: int  # the round's name on the run's count
    sent: torch.Tensor
    plan: dict  # the plan it began in
    rings: List[Ring]  # ours in it
    partners: FrozenSet[str]  # the other members of those rings
    task: "asyncio.Task[Optional[Tuple[bool, torch.Tensor]]]"
    started: float  # time.monotonic() at its start: a round given up says how long it ran


@dataclass(frozen=True)
class AppliedRound:
    """A round beside training as a stage took it: what a divergence soon after it says (the lab run saw a stage
    diverge right after applying a compressed round, once in long runs on a loaded machine, cause not found)."""

    step: int  # the round's name on the run's count
    at: int  # the stage's step when it took the result
    moved: float  # the L2 norm of what the round changed of the values we sent
    trained: float  # the L2 norm of what the stage trained while the round ran, kept on top of the result
    parameters: float  # the L2 norm of the parameters after

    def __str__(self) -> str:
        return (f"averaging round {self.step}, taken at step {self.at}, moved the parameters by {self.moved:.3g} (L2) "
                f"beside {self.trained:.3g} trained during it, to a norm of {self.parameters:.3g}")


@dataclass(frozen=True)
class LastRound:
    """A graceful leave's last round (:meth:`StageAveraging.leave_round`): its name on the run's count, our step at
    it, whether every ring of ours averaged, and its partners with the layers the plan gave each: those whose
    records keep the round (``kept_rounds``) on those layers took our work in its average (``hand_over``)."""

    label: int
    step: int
    averaged: bool
    partners: Dict[str, Tuple[int, int]]


class StageAveraging:
    """The averager of one volunteer, and what its rounds counted.

    :param announcer: our record (state ``averaging`` during a round, the counts, the note) and the run's records
    :param state_server: keeps each averaged state, which joiners compare across holders
    :param following: what we train now (:class:`Following`), asked whenever ring messages arrive
    :param layer_sizes: every layer's parameter count (the flat vector's layout)
    :param period: the run's ``averaging_period``
    :param microbatch_size: the run's, to tell how long a member still needs to reach a round
    :param heartbeat: how old a member's record may be
    :param say: a line in our log
    :param note: our record's note
    :param on_rejected: told how many hostile contributions or messages were refused
    :param outer: the run's outer optimizer, its lr and momentum (``optimizers.outer``): what a round's mean becomes
    :param compression: the run's ``averaging_compression``: ``none`` averages parameters in float32, any other
        codec pseudo-gradients with error feedback
    """

    def __init__(self, announcer: PeerAnnouncer, state_server: LayerStateServer, following: Callable[[], Following],
                 layer_sizes: List[int], period: int, microbatch_size: int, heartbeat: float, timeout: float,
                 aggregation: str, say: Callable[[str], None], note: Callable[[str], None],
                 on_rejected: Callable[[int], None], outer: Tuple[str, float, float] = ("average", 1.0, 0.0),
                 compression: str = "none"):
        self.announcer, self.node, self.state_server = announcer, announcer.node, state_server
        self.run, self.peer_id = announcer.run, announcer.peer_id
        self.following, self.layer_sizes = following, layer_sizes
        self.period, self.microbatch_size, self.heartbeat = period, microbatch_size, heartbeat
        self.say, self.note, self.on_rejected = say, note, on_rejected
        self.rounds = self.failures = 0  # rounds in which every ring of ours averaged, and those in which one did not
        self.times: List[Tuple[float, float]] = []  # (start, end) of each round we took part in
        self.bytes_sent_last_round = 0  # put on ring streams in our last round: metadata and parts as encoded
        self.bytes_sent = 0  # in every round so far
        self.compressed_segments = self.fallback_segments = 0  # rings that averaged pseudo-gradients, or parameters
        self.codec = codec(compression)
        self.averager = MultiRingAverager(self.node.routes, self.run, timeout=timeout, compression=self.codec,
                                          aggregation=aggregation)
        self.averager.follow(self._expected)
        self.averager.on_rejected = self._rejected
        self.round_limit = max(ROUND_LIMIT_TIMEOUTS * timeout, ROUND_LIMIT_MIN_S)  # before a round is given up
        self.patience = RecordPatience(announcer, microbatch_size, heartbeat, period, self.round_limit,
                                       gone=lambda: (now := self.following()).gone - now.left)
        self._gone_since: Dict[str, float] = {}  # a gone partner -> when we first saw it so (``_give_up_why``)
        self.outer_spec = outer  # (name, lr, momentum): the run's outer optimizer (optimizers.outer)
        self.outer: Optional[OuterOptimizer] = None
        self._outer_worker: Optional[StageWorker] = None  # whose flat vector ``outer`` holds
        # the last plan and gone peers the averager asked about, their rings, and every member of the plan's rings
        self._plan_rings: Tuple[Optional[dict], FrozenSet[str], List[Ring], FrozenSet[str]] = \
            (None, frozenset(), [], frozenset())
        self.in_flight: Optional[InFlightRound] = None  # averaging_overlap: the round running beside training
        # the round that runs (beside training or not) and its rings: their members' messages are taken for it
        # though gone peers change the rings of the plan since (a leaver's ring goes on without it)
        self._round_rings: Optional[Tuple[int, List[Ring]]] = None
        self._last_applied: Optional[Tuple[StageWorker, AppliedRound]] = None  # the last such round, and whose
        # the run's count of rounds (round_to_join): the next round we take part in, our step less the round step,
        # and the worker and plan they were aligned for (None: align at the next step boundary)
        self.next_round: Optional[int] = None
        self.offset = 0
        self._aligned: Optional[Tuple[StageWorker, Optional[dict]]] = None
        self._aligning: Optional[asyncio.Task] = None
        # our count said in our record at once, not at the next heartbeat (:meth:`_say_count`)
        self._said_next_round: Optional[int] = None
        # a round already due when our alignment ended (the read took a while as we trained on): it starts late at
        # our next boundary without moving our count (``_started``)
        self._due_at_alignment: Optional[int] = None
        # our record renewed now, not at the next heartbeat (:meth:`_renew_soon`): a new count, a kept round
        self._record_changed = False
        self._renewing: Optional[asyncio.Task] = None

    async def start(self) -> None:
        await self.averager.start()

    async def shutdown(self) -> None:
        cancelled = self.cancel()
        if cancelled is not None:
            await asyncio.gather(cancelled, return_exceptions=True)
        for task in (self._aligning, self._renewing):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.averager.shutdown()

    def outer_state(self, worker: StageWorker) -> Dict[str, torch.Tensor]:
        """``worker``'s outer state, what its checkpoint keeps (``OuterOptimizer.state_tensors``); empty before its
        first round, or when our outer state is another worker's."""
        return self.outer.state_tensors() if self._outer_worker is worker and self.outer is not None else {}

    def resume_outer(self, worker: StageWorker, state: Dict[str, torch.Tensor]) -> bool:
        """``worker`` goes on with the outer state its checkpoint kept (anchor, momentum, error), so that its first
        round compresses again where its ring's members kept the same; whether it fits the run's outer optimizer
        (else the stage's first round starts it anew, as a new stage's)."""
        outer = OuterOptimizer(*self.outer_spec)
        if not outer.restore(state):
            return False
        self._outer_worker, self.outer = worker, outer
        return True

    def due(self, worker: StageWorker, plan: dict, step: int) -> Optional[int]:
        """The round due at ``worker``'s ``step`` in ``plan`` (its name on the run's count), or None: none due, a
        round still runs beside training (the stage trains on, and takes the next round once it ended), or our
        count is being aligned with our partners' (started here, beside training, for a new worker or plan)."""
        if self.in_flight is not None:
            # aligned once it ended, not now: until then our record names the round in flight (``_started``), and a
            # partner that aligns meanwhile joins it. Aligned while it ran, our record named the next one, and a
            # stalled round's partners failed every round they waited for us in (the GPT soak's 3-minute stall)
            return None
        if self._aligned is None or self._aligned[0] is not worker or self._aligned[1] is not plan:
            if self._aligning is None or self._aligning.done():
                self._aligning = asyncio.create_task(self._align(worker, plan))
            return None
        if self.in_flight is not None or not self._reached(step):
            return None
        return self.next_round

    async def _align(self, worker: StageWorker, plan: dict) -> None:
        """Our count of rounds for ``worker`` in ``plan``: the round our partners take next, read from their
        records (:func:`round_to_join`); a read that fails keeps ours, or starts it at the step's next multiple.
        Counted from our step when the alignment began: the read takes a moment while we train on (about 200 steps/s
        on mlp-digits), and of two clusters resumed at step 180 one counted to round 200, the other (its read done
        past step 200) to 220: the first failed round 200 alone, which cost it its outer state (a CI run's
        ``test_two_sigkilled``, both runs). A round passed meanwhile is then due at once (:meth:`due`)."""
        step = worker.version
        partners = sorted(self.partners(plan))
        records: List[Dict] = []
        if partners:
            try:
                records = [r for r in await self.announcer.read_peers(peer_ids=partners) if r["peer_id"] in partners]
            except Exception as e:  # no news of them: our own count, and the rounds tell whether it meets theirs
                logger.warning(f"reading our ring partners' records to align our rounds failed: {e}")
        if self.following().worker is not worker:
            return  # the worker stopped meanwhile
        own = None
        if self.next_round is not None:
            same_worker = self._aligned is not None and self._aligned[0] is worker
            own = (self.next_round, self.offset if same_worker else None)
        self.next_round, self.offset = round_to_join(step, self.period, own, records)
        self._due_at_alignment = self.next_round if worker.version - self.offset >= self.next_round else None
        self._aligned = (worker, plan)
        self._say_count(next_round=self.next_round, round_offset=self.offset)

    def _say_count(self, **count) -> None:
        """Our record's ``next_round`` (and ``round_offset``), renewed at once: a partner that aligns reads them,
        and a record a heartbeat old names a round that is over for us, which costs both sides a failed round (the
        NAT lab's four clusters had 12 s between their plan and the run's end, and one missed every round). Once a
        round, where the round we name changes: a round's start names the one we named already."""
        self.announcer.update(**count)
        if count["next_round"] == self._said_next_round:
            return  # the heartbeat says the rest
        self._said_next_round = count["next_round"]
        self._renew_soon()

    def _renew_soon(self) -> None:
        """Renew our record now (once more where it changes during a renewal), not at the next heartbeat."""
        self._record_changed = True
        if self._renewing is None or self._renewing.done():
            self._renewing = asyncio.create_task(self._renew_while_changed())

    async def _renew_while_changed(self) -> None:
        while self._record_changed:  # a change during a renewal is renewed after it
            self._record_changed = False
            await self.announcer.renew()

    def _started(self, label: int, step: int) -> None:
        """Round ``label`` starts at our ``step``: the next is a period later on the run's count. Until it ends, our
        record names this one: a partner that aligns now joins it (we wait for it there), not the one after. A round
        that was due when our alignment ended keeps our count's offset: it is late by the read's time, not behind (an
        offset moved so left clusters in step a few steps apart, and their checkpoints at one step held different
        rounds' outer states)."""
        if label != self._due_at_alignment:
            self.offset = step - label
        self._due_at_alignment, self.next_round = None, label + self.period
        self.averager.enter(label)  # before its rings start (their members are dialled first)
        self._say_count(next_round=label, round_offset=self.offset)

    async def average(self, worker: StageWorker, plan: dict, step: int, label: int) -> bool:
        """Round ``label`` of ``worker``'s layers (at its ``step``) in ``plan``'s rings, the stage standing still
        meanwhile; whether every ring of ours averaged. ``rounds`` counts those, ``failures`` those in which one did
        not (its segment kept the local values), and the record's note says why; a round we have no ring in is
        neither."""
        self._started(label, step)
        parameters = list(worker.module.parameters())
        local = flatten([p.detach().cpu() for p in parameters])  # rings read and write host memory
        outcome = await self._round(worker, plan, label, local)
        if outcome is None:
            return False
        ok, values = outcome
        self._write(worker, label, ok, values)
        return ok

    def begin(self, worker: StageWorker, plan: dict, step: int, label: int) -> None:
        """Start round ``label`` of ``worker``'s layers as they are now (at its ``step``), and return: the stage
        trains on meanwhile (the run spec's ``averaging_overlap``). :meth:`take_finished`, called at each step
        boundary, applies it once it ended; until then no other round is due (:meth:`due`). The stage waits for it
        only where :meth:`holds_up` says: a cluster ahead of the others trains on and meets them at the next
        round's name."""
        rings = self._rings(plan)
        partners = self._partners_in(rings)
        if not partners:
            return
        self._started(label, step)
        self._gone_since = {}  # a partner gone in an earlier round and back since is given this one's grace anew
        sent = flatten([p.detach().cpu() for p in worker.module.parameters()])
        self.in_flight = InFlightRound(worker, label, sent, plan, rings, partners, asyncio.create_task(
            self._round(worker, plan, label, sent.clone(), beside_training=True, rings=rings)), time.monotonic())

    def _reached(self, step: int) -> bool:
        """Whether our ``step``, on the run's count of rounds, has reached our next round."""
        return self.next_round is not None and step - self.offset >= self.next_round

    async def leave_round(self, worker: StageWorker, plan: dict, step: int) -> Optional[LastRound]:
        """A graceful leave's last round (``Volunteer._train_to_round``), at a step boundary of ``worker``: a round
        beside training (``averaging_overlap``) that ended is applied; once our next round is due, the one still in
        flight is waited for, then the due one taken standing still, so the values it sends hold every step we
        trained. None before it is due."""
        if self.in_flight is not None:
            if not self._reached(step):
                self.take_finished(worker)
                return None
            await self.finish_in_flight(worker)
        label = self.due(worker, plan, step)
        if label is None:
            return None
        partners = self.partners(plan)
        layers = {stage["peer_id"]: (stage["layers"][0], stage["layers"][1]) for cluster in plan["clusters"]
                  for stage in cluster if stage["peer_id"] in partners}
        return LastRound(label, step, await self.average(worker, plan, step, label), layers)

    def holds_up(self, worker: StageWorker, step: int) -> bool:
        """Whether ``worker`` waits at this boundary for the round still in flight: our next round is due, and
        every member of every ring of that round arrived, so it is moving its parts, not waiting for a partner
        behind us. Clusters in step then keep one count of rounds with their steps (offset 0, all of a cluster's
        stages alike), as before the run's count; a cluster ahead, whose round waits for a slower one, trains on
        instead and meets it at the next round's name."""
        in_flight = self.in_flight
        if in_flight is None or in_flight.task.done() or in_flight.worker is not worker or not self._reached(step):
            return False
        counted = self._counted_in(in_flight)
        return all(arrived for member, arrived in counted.items() if member != self.peer_id)

    async def finish_in_flight(self, worker: StageWorker) -> Optional[bool]:
        """Wait for the round in flight to end, and apply it (:meth:`take_finished`); a round given up meanwhile
        (:meth:`_give_up_why`) is given up at once."""
        while self.in_flight is not None and not self.in_flight.task.done():
            await asyncio.wait({self.in_flight.task}, timeout=GONE_CHECK_S)
            if self.in_flight is not None and self._give_up_why(self.in_flight) is not None:
                break
        return self.take_finished(worker)

    def _give_up_why(self, in_flight: InFlightRound) -> Optional[str]:
        """Why the round in flight is given up now, not at its rings' timeout, or None.

        A partner our planning rounds found gone, while a ring of ours that has not ended still counts it, a while
        after (``gone_grace``): the ring votes it out (``RecordPatience.gone``) at its next look where it never came,
        and once its attempt failed, within a ring timeout more, where it reached the ring and crashed amid the round
        (``RingRound._gone_amid``); it goes on without it once the other members found it gone too, and a ring of two
        fails. Given up at once, a crash before the round failed it at every partner, and one amid it too. A partner
        that left gracefully is no reason either: the ring reads its record, which says so, within NEVER_COMING_LOOK_S
        and averages without it (given up, that round failed at every partner of each graceful leave: planning finds a
        leaver gone before the ring's first look, and the plan that drops its cluster comes a round's length later).

        A plan adopted since that changed our rings: peers that begin the round after adopting it look for us in the
        new rings, while ours wait in the old ones (in the NAT lab, 2 -> 4 clusters made one cluster fail the round
        in its old ring of two and the three others wait the ring's 20 s for it in the new). Given up, it is over
        here: a member of the new rings that waits for us in it is told so at once.

        None once its rings ended (the task then applies the outer step): nothing is left to give up."""
        if in_flight.step <= self.averager.last_finished_step:
            return None
        now, at = self.following(), time.monotonic()
        self._gone_since = {peer: self._gone_since.get(peer, at) for peer in now.gone - now.left}
        counted = self._counted_in(in_flight)
        gone = [peer for peer in in_flight.partners & self._gone_since.keys() if peer in counted and
                at - self._gone_since[peer] >= self.gone_grace + (self.averager.timeout if counted[peer] else 0.0)]
        if gone:
            return f"partner(s) {', '.join(sorted(p[-8:] for p in gone))} gone"
        if now.plan is not None and now.plan is not in_flight.plan and \
                without(self._rings(now.plan), now.left) != without(in_flight.rings, now.left):
            return f"plan round {now.plan.get('round')} changed its rings"
        return None

    def _counted_in(self, in_flight: InFlightRound) -> Dict[str, bool]:
        """The members that a ring of the round in flight, not ended yet, still counts (not voted out, nor
        withdrawn), each with whether it reached such a ring. Reads ring states, never creates one: a look just after
        the round finished (its task still applying the outer step) brought its states back, unsettled, and gave up
        the round its rings had averaged (a review)."""
        counted: Dict[str, bool] = {}
        if in_flight.step <= self.averager.last_finished_step:
            return counted  # its rings ended and their states went; the task applies its outer step
        for ring in in_flight.rings:
            state = self.averager.mailbox.ring_state_if_any(in_flight.step, ring.index)
            if state is None:  # the ring has not started: every member counts, none arrived
                counted.update({member: counted.get(member, False) for member in ring.members})
                continue
            if state.settled:
                continue
            view = state.view(ring.members)
            for member in ring.members:
                if member not in view.excluded and member not in view.withdrawn:
                    counted[member] = counted.get(member, False) or member in state.arrived
        return counted

    @property
    def gone_grace(self) -> float:
        """Seconds a round in flight goes on after our planning found a partner of it gone: its rings' next look,
        and the other members' planning polls to find it gone too and vote."""
        return 2 * NEVER_COMING_LOOK_S + 2 * self.heartbeat

    def partners(self, plan: dict) -> FrozenSet[str]:
        """The other members of our rings in ``plan``, its clusters with a gone peer left out (``plan_rings``)."""
        return self._partners_in(self._rings(plan))

    def _rings(self, plan: dict) -> List[Ring]:
        """Our rings in ``plan``, its clusters with a gone peer left out (``plan_rings``)."""
        return rings_of(self.peer_id, plan_rings(plan, self.layer_sizes, self.following().gone))

    def _partners_in(self, rings: List[Ring]) -> FrozenSet[str]:
        return frozenset(member for ring in rings for member in ring.members) - {self.peer_id}

    def take_finished(self, worker: StageWorker) -> Optional[bool]:
        """At a step boundary of ``worker``: the round in flight, once it ended, applied one round late. Its
        result (the same on every member) takes the place of the values we sent, and what we trained since
        is kept on top of it: parameters = result + (now - sent). None: no round ended (or it ended for
        another worker, whose layers we no longer train); else whether every ring of ours averaged. A round a
        partner of which our planning rounds found gone, or whose rings a plan adopted since changed, is given up at
        once, not at its rings' timeout (:meth:`_give_up_why`)."""
        if self.in_flight is None:
            return None
        why = None if self.in_flight.task.done() else self._give_up_why(self.in_flight)
        if why is not None:
            given_up, self.in_flight = self.in_flight, None
            given_up.task.cancel()  # it ends by itself; averaging never stops training
            # and may yet take its outer step on the outer state it was given, should it outlast the cancel's wait:
            # that state is left to it, and our next round starts ours anew (as after a stalled round)
            self._outer_worker = self.outer = None
            # how long it ran says whether it was stalled (a soak saw one run 3 minutes, its ring's other members
            # failing every round meanwhile)
            self._failed(given_up.step, f"given up after {time.monotonic() - given_up.started:.0f}s: {why}")
            return False
        if not self.in_flight.task.done():
            return None
        finished, self.in_flight = self.in_flight, None
        try:
            outcome = finished.task.result()
        except (asyncio.CancelledError, Exception) as e:  # averaging must never stop training
            self._failed(finished.step, f"{type(e).__name__}: {e}")
            outcome = None
        applied: Optional[bool] = None
        if outcome is not None and finished.worker is worker:
            applied, values = outcome
            parameters = list(worker.module.parameters())
            trained = flatten([p.detach().cpu() for p in parameters]) - finished.sent
            self._write(worker, finished.step, applied, values)
            if applied:
                # the round's kept state said now: a leaver that averaged with us counts us once it reads it, and
                # our round's own renewal came before this step boundary
                self._renew_soon()
            taken = values + trained
            with torch.no_grad():
                unflatten_into(taken, parameters)
            self._last_applied = (worker, AppliedRound(finished.step, worker.version,
                                                       float((values - finished.sent).norm()), float(trained.norm()),
                                                       float(taken.norm())))
        return applied

    def taken_within_period(self, worker: StageWorker) -> Optional[AppliedRound]:
        """The round beside training that ``worker`` took within an averaging period before its step, if any."""
        if self._last_applied is None or self._last_applied[0] is not worker:
            return None
        applied = self._last_applied[1]
        return applied if 0 <= worker.version - applied.at <= self.period else None

    async def _round(self, worker: StageWorker, plan: dict, step: int, local: torch.Tensor,
                     beside_training: bool = False,
                     rings: Optional[List[Ring]] = None) -> Optional[Tuple[bool, torch.Tensor]]:
        """The rings of one round over ``local`` (our flat values, written in place), then the outer step: whether
        every ring of ours averaged, and the values the stage takes. None: no ring of ours in this round. Our
        record's state says ``averaging`` while the stage stands still for it, not ``beside_training``. ``rings``:
        those the round in flight was begun with (what ``_give_up_why`` reads), else ours in ``plan`` now."""
        state = "training" if beside_training else "averaging"
        rings = self._rings(plan) if rings is None else rings
        if not rings or step <= self.averager.last_finished_step or self._partners_in(rings) <= self.patience.finished:
            # a peer moved to a slot that is behind the rounds it already took part in skips ahead; a cluster behind
            # the others at the run's end has nobody left to average with
            self._say_count(next_round=self.next_round)
            return None
        self.announcer.update(state=state)
        started = time.time()  # wall clock, as the worker's report: a bench lines both up across processes
        local_start, _ = element_range(self.layer_sizes, (worker.start_layer, worker.end_layer))
        if self._outer_worker is not worker:  # a new stage: its outer state starts at its first round's mean
            self._outer_worker, self.outer = worker, OuterOptimizer(*self.outer_spec)
        sent_before = self.averager.sender.bytes_sent

        async def rings_and_outer_step() -> Tuple[RoundResult, torch.Tensor]:
            # p2pd's own routing cannot find partners whose addresses are not public (a LAN, the network lab's):
            # dial them at the addresses their records announce, as the pipeline does for its neighbours
            await connect_members(self.node, self.run, rings, self.announcer.bucket_counts_in_use())
            return await outer_round(self.averager, self.outer, step, local, local_start, rings, self.patience)

        held = self._round_rings = (step, rings)  # its messages keep these rings while it runs (``_expected``)
        try:
            result, local = await within_limit(rings_and_outer_step(), self.round_limit, step)
        except RoundStalled:  # its outer state is left to it: the next round starts ours anew, as after any failure
            self._outer_worker = self.outer = None
            self._failed(step, f"stalled: still running after {self.round_limit:.0f}s (given up; the log says where "
                               f"it waited)")
            self.announcer.update(state="training")
            return None
        except Exception as e:  # averaging must never stop training: keep the local values, say why
            self._failed(step, str(e) if isinstance(e, RingsChanged) else f"{type(e).__name__}: {e}")
            self.announcer.update(state="training")
            return None
        finally:
            if self._round_rings is held:  # not a later round's (one given up may end after the next began)
                self._round_rings = None
            self.times.append((started, time.time()))  # a failed round costs its time too
            self._say_count(next_round=self.next_round)  # this one is over: partners align to the next
            self.bytes_sent_last_round = self.averager.sender.bytes_sent - sent_before
            self.bytes_sent += self.bytes_sent_last_round
        if self.codec is not RAW:
            modes = [segment.mode for segment in result.segments if segment.status == "ok"]
            self.compressed_segments += modes.count(PSEUDO_GRADIENTS)
            self.fallback_segments += len(modes) - modes.count(PSEUDO_GRADIENTS)
        if result.rejected:
            self.on_rejected(len(result.rejected))
            first = result.rejected[0]
            self.note(f"{REFUSAL_NOTE} in ring {first['ring']} at step {step} the contribution of "
                      f"{first['peer'][-8:]}: {first['reason']}")
        failed = result.failed
        if failed:
            self._failed(step, f"ring {failed[0].index} {failed[0].status}: {failed[0].detail}", result.summary())
        elif any(segment.status == "ok" for segment in result.segments):
            self.rounds += 1  # a ring whose partners all finished the run had nobody to average with: no failure
        else:
            self.say(f"averaging at step {step}: nobody left to average with ({result.summary()})")
        self.announcer.update(state="training", averaging_rounds=self.rounds, averaging_failures=self.failures,
                              averaging_bytes_sent=self.bytes_sent)
        return result.ok, local

    def _write(self, worker: StageWorker, step: int, ok: bool, values: torch.Tensor) -> None:
        """``values`` into the stage's parameters; a round in which every ring of ours averaged is kept as what a
        joiner compares across holders (every member of our rings now holds it)."""
        with torch.no_grad():
            unflatten_into(values, list(worker.module.parameters()))
        if ok:
            self.state_server.keep_averaged(offered_layers(worker.start_layer, worker.module, step))
            self.announcer.update(kept_rounds=self.state_server.kept_rounds(worker.start_layer, worker.end_layer))

    def cancel(self) -> Optional[asyncio.Task]:
        """Stop the round in flight (we leave, or stop training: its result would be for layers we no longer
        train); its task, which ends by itself."""
        if self.in_flight is None:
            return None
        task, self.in_flight = self.in_flight.task, None
        task.cancel()
        return task

    def _expected(self) -> Optional[Expected]:
        """What ring messages the averager takes now: from the members of our rings in the plan we follow, for
        rounds from the one we take part in (in flight, else our next) up to two periods past it or our worker's
        step (a faster cluster waits at its next round, or goes on to the one after if that round failed); none
        while we train no stage. A round before ours is over here: rounds never go back, and a partner that waits
        in one (two clusters that aligned at once, each before the other's record said its count) is told so at
        once, ends it alone and aligns with us, instead of each waiting in a round of its own until the ring's
        timeout (CI saw two clusters train a whole run so, none of their rounds ending). Until our count is
        aligned for this worker, every round we have not finished: we do not know yet where the run is."""
        now = self.following()
        if now.worker is None or now.plan is None:
            return None
        if self._plan_rings[0] is not now.plan or self._plan_rings[1] != now.gone:
            # every member of the plan's rings, gone clusters too: ``Expected`` leaves out those our rings do not
            # have (a partner that has not found them gone yet votes against them, and we agree)
            everyone: FrozenSet[str] = frozenset()
            if now.gone:
                whole_plan = plan_rings(now.plan, self.layer_sizes, frozenset())
                everyone = frozenset(member for ring in whole_plan for member in ring.members)
            self._plan_rings = (now.plan, now.gone, plan_rings(now.plan, self.layer_sizes, now.gone), everyone)
        at = now.worker.version - self.offset  # where we are on the run's count of rounds
        first = self.averager.last_finished_step + 1
        if self.averager.mailbox.entered_step >= first:  # a round of ours runs, beside training or not
            first = self.averager.mailbox.entered_step
        elif self._aligned is not None and self._aligned[0] is now.worker and self.next_round is not None:
            first = max(first, self.next_round)
        aligned = self._aligned is not None and self._aligned[0] is now.worker and self._aligned[1] is now.plan
        return Expected(self._plan_rings[2], self.peer_id, first, max(at, self.next_round or 0) + 2 * self.period,
                        left_out=self._plan_rings[3], held=self._round_rings, known=now.known, aligned=aligned)

    def _rejected(self, reason: str) -> None:
        """The averager refused hostile input: our record counts it and its note says what it was."""
        self.on_rejected(1)
        self.note(f"{REFUSAL_NOTE} {reason}")

    def _failed(self, step: int, cause: str, summary: Optional[str] = None) -> None:
        """Round ``step`` failed: counted, said, noted; our count of rounds is aligned again with our partners'
        before the next (a cluster that fell behind the others' count catches up in one round)."""
        self.failures += 1
        if self._aligned is not None:
            self._aligned = (self._aligned[0], None)  # aligned again at the next boundary, the worker's offset kept
        self.say(f"averaging at step {step} failed: {summary or cause}")
        self.announcer.update(averaging_failures=self.failures)
        self.note(f"{AVERAGING_NOTE} step {step}: {cause}")


class RecordPatience:
    """A ring's patience (``ring.Patience``) from the missing members' peer records: how long they still need to
    reach the round (:func:`arrival_wait`), and whether one of them finished the run or left its stage (its record
    says ``done`` or ``leaving``). One read serves every ring of the round that asks within ``NEVER_COMING_LOOK_S``."""

    def __init__(self, announcer: PeerAnnouncer, microbatch_size: int, heartbeat: float, period: int,
                 limit: float = math.inf, gone: Callable[[], FrozenSet[str]] = frozenset):
        self.announcer, self.microbatch_size, self._gone = announcer, microbatch_size, gone
        self.heartbeat, self.period, self.limit = heartbeat, period, limit  # limit: a round's, in seconds
        self._reading = asyncio.Lock()
        self._records: Dict[str, Dict] = {}
        self._read_at = -math.inf
        self.finished: Set[str] = set()  # members whose records said ``done``: they average no more in this run

    async def _read(self, step: int, missing: List[str], fresh_within: float) -> Dict[str, Dict]:
        """Their records, read again unless every one was read within ``fresh_within`` s; a read that misses one
        of them is tried once more."""
        async with self._reading:
            if time.monotonic() - self._read_at > fresh_within or not all(m in self._records for m in missing):
                records: Dict[str, Dict] = {}
                for _ in range(2):
                    try:
                        # a read that hangs must not hold the ring past its limit
                        async with asyncio.timeout(self.heartbeat):
                            records.update({p["peer_id"]: p for p in await self.announcer.read_peers(peer_ids=missing)})
                    except Exception as e:  # no news of the member is no sign that it is coming
                        logger.warning(f"reading the peer records for averaging round {step} failed: "
                                       f"{type(e).__name__}: {e}")
                    if all(member in records for member in missing):
                        break
                self._records, self._read_at = records, time.monotonic()
            return {m: self._records[m] for m in missing if m in self._records}

    async def more(self, step: int, missing: List[str]) -> float:
        return arrival_wait(step, missing, await self._read(step, missing, 0.0), self.microbatch_size,
                            self.heartbeat, self.period, self.limit)

    def gone(self, missing: List[str]) -> List[str]:
        """Those of ``missing`` our planning rounds found gone (their records expired and stayed away)."""
        found = self._gone()
        return [member for member in missing if member in found]

    async def never_coming(self, step: int, missing: List[str]) -> List[str]:
        records = await self._read(step, missing, NEVER_COMING_LOOK_S / 2)
        ended = {m: f"is {records[m]['state']}" for m in missing
                 if m in records and records[m]["state"] in ("done", "leaving")}
        self.finished.update(m for m in ended if records[m]["state"] == "done")
        # a graceful leave stands still after its last round (``Volunteer._train_to_round``): a round after it never
        # sees it. 0 is a leaver that did not know its next round yet, and takes the first one due
        ended.update({m: f"leaves after round {records[m]['leaving_after_round']}" for m in missing
                      if m in records and m not in ended and 0 < (records[m].get("leaving_after_round") or 0) < step})
        if ended:
            logger.info(f"averaging round {step}: {', '.join(f'{m[-8:]} {why}' for m, why in ended.items())} "
                        f"(its record): the ring waits for it no longer")
        return list(ended)


def without(rings: Sequence[Ring], peers: FrozenSet[str]) -> List[Tuple[int, int, int, Tuple[str, ...]]]:
    """``rings`` with ``peers`` left out of their members: what a ring that withdrew them averages."""
    return [(ring.index, ring.start, ring.end, tuple(m for m in ring.members if m not in peers)) for ring in rings]


async def outer_round(averager: MultiRingAverager, outer: OuterOptimizer, step: int, local: torch.Tensor,
                      local_start: int, rings: Sequence[Ring],
                      patience: Optional[Patience] = None) -> Tuple[RoundResult, torch.Tensor]:
    """One averaging round of a stage's flat parameters ``local`` (from element ``local_start``) in ``rings``, and
    the outer step of ``outer`` (the stage's outer state) on what it gave: the round, and the stage's parameters.

    With the averager's codec ``none`` the rings average parameters and ``outer.step`` takes their mean, as it
    always did. With a compressing one, each ring averages pseudo-gradients where its members share our outer
    state, parameters in float32 where they do not (``ring.RingRound``), and ``outer.step_segments`` steps each
    segment by what its ring averaged, keeping what the codec dropped of ours as the next round's error.
    A round in which some ring failed keeps the local values there (the others' means elsewhere) and forgets the
    outer state: the next round averages parameters, and every member of a ring ends it on the same values.
    """
    compressing = averager.compression is not RAW
    bounds = [(ring.start - local_start, ring.end - local_start) for ring in rings]
    pseudo_gradient = residual = anchors = None
    if compressing:
        anchors = {ring.index: outer.digest(lo, hi) for ring, (lo, hi) in zip(rings, bounds)}
        if outer.has_anchor(local):
            pseudo_gradient = outer.pseudo_gradient(local)
            # what the codec drops of the values we send on their own (the ring sends the rest summed with others'),
            # taken before the ring overwrites them with the mean; a ring attempt that leaves a member out moves
            # our chunk, and that round's error is of the chunk we would have sent with all of them
            parts = [(lo + first, lo + last) for ring, (lo, hi) in zip(rings, bounds)
                     for first, last in own_encoded_parts(hi - lo, ring.members, averager.peer_id,
                                                          max(1, averager.part_bytes // 4), averager.robust)]
            residual = compression_residual(pseudo_gradient, averager.compression, parts)
    result = await averager.average(step, local, local_start, rings, patience, pseudo_gradient, anchors)
    compressed = [(segment.start - local_start, segment.end - local_start) for segment in result.segments
                  if segment.status == "ok" and segment.mode == PSEUDO_GRADIENTS]
    if result.ok and compressing:
        return result, outer.step_segments(local, pseudo_gradient, compressed, residual)
    if result.ok:
        return result, outer.step(local)  # every ring of ours gave the mean: the outer step takes it
    if compressed:
        # a ring that averaged pseudo-gradients takes the outer step its other members take (theirs may all have
        # completed): a plain average's step here left a nesterov ring's members on different values
        local = outer.step_segments(local, pseudo_gradient, compressed, residual)
    outer.forget()  # some segments kept their own values: the next round starts the outer state anew
    return result, local


async def within_limit(work: Awaitable[Result], limit: float, step: int) -> Result:
    """``work`` (round ``step``'s rings and outer step), or :class:`RoundStalled` once it ran ``limit`` seconds.

    Every wait of a round has a deadline, so a round that outlives them all waits on something that does not end
    when cancelled: it is cancelled and left to end by itself, not waited for (averaging never holds training),
    and the log says where its tasks wait. Cancelled itself (we stop, or leave the stage), it cancels ``work`` and
    gives it a moment to close its streams."""
    task = asyncio.ensure_future(work)
    # whenever it ends, its outcome is retrieved: one given up here may end long after, with nobody to read it
    task.add_done_callback(lambda ended: ended.cancelled() or ended.exception())
    try:
        done, _ = await asyncio.wait({task}, timeout=limit)
    except asyncio.CancelledError:
        task.cancel()
        await asyncio.wait({task}, timeout=CANCELLED_ROUND_WAIT_S)
        raise
    if done:
        return task.result()
    where = waiting_at()
    task.cancel()
    logger.warning(f"averaging round {step} stalled: still running after {limit:g}s, given up; its tasks wait "
                   f"at {where}")
    raise RoundStalled(f"round {step} still running after {limit:g}s")
