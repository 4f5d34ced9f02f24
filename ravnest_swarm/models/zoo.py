"""A small model zoo built from code (no downloads): each model is a flat sequence of layers.

A plan assigns a stage the layer range ``[a, b)``; :meth:`ModelSpec.build_stage` builds only those
layers, each from its own seed, so a stage's weights equal the same layers of the whole model while a
peer never allocates layers it does not own. Per-layer parameter bytes come from building the layer
on the ``meta`` device (no memory), FLOPs per sample from the layer's shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ravnest_swarm.models.data import Dataset, digits_dataset, stdlib_text_dataset


@dataclass(frozen=True)
class LayerSpec:
    """One layer of a flat model.

    :param name: a label (``block2``)
    :param build: makes the layer's module (called under a per-layer seed)
    :param input_shape: the shape of one sample's input to this layer
    :param input_dtype: its dtype (``torch.long`` for token ids)
    :param flops_per_sample: forward FLOPs for one sample (a multiply-add counts two)
    """

    name: str
    build: Callable[[], nn.Module]
    input_shape: Tuple[int, ...]
    input_dtype: torch.dtype
    flops_per_sample: int

    @property
    def param_bytes(self) -> int:
        with torch.device("meta"):
            module = self.build()
        return sum(p.numel() * p.element_size() for p in module.parameters())

    @property
    def activation_bytes(self) -> int:
        """Bytes a forward keeps for its backward, per sample: what a stage holds for each microbatch in flight.

        Counted on the ``meta`` device (no memory) as half the saved tensors of a batch of four less those of a batch
        of two, so the weights the backward also keeps cancel out (batch norm in training mode refuses a batch of
        one)."""
        def saved(batch: int) -> int:
            total = 0

            def count(tensor: torch.Tensor) -> torch.Tensor:
                nonlocal total
                total += tensor.numel() * tensor.element_size()
                return tensor

            with torch.device("meta"), torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor):
                self.build()(torch.zeros((batch, *self.input_shape), dtype=self.input_dtype))
            return total

        return (saved(4) - saved(2)) // 2

    @property
    def param_count(self) -> int:
        with torch.device("meta"):
            module = self.build()
        return sum(p.numel() for p in module.parameters())


IGNORED_TARGET = -100  # cross-entropy's ignore_index: a target that counts for no loss and no accuracy
YARDSTICK_GFLOP = 200.0  # about ten seconds of a home PC's forward compute
YARDSTICK_MIN_SAMPLES = 8


@dataclass(frozen=True)
class ModelSpec:
    """A model of the zoo: its layers, its data and its loss.

    :param name: zoo name (``mlp-digits``)
    :param layers: the flat sequence of layers
    :param dataset: makes the data set (samples addressed by id)
    :param loss: ``loss(outputs, targets)``, a mean over the microbatch
    :param seed: base seed; layer ``i`` is built under ``seed * 1000 + i``
    :param heldout: makes the held-out data set (never trained on) that :meth:`evaluate` uses
    :param vocab: for a model of token ids, how many ids its embedding takes (user data is checked against it)

    A model without data of its own (``dataset`` None) trains on what ``--data`` gives (``models/user_data.py``).
    """

    name: str
    layers: Tuple[LayerSpec, ...]
    dataset: Optional[Callable[[], Dataset]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    seed: int = 0
    heldout: Optional[Callable[[], Dataset]] = None
    vocab: Optional[int] = None

    def build_layer(self, index: int) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed * 1000 + index)
            return self.layers[index].build()

    def build_stage(self, start: int, end: int) -> nn.Sequential:
        """Only the layers ``[start, end)``, with the same weights they have in the whole model."""
        check_layer_range(self, start, end)
        return nn.Sequential(*(self.build_layer(index) for index in range(start, end)))

    def build_full(self) -> nn.Sequential:
        return self.build_stage(0, len(self.layers))

    def run_layers(self, inputs: torch.Tensor, states: Optional[Dict[int, Dict[str, torch.Tensor]]] = None
                   ) -> torch.Tensor:
        """The whole model's outputs with one layer in memory at a time: a model bigger than this machine's
        memory is still evaluated. ``states``: trained weights by layer index (else the seeded start)."""
        x = inputs
        with torch.no_grad():
            for index in range(len(self.layers)):
                layer = self.build_layer(index)
                if states is not None:
                    layer.load_state_dict(states[index])
                x = layer.eval()(x)  # as a user runs the model: no dropout, batch norm's running statistics
        return x

    def yardstick(self, split: str = "train") -> Tuple[torch.Tensor, torch.Tensor]:
        """The first samples of a split that fit in :data:`YARDSTICK_GFLOP` of forward compute (at least
        :data:`YARDSTICK_MIN_SAMPLES`): all of a small model's held-out set, a sample of a big model's."""
        data = self.dataset() if split == "train" else self.heldout()
        gflop = sum(layer.flops_per_sample for layer in self.layers) / 1e9
        count = min(data.size, 2048, max(YARDSTICK_MIN_SAMPLES, int(YARDSTICK_GFLOP / max(gflop, 1e-9))))
        return data.get(range(count))

    def evaluate(self, model: nn.Module, batch: int = 256) -> float:
        """Accuracy (argmax against the targets, per sample or per token) on the held-out split."""
        data = self.heldout()
        correct = total = 0
        training = model.training
        model.eval()
        try:
            with torch.no_grad():
                for begin in range(0, data.size, batch):
                    inputs, targets = data.get(range(begin, min(begin + batch, data.size)))
                    right, counted = accuracy_counts(model(inputs), targets)
                    correct, total = correct + right, total + counted
        finally:
            model.train(training)
        return correct / total if total else float("nan")


def class_dim(outputs: torch.Tensor, targets: torch.Tensor) -> int:
    """The dimension of ``outputs`` that holds the class scores of class-label ``targets``: the last (``(N, C)``, a
    language model's ``(N, L, V)``), or the second, as torch's cross-entropy takes a sequence's (``(N, C, L)`` for
    targets ``(N, L)``) where only that fits the targets' shape."""
    shape = tuple(targets.shape)
    if outputs.dim() > 2 and tuple(outputs.shape[:-1]) != shape and \
            (outputs.shape[0], *outputs.shape[2:]) == shape:
        return 1
    return -1


