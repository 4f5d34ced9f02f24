"""A backbone peer: a long-lived DHT server and relay that welcomes volunteers and trains nothing."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from hivemind.utils.multiaddr import Multiaddr

from ravnest_swarm.lifecycle import configure_logging, install_stop_signals, run_async
from ravnest_swarm.membership.records import make_validators, parse_run_address
from ravnest_swarm.membership.services import BackboneServices
from ravnest_swarm.net.node import parse_maddrs, start_node, stop_node


class Backbone:
    """DHT node + libp2p relay service (p2pd's default) with a persistent identity.

    :param host_maddrs: where to listen, e.g. ``/ip4/0.0.0.0/tcp/31337``
    :param announce_maddrs: the public addresses volunteers dial (needed behind a cloud NAT)
    :param identity_path: private key file; created on first start and reused, so the peer id is stable
    :param initial_peers: other backbones to join
    :param runs: runs whose records this node validates too, by name or address (``demo@<owner>``: then it also
        refuses specs not signed by that owner); it serves every run's keys either way, and honest volunteers
        validate what they read, so this only keeps garbage out of its own storage
    """

    def __init__(
        self,
        host_maddrs: Sequence[str],
        announce_maddrs: Optional[Sequence[str]] = None,
        identity_path: Optional[str] = None,
        initial_peers: Sequence[Multiaddr] = (),
        runs: Sequence[str] = (),
        timeout: float = 15.0,
    ):
        self.host_maddrs, self.announce_maddrs = list(host_maddrs), announce_maddrs
        self.identity_path, self.initial_peers, self.timeout = identity_path, list(initial_peers), timeout
        self.runs = [parse_run_address(run) for run in runs]
        self.node = None

    async def start(self) -> list:
        validators = []
        for run in self.runs:
            validators.extend(make_validators(run.name, run.owner))
        self.node = await start_node(
            self.initial_peers,
            record_validators=validators,
            host_maddrs=self.host_maddrs,
            announce_maddrs=self.announce_maddrs,
            identity_path=self.identity_path,
            timeout=self.timeout,
        )
        await BackboneServices(self.node.p2p).add_handlers()
        return await self.visible_maddrs()

    async def visible_maddrs(self) -> list:
        return [str(maddr) for maddr in await self.node.p2p.get_visible_maddrs()]

    async def serve_forever(self) -> None:
        await install_stop_signals().wait()
        await stop_node(self.node)


@dataclass
class BackboneOptions:
    """What ``ravnest-swarm backbone`` was asked to do (its flags; see :class:`Backbone` for each)."""

    host_maddrs: List[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/31337"])
    announce_maddrs: Optional[List[str]] = None
    identity: Optional[str] = None
    initial_peers: List[str] = field(default_factory=list)
    runs: List[str] = field(default_factory=list)
    timeout: float = 15.0
    verbose: bool = False


def run_backbone_process(options: BackboneOptions) -> int:
    """A backbone's whole life as a process: checks, start, serve until SIGINT/SIGTERM; returns its exit code."""
    configure_logging(options.verbose)

    async def main():
        parse_maddrs(options.host_maddrs, what="--host-maddrs", need_peer_id=False)
        parse_maddrs(options.announce_maddrs or [], what="--announce-maddrs", need_peer_id=False)
        await run_backbone(Backbone(options.host_maddrs, options.announce_maddrs, options.identity,
                                    parse_maddrs(options.initial_peers), options.runs, options.timeout))

    return run_async(main())


async def run_backbone(backbone: Backbone) -> None:
    for maddr in await backbone.start():
        print(maddr, flush=True)
    print("backbone ready; Ctrl-C to stop", file=sys.stderr, flush=True)
    await backbone.serve_forever()
    print("backbone stopped", file=sys.stderr, flush=True)  # an operator sees its Ctrl-C ended it, cleanly
