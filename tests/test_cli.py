"""The CLI's contract: help for every verb, and bad input as one clear line with a non-zero exit."""

import re
import socket
import subprocess
import sys
import threading

import pytest

DEAD_PEER = "/ip4/127.0.0.1/tcp/{port}/p2p/QmXZQ6jtyt8oZHGuNPBiJ4HFBGsm2bkdh9fNCnWu5A8RZt"
VERBS = ["backbone", "join", "status", "doctor", "bench"]


def cli(*args, timeout=90):
    return subprocess.run([sys.executable, "-m", "ravnest_swarm", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def assert_one_line_error(result, *fragments, code=None):
    assert result.returncode != 0, result
    if code is not None:
        assert result.returncode == code, result
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("verb", [None] + VERBS)
def test_help_of_every_verb(verb):
    result = cli(*([verb] if verb else []), "--help")
    assert result.returncode == 0, result.stderr
    assert "Usage" in result.stdout


def test_malformed_multiaddr_is_one_line():
    result = cli("join", "--initial-peers", "/ip4/999.1.1.1/tcp/x", "--run", "r", "--name", "a")
    assert_one_line_error(result, "malformed initial peer multiaddr", "/ip4/999.1.1.1/tcp/x", code=2)
    result = cli("status", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--run", "r")  # no /p2p/ID part
    assert_one_line_error(result, "malformed initial peer multiaddr", code=2)


@pytest.mark.parametrize("run_name", ["", "has space", "-leading-dash", "x" * 49, "bad/slash"])
def test_invalid_run_name(run_name):
    result = cli("join", "--initial-peers", DEAD_PEER.format(port=1), "--run", run_name, "--name", "a")
    assert_one_line_error(result, "invalid run name", code=2)


@pytest.mark.parametrize("flag", ["--ram-gb", "--gflops", "--bandwidth-mbps", "--max-ram-gb"])
@pytest.mark.parametrize("value", ["-1", "nan"])
def test_negative_or_nan_override(flag, value):
    result = cli("join", "--initial-peers", DEAD_PEER.format(port=1), "--run", "r", "--name", "a", flag, value)
    assert_one_line_error(result, flag, code=2)


@pytest.mark.parametrize("verb", ["join", "local"])
def test_unknown_pipeline_compression(verb):
    peer_flags = ["--initial-peers", DEAD_PEER.format(port=1), "--run", "r", "--name", "a"] if verb == "join" else []
    result = cli(verb, *peer_flags, "--pipeline-compression", "zip")
    assert_one_line_error(result, "--pipeline-compression must be one of none, float16, meanstd16", code=2)


def test_initial_peer_refusing_connections():
    maddr = DEAD_PEER.format(port=free_port())
    result = cli("join", "--initial-peers", maddr, "--run", "r", "--name", "a", "--timeout", "5")
    assert_one_line_error(result, "could not reach any initial peer", maddr, "doctor", code=1)


def test_initial_peer_that_never_answers_times_out():
    """A port that accepts TCP but never speaks: we give up after --timeout with the address named."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held = []
    threading.Thread(target=lambda: held.extend(server.accept() for _ in range(16)), daemon=True).start()
    maddr = DEAD_PEER.format(port=server.getsockname()[1])
    try:
        result = cli("status", "--initial-peers", maddr, "--run", "r", "--timeout", "3", timeout=60)
    finally:
        server.close()
    assert_one_line_error(result, maddr, code=1)
    assert re.search(r"could not reach|no answer|did not answer", result.stderr)


def test_missing_identity_directory():
    result = cli("backbone", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--identity", "/nonexistent-dir/backbone.key")
    assert_one_line_error(result, "identity directory /nonexistent-dir does not exist", code=2)


def test_name_too_long():
    result = cli("join", "--initial-peers", DEAD_PEER.format(port=1), "--run", "r", "--name", "n" * 65)
    assert_one_line_error(result, "--name", code=2)


@pytest.mark.timeout(120)
def test_backbone_identity_is_created_once_and_reused(processes, tmp_path):
    identity = str(tmp_path / "backbone.key")
    first = processes.start(["backbone", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--identity", identity], "first")
    first_id = first.maddrs()[0].rsplit("/p2p/", 1)[1]
    assert first.stop() == 0
    second = processes.start(["backbone", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--identity", identity], "second")
    maddrs = second.maddrs()
    assert all(maddr.endswith(f"/p2p/{first_id}") for maddr in maddrs)
    assert all(re.match(r"^/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+$", maddr) for maddr in maddrs)


@pytest.mark.timeout(120)
def test_doctor_says_can_join_with_a_live_backbone(backbone):
    result = cli("doctor", "--initial-peers", backbone)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok   p2pd: starts" in result.stdout
    assert re.search(r"initial peer .*answers, round trip [\d.]+ ms", result.stdout)
    assert "reachability: direct" in result.stdout
    assert re.search(r"capabilities: [\d.]+ GB RAM, [\d.]+ GFLOP/s, \d+ Mbit/s", result.stdout)
    assert result.stdout.strip().splitlines()[-1] == "verdict: can join"


def test_doctor_says_cannot_join_without_a_backbone():
    result = cli("doctor", "--initial-peers", DEAD_PEER.format(port=free_port()), "--timeout", "5")
    assert result.returncode == 1
    assert "FAIL initial peers" in result.stdout
    assert result.stdout.strip().splitlines()[-1].startswith("verdict: cannot join")
