"""Reaching peers behind NAT through a backbone: connection reversal, and forwarding as the fallback.

Over 400 lines because the routes, the schemas of the NAT handlers (which the backbone's side in
``relay.py`` shares) and the probe that measures a route are one protocol, read together.

Measured on hivemind 1.1.12's p2pd (see docs/nat.md): the libp2p relay resets every relayed connection
after 128 KiB, so tensors never go through it. What works is the connection a NATed volunteer keeps
open to its backbone (its initial peer): over it the backbone can call the volunteer's handlers.

* **Direct**: if we can dial the target (or are already connected, e.g. because it dialled us), we use
  that connection. A peer whose record says ``reachability: "relay"`` is not dialled at all.
* **Reversal**: a target behind NAT is asked, through a backbone (``ravnest.reverse_connect`` ->
  ``ravnest.dial_me`` over the target's own connection), to dial us at our announced addresses. The
  bulk streams then run on that direct connection, opened from inside the target's NAT.
* **Forwarding**: when neither side can dial the other (two NATs), the sender streams to the backbone's
  ``ravnest.forward`` handler, which pipes the bytes into the target's ``ravnest.forwarded`` handler over
  the target's connection, and the reply back. The target trusts only its own backbones to say who the
  original sender was. The backbone caps each stream and the number of streams, and counts the bytes; a
  sender keeps within its share of those streams (:meth:`Routes.call` waits for a slot).

Every node started by :func:`ravnest_swarm.net.node.start_node` carries its :class:`Routes`
(``node.routes``), whose backbones are its initial peers; the parts that send are given that object.
Handlers that others may reach through a forwarding backbone are registered with
:meth:`Routes.add_forwardable_handler`. The backbone's side is :mod:`ravnest_swarm.net.relay`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from contextlib import closing
from typing import Annotated, AsyncIterator, Awaitable, Callable, Dict, List, Optional, Sequence, Tuple, Type

from hivemind.p2p import P2P, P2PContext, P2PHandlerError, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError
from hivemind.utils.multiaddr import Multiaddr
from pydantic import AfterValidator, ConfigDict, Field

from ravnest_swarm.net.messages import Handler, Message, MessageError, MessageT, decode_message, register_handler
from ravnest_swarm.net.traffic import Traffic
from ravnest_swarm.net.transport import (UNARY_MAX_BYTES, call_handler, call_stream, iterate_frames, make_request,
                                         make_response, message_reply, send_reply)

logger = logging.getLogger(__name__)

DIAL_ME = "ravnest.dial_me"
REVERSE_CONNECT = "ravnest.reverse_connect"
FORWARD = "ravnest.forward"
FORWARDED = "ravnest.forwarded"
PROBE = "ravnest.probe"

DIRECT_DIAL_TIMEOUT = 3.0  # a NAT drops our SYN silently: give up on the direct path after this
REVERSE_TIMEOUT = 10.0
HEADER_TIMEOUT = 10.0
MAX_HEADER_BYTES = 16 * 1024
MAX_DIAL_MADDRS = 8
MAX_ERROR_CHARS = 300
PROBE_CHUNK_BYTES = 256 * 1024
MAX_PROBE_FRAME_BYTES = 4 * PROBE_CHUNK_BYTES  # a part, its protobuf's framing, and room for another sender's parts
MAX_PROBE_BYTES = 64 * 1024 * 1024 + 1024 * 1024  # 64 MiB of payload plus framing
PROBE_TIMEOUT = 120.0
# A backbone's forwarding caps (relay.RelayServices' defaults): streams it pipes at once, in all and for one caller.
# A caller over either is refused with a reason that starts with FORWARD_BUSY.
MAX_FORWARD_STREAMS = 16
MAX_FORWARD_STREAMS_PER_CALLER = MAX_FORWARD_STREAMS // 2
FORWARD_BUSY = "this backbone forwards at most"
# A backbone that cannot reach the target (it is not connected there, or its stream broke off) refuses with a reason
# that starts with FORWARD_REFUSED: the backbone's answer, not the target's (a ring asks whether a member crashed)
FORWARD_REFUSED = "cannot forward"
# A sender keeps its streams through one backbone within that backbone's share for one caller, less one: the
# backbone frees a slot a moment after our call returned (when the target's side of the stream closes), so a
# stream opened at once must not need it. SMALL_FORWARD_SLOTS of them are kept for small messages (a ring's
# notes), which must not wait behind bulk streams.
FORWARD_SLOTS = MAX_FORWARD_STREAMS_PER_CALLER - 1
SMALL_FORWARD_SLOTS = 2

StreamHandler = Callable[[StreamInfo, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

# ---- message schemas: of these handlers and of the backbone's (relay.py), which share the field types ----

PeerIdText = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[1-9A-HJ-NP-Za-km-z]+$")]  # base58
def _parses_as_multiaddr(text: str) -> str:
    Multiaddr(text)  # its parse error is a ValueError naming the bad part, which the schema reports as the field's
    return text


MaddrText = Annotated[str, Field(min_length=2, max_length=256, pattern=r"^/[!-~]+$"),  # printable ASCII
                      AfterValidator(_parses_as_multiaddr)]
HandlerNameText = Annotated[str, Field(min_length=1, max_length=100, pattern=r"^ravnest\.[a-z0-9_.]+$")]
ErrorText = Annotated[str, Field(max_length=MAX_ERROR_CHARS)]


class DialRequest(Message):
    """Dial ``peer`` at ``maddrs``: a peer asks a backbone (``reverse_connect``), which passes it on (``dial_me``)."""

    peer: PeerIdText
    maddrs: List[MaddrText] = Field(default_factory=list, max_length=MAX_DIAL_MADDRS)


class DialMeReply(Message):
    """Whether we dialled the peer; ``error`` says why not."""

    dialed: bool
    error: Optional[ErrorText] = None


class ReverseConnectReply(Message):
    """Whether the target is connected to the backbone and dialled the caller; ``error`` says why not."""

    connected: bool
    dialed: bool = False
    error: Optional[ErrorText] = None


class ForwardHeader(Message):
    """The first frame of a stream to a backbone's ``forward``: whose handler it is for."""

    to: PeerIdText
    handler: HandlerNameText


