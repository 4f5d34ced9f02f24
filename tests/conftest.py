"""Fixtures that start real processes and stop every one of them by pid, even when the test fails; and the
rule for network-lab tests (marker ``netns``): they skip with a reason on a machine that cannot build the lab,
and fail instead where ``RAVNEST_REQUIRE_LAB=1`` says it must (``.ci/run`` on a root machine with iproute2
and iptables), so CI cannot stay green with none of them run."""

import functools
import os
import signal
from typing import Optional

import pytest

from ravnest_swarm.bench.natlab import nat_lab_available
from commands import shared_launcher
from ravnest_swarm.processes import ProcessGroup

pytest_plugins = ["pytester"]  # test_conftest.py runs this conftest's lab rule in a throwaway pytest

LAB_REQUIRED_VARIABLE = "RAVNEST_REQUIRE_LAB"

# A suite started in the background of a non-interactive shell inherits SIGINT ignored, and so would every peer
# and p2pd it starts: Ctrl-C tests would then pass without Ctrl-C doing anything. A terminal's commands start
# with SIGINT at its default; so do ours.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@functools.cache
def lab_unavailable() -> Optional[str]:
    """Why the network lab cannot be built here, or None; asked once a session (it creates a probe namespace)."""
    return nat_lab_available()


def lab_required() -> bool:
    return os.environ.get(LAB_REQUIRED_VARIABLE) == "1"


# The suite runs on two xdist workers (``-n 2 --dist loadgroup``, pyproject.toml; README gives the figures). These
# tests share one xdist group, so one worker runs them one after another while the other runs the rest:
# - big swarms (many processes each, about half the suite's time): two at once on two cores would starve
#   each other's heartbeats and deadlines;
# - every network-lab test (namespaces, cgroups, timed links): one lab at a time, and none timed beside another;
# - modules with a module-scoped swarm (test_attacks' one attacked run), which must start once, on one worker.
# A module's path takes all its tests; a ``path::test`` takes that test with all its parameters.
SERIAL_GROUP = "one-swarm-at-a-time"
SERIAL_TESTS = (
    "tests/test_attacks.py",
    "tests/test_invite_only.py",
    "tests/test_nat.py",
    "tests/test_netlab.py",
    "tests/test_speedup_bench.py",
    "tests/test_run_length.py",
    "tests/test_replan.py",
    "tests/test_late_cluster.py",
    "tests/test_sized_model.py",
    "tests/test_light_peers.py",
    "tests/test_pipeline_bench.py::test_a_stopped_bench_stops_every_process_it_started_and_removes_its_lab",
    "tests/test_local_resume.py::test_kill_every_process_of_a_local_run_then_resume_loses_nothing",
    "tests/test_export.py",
    "tests/test_export_use.py::test_a_local_gpt_exported_evaluates_to_its_summary_loads_samples_and_plots",
    "tests/test_export_use.py::test_a_user_model_exported_from_local_evaluates_to_its_summary_and_loads",
    "tests/test_export_use.py::test_export_of_a_300m_gpt_from_local_checkpoints_peaks_below_two_stages",
    "tests/test_local.py::test_local_beside_a_cpu_hog_averages_and_reports_only_what_happened",
    "tests/test_local.py::test_local_swarm_forms_clusters_averages_and_halves_the_loss",
    "tests/test_leave.py::test_sigint_hands_the_layers_over_to_the_standby_at_the_leavers_step",
    "tests/test_swarm.py::test_sigkilled_stage_is_replaced_by_a_standby_and_training_goes_on",
    "tests/test_swarm.py::test_kill_everything_then_resume_continues_from_the_checkpoints",
)


def runs_alone(item) -> bool:
    test = item.nodeid.split("[", 1)[0]
    module = test.split("::", 1)[0]
    return item.get_closest_marker("netns") is not None or module in SERIAL_TESTS or test in SERIAL_TESTS


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (it appends each one to its tests' ids)
def pytest_collection_modifyitems(items):
    for item in items:
        if runs_alone(item):
            item.add_marker(pytest.mark.xdist_group(SERIAL_GROUP))


def pytest_runtest_setup(item):
    if item.get_closest_marker("netns") is None:
        return
    reason = lab_unavailable()
    if reason is not None:
        pytest.skip(f"network lab unavailable: {reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Where the lab is required, a lab test that skipped (for whatever reason) is reported as failed."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and lab_required() and item.get_closest_marker("netns") is not None:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        report.outcome = "failed"
        report.longrepr = f"{LAB_REQUIRED_VARIABLE}=1 and this network-lab test skipped: {reason}"


_first_failures = []  # (test, its first failure's error) of each test that needed its rerun (README: reruns)


def pytest_runtest_logreport(report):
    if report.outcome == "rerun":
        lines = [line for line in report.longreprtext.splitlines() if line.startswith("E ")]
        _first_failures.append((report.nodeid, "\n".join(lines[:8]) or report.longreprtext[-2000:]))


def pytest_terminal_summary(terminalreporter):
    """What each rerun test's first run failed on: pytest-rerunfailures lists the test only, and a rerun is a
    defect to read."""
    if _first_failures:
        terminalreporter.section("first failures of the tests that were rerun")
        for test, error in _first_failures:
            terminalreporter.write_line(f"{test}:")
            terminalreporter.write_line(error)


@pytest.fixture(scope="session")
def launcher():
    """One fork server for the whole session (ravnest_swarm/launcher.py, started by tests/commands.py): a test's
    peers start in a fraction of a second instead of importing torch and hivemind each, 3-4 CPU-seconds that
    made most of the suite's time."""
    return shared_launcher()


@pytest.fixture
def processes(tmp_path, launcher):
    group = ProcessGroup(str(tmp_path), launcher)
    try:
        yield group
    finally:
        group.stop_all()


@pytest.fixture
def backbone(processes):
    """A running backbone on 127.0.0.1; yields its first multiaddr."""
    process = processes.start(["backbone", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], "backbone")
    return process.maddrs()[0]
