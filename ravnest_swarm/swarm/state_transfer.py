"""Downloading the current parameters of a layer range from peers that hold them (as in DeDLOC).

Over 400 lines because the server (what a holder offers and how it streams it), the two wire forms (streamed,
and one message for forwarded calls) and the joiner's rule of belief are one protocol: split, each half would
restate the other's schemas and limits.

A late joiner, a standby that replaces a dead stage, and a peer whose layer range changed with a new
plan all do the same thing: for every layer they now own, ask the peers whose records say they hold
that layer for its tensors (:func:`fill_layer`). Records are self-declared, so a holder is not believed
alone where others like it can be asked:

* the holders that count are the layer's trainers under the plan in force before the adopted one: those the
  adopted plan keeps, else those that leave (a peer that trained the layer alone: a standby's older copy does not
  outvote it); where none offers the layer, those the adopted plan names (any stage of any cluster); others (a
  stranger) count only when the plan names none that offers the layer (:func:`counted_offers`);
* the layer's step is the median of their claims (the lower of the middle two): only a majority of
  them can move it, never the highest claim alone;
* where two or more count, two of them must serve the same content (sha256 of every tensor): each
  serves the layer as its last averaging round left it (identical on every member of the rings, while
  the live weights of two clusters drift apart), and we ask holder after holder until two agree;
  if none do, we keep our own weights and say so; but where none of them has an averaged copy at all (the
  first clusters of a run: one trained alone, the others took its layers a moment ago), we take the live
  weights of the holder nearest the agreed step, and say so.
  :attr:`LayerFill.unanswered` names the holders that served nothing: the joiner looks up the layer's holders again
  without them (``Volunteer._download``), since a leaver may have gone once another peer held its layers.
  One holder alone is asked for its live weights, which it copies once for our whole download, so all the
  layers we get from it are of one step.
* a holder keeps the averaged copies of its last :data:`KEPT_ROUNDS` rounds, and a request may name one by its
  step: two holders whose last copies are a round apart agree on the earlier one, and the stages of a new cluster
  all take the round its first stage took (``Volunteer._download``), so the cluster starts from one step.

Wire format: a server-streaming handler ``ravnest.layer_state``. The request (one frame, read bounded)
names the run and the layers; the answer is a stream of ``ExpertResponse``: for each tensor, its parts
from hivemind's ``split_for_streaming`` of a ``serialize_torch_tensor`` protobuf, the first part carrying
``{"layer", "name", "parts", "step"}``. The receiver checks every tensor's name, shape, dtype and
finiteness against the layers it built itself, so a holder can serve only numbers, never structure.

A holder reached only through a backbone's forwarding (both of us behind NAT) is asked with
``ravnest.layer_state_message``: forwarded calls carry one reply, so the request names one layer and the reply
holds its tensors, ``{"layer", "names", "step"}`` in the order of ``names``, within the backbone's byte cap.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter
from contextlib import aclosing, closing
from dataclasses import dataclass, replace
from typing import Annotated, AsyncIterator, Awaitable, Callable, Dict, List, Optional, Sequence, Set, Tuple, Type

import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming
from pydantic import Field

from ravnest_swarm.checkpoint import first_non_finite
from ravnest_swarm.codecs.codec import CodecError, raw_tensor
from ravnest_swarm.membership.records import CONTROL_CHARACTER_RE, MAX_LAYOUT_LAYERS, MAX_LAYOUT_TENSORS, RUN_NAME_RE
from ravnest_swarm.net.messages import Handler, Message, MessageError, MessageT, decode_message, register_handler
from ravnest_swarm.net.routes import Routes
from ravnest_swarm.net.transport import (INCOMPLETE, SMALL_REPLY_BYTES, bounded_stream_handler, iterate_replies,
                                         make_request, make_response, read_frames, send_reply)
from ravnest_swarm.swarm.placement import copies_to_agree, offered_step

logger = logging.getLogger(__name__)

LAYER_STATE = "ravnest.layer_state"
LAYER_STATE_MESSAGE = "ravnest.layer_state_message"  # one layer in one reply, for forwarded calls
PART_BYTES = 1 << 20
HELD_COPY_SECONDS = 60.0  # how long a copy of our layers serves one requester (a stage's download: _held_copy)
# requesters with a copy at once: a new cluster's stages each download theirs; more, and the least recently asked
# goes (its requester's next layer comes from a fresh copy), so peer ids made up by the hundred hold no more than this
MAX_HELD_COPIES = 4
MAX_PARTS = 1 << 16  # of one tensor: 64 GiB in parts of PART_BYTES
# what a reply may carry beyond the raw bytes of the tensors asked for (protobuf and msgpack framing, names, a step):
# a holder never makes us read more than that for a layer of known size (a hostile one streamed 256 MiB for 96 bytes)
REPLY_SLACK_BYTES = 1 << 20
MAX_LAYERS_PER_REQUEST = MAX_LAYOUT_LAYERS
MAX_REQUEST_BYTES = 64 * 1024
ATTEMPTS_PER_HOLDER = 2
# averaging rounds whose state a holder keeps: the stages of a new cluster all start from one round's (the one its
# first stage took), which must still be on offer when the others ask (a moment later: a record's renewal)
KEPT_ROUNDS = 4

RunNameText = Annotated[str, Field(pattern=RUN_NAME_RE.pattern)]
LayerIndex = Annotated[int, Field(ge=0, lt=MAX_LAYOUT_LAYERS)]
TensorNameText = Annotated[str, Field(min_length=1, max_length=256)]  # as in the run spec's layout
Step = Annotated[int, Field(ge=0, le=2**53)]  # as every message's step: a holder's 2**64 - 1 became a stage's


class LayerStateRequest(Message):
    """The layers of ``run`` whose tensors the caller wants: live, or as an averaging round left them (the last one,
    or the round of step ``round_step``)."""

    run: RunNameText
    layers: List[LayerIndex] = Field(min_length=1, max_length=MAX_LAYERS_PER_REQUEST)
    averaged: bool = False
    round_step: Optional[Step] = None


class LayerStateMessageRequest(Message):
    """One layer of ``run`` whose tensors the caller wants in one reply."""

    run: RunNameText
    layers: List[LayerIndex] = Field(min_length=1, max_length=1)
    averaged: bool = False
    round_step: Optional[Step] = None


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
LayerStates = Dict[int, Tuple[Dict[str, torch.Tensor], int]]
StateProvider = Callable[[], LayerStates]


def offered_layers(start: int, module: torch.nn.Sequential, step: int) -> LayerStates:
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
        # the layers as our last KEPT_ROUNDS averaging rounds left them, by the round's step (keep_averaged)
        self.averaged_rounds: Dict[int, LayerStates] = {}
        self._copies: Dict[PeerID, Tuple[float, LayerStates]] = {}  # each requester's: (when, what) (_held_copy)
        self._used: Dict[PeerID, float] = {}  # when each requester with a copy last asked
        # how many times each layer went out whole, by (requester, layer): a leaver that alone held a layer goes only
        # once it did, to a peer a plan places (``hand_over.py``)
        self.served: Counter = Counter()

    def keep_averaged(self, layers: LayerStates) -> None:
        """Keep a copy of ``layers`` as an averaging round in which all our rings finished left them: the
        same on every member, so what two holders of a layer in different clusters serve can be compared. The
        last :data:`KEPT_ROUNDS` rounds are kept, so a new cluster's stages can all take one round's state."""
        for index, (state, step) in layers.items():
            self.averaged_rounds.setdefault(step, {})[index] = (
                {name: t.detach().to("cpu", copy=True) for name, t in state.items()}, step)
        for step in sorted(self.averaged_rounds)[:-KEPT_ROUNDS]:
            del self.averaged_rounds[step]

    def kept_rounds(self, start: int, end: int) -> List[int]:
        """The rounds (their steps) of which we keep every layer of ``start:end`` averaged, oldest first: what our
        record's ``kept_rounds`` says, so that a new cluster's first stage picks a round every stage of it can take."""
        return [step for step, layers in sorted(self.averaged_rounds.items())
                if all(index in layers for index in range(start, end))]

    def averaged(self, round_step: Optional[int] = None) -> LayerStates:
        """The layers as the round of step ``round_step`` left them; without one, each layer as its last round did."""
        if round_step is not None:
            return self.averaged_rounds.get(round_step, {})
        latest: LayerStates = {}
        for step in sorted(self.averaged_rounds):
            latest.update(self.averaged_rounds[step])
        return latest

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(LAYER_STATE, self.routes.gated(LAYER_STATE, self._serve_layer_state))
        await self.routes.add_forwardable_handler(LAYER_STATE_MESSAGE, bounded_stream_handler(
            LAYER_STATE_MESSAGE, self.p2p.peer_id, self._rpc_layer_state_message, MAX_REQUEST_BYTES,
            self.request_timeout, linger=True))

    def _snapshot(self, request: runtime_pb2.ExpertRequest, schema: Type[MessageT], handler: str,
                  requester: PeerID) -> List[Tuple[int, Dict[str, torch.Tensor], int]]:
        """The requested layers' tensors, copies in host memory (training goes on while they are sent), and steps."""
        asked = decode_message(schema, request.metadata, handler)
        if asked.run != self.run:
            raise ValueError(f"this peer serves run {self.run!r}")
        offered = self.averaged(asked.round_step) if asked.averaged else self._held_copy(asked.layers, requester)
        missing = [i for i in asked.layers if i not in offered]
        if missing:
            kind = "an averaged copy of layers" if asked.averaged else "layers"
            of_round = f" of the round of step {asked.round_step}" if asked.averaged and asked.round_step is not None \
                else ""
            raise ValueError(f"this peer does not hold {kind} {missing}{of_round}")
        return [(i, offered[i][0], offered[i][1]) for i in asked.layers]

    def _held_copy(self, layers: List[int], requester: PeerID) -> LayerStates:
        """A copy of all we hold, served to one requester for :data:`HELD_COPY_SECONDS` (issue 29: a copy at each request
        gave a joiner layers of several steps, a state no cluster had)."""
        now = time.monotonic()
        self._copies = {peer: copy for peer, copy in self._copies.items() if now - copy[0] <= HELD_COPY_SECONDS}
        if (copy := self._copies.get(requester)) is None or any(i not in copy[1] for i in layers):
            held = self.provider()
            if any(i not in held for i in layers):
                return held  # refused by the caller before anything is copied (a stranger's asks for layers we do
                # not hold each made a copy of all we hold, kept for a minute, one per peer id it made up)
            if requester not in self._copies and len(self._copies) >= MAX_HELD_COPIES:
                # the least recently asked goes: a download under way asks layer after layer and keeps its copy
                del self._copies[min(self._copies, key=lambda peer: self._used.get(peer, 0.0))]
            copy = self._copies[requester] = (now, {i: ({n: t.detach().to("cpu", copy=True) for n, t in state.items()},
                                                        step) for i, (state, step) in held.items()})
        self._used = {peer: used for peer, used in self._used.items() if peer in self._copies}
        self._used[requester] = now
        return copy[1]

    async def _rpc_layer_state_message(self, frames: List[runtime_pb2.ExpertRequest],
                                       context: P2PContext) -> runtime_pb2.ExpertResponse:
        if len(frames) != 1:
            raise ValueError(f"{LAYER_STATE_MESSAGE} takes one request frame, got {len(frames)}")
        (layer, tensors, step), = self._snapshot(frames[0], LayerStateMessageRequest, LAYER_STATE_MESSAGE,
                                                 context.remote_id)
        names = list(tensors)
        reply = LayerStateMessageReply(layer=layer, names=names, step=int(step))
        response = make_response(reply.as_metadata(), [serialize_torch_tensor(tensors[name]) for name in names])
        self.served[context.remote_id.to_base58(), layer] += 1
        return response

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
        for layer, tensors, step in self._snapshot(request, LayerStateRequest, LAYER_STATE, context.remote_id):
            for name, tensor in tensors.items():
                parts = list(split_for_streaming(serialize_torch_tensor(tensor), PART_BYTES))
                header = LayerStateTensorHeader(layer=layer, name=name, parts=len(parts), step=int(step))
                for index, part in enumerate(parts):
                    yield make_response(header.as_metadata() if index == 0 else {}, [part])
            self.served[context.remote_id.to_base58(), layer] += 1  # resumed once its last part was written


