"""Data sets addressed by sample id, and sharding by sample id so every cluster draws its own stream.

Both data sets come with the installation: scikit-learn's bundled 8x8 digits, and the text of the
Python standard library's own ``.py`` files (the first files in name order, so every peer running
the same Python reads the same bytes). Nothing is downloaded.
"""

from __future__ import annotations

import os
import sysconfig
from functools import lru_cache
from typing import List, Sequence, Tuple

import numpy as np
import torch

TEXT_BYTES = 512 * 1024


class Dataset:
    """Samples addressed by integer id in ``[0, size)``.

    :param inputs: every sample's input, stacked
    :param targets: every sample's target, stacked
    """

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor):
        self.inputs, self.targets = inputs, targets

    @property
    def size(self) -> int:
        return len(self.inputs)

    def get(self, ids: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(list(ids), dtype=torch.long)
        return self.inputs[index], self.targets[index]


HELDOUT_EVERY = 6  # every 6th sample is held out for evaluation (300 of the 1,797 digits)


@lru_cache(maxsize=None)
def digits_dataset(split: str = "train") -> Dataset:
    """scikit-learn's bundled digits; ``train`` and ``heldout`` never share a sample."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    inputs = torch.as_tensor(digits.data / 16.0, dtype=torch.float32)
    targets = torch.as_tensor(digits.target, dtype=torch.long)
    held = torch.arange(len(targets)) % HELDOUT_EVERY == HELDOUT_EVERY - 1
    keep = held if split == "heldout" else ~held
    return Dataset(inputs[keep], targets[keep])


def stdlib_source_files() -> List[str]:
    directory = sysconfig.get_paths()["stdlib"]
    return sorted(os.path.join(directory, name) for name in os.listdir(directory) if name.endswith(".py"))


@lru_cache(maxsize=None)
def stdlib_text_dataset(context: int, split: str = "train") -> Dataset:
    """Non-overlapping windows of ``context + 1`` bytes of stdlib source; targets are inputs shifted by one.

    ``heldout`` is every 6th window, ``train`` the rest."""
    chunks, total = [], 0
    for path in stdlib_source_files():
        with open(path, "rb") as f:
            data = f.read()
        chunks.append(data)
        total += len(data)
        if total >= TEXT_BYTES:
            break
    text = np.frombuffer(b"".join(chunks)[:TEXT_BYTES], dtype=np.uint8).astype(np.int64)
    windows = len(text) // (context + 1)
    samples = torch.as_tensor(text[: windows * (context + 1)]).view(windows, context + 1)
    held = torch.arange(windows) % HELDOUT_EVERY == HELDOUT_EVERY - 1
    samples = samples[held] if split == "heldout" else samples[~held]
    return Dataset(samples[:, :-1].contiguous(), samples[:, 1:].contiguous())


class ShardedSampler:
    """Cluster ``cluster`` of ``clusters`` draws every ``clusters``-th sample of a shuffled stream.

    Position ``p`` of the global stream is sample ``perm_e[p % size]`` with ``e = p // size`` the epoch
    and ``perm_e`` a permutation seeded by ``(seed, e)``, so clusters draw disjoint samples within an
    epoch and anyone can tell which samples a microbatch holds from its index alone.

    :param size: number of samples in the data set
    :param cluster: this cluster's index
    :param clusters: number of clusters
    :param microbatch_size: samples per microbatch
    :param seed: shuffling seed shared by the run
    """

    def __init__(self, size: int, cluster: int, clusters: int, microbatch_size: int, seed: int = 0):
        if not 0 <= cluster < clusters:
            raise ValueError(f"cluster {cluster} is not in 0..{clusters - 1}")
        self.size, self.cluster, self.clusters = size, cluster, clusters
        self.microbatch_size, self.seed = microbatch_size, seed
        self._permutations = {}

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch not in self._permutations:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._permutations = {epoch: torch.randperm(self.size, generator=generator)}
        return self._permutations[epoch]

    def sample_ids(self, microbatch: int) -> List[int]:
        ids = []
        for j in range(self.microbatch_size):
            position = (microbatch * self.microbatch_size + j) * self.clusters + self.cluster
            ids.append(int(self._permutation(position // self.size)[position % self.size]))
        return ids
