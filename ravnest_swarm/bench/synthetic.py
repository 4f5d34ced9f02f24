"""The averaging tests' and bench's synthetic model: layer values from a seed, the cluster and the layer index,
so a test can compute the exact mean in its own process."""

from __future__ import annotations

from typing import Sequence, Tuple

import torch

from ravnest_swarm.errors import UserError


def compression_by_name(name: str):
    """hivemind compression for ``--compression`` (none, fp16, 8bit)."""
    from hivemind.compression import Float16Compression, NoCompression, Uniform8BitQuantization

    choices = {"none": NoCompression, "fp16": Float16Compression, "8bit": Uniform8BitQuantization}
    if name not in choices:
        raise UserError(f"--compression must be one of {', '.join(choices)}, not {name!r}")
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