async def fetch_layer(routes: Routes, run: str, holder: PeerID, layer: int, expected: Dict[str, torch.Tensor],
                      timeout: float, averaged: bool = False,
                      round_step: Optional[int] = None) -> Tuple[Dict[str, torch.Tensor], int]:
    """One layer's tensors from ``holder`` (its averaged copy if ``averaged``: of the round of step ``round_step``,
    or its last), checked against ``expected`` (the layer as built locally)."""

    async def collect() -> Tuple[Dict[str, torch.Tensor], int]:
        received: Dict[str, torch.Tensor] = {}
        step = 0
        request = make_request(LayerStateRequest(run=run, layers=[layer], averaged=averaged,
                                                 round_step=round_step).as_metadata())
        # each frame is one part and its header: read bounded, so no declared length makes us hold more
        replies = iterate_replies(routes.p2p, holder, LAYER_STATE, request, runtime_pb2.ExpertResponse,
                                  PART_BYTES + SMALL_REPLY_BYTES, routes.traffic)
        header, parts, part_bytes, limit = None, [], 0, 0
        async with aclosing(replies) as stream:  # closed at once when a part is refused
            async for response in stream:
                if not parts:
                    header = _reply(LayerStateTensorHeader, response.metadata, LAYER_STATE, holder)
                    if header.layer != layer or header.name not in expected:
                        raise StateTransferError(f"{holder} sent an unexpected tensor {header.name!r} of layer "
                                                 f"{header.layer}")
                    limit = tensor_bytes({header.name: expected[header.name]}) + REPLY_SLACK_BYTES
                    part_bytes = 0
                parts.extend(response.tensors)
                part_bytes += sum(len(part.buffer) for part in response.tensors)
                if len(parts) > header.parts or part_bytes > limit or header.parts > limit // PART_BYTES + 1:
                    raise StateTransferError(f"{holder} sent more than {header.name} of layer {layer} takes "
                                             f"({len(parts)} part(s) of {part_bytes} bytes, announced {header.parts}; "
                                             f"at most {limit} bytes)")
                if len(parts) == header.parts:
                    received[header.name] = _decoded(holder, layer, header.name, combine_from_streaming(parts),
                                                     expected)
                    step = max(step, header.step)
                    parts = []
        return _complete(holder, layer, received, expected), step

    return await asyncio.wait_for(collect(), timeout)


