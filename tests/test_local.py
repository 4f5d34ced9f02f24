"""``ravnest-swarm local``: the README's first command, seen in a real terminal and by its JSON summary."""

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from process_tree import alive, descendants, kill_pids
from waiting import output_of, wait_until
from commands import ravnest

needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)")


def planning_lines(log_root):
    lines = []
    for path in sorted(log_root.glob("ravnest-*/peer*.err")):
        lines += [f"{path.stem}: {line}" for line in path.read_text(errors="replace").splitlines()
                  if "round" in line or "adopted" in line]
    return "\n".join(lines)


@needs_tmux
@pytest.mark.timeout(300)
def test_dashboard_of_a_real_local_run_in_a_terminal(tmp_path):
    session = f"ravnest-test-{os.getpid()}"
    # the peers' logs land under tmp_path, so a failure can say what the planning rounds did
    command = (f"TMPDIR={tmp_path} {sys.executable} -m ravnest_swarm local --peers 5 --steps 300 "
               f"--averaging-period 20 --time-limit 200")
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "80", "-y", "60", command], check=True)
    pane_pid = int(subprocess.check_output(["tmux", "list-panes", "-t", session, "-F", "#{pane_pid}"], text=True))
    started = set()
    screen = ""
    try:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline:
            started |= descendants(pane_pid)
            capture = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True)
            if capture.returncode != 0:
                raise AssertionError(f"local exited before its dashboard showed the swarm; last screen:\n{screen}"
                                     f"\nthe peers' planning lines:\n{planning_lines(tmp_path)}")
            screen = capture.stdout
            # both clusters on one screen: a screen caught while a re-plan leaves one cluster is looked at again
            if "swarm map" in screen and all(f"cluster {c}" in screen for c in (0, 1)) and \
                    all(f"peer{i}" in screen for i in range(5)):
                break
            time.sleep(2)
        else:
            raise AssertionError(f"the dashboard never showed both clusters and every peer:\n{screen}"
                                 f"\nthe peers' planning lines:\n{planning_lines(tmp_path)}")
        assert all(len(line) <= 80 for line in screen.splitlines())
        assert "cluster 0" in screen
        subprocess.run(["tmux", "send-keys", "-t", session, "C-c"], check=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(psutil.pid_exists(pid) for pid in descendants(pane_pid)):
            time.sleep(1)
        assert not descendants(pane_pid) - {pid for pid in started if not psutil.pid_exists(pid)}
    finally:
        kill_pids(started | descendants(pane_pid))
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


@pytest.mark.timeout(420)
def test_local_swarm_forms_clusters_averages_and_halves_the_loss(tmp_path):
    result = ravnest("local", "--peers", "6", "--steps", "300", "--json", "--no-dashboard", "--time-limit", "360",
                     timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["clusters"] >= 2, summary
    assert summary["averaging_rounds"] >= 2, summary
    assert summary["loss_end"] <= summary["loss_start"] / 2, summary
    assert summary["metric_name"] == "heldout_accuracy" and summary["metric"] > 0.8, summary
    assert summary["max_peer_memory_fraction"] is not None


@pytest.mark.timeout(420)
def test_local_swarm_with_int8_pseudo_gradients_averages_and_halves_the_loss(tmp_path):
    """`--averaging-compression int8` (issue 30): the spec reaches every peer's averager, the rings average
    pseudo-gradients, training still halves the loss, and each peer's record counts the bytes it sent."""
    result = ravnest("local", "--peers", "6", "--steps", "300", "--json", "--no-dashboard", "--time-limit", "360",
                     "--averaging-compression", "int8", timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["clusters"] >= 2 and summary["averaging_rounds"] >= 2, summary
    assert summary["loss_end"] <= summary["loss_start"] / 2, summary
    assert summary["metric_name"] == "heldout_accuracy" and summary["metric"] > 0.8, summary
    averaging = [record for record in summary["peer_records"].values() if record.get("averaging_rounds")]
    assert averaging and all((record.get("averaging_bytes_sent") or 0) > 0 for record in averaging), averaging


def averaging_in_logs(log_dir, name):
    """What a peer's own log says of its averaging rounds: (rounds every ring of it averaged, rounds that failed)."""
    log = (log_dir / f"{name}.err").read_text(errors="replace")
    averaged = sum(done == total for done, total in re.findall(r"averaging step \d+: (\d+)/(\d+) segments averaged", log))
    failed = len(re.findall(rf"^{name}: averaging at step \d+ failed", log, re.MULTILINE))
    return averaged, failed


@pytest.mark.timeout(300)
def test_local_beside_a_cpu_hog_averages_and_reports_only_what_happened(processes, tmp_path):
    """Must-show of issue 16: `local` beside two processes that keep both cores busy. At least 90 % of the
    averaging rounds succeed; the run's events show no peer vanishing (none left) and no poisoned input (every
    peer is honest); and the summary's counts are the peers' records', which say what each peer's own log says."""
    for index in range(2):
        processes.start_python("while True: pass", [], f"hog{index}")
    local = processes.start(["local", "--peers", "5", "--steps", "300", "--averaging-period", "20", "--json",
                             "--no-dashboard", "--time-limit", "200"], "local", env={"TMPDIR": str(tmp_path)})
    started = set()
    try:
        deadline = time.monotonic() + 260
        while local.popen.poll() is None and time.monotonic() < deadline:
            started |= descendants(local.pid)  # its peers run in sessions of their own: stopped by pid below
            time.sleep(1)
        assert local.wait(30) == 0, local.stderr()[-3000:]
    finally:
        kill_pids(alive(started))
    summary = json.loads(local.stdout().strip().splitlines()[-1])
    assert summary["finished"] and summary["clusters"] >= 2, summary
    log_dir = pathlib.Path(summary["log_dir"])
    records = summary["peer_records"]
    averaged = failed = 0
    for name, record in records.items():
        in_log = averaging_in_logs(log_dir, name)
        assert (record["averaging_rounds"] or 0, record["averaging_failures"] or 0) == in_log, (name, record, in_log)
        averaged, failed = averaged + in_log[0], failed + in_log[1]
    print(f"averaging rounds beside the hog: {averaged} averaged, {failed} failed (per peer, summed)")
    assert averaged >= 2 * len(records) and averaged >= 0.9 * (averaged + failed), (averaged, failed)
    assert summary["averaging_rounds"] == max(r["averaging_rounds"] or 0 for r in records.values())
    assert summary["averaging_failed"] == max(r["averaging_failures"] or 0 for r in records.values())
    # with 2 in flight, 5 peers form two 2-stage clusters and a standby, whose record counts nothing (None)
    assert summary["rejected"] == 0 and all(r["rejected"] == 0 or (r["cluster"] == -1 and r["rejected"] is None)
                                            for r in records.values()), records
    events = [f"{event['kind']}: {event['text']}" for event in summary["events"]]
    # the standby (the run's owner) leaves once every stage is done, and may be seen to before `local` stops
    assert not [e for e in events if e.startswith(("left", "rejected")) and not e.endswith("(the run is finished)")], \
        events
    assert len([e for e in events if e.startswith("joined")]) == 5, events
    sentences = local.stderr().strip().splitlines()[-6:]
    assert sentences[0].startswith("Trained mlp-digits with 5 peers in") and "Nothing else failed." in sentences
    # the peak memory it reports is the peers' own, as the dashboard shows it (no peer left, so all are in records)
    peak_mb = round(max(r["peak_memory_gb"] for r in records.values()) * 1000, 1)
    assert summary["peak_peer_memory_mb"] == peak_mb and f"peak peer memory {peak_mb:.0f} MB." in "\n".join(sentences)


@pytest.mark.timeout(180)
def test_a_stopped_quality_bench_reports_nothing_and_leaves_nothing_running(processes):
    """SIGTERM while the swarm trains: the swarm stops, and the bench says in one line that a stopped swarm
    does not compare with its baseline instead of printing figures from a cut-short run."""
    bench = processes.start(["bench", "quality", "--peers", "2", "--steps", "5000", "--json"], "quality")
    started = set()
    try:
        bench.wait_for_output("training the swarm", 60, stream="stderr")
        deadline = time.monotonic() + 90
        while len(started) < 4:  # two volunteers and their p2pd, at least
            assert time.monotonic() < deadline and bench.popen.poll() is None, bench.stderr()[-2000:]
            time.sleep(0.5)
            started = descendants(bench.pid)
        wait_until(lambda: any(re.search(r"^peer\d+: training cluster", output_of(pid, 2), re.MULTILINE)
                               for pid in descendants(bench.pid)), 120, "a volunteer of the bench's swarm training")
        started |= descendants(bench.pid)
        bench.signal(signal.SIGTERM)
        assert bench.wait(90) == 1, bench.stderr()[-2000:]
        assert "error: the swarm stopped before its 5000 steps" in bench.stderr() and bench.stdout() == ""
        assert alive(started) == set()
    finally:
        kill_pids(alive(started))


@pytest.mark.timeout(200)
def test_a_local_run_no_plan_can_place_says_why_and_exits_non_zero(tmp_path):
    """Peers whose RAM holds no cluster (here capped by --max-ram-gb; a one-layer model once, whose layer no offer
    held) trained nothing, yet the summary said "one cluster held the whole model", "nothing else failed", and the
    exit was 0. Now it names what the planners found, and exits 1."""
    result = ravnest("local", "--peers", "2", "--steps", "100", "--no-dashboard", "--time-limit", "20",
                     "--max-ram-gb", "0.00001", timeout=150)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "No plan placed any peer, as no cluster is feasible: the 2 computing peer(s) with the most RAM offer" \
        in result.stderr, result.stderr[-3000:]
    assert "one cluster held the whole model" not in result.stderr
