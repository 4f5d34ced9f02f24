"""Stage checkpoints: exact round trip, atomic replacement, and clear errors for bad files."""

import os

import pytest
import torch

from ravnest_swarm.checkpoint import load_stage, read_stage, save_stage, write_atomically
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
