"""Stage checkpoints as safetensors: parameters, optimizer state, step and layer range, written atomically.

A checkpoint is one ``.safetensors`` file. Tensors are the stage's parameters (``param.<name>``), its inner
optimizer's per-parameter state (``optim.<index>.<key>``) and its outer optimizer's state over the stage's flat
parameter vector (``outer.anchor``, ``outer.momentum``, ``outer.error``: ``optimizers/outer.py``), where it has
one; everything else (step, layer range, model, run, optimizer hyper-parameters and scalar state) is JSON in the
safetensors metadata. Nothing is pickled, so a checkpoint from anywhere is safe to open. Resume
(:func:`load_stage_layers`, :func:`load_optimizer_state`, :func:`load_outer_state`) restores the parameters, the
step and both optimizers' state; the inner state kept is empty for plain SGD.

Writes go to a temporary file in the same directory, are fsynced, then renamed over the old file
(and the directory fsynced), so a crash at any moment leaves either the old or the new checkpoint,
never half of one. A writer killed mid-write leaves at most its hidden ``.tmp-*.part`` file, which is
never read as a checkpoint (:func:`remove_unfinished_writes` clears them).

:class:`SafetensorsWriter` writes a safetensors file one tensor at a time (an export, ``swarm/export.py``), the same
way: a temporary file renamed into place.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Callable, Dict, List, Optional, Tuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from ravnest_swarm.errors import UserError

FORMAT = "ravnest-stage-checkpoint/1"
# the outer optimizer's state a checkpoint may keep (``OuterOptimizer``'s fields), each one float32 value per
# parameter of the stage, under ``outer.<key>``
OUTER_PREFIX, OUTER_STATE_KEYS = "outer.", ("anchor", "momentum", "error")
TEMPORARY_PREFIX, TEMPORARY_SUFFIX = ".tmp-", ".part"


def write_atomically(path: str, payload: bytes) -> None:
    """Replace ``path`` with ``payload`` so that readers see the old or the new file, never a mix."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    # the temporary file names its target, so a writer can clear its own leftovers in a shared directory
    descriptor, temporary = tempfile.mkstemp(prefix=f"{TEMPORARY_PREFIX}{os.path.basename(path)}.",
                                             suffix=TEMPORARY_SUFFIX, dir=directory)
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(payload)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    directory_descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(directory_descriptor)  # make the rename itself durable
    finally:
        os.close(directory_descriptor)


def remove_unfinished_writes(directory: str, target: Optional[str] = None) -> List[str]:
    """Delete the temporary files of writes that never finished (their writer was killed); return their names.

    :param target: only those of writes to this file name (its writer, about to write again, may clear
        them while others write beside it); None: all of them, only safe while nothing writes there
    """
    prefix = TEMPORARY_PREFIX if target is None else f"{TEMPORARY_PREFIX}{target}."
    unfinished = [name for name in os.listdir(directory)
                  if name.startswith(prefix) and name.endswith(TEMPORARY_SUFFIX)]
    for name in unfinished:
        os.unlink(os.path.join(directory, name))
    return unfinished


def save_stage(path: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer, info: Dict,
               outer: Optional[Dict[str, torch.Tensor]] = None) -> None:
    """Write a stage checkpoint.

    :param path: the ``.safetensors`` file to (re)write
    :param module: the stage's layers
    :param optimizer: its optimizer (per-parameter state is saved as tensors)
    :param info: JSON-able facts to keep: at least ``step`` and ``layers``; usually ``run`` and ``model``
    :param outer: its outer optimizer's state (``OuterOptimizer.state_tensors``: some of
        :data:`OUTER_STATE_KEYS`), none when it has none yet
    """
    # host copies: a stage on a GPU checkpoints what a CPU peer can load, and safetensors writes from the host
    tensors = {f"param.{name}": tensor.detach().to("cpu", copy=True).contiguous()
               for name, tensor in module.state_dict().items()}
    state_tensors, scalars = optimizer_tensors(optimizer, outer)
    tensors.update(state_tensors)
    metadata = {"format": FORMAT, "info": info, "param_groups": optimizer.state_dict()["param_groups"],
                "optimizer_scalars": scalars}
    write_atomically(path, save(tensors, metadata={"ravnest": json.dumps(metadata)}))


