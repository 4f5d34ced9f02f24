"""The dashboard: events and totals derived from snapshots, and a readable rendering at 80 columns."""

import asyncio
import io
import json
import logging
import os
import re
import subprocess
import sys
import time

import pytest
from rich.console import Console

from commands import ravnest
from ravnest_swarm.bench.records import peer_id_of, write_run_records
from ravnest_swarm.dashboard.focus import FULL_READ_BUCKETS, sees_part
from ravnest_swarm.dashboard.live import LogPanel, logs_below, render_with_logs
from ravnest_swarm.dashboard.peers_table import SCREENFUL_ROWS, peers_table, status_document, status_view
from ravnest_swarm.dashboard.state import SwarmState, load_recording
from ravnest_swarm.dashboard.view import render, render_text
from ravnest_swarm.membership.buckets import bucket_of, run_samples_per_s
from ravnest_swarm.membership.records import make_validators
from ravnest_swarm.net.node import parse_maddrs, start_node, stop_node
from ravnest_swarm.swarm.observe import ROTATING_BUCKETS, SnapshotReader, neighbour_ids
from ravnest_swarm.swarm.spec import OPEN_ENDED

# what the dashboard was fed during a real run: RAVNEST_RECORD_SNAPSHOTS=FILE ravnest-swarm local --peers 5
# --steps 200 --averaging-period 20 (docs/dashboard.md): 5 peers, 2 clusters, plan round 1, 10 averaging rounds
RECORDING = os.path.join(os.path.dirname(__file__), "data", "local_run_snapshots.jsonl")
RECORDED_STEPS = 200


def peer(name, state="training", cluster=None, stage=None, **fields):
    record = dict(peer_id=f"id-{name}", name=name, state=state, ram_gb=8.0, bandwidth_mbps=100.0, gflops=500.0,
                  reachability="direct", cluster=cluster, stage=stage, time=1.0,
                  layers=None if stage is None else [stage * 4, stage * 4 + 4])
    record.update(fields)
    return record


def kinds(events):
    return [event.kind for event in events]


def lines_of(text):
    return text.rstrip("\n").splitlines()


@pytest.fixture(scope="module")
def snapshots():
    return load_recording(RECORDING)


@pytest.fixture(scope="module")
def recorded(snapshots):
    return SwarmState.replay(snapshots, steps=RECORDED_STEPS)


def test_the_recorded_run_ends_as_it_did(snapshots, recorded):
    """The last snapshot of the real run: every peer done at the run's length in the plan's two clusters, the
    averaging rounds the peers counted, the events of the run (a start, five joins, one round adopted)."""
    last = snapshots[-1]
    text = render_text(recorded, 80)
    assert max(len(line) for line in lines_of(text)) <= 80
    assert f"run local · finished at step {RECORDED_STEPS}" in text
    assert len(last["peers"]) == 5 and len(last["plan"]["clusters"]) == 2
    assert "peers 5 │ clusters 2 │ placed 5 │ spares 0" in text and "plan round 1" in text
    rounds = max(p["averaging_rounds"] for p in last["peers"])
    assert rounds == 10 and f"avg rounds {rounds} done, 0 failed" in text
    for cluster, stages in enumerate(last["plan"]["clusters"]):
        assert f"cluster {cluster}" in text
        for stage, planned in enumerate(stages):
            holder = next(p for p in last["peers"] if p["peer_id"] == planned["peer_id"])
            assert (holder["cluster"], holder["stage"], holder["layers"]) == (cluster, stage, planned["layers"])
            assert holder["name"] in text and f"L{planned['layers'][0]}-{planned['layers'][1]}" in text
    assert text.count(f"#{RECORDED_STEPS} ") == 5
    assert kinds(recorded.events) == ["start"] + ["joined"] * 5 + ["round"]
    assert "planning round 1 adopted: 2 cluster(s), 5 placed, 0 standby" in text


def test_the_recorded_losses_are_the_training_peers_means(snapshots, recorded):
    """The loss curve holds, for each snapshot with a training peer reporting a loss, the mean of those losses,
    as the recording has them (every peer's record is in every read of this run, so nothing is merged in)."""
    expected = []
    for snapshot in snapshots:
        losses = [p["loss"] for p in snapshot["peers"] if p["state"] in ("training", "averaging")
                  and p.get("loss") is not None]
        if losses:
            expected.append((snapshot["at"], sum(losses) / len(losses)))
    assert [at for at, _ in recorded.losses] == [at for at, _ in expected]
    assert [loss for _, loss in recorded.losses] == pytest.approx([loss for _, loss in expected])
    assert expected[0][1] > 1.5 and expected[-1][1] < 0.1  # the run learned
    assert f"last {expected[-1][1]:.2f} over {len(expected)} snapshot(s)" in render_text(recorded, 80)
    assert re.search(r"[▁▂▃▄▅▆▇█]{8,}", render_text(recorded, 80)), "no loss curve"


