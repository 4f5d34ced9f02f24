"""The ``ravnest-swarm`` command: a thin layer of flags over library code. Each verb calls one library function.

Over 400 lines because it declares every verb's flags and their help (21 verbs, two of them hidden test
peers); a verb's body only builds the library's options object and makes that one call.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from typing import List, Optional

import typer
# typer 0.29 vendors click; its usage errors are caught in main() to print them as one line
from typer._click import exceptions as click_exceptions
from rich.console import Console

from ravnest_swarm.errors import UserError, print_error
from ravnest_swarm.lifecycle import (configure_logging, log_to_file, run_async, run_blocking, survive_a_closed_terminal,
                                     unexpected_error_as_one_line)

# click's plain help, not typer's rich panels: typer 0.29's panels show every flag as taking a value
# ("--verbose <bool>", even "--help <bool>")
HELP_SETTINGS = dict(rich_markup_mode=None, context_settings={"help_option_names": ["-h", "--help"]})
app = typer.Typer(
    help="Train one neural network together on volunteers' computers (Ravnest + DeDLOC over hivemind).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    **HELP_SETTINGS,
)
bench_app = typer.Typer(help="Benchmarks: JSON figures, comparisons run side by side in one process.\n\n"
                             "\b\nExample:\n  ravnest-swarm bench pipeline --json",
                        no_args_is_help=True, **HELP_SETTINGS)
app.add_typer(bench_app, name="bench")


def _print_version(requested: bool) -> None:
    if requested:
        from ravnest_swarm import __version__

        print(f"ravnest-swarm {__version__}")
        raise typer.Exit()


# the top-level options, before any verb
@app.callback()
def _top_level(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                            help="Print the version and exit.")):
    pass


InitialPeers = typer.Option(..., "--initial-peers", help="Full multiaddr of a backbone (/ip4/.../tcp/PORT/p2p/ID); repeatable.")
Verbose = typer.Option(False, "--verbose", help="Show hivemind's info and warning lines too, not only its errors.")
LogFile = typer.Option(None, "--log-file", help="Append every log line to this file instead of the terminal (the "
                       "live view shows the latest warnings below it either way).")


def _initial_peers(values: List[str]):
    from ravnest_swarm.net.node import parse_maddrs

    return parse_maddrs(values)


@app.command()
def backbone(
    host_maddrs: List[str] = typer.Option(["/ip4/0.0.0.0/tcp/31337"], "--host-maddrs", help="Where to listen."),
    announce_maddrs: Optional[List[str]] = typer.Option(None, "--announce-maddrs", help="Public addresses to announce."),
    identity: Optional[str] = typer.Option(None, "--identity", help="Private key file; created on first run, reused after."),
    initial_peers: Optional[List[str]] = typer.Option(None, "--initial-peers", help="Other backbones to join."),
    run: Optional[List[str]] = typer.Option(None, "--run", help="Also validate this run's records in our storage (name, or name@owner to refuse specs not signed by its owner); repeatable."),
    timeout: float = typer.Option(15.0, "--timeout", min=1.0, help="Seconds to wait for p2pd and initial peers."),
    verbose: bool = Verbose,
):
    """Run a backbone peer: a DHT node and relay with a stable identity. Prints its multiaddrs, one per line.

    \b
    Example:
      ravnest-swarm backbone --identity ./backbone.key --announce-maddrs /ip4/203.0.113.5/tcp/31337
    """
    from ravnest_swarm.membership.backbone import BackboneOptions, run_backbone_process

    sys.exit(run_backbone_process(BackboneOptions(host_maddrs, announce_maddrs, identity, initial_peers or [], run or [],
                                                  timeout, verbose)))


@app.command()
def join(
    initial_peers: List[str] = InitialPeers,
    run: str = typer.Option(..., "--run", help="Run address: name@owner as the peer that started the run printed "
                            "it (a bare name trusts the only owner it finds, or starts a run you own)."),
    name: str = typer.Option(..., "--name", help="Name shown to others (<= 64 characters)."),
    ram_gb: Optional[float] = typer.Option(None, "--ram-gb", min=0.0, help="Override measured RAM (GB)."),
    max_ram_gb: Optional[float] = typer.Option(None, "--max-ram-gb", min=0.0, help="Cap on RAM offered (GB)."),
    gflops: Optional[float] = typer.Option(None, "--gflops", min=0.0, help="Override measured GFLOP/s."),
    bandwidth_mbps: Optional[float] = typer.Option(None, "--bandwidth-mbps", min=0.0, help="Override measured Mbit/s."),
    heartbeat: float = typer.Option(5.0, "--heartbeat", min=0.5, max=600.0, help="Seconds between record "
                                   "renewals; records expire after three (slower beyond 500 peers)."),
    timeout: float = typer.Option(15.0, "--timeout", min=1.0, help="Seconds to wait for initial peers, per attempt."),
    patience: float = typer.Option(300.0, "--patience", min=0.0, help="Seconds to keep trying while no initial "
                                   "peer answers (a backbone still starting, or busy), with backoff."),
    host_maddrs: List[str] = typer.Option(["/ip4/0.0.0.0/tcp/0"], "--host-maddrs", help="Where to listen."),
    announce_maddrs: Optional[List[str]] = typer.Option(None, "--announce-maddrs", help="Addresses to announce."),
    no_dashboard: bool = typer.Option(False, "--no-dashboard", help="Plain log lines instead of a live view."),
    # the planner test mode's options (docs/planning.md), hidden from volunteers
    model_gb: Optional[float] = typer.Option(None, "--model-gb", hidden=True, help="Take part in planning rounds for a model needing this many GB."),
    gflop_per_sample: float = typer.Option(1.0, "--gflop-per-sample", hidden=True, help="Planning: forward+backward GFLOP per sample."),
    activation_mb: float = typer.Option(0.0, "--activation-mb", hidden=True, help="Planning: activations between stages per sample, MB."),
    max_stages: int = typer.Option(8, "--max-stages", min=1, max=64, help="Planning: most peers per cluster."),
    min_peers: int = typer.Option(2, "--min-peers", min=1, help="Planning: open the first round once this many peers are live."),
    round_period: float = typer.Option(600.0, "--round-period", min=0.0, help="Planning: revise the plan after this many seconds (0: never)."),
    round_seconds: float = typer.Option(10.0, "--round-seconds", min=3.0, help="Planning: seconds from a round's opening to its deadline."),
    num_layers: int = typer.Option(32, "--num-layers", min=1, hidden=True, help="Planning: identical layers cut into stage ranges."),
    model: Optional[str] = typer.Option(None, "--model", help="Start the run with this model if it has no spec yet: "
                                        "mlp-digits, gpt, gpt-tiny, gpt-85m, gpt-350m, or your own module:function "
                                        "(docs/models.md)."),
    model_config: Optional[str] = typer.Option(None, "--model-config", help="Run spec: the model's settings, "
                                               "e.g. layers=12,width=768,heads=12,context=256."),
    data: Optional[str] = typer.Option(None, "--data", help="Train on this directory (text files, or .npy arrays; "
                                       "docs/models.md) instead of the model's own data; every peer needs a copy."),
    lr: Optional[float] = typer.Option(None, "--lr", min=0.0, help="Run spec: learning rate (default 0.002)."),
    microbatch_size: Optional[int] = typer.Option(None, "--microbatch-size", min=1, max=4096, help="Run spec: samples per microbatch."),
    max_in_flight: Optional[int] = typer.Option(None, "--max-in-flight", min=1, max=1024, help="Run spec: microbatches in flight per cluster."),
    averaging_period: Optional[int] = typer.Option(None, "--averaging-period", min=1, help="Run spec: optimizer steps between averaging rounds."),
    averaging_overlap: Optional[bool] = typer.Option(None, "--averaging-overlap/--no-averaging-overlap", help="Run "
                                                     "spec: stages train on while their averaging round runs and "
                                                     "apply it one round late (default: on; --no-averaging-overlap: "
                                                     "they stand still, docs/averaging.md)."),
    pipeline_compression: Optional[str] = typer.Option(None, "--pipeline-compression", help="Run spec: the codec of "
                                                       "activations and gradients between stages: none, float16, meanstd16, "
                                                       "int8, int6, int4 or int3 (docs/pipeline.md)."),
    link_bound_compression: Optional[str] = typer.Option(None, "--link-bound-compression", help="Run spec: the "
                                                         "stronger codec a stage boundary switches to while its link is "
                                                         "the bottleneck (default int8; the run's own codec: never)."),
    averaging_compression: Optional[str] = typer.Option(None, "--averaging-compression", help="Run spec: the codec "
                                                        "of the averaging rings: none (parameters in float32), or int8 "
                                                        "(default), int4 ...: pseudo-gradients with error feedback "
                                                        "(docs/averaging.md)."),
    steps: Optional[int] = typer.Option(None, "--steps", min=0, max=2**53, help="Run spec: the run's length, "
                                        "optimizer steps of every stage (default 300); every volunteer trains until the "
                                        "run reaches it. 0: open-ended, until its owner runs update-spec --finish."),
    precision: Optional[str] = typer.Option(None, "--precision", help="Run spec: fp32 (default), or bf16 or fp16 "
                                            "autocast of the stages' forward (fp16 runs as bf16 on a CPU)."),
    backward: Optional[str] = typer.Option(None, "--backward", help="Run spec: stash (default: keep each microbatch's "
                                           "activations and weights until its gradient returns) or recompute (keep "
                                           "its input only and redo the forward: less memory, more compute)."),
    aggregation: Optional[str] = typer.Option(None, "--aggregation", help="Run spec: how averaging combines the "
                                              "clusters' values: mean (default), or trimmed_mean or centered_clip, "
                                              "which bound what one hostile peer of a ring can do (docs/averaging.md)."),
    optimizer: Optional[str] = typer.Option(None, "--optimizer", help="Run spec: the stages' inner optimizer: sgd, "
                                            "momentum or adamw (default; docs/swarm.md)."),
    weight_decay: Optional[float] = typer.Option(None, "--weight-decay", min=0.0, max=10.0, help="Run spec: its "
                                                 "weight decay (default 0)."),
    lr_schedule: Optional[str] = typer.Option(None, "--lr-schedule", help="Run spec: constant (default), or cosine: "
                                              "a warm-up, then a cosine decay to a tenth over the run's length."),
    warmup_steps: Optional[int] = typer.Option(None, "--warmup-steps", min=0, help="Run spec: steps of linear lr "
                                               "warm-up from the run's start (default 0)."),
    outer_optimizer: Optional[str] = typer.Option(None, "--outer-optimizer", help="Run spec: what an averaging "
                                                  "round's mean becomes: average (the default: take it) or "
                                                  "nesterov (DiLoCo's outer step on the averaged pseudo-gradient)."),
    outer_lr: Optional[float] = typer.Option(None, "--outer-lr", min=0.0, max=10.0, help="Run spec: the outer "
                                             "step's lr (default 0.7)."),
    lr_scaling: Optional[str] = typer.Option(None, "--lr-scaling", help="Run spec: how a cluster's lr follows the "
                                             "number of clusters: none (default), sqrt, linear or warmup "
                                             "(docs/swarm.md; `bench lr-scaling` compares them)."),
    divergence_factor: Optional[float] = typer.Option(None, "--divergence-factor", min=0.0, max=1e6, help="Run "
                                                      "spec: a loss above this many times a stage's level skips its "
                                                      "step, three in a row restore its last good state (default 10; "
                                                      "0: only a loss that is not finite)."),
    move_horizon: Optional[float] = typer.Option(None, "--move-horizon", min=1.0, max=1e7, help="Run spec: seconds "
                                                 "within which a new plan must pay back moving layers with its gain "
                                                 "in throughput, or the plan in force stays (default 600)."),
    device: str = typer.Option("auto", "--device", help="Where this peer's stages compute: auto (the first GPU "
                               "torch sees, else the CPU), cpu, or cuda (cuda:N)."),
    device_memory_gb: Optional[float] = typer.Option(None, "--device-memory-gb", min=0.0, help="Override the "
                                                     "memory (GB) the planner sizes our stages by (default: the "
                                                     "GPU's total memory, or the RAM offered on the CPU)."),
    handover_timeout: float = typer.Option(90.0, "--handover-timeout", min=0.0, help="Seconds a leaving peer keeps "
                                           "serving its layers until another peer has them (then: a checkpoint)."),
    checkpoint_dir: Optional[str] = typer.Option(None, "--checkpoint-dir", help="Write this peer's checkpoint here."),
    checkpoint_every: int = typer.Option(50, "--checkpoint-every", min=1, help="Steps between checkpoints."),
    resume: bool = typer.Option(False, "--resume", help="Continue from this peer's checkpoint in --checkpoint-dir."),
    identity: Optional[str] = typer.Option(None, "--identity", help="Private key file (RSA, created on the first start): a stable peer id across restarts, and the key this peer signs its records with."),
    owner_key: Optional[str] = typer.Option(None, "--owner-key", help="The run owner's key file, for a run you start "
                                            "(default ~/.config/ravnest-swarm/owners/RUN.key)."),
    ticket: Optional[str] = typer.Option(None, "--ticket", help="Your admission ticket to an invite-only run (the "
                                         "text `ravnest-swarm invite` printed for you, or a file holding it)."),
    invite_only: Optional[bool] = typer.Option(None, "--invite-only", help="Run spec: only peers with a ticket you "
                                               "sign (`ravnest-swarm invite`) take part (docs/security.md)."),
    snapshot_dir: Optional[str] = typer.Option(None, "--snapshot-dir", help="Append the run's figures (loss, "
                                               "samples/s, peers, clusters, averaging rounds) to DIR/metrics.jsonl "
                                               "every heartbeat (`ravnest-swarm plot DIR`)."),
    snapshot_every: int = typer.Option(0, "--snapshot-every", min=0, help="Also export the run to "
                                       "DIR/snapshot-STEP every this many steps, keeping the last 3 (0: never)."),
    init_from: Optional[str] = typer.Option(None, "--init-from", help="An export (a snapshot) whose layers fill those "
                                            "nobody serves, at their steps, instead of fresh weights: a new run from "
                                            "it, or a stage restarted after all its holders left."),
    report: Optional[str] = typer.Option(None, "--report", hidden=True, help="When the run is finished, write our "
                                         "stage's timings here (JSON; bench speedup)."),
    log_file: Optional[str] = LogFile,
    verbose: bool = Verbose,
):
    """Join a run as a volunteer: measure, advertise, get placed, train a stage, average, leave on Ctrl-C/SIGTERM.

    Without --model the peer follows the run's spec, waiting as a standby until someone starts the run.
    The options of the planner test mode, in which a peer only takes part in planning rounds (--model-gb
    and others), are hidden: see docs/planning.md.

    \b
    Example:
      ravnest-swarm join --run demo --name my-pc \\
          --initial-peers /ip4/203.0.113.5/tcp/31337/p2p/Qm...
    """
    from ravnest_swarm.swarm.join import JoinOptions, run_join
    from ravnest_swarm.swarm.spec import length_from_option

    steps = length_from_option(steps)
    sys.exit(run_join(JoinOptions(
        initial_peers=initial_peers, run=run, name=name, ram_gb=ram_gb, max_ram_gb=max_ram_gb, gflops=gflops,
        bandwidth_mbps=bandwidth_mbps, device=device, device_memory_gb=device_memory_gb, heartbeat=heartbeat,
        timeout=timeout, patience=patience, host_maddrs=host_maddrs, announce_maddrs=announce_maddrs, identity=identity,
        owner_key=owner_key, ticket=ticket, invite_only=invite_only, model=model,
        model_config=model_config, lr=lr, microbatch_size=microbatch_size, max_in_flight=max_in_flight,
        averaging_period=averaging_period, averaging_overlap=averaging_overlap,
        pipeline_compression=pipeline_compression, link_bound_compression=link_bound_compression,
        averaging_compression=averaging_compression, steps=steps,
        precision=precision, backward=backward, aggregation=aggregation, lr_scaling=lr_scaling, optimizer=optimizer,
        weight_decay=weight_decay, lr_schedule=lr_schedule, warmup_steps=warmup_steps, outer_optimizer=outer_optimizer,
        outer_lr=outer_lr,
        divergence_factor=divergence_factor, move_horizon_s=move_horizon, data=data, handover_timeout=handover_timeout,
        checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, resume=resume, report=report,
        snapshot_dir=snapshot_dir, snapshot_every=snapshot_every, init_from=init_from,
        model_gb=model_gb, gflop_per_sample=gflop_per_sample, activation_mb=activation_mb, max_stages=max_stages,
        min_peers=min_peers, round_period=round_period, round_seconds=round_seconds, num_layers=num_layers,
        dashboard=not no_dashboard, log_file=log_file, verbose=verbose)))


@app.command()
def status(
    initial_peers: List[str] = InitialPeers,
    run: str = typer.Option(..., "--run", help="Run name or address (name@owner)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document and exit."),
    watch: bool = typer.Option(False, "--watch", help="The live dashboard (docs/dashboard.md) until Ctrl-C."),
    show_all: bool = typer.Option(False, "--all", help="A row for every peer (without: at most a screenful, the "
                                                       "peers that matter, under a line adding up the run)."),
    timeout: float = typer.Option(15.0, "--timeout", min=1.0),
    verbose: bool = Verbose,
):
    """Observe a run (DHT client, trains nothing): its summary and a table of its peers, --json, or --watch.

    \b
    Example:
      ravnest-swarm status --run demo --watch \\
          --initial-peers /ip4/203.0.113.5/tcp/31337/p2p/Qm...
    """
    configure_logging(verbose)
    from ravnest_swarm.swarm.status import show_status

    sys.exit(run_async(show_status(initial_peers, run, as_json, watch, timeout, show_all)))


@app.command("update-spec")
def update_spec(
    initial_peers: List[str] = InitialPeers,
    run: str = typer.Option(..., "--run", help="Run name or address (name@owner)."),
    lr: Optional[float] = typer.Option(None, "--lr", min=0.0, max=10.0, help="The run's new learning rate."),
    steps: Optional[int] = typer.Option(None, "--steps", min=0, max=2**53, help="The run's new length: stages still "
                                        "training train to it (0: open-ended). A finished run cannot be extended."),
    finish: bool = typer.Option(False, "--finish", help="End the run: training peers stop, and status says it is "
                                "finished even after every peer has left."),
    invite_only: Optional[bool] = typer.Option(None, "--invite-only/--open", help="Admit only peers with a ticket "
                                               "(`ravnest-swarm invite`), or anyone again."),
    revoke: Optional[List[str]] = typer.Option(None, "--revoke", help="Revoke this ticket id (as `invite` printed "
                                               "it): its peer is dropped by every peer and leaves. Repeatable."),
    owner_key: Optional[str] = typer.Option(None, "--owner-key", help="The run owner's key file (default "
                                            "~/.config/ravnest-swarm/owners/RUN.key)."),
    timeout: float = typer.Option(15.0, "--timeout", min=1.0),
    verbose: bool = Verbose,
):
    """As the run's owner, publish a new version of its spec (lr, length, or its end); running peers follow it
    within a heartbeat or two. Nobody else can.

    \b
    Example:
      ravnest-swarm update-spec --run demo@0123456789abcdef --lr 0.02 \\
          --initial-peers /ip4/203.0.113.5/tcp/31337/p2p/Qm...
    """
    configure_logging(verbose)
    from ravnest_swarm.swarm.spec_versions import update_spec as publish

    from ravnest_swarm.swarm.spec import length_from_option

    changes = {name: value for name, value in (("lr", lr), ("steps", length_from_option(steps)),
                                               ("invite_only", invite_only)) if value is not None}
    if finish:
        changes["finished"] = True
    sys.exit(run_async(publish(initial_peers, run, changes, owner_key, timeout, revoke or [])))


@app.command()
def invite(
    run: str = typer.Option(..., "--run", help="The run's address (name@owner), as `join` printed it when it "
                            "started the run."),
    peer: Optional[str] = typer.Option(None, "--peer", help="The peer id the ticket admits (the volunteer's, fixed "
                                       "by its `--identity`); without: any peer id, until it expires."),
    expires: str = typer.Option("30d", "--expires", help="A duration (90s, 30m, 12h, 7d, 2w) or a time "
                                "(2026-12-31T18:00, UTC)."),
    owner_key: Optional[str] = typer.Option(None, "--owner-key", help="The run owner's key file (default "
                                            "~/.config/ravnest-swarm/owners/RUN.key)."),
    verbose: bool = Verbose,
):
    """As the run's owner, sign an admission ticket to an invite-only run (offline: nothing is published). Prints
    the ticket on stdout, for the volunteer's `join --ticket`, and its id on stderr, for `update-spec --revoke`.

    \b
    Example:
      ravnest-swarm invite --run demo@0123456789abcdef --peer QmVolunteer... --expires 7d
    """
    configure_logging(verbose)
    from ravnest_swarm.swarm.admission import print_invite

    sys.exit(run_blocking(lambda: print_invite(run, peer, expires, owner_key)))


@app.command()
def export(
    initial_peers: List[str] = InitialPeers,
    run: str = typer.Option(..., "--run", help="Run address (name@owner; a bare name trusts the only owner it finds)."),
    out: str = typer.Option(..., "--out", help="Directory to write model.safetensors and model.json to (created)."),
    timeout: float = typer.Option(15.0, "--timeout", min=1.0, help="Seconds to wait for the initial peers and each "
                                  "DHT read."),
    transfer_timeout: float = typer.Option(120.0, "--transfer-timeout", min=1.0, help="Seconds one holder may take "
                                           "to send one layer."),
    verbose: bool = Verbose,
):
    """Download the run's trained model from the peers that hold its layers, layer by layer, into a directory.

    Each layer is believed as a joining stage believes it (two holders serving the same averaged copy where
    two or more hold it); model.json names the step of each layer and who served it. Use the result with
    `ravnest-swarm evaluate DIR`, `ravnest-swarm sample DIR` or ravnest_swarm.load_model(DIR).

    \b
    Example:
      ravnest-swarm export --run demo@0123456789abcdef --out ./demo-model \\
          --initial-peers /ip4/203.0.113.5/tcp/31337/p2p/Qm...
    """
    configure_logging(verbose)
    if not verbose:  # a route to each holder is a join log's NAT diagnosis; here it broke the progress bars apart
        logging.getLogger("ravnest_swarm.net.routes").setLevel(logging.WARNING)
    from ravnest_swarm.swarm.export import ExportOptions, run_export

    sys.exit(run_async(run_export(ExportOptions(initial_peers, run, out, timeout, transfer_timeout))))


@app.command()
def evaluate(
    directory: str = typer.Argument(..., metavar="DIR", help="An export (`ravnest-swarm export`, `local --export`)."),
    data: Optional[str] = typer.Option(None, "--data", help="Evaluate on this directory's held-out part (as --data of "
                                       "join) instead of the model's own data; needed for a run trained on its own."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of a sentence."),
):
    """Held-out loss and accuracy of an exported model, as `local`'s summary computes them.

    \b
    Example:
      ravnest-swarm evaluate ./demo-model
    """
    configure_logging(False)
    from ravnest_swarm.swarm.exported import evaluate_export

    sys.exit(run_blocking(lambda: evaluate_export(directory, data, as_json)))


@app.command()
def sample(
    directory: str = typer.Argument(..., metavar="DIR", help="An export of a byte-level GPT."),
    prompt: str = typer.Option("", "--prompt", help="The text to continue."),
    tokens: int = typer.Option(200, "--tokens", min=1, max=100_000, help="Bytes to generate."),
    temperature: float = typer.Option(0.8, "--temperature", min=0.0, max=10.0, help="0: the likeliest byte each "
                                      "time; higher: more varied."),
    seed: int = typer.Option(0, "--seed", help="Seed of the sampling."),
):
    """Generate text with an exported byte-level GPT (gpt, gpt-tiny, gpt-85m, gpt-350m): the prompt and its sequel.

    \b
    Example:
      ravnest-swarm sample ./demo-model --prompt "def main(" --tokens 300
    """
    configure_logging(False)
    from ravnest_swarm.swarm.exported import sample_export

    sys.exit(run_blocking(lambda: sample_export(directory, prompt, tokens, temperature, seed)))


@app.command()
def plot(
    directory: str = typer.Argument(..., metavar="DIR", help="A --snapshot-dir of join or local (its metrics.jsonl)."),
    out: Optional[str] = typer.Option(None, "--out", help="The PNG to write (default DIR/run.png)."),
    as_json: bool = typer.Option(False, "--json", help="Print the series drawn as one JSON object."),
):
    """Draw a run's loss and samples/s over time to a PNG, from the figures a peer appended to DIR/metrics.jsonl.

    \b
    Example:
      ravnest-swarm local --snapshot-dir ./history && ravnest-swarm plot ./history
    """
    configure_logging(False)
    from ravnest_swarm.swarm.metrics import run_plot

    sys.exit(run_blocking(lambda: run_plot(directory, out, as_json)))


@app.command()
def local(
    peers: int = typer.Option(6, "--peers", min=2, max=30, help="Volunteers to start on this machine."),
    steps: int = typer.Option(300, "--steps", min=1, help="Optimizer steps every stage trains for."),
    model: str = typer.Option("mlp-digits", "--model", help="mlp-digits, gpt, gpt-tiny, gpt-85m, gpt-350m, or your "
                              "own module:function (docs/models.md)."),
    model_config: str = typer.Option("", "--model-config", help="The model's settings, e.g. layers=4,width=256."),
    data: Optional[str] = typer.Option(None, "--data", help="Train on this directory (text files, or .npy arrays) "
                                       "instead of the model's own data."),
    chaos: bool = typer.Option(False, "--chaos", help="SIGKILL a training stage partway and start one more peer late."),
    averaging_period: int = typer.Option(25, "--averaging-period", min=1, help="Optimizer steps between averaging rounds."),
    averaging_overlap: bool = typer.Option(True, "--averaging-overlap/--no-averaging-overlap", help="Stages train on "
                                           "while their averaging round runs (docs/averaging.md)."),
    pipeline_compression: str = typer.Option("none", "--pipeline-compression", help="The codec of activations "
                                             "and gradients between stages: none, float16, meanstd16, int8, int6, "
                                             "int4 or int3 (docs/pipeline.md)."),
    link_bound_compression: str = typer.Option("int8", "--link-bound-compression", help="The stronger codec a "
                                               "stage boundary switches to while its link is the bottleneck (the run's "
                                               "own codec: never)."),
    averaging_compression: str = typer.Option("int8", "--averaging-compression", help="The codec of the averaging "
                                              "rings: none (parameters in float32), or int8, int4 ...: "
                                              "pseudo-gradients with error feedback (docs/averaging.md)."),
    time_limit: float = typer.Option(900.0, "--time-limit", min=10.0, help="Stop after this many seconds regardless."),
    checkpoint_dir: Optional[str] = typer.Option(None, "--checkpoint-dir", help="Keep the peers' checkpoints here."),
    checkpoint_every: int = typer.Option(50, "--checkpoint-every", min=1, help="Steps between a stage's checkpoints."),
    resume: bool = typer.Option(False, "--resume", help="Restart every peer from its checkpoint in --checkpoint-dir."),
    no_dashboard: bool = typer.Option(False, "--no-dashboard", help="No live dashboard."),
    as_json: bool = typer.Option(False, "--json", help="Also print the summary as one JSON object, on stdout's last line."),
    precision: str = typer.Option("fp32", "--precision", help="fp32, or bf16 or fp16 autocast of the stages' forward."),
    backward: str = typer.Option("stash", "--backward", help="stash, or recompute: less memory, more compute."),
    microbatch_size: int = typer.Option(32, "--microbatch-size", min=1, max=4096, help="Samples per microbatch."),
    max_in_flight: int = typer.Option(2, "--max-in-flight", min=1, max=1024, help="Microbatches in flight per "
                                      "cluster: the planner counts at most this many of a cluster's stages busy."),
    lr: float = typer.Option(0.002, "--lr", min=0.0, max=10.0, help="Learning rate."),
    optimizer: str = typer.Option("adamw", "--optimizer", help="The stages' inner optimizer: sgd, momentum or adamw."),
    weight_decay: float = typer.Option(0.0, "--weight-decay", min=0.0, max=10.0, help="Its weight decay."),
    lr_schedule: str = typer.Option("constant", "--lr-schedule", help="constant, or cosine (warm-up, then a cosine "
                                    "decay over the run)."),
    warmup_steps: int = typer.Option(0, "--warmup-steps", min=0, help="Steps of linear lr warm-up from the start."),
    outer_optimizer: str = typer.Option("average", "--outer-optimizer", help="What an averaging round's mean "
                                        "becomes: average (take it) or nesterov (DiLoCo's outer step)."),
    outer_lr: float = typer.Option(0.7, "--outer-lr", min=0.0, max=10.0, help="The outer step's lr (nesterov)."),
    max_ram_gb: Optional[float] = typer.Option(None, "--max-ram-gb", min=0.0, help="Every peer offers at most this "
                                               "much RAM (GB), measured; by default peers offer 0.4-0.7 of the model."),
    device: str = typer.Option("auto", "--device", help="Where every peer computes: auto (the first GPU torch sees, "
                               "else the CPU), cpu, or cuda (cuda:N)."),
    export_dir: Optional[str] = typer.Option(None, "--export", help="At the end, export the trained model to this "
                                             "directory (as `ravnest-swarm export` does from a swarm)."),
    snapshot_dir: Optional[str] = typer.Option(None, "--snapshot-dir", help="Append the run's figures to "
                                               "DIR/metrics.jsonl every second (`ravnest-swarm plot DIR`)."),
    log_file: Optional[str] = LogFile,
):
    """Run a whole swarm here: a backbone and N volunteers on 127.0.0.1, with the dashboard; Ctrl-C stops all.

    \b
    Example:
      ravnest-swarm local --peers 4 --steps 100 --checkpoint-dir ./ckpt
    """
    configure_logging(False)

    async def main():
        from ravnest_swarm.devices import check_precision, resolve_device
        from ravnest_swarm.swarm.local import LocalOptions, run_local
        from ravnest_swarm.swarm.spec import RunSpec
        from ravnest_swarm.swarm.spec_checks import check_spec_choices

        if log_file is not None:
            log_to_file(log_file)
        check_spec_choices(pipeline_compression, backward, optimizer=optimizer, lr_schedule=lr_schedule,
                           outer_optimizer=outer_optimizer, link_bound_compression=link_bound_compression,
                           averaging_compression=averaging_compression)
        check_precision(precision)
        where = resolve_device(device)  # before any process starts: `--device cuda` without a GPU is one line
        options = LocalOptions(peers=peers, steps=steps, model=model, chaos=chaos, time_limit=time_limit, data=data,
                               spec=RunSpec(model=model, model_config=model_config, averaging_period=averaging_period,
                                            averaging_overlap=averaging_overlap,
                                            pipeline_compression=pipeline_compression,
                                            link_bound_compression=link_bound_compression,
                                            averaging_compression=averaging_compression, precision=precision,
                                            backward=backward, microbatch_size=microbatch_size, lr=lr,
                                            max_in_flight=max_in_flight, optimizer=optimizer,
                                            weight_decay=weight_decay, lr_schedule=lr_schedule,
                                            warmup_steps=warmup_steps, outer_optimizer=outer_optimizer,
                                            outer_lr=outer_lr),
                               max_ram_gb=max_ram_gb, export=export_dir, snapshot_dir=snapshot_dir,
                               dashboard=not no_dashboard, checkpoint_dir=checkpoint_dir,
                               checkpoint_every=checkpoint_every, resume=resume, device=where)
        return await run_local(options, as_json)

    sys.exit(run_async(main()))


@app.command()
def probe(
    initial_peers: List[str] = InitialPeers,
    run: str = typer.Option(..., "--run", help="Run name."),
    peer: str = typer.Option(..., "--peer", help="The peer to probe: its name or peer id in the run's records."),
    mb: float = typer.Option(4.0, "--mb", min=0.25, max=64.0, help="MiB to send (one uint8 tensor)."),
    timeout: float = typer.Option(15.0, "--timeout", min=1.0),
    host_maddrs: List[str] = typer.Option(["/ip4/0.0.0.0/tcp/0"], "--host-maddrs", help="Where to listen."),
    announce_maddrs: Optional[List[str]] = typer.Option(None, "--announce-maddrs", help="Addresses to announce."),
    verbose: bool = Verbose,
):
    """Send a tensor to a peer over the route a stage would use (direct, reversal, forwarding); one JSON line.

    \b
    Example:
      ravnest-swarm probe --run demo --peer my-pc \\
          --initial-peers /ip4/203.0.113.5/tcp/31337/p2p/Qm...
    """
    from ravnest_swarm.membership.probe import ProbeOptions, run_probe_process

    sys.exit(run_probe_process(ProbeOptions(initial_peers, run, peer, mb, timeout, host_maddrs, announce_maddrs, verbose)))


@app.command()
def doctor(
    initial_peers: List[str] = InitialPeers,
    timeout: float = typer.Option(10.0, "--timeout", min=1.0),
    verbose: bool = Verbose,
):
    """Preflight before joining: p2pd, initial peers, reachability, capabilities, and a verdict (exit 0/1).

    \b
    Example:
      ravnest-swarm doctor --initial-peers /ip4/203.0.113.5/tcp/31337/p2p/Qm...
    """
    configure_logging(verbose)

    async def main():
        from ravnest_swarm.membership.doctor import run_doctor

        return await run_doctor(_initial_peers(initial_peers), timeout, Console())

    sys.exit(run_async(main()))


@app.command()
def plan(
    peers_file: str = typer.Argument(..., metavar="PEERS.json", help="List of {peer_id, ram_gb, gflops, bandwidth_mbps}."),
    model_gb: float = typer.Option(..., "--model-gb", help="Memory the model needs, GB."),
    gflop_per_sample: float = typer.Option(..., "--gflop-per-sample", help="Forward+backward GFLOP per sample."),
    activation_mb: float = typer.Option(..., "--activation-mb", help="Activations sent between stages per sample, MB."),
    seed: int = typer.Option(0, "--seed", help="GA seed: the same seed gives the same plan."),
    max_stages: int = typer.Option(8, "--max-stages", min=1, max=64, help="Most peers per cluster."),
    max_in_flight: Optional[int] = typer.Option(
        None, "--max-in-flight", min=1, max=1024,
        help="Microbatches in flight per cluster (a run's spec has 2): a deeper cluster keeps only that many stages "
             "busy. Unset: every stage busy."),
    time_limit: float = typer.Option(10.0, "--time-limit", min=0.0, help="Seconds the GA may run."),
    num_layers: int = typer.Option(32, "--num-layers", min=1, help="Identical layers to split into stages."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
):
    """Plan clusters offline for a list of peers: greedy seed, island GA, fractions and layer ranges.

    \b
    Example:
      ravnest-swarm plan peers.json --model-gb 20 --gflop-per-sample 40 --activation-mb 0.5
    """
    configure_logging(False)

    async def main():
        from ravnest_swarm.planning.plan import load_peers, make_workload, plan_swarm
        from ravnest_swarm.planning.report import print_plan, progress_bar

        workload = make_workload(model_gb, gflop_per_sample, activation_mb, max_stages, max_in_flight)
        peers = load_peers(peers_file)
        with progress_bar(time_limit) as on_generation:
            result = plan_swarm(peers, workload, seed=seed, time_limit=time_limit, num_layers=num_layers,
                                on_generation=on_generation)
        if as_json:
            print(json.dumps(result.to_json()), flush=True)
        else:
            print_plan(result, Console())

    sys.exit(run_async(main()))


@bench_app.command("plan")
def bench_plan(
    time_limit: float = typer.Option(15.0, "--time-limit", min=0.1, help="Seconds the GA may run per swarm."),
    as_json: bool = typer.Option(False, "--json", help="JSON on the last line."),
):
    """Plan time and quality on generated swarms of 100, 1,000 and 10,000 peers: GA, greedy, random restarts.

    \b
    Example:
      ravnest-swarm bench plan --json
    """
    configure_logging(False)
    from ravnest_swarm.bench.planning import run_bench_plan

    sys.exit(run_bench_plan(time_limit, as_json))


@bench_app.command("quality")
def bench_quality(
    peers: int = typer.Option(6, "--peers", min=2, max=30),
    steps: int = typer.Option(300, "--steps", min=1, help="Optimizer steps per stage."),
    model: str = typer.Option("mlp-digits", "--model"),
    repeats: int = typer.Option(1, "--repeats", min=1, max=20, help="Swarm runs (and baseline seeds) averaged."),
    scheme: str = typer.Option("today", "--scheme", help="The run's optimizers and averaging, as `bench speedup "
                               "--schemes` names one: today, new, diloco, or name:key=value,... (the baseline trains with "
                               "the same inner optimizer)."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Swarm held-out accuracy beside a single process trained on as many samples; per-peer memory share.

    \b
    Example:
      ravnest-swarm bench quality --peers 6 --steps 300 --json
      ravnest-swarm bench quality --scheme new --repeats 3 --json
    """
    configure_logging(False)
    from ravnest_swarm.bench.quality import bench_quality as run

    sys.exit(run_async(run(peers, steps, model, as_json, repeats, scheme)))


