"""Devices, precision and measured memory (issue 17, items 4 and 5), on the CPU.

The stage's device handling is tested in-process on every device torch sees here (the CPU only on a machine
without a GPU); ``--device``, ``--precision`` and the peer record's device fields through real ``join`` and
``local`` processes, each stopped by its pid.
"""

import asyncio
import json
import math
import re
import signal
import time
from types import SimpleNamespace

import pytest
import torch

from commands import ravnest
from ravnest_swarm.devices import autocast_dtype, peak_memory, resolve_device
from ravnest_swarm.errors import UserError
from ravnest_swarm.membership.capabilities import measure_gflops, measure_layer_gflops
from ravnest_swarm.membership.records import PeerRecord, planning_memory_gb
from ravnest_swarm.pipeline.stage import StageConfig, StageWorker

DEVICES = ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else [])


def worker_for(stage: int, stages: int, layers, device: str, precision: str) -> StageWorker:
    # the compute path needs no network: a node whose P2P is never used
    config = StageConfig(run="devices", stage=stage, stages=stages, model="mlp-digits", layers=layers,
                         microbatch_size=8, microbatches=4, device=device, precision=precision)
    return StageWorker(config, SimpleNamespace(p2p=None))


def capture_sends(worker: StageWorker) -> list:
    sent = []
    worker.scheduler.spawn = lambda handler, stage, message, tensors, microbatch, to=None: \
        sent.append((handler, tensors))
    return sent


def on_device(tensor: torch.Tensor, device: str) -> bool:
    return tensor.device == torch.device(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_middle_stage_computes_on_its_device_and_sends_float32_from_host_memory(device, precision):
    worker = worker_for(1, 3, (3, 6), device, precision)
    assert all(on_device(p, device) for p in worker.module.parameters())
    sent = capture_sends(worker)
    inputs, targets = torch.randn(8, 64), torch.randint(0, 10, (8,))

    async def forward_then_backward():
        await worker.scheduler.run_forward(0, list(range(8)), inputs, targets)
        (_, (output, sent_targets)), = sent
        # the next stage decodes what its first layer takes (float32), whatever autocast computed in
        assert output.device.type == "cpu" and output.dtype == torch.float32 and output.shape == (8, 64)
        assert sent_targets.device.type == "cpu"
        before = [p.detach().cpu().clone() for p in worker.module.parameters()]
        await worker.scheduler.run_backward(0, torch.ones(8, 64))  # the gradient arrives from the wire, on the host
        return before

    before = asyncio.run(forward_then_backward())
    handler, (input_grad,) = sent[1]
    assert handler.endswith("backward") and input_grad.device.type == "cpu" and input_grad.dtype == torch.float32
    assert worker.version == 1  # the optimizer stepped, and the parameters, with their state, stayed on the device
    assert any(not torch.equal(b, p.detach().cpu()) for b, p in zip(before, worker.module.parameters()))
    assert all(on_device(p, device) for p in worker.module.parameters())
    assert all(on_device(t, device) for state in worker.optimizer.state.values() for t in state.values()
               if torch.is_tensor(t))
    worker.compute.close()


@pytest.mark.parametrize("device", DEVICES)
def test_the_last_stage_trains_in_bf16_with_a_finite_loss(device):
    worker = worker_for(0, 1, (0, 9), device, "bf16")
    assert worker.autocast_dtype == torch.bfloat16
    data = worker.spec.dataset()
    losses = []
    for microbatch in range(30):
        inputs, targets = data.get(list(range(microbatch * 8, microbatch * 8 + 8)))
        loss, _ = worker.compute.forward_backward_last(inputs, targets)  # data from the host, as stage 0 draws it
        losses.append(loss)
    assert all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-5:]) < sum(losses[:5])
    worker.compute.close()


def test_autocast_choices_on_a_cpu():
    assert autocast_dtype("fp32", "cpu") == (None, None)
    assert autocast_dtype("bf16", "cpu") == (torch.bfloat16, None)
    dtype, note = autocast_dtype("fp16", "cpu")  # refusing would keep CPU peers out of an fp16 run
    assert dtype == torch.bfloat16 and "bf16" in note


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_device_choices_without_a_gpu():
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    with pytest.raises(UserError, match="--device cuda"):
        resolve_device("cuda")
    with pytest.raises(UserError, match="--device must be one of"):
        resolve_device("tpu")


def test_compute_probes_run_on_the_device_and_the_run_model():
    assert measure_gflops(seconds=0.05, device=DEVICES[-1]) > 0
    model = worker_for(0, 1, (0, 9), "cpu", "fp32").spec
    assert measure_layer_gflops(model, DEVICES[-1], 8, "bf16", seconds=0.05) > 0


def test_peak_memory_is_measured_and_older_records_still_validate():
    rss, device_peak = peak_memory("cpu")
    assert 0.01 < rss < 64 and device_peak is None
    old = dict(peer_id="QmPeer", name="old", state="standby", ram_gb=2.0, bandwidth_mbps=10.0, gflops=5.0,
               reachability="direct", maddrs=[], version="0.1", time=1.0, layers=None)
    record = PeerRecord.parse_obj(old).dict()  # a peer from before devices
    assert record["device"] is None and planning_memory_gb(record) == 2.0
    record = PeerRecord.parse_obj(dict(old, device="cuda:0", device_memory_gb=24.0, peak_memory_gb=1.5,
                                       device_peak_gb=3.0)).dict()
    assert planning_memory_gb(record) == 24.0  # a GPU peer's stages are sized by its GPU
    for bad in (dict(device="tpu"), dict(device="cuda:0\n"), dict(peak_memory_gb=float("nan")),
                dict(device_peak_gb=-1.0)):
        with pytest.raises(ValueError):
            PeerRecord.parse_obj(dict(old, **bad))


