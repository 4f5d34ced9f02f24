"""Downloading the current parameters of a layer range from peers that hold them (as in DeDLOC).

A late joiner, a standby that replaces a dead stage, and a peer whose layer range changed with a new
plan all do the same thing: for every layer they now own, ask a peer whose record says it holds
that layer (the one with the highest step) for that layer's tensors.

Wire format: a server-streaming handler ``ravnest.layer_state``. The request (one frame, read bounded)
names the run and the layers; the answer is a stream of ``ExpertResponse``: for each tensor, its parts
from hivemind's ``split_for_streaming`` of a ``serialize_torch_tensor`` protobuf, the first part carrying
``{"layer", "name", "parts", "step"}``. The receiver checks every tensor's name, shape, dtype and
finiteness against the layers it built itself, so a holder can serve only numbers, never structure.

A holder that we can reach only through a backbone's forwarding (both of us behind NAT) is asked with
``ravnest.layer_state_message`` instead: forwarded calls carry one reply message, so the request names
one layer and the reply holds all its tensors, ``{"layer", "names", "step"}`` with the tensors in the
order of ``names``, bounded by the backbone's per-stream byte cap.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import closing
from typing import Annotated, AsyncIterator, Awaitable, Callable, Dict, List, Optional, Sequence, Tuple, Type

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming
from pydantic import Field

from ravnest_swarm.membership.records import MAX_LAYOUT_LAYERS, MAX_LAYOUT_TENSORS, RUN_NAME_RE
from ravnest_swarm.net.messages import Handler, Message, MessageError, MessageT, decode_message, register_handler
from ravnest_swarm.net.routes import Routes
from ravnest_swarm.net.transport import (INCOMPLETE, bounded_stream_handler, make_request, make_response, read_frames,
                                         send_reply)

logger = logging.getLogger(__name__)

LAYER_STATE = "ravnest.layer_state"
LAYER_STATE_MESSAGE = "ravnest.layer_state_message"  # one layer in one reply, for forwarded calls
PART_BYTES = 1 << 20
MAX_PARTS = 1 << 16  # of one tensor: 64 GiB in parts of PART_BYTES
MAX_LAYERS_PER_REQUEST = MAX_LAYOUT_LAYERS
MAX_REQUEST_BYTES = 64 * 1024
ATTEMPTS_PER_HOLDER = 2

RunNameText = Annotated[str, Field(pattern=RUN_NAME_RE.pattern)]
LayerIndex = Annotated[int, Field(ge=0, lt=MAX_LAYOUT_LAYERS)]
TensorNameText = Annotated[str, Field(min_length=1, max_length=256)]  # as in the run spec's layout
Step = Annotated[int, Field(ge=0)]


class LayerStateRequest(Message):
    """The layers of ``run`` whose tensors the caller wants."""

    run: RunNameText
    layers: List[LayerIndex] = Field(min_length=1, max_length=MAX_LAYERS_PER_REQUEST)


class LayerStateMessageRequest(Message):
    """One layer of ``run`` whose tensors the caller wants in one reply."""

    run: RunNameText
    layers: List[LayerIndex] = Field(min_length=1, max_length=1)


class LayerStateTensorHeader(Message):
    """The metadata of a tensor's first part in a ``layer_state`` stream (its other parts carry an empty map)."""

    layer: LayerIndex
    name: TensorNameText
    parts: int = Field(ge=1, le=MAX_PARTS)
    step: Step


class LayerStateMessageReply(Message):
    """One layer's tensors, in the order of ``names``, and the optimizer step they are at."""

    layer: LayerIndex
    names: List[TensorNameText] = Field(max_length=MAX_LAYOUT_TENSORS)
    step: Step


register_handler(Handler(LAYER_STATE, LayerStateRequest, LayerStateTensorHeader, MAX_REQUEST_BYTES,
                         callers="any peer of the run (a late joiner, a standby, a peer whose layers changed)",
                         owner=__name__))
register_handler(Handler(LAYER_STATE_MESSAGE, LayerStateMessageRequest, LayerStateMessageReply, MAX_REQUEST_BYTES,
                         callers="any peer of the run, directly or through a backbone's forward", owner=__name__))

# what a server offers right now: layer index -> (that layer's state dict, the optimizer step it is at)
StateProvider = Callable[[], Dict[int, Tuple[Dict[str, torch.Tensor], int]]]


def offered_layers(start: int, module: torch.nn.Sequential, step: int) -> Dict[int, Tuple[Dict[str, torch.Tensor], int]]:
    """A stage's layers (``start`` onwards) in the form a :data:`StateProvider` returns."""
    return {start + offset: (layer.state_dict(), step) for offset, layer in enumerate(module)}


class StateTransferError(Exception):
    """No holder could give a layer, or what it gave does not fit."""


