"""Cutting the flat parameter vector into segments, and one all-reduce ring per segment.

Every cluster holds the whole model, split into stages at its own layer boundaries. The union of all
clusters' boundaries cuts the flat vector into segments; inside a segment every cluster has exactly
one owner, so a segment is averaged by one ring of C members (one per cluster), and nobody else takes
part. See ``docs/averaging.md`` for a worked example.

These are pure functions: every peer computes the same rings from the same adopted plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Dict, List, Sequence, Tuple

import torch

# (owner, start, end): an owner holds the elements [start, end) of the flat vector
OwnedRange = Tuple[str, int, int]


@dataclass(frozen=True)
class Ring:
    """One segment of the flat vector and the peers that average it.

    :param index: segment number, in vector order
    :param start: first element of the segment in the flat vector
    :param end: one past its last element
    :param members: the segment's owner in each cluster, ordered by peer id (the ring order): a plan that
        renumbers clusters (one dropped, another moved into its gap) keeps every ring as it was, so a round in
        flight goes on through it
    """

    index: int
    start: int
    end: int
    members: Tuple[str, ...]

    @property
    def size(self) -> int:
        return self.end - self.start


def layer_offsets(layer_sizes: Sequence[int]) -> List[int]:
    """Element offset of every layer in the flat vector, plus the total: ``[0, n0, n0 + n1, ...]``. A layer without
    parameters (a user model's ``Flatten`` or activation) has size 0: it takes no room in the vector."""
    offsets = [0]
    for size in layer_sizes:
        if size < 0:
            raise ValueError(f"layer sizes cannot be negative, got {size}")
        offsets.append(offsets[-1] + size)
    return offsets


def element_range(layer_sizes: Sequence[int], layers: Tuple[int, int]) -> Tuple[int, int]:
    """The flat-vector range ``[start, end)`` of the layers ``[first, last)``."""
    first, last = layers
    if not 0 <= first < last <= len(layer_sizes):
        raise ValueError(f"layer range {layers} is not inside [0, {len(layer_sizes)})")
    offsets = layer_offsets(layer_sizes)
    return offsets[first], offsets[last]


def check_cluster(ranges: Sequence[OwnedRange], total: int) -> None:
    """Raise ``ValueError`` unless ``ranges`` cover ``[0, total)`` contiguously, in order. A range may be empty: a
    stage whose layers have no parameters owns nothing to average, and is in no ring."""
    position = 0
    for owner, start, end in ranges:
        if start != position or end < start:
            raise ValueError(f"cluster ranges must tile [0, {total}) in order: {owner} holds [{start}, {end}) "
                             f"where [{position}, ...) was expected")
        position = end
    if position != total:
        raise ValueError(f"cluster ranges end at {position}, not at the vector's end {total}")


def build_rings(clusters: Sequence[Sequence[OwnedRange]], total: int) -> List[Ring]:
    """The segments cut by the union of all clusters' boundaries, each with its owner in every cluster.

    :param clusters: per cluster, its stages' owned ranges in vector order
    :param total: length of the flat vector
    """
    if not clusters:
        raise ValueError("need at least one cluster")
    owners = [owner for cluster in clusters for owner, _, _ in cluster]
    if len(set(owners)) != len(owners):
        raise ValueError("a peer can own only one range in one cluster")
    for cluster in clusters:
        check_cluster(cluster, total)
    cuts = sorted({start for cluster in clusters for _, start, _ in cluster} | {total})
    rings = []
    for index, (start, end) in enumerate(zip(cuts, cuts[1:])):
        # a segment lies inside one range of each cluster, because no cluster cuts inside it
        members = tuple(sorted(next(owner for owner, lo, hi in cluster if lo <= start < hi) for cluster in clusters))
        rings.append(Ring(index, start, end, members))
    return rings


def rings_of(owner: str, rings: Sequence[Ring]) -> List[Ring]:
    return [ring for ring in rings if owner in ring.members]


def chunk_bounds(length: int, parts: int) -> List[Tuple[int, int]]:
    """Split ``length`` elements into ``parts`` contiguous chunks whose sizes differ by at most one."""
    base, extra = divmod(length, parts)
    bounds, position = [], 0
    for index in range(parts):
        size = base + (1 if index < extra else 0)
        bounds.append((position, position + size))
        position += size
    return bounds


def own_encoded_parts(length: int, members: Sequence[str], me: str, part_elements: int,
                      robust: bool) -> List[Tuple[int, int]]:
    """Where our own values of a ring's segment of ``length`` elements go out encoded on their own, as ranges of the
    segment, part by part as the ring serializes them (``part_elements`` a part, from each chunk's start): the plain
    ring sends our chunk (our position's) at its first step (``ring.RingAttempt``), a robust one every other member's
    chunk to its owner (``robust_ring.RobustRingAttempt``). Our other values go out only summed with the others',
    so what a codec drops there is nobody's own: error feedback keeps what it drops here, and only here."""
    count, position = len(members), members.index(me)
    chunks = chunk_bounds(length, count)
    ours = [chunk for index, chunk in enumerate(chunks) if index != (position + 1) % count] if robust \
        else [chunks[position]]
    return [(lo + offset, min(lo + offset + part_elements, hi)) for lo, hi in ours
            for offset in range(0, hi - lo, part_elements)]


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate tensors (parameters, then optimizer state, in the caller's canonical order) as float32."""
    return torch.cat([tensor.detach().reshape(-1).to(torch.float32) for tensor in tensors])


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``flat`` back into ``tensors`` in the order :func:`flatten` read them."""
    position = 0
    for tensor in tensors:
        count = tensor.numel()
        with torch.no_grad():
            tensor.copy_(flat[position:position + count].view_as(tensor).to(tensor.dtype))
        position += count
    if position != flat.numel():
        raise ValueError(f"flat vector has {flat.numel()} elements, the tensors {position}")


def ring_bytes_per_peer(rings: Sequence[Ring], bytes_per_element: int = 4) -> Dict[str, int]:
    """Bytes each peer holds across its rings (what bounds its time: it sends 2(C-1)/C of this)."""
    held: Dict[str, int] = {}
    for ring in rings:
        for member in ring.members:
            held[member] = held.get(member, 0) + ring.size * bytes_per_element
    return held


def plan_rings(plan: dict, layer_sizes: Sequence[int], gone: Collection[str] = ()) -> List[Ring]:
    """The rings of an adopted plan record: element ranges from each stage's layer range. A cluster with a peer
    in ``gone`` is left out (its pipeline cannot train: it has nothing to average, and a ring that waits for the
    gone peer would hold every other cluster until the ring's timeout); none left, no rings."""
    total = sum(layer_sizes)
    clusters = [[(stage["peer_id"], *element_range(layer_sizes, tuple(stage["layers"]))) for stage in cluster]
                for cluster in plan["clusters"] if not any(stage["peer_id"] in gone for stage in cluster)]
    return build_rings(clusters, total) if clusters else []
