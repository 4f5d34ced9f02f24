"""A volunteer's own utilisation and traffic (issues 33 and 30): where a placed stage's wall time goes, the bytes its
streams carry, their place in its record, and what ``status`` shows of them (the table, ``--json``) on a real run."""

import asyncio
import io
import json
import socket

import pydantic.v1 as pydantic
import pytest
from rich.console import Console

from ravnest_swarm.dashboard.peers_table import status_document, use_table
from ravnest_swarm.dashboard.state import SwarmState
from ravnest_swarm.dashboard.view import render_text
from ravnest_swarm.membership.own_record import publishable
from ravnest_swarm.membership.progress import TIME_USES, placed_use
from ravnest_swarm.membership.records import PeerRecord
from ravnest_swarm.net.traffic import Traffic
from ravnest_swarm.pipeline.counters import BusyTime, Counters, WallTime, utilisation
from test_swarm import placed, swarm  # noqa: F401 (swarm: the fixture of real `join` volunteers)


class Clock:
    """Time that moves only when the test says."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_each_moment_counts_once_for_the_first_use_that_holds():
    clock = Clock()
    wall = WallTime(clock)
    clock.now = 5.0  # before the first placement: nobody's time
    wall.count(True)
    with wall.using("plan"):
        clock.now += 1.0
        with wall.using("download"):  # a download during a plan's move is a download
            clock.now += 4.0
        clock.now += 1.0
    neighbour = wall.using("neighbour")
    neighbour.__enter__()
    clock.now += 2.0
    with wall.using("computing"), wall.using("sending"):  # a send beside a compute: computing
        clock.now += 3.0
    with wall.using("sending"), wall.using("sending"):  # two sends at once count once
        clock.now += 1.0
    neighbour.__exit__(None, None, None)
    with wall.using("averaging"):
        clock.now += 2.0
    clock.now += 1.0  # between tasks: other
    wall.count(False)  # a standby
    clock.now += 100.0
    assert wall.seconds == dict(computing=3.0, sending=1.0, download=4.0, plan=2.0, averaging=2.0, neighbour=2.0,
                                other=1.0)
    shares = wall.shares()
    assert sum(shares.values()) == pytest.approx(1.0) and wall.total() == 15.0
    # computing and sending over the time that was not a download: 4 / 11
    assert utilisation(shares) == pytest.approx(4 / 11)
    assert WallTime(clock).shares() is None
    with pytest.raises(ValueError):
        wall.using("other").__enter__()


def test_overlapping_uses_need_not_nest():
    """A send's task may end after the compute that started after it: each use is counted, not stacked."""
    clock = Clock()
    wall = WallTime(clock)
    wall.count(True)
    send, compute = wall.using("sending"), wall.using("computing")
    send.__enter__()
    clock.now += 1.0
    compute.__enter__()
    clock.now += 2.0
    send.__exit__(None, None, None)
    clock.now += 3.0
    compute.__exit__(None, None, None)
    clock.now += 1.0
    assert wall.total() == 7.0  # charges the time since the last change
    assert (wall.seconds["sending"], wall.seconds["computing"], wall.seconds["other"]) == (1.0, 5.0, 1.0)


def test_a_stage_charges_its_compute_and_sends_to_its_volunteers_wall_time():
    clock = Clock()
    wall = WallTime(clock)
    wall.count(True)
    counters = Counters()
    busy = BusyTime(counters, wall)
    with busy.measure("computing"):
        clock.now += 2.0
    with busy.measure():  # a send's retries and waits between them: busy, but charged only where it sends
        clock.now += 1.0
        with wall.using("sending"):
            clock.now += 1.0
    assert (wall.seconds["computing"], wall.seconds["sending"], wall.seconds["other"]) == (2.0, 1.0, 1.0)
    assert len(counters.busy) == 2


def test_counted_streams_add_what_passes_by_handler():
    async def main():
        traffic = Traffic()
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=ours)
        other_reader, other_writer = await asyncio.open_connection(sock=theirs)
        counted_reader, counted_writer = traffic.counted("ravnest.forward", reader, writer)
        counted_writer.write(b"x" * 1000)
        await counted_writer.drain()
        assert await other_reader.readexactly(1000) == b"x" * 1000
        other_writer.write(b"y" * 300)
        await other_writer.drain()
        assert await counted_reader.readexactly(100) == b"y" * 100
        assert await counted_reader.read(1000) == b"y" * 200
        assert not counted_reader.at_eof()
        for stream in (counted_writer, other_writer):
            stream.close()
            await stream.wait_closed()
        return traffic

    traffic = asyncio.run(main())
    assert traffic.sent == {"ravnest.forward": 1000} and traffic.received == {"ravnest.forward": 300}
    assert traffic.totals() == (1000, 300)


def record(**fields):
    base = dict(peer_id="QmPeer", name="p", state="training", ram_gb=1.0, bandwidth_mbps=100.0, gflops=10.0,
                reachability="direct", maddrs=[], version="1", time=1.0, layers=None)
    return dict(base, **fields)


SHARES = dict(computing=0.7, sending=0.2, download=0.02, plan=0.01, averaging=0.03, neighbour=0.03, other=0.01)


