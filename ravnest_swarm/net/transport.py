"""The message envelope every project RPC uses, and bounded reads of streamed frames.

Every RPC handler of the project takes and returns hivemind's ``ExpertRequest``/``ExpertResponse``
protobufs: ``metadata`` is a msgpack dict checked against a size limit and, by the handler, against a
pydantic schema; ``tensors`` are hivemind ``serialize_torch_tensor`` protobufs. Nothing is pickled.
Errors travel back as hivemind ``P2PHandlerError`` with a one-line reason.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import closing
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, List, Optional, Union

import msgpack
from google.protobuf.message import DecodeError
from hivemind.p2p import P2P, P2PContext, P2PHandlerError, PeerID
from hivemind.p2p.p2p_daemon_bindings.control import DEFAULT_MAX_MSG_SIZE
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError


logger = logging.getLogger(__name__)

MAX_METADATA_BYTES = 64 * 1024
# unary calls travel over p2pd's persistent connection, whose messages (the request and its envelope) p2pd caps
UNARY_MAX_BYTES = DEFAULT_MAX_MSG_SIZE
DISCARD_SECONDS = 2.0
# hivemind's asingle() when a stream closed with no reply: p2pd did this under load to whole messages
EMPTY_REPLY = "got an empty iterable"  # see call_stream for why
# the longest reply a call takes where its caller names no bound: every such reply is one metadata map, no tensors
# (hivemind's readers take whatever length a peer declares, and wait for that many bytes in memory)
SMALL_REPLY_BYTES = MAX_METADATA_BYTES + 4096


class ReplyLost(ConnectionError):
    """The stream closed before the receiver's reply came (:func:`call_stream`)."""


def reply_lost(error: Exception) -> bool:
    """Whether a call failed because its stream closed before the reply came (hivemind raises a ValueError from
    ``asingle()``, :func:`call_stream` :class:`ReplyLost`): the message may never have been handled, so sending
    it again is safe and worth it."""
    return isinstance(error, ReplyLost) or isinstance(error, ValueError) and EMPTY_REPLY in str(error)


async def receive_bounded(output_type, reader: asyncio.StreamReader, max_bytes: int, what: str):
    """``P2P.receive_protobuf`` that refuses a reply longer than ``max_bytes`` from its length header, before reading
    it (hivemind's reads whatever length the sender declares): ``(reply, None)`` or ``(None, error)``."""
    marker = await reader.readexactly(1)
    if marker not in (P2P.MESSAGE_MARKER, P2P.ERROR_MARKER):
        raise ValueError(f"{what} replied with frame marker {marker!r}, neither a message nor an error")
    length = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
    if length > max_bytes:
        raise ValueError(f"{what} sent a reply of {length} bytes, over the {max_bytes} this call takes")
    message = output_type() if marker == P2P.MESSAGE_MARKER else RPCError()
    try:
        message.ParseFromString(await reader.readexactly(length))
    except DecodeError:
        raise ValueError(f"{what} sent a reply that is not a {type(message).__name__} protobuf") from None
    return (message, None) if marker == P2P.MESSAGE_MARKER else (None, message)