class ForwardedHeader(Message):
    """The first frame of a stream a backbone pipes to ``forwarded``: who sent it, for which handler."""

    model_config = ConfigDict(serialize_by_alias=True)

    sender: PeerIdText = Field(alias="from")  # "from" on the wire, a Python keyword
    handler: HandlerNameText


class ForwardBusy(ConnectionError):
    """A backbone refused to forward a stream for lack of a slot (its caps, ``FORWARD_BUSY``): it was not
    delivered, and may be sent again in a moment."""


class Relayed(Message):
    """The reply of a piped stream: the named handler's own reply (or error), passed back unread."""


class ProbeFrame(Message):
    """A probe frame's metadata: none (senders leave it empty); only its tensors' bytes are counted."""


class ProbeReply(Message):
    """The tensor bytes a probe handler counted."""

    bytes: int = Field(ge=0)


register_handler(Handler(DIAL_ME, DialRequest, DialMeReply, UNARY_MAX_BYTES,
                         callers="the node's own backbones (its initial peers), passing on a reverse_connect",
                         owner=__name__))
register_handler(Handler(FORWARDED, ForwardedHeader, Relayed, MAX_HEADER_BYTES,
                         callers="the node's own backbones, piping a forward stream (the rest of the stream is the "
                                 "named handler's message, under that handler's limit)",
                         owner=__name__))
register_handler(Handler(PROBE, ProbeFrame, ProbeReply, MAX_PROBE_BYTES,
                         callers="any peer (ravnest-swarm probe), directly or through a backbone's forward",
                         owner=__name__))


async def start_routes(p2p: P2P, backbones: Sequence[PeerID]) -> "Routes":
    """The node's :class:`Routes`, with the handlers a volunteer serves to its backbones registered."""
    routes = Routes(p2p, backbones)
    await routes.start()
    return routes


async def read_header(reader: asyncio.StreamReader, schema: Type[MessageT], handler: str) -> MessageT:
    """One hivemind frame holding an ``ExpertRequest`` whose metadata is the header, read exactly within
    ``HEADER_TIMEOUT`` (the bytes after it stay in ``reader`` for whoever handles the rest of the stream).
    ``ValueError`` says what is wrong with it."""

    async def read() -> MessageT:
        marker = await reader.readexactly(1)
        length = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
        if marker != P2P.MESSAGE_MARKER or length > MAX_HEADER_BYTES:
            raise ValueError(f"{handler}: a forwarded stream must start with one small header frame")
        frame = runtime_pb2.ExpertRequest()
        frame.ParseFromString(await reader.readexactly(length))
        return decode_message(schema, frame.metadata, handler)

    try:
        return await asyncio.wait_for(read(), HEADER_TIMEOUT)
    except asyncio.TimeoutError:
        raise ValueError(f"{handler}: no header within {HEADER_TIMEOUT:.0f}s") from None


