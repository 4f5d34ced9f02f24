"""``ravnest-swarm local --resume``: a whole local swarm killed with SIGKILL mid-training loses nothing.

The attack: every process of a running ``local`` swarm (the ``local`` process, its backbone, every
volunteer and every p2pd) is frozen and then SIGKILLed at one moment, mid-training and past several
checkpoints, as a power cut would: no process gets to finish a write, write a last checkpoint or clean
up. Then every checkpoint left must read cleanly (a write in flight leaves at most a hidden temporary
file, never a half-written checkpoint), and ``local --resume`` must restart every peer that had a
checkpoint from exactly that checkpoint's step and train to the end.
"""

import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from ravnest_swarm.checkpoint import TEMPORARY_PREFIX, TEMPORARY_SUFFIX, read_stage, save_stage

# long enough that the kill lands mid-training: a 2-stage mlp-digits cluster trains about 100 steps a second here
PEERS, STEPS, CHECKPOINT_EVERY = 4, 1200, 20
CHECKPOINT = re.compile(r"^local-peer\d+\.safetensors$")
IDENTITY = re.compile(r"^local-peer\d+\.key$")


class LocalRun:
    """A ``local`` process in its own session, and every process seen under it while it ran.

    :param arguments: arguments after ``ravnest-swarm local``
    :param log_dir: where its stdout and stderr go
    :param name: a label for the log files
    """

    def __init__(self, arguments, log_dir, name):
        self.stdout_path, self.stderr_path = log_dir / f"{name}.out", log_dir / f"{name}.err"
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.popen = subprocess.Popen([sys.executable, "-m", "ravnest_swarm", "local", *arguments],
                                          stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
        self.seen = {self.popen.pid: psutil.Process(self.popen.pid)}

    def look(self):
        """Remember every process now under ``local`` (an orphan is no longer its descendant)."""
        try:
            for child in self.seen[self.popen.pid].children(recursive=True):
                self.seen.setdefault(child.pid, child)
        except psutil.Error:
            pass

    def wait(self, timeout):
        """Wait for ``local`` to exit, watching its processes meanwhile; return its exit status."""
        deadline = time.monotonic() + timeout
        while self.popen.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"local did not exit within {timeout}s; stderr: {self.stderr()[-3000:]}")
            self.look()
            time.sleep(1.0)
        return self.popen.returncode

    def stdout(self):
        return self.stdout_path.read_text(errors="replace")

    def stderr(self):
        return self.stderr_path.read_text(errors="replace")

    def signal_all(self, sig):
        """Send ``sig`` to every process seen, by pid (psutil refuses a pid reused by another process)."""
        for process in self.seen.values():
            try:
                process.send_signal(sig)
            except psutil.Error:
                pass

    def kill_everything_at_once(self):
        """Freeze the whole tree (repeating until no new process appears), then SIGKILL every frozen process."""
        known = None
        while known != set(self.seen):
            known = set(self.seen)
            self.signal_all(signal.SIGSTOP)
            self.look()
        self.signal_all(signal.SIGKILL)
        self.popen.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.alive():
            time.sleep(0.1)  # SIGKILL is delivered at once, but a process takes a moment to be torn down

    def alive(self):
        """The processes seen that still run: not gone, and not zombies (a killed orphan may wait for a reaper)."""
        running = []
        for process in self.seen.values():
            try:
                if process.status() != psutil.STATUS_ZOMBIE:
                    running.append((process.pid, process.name(), process.status()))
            except psutil.NoSuchProcess:
                pass
        return running

    def stop(self):
        """SIGKILL whatever is still alive of this run; for ``finally``."""
        self.look()
        self.signal_all(signal.SIGKILL)
        if self.popen.poll() is None:
            self.popen.wait(10)


def checkpoint_steps(directory):
    """Step of every checkpoint file in ``directory``; raises if any of them does not read cleanly."""
    return {name: read_stage(str(directory / name))[1]["info"]["step"]
            for name in os.listdir(directory) if CHECKPOINT.match(name)}


def freshest_step_per_layer(directory):
    layers = {}
    for name in os.listdir(directory):
        if CHECKPOINT.match(name):
            info = read_stage(str(directory / name))[1]["info"]
            for layer in range(*info["layers"]):
                layers[layer] = max(layers.get(layer, 0), info["step"])
    return layers


