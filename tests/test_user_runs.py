"""A user's model and a user's data in real runs: `local` trains them; a joiner whose code or data differs
refuses with one line and leaves nothing running."""

import json
import os
import subprocess
import sys
import time

import pytest

from process_tree import alive, descendants, kill_pids
from run_observer import RunObserver
from test_user_models import USER_MODELS, features_dir, text_dir

from commands import ravnest
from ravnest_swarm.membership.records import RunAddress
from ravnest_swarm.swarm.spec import read_spec

pytestmark = pytest.mark.timeout(400)


def local(*args, env=None, timeout=300):
    """``local --json`` with ``args``; its processes (backbone, peers and their p2pd) are killed if it fails."""
    process = subprocess.Popen([sys.executable, "-m", "ravnest_swarm", "local", "--no-dashboard", "--json", *args],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                               env={**os.environ, **(env or {})}, start_new_session=True)
    started = set()
    try:
        deadline = time.monotonic() + timeout
        while process.poll() is None and time.monotonic() < deadline:
            started |= descendants(process.pid)
            time.sleep(0.5)
        assert process.poll() is not None, f"local did not finish within {timeout}s"
        stdout, stderr = process.communicate()
        assert process.returncode == 0, stderr[-3000:]
        return json.loads(stdout.strip().splitlines()[-1])
    finally:
        kill_pids(alive(started | {process.pid}))


def test_local_trains_a_user_model_from_outside_the_package_on_user_features(tmp_path):
    data = features_dir(tmp_path / "data")
    summary = local("--peers", "3", "--steps", "150", "--model", "tabular:build", "--model-config", "hidden=64",
                    "--optimizer", "sgd", "--lr", "0.3", "--data", data, env={"PYTHONPATH": USER_MODELS})
    assert summary["finished"], summary["stopped"]
    assert summary["loss_end"] < 0.7 * summary["loss_start"], (summary["loss_start"], summary["loss_end"])
    assert summary["metric"] > 0.5  # 4 classes: chance is 0.25


def test_local_trains_a_gpt_on_a_directory_of_text(tmp_path):
    with open(os.__file__, "rb") as f:  # the standard library's own source: text every machine has
        text = f.read()
    data = text_dir(tmp_path / "text", text)
    summary = local("--peers", "3", "--steps", "60", "--model", "gpt", "--model-config",
                    "layers=2,width=32,heads=2,context=32", "--data", data)
    assert summary["finished"], summary["stopped"]
    assert summary["loss_end"] < summary["loss_start"] - 0.5, (summary["loss_start"], summary["loss_end"])


def test_a_joiner_whose_model_or_data_differs_refuses_in_one_line_and_leaves_nothing(tmp_path, processes, backbone):
    data = features_dir(tmp_path / "data")
    run = "user-run"
    on_path = {"PYTHONPATH": USER_MODELS}
    processes.start(["join", "--initial-peers", backbone, "--run", run, "--name", "creator", "--no-dashboard",
                     "--model", "tabular:build", "--data", data, "--host-maddrs", "/ip4/127.0.0.1/tcp/0"],
                    "creator", env=on_path)
    observer = RunObserver(backbone, run)
    try:
        deadline = time.monotonic() + 120
        while observer.call(read_spec(observer.node, RunAddress(run))) is None:
            assert time.monotonic() < deadline, "the creator published no spec"
            time.sleep(0.5)
    finally:
        observer.close()

    # another copy of the module, whose layers are wider: same name, different code
    other = tmp_path / "other_code"
    other.mkdir()
    with open(os.path.join(USER_MODELS, "tabular.py")) as f:
        (other / "tabular.py").write_text(f.read().replace("hidden: int = 64", "hidden: int = 96"))
    other_data = features_dir(tmp_path / "other_data", seed=1)
    cases = [
        ("wider", {"PYTHONPATH": str(other)}, ["--data", data],
         "builds a different model from the run's tabular:build: layer 0 (inner): yours has 0.weight [96, 16] "
         "float32, the run's 0.weight [64, 16] float32"),
        ("otherdata", on_path, ["--data", other_data], f"your --data {other_data}"),
        ("nodata", on_path, [], "this run trains on its own data"),
    ]
    # each joiner refuses on its own: started together, they cost one refusal's wait instead of three
    joiners = {name: processes.start(["join", "--initial-peers", backbone, "--run", run, "--name", name,
                                      "--no-dashboard", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", *flags], name, env=env)
               for name, env, flags, _ in cases}
    children = {name: set() for name in joiners}
    deadline = time.monotonic() + 150
    while any(joiner.popen.poll() is None for joiner in joiners.values()) and time.monotonic() < deadline:
        for name, joiner in joiners.items():
            children[name] |= descendants(joiner.popen.pid)  # its p2pd, while it runs
        time.sleep(0.2)
    for name, _, _, fragment in cases:
        joiner = joiners[name]
        assert joiner.wait(5) == 1, joiner.stderr()
        errors = [line for line in joiner.stderr().splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and fragment in errors[0], joiner.stderr()
        assert "Traceback" not in joiner.stderr()
        assert children[name] and not alive(children[name]), f"{name} left {alive(children[name])} running"


@pytest.mark.parametrize("verb", ["join", "local"])
def test_bad_data_is_one_line_before_anything_starts(tmp_path, verb):
    (tmp_path / "empty").mkdir()
    peer_flags = ["--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmXZQ6jtyt8oZHGuNPBiJ4HFBGsm2bkdh9fNCnWu5A8RZt",
                  "--run", "r", "--name", "a"] if verb == "join" else []
    result = ravnest(verb, *peer_flags, "--model", "gpt-tiny", "--data", str(tmp_path / "empty"), timeout=60)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "holds no files" in errors[0], result.stderr
    assert "measur" not in result.stderr.lower()  # refused before measuring or joining anything

