"""The rule in conftest.py for network-lab tests: a skip is a skip on a machine that cannot build the lab,
and a failure, with the skip's reason, where ``RAVNEST_REQUIRE_LAB=1`` (set by ``.ci/run``)."""

from pathlib import Path

import pytest

import ravnest_swarm.bench.natlab

LAB_TESTS = """
import pytest

@pytest.mark.netns
def test_in_the_lab():
    pass

@pytest.mark.netns
def test_in_the_lab_that_skips_itself():
    pytest.skip("no lab today")

def test_elsewhere_that_skips_itself():
    pytest.skip("not a lab test")
"""


@pytest.fixture
def lab_tests(pytester):
    """This conftest and three tests in a throwaway pytest (run in this process, so the lab check can be faked)."""
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    netns: needs root and network namespaces\n")
    pytester.makepyfile(test_lab=LAB_TESTS)
    return pytester


def lab_check_says(monkeypatch, reason):
    monkeypatch.setattr(ravnest_swarm.bench.natlab, "nat_lab_available", lambda: reason)


@pytest.mark.parametrize("required", [False, True])
def test_where_the_lab_works_lab_tests_run(lab_tests, monkeypatch, required):
    lab_check_says(monkeypatch, None)
    monkeypatch.setenv("RAVNEST_REQUIRE_LAB", "1" if required else "0")
    result = lab_tests.runpytest_inprocess("-ra")
    if required:  # a lab test that skips itself, whatever the reason, fails
        result.assert_outcomes(passed=1, failed=1, skipped=1)
        result.stdout.fnmatch_lines(["RAVNEST_REQUIRE_LAB=1 and this network-lab test skipped: no lab today"])
    else:
        result.assert_outcomes(passed=1, skipped=2)
    result.stdout.fnmatch_lines(["SKIPPED*not a lab test"])


def test_where_the_lab_cannot_be_built_lab_tests_skip_with_the_reason(lab_tests, monkeypatch):
    lab_check_says(monkeypatch, "simulated: no namespaces")
    monkeypatch.delenv("RAVNEST_REQUIRE_LAB", raising=False)
    result = lab_tests.runpytest_inprocess("-ra")
    result.assert_outcomes(skipped=3)
    result.stdout.fnmatch_lines(["SKIPPED*network lab unavailable: simulated: no namespaces"])


def test_where_the_lab_is_required_but_cannot_be_built_lab_tests_fail_with_the_reason(lab_tests, monkeypatch):
    lab_check_says(monkeypatch, "simulated: no namespaces")
    monkeypatch.setenv("RAVNEST_REQUIRE_LAB", "1")
    result = lab_tests.runpytest_inprocess("-ra")
    # the lab check runs at setup, so pytest counts these failures as errors; the other test still skips
    result.assert_outcomes(errors=2, skipped=1)
    result.stdout.fnmatch_lines(["RAVNEST_REQUIRE_LAB=1 and this network-lab test skipped: "
                                 "network lab unavailable: simulated: no namespaces"] * 2)
    result.stdout.fnmatch_lines(["SKIPPED*not a lab test"])


def test_lab_tests_share_the_group_that_one_xdist_worker_runs_alone(lab_tests):
    """Two labs at once would be timed against each other: every lab test joins the group that one worker runs."""
    items, _ = lab_tests.inline_genitems()
    groups = {item.name: [mark.args for mark in item.iter_markers("xdist_group")] for item in items}
    assert groups == {"test_in_the_lab": [("one-swarm-at-a-time",)],
                      "test_in_the_lab_that_skips_itself": [("one-swarm-at-a-time",)],
                      "test_elsewhere_that_skips_itself": []}
