"""Measuring what a volunteer can offer: RAM, compute and bandwidth, each with a CLI override."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Optional

import psutil

from ravnest_swarm.errors import UserError


@dataclass
class Capabilities:
    """What a peer advertises.

    :param ram_gb: memory it offers for model state, GB
    :param gflops: measured forward+backward throughput, GFLOP/s
    :param bandwidth_mbps: measured upload rate to a backbone, Mbit/s
    :param reachability: ``direct`` (others can dial it), ``relay`` (reached through a backbone) or ``unknown``
    """

    ram_gb: float
    gflops: float
    bandwidth_mbps: float
    reachability: str = "unknown"

    def as_dict(self) -> dict:
        return asdict(self)


def check_override(name: str, value: Optional[float]) -> Optional[float]:
    if value is not None and not value >= 0:  # also refuses NaN
        raise UserError(f"--{name} must be a non-negative number, got {value}")
    return value


def measure_ram_gb(max_ram_gb: Optional[float] = None) -> float:
    """Available memory (psutil), capped by ``max_ram_gb``."""
    available = psutil.virtual_memory().available / 1e9
    return round(min(available, max_ram_gb) if max_ram_gb is not None else available, 3)


def measure_gflops(width: int = 512, batch: int = 64, seconds: float = 0.5) -> float:
    """GFLOP/s of a timed forward+backward of a real ``nn.Linear`` layer (2*B*I*O forward, twice that backward)."""
    import torch

    layer = torch.nn.Linear(width, width)
    inputs = torch.randn(batch, width, requires_grad=True)
    flop_per_step = 6 * batch * width * width
    layer(inputs).sum().backward()  # warm-up: allocations and kernel selection
    steps, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        layer(inputs).sum().backward()
        steps += 1
    return round(flop_per_step * steps / (time.perf_counter() - started) / 1e9, 3)
