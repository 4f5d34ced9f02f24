"""``bench soak`` end to end in a short configuration: real join processes in the network lab, one Ctrl-C and one
SIGKILL, each followed by a new volunteer; the report says what happened and that no peer hit an unexpected error."""

import json
import subprocess

import pytest

from process_tree import exits_leaving_nothing
from ravnest_swarm.bench.netlab import LAB_PREFIX
from ravnest_swarm.bench.soak import LogScan, placed_now


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


@pytest.mark.timeout(240)
@pytest.mark.netns
def test_bench_soak_survives_a_ctrl_c_and_a_sigkill_and_leaves_nothing_running(processes, tmp_path):
    out = tmp_path / "soak"
    bench = processes.start(["bench", "soak", "--peers", "4", "--minutes", "1.25", "--churn-every", "25",
                             "--out", str(out)], "bench")
    exits_leaving_nothing(bench, 225)  # the peers, their p2pd, the status looks, the backbone, the relays
    report = json.loads(bench.stdout().strip().splitlines()[-1])
    assert report["benchmark"] == "soak" and report["peers"] == 4 and report["minutes_run"] == 1.25
    assert report["link"]["mode"] == "netns" and report["out"] == str(out)
    # one churn event of each kind, at the schedule's times; each victim exited and a new volunteer took its host
    events = report["churn_events"]
    assert [event["kind"] for event in events] == ["ctrl-c", "sigkill"], events
    ctrl_c, sigkill = events
    assert ctrl_c["exit_code"] == 0 and not ctrl_c.get("timed_out"), ctrl_c  # it handed over and left by itself
    assert sigkill["exit_code"] == -9 and sigkill["time_s"] - ctrl_c["time_s"] >= 24, events
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
    assert all((out / f"{name}.err").exists() for name in volunteers)
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{LAB_PREFIX}{bench.pid}-" not in namespaces
