"""``bench pipeline``: the asynchronous pipeline beside a synchronous GPipe-style schedule, same stages and links.

Every stage runs as its own process (one torch thread) on its own host of a
:class:`~ravnest_swarm.bench.netlab.NetLab` (namespaces on a hub, ``tc tbf`` rate, userspace delay relay;
loopback without root, which the output says). The same stages run twice: asynchronously (steps on
every gradient, ``--max-in-flight`` microbatches in flight) and synchronously (the same number of
microbatches per step, flushed every step). Before that, a bulk tensor is sent over the hivemind P2P
transport and over a raw TCP socket, on the emulated link and on plain loopback.

Each host also gets its own share of the CPU (``--cpus-per-stage``, by default the machine's cores divided
by the stages; a cgroup quota, root only): stages are meant to be different peers' computers, and on
shared cores a stage that idles through a synchronous flush would lend its CPU to the others, which
hides the very bubbles the comparison is about. ``--cpus-per-stage 0`` shares the cores as before.

Steady state: from the moment stage 0 has completed its first ``max_in_flight`` microbatches (the
pipeline is full) to its last injection (after it, the pipeline only drains). Busy fraction: the share
of that window during which the stage had a forward, backward or send in progress (``compute_fraction``:
forward or backward only, wall time, so it includes waiting for a core). Throughput: samples
completed after the window opens, divided by the time to the last completion.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from ravnest_swarm.bench.transfer import (TransferSendOptions, TransferServeOptions, run_transfer_send,
                                          run_transfer_serve)
from ravnest_swarm.membership.backbone import BackboneOptions, run_backbone_process
from ravnest_swarm.pipeline.config import Neighbours
from ravnest_swarm.pipeline.stage import StageConfig, StageProcessOptions, run_stage_process
from ravnest_swarm.errors import UserError

STAGE_PORT, TRANSFER_P2P_PORT, TRANSFER_TCP_PORT = 0, 1, 2


def busy_fraction(intervals: Sequence[Sequence[float]], start: float, end: float) -> float:
    covered = sum(max(0.0, min(b, end) - max(a, start)) for a, b in intervals)
    return covered / max(end - start, 1e-9)


def steady_state(first: Dict, warmup: int) -> Tuple[float, float, float]:
    """(window start, last injection, last completion) from stage 0's report."""
    completes = first["complete_times"]
    if len(completes) <= warmup:
        raise UserError(f"only {len(completes)} microbatches completed: raise --microbatches above {warmup}", 1)
    return completes[warmup - 1], first["inject_times"][-1], completes[-1]


