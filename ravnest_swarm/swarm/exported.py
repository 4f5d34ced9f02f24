"""An exported model (``ravnest-swarm export``, ``local --export``): reading it back and using it.

An export is a directory of two files:

- ``model.safetensors``: every layer's tensors under ``{layer name}.{tensor name}`` (``embed.tokens.weight``,
  ``block3.qkv.bias``; a model whose layer names repeat gets ``{index}.{layer name}.`` instead), layer after layer;
- ``model.json``: the run's spec (model entry point or zoo name, its settings, the layout of every layer, the data
  hash), and per layer its index, name, the step its copy is at and the peers that served it.

Nothing in an export runs: :func:`load_model` builds the model from this machine's code (the zoo, or the user's
``module:function`` that the spec names, importable here), checks it against the export's layout, and loads the
weights; a safetensors file holds only numbers. Evaluating goes layer by layer (:class:`LayerStates`), so a model
bigger than this machine's memory is still evaluated, and :func:`model_figures` is what ``local``'s summary uses, so
an export of a ``local`` run evaluates to the summary's figures.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn

from ravnest_swarm.checkpoint import SAFETENSORS_DTYPES, first_non_finite
from ravnest_swarm.errors import UserError
from ravnest_swarm.models import (ModelSpec, accuracy_counts, first_difference, load_model as build_model, model_layout,
                                  model_structure)

FORMAT = "ravnest-export/1"
WEIGHTS, MANIFEST = "model.safetensors", "model.json"
SAMPLE_CONTEXT_BYTES = 256  # a byte-level GPT's vocabulary


def layer_prefixes(layout: Sequence) -> List[str]:
    """The key prefix of each layer's tensors: its name, or ``{index}.{name}`` for every layer where names repeat."""
    names = [name for name, _ in layout]
    return names if len(set(names)) == len(names) else [f"{index}.{name}" for index, name in enumerate(names)]


def weight_entries(layout: Sequence) -> List[Tuple[str, List[int], torch.dtype]]:
    """``(key, shape, dtype)`` of every tensor of the model, in file order (layer by layer)."""
    return [(f"{prefix}.{key}", list(shape), getattr(torch, dtype))
            for prefix, (_, tensors) in zip(layer_prefixes(layout), layout) for key, shape, dtype in tensors]


@dataclass
class Export:
    """An export read back: where it is, its ``model.json``, and the model built here from the spec it names."""

    path: str
    manifest: Dict
    model: ModelSpec

    @property
    def spec(self) -> Dict:
        return self.manifest["spec"]

    def layer_state(self, index: int) -> Dict[str, torch.Tensor]:
        """Layer ``index``'s tensors, read from the file (only those)."""
        from safetensors import safe_open

        layout = self.spec["layout"]
        prefix = layer_prefixes(layout)[index]
        with safe_open(os.path.join(self.path, WEIGHTS), framework="pt") as weights:
            state = {key: weights.get_tensor(f"{prefix}.{key}") for key, _, _ in layout[index][1]}
        not_finite = first_non_finite(state)
        if not_finite is not None:
            raise UserError(f"{self.path} holds non-finite values in layer {index}'s {not_finite}: the export is "
                            f"damaged (export it again)", 1)
        return state

    def states(self) -> "LayerStates":
        return LayerStates(self)


class LayerStates(Mapping):
    """The export's layers by index, each read from the file when asked for: what ``ModelSpec.run_layers`` takes, so a
    model is evaluated with one layer in memory at a time."""

    def __init__(self, export: Export):
        self.export = export

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        if not isinstance(index, int) or not 0 <= index < len(self):
            raise KeyError(index)
        return self.export.layer_state(index)

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self)))

    def __len__(self) -> int:
        return len(self.export.spec["layout"])


def newest_export(path: str) -> Optional[str]:
    """``path`` if it is an export, else the newest complete ``snapshot-*`` export in it (``join --snapshot-dir``),
    else None."""
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    if not os.path.isdir(path):
        return None
    found = sorted(name for name in os.listdir(path)
                   if name.startswith("snapshot-") and os.path.isfile(os.path.join(path, name, MANIFEST)))
    return os.path.join(path, found[-1]) if found else None


