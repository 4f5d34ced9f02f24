"""``bench soak`` end to end in a short configuration: real join processes in the network lab, one Ctrl-C and one
SIGKILL, each followed by a new volunteer; the report says what happened and that no peer hit an unexpected error."""

import json
import subprocess

import pytest

from process_tree import exits_leaving_nothing
from ravnest_swarm.bench.netlab import LAB_PREFIX
from ravnest_swarm.bench.soak import (LogScan, Soak, held_elsewhere, last_averaged_step, placed_now, round_figures,
                                      stage_use, steps_lost, unaveraged_steps, use_lines)
from ravnest_swarm.checkpoint import read_stage


def test_the_log_scan_keeps_unexpected_lines_and_one_entry_per_traceback(tmp_path):
    log = tmp_path / "peer0.err"
    log.write_text("peer0: training cluster 0 stage 1/2 layers 4:9 from step 0 on cpu\n"
                   "error: unexpected KeyError: 'x' (set RAVNEST_DEBUG=1 for the traceback)\n"
                   "Traceback (most recent call last):\n  File \"a.py\", line 1, in <module>\n    f()\n"
                   "ValueError: boom\npeer0: standby in plan round 2: the swarm is fastest\nTraceback (most")
    scan = LogScan()
    scan.scan("peer0", str(log), after_stop=False)  # the last line is still being written: not read yet
    assert [found["line"] for found in scan.found] == ["error: unexpected KeyError: 'x' (set RAVNEST_DEBUG=1 for the "
                                                       "traceback)", "Traceback: ValueError: boom"]
    scan.scan("peer0", str(log), after_stop=True, to_end=True)
    assert scan.found[-1] == {"peer": "peer0", "line": "Traceback (most", "after_stop": True}
    assert not placed_now(log.read_text(), "peer0")  # its last placement line says standby
    assert placed_now("peer1: standby in plan round 1: x\npeer1: training cluster 1 stage 0/2 layers 0:4 from step 5",
                      "peer1")


def test_the_report_adds_up_the_stages_time_by_seconds_and_counts_rounds_and_moves_from_the_logs():
    logs = {"peer0": "round 1 opened (first plan): 4 peers, deadline in 5.0s\nadopted plan round 1 fitness 1 hash x\n"
                     "peer0: training cluster 0 stage 0/2 layers 0:4 from step 0 on cpu\n"
                     "round 2 opened (a planned peer gone): 3 peers\nadopted plan round 2 fitness 1 hash y\n"
                     "peer0: training cluster 1 stage 0/2 layers 0:4 from step 9 on cpu\n",
            "peer1": "round 1 opened (first plan): 4 peers\nadopted plan round 1 fitness 1 hash x\n"
                     "peer1: training cluster 0 stage 1/2 layers 4:9 from step 0 on cpu\nround 3 opened (late): 4\n"}
    rounds = round_figures(logs)
    assert rounds == dict(rounds_opened=3, rounds_adopted=2, moves=1, moves_per_adopted_round=1.0)
    shares = dict(computing=0.5, sending=0.3, download=0.1, plan=0.0, averaging=0.05, neighbour=0.05, other=0.0)
    volunteers = [dict(time_shares=shares, window_s=100.0, moved_bytes=2_000_000),
                  dict(time_shares=dict(shares, computing=0.9, sending=0.1, download=0.0, averaging=0.0, neighbour=0.0),
                       window_s=300.0, moved_bytes=None),
                  dict(time_shares=None, window_s=None, moved_bytes=None)]  # never placed: counts no time
    use = stage_use(volunteers)
    assert use["stage_seconds"] == 400.0 and use["moved_bytes"] == 2_000_000
    assert use["time_shares"]["computing"] == 0.8 and use["time_shares"]["download"] == 0.025
    assert use["utilisation"] == round(0.95 / 0.975, 4)  # computing and sending outside downloads
    lines = use_lines(dict(use=use, rounds=rounds)).splitlines()
    assert lines[0].startswith("placed stages (6.7 stage-minutes): computing 80.0%, sending 15.0%, so 97.4% busy")
    assert "2.0 MB of layers downloaded for moves" in lines[0]
    assert lines[1] == ("planning rounds: 3 opened, 2 adopted; 1 move(s) of placed volunteers, 1.0 per adopted round "
                        "after the first")
    assert stage_use(volunteers[2:]) is None

    kills = [dict(kind="ctrl-c"), dict(kind="sigkill", unaveraged_steps=7, layers_held_elsewhere=True),
             dict(kind="sigkill", unaveraged_steps=None, layers_held_elsewhere=None)]
    assert use_lines(dict(use=use, rounds=rounds, churn_events=kills)).splitlines()[2] == (
        "SIGKILLs: 2; the killed stage's steps since its last averaged round (lost with it): 7, ?; its layers trained "
        "by another cluster then: yes, ?")
    leaves = [dict(kind="ctrl-c", handed_over=True, last_round_averaged=True, last_round_step=80, unaveraged_steps=0),
              dict(kind="ctrl-c", handed_over=False, last_round_averaged=False, unaveraged_steps=12)]
    for event in leaves:
        event["steps_lost"] = steps_lost(event)
    assert use_lines(dict(use=use, rounds=rounds, churn_events=leaves)).splitlines()[2] == (
        "Ctrl-Cs: 2; steps lost (0 where it handed over): 0, 12; its last round averaged: yes, no")