@bench_app.command("export")
def bench_export(
    model: str = typer.Option("gpt-350m", "--model", help="Zoo model whose local-run checkpoints are exported."),
    stages: int = typer.Option(4, "--stages", min=1, max=64, help="Stages the local run split it into."),
    as_json: bool = typer.Option(False, "--json", help="JSON on the last line."),
):
    """Peak memory of exporting a model from a local run's checkpoints, against the size of two of its stages.

    \b
    Example:
      ravnest-swarm bench export --model gpt-350m --stages 4 --json
    """
    configure_logging(False)
    from ravnest_swarm.bench.export import bench_export as run

    sys.exit(run_blocking(lambda: run(model, stages, as_json)))


@bench_app.command("membership")
def bench_membership(
    peers: int = typer.Option(100, "--peers", min=2, max=5000, help="Light peers (real DHT nodes and p2pd)."),
    peers_per_process: int = typer.Option(20, "--peers-per-process", min=1, max=200,
                                          help="Light peers hosted by one OS process."),
    heartbeat: float = typer.Option(5.0, "--heartbeat", min=0.5, help="Seconds between renewals (join's default)."),
    stable_seconds: float = typer.Option(300.0, "--stable-seconds", min=0.0,
                                         help="How long every view must stay complete once converged."),
    churn_seconds: float = typer.Option(300.0, "--churn-seconds", min=0.0, help="0 skips the churn."),
    churn_every: float = typer.Option(60.0, "--churn-every", min=1.0, help="Seconds between churn rounds."),
    churn_fraction: float = typer.Option(0.1, "--churn-fraction", min=0.0, max=1.0,
                                         help="Share of the peers killed (no 'leaving') and replaced each round."),
    records: int = typer.Option(1000, "--records", min=0, max=100_000,
                                help="status --json is also timed on a run of this many written records (0: not)."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Membership at scale: light peers on one backbone; convergence, stability, churn, memory, DHT latency.

    \b
    Example:
      ravnest-swarm bench membership --peers 100 --json
    """
    configure_logging(False)
    from ravnest_swarm.bench.backbone import MembershipBenchOptions, bench_membership as run

    options = MembershipBenchOptions(peers=peers, peers_per_process=peers_per_process, heartbeat=heartbeat,
                                     stable_seconds=stable_seconds, churn_seconds=churn_seconds,
                                     churn_every=churn_every, churn_fraction=churn_fraction, records=records)
    sys.exit(run_async(run(options, as_json)))


@bench_app.command("neighbours")
def bench_neighbours(
    peers: int = typer.Option(1000, "--peers", min=4, max=20_000, help="Peer records (4 stages to a cluster)."),
    nodes: int = typer.Option(8, "--nodes", min=0, max=64, help="DHT nodes beside the backbone."),
    reads: int = typer.Option(30, "--reads", min=1, help="Reads of each kind in each layout."),
    as_json: bool = typer.Option(False, "--json"),
):
    """A trainer's reads of its stage neighbours and ring partners: the layout before issue #20 beside today's.

    \b
    Example:
      ravnest-swarm bench neighbours --peers 1000 --json
    """
    configure_logging(False)
    from ravnest_swarm.bench.neighbours import bench_neighbours as run

    sys.exit(run_async(run(peers, nodes, reads, as_json)))


@bench_app.command("simulate")
def bench_simulate(
    peers: List[str] = typer.Option(["100,1000,10000"], "--peers", help="Swarm sizes: repeatable, or a list (100,1000)."),
    seconds: Optional[float] = typer.Option(None, "--seconds", min=1.0, help="Steady state measured (simulated seconds; default 3 heartbeats)."),
    churn_fraction: float = typer.Option(0.1, "--churn-fraction", min=0.0, max=0.9, help="Share of the peers killed and replaced at once."),
    loss: float = typer.Option(0.02, "--loss", min=0.0, max=0.9, help="Share of DHT RPCs lost (each costs the caller a 3 s timeout)."),
    latency_ms: float = typer.Option(100.0, "--latency-ms", min=0.0, help="Mean round trip of a DHT RPC."),
    heartbeat: float = typer.Option(5.0, "--heartbeat", min=0.5, help="Base heartbeat, as join's (slower beyond 500 peers)."),
    seed: int = typer.Option(0, "--seed"),
    cold_start: bool = typer.Option(False, "--cold-start", help="All peers start from an empty DHT, not a running swarm's."),
    cache_nearest: int = typer.Option(0, "--cache-nearest", min=0, max=1, help="Cache each get's result on the nearest node (hivemind's default 1; ours 0)."),
    as_json: bool = typer.Option(False, "--json", help="JSON on the last line."),
):
    """Membership at 100 to 10,000 peers, simulated: the real heartbeat and view code on a simulated DHT.

    \b
    Example:
      ravnest-swarm bench simulate --peers 100,1000,10000 --loss 0.02 --json
    """
    configure_logging(False)
    from ravnest_swarm.bench.simulation import SimulationConfig, parse_peer_counts, run_bench_simulate

    def verb() -> int:
        counts = parse_peer_counts(peers)
        config = SimulationConfig(peers=counts[0], heartbeat=heartbeat, seconds=seconds, churn_fraction=churn_fraction,
                                  loss=loss, latency_ms=latency_ms, seed=seed, cold_start=cold_start,
                                  cache_nearest=cache_nearest)
        return run_bench_simulate(counts, config, as_json)

    sys.exit(run_blocking(verb))


@bench_app.command("backbone")
def bench_backbone(
    seconds: float = typer.Option(5.0, "--seconds", min=1.0, help="Settle time before measuring."),
    volunteers: int = typer.Option(3, "--volunteers", min=0, help="Volunteers joined to the backbone while measuring."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Backbone memory (PSS of all its processes, p2pd included) beside a plain hivemind.DHT, in one run.

    \b
    Example:
      ravnest-swarm bench backbone --volunteers 3 --json
    """
    configure_logging(False)
    from ravnest_swarm.bench.membership import bench_backbone as run

    sys.exit(run_async(run(seconds, volunteers, as_json)))


@bench_app.command("averaging")
def bench_averaging(
    clusters: int = typer.Option(3, "--clusters", min=2, max=16, help="Clusters (copies of the model)."),
    stages: int = typer.Option(2, "--stages", min=1, max=8, help="Stages per cluster (cut at different layers per cluster)."),
    mbps: float = typer.Option(100.0, "--mbps", min=1.0, help="Access-link rate of every peer, Mbit/s each way (tc tbf)."),
    delay_ms: float = typer.Option(20.0, "--delay-ms", min=0.0, help="One-way delay between peers (userspace relay)."),
    size_mb: float = typer.Option(64.0, "--size-mb", min=0.01, help="Size of the float32 parameter vector, MiB."),
    compression: str = typer.Option("none", "--compression", help="none, fp16 or 8bit (hivemind compression)."),
    timeout: float = typer.Option(300.0, "--timeout", min=1.0, help="Seconds one ring may take."),
    robust: Optional[str] = typer.Option(None, "--robust", help="Instead: the mean beside this robust aggregate "
                                         "(trimmed_mean or centered_clip), honest and with the last cluster's "
                                         "values scaled to just under the scale check."),
    as_json: bool = typer.Option(False, "--json", help="Last line: one JSON object with the figures."),
):
    """Multi-ring all-reduce vs hivemind's DecentralizedAverager vs one ring, same peers and emulated links.

    \b
    Example:
      ravnest-swarm bench averaging --clusters 3 --stages 2 --size-mb 64 --json
      ravnest-swarm bench averaging --robust trimmed_mean --clusters 4 --stages 1 --json
    """
    configure_logging(False)
    from ravnest_swarm.bench.averaging import bench_averaging as run

    sys.exit(run_blocking(lambda: run(clusters, stages, mbps, delay_ms, size_mb, as_json, compression, timeout,
                                      robust)))


@app.command("averaging-peer", hidden=True)
def averaging_peer(
    initial_peers: List[str] = InitialPeers,
    run: str = typer.Option(..., "--run", help="Run name."),
    cluster: int = typer.Option(..., "--cluster", min=0, help="Our cluster index."),
    stage: int = typer.Option(..., "--stage", min=0, help="Our stage index in the cluster."),
    layer_sizes: str = typer.Option(..., "--layer-sizes", help="Elements per layer of the synthetic model, comma-separated."),
    layers: str = typer.Option(..., "--layers", help="Our layer range FIRST,LAST (last excluded)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the synthetic parameters."),
    step: int = typer.Option(1, "--step", min=0, help="The training step that names the round."),
    timeout: float = typer.Option(30.0, "--timeout", min=0.1, help="Seconds one ring may take."),
    compression: str = typer.Option("none", "--compression", help="none, fp16 or 8bit."),
    aggregation: str = typer.Option("mean", "--aggregation", help="mean, trimmed_mean or centered_clip."),
    poison: Optional[str] = typer.Option(None, "--poison", help="Poison our values: nan, inf, scale (x1e6), or "
                                         "plausible (largest value just under the scale check) (fault tests)."),
    hostile_abort: Optional[str] = typer.Option(None, "--hostile-abort", help="Act as a hostile ring member: once "
                                                "the ring runs, vote against our successor (exclude) or end the ring "
                                                "(fail), and send nothing (attack tests)."),
    alter_aggregate: float = typer.Option(0.0, "--alter-aggregate", help="Act as a hostile chunk owner: add this to "
                                          "our robust aggregate before gathering it (attack tests)."),
    out: Optional[str] = typer.Option(None, "--out", help="Write our averaged range here (safetensors)."),
    publish_plan: int = typer.Option(0, "--publish-plan", min=0, help="Stand in for the planner: publish the plan once N peers are placed."),
    plan_timeout: float = typer.Option(60.0, "--plan-timeout", min=1.0, help="Seconds to wait for the plan."),
    delay_start: float = typer.Option(0.0, "--delay-start", min=0.0, help="Seconds between adopting the plan and averaging (fault tests)."),
    part_bytes: int = typer.Option(512 * 1024, "--part-bytes", min=64, help="Bytes per streamed part of a ring message."),
    lose_replies: int = typer.Option(0, "--lose-replies", min=0, help="Close the first N ring streams without a reply (fault tests)."),
    cut_streams: int = typer.Option(0, "--cut-streams", min=0, help="Break the first N multi-part ring streams midway (fault tests)."),
    host_maddrs: List[str] = typer.Option(["/ip4/127.0.0.1/tcp/0"], "--host-maddrs", help="Where to listen."),
    announce_maddrs: Optional[List[str]] = typer.Option(None, "--announce-maddrs", help="Addresses to announce."),
    bench_config: Optional[str] = typer.Option(None, "--bench-config", help="Run the timed phases of `bench averaging` (config file it wrote)."),
    identity: Optional[str] = typer.Option(None, "--identity", help="Private key file (created if missing): our peer id, which orders the ring."),
    verbose: bool = Verbose,
):
    """Test and benchmark peer: a synthetic model range, one multi-ring averaging round, a JSON line."""
    configure_logging(verbose)

    async def main():
        from ravnest_swarm.bench.averaging_peer import AveragingPeerOptions, parse_ints, run_averaging_peer
        from ravnest_swarm.membership.records import validate_run_name

        validate_run_name(run)
        layer_range = parse_ints(layers, "--layers")
        if len(layer_range) != 2:
            raise UserError("--layers must be FIRST,LAST")
        options = AveragingPeerOptions(
            initial_peers=_initial_peers(initial_peers), run=run, cluster=cluster, stage=stage,
            layer_sizes=parse_ints(layer_sizes, "--layer-sizes"), layers=tuple(layer_range), seed=seed, step=step,
            timeout=timeout, compression=compression, aggregation=aggregation, poison=poison,
            hostile_abort=hostile_abort, alter_aggregate=alter_aggregate, out=out,
            publish_plan=publish_plan,
            plan_timeout=plan_timeout, delay_start=delay_start, part_bytes=part_bytes, lose_replies=lose_replies,
            cut_streams=cut_streams, host_maddrs=host_maddrs, announce_maddrs=announce_maddrs, bench_config=bench_config,
            identity=identity,
        )
        return await run_averaging_peer(options)

    sys.exit(run_async(main()))


@bench_app.command("nat")
def bench_nat(
    size_mb: float = typer.Option(32.0, "--size-mb", min=0.25, max=64.0, help="MiB sent over each path."),
    repeats: int = typer.Option(2, "--repeats", min=1, max=10, help="Probes per path."),
    mbps: Optional[float] = typer.Option(None, "--mbps", min=0.1, help="Shape every access link (default unshaped)."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Direct vs connection reversal vs backbone forwarding, behind real NAT in namespaces (root).

    \b
    Example:
      sudo ravnest-swarm bench nat --size-mb 32 --repeats 2 --json
    """
    configure_logging(False)
    from ravnest_swarm.bench.nat import bench_nat as run

    sys.exit(run_blocking(lambda: run(size_mb, repeats, mbps, as_json)))


@bench_app.command("pipeline")
def bench_pipeline(
    stages: int = typer.Option(4, "--stages", min=2, help="Pipeline stages, one process and host each."),
    model: str = typer.Option("gpt-tiny", "--model", help="Zoo model, split into balanced stages."),
    model_config: str = typer.Option("", "--model-config", help="The model's settings, e.g. width=256,residual=2."),
    delay_ms: float = typer.Option(20.0, "--delay-ms", min=0.0, help="One-way delay between hosts."),
    mbps: float = typer.Option(100.0, "--mbps", min=0.1, help="Access-link rate of every host, each direction."),
    microbatches: int = typer.Option(160, "--microbatches", min=2, help="Microbatches per schedule."),
    microbatch_size: int = typer.Option(16, "--microbatch-size", min=1, max=4096),
    max_in_flight: int = typer.Option(8, "--max-in-flight", min=1, help="Also the sync schedule's microbatches per step."),
    transfer_mb: float = typer.Option(16.0, "--transfer-mb", min=0.1, help="Tensor size of the transfer probe."),
    mode: str = typer.Option("stash", "--mode", help="stash or recompute."),
    compression: str = typer.Option("none", "--compression", help="Codecs of activations and gradients "
                                    "on the wire, comma-separated, each run asynchronously in turn: none, float16, "
                                    "meanstd16, int8, int6, int4, int3; a>b: a, and b while a link is the bottleneck."),
    cpus_per_stage: Optional[float] = typer.Option(None, "--cpus-per-stage", min=0.0, help="CPU cores each stage's "
                                                   "host may use (default: the machine's cores / stages; 0: no limit)."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Async pipeline vs a synchronous GPipe-style schedule on emulated links; busy time, throughput, P2P vs TCP.

    \b
    Example:
      ravnest-swarm bench pipeline --stages 4 --compression float16 --json
    """
    configure_logging(False)
    from ravnest_swarm.bench.pipeline import bench_pipeline as run
    from ravnest_swarm.codecs.codec import CODECS as COMPRESSIONS, is_pipeline_codec

    if microbatches <= max_in_flight:
        print("error: --microbatches must exceed --max-in-flight (the steady state starts after one window)",
              file=sys.stderr)
        sys.exit(2)
    codecs = [name.strip() for name in compression.split(",")]
    if not all(is_pipeline_codec(part) for name in codecs for part in name.split(">", 1)) or len(set(codecs)) != len(codecs):
        print(f"error: --compression must be distinct names of {', '.join(COMPRESSIONS)}", file=sys.stderr)
        sys.exit(2)
    sys.exit(run_blocking(lambda: run(stages, model, delay_ms, mbps, microbatches, microbatch_size, max_in_flight,
                                      transfer_mb, mode, as_json, compression=codecs, cpus_per_stage=cpus_per_stage,
                                      model_config=model_config)))


@bench_app.command("lr-scaling")
def bench_lr_scaling(
    model: str = typer.Option("mlp-digits", "--model", help="Zoo model."),
    clusters: int = typer.Option(4, "--clusters", min=1, max=64, help="Clusters K after the re-plan."),
    lrs: str = typer.Option("0.05,0.1,0.2", "--lrs", help="The run's learning rates to compare, comma-separated."),
    rules: str = typer.Option("none,sqrt,linear,warmup", "--rules", help="The rules to compare, comma-separated."),
    solo: int = typer.Option(1800, "--solo", min=0, help="Steps the first cluster trains alone before the re-plan."),
    samples: int = typer.Option(96_000, "--samples", min=1, help="Samples the K clusters train on after it, in all."),
    as_json: bool = typer.Option(False, "--json", help="JSON on the last line."),
):
    """The lr rules across clusters side by side: one cluster alone, then K from its state, averaging.

    \b
    Example:
      ravnest-swarm bench lr-scaling --clusters 4 --lrs 0.05,0.2 --json
    """
    configure_logging(False)
    from ravnest_swarm.bench.lr_scaling import LrScalingOptions, bench_lr_scaling as run

    try:
        rates = [float(part) for part in lrs.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"--lrs must be numbers separated by commas, like 0.05,0.2, not {lrs!r}")
    options = LrScalingOptions(model=model, clusters=clusters, lrs=rates, solo=solo, samples=samples,
                               rules=[part.strip() for part in rules.split(",") if part.strip()])
    sys.exit(run(options, as_json))


@bench_app.command("codecs")
def bench_codecs(
    codecs: str = typer.Option("none,float16,int8,int6,int4,int3", "--codecs", help="Codecs to train with, "
                               "comma-separated, in turn."),
    model: str = typer.Option("gpt", "--model", help="Zoo model, or a user's module:function."),
    model_config: str = typer.Option("layers=4,width=64,heads=4,context=64", "--model-config", help="Its settings."),
    stages: int = typer.Option(2, "--stages", min=2, max=4, help="Pipeline stages, a process and host each."),
    microbatches: int = typer.Option(600, "--microbatches", min=8, help="Microbatches every codec trains on."),
    microbatch_size: int = typer.Option(16, "--microbatch-size", min=1, max=4096),
    max_in_flight: int = typer.Option(4, "--max-in-flight", min=1),
    optimizer: str = typer.Option("adamw", "--optimizer", help="sgd, momentum or adamw."),
    lr: float = typer.Option(0.003, "--lr", min=0.0),
    mbps: float = typer.Option(100.0, "--mbps", min=0.1, help="Access-link rate of every host, each direction."),
    delay_ms: float = typer.Option(20.0, "--delay-ms", min=0.0, help="One-way delay between hosts."),
    cpus_per_stage: Optional[float] = typer.Option(None, "--cpus-per-stage", min=0.0, help="CPU cores each stage's "
                                                   "host may use (default: the machine's cores / stages, at most 1)."),
    repeats: int = typer.Option(1, "--repeats", min=1, help="Runs of each codec (the held-out loss's spread)."),
    as_json: bool = typer.Option(False, "--json", help="JSON on the last line."),
):
    """Bytes per sample against held-out loss: one byte-level GPT trained in a real pipeline with each codec.

    \b
    Example:
      ravnest-swarm bench codecs --codecs none,int8,int4,int3 --repeats 3 --json
    """
    configure_logging(False)
    from ravnest_swarm.bench.codecs import CodecBenchOptions, bench_codecs as run
    from ravnest_swarm.codecs.codec import CODECS, is_pipeline_codec
    from ravnest_swarm.optimizers.inner import INNER_OPTIMIZERS as OPTIMIZERS

    names = [name.strip() for name in codecs.split(",")]
    if not all(is_pipeline_codec(name) for name in names) or len(set(names)) != len(names):
        print(f"error: --codecs must be distinct names of {', '.join(CODECS)} (or forward/backward pairs of them)",
              file=sys.stderr)
        sys.exit(2)
    if optimizer not in OPTIMIZERS:
        print(f"error: --optimizer must be one of {', '.join(OPTIMIZERS)}", file=sys.stderr)
        sys.exit(2)
    sys.exit(run_blocking(lambda: run(CodecBenchOptions(
        names, model, model_config, stages, microbatches, microbatch_size, max_in_flight, optimizer, lr, mbps,
        delay_ms, cpus_per_stage, repeats), as_json)))


@bench_app.command("diloco")
def bench_diloco(
    model: str = typer.Option("mlp-digits", "--model", help="Zoo model."),
    samples: int = typer.Option(19_200, "--samples", min=1, help="Samples each configuration trains on, in all."),
    averaging_period: int = typer.Option(25, "--averaging-period", min=1, help="Steps between averaging rounds."),
    outer_lr: float = typer.Option(0.7, "--outer-lr", min=0.0, max=10.0, help="The nesterov outer step's lr."),
    outer_momentum: float = typer.Option(0.9, "--outer-momentum", min=0.0, max=0.999,
                                         help="The nesterov outer step's momentum."),
    averaging_compression: str = typer.Option("none", "--averaging-compression", help="Ring codecs each "
                                              "configuration of K > 1 runs in, comma-separated (none,int8,int4): "
                                              "bytes per round and held-out loss side by side."),
    reform_every: Optional[int] = typer.Option(None, "--reform-every", min=1, help="Every this many rounds one "
                                               "cluster is re-formed, its inner optimizer state reset or carried from "
                                               "the cluster it downloads from, beside none re-formed (a new run's "
                                               "optimizers only)."),
    configurations: Optional[str] = typer.Option(None, "--configurations", help="inner:lr:outer,... to run "
                                                 "instead of the six built in (the first one's K = 1 sets the "
                                                 "target), e.g. adamw:0.008:average."),
    synchronous: bool = typer.Option(False, "--synchronous", help="Beside each K > 1, one replica on K x the "
                                     "microbatch: synchronous data parallelism, the usual reference for K clusters."),
    target_samples: Optional[int] = typer.Option(None, "--target-samples", min=1, help="The target is the first "
                                                 "configuration's K = 1 loss at these samples, not at the end: the "
                                                 "others train on to --samples to reach it."),
    as_json: bool = typer.Option(False, "--json", help="JSON on the last line."),
):
    """Inner (sgd, momentum, adamw) and outer (average, nesterov) optimizers, K = 4 against 1, side by side.

    \b
    Example:
      ravnest-swarm bench diloco --json
      ravnest-swarm bench diloco --averaging-compression none,int8,int4
      ravnest-swarm bench diloco --reform-every 4 --averaging-compression int8
      ravnest-swarm bench diloco --model gpt-tiny --samples 19200 --target-samples 9600 --synchronous \\
        --configurations adamw:0.002:average,adamw:0.008:average
    """
    configure_logging(False)
    from ravnest_swarm.bench.diloco import CONFIGURATIONS, DilocoOptions, bench_diloco as run, parse_configurations
    from ravnest_swarm.codecs.codec import CODECS

    compressions = tuple(name.strip() for name in averaging_compression.split(",") if name.strip())
    unknown = [name for name in compressions if name not in CODECS]
    if unknown or not compressions:
        raise UserError(f"--averaging-compression must name codecs among {', '.join(CODECS)}, not "
                        f"{averaging_compression!r}")
    if "none" not in compressions:
        compressions = ("none",) + compressions  # what the others are compared with
    options = DilocoOptions(model=model, samples=samples, averaging_period=averaging_period, outer_lr=outer_lr,
                            outer_momentum=outer_momentum, compressions=compressions, reform_every=reform_every,
                            synchronous=synchronous, target_samples=target_samples)
    # re-formed clusters matter to optimizers with state: a new run's, whose K = 1 is then the target
    from ravnest_swarm.swarm.spec import RunSpec
    new_run = ((RunSpec.optimizer, RunSpec.lr, RunSpec.outer_optimizer),)
    chosen = parse_configurations(configurations) if configurations is not None else \
        new_run if reform_every else CONFIGURATIONS
    sys.exit(run(options, as_json, chosen))


@bench_app.command("speedup")
def bench_speedup(
    clusters: str = typer.Option("1,2,4", "--clusters", help="Cluster counts K to compare, comma-separated; 1 among "
                                 "them (the ratios are to K = 1)."),
    stages: int = typer.Option(2, "--stages", min=1, max=5, help="Stages per cluster, a peer and host each."),
    model: str = typer.Option("mlp-digits", "--model", help="Zoo model (mlp-digits or gpt-tiny)."),
    samples: int = typer.Option(19200, "--samples", min=1, help="Samples every K trains in all: K clusters train "
                                "1/K of the steps each, so the held-out losses compare at equal samples."),
    mbps: float = typer.Option(100.0, "--mbps", min=0.1, help="Access-link rate of every peer, each direction."),
    delay_ms: float = typer.Option(20.0, "--delay-ms", min=0.0, help="One-way delay between peers."),
    averaging_period: int = typer.Option(25, "--averaging-period", min=1, help="Optimizer steps between averaging "
                                         "rounds."),
    cpus_per_peer: Optional[float] = typer.Option(None, "--cpus-per-peer", min=0.0, help="CPU cores each peer's host "
                                                  "may use, the same for every K (default: 0.9 x the machine's cores "
                                                  "/ (largest K x stages + 1), at most 1; 0: no limit)."),
    time_limit: float = typer.Option(600.0, "--time-limit", min=10.0, help="Seconds each K of each scheme may "
                                     "take."),
    schemes: str = typer.Option("today,new", "--schemes", help="Training schemes to run side by side, each at every "
                                "K: today (sgd, average, float32, stages stand still), new (a new run's defaults: adamw, "
                                "the mean of int8 pseudo-gradients, averaging beside training), diloco (new with a "
                                "nesterov outer step), or name:key=value,... of your own (run-spec settings, "
                                "from today's). The first is the reference: its K = 1's final held-out loss is the "
                                "target all are timed to."),
    target_samples: Optional[int] = typer.Option(None, "--target-samples", min=1, help="The target is the "
                                                 "reference's K = 1 held-out loss at these samples, not at the end: "
                                                 "every K trains on to --samples to show the samples it needs."),
    as_json: bool = typer.Option(False, "--json", help="JSON on the last line."),
):
    """Wall time and samples to a held-out loss, and samples/s, of K = 1, 2 and 4 clusters of the same stages in
    each scheme, same links and CPU per peer.

    \b
    Examples:
      sudo ravnest-swarm bench speedup --json
      sudo ravnest-swarm bench speedup --clusters 1,2 --samples 4800 --schemes today,new,adamw:optimizer=adamw,lr=0.002
      sudo ravnest-swarm bench speedup --samples 38400 --target-samples 19200 --json
    """
    configure_logging(False)
    from ravnest_swarm.bench.speedup import bench_speedup as run, parse_clusters, parse_schemes

    sys.exit(run_blocking(lambda: run(parse_clusters(clusters), stages, model, samples, mbps, delay_ms,
                                      averaging_period, cpus_per_peer, time_limit, as_json,
                                      parse_schemes(schemes), target_samples)))


@bench_app.command("soak")
def bench_soak(
    peers: int = typer.Option(8, "--peers", min=2, max=200, help="Volunteers at once, a lab host each."),
    minutes: float = typer.Option(30.0, "--minutes", min=0.5, help="How long the soak runs."),
    churn_every: float = typer.Option(180.0, "--churn-every", min=10.0, help="Seconds between churn events: "
                                      "alternately Ctrl-C and SIGKILL of a random placed volunteer, then a new one "
                                      "joins."),
    mbps: float = typer.Option(100.0, "--mbps", min=0.1, help="Access-link rate of every peer, each direction."),
    delay_ms: float = typer.Option(20.0, "--delay-ms", min=0.0, help="One-way delay between peers."),
    model: str = typer.Option("mlp-digits", "--model", help="Zoo model the run trains."),
    stages: int = typer.Option(2, "--stages", min=1, max=5, help="Stages per cluster (RAM for 1.2 / stages of "
                               "the model per peer)."),
    steps: int = typer.Option(10**9, "--steps", min=1, max=2**53, help="The run's length (default: more than any "
                              "soak trains)."),
    averaging_period: int = typer.Option(25, "--averaging-period", min=1, help="Optimizer steps between averaging "
                                         "rounds."),
    cpus_per_peer: Optional[float] = typer.Option(None, "--cpus-per-peer", min=0.0, help="CPU cores each peer's host "
                                                  "may use (default: 0.9 x the machine's cores / (peers + 1), at "
                                                  "most 1; 0: no limit)."),
    out: Optional[str] = typer.Option(None, "--out", help="A new directory for every peer's log and checkpoints "
                                      "(default: a temporary one, printed)."),
    seed: int = typer.Option(0, "--seed", help="Which volunteers the churn picks."),
    scheme: str = typer.Option("today", "--scheme", help="The run's training scheme, one of bench speedup's: today "
                               "(SGD, float32 averaging while stages stand still), new (a new run's defaults: AdamW, the "
                               "mean of int8 pseudo-gradients beside training), diloco (new with a nesterov outer "
                               "step), or name:key=value,... of your own."),
):
    """A long run of real join volunteers in the network lab with churn on a schedule: did any peer hit an
    unexpected error? A table, then one JSON object on the last line.

    \b
    Example:
      sudo ravnest-swarm bench soak --peers 8 --minutes 30 --churn-every 180 --out ./soak
    """
    configure_logging(False)
    from ravnest_swarm.bench.soak import SoakOptions, bench_soak as run

    options = SoakOptions(peers=peers, minutes=minutes, churn_every=churn_every, mbps=mbps, delay_ms=delay_ms,
                          model=model, stages=stages, steps=steps, averaging_period=averaging_period,
                          cpus_per_peer=cpus_per_peer, out=out, seed=seed, scheme=scheme)
    sys.exit(run_blocking(lambda: run(options)))


@app.command("stage", hidden=True)
def stage(
    initial_peers: List[str] = InitialPeers,
    run: str = typer.Option(..., "--run", help="Run name."),
    stage_index: int = typer.Option(..., "--stage", min=0, help="Our stage index in the pipeline."),
    stages: int = typer.Option(..., "--stages", min=1, help="Stages in the pipeline."),
    model: str = typer.Option(..., "--model", help="Zoo model: mlp-digits or gpt-tiny."),
    layers: str = typer.Option(..., "--layers", help="Our layer range a:b (b excluded)."),
    cluster: int = typer.Option(0, "--cluster", min=0, help="Our cluster index."),
    clusters: int = typer.Option(1, "--clusters", min=1, help="Clusters of the run (data sharding)."),
    microbatch_size: int = typer.Option(16, "--microbatch-size", min=1, max=4096),
    microbatches: int = typer.Option(0, "--microbatches", min=0, help="Stage 0: microbatches to inject, then finish."),
    max_in_flight: int = typer.Option(4, "--max-in-flight", min=1, help="Microbatches in flight per cluster."),
    schedule: str = typer.Option("async", "--schedule", help="async, or sync (GPipe-style flush each step)."),
    microbatches_per_step: int = typer.Option(4, "--microbatches-per-step", min=1, help="Sync schedule only."),
    lr: float = typer.Option(0.05, "--lr", min=0.0),
    mode: str = typer.Option("stash", "--mode", help="stash (weight stashing) or recompute."),
    seed: int = typer.Option(0, "--seed"),
    microbatch_timeout: float = typer.Option(30.0, "--microbatch-timeout", min=0.1),
    send_timeout: float = typer.Option(30.0, "--send-timeout", min=0.1),
    max_message_mb: float = typer.Option(64.0, "--max-message-mb", min=0.001),
    compression: str = typer.Option("none", "--compression", help="Our activations or gradients on the wire: none, "
                                    "float16 or meanstd16."),
    report: Optional[str] = typer.Option(None, "--report", help="Write counters, losses and busy time here (JSON)."),
    trace: bool = typer.Option(False, "--trace", help="Add each microbatch's arrival, compute and send times to --report."),
    save: Optional[str] = typer.Option(None, "--save", help="Write our parameters here at the end (safetensors)."),
    timeout: float = typer.Option(15.0, "--timeout", min=1.0),
    host_maddrs: List[str] = typer.Option(["/ip4/127.0.0.1/tcp/0"], "--host-maddrs", help="Where to listen."),
    announce_maddrs: Optional[List[str]] = typer.Option(None, "--announce-maddrs", help="Addresses to announce."),
    verbose: bool = Verbose,
):
    """One pipeline stage (the building block `join` runs after planning): serves its layers until the run ends."""
    configure_logging(verbose)

    async def main():
        from ravnest_swarm.membership.records import validate_run_name
        from ravnest_swarm.models import get_model, parse_layers
        from ravnest_swarm.pipeline.stage import MODES, SCHEDULES, StageConfig, serve_stage
        from ravnest_swarm.codecs.codec import CODECS as COMPRESSIONS, is_pipeline_codec

        validate_run_name(run)
        if schedule not in SCHEDULES or mode not in MODES or not is_pipeline_codec(compression):
            raise UserError(f"--schedule must be one of {', '.join(SCHEDULES)}, --mode one of {', '.join(MODES)} "
                            f"and --compression one of {', '.join(COMPRESSIONS)}")
        if stage_index >= stages or cluster >= clusters:
            raise UserError("--stage must be below --stages and --cluster below --clusters")
        try:
            layer_range = parse_layers(layers, get_model(model))
        except ValueError as e:
            raise UserError(str(e))
        config = StageConfig(
            run=run, stage=stage_index, stages=stages, model=model, layers=layer_range, cluster=cluster,
            clusters=clusters, microbatch_size=microbatch_size, microbatches=microbatches, max_in_flight=max_in_flight,
            schedule=schedule, microbatches_per_step=microbatches_per_step, lr=lr, mode=mode, seed=seed,
            microbatch_timeout=microbatch_timeout, send_timeout=send_timeout,
            max_message_bytes=int(max_message_mb * 1024 * 1024), compression=compression, trace=trace,
        )
        return await serve_stage(config, _initial_peers(initial_peers), host_maddrs, announce_maddrs, timeout,
                                 report, save)

    sys.exit(run_async(main()))


def _not_a_number(error: click_exceptions.UsageError) -> Optional[str]:
    """The message for a float option given nan or inf, which its range check called "should be less than or equal to
    10" (``--temperature nan``): the value given, read back from the command line, is what is wrong."""
    opts = getattr(getattr(error, "param", None), "opts", None) or []
    args = sys.argv[1:]
    for i, arg in enumerate(args):
        name, _, attached = arg.partition("=")
        if name in opts:
            value = attached if attached or "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
            try:
                if not math.isfinite(float(value)):
                    return f"Invalid value for '{name}': '{value}' is not a finite number"
            except ValueError:
                return None
    return None


def main() -> None:
    """Entry point: click's usage errors become one line too, like our own :class:`UserError`."""
    survive_a_closed_terminal()
    try:
        # typer returns (not raises) its exit code in this mode: a Ctrl-C before a verb's own handling (its imports,
        # its checks) is a 130 returned, which a dropped return value made an exit 0
        code = app(standalone_mode=False)
        if isinstance(code, int) and code != 0:
            sys.exit(code)
    except click_exceptions.NoArgsIsHelpError:
        sys.exit(0)
    except click_exceptions.UsageError as e:
        hint = f" (see `{e.ctx.command_path} --help`)" if e.ctx is not None else ""
        print_error(f"{_not_a_number(e) or e.format_message()}{hint}")
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):  # the latter while typer builds the commands, before click's main
        sys.exit(130)
    except UserError as e:  # a command's check of its options before it runs (`bench diloco --configurations`)
        print_error(str(e))
        sys.exit(e.exit_code)
    except Exception as e:
        sys.exit(unexpected_error_as_one_line(e))