async def fetch_layer_message(routes: Routes, run: str, holder: PeerID, layer: int, expected: Dict[str, torch.Tensor],
                              timeout: float, averaged: bool = False,
                              round_step: Optional[int] = None) -> Tuple[Dict[str, torch.Tensor], int]:
    """:func:`fetch_layer` in one reply message, over the route :class:`Routes` chose (forwarding included)."""

    async def request() -> AsyncIterator[runtime_pb2.ExpertRequest]:
        yield make_request(LayerStateMessageRequest(run=run, layers=[layer], averaged=averaged,
                                                    round_step=round_step).as_metadata())

    response = await asyncio.wait_for(routes.call(holder, LAYER_STATE_MESSAGE, request(),
                                                  max_bytes=tensor_bytes(expected) + REPLY_SLACK_BYTES), timeout)
    reply = _reply(LayerStateMessageReply, response.metadata, LAYER_STATE_MESSAGE, holder)
    if reply.layer != layer or len(reply.names) != len(response.tensors):
        raise StateTransferError(f"{holder} sent a malformed reply for layer {layer}")
    received = {}
    for name, serialized in zip(reply.names, response.tensors):
        if name not in expected:
            raise StateTransferError(f"{holder} sent an unexpected tensor {name!r} of layer {layer}")
        received[name] = _decoded(holder, layer, name, serialized, expected)
    return _complete(holder, layer, received, expected), reply.step


