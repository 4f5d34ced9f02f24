"""Averaging beside training (issues 30 and 33): with the run spec's ``averaging_overlap`` a stage trains on while
its round runs and applies the result one round late, so a cluster that reaches a round first does not stand
still waiting for the other."""

import json

import pytest

from test_swarm import swarm  # noqa: F401 (a fixture)

# 600 steps trained in 3-6 s on a busy machine, at a round every 0.1-0.5 s: ten rounds were not always there to take
STEPS = 1000


def overlap(spans, intervals):
    """Seconds of ``intervals`` that fall inside any of ``spans``."""
    return sum(max(0.0, min(end, b) - max(start, a)) for start, end in spans for a, b in intervals)


@pytest.mark.timeout(300)
def test_stages_train_on_while_their_averaging_round_runs(swarm, tmp_path):
    # each can hold the whole model: two clusters of one stage
    peers = {name: swarm(name, ram_fraction=1.5, steps=STEPS,
                         extra=("--min-peers", "2", "--averaging-overlap", "--report", str(tmp_path / f"{name}.json")))
             for name in ("p0", "p1")}
    # a finished stage writes its report and stays on offer until stopped
    swarm.watcher.wait_for(lambda records: all((tmp_path / f"{name}.json").exists() for name in peers), 240,
                           "both stages finished their run")
    for name, peer in peers.items():
        report = json.loads((tmp_path / f"{name}.json").read_text())
        rounds, failures = report["averaging_rounds"], report["averaging_failures"]
        assert rounds >= 10 and failures <= 0.1 * (rounds + failures), (name, rounds, failures)
        spans = [tuple(span) for span in report["averaging"]]
        compute = [tuple(interval) for interval in report["compute"]]
        # forwards and backwards ran inside the rounds' windows: the stage did not stand still for them
        assert overlap(spans, compute) > 0, (name, spans[:5])
        losses = [loss for _, loss in report["losses"]]
        assert sum(losses[-50:]) / 50 < 0.5 * sum(losses[:50]) / 50, name  # and it learned, rounds applied late
        log = peer.stderr()
        assert "unexpected" not in log and "Traceback" not in log, log[-3000:]
