"""Stage checkpoints: resume restores a stage exactly, writes replace files atomically, bad files are clear errors."""

import asyncio
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from ravnest_swarm.checkpoint import (FORMAT, TEMPORARY_PREFIX, TEMPORARY_SUFFIX, load_stage_layers, read_stage,
                                      remove_unfinished_writes, save_stage, write_atomically)
from ravnest_swarm.errors import UserError
from ravnest_swarm.models import get_model
from ravnest_swarm.optimizers.outer import OuterOptimizer
from ravnest_swarm.pipeline.stage import StageConfig, StageWorker
from ravnest_swarm.swarm.stage_averaging import StageAveraging
from ravnest_swarm.swarm.volunteer import Volunteer

RUN, LAYERS = "resume", (0, 2)


def make_stage(seed=0):
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    for _ in range(3):
        optimizer.zero_grad()
        module(torch.randn(5, 8)).pow(2).mean().backward()
        optimizer.step()
    return module, optimizer


def stage_worker(lr: float = 0.1) -> StageWorker:
    """A stage as a volunteer builds one (layers 0:2 of mlp-digits); no node, nothing here sends."""
    return StageWorker(StageConfig(run=RUN, stage=0, stages=2, model="mlp-digits", layers=LAYERS, lr=lr), node=None)


def train(worker: StageWorker, batches) -> None:
    for batch in batches:
        worker.optimizer.zero_grad()
        worker.module(batch).pow(2).mean().backward()
        worker.optimizer.step()


def stage_averaging(outer: str) -> StageAveraging:
    """A volunteer's averager as its checkpoints and resume see it: the run's outer optimizer and the outer state
    of the stage it averaged last (none yet); its rings are never started here."""
    averaging = StageAveraging.__new__(StageAveraging)
    averaging.outer_spec, averaging.outer, averaging._outer_worker = (outer, 0.7, 0.9), None, None
    return averaging


def resuming_volunteer(path: str, outer: str = "average") -> SimpleNamespace:
    """What a :class:`Volunteer`'s checkpoint and resume methods read of it: a peer alone in its first plan (its
    announcer reads no other peer)."""
    async def no_peers(**reads):
        return []

    announcer = SimpleNamespace(update=lambda **fields: None, read_peers=no_peers)
    said = []
    return SimpleNamespace(name="peer", run=RUN, peer_id="me", plan=None, plan_before=None, node=None,
                           checkpoint_path=path,
                           spec=SimpleNamespace(model="mlp-digits", model_config="", data_hash="", optimizer="sgd",
                                                lr=0.05, outer_optimizer=outer),
                           model=get_model("mlp-digits"), cache={}, averaging=stage_averaging(outer),
                           held=None, announcer=announcer, said=said, say=said.append, kept_outer=None,
                           kept_optimizer=None, stopped_stage=None)


def test_resume_restores_a_stage_exactly(tmp_path):
    """Through the very methods `join --resume` runs: the volunteer writes its stage's checkpoint, reads it back
    into its layer cache (load_stage_layers), and fills a new stage from that cache; then both train on."""
    batches = [torch.randn(4, 64) for _ in range(4)]
    trained = stage_worker()
    train(trained, batches[:3])
    trained.resume_at(3)  # the count of the steps above, which ran outside the stage's scheduler
    volunteer = resuming_volunteer(str(tmp_path / f"{RUN}-peer.safetensors"))
    Volunteer._save_checkpoint(volunteer, trained)
    Volunteer._load_checkpoint_into_cache(volunteer)

    resumed = stage_worker()
    step, downloaded = asyncio.run(Volunteer._fill_layers(volunteer, resumed.module, LAYERS))
    resumed.resume_at(step)
    assert (step, resumed.version, downloaded) == (3, 3, False)
    for (name, a), b in zip(trained.module.state_dict().items(), resumed.module.state_dict().values()):
        assert torch.equal(a, b), name
    # resume loses no optimizer state: a stage's SGD keeps none (momentum's and AdamW's state the volunteer takes
    # from the checkpoint, _take_optimizer_state: tests/test_optimizers.py), and its settings come from its config
    assert trained.optimizer.state_dict() == resumed.optimizer.state_dict()
    assert trained.optimizer.state_dict()["state"] == {}
    train(trained, batches[3:])
    train(resumed, batches[3:])
    for a, b in zip(trained.module.parameters(), resumed.module.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "flipped_header"])
