"""The pipeline's messages on the wire: framing, chunked tensors, and checks before anything is queued.

A message is a stream of hivemind ``ExpertRequest`` frames in hivemind's own framing (one marker byte,
an 8-byte big-endian length, the protobuf), ended by hivemind's end-of-stream marker, so one message is
also a plain ``P2P.call_protobuf_handler`` call; stages send many on one stream (``channel.py``). The first frame carries the msgpack ``metadata``; the tensors are
hivemind ``serialize_torch_tensor`` protobufs cut by ``split_for_streaming`` into chunks spread over the
frames; floating-point tensors (activations, gradients) may go compressed to 16 bits (``COMPRESSIONS``),
integer ones (targets) never. The reply is one ``ExpertResponse``, or hivemind's error frame with a one-line reason.

The receiver reads the frames itself (a binary stream handler rather than hivemind's protobuf
wrapper) so that it can refuse an oversize frame from its length header before reading it, and answer
garbage with a reason instead of closing the stream.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Dict, List, Optional, Sequence, Tuple

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.proto.runtime_pb2 import CompressionType
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from ravnest_swarm.net.transport import make_request, read_frames, unpack_metadata

FORWARD = "ravnest.pipeline.forward"
BACKWARD = "ravnest.pipeline.backward"
STATUS = "ravnest.pipeline.status"

CHUNK_BYTES = 512 * 1024
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_TENSORS = 4
MAX_SAMPLES = 4096
# what a stage may send, and all it accepts: hivemind's 8-bit codecs carry lookup tables a sender chooses
COMPRESSIONS = {"none": CompressionType.NONE, "float16": CompressionType.FLOAT16,
                "meanstd16": CompressionType.MEANSTD_16BIT}


class MessageError(ValueError):
    """A message this stage refuses; its text goes back to the sender as the error."""


def encode(metadata: Dict, tensors: Sequence[torch.Tensor], compression: str = "none") -> List[runtime_pb2.ExpertRequest]:
    """The frames of one message: metadata in the first, every tensor's chunks after it; ``compression``
    (a key of ``COMPRESSIONS``) applies to floating-point tensors only."""
    parts = [part for tensor in tensors for part in split_for_streaming(
        serialize_torch_tensor(tensor, COMPRESSIONS[compression] if tensor.is_floating_point() else CompressionType.NONE),
        CHUNK_BYTES)]
    frames = [make_request(metadata, parts[:1])]
    frames += [runtime_pb2.ExpertRequest(tensors=[part]) for part in parts[1:]]
    return frames


async def as_stream(frames: Sequence[runtime_pb2.ExpertRequest]) -> AsyncIterator[runtime_pb2.ExpertRequest]:
    for frame in frames:
        yield frame


async def read_message(reader: asyncio.StreamReader, max_bytes: int,
                       first_marker: Optional[bytes] = None) -> Tuple[Dict, List[runtime_pb2.Tensor]]:
    """Read one message's frames up to the end-of-stream marker; refuse oversize or malformed input.
    ``first_marker``: its first byte, if the caller already read it (see ``transport.iterate_frames``)."""
    try:
        frames = await read_frames(reader, max_bytes, first_marker)
        metadata = unpack_metadata(frames[0].metadata)
    except ValueError as e:
        raise MessageError(str(e))
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


def decode_tensor(serialized: runtime_pb2.Tensor, what: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Deserialize and check the exact shape and dtype this stage expects (and a compression it accepts)."""
    if list(serialized.size) != list(shape) or serialized.dtype != str(dtype).replace("torch.", ""):
        raise MessageError(
            f"{what} has shape {list(serialized.size)} and dtype {serialized.dtype or '?'}; "
            f"expected {list(shape)} {str(dtype).replace('torch.', '')}"
        )
    accepted = list(COMPRESSIONS.values()) if dtype.is_floating_point else [CompressionType.NONE]
    if serialized.compression not in accepted:
        names = [name for name, kind in COMPRESSIONS.items() if kind in accepted]
        raise MessageError(f"{what} is compressed as {CompressionType.Name(serialized.compression)}; "
                           f"this stage accepts {', '.join(names)}")
    try:
        tensor = deserialize_torch_tensor(serialized)
    except Exception as e:
        raise MessageError(f"{what} could not be decoded ({type(e).__name__}: {e})")
    if list(tensor.shape) != list(shape) or tensor.dtype != dtype:
        raise MessageError(f"{what} decodes to {list(tensor.shape)} {tensor.dtype}, expected {list(shape)} {dtype}")
    return tensor


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


def field(metadata: Dict, name: str, kind: type, lo: int = 0, hi: int = 2**53):
    value = metadata.get(name)
    if kind is int:
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise MessageError(f"metadata field {name!r} must be an integer in [{lo}, {hi}], got {value!r}")
    elif not isinstance(value, kind):
        raise MessageError(f"metadata field {name!r} must be {kind.__name__}, got {type(value).__name__}")
    return value


def sample_ids_field(metadata: Dict) -> List[int]:
    ids = metadata.get("sample_ids")
    if (not isinstance(ids, list) or not 1 <= len(ids) <= MAX_SAMPLES
            or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**53 for i in ids)):
        raise MessageError(f"'sample_ids' must be a list of 1-{MAX_SAMPLES} non-negative integers")
    return ids
