"""Rounds the run counts (issue 30's item 0): a cluster ahead of the others is not held at a barrier.

Before, rounds were named by each cluster's own step, so a faster cluster waited at every averaging boundary
until the slower one reached the same step (a walkthrough saw a one-stage cluster stand still 49 % of its time
beside a two-stage one). Now rounds are named on the run's count: the faster cluster trains on while a round
waits for the slower one, and meets it at the next round's name whatever its own step.
"""

import os
import signal
import threading
import time

import pytest

from test_swarm import placed, swarm  # noqa: F401 (a fixture)

WINDOW_S = 40


def slow_down(pid: int, stop: threading.Event, stopped_s: float = 0.15, running_s: float = 0.1) -> None:
    """Make ``pid`` a slower machine: stopped ``stopped_s`` of every ``stopped_s + running_s`` seconds, until
    ``stop``; it is running again when this returns."""
    try:
        while not stop.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stopped_s)
            os.kill(pid, signal.SIGCONT)
            time.sleep(running_s)
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.mark.timeout(300)
def test_a_cluster_ahead_trains_on_and_still_meets_the_slower_one_at_each_round(swarm):
    # each can hold the whole model: two clusters of one stage, averaging every 20 steps beside training
    fast = swarm("fast", ram_fraction=1.5, steps=1_000_000, extra=("--min-peers", "2"))
    slow = swarm("slow", ram_fraction=1.5, steps=1_000_000, extra=("--min-peers", "2"))
    swarm.watcher.wait_for(lambda peers: len(placed(peers)) == 2 and
                           all((p.get("averaging_rounds") or 0) >= 2 for p in placed(peers).values()),
                           150, "two clusters that averaged twice")
    stop = threading.Event()
    slowing = threading.Thread(target=slow_down, args=(slow.pid, stop), daemon=True)
    before = swarm.watcher.peers()
    slowing.start()
    try:
        time.sleep(WINDOW_S)
        after = swarm.watcher.peers()
    finally:
        stop.set()
        slowing.join(5)

    def gained(name, field):
        return (after[name].get(field) or 0) - (before[name].get(field) or 0)

    fast_steps, slow_steps = gained("fast", "step"), gained("slow", "step")
    print(f"in {WINDOW_S}s: fast {fast_steps} steps, {gained('fast', 'averaging_rounds')} rounds, "
          f"{gained('fast', 'averaging_failures')} failed; slow {slow_steps} steps, "
          f"{gained('slow', 'averaging_rounds')} rounds")
    # held at each boundary, the fast cluster would have trained about as many steps as the slow one
    assert fast_steps >= 1.5 * slow_steps > 0, (before, after)
    rounds, failures = gained("fast", "averaging_rounds"), gained("fast", "averaging_failures")
    assert rounds >= 3 and failures <= 0.1 * (rounds + failures), (before["fast"], after["fast"])
    assert gained("slow", "averaging_rounds") >= 3, (before["slow"], after["slow"])
    # the fast cluster ran ahead of the rounds it took part in, further than the slow one did
    assert after["fast"]["round_offset"] - after["slow"]["round_offset"] >= 40, (after["fast"], after["slow"])
    for process in (fast, slow):
        assert "Traceback" not in process.stderr() and "unexpected" not in process.stderr()
