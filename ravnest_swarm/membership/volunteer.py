"""``join`` up to being a standby member: measure, start the node, advertise, heartbeat, leave on a signal.

Later stages of the lifecycle (placement, training, averaging) build on :class:`Membership`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from functools import partial
from typing import List, Optional, Sequence

from hivemind.dht.node import DHTNode
from hivemind.utils.multiaddr import Multiaddr
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn

from ravnest_swarm.devices import device_kind, device_memory_gb
from ravnest_swarm.errors import UserError
from ravnest_swarm.membership.announcer import PeerAnnouncer
from ravnest_swarm.membership.capabilities import Capabilities, measure_gflops, measure_ram_gb
from ravnest_swarm.membership.records import make_validators
from ravnest_swarm.membership.services import check_reachability, failure_reason, measure_bandwidth, retried
from ravnest_swarm.net.identity import open_identity
from ravnest_swarm.net.node import answering_initial_peer, start_node_patiently, stop_node

logger = logging.getLogger(__name__)


@dataclass
class MembershipOptions:
    """What membership needs of ``join``'s options (``swarm/join.py``), validated."""

    initial_peers: List[Multiaddr]
    run: str  # the run's name: its DHT keys' prefix
    name: str
    owner: Optional[str] = None  # the run owner's fingerprint, where the run's address names it
    ram_gb: Optional[float] = None
    max_ram_gb: Optional[float] = None
    gflops: Optional[float] = None
    bandwidth_mbps: Optional[float] = None
    heartbeat: float = 5.0
    timeout: float = 15.0
    host_maddrs: Sequence[str] = ("/ip4/0.0.0.0/tcp/0",)
    announce_maddrs: Optional[Sequence[str]] = None
    probe_mb: float = 4.0
    identity_path: Optional[str] = None
    device: str = "cpu"  # resolved (devices.resolve_device): where this peer's stages compute
    device_memory_gb: Optional[float] = None  # overrides the device's memory the planner sizes stages by
    patience: float = 300.0  # seconds to keep trying the initial peers while none answers


async def measure(options: MembershipOptions, node: DHTNode, console: Console) -> Capabilities:
    """Measure what is not overridden, with a progress display; reachability is always asked of a backbone."""
    backbone = await answering_initial_peer(node, options.initial_peers)  # not one that is down
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[result]}"),
                  console=console, transient=False) as progress:
        ram_task = progress.add_task("RAM", total=1, result="")
        ram = options.ram_gb if options.ram_gb is not None else measure_ram_gb(options.max_ram_gb)
        progress.update(ram_task, completed=1, result=f"{ram:.1f} GB")
        device_memory = options.device_memory_gb
        if device_memory is None:
            device_memory = device_memory_gb(options.device, float(ram))
        if device_kind(options.device) != "cpu" or options.device_memory_gb is not None:
            progress.add_task(f"{options.device}", total=1, completed=1, result=f"{device_memory:.1f} GB")

        compute_task = progress.add_task("compute", total=1, result="")
        gflops = options.gflops
        if gflops is None:
            # a first figure on our device; a volunteer measures again on the run's model once it knows it
            gflops = await asyncio.get_running_loop().run_in_executor(None, partial(measure_gflops,
                                                                                    device=options.device))
        progress.update(compute_task, completed=1, result=f"{gflops:.1f} GFLOP/s")

        bandwidth_task = progress.add_task("bandwidth", total=1, result="")
        bandwidth = options.bandwidth_mbps
        if bandwidth is None and backbone is not None:
            try:
                bandwidth = await retried(lambda: measure_bandwidth(
                    node.p2p, backbone, int(options.probe_mb * 2**20), options.timeout,
                    on_progress=lambda done, total: progress.update(bandwidth_task, completed=done, total=total),
                ))
            except Exception as e:
                reason = failure_reason(e, options.timeout)
                raise UserError(f"the bandwidth probe to backbone {backbone} failed ({reason}); "
                                f"try again, or give --bandwidth-mbps to skip the probe", 1)
        bandwidth = bandwidth if bandwidth is not None else 0.0
        progress.update(bandwidth_task, completed=progress.tasks[bandwidth_task].total, result=f"{bandwidth:.0f} Mbit/s")

        reach_task = progress.add_task("reachability", total=1, result="")
        reachability = "unknown"
        if backbone is not None:
            try:
                reachability = await retried(lambda: check_reachability(node.routes, backbone, options.timeout))
            except Exception as e:
                reason = failure_reason(e, options.timeout)
                raise UserError(f"the reachability check by backbone {backbone} failed ({reason}); "
                                f"try again, or run ravnest-swarm doctor", 1)
        progress.update(reach_task, completed=1, result=reachability)
    return Capabilities(ram_gb=float(ram), gflops=float(gflops), bandwidth_mbps=float(bandwidth), reachability=reachability,
                        device=options.device, device_memory_gb=float(device_memory))


class Membership:
    """A volunteer's node and its heartbeating record, from start until it leaves.

    :param options: validated join options
    :param console: where progress and logs go
    """

    def __init__(self, options: MembershipOptions, console: Console):
        self.options, self.console = options, console
        self.node: Optional[DHTNode] = None
        self.announcer: Optional[PeerAnnouncer] = None
        self._heartbeat_task: Optional[asyncio.Task] = None

    async def start(self) -> PeerAnnouncer:
        # one key for p2pd and for our records: every node checks that a record naming us was signed by us
        identity = open_identity(self.options.identity_path)
        self.node = await start_node_patiently(
            self.options.initial_peers, self.options.patience, self._waiting_for_initial_peers,
            record_validators=make_validators(self.options.run, self.options.owner, signing_key=identity.key),
            host_maddrs=self.options.host_maddrs,
            announce_maddrs=self.options.announce_maddrs,
            identity=identity,
            timeout=self.options.timeout,
        )
        try:
            capabilities = await measure(self.options, self.node, self.console)
        except UserError:
            await stop_node(self.node)
            raise
        self.announcer = PeerAnnouncer(self.node, self.options.run, self.options.name, capabilities,
                                       self.options.heartbeat)
        maddrs = [str(m) for m in await self.node.p2p.get_visible_maddrs()]
        self.announcer.update(state="standby", maddrs=maddrs[:16])
        await self.announcer.find_bucket_count()
        await self.announcer.publish()
        self._heartbeat_task = asyncio.create_task(self.announcer.heartbeat_forever())
        return self.announcer

    def _waiting_for_initial_peers(self, reason: str, attempt: int, wait: float, left: float) -> None:
        self.console.print(f"{self.options.name}: waiting for the initial peers (attempt {attempt} failed: {reason}); "
                           f"trying again in {wait:.0f}s, for {left:.0f}s more", markup=False, highlight=False,
                           soft_wrap=True)

    async def leave(self) -> None:
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
        if self.announcer is not None:
            try:
                await asyncio.wait_for(self.announcer.leave(), self.options.timeout)
            except Exception as e:
                logger.warning(f"could not publish 'leaving': {e}")
        if self.node is not None:
            await stop_node(self.node)
