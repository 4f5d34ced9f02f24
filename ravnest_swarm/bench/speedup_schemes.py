"""``bench speedup``'s schemes and what its report says of them.

A scheme is a named set of run-spec settings (:data:`SCHEMES`, or the user's ``name:key=value,...``:
:func:`parse_schemes`) that every K of the bench trains with. :func:`compare` turns each (scheme, K)'s measured
figures into what a user waits for: the wall time and samples to the target loss, and the ratios to K = 1 of the
same scheme and to the reference scheme at the same K, with the issue's targets met or not.
"""

from __future__ import annotations

import re
from dataclasses import fields
from typing import Any, Dict, Optional, Tuple

from rich.table import Table

from ravnest_swarm.bench.speedup_curve import time_to_target
from ravnest_swarm.errors import UserError
from ravnest_swarm.swarm.spec import RunSpec
from ravnest_swarm.swarm.spec_checks import check_spec_choices

# the run-spec settings a scheme may set (``JoinOptions`` carries each to the run it starts)
SCHEME_KEYS = ("optimizer", "lr", "weight_decay", "lr_schedule", "warmup_steps", "outer_optimizer", "outer_lr",
               "averaging_period", "averaging_overlap", "averaging_compression", "aggregation", "lr_scaling",
               "pipeline_compression", "max_in_flight")
# named schemes. today: what the swarm trained with before issue 30 (plain SGD, parameters averaged in float32
# while the stages stand still); new: a new run's defaults since (AdamW inside, the clusters' mean of int8
# pseudo-gradients with error feedback, rounds beside training; docs/averaging.md "Defaults"); diloco: the same with
# DiLoCo's Nesterov outer step, which "new" was until bench diloco measured the mean ahead (docs/benchmarks.md)
_DEFAULTS = RunSpec("mlp-digits")
SCHEMES: Dict[str, Dict[str, Any]] = {
    "today": dict(optimizer="sgd", lr=0.05, outer_optimizer="average", averaging_compression="none",
                  averaging_overlap=False),
    "new": dict(optimizer=_DEFAULTS.optimizer, lr=_DEFAULTS.lr, outer_optimizer=_DEFAULTS.outer_optimizer,
                averaging_compression=_DEFAULTS.averaging_compression, averaging_overlap=_DEFAULTS.averaging_overlap),
    "diloco": dict(optimizer="adamw", lr=0.002, outer_optimizer="nesterov", averaging_compression="int8",
                   averaging_overlap=True),
}
# the targets for K clusters against one: the wall time to the target loss (x sooner), samples/s (x), and
# where the machine's cores bound the rate, the share of a stage's time it stands still for averaging
SOONER_TARGETS = {2: 1.5, 4: 2.5}
RATE_TARGETS = {2: 1.6, 4: 3.2}
STOOD_STILL_TARGET = 0.05


def scheme_value(key: str, text: str) -> Any:
    """A scheme setting's text as the run spec's type for ``key`` (one of :data:`SCHEME_KEYS`)."""
    if key not in SCHEME_KEYS:
        raise UserError(f"--schemes: {key!r} is not a setting a scheme may change; one of {', '.join(SCHEME_KEYS)}")
    kind = type(next(field.default for field in fields(RunSpec) if field.name == key))
    if kind is bool:
        if text.lower() not in ("true", "false", "yes", "no", "on", "off", "1", "0"):
            raise UserError(f"--schemes: {key} is on or off (true/false), not {text!r}")
        return text.lower() in ("true", "yes", "on", "1")
    try:
        return kind(text)
    except ValueError:
        raise UserError(f"--schemes: {key} must be a {kind.__name__}, not {text!r}")


def parse_schemes(text: str) -> Dict[str, Dict[str, Any]]:
    """``"today,new"`` or ``"today,fast:optimizer=adamw,lr=0.003"`` -> {name: settings}, in order. A bare name is
    one of :data:`SCHEMES`; ``name:key=value`` starts from the named scheme (from ``today`` for a new name) and
    changes that setting, as does each ``key=value`` item after it (of the scheme before it). The first scheme is
    the reference."""
    schemes: Dict[str, Dict[str, Any]] = {}
    current: Optional[str] = None
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if "=" in item and ":" not in item.split("=", 1)[0]:  # a setting of the scheme before it
            if current is None:
                raise UserError(f"--schemes: {item!r} names no scheme; write name:{item}")
            key, value = (side.strip() for side in item.split("=", 1))
            schemes[current][key] = scheme_value(key, value)
            continue
        name, _, setting = item.partition(":")
        name = name.strip()
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{0,31}", name):
            raise UserError(f"--schemes: a scheme's name is a word like today or fast, not {name!r}")
        if name in schemes:
            raise UserError(f"--schemes names {name!r} twice")
        if not setting and name not in SCHEMES:
            raise UserError(f"--schemes: unknown scheme {name!r}: one of {', '.join(SCHEMES)}, or "
                            f"{name}:key=value,... for one of your own")
        schemes[name] = dict(SCHEMES.get(name, SCHEMES["today"]))
        current = name
        if setting:
            key, equals, value = setting.partition("=")
            if not equals:
                raise UserError(f"--schemes: {item!r} must be name:key=value")
            schemes[name][key.strip()] = scheme_value(key.strip(), value.strip())
    if not schemes:
        raise UserError("--schemes names no scheme: e.g. today,new")
    for name, settings in schemes.items():
        merged = RunSpec(model="-", **settings)
        try:
            check_spec_choices(merged.pipeline_compression, merged.backward, merged.aggregation, merged.optimizer,
                               merged.lr_schedule, merged.outer_optimizer, merged.lr_scaling,
                               averaging_compression=merged.averaging_compression)
        except UserError as e:
            raise UserError(f"--schemes {name}: {e}")
    return schemes