def read_export(path: str, data: Optional[str] = None) -> Export:
    """The export at ``path``, its model built from this machine's code (on the data at ``data``, where given, for
    evaluating); a missing or corrupt export, or code that builds another model, is a one-line :class:`UserError`."""
    if not os.path.isdir(path):
        raise UserError(f"no export at {path}: {'not a directory' if os.path.exists(path) else 'no such directory'}", 1)
    manifest_path, weights_path = os.path.join(path, MANIFEST), os.path.join(path, WEIGHTS)
    for needed in (manifest_path, weights_path):
        if not os.path.isfile(needed):
            raise UserError(f"{path} is not a complete export: {os.path.basename(needed)} is missing "
                            f"(`ravnest-swarm export` writes it)", 1)
    try:
        with open(manifest_path) as file:
            manifest = json.load(file)
        spec, layers = manifest["spec"], manifest["layers"]
        layout = spec["layout"]
        if manifest.get("format") != FORMAT or not isinstance(layout, list) or len(layers) != len(layout):
            raise ValueError("not an export of this format")
        if not isinstance(spec["model"], str) or not isinstance(spec.get("model_config", ""), str):
            raise ValueError("its model and model_config are not text")
        entries = weight_entries(layout)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"{manifest_path} is corrupt or not a ravnest export ({type(e).__name__}: {e})", 1)
    _check_weights(weights_path, entries)
    try:
        model = (build_model(spec["model"], spec.get("model_config", ""), os.path.abspath(data)) if data is not None
                 else model_structure(spec["model"], spec.get("model_config", "")))
    except ValueError as e:
        raise UserError(f"cannot build the export's model {spec['model']}: {e}", 1)
    difference = first_difference(model_layout(model), layout)
    if difference is not None:
        raise UserError(f"your code builds a different model from the export's {spec['model']}: {difference}", 1)
    return Export(path, manifest, model)


def _check_weights(path: str, entries: List[Tuple[str, List[int], torch.dtype]]) -> None:
    """The weights file's header names exactly the layout's tensors, with their shapes and dtypes, and the file is
    as long as they need (a truncated copy is refused here, not half-loaded later)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as weights:
            keys = set(weights.keys())
            missing = [name for name, _, _ in entries if name not in keys]
            if missing or len(keys) != len(entries):
                raise ValueError(f"it lacks {missing[0]}" if missing else "it holds tensors the layout does not name")
            for name, shape, dtype in entries:
                found = weights.get_slice(name)
                if list(found.get_shape()) != list(shape):
                    raise ValueError(f"{name} has shape {found.get_shape()}, the layout {shape}")
                if found.get_dtype() != SAFETENSORS_DTYPES.get(dtype):
                    raise ValueError(f"{name} is {found.get_dtype()}, the layout {SAFETENSORS_DTYPES.get(dtype, dtype)}")
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{path} is corrupt or does not match its model.json ({e})", 1)


def load_model(path: str) -> torch.nn.Sequential:
    """The whole model of the export at ``path`` as one torch module (layers in order), in eval mode, with the
    exported weights; built from this machine's code, never from the export (module docstring)."""
    export = read_export(path)
    module = export.model.build_full()  # built as the run built it (buffers outside the state included), then loaded
    for index, layer in enumerate(module):
        layer.load_state_dict(export.layer_state(index))
    return module.eval()