async def call_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, requests: AsyncIterator,
                      output_type, what: str, max_bytes: Optional[int] = None):
    """A streamed call on an open stream: ``requests`` then hivemind's end of stream, and exactly one reply read
    back, as ``P2P.call_protobuf_handler`` frames them; the caller closes the stream at once after.

    Unlike ``call_protobuf_handler``, this does not wait for the receiver to close first. A receiver that closes
    its side right after its reply makes p2pd reset the stream (its side closes for reading, and its pipe from
    the stream then fails), and a reset that reaches the sender's p2pd before the reply was read from its buffer
    drops the reply: hivemind's ``asingle() ... got an empty iterable`` for a message the receiver handled. So
    the sender, which has everything once it has the reply, closes first, and a receiver that can (the ring
    handler, ``send_reply(linger=True)``) waits for that. The requests are written in their own task: a
    receiver may answer (a refusal) before it read them all. ``what`` names the call in errors:
    ``P2PHandlerError`` for the receiver's error reply, :class:`ReplyLost` for none. ``max_bytes``: the longest reply
    taken (:func:`receive_bounded`), for calls whose reply carries state of a size the caller knows; without it,
    :data:`SMALL_REPLY_BYTES`.
    """
    async def write() -> None:
        async for request in requests:
            await P2P.send_protobuf(request, writer)
        await P2P.send_protobuf(P2P.END_OF_STREAM, writer)

    writing = asyncio.create_task(write())
    try:
        response, error = await receive_bounded(output_type, reader, max_bytes or SMALL_REPLY_BYTES, what)
    except asyncio.IncompleteReadError:
        raise ReplyLost(f"{what} closed the stream with no reply") from None
    finally:
        if not writing.done():
            writing.cancel()
        await asyncio.gather(writing, return_exceptions=True)
    if error is not None:
        raise P2PHandlerError(f"Failed to call handler {what}: {error.message}")
    return response


async def call_handler(p2p: P2P, peer_id: PeerID, name: str, requests: AsyncIterator, output_type,
                       max_bytes: Optional[int] = None, traffic=None):
    """``P2P.call_protobuf_handler`` for a stream of requests on a stream of its own, its reply read bounded
    (:func:`call_stream`). ``traffic``: where its bytes are counted (``net/traffic.py``)."""
    _, reader, writer = await p2p.call_binary_stream_handler(peer_id, name)
    with closing(writer):
        if traffic is not None:
            reader, writer = traffic.counted(name, reader, writer)
        return await call_stream(reader, writer, requests, output_type, f"`{name}` at {peer_id}", max_bytes)


async def iterate_replies(p2p: P2P, peer_id: PeerID, name: str, request, output_type, max_frame_bytes: int,
                          traffic=None) -> AsyncIterator:
    """``P2P.iterate_protobuf_handler`` for one request, whose every reply frame is read bounded by
    ``max_frame_bytes`` (:func:`receive_bounded`: a ``ValueError`` names one over it before it is read); the
    stream ends where the holder closes it. ``traffic``: where its bytes are counted (``net/traffic.py``)."""
    _, reader, writer = await p2p.call_binary_stream_handler(peer_id, name)
    with closing(writer):
        if traffic is not None:
            reader, writer = traffic.counted(name, reader, writer)
        await P2P.send_protobuf(request, writer)
        await P2P.send_protobuf(P2P.END_OF_STREAM, writer)
        what = f"`{name}` at {peer_id}"
        while True:
            try:
                response, error = await receive_bounded(output_type, reader, max_frame_bytes, what)
            except asyncio.IncompleteReadError:
                return  # closed: what came is checked whole by the caller
            if error is not None:
                raise P2PHandlerError(f"Failed to call handler {what}: {error.message}")
            yield response


def pack_metadata(metadata: Dict[str, Any]) -> bytes:
    return msgpack.packb(metadata, use_bin_type=True)


def unpack_metadata(raw: bytes) -> Dict[str, Any]:
    """Decode a message's msgpack metadata, refusing oversize or non-dict payloads with a clear reason."""
    if len(raw) > MAX_METADATA_BYTES:
        raise ValueError(f"metadata of {len(raw)} bytes exceeds the {MAX_METADATA_BYTES}-byte limit")
    try:
        value = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:
        raise ValueError(f"metadata is not valid msgpack ({type(e).__name__})")
    if not isinstance(value, dict):
        raise ValueError("metadata must be a msgpack map")
    return value


def make_request(metadata: Dict[str, Any], tensors=(), uid: str = "") -> runtime_pb2.ExpertRequest:
    return runtime_pb2.ExpertRequest(uid=uid, metadata=pack_metadata(metadata), tensors=list(tensors))


def make_response(metadata: Dict[str, Any], tensors=()) -> runtime_pb2.ExpertResponse:
    return runtime_pb2.ExpertResponse(metadata=pack_metadata(metadata), tensors=list(tensors))


