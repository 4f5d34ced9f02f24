"""Fixtures that start real processes and stop every one of them by pid, even when the test fails."""

import pytest

from ravnest_swarm.processes import ProcessGroup


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
