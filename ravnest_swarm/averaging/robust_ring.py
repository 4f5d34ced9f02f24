"""A ring attempt that aggregates robustly: every member sends each chunk straight to its owner, the owner
aggregates the members' values (``robust.py``) instead of summing them, and the ring gathers as before.

A ring's reduce-scatter cannot do this: member i receives a partial *sum* of the others' values, and no robust
aggregate can be computed from sums. So the reduce phase is an all-to-all scatter (as in a butterfly
all-reduce): member i owns chunk (i + 1) mod C, as after a ring's reduce-scatter, and receives that chunk from
each of the C - 1 others directly (one ``reduce`` message, position 0, from each: the mailbox keys it by sender).
With two members it sends exactly what a ring's reduce-scatter sends.

The cost, beside the mean (``docs/averaging.md``, measured in ``bench averaging --robust``):

* the same bytes per member ((C-1)/C of the segment out, as much in), but over C - 1 streams to C - 1 peers at
  once instead of one stream to one neighbour;
* the owner holds the C - 1 received copies of its chunk (another (C-1)/C of the segment in memory) and
  aggregates a part only once every member's values for it arrived, so the slowest sender paces the part;
* the aggregate itself: a sort of C values per coordinate (trimmed mean), or about ten passes over a part
  (CenteredClip), on the owner's CPU.

Every received chunk passes the same checks as in the ring (finite, the right size, within ``max_scale`` of a
single contribution at our scale): a value refused names its sender exactly, since nobody forwards another's.

Chunk owners checked (as BTARD, arXiv 2106.11257, checks its aggregators; ``trimmed_mean``, which is computed
per coordinate, with the ``none`` codec, whose values arrive exactly as sent). An owner could send back any
aggregate of its chunk. So once its gather is complete, each member picks ``PROBED_PER_CHUNK`` coordinates of
every chunk it does not own, at random (its own randomness, drawn only now: no owner knows them when it
aggregates), and asks every other member (a ``probe``) for its own values there and, the owner, for every
member's values it aggregated there. The owner is caught, first-hand, when the row it reports for us is not
what we sent, or when the aggregate of the rows it reports is not what it gathered to us: we vote against it
(``ContributionRejected``: the ring's majority rule, ``ring.py``) and, once a majority caught it, the others
run the ring again without it. When the owner's row for a third member differs from that member's own answer,
one of the two lies and we cannot tell which: we keep our local values for that chunk. Each member stays in
its attempt until every other member's probe was answered (its values are the segment's until it completes).
An owner that alters a fraction f of its chunk escapes one member's check with probability (1 - f)^8; the
check costs each member one small message to each other member.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import random
import time
from typing import Callable, Coroutine, Dict, List, Set

import torch
from hivemind.p2p import P2PHandlerError

from ravnest_swarm.averaging.mailbox import NOT_IN_ATTEMPT, MessageKey
from ravnest_swarm.averaging.ring import (ContributionRejected, Progress, RingAttempt, RingDisagreement, RingRound,
                                          RingStep, past_round_or)
from ravnest_swarm.averaging.robust import AGGREGATIONS, MEAN, PER_COORDINATE, ROBUST_AGGREGATES
from ravnest_swarm.averaging.wire import (PROBED_PER_CHUNK, REDUCE, Outbox, RingPart, RingProbe, RingReply, decode_part,
                                          serialize_part)
from ravnest_swarm.codecs.codec import RAW

logger = logging.getLogger(__name__)


def attempt_for(aggregation: str) -> Callable[[RingRound, List[str], float], RingAttempt]:
    """How a ring's attempts reduce for the run spec's ``aggregation``: the plain ring for the mean."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, not {aggregation!r}")
    if aggregation == MEAN:
        return RingAttempt
    return functools.partial(RobustRingAttempt, aggregate=ROBUST_AGGREGATES[aggregation],
                             checked=aggregation in PER_COORDINATE)


