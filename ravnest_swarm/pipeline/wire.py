"""The pipeline's messages on the wire: framing, chunked tensors, and checks before anything is queued.

A message is a stream of hivemind ``ExpertRequest`` frames in hivemind's own framing (one marker byte,
an 8-byte big-endian length, the protobuf), ended by hivemind's end-of-stream marker, so one message is
also a plain ``P2P.call_protobuf_handler`` call; stages send many on one stream (``channel.py``). The first frame carries the msgpack ``metadata``; the tensors are
hivemind ``serialize_torch_tensor`` protobufs cut by ``split_for_streaming`` into chunks spread over the
frames; floating-point tensors (activations, gradients) go in the codec the message names (``codecs/``:
16 bits, or 8 to 2 bits a value with a scale per block), integer ones (targets) exactly, in the narrowest
integer dtype that holds them. The reply is one ``ExpertResponse``, or hivemind's error frame with a one-line reason.

The receiver reads the frames itself (a binary stream handler rather than hivemind's protobuf
wrapper) so that it can refuse an oversize frame from its length header before reading it, and answer
garbage with a reason instead of closing the stream.

Each handler's metadata is a schema below (``net/messages.py``: strict types, unknown fields refused); the
handlers parse it with ``parse_message`` and read nothing else from the raw map.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, AsyncIterator, Callable, Dict, List, Literal, Optional, Sequence, Tuple

import torch
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming
from pydantic import Field

from ravnest_swarm.codecs.codec import CODEC_NAME_PATTERN, CODECS, INTEGERS, RAW, CodecError
from ravnest_swarm.membership.records import RUN_NAME_RE
from ravnest_swarm.membership.text import CONTROL_CHARACTERS
from ravnest_swarm.net.messages import Message, MessageError
from ravnest_swarm.net.transport import MAX_METADATA_BYTES, make_request, read_frames, unpack_metadata

FORWARD = "ravnest.pipeline.forward"
BACKWARD = "ravnest.pipeline.backward"
STATUS = "ravnest.pipeline.status"

CHUNK_BYTES = 512 * 1024
FRAME_SLACK_BYTES = 4096  # a chunk's protobuf fields beside its bytes (dtype, size, chunks) and the frame's own
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_TENSORS = 4
MAX_SAMPLES = 4096
MAX_REASON_LEN = 300
Reason = Annotated[str, Field(max_length=MAX_REASON_LEN, pattern=f"^[^{CONTROL_CHARACTERS}]*$")]  # a stage's words
CodecName = Annotated[str, Field(pattern=CODEC_NAME_PATTERN)]  # what a stage may send, and all it accepts

# a message this stage refuses raises MessageError (net/messages.py); its one-line text goes back to the sender

# microbatch ids, optimizer steps and sample ids travel as msgpack integers; 2**53 keeps them exact in any reader
Count = Annotated[int, Field(ge=0, le=2**53)]
SampleId = Annotated[int, Field(ge=0, lt=2**53)]


class StageAddress(Message):
    """Who a message is for: a stage refuses one meant for another run, cluster or stage."""

    run: Annotated[str, Field(pattern=RUN_NAME_RE.pattern)]
    cluster: Count
    stage: Count


class ForwardRequest(StageAddress):
    """Frame 0 of a forward message: one microbatch's activations and targets for stage ``stage``."""

    microbatch: Count
    sample_ids: Annotated[List[SampleId], Field(min_length=1, max_length=MAX_SAMPLES)]
    version: Count  # the sender's optimizer steps
    codec: CodecName = "none"  # the activations' (``encode``)


class FinishRequest(StageAddress):
    """The end of the run, passed down the chain on the forward stream once stage 0 is done (no tensors)."""

    op: Literal["finish"]
    completed: Count
    step: Count  # the step the run ended at, as stage 0 counts it: every later stage ends at it too


class BackwardRequest(StageAddress):
    """Frame 0 of a backward message: the gradient of the output this stage sent for ``microbatch``.
    ``diverged``: a later stage's loss says the cluster diverged (``pipeline/guard.py``): the gradient is
    zero, and this stage restores its layers instead of stepping, then tells the stage before it. ``dropped``: a
    later stage dropped the microbatch (a loss spike's skipped step, a compute that failed): the gradient is zero,
    and this stage drops it too, without a step, and tells the stage before it (stage 0 draws another at once
    instead of waiting ``microbatch_timeout`` for a gradient that never comes)."""

    microbatch: Count
    version: Count
    codec: CodecName = "none"  # the gradient's (``encode``)
    diverged: Optional[Reason] = None
    dropped: Optional[Reason] = None


class Accepted(Message):
    """A forward or backward message taken: queued (``queued`` messages now wait), or already held (``duplicate``)."""

    ok: Literal[True] = True
    queued: Optional[int] = None
    duplicate: Optional[Literal[True]] = None
    read_ms: Optional[Count] = None  # first byte to last of the message answered: its time on the link

    def as_metadata(self) -> Dict:
        return self.model_dump(exclude_none=True)  # a finish is answered {"ok": true}, nothing more


class ForwardReply(Accepted):
    """What a forward or finish message gets back."""


