"""NAT traversal behind real NAT: network namespaces, iptables MASQUERADE routers, real p2pd processes.

Public hosts (backbone, observer, public peers) share a switch; each home host sits behind its own
router that drops unsolicited inbound traffic (``ravnest_swarm.bench.natlab``). Every process a test starts
is stopped, and every namespace removed, even when it fails.
"""

import json
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from pipeline_helpers import losses, read_report
from ring_helpers import identities_in_ring_order
from test_swarm import MODEL_GB, checkpoint_layers
from ravnest_swarm.bench.synthetic import synthetic_layer
from ravnest_swarm.models import get_model
from ravnest_swarm.bench.natlab import NatLab
from ravnest_swarm.bench.netlab import LAB_PREFIX

pytestmark = pytest.mark.netns
RUN = "nat"


@pytest.fixture
def make_lab(processes):
    """Build a :class:`NatLab`; at teardown stop the test's processes first, then remove the namespaces."""
    labs = []

    def make(public, homes, mbps=None):
        lab = NatLab(public, homes, mbps=mbps).__enter__()
        labs.append(lab)
        return lab

    try:
        yield make
    finally:
        processes.stop_all()
        for lab in labs:
            lab.close()


def start_backbone(processes, lab):
    return processes.start(["backbone", "--host-maddrs", lab.public_maddr(0)], "backbone",
                           lab_host=lab.public_host(0)).maddrs()[0]


def start_volunteer(processes, backbone, name, host_maddr, lab_host):
    """A real ``join`` (planning-only mode, measurements overridden except reachability, which it asks the
    backbone for); it idles as a standby and serves its probe handler."""
    return processes.start(["join", "--initial-peers", backbone, "--run", RUN, "--name", name, "--host-maddrs",
                            host_maddr, "--model-gb", "1", "--min-peers", "50", "--no-dashboard", "--ram-gb", "4",
                            "--gflops", "10", "--bandwidth-mbps", "100", "--heartbeat", "2"], name, lab_host=lab_host)


def run_json(processes, args, name, lab_host, timeout=90):
    process = processes.start(args, name, lab_host=lab_host)
    assert process.wait(timeout) == 0, process.stderr()[-3000:]
    return json.loads(process.stdout().strip().splitlines()[-1])


def observe(processes, backbone, lab, name, reachability, timeout=45.0):
    """Poll ``status --json`` from the observer host until ``name`` shows ``reachability``."""
    return observe_until(processes, backbone, lab, name, lambda record: record["reachability"] == reachability,
                         f"as {reachability}", timeout)


def observe_until(processes, backbone, lab, name, check, what, timeout):
    """Poll ``status --json`` from the observer host until ``name``'s record passes ``check``."""
    deadline = time.monotonic() + timeout
    while True:
        peers = run_json(processes, ["status", "--json", "--run", RUN, "--initial-peers", backbone],
                         f"status{len(processes.processes)}", lab.public_host(1))["peers"]
        record = next((p for p in peers if p["name"] == name), None)
        if record is not None and check(record):
            return record
        assert time.monotonic() < deadline, f"observer never saw {name} {what}: {peers}"
        time.sleep(1.0)


def connects(lab_host, ip, port, timeout=2.0) -> bool:
    """Whether a TCP connection from inside a namespace to ``ip:port`` succeeds."""
    code = f"import socket; socket.create_connection(({ip!r}, {port}), {timeout})"
    return subprocess.run([*lab_host.prefix(), sys.executable, "-c", code], capture_output=True).returncode == 0


