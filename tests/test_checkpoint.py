"""Stage checkpoints: exact round trip, atomic replacement, and clear errors for bad files."""

import os
import subprocess
import sys
import time

import pytest
import torch

from ravnest_swarm.checkpoint import (TEMPORARY_PREFIX, TEMPORARY_SUFFIX, load_stage, read_stage,
                                      remove_unfinished_writes, save_stage, write_atomically)
from ravnest_swarm.errors import UserError


def make_stage(seed=0):
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    for _ in range(3):
        optimizer.zero_grad()
        module(torch.randn(5, 8)).pow(2).mean().backward()
        optimizer.step()
    return module, optimizer


@pytest.mark.parametrize("optimizer_name", ["adam", "sgd-momentum"])
def test_round_trip_restores_parameters_and_optimizer_state_exactly(tmp_path, optimizer_name):
    module, optimizer = make_stage()
    if optimizer_name == "sgd-momentum":
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        module(torch.randn(5, 8)).sum().backward()
        optimizer.step()
    path = str(tmp_path / "stage.safetensors")
    save_stage(path, module, optimizer, {"step": 3, "layers": [2, 5], "model": "mlp-digits"})

    restored, restored_optimizer = make_stage(seed=1)
    if optimizer_name == "sgd-momentum":
        restored_optimizer = torch.optim.SGD(restored.parameters(), lr=0.5, momentum=0.1)
    info = load_stage(path, restored, restored_optimizer)
    assert info == {"step": 3, "layers": [2, 5], "model": "mlp-digits"}
    for a, b in zip(module.state_dict().values(), restored.state_dict().values()):
        assert torch.equal(a, b)
    original, loaded = optimizer.state_dict(), restored_optimizer.state_dict()
    assert original["param_groups"] == loaded["param_groups"]
    for index, values in original["state"].items():
        for key, value in values.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(loaded["state"][index][key])), key
    # training goes on identically from the restored state
    batch = torch.randn(5, 8)
    for m, o in ((module, optimizer), (restored, restored_optimizer)):
        o.zero_grad()
        m(batch).pow(2).mean().backward()
        o.step()
    for a, b in zip(module.parameters(), restored.parameters()):
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
        load_stage(path, *make_stage())


def test_checkpoint_of_other_layers_is_refused(tmp_path):
    module, optimizer = make_stage()
    path = str(tmp_path / "stage.safetensors")
    save_stage(path, module, optimizer, {"step": 1, "layers": [0, 3]})
    other = torch.nn.Sequential(torch.nn.Linear(8, 32))
    with pytest.raises(UserError, match="other layers"):
        load_stage(path, other, torch.optim.SGD(other.parameters(), lr=0.1))


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