class BackwardReply(Accepted):
    """What a backward message gets back."""


class StatusRequest(Message):
    """The status request carries nothing."""


class StatusReply(Message):
    """A stage's counters (``scheduler.Counters``), its step and the microbatches it holds."""

    stage: int
    version: int
    forwards: int
    backwards: int
    injected: int
    completed: int
    dropped: int
    rejected: int
    turned_away: int
    failed: int
    resends: int
    max_staleness: int
    in_flight: int
    pending: int


def encode(metadata: Dict, tensors: Sequence[torch.Tensor], codec: str = "none") -> List[runtime_pb2.ExpertRequest]:
    """The frames of one message: metadata in the first, every tensor's chunks after it. ``codec`` (a key of
    ``codecs.CODECS``) applies to the first tensor (the activations or their gradient) where it is floating-point,
    and the metadata names it; the others (targets) go exactly: a regression's float targets in a lossy codec
    were values the loss was never meant to see."""
    if codec != "none" and tensors and tensors[0].is_floating_point():
        metadata = dict(metadata, codec=codec)
    parts = [part for index, tensor in enumerate(tensors) for part in split_for_streaming(
        (INTEGERS if not tensor.is_floating_point() else CODECS[codec] if index == 0 else RAW).encode(tensor),
        CHUNK_BYTES)]
    frames = [make_request(metadata, parts[:1])]
    frames += [runtime_pb2.ExpertRequest(tensors=[part]) for part in parts[1:]]
    return frames


async def as_stream(frames: Sequence[runtime_pb2.ExpertRequest]) -> AsyncIterator[runtime_pb2.ExpertRequest]:
    for frame in frames:
        yield frame


async def read_message(reader: asyncio.StreamReader, max_bytes: int, first_marker: Optional[bytes] = None,
                       vet: Optional[Callable[[Dict], None]] = None) -> Tuple[Dict, List[runtime_pb2.Tensor]]:
    """Read one message's frames up to the end-of-stream marker; refuse oversize or malformed input.
    ``first_marker``: its first byte, if the caller already read it (see ``transport.iterate_frames``).
    ``vet(metadata)``: raises a ValueError for a message refused by its metadata, read first, before its tensors.

    Every frame is held until the message is whole, so what :func:`encode` sends bounds them: one chunk a frame,
    and the chunks of at most ``max_bytes`` of tensors (a stranger's million empty frames, or one frame of 30
    million empty tensors, held gigabytes before the message was even read as someone's)."""
    vet_first = None if vet is None else lambda frame: vet(unpack_metadata(frame.metadata))
    try:
        frames = await read_frames(reader, max_bytes, first_marker,
                                   max_frames=max_bytes // CHUNK_BYTES + MAX_TENSORS + 1,
                                   max_frame_bytes=CHUNK_BYTES + MAX_METADATA_BYTES + FRAME_SLACK_BYTES,
                                   vet_first=vet_first)
        metadata = unpack_metadata(frames[0].metadata)
    except ValueError as e:
        raise MessageError(str(e))
    if any(len(frame.tensors) > 1 for frame in frames):
        raise MessageError("a frame holds more than one chunk")
    return metadata, combine_chunks([part for frame in frames for part in frame.tensors])


def combine_chunks(parts: List[runtime_pb2.Tensor]) -> List[runtime_pb2.Tensor]:
    """Regroup ``split_for_streaming`` chunks: each tensor's first chunk says how many chunks it has."""
    tensors, index = [], 0
    while index < len(parts):
        count = parts[index].chunks
        if count < 1 or index + count > len(parts):
            raise MessageError(f"tensor {len(tensors)} announces {count} chunks but {len(parts) - index} arrived")
        tensors.append(combine_from_streaming(parts[index:index + count]))
        index += count
        if len(tensors) > MAX_TENSORS:
            raise MessageError(f"more than {MAX_TENSORS} tensors in one message")
    return tensors


def decode_tensor(serialized: runtime_pb2.Tensor, what: str, shape: Sequence[int], dtype: torch.dtype,
                  codec: str = "none") -> torch.Tensor:
    """Decode with the codec the message names (integers: none), to the exact shape and dtype this stage
    expects; a header that says otherwise is refused before anything is decoded."""
    try:
        return (CODECS[codec] if dtype.is_floating_point else INTEGERS).decode(serialized, what, shape, dtype)
    except CodecError as e:
        raise MessageError(str(e))


def check_values(tensor: torch.Tensor, what: str, max_abs: float) -> torch.Tensor:
    """Refuse poisoned floats: NaN or Inf, or a magnitude no honest activation or gradient reaches.

    Either would be applied to this stage's parameters by the next optimizer step (or passed on to the
    next stage), so it is refused before it is queued.
    """
    if tensor.is_floating_point() and tensor.numel():
        if not torch.isfinite(tensor).all():
            raise MessageError(f"{what} holds NaN or Inf")
        largest = tensor.abs().max().item()
        if largest > max_abs:
            raise MessageError(f"{what} has a value of magnitude {largest:.3g}, above the {max_abs:.3g} limit")
    return tensor
