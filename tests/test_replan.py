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


ADOPTED = re.compile(r"^adopted plan round (\d+) fitness \S+ hash \S+ clusters (\d+) members (\S+)$", re.M)


@pytest.mark.timeout(300)
def test_a_churn_event_a_kill_then_a_joiner_adopts_one_plan_that_moves_only_the_joiner(swarm):
    """Issue 33's soak adopted two plans per churn event: one without the killed peer (its cluster dropped), one
    with the joiner that came right after (a cluster again), and the first cost the survivors a pause. Two real
    clusters of one stage; p1 is SIGKILLed (its whole session) and, once p0 has seen p1 gone, a new peer joins, as
    the soak's churn does. The survivor trains on while the plan waits for the joiner; one round puts the joiner in
    p1's place, moving only the joiner, and it then averages with p0."""
    extra = ("--min-peers", "2", "--max-stages", "1")
    volunteers = {name: swarm(name, ram_fraction=1.5, steps=100_000, extra=extra) for name in ("p0", "p1")}
    before = swarm.watcher.wait_for(lambda peers: len({p["cluster"] for p in placed(peers).values()}) == 2 and
                                    all((p.get("averaging_rounds") or 0) >= 2 for p in placed(peers).values()),
                                    150, "two clusters of one stage that averaged")
    killed_at = len(volunteers["p0"].stderr())
    volunteers["p1"].kill_group()
    # the joiner comes once p0 has seen p1 gone (a joiner seen before that opens the round itself, as p1's record
    # expires within its deadline): no round is opened without p1 meanwhile
    volunteers["p0"].wait_for_output(r"^planned peer\(s\) p1 gone: the other clusters train on; waiting up to 30s "
                                     r"for a joiner", 60, stream="stderr")
    volunteers["p2"] = swarm("p2", ram_fraction=1.5, steps=100_000, extra=extra)  # well within the 30 s wait
    waiting = swarm.watcher.wait_for(lambda peers: "p0" in peers, 10, "p0's record")["p0"]["step"]
    swarm.watcher.wait_for(lambda peers: peers["p0"]["step"] > waiting + 20, 20, "p0 training on meanwhile")
    peers = swarm.watcher.wait_for(lambda peers: "p1" not in peers and
                                   peers.get("p2", {}).get("cluster") == before["p1"]["cluster"] and
                                   (peers["p2"].get("averaging_rounds") or 0) >= 3, 150,
                                   "p2 in p1's place, averaging with p0")
    time.sleep(10)  # a second round would open within seconds of the first: none does
    after = volunteers["p0"].stderr()[killed_at:]
    adopted = ADOPTED.findall(after)
    assert len(adopted) == 1, after
    assert adopted[0][1:] == ("2", "p0,p2"), adopted
    assert re.search(rf"^round {adopted[0][0]} moves 1 peer\(s\)", after, re.M), after
    # p0 kept its place, and trained on while the plan waited for the joiner
    assert re.search(rf"^p0: plan round {adopted[0][0]} keeps us in place", after, re.M), after
    assert peers["p0"]["cluster"] == before["p0"]["cluster"], peers["p0"]
    assert peers["p0"]["state"] in ("training", "averaging"), peers["p0"]
    for name in ("p0", "p2"):
        assert not re.search(r"unexpected|Traceback", volunteers[name].stderr()), volunteers[name].stderr()[-3000:]