def test_the_recorded_run_midway_shows_rates_steps_and_averaging(snapshots):
    """The first snapshot in which peers averaged: each cluster's rate is its last stage's, each cell the
    step and rate its peer reported."""
    midway = next(i for i, snapshot in enumerate(snapshots)
                  if sum(p["state"] == "averaging" for p in snapshot["peers"]) >= 2)
    state = SwarmState.replay(snapshots[:midway + 1], steps=RECORDED_STEPS)
    text = render_text(state, 80)
    assert "finished" not in text
    peers = snapshots[midway]["peers"]
    averaging = sum(p["state"] == "averaging" for p in peers)
    assert f"{averaging} averaging now" in text
    last_stages = [max((p for p in peers if p["cluster"] == c), key=lambda p: p["stage"]) for c in (0, 1)]
    assert state.totals().samples_per_s == pytest.approx(sum(p["samples_per_s"] for p in last_stages))
    for record in peers:
        assert f"#{record['step']} {record['samples_per_s']:.0f}/s" in text, record["name"]


def test_short_terminal_compacts_the_map_but_keeps_every_peer(recorded):
    console = Console(width=80, height=20, file=io.StringIO(), record=True, color_system=None)
    console.print(render(recorded, 80, height=20))
    text = console.export_text()
    assert len(lines_of(text)) < len(lines_of(render_text(recorded, 80)))
    assert max(len(line) for line in lines_of(text)) <= 80
    for record in recorded.peers:
        assert record["name"] in text


def test_many_clusters_wrap_into_rows_without_folding_names():
    peers = [peer(f"volunteer-{k}-{s}-abcdef", cluster=k, stage=s, step=123456, samples_per_s=1234.5,
                  loss=2.5 if s == 3 else None) for k in range(8) for s in range(4)]
    state = SwarmState("wide")
    state.update(peers)
    for width in (80, 100, 160):
        text = render_text(state, width)
        assert max(len(line) for line in lines_of(text)) <= width
        for record in peers:
            assert record["name"] in text
        assert all(f"cluster {k}" in text for k in range(8))


def test_empty_and_unplaced_swarms_render():
    state = SwarmState("new")
    assert "no snapshot yet" in render_text(state, 80)
    state.update([peer("first", "joining"), peer("second", "standby")])
    text = render_text(state, 80)
    assert "no cluster yet" in text and "first (join)" in text and "second (spare)" in text
    assert "no loss reported yet" in text


def test_json_round_trip_renders_and_diffs_the_same(recorded):
    restored = SwarmState.from_json(json.loads(json.dumps(recorded.to_json())))
    assert render_text(restored, 80) == render_text(recorded, 80)
    later = recorded.peers[1:]
    copy = SwarmState.from_json(recorded.to_json())
    assert copy.update(later, recorded.plan, recorded.at + 10) == \
        SwarmState.from_json(restored.to_json()).update(later, recorded.plan, recorded.at + 10)


def test_joined_and_left_events():
    state = SwarmState()
    assert kinds(state.update([peer("a")], at=1)) == ["start"]
    assert kinds(state.update([peer("a"), peer("b", "joining")], at=2)) == ["joined"]
    events = state.update([peer("a", "leaving"), peer("b", "standby")], at=3)
    assert kinds(events) == ["left"] and "a is leaving" in events[0].text
    assert state.update([peer("b", "standby")], at=4) == []  # its expiry after "leaving" is no news
    events = state.update([], at=5)
    assert kinds(events) == ["left"] and "b vanished" in events[0].text


def test_a_peer_leaving_a_finished_run_is_said_to_leave_because_it_is_finished():
    state = SwarmState(steps=100)
    state.update([peer("a", "done", 0, 0, step=100), peer("s", "standby")], at=1)
    (event,) = state.update([peer("a", "done", 0, 0, step=100), peer("s", "leaving")], at=2)
    assert event.text == "s is leaving (the run is finished)"
    unfinished = SwarmState(steps=100)
    unfinished.update([peer("a", "training", 0, 0, step=50), peer("s", "standby")], at=1)
    (event,) = unfinished.update([peer("a", "training", 0, 0, step=50), peer("s", "leaving")], at=2)
    assert event.text == "s is leaving"


