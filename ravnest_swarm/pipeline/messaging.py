"""A stage's messaging: the forward, backward and status handlers it serves, and its sends to neighbour stages.

Receiving (:class:`Inbox`): each inbound stream carries message after message (``channel.py``); each is
read and checked in full before anything is queued (framing and size in ``wire.read_message``, metadata
against its schema in ``wire``, address, tensors' shape, dtype, compression and values), and a refusal
goes back as one line. Refusals for where or when a message came (``TURNED_AWAY``) are counted apart
from malformed or poisoned input (``rejected``), which honest neighbours never send.

Sending (:class:`Outbox`): delivery is at-least-once (a send that gets no reply re-resolves the
neighbour and resends until ``send_timeout``; receivers acknowledge ids they already hold), on one
long-lived stream per neighbour and handler, or on a stream per message through a forwarding backbone.
"""

from __future__ import annotations

import asyncio
import math
import logging
import time
from contextlib import closing, suppress
from typing import Awaitable, Callable, Dict, List, Optional, Set, Tuple, Type, Union

import torch
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2PContext, P2PHandlerError, PeerID
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError

from ravnest_swarm.codecs.codec import directions
from ravnest_swarm.models import LayerSpec
from ravnest_swarm.net.messages import Handler, decode_message, parse_message, register_handler
from ravnest_swarm.net.transport import (INCOMPLETE, MAX_METADATA_BYTES, make_response, message_reply, send_reply,
                                         unpack_metadata)
from ravnest_swarm.pipeline import wire
from ravnest_swarm.pipeline.channel import MessageChannel
from ravnest_swarm.pipeline.config import StageConfig
from ravnest_swarm.pipeline.endpoints import EndpointResolver
from ravnest_swarm.pipeline.link_codec import LinkCodec
from ravnest_swarm.pipeline.counters import BusyTime, Counters
from ravnest_swarm.pipeline.scheduler import Scheduler
from ravnest_swarm.pipeline.wire import MessageError

logger = logging.getLogger(__name__)

# refusals a sender answers by sending again: a message meant for another stage (the sender's endpoint for
# it is stale: re-resolve), one a stage has no room for yet (its stale microbatches are about to be dropped),
# and one from a peer the stage does not name as its neighbour (an honest sender placed by a plan the receiver
# has not adopted yet is taken once it has; anyone else gets the same refusal until its send timeout)
MISADDRESSED = ", but this is run"
BUSY = "; retry later"
NOT_A_NEIGHBOUR = "is not this stage's neighbour"
# said beside NOT_A_NEIGHBOUR where the sender is a peer of the run we have read a record of
NOT_YET = "one of us follows a plan the other has not adopted yet"
UNKNOWN_MICROBATCH = "unknown microbatch id"
# refusals for when or where a message arrived, not for what it holds: honest neighbours cause them (an endpoint
# gone stale in a new plan, no room yet, a neighbour in a plan one of us has not adopted yet, a gradient that came
# after its microbatch was dropped, a stream stalled on a busy machine), so they are counted apart from the
# malformed or poisoned input that `rejected` counts
TURNED_AWAY = (MISADDRESSED, BUSY, NOT_YET, UNKNOWN_MICROBATCH, INCOMPLETE)

register_handler(Handler(
    name=wire.FORWARD, request=wire.ForwardRequest, reply=wire.ForwardReply, max_bytes=wire.DEFAULT_MAX_MESSAGE_BYTES,
    callers="the peer the adopted plan puts at stage k-1 of the same run and cluster (the sender and the address "
            "are checked), which also ends the run on it with a FinishRequest", owner=__name__))
register_handler(Handler(
    name=wire.BACKWARD, request=wire.BackwardRequest, reply=wire.BackwardReply,
    max_bytes=wire.DEFAULT_MAX_MESSAGE_BYTES,
    callers="the peer the adopted plan puts at stage k+1 of the same run and cluster, for a microbatch this "
            "stage sent it", owner=__name__))
register_handler(Handler(
    name=wire.STATUS, request=wire.StatusRequest, reply=wire.StatusReply, max_bytes=MAX_METADATA_BYTES,
    callers="anyone (read-only counters: tests and operators)", owner=__name__))

Request = Union[wire.ForwardRequest, wire.FinishRequest, wire.BackwardRequest]
Handle = Callable[[Request, List[runtime_pb2.Tensor]], Awaitable[wire.Accepted]]