def accuracy_counts(outputs: torch.Tensor, targets: torch.Tensor) -> Tuple[int, int]:
    """The targets that the argmax of ``outputs`` (over their class dimension, :func:`class_dim`) gets right, and the
    targets that count: all but :data:`IGNORED_TARGET` (a user's padding; counted as misses, an accuracy of 89 %
    read 44.5 %)."""
    counted = targets != IGNORED_TARGET
    return int(((outputs.argmax(dim=class_dim(outputs, targets)) == targets) & counted).sum()), int(counted.sum())


def check_layer_range(spec: ModelSpec, start: int, end: int) -> None:
    if not 0 <= start < end <= len(spec.layers):
        raise ValueError(f"layer range {start}:{end} is not inside 0:{len(spec.layers)} of {spec.name}")


def balanced_split(spec: ModelSpec, stages: int) -> List[Tuple[int, int]]:
    """Contiguous layer ranges for ``stages`` stages minimising the largest stage's FLOPs."""
    flops = [layer.flops_per_sample for layer in spec.layers]
    count = len(flops)
    if not 1 <= stages <= count:
        raise ValueError(f"{spec.name} has {count} layers: it splits into 1-{count} stages")
    prefix = [0]
    for value in flops:
        prefix.append(prefix[-1] + value)
    # best[k][i]: the smallest possible maximum when the first i layers form k stages
    best = [[math.inf] * (count + 1) for _ in range(stages + 1)]
    cut = [[0] * (count + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, count + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    ranges, end = [], count
    for k in range(stages, 0, -1):
        start = cut[k][end]
        ranges.append((start, end))
        end = start
    return ranges[::-1]


class Dense(nn.Module):
    """``Linear`` followed by ReLU (left out on the classifier layer).

    :param inputs: input features
    :param outputs: output features
    :param relu: apply ReLU after the linear map
    """

    def __init__(self, inputs: int, outputs: int, relu: bool = True):
        super().__init__()
        self.linear = nn.Linear(inputs, outputs)
        # He initialisation: torch's default shrinks the signal layer by layer, and the MLP then idles on a
        # loss plateau for hundreds of steps; with it, a few hundred microbatches train the digits
        nn.init.kaiming_normal_(self.linear.weight, nonlinearity="relu")
        nn.init.zeros_(self.linear.bias)
        self.relu = relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        return F.relu(x) if self.relu else x


class ResidualDense(nn.Module):
    """``x + Dense(x)``: a residual layer of one width.

    :param width: input and output features
    :param scale: factor on the He-initialised weights; 1/sqrt(number of residual layers) keeps the
        sum of the branches from growing the signal layer by layer
    """

    def __init__(self, width: int, scale: float):
        super().__init__()
        self.dense = Dense(width, width)
        with torch.no_grad():
            self.dense.linear.weight.mul_(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dense(x)


def mlp_digits(width: int = 64, residual: int = 7) -> ModelSpec:
    """An MLP on scikit-learn's bundled 8x8 digits: 64 -> width, ``residual`` residual layers, width -> 10.

    With width 64 every layer but the small classifier holds the same bytes, so whole layers split the
    model evenly into 2, 3 or 4 stages (within 10 % of an even split); residual connections keep a model
    this deep as easy to train in one process as a shallow one. Being deep, it suffers more from pipeline
    staleness, which is why the run spec keeps 2 microbatches in flight (``swarm/spec.py``).
    """
    def layer(name: str, build: Callable[[], nn.Module], inputs: int, outputs: int) -> LayerSpec:
        return LayerSpec(name, build, (inputs,), torch.float32, 2 * inputs * outputs)

    layers = [layer("dense0", lambda: Dense(64, width), 64, width)]
    layers += [layer(f"residual{i}", lambda: ResidualDense(width, residual ** -0.5), width, width)
               for i in range(1, residual + 1)]
    layers.append(layer("classifier", lambda: Dense(width, 10, relu=False), width, 10))
    return ModelSpec("mlp-digits", tuple(layers), digits_dataset, F.cross_entropy,
                     heldout=lambda: digits_dataset("heldout"))


class TokenEmbedding(nn.Module):
    """Token plus learned position embedding.

    :param vocab: vocabulary size (256: bytes)
    :param context: tokens per sample
    :param width: model width
    """

    def __init__(self, vocab: int, context: int, width: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))


class DecoderBlock(nn.Module):
    """A pre-norm nanoGPT block: causal self-attention, then a 4x MLP, each with a residual.

    :param width: model width
    :param heads: attention heads
    """

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, tokens, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, tokens, width))
        return x + self.mlp(self.norm2(x))


