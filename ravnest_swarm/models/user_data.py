"""A user's data (``--data PATH``): a directory of text files, or of ``.npy`` arrays, with a content hash.

Three layouts, told apart by the files (hidden files are skipped):

- text files (any names but ``.npy``): their bytes, in path order, are the tokens (byte-level, ids 0-255);
- one ``.npy`` file holding a 1-D array of integer token ids;
- ``inputs.npy`` and ``targets.npy``: features and labels, one sample per row of each.

Token streams are cut into windows of the model's context plus one (targets are the inputs shifted by
one), as the built-in text is. Every 6th sample is held out, as for the built-in data, and samples stay
addressed by id, so each cluster draws its own shard. The run spec carries the content hash and size; a
peer whose copy differs refuses to join. Arrays load with ``allow_pickle=False``: a data file never runs code.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Tuple

import numpy as np
import torch

from ravnest_swarm.models.data import HELDOUT_EVERY, Dataset
from ravnest_swarm.models.zoo import IGNORED_TARGET, ModelSpec, class_dim

FEATURE_FILES = ("inputs.npy", "targets.npy")
MIN_SAMPLES = 2 * HELDOUT_EVERY  # fewer, and the held-out split or the training split is nearly empty
HASH_CHUNK = 1 << 20
SHOW_PROGRESS_BYTES = 64 << 20  # hashing less than this takes well under a second


@dataclass(frozen=True)
class DataSource:
    """A checked data directory.

    :param path: the directory
    :param kind: ``text``, ``tokens`` or ``features``
    :param files: its files, relative to ``path``, in the order their bytes are read
    :param size: bytes in all
    :param digest: sha256 of every file's relative path, size and content, in that order
    """

    path: str
    kind: str
    files: Tuple[str, ...]
    size: int
    digest: str


def _listing(path: str) -> Tuple[str, ...]:
    if not os.path.isdir(path):
        raise ValueError(f"--data {path}: {'no such directory' if not os.path.exists(path) else 'not a directory'}")
    files = []
    try:
        for root, directories, names in os.walk(path, onerror=_raise):
            directories[:] = sorted(d for d in directories if not d.startswith("."))
            files += [os.path.relpath(os.path.join(root, name), path) for name in names if not name.startswith(".")]
    except OSError as e:
        raise ValueError(f"--data {path}: cannot read {e.filename or path}: {e.strerror}")
    return tuple(sorted(files))


def _raise(error: OSError) -> None:
    raise error


def _kind(path: str, files: Tuple[str, ...]) -> str:
    if not files:
        raise ValueError(f"--data {path} holds no files: put text files, or .npy arrays, in it")
    arrays = [name for name in files if name.endswith(".npy")]
    if arrays and len(arrays) != len(files):
        text = next(name for name in files if not name.endswith(".npy"))
        raise ValueError(f"--data {path} mixes .npy arrays ({arrays[0]}) with other files ({text}): "
                         f"give text files or arrays, not both")
    if not arrays:
        return "text"
    if sorted(arrays) == sorted(FEATURE_FILES):
        return "features"
    if len(arrays) == 1:
        return "tokens"
    raise ValueError(f"--data {path} holds {len(arrays)} arrays ({', '.join(arrays[:3])}): give one array of "
                     f"token ids, or exactly {' and '.join(FEATURE_FILES)}")


@lru_cache(maxsize=4)
def scan_data(path: str) -> DataSource:
    """Check the directory's layout and hash its content (a progress bar for large data); one-line errors."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    path = os.path.abspath(path)
    files = _listing(path)
    kind = _kind(path, files)
    sizes = []
    for name in files:
        try:
            sizes.append(os.path.getsize(os.path.join(path, name)))
        except OSError as e:
            raise ValueError(f"--data {path}: cannot read {name}: {e.strerror}")
    digest = hashlib.sha256()
    with Progress(TextColumn("hashing --data"), BarColumn(), DownloadColumn(), transient=True,
                  console=Console(stderr=True), disable=sum(sizes) < SHOW_PROGRESS_BYTES) as progress:
        task = progress.add_task("hash", total=sum(sizes))
        for name, size in zip(files, sizes):
            digest.update(f"{name}\0{size}\0".encode())
            try:
                with open(os.path.join(path, name), "rb") as f:
                    while chunk := f.read(HASH_CHUNK):
                        digest.update(chunk)
                        progress.advance(task, len(chunk))
            except OSError as e:
                raise ValueError(f"--data {path}: cannot read {name}: {e.strerror}")
    return DataSource(path, kind, files, sum(sizes), digest.hexdigest())


def _load_array(source: DataSource, name: str) -> np.ndarray:
    try:
        return np.load(os.path.join(source.path, name), allow_pickle=False, mmap_mode="r")
    except (OSError, ValueError) as e:  # not an .npy file, or an array of Python objects
        raise ValueError(f"--data {source.path}: {name} is not a numeric .npy array ({e})")