def test_an_open_ended_run_its_owner_ended_is_finished_at_the_step_its_stages_reached():
    """An open-ended run has no length a stage reaches: the dashboard says it is finished once its owner's signed
    spec says so (``status --watch`` passes it in each snapshot), at the step its stages stopped at."""
    state = SwarmState(run="open", steps=OPEN_ENDED)
    running = [peer("a", "done", 0, 0, step=812), peer("b", "training", 0, 1, step=811)]
    state.feed(dict(run="open", at=1, peers=running, steps=OPEN_ENDED, finished=False))
    assert not state.finished
    state.feed(dict(run="open", at=2, peers=running, steps=OPEN_ENDED, finished=True))
    assert state.finished
    assert "finished at step 812" in render_text(state, width=100)


def test_the_dashboard_says_how_many_records_its_validator_refused():
    """``status --watch`` and a volunteer's dashboard read through a validator that refuses records not written by
    the peer they name (membership/identity.py); the snapshot carries its counts and the totals line says them."""
    state = SwarmState(run="demo")
    state.feed(dict(run="demo", at=1, peers=[peer("a", cluster=0, stage=0)], refused={}))
    assert "refused" not in render_text(state, width=160)
    state.feed(dict(run="demo", at=2, peers=[peer("a", cluster=0, stage=0)],
                    refused={"written by a key that is not the peer they name": 3}))
    assert "refused 3 records" in render_text(state, width=160)


def test_replaced_even_after_the_slot_was_vacant():
    state = SwarmState()
    state.update([peer("a", cluster=0, stage=1), peer("spare", "standby")], at=1)
    assert state.update([peer("spare", "standby")], at=2)[0].kind == "left"
    events = state.update([peer("spare", cluster=0, stage=1)], at=3)
    assert kinds(events) == ["replaced"] and "spare replaced a at cluster 0 stage 1" in events[0].text


def test_new_round_is_one_event_not_a_flood_of_replacements():
    """A round that moves every peer is one event, with the counts of its plan record, not a replacement per
    slot. Peers' records alone make no round event: they say a round before their place in it (three
    standbys reporting round 1, which placed two of them, once gave ``0 cluster(s), 0 placed, 3 standby``)."""
    state = SwarmState()
    state.update([peer(name, "standby") for name in "abc"], at=0)
    assert state.update([peer(name, "standby", plan_round=1) for name in "abc"], at=1) == []
    assert state.totals().plan_round == 1
    first = dict(round=1, time=0.0, clusters=[[dict(peer_id="id-a", layers=[0, 4]), dict(peer_id="id-b", layers=[4, 8])]])
    placed = [peer("a", cluster=0, stage=0, plan_round=1), peer("b", cluster=0, stage=1, plan_round=1),
              peer("c", "standby", plan_round=1)]
    events = state.update(placed, first, at=2)
    assert [e.text for e in events] == ["planning round 1 adopted: 1 cluster(s), 2 placed, 1 standby"]
    moved = [peer("a", cluster=0, stage=1, plan_round=2), peer("b", cluster=0, stage=0, plan_round=2),
             peer("c", "standby", plan_round=2)]
    assert state.update(moved, at=3) == [] and state.totals().plan_round == 2  # no flood of replacements
    second = dict(round=2, time=0.0, clusters=[[dict(peer_id="id-b", layers=[0, 4]), dict(peer_id="id-a", layers=[4, 8])]])
    events = state.update(moved, second, at=4)
    assert [e.text for e in events] == ["planning round 2 adopted: 1 cluster(s), 2 placed, 1 standby"]
    assert state.update(moved, second, at=5) == []
    # a peer leaving its slot is no spare: the next round's event counts the two placed and nobody else
    left = [peer("a", "leaving", cluster=0, stage=1, plan_round=2), peer("b", cluster=0, stage=0, plan_round=3),
            peer("c", cluster=0, stage=1, plan_round=3)]
    third = dict(round=3, time=0.0, clusters=[[dict(peer_id="id-b", layers=[0, 4]), dict(peer_id="id-c", layers=[4, 8])]])
    events = state.update(left, third, at=6)
    assert [e.text for e in events if e.kind == "round"] == ["planning round 3 adopted: 1 cluster(s), 2 placed, 0 standby"]
    assert (state.totals().peers, state.totals().standby) == (3, 0)


