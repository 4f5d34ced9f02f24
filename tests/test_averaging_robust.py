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


def test_a_member_left_out_of_an_attempt_is_no_prober_of_it():
    """A ring member left out of an attempt probed its owner and counted as one of its checks: the owner finished
    and dropped its answers before a member of the attempt had checked it, whose ring then failed (a review)."""
    import asyncio
    from types import SimpleNamespace

    from ravnest_swarm.averaging.mailbox import NOT_IN_ATTEMPT, Expected, Mailbox
    from ravnest_swarm.averaging.robust import trimmed_mean
    from ravnest_swarm.averaging.robust_ring import RobustRingAttempt
    from ravnest_swarm.averaging.segments import Ring
    from ravnest_swarm.averaging.wire import RingProbe
    from ravnest_swarm.codecs.codec import RAW

    me, b, c, e = "QmMe" + "a" * 40, "QmB" + "b" * 41, "QmC" + "c" * 41, "QmE" + "e" * 41

    async def scenario():
        ring = Ring(0, 0, 40, (me, b, c, e))
        box = Mailbox(2 ** 30, RAW)
        expected = Expected([ring], me, 5, 5)
        box.expecting = lambda: expected
        state = box.ring_state(5, 0)
        peer = SimpleNamespace(peer_id=me, part_bytes=512 * 1024, mailbox=box)
        ring_round = SimpleNamespace(peer=peer, segment=torch.zeros(40), codec=RAW, ring=ring, state=state, step=5)
        attempt = RobustRingAttempt(ring_round, [me, b, c], deadline=0.0, aggregate=trimmed_mean, checked=True)
        assert attempt.excluded_before == [e]
        state.probes[(e,)] = attempt._answer  # as run() registers it
        owned = attempt.chunks[attempt.owned]
        attempt.handled[attempt.first_gather - 1].advance(owned.stop - owned.start)  # our chunk is aggregated

        def probe(sender):
            return box.probe(RingProbe(run="r", step=5, ring=0, position=0, attempt=[e], coordinates=[owned.start]),
                             sender)

        with pytest.raises(ValueError, match=NOT_IN_ATTEMPT):
            probe(e)
        probe(b)
        return attempt.all_probed.is_set(), attempt.probed_by

    all_probed, probed_by = asyncio.run(scenario())
    assert not all_probed and probed_by == {b}  # c, a member of the attempt, is still to check us


@pytest.mark.parametrize("hostile", ["forwarder", "owner"])
def test_a_member_that_alters_a_chunk_it_passes_on_frames_no_honest_owner(hostile):
    """trimmed_mean, four members on real P2P: member 1 adds 50 to the chunk it passes on in the gather (member 0's).
    Members 2 and 3 blamed member 0, which had aggregated honestly, and averaged without it (a review). The probe's
    reply now carries the owner's aggregate: it matches its rows, so the chunk was altered on its way, and they keep
    their own values for it; nobody is refused. Where member 0 itself sends its chunk altered and reports the true
    aggregate, member 1, which had the chunk from it, refuses it; 2 and 3 cannot tell, and keep their own values."""
    import asyncio
    import dataclasses
    import functools

    from hivemind.p2p import PeerID

    from ravnest_swarm.averaging.averager import MultiRingAverager
    from ravnest_swarm.averaging.robust_ring import RobustRingAttempt
    from ravnest_swarm.averaging.segments import Ring, chunk_bounds
    from ravnest_swarm.averaging.wire import serialize_part
    from ravnest_swarm.net.node import maddrs_without_peer_id, start_node, stop_node

    size = 4000

    class PassesOnAltered(RobustRingAttempt):
        def _take(self, index, elements, received, as_sent):
            step = self.steps[index]
            if step.phase == "gather" and step.position == 0 and not self.excluded_before and \
                    index + 1 < len(self.steps):
                self.work[elements].copy_(received)  # the true values for itself, altered ones for the next member
                self.outboxes[index + 1].put(serialize_part(received + 50.0, self.codec))
                return
            super()._take(index, elements, received, as_sent)

    class SendsAltered(RobustRingAttempt):
        async def _aggregate_owned(self):  # as the ring's, but what goes to the gather is altered
            owned, mark = self.chunks[self.owned], self.handled[self.first_gather - 1]
            length = owned.stop - owned.start
            for progress in self.arrived:
                await progress.reach(length)
            values = self.work[owned.start:owned.stop]
            values.copy_(self.aggregate(torch.cat([self.segment[owned.start:owned.stop].unsqueeze(0),
                                                   self.received[:, :length]])))
            self.outboxes[self.first_gather].put(serialize_part(values + 50.0, self.codec))
            self.outboxes[self.first_gather].close()
            mark.advance(length, done=True)

    async def scenario():
        nodes = [await start_node((), host_maddrs=["/ip4/127.0.0.1/tcp/0"]) for _ in range(4)]
        averagers = [MultiRingAverager(node.routes, "forwarder", timeout=20.0, aggregation=TRIMMED_MEAN)
                     for node in nodes]
        try:
            for averager in averagers:
                await averager.start()
            ids = [node.peer_id.to_base58() for node in nodes]
            for i, node in enumerate(nodes):
                for j in range(i + 1, 4):
                    peer = PeerID.from_base58(ids[j])
                    maddrs = [str(m) for m in await nodes[j].p2p.get_visible_maddrs()]
                    await node.routes.connect(peer, maddrs_without_peer_id(maddrs, peer), "direct")
            altering, attempt = (1, PassesOnAltered) if hostile == "forwarder" else (0, SendsAltered)
            averagers[altering].ring_peer = dataclasses.replace(averagers[altering].ring_peer, attempt=functools.partial(
                attempt, aggregate=ROBUST_AGGREGATES[TRIMMED_MEAN], checked=True))
            ring = Ring(0, 0, size, tuple(ids))
            for averager in averagers:
                averager.expect([ring], 5)
            generator = torch.Generator().manual_seed(0)
            values = [torch.full((size,), float(k)) + 0.01 * torch.randn(size, generator=generator) for k in range(4)]
            originals = [v.clone() for v in values]
            results = await asyncio.gather(*(a.average(5, v, 0, [ring]) for a, v in zip(averagers, values)))
            return ids, originals, values, results
        finally:
            for averager in averagers:
                await averager.shutdown()
            for node in nodes:
                await stop_node(node)

    ids, originals, values, results = asyncio.run(scenario())
    refused = [(member, rejected["peer"], rejected["reason"]) for member, result in enumerate(results)
               for rejected in result.rejected]
    if hostile == "forwarder":
        assert refused == [] and values[0][slice(*chunk_bounds(size, 4)[1])].max().item() < 3.1, refused
    else:
        assert refused == [(1, ids[0], "sent chunk 1 other than the aggregate it reports")], refused
    passed_on = slice(*chunk_bounds(size, 4)[1])  # member 0's chunk, passed on by member 1 to 2, then to 3
    for member in (2, 3):
        assert torch.equal(values[member][passed_on], originals[member][passed_on])  # their own, not + 50
