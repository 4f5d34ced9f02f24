"""Parallel multi-ring all-reduce over hivemind P2P streams: the averager a peer runs, one round at a time.

A peer serves one handler, ``ravnest.averaging.ring``, and averages each of its segments in its own ring,
all rings at once. The parts, each in its own module:

* ``wire.py``: the ring's message schemas (registered with the handler), a chunk's parts and how a message
  is sent over striped streams, with resends;
* ``mailbox.py``: where the handler files what arrives, keyed by round, ring, attempt, step and sender,
  bounded, until the ring that expects it takes it;
* ``ring.py``: one ring's protocol: wait for its members, then reduce-scatter and all-gather, attempt by
  attempt, with the checks that refuse a poisoned contribution;
* here: the handler (read a stream within its limits, file its parts) and the round (start every ring, wait
  for them, finish the round in the mailbox, report a :class:`RoundResult`).

Every round is named by its training step: a message for a step that is over here is refused, one for a
later step waits in the mailbox. Only members of the rings this peer expects (:meth:`MultiRingAverager.expect`,
or the ``expecting`` its owner gives) may send, for rounds in its window (``mailbox.Mailbox.admit``). The
handler reads frames itself (within ``max_message_bytes`` and the ring timeout): a message over the limit,
metadata that fits no schema, a truncated protobuf, a sender outside the ring or a silent stream gets an error
with a reason, a log line and a count: ``turned_away`` for what honest members cause (a round over here, a plan
one of us has not adopted yet or a peer one of us has not found gone yet, a stalled stream), ``rejected`` for the
rest, which only a hostile peer sends.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Coroutine, Dict, List, Optional, Sequence, Set, Union

import torch
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError

from ravnest_swarm.averaging.mailbox import (COUNTED_APART, MAILBOX_FULL, NOT_ALIGNED, NOT_EXPECTING, NOT_IN_ATTEMPT,
                                             OTHER_RING, Expected, Inbox, Mailbox)
from ravnest_swarm.averaging.ring import PSEUDO_GRADIENTS, Patience, RingPeer, RingRound, RoundLog, SegmentResult
from ravnest_swarm.averaging.robust import MEAN
from ravnest_swarm.averaging.robust_ring import attempt_for
from ravnest_swarm.averaging.segments import Ring
from ravnest_swarm.averaging.wire import (CONTROL_TIMEOUT, MAX_MESSAGE_BYTES, PART_BYTES, RING_HANDLER, ROUND_OVER,
                                          STREAMS_PER_STEP, RingAbort, RingArrive, RingPart, RingProbe, RingReply, RingSender,
                                          decode_ring_message)
from ravnest_swarm.codecs.codec import CODECS, RAW, Codec
from ravnest_swarm.net.messages import MessageError
from ravnest_swarm.net.routes import Routes
from ravnest_swarm.net.transport import (INCOMPLETE, MAX_METADATA_BYTES, iterate_frames, make_response, message_reply,
                                         send_reply)

logger = logging.getLogger(__name__)

# refusals honest members cause: a round this peer finished or passed, a plan one of us has not adopted yet (or a peer
# one of us has not found gone yet), a stream stalled on a busy machine, a mailbox full as a whole; counted as
# `turned_away`, apart from the hostile input `rejected` counts
TURNED_AWAY = (ROUND_OVER, NOT_EXPECTING, OTHER_RING, COUNTED_APART, INCOMPLETE, NOT_IN_ATTEMPT, MAILBOX_FULL,
               NOT_ALIGNED)

# a stopping peer stays this long after the last ring stream it was sent: a sender whose reply was lost sends
# the stripe again after RESEND_BACKOFF plus a dial, and a peer that had gone would fail its complete ring
RESEND_QUIET = 0.5


@dataclass
class RoundResult:
    """One averaging round of this peer: a result per ring, every refused contribution, how many ring
    streams (stripes of its messages) it sent again after a transport failure, and the bytes it put on ring
    streams meanwhile (metadata and parts as encoded, counted by its sender)."""

    step: int
    seconds: float
    segments: List[SegmentResult]
    rejected: List[dict] = field(default_factory=list)
    resends: int = 0
    bytes_sent: int = 0

    @property
    def ok(self) -> bool:
        return all(segment.status == "ok" for segment in self.segments)

    def failed_segments(self) -> List[int]:
        return [segment.index for segment in self.segments if segment.status != "ok"]

    @property
    def failed(self) -> List[SegmentResult]:
        """The rings that failed someone: neither averaged nor ``finished`` (every other member of a ring that ended
        so finished the run, and nobody failed)."""
        return [segment for segment in self.segments if segment.status not in ("ok", "finished")]

    def summary(self) -> str:
        """One short line for logs and the peer record's dashboard field."""
        done = sum(segment.status == "ok" for segment in self.segments)
        text = f"step {self.step}: {done}/{len(self.segments)} segments averaged in {self.seconds:.2f}s"
        compressed = sum(segment.status == "ok" and segment.mode == PSEUDO_GRADIENTS for segment in self.segments)
        if compressed:
            text += f" ({compressed} as compressed pseudo-gradients)"
        text += f", {self.bytes_sent / 1e6:.3g} MB sent"
        failed = [f"{s.index}:{s.status}" for s in self.segments if s.status != "ok"]
        if failed:
            text += "; kept local " + ",".join(failed)
        if self.rejected:
            text += f"; rejected {len(self.rejected)} poisoned"
        if self.resends:
            text += f"; {self.resends} ring streams resent"
        return text

    def as_dict(self) -> dict:
        return dict(step=self.step, seconds=self.seconds, ok=self.ok, segments=[s.as_dict() for s in self.segments],
                    failed_segments=self.failed_segments(), rejected=self.rejected, resends=self.resends,
                    bytes_sent=self.bytes_sent)