def test_the_record_holds_the_shares_and_the_traffic_within_their_bounds():
    use = dict(utilisation=0.92, time_shares=SHARES, window_s=120.5, bytes_up_per_s=2.5e5, bytes_down_per_s=1e5,
               moved_bytes=4096, averaging_codec="int8")
    assert PeerRecord.parse_obj(record(**use)).dict()["time_shares"] == SHARES
    for bad in (dict(time_shares=dict(SHARES, sleeping=0.1)), dict(time_shares=dict(SHARES, computing=1.5)),
                dict(utilisation=-0.1), dict(bytes_up_per_s=float("nan")), dict(averaging_codec="int8\n"),
                dict(moved_bytes=-1), dict(time_shares=dict(computing="0.7"))):
        with pytest.raises(pydantic.ValidationError):
            PeerRecord.parse_obj(record(**dict(use, **bad)))
    # our own figures out of their bounds are published clamped and named, not a record that fails to renew
    fixed = publishable(record(bytes_up_per_s=1e13, utilisation=1.0000001))
    assert fixed["bytes_up_per_s"] == 1e12 and fixed["utilisation"] == 1.0
    assert set(fixed["out_of_range"]) == {"bytes_up_per_s", "utilisation"}


def test_status_and_the_dashboard_show_the_placed_stages_use():
    busy = record(name="busy", peer_id="QmA", cluster=0, stage=0, utilisation=0.9, time_shares=SHARES,
                  bytes_up_per_s=250_000.0, bytes_down_per_s=120_000.0, codecs=dict(forward="f16", backward="none"),
                  averaging_codec="none")
    idle = record(name="idle", peer_id="QmB", cluster=0, stage=1, utilisation=0.5,
                  time_shares=dict(computing=0.4, sending=0.1, download=0.0, plan=0.0, averaging=0.1, neighbour=0.4,
                                   other=0.0), bytes_up_per_s=1000.0, bytes_down_per_s=2000.0)
    spare = record(name="spare", peer_id="QmC", state="standby", cluster=-1, utilisation=0.1, time_shares=SHARES)
    use = placed_use([busy, idle, spare])  # a standby's old figures are no placed stage's
    assert use["stages"] == 2 and use["utilisation"] == pytest.approx(0.7)
    assert use["time_shares"]["neighbour"] == pytest.approx(0.215) and set(use["time_shares"]) == set(TIME_USES)
    assert json.loads(json.dumps(status_document("r", 10, False, None, [busy, idle, spare])))["use"] == use
    console = Console(width=80, file=io.StringIO(), record=True, color_system=None)
    console.print(use_table([busy, idle, spare]))
    text = console.export_text()
    assert "placed stages 70% busy (mean of 2)" in text
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 80
    row = next(line.split() for line in text.splitlines() if line.strip().startswith("busy"))
    assert row == ["busy", "90%", "70%", "20%", "2%", "1%", "3%", "3%", "1%", "250/120", "f16/none", "none"]
    assert use_table([record()]) is None
    state = SwarmState("r")
    state.update([busy, idle, spare], at=1.0)
    assert "busy 70%" in render_text(state, width=120) and "up 251.0 kB/s down 122.0 kB/s" in render_text(state, 120)


@pytest.mark.timeout(300)
def test_status_json_shows_a_training_peers_utilisation_and_traffic(swarm, processes):  # noqa: F811
    """Two real `join` volunteers train one cluster of two stages: `status --json` shows each placed peer's
    utilisation in [0, 1], time shares that add up to 1, bytes per second out and in above 0, and its codecs;
    `status` prints them in its table of time and traffic."""
    for name in ("u0", "u1"):
        swarm(name, steps=100_000, extra=("--min-peers", "2"))
    swarm.watcher.wait_for(
        lambda peers: len(placed(peers)) == 2 and all((p.get("window_s") or 0) > 10 and p.get("bytes_up_per_s")
                                                      for p in placed(peers).values()),
        200, "both peers placed, training for 10 s, and publishing their traffic")
    status = processes.start(["status", "--initial-peers", swarm.maddr, "--run", "swarm-test", "--json"], "status")
    assert status.wait(90) == 0, status.stderr()[-3000:]
    document = json.loads(status.stdout().strip().splitlines()[-1])
    training = [p for p in document["peers"] if p["state"] == "training"]
    assert len(training) == 2, document["peers"]
    for peer in training:
        assert 0.0 <= peer["utilisation"] <= 1.0 and peer["window_s"] > 10
        assert set(peer["time_shares"]) == set(TIME_USES)
        assert sum(peer["time_shares"].values()) == pytest.approx(1.0, abs=0.01)
        assert peer["time_shares"]["computing"] > 0
        assert peer["bytes_up_per_s"] > 0 and peer["bytes_down_per_s"] > 0, peer
        assert peer["codecs"] and peer["averaging_codec"] == "int8"  # the run's default
    assert document["use"]["stages"] == 2 and 0.0 <= document["use"]["utilisation"] <= 1.0
    table = processes.start(["status", "--initial-peers", swarm.maddr, "--run", "swarm-test"], "status-table",
                            env={"COLUMNS": "100"})
    assert table.wait(90) == 0, table.stderr()[-3000:]
    assert "time and traffic: placed stages" in table.stdout() and "u0" in table.stdout()