def _token_windows(source: DataSource, spec: ModelSpec) -> torch.Tensor:
    first = spec.layers[0]
    if first.input_dtype != torch.long or len(first.input_shape) != 1:
        raise ValueError(f"--data {source.path} holds {'text' if source.kind == 'text' else 'token ids'}, but "
                         f"model {spec.name} takes {list(first.input_shape)} {first.input_dtype} samples, not "
                         f"token ids: give it inputs.npy and targets.npy")
    if source.kind == "text":
        tokens = np.concatenate([np.fromfile(os.path.join(source.path, name), dtype=np.uint8)
                                 for name in source.files]).astype(np.int64)
    else:
        array = _load_array(source, source.files[0])
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"--data {source.path}: {source.files[0]} must be a 1-D array of integer token ids, "
                             f"not {array.ndim}-D {array.dtype}")
        tokens = np.array(array, dtype=np.int64)  # a copy: torch takes no read-only (memory-mapped) arrays
    vocab = spec.vocab or _embedding_rows(spec)
    if len(tokens) and (tokens.min() < 0 or (vocab is not None and tokens.max() >= vocab)):
        raise ValueError(f"--data {source.path}: token ids run from {tokens.min()} to {tokens.max()}, model "
                         f"{spec.name} takes 0-{(vocab or 1) - 1}")
    width = first.input_shape[0] + 1
    windows = len(tokens) // width
    return torch.as_tensor(tokens[: windows * width]).view(windows, width)


def _embedding_rows(spec: ModelSpec):
    """How many token ids the first layer takes, for a model that names no ``vocab`` (a user's review: ids past it
    were taken, and every microbatch then failed on an IndexError); None without an embedding. The embedding that
    looks the layer's input up is the tokens' (a positional one looks positions up, and a byte model's can be the
    larger); where none takes the input as it is, the largest, which refuses no id any embedding could take."""
    with torch.device("meta"):
        first = spec.layers[0].build()
        embeddings = [module for module in first.modules() if isinstance(module, torch.nn.Embedding)]
        if not embeddings:
            return None
        probe, looked_up = torch.zeros((2, *spec.layers[0].input_shape), dtype=torch.int64), []
        hooks = [embedding.register_forward_pre_hook(
            lambda module, inputs: looked_up.append(module) if inputs and inputs[0] is probe else None)
            for embedding in embeddings]
        try:
            first(probe)
        except Exception:  # a layer meta tensors cannot run: the largest embedding's rows, as said
            looked_up.clear()
        finally:
            for hook in hooks:
                hook.remove()
    return (looked_up[0] if looked_up else max(embeddings, key=lambda e: e.num_embeddings)).num_embeddings


def _split(inputs: torch.Tensor, targets: torch.Tensor, split: str) -> Dataset:
    held = torch.arange(len(inputs)) % HELDOUT_EVERY == HELDOUT_EVERY - 1
    keep = held if split == "heldout" else ~held
    return Dataset(inputs[keep].contiguous(), targets[keep].contiguous())


@lru_cache(maxsize=4)
def _samples(source: DataSource, spec: ModelSpec) -> Tuple[torch.Tensor, torch.Tensor]:
    if source.kind == "features":
        inputs, targets = (_load_array(source, name) for name in FEATURE_FILES)
        if len(inputs) != len(targets):
            raise ValueError(f"--data {source.path}: inputs.npy has {len(inputs)} samples, targets.npy "
                             f"{len(targets)}")
        first = spec.layers[0]
        if tuple(inputs.shape[1:]) != tuple(first.input_shape):
            raise ValueError(f"--data {source.path}: samples of shape {list(inputs.shape[1:])}, but model "
                             f"{spec.name} takes {list(first.input_shape)}")
        # a copy, as for token ids, in this machine's byte order (torch takes no big-endian array)
        inputs = torch.as_tensor(np.array(inputs, dtype=inputs.dtype.newbyteorder("=")), dtype=first.input_dtype)
        if targets.dtype == np.bool_:  # else taken as floats 0.0 and 1.0: "float targets" a user never gave
            raise ValueError(f"--data {source.path}: targets.npy holds true/false values: give class labels as "
                             f"integers (0 and 1) or regression targets as floats")
        # integer labels are classes (cross entropy takes them as int64), anything else regression targets
        targets = torch.as_tensor(np.array(targets, dtype=np.int64 if np.issubdtype(targets.dtype, np.integer)
                                             else np.float32))
        for name, values in zip(FEATURE_FILES, (inputs, targets)):
            # one NaN made stage 0's output non-finite at every pass over it: a "divergence" that restored the
            # layers to their start, once an epoch
            if values.is_floating_point() and not bool(torch.isfinite(values).all()):
                index = int((~torch.isfinite(values)).reshape(len(values), -1).any(dim=1).nonzero()[0])
                raise ValueError(f"--data {source.path}: {name} holds a value that is not finite (NaN or infinite) "
                                 f"in sample {index}")
    else:
        windows = _token_windows(source, spec)
        inputs, targets = windows[:, :-1], windows[:, 1:]
    if len(inputs) < MIN_SAMPLES:
        raise ValueError(f"--data {source.path} makes {len(inputs)} samples for model {spec.name}; it needs at "
                         f"least {MIN_SAMPLES}")
    return inputs, targets