def parse_scheme(text: str) -> Tuple[str, Dict[str, Any]]:
    """``--scheme``: one scheme as ``bench speedup --schemes`` names it (``today``, ``new``, ``name:key=value,...``)."""
    try:
        schemes = parse_schemes(text)
    except UserError as e:
        raise UserError(str(e).replace("--schemes", "--scheme"))
    if len(schemes) != 1:
        raise UserError(f"--scheme names one scheme, not {len(schemes)}: {', '.join(schemes)}")
    return next(iter(schemes.items()))


def stood_still_share(shares: Optional[Dict[str, float]]) -> Optional[float]:
    """Of a stage's wall time (``WallTime`` shares) while it trained, the share it stood still for averaging: its
    downloads and plans (before it trains, or a move) are left out. None without shares."""
    if not shares:
        return None
    training = 1.0 - shares.get("download", 0.0) - shares.get("plan", 0.0)
    return round(shares.get("averaging", 0.0) / training, 4) if training > 0 else None


def ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    return None if numerator is None or not denominator else round(numerator / denominator, 3)


def compare(runs: Dict[str, Dict[int, Dict]], reference: str, target: float) -> Dict[str, Dict[str, Dict]]:
    """Each (scheme, K)'s figures against K = 1 of its scheme and the same K of the reference scheme: the wall time
    and samples to ``target`` (first point of its held-out curve at or below it), how many times sooner than
    K = 1 (its time over ours), samples/s and its ratios, the final loss, and the share stages stood still for
    averaging (the largest of any stage); then the issue's targets met or not (:data:`SOONER_TARGETS`)."""
    results: Dict[str, Dict[str, Dict]] = {}
    for scheme, by_k in runs.items():
        results[scheme] = {}
        for k, run in by_k.items():
            seconds, samples = time_to_target(run["curve"], target)
            alone, same_k = by_k[1], runs[reference][k]
            alone_seconds, reference_seconds = (time_to_target(other["curve"], target)[0] for other in (alone, same_k))
            stood_still = [share for share in run["stood_still_share"] if share is not None]
            results[scheme][str(k)] = dict(
                seconds_to_target=seconds, samples_to_target=samples,
                sooner_than_k1=ratio(alone_seconds, seconds), sooner_than_reference=ratio(reference_seconds, seconds),
                samples_per_s=run["samples_per_s"],
                samples_per_s_vs_k1=ratio(run["samples_per_s"], alone["samples_per_s"]),
                samples_per_s_vs_reference=ratio(run["samples_per_s"], same_k["samples_per_s"]),
                heldout_loss=run["heldout_loss"], heldout_loss_vs_target=ratio(run["heldout_loss"], target),
                heldout_accuracy=run["heldout_accuracy"], window_s=run["window_s"],
                stood_still_share=max(stood_still) if stood_still else None, averaging_share=run["averaging_share"])
            if k in SOONER_TARGETS:
                figures = results[scheme][str(k)]
                figures["targets"] = dict(
                    sooner=figures["sooner_than_k1"] is not None and figures["sooner_than_k1"] >= SOONER_TARGETS[k],
                    samples_per_s=figures["samples_per_s_vs_k1"] is not None
                    and figures["samples_per_s_vs_k1"] >= RATE_TARGETS[k],
                    stood_still=figures["stood_still_share"] is not None
                    and figures["stood_still_share"] < STOOD_STILL_TARGET)
    return results


def summary_table(report: Dict) -> Table:
    table = Table(title=f"bench speedup: {report['model']}, {report['stages']} stages per cluster, "
                        f"{report['samples']} samples per K, {report['cpus_per_peer'] or 'shared'} cores per peer; "
                        f"target: {report['reference']} K = 1's held-out loss at {report['target_samples']} samples, "
                        f"{report['target_loss']}")
    for column in ("scheme", "K", "s to target", "x sooner than K=1", "samples to target", "samples/s", "x K=1",
                   f"x {report['reference']}", "held-out loss", "stood still (max stage)", "averaging s/round",
                   "cores per peer", "machine busy cores"):
        table.add_column(column, justify="right")
    shown = lambda value: "-" if value is None else str(value)  # noqa: E731
    for scheme, by_k in report["results"].items():
        for key, figures in by_k.items():
            run = report["runs"][scheme][key]
            cores = [c for c in run["peer_cores"] if c is not None]
            table.add_row(scheme, key, shown(figures["seconds_to_target"]), shown(figures["sooner_than_k1"]),
                          shown(figures["samples_to_target"]), str(figures["samples_per_s"]),
                          shown(figures["samples_per_s_vs_k1"]), shown(figures["samples_per_s_vs_reference"]),
                          str(figures["heldout_loss"]), shown(figures["stood_still_share"]),
                          shown(run["averaging_round_s"]), f"{min(cores, default=0):.2f}-{max(cores, default=0):.2f}",
                          shown(run["machine_busy_cores"]))
    return table

