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
from ravnest_swarm.swarm.spec import read_spec

RUN = "run-end"


@pytest.mark.timeout(400)
def test_the_owner_extends_and_ends_the_run_a_stranger_cannot_and_status_says_finished_after_all_left(processes,
                                                                                                     tmp_path):
    backbone = processes.start(["backbone", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--run", RUN], "backbone")
    maddr = backbone.maddrs()[0]
    owner_env = {OWNER_KEYS_ENV: str(tmp_path / "owner-keys")}
    stranger_key = tmp_path / "stranger.key"
    load_or_create_owner_key(str(stranger_key))
    peers = {}
    for index in range(2):
        args = ["join", "--initial-peers", maddr, "--run", RUN, "--name", f"p{index}", "--no-dashboard", "--steps", "4000",
                "--heartbeat", "2", "--round-seconds", "6", "--min-peers", "2", "--ram-gb", f"{MODEL_GB * 0.6:.9f}",
                "--gflops", "20", "--bandwidth-mbps", "100", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                *(("--model", "mlp-digits") if index == 0 else ())]
        # only p0 (the run's starter) holds the owner key; p1 keeps its keys elsewhere, as another machine would
        peers[f"p{index}"] = processes.start(args, f"p{index}", env=owner_env if index == 0 else
                                             {OWNER_KEYS_ENV: str(tmp_path / "p1-keys")})
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
