"""Where a peer computes (``--device``), in which precision (the run spec's ``precision``), and how much
memory it measurably used.

Only this peer's own choices live here: nothing device-specific crosses the wire. Stages send and receive
float32 tensors from host memory, checkpoints and layer transfers hold host copies, so a GPU peer and a
CPU peer can serve neighbouring stages of one cluster.
"""

from __future__ import annotations

import re
import resource
import sys
from contextlib import nullcontext
from typing import ContextManager, Optional, Tuple

from ravnest_swarm.errors import UserError

DEVICE_CHOICES = ("auto", "cpu", "cuda")
PRECISIONS = ("fp32", "bf16", "fp16")
DEVICE_RE = re.compile(r"^(cpu|cuda(:\d{1,3})?)$")  # what a peer record's ``device`` may say


def resolve_device(choice: str) -> str:
    """The torch device ``--device`` names: ``auto`` is the first GPU torch sees, else the CPU; ``cuda`` (or
    ``cuda:N``) on a machine where torch sees no such GPU is a :class:`UserError`, not a crash mid-training."""
    import torch

    if choice == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if choice == "cpu":
        return "cpu"
    match = re.fullmatch(r"cuda(?::(\d{1,3}))?", choice)
    if match is None:
        raise UserError(f"--device must be one of {', '.join(DEVICE_CHOICES)} (or cuda:N), not {choice!r}")
    index = int(match.group(1) or 0)
    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "torch sees no GPU here"
        raise UserError(f"--device {choice}: {why}; use --device cpu (or auto)", exit_code=1)
    if index >= torch.cuda.device_count():
        raise UserError(f"--device {choice}: torch sees {torch.cuda.device_count()} GPU(s) here", exit_code=1)
    return f"cuda:{index}"


def device_kind(device: str) -> str:
    """``cpu`` or ``cuda``: what the planner and the dashboard tell apart."""
    return device.split(":", 1)[0]


def device_memory_gb(device: str, ram_gb: float) -> float:
    """The memory of the device that holds a stage: a GPU's total memory, or on the CPU the RAM offer."""
    if device_kind(device) != "cuda":
        return ram_gb
    import torch

    return round(torch.cuda.get_device_properties(torch.device(device)).total_memory / 1e9, 3)


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise UserError(f"--precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    return precision


def autocast_dtype(precision: str, device: str) -> Tuple[Optional["torch.dtype"], Optional[str]]:
    """The dtype a stage autocasts its forward to on ``device`` (None: plain float32), and a note when the run's
    precision cannot be had there.

    fp16 on a CPU runs as bf16: CPU kernels have no fast fp16 path, and bf16 keeps the same 16-bit activations
    with float32's range. bf16 on a GPU without bf16 support runs as fp16. Either way only this peer's compute
    changes: what it sends is float32, so its neighbours never notice.
    """
    import torch

    if precision == "fp32":
        return None, None
    if device_kind(device) == "cpu":
        if precision == "fp16":
            return torch.bfloat16, "precision fp16 runs as bf16 on a CPU (its kernels have no fast fp16)"
        return torch.bfloat16, None
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        return torch.float16, f"precision bf16 runs as fp16 on {device}: this GPU does not support bf16"
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[precision], None


def autocast(device: str, dtype: Optional["torch.dtype"]) -> ContextManager:
    """``torch.autocast`` to ``dtype`` on ``device``'s kind, or nothing for float32."""
    if dtype is None:
        return nullcontext()
    import torch

    return torch.autocast(device_type=device_kind(device), dtype=dtype)


def peak_memory(device: str) -> Tuple[float, Optional[float]]:
    """``(peak RSS of this process, the GPU's peak allocation or None on the CPU)``, both in GB, as measured.

    RSS is the kernel's high-water mark (``ru_maxrss``), not a sample, so no short spike is missed; it covers
    this Python process, not its p2pd daemon (a separate process of a few tens of MB, whatever the model).
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak_bytes = peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes, Linux KiB
    device_peak = None
    if device_kind(device) == "cuda":
        import torch

        device_peak = round(torch.cuda.max_memory_allocated(torch.device(device)) / 1e9, 3)
    return round(peak_bytes / 1e9, 3), device_peak
