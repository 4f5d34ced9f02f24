"""The arithmetic of ``bench pipeline``'s figures, on traces whose answers are known."""

import os
import re
import signal
import subprocess
import time

import pytest

from process_tree import alive, descendants, kill_pids
from waiting import output_of, wait_until
from ravnest_swarm.bench.netlab import LAB_PREFIX, namespaces_available
from ravnest_swarm.bench.pipeline import busy_fraction, round_trip_breakdown


def two_stage_trace(start: float, microbatch: int):
    """Stage 0: inject, 10 ms forward, 30 ms hop, stage 1: 5 ms queue, 20 ms forward+backward, 40 ms hop back,
    stage 0: 15 ms queue, 12 ms backward: a 132 ms round trip."""
    t = start
    stage0 = [(t, "forward_arrived", microbatch), (t, "forward_started", microbatch),
              (t + 0.010, "forward_done", microbatch)]
    stage1 = [(t + 0.040, "forward_arrived", microbatch), (t + 0.045, "forward_started", microbatch),
              (t + 0.065, "forward_done", microbatch)]
    stage0 += [(t + 0.105, "backward_arrived", microbatch), (t + 0.120, "backward_started", microbatch),
               (t + 0.132, "backward_done", microbatch)]
    return stage0, stage1


def test_round_trip_breakdown_splits_a_known_trace_into_its_parts():
    reports = [{"trace": []}, {"trace": []}]
    for microbatch in range(5):
        stage0, stage1 = two_stage_trace(10.0 + microbatch, microbatch)
        reports[0]["trace"] += stage0
        reports[1]["trace"] += stage1
    # only the microbatches injected inside the window count: 1, 2 and 3
    breakdown = round_trip_breakdown(reports, 11.0, 13.5)
    assert breakdown["microbatches"] == 3
    assert breakdown["round_trip"] == pytest.approx(132.0)
    assert breakdown["forward_queue"] == pytest.approx([0.0, 5.0])
    assert breakdown["forward_compute"] == pytest.approx([10.0, 20.0])
    assert breakdown["forward_hop"] == pytest.approx([30.0])
    assert breakdown["backward_hop"] == pytest.approx([40.0])
    assert breakdown["backward_queue"] == pytest.approx([15.0])
    assert breakdown["backward_compute"] == pytest.approx([12.0])


def test_busy_fraction_counts_only_the_window():
    assert busy_fraction([(0.0, 2.0), (3.0, 4.0), (9.0, 12.0)], 1.0, 11.0) == pytest.approx(0.4)


@pytest.mark.timeout(180)
def test_a_stopped_bench_stops_every_process_it_started_and_removes_its_lab(processes):
    """SIGTERM (or Ctrl-C) while the stages run: the bench stops its stages, their p2pd, the backbone and
    the delay relay, removes its namespaces, and exits 130. Before, SIGTERM orphaned all of them and
    Ctrl-C waited for the whole run to end."""
    bench = processes.start(["bench", "pipeline", "--json", "--microbatches", "400", "--transfer-mb", "1"], "bench")
    started = set()
    try:
        deadline = time.monotonic() + 120
        while not any(_is_stage(pid) for pid in started):
            assert time.monotonic() < deadline and bench.popen.poll() is None, bench.stderr()[-2000:]
            time.sleep(0.5)
            started = descendants(bench.pid)
        wait_until(lambda: any(_is_stage(pid) and "progress " in output_of(pid, 1) for pid in descendants(bench.pid)),
                   120, "the first stage reporting trained microbatches")
        started |= descendants(bench.pid)
        bench.signal(signal.SIGTERM)
        assert bench.wait(60) == 130, bench.stderr()[-2000:]
        assert alive(started) == set()
        if namespaces_available():
            namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            assert f"{LAB_PREFIX}{bench.pid}-" not in namespaces
    finally:
        kill_pids(alive(started))


def _is_stage(pid: int) -> bool:
    """A stage process: the bench names its log ``<schedule>-stage<i>.out`` (its command line is the launcher's
    where it is forked, ravnest_swarm/launcher.py)."""
    try:
        return re.search(r"-stage\d+\.out$", os.readlink(f"/proc/{pid}/fd/1")) is not None
    except OSError:
        return False