def test_corrupt_checkpoint_is_a_clear_error(tmp_path, damage):
    module, optimizer = make_stage()
    path = str(tmp_path / "stage.safetensors")
    save_stage(path, module, optimizer, {"step": 1, "layers": [0, 3]})
    data = open(path, "rb").read()
    damaged = {"truncated": data[: len(data) // 2], "garbage": os.urandom(300), "empty": b"",
               "flipped_header": data[:8] + b"{" * 20 + data[28:]}[damage]
    open(path, "wb").write(damaged)
    with pytest.raises(UserError, match="corrupt or not a ravnest checkpoint"):
        load_stage_layers(path, lambda start, end: make_stage()[0])


def test_checkpoint_of_other_layers_is_refused(tmp_path):
    module, optimizer = make_stage()
    path = str(tmp_path / "stage.safetensors")
    save_stage(path, module, optimizer, {"step": 1, "layers": [0, 3]})
    with pytest.raises(UserError, match="other layers"):
        load_stage_layers(path, lambda start, end: torch.nn.Sequential(torch.nn.Linear(8, 32)))


def test_a_checkpoint_whose_weights_hold_a_nan_is_refused_not_resumed(tmp_path):
    module, optimizer = make_stage()
    with torch.no_grad():
        module[0].weight[3, 1] = float("nan")  # a diverged run's save, or a flipped bit
    path = str(tmp_path / "stage.safetensors")
    save_stage(path, module, optimizer, {"step": 7, "layers": [0, 3]})
    with pytest.raises(UserError, match=r"non-finite values in 0\.weight"):
        load_stage_layers(path, lambda start, end: make_stage()[0])


def test_a_checkpoint_that_cannot_be_written_is_said_once_and_training_goes_on(tmp_path):
    """A full disk or an unwritable --checkpoint-dir raised out of the leave (so its hand-over never ran) and out of
    the periodic save (ending the task that saves); now the volunteer says why, once, and goes on."""
    (tmp_path / "a-file").write_text("not a directory")
    volunteer = resuming_volunteer(str(tmp_path / "a-file" / "stage.safetensors"))
    volunteer._checkpoint_problem = None
    worker = stage_worker()
    for _ in range(3):
        assert Volunteer._save_checkpoint(volunteer, worker) is False
    assert len(volunteer.said) == 1 and "could not write the checkpoint" in volunteer.said[0], volunteer.said


def test_a_checkpoint_that_does_not_say_its_layers_and_step_is_a_clear_error(tmp_path):
    import json as json_module

    from safetensors.torch import save_file

    module, _ = make_stage()
    path = str(tmp_path / "stage.safetensors")
    for metadata in ({"format": FORMAT}, {"format": FORMAT, "info": {"step": "x", "layers": [0, 3]}}):
        save_file({f"param.{k}": v for k, v in module.state_dict().items()}, path,
                  metadata={"ravnest": json_module.dumps(metadata)})
        with pytest.raises(UserError, match="does not say which layers and step"):
            load_stage_layers(path, lambda start, end: make_stage()[0])


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="no checkpoint at"):
        read_stage(str(tmp_path / "absent.safetensors"))


def test_failed_write_leaves_the_old_file_and_no_partial_file(tmp_path, monkeypatch):
    path = str(tmp_path / "stage.safetensors")
    write_atomically(path, b"old contents")

    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError):
        write_atomically(path, b"new contents that never land")
    assert open(path, "rb").read() == b"old contents"
    assert os.listdir(tmp_path) == ["stage.safetensors"]


