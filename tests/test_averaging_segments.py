"""Segment/ring construction: pure functions, checked against a brute-force owner lookup."""

import pytest
import torch

from ravnest_swarm.averaging.segments import (
    build_rings, chunk_bounds, element_range, flatten, layer_offsets, plan_rings, ring_bytes_per_peer, rings_of,
    unflatten_into,
)


def owner_at(cluster, index):
    return next(owner for owner, lo, hi in cluster if lo <= index < hi)


def test_worked_example_from_docs():
    # 6 layers; cluster A splits after layer 2, cluster B after layers 1 and 4 (see docs/averaging.md)
    sizes = [100, 200, 300, 100, 200, 100]
    assert layer_offsets(sizes) == [0, 100, 300, 600, 700, 900, 1000]
    a = [("a0", *element_range(sizes, (0, 2))), ("a1", *element_range(sizes, (2, 6)))]
    b = [("b0", *element_range(sizes, (0, 1))), ("b1", *element_range(sizes, (1, 4))), ("b2", *element_range(sizes, (4, 6)))]
    rings = build_rings([a, b], 1000)
    assert [(r.start, r.end, r.members) for r in rings] == [
        (0, 100, ("a0", "b0")), (100, 300, ("a0", "b1")), (300, 700, ("a1", "b1")), (700, 1000, ("a1", "b2")),
    ]
    assert [r.index for r in rings_of("b1", rings)] == [1, 2]
    assert ring_bytes_per_peer(rings) == {"a0": 1200, "b0": 400, "b1": 2400, "a1": 2800, "b2": 1200}


@pytest.mark.parametrize("clusters_cuts", [
    [[0, 5], [0, 3, 9], [0, 1, 2, 7]],
    [[0], [0]],
    [[0, 4, 8], [0, 4, 8], [0, 2, 6], [0, 9]],
])
def test_every_element_in_exactly_one_ring_with_its_owner_in_every_cluster(clusters_cuts):
    total = 10
    clusters = []
    for k, cuts in enumerate(clusters_cuts):
        bounds = cuts + [total]
        clusters.append([(f"c{k}s{s}", lo, hi) for s, (lo, hi) in enumerate(zip(bounds, bounds[1:]))])
    rings = build_rings(clusters, total)
    covered = [i for ring in rings for i in range(ring.start, ring.end)]
    assert covered == list(range(total))
    for ring in rings:
        for index in range(ring.start, ring.end):
            assert ring.members == tuple(sorted(owner_at(cluster, index) for cluster in clusters))
    expected_cuts = sorted({c for cuts in clusters_cuts for c in cuts})
    assert [ring.start for ring in rings] == expected_cuts


def test_rejects_gaps_overlaps_and_shared_owners():
    with pytest.raises(ValueError, match="tile"):
        build_rings([[("a", 0, 4), ("b", 5, 10)]], 10)
    with pytest.raises(ValueError, match="end at"):
        build_rings([[("a", 0, 4), ("b", 4, 9)]], 10)
    with pytest.raises(ValueError, match="only one range"):
        build_rings([[("a", 0, 10)], [("a", 0, 10)]], 10)
    with pytest.raises(ValueError):
        element_range([3, 4], (1, 3))


def test_a_layer_without_parameters_takes_no_room_and_a_stage_of_only_such_layers_is_in_no_ring():
    """A user model's ``Flatten`` between a conv and a linear layer has no parameters: every averaging hook raised on
    it ("layer sizes must be positive") and the stages stood still. It now takes no room in the vector; a stage that
    holds only such layers owns an empty range, and no ring has it as a member."""
    sizes = [80, 0, 650]
    assert layer_offsets(sizes) == [0, 80, 80, 730]
    a = [("a0", *element_range(sizes, (0, 2))), ("a1", *element_range(sizes, (2, 3)))]
    b = [("b0", *element_range(sizes, (0, 1))), ("b1", *element_range(sizes, (1, 2))), ("b2", *element_range(sizes, (2, 3)))]
    rings = build_rings([a, b], 730)
    assert [(r.start, r.end, r.members) for r in rings] == [(0, 80, ("a0", "b0")), (80, 730, ("a1", "b2"))]
    assert rings_of("b1", rings) == []
    with pytest.raises(ValueError, match="negative"):
        layer_offsets([3, -1])


def test_chunks_cover_the_segment_evenly():
    assert chunk_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert chunk_bounds(2, 3) == [(0, 1), (1, 2), (2, 2)]


def test_flatten_roundtrip_in_canonical_order():
    tensors = [torch.randn(2, 3), torch.randn(4), torch.randn(1, 1, 2)]
    flat = flatten(tensors)
    assert flat.shape == (12,)
    targets = [torch.zeros_like(t) for t in tensors]
    unflatten_into(flat, targets)
    for t, u in zip(tensors, targets):
        assert torch.equal(t, u)


def test_a_cluster_with_a_gone_peer_is_left_out_of_the_rings():
    """A killed peer's cluster cannot train; its rings waited for it at every round until their timeout, holding
    the other clusters (issue 33: a plan that waits for a joiner keeps the others training)."""
    plan = {"clusters": [[{"peer_id": "a0", "layers": [0, 2]}, {"peer_id": "a1", "layers": [2, 4]}],
                         [{"peer_id": "b0", "layers": [0, 1]}, {"peer_id": "b1", "layers": [1, 4]}],
                         [{"peer_id": "c0", "layers": [0, 4]}]]}
    sizes = [10, 20, 30, 40]
    rings = plan_rings(plan, sizes, gone={"b1"})
    assert [(r.start, r.end, r.members) for r in rings] == [(0, 30, ("a0", "c0")), (30, 100, ("a1", "c0"))]
    assert rings_of("b0", rings) == []  # the gone peer's partner takes part in no round
    assert plan_rings(plan, sizes, gone={"a0", "b1", "c0"}) == []
    assert len(plan_rings(plan, sizes)) == 3
    # the same rings once a plan drops that cluster and renumbers the last into its gap: a round in flight goes on
    renumbered = {"clusters": [plan["clusters"][2], plan["clusters"][0]]}
    assert plan_rings(renumbered, sizes) == rings


def test_the_values_a_member_sends_on_their_own_are_its_chunk_in_a_ring_and_the_others_chunks_in_a_robust_one():
    """Error feedback keeps what the codec drops of these only: a ring sends the rest of our values summed."""
    from ravnest_swarm.averaging.segments import own_encoded_parts

    members = ("a", "b", "c")
    # chunks of 1000 values among 3: 0:334, 334:667, 667:1000; parts of 200 values from each chunk's start
    assert own_encoded_parts(1000, members, "a", 200, robust=False) == [(0, 200), (200, 334)]
    assert own_encoded_parts(1000, members, "c", 200, robust=False) == [(667, 867), (867, 1000)]
    # robust: member i owns chunk i + 1 and sends each of the others' to its owner
    assert own_encoded_parts(1000, members, "a", 200, robust=True) == [(0, 200), (200, 334), (667, 867), (867, 1000)]
    assert own_encoded_parts(2, members, "c", 200, robust=False) == []  # an empty chunk sends no value
