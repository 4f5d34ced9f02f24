"""Compressed pseudo-gradients with error feedback (issue 30): rings of real averagers over real P2P (p2pd) in
this process, each member's round run as a volunteer runs it (``stage_averaging.outer_round``), and the error
feedback of ``optimizers.outer`` on its own."""

import asyncio
import dataclasses
from contextlib import asynccontextmanager
from typing import List

import pytest
import torch

from ravnest_swarm.averaging.ring import PARAMETERS, PSEUDO_GRADIENTS, RingAttempt
from ravnest_swarm.averaging.robust import MEAN, ROBUST_AGGREGATES, TRIMMED_MEAN
from ravnest_swarm.averaging.segments import Ring, own_encoded_parts
from ravnest_swarm.averaging.wire import serialize_part
from ravnest_swarm.checkpoint import load_outer_state, read_stage, save_stage
from ravnest_swarm.codecs.codec import CODECS, compression_residual
from ravnest_swarm.optimizers.outer import OuterOptimizer
from ravnest_swarm.swarm.stage_averaging import outer_round
from ring_helpers import connected_averagers

SIZE = 3000  # two rings: [0, 1500) and [1500, 3000)


def test_error_feedback_sends_what_the_pseudo_gradients_add_up_to():
    """What a member sends over rounds (decoded) adds up to its pseudo-gradients, less the last round's error
    only; without the error kept, int4's rounding of the same small drift adds up round after round."""
    torch.manual_seed(0)
    codec, rounds = CODECS["int4"], 40
    drift = torch.randn(SIZE) * 0.01 + 0.003  # what training moves the parameters by each round, alike each time
    outer = OuterOptimizer("average")
    parameters = torch.randn(SIZE)
    outer.step_segments(parameters, parameters, [], torch.zeros(SIZE))  # the first round: an anchor
    start = parameters.clone()
    sent_total, dropped_without_feedback = torch.zeros(SIZE), torch.zeros(SIZE)
    for _ in range(rounds):
        local = parameters - drift
        pseudo_gradient = outer.pseudo_gradient(local)
        residual = compression_residual(pseudo_gradient, codec, [(0, 1500), (1500, SIZE)])
        sent = pseudo_gradient - residual  # what the ring's members decode of it (a ring of one: the mean)
        sent_total += sent
        dropped_without_feedback += compression_residual(drift, codec, [(0, 1500), (1500, SIZE)])
        parameters = outer.step_segments(local, sent, [(0, 1500), (1500, SIZE)], residual)
    assert torch.allclose(start - parameters, sent_total, atol=1e-5)  # the parameters moved by what was sent
    tracked = (sent_total - rounds * drift).abs().max().item()
    assert torch.allclose(sent_total + outer.error, rounds * drift, atol=1e-4)  # less the last error, exactly
    assert tracked <= residual.abs().max().item() + 1e-4  # one round's rounding at most
    assert dropped_without_feedback.abs().max().item() > 5 * tracked  # what error feedback saves


