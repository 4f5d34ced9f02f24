"""Every cluster meets the run (issue 30): a volunteer placed as a new cluster while two clusters train averages
with them from its first round on. Before, it downloaded the layers at the holders' step while they trained on at
about 100 steps a second, so its rounds were rounds they had left long ago: it failed 25 of 25 rounds in one run."""

import re

import pytest

from test_swarm import placed, swarm  # noqa: F401 (a fixture)

ROUNDS = 12


@pytest.mark.timeout(300)
def test_a_cluster_formed_mid_run_averages_with_the_others_from_its_first_round(swarm):
    # each can hold the whole model: clusters of one stage
    swarm("p0", ram_fraction=1.5, steps=100_000, extra=("--min-peers", "2"))
    swarm("p1", ram_fraction=1.5, steps=100_000, extra=("--min-peers", "2"))
    swarm.watcher.wait_for(lambda peers: len(placed(peers)) == 2 and
                           all((p.get("step") or 0) >= 400 for p in placed(peers).values()),
                           150, "two clusters past step 400")
    late = swarm("late", ram_fraction=1.5, steps=100_000, extra=("--min-peers", "2"))
    joined = late.wait_for_output(r"late: training cluster (\d+) stage 0/1 layers \S+ from step (\d+)", 120,
                                  stream="stderr")
    peers = swarm.watcher.wait_for(
        lambda peers: (peers.get("late", {}).get("averaging_rounds") or 0) +
        (peers.get("late", {}).get("averaging_failures") or 0) >= ROUNDS, 150, f"{ROUNDS} rounds of the late cluster")
    record = peers["late"]
    done, failed = record.get("averaging_rounds") or 0, record.get("averaging_failures") or 0
    log = late.stderr()
    # the rounds that failed say why (CI once saw 9 of 12, and the log's tail held only the successes after them)
    failures = re.findall(r"^.*averaging at step \d+ failed.*$", log, re.MULTILINE)
    assert done / (done + failed) >= 0.9, "\n".join([str(record)] + failures)
    assert re.search(r"late: cluster \d+ counts from step \d+, where the run's other clusters are", log) or \
        int(joined.group(2)) >= 400, log[-3000:]
    assert "unexpected" not in log and "Traceback" not in log