def test_dashboard_and_status_table_show_measured_memory():
    import io

    from rich.console import Console

    from ravnest_swarm.dashboard.peers_table import peers_table
    from ravnest_swarm.dashboard.state import SwarmState
    from ravnest_swarm.dashboard.view import render_text

    def record(name, stage, **fields):
        return dict(peer_id=f"id-{name}", name=name, state="training", ram_gb=8.0, bandwidth_mbps=100.0,
                    gflops=500.0, reachability="direct", cluster=0, stage=stage, time=1.0,
                    layers=[stage * 4, stage * 4 + 4], **fields)

    peers = [record("cpu-pc", 0, device="cpu", device_memory_gb=8.0, peak_memory_gb=0.31, device_peak_gb=None),
             record("gpu-pc", 1, device="cuda:0", device_memory_gb=24.0, peak_memory_gb=1.9, device_peak_gb=2.5),
             record("old-pc", 2)]  # a record from before devices
    state = SwarmState("demo")
    state.update(peers, at=1)
    text = render_text(state, 80)
    cells = [line.strip() for line in text.splitlines()]
    assert "train L0-4 310M" in cells and "train L4-8 gpu2.5G" in cells and "train L8-12" in cells, text
    console = Console(width=80, file=io.StringIO(), record=True, color_system=None)
    console.print(peers_table("demo", peers))
    table = console.export_text()
    assert re.search(r"cpu-pc\s+training\s+0\.3/8\.0\s", table) and re.search(r"gpu-pc\s+training\s+g2\.5/24\s", table)
    assert re.search(r"old-pc\s+training\s+-/8\.0\s", table), table


# ------------------------------------------------------------------ real processes

def model_gb() -> float:
    """What the planner says mlp-digits needs with the run spec's defaults, GB."""
    from ravnest_swarm.swarm.spec import RunSpec
    from ravnest_swarm.swarm.placement import model_workload

    return model_workload(worker_for(0, 1, (0, 9), "cpu", "fp32").spec, RunSpec(model="mlp-digits"), 8)[0].model_gb


@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_device_cuda_without_a_gpu_is_one_line_and_a_non_zero_exit(backbone):
    for args in (["join", "--initial-peers", backbone, "--run", "devices", "--name", "gpu-less", "--no-dashboard"],
                 ["local", "--peers", "2", "--no-dashboard"]):
        result = ravnest(*args, "--device", "cuda")
        assert result.returncode == 1, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and re.fullmatch(r"error: --device cuda: (this torch is built without CUDA|torch "
                                                r"sees no GPU here); use --device cpu \(or auto\)", lines[0]), lines


@pytest.mark.timeout(240)
@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_join_trains_on_its_device_in_bf16_and_its_record_says_what_it_measured(processes, backbone, device):
    run = f"devices-{device}"
    ram = f"{0.6 * model_gb():.9f}"  # two peers hold the model together, one alone cannot: two stages
    common = ["join", "--initial-peers", backbone, "--run", run, "--no-dashboard", "--heartbeat", "2",
              "--min-peers", "2", "--round-seconds", "4", "--device", device, "--ram-gb", ram,
              "--bandwidth-mbps", "1000", "--handover-timeout", "5", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
    peers = {"first": processes.start(common + ["--name", "first", "--model", "mlp-digits", "--steps", "100000",
                                                "--precision", "bf16"], "first"),
             "second": processes.start(common + ["--name", "second"], "second")}
    for name, process in peers.items():
        process.wait_for_output(rf"^{name}: training cluster 0 stage \d/2 layers \d+:\d+ from step \d+ on cpu "
                                rf"with bfloat16 autocast$", 150, stream="stderr")
    records = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # as an observer reads them, once both stages have trained a while
        result = ravnest("status", "--initial-peers", backbone, "--run", run, "--json", timeout=60)
        assert result.returncode == 0, result.stderr
        records = {p["name"]: p for p in json.loads(result.stdout.strip().splitlines()[-1])["peers"]}
        if set(records) == set(peers) and all((p["step"] or 0) >= 20 for p in records.values()):
            break
        time.sleep(1)
    assert set(records) == set(peers) and all((p["step"] or 0) >= 20 for p in records.values()), records
    for record in records.values():
        assert record["device"] == "cpu" and record["device_peak_gb"] is None
        assert record["device_memory_gb"] == record["ram_gb"] == float(ram)  # on a CPU: the RAM offer
        assert 0.05 < record["peak_memory_gb"] < 8  # Python with torch: measured, not the 0.0003 GB offered
        assert record["gflops"] > 0  # measured on the model's largest layer
    losses = [p["loss"] for p in records.values() if p["loss"] is not None]
    assert losses and all(math.isfinite(loss) for loss in losses)
    for process in peers.values():
        process.signal(signal.SIGTERM)
    for name, process in peers.items():
        assert process.wait(120) == 0, process.stderr()[-2000:]


@pytest.mark.timeout(300)
def test_local_on_the_cpu_in_bf16_trains_and_reports_each_peers_measured_memory():
    result = ravnest("local", "--peers", "3", "--steps", "60", "--device", "cpu", "--precision", "bf16", "--json",
                     "--no-dashboard", "--time-limit", "240", timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["finished"], summary
    assert math.isfinite(summary["loss_end"]) and summary["loss_end"] < summary["loss_start"], summary
    records = summary["peer_records"]
    assert set(records) == {"peer0", "peer1", "peer2"}, records
    for record in records.values():
        assert record["device"] == "cpu" and record["device_peak_gb"] is None
        assert 0.05 < record["peak_memory_gb"] < 8 and record["device_memory_gb"] > 0
