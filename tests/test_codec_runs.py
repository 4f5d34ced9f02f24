"""A local swarm trains through each blockwise codec (``codecs/``): activations and gradients cross every stage
boundary quantized, and the loss still falls. (16-bit codecs: tests/test_pipeline.py.)"""

import json

import pytest

from commands import ravnest
from ravnest_swarm.codecs.codec import CODECS, BlockwiseCodec

BLOCKWISE = [name for name, codec in CODECS.items() if isinstance(codec, BlockwiseCodec)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("codec", BLOCKWISE)
def test_a_local_run_with_the_codec_trains_and_its_loss_falls(codec):
    result = ravnest("local", "--peers", "3", "--steps", "40", "--pipeline-compression", codec, "--json",
                     "--no-dashboard", "--time-limit", "240", timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["finished"], summary
    # one cluster of three stages: two boundaries crossed in the codec, each way
    assert sorted(record["stage"] for record in summary["peer_records"].values()) == [0, 1, 2], summary["peer_records"]
    assert summary["loss_end"] < 0.6 * summary["loss_start"], (summary["loss_start"], summary["loss_end"])