def tensor_bytes(tensors: Dict[str, torch.Tensor]) -> int:
    """The raw bytes of ``tensors``: what their serialized copies (uncompressed) take on the wire."""
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())


def _reply(schema: Type[MessageT], raw: bytes, handler: str, holder: PeerID) -> MessageT:
    try:
        return decode_message(schema, raw, handler)
    except MessageError as e:
        raise StateTransferError(f"{holder} sent a malformed reply: {e}") from None


def _decoded(holder: PeerID, layer: int, name: str, serialized: runtime_pb2.Tensor,
             expected: Dict[str, torch.Tensor]) -> torch.Tensor:
    """The tensor ``serialized`` if it fits ``expected[name]`` in shape and dtype (its header checked before it is
    decoded: ``codecs.raw_tensor``) and holds only finite numbers."""
    reference = expected[name]
    try:
        tensor = raw_tensor(serialized, f"{name} of layer {layer} from {holder}", reference.shape, reference.dtype)
    except CodecError as e:
        raise StateTransferError(str(e)) from None
    if tensor.shape != reference.shape or tensor.dtype != reference.dtype:
        raise StateTransferError(f"{holder} sent {name} of layer {layer} with shape "
                                 f"{tuple(tensor.shape)} {tensor.dtype}, expected {tuple(reference.shape)}")
    if first_non_finite({name: tensor}) is not None:
        raise StateTransferError(f"{holder} sent non-finite values for layer {layer}")
    return tensor


