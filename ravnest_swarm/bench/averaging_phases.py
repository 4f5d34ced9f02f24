"""The peer side of ``bench averaging``: the same round as multi-ring, as hivemind's averager and as one ring
(or, with ``--robust``, as the mean and as a robust aggregate, honest and attacked), each phase started at a
moment the coordinator writes into a shared directory."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time

import torch

from ravnest_swarm.averaging.partners import connect_members
from ravnest_swarm.averaging.robust import MEAN
from ravnest_swarm.averaging.robust_ring import attempt_for
from ravnest_swarm.averaging.segments import plan_rings, rings_of
from ravnest_swarm.errors import UserError
from ravnest_swarm.bench.synthetic import compression_by_name, single_ring_plan, synthetic_range

POLL_SECONDS = 0.02
# with --robust: the mean and the robust aggregate on honest values, then both with the attacker's scaled ones
ROBUST_PHASES = ("mean", "robust", "mean_attacked", "robust_attacked")


def wait_for_signal(directory: str, name: str) -> float:
    """Block until the bench writes the file ``name``, then until its time; return that time."""
    path = os.path.join(directory, name)
    while not os.path.exists(path):
        time.sleep(POLL_SECONDS)
    with open(path) as f:
        go = json.load(f)["time"]
    time.sleep(max(0.0, go - time.time()))
    return go


async def run_bench_phases(node, averager, options, plan: dict, local: torch.Tensor, start: int, config: dict) -> dict:
    """The three timed phases of one bench peer; prints ``ready``/``done`` lines the bench waits on.

    After its ``done`` line a peer waits until every peer is done (``over-{phase}``) before it does anything
    else, so no peer's checking, teardown or set-up of the next phase (hivemind's DHT process, forked from
    this one) runs on the shared cores while another peer is still in a timed phase.
    """

    me = node.peer_id.to_base58()
    directory, report = config["dir"], {}
    exact = torch.stack([synthetic_range(options.seed, k, options.layer_sizes, options.layers).double()
                         for k in range(config["clusters"])]).mean(0)
    original = local.clone()

    every_ring = plan_rings(plan, options.layer_sizes)
    rings = rings_of(me, every_ring)
    averager.expect(every_ring, 1)
    print("ready multiring", flush=True)
    await asyncio.to_thread(wait_for_signal, directory, "go-multiring")
    result = await averager.average(1, local, start, rings)
    report["multiring"] = dict(end=time.time(), ok=result.ok, failed_segments=result.failed_segments(),
                               seconds=result.seconds, resends=result.resends)
    print(f"done multiring {json.dumps(report['multiring'])}", flush=True)
    await asyncio.to_thread(wait_for_signal, directory, "over-multiring")
    report["multiring"]["max_abs_error"] = (local.double() - exact).abs().max().item()

    report["hivemind"] = await _hivemind_phase(options, plan, original.clone(), start, config)

    every_single = plan_rings(single_ring_plan(plan, options.layer_sizes), options.layer_sizes)
    single = rings_of(me, every_single)
    averager.expect(every_single, 2)
    whole = synthetic_range(options.seed, options.cluster, options.layer_sizes, (0, len(options.layer_sizes))) \
        if single else None
    await connect_members(node, options.run, single)
    print("ready single_ring", flush=True)
    await asyncio.to_thread(wait_for_signal, directory, "go-single_ring")
    if single:
        result = await averager.average(2, whole, 0, single)
        report["single_ring"] = dict(end=time.time(), ok=result.ok, seconds=result.seconds)
    else:
        report["single_ring"] = dict(end=time.time(), ok=True, idle=True)
    print(f"done single_ring {json.dumps(report['single_ring'])}", flush=True)
    await asyncio.to_thread(wait_for_signal, directory, "over-single_ring")
    return report


async def run_robust_phases(node, averager, options, plan: dict, local: torch.Tensor, start: int, config: dict,
                            attacked: torch.Tensor) -> dict:
    """``bench averaging --robust``: one round per phase of ``ROBUST_PHASES`` on the same rings, each from our
    original values (``attacked``: the scaled ones the attacking cluster's peers contribute, else ``local``).

    Every peer reports how far its result lies from the exact mean of every cluster's unscaled values (what
    the round gives without an attack), and ``spread``: how far the honest clusters' own values lie from it.
    """
    me = node.peer_id.to_base58()
    directory, report = config["dir"], {}
    honest = torch.stack([synthetic_range(options.seed, k, options.layer_sizes, options.layers).double()
                          for k in range(config["clusters"]) if k != config["attacker"]])
    exact = torch.stack([synthetic_range(options.seed, k, options.layer_sizes, options.layers).double()
                         for k in range(config["clusters"])]).mean(0)
    spread = (honest - exact).abs().max().item()
    every_ring = plan_rings(plan, options.layer_sizes)
    rings = rings_of(me, every_ring)
    for step, phase in enumerate(ROBUST_PHASES, start=1):
        aggregation = config["robust"] if phase.startswith("robust") else MEAN
        # the same averager (its handler, its mailbox), its rings told to aggregate this phase's way
        averager.ring_peer = dataclasses.replace(averager.ring_peer, attempt=attempt_for(aggregation))
        averager.expect(every_ring, step)
        values = (attacked if phase.endswith("attacked") else local).clone()
        print(f"ready {phase}", flush=True)
        await asyncio.to_thread(wait_for_signal, directory, f"go-{phase}")
        result = await averager.average(step, values, start, rings)
        report[phase] = dict(end=time.time(), ok=result.ok, failed_segments=result.failed_segments(),
                             seconds=result.seconds, resends=result.resends, rejected=len(result.rejected))
        print(f"done {phase} {json.dumps(report[phase])}", flush=True)
        await asyncio.to_thread(wait_for_signal, directory, f"over-{phase}")
        report[phase]["max_abs_deviation"] = (values.double() - exact).abs().max().item()
    report["spread"] = spread
    return report


async def _hivemind_phase(options, plan: dict, local: torch.Tensor, start: int, config: dict) -> dict:
    """One ``DecentralizedAverager`` per segment we own, matched before the go time, triggered at it."""
    from hivemind.averaging import DecentralizedAverager
    from hivemind.averaging.control import AveragingStage
    from hivemind.dht import DHT
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr


    # hivemind's DHT starts its own process and p2pd; created on the main thread (it installs signal handlers)
    dht = DHT(initial_peers=[str(m) for m in options.initial_peers], start=True,
              host_maddrs=[config["hivemind_host_maddr"]], announce_maddrs=[config["hivemind_announce_maddr"]])
    directory = config["dir"]
    path = os.path.join(directory, f"hivemind-c{options.cluster}s{options.stage}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(dict(peer_id=dht.peer_id.to_base58(), maddr=config["hivemind_announce_maddr"]), f)
    os.rename(path + ".tmp", path)  # others list this directory: they must never read a half-written file
    # p2pd's routing cannot resolve lab (non-public) addresses: dial every other hivemind peer first,
    # through a client of this DHT's daemon, which the averagers share
    p2p = await dht.replicate_p2p()
    deadline = time.monotonic() + 120
    while len([n for n in os.listdir(directory) if n.startswith("hivemind-") and n.endswith(".json")]) < config["peers"]:
        if time.monotonic() > deadline:
            raise UserError("not every bench peer started its hivemind DHT in time", exit_code=1)
        await asyncio.sleep(POLL_SECONDS)
    for name in os.listdir(directory):
        if name.startswith("hivemind-") and name.endswith(".json"):
            with open(os.path.join(directory, name)) as f:
                other = json.load(f)
            if other["peer_id"] != dht.peer_id.to_base58():
                await p2p._client.connect(PeerID.from_base58(other["peer_id"]), [Multiaddr(other["maddr"])])
    # our rings by our place in the plan: this DHT has an identity of its own
    me = _my_multiring_id(plan, options)
    rings = [ring for ring in plan_rings(plan, options.layer_sizes) if me in ring.members]
    averagers = [
        DecentralizedAverager(
            [local[ring.start - start:ring.end - start].clone()], dht, start=True,
            prefix=f"{options.run}_seg{ring.index}", target_group_size=config["clusters"],
            min_group_size=config["clusters"], min_matchmaking_time=2.0, request_timeout=5.0,
            compression=compression_by_name(options.compression), allreduce_timeout=options.timeout,
        )
        for ring in rings
    ]
    controls = [averager.step(require_trigger=True, wait=False, timeout=options.timeout + 60) for averager in averagers]
    deadline = time.monotonic() + 120
    while not all(c.stage == AveragingStage.AWAITING_TRIGGER or c.done() for c in controls):
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(POLL_SECONDS)
    matched = all(c.stage == AveragingStage.AWAITING_TRIGGER for c in controls)
    print("ready hivemind", flush=True)
    await asyncio.to_thread(wait_for_signal, directory, "go-hivemind")

    def run() -> bool:
        for control in controls:
            control.allow_allreduce()
        ok = True
        for control in controls:
            try:
                ok = control.result() is not None and ok
            except Exception:
                ok = False
        return ok

    ok = await asyncio.to_thread(run) if matched else False
    report = dict(end=time.time(), ok=ok and matched, matched=matched, segments=len(controls))
    print(f"done hivemind {json.dumps(report)}", flush=True)
    await asyncio.to_thread(wait_for_signal, directory, "over-hivemind")
    for averager in averagers:
        averager.shutdown()
    await p2p.shutdown()
    dht.shutdown()
    return report


def _my_multiring_id(plan: dict, options) -> str:
    return next(stage["peer_id"] for stage in plan["clusters"][options.cluster]
                if list(stage["layers"]) == list(options.layers))
