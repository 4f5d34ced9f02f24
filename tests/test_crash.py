"""A crash between averaging rounds costs its ring partners no round: real `join` processes, SIGKILL."""

import os
import re
import signal
import time

import pytest

from test_swarm import placed, swarm  # noqa: F401 (the fixture)

FAILED_ROUND = re.compile(r"averaging at step \d+ failed: (.*)$", re.M)


@pytest.mark.timeout(300)
def test_the_partners_of_a_peer_killed_between_rounds_vote_it_out_and_average_without_it(swarm):
    """Three clusters of one stage, rounds 400 steps apart (a few seconds), and a SIGKILL of one peer right after its
    round. Its record says it trains on until it expires, so the next round's rings wait for it; once each partner's
    planning finds it gone, the rings vote it out at their next look and the two average without it. Before, each
    partner gave that round up as planning found it gone: one failed round at every partner of each crash."""
    extra = ("--min-peers", "3", "--max-stages", "1", "--checkpoint-every", "100000", "--averaging-period", "400")
    volunteers = {f"p{i}": swarm(f"p{i}", ram_fraction=1.2, steps=100_000, extra=extra) for i in range(3)}
    swarm.watcher.wait_for(lambda peers: len(placed(peers)) == 3 and
                           all((p.get("averaging_rounds") or 0) >= 2 for p in placed(peers).values()),
                           200, "three clusters of one stage that averaged twice")
    victim, stayers = "p1", ("p0", "p2")
    failed_before = {name: len(FAILED_ROUND.findall(volunteers[name].stderr())) for name in stayers}
    rounds = volunteers[victim].stderr().count("segments averaged")
    deadline = time.monotonic() + 60
    while volunteers[victim].stderr().count("segments averaged") == rounds and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(volunteers[victim].pid, signal.SIGKILL)
    averaged_then = {name: volunteers[name].stderr().count("segments averaged") for name in stayers}
    for name in stayers:
        volunteers[name].wait_for_output(r"did not come; voting to average without it", 60, stream="stderr")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(volunteers[name].stderr().count("segments averaged") <
                                              averaged_then[name] + 3 for name in stayers):
        time.sleep(0.5)
    for name in stayers:
        said = volunteers[name].stderr()
        assert said.count("segments averaged") >= averaged_then[name] + 3, (name, said[-3000:])
        assert FAILED_ROUND.findall(said)[failed_before[name]:] == [], (name, said[-3000:])
        assert "Traceback" not in said, name
