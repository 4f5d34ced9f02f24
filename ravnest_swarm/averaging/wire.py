"""The ring's messages on the wire: their schemas, the parts of a chunk, and sending them over striped streams.

A ring message is one stream of ``ExpertRequest`` per stripe: the first request carries only the metadata (a
schema below, as msgpack), each further one a single part of the chunk, a whole ``serialize_torch_tensor``
protobuf. A message's parts are dealt round-robin over its ``stripes`` streams: stripe j carries parts j,
j + stripes, ... Notes (``arrive``, ``abort``) are metadata alone, on one stream. Nothing is pickled.

Stripes. One yamux stream moves at most its flow-control window per round trip: in the lab (100 Mbit/s,
20 ms one-way) one P2P stream carried 8.8 MB/s where raw TCP carried 11.8, and two concurrent streams
11.75. So a step's parts are dealt round-robin over ``STREAMS_PER_STEP`` streams to the same peer. Through a
forwarding backbone a message is one stream, opened once its first part is ready (``RingSender.send_chunk``).

Resends. A stripe whose stream fails on the transport (closed or reset, reply lost) is sent again from its
first part, at most ``MAX_RESENDS`` times within the ring's deadline; the receiver keeps each part once
(``mailbox.Inbox``). A refusal from the receiver is final; a forwarding backbone that had no slot for a stream
(``ForwardBusy``), or a member our daemon could not dial (nothing was delivered; after one failed dial libp2p
refuses every dial to that address for about 6 s, its "dial backoff"), is asked again until the deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Annotated, AsyncIterator, Awaitable, Callable, List, Literal, Optional, Tuple, Union

import torch
from hivemind.p2p import P2PDaemonError, P2PHandlerError, PeerID
from hivemind.proto import runtime_pb2
from pydantic import Discriminator, Field, RootModel, Tag, model_validator

from ravnest_swarm.codecs.codec import CODEC_NAME_PATTERN, Codec
from ravnest_swarm.membership.records import RUN_NAME_RE
from ravnest_swarm.net.messages import Handler, Message, decode_message, register_handler
from ravnest_swarm.net.routes import ForwardBusy, Routes
from ravnest_swarm.net.transport import MAX_METADATA_BYTES, make_request, reply_lost

logger = logging.getLogger(__name__)

RING_HANDLER = "ravnest.averaging.ring"
PART_BYTES = 512 * 1024
STREAMS_PER_STEP = 2  # measured: two streams fill a 100 Mbit/s, 40 ms round-trip link, one fills 75 % of it
MAX_STRIPES = 8  # a receiver accepts messages striped over at most this many streams
MAX_MESSAGE_BYTES = 512 * 1024**2  # the largest stripe a peer reads by default (MultiRingAverager.max_message_bytes)
PEER_ID_CHARS = 128
# attempt and exclusion lists are peer ids: no more of them fit in the metadata limit
MAX_LISTED_PEERS = MAX_METADATA_BYTES // PEER_ID_CHARS
FAILURE_CHARS = 200  # why a ring was ended, as the other members report it
REDUCE, GATHER, ABORT, ARRIVE, PROBE = "reduce", "gather", "abort", "arrive", "probe"
# coordinates a member samples of each chunk it checks (robust aggregation: robust_ring.py), and the most one
# probe may ask about (a ring of 64 members' chunks)
PROBED_PER_CHUNK = 8
MAX_PROBED = 64 * PROBED_PER_CHUNK
CONTROL_TIMEOUT = 2.0  # how long a note may take to reach a member
MAX_RESENDS = 3  # per stripe; each waits RESEND_BACKOFF x its number first
RESEND_BACKOFF = 0.1
BUSY_BACKOFF, MAX_BUSY_BACKOFF = 0.2, 1.0  # a forwarding backbone without a slot for us: asked again after these
DIAL_BACKOFF, MAX_DIAL_BACKOFF = 0.5, 2.0  # a member our daemon could not dial: dialled again after these
NOT_DIALED = "failed to dial"  # how the daemon says it reached no address of the peer (a ``ControlFailure``)
ROUND_OVER = "is over here"  # how a peer refuses a message for a round it has finished

Count = Annotated[int, Field(ge=0, le=2**53)]
# a digest of a member's outer state over a ring's segment (``optimizers.outer.OuterOptimizer.digest``): members whose
# digests agree average pseudo-gradients in the ring's codec, others their parameters in float32
AnchorDigest = Annotated[str, Field(pattern="^[0-9a-f]{32}$")]
PeerIdText = Annotated[str, Field(max_length=PEER_ID_CHARS)]
PeerIds = Annotated[List[PeerIdText], Field(max_length=MAX_LISTED_PEERS)]


class RingMessage(Message):
    """What every ring message names: the run, the round (a training step), the ring, the attempt and the ring step.

    The mailbox files a message under these and its sender. ``attempt`` is the sorted list of the peers the
    ring excluded before this attempt; a note carries ``position`` 0 and ``attempt`` [] (they name no step).
    """

    run: Annotated[str, Field(pattern=RUN_NAME_RE.pattern)]
    step: Count
    ring: Count
    position: Count
    attempt: PeerIds


class RingPart(RingMessage):
    """One stripe of a ring step's chunk: its parts follow as the stream's further requests."""

    phase: Literal["reduce", "gather"]
    # the codec its parts are in: the averager's, or ``none`` where a ring fell back to parameters in float32
    codec: Annotated[str, Field(pattern=CODEC_NAME_PATTERN)] = "none"
    stripe: Annotated[int, Field(ge=0, lt=MAX_STRIPES)] = 0  # a message without stripe/stripes is one stream
    stripes: Annotated[int, Field(ge=1, le=MAX_STRIPES)] = 1

    @model_validator(mode="after")
    def _stripe_of_stripes(self) -> "RingPart":
        if self.stripe >= self.stripes:
            raise ValueError(f"stripe {self.stripe} of a message dealt over {self.stripes} streams")
        return self


class RingArrive(RingMessage):
    """A note: the sender reached this round; a ring starts once every member has. ``anchor``: the digest of
    its outer state over the ring's segment, where it averages pseudo-gradients (None: it has none)."""

    phase: Literal["arrive"] = ARRIVE
    anchor: Optional[AnchorDigest] = None

    def as_metadata(self) -> dict:
        return self.model_dump(exclude_none=True)  # parameters alone: no anchor to tell


