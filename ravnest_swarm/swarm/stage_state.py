"""A stage's optimizer state handed to the peer that takes its layers over (issue 30).

Layers travel with ``state_transfer.py``; the inner optimizer's state (AdamW's moments, momentum buffers, AdamW's
step counts) and the outer optimizer's (the last round's anchor, the Nesterov momentum, the codec's error feedback)
travel here. Only a stage nobody trains any more hands it over: a peer that is ``leaving`` (Ctrl-C, ``hand_over.py``)
or that a plan moved to other layers (its record's ``held``). Its state belongs to that stage's place in the run,
and without it the taker starts AdamW afresh, whose first steps move every weight by the full lr, and its outer
state at its first round, a float32 round instead of a compressed one. A stage that still trains its layers keeps
its state: its error feedback is its own, and a copy would count twice.

A stage that still trains gives a copy of its inner state for some of its layers (``live``): a new cluster whose
layers come from other clusters' holders takes their moments with them (``carry_layer_states``), which `bench
diloco --reform-every` measured better than starting afresh (docs/benchmarks.md). Never its outer state: that one
is its own. A stopped stage answers the same request for its layers where the peer trains none of them: the takers
of a stage that a new plan split ask each for their own layers.

The taker asks for exactly its layer range (the outer state is one flat vector over the stage, so only the same
range can take it) and checks what comes as it checks a checkpoint (``checkpoint.take_optimizer_state``,
``take_outer_state``): names, shapes, dtypes, finite values. A holder can serve numbers, never structure.

Wire format: ``ravnest.stage_state``, one request and one reply (forwardable, within a backbone's byte cap): the
request names the run and the range; the reply's metadata ``{"names", "scalars", "step"}`` names its tensors in
order (``optim.<index>.<key>``, ``outer.<key>``, as a checkpoint names them) and carries the inner optimizer's
scalar state by parameter index; its tensors are hivemind ``serialize_torch_tensor`` protobufs.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Annotated, AsyncIterator, Awaitable, Callable, Dict, List, Optional, Set, Tuple

import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import runtime_pb2
from pydantic import Field

from ravnest_swarm.checkpoint import (OUTER_STATE_KEYS, optimizer_like, optimizer_tensors, take_optimizer_state,
                                      take_outer_state)
from ravnest_swarm.codecs.codec import CodecError, raw_tensor
from ravnest_swarm.membership.records import MAX_LAYOUT_LAYERS, MAX_LAYOUT_TENSORS, RUN_NAME_RE
from ravnest_swarm.net.messages import Handler, Message, MessageError, decode_message, register_handler
from ravnest_swarm.net.routes import Routes
from ravnest_swarm.net.transport import bounded_stream_handler, make_request, make_response
from ravnest_swarm.swarm.state_transfer import REPLY_SLACK_BYTES, tensor_bytes

logger = logging.getLogger(__name__)

STAGE_STATE = "ravnest.stage_state"
MAX_REQUEST_BYTES = 64 * 1024
STAGE_STATE_REPLIES = 2  # made and sent at once: a leaver's takers ask one after another, a new cluster's stages each
# per parameter tensor of a stage: AdamW's two moments (or one momentum buffer); the outer state's three vectors
MAX_STATE_TENSORS = 2 * MAX_LAYOUT_TENSORS + 3

LayerIndex = Annotated[int, Field(ge=0, le=MAX_LAYOUT_LAYERS)]
StateName = Annotated[str, Field(min_length=1, max_length=300, pattern=r"^(optim\.\d+\.[A-Za-z_]+|outer\.[a-z]+)$")]
ScalarName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z_]+$")]


class StageStateRequest(Message):
    """The optimizer state of the stage of layers ``layers[0]:layers[1]`` of ``run``."""

    run: Annotated[str, Field(pattern=RUN_NAME_RE.pattern)]
    layers: List[LayerIndex] = Field(min_length=2, max_length=2)
    live: bool = False  # the inner state of some layers of the stage the peer trains now, not of one it stopped


class StageStateReply(Message):
    """The tensors' names in order, the inner optimizer's scalar state by parameter index, and the stage's step."""

    names: List[StateName] = Field(max_length=MAX_STATE_TENSORS)
    scalars: Dict[Annotated[str, Field(pattern=r"^\d{1,6}$")], Dict[ScalarName, float]] = Field(
        max_length=MAX_LAYOUT_TENSORS)
    step: Annotated[int, Field(ge=0, le=2**53)]


register_handler(Handler(STAGE_STATE, StageStateRequest, StageStateReply, MAX_REQUEST_BYTES,
                         callers="the peer that takes over a stage this peer stopped training (a leave, a move), "
                                 "or a new cluster's stage that took layers this peer trains (their inner state)",
                         owner=__name__))