async def refuse_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reason: str) -> None:
    """Refuse a stream with a one-line reason that reaches the caller even while it is still writing."""
    await send_reply(RPCError(message=reason), reader, writer)


def _strip_peer_id(maddrs: Sequence[Multiaddr]) -> List[str]:
    return [str(m).split("/p2p/", 1)[0] for m in maddrs]


class Routes:
    """How this node reaches other peers: direct, by connection reversal, or forwarded by a backbone.

    :param p2p: the node's P2P instance
    :param backbones: peer ids of the backbones we keep a connection to (our initial peers): the only
        peers whose ``dial_me`` and ``forwarded`` requests we accept, and the ones we ask for help
    :param direct_timeout: seconds a direct dial may take before we try a backbone
    :param reverse_timeout: seconds a reversal (backbone round trip plus the target's dial) may take
    :param forward_slots: streams we have a backbone forward at once (more wait for one to end); at most its
        cap for one caller, of which ``SMALL_FORWARD_SLOTS`` are kept for small messages
    """

    def __init__(self, p2p: P2P, backbones: Sequence[PeerID], direct_timeout: float = DIRECT_DIAL_TIMEOUT,
                 reverse_timeout: float = REVERSE_TIMEOUT, forward_slots: int = FORWARD_SLOTS):
        if forward_slots <= SMALL_FORWARD_SLOTS:
            raise ValueError(f"forward_slots must be above the {SMALL_FORWARD_SLOTS} kept for small messages")
        self.p2p, self.backbones = p2p, list(backbones)
        self.direct_timeout, self.reverse_timeout = direct_timeout, reverse_timeout
        self.forward_slots = forward_slots
        self.reachability = "unknown"  # ours, as a backbone's dial-back found it (check_reachability sets it)
        self.chosen: Dict[PeerID, Tuple[str, Optional[PeerID]]] = {}  # peer -> (direct|reversed|forward, backbone)
        # the last route chosen to each peer: calls keep using it after a failure made us forget it, until the next
        # connect chooses again (a peer behind NAT cannot be dialled "direct", which calls would otherwise try)
        self._last: Dict[PeerID, Tuple[str, Optional[PeerID]]] = {}
        # per backbone: every stream it forwards for us, and those of them that are not small
        self._forward_slots: Dict[PeerID, Tuple[asyncio.Semaphore, asyncio.Semaphore]] = {}
        self.counts: Counter = Counter()  # routes established, by kind, calls made over them, requests refused
        self._forwardable: Dict[str, StreamHandler] = {}
        self._locks: Dict[PeerID, asyncio.Lock] = {}
        # who may call our forwardable handlers: (caller, handler) -> why it may not, or None; None admits anyone. An
        # invite-only run admits the peers with a valid ticket (membership/tickets.py: ``Admission.refusal``)
        self.gate: Optional[Callable[[PeerID, str], Optional[str]]] = None
        self.on_gate_refusal: Optional[Callable[[str], None]] = None  # told each refusal of the gate, in one line
        self.traffic = Traffic()  # the bytes of our gated handlers' streams and of our calls (net/traffic.py)

    async def start(self) -> None:
        await self.p2p.add_protobuf_handler(DIAL_ME, self._rpc_dial_me, runtime_pb2.ExpertRequest)
        await self.p2p.add_binary_stream_handler(FORWARDED, self._serve_forwarded)
        await self.add_forwardable_handler(PROBE, probe_handler(PROBE, MAX_PROBE_BYTES, PROBE_TIMEOUT, linger=True))

    async def add_forwardable_handler(self, name: str, serve: StreamHandler) -> None:
        """Register a binary stream handler that peers may also reach through a forwarding backbone, behind the
        :attr:`gate` (:meth:`gated`)."""
        self._forwardable[name] = self.gated(name, serve)
        await self.p2p.add_binary_stream_handler(name, self._forwardable[name])

    def gated(self, name: str, serve: StreamHandler) -> StreamHandler:
        """``serve`` behind the :attr:`gate`: a caller it refuses (the original sender, for a forwarded stream) is
        answered its one-line reason and counted (``counts["refused"]``) before the handler reads anything."""

        async def gated(info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            reason = self.gate(info.peer_id, name) if self.gate is not None else None
            if reason is None:
                await serve(info, *self.traffic.counted(name, reader, writer))
                return
            self._refuse(info.peer_id, reason)
            if self.on_gate_refusal is not None:
                self.on_gate_refusal(reason)
            with closing(writer):
                await refuse_stream(reader, writer, reason)

        return gated

    # ---- choosing a route ----------------------------------------------------------------------

    async def connect(self, peer_id: PeerID, maddrs: Sequence[Multiaddr], reachability: Optional[str] = None) -> str:
        """Make ``peer_id`` callable and return the route: ``direct``, ``reversed`` or ``forward``.

        :param maddrs: its announced addresses (without ``/p2p/``)
        :param reachability: its record's verdict, if known; ``relay`` skips the direct dial
        """
        lock = self._locks.setdefault(peer_id, asyncio.Lock())
        async with lock:
            route = self.chosen.get(peer_id)
            if route is not None and route[0] == "forward":
                return "forward"
            if await self._connected(peer_id):
                # a connection it opened to us counts as direct too: either side dialling is enough
                if route is None:
                    logger.info(f"route to {peer_id}: direct over a connection already open")
                self.chosen[peer_id] = self._last[peer_id] = route or ("direct", None)
                return self.chosen[peer_id][0]
            problems = []
            if reachability != "relay" and maddrs:
                try:
                    await asyncio.wait_for(self.p2p._client.connect(peer_id, list(maddrs)), self.direct_timeout)
                    return self._use(peer_id, "direct", None)
                except Exception as e:
                    problems.append(f"direct dial: {type(e).__name__}: {e}")
            for backbone in self.backbones:
                if backbone == peer_id:
                    continue
                try:
                    answer = await self._ask_reversal(backbone, peer_id, dial=self.reachability != "relay")
                except Exception as e:
                    problems.append(f"backbone {backbone}: {type(e).__name__}: {e}")
                    continue
                if not answer.connected:
                    problems.append(f"backbone {backbone} has no connection to it")
                    continue
                if answer.dialed and await self._wait_connected(peer_id):
                    return self._use(peer_id, "reversed", backbone)
                problems.append(f"reversal through {backbone}: {answer.error or 'not asked'}")
                return self._use(peer_id, "forward", backbone)
            raise ConnectionError(f"cannot reach {peer_id}: " + "; ".join(problems or ["no backbone to ask"]))

    def forget(self, peer_id: PeerID) -> None:
        """Drop the route after a failed call, so the next :meth:`connect` chooses again."""
        self.chosen.pop(peer_id, None)

    def route(self, peer_id: PeerID) -> Optional[str]:
        """The route :meth:`call` takes to ``peer_id`` now (None: none chosen yet, it tries direct)."""
        return self.chosen.get(peer_id, self._last.get(peer_id, (None, None)))[0]

    def _use(self, peer_id: PeerID, kind: str, backbone: Optional[PeerID]) -> str:
        self.chosen[peer_id] = self._last[peer_id] = (kind, backbone)
        self.counts[kind] += 1
        logger.info(f"route to {peer_id}: {kind}" + (f" via backbone {backbone}" if backbone else ""))
        return kind

    async def _connected(self, peer_id: PeerID) -> bool:
        for info in await self.p2p.list_peers():
            if info.peer_id == peer_id:
                return not all("p2p-circuit" in str(addr) for addr in info.addrs)
        return False

    async def _wait_connected(self, peer_id: PeerID, seconds: float = 2.0) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if await self._connected(peer_id):
                return True
            await asyncio.sleep(0.05)
        return False

    async def _ask_reversal(self, backbone: PeerID, peer_id: PeerID, dial: bool) -> ReverseConnectReply:
        ours = _strip_peer_id(await self.p2p.get_visible_maddrs()) if dial else []
        request = DialRequest(peer=peer_id.to_base58(), maddrs=ours[:MAX_DIAL_MADDRS])
        response = await asyncio.wait_for(self.p2p.call_protobuf_handler(
            backbone, REVERSE_CONNECT, make_request(request.as_metadata()), runtime_pb2.ExpertResponse),
            self.reverse_timeout)
        return decode_message(ReverseConnectReply, response.metadata, REVERSE_CONNECT)

    # ---- calling -------------------------------------------------------------------------------

    async def call(self, peer_id: PeerID, name: str, requests, output_type=runtime_pb2.ExpertResponse,
                   small: bool = False, max_bytes: Optional[int] = None):
        """``P2P.call_protobuf_handler`` with a stream of requests, over the route :meth:`connect` chose.

        Through a forwarding backbone, the call first waits for one of our slots there (``forward_slots``;
        ``small``: a short message, which may also take the slots kept for those), so we never open more streams
        than the backbone forwards for one caller. A caller that opens a stream before its first bytes are ready
        holds a slot while it waits (the ring opens a forwarded stream only once its data is ready).
        ``ForwardBusy`` says the backbone refused it for lack of a slot all the same (others' streams took them).
        ``max_bytes``: the longest reply taken (``transport.call_stream``).
        """
        kind, backbone = self.chosen.get(peer_id, self._last.get(peer_id, ("direct", None)))
        self.counts[f"calls_{kind}"] += 1
        try:
            if kind == "forward":
                every, bulk = self._slots(backbone)
                if small:
                    async with every:
                        return await self._call_forwarded(backbone, peer_id, name, requests, output_type, max_bytes)
                async with bulk, every:
                    return await self._call_forwarded(backbone, peer_id, name, requests, output_type, max_bytes)
            return await call_handler(self.p2p, peer_id, name, requests, output_type, max_bytes, self.traffic)
        except (P2PHandlerError, ForwardBusy):
            raise  # the peer (or the backbone, busy) answered: the route works
        except Exception:
            self.forget(peer_id)  # not on a cancellation: the caller gave up, which says nothing of the route
            raise

    def _slots(self, backbone: PeerID) -> Tuple[asyncio.Semaphore, asyncio.Semaphore]:
        if backbone not in self._forward_slots:
            self._forward_slots[backbone] = (asyncio.Semaphore(self.forward_slots),
                                             asyncio.Semaphore(self.forward_slots - SMALL_FORWARD_SLOTS))
        return self._forward_slots[backbone]

    async def _call_forwarded(self, backbone: PeerID, peer_id: PeerID, name: str, requests, output_type,
                              max_bytes: Optional[int]):
        _, reader, writer = await self.p2p.call_binary_stream_handler(backbone, FORWARD)
        with closing(writer):
            reader, writer = self.traffic.counted(name, reader, writer)
            header = ForwardHeader(to=peer_id.to_base58(), handler=name)
            await P2P.send_protobuf(make_request(header.as_metadata()), writer)
            what = f"`{name}` at {peer_id} via {backbone}"
            try:
                return await call_stream(reader, writer, requests, output_type, what, max_bytes)
            except P2PHandlerError as e:
                reason = str(e).removeprefix(f"Failed to call handler {what}: ")
                if reason.startswith(FORWARD_BUSY):  # the backbone's refusal, before it piped anything
                    raise ForwardBusy(f"backbone {backbone} did not forward to {peer_id}: {reason}") from None
                raise

    # ---- serving our backbones -----------------------------------------------------------------

    async def _rpc_dial_me(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        """A backbone passes on a peer's request that we dial it (we are the one behind NAT)."""
        try:
            if context.remote_id not in self.backbones:
                raise MessageError(f"{DIAL_ME} is accepted from our backbones only")
            dial = decode_message(DialRequest, request.metadata, DIAL_ME)
            peer_id, maddrs = PeerID.from_base58(dial.peer), [Multiaddr(m) for m in dial.maddrs]
        except MessageError as e:
            self._refuse(context.remote_id, str(e))
            raise
        # p2pd would reuse a relayed connection (reset after 128 KiB) instead of dialling: drop it first
        for info in await self.p2p.list_peers():
            if info.peer_id == peer_id and any("p2p-circuit" in str(a) for a in info.addrs):
                await self.p2p._client.disconnect(peer_id)
        try:
            await asyncio.wait_for(self.p2p._client.connect(peer_id, maddrs), self.direct_timeout)
        except Exception as e:
            return make_response(DialMeReply(dialed=False, error=error_text(e)).as_metadata())
        return make_response(DialMeReply(dialed=True).as_metadata())

    async def _serve_forwarded(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A backbone pipes another peer's stream to us: hand it to the named handler as if it came directly."""
        try:
            if info.peer_id not in self.backbones:
                raise ValueError("forwarded streams are accepted from our backbones only")
            header = await read_header(reader, ForwardedHeader, FORWARDED)
            serve = self._forwardable.get(header.handler)
            if serve is None:
                raise ValueError(f"handler {header.handler!r} does not take forwarded streams here")
        except Exception as e:  # a ValueError says what is wrong; anything else is a stream that broke off
            reason = str(e) if isinstance(e, ValueError) else f"bad forwarded stream header: {error_text(e)}"
            self._refuse(info.peer_id, reason)
            with closing(writer):
                await refuse_stream(reader, writer, reason)
            return
        self.counts["forwarded_in"] += 1
        await serve(StreamInfo(PeerID.from_base58(header.sender), info.addr, header.handler), reader, writer)

    def _refuse(self, caller: PeerID, reason: str) -> None:
        """Count a refused ``dial_me`` or ``forwarded`` request (``counts["refused"]``) and say why, in one line."""
        self.counts["refused"] += 1
        logger.info(f"routes: refused a request from {caller}: {reason}")


def error_text(error: Exception) -> str:
    """An exception as the ``error`` field of a reply: its type and text, cut to the field's limit."""
    return f"{type(error).__name__}: {error}"[:MAX_ERROR_CHARS]


def probe_handler(name: str, max_bytes: int, timeout: float, linger: bool = False) -> StreamHandler:
    """A probe handler (``probe``, and a backbone's ``bandwidth_probe``): one message of at most ``max_bytes`` within
    ``timeout`` seconds, answered with the bytes of the tensors that arrived. Each frame is counted as it arrives and
    dropped, and one frame takes at most a few of the 256 KiB parts senders send: every probe stream held its whole
    message only to add up its length (64 MiB each, many streams at once, a hostile review)."""

    async def serve(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def count() -> runtime_pb2.ExpertResponse:
            counted, frames = 0, 0
            async for frame in iterate_frames(reader, max_bytes, max_frame_bytes=MAX_PROBE_FRAME_BYTES):
                if frame.metadata:  # senders leave it empty; whatever else comes must still fit the schema
                    decode_message(ProbeFrame, frame.metadata, name)
                counted += sum(len(tensor.buffer) for tensor in frame.tensors)
                frames += 1
            if not frames:
                raise ValueError("empty message: no frames before end of stream")
            return make_response(ProbeReply(bytes=counted).as_metadata())

        with closing(writer):
            reply = await message_reply(name, stream_info.peer_id, count, timeout)
            if reply is not None:
                await send_reply(reply, reader, writer, linger=linger)

    return serve


ProbeCall = Callable[[AsyncIterator[runtime_pb2.ExpertRequest]], Awaitable[runtime_pb2.ExpertResponse]]


async def send_probe(call: ProbeCall, handler: str, total_bytes: int, timeout: float,
                     on_progress: Optional[Callable[[int, int], None]] = None) -> Tuple[int, float]:
    """Stream ``total_bytes`` (one uint8 tensor in 256 KiB parts) through ``call`` to a probe handler
    (:func:`probe_handler` named ``handler``); return the bytes it counted and the seconds from the first byte
    to its reply. ``on_progress(parts sent, parts)`` follows the stream. The one sender of both probes:
    :func:`probe_peer` and the bandwidth a volunteer measures to a backbone (``membership.services``)."""
    payload = runtime_pb2.Tensor(buffer=bytes(PROBE_CHUNK_BYTES), dtype="uint8", size=[PROBE_CHUNK_BYTES])
    parts = max(1, total_bytes // PROBE_CHUNK_BYTES)

    async def stream():
        for index in range(parts):
            yield runtime_pb2.ExpertRequest(tensors=[payload])
            if on_progress is not None:
                on_progress(index + 1, parts)

    started = time.perf_counter()
    response = await asyncio.wait_for(call(stream()), timeout)
    return decode_message(ProbeReply, response.metadata, handler).bytes, time.perf_counter() - started


async def probe_peer(routes: "Routes", peer_id: PeerID, total_bytes: int, timeout: float = PROBE_TIMEOUT) -> Tuple[int, float]:
    """:func:`send_probe` to a peer's ``probe`` handler over its route (direct, reversal or forwarding)."""
    return await send_probe(lambda stream: routes.call(peer_id, PROBE, stream), PROBE, total_bytes, timeout)
