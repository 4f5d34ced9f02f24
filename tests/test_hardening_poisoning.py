"""Poisoned averaging with real peer processes: an absurdly scaled contribution is refused and reported.

(NaN contributions: ``test_averaging.test_nan_contribution_is_rejected_and_the_others_average``;
poisoned activations and gradients: ``test_hardening_handlers``.)
"""

import json
import subprocess
import sys

import pytest

from test_averaging import averaged, exact_mean, finish, start_swarm


@pytest.mark.timeout(150)
def test_scaled_contribution_is_rejected_reported_in_status_and_honest_values_unaffected(processes, backbone,
                                                                                         tmp_path):
    """Attack: peer c2s1 multiplies every value it contributes to averaging by 1e6 (finite, so a NaN check
    alone would let it drag the average its way). Every ring it is in must exclude it; the honest peers end
    with the exact mean of the honest clusters there (and of all three elsewhere); each honest peer that
    refused it reports the count in its peer record (``rejected``, ``note``), which ``status --json`` shows."""
    layouts = [[0, 2, 6], [0, 3, 6], [0, 1, 6]]
    peers = start_swarm(processes, backbone, layouts, "avgscale", tmp_path, extra={"c2s1": ["--poison", "scale"]})
    results = {name: finish(peer) for name, peer in peers.items()}
    culprit = results["c2s1"]["peer_id"]
    poisoned_from = results["c2s1"]["start"]  # c2s1 poisons its whole range
    mean_all, mean_honest = exact_mean(range(3)), exact_mean([0, 1])
    reports = [r for name, result in results.items() if name != "c2s1" for r in result["rejected"]]
    assert reports and all(r["peer"] == culprit and "absurdly scaled" in r["reason"] for r in reports)
    for name, result in results.items():
        if name == "c2s1":
            continue
        values = averaged(tmp_path, name)
        for segment in result["segments"]:
            lo, hi = segment["start"] - result["start"], segment["end"] - result["start"]
            hit = segment["start"] >= poisoned_from
            assert segment["status"] == "ok" and segment["members"] == (2 if hit else 3), (name, segment)
            expected = (mean_honest if hit else mean_all)[segment["start"]:segment["end"]]
            assert (values[lo:hi] - expected).abs().max() <= 1e-5, (name, segment)

    status = subprocess.run([sys.executable, "-m", "ravnest_swarm", "status", "--initial-peers", backbone, "--run",
                             "avgscale", "--json"], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    records = {p["peer_id"]: p for p in json.loads(status.stdout.strip().splitlines()[-1])["peers"]}
    for name, result in results.items():
        record = records[result["peer_id"]]
        assert record["rejected"] == len(result["rejected"]), name
        if result["rejected"]:
            assert "poisoned" in record["note"], record
