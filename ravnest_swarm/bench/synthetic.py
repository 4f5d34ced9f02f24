"""The averaging tests' and bench's synthetic model: layer values from a seed, the cluster and the layer index,
so a test can compute the exact mean in its own process."""

from __future__ import annotations

from typing import Sequence, Tuple

import torch

from ravnest_swarm.errors import UserError


# the bench's short names, as hivemind calls its codecs: ``8bit`` is hivemind's Uniform8BitQuantization for its
# own averager, and our blockwise ``int8`` (a scale per 64 values, codecs/blockwise.py) for our rings
SHORT_NAMES = {"fp16": "float16", "8bit": "int8"}


def codec_by_name(name: str):
    """Our rings' codec for ``--compression``: a name of ``codecs.CODECS``, or ``fp16`` or ``8bit``."""
    from ravnest_swarm.codecs.codec import CODECS

    name = SHORT_NAMES.get(name, name)
    if name not in CODECS:
        raise UserError(f"--compression must be one of {', '.join([*SHORT_NAMES, *CODECS])}, not {name!r}")
    return CODECS[name]


def compression_by_name(name: str):
    """hivemind's compression for its own averager (the bench's baseline): none, fp16 or 8bit."""
    from hivemind.compression import Float16Compression, NoCompression, Uniform8BitQuantization

    choices = {"none": NoCompression, "fp16": Float16Compression, "float16": Float16Compression,
               "8bit": Uniform8BitQuantization}
    if name not in choices:
        raise UserError(f"hivemind's averager has no codec {name!r}: --compression none, fp16 or 8bit to compare with it")
    return choices[name]()


def synthetic_layer(seed: int, cluster: int, layer: int, size: int) -> torch.Tensor:
    """The deterministic values of ``layer`` in ``cluster``: what a test averages and checks against."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + cluster * 10_007 + layer)
    return torch.randn(size, generator=generator, dtype=torch.float32)


def synthetic_range(seed: int, cluster: int, layer_sizes: Sequence[int], layers: Tuple[int, int]) -> torch.Tensor:
    return torch.cat([synthetic_layer(seed, cluster, j, layer_sizes[j]) for j in range(*layers)])


def single_ring_plan(plan: dict, layer_sizes: Sequence[int]) -> dict:
    """The comparison plan: the first stage's peer of each cluster holds the whole vector (one ring)."""
    return dict(plan, clusters=[[dict(peer_id=cluster[0]["peer_id"], layers=[0, len(layer_sizes)])]
                                for cluster in plan["clusters"]])
