"""The run spec: what a swarm trains, published once under ``{run}_spec`` and read by every joiner.

Only names and numbers travel: a joiner builds the named model from its own code (the zoo, or a user's
``module:function``), so no code or weights ever come from the network. The spec carries the model's
layout and the content hash of ``--data``, so a joiner whose code builds another model, or whose data
differs, refuses with one line, as does one that lacks the model or asked for different settings.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

from hivemind.dht.node import DHTNode
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from ravnest_swarm import PROTOCOL_VERSION
from ravnest_swarm.errors import UserError
from ravnest_swarm.membership.owner import (
    fingerprint, load_or_create_owner_key, load_owner_key, owner_key_path, public_key_text, sign_spec, spec_owner,
)
from ravnest_swarm.membership.records import RunAddress, RunSpecRecord, signing_validator, spec_key
from ravnest_swarm.net.node import store_record
from ravnest_swarm.planning.cost import DEFAULT_MOVE_HORIZON_S

SPEC_LIFETIME = 7 * 24 * 3600  # a run outlives any one peer: its peers store the spec again while it lives
# a peer stores the spec it follows again once no copy outlives this (each peer at a random fraction of it, so that
# one of them renews it and the others see that copy): else the owner's newest version expired after a week, and
# an older one that a stranger kept storing became the spec joiners followed (its revocations and end undone)
SPEC_RENEW_BEFORE = SPEC_LIFETIME / 2
# what the owner may change in a running run: every peer follows the lr from its next step, a training stage the length
# (``steps``: extend or shorten it) and the end (``finished``: the run is over, whatever its steps; status says so);
# who is admitted (``invite_only``, and the tickets ``revoked``: membership/tickets.py)
FOLLOWED = ("lr", "steps", "finished", "invite_only", "revoked")
# how a cluster's learning rate follows the number of clusters (``cluster_lr``); ``bench lr-scaling`` measures them
LR_SCALINGS = ("none", "sqrt", "linear", "warmup")
# the length of an open-ended run (``--steps 0``): more steps than any run takes; it ends when its owner says so
# (``update-spec --finish``) or sets a length (``update-spec --steps N``)
OPEN_ENDED = 2**53
LR_WARMUP_STEPS = 200  # ``warmup``: steps after a stage starts over which its lr goes from the run's to K x it


def run_length(steps: Optional[int]) -> str:
    """A run's length as a person reads it."""
    return "?" if steps is None else "open-ended" if steps >= OPEN_ENDED else str(steps)


def length_from_option(steps: Optional[int]) -> Optional[int]:
    """``--steps``: 0 is an open-ended run."""
    return OPEN_ENDED if steps == 0 else steps


def cluster_lr(lr: float, clusters: int, rule: str, steps_since_start: int, warmup_steps: int = LR_WARMUP_STEPS) -> float:
    """A cluster's learning rate when the run's is ``lr`` and ``clusters`` train: ``none`` keeps it, ``sqrt`` and
    ``linear`` multiply it by sqrt K and K, ``warmup`` goes from lr to K x lr over ``warmup_steps`` steps after the
    stage started among ``clusters`` (a stage a re-plan keeps in place counts from the change). docs/swarm.md, "The learning rate across clusters"."""
    if rule == "none" or clusters <= 1:
        return lr
    if rule == "sqrt":
        return lr * math.sqrt(clusters)
    if rule == "linear":
        return lr * clusters
    ramp = min(1.0, steps_since_start / max(1, warmup_steps))
    return lr * (1 + (clusters - 1) * ramp)