@pytest.mark.timeout(900)
def test_kill_every_process_of_a_local_run_then_resume_loses_nothing(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    arguments = ["--peers", str(PEERS), "--steps", str(STEPS), "--checkpoint-every", str(CHECKPOINT_EVERY),
                 "--checkpoint-dir", str(checkpoints), "--json", "--no-dashboard", "--time-limit", "400"]
    first = LocalRun(arguments, tmp_path, "first")
    resumed = None
    try:
        deadline, steps = time.monotonic() + 300, {}
        while time.monotonic() < deadline:
            assert first.popen.poll() is None, f"local exited before the kill: {first.stderr()[-3000:]}"
            first.look()
            if checkpoints.is_dir():
                steps = checkpoint_steps(checkpoints)
            if len(steps) >= 2 and max(steps.values()) >= 3 * CHECKPOINT_EVERY:
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"training never got past three checkpoints: {steps}")
        time.sleep(random.uniform(0.0, 2.0))  # strike between checkpoints, or during a write, not just after one
        first.kill_everything_at_once()
        assert first.alive() == []

        files = sorted(os.listdir(checkpoints))
        # a write in flight at the kill leaves only its hidden temporary file, never a checkpoint lookalike
        strays = [f for f in files if not (CHECKPOINT.match(f) or IDENTITY.match(f) or
                                           (f.startswith(TEMPORARY_PREFIX) and f.endswith(TEMPORARY_SUFFIX)))]
        assert strays == [], files
        saved = {name.split("-")[1].split(".")[0]: step for name, step in checkpoint_steps(checkpoints).items()}
        assert len(saved) >= 2 and all(step > 0 and step % CHECKPOINT_EVERY == 0 for step in saved.values()), saved
        assert max(saved.values()) < STEPS, f"the kill came after training ended: {saved}"

        resumed = LocalRun([*arguments, "--resume"], tmp_path, "resumed")
        started = time.monotonic()
        code = resumed.wait(480)
        assert code == 0, resumed.stderr()[-3000:]
        summary = json.loads(resumed.stdout().strip().splitlines()[-1])
        print(f"killed at {saved}; resumed run took {time.monotonic() - started:.0f}s; summary {summary}")
        assert summary["resumed_from"] == saved, (summary["resumed_from"], saved)
        # nothing trained before the last checkpoints is trained again: no stage starts below them
        training_from = summary["training_from"]
        assert len(training_from) >= 2 and min(training_from.values()) >= min(saved.values()), (training_from, saved)
        assert summary["finished"], summary
        freshest = freshest_step_per_layer(checkpoints)
        assert sorted(freshest) == list(range(len(freshest))) and min(freshest.values()) > max(saved.values()), freshest
        assert freshest[0] >= STEPS - 2 * CHECKPOINT_EVERY, freshest  # the data stream ran (nearly) to the end
        assert math.isfinite(summary["loss_end"]) and summary["loss_end"] <= summary["loss_start"] / 2, summary
        assert not [f for f in os.listdir(checkpoints) if f.startswith(TEMPORARY_PREFIX)]
    finally:
        first.stop()
        if resumed is not None:
            resumed.stop()


def write_checkpoint(path, model="mlp-digits", **info):
    module = torch.nn.Linear(2, 2)
    save_stage(str(path), module, torch.optim.SGD(module.parameters(), lr=0.1),
               {"step": 20, "layers": [0, 1], "model": model, **info})


def damage(directory, how):
    if how == "corrupt":
        path = directory / "local-peer0.safetensors"
        write_checkpoint(path)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # half a file, as a non-atomic write leaves
    elif how == "foreign file only":
        (directory / "notes.txt").write_text("not a checkpoint")
    elif how == "other model":
        write_checkpoint(directory / "local-peer0.safetensors", model="gpt-tiny")
    elif how == "other model config":
        write_checkpoint(directory / "local-peer0.safetensors", model_config="hidden=32", data_hash="")
    elif how == "other data":
        write_checkpoint(directory / "local-peer0.safetensors", model_config="", data_hash="ab" * 32)
    elif how == "peer not started":
        write_checkpoint(directory / "local-peer0.safetensors")
        write_checkpoint(directory / "local-peer5.safetensors")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how, expected", [
    ("empty", "holds no checkpoints of a local run"),
    ("foreign file only", "holds no checkpoints of a local run"),
    ("corrupt", "local-peer0.safetensors is corrupt or not a ravnest checkpoint"),
    ("other model", "local-peer0.safetensors is of model 'gpt-tiny', not 'mlp-digits'"),
    ("peer not started", "holds checkpoints of peer5, which --peers 2 does not start"),
    # a user's review: another --model-config stood silent for the whole time limit, every peer dead; other --data
    # went on without a word
    ("other model config", "local-peer0.safetensors is of --model-config 'hidden=32', not '': pass --model-config "
                           "hidden=32 to continue it"),
    ("other data", "local-peer0.safetensors trained on other data (sha256 abababababab) than this run's (the "
                   "model's own data)"),
])
def test_resume_without_usable_checkpoints_is_one_line_error(tmp_path, how, expected):
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    damage(directory, how)
    run = LocalRun(["--peers", "2", "--checkpoint-dir", str(directory), "--resume", "--no-dashboard", "--json"],
                   tmp_path, "local")
    try:
        code = run.wait(90)
        stderr = run.stderr().strip()
        assert code == 1, stderr
        assert stderr.startswith("error: ") and expected in stderr and len(stderr.splitlines()) == 1, stderr
        assert "Traceback" not in stderr and run.stdout() == ""
        assert len(run.seen) == 1  # refused before starting any peer
    finally:
        run.stop()