@pytest.mark.timeout(60)
def test_lab_nat_lets_home_out_and_nothing_in(processes):
    listeners = []
    with NatLab(1, 1) as lab:
        try:
            for lab_host in (lab.public_host(0), lab.home_host(0)):
                listeners.append(subprocess.Popen([*lab_host.prefix(), sys.executable, "-c",
                    "import socket,time; s=socket.create_server(('0.0.0.0', 40000)); print('listening', flush=True); "
                    "time.sleep(60)"], stdout=subprocess.PIPE, text=True))
            for listener in listeners:  # else the refusals below would prove nothing
                assert listener.stdout.readline() == "listening\n"
            assert connects(lab.home_host(0), lab.public_ip(0), 40000), "home host cannot reach the public side"
            # the router's public address answers nothing unsolicited, and home LANs are not routed publicly
            assert not connects(lab.public_host(0), lab.router_ip(0), 40000)
            assert not connects(lab.public_host(0), lab.home_ip(0), 40000)
            names = lab.namespaces()
        finally:
            for listener in listeners:
                listener.kill()
                listener.wait()
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listing for name in names) and all(n.startswith(LAB_PREFIX) for n in names)


@pytest.mark.timeout(180)
def test_volunteer_behind_nat_is_relay_and_answers_a_public_peer(processes, make_lab):
    lab = make_lab(3, 1)
    backbone = start_backbone(processes, lab)
    start_volunteer(processes, backbone, "home", lab.home_maddr(0), lab.home_host(0))
    doctor = processes.start(["doctor", "--initial-peers", backbone], "doctor", lab_host=lab.home_host(0))
    observe(processes, backbone, lab, "home", "relay")
    result = run_json(processes, ["probe", "--initial-peers", backbone, "--run", RUN, "--peer", "home", "--mb", "1",
                                  "--host-maddrs", lab.public_maddr(2)], "probe", lab.public_host(2))
    # the public peer's tensor reached the NATed volunteer, which counted every byte in its reply
    assert result["bytes"] == 2**20 and result["route"] == "reversed"
    assert next(iter(result["backbones"].values())).get("reversals", 0) >= 1
    assert doctor.wait(90) == 0, doctor.stderr()[-2000:]
    backbone_id = backbone.rsplit("/", 1)[-1]
    assert "reachability: relay" in doctor.stdout() and f"relay: backbone {backbone_id}" in doctor.stdout()


@pytest.mark.timeout(150)
def test_public_volunteer_is_direct_and_uses_no_relay(processes, make_lab):
    lab = make_lab(3, 0)
    backbone = start_backbone(processes, lab)
    start_volunteer(processes, backbone, "public", lab.public_maddr(2), lab.public_host(2))
    observe(processes, backbone, lab, "public", "direct")
    result = run_json(processes, ["probe", "--initial-peers", backbone, "--run", RUN, "--peer", "public", "--mb", "1",
                                  "--host-maddrs", lab.public_maddr(1)], "probe", lab.public_host(1))
    assert result["bytes"] == 2**20 and result["route"] == "direct"
    # the backbone passed no reversal and forwarded nothing
    stats = next(iter(result["backbones"].values()))
    assert stats.get("reversals", 0) == 0 and stats.get("forwarded_bytes", 0) == 0


@pytest.mark.timeout(240)
def test_two_stage_pipeline_with_a_stage_behind_nat_trains(processes, make_lab, tmp_path):
    lab = make_lab(2, 1)
    backbone = start_backbone(processes, lab)
    common = ["--initial-peers", backbone, "--run", RUN, "--stages", "2", "--model", "mlp-digits",
              "--microbatches", "60", "--microbatch-size", "32", "--max-in-flight", "4", "--lr", "0.1"]
    places = [(lab.public_maddr(1), lab.public_host(1)), (lab.home_maddr(0), lab.home_host(0))]
    stages = []
    for index, (layers, (maddr, lab_host)) in enumerate(zip(("0:5", "5:9"), places)):
        stages.append(processes.start(
            ["stage", *common, "--stage", str(index), "--layers", layers, "--host-maddrs", maddr,
             "--report", str(tmp_path / f"report{index}.json")], f"stage{index}", lab_host=lab_host))
    for index, stage in enumerate(stages):
        assert stage.wait(200) == 0, f"stage {index}: {stage.stderr()[-3000:]}"
    first, last = read_report(str(tmp_path), 0), read_report(str(tmp_path), 1)
    curve = losses(last)
    start, end = sum(curve[:8]) / 8, sum(curve[-8:]) / 8
    assert end < 0.75 * start, f"loss went from {start:.3f} to {end:.3f}"
    assert first["completed"] == 60 and first["dropped"] == 0
    # the public stage reached the NATed one by connection reversal, never through the relay
    assert first["routes"].get("reversed", 0) >= 1 and first["routes"].get("forward", 0) == 0