@dataclass(frozen=True)
class StoppedStage:
    """A stage this peer trained and stopped: its range, its last step, its inner optimizer and its outer state,
    and its layers' modules (which parameters of the optimizer are which layer's)."""

    layers: Tuple[int, int]
    step: int
    optimizer: torch.optim.Optimizer
    outer: Dict[str, torch.Tensor]
    module: torch.nn.Sequential


@dataclass(frozen=True)
class TrainingStage:
    """The stage this peer trains now: its first layer, its layers' modules and its inner optimizer."""

    start: int
    module: torch.nn.Sequential
    optimizer: torch.optim.Optimizer
    step: int


def parameter_indices(module: torch.nn.Sequential, start: int, layers: Tuple[int, int]) -> range:
    """The indices, in ``module.parameters()`` order (the optimizer's), of the parameters of ``layers`` of a stage
    whose first layer is ``start``."""
    counts = [len(list(layer.parameters())) for layer in module]
    first = sum(counts[:layers[0] - start])
    return range(first, first + sum(counts[layers[0] - start:layers[1] - start]))


class StageStateServer:
    """Serves the optimizer state of the stage this peer stopped last (``stopped()``, None while there is none), and
    a copy of the inner state of layers of the stage it trains (``training()``)."""

    def __init__(self, routes: Routes, run: str, stopped: Callable[[], Optional[StoppedStage]],
                 request_timeout: float = 60.0, training: Callable[[], Optional[TrainingStage]] = lambda: None):
        self.routes, self.run, self.stopped, self.request_timeout = routes, run, stopped, request_timeout
        self.training = training
        # (peer, layers, step) of each stage state we sent (a leave waits for its stage's: hand_over.py)
        self.served: Set[Tuple[str, Tuple[int, int], int]] = set()

    async def start(self) -> None:
        # a reply is twice the stage's parameters (AdamW's moments), copied four or five times on its way out: a
        # few requests of a stranger that never read their replies held gigabytes (a hostile review)
        await self.routes.add_forwardable_handler(STAGE_STATE, bounded_stream_handler(
            STAGE_STATE, self.routes.p2p.peer_id, self._reply, MAX_REQUEST_BYTES, self.request_timeout, linger=True,
            replies=asyncio.Semaphore(STAGE_STATE_REPLIES)))

    async def _reply(self, frames: List[runtime_pb2.ExpertRequest], context: P2PContext) -> runtime_pb2.ExpertResponse:
        if len(frames) != 1:
            raise ValueError(f"{STAGE_STATE} takes one request frame, got {len(frames)}")
        asked = decode_message(StageStateRequest, frames[0].metadata, STAGE_STATE)
        if asked.run != self.run:
            raise ValueError(f"this peer serves run {self.run!r}")
        if asked.live:
            return self._live_reply(tuple(asked.layers))
        stage = self.stopped()
        if stage is None or stage.layers != tuple(asked.layers):
            raise ValueError(f"this peer stopped no stage of layers {asked.layers[0]}:{asked.layers[1]}")
        self.served.add((context.remote_id.to_base58(), stage.layers, stage.step))
        return _state_response(optimizer_tensors(stage.optimizer, stage.outer), stage.step)


    def _live_reply(self, layers: Tuple[int, int]) -> runtime_pb2.ExpertResponse:
        """A copy of the inner state of ``layers`` of the stage we train, its parameters numbered from 0; or of the
        stage we stopped, where we train no stage with them (a leaver whose stage a new plan split between takers:
        each asks for its own layers, never the stopped range, and their AdamW state was lost)."""

        def within(start: int, module: torch.nn.Sequential) -> bool:
            return start <= layers[0] < layers[1] <= start + len(module)

        training, stopped = self.training(), self.stopped()
        if training is not None and within(training.start, training.module):
            start, module, optimizer, step = training.start, training.module, training.optimizer, training.step
        elif stopped is not None and within(stopped.layers[0], stopped.module):
            start, module, optimizer, step = stopped.layers[0], stopped.module, stopped.optimizer, stopped.step
        else:
            raise ValueError(f"this peer trains no stage with layers {layers[0]}:{layers[1]}")
        parameters = parameter_indices(module, start, layers)
        return _state_response(optimizer_tensors(optimizer, parameters=parameters), step)


def _state_response(state: Tuple[Dict[str, torch.Tensor], Dict[str, Dict]], step: int) -> runtime_pb2.ExpertResponse:
    """The reply to a ``stage_state`` request: ``state`` as ``optimizer_tensors`` gives it, at ``step``."""
    tensors, scalars = state
    names = list(tensors)
    reply = StageStateReply(names=names, scalars={index: {key: float(value) for key, value in values.items()}
                                                  for index, values in scalars.items()}, step=step)
    return make_response(reply.as_metadata(), [serialize_torch_tensor(tensors[name]) for name in names])


@dataclass(frozen=True)
class HandedState:
    """What a taker got: the inner optimizer's per-parameter state (``optimizer.state_dict()["state"]`` of its
    stage), the outer state (empty when the giver had none yet), and from whom, as the log says it."""

    inner: Dict[int, Dict]
    outer: Dict[str, torch.Tensor]
    source: str


