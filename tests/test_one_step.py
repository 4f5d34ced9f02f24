"""Clusters in step (issue 33, item 4; issue 30, item 0): a cluster formed mid-run starts all its stages from one
step, the state of one averaging round (the same on every cluster), and then averages with the others. Before,
each stage took its layers from holders of its own choosing, and a re-formed cluster's stages came from steps
1,879 and 3,100."""

import re
import time

import pytest

from test_swarm import placed, swarm  # noqa: F401 (a fixture)

LATE = ("late0", "late1")
CARRIED = re.compile(r"^\w+: adamw state resumed from the holders of its downloaded layers \((\d+) of (\d+): ",
                     re.MULTILINE)
START = re.compile(r"^(\w+): training cluster (\d+) stage (\d)/2 layers \d+:\d+ from step \d+ on cpu; "
                   r"its layers are (.+) of (?:rounds?|steps?|rounds and steps) ([\d, ]+)"
                   r"(?:, not all of round \d+ .*)?$", re.MULTILINE)  # that suffix: the test's steps then differ


@pytest.mark.timeout(330)
def test_the_stages_of_a_cluster_formed_mid_run_all_start_from_one_averaged_round(swarm):
    """Two clusters of two stages train and average; two volunteers join. The plan that places them forms a third
    cluster (and may re-form the others, moving their peers): every stage that takes its layers from others under
    it says which step they are of, and in each cluster they are of one step, the state of one averaging round."""
    # each holds about 0.6 of the model: clusters of two stages
    first = {f"p{index}": swarm(f"p{index}", steps=100_000, extra=("--min-peers", "4")) for index in range(4)}
    swarm.watcher.wait_for(lambda peers: len(placed(peers)) == 4 and
                           len({p["cluster"] for p in placed(peers).values()}) == 2 and
                           all((p.get("averaging_rounds") or 0) >= 2 for p in placed(peers).values()),
                           150, "two clusters of two stages that have averaged")
    before = {name: len(process.stderr()) for name, process in first.items()}
    volunteers = {**first, **{name: swarm(name, steps=100_000, extra=("--min-peers", "4")) for name in LATE}}
    peers = swarm.watcher.wait_for(lambda peers: all(peers.get(n, {}).get("state") == "training" for n in LATE)
                                   and len({p["cluster"] for p in placed(peers).values()}) == 3,
                                   150, "three clusters with the two late volunteers training")
    # every first peer started anew under the plan or stayed in place (a peer the plan moved may still download when
    # the stage after it, which needs only its round, has started)
    settled = re.compile(r"^\w+: (training cluster .*|plan round \d+ keeps us in place.*)$", re.MULTILINE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(settled.search(process.stderr()[before[name]:])
                                                   for name, process in first.items()):
        time.sleep(1)
    starts = {}  # name -> (cluster, stage, what its layers are, their steps), its last start since the late joined
    for name, process in volunteers.items():
        found = START.findall(process.stderr()[before.get(name, 0):])
        if found:
            _, cluster, stage, kind, steps = found[-1]
            starts[name] = (int(cluster), int(stage), kind, steps)
    logs = "\n".join(f"{name}: {process.stderr()[-1500:]}" for name, process in volunteers.items())
    assert set(LATE) <= set(starts), logs
    # their AdamW moments came with their layers, a copy of their holders' (not afresh: bench diloco --reform-every
    # measured a re-formed cluster better with them)
    for name in LATE:
        log = volunteers[name].stderr()[before.get(name, 0):]
        carried = CARRIED.search(log)
        # its own log first: the swarm's is long, and an assertion's text is cut (CI showed only p0's lines)
        assert carried and carried.group(1) == carried.group(2), (name, log[-4000:], logs)
    by_cluster = {}
    for name, (cluster, stage, kind, steps) in starts.items():
        assert kind == "the run's averaged state" and "," not in steps, (name, starts, logs)
        by_cluster.setdefault(cluster, {})[stage] = int(steps)
    # a cluster whose two stages both took their layers from others: the late volunteers', or a re-formed one
    assert any(len(stages) == 2 for stages in by_cluster.values()), (starts, logs)
    for cluster, stages in by_cluster.items():
        assert len(set(stages.values())) == 1 and min(stages.values()) > 0, (cluster, starts, logs)
    # their records say it too, and every cluster then averages with the others: rounds counted from here, once
    # every peer the plan moved trains again (the first rounds after a plan that moves them all wait for its moves)
    peers = swarm.watcher.wait_for(lambda peers: len(placed(peers)) == 6 and
                                   all(p["state"] in ("training", "averaging") for p in placed(peers).values()),
                                   60, "all six peers training")
    counts = {n: (peers[n].get("averaging_rounds") or 0, peers[n].get("averaging_failures") or 0) for n in volunteers}
    peers = swarm.watcher.wait_for(lambda peers: all((peers.get(n, {}).get("averaging_rounds") or 0) >=
                                                     counts[n][0] + 3 for n in volunteers),
                                   120, "3 more averaging rounds of every stage")
    for name, (cluster, stage, _, steps) in starts.items():
        record = peers[name]
        if record.get("cluster") == cluster and record.get("stage") == stage:  # not moved again since
            assert record.get("start_round") == int(steps), record
    for name in LATE:
        done = peers[name]["averaging_rounds"] - counts[name][0]
        failed = (peers[name].get("averaging_failures") or 0) - counts[name][1]
        failures = re.findall(r"^.*averaging at step \d+ failed.*$", volunteers[name].stderr(), re.MULTILINE)
        assert done / (done + failed) >= 0.75, "\n".join([str(peers[name])] + failures)
    assert all("Traceback" not in process.stderr() for process in volunteers.values()), logs
