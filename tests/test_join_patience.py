"""A volunteer does not give up on a backbone that is not up yet: it waits with backoff, says so, and joins
once the backbone answers (issue #20, item 0). Giving up after --patience: tests/test_cli.py."""

import os
import signal
import socket
import time

import pytest
from hivemind.p2p import P2P, PeerID

from run_observer import RunObserver

P2P_ID_OF_NOBODY = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"  # a well-formed id nobody holds


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(150)
def test_join_waits_for_a_backbone_that_is_not_up_yet_and_joins_once_it_answers(processes, tmp_path):
    identity = str(tmp_path / "backbone.key")
    P2P.generate_identity(identity)  # the backbone's address is known before it runs, as a volunteer is told it
    with open(identity, "rb") as f:
        peer_id = PeerID.from_identity(f.read()).to_base58()
    port = free_port()
    maddr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer_id}"
    volunteer = processes.start(["join", "--initial-peers", maddr, "--run", "patient", "--name", "early",
                                 "--model-gb", "0.001", "--ram-gb", "1", "--gflops", "10", "--bandwidth-mbps", "100",
                                 "--timeout", "3", "--patience", "120", "--no-dashboard", "--heartbeat", "2",
                                 "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], "early")
    volunteer.wait_for_output(r"early: waiting for the initial peers \(attempt 2 failed: .*\); trying again in \d+s",
                              60, stream="stderr")
    processes.start(["backbone", "--identity", identity, "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}",
                     "--run", "patient"], "backbone").maddrs()
    observer = RunObserver(maddr, "patient")
    try:
        observer.wait_for(lambda peers: "early" in peers, 60, "the early volunteer's record")
    finally:
        observer.close()
    assert volunteer.popen.poll() is None and "Traceback" not in volunteer.stderr()


@pytest.mark.timeout(150)
def test_join_given_a_dead_backbone_and_a_live_one_joins_through_the_live_one(processes, backbone):
    """Several backbones: one that never answers does not stop a volunteer that another one answers."""
    dead = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{P2P_ID_OF_NOBODY}"
    volunteer = processes.start(["join", "--initial-peers", dead, "--initial-peers", backbone, "--run", "test-run",
                                 "--name", "two-ways",
                                 "--ram-gb", "1", "--gflops", "10", "--bandwidth-mbps", "100", "--timeout", "5",
                                 "--no-dashboard", "--heartbeat", "2", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"],
                                "two-ways")
    observer = RunObserver(backbone, "test-run")
    try:
        observer.wait_for(lambda peers: "two-ways" in peers, 60, "the volunteer's record")
    finally:
        observer.close()
    assert volunteer.popen.poll() is None and "Traceback" not in volunteer.stderr()


@pytest.mark.timeout(120)
def test_ctrl_c_while_join_waits_for_its_backbone_ends_the_wait_at_once(processes):
    """It said "stopping..." and retried on until --patience ran out (for ever with ``--patience inf``; SIGTERM did
    not end it either)."""
    dead = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{P2P_ID_OF_NOBODY}"
    volunteer = processes.start(["join", "--initial-peers", dead, "--run", "patient", "--name", "waiting",
                                 "--timeout", "2", "--patience", "inf", "--no-dashboard",
                                 "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], "waiting")
    volunteer.wait_for_output(r"waiting: waiting for the initial peers \(attempt 2 failed", 60, stream="stderr")
    os.killpg(volunteer.pid, signal.SIGINT)
    started = time.monotonic()
    while volunteer.popen.poll() is None and time.monotonic() - started < 30:
        time.sleep(0.2)
    assert volunteer.popen.poll() == 0, volunteer.stderr()[-2000:]
    assert time.monotonic() - started < 15 and "Traceback" not in volunteer.stderr()