def test_averaging_failures_and_refusals_are_events_with_their_cause():
    state = SwarmState()
    state.update([peer("a", averaging_failures=0), peer("b", averaging_failures=None)], at=1)
    events = state.update([peer("a", averaging_failures=2, note="averaging step 40: ring 0 timeout: c did not "
                                                                "reach round 40 within 20s"),
                           peer("b", averaging_failures=1, rejected=1, note="refused forward from c: activations "
                                                                            "holds NaN or Inf")], at=2)
    assert kinds(events) == ["avg-fail", "avg-fail", "rejected"]
    assert events[0].text == "averaging failed on a (2 so far): step 40: ring 0 timeout: c did not reach round 40 within 20s"
    assert events[1].text == "averaging failed on b (1 so far)"  # its note is about something else
    assert events[2].text == "poisoned or malformed input refused by b (1 so far): forward from c: activations holds NaN or Inf"
    assert state.totals().averaging_failures == 2  # the most any peer saw, comparable with rounds done


def test_totals_and_vacant_planned_slot():
    plan = dict(round=5, time=0.0, clusters=[[dict(peer_id="id-a", layers=[0, 4]), dict(peer_id="id-gone", layers=[4, 8])],
                                             [dict(peer_id="id-c", layers=[0, 8])]])
    peers = [peer("a", "averaging", 0, 0, samples_per_s=50.0, averaging_rounds=7, loss=None),
             peer("c", "training", 1, 0, samples_per_s=30.0, averaging_rounds=6, averaging_failures=1, loss=2.0),
             peer("d", "standby")]
    state = SwarmState("t")
    state.update(peers, plan, at=1)
    totals = state.totals()
    # cluster 0's last live stage is stage 0 (stage 1 is vacant): its rate counts, as does cluster 1's
    assert (totals.peers, totals.clusters, totals.placed, totals.standby, totals.samples_per_s) == (3, 2, 2, 1, 80.0)
    assert (totals.averaging_done, totals.averaging_running, totals.averaging_failures, totals.plan_round) == (7, 1, 1, 5)
    assert list(state.losses) == [(1, 2.0)]
    text = render_text(state, 80)
    assert "(vacant)" in text and "plan: id-gone" in text


def test_memory_is_bounded():
    state = SwarmState(max_events=5, max_losses=3, max_names=4)
    for i in range(20):
        state.update([peer(f"p{i}", loss=float(i))], at=i)
    assert len(state.events) == 5 and len(state.losses) == 3 and list(state.names.values()) == ["p16", "p17", "p18", "p19"]


def test_a_read_that_misses_records_keeps_them_until_they_expire():
    """A DHT read that misses some records (a node holding them did not answer in time, common on a busy
    machine) is no news: they stay until their own expiration time, so a partial read makes no 'vanished'
    event, and the next full read no 'joined' one. A stale copy of a record (a node that missed a renewal)
    does not replace the newer one known."""
    records = [peer(name, time=100.0, step=10, expires_in=8.0) for name in ("a", "b", "c")]
    state = SwarmState()
    state.update(records, at=100)
    for at, read in ((101, records[:1]), (102, []), (103, records), (104, records[1:])):
        assert state.update(read, at=at) == [], at
        assert [p["name"] for p in state.peers] == ["a", "b", "c"] and state.totals().peers == 3
    assert state.update([dict(records[0], time=105.0, step=20, expires_in=8.0)], at=105) == []
    assert state.update([dict(records[0], step=10, expires_in=2.0)], at=106) == []  # the stale copy
    assert state.peers[0]["step"] == 20 and state.peers[0]["expires_in"] == 7.0
    events = state.update([dict(records[0], time=112.0, step=30, expires_in=8.0)], at=112.5)  # b, c expired at 112
    assert kinds(events) == ["left", "left"] and all("vanished" in e.text for e in events)
    assert [p["name"] for p in state.peers] == ["a"] and state.peers[0]["step"] == 30


def test_counts_and_planned_slots_come_from_the_adopted_plan():
    """When a round is adopted, the placed peers' records still say standby for a moment (they fetch their
    layers first): the round event and the totals count the plan's clusters, and the map names each planned
    peer in its slot, live ones as starting and gone ones by the name they had."""
    state = SwarmState()
    gone = peer("gone", "standby", expires_in=4.0)
    state.update([peer(name, "standby", expires_in=8.0) for name in ("a", "b", "c")] + [gone], at=100)
    state.update([peer(name, "standby", expires_in=8.0) for name in ("a", "b", "c")], at=105)  # gone's record expired
    plan = dict(round=1, time=0.0, clusters=[[dict(peer_id=f"id-{name}", layers=[0, 4]) for name in ("a", "b")],
                                             [dict(peer_id="id-gone", layers=[0, 4])]])
    events = state.update([peer(name, "standby", expires_in=8.0) for name in ("a", "b", "c")], plan, at=106)
    assert [e.text for e in events] == ["planning round 1 adopted: 2 cluster(s), 2 placed, 1 standby"]
    totals = state.totals()
    assert (totals.clusters, totals.placed, totals.standby) == (2, 2, 1)
    text = render_text(state, 80)
    assert "starting (now spare)" in text and "plan: gone" in text and "outside clusters (1): c (spare)" in text
    assert state.update(state.peers, None, at=107) == [] and state.plan == plan  # a read that found no plan
    assert state.update(state.peers, dict(plan, round=0), at=108) == [] and state.plan == plan  # a lagging node's