class MultiRingAverager:
    """Serves the ring handler on a peer's P2P and averages this peer's segments, all rings at once.

    :param routes: this peer's routes (its DHT node's), whose P2P the handler is registered on
    :param run: run name; messages of another run are refused
    :param timeout: seconds one ring may take before it ends and its segment keeps the local value
    :param compression: the codec of the floats on the wire (``codecs.CODECS``: ``none``, 16 bits, or blockwise
        ``int8`` ... ``int3``); every member must use the same; summing happens in float32
    :param part_bytes: size of the streamed parts of a serialized chunk
    :param streams_per_step: concurrent streams one ring message is dealt over (see "Stripes" in ``wire.py``)
    :param max_buffered_bytes: cap on chunks held for rings that have not asked for them yet (early
        peers), shared among our ring partners, so no member can make us hold unbounded memory
    :param max_message_bytes: a larger stream of a ring message is refused before it is read
    :param max_scale: a received chunk whose largest magnitude exceeds this many times the sum its
        contributions could reach at our own values' scale (at least 1 per element) is refused as poisoned
    :param aggregation: the run spec's ``aggregation``: ``mean`` (summed along each ring), or ``trimmed_mean``
        or ``centered_clip``, aggregated robustly by each chunk's owner (``robust_ring.py``)
    """

    def __init__(self, routes: Routes, run: str, timeout: float = 30.0, compression: Codec = RAW,
                 part_bytes: int = PART_BYTES, streams_per_step: int = STREAMS_PER_STEP,
                 max_buffered_bytes: int = 2 * 1024**3, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 max_scale: float = 100.0, aggregation: str = MEAN):
        self.routes, self.p2p = routes, routes.p2p
        self.run, self.timeout, self.compression = run, timeout, compression
        self.part_bytes, self.max_message_bytes = part_bytes, max_message_bytes
        self.robust = aggregation != MEAN  # its rings send each chunk to its owner (robust_ring.py)
        self.peer_id = self.p2p.peer_id.to_base58()
        self.last_result: Optional[RoundResult] = None
        self.mailbox = Mailbox(max_buffered_bytes, compression)
        self.sender = RingSender(routes, run, streams_per_step)
        self.ring_peer = RingPeer(self.peer_id, self.mailbox, self.sender, self._in_background, timeout, compression,
                                  part_bytes, max_scale, attempt_for(aggregation))
        self._control_tasks: Set[asyncio.Task] = set()  # notes still being sent
        self._serving: Set[asyncio.Task] = set()  # handler calls still reading a message or sending its reply
        self._last_stream = -math.inf  # time.monotonic() when the last ring stream reached us
        self.rejected = 0  # messages refused as hostile input: malformed, from outside the ring, out of bounds
        self.last_rejected: Optional[str] = None  # the last of them, with its reason
        self.on_rejected: Callable[[str], None] = lambda what: None  # told each of them (the peer's record counts)
        self.turned_away = 0  # messages refused for when they came (TURNED_AWAY)

    @property
    def last_finished_step(self) -> int:
        return self.mailbox.last_finished_step

    def enter(self, step: int) -> None:
        """This peer takes part in round ``step`` now: an earlier round it has not finished is over for it, and a
        member that waits in one is told so when it asks (it leaves that round, not waits its timeout out)."""
        self.mailbox.entered_step = max(self.mailbox.entered_step, step)

    def follow(self, expecting: Callable[[], Optional[Expected]]) -> None:
        """Take ring messages as ``expecting()`` says at the time each arrives (None: none): the owner's rings
        in the plan it follows, and the rounds near its training step."""
        self.mailbox.expecting = expecting

    def expect(self, rings: Sequence[Ring], step: int) -> None:
        """Take ring messages for round ``step`` only, from the members of those of ``rings`` we are in."""
        expected = Expected(rings, self.peer_id, step, step)
        self.follow(lambda: expected)

    async def start(self) -> None:
        # forwardable: a ring partner behind another NAT reaches us through a backbone (reversal.py)
        await self.routes.add_forwardable_handler(RING_HANDLER, self._serve)

    async def shutdown(self, quiet_for: float = RESEND_QUIET, at_most: float = CONTROL_TIMEOUT) -> None:
        """Give the last notes to other members, our replies to their last messages, and their resends of
        messages whose reply was lost a moment to arrive (at most ``at_most`` seconds), then stop serving.

        A round ends here once every part of the last message was read, which can be before the handler's
        reply has left, and a reply can be lost on the way: a peer that stopped then would make the sender of
        that message, which sees no reply, send it again to a peer that is gone and fail a ring every member
        had completed. So it waits for handler calls in flight and for ``quiet_for`` without a new stream.
        """
        deadline = time.monotonic() + at_most
        while (left := deadline - time.monotonic()) > 0:
            pending = self._control_tasks | self._serving
            quiet = self._last_stream + quiet_for - time.monotonic()
            if pending:
                await asyncio.wait(pending, timeout=left)
            elif quiet > 0:
                await asyncio.sleep(min(quiet, left))
            else:
                break
        for task in list(self._control_tasks):
            task.cancel()
        await asyncio.gather(*self._control_tasks, return_exceptions=True)
        await self.p2p.remove_binary_stream_handler(RING_HANDLER)

    def _in_background(self, note: Coroutine) -> None:
        task = asyncio.create_task(note)
        self._control_tasks.add(task)
        task.add_done_callback(self._control_tasks.discard)

    # ---- receiving -------------------------------------------------------------------------------------

    async def _serve(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One stripe of a ring message: read it within the size limit and the timeout, filing its parts as they
        come."""
        serving = asyncio.current_task()
        self._serving.add(serving)
        self._last_stream = time.monotonic()
        try:
            await self._serve_stream(stream_info, reader, writer)
        finally:
            self._serving.discard(serving)

    async def _serve_stream(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sender = stream_info.peer_id.to_base58()
        filling: List[Inbox] = []  # the inbox this stream fills, once its metadata named one

        def broken() -> None:
            # not an error here: the sender sends the message again, or the ring's deadline ends it
            logger.debug(f"{RING_HANDLER}: a message from {sender[-8:]} broke off")

        with closing(writer):
            reply = await message_reply(RING_HANDLER, stream_info.peer_id,
                                        lambda: self._read_message(reader, sender, filling), self.timeout,
                                        on_refused=lambda reason: self._refused(sender, reason), on_broken=broken)
            if reply is None:
                return
            if isinstance(reply, RPCError):
                for inbox in filling:
                    inbox.refuse(f"refused: {reply.message}")
            # the sender (RingSender, over Routes.call) closes once it has the reply: closing first here could
            # lose the reply on its way, and the sender would send the whole stripe again (transport.call_stream)
            await send_reply(reply, reader, writer, linger=True)

    async def _read_message(self, reader: asyncio.StreamReader, sender: str,
                            filling: List[Inbox]) -> runtime_pb2.ExpertResponse:
        """Read frames up to the end of stream; the first one's metadata says where the parts go."""
        message, inbox, index = None, None, 0
        # a frame is the metadata, or one part of at most part_bytes (a sender's default too): a stranger's one
        # frame of 512 MiB was read whole before the metadata of the first was even looked at
        largest_frame = max(self.part_bytes, PART_BYTES) + MAX_METADATA_BYTES
        async for frame in iterate_frames(reader, self.max_message_bytes, max_frame_bytes=largest_frame):
            if message is None:
                message = self._decode(frame.metadata)
                if not isinstance(message, RingPart):
                    continue  # a note carries no tensor
                inbox = self.mailbox.inbox_for(message, sender)  # refused here if the sender is in no ring
                if inbox is not None:
                    inbox.join(message.stripes, CODECS[message.codec])
                    filling.append(inbox)
            elif not isinstance(message, RingPart):
                raise ValueError("a ring note or probe is one frame, its metadata: this one goes on")
            for part in frame.tensors:
                if inbox is not None:
                    self.mailbox.file(inbox, message.stripe, index, part)
                index += 1
        if message is None:
            raise ValueError("empty message: no frames before end of stream")
        reply = RingReply()
        if isinstance(message, RingProbe):
            reply = self.mailbox.probe(message, sender)
        elif not isinstance(message, RingPart):
            state = self.mailbox.note(message, sender)
            if isinstance(message, RingArrive):
                reply = RingReply(arrived=state.here, anchor=state.anchor if state.here else None)
            elif message.excluded:
                reply = RingReply(left_out=self.mailbox.left_out_of(message.excluded) or None)
        elif inbox is not None and not inbox.taken:
            inbox.end_stripe(message.stripe, index)  # a stripe may be empty, the whole message may not
        return make_response(reply.as_metadata())

    def _refused(self, sender: str, reason: str) -> None:
        if any(marker in reason for marker in TURNED_AWAY):
            self.turned_away += 1
            logger.info(f"{RING_HANDLER}: turned away a message from {sender[-8:]}: {reason}")
            return
        self.rejected += 1
        self.last_rejected = f"ring message from {sender[-8:]}: {reason}"
        logger.warning(f"{RING_HANDLER}: rejected a message from {sender}: {reason}")
        self.on_rejected(self.last_rejected)

    def _decode(self, raw: bytes) -> Union[RingPart, RingArrive, RingAbort, RingProbe]:
        """The first frame's metadata, refused unless it fits its schema and is of our run (the mailbox checks
        its round as it files it)."""
        message = decode_ring_message(raw)
        if message.run != self.run:
            raise MessageError(f"this peer averages run {self.run!r}, not {message.run!r}")
        return message

    # ---- a round ---------------------------------------------------------------------------------------

    async def average(self, step: int, local: torch.Tensor, local_start: int, rings: Sequence[Ring],
                      patience: Optional[Patience] = None, pseudo_gradient: Optional[torch.Tensor] = None,
                      anchors: Optional[Dict[int, Optional[str]]] = None) -> RoundResult:
        """Average every segment this peer owns with its owners in the other clusters, all rings at once.

        Each ring first waits for every member to reach the round (each says so to the others as it does):
        up to the timeout, and then for as long as ``patience`` says a missing member is on its way. Only then
        does the ring's own timeout start, so a member that trains slower than the others (its cluster is
        slower, its machine is busy) costs the others a wait, not the round.

        :param step: the training step that names this round; every member must use the same one
        :param local: this peer's flat float32 range of the vector; averaged segments are written in place
        :param local_start: the flat-vector index of ``local[0]``
        :param rings: the rings this peer is a member of (see ``segments.rings_of``); it must be expecting their
            messages for this round (:meth:`expect`, :meth:`follow`), or their members could not reach it
        :param patience: asked, once the wait for missing members passed the timeout, how many seconds more
            to wait for them; None gives up then
        :param pseudo_gradient: beside ``local``, its pseudo-gradient (same range; None: we have no outer state):
            a ring whose members all have our anchor averages it in our codec instead of ``local``, any other
            ring averages ``local`` in float32 (``ring.RingRound``; each segment's result says which it averaged)
        :param anchors: given (even empty), we average pseudo-gradients where our rings agree: by ring index, the
            digest of our outer state over its segment (missing or None: we have none); None: every ring
            averages ``local`` in our codec
        """
        if step <= self.last_finished_step:
            raise ValueError(f"step {step} is not after the last averaged step {self.last_finished_step}")
        expected = self.mailbox.expecting()
        for ring in rings:
            if not (local_start <= ring.start and ring.end <= local_start + local.numel()):
                raise ValueError(f"ring {ring.index} [{ring.start}, {ring.end}) is not inside this peer's range")
            if expected is None or not expected.first_step <= step <= expected.last_step \
                    or expected.members(step, ring.index) != frozenset(ring.members):
                raise RingsChanged(f"ring {ring.index} of round {step} is not among those this peer takes messages for "
                                   f"now: a plan adopted as the round began changed its rings")
        if pseudo_gradient is not None and pseudo_gradient.shape != local.shape:
            raise ValueError(f"a pseudo-gradient of {pseudo_gradient.numel()} values for {local.numel()} parameters")
        self.enter(step)
        started, sent_before = time.monotonic(), self.sender.bytes_sent
        log = RoundLog()

        def ring_round(ring: Ring) -> RingRound:
            where = slice(ring.start - local_start, ring.end - local_start)
            return RingRound(self.ring_peer, step, ring, local[where], log, anchors is not None,
                             None if pseudo_gradient is None else pseudo_gradient[where], (anchors or {}).get(ring.index))

        results = await asyncio.gather(*(ring_round(ring).run(started, patience) for ring in rings))
        self.mailbox.finish_round(step)
        result = RoundResult(step, time.monotonic() - started, list(results), log.rejected, log.resends,
                             self.sender.bytes_sent - sent_before)
        self.last_result = result
        (logger.warning if result.failed else logger.info)(f"averaging {result.summary()}")
        return result


class RingsChanged(ValueError):
    """A round asked for rings this peer no longer follows: a plan adopted between the round's start and its first
    message changed them (:meth:`MultiRingAverager.follow`). The round fails; the next one has the new rings."""


def waiting_at() -> str:
    """Where this process's pending averaging tasks wait, counted: each task's innermost frame, and the innermost
    of ours above it where that one is a library's. What a round that outlived its limit says, so that the cause of
    a stall can be read from one line of a soak's log."""
    here = Counter()
    for task in asyncio.all_tasks():
        frames = awaiting_frames(task.get_coro())
        if task.done() or not any("/ravnest_swarm/averaging/" in frame.f_code.co_filename for frame in frames):
            continue
        ours = [frame for frame in frames if "/ravnest_swarm/" in frame.f_code.co_filename]
        places = [frames[-1]] if frames[-1] is ours[-1] else [ours[-1], frames[-1]]
        here[" > ".join(f"{Path(f.f_code.co_filename).name}:{f.f_lineno} {f.f_code.co_name}" for f in places)] += 1
    return "; ".join(f"{count}x {place}" for place, count in here.most_common()) or "no averaging task"


def awaiting_frames(coroutine) -> list:
    """The frames of a suspended coroutine and of what it awaits, outermost first (``Task.get_stack`` gives only
    the outermost: a suspended coroutine's frame has no ``f_back``)."""
    frames = []
    while coroutine is not None:
        frame = getattr(coroutine, "cr_frame", None) or getattr(coroutine, "gi_frame", None)
        if frame is None:
            break
        frames.append(frame)
        coroutine = getattr(coroutine, "cr_await", None) or getattr(coroutine, "gi_yieldfrom", None)
    return frames