class CorruptingAttempt(RingAttempt):
    """A hostile member: its own chunk goes out as a part that does not decode (``corrupt``: bytes cut off) or
    that holds twice the chunk's values (``oversized``)."""

    def __init__(self, *args, kind: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.kind = kind

    async def _send_own_chunk(self) -> None:
        chunk = self.segment[self.chunks[self.steps[0].sends]]
        if self.kind == "oversized":
            part = serialize_part(torch.cat([chunk, chunk]), self.codec)
        else:
            part = serialize_part(chunk, self.codec)
            part.buffer = part.buffer[:-7]
            part.size[0] -= 7
        self.outboxes[0].put(part)
        self.outboxes[0].close()


@asynccontextmanager
async def ring_of(backbone: str, count: int, codec: str, aggregation: str = MEAN):
    async with connected_averagers(backbone, count, "compressed", timeout=15.0, compression=CODECS[codec],
                                   aggregation=aggregation) as (averagers, ids):
        yield averagers, [Ring(0, 0, 1500, tuple(ids)), Ring(1, 1500, SIZE, tuple(ids))]


async def one_round(averagers, outers, step: int, locals_: List[torch.Tensor], rings):
    for averager in averagers:
        averager.expect(rings, step)
    done = await asyncio.gather(*(outer_round(averager, outer, step, local.clone(), 0, rings)
                                  for averager, outer, local in zip(averagers, outers, locals_)))
    return [result for result, _ in done], [parameters for _, parameters in done]


def modes(result) -> List[str]:
    return [segment.mode for segment in result.segments]


def aggregate(values: List[torch.Tensor], aggregation: str) -> torch.Tensor:
    stacked = torch.stack(values).double()
    return stacked.mean(0) if aggregation == MEAN else ROBUST_AGGREGATES[aggregation](stacked)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("outer_name, aggregation", [("average", MEAN), ("nesterov", MEAN), ("average", TRIMMED_MEAN)])
def test_compressed_rounds_end_bit_identical_and_differing_anchors_fall_back_to_float32(backbone, outer_name,
                                                                                      aggregation):
    """Three members, two rings, int8 (the mean, or a robust aggregation on decoded values: with three members the
    trimmed mean is the median). Round 1: nobody has an outer state, so both rings average parameters in
    float32: the exact aggregate, the same on all. Round 2: every member shares the anchor, both rings average
    pseudo-gradients in int8: the members end bit for bit the same, near the float32 outer step, sending about
    a quarter of round 1's bytes. Round 3: one member's anchor differs over ring 0's segment (it missed a round):
    ring 0 averages parameters in float32 (the exact mean), ring 1 still pseudo-gradients; all end the same.
    Round 4 compresses both rings again."""
    torch.manual_seed(1)

    async def scenario():
        async with ring_of(backbone, 3, "int8", aggregation) as (averagers, rings):
            outers = [OuterOptimizer(outer_name, 0.7, 0.9) for _ in averagers]
            start = [torch.randn(SIZE) for _ in averagers]
            results, after = await one_round(averagers, outers, 10, start, rings)
            rounds = [(results, after, start)]
            for step in (20, 30, 40):
                trained = [parameters - torch.randn(SIZE) * 0.05 for parameters in after]
                if step == 30:  # member 2 missed a round: its outer state over ring 0's segment is another
                    outers[2].anchor[:1500] += 0.01
                expected = OuterOptimizer(outer_name, 0.7, 0.9, anchor=outers[0].anchor.clone(),
                                          momentum=None if outers[0].momentum is None else outers[0].momentum.clone())
                results, after = await one_round(averagers, outers, step, trained, rings)
                rounds.append((results, after, trained, expected))
                if step == 20:
                    kept_errors = [outer.error.clone() for outer in outers]
            return rounds, kept_errors, averagers

    rounds, kept_errors, averagers = asyncio.run(scenario())
    (first, after1, start), (second, after2, trained2, expected2) = rounds[0], rounds[1]
    exact = aggregate(start, aggregation)
    assert all(r.ok and modes(r) == [PARAMETERS, PARAMETERS] for r in first)
    assert all(torch.equal(after1[0], values) for values in after1)
    assert (after1[0].double() - exact).abs().max() <= 1e-5
    assert all(r.ok and modes(r) == [PSEUDO_GRADIENTS, PSEUDO_GRADIENTS] for r in second), [r.summary() for r in second]
    assert all(torch.equal(after2[0], values) for values in after2)
    float32_step = expected2.step(aggregate(trained2, aggregation).float())  # the same step on the exact aggregate
    assert 0 < (after2[0] - float32_step).abs().max() <= 0.01
    # counted from what was sent: int8 parts are 3.9x fewer bytes, but parts of 500 values here are about the
    # size of a message's metadata and notes, which int8 leaves alone (docs/benchmarks.md: a real stage's ratio)
    for first_result, second_result in zip(first, second):
        assert 0 < second_result.bytes_sent < first_result.bytes_sent / 2.5, (first_result.bytes_sent,
                                                                              second_result.bytes_sent)
    # error feedback keeps exactly what the codec dropped of the values each member sent on its own (its chunk's
    # parts, or every other member's chunk in a robust ring), and nothing of the values it sent only summed
    for member, (averager, error) in enumerate(zip(averagers, kept_errors)):
        pseudo_gradient = after1[member] - trained2[member]
        expected_error = torch.zeros(SIZE)
        for lo, hi in ((0, 1500), (1500, SIZE)):
            ids = [a.peer_id for a in averagers]
            for first, last in own_encoded_parts(hi - lo, ids, averager.peer_id, averager.part_bytes // 4,
                                                 averager.robust):
                part = pseudo_gradient[lo + first:lo + last]
                expected_error[lo + first:lo + last] = part - CODECS["int8"].decode(CODECS["int8"].encode(part), "", None)
        assert torch.equal(error, expected_error) and error.abs().sum() > 0
    third, after3, trained3, _ = rounds[2]
    assert all(r.ok and modes(r) == [PARAMETERS, PSEUDO_GRADIENTS] for r in third), [r.as_dict() for r in third]
    assert all(torch.equal(after3[0], values) for values in after3)
    exact3 = aggregate(trained3, aggregation)[:1500]
    assert (after3[0][:1500].double() - exact3).abs().max() <= 1e-5  # re-synced on the float32 mean
    fourth, after4, _, _ = rounds[3]
    assert all(r.ok and modes(r) == [PSEUDO_GRADIENTS, PSEUDO_GRADIENTS] for r in fourth)
    assert all(torch.equal(after4[0], values) for values in after4)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["corrupt", "oversized"])