def stage_giver(records: List[Dict], self_id: str, layers: Tuple[int, int],
                preferred: Optional[str] = None) -> Optional[Dict]:
    """The record of the peer that stopped training exactly ``layers`` and can hand its state over: one leaving
    with them (``preferred`` first: the leaver whose place we take), else one whose ``held`` stage they are while it
    trains other layers or stands by; None when none did."""
    wanted = list(layers)
    others = [r for r in records if r["peer_id"] != self_id]
    leaving = sorted((r for r in others if r["state"] == "leaving" and r.get("layers") == wanted),
                     key=lambda r: r["peer_id"] != preferred)
    # moved off them: training others, or a standby (whose record offers the layers it last trained as its own)
    moved = [r for r in others if r.get("held") and list(r["held"][:2]) == wanted
             and (r.get("layers") != wanted or r["state"] == "standby")]
    return (leaving or moved or [None])[0]


async def fetch_stage_state(routes: Routes, run: str, holder: PeerID, layers: Tuple[int, int],
                            module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                            timeout: float, live: bool = False) -> Tuple[Dict[int, Dict], Dict[str, torch.Tensor], int]:
    """The inner and outer optimizer state ``holder`` kept of the stage of ``layers``, checked against ``module``
    (our layers, the same range) and loaded into a scratch copy of ``optimizer``'s kind; its step. ``live``: a copy
    of the inner state of ``layers`` of the stage it trains (no outer state). A ``ValueError`` says what was wrong
    with it."""

    async def request() -> AsyncIterator[runtime_pb2.ExpertRequest]:
        yield make_request(StageStateRequest(run=run, layers=list(layers), live=live).as_metadata())

    # at most: AdamW's three moments (amsgrad's included) and the outer state, each of the parameters' size
    state_bytes = (3 + len(OUTER_STATE_KEYS)) * tensor_bytes(dict(module.named_parameters()))
    response = await asyncio.wait_for(routes.call(holder, STAGE_STATE, request(),
                                                  max_bytes=state_bytes + REPLY_SLACK_BYTES), timeout)
    try:
        reply = decode_message(StageStateReply, response.metadata, STAGE_STATE)
    except MessageError as e:
        raise ValueError(f"a malformed reply: {e}") from None
    if len(reply.names) != len(response.tensors):
        raise ValueError(f"{len(reply.names)} names for {len(response.tensors)} tensors")
    try:  # each refused by its header, not once decoded: the reply's cap is of its bytes on the wire
        tensors = {name: raw_tensor(serialized, name) for name, serialized in zip(reply.names, response.tensors)}
    except CodecError as e:
        raise ValueError(str(e)) from None
    inner: Dict[int, Dict] = {}
    if any(name.startswith("optim.") for name in tensors):
        # an optimizer of our kind on our own parameters takes the state (and checks it), leaving ours as it is;
        # only its state is read back, so its hyper-parameters do not matter
        scratch = optimizer_like(optimizer, module.parameters())
        if not take_optimizer_state(tensors, {"optimizer_scalars": reply.scalars}, scratch):
            raise ValueError("its inner optimizer state does not fit our layers")
        inner = scratch.state_dict()["state"]
    if live and any(name.startswith("outer.") for name in tensors):
        raise ValueError("it sent outer state for a stage it still trains")
    outer = take_outer_state(tensors, sum(p.numel() for p in module.parameters()))
    return inner, outer, reply.step


async def carry_layer_states(routes: Routes, run: str, module: torch.nn.Sequential, start: int,
                             optimizer: torch.optim.Optimizer, holders: Dict[int, List[PeerID]], timeout: float,
                             reach: Callable[[PeerID], Awaitable[str]]) -> Tuple[Dict[int, Dict], Dict[int, PeerID]]:
    """The inner state of our downloaded layers (``holders``: each layer's holders that served it), a copy of one
    holder's each, numbered as ``optimizer`` numbers our stage's parameters (its first layer ``start``); and who
    gave each layer's. A holder that fails is logged and the next asked; a layer none gives starts afresh."""
    state: Dict[int, Dict] = {}
    givers: Dict[int, PeerID] = {}
    for layer, its_holders in sorted(holders.items()):
        offset = parameter_indices(module, start, (layer, layer + 1)).start
        for holder in its_holders:
            try:
                await reach(holder)
                inner, _, _ = await fetch_stage_state(routes, run, holder, (layer, layer + 1), module[layer - start],
                                                      optimizer, timeout, live=True)
            except Exception as e:  # it left, or sent what does not fit: the next holder of the layer
                logger.info(f"the inner state of layer {layer} from {holder}: {type(e).__name__}: {e}")
                continue
            if inner:
                state.update({offset + index: values for index, values in inner.items()})
                givers[layer] = holder
                break
    return state, givers