def _complete(holder: PeerID, layer: int, received: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor]):
    if not received:  # a holder without the layer refuses in words: a stream with no tensor was cut short
        raise StateTransferError(f"{holder}'s stream of layer {layer} ended before its first tensor")
    if set(received) != set(expected):
        raise StateTransferError(f"{holder} sent {sorted(received)} of layer {layer}, expected {sorted(expected)}")
    return received


@dataclass(frozen=True)
class LayerOffer:
    """A peer whose record offers a layer: the step it claims, whether the plans vouch for it (the adopted plan names
    it, or it leaves the layer the plan before placed it on), and whether it trained the layer under the plan before
    (its copy is the layer's latest, unlike a standby's copy of an older place)."""

    holder: PeerID
    step: int
    planned: bool
    trained: bool = False
    leaving: bool = False  # a trainer whose record says it is leaving (it goes once another holds its layers)


@dataclass(frozen=True)
class LayerFill:
    """What :func:`fill_layer` did: the step training goes on from, whether the layer was loaded, and if not why;
    whose copy was loaded (two that agreed, or the only one), its step (an export names both, export.py), and
    whether it was an averaging round's (the same on every cluster) or a holder's live weights; where it was not
    loaded, the holders that served no copy at all (gone, unreachable, or misbehaving, unlike two that disagree)."""

    step: int
    loaded: bool
    problem: Optional[str] = None
    holders: Tuple[str, ...] = ()
    copy_step: Optional[int] = None
    averaged: bool = False
    unanswered: Tuple[str, ...] = ()


def offers_of(records: Sequence[Dict], plan: Optional[dict], layer: int,
              before: Optional[dict] = None) -> List[LayerOffer]:
    """Who offers ``layer`` by their peer records (``layers`` and ``held``), each marked with whether the plans vouch
    for it (``plan``, the adopted plan if any, names it, or it leaves a place on ``layer`` that ``before``, the plan
    in force before ``plan``, gave it) and whether it trained ``layer`` under ``before``: placed on it there, and its
    record says it trains (kept by ``plan``) or leaves. A peer placed there that never started (still a standby, its
    copy of an older place) is not a trainer."""
    planned = {stage["peer_id"] for cluster in plan["clusters"] for stage in cluster} if plan else set()
    trainers = {stage["peer_id"] for cluster in before["clusters"] for stage in cluster
                if stage["layers"][0] <= layer < stage["layers"][1]} if before else set()
    offers = []
    for record in records:
        step = offered_step(record, layer)
        if step is None:
            continue
        peer, state = record["peer_id"], record.get("state")
        leaving = peer in trainers and state == "leaving"
        kept = peer in trainers and peer in planned and state in ("training", "averaging", "done")
        offers.append(LayerOffer(PeerID.from_base58(peer), step, peer in planned or leaving, kept or leaving, leaving))
    return offers


