"""A new run's spec values, checked before anything starts: each wrong one is one line naming its flag, where it
would otherwise fail the spec record's schema once published, after the peer had measured itself."""

from __future__ import annotations

from typing import Any, Dict

from ravnest_swarm.errors import UserError
from ravnest_swarm.swarm.spec import LR_SCALINGS


def check_spec_choices(pipeline_compression: str, backward: str, aggregation: str = "mean", optimizer: str = "sgd",
                       lr_schedule: str = "constant", outer_optimizer: str = "average", lr_scaling: str = "none",
                       link_bound_compression: str = "", averaging_compression: str = "none") -> None:
    """The spec's named choices, checked before a run is started with them: a wrong one is one line naming its flag."""
    from ravnest_swarm.averaging.robust import AGGREGATIONS
    from ravnest_swarm.optimizers.inner import INNER_OPTIMIZERS, LR_SCHEDULES
    from ravnest_swarm.optimizers.outer import OUTER_OPTIMIZERS
    from ravnest_swarm.pipeline.stage import MODES
    from ravnest_swarm.codecs.codec import CODECS, is_pipeline_codec

    for flag, value in (("--pipeline-compression", pipeline_compression),
                        ("--link-bound-compression", link_bound_compression)):
        if value and not is_pipeline_codec(value) or flag == "--pipeline-compression" and not value:
            raise UserError(f"{flag} must be one of {', '.join(CODECS)}, or two of them as forward/backward "
                            f"(int4/int3), not {value!r}")
    if averaging_compression not in CODECS:
        raise UserError(f"--averaging-compression must be one of {', '.join(CODECS)}, not {averaging_compression!r}")
    for flag, value, choices in (("--backward", backward, MODES), ("--aggregation", aggregation, AGGREGATIONS),
                                 ("--optimizer", optimizer, INNER_OPTIMIZERS),
                                 ("--outer-optimizer", outer_optimizer, OUTER_OPTIMIZERS),
                                 ("--lr-schedule", lr_schedule, LR_SCHEDULES), ("--lr-scaling", lr_scaling, LR_SCALINGS)):
        if value not in choices:
            raise UserError(f"{flag} must be one of {', '.join(choices)}, not {value!r}")


def check_spec_values(values: Dict[str, Any]) -> None:
    """The values a new run's spec would hold (flags, and the model's facts: its layout), checked against the spec
    record's bounds before anything starts. Out of them, the spec failed its own schema when it was published, after
    the peer had measured itself: three lines of a pydantic error (``--lr 20``, ``--averaging-period 2000000``, a
    ``--model-config`` of 300 characters, a GPT of 2,000 layers), and every peer of ``local`` died that way."""
    from ravnest_swarm.membership.records import RunSpecRecord

    for name, value in values.items():
        field = RunSpecRecord.__fields__.get(name)
        if field is None or value is None or name in ("version", "origin", "protocol", "created"):
            continue
        _, error = field.validate(value, {}, loc=name)
        if error is not None:
            errors = error if isinstance(error, list) else [error]
            shown = "the model's layout" if name == "layout" else f"--{name.replace('_', '-')} {str(value)[:80]}"
            raise UserError(f"{shown}: {errors[0].exc} (the run spec's bound)")


def scan_user_data(data: str) -> None:
    """A ``--data`` directory read through (and hashed), its problems as one line."""
    from ravnest_swarm.models.user_data import scan_data

    try:
        scan_data(data)
    except ValueError as e:
        raise UserError(str(e))