class RingAbort(RingMessage):
    """A note: the sender excluded peers from the ring (``excluded``), or ended it (``failure``)."""

    phase: Literal["abort"] = ABORT
    excluded: Optional[PeerIds] = None
    failure: Optional[Annotated[str, Field(max_length=FAILURE_CHARS)]] = None

    def as_metadata(self) -> dict:
        return self.model_dump(exclude_none=True)  # a note says one of the two


class RingProbe(RingMessage):
    """A check of a robust attempt (``robust_ring.py``): the sender asks for our own values at ``coordinates``
    (offsets in the segment) and, for those in the chunk we own, every member's values we aggregated there."""

    phase: Literal["probe"] = PROBE
    coordinates: Annotated[List[Count], Field(min_length=1, max_length=MAX_PROBED)]


def _kind(metadata) -> Optional[str]:
    """Which schema a ring message's metadata is for, by its ``phase``; None refuses it with a fixed reason
    (pydantic's own would quote the phase it got, newlines and all)."""
    phase = metadata.get("phase") if isinstance(metadata, dict) else getattr(metadata, "phase", None)
    if not isinstance(phase, str):
        return None
    return {REDUCE: "part", GATHER: "part", ARRIVE: "arrive", ABORT: "abort", PROBE: "probe"}.get(phase)


class RingRequest(RootModel[Annotated[
    Union[Annotated[RingPart, Tag("part")], Annotated[RingArrive, Tag("arrive")], Annotated[RingAbort, Tag("abort")],
          Annotated[RingProbe, Tag("probe")]],
    Discriminator(_kind, custom_error_type="ring_phase",
                  custom_error_message=f"'phase' must be one of {REDUCE}, {GATHER}, {ARRIVE}, {ABORT}, {PROBE}")]]):
    """The metadata of a ring stream's first request: a :class:`RingPart`, :class:`RingArrive`,
    :class:`RingAbort` or :class:`RingProbe`, told apart by ``phase``."""


class RingReply(Message):
    """A ring message was filed (or was a resend of one already here). An arrive note is answered with whether
    the receiver has reached that round too (``arrived``, and then its ``anchor`` digest, as its own note says):
    a note of its own may have come before we expected messages of that round, and been refused; a probe with the
    receiver's own values at its coordinates (``values``) and, at those in the chunk it owns, one row per member of
    the attempt, in ring order, of the values it aggregated (``rows``) and its aggregate (``aggregated``); every
    other message with empty metadata. A vote (an abort note's ``excluded``) is answered with those of its names that the receiver's own rings already leave out (``left_out``:
    a cluster it found gone, which the voter has not yet): that is the receiver's vote too."""

    arrived: Optional[bool] = None
    left_out: Optional[PeerIds] = None
    anchor: Optional[AnchorDigest] = None
    values: Optional[Annotated[List[float], Field(max_length=MAX_PROBED)]] = None
    rows: Optional[Annotated[List[Annotated[List[float], Field(max_length=MAX_PROBED)]],
                             Field(max_length=MAX_LISTED_PEERS)]] = None
    # at those coordinates in the chunk the receiver owns, its aggregate of them (what it passed on to the gather)
    aggregated: Optional[Annotated[List[float], Field(max_length=MAX_PROBED)]] = None

    def as_metadata(self) -> dict:
        return self.model_dump(exclude_none=True)