def test_a_corrupt_or_oversized_compressed_part_is_refused_and_the_ring_goes_on_without_its_sender(backbone, kind):
    """Three members share an anchor and average int4 pseudo-gradients; the third sends its own chunk as a part
    that does not decode, or as one of twice the chunk's values. Each is refused from its sender and counted,
    and the two honest members average their own two pseudo-gradients, ending bit for bit the same."""
    torch.manual_seed(2)

    async def scenario():
        async with ring_of(backbone, 3, "int4") as (averagers, rings):
            hostile = averagers[2]
            hostile.ring_peer = dataclasses.replace(
                hostile.ring_peer, attempt=lambda ring_round, members, deadline: CorruptingAttempt(
                    ring_round, members, deadline, kind=kind))
            outers = [OuterOptimizer("average") for _ in averagers]
            shared = torch.randn(SIZE)
            for outer in outers:  # as after a round they all took part in
                outer.step_segments(shared.clone(), shared, [], torch.zeros(SIZE))
            trained = [shared - torch.randn(SIZE) * 0.05 for _ in averagers]
            results, after = await one_round(averagers, outers, 5, trained, [rings[0]])
            return results, after, trained, [averager.rejected for averager in averagers]

    results, after, trained, handler_refusals = asyncio.run(scenario())
    culprit_rejections = [entry for result in results[:2] for entry in result.rejected]
    if kind == "corrupt":
        # refused as it was read, and counted as hostile input. Its sender's own send fails on that refusal, so an
        # honest-coded sender ends the ring for itself: whether its receiver's ring also voted against it depends
        # on which came first, the sender's note or the receiver's attempt reading the part
        assert sum(handler_refusals[:2]) >= 1
    else:
        assert culprit_rejections, [r.as_dict() for r in results]
    for result in results[:2]:
        [segment] = result.segments
        assert (segment.status, segment.members, segment.mode) == ("ok", 2, PSEUDO_GRADIENTS), result.as_dict()
    assert torch.equal(after[0][:1500], after[1][:1500])  # the rest of the vector is in no ring here
    honest_mean = (trained[0][:1500] + trained[1][:1500]) / 2
    assert (after[0][:1500] - honest_mean).abs().max() <= 0.05  # int4 of pseudo-gradients of about 0.15
    assert results[2].segments[0].status != "ok"


@pytest.mark.timeout(180)
def test_a_member_resumed_from_its_checkpoint_compresses_again_from_its_first_round(backbone, tmp_path):
    """Three members average int8 pseudo-gradients with nesterov; after round 20 the third one's stage is stopped
    and its checkpoint (``save_stage`` with its outer state) read back into a new outer optimizer, as ``--resume``
    does. Its digests match the others' at once: round 30 averages pseudo-gradients on both rings (no float32
    re-sync) and every member ends it with the same parameters, bit for bit. Without the checkpoint's outer state
    the same member makes both rings fall back to float32 parameters."""
    torch.manual_seed(4)
    path = str(tmp_path / "member2.safetensors")

    async def scenario(resumed_with_state: bool):
        async with ring_of(backbone, 3, "int8") as (averagers, rings):
            outers = [OuterOptimizer("nesterov", 0.7, 0.9) for _ in averagers]
            parameters = [torch.randn(SIZE) for _ in averagers]
            for step in (10, 20):
                trained = [values - torch.randn(SIZE) * 0.05 for values in parameters]
                _, parameters = await one_round(averagers, outers, step, trained, rings)
            stage = torch.nn.Linear(SIZE, 1, bias=False)  # the stopped member's layers: one value per parameter
            with torch.no_grad():
                stage.weight.copy_(parameters[2].view(1, SIZE))
            save_stage(path, stage, torch.optim.SGD(stage.parameters(), lr=0.1), {"step": 20, "layers": [0, 1]},
                       outer=outers[2].state_tensors())
            outers[2] = OuterOptimizer("nesterov", 0.7, 0.9)
            if resumed_with_state:
                assert outers[2].restore(load_outer_state(path, SIZE))
            parameters[2] = read_stage(path)[0]["param.weight"].view(SIZE).clone()
            trained = [values - torch.randn(SIZE) * 0.05 for values in parameters]
            results, after = await one_round(averagers, outers, 30, trained, rings)
            return results, after

    results, after = asyncio.run(scenario(True))
    assert all(r.ok and modes(r) == [PSEUDO_GRADIENTS, PSEUDO_GRADIENTS] for r in results), \
        [r.summary() for r in results]
    assert all(torch.equal(after[0], values) for values in after)
    results, after = asyncio.run(scenario(False))
    assert all(r.ok and modes(r) == [PARAMETERS, PARAMETERS] for r in results), [r.summary() for r in results]
    assert all(torch.equal(after[0], values) for values in after)


