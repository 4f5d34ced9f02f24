"""An in-process observer of a run's peer records, polled by the tests (faster than a `status` subprocess)."""

import asyncio
import time
from typing import Callable, Dict

from ravnest_swarm.membership.reader import read_peers
from ravnest_swarm.membership.records import make_validators
from ravnest_swarm.net.node import parse_maddrs, start_node, stop_node


class RunObserver:
    """A client-mode DHT node on its own event loop that reads ``run``'s peer records; close it when done.

    :param maddr: a backbone's multiaddr
    :param run: the run whose peer records it reads
    :param period: seconds between reads in :meth:`wait_for`
    """

    def __init__(self, maddr: str, run: str, period: float = 0.25):
        self.run, self.period = run, period
        self.loop = asyncio.new_event_loop()
        self.node = self.call(start_node(parse_maddrs([maddr]), record_validators=make_validators(run),
                                         client_mode=True))

    def call(self, coroutine):
        """Run ``coroutine`` on the observer's event loop (where its node lives) and return its result."""
        return self.loop.run_until_complete(coroutine)

    def peers(self) -> Dict[str, dict]:
        """The live peer records, by name."""
        return {p["name"]: p for p in self.call(read_peers(self.node, self.run))}

    def wait_for(self, predicate: Callable[[Dict[str, dict]], bool], timeout: float, what: str = "condition",
                 period: float = None) -> Dict[str, dict]:
        """Read the records until ``predicate(peers)`` holds; return them, or raise ``TimeoutError``."""
        deadline, peers = time.monotonic() + timeout, {}
        while time.monotonic() < deadline:
            peers = self.peers()
            if predicate(peers):
                return peers
            time.sleep(self.period if period is None else period)
        summary = {n: (p["state"], p.get("cluster"), p.get("stage"), p.get("step")) for n, p in peers.items()}
        raise TimeoutError(f"{what}: not within {timeout}s; last view {summary}")

    def close(self) -> None:
        self.call(stop_node(self.node))
        self.loop.close()