def model_figures(model: ModelSpec, states: Optional[Mapping]) -> Dict[str, Optional[float]]:
    """Held-out loss and accuracy (argmax against the targets; None for regression targets) on the model's held-out
    yardstick, and the loss on the training yardstick (``ModelSpec.yardstick``), of the layers ``states`` (None: the
    seeded start), run one layer at a time. ``local``'s summary and ``evaluate`` both say these."""
    inputs, targets = model.yardstick("heldout")
    outputs = model.run_layers(inputs, states)
    correct, counted = (0, 0) if targets.is_floating_point() else accuracy_counts(outputs, targets)
    accuracy = round(correct / counted, 4) if counted else None
    train_inputs, train_targets = model.yardstick("train")
    return dict(heldout_loss=round(float(model.loss(outputs, targets)), 4), heldout_accuracy=accuracy,
                train_loss=round(float(model.loss(model.run_layers(train_inputs, states), train_targets)), 4))


def evaluate_export(path: str, data: Optional[str], as_json: bool) -> int:
    """``ravnest-swarm evaluate``: the export's figures (:func:`model_figures`), a line or JSON."""
    export = read_export(path, data)
    run = export.manifest.get("run", "?")
    if data is None and export.spec.get("data_hash"):
        raise UserError(f"{path} was trained on data of its own (sha256 {export.spec['data_hash'][:12]}): pass --data "
                        f"with your copy, or other data of that form", 1)
    if export.model.heldout is None:
        raise UserError(f"model {export.spec['model']} has no held-out data of its own: pass --data", 1)
    figures = model_figures(export.model, export.states())
    if as_json:
        print(json.dumps(dict(figures, export=path, run=run, model=export.spec["model"])), flush=True)
        return 0
    accuracy = "n/a" if figures["heldout_accuracy"] is None else f"{figures['heldout_accuracy']:.1%}"
    print(f"{export.spec['model']} from run {run}: held-out loss {figures['heldout_loss']:.4g}, held-out accuracy "
          f"{accuracy}; training loss {figures['train_loss']:.4g}", flush=True)
    return 0


def sample_text(module: torch.nn.Module, context: int, prompt: bytes, tokens: int, temperature: float,
                seed: int, generated: Callable[[], None] = lambda: None) -> bytes:
    """``tokens`` bytes generated after ``prompt`` by a byte-level language model ``module`` (ids in, logits per
    position out) that sees at most ``context`` tokens; ``temperature`` 0 takes the likeliest byte each time;
    ``generated()`` is called after each byte."""
    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt) or [ord("\n")]  # no prompt: it writes as after a line's end (which is not its output)
    start = len(ids)
    with torch.no_grad():
        for _ in range(tokens):
            logits = module(torch.tensor([ids[-context:]], dtype=torch.long))[0, -1].float()
            if temperature <= 0:
                ids.append(int(logits.argmax()))
            else:
                probabilities = torch.softmax(logits / temperature, dim=-1)
                ids.append(int(torch.multinomial(probabilities, 1, generator=generator)))
            generated()
    return bytes(ids[start:])


def sample_export(path: str, prompt: str, tokens: int, temperature: float, seed: int) -> int:
    """``ravnest-swarm sample``: the prompt and what the export's byte-level GPT writes after it, on stdout."""
    export = read_export(path)
    first = export.model.layers[0]
    if first.input_dtype != torch.long or export.model.vocab != SAMPLE_CONTEXT_BYTES or len(first.input_shape) != 1:
        raise UserError(f"sample writes text with byte-level language models (token ids 0-255 in, one logit per "
                        f"byte out); {export.spec['model']} is not one", 1)
    module = load_model(path)
    # on stderr and gone once done: stdout carries the text alone, for a pipe
    with Progress(TextColumn("sampling"), BarColumn(), TextColumn("{task.completed}/{task.total} bytes"),
                  console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("sampling", total=tokens)
        # the prompt's bytes as they were typed: a terminal's bytes that are no UTF-8 reach us as surrogates
        written = os.fsencode(prompt)
        text = sample_text(module, first.input_shape[0], written, tokens, temperature, seed,
                           lambda: progress.advance(task))
    sys.stdout.flush()
    # the prompt as typed; the model's bytes as UTF-8, a byte that is none shown as U+FFFD
    sys.stdout.buffer.write(written + text.decode("utf-8", errors="replace").encode() + b"\n")
    sys.stdout.buffer.flush()
    return 0