def test_the_loss_curve_leaves_out_finished_peers():
    state = SwarmState()
    state.update([peer("a", cluster=0, stage=0, loss=2.0), peer("b", "done", cluster=1, stage=0, loss=9.0)], at=1)
    state.update([peer("a", "done", cluster=0, stage=0, loss=1.0), peer("b", "done", cluster=1, stage=0, loss=9.0)],
                 at=2)
    assert list(state.losses) == [(1, 2.0)]


def test_peers_table_fits_80_columns_without_folding_words(recorded):
    console = Console(width=80, file=io.StringIO(), record=True, color_system=None)
    console.print(peers_table("demo", recorded.peers))
    text = console.export_text()
    assert max(len(line) for line in lines_of(text)) <= 80
    for record in recorded.peers:
        assert record["name"] in text and re.search(rf"{re.escape(record['name'])}\s+{record['state']}\s", text)


# runs its arguments on an 80x40 pseudo-terminal and forwards SIGTERM, so the watcher stops its DHT node
# cleanly (the child is in a session of its own, out of reach of the process group's signals)
PTY_WRAPPER = """
import fcntl, os, pty, signal, struct, sys, termios
pid, fd = pty.fork()
if pid == 0:
    os.environ.update(COLUMNS="80", LINES="40", TERM="xterm")
    os.execvp(sys.argv[1], sys.argv[1:])
fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 80, 0, 0))
signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGTERM))
while True:
    try:
        data = os.read(fd, 65536)
    except InterruptedError:
        continue
    except OSError:
        break
    if not data:
        break
    os.write(1, data)
sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def test_status_watch_shows_a_joiner_live(processes, backbone):
    joiner = processes.start(["join", "--initial-peers", backbone, "--run", "dash", "--name", "dash-joiner",
                              "--no-dashboard", "--ram-gb", "4", "--gflops", "100", "--bandwidth-mbps", "100",
                              "--heartbeat", "1", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], "joiner")
    joiner.wait_for_output(r"sees \d+ peer", 60, stream="stderr")
    watcher = processes.start(["status", "--initial-peers", backbone, "--run", "dash", "--watch"], "watcher",
                              prefix=[sys.executable, "-c", PTY_WRAPPER])
    watcher.wait_for_output(r"dash-joiner", 60)
    watcher.wait_for_output(r"peers 1 ", 30)
    assert "spares 1" in watcher.stdout() or "outside clusters (1)" in watcher.stdout()
    assert watcher.stop(grace=20) == 0
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", watcher.stdout())
    assert max(len(line) for line in plain.replace("\r", "\n").splitlines()) <= 80


def test_log_lines_go_below_the_live_view_counted_not_over_it(capsys):
    """While a live view is up, a warning repeated every half second is one line below the view with a count,
    nothing reaches the terminal's stream, and the terminal's handler is back afterwards."""
    log = logging.getLogger("ravnest_swarm.pipeline.stage")
    root = logging.getLogger()
    screen = logging.StreamHandler(sys.stderr)
    root.addHandler(screen)
    try:
        with logs_below(LogPanel(lines=2)) as panel:
            assert screen not in root.handlers
            for microbatch in range(12):
                log.warning(f"send forward of microbatch {microbatch} to stage 1 failed (LookupError); retrying")
            log.warning("stage 0: rejected forward from X: activations\x1b[2J holds NaN or Inf")
            log.info("an info line is not shown")
            state = SwarmState("logs")
            state.update([peer("a")], at=1)
            console = Console(width=80, height=40, file=io.StringIO(), record=True, color_system=None)
            console.print(render_with_logs(state, panel, console))
        text = console.export_text()
        assert "WARN x12 send forward of microbatch 11 to stage 1 failed" in text
        assert "WARN stage 0: rejected forward from X: activations" in text and "\x1b" not in text
        assert "info line" not in text
        assert max(len(line) for line in lines_of(text)) <= 80
        assert capsys.readouterr().err == ""
        assert screen in root.handlers
    finally:
        root.removeHandler(screen)


def test_the_title_says_when_the_run_is_finished_and_not_before():
    state = SwarmState("demo", steps=300)
    state.update([peer("a", "done", 0, 0, step=300), peer("b", "training", 0, 1, step=290), peer("s", "standby", -1)])
    assert not state.finished and "finished" not in render_text(state, 100)
    state.update([peer("a", "done", 0, 0, step=300), peer("b", "done", 0, 1, step=300), peer("s", "standby", -1)])
    assert state.finished and "run demo · finished at step 300" in render_text(state, 100)
    assert not SwarmState("demo").finished  # a run's length unknown (no spec read): never called finished


def test_the_dashboard_imports_no_network_code():
    """The dashboard draws snapshots it is handed (membership.reader reads them): importing it loads no
    hivemind module (the package's light entry is no module of hivemind's), nor our network code."""
    code = ("import sys, ravnest_swarm.dashboard.live, ravnest_swarm.dashboard.view, "
            "ravnest_swarm.dashboard.peers_table; print(' '.join(sys.modules))")
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    network = [name for name in imported if name.startswith(("hivemind.", "ravnest_swarm.net"))
               or name in ("ravnest_swarm.membership.reader", "ravnest_swarm.membership.records")]
    assert network == []


# --- a large run: 1,000 peers in 250 clusters of 4 stages, made in the test -----------------------------------------

def large_run(clusters=250, stages=4):
    """Every peer training at its slot (cluster c's stages run at 10 + c % 7 samples/s, its last stage reports a
    loss), except that cluster 200's stage 1 is leaving; and the summary its buckets add up to (16 buckets)."""
    peers = [peer(f"v{c}-{s}", "leaving" if (c, s) == (200, 1) else "training", c, s, samples_per_s=10.0 + c % 7,
                  step=100, loss=2.0 if s == stages - 1 else None) for c in range(clusters) for s in range(stages)]
    live = [p for p in peers if p["state"] != "leaving"]
    summary = dict(buckets=16, buckets_summarized=16, peers=len(live), states={"training": len(live)},
                   clusters=clusters, peers_by_cluster={str(c): stages for c in range(clusters)},
                   samples_per_s=run_samples_per_s(live), time=1.0)
    return peers, summary


