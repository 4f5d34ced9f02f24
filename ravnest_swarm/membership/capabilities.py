"""Measuring what a volunteer can offer: RAM, its device's memory, compute and bandwidth, each with a CLI override."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Optional

import psutil

from ravnest_swarm.errors import UserError

PER_SAMPLE_TIMINGS = 5  # of one sample's step, the least disturbed sizing the measured batch


@dataclass
class Capabilities:
    """What a peer advertises.

    :param ram_gb: memory it offers for model state, GB
    :param gflops: measured forward+backward throughput, GFLOP/s
    :param bandwidth_mbps: measured upload rate to a backbone, Mbit/s
    :param reachability: ``direct`` (others can dial it), ``relay`` (reached through a backbone) or ``unknown``
    :param device: where its stages compute (``cpu``, ``cuda:0``)
    :param device_memory_gb: the memory of that device, which the planner sizes its stages by: a GPU's total
        memory, or on the CPU the RAM it offers (``ram_gb``)
    """

    ram_gb: float
    gflops: float
    bandwidth_mbps: float
    reachability: str = "unknown"
    device: str = "cpu"
    device_memory_gb: Optional[float] = None

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


def measure_gflops(width: int = 512, batch: int = 64, seconds: float = 0.5, device: str = "cpu") -> float:
    """GFLOP/s of a timed forward+backward of an ``nn.Linear`` layer on ``device`` (2*B*I*O forward, twice that
    backward): the figure a peer advertises before it knows the run's model (:func:`measure_layer_gflops`)."""
    import torch

    layer = torch.nn.Linear(width, width, device=device)
    inputs = torch.randn(batch, width, requires_grad=True, device=device)
    return _timed(lambda: layer(inputs).sum().backward(), 6 * batch * width * width, seconds, device)


def measure_layer_gflops(model, device: str = "cpu", microbatch_size: int = 32, precision: str = "fp32",
                         seconds: float = 0.5) -> float:
    """GFLOP/s of a timed forward+backward of the run's largest layer (by FLOPs) on ``device``, in the run's
    precision, as Petals measures its blocks: what this peer trains at, which a ``Linear`` probe misjudges (a
    GPU's launch overhead, attention, embeddings).

    :param model: the run's ``ModelSpec`` (its layers' ``build``, ``input_shape``, ``input_dtype`` and
        ``flops_per_sample``: forward FLOPs, so forward+backward counts three times them)
    :param microbatch_size: the run's; fewer samples per step when one step of them would outlast a quarter
        of ``seconds`` (a large layer on a slow CPU), since the rate per FLOP hardly depends on it then
    """
    import torch

    from ravnest_swarm.devices import autocast, autocast_dtype

    index = max(range(len(model.layers)), key=lambda i: model.layers[i].flops_per_sample)
    spec = model.layers[index]
    layer = model.build_layer(index).to(device)
    dtype, _ = autocast_dtype(precision, device)

    def inputs(batch: int) -> torch.Tensor:
        shape = (batch, *spec.input_shape)
        if spec.input_dtype.is_floating_point:
            return torch.randn(shape, dtype=spec.input_dtype, device=device, requires_grad=True)
        return torch.randint(0, 2, shape, dtype=spec.input_dtype, device=device)  # ids 0 and 1 fit any vocabulary

    def step(x: torch.Tensor) -> None:
        with autocast(device, dtype):
            output = layer(x)
        output.float().sum().backward()

    one = inputs(1)
    step(one)  # warm-up: allocations and kernel selection
    # the least disturbed of a few timings, as timeit takes: one step a busy machine preempted sizes the batch down
    # to a sample or two, where a small layer's per-call overhead dominates. mlp-digits beside two training peers on
    # 2 cores: a median of 0.22 GFLOP/s with this against 0.08 with one timing (7.7 on the idle machine; what is
    # left is the busy machine's real share of its cores, which volunteers on their own machines do not see)
    per_sample, until = math.inf, time.perf_counter() + seconds / 4
    for _ in range(PER_SAMPLE_TIMINGS):
        started = time.perf_counter()
        step(one)
        _synchronize(device)
        per_sample = min(per_sample, time.perf_counter() - started)
        if time.perf_counter() >= until:
            break
    batch = max(1, min(microbatch_size, int(seconds / 4 / max(per_sample, 1e-9))))
    x = inputs(batch)
    return _timed(lambda: step(x), 3 * spec.flops_per_sample * batch, seconds, device)


def _timed(step, flop_per_step: float, seconds: float, device: str) -> float:
    """GFLOP/s of ``step`` run again and again for ``seconds`` (at least once) after one warm-up run."""
    step()  # warm-up: allocations and kernel selection
    _synchronize(device)
    steps, started = 0, time.perf_counter()
    while steps == 0 or time.perf_counter() - started < seconds:
        step()
        steps += 1
    _synchronize(device)  # a GPU runs ahead of Python: count the time its queued work takes
    # three significant figures, not decimals: a small layer on a loaded CPU measures well under 0.001 GFLOP/s, and
    # a rate rounded to 0 would make the planner drop this peer
    return float(f"{flop_per_step * steps / (time.perf_counter() - started) / 1e9:.3g}")


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(torch.device(device))
