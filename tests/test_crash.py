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


def test_a_round_in_flight_is_given_up_for_a_gone_partner_only_while_a_running_ring_still_counts_it():
    """``StageAveraging._give_up_why``, pure: a gone partner that never came gives the round up only after
    ``gone_grace`` (its ring votes it out first); one that reached a running ring of ours (it died amid an attempt)
    a ring timeout later still (its ring votes once its attempt fails); one the ring voted out or withdrew, or a round
    whose rings ended, never."""
    import asyncio
    from types import SimpleNamespace

    from ravnest_swarm.averaging.mailbox import RingState
    from ravnest_swarm.averaging.segments import Ring
    from ravnest_swarm.swarm.stage_averaging import InFlightRound, StageAveraging

    def averaging_with(state, last_finished=99):
        averaging = StageAveraging.__new__(StageAveraging)
        averaging.following = lambda: SimpleNamespace(gone=frozenset({"dead"}), left=frozenset(), plan=None)
        averaging.averager = SimpleNamespace(last_finished_step=last_finished, timeout=20.0, mailbox=SimpleNamespace(
            ring_state_if_any=lambda step, index: state if (step, index) == (100, 0) else None))
        averaging.peer_id, averaging.heartbeat, averaging._gone_since = "me", 2.0, {}
        return averaging

    loop = asyncio.new_event_loop()
    try:
        in_flight = InFlightRound(None, 100, None, {}, [Ring(0, 0, 10, ("me", "other", "dead"))],
                                  frozenset({"other", "dead"}), loop.create_future(), time.monotonic())
        died_amid = RingState()
        died_amid.arrive("dead")
        amid = averaging_with(died_amid)
        assert amid._give_up_why(in_flight) is None  # left to the ring's vote once its attempt fails
        amid._gone_since["dead"] -= amid.gone_grace
        assert amid._give_up_why(in_flight) is None
        amid._gone_since["dead"] -= 20.0
        assert "gone" in amid._give_up_why(in_flight)  # the vote did not end the ring in time
        never_came = averaging_with(RingState())
        assert never_came._give_up_why(in_flight) is None  # left to the ring's vote for now
        never_came._gone_since["dead"] -= never_came.gone_grace
        assert "gone" in never_came._give_up_why(in_flight)  # the vote did not end the ring in time
        not_started = averaging_with(None)
        assert not_started._give_up_why(in_flight) is None
        voted_out = RingState()
        voted_out.arrive("dead")
        voted_out.vote("me", ["dead"])
        voted_out.vote("other", ["dead"])
        late = averaging_with(voted_out)
        late._gone_since["dead"] = time.monotonic() - 10 * late.gone_grace
        assert late._give_up_why(in_flight) is None
        withdrawn = RingState()
        withdrawn.withdraw("dead", "dead will never reach round 100 (its record)")
        assert averaging_with(withdrawn)._give_up_why(in_flight) is None
        ended = RingState()
        ended.arrive("dead")
        ended.settled = True
        assert averaging_with(ended)._give_up_why(in_flight) is None
        assert averaging_with(died_amid, last_finished=100)._give_up_why(in_flight) is None
    finally:
        loop.close()
