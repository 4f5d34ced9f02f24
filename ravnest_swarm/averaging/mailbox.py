"""The averager's mailbox: ring messages and notes, filed as they arrive, until the ring that expects them looks.

The handler files each part of a message in an :class:`Inbox` keyed by (step, ring, attempt, phase, position,
sender) and answers at once; the ring coroutine that expects it takes the parts from there. So a member that
starts its round early never waits for a late one to be listening, and a message only counts when it comes
from the ring's expected predecessor. Notes (who arrived, whose contribution a member refused, who ended the
ring for itself) go to the ring's :class:`RingState`, keyed by (step, ring), which counts them as votes: a
member is excluded only by a majority of the ring's members. Over 400 lines because admitting, filing, the
rings' states and the rounds over here are one bounded store that every check reads.

Who may send what (:meth:`Mailbox.admit`, before anything is kept): what the peer's owner says it expects now
(:class:`Expected`: its rings in the plan it follows, and a window of rounds around its training step). A
message, note or abort counts only from a member of the ring it names, for a round in that window, and may
name (as left out of its attempt, or as refused now) only members of that ring: a member that names other peers of
the run counts the ring apart from us for a moment (at a churn event one of us adopts the new plan or finds a peer
gone first), one that names peers nobody told us of is hostile. Each ring partner holds at
most its share of the mailbox (``MAX_MAILBOX_ENTRIES`` inboxes and ``max_buffered_bytes`` of parts, divided
by the number of partners), so neither a stranger nor a member can make us hold unbounded memory or crowd the
others out. When a round ends, everything of that step and earlier is dropped, and the keys of its messages
that were complete are kept for one more round: a resend whose first copy arrived is acknowledged and
dropped, not refused.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import (AsyncIterator, Callable, Collection, Dict, FrozenSet, List, NamedTuple, Optional, Sequence, Set,
                    Tuple, Union)

import torch
from hivemind.proto import runtime_pb2

from ravnest_swarm.averaging.segments import Ring
from ravnest_swarm.averaging.wire import (ROUND_OVER, RingAbort, RingArrive, RingMessage, RingPart, RingProbe,
                                          RingReply, decode_part)
from ravnest_swarm.codecs.codec import RAW, Codec

MAX_MAILBOX_ENTRIES = 4096  # early messages (and ring states) held for rounds not yet asked for
# what a filed part holds beyond its wire bytes and decoded values (the protobuf and the objects around them): charged
# to the caps, so the caps bound memory (200,000 empty parts counted 2.4 MB and held 453 MB)
PART_OVERHEAD_BYTES = 1024

# How the mailbox refuses a message for who sent it or when. An honest member can cause the first three (one of us
# follows a plan the other has not adopted yet or found a peer gone first, or we are still fetching our layers), a
# round over here (wire.ROUND_OVER), and a round far ahead before we aligned our count (NOT_ALIGNED), so the averager
# counts those apart from hostile input.
NOT_EXPECTING = "this peer expects no ring messages now: it trains no stage of a plan yet"
OTHER_RING = "shares no ring"
COUNTED_APART = "counts the ring apart from this peer"
NOT_A_MEMBER = "is in no ring of the plan this peer follows"
TOO_FAR_AHEAD = "is too far ahead"
# a member's round past our window while we do not know the run's count yet (a new stage, or one whose round failed)
NOT_ALIGNED = "this peer has not aligned its count of rounds with its partners yet"
OUTSIDE_THE_RING = "names peers outside ring"
OVER_SHARE = "holds its share of this mailbox"
# a probe for an attempt this peer is not running (not yet, or any more: a note changed the ring): honest timing
NOT_IN_ATTEMPT = "runs no such attempt of the ring now"
# the mailbox as a whole is full (each partner within its share, as the count of partners changed): not the
# sender's doing, whoever it is
MAILBOX_FULL = "retry later"

# step, ring, attempt (the peers excluded before it), phase, position, sender
MessageKey = Tuple[int, int, Tuple[str, ...], str, int, str]


class UndecodablePart(ValueError):
    """A part of an expected message did not decode in its codec: only its sender made it so (a vote against it)."""


def message_key(message: RingPart, sender: str) -> MessageKey:
    return message.step, message.ring, tuple(message.attempt), message.phase, message.position, sender


class Expected:
    """The ring messages this peer takes now: from the members of its rings in the plan it follows, for the
    rounds ``first_step`` to ``last_step`` (those it has finished are refused anyway).

    :param rings: every ring of the plan (``segments.plan_rings``), or at least this peer's
    :param peer_id: this peer
    :param left_out: members of the plan's rings (all of them may be given: those in ``rings`` are not left out);
        the others, the clusters of peers this peer found gone, may be named in a vote, which is answered with
        our own (``Mailbox.left_out_of``)
    :param held: the round this peer is in and its rings, where they are not ``rings``: a round goes on in the rings
        it began in (a partner that left gracefully is left out by the ring itself, not by new rings of the others)
    :param known: other peers of the run this peer has read records of (a joiner that a plan we have not adopted
        yet places): a member that names one of them in its ring counts the ring apart from us, honestly
    :param aligned: whether our window is counted from where our partners' records said the run's rounds are; until
        then a member's round past it is honest (a taker counts from its layers' step, a walkthrough's partner was 200
        rounds on), refused all the same
    """

    def __init__(self, rings: Sequence[Ring], peer_id: str, first_step: int, last_step: int,
                 left_out: Sequence[str] = (), held: Optional[Tuple[int, Sequence[Ring]]] = None,
                 known: Collection[str] = (), aligned: bool = True):
        self.first_step, self.last_step, self.aligned = first_step, last_step, aligned
        # our rings' members by ring index; everyone the plan puts in a ring (a sender in none is a stranger)
        self.rings: Dict[int, FrozenSet[str]] = {ring.index: frozenset(ring.members) for ring in rings
                                                 if peer_id in ring.members}
        self.held_step, held_rings = held if held is not None else (None, [])
        self.held_rings = {ring.index: frozenset(ring.members) for ring in held_rings}
        in_plan = frozenset(member for ring in rings for member in ring.members)
        # the held round's members too: a sender in no ring at all is a stranger
        self.planned: FrozenSet[str] = in_plan | frozenset(member for ring in held_rings for member in ring.members)
        self.partners = len(set().union(*self.rings.values(), *self.held_rings.values()) - {peer_id})
        # a gone peer of the held round is still left out of the plan's other rounds (votes against it agree)
        self.left_out: FrozenSet[str] = frozenset(left_out) - in_plan
        self.known = known

    def knows(self, peers: Set[str]) -> bool:
        """Whether every one of ``peers`` is a peer of the run we know of: in the plan's rings, left out of
        ours, or in a record we read."""
        return all(peer in self.planned or peer in self.left_out or peer in self.known for peer in peers)

    def members(self, step: int, ring: int) -> Optional[FrozenSet[str]]:
        """The members of our ring ``ring`` in round ``step``; None: we have no such ring."""
        return (self.held_rings if step == self.held_step else self.rings).get(ring)


class Inbox:
    """One ring message as it arrives on its stripes: the handler files decoded parts by their index in the
    message, the ring coroutine takes them in order.

    It stays in the mailbox until its round ends, so a resent stripe finds what arrived before: part k of
    every stream of stripe j is the same part (index j + k x stripes), and only the first copy is kept.
    """

    def __init__(self, sender: str):
        self.sender = sender  # whose share of the mailbox it takes
        self.codec: Optional[Codec] = None  # what its parts are in, as its first stream said
        self.parts: Dict[int, Tuple[torch.Tensor, runtime_pb2.Tensor, int]] = {}  # index: (values, as sent, bytes)
        self.stripes: Optional[int] = None  # set by the first stream of the message that arrives
        self.accepted: List[int] = []  # per stripe: parts kept so far, whichever stream brought them
        self.ended: Set[int] = set()  # stripes whose stream reached its end of stream with every part kept
        self.next = 0  # the index of the part the ring coroutine takes next
        self.complete = False  # every stripe ended: every part is here
        self.taken = False  # the ring coroutine is done with it (finished, or its attempt was abandoned)
        self.error: Optional[str] = None  # refused midway: the ring that expects it fails
        self.undecodable: Optional[str] = None  # a part its sender encoded wrong: the ring refuses the sender
        self.changed = asyncio.Event()

    def notify(self) -> None:
        self.changed.set()

    def join(self, stripes: int, codec: Codec = RAW) -> None:
        """A stream of this message arrived, dealt over ``stripes`` streams in ``codec``; every stream of it must
        agree."""
        if self.stripes is None:
            self.stripes, self.accepted, self.codec = stripes, [0] * stripes, codec
        elif stripes != self.stripes:
            raise ValueError(f"ring message striped over {stripes} streams, earlier over {self.stripes}")
        elif codec is not self.codec:
            raise ValueError(f"ring message in codec {codec.name}, earlier in {self.codec.name}")

    def end_stripe(self, stripe: int, count: int) -> None:
        """Stripe ``stripe``'s stream ended after ``count`` parts; once every stripe has, the message is complete."""
        if count != self.accepted[stripe]:
            raise ValueError(f"ring stripe ended after {count} parts, but {self.accepted[stripe]} arrived before")
        self.ended.add(stripe)
        if len(self.ended) < self.stripes:
            return
        total = sum(self.accepted)
        if not total:
            raise ValueError("ring message carries no tensor")
        # dealt round-robin, stripe j holds the indices j, j + stripes, ... below total: anything else has a gap
        if any(count != (total - j + self.stripes - 1) // self.stripes for j, count in enumerate(self.accepted)):
            raise ValueError(f"ring message stripes hold {self.accepted} parts: not one message dealt round-robin")
        self.complete = True
        self.notify()

    def refuse(self, reason: str) -> None:
        """A stream of this message was refused: the ring that expects it fails (unless it is already whole)."""
        if not self.complete and self.error is None:
            self.error = reason
            self.notify()


def majority(members: int) -> int:
    """How many distinct members' votes exclude one of a ring of ``members``: more than half of them."""
    return members // 2 + 1


class RingView(NamedTuple):
    """Who runs the ring's next attempt, as the members' own notes decide it (:meth:`RingState.view`)."""

    excluded: FrozenSet[str]  # a majority of the ring's members refused its contribution
    withdrawn: FrozenSet[str]  # ended the ring for itself
    refusing: FrozenSet[str]  # refused a member the majority has not excluded: waits out until it is
    members: Tuple[str, ...]  # the rest, in ring order: the attempt's members


class RingState:
    """What the members of one ring in one round have told us, each about itself: who arrived, whose
    contribution each refused (its votes), who ended the ring for itself; and whether it ended for us.

    Every note is its sender's own (libp2p authenticates it), so a member speaks only for itself: it can vote,
    once per accused member, and leave; it cannot remove anyone else. :meth:`view` turns the notes into the
    next attempt's members.
    """

    def __init__(self):
        self.arrived: Set[str] = set()
        self.refusals: Dict[str, Set[str]] = {}  # voter: the members whose contribution it refused
        self.withdrawn: Dict[str, str] = {}  # member: why it ended the ring for itself
        self.failure: Optional[str] = None  # why the ring ended for this peer (what it saw itself)
        # the running robust attempt's answer to a member's probe, keyed by the attempt (its left-out members)
        self.probes: Dict[Tuple[str, ...], Callable[[List[int], str], RingReply]] = {}
        self.here = False  # this peer reached the round: a member's arrive note is answered so
        self.settled = False  # our ring ended, whatever its result: its members no longer wait on each other here
        self.anchor: Optional[str] = None  # our outer state's digest over the ring's segment, told with ``here``
        self.anchors: Dict[str, Optional[str]] = {}  # each arrived member's, as its note or its answer to ours said
        self.changed = asyncio.Event()  # votes, withdrawals or our end: a running attempt must start over or end
        self.arrival = asyncio.Event()  # someone new arrived: only the wait before the first attempt cares

    def arrive(self, member: str, anchor: Optional[str] = None) -> None:
        self.anchors[member] = anchor
        if member not in self.arrived:
            self.arrived.add(member)
            self.arrival.set()

    def vote(self, voter: str, accused: Sequence[str]) -> None:
        """``voter`` refused the contributions of ``accused``; a vote repeated counts once."""
        new = set(accused) - self.refusals.get(voter, set())
        if new:
            self.refusals.setdefault(voter, set()).update(new)
            self.changed.set()

    def withdraw(self, member: str, reason: str) -> None:
        if member not in self.withdrawn:
            self.withdrawn[member] = reason
            self.changed.set()

    def end(self, failure: str) -> None:
        if self.failure is None:
            self.failure = failure
            self.changed.set()

    def view(self, ring_members: Sequence[str]) -> RingView:
        """Excluded: a member whose contribution a majority of the ring's members refused (the accused's own
        vote not counted). Refusing: a member that refused one still in the ring; it cannot work with it, and
        nobody can tell which of the two is honest, so the accuser waits out, and comes back if the others'
        votes exclude the accused. Members: everyone else not withdrawn."""
        need = majority(len(ring_members))
        excluded = frozenset(member for member in ring_members
                             if sum(member in accused for voter, accused in self.refusals.items()
                                    if voter != member) >= need)
        present = [member for member in ring_members if member not in excluded and member not in self.withdrawn]
        refusing = frozenset(member for member in present if self.refusals.get(member, set()) & set(present))
        return RingView(excluded, frozenset(self.withdrawn), refusing,
                        tuple(member for member in present if member not in refusing))

    async def news(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for a change or an arrival; whether one came."""
        waits = [asyncio.create_task(self.changed.wait()), asyncio.create_task(self.arrival.wait())]
        try:
            done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        return bool(done)


class Mailbox:
    """Every inbox and ring state of this peer, bounded, and the rounds it has finished.

    ``expecting`` says what this peer expects now (None: nothing, every message is refused); its owner sets it.
    ``codec``: the averager's; a part arrives in it or (a ring that fell back to parameters) in ``none``, as its
    message says, and is decoded as it is filed.
    """

    def __init__(self, max_buffered_bytes: int, codec: Codec = RAW):
        self.max_buffered_bytes, self.codec = max_buffered_bytes, codec
        self.expecting: Callable[[], Optional[Expected]] = lambda: None
        self.last_finished_step = -1
        self.entered_step = -1  # the latest round this peer entered (MultiRingAverager.enter): earlier ones are over
        self.inboxes: Dict[MessageKey, Inbox] = {}
        self._delivered: Set[MessageKey] = set()  # complete when the last round ended: their resends are acked
        self._buffered_bytes = 0
        self._rings: Dict[Tuple[int, int], RingState] = {}
        self._held_inboxes: Counter = Counter()  # per sender
        self._held_bytes: Counter = Counter()  # per sender: parts filed and not yet taken
        self._share = (MAX_MAILBOX_ENTRIES, max_buffered_bytes)  # each partner's, as of the last message admitted

    def refuse_if_over(self, step: int) -> None:
        if step <= self.last_finished_step:
            raise ValueError(f"round {step} {ROUND_OVER} (last finished {self.last_finished_step})")
        if step < self.entered_step:  # rounds never go back: the sender leaves it, not waits its timeout for us
            raise ValueError(f"round {step} {ROUND_OVER} (this peer is in round {self.entered_step})")

    def admit(self, message: RingMessage, sender: str) -> None:
        """Refuse, in one line, a message ``sender`` may not send now: for a round over here or outside the
        window of rounds we expect, for a ring we do not share with it, or naming peers outside that ring."""
        self.refuse_if_over(message.step)
        expected = self.expecting()
        if expected is None:
            raise ValueError(NOT_EXPECTING)
        members = expected.members(message.step, message.ring)
        if members is None or sender not in members:
            if expected.knows({sender}):  # a partner in another ring, or a joiner: one of us follows another plan
                raise ValueError(f"{sender[-8:]} {OTHER_RING} {message.ring} with this peer in the plan it follows")
            raise ValueError(f"{sender[-8:]} {NOT_A_MEMBER}")
        if message.step < expected.first_step:  # a round we passed without taking part: it ends for the sender
            raise ValueError(f"round {message.step} {ROUND_OVER} (this peer is at round {expected.first_step} or later)")
        if message.step > expected.last_step:
            unaligned = "" if expected.aligned else f"; {NOT_ALIGNED}"
            raise ValueError(f"round {message.step} {TOO_FAR_AHEAD} (this peer takes rounds up to {expected.last_step}"
                             f"{unaligned})")
        excluded = set(getattr(message, "excluded", None) or ())
        outside = (set(message.attempt) | (excluded - expected.left_out)) - members
        if outside and expected.knows(outside):
            raise ValueError(f"{message.phase} message {COUNTED_APART} in ring {message.ring}: it names peers of the "
                             f"run our ring leaves out (one of us follows another plan, or found them gone)")
        if outside:
            raise ValueError(f"{message.phase} message {OUTSIDE_THE_RING} {message.ring}")
        self._share = (MAX_MAILBOX_ENTRIES // max(1, expected.partners),
                       self.max_buffered_bytes // max(1, expected.partners))

    # ---- the handler's side ------------------------------------------------------------------------

    def inbox_for(self, message: RingPart, sender: str) -> Optional[Inbox]:
        """The inbox a message fills; None for a resend of one that was complete when its round ended."""
        key = message_key(message, sender)
        if message.step <= self.last_finished_step and key in self._delivered:
            return None  # the sender lost our reply: acknowledge again, keep nothing
        self.admit(message, sender)
        if message.codec not in (RAW.name, self.codec.name):
            raise ValueError(f"ring message in codec {message.codec}: this peer averages in {self.codec.name} "
                             f"or none")
        if key not in self.inboxes:
            if self._held_inboxes[sender] >= self._share[0]:
                raise ValueError(f"{sender[-8:]} {OVER_SHARE}: {self._held_inboxes[sender]} ring messages")
            if len(self.inboxes) >= MAX_MAILBOX_ENTRIES:
                raise ValueError(f"too many ring messages waiting here; {MAILBOX_FULL}")
        return self._inbox(key)

    def file(self, inbox: Inbox, stripe: int, index: int, part: runtime_pb2.Tensor) -> None:
        """Decode part ``index`` of a stripe and hand it to the ring coroutine (or keep it for later)."""
        if index < inbox.accepted[stripe] or inbox.taken:
            # a resend repeats the parts that arrived before: the first copy counts. Once the ring is done with
            # the message (or gave up that attempt, and told its members), the rest is acknowledged and dropped:
            # refusing it would fail the sender's ring over a message nobody needs any more.
            return
        if index > inbox.accepted[stripe]:
            raise ValueError(f"ring stripe part {index} arrived before part {inbox.accepted[stripe]}")
        # what the part will hold: its wire bytes (reading .buffer would copy them out of the protobuf just to count
        # them), its values once decoded (an int3 part decodes to 10.7 times its bytes) and PART_OVERHEAD_BYTES
        size = part.ByteSize() + PART_OVERHEAD_BYTES
        self._check_room(inbox.sender, size)
        try:
            values = decode_part(part, inbox.codec)
        except ValueError as e:  # refused to the sender too (the handler's error); its ring votes against it
            inbox.undecodable = inbox.undecodable or str(e)
            inbox.notify()
            raise
        size += values.numel() * values.element_size()
        self._check_room(inbox.sender, size)
        inbox.parts[stripe + index * inbox.stripes] = (values, part, size)
        inbox.accepted[stripe] += 1
        self._buffered_bytes += size
        self._held_bytes[inbox.sender] += size
        inbox.notify()

    def _check_room(self, sender: str, size: int) -> None:
        if self._held_bytes[sender] + size > self._share[1]:
            raise ValueError(f"{sender[-8:]} {OVER_SHARE}: {self._share[1]} bytes of ring data")
        if self._buffered_bytes + size > self.max_buffered_bytes:
            raise ValueError(f"too much ring data buffered here; {MAILBOX_FULL}")

    def note(self, note: Union[RingArrive, RingAbort], sender: str) -> RingState:
        """A member arrived, refused members' contributions (its votes) or ended the ring for itself; the ring's
        state (is this peer there)."""
        self.admit(note, sender)
        if (note.step, note.ring) not in self._rings and len(self._rings) >= MAX_MAILBOX_ENTRIES:
            raise ValueError(f"too many rings pending here; {MAILBOX_FULL}")
        state = self.ring_state(note.step, note.ring)
        if isinstance(note, RingArrive):
            state.arrive(sender, note.anchor)
            return state
        if note.excluded:
            state.vote(sender, note.excluded)
        if note.failure:
            state.withdraw(sender, f"{sender[-8:]} ended it: {note.failure}")
        return state

    def left_out_of(self, excluded: Sequence[str]) -> List[str]:
        """Of the members a vote names, those our own rings leave out already: our vote against them too. Members
        that find a peer gone at different moments compute the ring apart for a while; a vote of the ones that
        still count it would otherwise never reach a majority (a walkthrough's ring of four waited 40 s for a
        member that left by Ctrl-C: two voted, the third already averaged without it)."""
        expected = self.expecting()
        return sorted(set(excluded) & expected.left_out) if expected is not None else []

    def probe(self, probe: RingProbe, sender: str) -> RingReply:
        """A member's check of the robust attempt we run with it: our answer, or a one-line refusal."""
        self.admit(probe, sender)
        answer = self._rings.get((probe.step, probe.ring), RingState()).probes.get(tuple(probe.attempt))
        if answer is None:
            raise ValueError(f"round {probe.step}: this peer {NOT_IN_ATTEMPT} {probe.ring}")
        return answer(list(probe.coordinates), sender)

    # ---- the rings' side ---------------------------------------------------------------------------

    def ring_state(self, step: int, ring: int) -> RingState:
        return self._rings.setdefault((step, ring), RingState())

    def ring_state_if_any(self, step: int, ring: int) -> Optional[RingState]:
        """The ring's state where one exists: a round's owner that only looks creates none (a round just finished
        had its states dropped, and a look must not bring them back)."""
        return self._rings.get((step, ring))

    async def receive(self, key: MessageKey, deadline: float,
                      codec: Codec) -> AsyncIterator[Tuple[torch.Tensor, runtime_pb2.Tensor]]:
        """The parts of one expected message, in order, as they arrive (values, and the part as sent); in
        ``codec``, what the ring's attempt runs in (a member that runs it in another codec fails the ring)."""
        inbox = self._inbox(key)
        try:
            while True:
                if inbox.codec is not None and inbox.codec is not codec:
                    raise ValueError(f"the {key[3]} step {key[4]} message from {key[-1][-8:]} is in codec "
                                     f"{inbox.codec.name}; this ring runs in {codec.name}")
                if inbox.next in inbox.parts:
                    tensor, part, size = inbox.parts.pop(inbox.next)
                    inbox.next += 1
                    self._buffered_bytes -= size
                    self._held_bytes[inbox.sender] -= size
                    yield tensor, part
                elif inbox.undecodable is not None:
                    raise UndecodablePart(inbox.undecodable)
                elif inbox.error is not None:
                    raise ConnectionError(f"the {key[3]} step {key[4]} message from {key[-1][-8:]} {inbox.error}")
                elif inbox.complete:
                    return  # every part was filed, and the ring took them all
                else:
                    inbox.changed.clear()
                    try:
                        # not asyncio.wait_for, which drops a cancellation that comes as its wait ends (ring.py)
                        async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                            await inbox.changed.wait()
                    except TimeoutError:
                        raise asyncio.TimeoutError(
                            f"no chunk from {key[-1][-8:]} ({key[3]} step {key[4]}) within the ring timeout")
        finally:
            # it stays in the mailbox until the round ends, so a resend of it is recognised
            inbox.taken = True
            self._drop_parts(inbox)

    def finish_round(self, step: int) -> None:
        """Drop everything of round ``step`` and earlier; remember which of its messages were complete."""
        self.last_finished_step = step
        self._delivered = {key for key, inbox in self.inboxes.items() if key[0] == step and inbox.complete}
        for key in [key for key in self.inboxes if key[0] <= step]:
            inbox = self.inboxes.pop(key)
            self._drop_parts(inbox)
            self._held_inboxes[inbox.sender] -= 1
            inbox.error = inbox.error or "arrived after its round ended"
            inbox.notify()
        for key in [key for key in self._rings if key[0] <= step]:
            del self._rings[key]
        self._held_inboxes, self._held_bytes = +self._held_inboxes, +self._held_bytes  # forget senders holding none

    def _inbox(self, key: MessageKey) -> Inbox:
        if key not in self.inboxes:
            self.inboxes[key] = Inbox(key[-1])
            self._held_inboxes[key[-1]] += 1
        return self.inboxes[key]

    def _drop_parts(self, inbox: Inbox) -> None:
        size = sum(size for _, _, size in inbox.parts.values())
        self._buffered_bytes -= size
        self._held_bytes[inbox.sender] -= size
        inbox.parts.clear()
