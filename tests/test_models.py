"""The model zoo: stages built by layer range equal the whole model's layers; sharding by sample id."""

import pytest
import torch

from ravnest_swarm.models import MODELS, PRESETS, ShardedSampler, balanced_split, get_model, parse_layers

# built whole here; the big presets are checked on the meta device below
SMALL_MODELS = ["mlp-digits", "gpt", "gpt-tiny"]


@pytest.mark.parametrize("name", SMALL_MODELS)
def test_stage_layers_equal_the_whole_models_layers(name):
    spec = get_model(name)
    full = spec.build_full()
    count = len(spec.layers)
    stage = spec.build_stage(1, count - 1)
    # the stage holds only the layers it owns, with the same weights they have in the whole model
    assert len(stage) == count - 2
    assert sum(p.numel() * p.element_size() for p in stage.parameters()) == sum(
        spec.layers[i].param_bytes for i in range(1, count - 1))
    for offset, layer in enumerate(stage):
        for (name_a, a), (name_b, b) in zip(layer.named_parameters(), full[offset + 1].named_parameters()):
            assert name_a == name_b and torch.equal(a, b)


@pytest.mark.parametrize("name", SMALL_MODELS)
def test_stages_chain_to_the_whole_model_and_the_loss_is_finite(name):
    spec = get_model(name)
    dataset = spec.dataset()
    inputs, targets = dataset.get([0, 5, 9])
    layer0 = spec.layers[0]
    assert tuple(inputs.shape[1:]) == layer0.input_shape and inputs.dtype == layer0.input_dtype
    ranges = balanced_split(spec, 2)
    x = inputs
    for start, end in ranges:
        x = spec.build_stage(start, end)(x)
    assert torch.allclose(x, spec.build_full()(inputs), atol=1e-6)
    loss = spec.loss(x, targets)
    assert torch.isfinite(loss) and loss.item() > 0
    assert all(layer.flops_per_sample > 0 for layer in spec.layers)


def test_balanced_split_is_contiguous_and_covers_every_layer():
    spec = get_model("gpt-tiny")
    ranges = balanced_split(spec, 4)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(spec.layers)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    flops = [sum(spec.layers[i].flops_per_sample for i in range(a, b)) for a, b in ranges]
    assert max(flops) <= 1.3 * min(flops)


def test_parse_layers_rejects_ranges_outside_the_model():
    spec = get_model("mlp-digits")
    assert parse_layers("1:3", spec) == (1, 3)
    for bad in ("3:1", "0:99", "x", "1"):
        with pytest.raises(ValueError):
            parse_layers(bad, spec)


def test_clusters_draw_disjoint_streams_by_sample_id():
    size = 100
    streams = [ShardedSampler(size, cluster, 3, 4, seed=7) for cluster in range(3)]
    drawn = [sum((s.sample_ids(m) for m in range(8)), []) for s in streams]
    assert all(len(set(ids)) == len(ids) for ids in drawn)
    assert not set(drawn[0]) & set(drawn[1]) and not set(drawn[1]) & set(drawn[2])
    # the same index always names the same samples, in any process
    assert ShardedSampler(size, 1, 3, 4, seed=7).sample_ids(5) == streams[1].sample_ids(5)