class LanguageHead(nn.Module):
    """Final LayerNorm and the projection to vocabulary logits.

    :param width: model width
    :param vocab: vocabulary size
    """

    def __init__(self, width: int, vocab: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def gpt(layers: int = 4, width: int = 64, heads: int = 4, context: int = 64, vocab: int = 256,
        name: str = "gpt") -> ModelSpec:
    """A byte-level nanoGPT-style decoder trained on the Python standard library's own source text.

    Its layers are the embedding, ``layers`` decoder blocks and the head, each a layer the planner places
    like any other, so a model too big for any one peer spreads over several.
    """
    for key, value in dict(layers=layers, width=width, heads=heads, context=context, vocab=vocab).items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: {key} must be a positive whole number, not {value!r}")
    if width % heads:
        raise ValueError(f"{name}: width {width} must be a multiple of heads {heads}")
    block_flops = context * (24 * width * width + 4 * context * width)
    specs = [LayerSpec("embed", lambda: TokenEmbedding(vocab, context, width), (context,), torch.long,
                       context * width)]
    specs += [
        LayerSpec(f"block{i}", lambda: DecoderBlock(width, heads), (context, width), torch.float32, block_flops)
        for i in range(layers)
    ]
    specs.append(LayerSpec("head", lambda: LanguageHead(width, vocab), (context, width), torch.float32,
                           context * 2 * width * vocab))
    return ModelSpec(name, tuple(specs), lambda: stdlib_text_dataset(context), _lm_loss,
                     heldout=lambda: stdlib_text_dataset(context, "heldout"), vocab=vocab)


# named sizes of the gpt family. Training state (parameters and gradients in float32, 8 bytes a parameter,
# before a stage's weights in flight): gpt-tiny 1.7 MB, gpt-85m 0.68 GB, gpt-350m 2.4 GB, more than most
# home PCs can spare, and gpt-85m's passes 1 GB with the pipeline's copy of the weights in flight
PRESETS: Dict[str, Dict[str, int]] = {
    "gpt-tiny": dict(layers=4, width=64, heads=4, context=64),
    "gpt-85m": dict(layers=12, width=768, heads=12, context=256),
    "gpt-350m": dict(layers=24, width=1024, heads=16, context=512),
}
# model families by name; each takes keyword settings (``--model-config``)
FAMILIES: Dict[str, Callable[..., ModelSpec]] = {"mlp-digits": mlp_digits, "gpt": gpt}
MODELS: Tuple[str, ...] = tuple(FAMILIES) + tuple(PRESETS)


def parse_layers(text: str, spec: ModelSpec) -> Tuple[int, int]:
    """``"a:b"`` -> ``(a, b)``, checked against the model's layer count."""
    try:
        start, end = (int(part) for part in text.split(":"))
    except ValueError:
        raise ValueError(f"--layers must look like 0:2, got {text!r}")
    check_layer_range(spec, start, end)
    return start, end


def layer_table(spec: ModelSpec) -> List[Dict]:
    return [dict(index=i, name=layer.name, param_bytes=layer.param_bytes, flops_per_sample=layer.flops_per_sample)
            for i, layer in enumerate(spec.layers)]