async def iterate_frames(reader: asyncio.StreamReader, max_bytes: int, first_marker: Optional[bytes] = None,
                         max_frames: Optional[int] = None,
                         max_frame_bytes: Optional[int] = None) -> AsyncIterator[runtime_pb2.ExpertRequest]:
    """Yield one streamed message's ``ExpertRequest`` frames as they are read, up to hivemind's end-of-stream marker.

    The frames use hivemind's own framing (a marker byte, an 8-byte length, the protobuf), so senders use
    plain ``P2P.call_protobuf_handler``. Unlike hivemind's stream handlers, this refuses a message from
    its length headers before reading past ``max_bytes`` (each frame's marker and header counted: a million
    empty frames are 9 MB, not nothing), and names what is wrong (``ValueError``).
    ``first_marker``: the message's first byte when the caller already read it (a stream that carries
    many messages waits for the next one's first byte without the deadline of a message in progress).
    ``max_frames``, ``max_frame_bytes``: what a caller that holds every frame takes at most (``read_frames``).
    """
    total, count = 0, 0
    while True:
        marker = first_marker or await reader.readexactly(1)
        first_marker = None
        if marker not in (P2P.MESSAGE_MARKER, P2P.ERROR_MARKER):
            raise ValueError(f"not a message: frame marker {marker!r} is neither data nor end of stream")
        length = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
        total += 1 + P2P.HEADER_LEN + length
        if total > max_bytes:
            raise ValueError(f"message exceeds the {max_bytes}-byte limit (at least {total} bytes)")
        if marker == P2P.MESSAGE_MARKER and max_frame_bytes is not None and length > max_frame_bytes:
            raise ValueError(f"frame {count} of {length} bytes is over the {max_frame_bytes} a frame takes")
        if marker == P2P.ERROR_MARKER and length > SMALL_REPLY_BYTES:  # an end of stream, or one line of error
            raise ValueError(f"an end-of-stream frame of {length} bytes (at most {SMALL_REPLY_BYTES})")
        if marker == P2P.MESSAGE_MARKER and max_frames is not None and count >= max_frames:
            raise ValueError(f"message of more than {max_frames} frames")
        data = await reader.readexactly(length)
        if marker == P2P.ERROR_MARKER:
            return
        frame = runtime_pb2.ExpertRequest()
        try:
            frame.ParseFromString(data)
        except DecodeError:
            raise ValueError(f"frame {count} ({length} bytes) is not an ExpertRequest protobuf")
        del data  # a large frame's bytes need not live while the caller handles it
        count += 1
        yield frame


async def read_frames(reader: asyncio.StreamReader, max_bytes: int, first_marker: Optional[bytes] = None,
                      max_frames: Optional[int] = None, max_frame_bytes: Optional[int] = None,
                      vet_first: Optional[Callable[[runtime_pb2.ExpertRequest], None]] = None
                      ) -> List[runtime_pb2.ExpertRequest]:
    """All frames of one streamed message (see :func:`iterate_frames`); a message with none is refused.
    ``vet_first(frame)``: raises a ValueError for a message refused by its first frame (who sent it, to whom), so
    the rest is never read and held (a stranger's 64 MiB were, to be refused once whole)."""
    frames = []
    async for frame in iterate_frames(reader, max_bytes, first_marker, max_frames, max_frame_bytes):
        if not frames and vet_first is not None:
            vet_first(frame)
        frames.append(frame)
    if not frames:
        raise ValueError("empty message: no frames before end of stream")
    return frames


Reply = Union[runtime_pb2.ExpertResponse, RPCError]


INCOMPLETE = "message incomplete"  # how message_reply refuses a stream that stayed silent past its timeout