def counted_offers(offers: Sequence[LayerOffer]) -> List[LayerOffer]:
    """The offers that count: those of the layer's trainers under the plan before that the plan keeps, else those of
    its trainers that leave (a standby's copy of a place it left long ago is no witness of the layer's step while
    they serve it: a walkthrough's standbys, placed when the only cluster left, took their own copies 17,000 steps
    old and the leaver's work was lost; a leaver beside kept trainers may be gone already, and they hold its last
    round), else those of holders the plan names, else all of them; one per holder (its lowest claim, should two
    records name one peer: it is one witness)."""
    counted: Dict[PeerID, LayerOffer] = {}
    kept = [offer for offer in offers if offer.trained and not offer.leaving]
    for offer in kept or [offer for offer in offers if offer.trained] or [offer for offer in offers if offer.planned] \
            or offers:
        if offer.holder not in counted or offer.step < counted[offer.holder].step:
            counted[offer.holder] = offer
    return list(counted.values())


def seeded_only(offers: Sequence[LayerOffer]) -> bool:
    """Whether every holder that counts offers the layer at step 0: the seeded weights, which every peer has, so
    nothing to fetch (a run's first stages once downloaded them from a neighbour that had published first, and
    started late). Every one: the median of two trained holders and two at 0 (a record a heartbeat old, or a lie)
    is 0 too, and the trained copy must still be fetched."""
    counted = counted_offers(offers)
    return bool(counted) and max(offer.step for offer in counted) == 0