def optimizer_tensors(optimizer: torch.optim.Optimizer, outer: Optional[Dict[str, torch.Tensor]] = None,
                      parameters: Optional[range] = None) -> Tuple[Dict[str, torch.Tensor], Dict[str, Dict]]:
    """A stage's optimizer state as a checkpoint names it: host copies of the inner optimizer's per-parameter
    tensors (``optim.<index>.<key>``) and of the outer state (``outer.<key>``), and the inner optimizer's scalars
    by parameter index (AdamW's step counts). What a checkpoint keeps, and what a stage that stopped hands to the
    peer taking it over (``swarm/stage_state.py``). ``parameters``: only the state of these (some layers of the
    stage), numbered from the first, and only theirs copied."""
    tensors: Dict[str, torch.Tensor] = {}
    scalars: Dict[str, Dict] = {}
    for index, per_parameter in optimizer.state_dict()["state"].items():
        if parameters is not None:
            if index not in parameters:
                continue
            index -= parameters.start
        for key, value in per_parameter.items():
            if torch.is_tensor(value) and value.dim() > 0:
                tensors[f"optim.{index}.{key}"] = value.detach().to("cpu", copy=True).contiguous()
            else:
                scalars.setdefault(str(index), {})[key] = value.item() if torch.is_tensor(value) else value
    for key, value in (outer or {}).items():
        if key not in OUTER_STATE_KEYS:
            raise ValueError(f"no outer optimizer state is called {key!r}: one of {', '.join(OUTER_STATE_KEYS)}")
        tensors[OUTER_PREFIX + key] = value.detach().to("cpu", torch.float32, copy=True).contiguous()
    return tensors, scalars


def read_stage(path: str) -> Tuple[Dict[str, torch.Tensor], Dict]:
    """Read a checkpoint's tensors and metadata; a missing, corrupt or foreign file is a :class:`UserError`."""
    if not os.path.isfile(path):
        raise UserError(f"no checkpoint at {path}", exit_code=1)
    try:
        tensors = load_file(path)
        with open(path, "rb") as file:
            header_size = int.from_bytes(file.read(8), "little")
            header = json.loads(file.read(header_size))
        metadata = json.loads(header["__metadata__"]["ravnest"])
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"checkpoint {path} is corrupt or not a ravnest checkpoint ({type(e).__name__}); "
                        f"move it away to start this stage fresh", exit_code=1)
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        found = metadata.get("format") if isinstance(metadata, dict) else None
        raise UserError(f"checkpoint {path} has format {found!r}, expected {FORMAT!r}", exit_code=1)
    return tensors, metadata


def load_optimizer_state(path: str, optimizer: torch.optim.Optimizer) -> bool:
    """Load the per-parameter state a checkpoint kept (AdamW's moments, momentum buffers) into ``optimizer``, whose
    parameters are those of the checkpoint's layers in the same order; its hyper-parameters (the lr the schedule
    sets) stay. False when the checkpoint kept no state, or state of other shapes (then nothing is loaded)."""
    return take_optimizer_state(*read_stage(path), optimizer)


def take_optimizer_state(tensors: Dict[str, torch.Tensor], metadata: Dict, optimizer: torch.optim.Optimizer) -> bool:
    """:func:`load_optimizer_state` from a checkpoint's tensors and metadata, read or received: only finite float
    tensors of the parameters' shapes, and finite numbers for their scalars (AdamW's step count), are loaded."""
    state: Dict[int, Dict] = {}
    for name, tensor in tensors.items():
        if name.startswith("optim."):
            _, index, key = (name.split(".", 2) + ["", ""])[:3]
            if not index.isdigit() or not key or not tensor.is_floating_point() or not bool(torch.isfinite(tensor).all()):
                return False
            state.setdefault(int(index), {})[key] = tensor
    scalars = metadata.get("optimizer_scalars", {})
    if not isinstance(scalars, dict):
        return False
    for index, values in scalars.items():
        if not str(index).isdigit() or not isinstance(values, dict) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                for v in values.values()):
            return False
        state.setdefault(int(index), {}).update({key: torch.tensor(value, dtype=torch.float32) if key == "step"
                                                 else value for key, value in values.items()})
    current = optimizer.state_dict()
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    layout = state_layout(optimizer)
    # numbers, never structure: each parameter's state has exactly the keys our optimizer keeps, moments of the
    # parameter's shape and scalars as scalars (a state without exp_avg_sq, or with 0-dim moments, was taken and
    # then failed every step, which dropped every microbatch of the stage)
    if not state or any(i >= len(parameters) or set(s) != set(layout) or any(
            not torch.is_tensor(v) or (v.shape != parameters[i].shape if layout[k] else v.dim() != 0)
            for k, v in s.items()) for i, s in state.items()):
        return False
    optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})
    return True


