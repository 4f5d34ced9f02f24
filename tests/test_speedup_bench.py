"""``bench speedup`` end to end in a small configuration: real join processes in the network lab."""

import json
import math
import subprocess
from types import SimpleNamespace

import pytest
from rich.console import Console

from process_tree import exits_leaving_nothing
from ravnest_swarm.bench.netlab import LAB_PREFIX
from ravnest_swarm.bench.speedup import SpeedupRun, parse_clusters, steps_per_cluster
from ravnest_swarm.bench.speedup_curve import check_target_samples, target_loss, time_to_target
from ravnest_swarm.bench.speedup_schemes import SCHEMES, compare, parse_schemes, stood_still_share, summary_table
from ravnest_swarm.errors import UserError
from ravnest_swarm.swarm.spec import RunSpec


def test_every_k_trains_the_same_samples_in_whole_steps_and_bad_settings_are_one_line():
    assert steps_per_cluster(19200, [1, 2, 4], 32) == {1: 600, 2: 300, 4: 150}
    assert parse_clusters("4, 1,2") == [1, 2, 4]
    with pytest.raises(UserError, match="use a multiple of 128"):
        steps_per_cluster(1000, [1, 2, 4], 32)
    with pytest.raises(UserError, match="must include 1"):
        parse_clusters("2,4")
    with pytest.raises(UserError, match="whole numbers"):
        parse_clusters("1,two")


def test_schemes_are_named_run_spec_settings_and_bad_ones_are_one_line():
    assert parse_schemes("today,new") == {"today": SCHEMES["today"], "new": SCHEMES["new"]}
    assert SCHEMES["today"] == dict(optimizer="sgd", lr=0.05, outer_optimizer="average", averaging_compression="none",
                                    averaging_overlap=False)
    # new: a new run's defaults; diloco: the same with DiLoCo's outer step
    assert SCHEMES["new"] == dict(optimizer="adamw", lr=0.002, outer_optimizer="average",
                                  averaging_compression="int8", averaging_overlap=True)
    assert SCHEMES["diloco"] == dict(SCHEMES["new"], outer_optimizer="nesterov")
    # a name of one's own starts from today's; a known name's settings change; the spec's types come back
    schemes = parse_schemes("today, mine:optimizer=adamw,lr=0.003,averaging_overlap=on, new:outer_lr=0.3")
    assert list(schemes) == ["today", "mine", "new"]
    assert schemes["mine"] == dict(SCHEMES["today"], optimizer="adamw", lr=0.003, averaging_overlap=True)
    assert schemes["new"] == dict(SCHEMES["new"], outer_lr=0.3)
    for text, message in (("today,x", "unknown scheme 'x'"), ("lr=3", "names no scheme"),
                          ("a:steps=5", "'steps' is not a setting"), ("a:optimizer=lion", "--schemes a: --optimizer"),
                          ("today,today", "'today' twice"), ("a:lr=fast", "lr must be a float"),
                          ("a:averaging_overlap=maybe", "on or off"), (",", "names no scheme")):
        with pytest.raises(UserError, match=message):
            parse_schemes(text)