def agreed_step(offers: Sequence[LayerOffer]) -> int:
    """The median of the offers' claimed steps, the lower of the middle two: a step that only a majority of
    the holders can move (one holder claiming a huge step, or 0, among honest ones changes nothing)."""
    steps = sorted(offer.step for offer in offers)
    return steps[(len(steps) - 1) // 2]


def content_digest(tensors: Dict[str, torch.Tensor]) -> str:
    """sha256 of a layer's tensors: names, dtypes, shapes and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}:".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


async def fill_layer(routes: Routes, run: str, layer_module: torch.nn.Module, layer: int, offers: Sequence[LayerOffer],
                     timeout: float, reach: Optional[Callable[[PeerID], Awaitable[str]]] = None,
                     round_step: Optional[int] = None) -> LayerFill:
    """Load ``layer_module`` (layer ``layer``) from its holders, trusting no single claim where others can be
    asked (module docstring); on failure it keeps its weights and :attr:`LayerFill.problem` says why.

    ``round_step``: the averaging round whose state to take (the one a new cluster's first stage took, so that all
    its stages start from one step): where two holders that count agree on their copy of that round (or the only
    one serves it), it is loaded; where none does, the layer is filled as without it, and
    :attr:`LayerFill.copy_step` says which step it came from.

    ``reach`` connects to a holder before it is asked and returns the route (``Routes.connect``): a
    holder behind NAT dials us back at a backbone's request; one reachable only through a backbone's
    forwarding (both behind NAT) gives the layer in one message (:func:`fetch_layer_message`).
    """
    counted = counted_offers(offers)
    if not counted:
        return LayerFill(0, False, f"nobody holds layer {layer}")
    step, expected = agreed_step(counted), layer_module.state_dict()
    averaged = len(counted) > 1
    ordered = sorted(counted, key=lambda offer: abs(offer.step - step))  # the likeliest to agree first
    errors: List[str] = []
    answered: Set[PeerID] = set()  # the holders that served a copy, of any round
    if round_step is not None:
        copies: Dict[str, Set[PeerID]] = {}
        fill = await _agreed_copy(routes, run, layer_module, layer, ordered, expected, timeout, reach, errors, copies,
                                  step, round_step, needed=copies_to_agree(len(counted)), answered=answered)
        if fill is not None:
            return fill
        errors.clear()  # what follows says what went wrong, if anything does
    if not averaged:  # the only holder that counts: its live weights, at the step it serves them at
        fill = await _first_live_copy(routes, run, layer_module, layer, ordered, expected, timeout, reach, errors)
        if fill is not None:
            return fill
    else:
        copies = {}  # content digest -> the holders that served it
        served: Set[int] = set()  # the rounds (steps) their copies were of
        fill = await _agreed_copy(routes, run, layer_module, layer, ordered, expected, timeout, reach, errors, copies,
                                  step, served=served, answered=answered)
        if fill is None and len(served) > 1:
            # one had finished a round the other had not yet: the earlier round, which both keep (KEPT_ROUNDS)
            fill = await _agreed_copy(routes, run, layer_module, layer, ordered, expected, timeout, reach, errors, {},
                                      step, round_step=min(served), answered=answered)
        if fill is not None:
            return fill
        disagreement = f"no two of its {len(counted)} holders serve the same averaged copy ({len(copies)} different ones)"
        # none has averaged yet (the run's first clusters: a holder that trained alone, and joiners that took its
        # layers a moment ago): the live weights of the holder at the agreed step beat our seeded ones, which
        # would undo all the training before us at the first averaging round. Copies that differ are another
        # matter: one of their holders lies, and neither is believed
        fill = None if copies else await _first_live_copy(routes, run, layer_module, layer, ordered, expected, timeout,
                                                          reach, errors)
        if fill is not None:
            # at the step it served them at, within the holders' claims: of several, none alone moves the step
            # (one served 2**53, and our stage would have counted from there); a live step a heartbeat past its
            # record's claim is the weights' own
            taken = min(max(fill.step, step), max(offer.step for offer in counted))
            return replace(fill, step=taken, problem=CONTROL_CHARACTER_RE.sub(
                " ", f"layer {layer}: {disagreement}: took the live weights of {fill.holders[0]} (served at step "
                     f"{fill.step}) at step {taken}, within the holders' claims"))
        errors.insert(0, disagreement)
    # the errors quote what holders sent back: no control characters reach our terminal or note
    return LayerFill(step, False, CONTROL_CHARACTER_RE.sub(" ", f"layer {layer}: {'; '.join(errors)}"),
                     unanswered=tuple(offer.holder.to_base58() for offer in ordered if offer.holder not in answered))


async def fill_again(routes: Routes, run: str, module: torch.nn.Sequential, start: int, failed: Dict[int, LayerFill],
                     read_offers: Callable[[], Awaitable[Callable[[int], List[LayerOffer]]]], timeout: float,
                     reach: Optional[Callable[[PeerID], Awaitable[str]]] = None, round_step: Optional[int] = None,
                     lookups: int = 5, pause: float = 1.0) -> Dict[int, LayerFill]:
    """Ask again for the layers in ``failed`` (layer of ``module``, whose first is ``start`` -> its first
    :class:`LayerFill`), of the holders that fresh records offer, less those that served nothing
    (:attr:`LayerFill.unanswered`): up to ``lookups`` looks ``pause`` s apart for all the layers together.
    ``read_offers()`` reads the records once and gives each layer's offers (:func:`offers_of`).

    The holders a first read named may be gone: a leaver goes once another peer holds its layers at its step, and
    that peer's record can be newer than the read (a walkthrough's taker, offered only the leaver, trained its
    layers from the seeded weights). A layer is asked again only when the holders that count changed. Where the
    new ones are all outside the plan, their weights are taken but the step stays the first fill's (the plan's
    holders' claim): a stranger's claim moves no step. Returns each layer's last fill."""
    failed = dict(failed)
    tried = {layer: set(filled.unanswered) for layer, filled in failed.items()}
    asked: Dict[int, Set[str]] = {}  # the holders that counted at the last ask: asked again only with others
    for _ in range(lookups if failed else 0):
        await asyncio.sleep(pause)
        try:
            offers_for = await read_offers()
        except Exception as e:  # no news of the holders: look again, the lookups still bound it
            logger.warning(f"reading the records of our layers' holders failed: {e}")
            continue
        for layer in [layer for layer, filled in sorted(failed.items()) if not filled.loaded]:
            offers = [offer for offer in offers_for(layer) if offer.holder.to_base58() not in tried[layer]]
            counted = {offer.holder.to_base58(): offer.planned for offer in counted_offers(offers)}
            if not counted or set(counted) == asked.get(layer):
                continue
            asked[layer] = set(counted)
            filled = await fill_layer(routes, run, module[layer - start], layer, offers, timeout, reach, round_step)
            tried[layer] |= set(filled.unanswered)
            if filled.loaded and any(counted.values()):
                failed[layer] = filled
            elif filled.loaded:
                failed[layer] = replace(filled, step=failed[layer].step, problem=(
                    f"layer {layer}: the plan's holders served nothing; took the copy of "
                    f"{', '.join(filled.holders)}, outside the plan, at step {failed[layer].step}"))
            else:
                failed[layer] = replace(filled, step=failed[layer].step)
        if all(filled.loaded for filled in failed.values()):
            break
    return failed


