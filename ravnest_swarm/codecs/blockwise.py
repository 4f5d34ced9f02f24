"""Blockwise quantization to ``bits`` bits per value, pure torch: the codecs that beat hivemind's on a home link.

A payload starts with the count of values (4 bytes, little end first: a ring's parts are cut anywhere, and the
last block's padding must not decode as values), then a tensor is cut into blocks of ``BLOCK`` consecutive values (the last one padded with zeros); each block
keeps one scale, its largest magnitude, as a bfloat16 (float32's range in two bytes: an activation or
gradient of any size the pipeline accepts keeps its scale), and every value is the nearest of ``2**bits``
evenly spaced levels between -scale and +scale. The codes are packed ``bits`` at a time, little end first:
``8 / gcd(8, bits)`` codes fill a whole number of bytes, and a block of 64 holds a whole number of those groups.

Why per block and not per tensor (hivemind's ``Uniform8BitQuantization``): one large activation, such as the
outlier channels of a transformer's residual stream, then coarsens 63 neighbours, not the whole tensor.

Error bound: rounding to the nearest level moves a value by at most half a step, ``scale / (2**bits - 1)``, where
the scale is at most ``(1 + 2**-6)`` times the block's largest magnitude. (Stochastic rounding of the gradients,
unbiased, was measured and trained worse at 4 and 3 bits: docs/benchmarks.md, "bench codecs".)
"""

from __future__ import annotations

import math
from typing import Tuple

import torch

BLOCK = 64
COUNT_BYTES = 4
MAX_VALUES = 2 ** 32 - 1
SCALE_BYTES = 2  # a bfloat16 per block
# bfloat16 keeps 8 significant bits, so its nearest rounding moves a scale by at most 2**-8 of it: raising it by
# 2**-7 first keeps every scale at or above its block's largest magnitude, and no value is clipped
SCALE_HEADROOM = 1 + 2 ** -7


def codes_per_group(bits: int) -> int:
    return 8 // math.gcd(8, bits)


def packed_bytes(numel: int, bits: int) -> int:
    """Bytes of one tensor of ``numel`` values: their count, every block's scale, then its codes."""
    blocks = -(-numel // BLOCK)
    return COUNT_BYTES + blocks * SCALE_BYTES + blocks * BLOCK * bits // 8


def count_of(payload: torch.Tensor) -> int:
    """The count of values a payload says it holds (the caller checks it against its length and what it expects)."""
    return int.from_bytes(payload[:COUNT_BYTES].numpy().tobytes(), "little") if payload.numel() >= COUNT_BYTES else -1


def quantize(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``values`` (any float dtype and shape) as one uint8 tensor of ``packed_bytes(values.numel(), bits)``."""
    flat = values.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
    if flat.numel() > MAX_VALUES:
        raise ValueError(f"{flat.numel()} values do not fit one blockwise payload (at most {MAX_VALUES})")
    count = torch.tensor(list(flat.numel().to_bytes(COUNT_BYTES, "little")), dtype=torch.uint8)
    blocks = -(-flat.numel() // BLOCK)
    padded = torch.nn.functional.pad(flat, (0, blocks * BLOCK - flat.numel())).view(blocks, BLOCK)
    scales = (padded.abs().amax(dim=1) * SCALE_HEADROOM).to(torch.bfloat16)
    levels = 2 ** bits - 1
    # x -> (x / scale + 1) * levels / 2, in [0, levels]: one multiply by (levels / 2) / scale, one add
    per_unit = scales.float().reciprocal_().nan_to_num_(posinf=0.0).mul_(levels / 2).unsqueeze(1)
    position = torch.addcmul(torch.full((1, 1), levels / 2), padded, per_unit).clamp_(0, levels).round_()
    codes = position.to(torch.uint8).reshape(-1)
    return torch.cat([count, scales.view(torch.uint8), pack(codes, bits)])


def dequantize(payload: torch.Tensor, numel: int, bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(the ``numel`` float32 values, the blocks' scales) of a payload of exactly ``packed_bytes(numel, bits)``;
    the caller checks the scales (a sender chooses them)."""
    blocks = -(-numel // BLOCK)
    payload = payload[COUNT_BYTES:]
    scales = payload[:blocks * SCALE_BYTES].view(torch.bfloat16).float()
    codes = unpack(payload[blocks * SCALE_BYTES:], bits, blocks * BLOCK).view(blocks, BLOCK)
    levels = 2 ** bits - 1
    step = scales.mul(2 / levels).unsqueeze(1)
    values = torch.addcmul(scales.neg().unsqueeze(1), codes.float(), step)  # code * step - scale
    return values.reshape(-1)[:numel], scales


def _word_dtype(bits: int) -> torch.dtype:
    """A group's bits fit an int32 (cheaper) but for 5 bits: 8 codes of 5 are 40."""
    return torch.int32 if codes_per_group(bits) * bits < 32 else torch.int64


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes below ``2**bits`` (a multiple of one group long) into bytes, ``bits`` each, low bits first."""
    if bits == 8:
        return codes.to(torch.uint8)
    group = codes_per_group(bits)
    columns = codes.view(-1, group).to(_word_dtype(bits))
    words = columns[:, 0].clone()
    for index in range(1, group):
        words |= columns[:, index] << (bits * index)
    return torch.stack([(words >> (8 * byte)) & 0xFF for byte in range(group * bits // 8)], dim=1).to(torch.uint8).reshape(-1)


def unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The uint8 codes of :func:`pack`, ``count`` of them."""
    if bits == 8:
        return packed[:count]
    group = codes_per_group(bits)
    columns = packed.view(-1, group * bits // 8).to(_word_dtype(bits))
    words = columns[:, 0].clone()
    for byte in range(1, group * bits // 8):
        words |= columns[:, byte] << (8 * byte)
    mask = 2 ** bits - 1
    return torch.stack([(words >> (bits * index)) & mask for index in range(group)], dim=1).to(torch.uint8).reshape(-1)[:count]