def average_in_a_ring(processes, lab, backbone, places, tmp_path, sizes, seed=11, part_bytes=None, timeout=120):
    """One averaging round of ``averaging-peer``s, cluster k at ``places[k]`` (maddr, lab host), so the ring runs
    in the order of ``places`` (a ring orders its members by peer id: cluster k gets the k-th lowest of identities
    made here); checks every peer holds the exact mean and returns their results."""
    identities = identities_in_ring_order(tmp_path, len(places))
    peers = []
    for cluster, (maddr, lab_host) in enumerate(places):
        args = ["averaging-peer", "--initial-peers", backbone, "--run", RUN, "--cluster", str(cluster), "--stage", "0",
                "--layer-sizes", ",".join(map(str, sizes)), "--layers", f"0,{len(sizes)}", "--seed", str(seed),
                "--step", "1", "--host-maddrs", maddr, "--out", str(tmp_path / f"c{cluster}.safetensors"),
                "--identity", identities[cluster].path]
        if part_bytes is not None:
            args += ["--part-bytes", str(part_bytes)]
        if cluster == 0:
            args += ["--publish-plan", str(len(places))]
        peers.append(processes.start(args, f"c{cluster}", lab_host=lab_host))
    expected = torch.stack([torch.cat([synthetic_layer(seed, k, j, n) for j, n in enumerate(sizes)])
                            for k in range(len(places))]).mean(0)
    results = []
    for cluster, peer in enumerate(peers):
        assert peer.wait(timeout) == 0, peer.stderr()[-3000:]
        results.append(json.loads(peer.stdout().strip().splitlines()[-1]))
        assert results[-1]["failed_segments"] == [], (results[-1], peer.stderr()[-3000:])
        values = load_file(str(tmp_path / f"c{cluster}.safetensors"))["values"]
        assert torch.allclose(values, expected, atol=1e-5)
    return results