@pytest.mark.timeout(60)
def test_writer_killed_mid_write_leaves_a_whole_file_and_only_a_temporary(tmp_path):
    """SIGKILL a process that rewrites a 16 MiB file in a loop: the file is always one whole version, and
    what the kill interrupted is only a hidden temporary file, which remove_unfinished_writes clears."""
    path = tmp_path / "stage.safetensors"
    size = 16 * 2**20
    writer = subprocess.Popen([sys.executable, "-c", (
        "from ravnest_swarm.checkpoint import write_atomically\n"
        f"for i in range(10**6):\n    write_atomically({str(path)!r}, bytes([65 + i % 26]) * {size})\n")],
        start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.7)
        writer.kill()
        writer.wait(10)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait(10)
    data = path.read_bytes()
    assert len(data) == size and data == data[:1] * size
    others = sorted(set(os.listdir(tmp_path)) - {path.name})
    assert all(name.startswith(TEMPORARY_PREFIX) and name.endswith(TEMPORARY_SUFFIX) for name in others), others
    assert sorted(remove_unfinished_writes(str(tmp_path))) == others
    assert os.listdir(tmp_path) == [path.name]


def test_a_writer_clears_only_its_own_unfinished_writes(tmp_path):
    """Peers of a `local` run share one checkpoint directory: a restarted peer clearing what its killed
    predecessor left must not delete the temporary file another peer is writing right now."""
    mine = tmp_path / f"{TEMPORARY_PREFIX}run-peer0.safetensors.abc{TEMPORARY_SUFFIX}"
    theirs = tmp_path / f"{TEMPORARY_PREFIX}run-peer1.safetensors.def{TEMPORARY_SUFFIX}"
    mine.write_bytes(b"cut short")
    theirs.write_bytes(b"being written")
    assert remove_unfinished_writes(str(tmp_path), "run-peer0.safetensors") == [mine.name]
    assert sorted(os.listdir(tmp_path)) == [theirs.name]


def test_resume_restores_the_outer_state_of_the_stage_its_checkpoint_kept(tmp_path):
    """Through the methods `join --resume` runs: the outer state (anchor, momentum, error) of the stage a checkpoint
    was written for is the resumed stage's, tensor for tensor, at the checkpoint's layers, also where they come
    from a holder at another step (the anchor is a round's, which each ring compares before it compresses); a
    stage of other layers starts the outer state anew (its first round), and says so."""
    trained = stage_worker()
    train(trained, [torch.randn(4, 64) for _ in range(3)])
    trained.resume_at(40)
    size = sum(parameter.numel() for parameter in trained.module.parameters())
    volunteer = resuming_volunteer(str(tmp_path / f"{RUN}-peer.safetensors"), "nesterov")
    outer = OuterOptimizer("nesterov", 0.7, 0.9, anchor=torch.randn(size), momentum=torch.randn(size),
                           error=torch.randn(size))
    volunteer.averaging.outer, volunteer.averaging._outer_worker = outer, trained
    Volunteer._save_checkpoint(volunteer, trained)

    for layers, step, kept in ((LAYERS, 40, ""), (LAYERS, 60, " (its layers are of step 60)"), ((0, 1), 40, None)):
        again = resuming_volunteer(volunteer.checkpoint_path, "nesterov")
        Volunteer._load_checkpoint_into_cache(again)
        # a plan that puts others on these layers finds us as the peer that stopped them, and we give their state
        assert again.stopped_stage.layers == LAYERS and again.stopped_stage.step == 40
        assert all(torch.equal(again.stopped_stage.outer[key], getattr(outer, key)) for key in ("anchor", "error"))
        resumed = stage_worker()
        Volunteer._take_outer_state(again, resumed, layers, step)
        if kept is not None:
            assert again.averaging.outer_state(resumed).keys() == {"anchor", "momentum", "error"}
            assert all(torch.equal(getattr(outer, key), value)
                       for key, value in again.averaging.outer_state(resumed).items())
            assert again.averaging.outer.digest(0, size) == outer.digest(0, size)
            assert f"peer: outer state (anchor, momentum, error) resumed from the checkpoint of step 40{kept}" \
                in again.said
        else:
            assert again.averaging.outer is None and again.averaging.outer_state(resumed) == {}
            assert any("starts at the stage's first round" in line for line in again.said), again.said


