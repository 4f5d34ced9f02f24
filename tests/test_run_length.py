"""The run decides its length: the README's flow (backbone, doctor, three `join`, `status`) with a fourth
volunteer joining mid-run, placed within 90 s, and every peer and `status` saying when the run is finished (the
dashboard of `status --watch` too, started before the run's owner published its spec)."""

import json
import re
import sys
import time

import pytest

from run_observer import RunObserver
from test_dashboard import PTY_WRAPPER
from test_swarm import MODEL_GB, placed
from commands import ravnest

RUN = "readme-flow"
STEPS = 6000


@pytest.mark.timeout(480)
def test_a_fourth_joiner_is_placed_mid_run_and_everyone_says_when_the_run_is_finished(processes):
    maddr = processes.start(["backbone", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--run", RUN], "backbone").maddrs()[0]
    doctor = ravnest("doctor", "--initial-peers", maddr)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    watcher = RunObserver(maddr, RUN, period=1.0)
    # a dashboard started before the run's owner published its spec learns the run's length when it does
    watching = processes.start(["status", "--initial-peers", maddr, "--run", RUN, "--watch"], "watching",
                               prefix=[sys.executable, "-c", PTY_WRAPPER])

    def join(name, *extra):
        # each offers RAM for 0.6 of the model, so a cluster needs two of them (a home PC would measure its own)
        return processes.start(["join", "--initial-peers", maddr, "--run", RUN, "--name", name, "--no-dashboard",
                                "--ram-gb", f"{MODEL_GB * 0.6:.9f}", "--gflops", "20", "--bandwidth-mbps", "100",
                                "--host-maddrs", "/ip4/127.0.0.1/tcp/0", *extra], name)

    try:
        volunteers = {"p0": join("p0", "--model", "mlp-digits", "--steps", str(STEPS), "--averaging-period", "100")}
        volunteers.update({name: join(name) for name in ("p1", "p2")})
        watcher.wait_for(lambda peers: len(placed(peers)) >= 2 and max(p.get("step") or 0 for p in peers.values()) >= 100,
                         180, "the first three train")
        joined = time.monotonic()
        volunteers["p3"] = join("p3")
        first = watcher.wait_for(lambda peers: "p3" in placed(peers) and peers["p3"]["state"] == "training", 120,
                                 "the fourth volunteer is placed")["p3"]["step"]
        watcher.wait_for(lambda peers: (peers.get("p3", {}).get("step") or 0) > first, 60, "the fourth trains")
        placed_after = time.monotonic() - joined
        assert placed_after <= 90, f"the fourth volunteer trained only {placed_after:.0f}s after joining"
        # every stage placed after the first plan continues the run's state, none starts over from step 0
        for name, process in volunteers.items():
            starts = re.findall(rf"^{name}: training cluster \d+ stage \d+/\d+ layers \d+:\d+ from step (\d+)",
                                process.stderr(), re.MULTILINE)
            first_plan = name != "p3" and f"{name}: standby in plan round 1" not in process.stderr()
            assert [int(step) for step in starts].count(0) <= (1 if first_plan else 0), (name, starts)

        peers = watcher.wait_for(lambda peers: len(placed(peers)) == 4 and
                                 all(p["state"] == "done" for p in placed(peers).values()), 300,
                                 "every volunteer trains until the run's length")
        assert all(p["step"] == STEPS for p in placed(peers).values()), {name: p["step"] for name, p in peers.items()}
        for name, process in volunteers.items():
            process.wait_for_output(rf"^{name}: run {RUN} is finished", 30, stream="stderr")
        table = ravnest("status", "--initial-peers", maddr, "--run", RUN)
        assert table.returncode == 0 and f"run {RUN} is finished" in table.stdout, table.stdout + table.stderr
        document = json.loads(ravnest("status", "--initial-peers", maddr, "--run", RUN, "--json").stdout)
        assert document["finished"] is True and document["steps"] == STEPS
        watching.wait_for_output(rf"finished at step {STEPS}", 60)  # in the title, between colour codes
        assert watching.stop(grace=20) == 0

        # one who joins a finished run is told so in one line, and leaves
        late = join("late")
        assert late.wait(90) == 0
        assert f"run {RUN} is finished" in late.stderr()
    finally:
        watcher.close()