@pytest.mark.timeout(180)
def test_two_volunteers_behind_two_nats_average_through_the_backbone(processes, make_lab, tmp_path):
    lab = make_lab(1, 2)
    backbone = start_backbone(processes, lab)
    results = average_in_a_ring(processes, lab, backbone, [(lab.home_maddr(k), lab.home_host(k)) for k in range(2)],
                                tmp_path, [3000, 5000])
    for result in results:
        assert result["reachability"] == "relay"
        # neither could dial the other: the ring's chunks went through the backbone's forwarding
        assert result["routes"].get("forward", 0) >= 1 and result["routes"].get("calls_forward", 0) >= 1


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", ["two-behind-nat", "all-behind-nat"])
def test_a_ring_of_four_averages_with_neighbours_behind_nat_through_the_backbone(processes, make_lab, tmp_path,
                                                                                layout):
    """The lab run's layout (two public volunteers, two behind two NATs, the NATed ones next to each other in the
    ring), and a ring of four all behind NAT. A member of a ring of 4 sends 6 ring messages at once, each chunk in
    parts that arrive pipelined; through a backbone, which forwards at most 8 streams at once for one caller and 16
    in all, those of 2 stripes each took 12 slots: the backbone refused 4, every round failed, and the streams it
    had let through kept their slots and their receivers waiting 20 s for the rest ("message incomplete"). Now a
    forwarded message is one stream, opened when its first part is ready, within our slots there, and a backbone
    that has no slot for it is asked again."""
    homes = 2 if layout == "two-behind-nat" else 4
    lab = make_lab(3 if homes == 2 else 1, homes, mbps=100)
    backbone = start_backbone(processes, lab)
    places = [(lab.home_maddr(k), lab.home_host(k)) for k in range(homes)]
    places += [(lab.public_maddr(k), lab.public_host(k)) for k in range(1, 5 - homes)]
    # at 100 Mbit/s, chunks of 1 MB in 8 parts: the steps overlap, as in a volunteer's rounds
    results = average_in_a_ring(processes, lab, backbone, places, tmp_path, [600000, 400000], part_bytes=128 * 1024)
    assert all(result["reachability"] == "relay" for result in results[:homes])
    # cluster 0, behind NAT, sent its 6 ring messages to cluster 1, behind another NAT, through the backbone
    assert results[0]["routes"].get("calls_forward", 0) >= 6, results[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("joiner", ["public", "behind-nat"])
def test_a_late_joiner_downloads_every_layer_from_a_holder_behind_nat(processes, make_lab, tmp_path, joiner):
    """The only holder of the trained layers is behind NAT (no inbound connection reaches it). A public
    late joiner has the backbone ask it to dial back (connection reversal), unless the holder's own first
    averaging call reached it first and its connection is already open; a joiner behind another NAT,
    which the holder cannot dial either, gets each layer in one message through the backbone's
    forwarding. Either downloads every layer mid-run and continues at the holder's step."""
    behind_nat = joiner == "behind-nat"
    lab = make_lab(2, 2) if behind_nat else make_lab(3, 1)
    backbone = start_backbone(processes, lab)

    def join(name, maddr, lab_host):
        # each can hold the whole model: a cluster of its own; a checkpoint only at placement and at exit
        return processes.start(["join", "--initial-peers", backbone, "--run", RUN, "--name", name, "--no-dashboard",
                                "--model", "mlp-digits", "--steps", "100000", "--min-peers", "1", "--heartbeat", "2",
                                "--round-seconds", "6", "--ram-gb", f"{MODEL_GB * 1.5:.9f}", "--gflops", "20",
                                "--bandwidth-mbps", "100", "--host-maddrs", maddr, "--checkpoint-dir", str(tmp_path),
                                "--checkpoint-every", "100000"], name, lab_host=lab_host)

    join("home", lab.home_maddr(0), lab.home_host(0))
    observe_until(processes, backbone, lab, "home", lambda r: r["reachability"] == "relay" and (r.get("step") or 0) >= 40,
                  "behind NAT past step 40", 150)
    late = join("late", *((lab.home_maddr(1), lab.home_host(1)) if behind_nat else
                          (lab.public_maddr(2), lab.public_host(2))))
    started = late.wait_for_output(r"late: training cluster \d+ stage 0/1 layers 0:\d+ from step (\d+)", 150,
                                   stream="stderr")
    step = int(started.group(1))
    assert step >= 40
    every_layer = list(range(len(get_model("mlp-digits").layers)))
    log = late.stderr()
    assert f"late: downloading layers {every_layer}" in log and "keeping this layer's local weights" not in log, log[-3000:]
    routes = ([": forward via backbone"] if behind_nat else
              [": reversed via backbone", ": direct over a connection already open"])
    assert any(route in log for route in routes), log[-3000:]
    # its checkpoint, written right after the download, holds the holder's trained layers at that step
    late_layers, late_step = checkpoint_layers(tmp_path / f"{RUN}-late.safetensors")
    assert late_step == step and sorted(late_layers) == every_layer
    initial = get_model("mlp-digits").build_stage(0, len(every_layer))
    for layer in every_layer:
        seeded = initial[layer].state_dict()
        assert any(not torch.equal(tensor, seeded[key]) for key, tensor in late_layers[layer].items()), layer
