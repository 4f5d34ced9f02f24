"""The robust aggregates of ``averaging/robust.py``: exact values on small cases, and what one hostile
contribution of four, scaled to just under the ring's scale check, can do to each. No network."""

import pytest
import torch

from ravnest_swarm.averaging.robust import (AGGREGATIONS, CENTERED_CLIP, ROBUST_AGGREGATES, TRIMMED_MEAN,
                                            centered_clip, trimmed_count, trimmed_mean)

MAX_SCALE = 100.0  # MultiRingAverager's default: a single contribution up to 100 x max(our scale, 1) passes


def rows(*values):
    return torch.tensor(values, dtype=torch.float32)


def plausibly_scaled(values: torch.Tensor) -> torch.Tensor:
    """The most a contribution can be scaled and still pass every receiver's check: largest magnitude 99."""
    return values * (0.99 * MAX_SCALE / values.abs().max())


def test_trimmed_count_drops_a_quarter_from_each_end_and_nothing_from_two():
    assert [trimmed_count(n) for n in (1, 2, 3, 4, 5, 7, 8, 12, 16)] == [0, 0, 1, 1, 1, 1, 2, 3, 4]


def test_trimmed_mean_is_exact_per_coordinate():
    contributions = rows([1, 5, 3], [2, -4, 3], [100, 0, 3], [4, 1, -50])
    # sorted per column: 1 2 4 100 | -4 0 1 5 | -50 3 3 3; the middle two of each
    assert torch.equal(trimmed_mean(contributions), rows(3, 0.5, 3))


def test_trimmed_mean_of_two_is_the_mean_and_of_three_the_median():
    assert torch.equal(trimmed_mean(rows([1, 8], [3, 2])), rows(2, 5))
    assert torch.equal(trimmed_mean(rows([1, 8], [30, 2], [3, -7])), rows(3, 2))


def test_centered_clip_clips_a_far_row_to_the_honest_rows_distance():
    # start: the trimmed mean 1.5; distances 1.5, 0.5, 0.5, 28.5, tau their lower median 0.5: the far row and the
    # nearest rows pull by 0.5 each, -0.5 - 0.5 + 0.5 + 0.5 = 0, so 1.5 is the fixed point at once
    assert torch.equal(centered_clip(rows([0], [1], [2], [30])), rows(1.5))
    assert torch.equal(centered_clip(rows([0], [1], [2], [30_000])), rows(1.5))


def test_centered_clip_of_rows_on_one_point_is_that_point_whatever_a_far_row_says():
    assert torch.equal(centered_clip(rows([0, 2], [0, 2], [0, 2], [10, -90])), rows(0, 2))


def test_centered_clip_of_two_rows_is_their_mean():
    assert torch.allclose(centered_clip(rows([1, 8, -3], [3, 2, 5])), rows(2, 5, 1), atol=1e-6)


def test_centered_clip_reaches_its_fixed_point():
    generator = torch.Generator().manual_seed(3)
    contributions = torch.randn(5, 1000, generator=generator)
    contributions[4] = plausibly_scaled(contributions[4])
    result = centered_clip(contributions)
    start = trimmed_mean(contributions)
    tau = torch.linalg.vector_norm(contributions - start, dim=1).sort().values[2]
    offsets = contributions - result
    norms = torch.linalg.vector_norm(offsets, dim=1)
    move = (offsets * torch.clamp(tau / norms, max=1.0)[:, None]).mean(0)
    assert torch.linalg.vector_norm(move) <= 1e-5 * tau


@pytest.mark.parametrize("aggregation", [TRIMMED_MEAN, CENTERED_CLIP])
def test_equal_rows_aggregate_to_themselves(aggregation):
    values = torch.randn(300, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(ROBUST_AGGREGATES[aggregation](values.repeat(4, 1)), values, atol=1e-6)


@pytest.mark.parametrize("aggregation", [TRIMMED_MEAN, CENTERED_CLIP])
def test_one_plausibly_scaled_row_of_four_moves_the_result_less_than_the_honest_rows_differ(aggregation):
    """The attack the scale check lets through: one member's values scaled to a largest magnitude of 99. The
    mean moves by about 99/4 at the largest coordinate; a robust aggregate stays within the honest rows' spread
    around the mean of all four unscaled rows (what the round would give without the attack)."""
    generator = torch.Generator().manual_seed(0)
    honest = torch.randn(4, 4096, generator=generator)
    expected = honest.mean(0)
    attacked = honest.clone()
    attacked[3] = plausibly_scaled(honest[3])
    spread = (honest - expected).abs().max()
    mean_deviation = (attacked.mean(0) - expected).abs().max()
    deviation = (ROBUST_AGGREGATES[aggregation](attacked) - expected).abs().max()
    assert mean_deviation > 20
    assert deviation < spread < 5
    if aggregation == TRIMMED_MEAN:  # per coordinate, inside the honest rows' range
        assert (trimmed_mean(attacked) >= honest[:3].min(0).values).all()
        assert (trimmed_mean(attacked) <= honest[:3].max(0).values).all()


def test_the_choices_are_the_run_specs():
    assert AGGREGATIONS == ("mean", TRIMMED_MEAN, CENTERED_CLIP)
    assert set(ROBUST_AGGREGATES) == set(AGGREGATIONS) - {"mean"}


def test_the_run_spec_carries_the_aggregation_signed_and_refuses_another():
    """A run started with a robust aggregation publishes it in the owner-signed spec every joiner reads (and
    builds its averager from: ``swarm/volunteer.py``); changing it breaks the signature; a record naming an
    aggregation this version lacks is refused by the schema."""
    import pydantic.v1 as pydantic
    from hivemind.utils.crypto import RSAPrivateKey

    from ravnest_swarm.membership.owner import spec_owner
    from ravnest_swarm.membership.records import RunSpecRecord
    from ravnest_swarm.swarm.spec import RunSpec

    record = RunSpec("mlp-digits", aggregation=CENTERED_CLIP).record(RSAPrivateKey(), "demo")
    assert RunSpec.from_record(RunSpecRecord.parse_obj(record).dict()).aggregation == CENTERED_CLIP
    assert spec_owner(record) is not None and spec_owner(dict(record, aggregation="mean")) is None
    assert RunSpec.from_record(RunSpec("mlp-digits").record(RSAPrivateKey(), "demo")).aggregation == "mean"
    for aggregation in AGGREGATIONS:
        RunSpecRecord.parse_obj(dict(record, aggregation=aggregation))
    with pytest.raises(pydantic.ValidationError, match="aggregation"):
        RunSpecRecord.parse_obj(dict(record, aggregation="median"))