register_handler(Handler(
    name=RING_HANDLER, request=RingRequest, reply=RingReply, max_bytes=MAX_MESSAGE_BYTES,
    callers="members of a ring of ours in the plan we follow: every message (part, arrive or abort note) only from "
            "a member of the ring it names, for a round in our window, naming only that ring's members; a chunk "
            "counts only from the ring's expected predecessor (robust aggregation: a reduce chunk from each member, and "
            "a probe only from a member of the attempt it names, while we run it)",
    owner=__name__))


def decode_ring_message(raw: bytes) -> Union[RingPart, RingArrive, RingAbort, RingProbe]:
    """A ring stream's first-request metadata as its schema, or :class:`MessageError` naming what is wrong."""
    return decode_message(RingRequest, raw, "ring message").root


def serialize_part(values: torch.Tensor, codec: Codec) -> runtime_pb2.Tensor:
    return codec.encode(values)


def decode_part(part: runtime_pb2.Tensor, codec: Codec) -> torch.Tensor:
    """A part as flat float32 in the ring's codec (``codecs.CodecError``, a ValueError, for anything else); its
    length is the ring's to check."""
    return codec.decode(part, "ring chunk", None)


class Outbox:
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

    async def ready(self, first: int) -> None:
        """Until part ``first`` is here, or the outbox is closed (a stripe that carries no part) or abandoned."""
        while len(self.parts) <= first and not self.closed and not self.abandoned:
            self.changed.clear()
            await self.changed.wait()

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


