"""Downloading the current parameters of a layer range from peers that hold them (as in DeDLOC).

A late joiner, a standby that replaces a dead stage, and a peer whose layer range changed with a new
plan all do the same thing: for every layer they now own, ask a peer whose record says it holds
that layer (the one with the highest step) for that layer's tensors.

Wire format: a server-streaming handler ``ravnest.layer_state``. The request's metadata names the
run and the layers; the answer is a stream of ``ExpertResponse``: for each tensor, its parts from
hivemind's ``split_for_streaming`` of a ``serialize_torch_tensor`` protobuf, the first part carrying
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
from typing import AsyncIterator, Awaitable, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from ravnest_swarm.net.routes import Routes
from ravnest_swarm.net.transport import bounded_stream_handler, make_request, make_response, unpack_metadata

logger = logging.getLogger(__name__)

LAYER_STATE = "ravnest.layer_state"
LAYER_STATE_MESSAGE = "ravnest.layer_state_message"  # one layer in one reply, for forwarded calls
PART_BYTES = 1 << 20
MAX_LAYERS_PER_REQUEST = 4096
MAX_REQUEST_BYTES = 64 * 1024
ATTEMPTS_PER_HOLDER = 2

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
        await self.p2p.add_protobuf_handler(LAYER_STATE, self.rpc_layer_state, runtime_pb2.ExpertRequest,
                                            stream_output=True)
        await self.routes.add_forwardable_handler(LAYER_STATE_MESSAGE, bounded_stream_handler(
            LAYER_STATE_MESSAGE, self.p2p.peer_id, self._rpc_layer_state_message, MAX_REQUEST_BYTES,
            self.request_timeout))

    def _snapshot(self, request: runtime_pb2.ExpertRequest) -> List[Tuple[int, Dict[str, torch.Tensor], int]]:
        """The requested layers' tensors, copied to host memory (training may go on while they are sent, and
        serialization reads the host), and steps."""
        metadata = unpack_metadata(request.metadata)
        layers = metadata.get("layers")
        if metadata.get("run") != self.run:
            raise ValueError(f"this peer serves run {self.run!r}")
        if not isinstance(layers, list) or not 0 < len(layers) <= MAX_LAYERS_PER_REQUEST \
                or not all(isinstance(i, int) for i in layers):
            raise ValueError("'layers' must be a non-empty list of layer indices")
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
        snapshot = self._snapshot(frames[0])
        if len(snapshot) != 1:
            raise ValueError(f"{LAYER_STATE_MESSAGE} gives one layer per request")
        (layer, tensors, step), = snapshot
        names = list(tensors)
        return make_response({"layer": layer, "names": names, "step": step},
                             [serialize_torch_tensor(tensors[name]) for name in names])

    async def rpc_layer_state(self, request: runtime_pb2.ExpertRequest,
                              context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        for layer, tensors, step in self._snapshot(request):
            for name, tensor in tensors.items():
                parts = list(split_for_streaming(serialize_torch_tensor(tensor), PART_BYTES))
                for index, part in enumerate(parts):
                    header = {"layer": layer, "name": name, "parts": len(parts), "step": step} if index == 0 else {}
                    yield make_response(header, [part])


async def fetch_layer(routes: Routes, run: str, holder: PeerID, layer: int, expected: Dict[str, torch.Tensor],
                      timeout: float) -> Tuple[Dict[str, torch.Tensor], int]:
    """One layer's tensors from ``holder``, checked against ``expected`` (the layer as built locally)."""

    async def collect() -> Tuple[Dict[str, torch.Tensor], int]:
        received: Dict[str, torch.Tensor] = {}
        step = 0
        stream = await routes.p2p.iterate_protobuf_handler(holder, LAYER_STATE, make_request({"run": run, "layers": [layer]}),
                                                    runtime_pb2.ExpertResponse)
        header, parts = None, []
        async for response in stream:
            if not parts:
                header = unpack_metadata(response.metadata)
                if header.get("layer") != layer or header.get("name") not in expected:
                    raise StateTransferError(f"{holder} sent an unexpected tensor {header}")
                if not isinstance(header.get("parts"), int) or not 0 < header["parts"] <= 1 << 16:
                    raise StateTransferError(f"{holder} sent a bad part count")
            parts.extend(response.tensors)
            if len(parts) == header["parts"]:
                tensor = deserialize_torch_tensor(combine_from_streaming(parts))
                received[header["name"]] = _checked(holder, layer, header["name"], tensor, expected)
                step = max(step, int(header.get("step", 0)))
                parts = []
        return _complete(holder, layer, received, expected), step

    return await asyncio.wait_for(collect(), timeout)


async def fetch_layer_message(routes: Routes, run: str, holder: PeerID, layer: int, expected: Dict[str, torch.Tensor],
                              timeout: float) -> Tuple[Dict[str, torch.Tensor], int]:
    """:func:`fetch_layer` in one reply message, over the route :class:`Routes` chose (forwarding included)."""

    async def request() -> AsyncIterator[runtime_pb2.ExpertRequest]:
        yield make_request({"run": run, "layers": [layer]})

    response = await asyncio.wait_for(routes.call(holder, LAYER_STATE_MESSAGE, request()), timeout)
    header = unpack_metadata(response.metadata)
    names = header.get("names")
    if header.get("layer") != layer or not isinstance(names, list) or len(names) != len(response.tensors):
        raise StateTransferError(f"{holder} sent a malformed reply for layer {layer}")
    received = {}
    for name, serialized in zip(names, response.tensors):
        if name not in expected:
            raise StateTransferError(f"{holder} sent an unexpected tensor {name!r} of layer {layer}")
        received[name] = _checked(holder, layer, name, deserialize_torch_tensor(serialized), expected)
    return _complete(holder, layer, received, expected), int(header.get("step", 0))


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