def bind_data(spec: ModelSpec, path: str) -> ModelSpec:
    """``spec`` training on the data at ``path`` instead of its own; checked against the model at once."""
    source = scan_data(path)
    _check_targets_fit(source, spec, _samples(source, spec)[1])  # a mismatch is one line now, not a stage failing later
    return dataclasses.replace(spec, dataset=lambda: _split(*_samples(source, spec), "train"),
                               heldout=lambda: _split(*_samples(source, spec), "heldout"))


def _check_targets_fit(source: DataSource, spec: ModelSpec, targets: torch.Tensor) -> None:
    """Targets whose shape the model's output cannot be scored against are refused here: class labels as a column
    ``(N, 1)`` failed every microbatch of a run, and float targets ``(N,)`` for outputs ``(N, 1)`` broadcast in a mean
    squared error, so the model learned only their mean while the run said nothing failed. Class labels take the
    output's shape less its class dimension (the last, or the second: ``class_dim``); float targets, the output's."""
    last = spec.layers[-1]
    with torch.device("meta"):
        output = last.build()(torch.zeros((2, *last.input_shape), dtype=last.input_dtype))
    per_sample, out = list(targets.shape[1:]), list(output.shape[1:])
    if targets.is_floating_point():
        fits, wanted = per_sample == out, f"{out}, as the model's output"
    else:
        shapes = [out[:-1]] + ([out[1:]] if len(out) > 1 else [])
        fits, wanted = per_sample in shapes, " or ".join(str(shape) for shape in shapes) + \
            ", the model's output less its class dimension"
    if not fits:
        kind = "float targets" if targets.is_floating_point() else "class labels"
        raise ValueError(f"--data {source.path}: {kind} of shape {per_sample} a sample, but model {spec.name} outputs "
                         f"{out} a sample: they must be of shape {wanted}")
    if source.kind == "features" and not targets.is_floating_point() and len(targets):
        # a label past the classes failed every microbatch it was in, and the run, minutes later, with an IndexError
        # (token ids are checked against the vocabulary as they are read, without a copy of every window here)
        dim = class_dim(torch.empty((1, *out), device="meta"), targets[:1])  # of the outputs with their batch
        classes = out[dim - 1 if dim > 0 else dim]
        counted = targets[targets != IGNORED_TARGET]
        low, high = (int(counted.min()), int(counted.max())) if counted.numel() else (0, 0)
        if low < 0 or high >= classes:
            raise ValueError(f"--data {source.path}: class labels run from {low} to {high}, but model {spec.name} "
                             f"outputs {classes} classes: labels must lie in 0-{classes - 1}")
    _check_loss(source, spec, output, targets)


def _check_loss(source: DataSource, spec: ModelSpec, output: torch.Tensor, targets: torch.Tensor) -> None:
    """The model's loss, tried once on made-up outputs of the right shape (seeded, in (0, 1): what a sigmoid or a
    softmax gives, and logits too) and two samples' targets: one that is no function, or that returns anything but
    one number with a gradient (the microbatch's mean), failed every microbatch of a run in a busy loop (a user's
    review: 15,000 dropped in 40 s) and ended it with an unexpected TypeError. A loss that raises on made-up
    outputs (one that wants a positive scale, say) is not judged: real outputs may suit it."""
    if not callable(spec.loss):
        raise ValueError(f"model {spec.name}'s loss is a {type(spec.loss).__name__}, not a function: give "
                         f"loss(outputs, targets), such as torch.nn.functional.cross_entropy")
    generator = torch.Generator().manual_seed(0)
    shape = (min(2, len(targets)), *output.shape[1:])
    outputs = (0.01 + 0.98 * torch.rand(shape, generator=generator)).requires_grad_()
    try:
        value = spec.loss(outputs, targets[: len(outputs)])
    except Exception:  # a user's loss may raise anything on outputs no model of theirs would give
        return
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.requires_grad:
        what = (f"a tensor of shape {list(value.shape)}{'' if value.requires_grad else ' that needs no gradient'}"
                if isinstance(value, torch.Tensor) else f"a {type(value).__name__}")
        raise ValueError(f"model {spec.name}'s loss returns {what}: it must return one number, the mean over the "
                         f"microbatch, that gradients flow back from")
