"""``bench neighbours`` end to end in a small configuration: a real backbone and DHT nodes, both layouts read."""

import json

import pytest

from process_tree import exits_leaving_nothing


@pytest.mark.timeout(180)
def test_bench_neighbours_reads_both_layouts_and_leaves_nothing_running(processes):
    bench = processes.start(["bench", "neighbours", "--json", "--peers", "80", "--nodes", "2", "--reads", "3"],
                            "bench")
    exits_leaving_nothing(bench, 160)  # the backbone, its p2pd and the p2pd of the bench's own nodes
    report = json.loads(bench.stdout().strip().splitlines()[-1])
    # 80 peers: two buckets now, one key before; every read of both layouts found what it looked for
    assert report["benchmark"] == "neighbours" and report["buckets_now"] == 2 and report["clusters"] == 20
    for name in ("endpoints_before", "endpoints_now", "partners_before", "partners_now"):
        assert report[name]["reads"] == 3 and report[name]["median_ms"] > 0
    assert report["partners_now_over_before"] == pytest.approx(
        report["partners_now"]["median_ms"] / report["partners_before"]["median_ms"], abs=0.01)
