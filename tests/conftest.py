"""Fixtures that start real processes and stop every one of them by pid, even when the test fails; and the
rule for network-lab tests (marker ``netns``): they skip with a reason on a machine that cannot build the lab,
and fail instead where ``RAVNEST_REQUIRE_LAB=1`` says it must (``.ci/run`` on a root machine with iproute2
and iptables), so CI cannot stay green with none of them run."""

import functools
import os
from typing import Optional

import pytest

from ravnest_swarm.bench.natlab import nat_lab_available
from ravnest_swarm.processes import ProcessGroup

pytest_plugins = ["pytester"]  # test_conftest.py runs this conftest's lab rule in a throwaway pytest

LAB_REQUIRED_VARIABLE = "RAVNEST_REQUIRE_LAB"


@functools.cache
def lab_unavailable() -> Optional[str]:
    """Why the network lab cannot be built here, or None; asked once a session (it creates a probe namespace)."""
    return nat_lab_available()


def lab_required() -> bool:
    return os.environ.get(LAB_REQUIRED_VARIABLE) == "1"


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


@pytest.fixture
def processes(tmp_path):
    group = ProcessGroup(str(tmp_path))
    try:
        yield group
    finally:
        group.stop_all()


@pytest.fixture
def backbone(processes):
    """A running backbone on 127.0.0.1; yields its first multiaddr."""
    process = processes.start(["backbone", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], "backbone")
    return process.maddrs()[0]