def test_the_bench_ring_mean_is_the_rings_arithmetic_and_counts_its_encoded_messages():
    """``bench diloco``'s in-process ring (``bench.diloco.ring_mean``): in float32 the exact mean, in int8 the
    members' mean within the codec's steps; its bytes are the messages' (metadata and parts as encoded), about
    2 (K - 1) / K of the vector per member in float32, and 3.9x fewer in int8 once parts dwarf their metadata."""
    from ravnest_swarm.bench.diloco import ring_mean

    torch.manual_seed(3)
    values = [torch.randn(40_000) * 0.01 for _ in range(4)]
    exact = torch.stack(values).double().mean(0)
    mean, float32_bytes = ring_mean(values, CODECS["none"])
    assert (mean.double() - exact).abs().max() <= 1e-7
    assert 2 * 3 / 4 * 40_000 * 4 < float32_bytes < 2 * 3 / 4 * 40_000 * 4 * 1.02
    mean, int8_bytes = ring_mean(values, CODECS["int8"])
    assert (mean.double() - exact).abs().max() <= 0.01 * 4 * 3 / 127
    assert 3.7 < float32_bytes / int8_bytes < 4.0


@pytest.mark.parametrize("outer_name", ["average", "nesterov"])
def test_a_ring_ends_the_same_on_a_member_whose_other_ring_failed(outer_name):
    """Two members share ring 0 (pseudo-gradients, completed); ring 1 failed for member A only. A once stepped ring 0
    as a plain average (the anchor less the mean) while B took the nesterov step: one round on different values.
    Stub averagers hand both the same mean of ring 0."""
    from ravnest_swarm.averaging.averager import RoundResult
    from ravnest_swarm.averaging.ring import SegmentResult

    torch.manual_seed(3)
    rings = [Ring(0, 0, 600, ("a", "b")), Ring(1, 600, 1000, ("a", "b"))]
    anchor, momentum = torch.randn(1000), torch.randn(1000)
    mean = torch.randn(1000) * 0.01  # what ring 0 (and, for B, ring 1) averaged

    class StubAverager:
        compression, part_bytes, robust = CODECS["int8"], 4096, False

        def __init__(self, peer_id, ring1_ok):
            self.peer_id, self.ring1_ok = peer_id, ring1_ok

        async def average(self, step, local, local_start, rings, patience, pseudo_gradient, anchors):
            pseudo_gradient.copy_(mean)
            statuses = ["ok", "ok" if self.ring1_ok else "timeout"]
            return RoundResult(step, 0.1, [SegmentResult(r.index, r.start, r.end, status, 2, mode=PSEUDO_GRADIENTS)
                                           for r, status in zip(rings, statuses)])

    ended = []
    for peer_id, ring1_ok in (("a", False), ("b", True)):
        outer = OuterOptimizer(outer_name, 0.7, 0.9, anchor=anchor.clone(),
                               momentum=None if outer_name == "average" else momentum.clone())
        local = anchor - torch.randn(1000) * 0.05
        _, parameters = asyncio.run(outer_round(StubAverager(peer_id, ring1_ok), outer, 50, local, 0, rings))
        ended.append(parameters)
    assert torch.equal(ended[0][:600], ended[1][:600])
