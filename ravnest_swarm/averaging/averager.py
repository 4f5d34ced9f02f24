"""Parallel multi-ring all-reduce over hivemind P2P streaming handlers.

A peer serves one handler, ``ravnest.averaging.ring``. Each message is a stream of ``ExpertRequest``:
the first carries the msgpack metadata (run, step, ring, attempt, phase, position) and every request
carries one part of a ``serialize_torch_tensor`` protobuf (``split_for_streaming``). The handler only
files the tensor in a mailbox keyed by (step, ring, attempt, phase, position, sender) and answers at
once; the ring coroutine that expects it takes it from there. So a peer that starts its round early
never waits for a late one to be listening, and every round is named by its training step: a message
for a step that is over here is refused, one for a later step waits in the mailbox.

Faults. Each ring has its own deadline: a member that does not answer in time ends that ring only,
the segment keeps its local value, and the other members are told to stop at once. A received chunk
with NaN or Inf, or absurdly scaled (its largest magnitude above ``max_scale`` times what that many
contributions of our own size could sum to), is refused: in a ring every forwarded partial sum was
checked by its receiver, so such a chunk can only come from the sender's own contribution. The
receiver names that sender, tells the ring, and the remaining members run the ring again without it.

Hostile input. The handler reads frames itself (``transport.bounded_stream_handler``): a message over
``max_message_bytes``, a truncated protobuf or a silent stream gets an error with a reason, and the
mailbox holds at most ``max_buffered_bytes`` and ``MAX_MAILBOX_ENTRIES`` early messages.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.compression.base import CompressionBase, NoCompression
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from ravnest_swarm.averaging.segments import Ring, chunk_bounds
from ravnest_swarm.transport import bounded_stream_handler, make_request, make_response, unpack_metadata

logger = logging.getLogger(__name__)

RING_HANDLER = "ravnest.averaging.ring"
PART_BYTES = 512 * 1024
CONTROL_TIMEOUT = 2.0
MAX_MAILBOX_ENTRIES = 4096  # early messages (and ring states) held for rounds not yet asked for
REDUCE, GATHER, ABORT = "reduce", "gather", "abort"


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
    """One averaging round of this peer: a result per ring, and every refused contribution."""

    step: int
    seconds: float
    segments: List[SegmentResult]
    rejected: List[dict] = field(default_factory=list)

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
        return text

    def as_dict(self) -> dict:
        return dict(step=self.step, seconds=self.seconds, ok=self.ok, segments=[s.as_dict() for s in self.segments],
                    failed_segments=self.failed_segments(), rejected=self.rejected)


class _RingState:
    """What the members of one ring in one round have told us: exclusions and whether it was ended."""

    def __init__(self):
        self.excluded: Set[str] = set()
        self.failure: Optional[str] = None
        self.changed = asyncio.Event()


class MultiRingAverager:
    """Serves the ring handler on a peer's P2P and averages this peer's segments, all rings at once.

    :param p2p: this peer's P2P (its DHT node's), on which the handler is registered
    :param run: run name; messages of another run are refused
    :param timeout: seconds one ring may take before it ends and its segment keeps the local value
    :param compression: hivemind compression for the floats on the wire (``NoCompression``,
        ``Float16Compression``, ``Uniform8BitQuantization``); summing happens in float32
    :param part_bytes: size of the streamed parts of a serialized chunk
    :param max_buffered_bytes: cap on chunks held for rings that have not asked for them yet (early
        peers), so a stranger cannot make us hold unbounded memory
    :param max_message_bytes: larger ring messages are refused before they are read
    :param max_scale: a received chunk whose largest magnitude exceeds this many times the sum its
        contributions could reach at our own values' scale (at least 1 per element) is refused as poisoned
    """

    def __init__(self, p2p: P2P, run: str, timeout: float = 30.0, compression: CompressionBase = NoCompression(),
                 part_bytes: int = PART_BYTES, max_buffered_bytes: int = 2 * 1024**3,
                 max_message_bytes: int = 512 * 1024**2, max_scale: float = 100.0):
        self.p2p, self.run, self.timeout, self.compression = p2p, run, timeout, compression
        self.part_bytes, self.max_buffered_bytes = part_bytes, max_buffered_bytes
        self.max_message_bytes, self.max_scale = max_message_bytes, max_scale
        self.peer_id = p2p.peer_id.to_base58()
        self.last_finished_step = -1
        self.last_result: Optional[RoundResult] = None
        self._mailbox: Dict[tuple, asyncio.Future] = {}
        self._buffered_bytes = 0
        self._rings: Dict[Tuple[int, int], _RingState] = {}
        self._control_tasks: Set[asyncio.Task] = set()

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(RING_HANDLER, bounded_stream_handler(
            RING_HANDLER, self.p2p.peer_id, self.rpc_ring, self.max_message_bytes, self.timeout))

    async def shutdown(self) -> None:
        """Give the last notes to other members a moment to arrive, then stop serving."""
        if self._control_tasks:
            await asyncio.wait(set(self._control_tasks), timeout=CONTROL_TIMEOUT)
        for task in list(self._control_tasks):
            task.cancel()
        await asyncio.gather(*self._control_tasks, return_exceptions=True)
        await self.p2p.remove_binary_stream_handler(RING_HANDLER)

    # ---- receiving -------------------------------------------------------------------------------------

    async def rpc_ring(self, frames: List[runtime_pb2.ExpertRequest], context: P2PContext) -> runtime_pb2.ExpertResponse:
        """File one ring message (frames already read within the size limit) in the mailbox."""
        metadata = self._check_metadata(unpack_metadata(frames[0].metadata))
        parts = [part for frame in frames for part in frame.tensors]
        size = sum(len(part.buffer) for part in parts)
        if self._buffered_bytes + size > self.max_buffered_bytes:
            raise ValueError("too much ring data buffered here; retry later")
        sender = context.remote_id.to_base58()
        step, ring = metadata["step"], metadata["ring"]
        if metadata["phase"] == ABORT:
            if (step, ring) not in self._rings and len(self._rings) >= MAX_MAILBOX_ENTRIES:
                raise ValueError("too many rings pending here; retry later")
            self._on_abort(step, ring, sender, metadata)
            return make_response({})
        key = (step, ring, tuple(metadata["attempt"]), metadata["phase"], metadata["position"], sender)
        if key not in self._mailbox and len(self._mailbox) >= MAX_MAILBOX_ENTRIES:
            raise ValueError("too many ring messages waiting here; retry later")
        if not parts:
            raise ValueError("ring message carries no tensor")
        try:
            tensor = deserialize_torch_tensor(combine_from_streaming(parts))
        except Exception as e:
            raise ValueError(f"ring chunk could not be decoded ({type(e).__name__})")
        slot = self._slot(key)
        if slot.done():
            raise ValueError("duplicate ring message")
        slot.set_result((tensor, size))
        self._buffered_bytes += size
        return make_response({})

    def _check_metadata(self, metadata: dict) -> dict:
        expected = dict(run=str, step=int, ring=int, phase=str, position=int, attempt=list)
        for name, kind in expected.items():
            if not isinstance(metadata.get(name), kind):
                raise ValueError(f"ring message needs '{name}' ({kind.__name__})")
        if metadata["run"] != self.run:
            raise ValueError(f"this peer averages run {self.run!r}, not {metadata['run']!r}")
        if metadata["step"] <= self.last_finished_step:
            raise ValueError(f"round {metadata['step']} is over here (last finished {self.last_finished_step})")
        if metadata["phase"] not in (REDUCE, GATHER, ABORT):
            raise ValueError(f"unknown ring phase {metadata['phase']!r}")
        # the mailbox key is built from these: they must be hashable and small
        if not all(isinstance(peer, str) and len(peer) <= 128 for peer in metadata["attempt"]):
            raise ValueError("ring message 'attempt' must list peer ids")
        return metadata

    def _slot(self, key: tuple) -> asyncio.Future:
        if key not in self._mailbox:
            self._mailbox[key] = asyncio.get_running_loop().create_future()
        return self._mailbox[key]

    def _ring_state(self, step: int, ring: int) -> _RingState:
        return self._rings.setdefault((step, ring), _RingState())

    def _on_abort(self, step: int, ring: int, sender: str, metadata: dict) -> None:
        state = self._ring_state(step, ring)
        excluded = {peer for peer in metadata.get("excluded", []) if isinstance(peer, str)}
        if not excluded <= state.excluded:
            state.excluded |= excluded
            state.changed.set()
        if metadata.get("failure") and state.failure is None:
            state.failure = f"ended by {sender[-8:]}: {str(metadata['failure'])[:200]}"
            state.changed.set()

    async def _receive(self, key: tuple, deadline: float) -> torch.Tensor:
        slot = self._slot(key)
        try:
            tensor, size = await asyncio.wait_for(asyncio.shield(slot), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise asyncio.TimeoutError(f"no chunk from {key[-1][-8:]} ({key[3]} step {key[4]}) within the ring timeout")
        del self._mailbox[key]
        self._buffered_bytes -= size
        return tensor

    # ---- sending ---------------------------------------------------------------------------------------

    async def _send(self, peer: str, metadata: dict, tensor: Optional[torch.Tensor], deadline: float) -> None:
        metadata = dict(metadata, run=self.run)
        serialized = [] if tensor is None else list(split_for_streaming(
            serialize_torch_tensor(tensor, self.compression.compression_type), self.part_bytes))

        async def stream():
            yield make_request(metadata, serialized[:1])
            for part in serialized[1:]:
                yield runtime_pb2.ExpertRequest(tensors=[part])

        await asyncio.wait_for(
            self.p2p.call_protobuf_handler(PeerID.from_base58(peer), RING_HANDLER, stream(), runtime_pb2.ExpertResponse),
            max(0.0, deadline - time.monotonic()),
        )

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

    async def average(self, step: int, local: torch.Tensor, local_start: int, rings: Sequence[Ring]) -> RoundResult:
        """Average every segment this peer owns with its owners in the other clusters, all rings at once.

        :param step: the training step that names this round; every member must use the same one
        :param local: this peer's flat float32 range of the vector; averaged segments are written in place
        :param local_start: the flat-vector index of ``local[0]``
        :param rings: the rings this peer is a member of (see ``segments.rings_of``)
        """
        if step <= self.last_finished_step:
            raise ValueError(f"step {step} is not after the last averaged step {self.last_finished_step}")
        for ring in rings:
            if not (local_start <= ring.start and ring.end <= local_start + local.numel()):
                raise ValueError(f"ring {ring.index} [{ring.start}, {ring.end}) is not inside this peer's range")
        started = time.monotonic()
        rejected: List[dict] = []
        results = await asyncio.gather(*(
            self._run_ring(step, ring, local[ring.start - local_start:ring.end - local_start], started, rejected)
            for ring in rings
        ))
        self._finish_round(step)
        result = RoundResult(step, time.monotonic() - started, list(results), rejected)
        self.last_result = result
        log = logger.info if result.ok else logger.warning
        log(f"averaging {result.summary()}")
        return result

    def _finish_round(self, step: int) -> None:
        self.last_finished_step = step
        for key in [key for key in self._mailbox if key[0] <= step]:
            slot = self._mailbox.pop(key)
            if slot.done():
                self._buffered_bytes -= slot.result()[1]
        for key in [key for key in self._rings if key[0] <= step]:
            del self._rings[key]

    async def _run_ring(self, step: int, ring: Ring, segment: torch.Tensor, started: float,
                        rejected: List[dict]) -> SegmentResult:
        state = self._ring_state(step, ring.index)
        deadline = started + self.timeout
        while True:
            members = [member for member in ring.members if member not in state.excluded]
            if self.peer_id not in members:
                return SegmentResult(ring.index, ring.start, ring.end, "excluded", len(members),
                                     "our contribution was refused by the ring")
            if state.failure is not None:
                return SegmentResult(ring.index, ring.start, ring.end, "failed", len(members), state.failure)
            if len(members) < 2:
                return SegmentResult(ring.index, ring.start, ring.end, "alone", 1, "every other member was excluded")
            state.changed.clear()
            attempt = asyncio.create_task(self._ring_attempt(step, ring, members, segment, deadline))
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
                rejected.append(dict(peer=e.peer, ring=ring.index, reason=str(e)))
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
            if not torch.isfinite(averaged).all():
                # only our own contribution can be non-finite here (every received chunk was checked): the
                # others refuse the chunk we finalized and go on without us, so we keep our local value
                return SegmentResult(ring.index, ring.start, ring.end, "excluded", len(members),
                                     "our own values are not finite")
            segment.copy_(averaged)
            return SegmentResult(ring.index, ring.start, ring.end, "ok", len(members))

    async def _ring_attempt(self, step: int, ring: Ring, members: List[str], segment: torch.Tensor,
                            deadline: float) -> torch.Tensor:
        """Reduce-scatter then all-gather over ``members``: 2(n-1) steps, each moving one chunk of segment/n."""
        count, me = len(members), members.index(self.peer_id)
        following, preceding = members[(me + 1) % count], members[(me - 1) % count]
        chunks = [slice(lo, hi) for lo, hi in chunk_bounds(segment.numel(), count)]
        work = segment.clone()
        base = dict(step=step, ring=ring.index, attempt=sorted(set(ring.members) - set(members)))

        async def exchange(phase: str, position: int, send_chunk: int, receive_chunk: int,
                           contributions: int) -> torch.Tensor:
            key = (step, ring.index, tuple(base["attempt"]), phase, position, preceding)
            sending = asyncio.create_task(
                self._send(following, dict(base, phase=phase, position=position), work[chunks[send_chunk]], deadline))
            receiving = asyncio.create_task(self._receive(key, deadline))
            try:
                _, received = await asyncio.gather(sending, receiving)
            finally:
                sending.cancel()
                receiving.cancel()
            if received.dtype != torch.float32:
                received = received.float()
            if not torch.isfinite(received).all():
                raise ContributionRejected(preceding, f"{phase} chunk {position} holds NaN or Inf")
            if received.numel() != work[chunks[receive_chunk]].numel():
                raise ContributionRejected(preceding, f"chunk of {received.numel()} elements, expected another size")
            if received.numel():
                # honest partial sums stay within `contributions` times values of our own scale
                ours = max(segment[chunks[receive_chunk]].abs().max().item(), 1.0)
                largest = received.abs().max().item()
                if largest > self.max_scale * contributions * ours:
                    raise ContributionRejected(preceding, f"{phase} chunk {position} is absurdly scaled "
                                                          f"(magnitude {largest:.3g}, ours {ours:.3g})")
            return received

        for position in range(count - 1):
            receive_chunk = (me - position - 1) % count
            received = await exchange(REDUCE, position, (me - position) % count, receive_chunk, position + 1)
            work[chunks[receive_chunk]] += received
        owned = (me + 1) % count
        work[chunks[owned]] /= count
        if not isinstance(self.compression, NoCompression):
            # the others get our chunk through the compression: keep the same value so all members agree
            work[chunks[owned]] = deserialize_torch_tensor(
                serialize_torch_tensor(work[chunks[owned]], self.compression.compression_type)).float()
        for position in range(count - 1):
            receive_chunk = (me - position) % count
            received = await exchange(GATHER, position, (me + 1 - position) % count, receive_chunk, 1)
            work[chunks[receive_chunk]] = received
        return work