def round_trip_breakdown(reports: List[Dict], start: float, end: float) -> Dict:
    """Median milliseconds of each part of a microbatch's round trip, over those injected in [start, end].

    Per stage: queueing (arrival to compute start) and compute, forward and backward; per hop: transit (the
    sender's compute end to the receiver's arrival: serialization, the sender's channel queue, p2pd, the link
    and reading). The last stage's forward holds its loss and backward. Medians, so the parts add up to the
    median round trip only roughly.
    """
    def median(values: List[float]) -> Optional[float]:
        values = sorted(values)
        return round(1000 * values[len(values) // 2], 1) if values else None

    events = [{(event, microbatch): t for t, event, microbatch in report["trace"]} for report in reports]
    last = len(reports) - 1
    chosen = [m for (event, m), t in events[0].items() if event == "forward_arrived" and start <= t <= end]

    def part(stage_a: int, event_a: str, stage_b: int, event_b: str) -> Optional[float]:
        return median([events[stage_b][(event_b, m)] - events[stage_a][(event_a, m)] for m in chosen
                       if (event_a, m) in events[stage_a] and (event_b, m) in events[stage_b]])

    done_at_end = "forward_done"  # the last stage's forward includes its backward
    return dict(
        round_trip=part(0, "forward_arrived", 0, "backward_done" if last else done_at_end),
        microbatches=len(chosen),
        forward_queue=[part(s, "forward_arrived", s, "forward_started") for s in range(last + 1)],
        forward_compute=[part(s, "forward_started", s, "forward_done") for s in range(last + 1)],
        forward_hop=[part(s, "forward_done", s + 1, "forward_arrived") for s in range(last)],
        backward_hop=[part(s + 1, done_at_end if s + 1 == last else "backward_done", s, "backward_arrived")
                      for s in range(last)],
        backward_queue=[part(s, "backward_arrived", s, "backward_started") for s in range(last)],
        backward_compute=[part(s, "backward_started", s, "backward_done") for s in range(last)],
    )


def summarise(reports: List[Dict], warmup: int, microbatch_size: int) -> Dict:
    start, last_inject, last_complete = steady_state(reports[0], warmup)
    completed_after = len(reports[0]["complete_times"]) - warmup
    return dict(
        round_trip_ms=round_trip_breakdown(reports, start, last_inject),
        samples_per_s=round(completed_after * microbatch_size / (last_complete - start), 2),
        busy_fraction=[round(busy_fraction(r["busy"], start, last_inject), 3) for r in reports],
        compute_fraction=[round(busy_fraction(r["compute"], start, last_inject), 3) for r in reports],
        steady_state_s=round(last_inject - start, 3),
        completed=reports[0]["completed"], dropped=sum(r["dropped"] for r in reports),
        max_staleness=reports[0]["max_staleness"],
        final_loss=round(sum(loss for _, loss in reports[-1]["losses"][-10:]) / 10, 4),
    )


def measure_transfer(group, lab, name: str, megabytes: float, emulated: bool) -> Dict:
    """Receiver on host 1, sender on host 0; through the relay when ``emulated``, else plain 127.0.0.1."""
    if emulated:
        receiver = TransferServeOptions(lab.host_maddr(1, TRANSFER_P2P_PORT), lab.host_ip(1),
                                        lab.listen_port(1, TRANSFER_TCP_PORT), lab.announce_maddr(1, TRANSFER_P2P_PORT))
        dial_p2p = lab.announce_maddr(1, TRANSFER_P2P_PORT)
        dial_tcp = (lab.hub_ip(1), lab.relay_port(1, TRANSFER_TCP_PORT))
        sender_maddr, hosts = lab.host_maddr(0, TRANSFER_P2P_PORT), (lab.lab_host(1), lab.lab_host(0))
    else:
        port = lab.listen_port(1, TRANSFER_TCP_PORT) + 7
        dial_p2p = f"/ip4/127.0.0.1/tcp/{port + 1}"
        receiver = TransferServeOptions(dial_p2p, "127.0.0.1", port)
        dial_tcp, sender_maddr, hosts = ("127.0.0.1", port), "/ip4/127.0.0.1/tcp/0", (None, None)
    server = group.start_library(run_transfer_serve, receiver, f"{name}-serve", lab_host=hosts[0])
    try:
        peer = server.wait_for_output(r"^ready (\S+)$", 120).group(1)
        sender = group.start_library(run_transfer_send, TransferSendOptions(
            sender_maddr, peer, dial_p2p, *dial_tcp, megabytes=megabytes), f"{name}-send", lab_host=hosts[1])
        sender.wait(300)
        if sender.popen.returncode != 0:
            raise UserError(f"transfer probe failed: {sender.stderr()[-500:]}", 1)
        return json.loads(sender.stdout().strip().splitlines()[-1])
    finally:
        server.stop()


def bytes_per_sample(reports: List[Dict]) -> float:
    """Bytes every stage handed to its links (activations forward, gradients back), per sample stage 0 completed."""
    sent = sum(sum(report["bytes_sent"].values()) for report in reports)
    return round(sent / max(1, reports[0]["completed"] * reports[0]["microbatch_size"]), 1)


def bench_pipeline(stages: int, model: str, delay_ms: float, mbps: float, microbatches: int,
                   microbatch_size: int, max_in_flight: int, transfer_mb: float, mode: str, as_json: bool,
                   lr: float = 0.01, compression: Sequence[str] = ("none",), cpus_per_stage: Optional[float] = None,
                   model_config: str = "") -> int:
    """``compression``: the codecs to compare; the async schedule runs once with each, the sync one with the first.
    ``a>b``: codec ``a``, switching to ``b`` while a link is the bottleneck (``pipeline/link_codec.py``)."""
    from ravnest_swarm.models import balanced_split, get_model, load_model
    from ravnest_swarm.bench.netlab import NetLab, cpu_quota_unavailable
    from ravnest_swarm.processes import ProcessGroup

    try:
        ranges = balanced_split(load_model(model, model_config) if model_config else get_model(model), stages)
    except ValueError as e:
        raise UserError(str(e))
    console = Console(stderr=True)
    workdir = tempfile.mkdtemp(prefix="ravnest-bench-pipe-")
    group = ProcessGroup(workdir)
    results: Dict[str, Dict] = {}
    no_quota = cpu_quota_unavailable()
    if cpus_per_stage is None:
        cpus_per_stage = 0.0 if no_quota else (os.cpu_count() or 1) / stages
        if no_quota:
            console.print(f"[yellow]no CPU quota per stage ({no_quota}): the stages share the machine's cores[/]")
    elif cpus_per_stage and no_quota:
        raise UserError(f"--cpus-per-stage is not possible here: {no_quota}; pass 0 to share the cores")
    with NetLab(stages + 1, mbps=mbps, delay_ms=delay_ms, ports=(40000, 40001, 40002),
                cpus=cpus_per_stage or None) as lab, Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(), console=console, transient=not as_json,
    ) as progress:
        if lab.mode == "loopback":
            console.print(f"[yellow]no network namespaces ({lab.loopback_reason}): running on loopback, links NOT "
                          f"rate-limited[/]")
        try:
            transfers = progress.add_task("tensor transfer", total=2)
            emulated = measure_transfer(group, lab, "link", transfer_mb, emulated=True)
            progress.advance(transfers)
            loopback = measure_transfer(group, lab, "loopback", transfer_mb * 4, emulated=False)
            progress.advance(transfers)
            backbone_host = stages
            backbone = group.start_library(run_backbone_process, BackboneOptions(
                host_maddrs=[lab.host_maddr(backbone_host)], announce_maddrs=[lab.announce_maddr(backbone_host)]),
                "backbone", lab_host=lab.lab_host(backbone_host))
            initial = next(m for m in backbone.maddrs(120) if m.startswith(lab.announce_maddr(backbone_host)))
            for schedule, codec in [("async", codec) for codec in compression] + [("sync", compression[0])]:
                label = schedule if codec == compression[0] else f"{schedule}-{codec.replace('>', '-to-').replace('/', '-')}"
                task = progress.add_task(f"{schedule} pipeline, {codec}", total=microbatches)
                base, _, strong = codec.partition(">")
                results[label] = _run_schedule(group, lab, initial, model, ranges, schedule, microbatches,
                                               microbatch_size, max_in_flight, mode, lr, base, workdir,
                                               lambda done, task=task: progress.update(task, completed=done),
                                               model_config=model_config, label=label, link_bound=strong)
        except (RuntimeError, TimeoutError) as e:
            raise UserError(f"a bench process failed ({e}); logs in {workdir}", exit_code=1)
        finally:
            group.stop_all()
    summary = {label: summarise(reports, max_in_flight, microbatch_size) for label, reports in results.items()}
    by_codec = {}
    for codec in compression:
        label = "async" if codec == compression[0] else f"async-{codec.replace('>', '-to-').replace('/', '-')}"
        by_codec[codec] = dict(
            samples_per_s=summary[label]["samples_per_s"], busy_fraction=summary[label]["busy_fraction"],
            compute_fraction=summary[label]["compute_fraction"], bytes_per_sample=bytes_per_sample(results[label]),
            final_loss=summary[label]["final_loss"], codecs_at_end=[r["codecs"] for r in results[label]],
            codec_switches=sum(len(r["codec_switches"]) for r in results[label]),
            samples_per_s_vs_first=round(summary[label]["samples_per_s"] / summary["async"]["samples_per_s"], 3))
    report = dict(
        busy_fraction=summary["async"]["busy_fraction"],
        async_samples_per_s=summary["async"]["samples_per_s"],
        sync_samples_per_s=summary["sync"]["samples_per_s"],
        speedup=round(summary["async"]["samples_per_s"] / summary["sync"]["samples_per_s"], 3),
        p2p_mb_per_s=emulated["p2p_mb_per_s"], tcp_mb_per_s=emulated["tcp_mb_per_s"],
        p2p_vs_tcp=round(emulated["p2p_mb_per_s"] / emulated["tcp_mb_per_s"], 3),
        loopback_p2p_mb_per_s=loopback["p2p_mb_per_s"], loopback_tcp_mb_per_s=loopback["tcp_mb_per_s"],
        link=dict(lab.describe(), transfer_mb=transfer_mb, loopback_transfer_mb=transfer_mb * 4),
        async_run=summary["async"], sync_run=summary["sync"], codecs=by_codec,
        model=model, model_config=model_config, stages=stages, layer_ranges=ranges, microbatches=microbatches, microbatch_size=microbatch_size,
        max_in_flight=max_in_flight, microbatches_per_step=max_in_flight, mode=mode, compression=compression,
        cpu_count=os.cpu_count(), load_avg=[round(x, 2) for x in os.getloadavg()],
    )
    if as_json:
        print(json.dumps(report), flush=True)
    else:
        for key in ("busy_fraction", "async_samples_per_s", "sync_samples_per_s", "speedup", "p2p_mb_per_s",
                    "tcp_mb_per_s", "p2p_vs_tcp", "loopback_p2p_mb_per_s", "loopback_tcp_mb_per_s"):
            console.print(f"{key:>22}: {report[key]}")
        console.print(f"{'link':>22}: {report['link']}")
        for codec, figures in by_codec.items():
            console.print(f"{codec:>22}: {figures['samples_per_s']} samples/s ({figures['samples_per_s_vs_first']}x "
                          f"{compression[0]}), {figures['bytes_per_sample']:,.0f} bytes/sample, busy {figures['busy_fraction']}")
    return 0


def _run_schedule(group, lab, initial: str, model: str, ranges, schedule: str, microbatches: int,
                  microbatch_size: int, max_in_flight: int, mode: str, lr: float, compression: str, workdir: str,
                  on_progress, model_config: str = "", label: Optional[str] = None, optimizer: str = "sgd",
                  save: bool = False, link_bound: str = "") -> List[Dict]:
    """Start one stage process per host, wait for the run to finish, return the stages' reports. Each stage has
    an identity made here, so each takes messages only from its fixed neighbours, as a volunteer's stage from
    the ones its plan names. ``label`` names the run and its files (default: the schedule); ``save``: each stage
    writes its parameters to ``{workdir}/{label}-stage{index}.safetensors`` at the end."""
    label = label or schedule
    run = f"bench-{label}"
    processes = []
    identities = [os.path.join(workdir, f"{label}-stage{index}.key") for index in range(len(ranges))]
    peer_ids = [new_peer_id(path) for path in identities]
    for index, (start, end) in enumerate(ranges):
        report = os.path.join(workdir, f"{label}-report{index}.json")
        config = StageConfig(
            run=run, stage=index, stages=len(ranges), model=model, model_config=model_config, layers=(start, end),
            microbatches=microbatches, microbatch_size=microbatch_size, max_in_flight=max_in_flight, schedule=schedule,
            microbatches_per_step=max_in_flight, mode=mode, lr=lr, optimizer=optimizer, compression=compression,
            link_bound_compression=link_bound,
            trace=True, microbatch_timeout=120.0, send_timeout=120.0,
            neighbours=Neighbours(previous=peer_ids[index - 1] if index > 0 else None,
                                  next=peer_ids[index + 1] if index + 1 < len(ranges) else None))
        processes.append(group.start_library(run_stage_process, StageProcessOptions(
            config, [initial], host_maddrs=[lab.host_maddr(index)], announce_maddrs=[lab.announce_maddr(index)],
            report=report, identity=identities[index],
            save=os.path.join(workdir, f"{label}-stage{index}.safetensors") if save else None),
            f"{label}-stage{index}", lab_host=lab.lab_host(index)))
    first = processes[0]
    deadline = time.monotonic() + 600
    while any(p.popen.poll() is None for p in processes):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the {schedule} pipeline did not finish within 600s")
        failed = [p for p in processes if p.popen.poll() not in (None, 0)]
        if failed:
            raise RuntimeError(f"{failed[0].name} exited with {failed[0].popen.returncode}: {failed[0].stderr()[-500:]}")
        lines = [line for line in first.stdout().splitlines() if line.startswith("progress ")]
        if lines:
            on_progress(int(lines[-1].split()[1].split("/")[0]))
        time.sleep(0.5)
    on_progress(microbatches)
    reports = []
    for index in range(len(ranges)):
        with open(os.path.join(workdir, f"{label}-report{index}.json")) as f:
            reports.append(json.load(f))
    return reports


def new_peer_id(identity_path: str) -> str:
    """Write a new private key file at ``identity_path`` and return its peer id (base58)."""
    from hivemind.p2p import P2P, PeerID

    P2P.generate_identity(identity_path)
    with open(identity_path, "rb") as f:
        return PeerID.from_identity(f.read()).to_base58()