class RingSender:
    """Sends this peer's ring messages: a step's chunk over ``streams_per_step`` stripes, a note on one stream.

    ``bytes_sent`` counts every request it has put on a stream (metadata and parts as encoded, resends included):
    what averaging cost this peer's uplink, counted, not computed from the segment's size."""

    def __init__(self, routes: Routes, run: str, streams_per_step: int = STREAMS_PER_STEP):
        if not 1 <= streams_per_step <= MAX_STRIPES:
            raise ValueError(f"streams_per_step must be 1-{MAX_STRIPES}")
        self.routes, self.run, self.streams_per_step = routes, run, streams_per_step
        self.bytes_sent = 0

    async def send_chunk(self, peer: str, message: RingPart, outbox: Outbox, deadline: float) -> int:
        """Every part of ``outbox`` as soon as it is ready, dealt round-robin over the stripes.

        Each stripe is resent on its own; the message fails if one of them does, and is delivered when all are.
        Returns how many times a stripe was sent again.

        Through a forwarding backbone (both peers behind NAT) a message is one stream, opened only once its first
        part is ready: the backbone forwards only so many streams at once for us (``Routes.call`` waits for one of
        its slots), and a stream that held a slot while it waited for parts still to come from our predecessor
        could hold every slot our predecessor's own stream needs to bring them, around the ring. A stream opened
        with its data ready holds its slot only while its predecessor's stream of the step before holds one,
        and so on down to step 0, which needs nobody: every stream holding a slot makes progress.
        """
        peer_id = PeerID.from_base58(peer)
        forwarded = self.routes.route(peer_id) == "forward"
        stripes = 1 if forwarded else self.streams_per_step
        sends = [asyncio.create_task(self._send_stream(
            peer, message.model_copy(update=dict(stripe=stripe, stripes=stripes)),
            lambda stripe=stripe: outbox.stripe(stripe, stripes), deadline,
            ready=(lambda stripe=stripe: outbox.ready(stripe)) if forwarded else None)) for stripe in range(stripes)]
        try:
            resends = sum(resent for _, resent in await asyncio.gather(*sends))
        finally:
            for send in sends:
                send.cancel()
            await asyncio.gather(*sends, return_exceptions=True)
        outbox.delivered()
        return resends

    async def send_note(self, peer: str, note: Union[RingArrive, RingAbort, RingProbe], deadline: float) -> RingReply:
        """A note (or a probe), on one stream, resent like a stripe; the receiver's reply."""
        response, _ = await self._send_stream(peer, note, None, deadline)
        return decode_message(RingReply, response.metadata, "ring reply")

    async def _send_stream(self, peer: str, message: RingMessage,
                           parts: Optional[Callable[[], AsyncIterator[runtime_pb2.Tensor]]], deadline: float,
                           ready: Optional[Callable[[], Awaitable[None]]] = None) -> Tuple[runtime_pb2.ExpertResponse, int]:
        """One stream: the metadata, then every part ``parts()`` yields as soon as it is ready (None: none, a note,
        sent as a small message); ``ready()`` returns once the stream may open.

        A transport failure (the stream closed or reset, the reply lost) sends it again from its first part, up
        to ``MAX_RESENDS`` times within ``deadline``; the receiver keeps each part once. A forwarding backbone that
        had no slot for it (``ForwardBusy``), or a dial that reached no address of the peer, delivered nothing: it
        is tried again until ``deadline`` (a dial that failed once on a loaded host is refused by libp2p's dial
        backoff for seconds, longer than the resends last: CI saw a ring ended by it). A refusal from the
        receiver is final. Returns the receiver's reply and how many times the stream was sent again.
        """
        metadata = message.as_metadata()
        routes, peer_id = self.routes, PeerID.from_base58(peer)

        async def stream():
            # the metadata goes alone: a stripe of a message shorter than its stripes carries no part
            request = make_request(metadata)
            self.bytes_sent += request.ByteSize()
            yield request
            if parts is not None:
                async for part in parts():
                    request = runtime_pb2.ExpertRequest(tensors=[part])
                    self.bytes_sent += request.ByteSize()
                    yield request

        async def call() -> runtime_pb2.ExpertResponse:
            if ready is not None:
                await ready()
            return await routes.call(peer_id, RING_HANDLER, stream(), runtime_pb2.ExpertResponse, small=parts is None)

        resends, busy, dials = 0, 0, 0
        while True:
            try:
                response = await asyncio.wait_for(call(), max(0.0, deadline - time.monotonic()))
                return response, resends
            except (P2PHandlerError, asyncio.TimeoutError):
                raise
            except ForwardBusy as e:
                busy += 1
                backoff = min(BUSY_BACKOFF * busy, MAX_BUSY_BACKOFF)
                if time.monotonic() + backoff >= deadline:
                    raise
                logger.info(f"ring message {_what(message)} to {peer[-8:]} waits for the backbone ({e})")
                await asyncio.sleep(backoff)
            except P2PDaemonError as e:
                if NOT_DIALED not in str(e):
                    resends = await self._resend_after(e, message, peer, resends, deadline)
                    continue
                dials += 1
                backoff = min(DIAL_BACKOFF * dials, MAX_DIAL_BACKOFF)
                if time.monotonic() + backoff >= deadline:
                    raise
                # one line, once per message: p2pd's error lists every address tried, one per line, and a member
                # that died is dialled again until the deadline
                (logger.info if dials == 1 else logger.debug)(
                    f"ring message {_what(message)} to {peer[-8:]}: could not dial it "
                    f"({' '.join(str(e).split())[:200]}); trying again until the round's deadline")
                await asyncio.sleep(backoff)
            except Exception as e:
                resends = await self._resend_after(e, message, peer, resends, deadline)

    @staticmethod
    async def _resend_after(error: Exception, message: RingMessage, peer: str, resends: int, deadline: float) -> int:
        """After a stream failed with ``error``: raise it unless it lost the message on the way and a resend is left
        within ``deadline``; otherwise wait the resend's backoff and return the resends made."""
        backoff = RESEND_BACKOFF * (resends + 1)
        if not _lost_on_the_way(error) or resends == MAX_RESENDS or time.monotonic() + backoff >= deadline:
            raise error
        resends += 1
        logger.warning(f"ring message {_what(message)} to {peer[-8:]} was lost ({type(error).__name__}: {error}); "
                       f"sending it again ({resends}/{MAX_RESENDS})")
        await asyncio.sleep(backoff)
        return resends


def _what(message: RingMessage) -> str:
    stripe = message.stripe if isinstance(message, RingPart) else 0
    return f"{message.phase} {message.position} of ring {message.ring} (stripe {stripe})"


def _lost_on_the_way(error: Exception) -> bool:
    """Whether a failed call lost the stream or its reply (worth a resend) rather than being refused."""
    return isinstance(error, (ConnectionError, asyncio.IncompleteReadError, P2PDaemonError)) or reply_lost(error)