def parse_forward(metadata: Dict) -> Union[wire.ForwardRequest, wire.FinishRequest]:
    """A forward stream's message: a microbatch, or the end of the run (``op: "finish"``)."""
    schema: Type[wire.Message] = wire.FinishRequest if metadata.get("op") == "finish" else wire.ForwardRequest
    return parse_message(schema, metadata, "forward")


def parse_backward(metadata: Dict) -> wire.BackwardRequest:
    return parse_message(wire.BackwardRequest, metadata, "backward")


class Inbox:
    """Serves the stage's handlers and hands what passes every check to its scheduler.

    :param config: the stage's settings
    :param scheduler: where accepted microbatches and gradients go
    :param input_spec: this stage's first layer (the activations' shape and dtype it takes)
    :param targets: the run's targets (their shape per sample and dtype)
    """

    def __init__(self, config: StageConfig, scheduler: Scheduler, input_spec: LayerSpec, targets: torch.Tensor):
        self.config, self.scheduler, self.counters = config, scheduler, scheduler.counters
        self.input_spec = input_spec
        self.target_shape, self.target_dtype = list(targets.shape[1:]), targets.dtype
        self.stopped = False  # set first by the worker's shutdown: what still arrives is not answered
        self.serving: Set[asyncio.Task] = set()  # one task per inbound stream we answer on

    async def add_handlers(self, node: DHTNode) -> None:
        # forwardable: a neighbour behind another NAT reaches these through a backbone (net/routes.py)
        routes = node.routes
        await routes.add_forwardable_handler(wire.FORWARD, self._stream_handler(wire.FORWARD, parse_forward,
                                                                                 self._on_forward))
        await routes.add_forwardable_handler(wire.BACKWARD, self._stream_handler(wire.BACKWARD, parse_backward,
                                                                                  self._on_backward))
        await node.p2p.add_protobuf_handler(wire.STATUS, self._on_status, runtime_pb2.ExpertRequest)

    async def remove_handlers(self, node: DHTNode) -> None:
        # a volunteer moved to another slot starts a new worker on the same P2P: free the handler names
        for name in (wire.FORWARD, wire.BACKWARD):
            await node.p2p.remove_binary_stream_handler(name)
        await node.p2p.remove_protobuf_handler(wire.STATUS)

    def _stream_handler(self, name: str, parse: Callable[[Dict], Request], handle: Handle):
        async def serve(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            """Answer message after message on one stream (see channel.py), each within the send timeout."""
            first_marker: Optional[bytes] = None
            arrived = time.monotonic()  # the message's first byte

            async def respond() -> runtime_pb2.ExpertResponse:
                vetted: List[Request] = []

                def vet(metadata: Dict) -> None:
                    """By its metadata, before its tensors are read (a stranger's 64 MiB were held to be refused)."""
                    request = parse(metadata)
                    self._check_address(request)  # first: a former neighbour of a slot we left is turned away
                    self._check_sender(name, peer_id)
                    vetted.append(request)

                _, tensors = await wire.read_message(reader, self.config.max_message_bytes, first_marker, vet)
                # its bytes' time on the link, first to last, which the sender's LinkCodec weighs (link_codec.py)
                read_ms = round((time.monotonic() - arrived) * 1000)
                if self.stopped:  # shutdown's cancel can be lost (asyncio.wait_for returns a result it raced)
                    raise ConnectionError("this stage worker stopped")  # no reply: the sender resends elsewhere
                reply = (await handle(vetted[0], tensors)).as_metadata()
                return make_response(dict(reply, read_ms=read_ms) if tensors else reply)

            task = asyncio.current_task()  # this stream's own: p2pd hands each stream to a new task
            self.serving.add(task)
            task.add_done_callback(self.serving.discard)
            peer_id = stream_info.peer_id
            with closing(writer):
                while not self.stopped:  # a stream opened after shutdown (through a backbone) is just closed
                    reply = await message_reply(name, peer_id, respond, self.config.send_timeout,
                                                lambda reason: self._refused(name, peer_id, reason),
                                                lambda: self._broken(name, peer_id))
                    if reply is None:
                        return
                    await send_reply(reply, reader, writer)
                    if isinstance(reply, RPCError):
                        return  # a refused message may have been cut short: what follows cannot be framed
                    try:
                        # between messages the stream may idle (no deadline runs); one idle for a whole send
                        # timeout is closed, and its sender opens a new one for its next message
                        first_marker = await asyncio.wait_for(reader.readexactly(1), self.config.send_timeout)
                        arrived = time.monotonic()
                    except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
                        return  # the sender closed the stream, or left it idle

        return serve

    def _refused(self, name: str, peer_id: PeerID, reason: str) -> None:
        if any(marker in reason for marker in TURNED_AWAY):
            # said as the averager says it: a walkthrough's new stage 0 warned "rejected" of a dead peer's gradient
            self.counters.turned_away += 1
            logger.info(f"stage {self.config.stage}: turned away {name} from {peer_id}: {reason}")
            return
        self.counters.rejected += 1
        self.counters.last_rejected = f"{name.rsplit('.', 1)[-1]} from {peer_id}: {reason}"
        logger.warning(f"stage {self.config.stage}: rejected {name} from {peer_id}: {reason}")

    def _broken(self, name: str, peer_id: PeerID) -> None:
        if not self.stopped:
            logger.warning(f"stage {self.config.stage}: {name} from {peer_id} ended early")

    def _check_sender(self, name: str, peer_id: PeerID) -> None:
        """Forwards (and the finish) only from the peer named at stage - 1, gradients only from stage + 1's: a
        stranger that names our run, cluster and stage could otherwise feed our parameters or end our run."""
        neighbours, stage = self.config.neighbours, self.config.stage
        if not neighbours.named:
            return
        neighbour_stage = stage - 1 if name == wire.FORWARD else stage + 1
        expected = neighbours.peer_of(stage, neighbour_stage)
        sender = peer_id.to_base58()
        if sender != expected:
            what = "forwards" if name == wire.FORWARD else "gradients"
            timing = f" ({NOT_YET}, or ended it)" if sender in neighbours.known else ""
            raise MessageError(f"the sender {NOT_A_NEIGHBOUR}: stage {stage} of cluster {self.config.cluster} takes "
                               f"{what} only from {expected or 'no peer'} (stage {neighbour_stage}){timing}")

    def _check_address(self, request: Request) -> None:
        config = self.config
        cluster = config.previous_cluster if request.cluster == config.previous_cluster else config.cluster
        if (request.run, request.cluster, request.stage) != (config.run, cluster, config.stage):
            raise MessageError(
                f"addressed to run {request.run!r} cluster {request.cluster!r} stage {request.stage!r}"
                f"{MISADDRESSED} {config.run!r} cluster {config.cluster} stage {config.stage}")

    async def _on_forward(self, request: Union[wire.ForwardRequest, wire.FinishRequest],
                          tensors: List[runtime_pb2.Tensor]) -> wire.ForwardReply:
        scheduler = self.scheduler
        if isinstance(request, wire.FinishRequest):
            scheduler.receive_finish(request.step)
            return wire.ForwardReply()
        if scheduler.is_first:
            raise MessageError("stage 0 takes no forward messages: it draws its own microbatches")
        if request.microbatch in scheduler.seen_forward:
            # a resend after our reply was lost: delivery is at-least-once, processing exactly once
            return wire.ForwardReply(duplicate=True)
        # stage 0 keeps at most max_in_flight microbatches in the pipeline; twice that leaves room for ones
        # a watchdog is about to drop, and anything beyond is a flood that would hold unbounded memory
        if scheduler.holding() >= 2 * self.config.max_in_flight:
            raise MessageError(f"too many microbatches in flight here ({2 * self.config.max_in_flight}){BUSY}")
        if len(tensors) != 2:
            raise MessageError(f"a forward message carries 2 tensors (activations, targets), got {len(tensors)}")
        count = len(request.sample_ids)
        inputs = wire.check_values(wire.decode_tensor(tensors[0], "activations", [count, *self.input_spec.input_shape],
                                                      self.input_spec.input_dtype, request.codec),
                                   "activations", self.config.max_abs_value)
        # float targets (a regression) are the loss's to judge, but never NaN or Inf: the loss would be, and the
        # stage would restore as if it diverged
        targets = wire.check_values(wire.decode_tensor(tensors[1], "targets", [count, *self.target_shape],
                                                       self.target_dtype), "targets", math.inf)
        queued = scheduler.queue_forward(request.microbatch, list(request.sample_ids), inputs, targets, request.version)
        return wire.ForwardReply(queued=queued)

    async def _on_backward(self, request: wire.BackwardRequest, tensors: List[runtime_pb2.Tensor]) -> wire.BackwardReply:
        scheduler, microbatch = self.scheduler, request.microbatch
        if microbatch in scheduler.seen_backward:
            return wire.BackwardReply(duplicate=True)
        pending = scheduler.pending.get(microbatch)
        if pending is None:
            raise MessageError(f"{UNKNOWN_MICROBATCH} {microbatch}: this stage did not send it forward "
                               f"(or already dropped it)")
        if len(tensors) != 1:
            raise MessageError(f"a backward message carries 1 tensor (the gradient), got {len(tensors)}")
        grad = wire.check_values(wire.decode_tensor(tensors[0], "gradient", pending.output_shape, pending.output.dtype,
                                                    request.codec), "gradient", self.config.max_abs_value)
        return wire.BackwardReply(queued=scheduler.queue_backward(microbatch, grad, request.diverged,
                                                                        request.dropped))

    async def _on_status(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        decode_message(wire.StatusRequest, request.metadata, "status")
        return make_response(self.status().as_metadata())

    def status(self) -> wire.StatusReply:
        c, scheduler = self.counters, self.scheduler
        return wire.StatusReply(
            stage=self.config.stage, version=scheduler.compute.version, forwards=c.forwards, backwards=c.backwards,
            injected=c.injected, completed=c.completed, dropped=c.dropped, rejected=c.rejected,
            turned_away=c.turned_away, failed=c.failed, resends=c.resends, max_staleness=c.max_staleness,
            in_flight=scheduler.in_flight, pending=len(scheduler.pending))


class Outbox:
    """Sends this stage's messages to its neighbours, re-resolving and resending until ``send_timeout``.

    :param config: the stage's settings
    :param node: our DHT node (its routes reach the neighbours; its records name them)
    :param counters: where resends are counted
    :param busy: sends count as busy time

    ``codecs``: per handler (forward, backward: a stage boundary each way), the codec its messages go in, the run's
    or, while that link is the bottleneck, the run's ``link_bound_compression`` (``link_codec.py``).
    """

    def __init__(self, config: StageConfig, node: DHTNode, counters: Counters, busy: BusyTime):
        self.config, self.node, self.counters, self.busy = config, node, counters, busy
        self.resolver = EndpointResolver(node, config.run, config.cluster, config.stage, lambda: self.config.neighbours)
        self._channels: Dict[Tuple[str, int], MessageChannel] = {}  # (handler, stage) -> its long-lived stream
        strong = directions(config.link_bound_compression) if config.link_bound_compression else ("", "")
        self.codecs = {handler: LinkCodec(base, stronger) for handler, base, stronger
                       in zip((wire.FORWARD, wire.BACKWARD), directions(config.compression), strong)}
        self._on_the_link = {handler: 0.0 for handler in self.codecs}  # seconds each handler's messages took to arrive

    def _codec_for(self, handler: str) -> str:
        link = self.codecs[handler]
        changed = link.observe(time.monotonic(), self._on_the_link[handler], self.counters.compute_seconds)
        if changed is not None:
            self.counters.codec_switches.append((time.time(), handler.rsplit(".", 1)[-1], changed))
            logger.info(f"{handler.rsplit('.', 1)[-1]} messages now go as {changed}: over the last {link.window:.0f}s "
                        f"they took {link.link_per_compute:.2f}s on the link per second of this stage's compute")
        return link.current

    def _on_link(self, handler: str, reply: runtime_pb2.ExpertResponse) -> None:
        """Add the seconds the receiver says our message's bytes took to arrive (its reply's ``read_ms``)."""
        if handler in self._on_the_link:
            with suppress(ValueError):
                read_ms = unpack_metadata(reply.metadata).get("read_ms")
                if isinstance(read_ms, int) and 0 <= read_ms <= 10 ** 9:
                    self._on_the_link[handler] += read_ms / 1000

    async def send(self, handler: str, stage: int, message: wire.Message, tensors: List[torch.Tensor],
                   microbatch: Optional[int], to: Optional[str] = None) -> Optional[str]:
        """Deliver one message; on failure re-resolve the neighbour and retry. None once delivered; else what
        failed and why, as one line (the caller drops the microbatch). ``to``: the peer it is for, as the plan
        named it when the message was made (None: whoever the plan names at ``stage`` now)."""
        op = getattr(message, 'op', handler.rsplit('.', 1)[-1])
        # a message of no microbatch (the run's finish) is not said to be "of microbatch None"
        what = f"{op}{'' if microbatch is None else f' of microbatch {microbatch}'} to stage {stage}"
        try:
            frames = wire.encode(message.as_metadata(), tensors, self._codec_for(handler))
        except Exception as e:  # a tensor the codec cannot take (a user model's bfloat16 in float16): dropped, said
            return f"{what} could not be encoded ({type(e).__name__}: {e})"
        size = sum(frame.ByteSize() for frame in frames)
        deadline = time.monotonic() + self.config.send_timeout
        attempt, said = 0, None
        def named() -> Optional[str]:  # read at each try: a new plan may name another peer meanwhile
            return self.config.neighbours.named_peer(self.config.stage, stage)

        # a gradient belongs to the peer that sent the forward: one the plan replaced (it died) never gets it, and its
        # successor refuses an id it never sent (a walkthrough's stage 1 retried 29 times, then sent it there), or
        # takes it for a microbatch of its own under the same id
        addressee = named() if to is None else to
        replaced = f"{what}: the plan put another peer at stage {stage} than the one that sent its forward"
        with self.busy.measure():
            while True:
                if handler == wire.BACKWARD and named() != addressee:
                    return replaced
                try:
                    peer_id = await self.resolver.resolve(stage, refresh=attempt > 0)
                    if handler == wire.BACKWARD and addressee is not None and peer_id.to_base58() != addressee:
                        return replaced  # the plan changed while the endpoint was looked up
                    self.counters.bytes_sent[handler.rsplit(".", 1)[-1]] += size  # what the link carries, resends too
                    with self.busy.wall_time.using("sending"):  # on its way: written, and its reply awaited
                        reply = await asyncio.wait_for(self._deliver(handler, stage, peer_id, frames),
                                                       max(1.0, deadline - time.monotonic()))
                    self._on_link(handler, reply)
                    return None
                except P2PHandlerError as e:
                    # the neighbour read the message and refused it: sending it again cannot help, unless it
                    # refused it for not serving that stage any more (it moved in a new plan while we kept its
                    # endpoint: the stage's current peer is found as after a failed send), for lack of room, or
                    # for not knowing us as its neighbour yet (it adopts the plan that placed us a moment later)
                    # the receiver's whole line (hivemind puts "Failed to call handler ... at PEER: " before it; the
                    # last ": " of a schema's refusal cut the field's name off)
                    reason = f"refused: {str(e).split(f' at {peer_id}: ', 1)[-1]}"
                    retry = any(marker in str(e) for marker in (MISADDRESSED, BUSY, NOT_A_NEIGHBOUR))
                except Exception as e:
                    # asyncio's timeout says nothing: "TimeoutError: " ended a walkthrough's drop line
                    timed_out = isinstance(e, (asyncio.TimeoutError, TimeoutError)) and not str(e)
                    reason = "timed out" if timed_out else f"{type(e).__name__}: {e}"
                    retry = True
                if retry:
                    self._close_channel(handler, stage)
                    if time.monotonic() < deadline:
                        attempt += 1
                        self.counters.resends += 1
                        # said at the first failure, at each new reason, and then every 10th try: a neighbour that
                        # left makes every microbatch in flight retry each second until a new plan names its
                        # successor (a walkthrough's terminal filled with two lines a second for a churn event's 30 s)
                        if reason != said or attempt % 10 == 0:
                            said = reason
                            again = "" if attempt == 1 else f" (try {attempt})"
                            logger.warning(f"send {what} failed{again} ({reason}); re-resolving the endpoint and "
                                           f"retrying")
                        await asyncio.sleep(min(0.2 * attempt, 1.0))
                        continue
                return f"{what} {reason}"

    async def _deliver(self, handler: str, stage: int, peer_id: PeerID, frames: List[runtime_pb2.ExpertRequest]):
        """One message to ``stage``: on our long-lived stream to it, or on a stream of its own when a backbone
        forwards our traffic (a forwarding backbone caps the bytes of every stream it pipes)."""
        routes = self.node.routes
        if routes.route(peer_id) == "forward":
            return await routes.call(peer_id, handler, wire.as_stream(frames), runtime_pb2.ExpertResponse)
        channel = self._channels.get((handler, stage))
        if channel is None or channel.closed or channel.peer_id != peer_id:
            self._close_channel(handler, stage)
            channel = self._channels[(handler, stage)] = MessageChannel(self.node.p2p, peer_id, handler, routes.traffic)
        return await channel.call(frames)

    def _close_channel(self, handler: str, stage: int) -> None:
        channel = self._channels.pop((handler, stage), None)
        if channel is not None:
            channel.close()

    async def aclose(self) -> None:
        await asyncio.gather(*(channel.aclose() for channel in self._channels.values()))
