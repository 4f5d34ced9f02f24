"""The averager's mailbox: ring messages and notes, filed as they arrive, until the ring that expects them looks.

The handler files each part of a message in an :class:`Inbox` keyed by (step, ring, attempt, phase, position,
sender) and answers at once; the ring coroutine that expects it takes the parts from there. So a member that
starts its round early never waits for a late one to be listening, and a message only counts when it comes
from the ring's expected predecessor. Notes (who arrived, who was excluded, whether the ring was ended) go
to the ring's :class:`RingState`, keyed by (step, ring).

A round is named by its training step: a message for a step that is over here is refused, one for a later
step waits (at most ``max_buffered_bytes`` of parts and ``MAX_MAILBOX_ENTRIES`` inboxes and ring states, so a
stranger cannot make us hold unbounded memory). When a round ends, everything of that step and earlier is
dropped, and the keys of its messages that were complete are kept for one more round: a resend whose first
copy arrived is acknowledged and dropped, not refused.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Dict, List, Optional, Set, Tuple, Union

import torch
from hivemind.proto import runtime_pb2

from ravnest_swarm.averaging.wire import ROUND_OVER, RingAbort, RingArrive, RingPart, decode_part

MAX_MAILBOX_ENTRIES = 4096  # early messages (and ring states) held for rounds not yet asked for

# step, ring, attempt (the peers excluded before it), phase, position, sender
MessageKey = Tuple[int, int, Tuple[str, ...], str, int, str]


def message_key(message: RingPart, sender: str) -> MessageKey:
    return message.step, message.ring, tuple(message.attempt), message.phase, message.position, sender


class Inbox:
    """One ring message as it arrives on its stripes: the handler files decoded parts by their index in the
    message, the ring coroutine takes them in order.

    It stays in the mailbox until its round ends, so a resent stripe finds what arrived before: part k of
    every stream of stripe j is the same part (index j + k x stripes), and only the first copy is kept.
    """

    def __init__(self):
        self.parts: Dict[int, Tuple[torch.Tensor, runtime_pb2.Tensor, int]] = {}  # index: (values, as sent, bytes)
        self.stripes: Optional[int] = None  # set by the first stream of the message that arrives
        self.accepted: List[int] = []  # per stripe: parts kept so far, whichever stream brought them
        self.ended: Set[int] = set()  # stripes whose stream reached its end of stream with every part kept
        self.next = 0  # the index of the part the ring coroutine takes next
        self.complete = False  # every stripe ended: every part is here
        self.taken = False  # the ring coroutine is done with it (finished, or its attempt was abandoned)
        self.error: Optional[str] = None  # refused midway: the ring that expects it fails
        self.changed = asyncio.Event()

    def notify(self) -> None:
        self.changed.set()

    def join(self, stripes: int) -> None:
        """A stream of this message arrived, dealt over ``stripes`` streams; every stream of it must agree."""
        if self.stripes is None:
            self.stripes, self.accepted = stripes, [0] * stripes
        elif stripes != self.stripes:
            raise ValueError(f"ring message striped over {stripes} streams, earlier over {self.stripes}")

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


class RingState:
    """What the members of one ring in one round have told us: who arrived, exclusions, whether it was ended."""

    def __init__(self):
        self.arrived: Set[str] = set()
        self.excluded: Set[str] = set()
        self.failure: Optional[str] = None
        self.changed = asyncio.Event()  # exclusions or failure: a running attempt must start over or end
        self.arrival = asyncio.Event()  # someone new arrived: only the wait before the first attempt cares

    def end(self, failure: str) -> None:
        if self.failure is None:
            self.failure = failure
            self.changed.set()

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
    """Every inbox and ring state of this peer, bounded, and the rounds it has finished."""

    def __init__(self, max_buffered_bytes: int):
        self.max_buffered_bytes = max_buffered_bytes
        self.last_finished_step = -1
        self.inboxes: Dict[MessageKey, Inbox] = {}
        self._delivered: Set[MessageKey] = set()  # complete when the last round ended: their resends are acked
        self._buffered_bytes = 0
        self._rings: Dict[Tuple[int, int], RingState] = {}

    def refuse_if_over(self, step: int) -> None:
        if step <= self.last_finished_step:
            raise ValueError(f"round {step} {ROUND_OVER} (last finished {self.last_finished_step})")

    # ---- the handler's side ------------------------------------------------------------------------

    def inbox_for(self, message: RingPart, sender: str) -> Optional[Inbox]:
        """The inbox a message fills; None for a resend of one that was complete when its round ended."""
        key = message_key(message, sender)
        if message.step <= self.last_finished_step and key in self._delivered:
            return None  # the sender lost our reply: acknowledge again, keep nothing
        self.refuse_if_over(message.step)
        if key not in self.inboxes and len(self.inboxes) >= MAX_MAILBOX_ENTRIES:
            raise ValueError("too many ring messages waiting here; retry later")
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
        size = part.ByteSize()  # reading .buffer would copy the bytes out of the protobuf just to count them
        if self._buffered_bytes + size > self.max_buffered_bytes:
            raise ValueError("too much ring data buffered here; retry later")
        inbox.parts[stripe + index * inbox.stripes] = (decode_part(part), part, size)
        inbox.accepted[stripe] += 1
        self._buffered_bytes += size
        inbox.notify()

    def note(self, note: Union[RingArrive, RingAbort], sender: str) -> None:
        """A member arrived, or excluded peers from the ring or ended it."""
        self.refuse_if_over(note.step)
        if (note.step, note.ring) not in self._rings and len(self._rings) >= MAX_MAILBOX_ENTRIES:
            raise ValueError("too many rings pending here; retry later")
        state = self.ring_state(note.step, note.ring)
        if isinstance(note, RingArrive):
            if sender not in state.arrived:
                state.arrived.add(sender)
                state.arrival.set()
            return
        if note.excluded and not set(note.excluded) <= state.excluded:
            state.excluded |= set(note.excluded)
            state.changed.set()
        if note.failure:
            state.end(f"ended by {sender[-8:]}: {note.failure}")

    # ---- the rings' side ---------------------------------------------------------------------------

    def ring_state(self, step: int, ring: int) -> RingState:
        return self._rings.setdefault((step, ring), RingState())

    async def receive(self, key: MessageKey, deadline: float) -> AsyncIterator[Tuple[torch.Tensor, runtime_pb2.Tensor]]:
        """The parts of one expected message, in order, as they arrive (values, and the part as sent)."""
        inbox = self._inbox(key)
        try:
            while True:
                if inbox.next in inbox.parts:
                    tensor, part, size = inbox.parts.pop(inbox.next)
                    inbox.next += 1
                    self._buffered_bytes -= size
                    yield tensor, part
                elif inbox.error is not None:
                    raise ConnectionError(f"the {key[3]} step {key[4]} message from {key[-1][-8:]} {inbox.error}")
                elif inbox.complete:
                    return  # every part was filed, and the ring took them all
                else:
                    inbox.changed.clear()
                    try:
                        await asyncio.wait_for(inbox.changed.wait(), max(0.0, deadline - time.monotonic()))
                    except asyncio.TimeoutError:
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
            inbox.error = inbox.error or "arrived after its round ended"
            inbox.notify()
        for key in [key for key in self._rings if key[0] <= step]:
            del self._rings[key]

    def _inbox(self, key: MessageKey) -> Inbox:
        if key not in self.inboxes:
            self.inboxes[key] = Inbox()
        return self.inboxes[key]

    def _drop_parts(self, inbox: Inbox) -> None:
        self._buffered_bytes -= sum(size for _, _, size in inbox.parts.values())
        inbox.parts.clear()
