"""Parallel multi-ring all-reduce over hivemind P2P streaming handlers.

A peer serves one handler, ``ravnest.averaging.ring``. Each message goes over ``streams_per_step``
concurrent streams (stripes) of ``ExpertRequest``: the first request of each carries the msgpack metadata
(run, step, ring, attempt, phase, position, stripe, stripes) and every further one carries one part of the
chunk, a whole ``serialize_torch_tensor`` protobuf; stripe j carries parts j, j + stripes, ... The handler only
files the tensor in a mailbox keyed by (step, ring, attempt, phase, position, sender) and answers at
once; the ring coroutine that expects it takes it from there. So a peer that starts its round early
never waits for a late one to be listening, and every round is named by its training step: a message
for a step that is over here is refused, one for a later step waits in the mailbox.

Faults. A stripe whose stream fails on the transport (closed or reset, reply lost) is sent again from
its first part, a bounded number of times within the ring's deadline; the receiver numbers the parts of
each stripe by their order in its stream and keeps each part once, so a resend never counts twice.
Each ring has its own deadline: a member that does not answer in time ends that ring only,
the segment keeps its local value, and the other members are told to stop at once. A received chunk
with NaN or Inf, or absurdly scaled (its largest magnitude above ``max_scale`` times what that many
contributions of our own size could sum to), is refused: in a ring every forwarded partial sum was
checked by its receiver, so such a chunk can only come from the sender's own contribution. The
receiver names that sender, tells the ring, and the remaining members run the ring again without it.

Pipelining. A ring step's chunk travels as parts of ``part_bytes``, each its own serialized tensor in its
own frame, and the handler files every part the moment it is read. The ring coroutine adds a part as soon
as it arrives and the same part of the next step goes out at once (all of an attempt's streams are open
from its start), so transfer, summing and (de)serialization of different parts overlap instead of each
step waiting for a whole chunk. All-gather parts are forwarded as received, not serialized again. Nothing
segment-sized precedes the first send: our own chunk is serialized part by part as its streams open.

Stripes. One yamux stream moves at most its flow-control window per round trip: in the lab (100 Mbit/s,
20 ms one-way) one P2P stream carried 8.8 MB/s where raw TCP carried 11.8, and two concurrent streams
11.75. So a step's parts are dealt round-robin over ``STREAMS_PER_STEP`` streams to the same peer.

Hostile input. The handler reads frames itself (within ``max_message_bytes`` and the ring timeout): a
message over the limit, a truncated protobuf or a silent stream gets an error with a reason, and the
mailbox holds at most ``max_buffered_bytes`` and ``MAX_MAILBOX_ENTRIES`` early messages.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from contextlib import closing
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.compression.base import CompressionBase, NoCompression
from hivemind.p2p import P2PDaemonError, P2PHandlerError, PeerID
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError

from ravnest_swarm.averaging.segments import Ring, chunk_bounds
from ravnest_swarm.net.routes import Routes
from ravnest_swarm.net.transport import iterate_frames, make_request, make_response, message_reply, send_reply, unpack_metadata

logger = logging.getLogger(__name__)

RING_HANDLER = "ravnest.averaging.ring"
PART_BYTES = 512 * 1024
STREAMS_PER_STEP = 2  # measured: two streams fill a 100 Mbit/s, 40 ms round-trip link, one fills 75 % of it
MAX_STRIPES = 8  # a receiver accepts messages striped over at most this many streams
CONTROL_TIMEOUT = 2.0
MAX_MAILBOX_ENTRIES = 4096  # early messages (and ring states) held for rounds not yet asked for
REDUCE, GATHER, ABORT, ARRIVE = "reduce", "gather", "abort", "arrive"
NOTES = (ABORT, ARRIVE)  # phases that carry no tensor: notes about a ring's members
MAX_RESENDS = 3  # per message; each waits RESEND_BACKOFF x its number first
RESEND_BACKOFF = 0.1
# a stopping peer stays this long after the last ring stream it was sent: a sender whose reply was lost sends
# the stripe again after RESEND_BACKOFF plus a dial, and a peer that had gone would fail its complete ring
RESEND_QUIET = 0.5
# hivemind's asingle() when a stream closed with no reply: p2pd did this under load to whole messages
EMPTY_REPLY = "got an empty iterable"
ROUND_OVER = "is over here"  # how a peer refuses a message for a round it has finished

# How long a ring waits for a member that has not reached the round yet, beyond the ring timeout: the caller
# (a volunteer) estimates it from the member's progress (steps left at its pace); 0 gives up
Patience = Callable[[int, List[str]], Awaitable[float]]


class RingAborted(Exception):
    """Another member of the ring changed its membership (``excluded``) or ended it (``failure``)."""


class ContributionRejected(Exception):
    """A chunk from ``peer`` held NaN or Inf, was absurdly scaled, or had the wrong size."""

    def __init__(self, peer: str, reason: str):
        super().__init__(reason)
        self.peer = peer


@dataclass
class SegmentResult:
    """How one ring ended for this peer.

    ``status`` is ``ok`` (averaged), ``timeout`` (a member did not answer in time), ``failed`` (a send
    failed or another member ended the ring), ``excluded`` (our own contribution was refused) or
    ``alone`` (every other member was excluded); all but ``ok`` keep the local value.
    """

    index: int
    start: int
    end: int
    status: str
    members: int
    detail: str = ""

    def as_dict(self) -> dict:
        return dict(index=self.index, start=self.start, end=self.end, status=self.status, members=self.members,
                    detail=self.detail)


@dataclass
class RoundResult:
    """One averaging round of this peer: a result per ring, every refused contribution, and how many ring
    streams (stripes of its messages) it sent again after a transport failure."""

    step: int
    seconds: float
    segments: List[SegmentResult]
    rejected: List[dict] = field(default_factory=list)
    resends: int = 0

    @property
    def ok(self) -> bool:
        return all(segment.status == "ok" for segment in self.segments)

    def failed_segments(self) -> List[int]:
        return [segment.index for segment in self.segments if segment.status != "ok"]

    def summary(self) -> str:
        """One short line for logs and the peer record's dashboard field."""
        done = sum(segment.status == "ok" for segment in self.segments)
        text = f"step {self.step}: {done}/{len(self.segments)} segments averaged in {self.seconds:.2f}s"
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
                    failed_segments=self.failed_segments(), rejected=self.rejected, resends=self.resends)


