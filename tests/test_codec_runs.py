"""A local swarm trains through each codec (``codecs/``): activations and gradients cross every stage boundary in
it, and the loss still falls; and a boundary whose link is the bottleneck switches to the stronger codec."""

import json

import pytest

from commands import ravnest
from ravnest_swarm.codecs.codec import CODECS

# every codec but float32 (every other local run's), and one pair by direction
CODEC_RUNS = [name for name in CODECS if name != "none"] + ["int4/int3"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("codec", CODEC_RUNS)
def test_a_local_run_with_the_codec_trains_and_its_loss_falls(codec):
    # 8 in flight: with the default 2 (or 3), two boundaries' round trips of the model's tiny activations idle a
    # third stage more than its share of compute gains, and the planner forms one 2-stage cluster and a standby
    result = ravnest("local", "--peers", "3", "--steps", "30", "--max-in-flight", "8", "--pipeline-compression", codec,
                     "--link-bound-compression", codec, "--json",
                     "--no-dashboard", "--time-limit", "240", timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["finished"], summary
    # one cluster of three stages: two boundaries crossed in the codec, each way
    records = summary["peer_records"].values()
    assert sorted(record["stage"] for record in records) == [0, 1, 2], summary["peer_records"]
    forward, _, backward = codec.partition("/")
    # each record says the codec its stage sends in, each way
    assert all(record["codecs"] == {"forward": forward, "backward": backward or forward} for record in records), records
    assert summary["loss_end"] < 0.6 * summary["loss_start"], (summary["loss_start"], summary["loss_end"])


@pytest.mark.netns
@pytest.mark.timeout(420)
def test_a_boundary_whose_link_is_the_bottleneck_switches_to_the_strong_codec_and_says_so():
    """Two stages on a 2 Mbit/s lab link, where float32 activations take about ten times their compute: with
    ``none>int4`` stage 0's forward link switches to int4 after its first window and the stages' reports say so;
    the float32 run beside it never switches, and the switched run moves fewer bytes per sample, faster."""
    result = ravnest("bench", "pipeline", "--stages", "2", "--microbatches", "40", "--microbatch-size", "4",
                     "--max-in-flight", "4", "--mbps", "2", "--transfer-mb", "0.25", "--compression", "none,none>int4",
                     "--json", timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    codecs = json.loads(result.stdout.strip().splitlines()[-1])["codecs"]
    plain, adaptive = codecs["none"], codecs["none>int4"]
    assert plain["codec_switches"] == 0 and plain["codecs_at_end"][0]["forward"] == "none"
    assert adaptive["codec_switches"] >= 1 and adaptive["codecs_at_end"][0]["forward"] == "int4", adaptive
    # the first 5-second window goes at float32 before the switch: over the bench's 40 microbatches, 57 % of the
    # float32 run's bytes in CI, where a run of hours would pay it once
    assert adaptive["bytes_per_sample"] < 0.8 * plain["bytes_per_sample"]
    assert adaptive["samples_per_s"] > plain["samples_per_s"]