def optimizer_like(optimizer: torch.optim.Optimizer, parameters) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s kind on ``parameters``, with the settings that decide what state it keeps
    (SGD's momentum, Adam's amsgrad) and its lr: a scratch copy to load received state into."""
    settings = {key: optimizer.defaults[key] for key in ("lr", "momentum", "amsgrad") if key in optimizer.defaults}
    return type(optimizer)(parameters, **settings)


def state_layout(optimizer: torch.optim.Optimizer) -> Dict[str, bool]:
    """The state ``optimizer``'s kind keeps per parameter once it stepped: each key, and whether it is a tensor of the
    parameter's shape (a moment, a momentum buffer) or a scalar (AdamW's step); a key a step leaves None (plain SGD's
    momentum buffer) is none. Read off a twin that takes one step on a probe parameter."""
    probe = torch.nn.Parameter(torch.zeros(2))
    twin = optimizer_like(optimizer, [probe])
    probe.grad = torch.zeros(2)
    twin.step()
    return {key: value.dim() > 0 for key, value in twin.state[probe].items() if torch.is_tensor(value)}


def load_outer_state(path: str, parameter_count: int) -> Dict[str, torch.Tensor]:
    """The outer optimizer's state a checkpoint kept (:data:`OUTER_STATE_KEYS`; empty when it kept none), for a stage
    of ``parameter_count`` parameters (the checkpoint's layers). Each must be a finite float32 vector of one value
    per parameter, with an anchor: anything else is a corrupt checkpoint, a one-line :class:`UserError`."""
    try:
        return take_outer_state(read_stage(path)[0], parameter_count)
    except ValueError as e:
        raise UserError(f"checkpoint {path} holds a corrupt outer optimizer state ({e}); move it away "
                        f"to start this stage fresh", exit_code=1)


def take_outer_state(tensors: Dict[str, torch.Tensor], parameter_count: int) -> Dict[str, torch.Tensor]:
    """:func:`load_outer_state` from a checkpoint's tensors, read or received; a ``ValueError`` names what is
    wrong."""
    # copies: the file read is mapped, and the stage's outer steps must not depend on it staying as it is
    state = {name[len(OUTER_PREFIX):]: tensor.clone() for name, tensor in tensors.items()
             if name.startswith(OUTER_PREFIX)}
    problems = [f"{key} is not one of {', '.join(OUTER_STATE_KEYS)}" for key in state if key not in OUTER_STATE_KEYS]
    if state and "anchor" not in state:
        problems.append("it has no anchor")
    for key, tensor in state.items():
        if tensor.dtype != torch.float32 or tuple(tensor.shape) != (parameter_count,):
            problems.append(f"{key} is {tensor.dtype} {list(tensor.shape)}, not float32 [{parameter_count}]")
        elif not bool(torch.isfinite(tensor).all()):
            problems.append(f"{key} is not finite")
    if problems:
        raise ValueError(problems[0])
    return state


def load_stage_layers(path: str, build_stage: Callable[[int, int], torch.nn.Sequential]
                      ) -> Tuple[Dict, torch.nn.Sequential]:
    """What ``--resume`` restores: the saved ``info`` (step, layer range) and the checkpoint's layers, built with
    ``build_stage(start, end)`` and loaded with the saved parameters.

    Names and shapes must match the built layers exactly; a checkpoint of other layers is refused, not
    partially applied. The optimizers' state is read apart (:func:`load_optimizer_state`, :func:`load_outer_state`),
    and the learning rate comes from the plan the stage joins (tests/test_checkpoint.py, tests/test_optimizers.py).
    """
    tensors, metadata = read_stage(path)
    info = metadata.get("info")
    if not (isinstance(info, dict) and isinstance(info.get("step"), int) and isinstance(info.get("layers"), list)
            and len(info["layers"]) == 2 and all(isinstance(i, int) and i >= 0 for i in info["layers"])):
        raise UserError(f"checkpoint {path} is corrupt: it does not say which layers and step it holds; move it "
                        f"away to start this stage fresh", 1)
    module = build_stage(*info["layers"])
    parameters = {name[len("param."):]: t for name, t in tensors.items() if name.startswith("param.")}
    expected = module.state_dict()
    mismatched = sorted(set(parameters) ^ set(expected)) or [
        name for name in expected if parameters[name].shape != expected[name].shape]
    if mismatched:
        raise UserError(f"checkpoint {path} holds other layers than this stage (first mismatch: {mismatched[0]})", 1)
    not_finite = first_non_finite(parameters)
    if not_finite is not None:
        raise UserError(f"checkpoint {path} holds non-finite values in {not_finite} (a damaged file, or saved from a "
                        f"run that diverged): move it away to start this stage from the run's holders", 1)
    module.load_state_dict(parameters)
    return info, module


def first_non_finite(tensors: Dict[str, torch.Tensor]) -> Optional[str]:
    """The name of the first floating tensor of ``tensors`` that holds a NaN or an infinity, else None: weights read
    from a file are checked as those from the network are (``state_transfer``), or one bad value spreads through
    every averaging round."""
    return next((name for name, tensor in tensors.items()
                 if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())), None)


# safetensors' names of the dtypes a model's state may hold
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                      torch.bool: "BOOL"}


class SafetensorsWriter:
    """A ``.safetensors`` file written one tensor at a time, in the order of ``entries``: the header is known
    beforehand from the names, shapes and dtypes (a model's layout), so a writer never holds more than the tensors
    it is handed (an export of a model bigger than memory: ``swarm/export.py``). Written to a temporary file beside
    ``path`` and renamed over it by :meth:`finish`, as :func:`write_atomically` does; :meth:`abandon` removes it.

    :param path: the file to write
    :param entries: ``(name, shape, dtype)`` of every tensor, in the order they will be written
    :param metadata: text the file's header keeps (safetensors' ``__metadata__``)
    """

    def __init__(self, path: str, entries: List[Tuple[str, List[int], torch.dtype]], metadata: Dict[str, str]):
        self.path, self.entries, self.written = path, list(entries), 0
        header: Dict = {"__metadata__": metadata}
        offset = 0
        for name, shape, dtype in self.entries:
            if dtype not in SAFETENSORS_DTYPES:
                raise UserError(f"cannot write tensor {name} of dtype {dtype} as safetensors")
            size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # as safetensors pads it: the data starts 8-byte aligned
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        descriptor, self.temporary = tempfile.mkstemp(prefix=f"{TEMPORARY_PREFIX}{os.path.basename(path)}.",
                                                      suffix=TEMPORARY_SUFFIX, dir=directory)
        self.file = os.fdopen(descriptor, "wb")
        try:
            self.file.write(len(encoded).to_bytes(8, "little") + encoded)
        except BaseException:  # a full disk: no temporary file is left behind
            self.abandon()
            raise

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The next tensor of ``entries``: it must be that one, of its shape and dtype."""
        expected_name, shape, dtype = self.entries[self.written]
        if name != expected_name or list(tensor.shape) != list(shape) or tensor.dtype != dtype:
            raise ValueError(f"expected {expected_name} {list(shape)} {dtype}, got {name} {list(tensor.shape)} "
                             f"{tensor.dtype}")
        self.file.write(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        self.written += 1

    def finish(self) -> None:
        if self.written != len(self.entries):
            raise ValueError(f"{len(self.entries) - self.written} tensor(s) of {self.path} were never written")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.temporary, self.path)

    def abandon(self) -> None:
        self.file.close()
        if os.path.exists(self.temporary):
            os.unlink(self.temporary)