class RobustRingAttempt(RingAttempt):
    """All-to-all scatter of every chunk to its owner, a robust aggregate there, then the ring's all-gather.

    The gather steps are the ring's own (``self.steps[count - 1:]``); the reduce steps are unused but for the
    mark of the last one, which the aggregate advances, so the first gather step waits on it as it would on the
    ring's last reduce step.
    """

    def __init__(self, ring_round: RingRound, members: List[str], deadline: float,
                 aggregate: Callable[[torch.Tensor], torch.Tensor], checked: bool = False):
        super().__init__(ring_round, members, deadline)
        self.aggregate = aggregate
        # owners are checked where the aggregate is per coordinate and values arrive exactly as sent
        self.checked = checked and self.codec is RAW
        self.probed_by: Set[str] = set()  # members whose probe we answered
        self.all_probed = asyncio.Event()
        me = members.index(self.peer.peer_id)
        self.owned = (me + 1) % self.count
        self.others = [member for member in members if member != self.peer.peer_id]
        owned = self.chunks[self.owned]
        # row j: the values member others[j] contributes to our chunk, filled as its parts arrive
        self.received = torch.empty(len(self.others), owned.stop - owned.start)
        self.arrived = [Progress() for _ in self.others]
        # one message to each other member; abandoned with the ring's own when the attempt ends
        self.scatter = [Outbox() for _ in self.others]
        self.outboxes += self.scatter
        self.first_gather = self.count - 1  # index of the first gather step in self.steps

    async def run(self) -> torch.Tensor:
        """The ring's attempt, then (``checked``) every other chunk's owner checked, and every member's probe
        of ours answered, before the attempt completes."""
        if not self.checked:
            return await super().run()
        # answered until the round ends, unless the attempt completes (the segment then holds the average): a
        # member that failed the attempt first (it caught an owner) is still probed by the others
        key = tuple(self.excluded_before)
        self.round.state.probes[key] = self._answer
        work = await super().run()
        self.checking = True
        try:
            await self._check_owners(work)
        finally:
            self.checking = False
            self.check_ended.set()
        try:
            async with asyncio.timeout(max(0.0, self.deadline - time.monotonic())):  # not wait_for: mailbox.receive
                await self.all_probed.wait()
        except TimeoutError:
            missing = [member[-8:] for member in self.others if member not in self.probed_by]
            raise asyncio.TimeoutError(f"no check of our chunk from {', '.join(missing)} within the ring timeout")
        del self.round.state.probes[key]
        return work

    def _answer(self, coordinates: List[int], sender: str) -> RingReply:
        """A member's probe: our own values at ``coordinates``, and the rows we aggregated at those in our chunk
        (every part of it is aggregated before it is gathered, and a member probes once its gather is done)."""
        if sender not in self.others:  # a ring member left out of this attempt: it would count as a prober, and
            # we would stop answering before a member of the attempt checked us (its ring failed)
            raise ValueError(f"this peer {NOT_IN_ATTEMPT} with {sender[-8:]}, which is not one of its members")
        if any(coordinate >= self.segment.numel() for coordinate in coordinates):
            raise ValueError(f"probe of coordinates beyond the segment's {self.segment.numel()}")
        owned = self.chunks[self.owned]
        if self.handled[self.first_gather - 1].value < owned.stop - owned.start:
            raise ValueError("probe before our chunk was aggregated: a member probes once its gather is complete")
        ours = [coordinate - owned.start for coordinate in coordinates if owned.start <= coordinate < owned.stop]
        rows = [(self.segment[owned.start:owned.stop] if member == self.peer.peer_id
                 else self.received[self.others.index(member)])[ours].tolist() for member in self.members]
        self.probed_by.add(sender)
        if len(self.probed_by) == len(self.others):
            self.all_probed.set()
        return RingReply(values=self.segment[coordinates].tolist(), rows=rows,
                         aggregated=self.work[owned.start:owned.stop][ours].tolist())

    async def _check_owners(self, work: torch.Tensor) -> None:
        """Probe every other member at random coordinates of each chunk we do not own; an owner caught lying
        is refused (:class:`ContributionRejected`), a chunk whose rows two members dispute keeps our values."""
        draw = random.SystemRandom()
        sampled: Dict[int, List[int]] = {}
        for chunk in range(self.count):
            bounds = self.chunks[chunk]
            if chunk != self.owned and bounds.stop > bounds.start:
                sampled[chunk] = sorted(draw.sample(range(bounds.start, bounds.stop),
                                                    min(PROBED_PER_CHUNK, bounds.stop - bounds.start)))
        coordinates = [coordinate for chunk in sorted(sampled) for coordinate in sampled[chunk]]
        if not coordinates:
            return
        probe = RingProbe(run=self.peer.sender.run, step=self.round.step, ring=self.round.ring.index, position=0,
                          attempt=self.excluded_before, coordinates=coordinates)
        replies = dict(zip(self.others, await asyncio.gather(*(
            self._probe(member, probe) for member in self.others))))
        me = self.members.index(self.peer.peer_id)
        for member, reply in replies.items():
            if reply.values is None or len(reply.values) != len(coordinates):
                raise ContributionRejected(member, "answered a probe without its values")
        for chunk, where in sampled.items():
            owner = self.members[(chunk - 1) % self.count]
            rows = replies[owner].rows
            if rows is None or len(rows) != self.count or any(len(row) != len(where) for row in rows):
                raise ContributionRejected(owner, f"answered a probe of its chunk {chunk} without its rows")
            if rows[me] != self.segment[where].tolist():
                raise ContributionRejected(owner, f"misreports our values in its chunk {chunk}")
            expected = self.aggregate(torch.tensor(rows, dtype=torch.float32))
            aggregated = replies[owner].aggregated
            if aggregated is None or len(aggregated) != len(where):
                raise ContributionRejected(owner, f"answered a probe of its chunk {chunk} without its aggregate")
            claimed = torch.tensor(aggregated, dtype=torch.float32)
            if not all(map(math.isfinite, expected.tolist())) or not torch.allclose(expected, claimed, rtol=1e-5,
                                                                                     atol=1e-6):
                raise ContributionRejected(owner, f"altered its aggregate of chunk {chunk}: it is not the "
                                                  f"{self.aggregate.__name__} of the values it reports")
            if not torch.allclose(claimed, work[where], rtol=1e-5, atol=1e-6):
                # what reached us is not the aggregate the owner reports. From the owner itself (we follow it in the
                # ring), the owner sent what it denies: refused. Through other members, one of them altered it, or
                # the owner sent one thing and reports another: which, our values cannot tell. Blaming the owner
                # let a member that altered what it passed on get an honest owner refused by every member after it
                # (a review); we keep our own values for the chunk and blame nobody
                if self.members[(self.members.index(owner) + 1) % self.count] == self.peer.peer_id:
                    raise ContributionRejected(owner, f"sent chunk {chunk} other than the aggregate it reports")
                logger.warning(f"ring {self.round.ring.index}: chunk {chunk} reached us altered on its way from "
                               f"{owner[-8:]}, which aggregated it as it reports: keeping our own values for it")
                bounds = self.chunks[chunk]
                work[bounds] = self.segment[bounds]
                continue
            first = coordinates.index(where[0])
            for index, member in enumerate(self.members):
                if member not in (owner, self.peer.peer_id) and rows[index] != replies[member].values[first:first + len(where)]:
                    logger.warning(f"ring {self.round.ring.index}: {owner[-8:]} and {member[-8:]} dispute "
                                   f"{member[-8:]}'s values in chunk {chunk}: keeping our own values for it")
                    bounds = self.chunks[chunk]
                    work[bounds] = self.segment[bounds]
                    break

    async def _probe(self, member: str, probe: RingProbe) -> RingReply:
        try:
            return await self.peer.sender.send_note(member, probe, self.deadline)
        except P2PHandlerError as e:
            raise past_round_or(e, member)

    def _tasks(self) -> List[Coroutine]:
        gathers = range(self.first_gather, len(self.steps))
        return ([self._send_to_owner(j) for j in range(len(self.others))] + [self._serialize_chunks()]
                + [self._receive_contribution(j) for j in range(len(self.others))] + [self._aggregate_owned()]
                + [self._send(i) for i in gathers] + [self._receive(i) for i in gathers])

    async def _send_to_owner(self, index: int) -> None:
        message = RingPart(run=self.peer.sender.run, step=self.round.step, ring=self.round.ring.index, position=0,
                           attempt=self.excluded_before, phase=REDUCE, codec=self.codec.name)
        try:
            resent = await self.peer.sender.send_chunk(self.others[index], message, self.scatter[index], self.deadline)
        except P2PHandlerError as e:
            raise past_round_or(e, self.others[index])
        self.round.log.resends += resent

    async def _serialize_chunks(self) -> None:
        """Our values of each other member's chunk, a part at a time, the first part of every chunk first, so
        every stream starts at once (between parts the other rings' coroutines run)."""
        part_elements = max(1, self.peer.part_bytes // 4)
        owners = [(self.members.index(member) + 1) % self.count for member in self.others]
        longest = max(self.chunks[chunk].stop - self.chunks[chunk].start for chunk in owners)
        for lo in range(0, max(longest, 1), part_elements):
            for outbox, chunk in zip(self.scatter, owners):
                elements = self.chunks[chunk]
                if lo < elements.stop - elements.start or lo == 0:  # an empty chunk is one empty part
                    hi = min(elements.start + lo + part_elements, elements.stop)
                    outbox.put(serialize_part(self.segment[elements.start + lo:hi], self.codec))
            await asyncio.sleep(0)
        for outbox in self.scatter:
            outbox.close()

    async def _receive_contribution(self, index: int) -> None:
        """Member ``others[index]``'s values of our chunk, part by part, checked as one contribution."""
        sender, length, offset = self.others[index], self.received.shape[1], 0
        check_as = RingStep(REDUCE, 0, self.owned, self.owned)  # a single contribution to our chunk
        key: MessageKey = (self.round.step, self.round.ring.index, tuple(self.excluded_before), REDUCE, 0, sender)
        async for values, _ in self._parts(key):
            try:
                values = self._checked(check_as, values, offset, length)
            except ContributionRejected as e:  # _checked blames the ring's predecessor; here the sender is known
                raise ContributionRejected(sender, str(e))
            self.received[index, offset:offset + values.numel()] = values
            offset += values.numel()
            self.arrived[index].advance(offset)
        if offset != length:
            raise RingDisagreement(sender, str(offset), length)
        self.arrived[index].advance(length, done=True)

    async def _aggregate_owned(self) -> None:
        """Aggregate our chunk a part at a time, as soon as every member's values for that part are here, and
        hand each part to the first gather step, like the ring's last reduce step."""
        owned = self.chunks[self.owned]
        length, part_elements = owned.stop - owned.start, max(1, self.peer.part_bytes // 4)
        mark = self.handled[self.first_gather - 1]
        for lo in range(0, length, part_elements) if length else [0]:
            hi = min(lo + part_elements, length)
            for progress in self.arrived:
                await progress.reach(hi)
            values = self.work[owned.start + lo:owned.start + hi]
            ours = self.segment[owned.start + lo:owned.start + hi]
            values.copy_(self.aggregate(torch.cat([ours.unsqueeze(0), self.received[:, lo:hi]])))
            part = serialize_part(values, self.codec)
            if self.codec is not RAW:
                # the others get our chunk through the compression: keep the same value so all agree
                values.copy_(decode_part(part, self.codec))
            self.outboxes[self.first_gather].put(part)
            mark.advance(hi)
            await asyncio.sleep(0)  # a part's aggregate is CPU work: let the streams move between parts
        self.outboxes[self.first_gather].close()
        mark.advance(length, done=True)