async def _agreed_copy(routes: Routes, run: str, layer_module: torch.nn.Module, layer: int,
                       offers: Sequence[LayerOffer], expected: Dict[str, torch.Tensor], timeout: float,
                       reach: Optional[Callable[[PeerID], Awaitable[str]]], errors: List[str],
                       copies: Dict[str, Set[PeerID]], step: int, round_step: Optional[int] = None,
                       needed: int = 2, served: Optional[Set[int]] = None,
                       answered: Optional[Set[PeerID]] = None) -> Optional[LayerFill]:
    """The averaged copy (of the round of step ``round_step``, or each holder's last) that ``needed`` of
    ``offers`` serve alike, asked holder after holder, loaded; None when none does (``copies``: each content's
    digest and who served it, ``served``: the rounds their copies were of, ``errors``: why others failed,
    ``answered``: told each holder that served a copy)."""
    for offer in offers:
        try:
            tensors, served_step = await _fetch_from(routes, run, offer.holder, layer, expected, timeout, reach, True,
                                                     round_step)
        except StateTransferError as e:
            errors.append(str(e))
            continue
        if answered is not None:
            answered.add(offer.holder)
        if round_step is not None and served_step != round_step:
            errors.append(f"{offer.holder} served the round of step {served_step} for that of step {round_step}")
            continue
        if served is not None:
            served.add(served_step)
        agreeing = copies.setdefault(content_digest(tensors), set())
        agreeing.add(offer.holder)
        if len(agreeing) == needed:
            layer_module.load_state_dict(tensors)
            return LayerFill(step, True, holders=tuple(sorted(h.to_base58() for h in agreeing)), copy_step=served_step,
                             averaged=True)
    return None


async def _first_live_copy(routes: Routes, run: str, layer_module: torch.nn.Module, layer: int,
                           offers: Sequence[LayerOffer], expected: Dict[str, torch.Tensor], timeout: float,
                           reach: Optional[Callable[[PeerID], Awaitable[str]]], errors: List[str]) -> Optional[LayerFill]:
    """The live weights of the first of ``offers`` that serves them, loaded at the step it serves them at; None, with
    ``errors`` told why each failed, when none does."""
    for offer in offers:
        try:
            tensors, served_step = await _fetch_from(routes, run, offer.holder, layer, expected, timeout, reach, False)
        except StateTransferError as e:
            errors.append(str(e))
            continue
        layer_module.load_state_dict(tensors)
        return LayerFill(served_step, True, holders=(offer.holder.to_base58(),), copy_step=served_step)
    return None


async def _fetch_from(routes: Routes, run: str, holder: PeerID, layer: int, expected: Dict[str, torch.Tensor],
                      timeout: float, reach: Optional[Callable[[PeerID], Awaitable[str]]],
                      averaged: bool, round_step: Optional[int] = None) -> Tuple[Dict[str, torch.Tensor], int]:
    """One holder's copy of the layer, asked twice: a stream that ran on a relayed connection ends when the
    relay resets it (after 128 KiB, docs/nat.md), and the next one runs on the direct connection the reversal
    opened. :class:`StateTransferError` names the holder and what went wrong."""
    problems: List[str] = []
    for _ in range(ATTEMPTS_PER_HOLDER):
        try:
            forwarded = reach is not None and await reach(holder) == "forward"
            fetch = fetch_layer_message if forwarded else fetch_layer
            return await fetch(routes, run, holder, layer, expected, timeout, averaged, round_step)
        except StateTransferError as e:  # it misbehaved (the error names it), or its stream was cut short
            problems.append(str(e))
        except asyncio.TimeoutError:
            problems.append(f"{holder} gave no answer within {timeout:.0f}s")
        except Exception as e:  # it left, or refused: ask again, then give up on it
            problems.append(f"{holder}: {type(e).__name__}: {e}")
    raise StateTransferError(problems[-1])