@dataclass
class RunSpec:
    """Hyper-parameters shared by the whole run.

    :param model: zoo name or preset (``gpt-85m``), or a user's entry point ``module:function``
    :param model_config: the model's settings, ``layers=12,width=768`` (``--model-config``)
    :param layout: every layer's tensors (``models.model_layout``): what joiners' builds must equal
    :param data_hash: sha256 of the run's ``--data`` (``models.user_data``); empty: the model's own data
    :param data_bytes: the size of that data
    :param optimizer: the stages' inner optimizer (``optimizers.inner``): ``sgd``, ``momentum`` or ``adamw``
    :param weight_decay: its decoupled weight decay (AdamW) or L2 penalty (SGD)
    :param lr_schedule: ``constant`` or ``cosine`` (a warm-up over ``warmup_steps``, then a cosine decay over the
      run's length), a function of the run's step (``optimizers.inner.scheduled_lr``)
    :param warmup_steps: steps over which the lr warms up from the start of the run
    :param outer_optimizer: what a stage does with its averaging round's mean (``optimizers.outer``): ``average``
      takes it, ``nesterov`` steps along the averaged pseudo-gradient with ``outer_lr`` and ``outer_momentum``
    :param lr: learning rate
    :param microbatch_size: samples per microbatch
    :param max_in_flight: microbatches in flight per cluster (bounded staleness)
    :param averaging_period: optimizer steps between averaging rounds (H)
    :param averaging_overlap: a stage trains on while its round runs and applies the result one round late
      (``swarm/stage_averaging.py``); off, it stands still for the round
    :param pipeline_compression: the codec stages send activations and gradients in (``codecs.CODECS``): ``none``,
      16 bits, or ``int8`` ... ``int3`` blockwise for a quarter to a tenth of the bytes on slow home links
      (docs/pipeline.md)
    :param link_bound_compression: the stronger codec a stage boundary switches to while its link is the
      bottleneck, and back from once it is not ("" or the run's own codec: never; ``pipeline/link_codec.py``)
    :param averaging_compression: the codec of the averaging rings' parts (``codecs.CODECS``): ``none`` sends the
      stages' parameters in float32; a compressing one (``int8``, ``int4`` ...) sends each stage's pseudo-gradient
      with error feedback (``swarm/stage_averaging.py``, docs/averaging.md, "Compressed pseudo-gradients")
    :param backward: how a stage computes a microbatch's backward: ``stash`` keeps the activations and a copy
      of the weights of its forward until its gradient returns (memory grows with the microbatches in flight);
      ``recompute`` keeps only its input and redoes the forward with the current weights (a third more
      compute, the activations of one microbatch at a time: for models that barely fit; docs/models.md)
    :param aggregation: how each averaging ring combines its members' values (``averaging.robust.AGGREGATIONS``):
      ``mean``, or ``trimmed_mean`` / ``centered_clip``, which bound what one hostile member of a ring can do
      at some cost in time (docs/averaging.md, "Aggregation")
    :param lr_scaling: how a cluster's lr follows the number of clusters (:data:`LR_SCALINGS`, ``cluster_lr``)
    :param divergence_factor: a loss above this many times a stage's level skips its step; a few in a row
      restore the stage's last good state (``pipeline/guard.py``); 0: only a loss that is not finite does
    :param precision: ``fp32``, or ``bf16`` / ``fp16``: stages compute their forward under a 16-bit autocast
      (weights, gradients, optimizer state and what travels stay float32; ``devices.autocast_dtype`` says what
      a device that lacks the dtype runs instead)
    :param move_horizon_s: seconds within which a new plan must pay back the samples its moves lose (layer
      downloads over each moved peer's link, and a pause) with its gain in throughput, or it is not adopted
      (``planning/cost.py::pays_back``, docs/planning.md "Moves")
    :param steps: the run's length: optimizer steps every stage trains for. It belongs to the run, not to a
      volunteer, so peers that join late or replace others train towards the same end, and the run is
      finished once its placed peers reach it; :data:`OPEN_ENDED` (``--steps 0``): until its owner ends it
    :param finished: the owner ended the run (``update-spec --finish``, or the owner's own peer once the run reached
      its length): signed, so ``status`` tells a finished run from an abandoned one after every peer has left
    :param protocol: wire protocol version; peers of other versions refuse to join
    :param version: the owner's version of this spec: running peers follow a higher one (only what
      ``FOLLOWED`` names may change between versions)
    :param origin: when version 1 of the run was signed (0: this is version 1, signed now); every version carries
      it, and a run started anew under the same address has a later one (:func:`read_specs`)
    """

    model: str
    model_config: str = ""
    layout: Optional[list] = None
    data_hash: str = ""
    data_bytes: int = 0
    # the defaults of issue 30, from measurement (docs/averaging.md, "Defaults"): AdamW inside, the clusters' mean of
    # int8 pseudo-gradients with error feedback, rounds beside training. Not DiLoCo's Nesterov step: at 25-step
    # rounds its momentum ended above the mean on text and, over long runs on the digits, 15x above it
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    outer_optimizer: str = "average"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    lr: float = 0.002
    microbatch_size: int = 32
    # bounded staleness: stage 0's gradients are up to max_in_flight - 1 updates old. At 4, mlp-digits' 9
    # layers lost 1.5 points of held-out accuracy to it in `bench quality`; at 2, 0.3 (docs/benchmarks.md)
    max_in_flight: int = 2
    averaging_period: int = 25
    averaging_overlap: bool = True
    pipeline_compression: str = "none"
    # measured (docs/pipeline.md, "Codecs"): int8 keeps the held-out loss within 1 % of float32 at 3.85x fewer
    # bytes, and wins on a link-bound boundary (1.86x the samples/s at 100 Mbit/s), while on a compute-bound one
    # its encoding costs more than the bytes it saves: so float32, and int8 where the link is the bottleneck
    link_bound_compression: str = "int8"
    averaging_compression: str = "int8"
    precision: str = "fp32"
    backward: str = "stash"
    # the mean by default: exact and the fastest; with two clusters no aggregate can tell which member is hostile,
    # and with three the trimmed mean is the median (docs/averaging.md, "Aggregation")
    aggregation: str = "mean"
    lr_scaling: str = "none"
    divergence_factor: float = 10.0
    move_horizon_s: float = DEFAULT_MOVE_HORIZON_S
    steps: int = 300
    finished: bool = False
    invite_only: bool = False
    revoked: List[str] = field(default_factory=list)
    protocol: int = PROTOCOL_VERSION
    version: int = 1
    origin: float = 0.0

    def record(self, owner_key: RSAPrivateKey, run: str) -> dict:
        """The spec as its DHT record of run ``run`` (its name), signed by the run owner's key."""
        created = time.time()
        unsigned = dict(asdict(self), created=created, origin=self.origin or created, run=run,
                        owner=public_key_text(owner_key), signature="")
        return sign_spec(RunSpecRecord.parse_obj(unsigned).dict(), owner_key)

    @classmethod
    def from_record(cls, value: dict) -> "RunSpec":
        fields = {key: value[key] for key in cls.__dataclass_fields__ if key in value}
        return cls(**fields)

    def check_usable(self) -> "RunSpec":
        from ravnest_swarm.models import MODELS  # the zoo imports torch: observers read specs without it
        from ravnest_swarm.models.loading import is_entry_point

        if self.protocol != PROTOCOL_VERSION:
            raise UserError(f"the run uses protocol {self.protocol}, this ravnest-swarm speaks {PROTOCOL_VERSION}: "
                            f"install the matching version", exit_code=1)
        if self.model not in MODELS and not is_entry_point(self.model):
            raise UserError(f"the run trains model {self.model!r}, which this version lacks "
                            f"(it has {', '.join(MODELS)})", exit_code=1)
        return self

    def build_model(self, data: Optional[str]):
        """The run's model from this peer's code, on its copy of the data at ``data``, checked against the
        spec's layout and data hash: a one-line :class:`UserError` names the first difference."""
        from ravnest_swarm.models import first_difference, load_model, model_layout
        from ravnest_swarm.models.user_data import scan_data

        if self.data_hash and data is None:
            raise UserError(f"this run trains on its own data ({_size(self.data_bytes)}, sha256 {self.data_hash[:12]}): "
                            f"pass --data with your copy", exit_code=1)
        if data is not None and not self.data_hash:
            raise UserError(f"this run trains {self.model} on the model's own data: drop --data", exit_code=1)
        try:
            if data is not None:
                source = scan_data(data)
                if source.digest != self.data_hash:
                    raise UserError(f"your --data {source.path} ({_size(source.size)}, sha256 {source.digest[:12]}) "
                                    f"differs from the run's ({_size(self.data_bytes)}, sha256 {self.data_hash[:12]}): "
                                    f"get the run's copy", exit_code=1)
            model = load_model(self.model, self.model_config, data)
        except ValueError as e:
            raise UserError(f"cannot build this run's model: {e}", exit_code=1)
        difference = first_difference(model_layout(model), self.layout) if self.layout is not None else None
        if difference is not None:
            raise UserError(f"your code builds a different model from the run's {self.model}: {difference}; "
                            f"install the code the run was started with", exit_code=1)
        return model

    def check_agrees(self, requested: Optional[Dict]) -> "RunSpec":
        """The flags a joiner gave must match the run's spec: refuse rather than train something else."""
        differences = [f"{name}={value!r} (run has {getattr(self, name)!r})"
                       for name, value in (requested or {}).items() if value != getattr(self, name)]
        if differences:
            raise UserError(f"this run's spec disagrees with your flags: {', '.join(differences)}; "
                            f"drop the flags to follow the run, or choose another --run", exit_code=1)
        return self