def test_a_stage_placed_back_on_the_layers_it_stopped_keeps_both_optimizers_state():
    """A plan stops our stage worker and a later one places us back on its layers, which come from our cache at its
    step: the new worker goes on with the stopped one's AdamW moments and outer state. At another step (fresher
    layers came from elsewhere) the AdamW moments start afresh, and the log says so; the outer state, a round's,
    is kept (each ring compares anchors before it compresses)."""
    stopped = StageWorker(StageConfig(run=RUN, stage=0, stages=2, model="mlp-digits", layers=LAYERS, lr=0.01,
                                      optimizer="adamw"), node=None)
    train(stopped, [torch.randn(4, 64) for _ in range(3)])
    stopped.resume_at(80)
    size = sum(parameter.numel() for parameter in stopped.module.parameters())
    for step, kept in ((80, True), (100, False)):
        volunteer = resuming_volunteer(None, "nesterov")
        volunteer.spec.optimizer, volunteer._note = "adamw", lambda text: None
        outer = OuterOptimizer("nesterov", 0.7, 0.9, anchor=torch.randn(size), momentum=torch.randn(size))
        volunteer.averaging.outer, volunteer.averaging._outer_worker = outer, stopped
        Volunteer._keep_optimizer_states(volunteer, stopped)
        placed_back = StageWorker(StageConfig(run=RUN, stage=0, stages=2, model="mlp-digits", layers=LAYERS,
                                              lr=0.01, optimizer="adamw"), node=None)
        Volunteer._take_optimizer_state(volunteer, placed_back, LAYERS, step)
        Volunteer._take_outer_state(volunteer, placed_back, LAYERS, step)
        moments = [state["exp_avg"] for state in placed_back.optimizer.state_dict()["state"].values()]
        if kept:
            expected = [state["exp_avg"] for state in stopped.optimizer.state_dict()["state"].values()]
            assert len(moments) == len(expected) > 0 and all(torch.equal(a, b) for a, b in zip(moments, expected))
            assert volunteer.averaging.outer.digest(0, size) == outer.digest(0, size)
            assert volunteer.said == ["peer: adamw state resumed from its stage stopped at step 80",
                                      "peer: outer state (anchor, momentum) resumed from its stage stopped at step 80"]
        else:
            assert moments == [] and volunteer.averaging.outer.digest(0, size) == outer.digest(0, size)
            assert volunteer.said == ["peer: adamw state of layers 0:2 starts afresh at step 100 (no peer that stopped "
                                      "training them handed theirs over)",
                                      "peer: outer state (anchor, momentum) resumed from its stage stopped at step 80 "
                                      "(its layers are of step 100)"]


def test_a_writer_whose_header_cannot_be_written_leaves_no_temporary_file(tmp_path, monkeypatch):
    from ravnest_swarm import checkpoint

    real_fdopen = os.fdopen

    class FullDisk:
        def __init__(self, file):
            self.file = file

        def write(self, data):
            raise OSError(28, "No space left on device")

        def close(self):
            self.file.close()

    monkeypatch.setattr(checkpoint.os, "fdopen", lambda descriptor, mode: FullDisk(real_fdopen(descriptor, mode)))
    with pytest.raises(OSError, match="No space left"):
        checkpoint.SafetensorsWriter(str(tmp_path / "model.safetensors"), [("w", [2, 2], torch.float32)], {})
    assert os.listdir(tmp_path) == []