def rendered(state, width, height, me=None):
    """The dashboard as text at ``width`` x ``height``, and the CPU seconds its drawing took (a redraw: rich's
    one-time start-up paid before; CPU time, since a machine shared with other tests keeps a process waiting)."""
    render_text(SwarmState("warm-up"), width)
    console = Console(width=width, height=height, file=io.StringIO(), record=True, color_system=None)
    started = time.process_time()
    console.print(render(state, width, height, me))
    return console.export_text(), time.process_time() - started


@pytest.mark.parametrize("width,height", [(80, 24), (120, 40)])
def test_a_thousand_peers_fit_the_screen_with_the_viewers_cluster(width, height):
    """1,000 peers in 250 clusters: the dashboard fits the terminal (one row of clusters, one line for the rest),
    shows the viewer's cluster, its ring neighbours and the failing one, adds up the whole run (from its summary: a
    run of 16 buckets is read in part), and draws fast. Without a summary, its figures are its own."""
    peers, summary = large_run()
    state = SwarmState("big")
    state.update(peers, at=1.0, summary=summary)
    text, seconds = rendered(state, width, height, me="v100-2")
    lines = lines_of(text)
    assert len(lines) <= height - 1 and max(len(line) for line in lines) <= width
    assert seconds < 0.5, seconds
    assert "peers 999 (999 train)" in text and "clusters 250" in text and "avg rounds 0 done" in text
    assert f"{summary['samples_per_s']:.0f} samples/s" in text
    for cluster in (99, 100, 101, 200):  # the viewer's, its ring neighbours, the failing one
        assert f"cluster {cluster} " in text, cluster
    assert "v100-2" in text and "v200-1" in text
    shown = len(re.findall(r"cluster \d+ ", text))
    assert f"swarm map: {shown} of 250 clusters" in text and f"{250 - shown} more clusters" in text
    assert re.search(r"more clusters, failing and slowest first: c\d+ 10/s, c\d+ 10/s", text)  # the slowest left out
    assert len(re.findall(r"\bv\d+-\d+\b", text)) <= 6 * 4 + 2
    own = SwarmState("big")
    own.update(peers, at=1.0)
    text, _ = rendered(own, width, height, me="v100-2")
    last_stages = sum(10.0 + c % 7 for c in range(250))  # each cluster's last stage: the dashboard's own figure
    assert "peers 999 (999 train)" in text and f"{last_stages:.0f} samples/s" in text and "cluster 100 " in text
    # the summary counts each cluster once too (its first stage), not once per stage
    assert summary["samples_per_s"] == last_stages