async def message_reply(name: str, peer_id: PeerID, respond: Callable[[], Awaitable[runtime_pb2.ExpertResponse]],
                        timeout: float, on_refused: Optional[Callable[[str], None]] = None,
                        on_broken: Optional[Callable[[], None]] = None) -> Optional[Reply]:
    """What a stream handler sends back for one message: ``respond()`` reads and handles it within ``timeout``.

    Its response, or hivemind's error frame with a one-line reason: the message was refused (a
    ``ValueError`` from reading or handling), the stream stayed silent past ``timeout`` (a slow peer cannot
    hold a handler open), or a bug of ours raised (logged; the sender still gets a reason). ``on_refused``
    gets the reason of a refusal or timeout (by default it is logged). ``None`` when the sender went away
    mid-message (``on_broken`` is told): nobody is left to answer.
    """
    try:
        return await asyncio.wait_for(respond(), timeout)
    except ValueError as e:
        reason = str(e)
    except asyncio.TimeoutError:
        reason = f"{INCOMPLETE}: no end of stream within {timeout:.0f}s"
    except (asyncio.IncompleteReadError, ConnectionError):
        if on_broken is not None:
            on_broken()
        return None
    except Exception as e:
        logger.exception(f"{name}: a message from {peer_id} failed")
        return RPCError(message=f"internal error: {type(e).__name__}: {e}")
    if on_refused is not None:
        on_refused(reason)
    else:
        logger.info(f"{name}: refused a message from {peer_id}: {reason}")
    return RPCError(message=reason)


async def send_reply(reply: Reply, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     linger: bool = False, write_timeout: Optional[float] = None) -> None:
    """Send a handler's reply; after an error, drop what the sender still writes for a moment, since closing
    with unread input resets the stream before the sender reads our reason. ``linger``: after any reply, wait
    as long for the sender to close first, as a sender using :func:`call_stream` does once it has the reply
    (our closing first could lose the reply on its way, see there); one using hivemind's
    ``call_protobuf_handler`` waits for us to close, so it would wait that long for nothing. ``write_timeout``:
    seconds the reply may take to go out (a sender that stops reading keeps it in memory until then)."""
    try:
        await asyncio.wait_for(P2P.send_protobuf(reply, writer), write_timeout)
        if linger or isinstance(reply, RPCError):
            await asyncio.wait_for(_discard(reader), DISCARD_SECONDS)
    except (ConnectionError, asyncio.TimeoutError):
        pass  # the sender went away or keeps writing; it has our answer or will retry


FrameHandler = Callable[[List[runtime_pb2.ExpertRequest], P2PContext], Awaitable[runtime_pb2.ExpertResponse]]


def bounded_stream_handler(name: str, local_id: PeerID, handle: FrameHandler, max_bytes: int, timeout: float,
                           linger: bool = False, replies: Optional[asyncio.Semaphore] = None):
    """A binary stream handler that reads one message of at most ``max_bytes`` within ``timeout`` seconds.

    ``handle`` gets the frames and returns the response; what goes back otherwise is :func:`message_reply`'s.
    Register it with ``P2P.add_binary_stream_handler``. ``linger``: its callers close first once they have the
    reply (:func:`call_stream`, as ``Routes.call`` does), so the handler waits for that (:func:`send_reply`).
    ``replies``: for a handler whose replies are large (a stage's optimizer state), how many are made and sent at
    once; each is then written within ``timeout`` too, as a caller that never reads held its copies for good.
    """

    async def serve(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        context = P2PContext(handle_name=name, local_id=local_id, remote_id=stream_info.peer_id)
        slot = []

        async def respond() -> runtime_pb2.ExpertResponse:
            frames = await read_frames(reader, max_bytes)
            if replies is not None:  # taken once the request is read: a silent caller holds no slot
                await replies.acquire()
                slot.append(replies)
            return await handle(frames, context)

        with closing(writer):
            try:
                reply = await message_reply(name, stream_info.peer_id, respond, timeout)
                if reply is not None:
                    await send_reply(reply, reader, writer, linger=linger,
                                     write_timeout=None if replies is None else timeout)
            finally:
                for taken in slot:
                    taken.release()

    return serve


async def _discard(reader: asyncio.StreamReader) -> None:
    while await reader.read(2**16):
        pass
