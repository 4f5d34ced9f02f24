"""The owner ends or extends the run (issue 31): `update-spec --steps` extends a training run and its peers train to
the new length; a stranger can neither extend nor finish it; the owner's peer signs the run's end into its spec, so
`status` says the run is finished after every peer has left, and `update-spec --finish` ends it the same way."""

import json
import os
import time

import pytest

from commands import ravnest
from run_observer import RunObserver
from test_cli import assert_one_line_error
from test_swarm import MODEL_GB, placed
from ravnest_swarm.membership.owner import OWNER_KEYS_ENV, load_or_create_owner_key
from ravnest_swarm.membership.records import RunAddress
from ravnest_swarm.swarm.spec import OPEN_ENDED, read_spec

RUN = "run-end"


def start_pair(processes, tmp_path, run: str, steps: str):
    """A backbone and two volunteers that form one cluster of two stages; p0 starts the run and owns it."""
    backbone = processes.start(["backbone", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--run", run], "backbone")
    maddr = backbone.maddrs()[0]
    owner_env = {OWNER_KEYS_ENV: str(tmp_path / "owner-keys")}
    peers = {}
    for index in range(2):
        args = ["join", "--initial-peers", maddr, "--run", run, "--name", f"p{index}", "--no-dashboard", "--steps", steps,
                "--heartbeat", "2", "--round-seconds", "6", "--min-peers", "2", "--ram-gb", f"{MODEL_GB * 0.6:.9f}",
                "--gflops", "20", "--bandwidth-mbps", "100", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                *(("--model", "mlp-digits") if index == 0 else ())]
        # only p0 (the run's starter) holds the owner key; p1 keeps its keys elsewhere, as another machine would
        peers[f"p{index}"] = processes.start(args, f"p{index}", env=owner_env if index == 0 else
                                             {OWNER_KEYS_ENV: str(tmp_path / "p1-keys")})
    return maddr, owner_env, peers


@pytest.mark.timeout(400)
def test_the_owner_extends_and_ends_the_run_a_stranger_cannot_and_status_says_finished_after_all_left(processes,
                                                                                                     tmp_path):
    maddr, owner_env, peers = start_pair(processes, tmp_path, RUN, "4000")
    stranger_key = tmp_path / "stranger.key"
    load_or_create_owner_key(str(stranger_key))
    watcher = RunObserver(maddr, RUN, period=0.5)
    try:
        watcher.wait_for(lambda seen: len(placed(seen)) == 2 and min(p.get("step") or 0 for p in placed(seen).values())
                         >= 50, 200, "both stages training")

        def update(*args, env=None):
            return ravnest("update-spec", "--initial-peers", maddr, "--run", RUN, *args, env=env)

        extended = update("--steps", "4600", env=owner_env)  # first: the stages must still be training
        assert extended.returncode == 0 and "steps=4600" in extended.stdout, extended.stderr
        for change in (["--finish"], ["--steps", "9"]):
            assert_one_line_error(update(*change, "--owner-key", str(stranger_key)), "no spec signed by your owner key",
                                  code=1)
        seen = watcher.wait_for(lambda seen: len(placed(seen)) == 2 and all(p["state"] == "done"
                                                                          for p in placed(seen).values()),
                                240, "both stages done")
        assert all(p["step"] == 4600 for p in placed(seen).values()), seen  # the new length, not 4000
        # p0 holds the owner key: it signs the end into the spec
        deadline = time.monotonic() + 30
        while not watcher.call(read_spec(watcher.node, RunAddress(RUN))).finished:
            assert time.monotonic() < deadline, "the owner's peer never signed the run's end"
            time.sleep(1)
        assert json.loads(ravnest("status", "--initial-peers", maddr, "--run", RUN, "--json").stdout)["finished"]
        # its stages stopped: a longer length would change the spec and train nothing, so the owner is told so
        assert_one_line_error(update("--steps", "9000", env=owner_env), "is finished", code=1)
        for process in peers.values():
            process.stop()
        watcher.wait_for(lambda seen: not seen, 60, "every peer's record to expire")
    finally:
        watcher.close()
    after = ravnest("status", "--initial-peers", maddr, "--run", RUN)
    assert after.returncode == 0 and "is finished" in after.stdout and "every peer has left" in after.stdout, after
    assert "p0: signed the end of run" in peers["p0"].stderr()
    ended = ravnest("update-spec", "--initial-peers", maddr, "--run", RUN, "--finish", env=owner_env)
    assert ended.returncode == 0 and "finished" in ended.stdout, ended.stderr
    assert "is finished" in ravnest("status", "--initial-peers", maddr, "--run", RUN).stdout
    assert os.listdir(tmp_path / "owner-keys") == [f"{RUN}.key"]


@pytest.mark.timeout(300)
def test_an_open_ended_run_trains_until_its_owner_ends_it(processes, tmp_path):
    """``--steps 0``: no length; the stages train on until ``update-spec --finish``, then stop where they are, and
    the run is finished (signed) even though nobody reached a length."""
    run = "open-ended"
    maddr, owner_env, peers = start_pair(processes, tmp_path, run, "0")
    watcher = RunObserver(maddr, run, period=0.5)
    try:
        watcher.wait_for(lambda seen: len(placed(seen)) == 2 and min(p.get("step") or 0 for p in placed(seen).values())
                         >= 300, 200, "both stages past step 300")
        spec = watcher.call(read_spec(watcher.node, RunAddress(run)))
        assert spec.steps == OPEN_ENDED and not spec.finished
        again = ravnest("update-spec", "--initial-peers", maddr, "--run", run, "--steps", "0", env=owner_env)
        assert again.returncode == 0 and again.stdout.rstrip().endswith("spec version 2: steps=open-ended"), again
        ended = ravnest("update-spec", "--initial-peers", maddr, "--run", run, "--finish", env=owner_env)
        assert ended.returncode == 0 and "finished" in ended.stdout, ended.stderr
        seen = watcher.wait_for(lambda seen: len(placed(seen)) == 2 and all(p["state"] == "done"
                                                                          for p in placed(seen).values()),
                                60, "both stages done")
        assert all(300 <= p["step"] < OPEN_ENDED for p in placed(seen).values()), seen
        status = json.loads(ravnest("status", "--initial-peers", maddr, "--run", run, "--json").stdout)
        assert status["finished"], status
    finally:
        watcher.close()
    assert "steps open-ended" not in peers["p1"].stderr()  # the length never changed: only the end was signed
    assert "run open-ended is finished" in peers["p1"].stderr()
