"""Which model a run trains, built from local code only: zoo names, settings, user entry points, fingerprints.

A run names its model as a zoo family or preset (``gpt-85m``, ``gpt`` with ``layers=12,width=768``) or as a
user's entry point (``my_package.my_module:build``), a function that returns a :class:`ModelSpec`. No code
travels: every peer builds the model from the code it has, and the run spec carries the model's *layout*
(every layer's parameter names, shapes and dtypes), so a peer whose code builds something else refuses with
the first difference instead of training another model.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from functools import partial
import os
import sys
from functools import lru_cache
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import msgpack
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ravnest_swarm.models.zoo import FAMILIES, MODELS, PRESETS, LayerSpec, ModelSpec, gpt

# one layer's layout: its name, then (parameter name, shape, dtype) of each tensor of its state
LayerLayout = Tuple[str, List[Tuple[str, List[int], str]]]


def parse_model_config(text: str) -> Dict[str, Union[int, float, str]]:
    """``"layers=12,width=768"`` -> ``{"layers": 12, "width": 768}``: numbers where they parse, else text."""
    settings: Dict[str, Union[int, float, str]] = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        key, equals, value = item.partition("=")
        if not equals or not key.strip().isidentifier() or not value.strip():
            raise ValueError(f"--model-config must look like layers=12,width=768, not {text!r}")
        value = value.strip()
        for kind in (int, float):
            try:
                value = kind(value)
                break
            except ValueError:
                continue
        settings[key.strip()] = value
    return settings


def is_entry_point(name: str) -> bool:
    return ":" in name


def _import_entry_point(name: str) -> Callable[..., ModelSpec]:
    module_name, _, function_name = name.partition(":")
    if module_name.endswith(".py") or "/" in module_name or os.sep in module_name:  # a path, not a module's name
        module = os.path.splitext(os.path.basename(module_name))[0] or "module"
        raise ValueError(f"--model {name}: give the module's name, not its file ({module}:{function_name or 'build'}), "
                         f"from its directory or with that directory on PYTHONPATH")
    # like uvicorn's --app-dir default: a user's module beside them imports without installing it
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # the user's module may raise anything while it imports
        where = " (run from its directory, or put that directory on PYTHONPATH)" \
            if isinstance(e, ModuleNotFoundError) and e.name == module_name.split(".")[0] else ""
        raise ValueError(f"cannot import {module_name!r} for --model {name}: {type(e).__name__}: {e}{where}")
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ValueError(f"{module_name} has no function {function_name!r} for --model {name}")
    return function


def _call_with_settings(function: Callable[..., ModelSpec], settings: Dict, name: str) -> ModelSpec:
    parameters = inspect.signature(function).parameters
    takes_any = any(p.kind == p.VAR_KEYWORD for p in parameters.values())
    unknown = [key for key in settings if key not in parameters or key == "name"]
    if unknown and not takes_any:
        accepted = ", ".join(key for key in parameters if key != "name") or "no settings"
        raise ValueError(f"model {name} takes {accepted}; --model-config names {', '.join(unknown)}")
    try:
        return function(**settings)
    except ValueError:
        raise
    except Exception as e:  # a user's build function may raise anything
        raise ValueError(f"building model {name} failed: {type(e).__name__}: {e}")


@lru_cache(maxsize=8)
def load_model(name: str, config: str = "", data: Optional[str] = None) -> ModelSpec:
    """The model a run names, built from this peer's code, on the data at ``data`` (None: its own).

    Nothing is allocated here but the layer list: stages build their own layers. Raises ``ValueError`` with
    one line for an unknown name, bad settings, a user module that does not import or builds no model,
    and data that does not fit the model.
    """
    from ravnest_swarm.models.user_data import bind_data  # numpy loading is only needed with --data

    spec = model_structure(name, config)
    if data is not None:
        return bind_data(spec, data)
    if spec.dataset is None:
        raise ValueError(f"model {name} has no data of its own: give --data PATH (docs/models.md)")
    return spec


@lru_cache(maxsize=8)
def model_structure(name: str, config: str = "") -> ModelSpec:
    """The model a run names, its layers only (a user's model without its data): what an export is loaded into
    (``swarm/exported.py``). Raises ``ValueError`` with one line as :func:`load_model` does."""
    settings = parse_model_config(config)
    if is_entry_point(name):
        spec = _call_with_settings(_import_entry_point(name), settings, name)
        if not isinstance(spec, ModelSpec):
            raise ValueError(f"--model {name} returned {type(spec).__name__}, not a ModelSpec "
                             f"(build one with ravnest_swarm.models.sequential_model; docs/models.md)")
    elif name in PRESETS:
        spec = _call_with_settings(partial(gpt, name=name), {**PRESETS[name], **settings}, name)
    elif name in FAMILIES:
        spec = _call_with_settings(FAMILIES[name], settings, name)
    else:
        raise ValueError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}, or give your own as "
                         f"module:function")
    if not spec.layers:
        raise ValueError(f"model {name} has no layers")
    return spec


def get_model(name: str) -> ModelSpec:
    """A zoo model by name, with its built-in data."""
    return load_model(name)


def sequential_model(name: str, layers: Sequence[Tuple[str, Callable[[], nn.Module]]],
                     input_shape: Sequence[int], input_dtype: torch.dtype = torch.float32,
                     loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
                     vocab: Optional[int] = None, seed: int = 0) -> ModelSpec:
    """A user's model from its layers in order: what a ``--model module:function`` entry point returns.

    Each layer's input shape and forward FLOPs come from running the layers once on the ``meta`` device
    (no memory, no compute), so a user writes only the modules. It trains on ``--data``.

    :param name: shown in records and checkpoints
    :param layers: ``(name, build)`` per layer; ``build()`` makes the module, under a per-layer seed
    :param input_shape: one sample's input to the first layer (``(64,)`` features, ``(context,)`` token ids)
    :param input_dtype: ``torch.long`` for token ids
    :param loss: ``loss(outputs, targets)``, a mean over the microbatch
    :param vocab: for token ids, how many the first layer takes
    :param seed: base seed of the per-layer seeds
    """
    specs = []
    with torch.device("meta"):
        # a batch of two, counted per sample: batch norm in training mode refuses a batch of one
        x = torch.zeros((2, *input_shape), dtype=input_dtype)
        modules = []
        for layer_name, build in layers:
            if isinstance(build, nn.Module) or not callable(build):  # else "forward() missing ... 'input'"
                raise ValueError(f"layer {layer_name!r} of model {name} is a {type(build).__name__}, not a function "
                                 f"that builds it: give (name, lambda: nn.Linear(...)), so each stage builds its own")
            modules.append(build())
            if not isinstance(modules[-1], nn.Module):
                raise ValueError(f"layer {layer_name!r} of model {name} builds a {type(modules[-1]).__name__}, not a "
                                 f"torch.nn.Module")
        owners: Dict[int, int] = {}  # id of each parameter built -> the index of the layer that holds it
        for index, module in enumerate(modules):
            for parameter in module.parameters():
                # tied weights (an embedding shared with the output head): each stage would train its own copy,
                # and the export would keep one of two that differ
                if owners.setdefault(id(parameter), index) != index:
                    raise ValueError(f"layers {layers[owners[id(parameter)]][0]!r} and {layers[index][0]!r} of model "
                                     f"{name} share a parameter (tied weights): stages train their layers apart, so "
                                     f"give each layer its own")
        for (layer_name, build), module in zip(layers, modules):
            counter = FlopCounterMode(display=False)
            try:
                with counter:
                    y = module(x)
            except Exception as e:  # torch's own words name no layer ("a and b must have same reduction dim")
                raise ValueError(f"layer {layer_name!r} of model {name} fails on its input, of shape "
                                 f"{list(x.shape[1:])} a sample ({str(x.dtype).replace('torch.', '')}): "
                                 f"{type(e).__name__}: {e}")
            if not isinstance(y, torch.Tensor):  # else the next line's error names no layer and no rule
                raise ValueError(f"layer {layer_name!r} of model {name} returns a {type(y).__name__}: a layer takes "
                                 f"one tensor and returns one")
            if y.numel() == 0:  # --model-config hidden=0 started a swarm that trained a model of no width
                raise ValueError(f"layer {layer_name!r} of model {name} returns an empty tensor (shape "
                                 f"{list(y.shape[1:])} a sample): check the model's settings")
            # FLOPs rank layers for the planner; a layer that counts none (an embedding lookup) still moves
            # its output through memory once
            flops = max(counter.get_total_flops(), y.numel()) // 2
            specs.append(LayerSpec(layer_name, build, tuple(x.shape[1:]), x.dtype, int(flops)))
            x = y
    return ModelSpec(name, tuple(specs), None, loss, seed=seed, vocab=vocab)


def model_layout(spec: ModelSpec) -> List[LayerLayout]:
    """Every layer's name and the names, shapes and dtypes of its state, from a build on ``meta`` (no memory)."""
    layout = []
    for layer in spec.layers:
        with torch.device("meta"):
            module = layer.build()
        layout.append((layer.name, [(key, list(t.shape), str(t.dtype).removeprefix("torch."))
                                    for key, t in module.state_dict().items()]))
    return layout


def layout_fingerprint(layout: Sequence) -> str:
    """A short hash of a layout, shown to people comparing runs (the spec carries the layout itself)."""
    normal = [[name, [[key, list(shape), dtype] for key, shape, dtype in tensors]] for name, tensors in layout]
    return hashlib.sha256(msgpack.packb(normal)).hexdigest()[:16]


def first_difference(ours: Sequence, theirs: Sequence) -> Optional[str]:
    """The first way the layout ``ours`` differs from the run's ``theirs``, in words, or None if they agree."""
    def tensor(entry) -> str:
        key, shape, dtype = entry
        return f"{key} {list(shape)} {dtype}"

    for index, ((our_name, our_tensors), (their_name, their_tensors)) in enumerate(zip(ours, theirs)):
        for position in range(max(len(our_tensors), len(their_tensors))):
            ours_here = tuple(our_tensors[position]) if position < len(our_tensors) else None
            theirs_here = tuple(their_tensors[position]) if position < len(their_tensors) else None
            if ours_here is None or theirs_here is None or \
                    (ours_here[0], list(ours_here[1]), ours_here[2]) != (theirs_here[0], list(theirs_here[1]),
                                                                          theirs_here[2]):
                return (f"layer {index} ({their_name}): yours has "
                        f"{tensor(ours_here) if ours_here else 'nothing more'}, the run's "
                        f"{tensor(theirs_here) if theirs_here else 'nothing more'}")
        if our_name != their_name:
            return f"layer {index} is {our_name!r} in yours, {their_name!r} in the run's"
    if len(ours) != len(theirs):
        return f"yours has {len(ours)} layers, the run's {len(theirs)}"
    return None
