"""Processes started from the library's own option objects (``ProcessGroup.start_library``), as ``local`` and
the benches start them: the options survive the trip as JSON, and a failure in the child is one line."""

import dataclasses
import json
import os
import signal

import psutil

from ravnest_swarm.bench.averaging_peer import AveragingPeerOptions
from ravnest_swarm.membership.backbone import BackboneOptions, run_backbone_process
from ravnest_swarm.pipeline.config import Neighbours
from ravnest_swarm.pipeline.stage import StageConfig, StageProcessOptions
from ravnest_swarm.processes import options_from_json
from ravnest_swarm.swarm.join import JoinOptions


def test_options_come_back_from_json_as_they_were_sent():
    join = JoinOptions(initial_peers=["/ip4/127.0.0.1/tcp/1/p2p/Qm"], run="r", name="n", ram_gb=1.5, resume=True)
    assert options_from_json(JoinOptions, json.loads(json.dumps(dataclasses.asdict(join)))) == join
    peer = AveragingPeerOptions(["/ip4/127.0.0.1/tcp/1/p2p/Qm"], "r", 0, 1, [4, 4], (0, 2), host_maddrs=["x"])
    assert options_from_json(AveragingPeerOptions, json.loads(json.dumps(dataclasses.asdict(peer)))) == peer
    stage = StageProcessOptions(StageConfig(run="r", stage=0, stages=2, model="gpt-tiny", layers=(0, 2),
                                            neighbours=Neighbours(next="QmNext")), ["x"], identity="stage0.key")
    assert options_from_json(StageProcessOptions, json.loads(json.dumps(dataclasses.asdict(stage)))) == stage


def test_a_backbone_started_from_its_options_serves_and_stops_cleanly(processes):
    backbone = processes.start_library(run_backbone_process, BackboneOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]),
                                       "backbone")
    assert backbone.maddrs()[0].startswith("/ip4/127.0.0.1/tcp/")
    backbone.signal(signal.SIGTERM)
    assert backbone.wait(30) == 0


def test_bad_options_in_a_child_are_one_line_and_a_nonzero_exit(processes):
    child = processes.start_library(run_backbone_process, BackboneOptions(host_maddrs=["not-a-multiaddr"]), "bad")
    assert child.wait(60) != 0
    lines = child.stderr().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--host-maddrs" in lines[0], lines


def test_kill_group_stops_the_p2pd_of_a_peer_killed_alone(processes):
    """A peer's p2pd runs in a process group of its own (so a terminal's Ctrl-C does not reach it), but in the
    peer's session: after ``kill -9`` of the peer alone, its orphaned p2pd is still found and stopped."""
    backbone = processes.start(["backbone", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], "backbone")
    backbone.maddrs()
    (p2pd,) = [p for p in psutil.Process(backbone.pid).children() if p.name() == "p2pd"]
    assert os.getpgid(p2pd.pid) != backbone.pid and os.getsid(p2pd.pid) == backbone.pid
    os.kill(backbone.pid, signal.SIGKILL)
    backbone.wait(10)
    assert p2pd.is_running()  # orphaned, still serving
    backbone.kill_group()
    p2pd.wait(10)
