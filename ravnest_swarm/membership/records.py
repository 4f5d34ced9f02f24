"""DHT records of a run: their keys, pydantic schemas and validators.

Every key a run uses is a field of :class:`RunRecords`; hivemind's ``SchemaValidator`` with the run
name as prefix spells the DHT key ``{run}_{field}`` (``demo_peers``). Per-peer values live under a
subkey that embeds the writer's RSA public key (``[owner:ssh-rsa ...]``), so hivemind's
``RSASignatureValidator`` rejects anyone else's write; a record that names a peer counts only when that
peer's own identity signed it (``membership/identity.py``). Every node of a run installs these validators,
which check records when they are stored on the node and when they are fetched from others, so a
malformed or forged record never reaches the code that reads it.

Values travel as msgpack (hivemind's ``MSGPackSerializer``): never pickle.

Over 400 lines because every record's schema, its key and its validators are read together: one place says what
any record of a run may hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import pydantic.v1 as pydantic
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.multiaddr import Multiaddr

from ravnest_swarm.codecs.codec import CODEC_NAME_PATTERN, PIPELINE_CODEC_PATTERN
from ravnest_swarm.errors import UserError
from ravnest_swarm.membership.buckets import (BUCKET_COUNTS, MAX_BUCKETS, MAX_SUMMARY_CLUSTERS, bucket_field,
                                              bucket_fields)
from ravnest_swarm.membership.identity import PeerIdentityValidator, SubkeyShapeValidator
from ravnest_swarm.membership.owner import FINGERPRINT_RE, RUN_NAME_RE, OwnerSpecValidator
from ravnest_swarm.membership.progress import TIME_USES
from ravnest_swarm.membership.text import CONTROL_CHARACTER_RE, CONTROL_CHARACTERS
from ravnest_swarm.membership.tickets import MAX_REVOKED, MAX_TICKET_CHARS, TICKET_ID_RE, TICKET_TEXT_PATTERN
from ravnest_swarm.net.identity import open_identity
from ravnest_swarm.net.node import SwarmNode, start_node


def _multiaddr(text: str) -> str:
    try:
        Multiaddr(text)
    except Exception as e:  # the parser's errors are ValueErrors, the pydantic check's only kind, but not only those
        raise ValueError(f"not a multiaddr: {e}") from None
    return text


PEER_STATES = ("joining", "standby", "training", "averaging", "done", "leaving")
REACHABILITY = ("direct", "relay", "unknown")
MAX_NAME_LEN = 64
MAX_ROUND_PEERS = 256  # a distributed planning round covers at most this many peers (one proposal stays small)
# a round's plan places each of its peers once; 4,096 stages of 128-character ids were 600 KB a record, and eight of
# them, one per round number under one writer's key, took the plan key past p2pd's 4 MiB reply: nobody read a plan
MAX_PLAN_STAGES = MAX_ROUND_PEERS
MAX_NOTE_LEN = 200
MAX_MODEL_NAME_LEN = 200  # a user's entry point: package.module:function
MAX_LAYOUT_LAYERS = 4096
MAX_LAYOUT_TENSORS = 16384  # tensors of all layers: a 96-block GPT has about 1,200 (a spec of about 40 KB)


def validate_run_name(run: str) -> str:
    """Return ``run`` if it can prefix DHT keys, else raise a :class:`UserError` that says the rule."""
    if not RUN_NAME_RE.match(run or ""):
        raise UserError(
            f"invalid run name {run!r}: use 1-48 letters, digits or '-', starting with a letter or digit"
        )
    return run


@dataclass(frozen=True)
class RunAddress:
    """What joiners are given: the run's name (its DHT keys' prefix) and, where known, its owner's fingerprint
    (``demo@<16 hex digits>``, printed by the peer that started the run; ``membership/owner.py``)."""

    name: str
    owner: Optional[str] = None

    def __str__(self) -> str:
        return self.name if self.owner is None else f"{self.name}@{self.owner}"


def parse_run_address(text: str) -> RunAddress:
    """``demo`` or ``demo@<fingerprint>``; a malformed address is a one-line :class:`UserError`."""
    name, at, owner = (text or "").partition("@")
    validate_run_name(name)
    if at and not FINGERPRINT_RE.match(owner):
        raise UserError(f"invalid run address {text!r}: after '@' comes the run owner's fingerprint, 16 hex digits, "
                        f"as the peer that started the run printed it")
    return RunAddress(name, owner if at else None)


def validate_peer_name(name: str) -> str:
    """Return ``name`` if others can be shown it as it is (``join --name``), else raise a :class:`UserError`."""
    if not 0 < len(name) <= MAX_NAME_LEN:
        raise UserError(f"--name must be 1-{MAX_NAME_LEN} characters, not {len(name)}")
    found = CONTROL_CHARACTER_RE.search(name)
    if found:
        raise UserError(f"--name must not contain control characters: {found.group()!r} at position {found.start()}")
    return name


def _shown_text(min_length: int, max_length: int):
    """A record string that may be printed: bounded, and without control characters."""
    # \Z, not $: $ would also match before a final newline
    return pydantic.constr(strict=True, min_length=min_length, max_length=max_length,
                           regex=f"^[^{CONTROL_CHARACTERS}]*\\Z")


def _bounded_float(lo: float, hi: float):
    return pydantic.confloat(strict=True, ge=lo, le=hi, allow_inf_nan=False)


class PeerRecord(pydantic.BaseModel):
    """What a volunteer says about itself, renewed every heartbeat under ``{run}_peers``.

    The subkey is the peer's signed public key; ``peer_id`` is its libp2p id, which others dial.
    Bounds come from DESIGN.md: RAM 0-4096 GB, bandwidth 0-100,000 Mbit/s, compute 0-10^6 GFLOP/s.
    """

    peer_id: _shown_text(1, 128)
    name: _shown_text(1, MAX_NAME_LEN)
    state: pydantic.constr(strict=True, regex="^(" + "|".join(PEER_STATES) + ")$")
    ram_gb: _bounded_float(0.0, 4096.0)
    bandwidth_mbps: _bounded_float(0.0, 100_000.0)
    gflops: _bounded_float(0.0, 1e6)
    reachability: pydantic.constr(strict=True, regex="^(" + "|".join(REACHABILITY) + ")$")
    maddrs: pydantic.conlist(pydantic.constr(strict=True, max_length=256), max_items=16)

    # each a multiaddr: one that does not parse failed the dial of every ring its writer was in, not just its own
    _multiaddrs = pydantic.validator("maddrs", each_item=True, allow_reuse=True)(lambda cls, text: _multiaddr(text))
    version: _shown_text(0, 32)
    time: _bounded_float(0.0, 1e11)
    cluster: Optional[pydantic.conint(strict=True, ge=-1, le=100_000)] = None
    stage: Optional[pydantic.conint(strict=True, ge=-1, le=64)] = None
    layers: Optional[pydantic.conlist(pydantic.conint(strict=True, ge=0, le=100_000), min_items=2, max_items=2)]
    step: Optional[pydantic.conint(strict=True, ge=0, le=2**53)] = None
    # [first, last, step] of the stage this peer stopped last: it still serves those layers to others
    held: Optional[pydantic.conlist(pydantic.conint(strict=True, ge=0, le=2**53), min_items=3, max_items=3)] = None
    # the step of the averaging round whose state its stage's layers came from, set when it took them under the plan
    # round it follows (``plan_round``): its cluster's other stages take theirs from the same round (docs/swarm.md)
    start_round: Optional[pydantic.conint(strict=True, ge=0, le=2**53)] = None
    # the run's count of averaging rounds (swarm/stage_averaging.py): the round its stage takes part in next, and its
    # step less the round step (how far its cluster ran ahead of the rounds it took part in), so that a stage that
    # starts or follows a new plan meets its ring partners at their next round
    next_round: Optional[pydantic.conint(strict=True, ge=0, le=2**53)] = None
    round_offset: Optional[pydantic.conint(strict=True, ge=-2**53, le=2**53)] = None
    # the rounds (their steps) whose averaged state of its stage's layers it keeps and serves (a few: KEPT_ROUNDS),
    # from which a new cluster's first stage picks one that every stage of the cluster can take
    kept_rounds: Optional[pydantic.conlist(pydantic.conint(strict=True, ge=0, le=2**53), max_items=16)] = None
    loss: Optional[_bounded_float(0.0, 1e6)] = None
    samples_per_s: Optional[_bounded_float(0.0, 1e9)] = None
    plan_round: Optional[pydantic.conint(strict=True, ge=0, le=2**53)] = None
    # which plan of that round it follows (``reader.plan_digest``): two plans of one round can place it alike, and a
    # peer stranded on the losing side of a split round follows the other only where its peers name that very plan
    plan_digest: Optional[pydantic.constr(strict=True, regex=r"^[0-9a-f]{16}\Z")] = None
    # a graceful leave trains on to this averaging round, then leaves (``Volunteer._train_to_round``): no holder
    # of its layers for another leaver
    leaving_after_round: Optional[pydantic.conint(strict=True, ge=0, le=2**53)] = None
    averaging_rounds: Optional[pydantic.conint(strict=True, ge=0, le=2**53)] = None
    averaging_failures: Optional[pydantic.conint(strict=True, ge=0, le=2**53)] = None
    # bytes our averaging rounds put on ring streams, counted as sent (``swarm/stage_averaging.py``)
    averaging_bytes_sent: Optional[pydantic.conint(strict=True, ge=0, le=2**53)] = None
    rejected: Optional[pydantic.conint(strict=True, ge=0, le=2**53)] = None  # poisoned or malformed input refused
    note: Optional[_shown_text(0, MAX_NOTE_LEN)] = None
    # where its stages compute and what memory they measurably took (docs/records.md); optional, so that the
    # records of peers from before devices still validate
    device: Optional[pydantic.constr(strict=True, regex=r"^(cpu|cuda(:\d{1,3})?)\Z")] = None
    device_memory_gb: Optional[_bounded_float(0.0, 4096.0)] = None  # what the planner sizes its stages by
    peak_memory_gb: Optional[_bounded_float(0.0, 4096.0)] = None  # the process's peak RSS
    device_peak_gb: Optional[_bounded_float(0.0, 4096.0)] = None  # the GPU's peak allocation; None on a CPU
    # the peer's own figures that fell outside their bounds and were published clamped (a bound) or as None (not
    # finite): a loss of 10^7 reads as "above 10^6", not as a record that failed to renew (``own_record.py``)
    out_of_range: Optional[pydantic.conlist(pydantic.constr(strict=True, regex=r"^[a-z_]{1,32}\Z"),
                                            max_items=16)] = None
    divergences: Optional[pydantic.conint(strict=True, ge=0, le=2**53)] = None  # restores after a divergence
    # the codecs our stage's messages go in now, forward and backward (``pipeline/link_codec.py``)
    codecs: Optional[Dict[pydantic.constr(strict=True, regex=r"^(forward|backward)\Z"),
                          pydantic.constr(strict=True, regex=CODEC_NAME_PATTERN)]] = None
    # where our wall time went since we were first placed, while placed (docs/records.md): each use's share of
    # ``window_s`` seconds, and ``utilisation``, the share computing or sending outside layer downloads
    utilisation: Optional[_bounded_float(0.0, 1.0)] = None
    time_shares: Optional[Dict[pydantic.constr(strict=True, regex="^(" + "|".join(TIME_USES) + r")\Z"),
                               _bounded_float(0.0, 1.0)]] = None
    window_s: Optional[_bounded_float(0.0, 1e9)] = None
    # bytes per second our streams carried lately, out and in (``net/traffic.py``), the bytes of the layers we
    # downloaded to take our places, and the codec of our averaging ring's parts
    bytes_up_per_s: Optional[_bounded_float(0.0, 1e12)] = None
    bytes_down_per_s: Optional[_bounded_float(0.0, 1e12)] = None
    moved_bytes: Optional[pydantic.conint(strict=True, ge=0, le=2**53)] = None
    averaging_codec: Optional[_shown_text(1, 64)] = None  # the spec's name for it, whatever its codecs are called
    # the owner's admission ticket, in an invite-only run (``membership/tickets.py``): readers check it
    ticket: Optional[pydantic.constr(strict=True, max_length=MAX_TICKET_CHARS, regex=TICKET_TEXT_PATTERN)] = None


def planning_memory_gb(record: Dict) -> float:
    """The memory a peer's stages may fill, by its record: its device's (a GPU's memory for a GPU peer), or,
    for a record without one, the RAM it offers."""
    device_memory = record.get("device_memory_gb")
    return record["ram_gb"] if device_memory is None else device_memory


class StageEndpoint(pydantic.BaseModel):
    """Where a pipeline stage serves, under ``{run}_stages_{cluster mod 64}`` (``stages_key``) with subkey
    ``b"{cluster}.{stage}" + owner key``.

    Neighbours resolve a stage here and again whenever a send to it fails or their plan names another peer
    for it: they count only records naming that peer (anyone can write a record for any slot), the newest
    ``time`` of them; a stage that names no neighbours takes the newest of all (``pipeline/endpoints.py``).
    """

    peer_id: pydantic.constr(strict=True, min_length=1, max_length=128)
    maddrs: pydantic.conlist(pydantic.constr(strict=True, max_length=256), max_items=16)

    # each a multiaddr: one that does not parse failed the dial of every ring its writer was in, not just its own
    _multiaddrs = pydantic.validator("maddrs", each_item=True, allow_reuse=True)(lambda cls, text: _multiaddr(text))
    model: pydantic.constr(strict=True, min_length=1, max_length=MAX_MODEL_NAME_LEN)
    layers: pydantic.conlist(pydantic.conint(strict=True, ge=0, le=100_000), min_items=2, max_items=2)
    version: pydantic.conint(strict=True, ge=0, le=2**53)
    time: _bounded_float(0.0, 1e11)


class PlanStage(pydantic.BaseModel):
    """One stage of a cluster in the adopted plan: the peer that serves it and its layers ``[first, last)``."""

    peer_id: _shown_text(1, 128)
    layers: pydantic.conlist(pydantic.conint(strict=True, ge=0, le=100_000), min_items=2, max_items=2)


class PlanRecord(pydantic.BaseModel):
    """An adopted plan under ``{run}_plan``: clusters in order, each with its stages in layer order.

    Each adopter writes its copy under its own signed subkey (``plan_subkey``), so nobody can overwrite
    another's. Anyone can still write a plan of their own: a reader counts a plan only when the signed
    records of most of the peers it places say they follow it (``membership.reader.adopted_plan``).
    Averaging rings are built from it (``averaging.segments.build_rings``), so every peer that reads
    the same round builds the same rings.
    """

    round: pydantic.conint(strict=True, ge=0, le=2**53)
    clusters: pydantic.conlist(pydantic.conlist(PlanStage, min_items=1, max_items=64), min_items=1, max_items=1024)
    time: _bounded_float(0.0, 1e11)

    @pydantic.validator("clusters")
    def _bounded_size(cls, clusters):
        # 1024 x 64 stages would be a 10 MB record every reader fetches; a plan covers one round's peers
        if sum(len(cluster) for cluster in clusters) > MAX_PLAN_STAGES:
            raise ValueError(f"a plan has at most {MAX_PLAN_STAGES} stages in all")
        return clusters


class RoundProposal(pydantic.BaseModel):
    """A peer's best plan in a planning round, under ``{run}_round`` with its signed public key as subkey.

    Each peer keeps one proposal and overwrites it round after round, so ``round`` says which round it
    belongs to; ``deadline`` (DHT time) is when the round closes, the earliest any proposal names.
    ``clusters`` are peer ids per cluster; ``fitness`` is their K x min T as the proposer computed it
    (adopters recompute it before trusting it). The proposer's own capabilities travel here, signed, so
    every adopter evaluates every plan on the same figures, and a fresh ``time`` says it is still alive.
    """

    round: pydantic.conint(strict=True, ge=1, le=2**53)
    deadline: _bounded_float(0.0, 1e11)
    peer_id: _shown_text(1, 128)
    ram_gb: _bounded_float(0.0, 4096.0)  # the memory its stages may fill (``planning_memory_gb``)
    gflops: _bounded_float(0.0, 1e6)
    bandwidth_mbps: _bounded_float(0.0, 100_000.0)
    fitness: _bounded_float(0.0, 1e12)
    clusters: pydantic.conlist(
        pydantic.conlist(_shown_text(1, 128), min_items=1, max_items=64),
        max_items=MAX_ROUND_PEERS)
    time: _bounded_float(0.0, 1e11)

    @pydantic.validator("clusters")
    def _one_round_of_peers(cls, clusters):
        # 256 clusters of 64 ids were 2 MB a proposal: a few filled the round key past what a reply carries
        if sum(len(cluster) for cluster in clusters) > MAX_ROUND_PEERS:
            raise ValueError(f"a proposal places at most {MAX_ROUND_PEERS} peers in all")
        return clusters


class RunSpecRecord(pydantic.BaseModel):
    """What the run trains, under ``{run}_spec`` (see ``swarm.spec.RunSpec``): names and numbers only.

    The subkey is the writer's signed public key (hivemind keeps no plain dict without a subkey); what makes a
    spec count is ``signature``, by the run owner's key (``membership/owner.py``).
    """

    model: _shown_text(1, MAX_MODEL_NAME_LEN)
    model_config: _shown_text(0, 200) = ""
    # every layer's [name, [[tensor name, shape, dtype], ...]]: a joiner whose code builds another model refuses
    layout: Optional[pydantic.conlist(Tuple[_shown_text(1, 128), pydantic.conlist(Tuple[
        _shown_text(1, 256), pydantic.conlist(pydantic.conint(strict=True, ge=0, le=2**40), max_items=8),
        pydantic.constr(strict=True, regex="^[a-z0-9]{1,16}$")], max_items=MAX_LAYOUT_TENSORS)],
        max_items=MAX_LAYOUT_LAYERS)] = None
    data_hash: pydantic.constr(strict=True, regex="^([0-9a-f]{64})?$") = ""  # sha256 of --data; "": the model's own
    data_bytes: pydantic.conint(strict=True, ge=0, le=2**53) = 0
    optimizer: pydantic.constr(strict=True, regex="^(sgd|momentum|adamw)$")  # optimizers.inner
    weight_decay: _bounded_float(0.0, 10.0) = 0.0
    lr_schedule: pydantic.constr(strict=True, regex="^(constant|cosine)$") = "constant"
    warmup_steps: pydantic.conint(strict=True, ge=0, le=2**53) = 0
    outer_optimizer: pydantic.constr(strict=True, regex="^(average|nesterov)$") = "average"  # optimizers.outer
    outer_lr: _bounded_float(0.0, 10.0) = 0.7
    outer_momentum: _bounded_float(0.0, 0.999) = 0.9
    lr: _bounded_float(0.0, 10.0)
    microbatch_size: pydantic.conint(strict=True, ge=1, le=4096)
    max_in_flight: pydantic.conint(strict=True, ge=1, le=1024)
    averaging_period: pydantic.conint(strict=True, ge=1, le=10**6)
    averaging_overlap: pydantic.StrictBool = False  # swarm/stage_averaging.py: rounds beside training
    pipeline_compression: pydantic.constr(strict=True, regex=PIPELINE_CODEC_PATTERN) = "none"  # codecs.CODECS
    link_bound_compression: pydantic.constr(strict=True, regex=f"{PIPELINE_CODEC_PATTERN}|^$") = ""  # link_codec.py
    # the ring's codec: with one that compresses, the rings average pseudo-gradients with error feedback
    averaging_compression: pydantic.constr(strict=True, regex=CODEC_NAME_PATTERN) = "none"  # swarm.stage_averaging
    precision: pydantic.constr(strict=True, regex="^(fp32|bf16|fp16)$") = "fp32"  # the stages' autocast
    backward: pydantic.constr(strict=True, regex="^(stash|recompute)$") = "stash"
    aggregation: pydantic.constr(strict=True, regex="^(mean|trimmed_mean|centered_clip)$") = "mean"  # averaging.robust
    lr_scaling: pydantic.constr(strict=True, regex="^(none|sqrt|linear|warmup)$") = "none"  # swarm.spec.cluster_lr
    divergence_factor: _bounded_float(0.0, 1e6) = 10.0  # pipeline/guard.py
    move_horizon_s: _bounded_float(1.0, 1e7) = 600.0  # planning/cost.py::pays_back (DEFAULT_MOVE_HORIZON_S)
    steps: pydantic.conint(strict=True, ge=1, le=2**53) = 300
    finished: pydantic.StrictBool = False  # the owner ended the run (update-spec --finish, or its peer at the end)
    # only peers with the owner's ticket count, and those of the revoked tickets not (membership/tickets.py)
    invite_only: pydantic.StrictBool = False
    revoked: pydantic.conlist(pydantic.constr(strict=True, regex=TICKET_ID_RE.pattern), max_items=MAX_REVOKED) = []
    protocol: pydantic.conint(strict=True, ge=0, le=10**6)
    created: _bounded_float(0.0, 1e11)
    # which run the owner signed it for (the run's name; its key is the owner's), and when that run began (version
    # 1's ``created``, carried by every later version): an owner key that signs specs of two runs, or of one name
    # started anew, has each spec count for its own run only, never a replay of another's (membership/owner.py)
    run: pydantic.constr(strict=True, regex=RUN_NAME_RE.pattern)
    origin: _bounded_float(0.0, 1e11)
    # the run owner's public key (ssh-rsa text), its signature over every other field (membership/owner.py),
    # and the version: peers follow the owner's highest of the latest origin
    owner: pydantic.constr(strict=True, max_length=1024)
    version: pydantic.conint(strict=True, ge=1, le=2**53) = 1
    signature: pydantic.constr(strict=True, max_length=1024)

    @pydantic.validator("layout")
    def _bounded_layout(cls, layout):
        if layout is not None and sum(len(tensors) for _, tensors in layout) > MAX_LAYOUT_TENSORS:
            raise ValueError(f"a layout has at most {MAX_LAYOUT_TENSORS} tensors in all")
        return layout


class BucketSummary(pydantic.BaseModel):
    """One bucket's counts, under ``{run}_summary``, written by the bucket's member with the smallest peer id
    (``membership/buckets.py``), ``peer_id``: a dashboard of a large run adds up the summaries whose writer's own
    record is in the bucket it summarizes (``buckets.add_up``)."""

    peer_id: _shown_text(1, 128)
    buckets: pydantic.conint(strict=True, ge=1, le=2**16)
    bucket: pydantic.conint(strict=True, ge=0, le=2**16)
    peers: pydantic.conint(strict=True, ge=0, le=10**6)
    states: Dict[pydantic.constr(strict=True, regex="^(" + "|".join(PEER_STATES) + ")$"),
                 pydantic.conint(strict=True, ge=0, le=10**6)]
    clusters: Dict[pydantic.constr(strict=True, regex="^[0-9]{1,6}$"), pydantic.conint(strict=True, ge=0, le=10**6)]
    samples_per_s: _bounded_float(0.0, 1e12)
    time: _bounded_float(0.0, 1e11)

    @pydantic.validator("clusters")  # pydantic v1 has no bounded dict type
    def _bounded_clusters(cls, clusters):
        if len(clusters) > MAX_SUMMARY_CLUSTERS:
            raise ValueError(f"a bucket's summary names at most {MAX_SUMMARY_CLUSTERS} clusters")
        return clusters

    # a count the run's keys have, and a bucket of it: a reader reads every bucket of each count a summary names,
    # and the validators know only those keys (a summary naming 65,536 buckets made every planner poll read 65,537
    # keys, none of them validated: a forged record there confirmed a hostile plan)
    @pydantic.validator("buckets")
    def _known_count(cls, buckets):
        if buckets not in BUCKET_COUNTS:
            raise ValueError(f"a run has 1 to {MAX_BUCKETS} buckets, a power of two")
        return buckets

    @pydantic.validator("bucket")
    def _bucket_of_count(cls, bucket, values):
        if "buckets" in values and bucket >= values["buckets"]:
            raise ValueError("the bucket is not one of its count")
        return bucket


class _RunKeys(pydantic.BaseModel):
    peers: Dict[BytesWithPublicKey, PeerRecord]  # the one bucket of a run with one (``bucket_field(1, 0)``)
    plan: Dict[BytesWithPublicKey, PlanRecord]
    round: Dict[BytesWithPublicKey, RoundProposal]
    spec: Dict[BytesWithPublicKey, RunSpecRecord]
    summary: Dict[BytesWithPublicKey, BucketSummary]


# Stage endpoints spread over this many keys by cluster: a neighbour reads its own cluster's key only, and no key
# holds every stage of a large run
STAGE_KEYS = 64

# The run's DHT keys (fields) and the type of each value: the keys above, every bucket of peer records and every
# key of stage endpoints
RunRecords = pydantic.create_model(
    "RunRecords", __base__=_RunKeys,
    **{field: (Dict[BytesWithPublicKey, PeerRecord], None) for field in bucket_fields() if field != "peers"},
    **{f"stages_{index}": (Dict[BytesWithPublicKey, StageEndpoint], None) for index in range(STAGE_KEYS)})


class RunSchemaValidator(SchemaValidator):
    """hivemind's ``SchemaValidator`` over :data:`RunRecords`, checking each record against a model of its own key
    alone: ``RunRecords`` has a field per bucket of every bucket count (579 in all), and parsing a record into the
    whole model, then dumping it, took about 2 ms a record, against 0.1 ms here; every store, and every read of a
    bucket of 64 records, paid it. The rules are hivemind's: the key's type, strictly, with no conversion."""

    def __init__(self, run: str):
        super().__init__(RunRecords, allow_extra_keys=True, prefix=run)
        self._models = {name: pydantic.create_model(f"RunRecords_{name}", __config__=_ForbidExtra,
                                                    **{name: (field.outer_type_, None)})
                        for name, field in RunRecords.__fields__.items()}

    def validate(self, record) -> bool:
        if record.key not in self._key_id_to_field_name:
            return self._allow_extra_keys
        try:
            value = self._deserialize_record(record)
            [name] = value
            parsed = self._models[name].parse_obj(value)
        except (ValueError, pydantic.ValidationError):  # pydantic's error is a ValueError too; said for the reader
            return False
        return parsed.dict(by_alias=True)[name] == value[name]

    def merge_with(self, other) -> bool:
        return False  # its models are its own keys': another schema's keys stay with that schema's validator


class _ForbidExtra(pydantic.BaseConfig):
    extra = pydantic.Extra.forbid


def make_validators(run: str, owner: Optional[str] = None, signing_key: Optional[RSAPrivateKey] = None) -> List:
    """The record validators every node of ``run`` installs (signature first, then schema, then the spec's
    owner: any spec must be signed by the key it names, and by ``owner``'s, a fingerprint, where it is known; then
    the writer's identity: every record that names a peer but plans and specs, by that peer's own key).

    :param signing_key: the key this node signs its records with; by default the process-wide key (a process is
        one peer). Several peers in one process (``bench/light.py``) each need their own, or their records,
        written under the same subkey, would replace one another.
    """
    return [RSASignatureValidator(signing_key), RunSchemaValidator(run), OwnerSpecValidator(spec_key(run), owner),
            PeerIdentityValidator(f"{run}_{field}" for field in RunRecords.__fields__ if field not in ("plan", "spec")),
            SubkeyShapeValidator(subkey_shapes(run))]


def subkey_shapes(run: str) -> Dict[str, bytes]:
    """Each key of ``run`` and what its writers put before their public key in a subkey (a regex): nothing for a
    bucket of peer records, a round's proposals and the spec; ``plan_subkey_prefix``, ``summary_subkey_prefix`` and
    ``stage_subkey_prefix`` where those name what the record is of."""
    shapes = {f"{run}_{field}": b"" for field in bucket_fields()}
    # a plan's round as its schema bounds it (2^53 has 16 digits: a far-future round is stored, and ignored by readers)
    shapes.update({round_key(run): b"", spec_key(run): b"", plan_key(run): rb"\d{1,16}\.",
                   summary_key(run): rb"\d{1,4}\.\d{1,4}\."})
    shapes.update({f"{run}_stages_{index}": rb"\d{1,6}\.\d{1,4}" for index in range(STAGE_KEYS)})
    return shapes


async def start_peer_node(initial_peers: Sequence[Multiaddr], run: str, owner: Optional[str] = None,
                          identity_path: Optional[str] = None, **options) -> SwarmNode:
    """``net.node.start_node`` for a peer of ``run``: its p2pd and its records under one identity (``--identity``'s,
    else one made for this process), so the records that name it are its own (``membership/identity.py``)."""
    identity = open_identity(identity_path)
    return await start_node(initial_peers, record_validators=make_validators(run, owner, signing_key=identity.key),
                            identity=identity, **options)


def signing_validator(node: DHTNode) -> RSASignatureValidator:
    """The validator that signs ``node``'s records (its subkey, ``local_public_key``, is the node's identity as a
    writer): the one among the node's validators, else the process-wide key's, which signs nothing a node without
    one would store."""
    validator = node.protocol.record_validator
    parts = getattr(validator, "_validators", [validator])  # hivemind's CompositeValidator keeps its parts there
    return next((part for part in parts if isinstance(part, RSASignatureValidator)), RSASignatureValidator())


def spec_key(run: str) -> str:
    return f"{run}_spec"


def peers_key(run: str, buckets: int = 1, bucket: int = 0) -> str:
    """The key of one bucket of peer records (``membership/buckets.py``); ``{run}_peers`` in a run of one."""
    return f"{run}_{bucket_field(buckets, bucket)}"


def summary_key(run: str) -> str:
    return f"{run}_summary"


def summary_subkey_prefix(buckets: int, bucket: int) -> bytes:
    """Subkeys of a bucket's summary start with this; the writer's public key follows."""
    return f"{buckets}.{bucket}.".encode()


def plan_key(run: str) -> str:
    return f"{run}_plan"


def plan_subkey_prefix(round_number: int) -> bytes:
    """Subkeys of a round's plan copies start with this; the adopter's public key follows."""
    return f"{round_number}.".encode()


def stages_key(run: str, cluster: int) -> str:
    """The key holding the endpoints of ``cluster``'s stages (with those of every 64th cluster beside it)."""
    return f"{run}_stages_{cluster % STAGE_KEYS}"


def stage_subkey_prefix(cluster: int, stage: int) -> bytes:
    """Subkeys of one stage's endpoint start with this; the owner's public key follows."""
    return f"{cluster}.{stage}".encode()


def round_key(run: str) -> str:
    return f"{run}_round"
