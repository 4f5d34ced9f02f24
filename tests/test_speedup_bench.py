"""``bench speedup`` end to end in a small configuration: real join processes in the network lab."""

import json
import math
import subprocess

import pytest

from process_tree import exits_leaving_nothing
from ravnest_swarm.bench.netlab import LAB_PREFIX
from ravnest_swarm.bench.speedup import parse_clusters, steps_per_cluster
from ravnest_swarm.errors import UserError


def test_every_k_trains_the_same_samples_in_whole_steps_and_bad_settings_are_one_line():
    assert steps_per_cluster(19200, [1, 2, 4], 32) == {1: 600, 2: 300, 4: 150}
    assert parse_clusters("4, 1,2") == [1, 2, 4]
    with pytest.raises(UserError, match="use a multiple of 128"):
        steps_per_cluster(1000, [1, 2, 4], 32)
    with pytest.raises(UserError, match="must include 1"):
        parse_clusters("2,4")
    with pytest.raises(UserError, match="whole numbers"):
        parse_clusters("1,two")


@pytest.mark.timeout(240)
@pytest.mark.netns
def test_bench_speedup_reports_each_k_and_leaves_nothing_running(processes):
    bench = processes.start(["bench", "speedup", "--json", "--clusters", "1,2", "--samples", "2560",
                             "--averaging-period", "10"], "bench")
    exits_leaving_nothing(bench, 220)  # the peers, their p2pd, the backbones, the relays
    report = json.loads(bench.stdout().strip().splitlines()[-1])
    assert report["benchmark"] == "speedup" and report["clusters"] == [1, 2] and report["stages"] == 2
    assert report["link"]["mode"] == "netns" and report["link"]["mbps"] == 100.0
    for k in ("1", "2"):
        run = report["runs"][k]
        assert run["samples_per_s"] > 0 and run["samples"] == 2560  # every K trains the same samples
        assert len(run["plan"]) == int(k) and all(len(cluster) == 2 for cluster in run["plan"])
        assert math.isfinite(report["heldout_loss"][k]) and report["heldout_loss"][k] < report["heldout_loss_start"]
        # the ratios come from the measured figures
        assert report["speedup"][k] == pytest.approx(run["samples_per_s"] / report["runs"]["1"]["samples_per_s"],
                                                     abs=1e-3)
        assert report["heldout_loss_vs_k1"][k] == pytest.approx(report["heldout_loss"][k] / report["heldout_loss"]["1"],
                                                                abs=1e-4)
    assert report["runs"]["2"]["averaging_rounds"] >= 1  # the clusters averaged across the lab's links
    assert set(report["targets"]["2"]) == {"speedup_at_least_0_8k", "loss_within_5_percent"}
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{LAB_PREFIX}{bench.pid}-" not in namespaces