def _size(count: int) -> str:
    return f"{count / 1e6:.1f} MB" if count >= 100_000 else f"{count} bytes"


def model_facts(model: str, model_config: str, data: Optional[str]) -> Dict:
    """What a new run's spec records of its model and data, besides their names: layout, data hash and size;
    a one-line :class:`UserError` when the model cannot be built here."""
    from ravnest_swarm.models import load_model, model_layout
    from ravnest_swarm.models.user_data import scan_data

    try:
        layout = model_layout(load_model(model, model_config, data))
        source = scan_data(data) if data is not None else None
    except ValueError as e:
        raise UserError(str(e))
    return dict(layout=[list(layer) for layer in layout], data_hash=source.digest if source else "",
                data_bytes=source.size if source else 0)


def spec_order(record: dict) -> Tuple[float, int, float]:
    """What makes one spec of an owner newer than another: the run it began (``origin``: an owner who starts a run of
    the same name anew has its specs, not a replay of the old run's last version, count), then its version, then
    when it was signed."""
    return record["origin"], record["version"], record["created"]


async def read_specs(node: DHTNode, run: str) -> Dict[str, dict]:
    """Each owner's newest signed spec of ``run`` (:func:`spec_order`), by fingerprint.

    Several owners appear when two people started runs of one name, or when a stranger signed a spec of
    their own: the run address (``name@fingerprint``) says which to follow (:func:`choose_spec`).
    """
    found = await node.get(spec_key(run), latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    newest: Dict[str, dict] = {}
    for item in found.value.values():
        owner = spec_owner(item.value)  # the validators checked it on the way in; this names the owner
        known = newest.get(owner)
        if owner is not None and item.value.get("run") == run and (
                known is None or spec_order(item.value) > spec_order(known)):
            newest[owner] = item.value
    return newest


async def keep_spec_alive(node: DHTNode, run: str, followed: dict, renew_before: float = SPEC_RENEW_BEFORE,
                          lifetime: float = SPEC_LIFETIME) -> bool:
    """Store ``followed`` (the owner-signed spec record of ``run`` this peer follows, as it is: nobody but the owner
    signs a spec) again under our own subkey, and on our backbones, where no copy of it outlives ``renew_before``
    seconds from now; whether we stored it."""
    found = await node.get(spec_key(run), latest=True)
    copies = found.value.values() if found is not None and isinstance(found.value, dict) else []
    latest = max((item.expiration_time for item in copies if item.value == followed), default=0.0)
    if latest >= get_dht_time() + renew_before:
        return False
    return await store_record(node, spec_key(run), followed, get_dht_time() + lifetime,
                              subkey=signing_validator(node).local_public_key)


def choose_spec(specs: Dict[str, dict], address: RunAddress, own: Optional[str] = None) -> Optional[dict]:
    """The spec record to follow among ``specs`` (by owner fingerprint), or None while there is none.

    :param address: the run's address; with an owner, only that owner's spec counts
    :param own: the fingerprint of our own owner key for this run, if we have one (we started the run)
    """
    if address.owner is not None:
        return specs.get(address.owner)
    if len(specs) == 1:
        return next(iter(specs.values()))
    if own in specs:
        return specs[own]
    if specs:
        owners = ", ".join(f"{address.name}@{owner}" for owner in sorted(specs))
        raise UserError(f"run {address.name!r} has specs signed by {len(specs)} owners ({owners}): join with the "
                        f"full address that the run's owner gave you", exit_code=1)
    return None


async def read_spec(node: DHTNode, address: RunAddress, own: Optional[str] = None) -> Optional[RunSpec]:
    """The spec the run at ``address`` follows (:func:`choose_spec`), or None while it has none."""
    chosen = choose_spec(await read_specs(node, address.name), address, own)
    return None if chosen is None else RunSpec.from_record(chosen)


async def ensure_spec(node: DHTNode, address: RunAddress, requested: Dict, wait: asyncio.Event,
                      on_wait=None, poll: float = 2.0, facts: Optional[Dict] = None,
                      owner_key_file: Optional[str] = None, on_start=None) -> Optional[Tuple[RunSpec, str]]:
    """The run's spec and its owner's fingerprint: create it from ``requested`` if the run has none, else check it
    agrees.

    :param requested: the spec fields the joiner gave explicitly (``model`` among them to create a run)
    :param facts: what a new spec records of the model and data (:func:`model_facts`)
    :param owner_key_file: where our owner key for this run is (created when we start the run); default
        ``owner.owner_key_path``
    :param on_start: called with the run's full address when we started the run (for the user to pass on)
    :param wait: set when the user stops us; without ``model``, or with another owner's address, we wait as a
        standby for the run to be started until then
    """
    key_file = owner_key_file or owner_key_path(address.name)
    existing = load_owner_key(key_file)
    own = None if existing is None else fingerprint(existing.get_public_key().to_bytes())
    while True:
        specs = await read_specs(node, address.name)
        chosen = choose_spec(specs, address, own)
        if chosen is not None:
            return RunSpec.from_record(chosen).check_usable().check_agrees(requested), spec_owner(chosen)
        if "model" in requested and not specs and address.owner in (None, own):
            existing = existing or load_or_create_owner_key(key_file)  # we start the run: we own it
            own = fingerprint(existing.get_public_key().to_bytes())
            record = RunSpec(**requested, **(facts or {})).check_usable().record(existing, address.name)
            if await store_record(node, spec_key(address.name), record, get_dht_time() + SPEC_LIFETIME,
                                  subkey=signing_validator(node).local_public_key):
                if on_start is not None:
                    on_start(str(RunAddress(address.name, own)))
            else:
                await asyncio.sleep(poll)  # no node took it (yet): try again, without spinning
            continue  # read back: if two owners raced, each follows its own (their addresses differ)
        if on_wait is not None:
            on_wait()
            on_wait = None  # said once: a line every poll would fill the screen while nobody starts the run
        try:
            await asyncio.wait_for(wait.wait(), poll)
        except asyncio.TimeoutError:
            continue
        return None  # stopped while waiting: a standby that leaves is no error