class _Inbox:
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


class _RingState:
    """What the members of one ring in one round have told us: who arrived, exclusions, whether it was ended."""

    def __init__(self):
        self.arrived: Set[str] = set()
        self.excluded: Set[str] = set()
        self.failure: Optional[str] = None
        self.changed = asyncio.Event()  # exclusions or failure: a running attempt must start over or end
        self.arrival = asyncio.Event()  # someone new arrived: only the wait before the first attempt cares

    async def news(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for a change or an arrival; whether one came."""
        waits = [asyncio.create_task(self.changed.wait()), asyncio.create_task(self.arrival.wait())]
        try:
            done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        return bool(done)


class MultiRingAverager:
    """Serves the ring handler on a peer's P2P and averages this peer's segments, all rings at once.

    :param routes: this peer's routes (its DHT node's), whose P2P the handler is registered on
    :param run: run name; messages of another run are refused
    :param timeout: seconds one ring may take before it ends and its segment keeps the local value
    :param compression: hivemind compression for the floats on the wire (``NoCompression``,
        ``Float16Compression``, ``Uniform8BitQuantization``); summing happens in float32
    :param part_bytes: size of the streamed parts of a serialized chunk
    :param streams_per_step: concurrent streams one ring message is dealt over (see "Stripes" above)
    :param max_buffered_bytes: cap on chunks held for rings that have not asked for them yet (early
        peers), so a stranger cannot make us hold unbounded memory
    :param max_message_bytes: a larger stream of a ring message is refused before it is read
    :param max_scale: a received chunk whose largest magnitude exceeds this many times the sum its
        contributions could reach at our own values' scale (at least 1 per element) is refused as poisoned
    """

    def __init__(self, routes: Routes, run: str, timeout: float = 30.0, compression: CompressionBase = NoCompression(),
                 part_bytes: int = PART_BYTES, streams_per_step: int = STREAMS_PER_STEP,
                 max_buffered_bytes: int = 2 * 1024**3, max_message_bytes: int = 512 * 1024**2,
                 max_scale: float = 100.0):
        if not 1 <= streams_per_step <= MAX_STRIPES:
            raise ValueError(f"streams_per_step must be 1-{MAX_STRIPES}")
        self.routes, self.p2p = routes, routes.p2p
        self.run, self.timeout, self.compression = run, timeout, compression
        self.part_bytes, self.streams_per_step, self.max_buffered_bytes = part_bytes, streams_per_step, max_buffered_bytes
        self.max_message_bytes, self.max_scale = max_message_bytes, max_scale
        self.peer_id = self.p2p.peer_id.to_base58()
        self.last_finished_step = -1
        self.last_result: Optional[RoundResult] = None
        self._mailbox: Dict[tuple, _Inbox] = {}
        self._delivered: Set[tuple] = set()  # messages complete when the last round ended: their resends are acked
        self._buffered_bytes = 0
        self._rings: Dict[Tuple[int, int], _RingState] = {}
        self._control_tasks: Set[asyncio.Task] = set()
        self._serving: Set[asyncio.Task] = set()  # handler calls still reading a message or sending its reply
        self._last_stream = -math.inf  # time.monotonic() when the last ring stream reached us

    async def start(self) -> None:
        # forwardable: a ring partner behind another NAT reaches us through a backbone (reversal.py)
        await self.routes.add_forwardable_handler(RING_HANDLER, self._serve)

    async def shutdown(self) -> None:
        """Give the last notes to other members, our replies to their last messages, and their resends of
        messages whose reply was lost a moment to arrive (at most ``CONTROL_TIMEOUT``), then stop serving.

        A round ends here once every part of the last message was read, which can be before the handler's
        reply has left, and a reply can be lost on the way: a peer that stopped then would make the sender of
        that message, which sees no reply, send it again to a peer that is gone and fail a ring every member
        had completed. So it waits for handler calls in flight and for ``RESEND_QUIET`` without a new stream.
        """
        deadline = time.monotonic() + CONTROL_TIMEOUT
        while (left := deadline - time.monotonic()) > 0:
            pending = self._control_tasks | self._serving
            quiet = self._last_stream + RESEND_QUIET - time.monotonic()
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
        filling: List[_Inbox] = []  # the inbox this stream fills, once its metadata named one

        def broken() -> None:
            # not an error here: the sender sends the message again, or the ring's deadline ends it
            logger.debug(f"{RING_HANDLER}: a message from {sender[-8:]} broke off")

        with closing(writer):
            reply = await message_reply(RING_HANDLER, stream_info.peer_id,
                                        lambda: self._read_message(reader, sender, filling), self.timeout,
                                        on_broken=broken)
            if reply is None:
                return
            if isinstance(reply, RPCError):
                for inbox in filling:
                    if not inbox.complete and inbox.error is None:
                        inbox.error = f"refused: {reply.message}"
                        inbox.notify()
            await send_reply(reply, reader, writer)

    async def _read_message(self, reader: asyncio.StreamReader, sender: str,
                            filling: List[_Inbox]) -> runtime_pb2.ExpertResponse:
        """Read frames up to the end of stream; the first one's metadata says where the parts go."""
        metadata, inbox, index = None, None, 0
        async for frame in iterate_frames(reader, self.max_message_bytes):
            if metadata is None:
                metadata = self._check_metadata(unpack_metadata(frame.metadata))
                if metadata["phase"] not in NOTES:
                    inbox = self._inbox_for(metadata, sender)
                    if inbox is not None:
                        inbox.join(metadata["stripes"])
                        filling.append(inbox)
            if metadata["phase"] in NOTES:
                continue  # a note carries no tensor
            for part in frame.tensors:
                if inbox is not None:
                    self._file(inbox, metadata["stripe"], index, part)
                index += 1
        if metadata is None:
            raise ValueError("empty message: no frames before end of stream")
        if metadata["phase"] in NOTES:
            step, ring = metadata["step"], metadata["ring"]
            if (step, ring) not in self._rings and len(self._rings) >= MAX_MAILBOX_ENTRIES:
                raise ValueError("too many rings pending here; retry later")
            if metadata["phase"] == ABORT:
                self._on_abort(step, ring, sender, metadata)
            else:
                self._on_arrive(step, ring, sender)
            return make_response({})
        if inbox is not None and not inbox.taken:
            inbox.end_stripe(metadata["stripe"], index)  # a stripe may be empty, the whole message may not
        return make_response({})

    def _inbox_for(self, metadata: dict, sender: str) -> Optional[_Inbox]:
        """The inbox a message fills; None for a resend of one that was complete when its round ended."""
        key = (metadata["step"], metadata["ring"], tuple(metadata["attempt"]), metadata["phase"],
               metadata["position"], sender)
        if key[0] <= self.last_finished_step:
            if key in self._delivered:
                return None  # the sender lost our reply: acknowledge again, keep nothing
            raise ValueError(f"round {key[0]} {ROUND_OVER} (last finished {self.last_finished_step})")
        if key not in self._mailbox and len(self._mailbox) >= MAX_MAILBOX_ENTRIES:
            raise ValueError("too many ring messages waiting here; retry later")
        return self._slot(key)

    def _file(self, inbox: _Inbox, stripe: int, index: int, part: runtime_pb2.Tensor) -> None:
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
        try:
            tensor = deserialize_torch_tensor(part)
        except Exception as e:
            raise ValueError(f"ring chunk could not be decoded ({type(e).__name__})")
        inbox.parts[stripe + index * inbox.stripes] = (tensor, part, size)
        inbox.accepted[stripe] += 1
        self._buffered_bytes += size
        inbox.notify()

    def _check_metadata(self, metadata: dict) -> dict:
        expected = dict(run=str, step=int, ring=int, phase=str, position=int, attempt=list)
        for name, kind in expected.items():
            if not isinstance(metadata.get(name), kind):
                raise ValueError(f"ring message needs '{name}' ({kind.__name__})")
        if metadata["run"] != self.run:
            raise ValueError(f"this peer averages run {self.run!r}, not {metadata['run']!r}")
        if metadata["phase"] in NOTES and metadata["step"] <= self.last_finished_step:
            raise ValueError(f"round {metadata['step']} {ROUND_OVER} (last finished {self.last_finished_step})")
        if metadata["phase"] not in (REDUCE, GATHER, *NOTES):
            raise ValueError(f"unknown ring phase {metadata['phase']!r}")
        # the mailbox key is built from these: they must be hashable and small
        if not all(isinstance(peer, str) and len(peer) <= 128 for peer in metadata["attempt"]):
            raise ValueError("ring message 'attempt' must list peer ids")
        # without these fields a message is one stream
        stripe, stripes = metadata.setdefault("stripe", 0), metadata.setdefault("stripes", 1)
        if not (type(stripe) is int and type(stripes) is int and 0 <= stripe < stripes <= MAX_STRIPES):
            raise ValueError(f"ring message needs 0 <= stripe < stripes <= {MAX_STRIPES}")
        return metadata

    def _slot(self, key: tuple) -> _Inbox:
        if key not in self._mailbox:
            self._mailbox[key] = _Inbox()
        return self._mailbox[key]

    def _ring_state(self, step: int, ring: int) -> _RingState:
        return self._rings.setdefault((step, ring), _RingState())

    def _on_arrive(self, step: int, ring: int, sender: str) -> None:
        state = self._ring_state(step, ring)
        if sender not in state.arrived:
            state.arrived.add(sender)
            state.arrival.set()

    def _on_abort(self, step: int, ring: int, sender: str, metadata: dict) -> None:
        state = self._ring_state(step, ring)
        excluded = {peer for peer in metadata.get("excluded", []) if isinstance(peer, str)}
        if not excluded <= state.excluded:
            state.excluded |= excluded
            state.changed.set()
        if metadata.get("failure") and state.failure is None:
            state.failure = f"ended by {sender[-8:]}: {str(metadata['failure'])[:200]}"
            state.changed.set()

    async def _receive(self, key: tuple, deadline: float) -> AsyncIterator[Tuple[torch.Tensor, runtime_pb2.Tensor]]:
        """The parts of one expected message, in order, as they arrive (values, and the part as sent)."""
        inbox = self._slot(key)
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
            self._buffered_bytes -= sum(size for _, _, size in inbox.parts.values())
            inbox.parts.clear()

    # ---- sending ---------------------------------------------------------------------------------------

    async def _send(self, peer: str, metadata: dict, outbox: Optional["_Outbox"], deadline: float) -> int:
        """One message: every part of ``outbox`` as soon as it is ready, dealt round-robin over
        ``streams_per_step`` concurrent streams (None: no tensor, one stream).

        Each stripe is resent on its own (``_send_stream``); the message fails if one of them does, and is
        delivered when all are. Returns how many times a stripe was sent again.
        """
        if outbox is None:
            return await self._send_stream(peer, metadata, None, deadline)
        stripes = self.streams_per_step
        sends = [asyncio.create_task(self._send_stream(peer, dict(metadata, stripe=stripe, stripes=stripes),
                                                       lambda stripe=stripe: outbox.stripe(stripe, stripes), deadline))
                 for stripe in range(stripes)]
        try:
            resends = sum(await asyncio.gather(*sends))
        finally:
            for send in sends:
                send.cancel()
            await asyncio.gather(*sends, return_exceptions=True)
        outbox.delivered()
        return resends

    async def _send_stream(self, peer: str, metadata: dict,
                           parts: Optional[Callable[[], AsyncIterator[runtime_pb2.Tensor]]], deadline: float) -> int:
        """One stream: the metadata, then every part ``parts()`` yields as soon as it is ready (None: none).

        A transport failure (the stream closed or reset, the reply lost) sends it again from its first part, up
        to ``MAX_RESENDS`` times within ``deadline``; the receiver keeps each part once. A refusal from the
        receiver is final. Returns how many times the stream was sent again.
        """
        metadata = dict(metadata, run=self.run)
        links, peer_id = self.routes, PeerID.from_base58(peer)
        route = links.chosen.get(peer_id)

        async def stream():
            # the metadata goes alone: a stripe of a message shorter than its stripes carries no part
            yield make_request(metadata)
            if parts is not None:
                async for part in parts():
                    yield runtime_pb2.ExpertRequest(tensors=[part])

        resends = 0
        while True:
            try:
                await asyncio.wait_for(links.call(peer_id, RING_HANDLER, stream(), runtime_pb2.ExpertResponse),
                                       max(0.0, deadline - time.monotonic()))
                return resends
            except (P2PHandlerError, asyncio.TimeoutError):
                raise
            except Exception as e:
                lost = isinstance(e, (ConnectionError, asyncio.IncompleteReadError, P2PDaemonError)) or (
                    isinstance(e, ValueError) and EMPTY_REPLY in str(e))
                backoff = RESEND_BACKOFF * (resends + 1)
                if not lost or resends == MAX_RESENDS or time.monotonic() + backoff >= deadline:
                    raise
                resends += 1
                what = (f"{metadata['phase']} {metadata['position']} of ring {metadata['ring']}"
                        f" (stripe {metadata.get('stripe', 0)})")
                logger.warning(f"ring message {what} to {peer[-8:]} was lost ({type(e).__name__}: {e}); "
                               f"sending it again ({resends}/{MAX_RESENDS})")
                if route is not None:
                    links.chosen.setdefault(peer_id, route)  # Routes forgets a route after a failed call
                await asyncio.sleep(backoff)

    def _say_arrived(self, step: int, ring: Ring, state: _RingState, deadline: float) -> None:
        """Tell every other member, in the background, that we reached round ``step``: each starts the ring once
        all have. A member that refuses it as a round it has finished will never come: that ends the ring."""

        async def tell(member: str) -> None:
            try:
                await self._send(member, dict(step=step, ring=ring.index, phase=ARRIVE, position=0, attempt=[]),
                                 None, deadline)
            except P2PHandlerError as e:
                if ROUND_OVER in str(e) and state.failure is None:
                    state.failure = f"{member[-8:]} is past round {step}"
                    state.changed.set()
            except Exception as e:  # unreachable: the wait for its own note, or the ring, runs out of time
                logger.debug(f"could not tell {member[-8:]} we reached round {step}: {e}")

        for member in ring.members:
            if member != self.peer_id:
                task = asyncio.create_task(tell(member))
                self._control_tasks.add(task)
                task.add_done_callback(self._control_tasks.discard)

    def _tell_ring(self, step: int, ring: Ring, members: Sequence[str], **fields) -> None:
        """Best effort, in the background: the ring's result does not wait for these notes to arrive."""
        metadata = dict(step=step, ring=ring.index, phase=ABORT, position=0, attempt=[], **fields)
        for member in members:
            if member != self.peer_id:
                task = asyncio.create_task(self._send_quietly(member, metadata))
                self._control_tasks.add(task)
                task.add_done_callback(self._control_tasks.discard)

    async def _send_quietly(self, peer: str, metadata: dict) -> None:
        try:
            await self._send(peer, metadata, None, time.monotonic() + CONTROL_TIMEOUT)
        except Exception as e:
            logger.debug(f"could not tell {peer[-8:]} about ring {metadata['ring']}: {e}")

    # ---- a round ---------------------------------------------------------------------------------------

    async def average(self, step: int, local: torch.Tensor, local_start: int, rings: Sequence[Ring],
                      patience: Optional[Patience] = None) -> RoundResult:
        """Average every segment this peer owns with its owners in the other clusters, all rings at once.

        Each ring first waits for every member to reach the round (each says so to the others as it does):
        up to the timeout, and then for as long as ``patience`` says a missing member is on its way. Only then
        does the ring's own timeout start, so a member that trains slower than the others (its cluster is
        slower, its machine is busy) costs the others a wait, not the round.

        :param step: the training step that names this round; every member must use the same one
        :param local: this peer's flat float32 range of the vector; averaged segments are written in place
        :param local_start: the flat-vector index of ``local[0]``
        :param rings: the rings this peer is a member of (see ``segments.rings_of``)
        :param patience: asked, once the wait for missing members passed the timeout, how many seconds more
            to wait for them; None gives up then
        """
        if step <= self.last_finished_step:
            raise ValueError(f"step {step} is not after the last averaged step {self.last_finished_step}")
        for ring in rings:
            if not (local_start <= ring.start and ring.end <= local_start + local.numel()):
                raise ValueError(f"ring {ring.index} [{ring.start}, {ring.end}) is not inside this peer's range")
        started = time.monotonic()
        log = _RoundLog()
        results = await asyncio.gather(*(
            self._run_ring(step, ring, local[ring.start - local_start:ring.end - local_start], started, log, patience)
            for ring in rings
        ))
        self._finish_round(step)
        result = RoundResult(step, time.monotonic() - started, list(results), log.rejected, log.resends)
        self.last_result = result
        (logger.info if result.ok else logger.warning)(f"averaging {result.summary()}")
        return result

    def _finish_round(self, step: int) -> None:
        self.last_finished_step = step
        self._delivered = {key for key, inbox in self._mailbox.items() if key[0] == step and inbox.complete}
        for key in [key for key in self._mailbox if key[0] <= step]:
            inbox = self._mailbox.pop(key)
            self._buffered_bytes -= sum(size for _, _, size in inbox.parts.values())
            inbox.parts.clear()
            inbox.error = inbox.error or "arrived after its round ended"
            inbox.notify()
        for key in [key for key in self._rings if key[0] <= step]:
            del self._rings[key]

    async def _run_ring(self, step: int, ring: Ring, segment: torch.Tensor, started: float,
                        log: "_RoundLog", patience: Optional[Patience]) -> SegmentResult:
        state = self._ring_state(step, ring.index)
        self._say_arrived(step, ring, state, started + self.timeout)
        waiting_until = started + self.timeout  # for members that have not reached the round
        deadline: Optional[float] = None  # the ring's own, from the moment every member is here
        while True:
            state.changed.clear()  # before looking: a note that comes while we look wakes the wait below
            state.arrival.clear()
            members = [member for member in ring.members if member not in state.excluded]
            if self.peer_id not in members:
                return SegmentResult(ring.index, ring.start, ring.end, "excluded", len(members),
                                     "our contribution was refused by the ring")
            if state.failure is not None:
                return SegmentResult(ring.index, ring.start, ring.end, "failed", len(members), state.failure)
            if len(members) < 2:
                return SegmentResult(ring.index, ring.start, ring.end, "alone", 1, "every other member was excluded")
            missing = [member for member in members if member != self.peer_id and member not in state.arrived]
            if missing:
                if await state.news(max(0.0, waiting_until - time.monotonic())):
                    continue
                more = await patience(step, missing) if patience is not None else 0.0
                if more > 0:
                    waiting_until = time.monotonic() + more
                    continue
                reason = (f"{', '.join(member[-8:] for member in missing)} did not reach round {step} within "
                          f"{time.monotonic() - started:.0f}s")
                logger.warning(f"ring {ring.index} (elements {ring.start}-{ring.end}) timeout: {reason}")
                self._tell_ring(step, ring, members, failure=reason)
                return SegmentResult(ring.index, ring.start, ring.end, "timeout", len(members), reason[:300])
            if deadline is None:
                deadline = time.monotonic() + self.timeout
            attempt = asyncio.create_task(self._ring_attempt(step, ring, members, segment, deadline, log))
            interrupted = asyncio.create_task(state.changed.wait())
            try:
                await asyncio.wait({attempt, interrupted}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                interrupted.cancel()
            if not attempt.done():
                attempt.cancel()
                await asyncio.gather(attempt, return_exceptions=True)
                continue  # membership changed or the ring was ended: decide again from the state
            try:
                averaged = attempt.result()
            except ContributionRejected as e:
                log.rejected.append(dict(peer=e.peer, ring=ring.index, reason=str(e)))
                logger.warning(f"ring {ring.index}: refused the contribution of {e.peer[-8:]}: {e}")
                state.excluded.add(e.peer)
                self._tell_ring(step, ring, members, excluded=sorted(state.excluded))
                continue
            except (asyncio.TimeoutError, Exception) as e:
                status = "timeout" if isinstance(e, asyncio.TimeoutError) else "failed"
                reason = str(e) or type(e).__name__
                logger.warning(f"ring {ring.index} (elements {ring.start}-{ring.end}) {status}: {reason}")
                self._tell_ring(step, ring, members, failure=reason)
                return SegmentResult(ring.index, ring.start, ring.end, status, len(members), reason[:300])
            if not math.isfinite(_largest(averaged)):
                # only our own contribution can be non-finite here (every received chunk was checked): the
                # others refuse the chunk we finalized and go on without us, so we keep our local value
                return SegmentResult(ring.index, ring.start, ring.end, "excluded", len(members),
                                     "our own values are not finite")
            segment.copy_(averaged)
            return SegmentResult(ring.index, ring.start, ring.end, "ok", len(members))

    async def _ring_attempt(self, step: int, ring: Ring, members: List[str], segment: torch.Tensor,
                            deadline: float, log: "_RoundLog") -> torch.Tensor:
        """Reduce-scatter then all-gather over ``members``: 2(n-1) steps, each moving one chunk of segment/n.

        Every step has its own sending stream and receiving coroutine, all started at once. A chunk moves
        in parts: when step i has a part of its chunk (received and summed, or final), the same part
        goes out in step i+1, so consecutive steps overlap. Step i handles a part only after step i-1
        handled the same elements, which keeps every read and write of ``work`` in the order of the
        unpipelined algorithm.

        Nothing the size of the segment is done before the streams open, because a peer's link is idle until
        then (in the bench a peer of three rings spent 0.2-0.3 s cloning, scanning and serializing them first):
        step 0's parts are serialized one at a time while the streams start, ``work`` is filled as parts
        arrive instead of starting as a copy of the segment, and a chunk's scale is taken when its first
        part arrives.
        """
        count, me = len(members), members.index(self.peer_id)
        following, preceding = members[(me + 1) % count], members[(me - 1) % count]
        chunks = [slice(lo, hi) for lo, hi in chunk_bounds(segment.numel(), count)]
        # every element is written once the ring completes: reduce steps write segment + received into all chunks
        # but our own, the gather steps write every chunk but the one we finalized. The segment itself keeps its
        # local values until then, so a failed ring leaves it as it was.
        work = torch.empty_like(segment)
        base = dict(step=step, ring=ring.index, attempt=sorted(set(ring.members) - set(members)))
        compressing = not isinstance(self.compression, NoCompression)
        # honest partial sums stay within `contributions` times values of our own scale (the infinity norm:
        # one pass, no temporary the size of the chunk); taken per chunk when the first part of it arrives
        scales: Dict[int, float] = {}

        def our_scale(index: int) -> float:
            if index not in scales:
                scales[index] = max(_largest(segment[chunks[index]]), 1.0)
            return scales[index]
        steps = [(REDUCE, t, (me - t) % count, (me - t - 1) % count) for t in range(count - 1)]
        steps += [(GATHER, t, (me + 1 - t) % count, (me - t) % count) for t in range(count - 1)]
        outboxes = [_Outbox() for _ in steps]
        handled = [_Progress() for _ in steps]  # elements of its received chunk each step has handled

        def serialize(values: torch.Tensor) -> runtime_pb2.Tensor:
            return serialize_torch_tensor(values, self.compression.compression_type)

        async def send_own_chunk() -> None:
            """Step 0 sends our own values (the segment, unchanged during the attempt), a part at a time: between
            parts the other rings' coroutines run, so every stream opens and starts sending at once."""
            first = chunks[steps[0][2]]
            part_elements = max(1, self.part_bytes // 4)
            bounds = range(first.start, first.stop, part_elements) if first.stop > first.start else [first.start]
            for lo in bounds:
                outboxes[0].put(serialize(segment[lo:min(lo + part_elements, first.stop)]))
                await asyncio.sleep(0)
            outboxes[0].close()

        async def receive(index: int) -> None:
            phase, position, _, receive_chunk = steps[index]
            chunk = chunks[receive_chunk]
            length, offset = chunk.stop - chunk.start, 0
            key = (step, ring.index, tuple(base["attempt"]), phase, position, preceding)
            last_reduce = phase == REDUCE and position == count - 2
            async for received, as_sent in self._receive(key, deadline):
                n = received.numel()
                if offset + n > length:
                    raise ContributionRejected(preceding, f"chunk of more than {length} elements, expected {length}")
                if received.dtype != torch.float32:
                    received = received.float()
                received = received.reshape(-1)
                largest = _largest(received)
                if not math.isfinite(largest):
                    raise ContributionRejected(preceding, f"{phase} chunk {position} holds NaN or Inf")
                if n:
                    contributions = position + 1 if phase == REDUCE else 1
                    ours = our_scale(receive_chunk)
                    if largest > self.max_scale * contributions * ours:
                        raise ContributionRejected(preceding, f"{phase} chunk {position} is absurdly scaled "
                                                              f"(magnitude {largest:.3g}, ours {ours:.3g})")
                if index > 0:
                    previous = chunks[steps[index - 1][3]]
                    await handled[index - 1].reach(min(offset + n, previous.stop - previous.start))
                elements = slice(chunk.start + offset, chunk.start + offset + n)
                values = work[elements]
                if phase == REDUCE:
                    torch.add(segment[elements], received, out=values)
                    if last_reduce:
                        values /= count
                else:
                    values.copy_(received)
                if index + 1 < len(steps):
                    if phase == GATHER:
                        outboxes[index + 1].put(as_sent)  # forwarded exactly as the owner compressed it
                    else:
                        part = serialize(values)
                        if last_reduce and compressing:
                            # the others get our chunk through the compression: keep the same value so all agree
                            values.copy_(deserialize_torch_tensor(part).float().reshape(-1))
                        outboxes[index + 1].put(part)
                offset += n
                handled[index].advance(offset)
            if offset != length:
                raise ContributionRejected(preceding, f"chunk of {offset} elements, expected {length}")
            if index + 1 < len(steps):
                outboxes[index + 1].close()
            handled[index].advance(length, done=True)

        async def send(index: int) -> None:
            phase, position, _, _ = steps[index]
            resent = await self._send(following, dict(base, phase=phase, position=position), outboxes[index], deadline)
            log.resends += resent  # not `+= await`: that would read the count before the other sends added theirs

        tasks = [asyncio.create_task(send(i)) for i in range(len(steps))]
        tasks += [asyncio.create_task(receive(i)) for i in range(len(steps))]
        tasks.append(asyncio.create_task(send_own_chunk()))
        try:
            # the first failure (a refused contribution, a timeout, a failed send) ends the attempt
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in tasks:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()
        finally:
            for task in tasks:
                task.cancel()
            for outbox in outboxes:
                outbox.abandon()
            await asyncio.gather(*tasks, return_exceptions=True)
        return work


def _largest(values: torch.Tensor) -> float:
    """The largest magnitude in one pass without temporaries; NaN if any element is NaN, Inf if any is infinite."""
    return torch.linalg.vector_norm(values, float("inf")).item() if values.numel() else 0.0


@dataclass
class _RoundLog:
    """What a round's rings note as they go: refused contributions and ring streams sent again."""

    rejected: List[dict] = field(default_factory=list)
    resends: int = 0


class _Outbox:
    """The serialized parts one step sends, in order, as they become ready; iterate a stripe to stream it.

    Every iteration starts at the stripe's first part, so a resend repeats the whole stripe; the parts are
    kept until every stripe of the message is delivered.
    """

    def __init__(self):
        self.parts: List[runtime_pb2.Tensor] = []
        self.closed = False
        self.abandoned = False
        self.changed = asyncio.Event()

    def put(self, part: runtime_pb2.Tensor) -> None:
        self.parts.append(part)
        self.changed.set()

    def close(self) -> None:
        self.closed = True
        self.changed.set()

    def abandon(self) -> None:
        """The attempt is over: a stream still sending must break off, not end as if the message were whole.

        hivemind writes a stream in its own task, which runs before the cancellation of our send reaches it:
        were the iteration to end normally, it would send a clean end of stream after a partial message (or
        after the metadata alone), which the receiver would take for the sender's whole contribution.
        """
        self.abandoned = True
        self.changed.set()

    def delivered(self) -> None:
        self.parts.clear()

    async def stripe(self, first: int, every: int) -> AsyncIterator[runtime_pb2.Tensor]:
        """Parts ``first``, ``first + every``, ... as they become ready, until the outbox is closed."""
        index = first
        while True:
            if self.abandoned:
                raise asyncio.CancelledError("the ring attempt ended")
            if index < len(self.parts):
                index += every
                yield self.parts[index - every]
            elif self.closed:
                return
            else:
                self.changed.clear()
                await self.changed.wait()


class _Progress:
    """How many elements of its chunk a step has handled; others wait for a mark."""

    def __init__(self):
        self.value, self.done = 0, False
        self.changed = asyncio.Event()

    def advance(self, value: int, done: bool = False) -> None:
        self.value, self.done = value, self.done or done
        self.changed.set()

    async def reach(self, mark: int) -> None:
        while self.value < mark and not self.done:
            self.changed.clear()
            await self.changed.wait()