def test_a_snapshot_holding_part_of_a_large_run_shows_the_summarys_figures():
    """A large run's dashboard reads some buckets: the totals are the summary's (peers by state, clusters, samples/s
    of each cluster's first stage), with how many records were read; an observer (no viewer) gets the failing and
    slowest clusters among those read; the peers that came into view are one event, not one each."""
    peers, summary = large_run()
    summary = dict(summary, states={"training": 900, "standby": 60, "joining": 39})
    state = SwarmState("big")
    state.feed(dict(run="big", at=1.0, peers=peers[:100], plan=None, summary=summary))
    events = state.feed(dict(run="big", at=2.0, peers=peers[:300], plan=None, summary=None))
    assert [e.text for e in events] == ["200 peers joined or came into view"]
    assert state.summary == summary and sees_part(state)  # a read that found no summary keeps the last one
    text, _ = rendered(state, 80, 24)
    assert "peers 999 (900 train, 60 spare, 39 join)" in text and "clusters 250" in text
    assert f"{summary['samples_per_s']:.0f} samples/s" in text and "300 records read" in text
    assert "cluster 0 " in text and "more clusters" in text
    assert len(lines_of(text)) <= 23
    restored = SwarmState.from_json(json.loads(json.dumps(state.to_json())))
    assert restored.summary == summary and render_text(restored, 80) == render_text(state, 80)


def test_status_shows_the_summary_and_a_screenful_of_the_peers_that_matter():
    """``status`` on a large run: a line adding up the run (its summary), then at most a screenful of rows, the
    peers with a note, refusals, failed averaging rounds or no slot first; ``--all`` a row for every peer; and
    ``--json`` the summary beside every record."""
    peers, summary = large_run()
    peers[5] = dict(peers[5], note="averaging step 40: ring 0 timeout", averaging_failures=1)
    peers[6] = dict(peers[6], rejected=3)
    peers[7] = dict(peers[7], state="standby", cluster=-1, stage=-1)
    line, table = status_view("big", summary, peers)
    console = Console(width=80, file=io.StringIO(), record=True, color_system=None)
    console.print(line)
    console.print(table)
    text = console.export_text()
    assert f"999 peer(s) (999 training) │ 250 cluster(s) │ {summary['samples_per_s']:.1f} samples/s" in text
    assert f"showing {SCREENFUL_ROWS} of 1000 peers read, those that matter first" in text
    assert f"run big: {SCREENFUL_ROWS} of 1000 peer(s)" in text
    rows = [row.strip() for row in lines_of(text) if re.match(r"\s*v\d+-\d+ ", row)]
    assert len(rows) == SCREENFUL_ROWS
    assert [row.split()[0] for row in rows[:3]] == [peers[5]["name"], peers[6]["name"], peers[7]["name"]]
    assert "v200-1" in text  # leaving: not placed any more
    assert max(len(row) for row in lines_of(text)) <= 80
    assert status_view("big", summary, peers, show_all=True)[1].row_count == 1000
    small_line, small_table = status_view("small", None, peers[:4])
    assert small_table.row_count == 4 and "showing" not in small_line.plain
    assert small_line.plain == "4 peer(s) (4 training) │ 1 cluster(s) │ 10.0 samples/s"  # one pipeline of 4 stages
    document = json.loads(json.dumps(status_document("big", 300, False, summary, peers)))
    assert document["summary"] == summary and len(document["peers"]) == 1000 and document["steps"] == 300