@pytest.mark.timeout(120)
def test_resume_without_checkpoint_dir_is_one_line_error(tmp_path):
    run = LocalRun(["--resume", "--no-dashboard"], tmp_path, "local")
    try:
        code = run.wait(90)
        stderr = run.stderr().strip()
        assert code == 2 and stderr == "error: --resume needs --checkpoint-dir: the directory of the run to continue"
    finally:
        run.stop()


@pytest.mark.timeout(150)
def test_ctrl_c_before_any_plan_says_so_and_exits_130(tmp_path):
    """A user's review: a Ctrl-C in a local run's first seconds said "No plan placed any peer: the peers' logs say
    why" (they said nothing of a plan) and exited 0, which the README gives to a run that trained."""
    run = LocalRun(["--peers", "2", "--no-dashboard", "--steps", "500"], tmp_path, "local")
    try:
        deadline = time.monotonic() + 60
        while len(run.seen) < 3 and time.monotonic() < deadline:  # its backbone and a peer started: it is running
            run.look()
            time.sleep(0.2)
        assert len(run.seen) >= 3, run.stderr()
        os.killpg(run.popen.pid, signal.SIGINT)  # as a terminal sends it
        code = run.wait(90)
        stderr = run.stderr()
        assert code == 130, stderr
        assert "You stopped it before any plan placed a peer." in stderr and "No plan placed" not in stderr, stderr
        assert "Traceback" not in stderr
    finally:
        run.stop()


@pytest.mark.timeout(200)
def test_a_run_whose_every_peer_exited_says_the_first_ones_error_and_exits_1_at_once(tmp_path):
    """A user's review: a resume whose every peer died at its start (checkpoints of other layers) stood silent for
    the whole time limit (900 s by default), then said only what the planners saw."""
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    for name in ("peer0", "peer1"):
        write_checkpoint(directory / f"local-{name}.safetensors")  # mlp-digits' name, other layers' tensors
    run = LocalRun(["--peers", "2", "--checkpoint-dir", str(directory), "--resume", "--no-dashboard",
                    "--time-limit", "600"], tmp_path, "local")
    try:
        started = time.monotonic()
        code = run.wait(150)
        stderr = run.stderr()
        assert code == 1 and time.monotonic() - started < 150, stderr
        assert re.search(r"every peer exited before every stage trained its \d+ steps \(the first said: peer0: "
                         r"checkpoint .*local-peer0.safetensors holds other layers than this stage", stderr), stderr
        assert "No plan placed" not in stderr and "No averaging" not in stderr and "Traceback" not in stderr
    finally:
        run.stop()


@pytest.mark.timeout(240)
def test_a_run_whose_peers_were_all_stopped_from_outside_ends_at_once(tmp_path):
    """A volunteer that trained its steps stays to serve its layers, so peers that all exited with 0 were stopped
    from outside (a Ctrl-C each): `local` waited out its time limit (here 600 s) with nothing left to train."""
    run = LocalRun(["--peers", "2", "--steps", "100000", "--no-dashboard", "--time-limit", "600"], tmp_path, "local")
    try:
        deadline, volunteers = time.monotonic() + 120, []
        while len(volunteers) < 2 and run.popen.poll() is None and time.monotonic() < deadline:
            run.look()
            # the volunteers are forks of the launcher (``launcher.py``), known by the log their stderr goes to
            volunteers = [p for pid, p in run.seen.items() if re.search(r"/peer\d+\.err$", _stderr_path(pid))]
            time.sleep(1.0)
        assert len(volunteers) == 2, run.stderr()
        time.sleep(5.0)  # their signal handlers are set once they run
        for volunteer in volunteers:
            volunteer.send_signal(signal.SIGINT)
        started = time.monotonic()
        code = run.wait(150)
        stderr = run.stderr()
        assert code == 1 and time.monotonic() - started < 150, stderr
        assert re.search(r"every peer exited before every stage trained its 100000 steps \(the first said: "
                         r"peer\d exited with 0\)", stderr), stderr
        assert "Traceback" not in stderr and "unexpected" not in stderr
    finally:
        run.stop()


def _stderr_path(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/2")
    except OSError:
        return ""


def test_model_configs_that_set_the_same_values_are_the_same():
    """A review: a resume compared the texts, so ``hidden = 128`` or another order refused the same model."""
    from ravnest_swarm.swarm.local import same_model_config

    assert same_model_config("hidden=128,depth=2", "depth=2, hidden = 128")
    assert not same_model_config("hidden=128", "hidden=64") and not same_model_config("hidden=128", "")
    assert not same_model_config("not a config", "hidden=1")
