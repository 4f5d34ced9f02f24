"""A re-plan to fewer clusters leaves every peer running (issue 29).

In the lab run of issue 29 peers whose records had expired while they still ran (their renewals failed) came back
to a plan of fewer clusters and exited on ``IndexError``: they read the newly adopted plan with the placement of
the old one. Here real peers are frozen (SIGSTOP of their whole session, p2pd included: a laptop that sleeps, a
machine that swaps) in the middle of training and averaging, long enough for their records to expire and for the
one left to adopt a plan of one cluster; then they wake up into it.
"""

import re
import signal
import time

import pytest

from process_tree import signal_session
from test_swarm import placed, swarm  # noqa: F401 (a fixture)

ADOPTED_ONE = r"adopted plan round (\d+) fitness \S+ hash \S+ clusters 1 "


@pytest.mark.timeout(300)
@pytest.mark.parametrize("clusters", [4, 3])
def test_a_replan_to_one_cluster_while_rounds_are_in_flight_leaves_every_peer_running(swarm, clusters):
    names = [f"p{i}" for i in range(clusters)]
    # each can hold the whole model: a cluster of one stage each, averaging every 20 steps
    volunteers = {name: swarm(name, ram_fraction=1.5, steps=100_000, extra=("--min-peers", str(clusters)))
                  for name in names}
    swarm.watcher.wait_for(lambda peers: len(placed(peers)) == clusters and
                           len({p["cluster"] for p in placed(peers).values()}) == clusters and
                           all((p.get("averaging_rounds") or 0) >= 1 for p in placed(peers).values()),
                           150, f"{clusters} clusters of one stage that averaged")
    survivor, frozen = names[0], names[1:]
    for name in frozen:
        signal_session(volunteers[name], signal.SIGSTOP)
    try:
        # their records expire (3 heartbeats of 2 s), a round adopts a plan of one cluster; frozen longer than the 15 s
        # after which a stalled stage explains its stall: what read the new plan with the old placement
        volunteers[survivor].wait_for_output(ADOPTED_ONE, 60, stream="stderr")
        time.sleep(16)
    finally:
        for name in frozen:
            signal_session(volunteers[name], signal.SIGCONT)
    # they wake up to the plan of one cluster (theirs are gone from it), and a later round places them again
    swarm.watcher.wait_for(lambda peers: len(placed(peers)) == clusters and
                           all(p["state"] in ("training", "averaging") for p in placed(peers).values()),
                           120, "every peer placed and training again")
    time.sleep(5)
    for name, volunteer in volunteers.items():
        assert volunteer.popen.poll() is None, f"{name} exited: {volunteer.stderr()[-3000:]}"
        log = volunteer.stderr()
        assert not re.search(r"unexpected|Traceback", log), f"{name}: {log[-3000:]}"