def test_what_a_sigkill_lost_comes_from_the_look_before_it_and_the_victims_log():
    log = ("12:00:01 INFO ravnest_swarm.averaging.averager: averaging step 50: 2/2 segments averaged in 0.3s, "
           "1 MB sent\n"
           "12:00:06 WARNING ravnest_swarm.averaging.averager: averaging step 75: 1/2 segments averaged in 20s; kept "
           "local 1:timeout\n"
           "12:00:07 INFO ravnest_swarm.averaging.averager: averaging step 60: 0/0 segments averaged in 0.0s\n")
    assert last_averaged_step(log) == 50 and last_averaged_step("no rounds") is None
    peers = {"peer0": dict(state="training", cluster=0, layers=[0, 4], step=83, round_offset=-20),
             "peer1": dict(state="training", cluster=0, layers=[4, 9]),
             "peer2": dict(state="training", cluster=1, layers=[0, 5]),
             "peer3": dict(state="leaving", cluster=-1, layers=[5, 9])}
    assert held_elsewhere(peers, "peer0") is True
    assert held_elsewhere(peers, "peer1") is False  # layers 5:9 only by a leaving peer
    assert held_elsewhere(peers, "peer9") is None
    loss = Soak._crash_loss("peer0", peers, log)
    assert loss == dict(step_at_kill=83, round_offset=-20, averaged_at_kill=50, layers_held_elsewhere=True)
    # its final step (a checkpoint written after the look: 86) on the run's count is 106: 56 steps since round 50
    assert unaveraged_steps(loss, 86) == 56 and unaveraged_steps(loss, None) is None
    assert unaveraged_steps(dict(loss, round_offset=None), 40) == 0
    # a Ctrl-C: what it had not averaged is lost only where nobody took it (it stays in its checkpoint)
    leave = dict(kind="ctrl-c", round_offset=-20, averaged_at_exit=50, handed_over=False)
    assert unaveraged_steps(leave, 86) == 56 and steps_lost(dict(leave, unaveraged_steps=56)) == 56
    assert steps_lost(dict(leave, handed_over=True, unaveraged_steps=56)) == 0  # a taker downloaded them
    # a leave that took its last round at step 84 and stood still there lost nothing; a step after it, one
    took = dict(leave, handed_over=True, last_round_step=84)
    assert unaveraged_steps(took, 84) == 0 and unaveraged_steps(took, 85) == 1
    assert steps_lost(dict(took, unaveraged_steps=1)) == 1
    assert steps_lost(dict(loss, kind="sigkill", unaveraged_steps=56)) == 56


