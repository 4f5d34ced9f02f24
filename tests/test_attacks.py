"""Attacks on an open run by strangers (issue #19), each against one run of real `join` processes.

The module starts one run (a backbone and two volunteers that form one cluster of two stages) and every
test attacks it from outside with its own hostile process (a stock hivemind DHT client or a raw libp2p
peer), then shows that the run keeps training and that what it attacked is unchanged. The last test
shows that a peer joining after all the attacks is placed and trains. Tests run in file order; keep the
late joiner last.
"""

import time
from typing import Callable, Dict

import pytest

from run_observer import RunObserver
from ravnest_swarm.models import get_model
from ravnest_swarm.processes import ProcessGroup
from ravnest_swarm.swarm.placement import model_workload
from ravnest_swarm.swarm.spec import RunSpec

RUN = "attacked"
MODEL_GB = model_workload(get_model("mlp-digits"), RunSpec("mlp-digits"), 8)[0].model_gb


class AttackedRun:
    """The run under attack: its backbone's multiaddr, its processes and an observer of its peer records."""

    def __init__(self, processes: ProcessGroup, maddr: str, observer: RunObserver):
        self.processes, self.maddr, self.observer = processes, maddr, observer

    def join(self, name: str, ram_fraction: float = 0.6, extra=()):
        """Start a volunteer; at 0.6 of the model's memory two of them form a cluster of two stages."""
        return self.processes.start(
            ["join", "--initial-peers", self.maddr, "--run", RUN, "--name", name, "--no-dashboard",
             "--model", "mlp-digits", "--steps", "100000", "--averaging-period", "20", "--heartbeat", "2",
             "--round-seconds", "6", "--min-peers", "2", "--ram-gb", f"{MODEL_GB * ram_fraction:.9f}",
             "--gflops", "20", "--bandwidth-mbps", "100", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", *extra], name)

    def training(self) -> Dict[str, dict]:
        """The records of the peers placed and training, by name."""
        return {name: p for name, p in self.observer.peers().items()
                if p["state"] == "training" and (p.get("cluster") or -1) >= 0}

    def wait_for(self, predicate: Callable[[Dict[str, dict]], bool], timeout: float, what: str) -> Dict[str, dict]:
        return self.observer.wait_for(predicate, timeout, what, period=1.0)

    def keeps_training(self, names=("v0", "v1"), steps: int = 5, timeout: float = 90) -> Dict[str, dict]:
        """Wait until each of ``names`` is placed and has trained ``steps`` more steps than now."""
        before = {name: (self.training().get(name) or {}).get("step") or 0 for name in names}
        return self.wait_for(lambda peers: all(
            peers.get(name, {}).get("state") == "training" and (peers[name].get("step") or 0) >= before[name] + steps
            for name in names), timeout, f"{', '.join(names)} train {steps} more steps after the attack")


@pytest.fixture(scope="module")
def attacked_run(tmp_path_factory):
    processes = ProcessGroup(str(tmp_path_factory.mktemp("attacked")))
    observer = None
    try:
        backbone = processes.start(["backbone", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--run", RUN], "backbone")
        maddr = backbone.maddrs()[0]
        observer = RunObserver(maddr, RUN)
        run = AttackedRun(processes, maddr, observer)
        run.join("v0")
        run.join("v1")
        run.wait_for(lambda peers: {"v0", "v1"} <= set(run.training()) and
                     all((p.get("step") or 0) > 0 for p in run.training().values()),
                     150, "v0 and v1 placed in one cluster and training")
        yield run
    finally:
        if observer is not None:
            observer.close()
        processes.stop_all()


# --- attacks go above this line, each a test named after its attack ---


@pytest.mark.timeout(240)
def test_a_peer_joining_after_the_attacks_is_placed_and_trains(attacked_run):
    """After every attack above, a newcomer that can hold the whole model is placed and trains, and the
    first two volunteers are still training."""
    attacked_run.join("late", ram_fraction=1.3)
    attacked_run.wait_for(lambda peers: "late" in attacked_run.training() and
                          (attacked_run.training()["late"].get("step") or 0) > 0,
                          180, "the late joiner placed and training")
    attacked_run.keeps_training(("v0", "v1", "late"))