def test_a_large_runs_dashboard_reads_its_viewers_buckets_and_a_few_in_turn():
    """A small run's dashboard reads every bucket; a large one's, the viewer's own, its neighbours' (its cluster's
    stages and the same stage in the clusters beside it, by the plan) and a few more in turn, so that every
    bucket is read within a few dozen redraws."""
    plan = dict(round=1, time=0.0, clusters=[[dict(peer_id=f"id-{c}-{s}", layers=[s, s + 1]) for s in range(3)]
                                             for c in range(10)])
    assert neighbour_ids(plan, "id-4-1") == {"id-4-0", "id-4-1", "id-4-2", "id-3-1", "id-5-1"}
    assert neighbour_ids(plan, "id-0-2") == {"id-0-0", "id-0-1", "id-0-2", "id-9-2", "id-1-2"}
    assert neighbour_ids(plan, "stranger") == set() and neighbour_ids(None, "id-4-1") == set()
    reader = SnapshotReader(node=None, run="big", viewer="id-4-1")
    assert reader.buckets_to_read(FULL_READ_BUCKETS) == list(range(FULL_READ_BUCKETS))
    reader.plan = plan
    own = {bucket_of(peer_id, 256) for peer_id in neighbour_ids(plan, "id-4-1")}
    met = set()
    for _ in range(256 // ROTATING_BUCKETS):
        read = reader.buckets_to_read(256)
        assert own <= set(read) and len(read) <= len(own) + ROTATING_BUCKETS
        met.update(read)
    assert met == set(range(256))


LARGE_RUN, LARGE_PEERS, LARGE_BUCKETS = "large", 320, 16  # 20 a bucket: a large run's layout, cheap to write


def status_of_large_run(backbone, *flags):
    return ravnest("status", "--initial-peers", backbone, "--run", LARGE_RUN, *flags, env={"COLUMNS": "80"})


@pytest.mark.timeout(400)
def test_status_and_the_dashboard_read_a_large_runs_buckets_from_the_network(processes, backbone):
    """A run laid out in 16 buckets on a real backbone: ``status --json`` has the totals and every record;
    ``status`` draws the totals' line and a screenful; a viewer's dashboard reads its own bucket and 8 more in
    turn, not all 16, counts the summaries of the buckets whose writers it has read, meets the rest at the next
    period, and draws the summaries' figures."""
    asyncio.run(write_run_records(backbone, LARGE_RUN, LARGE_PEERS, LARGE_BUCKETS))
    started = time.monotonic()
    result = status_of_large_run(backbone, "--json")
    print(f"status --json of {LARGE_PEERS} records in {LARGE_BUCKETS} buckets: {time.monotonic() - started:.1f} s, "
          f"the process's start included")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["summary"]["peers"] == LARGE_PEERS and document["summary"]["buckets"] == LARGE_BUCKETS
    assert document["summary"]["states"] == {"training": LARGE_PEERS}
    assert document["summary"]["clusters"] == LARGE_PEERS // 4
    assert len(document["peers"]) == LARGE_PEERS
    table = status_of_large_run(backbone)
    assert table.returncode == 0, table.stderr
    assert f"{LARGE_PEERS} peer(s) ({LARGE_PEERS} training) │ {LARGE_PEERS // 4} cluster(s)" in table.stdout
    assert f"showing {SCREENFUL_ROWS} of {LARGE_PEERS} peers read" in table.stdout

    async def dashboard_reads():
        node = await start_node(parse_maddrs([backbone]), record_validators=make_validators(LARGE_RUN),
                                client_mode=True)
        try:
            reader = SnapshotReader(node, LARGE_RUN, viewer=viewer)
            return [await reader.snapshot() for _ in range(2)]
        finally:
            await stop_node(node)

    viewer = peer_id_of(50, 2)
    first, second = asyncio.run(dashboard_reads())
    own = bucket_of(viewer, LARGE_BUCKETS)
    read = {bucket_of(p["peer_id"], LARGE_BUCKETS) for p in first["peers"]}
    assert read == set(range(ROTATING_BUCKETS)) | {own}
    # a summary counts once its writer's record was read in the bucket it summarizes: the buckets read, at first
    assert first["summary"]["peers"] == len(first["peers"]) < LARGE_PEERS
    assert len(second["peers"]) == LARGE_PEERS  # the second period's buckets in turn, merged: all 16 met
    assert second["summary"]["peers"] == LARGE_PEERS and second["summary"]["buckets"] == LARGE_BUCKETS
    state = SwarmState(LARGE_RUN)
    state.feed(second)
    text = render_text(state, 80, me="w50-2")
    assert f"peers {LARGE_PEERS} ({LARGE_PEERS} train)" in text and "samples/s" in text
    assert "cluster 50 " in text


def test_a_leaving_peer_is_in_no_cluster_in_the_table():
    """A graceful leave's record says cluster -1 and no stage: `status` showed it at "-1/None"."""
    console = Console(width=120, file=io.StringIO(), record=True, color_system=None)
    console.print(peers_table("demo", [peer("left", "leaving", cluster=-1, stage=None),
                                       peer("kept", cluster=0, stage=1)]))
    text = console.export_text()
    assert "-1/None" not in text and re.search(r"left\s+leaving\s.*\s-\s", text) and " 0/1 " in text, text