@pytest.mark.timeout(240)
@pytest.mark.netns
def test_bench_soak_survives_a_ctrl_c_and_a_sigkill_and_leaves_nothing_running(processes, tmp_path):
    out = tmp_path / "soak"
    bench = processes.start(["bench", "soak", "--peers", "4", "--minutes", "1.25", "--churn-every", "25",
                             "--scheme", "diloco", "--out", str(out)], "bench")
    exits_leaving_nothing(bench, 225)  # the peers, their p2pd, the status looks, the backbone, the relays
    report = json.loads(bench.stdout().strip().splitlines()[-1])
    assert report["benchmark"] == "soak" and report["peers"] == 4 and report["minutes_run"] == 1.25
    assert report["link"]["mode"] == "netns" and report["out"] == str(out)
    assert report["scheme"] == "diloco" and report["settings"]["optimizer"] == "adamw", report["settings"]
    # one churn event of each kind, at the schedule's times; each victim exited and a new volunteer took its host
    events = report["churn_events"]
    assert [event["kind"] for event in events] == ["ctrl-c", "sigkill"], events
    ctrl_c, sigkill = events
    assert ctrl_c["exit_code"] == 0 and not ctrl_c.get("timed_out"), ctrl_c  # it handed over and left by itself
    assert isinstance(ctrl_c["handed_over"], bool) and isinstance(ctrl_c["last_round_averaged"], bool), ctrl_c
    assert ctrl_c["steps_lost"] == 0 or not ctrl_c["handed_over"], ctrl_c
    assert "Ctrl-Cs: 1; steps lost" in bench.stdout()
    assert sigkill["exit_code"] == -9 and sigkill["time_s"] - ctrl_c["time_s"] >= 24, events
    # what the kill lost was looked at right before it: the victim was placed then, on layers another cluster trains
    assert sigkill["step_at_kill"] is not None and sigkill["layers_held_elsewhere"] is not None, sigkill
    assert "SIGKILLs: 1; " in bench.stdout()
    joins = {join["peer"]: join for join in report["joins"]}
    assert len(joins) == 6 and [join["replaces"] for join in report["joins"]][:4] == [None] * 4
    volunteers = {peer["name"]: peer for peer in report["volunteers"]}
    assert set(volunteers) == set(joins)
    for event in events:
        assert joins[event["replacement"]]["replaces"] == event["peer"]
        assert volunteers[event["peer"]]["ended_by"] == event["kind"]
    # the swarm trained and averaged across clusters through the churn, and status saw it
    survivors = [peer for peer in volunteers.values() if peer["ended_by"] == "stopped at the end"]
    assert len(survivors) == 4 and all(peer["exit_code"] == 0 for peer in survivors), survivors
    assert max(peer["final_step"] or 0 for peer in survivors) > 0
    assert max(peer["averaging_rounds"] or 0 for peer in volunteers.values()) >= 1
    assert len(report["timeline"]) >= 3 and any(look.get("peers") for look in report["timeline"])
    # survived: no log line said "unexpected" or held a traceback
    assert report["unexpected_errors"] == [] and report["survived"] is True, report["unexpected_errors"]
    # the placed stages said where their time went, and the logs how many rounds opened and were adopted
    assert 0.0 < report["use"]["utilisation"] <= 1.0 and report["use"]["stage_seconds"] > 0, report["use"]
    assert sum(report["use"]["time_shares"].values()) == pytest.approx(1.0, abs=0.01)
    assert report["rounds"]["rounds_adopted"] >= 1 and report["rounds"]["rounds_opened"] >= 1
    assert "placed stages (" in bench.stdout() and "planning rounds: " in bench.stdout()
    assert all((out / f"{name}.err").exists() for name in volunteers)
    # the run trained with the scheme's spec (diloco: AdamW inside, a nesterov outer step): the checkpoints hold
    # AdamW's moments and the nesterov outer state
    saved = [read_stage(str(path))[0] for path in (out / "checkpoints").glob("*/soak-*.safetensors")]
    assert saved and any(any(name.endswith(".exp_avg_sq") for name in tensors) and "outer.momentum" in tensors
                         for tensors in saved), [sorted(tensors)[:6] for tensors in saved]
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{LAB_PREFIX}{bench.pid}-" not in namespaces