class LayerStateServer:
    """Serves this peer's current layers to peers that need them.

    :param routes: the peer's routes (its P2P and backbones)
    :param run: run name; requests for other runs are refused
    :param provider: returns what this peer holds right now, by layer
    :param request_timeout: seconds a caller of the one-message handler may take to send its request
    """

    def __init__(self, routes: Routes, run: str, provider: StateProvider, request_timeout: float = 60.0):
        self.routes, self.p2p = routes, routes.p2p
        self.run, self.provider, self.request_timeout = run, provider, request_timeout

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(LAYER_STATE, self._serve_layer_state)
        await self.routes.add_forwardable_handler(LAYER_STATE_MESSAGE, bounded_stream_handler(
            LAYER_STATE_MESSAGE, self.p2p.peer_id, self._rpc_layer_state_message, MAX_REQUEST_BYTES,
            self.request_timeout))

    def _snapshot(self, request: runtime_pb2.ExpertRequest, schema: Type[MessageT],
                  handler: str) -> List[Tuple[int, Dict[str, torch.Tensor], int]]:
        """The requested layers' tensors, copied to host memory (training may go on while they are sent, and
        serialization reads the host), and steps."""
        asked = decode_message(schema, request.metadata, handler)
        if asked.run != self.run:
            raise ValueError(f"this peer serves run {self.run!r}")
        layers = asked.layers
        offered = self.provider()
        missing = [i for i in layers if i not in offered]
        if missing:
            raise ValueError(f"this peer does not hold layers {missing}")
        return [(i, {name: t.detach().to("cpu", copy=True) for name, t in offered[i][0].items()}, offered[i][1])
                for i in layers]

    async def _rpc_layer_state_message(self, frames: List[runtime_pb2.ExpertRequest],
                                       context: P2PContext) -> runtime_pb2.ExpertResponse:
        if len(frames) != 1:
            raise ValueError(f"{LAYER_STATE_MESSAGE} takes one request frame, got {len(frames)}")
        (layer, tensors, step), = self._snapshot(frames[0], LayerStateMessageRequest, LAYER_STATE_MESSAGE)
        names = list(tensors)
        reply = LayerStateMessageReply(layer=layer, names=names, step=int(step))
        return make_response(reply.as_metadata(), [serialize_torch_tensor(tensors[name]) for name in names])

    async def _serve_layer_state(self, info: StreamInfo, reader: asyncio.StreamReader,
                                 writer: asyncio.StreamWriter) -> None:
        """Read one request frame within ``MAX_REQUEST_BYTES`` and ``request_timeout`` (hivemind's own
        server-streaming handler would read a frame of any announced length), then stream the answer."""
        context = P2PContext(handle_name=LAYER_STATE, local_id=self.p2p.peer_id, remote_id=info.peer_id)
        with closing(writer):
            try:
                frames = await asyncio.wait_for(read_frames(reader, MAX_REQUEST_BYTES), self.request_timeout)
                if len(frames) != 1:
                    raise ValueError(f"{LAYER_STATE} takes one request frame, got {len(frames)}")
                async for response in self.rpc_layer_state(frames[0], context):
                    await P2P.send_protobuf(response, writer)
                return
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # the caller went away
            except asyncio.TimeoutError:
                reason = f"{INCOMPLETE}: no end of stream within {self.request_timeout:.0f}s"
            except ValueError as e:
                reason = str(e)
            except Exception as e:
                logger.exception(f"{LAYER_STATE}: a request from {info.peer_id} failed")
                reason = f"internal error: {type(e).__name__}: {e}"
            logger.info(f"{LAYER_STATE}: refused a request from {info.peer_id}: {reason}")
            await send_reply(RPCError(message=reason), reader, writer)

    async def rpc_layer_state(self, request: runtime_pb2.ExpertRequest,
                              context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        for layer, tensors, step in self._snapshot(request, LayerStateRequest, LAYER_STATE):
            for name, tensor in tensors.items():
                parts = list(split_for_streaming(serialize_torch_tensor(tensor), PART_BYTES))
                header = LayerStateTensorHeader(layer=layer, name=name, parts=len(parts), step=int(step))
                for index, part in enumerate(parts):
                    yield make_response(header.as_metadata() if index == 0 else {}, [part])


async def fetch_layer(routes: Routes, run: str, holder: PeerID, layer: int, expected: Dict[str, torch.Tensor],
                      timeout: float) -> Tuple[Dict[str, torch.Tensor], int]:
    """One layer's tensors from ``holder``, checked against ``expected`` (the layer as built locally)."""

    async def collect() -> Tuple[Dict[str, torch.Tensor], int]:
        received: Dict[str, torch.Tensor] = {}
        step = 0
        request = make_request(LayerStateRequest(run=run, layers=[layer]).as_metadata())
        stream = await routes.p2p.iterate_protobuf_handler(holder, LAYER_STATE, request, runtime_pb2.ExpertResponse)
        header, parts = None, []
        async for response in stream:
            if not parts:
                header = _reply(LayerStateTensorHeader, response.metadata, LAYER_STATE, holder)
                if header.layer != layer or header.name not in expected:
                    raise StateTransferError(f"{holder} sent an unexpected tensor {header.name!r} of layer {header.layer}")
            parts.extend(response.tensors)
            if len(parts) == header.parts:
                tensor = deserialize_torch_tensor(combine_from_streaming(parts))
                received[header.name] = _checked(holder, layer, header.name, tensor, expected)
                step = max(step, header.step)
                parts = []
        return _complete(holder, layer, received, expected), step

    return await asyncio.wait_for(collect(), timeout)


async def fetch_layer_message(routes: Routes, run: str, holder: PeerID, layer: int, expected: Dict[str, torch.Tensor],
                              timeout: float) -> Tuple[Dict[str, torch.Tensor], int]:
    """:func:`fetch_layer` in one reply message, over the route :class:`Routes` chose (forwarding included)."""

    async def request() -> AsyncIterator[runtime_pb2.ExpertRequest]:
        yield make_request(LayerStateMessageRequest(run=run, layers=[layer]).as_metadata())

    response = await asyncio.wait_for(routes.call(holder, LAYER_STATE_MESSAGE, request()), timeout)
    reply = _reply(LayerStateMessageReply, response.metadata, LAYER_STATE_MESSAGE, holder)
    if reply.layer != layer or len(reply.names) != len(response.tensors):
        raise StateTransferError(f"{holder} sent a malformed reply for layer {layer}")
    received = {}
    for name, serialized in zip(reply.names, response.tensors):
        if name not in expected:
            raise StateTransferError(f"{holder} sent an unexpected tensor {name!r} of layer {layer}")
        received[name] = _checked(holder, layer, name, deserialize_torch_tensor(serialized), expected)
    return _complete(holder, layer, received, expected), reply.step


def _reply(schema: Type[MessageT], raw: bytes, handler: str, holder: PeerID) -> MessageT:
    try:
        return decode_message(schema, raw, handler)
    except MessageError as e:
        raise StateTransferError(f"{holder} sent a malformed reply: {e}") from None


def _checked(holder: PeerID, layer: int, name: str, tensor: torch.Tensor,
             expected: Dict[str, torch.Tensor]) -> torch.Tensor:
    """``tensor`` if it fits ``expected[name]`` in shape and dtype and holds only finite numbers."""
    reference = expected[name]
    if tensor.shape != reference.shape or tensor.dtype != reference.dtype:
        raise StateTransferError(f"{holder} sent {name} of layer {layer} with shape "
                                 f"{tuple(tensor.shape)} {tensor.dtype}, expected {tuple(reference.shape)}")
    if tensor.is_floating_point() and not torch.isfinite(tensor).all():
        raise StateTransferError(f"{holder} sent non-finite values for layer {layer}")
    return tensor


def _complete(holder: PeerID, layer: int, received: Dict[str, torch.Tensor],
              expected: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    if set(received) != set(expected):
        raise StateTransferError(f"{holder} sent {sorted(received)} of layer {layer}, expected {sorted(expected)}")
    return received


async def download_layers(routes: Routes, run: str, module: torch.nn.Sequential, start: int,
                          holders: Dict[int, Sequence[PeerID]], timeout: float,
                          on_progress: Optional[Callable[[int, int], None]] = None,
                          reach: Optional[Callable[[PeerID], Awaitable[str]]] = None) -> int:
    """Fill ``module`` (layers ``start..``) from the holders, trying each holder of a layer in turn.

    ``reach`` connects to a holder before it is asked and returns the route (``Routes.connect``): a
    holder behind NAT dials us back at a backbone's request; one reachable only through a backbone's
    forwarding (both behind NAT) gives the layer in one message (:func:`fetch_layer_message`).
    Returns the highest step among the holders used. Raises :class:`StateTransferError` if a layer has
    no holder left; layers already loaded stay loaded.
    """
    step = 0
    layers = list(range(start, start + len(module)))
    for done, layer in enumerate(layers):
        expected = module[layer - start].state_dict()
        errors: List[str] = []
        # each holder twice: a stream that ran on a relayed connection ends when the relay resets it (after
        # 128 KiB, docs/nat.md), and the next one runs on the direct connection the reversal opened
        for holder in [holder for holder in holders.get(layer, ()) for _ in range(ATTEMPTS_PER_HOLDER)]:
            try:
                forwarded = reach is not None and await reach(holder) == "forward"
                fetch = fetch_layer_message if forwarded else fetch_layer
                tensors, holder_step = await fetch(routes, run, holder, layer, expected, timeout)
            except Exception as e:  # a holder that left or misbehaved: try again, then the next one
                errors.append(f"{holder}: {e}")
                continue
            module[layer - start].load_state_dict(tensors)
            step = max(step, holder_step)
            break
        else:
            raise StateTransferError(f"no holder could give layer {layer}: {'; '.join(errors) or 'nobody holds it'}")
        if on_progress is not None:
            on_progress(done + 1, len(layers))
    return step