def test_time_to_target_is_the_first_point_at_or_below_it_and_ratios_come_from_the_figures():
    assert time_to_target([[100, 1.0, 0.5], [200, 2.0, 0.3], [300, 3.0, 0.2]], 0.3) == (2.0, 200)
    assert time_to_target([[100, 1.0, 0.5]], 0.3) == (None, None)
    # a stage's time standing still for averaging, of its time training (a download and a plan left out)
    assert stood_still_share(dict(computing=0.5, averaging=0.1, download=0.2, plan=0.0)) == pytest.approx(0.125)
    assert stood_still_share(None) is None

    def run(rate, curve, final, stood_still):
        return dict(samples_per_s=rate, curve=curve, heldout_loss=final, heldout_accuracy=0.9, window_s=10.0,
                    stood_still_share=stood_still, averaging_share=0.1)

    runs = {"today": {1: run(100.0, [[1600, 8.0, 0.4], [3200, 16.0, 0.2]], 0.2, [0.0, 0.0]),
                      2: run(150.0, [[1600, 5.0, 0.3], [3200, 10.0, 0.25]], 0.25, [0.2, 0.1])},
            "new": {1: run(90.0, [[1600, 9.0, 0.2]], 0.15, [0.0, None]),
                    2: run(180.0, [[1600, 4.0, 0.19]], 0.19, [0.02, 0.03])}}
    results = compare(runs, "today", 0.2)
    assert results["today"]["1"]["seconds_to_target"] == 16.0 and results["today"]["1"]["sooner_than_k1"] == 1.0
    assert results["today"]["2"]["seconds_to_target"] is None and results["today"]["2"]["sooner_than_k1"] is None
    assert results["today"]["2"]["targets"] == dict(sooner=False, samples_per_s=False, stood_still=False)
    new = results["new"]["2"]
    assert (new["seconds_to_target"], new["samples_to_target"]) == (4.0, 1600)
    assert new["sooner_than_k1"] == pytest.approx(9.0 / 4.0, abs=1e-3) and new["sooner_than_reference"] is None
    assert new["samples_per_s_vs_k1"] == 2.0 and new["samples_per_s_vs_reference"] == 1.2
    assert new["stood_still_share"] == 0.03 and new["heldout_loss_vs_target"] == 0.95
    assert new["targets"] == dict(sooner=True, samples_per_s=True, stood_still=True)
    assert "targets" not in results["new"]["1"]
    # the table a person reads shows each (scheme, K), a target not reached as "-"
    report = dict(model="mlp-digits", stages=2, samples=3200, cpus_per_peer=0.36, reference="today", target_loss=0.2,
                  target_samples=3200,
                  results=results, runs={scheme: {str(k): dict(run, peer_cores=[0.2, 0.3], averaging_round_s=None,
                                                               machine_busy_cores=2.0) for k, run in by_k.items()}
                                         for scheme, by_k in runs.items()})
    console = Console(record=True, width=400)
    console.print(summary_table(report))
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in console.export_text().splitlines()]
    rows = [row for row in rows if row and row[0] in ("today", "new")]
    assert [row[:3] for row in rows] == [["today", "1", "16.0"], ["today", "2", "-"], ["new", "1", "9.0"],
                                         ["new", "2", "4.0"]]


def test_a_target_at_fewer_samples_is_a_point_of_k1s_curve_and_bad_ones_are_one_line():
    """``--target-samples``: every K trains on past K = 1's loss at those samples to show the samples it needs."""
    run = dict(heldout_loss=0.15, curve=[[1600, 8.0, 0.4], [3200, 16.0, 0.2], [4800, 24.0, 0.25], [6400, 32.0, 0.15]])
    assert target_loss(run, None) == 0.15 and target_loss(run, 3200) == 0.2
    with pytest.raises(UserError, match="no point at --target-samples 2400"):
        target_loss(run, 2400)
    # K = 1 of 600 steps checkpoints every 37 steps of 32 samples: a curve point every 1,184 samples
    check_target_samples(None, 19200, 600, 32, "cosine")
    check_target_samples(9472, 19200, 600, 32, "constant")
    for target, schedule, message in ((9600, "constant", "a multiple of 1184 samples, at most --samples 19200"),
                                      (20128, "constant", "at most --samples"),
                                      (9472, "cosine", "lr constant, not cosine")):
        with pytest.raises(UserError, match=message):
            check_target_samples(target, 19200, 600, 32, schedule)


