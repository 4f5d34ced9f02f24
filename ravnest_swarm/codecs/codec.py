"""The codecs floats travel in, by name: the pipeline's activations and gradients, and the ring's chunks.

Every codec turns a float tensor into one hivemind ``runtime_pb2.Tensor`` (``serialize_torch_tensor``, nothing
pickled) and back, and decodes only what it can check: the receiver knows the shape it expects, so a tensor
whose header names another shape, dtype, compression or byte count is refused before anything is decoded, and
a blockwise tensor whose scales are not finite non-negative numbers is refused after (a sender chooses them).
hivemind's 8-bit codecs are not here: their lookup tables are chosen by the sender too, and carry one scale
for the whole tensor, which the blockwise ``int8`` beats.

- ``none``, ``float16``, ``meanstd16``: hivemind's own (4, 2 and 2 bytes a value).
- ``a/b``: a pipeline's activations in ``a``, their gradients in ``b`` (a spec's ``pipeline_compression``).
- ``int8``, ``int6``, ``int4``, ``int3``: ``blockwise.py``, ``bits`` a value plus a bfloat16 scale per 64 values
  (3.9x, 5.1x, 7.5x and 9.8x fewer bytes than float32; their held-out loss: docs/pipeline.md).
- integer tensors go exactly, in the narrowest integer dtype that holds their values (``NarrowIntegers``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.proto.runtime_pb2 import CompressionType

from ravnest_swarm.codecs import blockwise


class CodecError(ValueError):
    """A tensor that does not decode as its codec and the expected shape say: one line, the sender's fault."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# every dtype's name as a header says it, read from the module's own names (a getattr of a sender's text could
# import one of torch's lazily loaded submodules)
DTYPE_NAMES = frozenset(_dtype_name(value) for value in vars(torch).values() if isinstance(value, torch.dtype))


def _said_dtype(serialized: runtime_pb2.Tensor) -> Optional[str]:
    """The header's dtype where it names one of torch's, else None. The sender chooses the text, and a refusal
    that quoted it could spell a marker of an honest refusal (a ring member's dtype "shares no ring" had its chunk
    counted as turned away, not rejected), as could hivemind's own error for a dtype numpy does not know."""
    return serialized.dtype if serialized.dtype in DTYPE_NAMES else None


