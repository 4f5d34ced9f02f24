"""What one stage process does: :class:`StageConfig`, the settings the ``stage`` verb and a volunteer give a
:class:`~ravnest_swarm.pipeline.worker.StageWorker`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Optional, Tuple

from ravnest_swarm.codecs.codec import CODECS, is_pipeline_codec
from ravnest_swarm.pipeline import wire

SCHEDULES = ("async", "sync")
MODES = ("stash", "recompute")


@dataclass
class Neighbours:
    """The peers (base58 libp2p ids) a stage takes pipeline messages from, and whose endpoint records it trusts.

    Anyone can call a stage's handlers and write a well-formed record for any slot, so a stage that names its
    neighbours takes forwards (and the run's finish) only from ``previous`` and gradients only from ``next``,
    and resolves those two slots only to them. A volunteer names them from the adopted plan and follows each
    new plan (a standby that replaces a dead neighbour); ``bench pipeline`` from its stages' fixed identities.

    :param previous: the peer serving stage - 1 of our cluster (None: nobody, as for stage 0)
    :param next: the peer serving stage + 1 (None: nobody, as for the last stage)
    :param named: False for a stage that takes messages from any sender that addresses it: the hidden
      ``stage`` verb, which the pipeline tests start without a plan or known peer ids
    :param known: the other peers of the run whose records the volunteer has read: one that sends before we
      adopt the plan that makes it our neighbour (or after we adopted one that does not) is refused all the same,
      and counted as turned away, not as hostile input
    """

    previous: Optional[str] = None
    next: Optional[str] = None
    named: bool = True
    known: Collection[str] = field(default=(), compare=False, repr=False)

    def peer_of(self, own_stage: int, stage: int) -> Optional[str]:
        """The peer named for ``stage`` (our neighbour on either side), else None."""
        return self.previous if stage == own_stage - 1 else self.next if stage == own_stage + 1 else None

    def named_peer(self, own_stage: int, stage: int) -> Optional[str]:
        """The peer the plan names for ``stage`` beside ``own_stage``; None where it names none (a stage that
        names no neighbours takes whoever addresses it)."""
        return self.peer_of(own_stage, stage) if self.named else None


@dataclass
class StageConfig:
    """What one stage process does.

    :param run: run name (prefix of the DHT keys)
    :param cluster: this stage's cluster; it only talks to stages of the same cluster
    :param clusters: number of clusters (for sharding the data by sample id)
    :param previous_cluster: the number this stage's cluster had before a plan renumbered it in place
        (``StageWorker.follow_clusters``): messages that name it are still taken from its neighbours
    :param stage: this stage's index in the pipeline
    :param stages: number of stages
    :param model: the run's model (``models.load_model``: a zoo name or a user's ``module:function``)
    :param model_config: its settings (``layers=12,width=768``)
    :param data: this peer's copy of the run's ``--data`` (None: the model's own data)
    :param layers: the layer range ``[a, b)`` this stage builds
    :param microbatch_size: samples per microbatch (stage 0 draws them)
    :param microbatches: how many microbatches stage 0 injects before finishing the run
    :param max_in_flight: microbatches in flight per cluster (async schedule)
    :param schedule: ``async`` (step on every gradient) or ``sync`` (GPipe-style flush every step)
    :param microbatches_per_step: microbatches of one synchronous step
    :param lr: SGD learning rate
    :param optimizer: the inner optimizer (``optimizers.inner``: ``sgd``, ``momentum``, ``adamw``) and its
      ``weight_decay``
    :param divergence_factor: a loss above this many times the stage's level skips its step, and a few in a row
      restore the stage (``pipeline/guard.py``); 0: only a loss that is not finite does
    :param mode: ``stash`` (backward uses the weights of its forward) or ``recompute`` (current weights)
    :param seed: data shuffling seed
    :param microbatch_timeout: seconds after which a microbatch with no gradient back is dropped
    :param send_timeout: seconds a send keeps retrying (re-resolving the neighbour) before dropping
    :param heartbeat: seconds between endpoint renewals
    :param max_message_bytes: larger incoming messages are refused
    :param max_abs_value: activations or gradients with a larger magnitude (or NaN/Inf) are refused as poisoned
    :param compression: the codec this stage sends activations and gradients in (``codecs.CODECS``): ``none``,
      16 bits (``float16``, or ``meanstd16``: scaled by the tensor's mean and std first), or ``int8``, ``int6``,
      ``int4``, ``int3`` (blockwise, a scale per 64 values); each message names its
      codec, and receivers accept every one; ``a/b``: activations in ``a``, gradients in ``b``
    :param link_bound_compression: the stronger codec a boundary switches to while its link is the bottleneck
      (``link_codec.py``); "" never switches
    :param device: the torch device that holds this stage's layers, gradients and optimizer state (``cpu``,
      ``cuda:0``); what it sends and receives is on the host, so its neighbours' devices do not matter
    :param precision: the run's ``fp32``, ``bf16`` or ``fp16``: 16 bits run the forward under ``torch.autocast``
      (``devices.autocast_dtype``); weights, gradients and what travels stay in their own dtypes
    :param neighbours: who may send this stage messages (:class:`Neighbours`); by default anyone, as a bare
      ``stage`` process has no plan to name them from
    :param trace: record when each microbatch arrives and when its forward and backward start and end
      (``bench pipeline`` splits a round trip into queueing, compute and transit with it; off otherwise, as it
      grows with the run)
    """

    run: str
    stage: int
    stages: int
    model: str
    layers: Tuple[int, int]
    model_config: str = ""
    data: Optional[str] = None
    cluster: int = 0
    clusters: int = 1
    previous_cluster: Optional[int] = None
    microbatch_size: int = 16
    microbatches: int = 0
    max_in_flight: int = 4
    schedule: str = "async"
    microbatches_per_step: int = 4
    lr: float = 0.05
    optimizer: str = "sgd"
    weight_decay: float = 0.0
    divergence_factor: float = 10.0
    mode: str = "stash"
    seed: int = 0
    microbatch_timeout: float = 30.0
    send_timeout: float = 30.0
    heartbeat: float = 2.0
    max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES
    max_abs_value: float = 1e6
    compression: str = "none"
    link_bound_compression: str = ""
    device: str = "cpu"
    precision: str = "fp32"
    trace: bool = False
    neighbours: Neighbours = field(default_factory=lambda: Neighbours(named=False))


def check_config(config: StageConfig) -> None:
    """Refuse a schedule, mode or compression this stage does not know, before anything is built."""
    if config.schedule not in SCHEDULES or config.mode not in MODES or not is_pipeline_codec(config.compression) or \
            not (config.link_bound_compression == "" or is_pipeline_codec(config.link_bound_compression)):
        raise ValueError(f"schedule must be one of {SCHEDULES}, mode one of {MODES} and compression one of "
                         f"{tuple(CODECS)}, or two of them as forward/backward (link-bound compression too, or none)")