# four labs one after the other: 4.3-6.2 min at load average 5-12; beside a 20-host soak (load 20), over 10
@pytest.mark.timeout(600)
@pytest.mark.netns
def test_every_peer_of_a_run_may_only_join_a_cluster_of_the_benchs_stages(tmp_path):
    """Each K's volunteers are told the bench's stages as the most peers per cluster: with RAM enough for the whole
    GPT, ``--stages 1`` once had its K = 4 planned as two clusters of two, and the bench refused it. The RAM each
    offers still keeps a stage of a longer split within one peer's share."""
    lab = SimpleNamespace(host_maddr=lambda host: f"/ip4/198.18.{host}.2/tcp/40000",
                          announce_maddr=lambda host: f"/ip4/198.18.{host}.2/tcp/41000")
    for stages in (1, 2):
        run = SpeedupRun(4, stages, 75, RunSpec("gpt-tiny"), "new", model_gb=0.01, mbps=100.0, delay_ms=20.0,
                         cpus=None, workdir=str(tmp_path), time_limit=60.0)
        options = run._join_options(lab, 0, "/ip4/198.18.9.2/tcp/41000/p2p/QmBackbone")
        assert options.max_stages == stages and options.min_peers == 4 * stages
        assert options.ram_gb * stages >= 0.01 > options.ram_gb * (stages - 1)


@pytest.mark.timeout(600)  # four swarm runs (168 s in a CI run, past the suite's 180 s in another); it waits 570 s
def test_bench_speedup_runs_two_schemes_at_each_k_times_them_to_the_target_and_leaves_nothing_running(processes):
    bench = processes.start(["bench", "speedup", "--json", "--clusters", "1,2", "--samples", "2560",
                             "--target-samples", "1280", "--averaging-period", "10", "--schemes", "today,new"],
                            "bench")
    exits_leaving_nothing(bench, 570)  # the peers, their p2pd, the backbones, the relays
    report = json.loads(bench.stdout().strip().splitlines()[-1])
    assert report["benchmark"] == "speedup" and report["clusters"] == [1, 2] and report["stages"] == 2
    assert report["link"]["mode"] == "netns" and report["link"]["mbps"] == 100.0
    assert report["schemes"]["new"]["optimizer"] == "adamw" and report["schemes"]["new"]["averaging_overlap"]
    # the target: today's K = 1 loss at --target-samples, a point of its curve; every K trains on to --samples
    today = report["runs"]["today"]["1"]
    assert report["reference"] == "today" and report["target_samples"] == 1280
    assert [report["target_loss"]] == [loss for samples, _, loss in today["curve"] if samples == 1280]
    for scheme in ("today", "new"):
        for k in ("1", "2"):
            run, figures = report["runs"][scheme][k], report["results"][scheme][k]
            assert run["samples_per_s"] > 0 and run["samples"] == 2560  # every K trains the same samples
            assert len(run["plan"]) == int(k) and all(len(cluster) == 2 for cluster in run["plan"])
            assert math.isfinite(run["heldout_loss"]) and run["heldout_loss"] < report["heldout_loss_start"]
            # the held-out curve: a point per checkpoint every peer wrote, samples and wall time rising to the end
            curve = run["curve"]
            assert len(curve) >= 8 and curve[-1][0] == 2560
            assert all(a[0] < b[0] and a[1] <= b[1] for a, b in zip(curve, curve[1:]))
            # the last point is timed at the end of the training and its last round (which lasts 20 s at most), not
            # when the peers wrote their last checkpoints on leaving
            assert run["window_s"] - 1 <= curve[-1][1] <= run["window_s"] + 20
            # the ratios come from the measured figures
            assert figures["samples_per_s_vs_k1"] == pytest.approx(
                run["samples_per_s"] / report["runs"][scheme]["1"]["samples_per_s"], abs=1e-3)
            assert all(0 <= share < 1 for share in run["stood_still_share"])
        assert report["runs"][scheme]["2"]["averaging_rounds"] >= 1  # the clusters averaged across the lab's links
        assert set(report["results"][scheme]["2"]["targets"]) == {"sooner", "samples_per_s", "stood_still"}
    # today's K = 1 reaches its own loss at the target's samples by then, at the latest
    assert report["results"]["today"]["1"]["samples_to_target"] <= 1280
    # rounds beside training: the new scheme's stages stand still less than today's, which stand still for each round
    assert max(report["runs"]["new"]["2"]["stood_still_share"]) < max(report["runs"]["today"]["2"]["stood_still_share"])
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{LAB_PREFIX}{bench.pid}-" not in namespaces