@dataclass(frozen=True)
class Codec:
    """``decode``'s ``shape``: the exact shape the receiver expects, or None for a flat tensor of any length (a
    ring's part, whose length the ring checks)."""

    name: str
    bytes_per_value: float  # on the wire, the blockwise scales included (LinkCodec weighs two codecs by it)

    def encode(self, tensor: torch.Tensor) -> runtime_pb2.Tensor:
        raise NotImplementedError

    def decode(self, serialized: runtime_pb2.Tensor, what: str, shape: Optional[Sequence[int]],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    def _refuse_header(self, serialized: runtime_pb2.Tensor, what: str, expected: str) -> CodecError:
        named = (CompressionType.Name(serialized.compression) if serialized.compression in CompressionType.values()
                 else serialized.compression)
        dtype = _said_dtype(serialized) or "(not torch's)"
        return CodecError(f"{what} has shape {list(serialized.size)} and dtype {dtype}, compressed as {named}; "
                          f"expected {expected} (codec {self.name})")

    @staticmethod
    def _deserialize(serialized: runtime_pb2.Tensor, what: str) -> torch.Tensor:
        if _said_dtype(serialized) is None:
            raise CodecError(f"{what} names a dtype torch has not")
        try:
            tensor = deserialize_torch_tensor(serialized)
        except Exception as e:
            raise CodecError(f"{what} could not be decoded ({type(e).__name__}: {e})")
        # hivemind obeys the sender's requires_grad flag; we never do: a ring part that asked for autograd made the
        # reduce's in-place sum raise and, once averaged into a stage's anchor, failed every later round there
        return tensor.requires_grad_(False)


@dataclass(frozen=True)
class HivemindCodec(Codec):
    compression: int = CompressionType.NONE

    def _compression_for(self, dtype: torch.dtype) -> int:
        """A bfloat16 tensor (a user model's boundary) is 16 bits already: the 16-bit codecs send it as it is
        (hivemind's refuse it, and every send of such a stage failed)."""
        if dtype == torch.bfloat16 and self.compression in (CompressionType.FLOAT16, CompressionType.MEANSTD_16BIT):
            return CompressionType.NONE
        return self.compression

    def encode(self, tensor: torch.Tensor) -> runtime_pb2.Tensor:
        return serialize_torch_tensor(tensor, self._compression_for(tensor.dtype))

    def decode(self, serialized: runtime_pb2.Tensor, what: str, shape: Optional[Sequence[int]],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        size = list(serialized.size) if shape is None and len(serialized.size) == 1 else list(shape or [-1])
        compression = self._compression_for(dtype)
        if list(serialized.size) != size or serialized.dtype != _dtype_name(dtype) or serialized.compression != compression:
            raise self._refuse_header(serialized, what, f"{size if shape is not None else '[n]'} {_dtype_name(dtype)} "
                                                        f"compressed as {CompressionType.Name(compression)}")
        tensor = self._deserialize(serialized, what)
        if list(tensor.shape) != size or tensor.dtype != dtype:
            raise CodecError(f"{what} decodes to {list(tensor.shape)} {tensor.dtype}, expected {size} {dtype}")
        return tensor


@dataclass(frozen=True)
class BlockwiseCodec(Codec):
    bits: int = 8

    def encode(self, tensor: torch.Tensor) -> runtime_pb2.Tensor:
        return serialize_torch_tensor(blockwise.quantize(tensor, self.bits), CompressionType.NONE)

    def decode(self, serialized: runtime_pb2.Tensor, what: str, shape: Optional[Sequence[int]],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        numel = None if shape is None else math.prod(shape)
        expected_bytes = "[n]" if numel is None else f"[{blockwise.packed_bytes(numel, self.bits)}]"
        if (len(serialized.size) != 1 or serialized.dtype != "uint8" or serialized.compression != CompressionType.NONE
                or (numel is not None and serialized.size[0] != blockwise.packed_bytes(numel, self.bits))):
            raise self._refuse_header(serialized, what, f"{expected_bytes} uint8 compressed as NONE, "
                                                        f"{shape if shape is not None else 'n'} values")
        payload = self._deserialize(serialized, what)
        count = blockwise.count_of(payload)
        if (numel is not None and count != numel) or payload.numel() != blockwise.packed_bytes(max(count, 0), self.bits):
            raise CodecError(f"{what} says it holds {count} values in {payload.numel()} bytes; expected "
                             f"{numel if numel is not None else 'as many as its bytes hold'}")
        values, scales = blockwise.dequantize(payload, count, self.bits)
        if not (torch.isfinite(scales).all() and (scales >= 0).all()):
            raise CodecError(f"{what} carries a block scale that is negative, NaN or infinite")
        return values.reshape(list(shape) if shape is not None else [count]).to(dtype)


@dataclass(frozen=True)
class NarrowIntegers(Codec):
    """Integer tensors (class labels, token ids as targets) in the narrowest of ``uint8``, ``int16``, ``int32`` and
    ``int64`` that holds their values: a byte-level GPT's targets go in an eighth of their int64 bytes, exactly."""

    def encode(self, tensor: torch.Tensor) -> runtime_pb2.Tensor:
        if tensor.numel():
            low, high = int(tensor.min()), int(tensor.max())
            for narrow in INTEGER_DTYPES:
                if narrow.is_signed or low >= 0:
                    info = torch.iinfo(narrow)
                    if info.min <= low and high <= info.max:
                        tensor = tensor.to(narrow)
                        break
        return serialize_torch_tensor(tensor, CompressionType.NONE)

    def decode(self, serialized: runtime_pb2.Tensor, what: str, shape: Optional[Sequence[int]],
               dtype: torch.dtype = torch.int64) -> torch.Tensor:
        allowed = [_dtype_name(narrow) for narrow in INTEGER_DTYPES if torch.iinfo(narrow).bits <= torch.iinfo(dtype).bits]
        if (shape is None or list(serialized.size) != list(shape) or serialized.dtype not in allowed
                or serialized.compression != CompressionType.NONE):
            raise self._refuse_header(serialized, what, f"{list(shape or [])} {' or '.join(allowed)} compressed as NONE")
        tensor = self._deserialize(serialized, what)
        if list(tensor.shape) != list(shape):
            raise CodecError(f"{what} decodes to {list(tensor.shape)}, expected {list(shape)}")
        return tensor.to(dtype)


INTEGER_DTYPES = (torch.uint8, torch.int16, torch.int32, torch.int64)


def _codecs() -> Dict[str, Codec]:
    codecs: Dict[str, Codec] = {
        "none": HivemindCodec("none", 4.0, CompressionType.NONE),
        "float16": HivemindCodec("float16", 2.0, CompressionType.FLOAT16),
        "meanstd16": HivemindCodec("meanstd16", 2.0, CompressionType.MEANSTD_16BIT),
    }
    for bits in (8, 6, 4, 3):  # 5 bits measured between 6 and 4; 2 bits lost 11 % of the loss
        codecs[f"int{bits}"] = BlockwiseCodec(f"int{bits}", bits / 8 + blockwise.SCALE_BYTES / blockwise.BLOCK, bits)
    return codecs


def raw_tensor(serialized: runtime_pb2.Tensor, what: str, shape: Optional[Sequence[int]] = None,
               dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A tensor sent as it is (``serialize_torch_tensor`` without compression: a layer's or an optimizer's state),
    of ``shape`` and ``dtype`` where given, refused by its header before it is decoded: a compressed one decodes to
    more than its bytes (a holder's 17 MB of float16 declared complex128 took 136 MB before it was refused), an
    uncompressed one to at most its bytes. A :class:`CodecError` otherwise."""
    if serialized.compression != CompressionType.NONE or (shape is not None and list(serialized.size) != list(shape)) \
            or (dtype is not None and serialized.dtype != _dtype_name(dtype)):
        expected = f"{list(shape) if shape is not None else 'any shape'} {_dtype_name(dtype) if dtype else ''}"
        raise RAW._refuse_header(serialized, what, f"{expected.strip()} uncompressed")
    return Codec._deserialize(serialized, what)


CODECS: Dict[str, Codec] = _codecs()
RAW = CODECS["none"]
INTEGERS = NarrowIntegers("integers", 8.0)  # what integer tensors (targets) go in, whatever the floats' codec
CODEC_NAME_PATTERN = "^(" + "|".join(CODECS) + ")$"
# a pipeline's codec: one for both directions, or ``forward/backward``: the activations' and their gradients'
PIPELINE_CODEC_PATTERN = "^(" + "|".join(CODECS) + ")(/(" + "|".join(CODECS) + "))?$"


def directions(name: str) -> Tuple[str, str]:
    """``a`` or ``a/b``: the codec of the activations a stage sends forward and of the gradients it sends back."""
    forward, _, backward = name.partition("/")
    return forward, backward or forward


def is_pipeline_codec(name: str) -> bool:
    return name.count("/") <= 1 and all(part in CODECS for part in name.split("/"))


def compression_residual(values: torch.Tensor, codec: Codec, bounds: Sequence[Tuple[int, int]]) -> torch.Tensor:
    """What ``codec`` drops of ``values``: ``values - decoded(encoded(values))``, each of ``bounds`` (a part a ring
    sends, where the codec's blocks start: ``segments.own_encoded_parts``) encoded on its own; zero elsewhere."""
    residual = torch.zeros_like(values)
    for lo, hi in bounds:
        if hi > lo:
            segment = values[lo:hi]
            residual[lo:hi] = segment - codec.decode(codec.encode(segment), "pseudo-gradient", None)
    return residual


def codec(name: str) -> Codec:
    """The codec called ``name``; a name nobody knows is a ValueError that lists the known ones."""
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}: one of {', '.join(CODECS)}")
    return CODECS[name]
