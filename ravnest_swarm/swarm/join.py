"""A volunteer's life, start to leave: what ``ravnest-swarm join`` runs, read top to bottom.

1. :func:`check_join`: every input checked before anything starts (a mistake is one line, nothing runs).
2. :class:`~ravnest_swarm.membership.volunteer.Membership` starts p2pd and the DHT node through the
   backbones, measures this machine and keeps its peer record alive.
3. The run's spec is read, or created from our ``--model`` (``swarm/spec.py``); then
   :class:`~ravnest_swarm.swarm.volunteer.Volunteer` takes part in planning rounds, trains the stage
   the plan gives us (``pipeline/``) and averages it with the other clusters (``averaging/``), until the
   run is finished or we are stopped. In the planner test mode (``--model-gb``) the peer only plans.
4. Meanwhile :func:`watch_peers` shows the run (the dashboard, or a log line per change).
5. On SIGINT/SIGTERM the volunteer hands its layers over and the membership says ``leaving``.

:class:`JoinOptions` holds plain values only, so ``local`` and the benches start a volunteer process
from the object itself (:func:`ravnest_swarm.processes.start_library_process`), not from flag names.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from rich.console import Console

from ravnest_swarm.errors import UserError
from ravnest_swarm.lifecycle import configure_logging, install_stop_signals, log_to_file, run_async, until_set

LOGGED_NAMES = 64  # peers named in a `--no-dashboard` log line
FIRST_READ_POLL = 0.2  # seconds between looks for the announcer's first read, before the first log line


@dataclass
class JoinOptions:
    """Everything one volunteer was asked to do; the fields are ``join``'s flags (see ``ravnest-swarm join -h``)."""

    initial_peers: List[str]
    run: str  # the run's address: ``demo``, or ``demo@<owner fingerprint>`` (membership/owner.py)
    name: str
    # what we offer (None: measured)
    ram_gb: Optional[float] = None
    max_ram_gb: Optional[float] = None
    gflops: Optional[float] = None
    bandwidth_mbps: Optional[float] = None
    device: str = "auto"
    device_memory_gb: Optional[float] = None
    # membership
    heartbeat: float = 5.0
    timeout: float = 15.0
    patience: float = 300.0
    host_maddrs: List[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce_maddrs: Optional[List[str]] = None
    identity: Optional[str] = None
    owner_key: Optional[str] = None  # the run owner's key file, for a run we start (default: owner.owner_key_path)
    ticket: Optional[str] = None  # our admission ticket to an invite-only run, or a file holding it (membership/tickets.py)
    # the run spec we start the run with, if it has none yet (None: the spec's default)
    model: Optional[str] = None
    model_config: Optional[str] = None
    lr: Optional[float] = None
    microbatch_size: Optional[int] = None
    max_in_flight: Optional[int] = None
    averaging_period: Optional[int] = None
    averaging_overlap: Optional[bool] = None
    pipeline_compression: Optional[str] = None
    link_bound_compression: Optional[str] = None
    averaging_compression: Optional[str] = None
    steps: Optional[int] = None
    invite_only: Optional[bool] = None
    precision: Optional[str] = None
    backward: Optional[str] = None
    aggregation: Optional[str] = None
    lr_scaling: Optional[str] = None
    divergence_factor: Optional[float] = None
    move_horizon_s: Optional[float] = None
    optimizer: Optional[str] = None
    weight_decay: Optional[float] = None
    lr_schedule: Optional[str] = None
    warmup_steps: Optional[int] = None
    outer_optimizer: Optional[str] = None
    outer_lr: Optional[float] = None
    # training
    data: Optional[str] = None
    handover_timeout: float = 90.0
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 50
    resume: bool = False
    report: Optional[str] = None
    snapshot_dir: Optional[str] = None  # append the run's figures to metrics.jsonl here every heartbeat (swarm/metrics.py)
    snapshot_every: int = 0  # export the run to snapshot_dir every this many steps (0: never)
    init_from: Optional[str] = None  # an export that fills the layers nobody serves (swarm/volunteer.py)
    # planning rounds (the planner test mode's model_gb and workload: docs/planning.md)
    model_gb: Optional[float] = None
    gflop_per_sample: float = 1.0
    activation_mb: float = 0.0
    max_stages: int = 8
    min_peers: int = 2
    round_period: float = 600.0
    round_seconds: float = 10.0
    num_layers: int = 32
    # how we show it
    dashboard: bool = True
    log_file: Optional[str] = None
    verbose: bool = False

    SPEC_FIELDS = ("model", "model_config", "lr", "microbatch_size", "max_in_flight", "averaging_period",
                   "averaging_overlap", "averaging_compression",
                   "pipeline_compression", "link_bound_compression", "precision", "backward", "aggregation", "lr_scaling", "divergence_factor",
                   "optimizer", "weight_decay", "lr_schedule", "warmup_steps", "outer_optimizer", "outer_lr",
                   "move_horizon_s", "steps", "invite_only")

    def requested_spec(self) -> dict:
        """The spec fields we were given, for a run that has no spec yet."""
        return {name: getattr(self, name) for name in self.SPEC_FIELDS if getattr(self, name) is not None}


def run_join(options: JoinOptions) -> int:
    """The process's whole life as a volunteer; returns its exit code."""
    configure_logging(options.verbose)
    return run_async(join(options))


async def join(options: JoinOptions) -> None:
    """Join the run, train until it is finished or we are stopped, then leave (see the module's docstring)."""
    if options.log_file is not None:
        log_to_file(options.log_file)
    facts = check_join(options)
    console = Console(stderr=True)
    leave_now = asyncio.Event()
    stop = install_stop_signals(lambda: console.print(f"{options.name}: stopping...", markup=False, highlight=False),
                                again=leave_now)
    # imported before the first record is published: on a busy machine importing torch's training modules
    # blocks the event loop longer than a record lives (three heartbeats), and the peer would seem to vanish
    from ravnest_swarm.membership.volunteer import Membership
    from ravnest_swarm.planning.round import PlanningRounds
    from ravnest_swarm.swarm.volunteer import take_part

    membership = Membership(membership_options(options), console)
    # Ctrl-C while we wait for an initial peer (--patience: minutes, or for ever) or measure ends the wait: it
    # said "stopping..." and then retried on until the patience ran out
    await until_set(membership.start(), stop)
    if stop.is_set():
        await membership.leave()
        return
    run = membership.options.run
    if options.model_gb is not None:
        work = asyncio.create_task(PlanningRounds(membership.node, run, membership.announcer,
                                                  planning_options(options), console).run_forever(stop))
    else:
        work = asyncio.create_task(take_part(membership, options.requested_spec(), volunteer_options(options), stop,
                                             console, leave_now, facts))
    watch = asyncio.create_task(watch_peers(membership.node, run, stop, options.heartbeat,
                                            # a live view drawn into a pipe or a file shows nothing (rich draws
                                            # only on a terminal): `join ... | tee log` got no line on the peers
                                            live=options.dashboard and console.is_terminal, console=console,
                                            me=options.name,
                                            viewer=membership.announcer.peer_id, known=membership.announcer.records))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work.done() and work.exception() is not None:
            raise work.exception()
        stop.set()
        await asyncio.gather(work, watch)
    finally:
        stop.set()
        for task in (work, watch):
            task.cancel()
        await membership.leave()
    console.print(f"{options.name} left run {run}", markup=False, highlight=False)


def check_join(options: JoinOptions) -> Optional[dict]:
    """Check every input before anything starts; returns the model's facts for a new run's spec (or None).

    The model is built and the data hashed here: a mistake in either is one line, and a new run's spec
    records both (``swarm/spec.py``).
    """
    from ravnest_swarm.devices import check_precision, resolve_device
    from ravnest_swarm.membership.capabilities import check_override
    from ravnest_swarm.membership.records import parse_run_address, validate_peer_name
    from ravnest_swarm.membership.tickets import check_ticket_for, ticket_argument
    from ravnest_swarm.net.node import parse_maddrs
    from ravnest_swarm.swarm.spec import model_facts
    from ravnest_swarm.swarm.spec_checks import check_spec_choices, check_spec_values, scan_user_data

    address = parse_run_address(options.run)
    if options.ticket is not None:  # garbled, of another run or expired: one line before anything starts
        options.ticket = ticket_argument(options.ticket)
        check_ticket_for(options.ticket, address.name, address.owner)
    for flag, value in (("ram-gb", options.ram_gb), ("max-ram-gb", options.max_ram_gb), ("gflops", options.gflops),
                        ("bandwidth-mbps", options.bandwidth_mbps), ("device-memory-gb", options.device_memory_gb)):
        check_override(flag, value)
    validate_peer_name(options.name)
    facts = model_facts(options.model, options.model_config or "", options.data) if options.model is not None else None
    if options.data is not None and options.model is None:
        scan_user_data(options.data)
    parse_maddrs(options.host_maddrs, what="--host-maddrs", need_peer_id=False)
    if options.resume and options.checkpoint_dir is None:
        raise UserError("--resume needs --checkpoint-dir")
    for flag, path in (("--checkpoint-dir", options.checkpoint_dir), ("--snapshot-dir", options.snapshot_dir)):
        if path is not None and os.path.exists(path) and not os.path.isdir(path):  # else refused at its first write
            raise UserError(f"{flag} {path} is a file, not a directory", 1)
    if options.resume:  # now, not once the peer joined and published its record
        checkpoint = os.path.join(options.checkpoint_dir, f"{address.name}-{options.name}.safetensors")
        if not os.path.isfile(checkpoint):
            raise UserError(f"--resume: no checkpoint at {checkpoint} (a checkpoint is named RUN-NAME.safetensors: "
                            f"give the --run and --name of the peer that wrote it)", 1)
    if options.snapshot_every and options.snapshot_dir is None:
        raise UserError("--snapshot-every needs --snapshot-dir: where the snapshots go")
    if options.init_from is not None:  # an export, or a --snapshot-dir whose newest snapshot counts (maybe none yet)
        from ravnest_swarm.models import first_difference
        from ravnest_swarm.swarm.exported import newest_export, read_export

        if options.snapshot_dir is not None and os.path.abspath(options.init_from) == os.path.abspath(options.snapshot_dir):
            os.makedirs(options.snapshot_dir, exist_ok=True)  # our own snapshots, none taken yet
        found = newest_export(options.init_from)
        if found is None and not os.path.isdir(options.init_from):
            raise UserError(f"--init-from {options.init_from}: no such directory (an export, or a --snapshot-dir)", 1)
        if found is not None:
            export = read_export(found)  # a corrupt export is one line now, not after joining
            # another model's export: refused now, not after a new run's spec was signed and published with it
            difference = first_difference(export.spec["layout"], facts["layout"]) if facts is not None else None
            if difference is not None:
                raise UserError(f"--init-from {found} is an export of another model than --model {options.model}: "
                                f"{difference}", 1)
    parse_maddrs(options.initial_peers)
    options.device = resolve_device(options.device)  # `--device cuda` without a GPU is one line, before joining
    check_spec_choices(options.pipeline_compression or "none", options.backward or "stash",
                       options.aggregation or "mean", options.optimizer or "sgd", options.lr_schedule or "constant",
                       options.outer_optimizer or "average", options.lr_scaling or "none",
                       options.link_bound_compression or "", options.averaging_compression or "none")
    check_precision(options.precision or "fp32")
    check_spec_values({**options.requested_spec(), **(facts or {})})
    return facts


def membership_options(options: JoinOptions):
    from ravnest_swarm.membership.records import parse_run_address
    from ravnest_swarm.membership.volunteer import MembershipOptions
    from ravnest_swarm.net.node import parse_maddrs

    address = parse_run_address(options.run)
    return MembershipOptions(
        initial_peers=parse_maddrs(options.initial_peers), run=address.name, owner=address.owner, name=options.name,
        ram_gb=options.ram_gb,
        max_ram_gb=options.max_ram_gb, gflops=options.gflops, bandwidth_mbps=options.bandwidth_mbps,
        heartbeat=options.heartbeat, timeout=options.timeout, host_maddrs=options.host_maddrs,
        announce_maddrs=options.announce_maddrs, identity_path=options.identity, device=options.device,
        patience=options.patience,
        device_memory_gb=options.device_memory_gb)


def planning_options(options: JoinOptions):
    from ravnest_swarm.planning.cost import DEFAULT_MOVE_HORIZON_S
    from ravnest_swarm.planning.plan import make_workload
    from ravnest_swarm.planning.round import RoundOptions

    workload = make_workload(options.model_gb, options.gflop_per_sample, options.activation_mb, options.max_stages,
                             options.max_in_flight)  # as `plan` does: None (not given) counts every stage busy
    return RoundOptions(workload, options.min_peers, options.round_period, options.round_seconds, options.num_layers,
                        move_horizon_s=options.move_horizon_s or DEFAULT_MOVE_HORIZON_S)


def volunteer_options(options: JoinOptions):
    from ravnest_swarm.swarm.volunteer import VolunteerOptions

    return VolunteerOptions(checkpoint_dir=options.checkpoint_dir, checkpoint_every=options.checkpoint_every,
                            resume=options.resume, min_peers=options.min_peers, round_seconds=options.round_seconds,
                            round_period=options.round_period, max_stages=options.max_stages,
                            handover_timeout=options.handover_timeout, data=options.data, report=options.report,
                            owner_key=options.owner_key, snapshot_dir=options.snapshot_dir,
                            snapshot_every=options.snapshot_every, init_from=options.init_from, ticket=options.ticket)


async def watch_peers(node, run: str, stop: asyncio.Event, period: float, live: bool, console: Console, me=None,
                      steps=None, viewer=None, known: Optional[Callable[[], Optional[List[Dict]]]] = None) -> None:
    """Show the run until ``stop`` is set: the live dashboard (docs/dashboard.md), or one log line per change.
    ``steps``: the run's length, for the dashboard to say when the run is finished; ``me`` and ``viewer``: the
    volunteer's name and peer id (None for an observer), whose cluster and neighbours a large run's dashboard
    shows; ``known``: the records a volunteer's own view holds (``PeerAnnouncer.records``, None before its first
    read), which the log lines then report without reading the DHT again (the announcer reads it every heartbeat
    already)."""
    from ravnest_swarm.dashboard.focus import sees_part
    from ravnest_swarm.dashboard.state import SwarmState
    from ravnest_swarm.swarm.observe import SnapshotReader

    if live:
        from ravnest_swarm.dashboard.live import watch_swarm

        await watch_swarm(SnapshotReader(node, run, viewer).snapshot, run, stop, period, console, me, steps)
        return

    last_names = None
    # reads as the dashboard does (a large run's in part), and merges each read into what is known: a read that
    # missed some records (a DHT node that did not answer in time) is no change to report
    reader, state = SnapshotReader(node, run, viewer, with_plan=False), SwarmState(run)

    async def wait():
        try:
            await asyncio.wait_for(stop.wait(), period)
        except asyncio.TimeoutError:
            pass

    while not stop.is_set():
        if known is not None:
            records = known()
            if records is None:  # a late joiner said "sees 0 peer(s)" here while the run's peers were live
                await asyncio.sleep(FIRST_READ_POLL)
                continue
            state.update(records)
        else:
            state.feed(await reader.snapshot())
        names = sorted(f"{p['name']}:{p['state']}" for p in state.peers)
        if names != last_names:
            # a large run's line names a screenful, not thousands of peers
            listed = ", ".join(names[:LOGGED_NAMES]) + (f", and {len(names) - LOGGED_NAMES} more"
                                                        if len(names) > LOGGED_NAMES else "")
            of_run = f" (of {state.summary['peers']} in the run)" if sees_part(state) else ""
            console.print(f"{me or 'observer'} sees {len(names)} peer(s){of_run}: {listed}", markup=False,
                          highlight=False, soft_wrap=True)
            last_names = names
        await wait()
