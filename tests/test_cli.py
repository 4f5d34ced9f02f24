"""The CLI's contract: help for every verb, and bad input as one clear line with a non-zero exit."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading

import pytest
from commands import ravnest

DEAD_PEER = "/ip4/127.0.0.1/tcp/{port}/p2p/QmXZQ6jtyt8oZHGuNPBiJ4HFBGsm2bkdh9fNCnWu5A8RZt"
VERBS = ["backbone", "join", "status", "local", "probe", "doctor", "plan", "bench", "bench plan", "bench quality",
         "bench membership", "bench neighbours", "bench backbone", "bench averaging", "bench nat", "bench pipeline",
         "bench codecs", "export", "evaluate", "sample", "plot", "update-spec", "bench export", "invite"]
PLANNER_TEST_OPTIONS = ["--model-gb", "--gflop-per-sample", "--activation-mb", "--num-layers"]


def cli(*args, timeout=90):
    return ravnest(*args, timeout=timeout)


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
    """-h is --help; every verb shows an example; flags show no value type (typer's panels said --verbose <bool>)."""
    words = verb.split() if verb else []
    result = cli(*words, "-h")
    assert result.returncode == 0, result.stderr
    assert "Usage" in result.stdout
    assert result.stdout == cli(*words, "--help").stdout
    if verb:
        assert re.search(r"^  Example:\n    (sudo )?ravnest-swarm ", result.stdout, re.MULTILINE), result.stdout
    assert "<bool>" not in result.stdout
    assert re.search(r"^  -h, --help +Show this message and exit\.$", result.stdout, re.MULTILINE), result.stdout


def test_version():
    from ravnest_swarm import __version__

    result = cli("--version")
    assert (result.returncode, result.stdout) == (0, f"ravnest-swarm {__version__}\n")


def test_bool_flags_render_as_flags_and_planner_test_options_are_hidden():
    text = cli("join", "--help").stdout
    for flag in ("--verbose", "--no-dashboard", "--resume"):
        assert re.search(rf"^  {flag}(  +\S|$)", text, re.MULTILINE), text  # the flag, then its help: no value
    assert re.search(r"^  --heartbeat <float range> ", text, re.MULTILINE)  # an option with a value says its type
    for option in PLANNER_TEST_OPTIONS:
        assert not re.search(rf"^  {option} ", text, re.MULTILINE), option


def test_malformed_multiaddr_is_one_line():
    result = cli("join", "--initial-peers", "/ip4/999.1.1.1/tcp/x", "--run", "r", "--name", "a")
    assert_one_line_error(result, "malformed initial peer multiaddr", "/ip4/999.1.1.1/tcp/x", code=2)
    result = cli("status", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--run", "r")  # no /p2p/ID part
    assert_one_line_error(result, "malformed initial peer multiaddr", code=2)


@pytest.mark.parametrize("args, said", [
    (("bench", "diloco", "--averaging-compression", "zip"), "--averaging-compression must name codecs among"),
    (("bench", "diloco", "--configurations", "adamw:0.01"), "--configurations: 'adamw:0.01' is not inner:lr:outer"),
    (("bench", "lr-scaling", "--lrs", "x"), "--lrs must be numbers separated by commas"),
    (("bench", "export", "--model", "nosuch"), "unknown model 'nosuch': choose one of mlp-digits"),
    # was two lines, once each bench peer it had started exited on it
    (("bench", "averaging", "--compression", "zip"), "--compression must be one of fp16, 8bit, none"),
    (("bench", "averaging", "--compression", "int4"), "hivemind's averager has no codec 'int4'")])
def test_a_commands_own_check_of_its_options_is_one_line(args, said):
    """A UserError a command raises before it runs (not inside ``run_blocking``) is the same one line, not an
    'unexpected UserError'."""
    result = cli(*args)
    assert_one_line_error(result, said, code=2)
    assert "unexpected" not in result.stderr


@pytest.mark.parametrize("args, said", [
    (("sample", "nowhere", "--temperature", "nan"), "Invalid value for '--temperature': 'nan' is not a finite number"),
    (("local", "--lr=inf"), "Invalid value for '--lr': 'inf' is not a finite number"),
    (("local", "--lr", "20"), "Invalid value for '--lr': Input should be less than or equal to 10")])
def test_a_float_option_given_nan_or_inf_says_so(args, said):
    """`--temperature nan` said "should be less than or equal to 10": its range check's words for a value no range
    holds. A value out of range still gets the range's words."""
    assert_one_line_error(cli(*args), said, code=2)


def test_empty_or_clashing_outputs_are_one_line_before_anything_starts(tmp_path):
    """Found by a review as a new user: `local --export FILE` trained, then failed naming an `--out` it does not have,
    its summary lost; `invite --peer ""` (an unset variable) signed a ticket for any peer; `status --json --watch`
    drew the live view, and a script waiting for JSON hung; `plot --out x` said it wrote x and wrote x.png."""
    afile = tmp_path / "afile"
    afile.write_text("hi")
    result = cli("local", "--peers", "2", "--steps", "20", "--no-dashboard", "--export", str(afile))
    assert_one_line_error(result, f"--export {afile} is a file, not a directory", code=1)
    from ravnest_swarm.membership.owner import fingerprint, load_or_create_owner_key

    key_file = str(tmp_path / "owner.key")
    owner = fingerprint(load_or_create_owner_key(key_file).get_public_key().to_bytes())
    result = cli("invite", "--run", f"demo@{owner}", "--owner-key", key_file, "--peer", "")
    assert_one_line_error(result, "--peer '' is not a peer id", code=2)
    result = cli("join", "--initial-peers", DEAD_PEER.format(port=1), "--run", "r", "--name", "a", "--checkpoint-dir",
                 str(afile))
    assert_one_line_error(result, f"--checkpoint-dir {afile} is a file, not a directory", code=1)
    # refused now, not once the peer had joined the run and was placed
    result = cli("join", "--initial-peers", DEAD_PEER.format(port=1), "--run", "r", "--name", "a", "--checkpoint-dir",
                 str(tmp_path), "--resume")
    assert_one_line_error(result, f"--resume: no checkpoint at {tmp_path / 'r-a.safetensors'}", code=1)
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "local-peer2.safetensors").write_bytes(b"an earlier run's")
    # its checkpoints were overwritten, and a layer of the earlier run at its step went into this run's export
    result = cli("local", "--peers", "2", "--steps", "20", "--no-dashboard", "--checkpoint-dir", str(earlier))
    assert_one_line_error(result, f"--checkpoint-dir {earlier} holds an earlier local run's checkpoints "
                                  "(local-peer2.safetensors): --resume continues it", code=1)
    result = cli("status", "--initial-peers", DEAD_PEER.format(port=1), "--run", "r", "--json", "--watch")
    assert_one_line_error(result, "--json prints one document and exits, --watch draws until Ctrl-C", code=2)


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


@pytest.mark.parametrize("verb", ["local", "join"])
def test_unknown_averaging_compression(verb):
    peer_flags = ["--initial-peers", DEAD_PEER.format(port=1), "--run", "r", "--name", "a"] if verb == "join" else []
    result = cli(verb, *peer_flags, "--averaging-compression", "int7")
    assert_one_line_error(result, "--averaging-compression must be one of none, float16, meanstd16, int8", code=2)


@pytest.mark.parametrize("verb, flags, said", [
    ("join", ["--lr", "20"], "--lr 20.0: ensure this value is less than or equal to 10.0 (the run spec's bound)"),
    ("join", ["--averaging-period", "2000000"], "--averaging-period 2000000: ensure this value is less than"),
    ("local", ["--steps", "9007199254740993"], "--steps 9007199254740993: ensure this value is less than"),
    ("local", ["--model", "gpt-tiny", "--model-config", "layers=2000"], "the model's layout: a layout has at most"),
])
def test_a_spec_value_out_of_the_records_bounds_is_one_line_before_anything_starts(verb, flags, said):
    """They passed the flags' checks and failed the spec's schema when it was published, after the peer measured
    itself: three lines of a pydantic error (every peer of `local` died that way while it waited out its limit)."""
    peer_flags = ["--initial-peers", DEAD_PEER.format(port=1), "--run", "r", "--name", "a", "--model",
                  "mlp-digits"] if verb == "join" else []
    result = cli(verb, *peer_flags, *flags)
    assert_one_line_error(result, said, code=2)


def test_unknown_aggregation():
    result = cli("join", "--initial-peers", DEAD_PEER.format(port=1), "--run", "r", "--name", "a",
                 "--aggregation", "median")
    assert_one_line_error(result, "--aggregation must be one of mean, trimmed_mean, centered_clip", code=2)
    result = cli("bench", "averaging", "--robust", "mean")
    assert_one_line_error(result, "--robust must be one of trimmed_mean, centered_clip", code=2)


def test_initial_peer_refusing_connections():
    """join tries again with backoff while --patience lasts (the backbone may be starting), saying so, then
    gives up in one line (tests/test_join_patience.py: the backbone comes up in time)."""
    maddr = DEAD_PEER.format(port=free_port())
    result = cli("join", "--initial-peers", maddr, "--run", "r", "--name", "a", "--timeout", "5", "--patience", "5")
    assert_one_line_error(result, "could not reach any initial peer", maddr, "doctor", "--patience", code=1)
    assert "a: waiting for the initial peers (attempt 1 failed: could not reach" in result.stderr


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


@pytest.mark.parametrize("verb", ["join", "local"])
def test_unknown_model_is_refused_before_anything_starts(verb):
    peer_flags = ["--initial-peers", DEAD_PEER.format(port=1), "--run", "r", "--name", "a"] if verb == "join" else []
    result = cli(verb, *peer_flags, "--model", "resnet50", timeout=30)
    assert_one_line_error(result, "unknown model 'resnet50': choose one of mlp-digits, gpt, gpt-tiny", "module:function", code=2)
    assert "measur" not in result.stderr.lower()


@pytest.mark.parametrize("name, shown", [("bell\x07", r"'\x07' at position 4"), ("two\nlines", r"'\n' at position 3"),
                                         ("esc\x1b[2J", r"'\x1b' at position 3"), ("bidi\u202eevil", r"'\u202e'")])
def test_name_with_control_characters(name, shown):
    result = cli("join", "--initial-peers", DEAD_PEER.format(port=1), "--run", "r", "--name", name)
    assert_one_line_error(result, "--name must not contain control characters", shown, code=2)


def bad_identity(kind, tmp_path):
    """A path for --identity that is not a key file, and the command prefix needed to make it unreadable."""
    path = tmp_path / f"{kind}.key"
    if kind == "garbage":
        path.write_bytes(bytes(range(256)) * 4)
    elif kind == "text":
        path.write_text("my backbone's key\n")
    elif kind == "directory":
        path.mkdir()
    else:
        path.write_bytes(b"secret")
        path.chmod(0)
    prefix = []
    if kind == "unreadable" and os.geteuid() == 0:
        # root reads any file: drop the capabilities that let it, for the command only
        if shutil.which("setpriv") is None:
            pytest.skip("root, and no setpriv to drop CAP_DAC_OVERRIDE")
        prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"]
    return str(path), prefix


@pytest.mark.parametrize("verb", ["backbone", "join"])
@pytest.mark.parametrize("kind, what", [("garbage", "is not a private key file"), ("text", "is not a private key file"),
                                        ("directory", "is a directory"), ("unreadable", "Permission denied")])
def test_bad_identity_file_is_one_line(verb, kind, what, tmp_path):
    path, prefix = bad_identity(kind, tmp_path)
    flags = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--identity", path]
    if verb == "join":
        flags += ["--initial-peers", DEAD_PEER.format(port=1), "--run", "r", "--name", "a"]
    if prefix:  # run under setpriv: a fresh interpreter
        result = subprocess.run([*prefix, sys.executable, "-m", "ravnest_swarm", verb, *flags], capture_output=True,
                                text=True, timeout=60, stdin=subprocess.DEVNULL)
    else:
        result = ravnest(verb, *flags, timeout=60)
    assert_one_line_error(result, f"--identity {path}", what, code=2)


@pytest.mark.timeout(120)
def test_second_backbone_on_a_port_in_use_refuses_and_the_first_still_answers(processes):
    port = free_port()
    first = processes.start(["backbone", "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}"], "first")
    maddr = first.maddrs()[0]
    for taken in (f"/ip4/127.0.0.1/tcp/{port}", f"/ip4/0.0.0.0/tcp/{port}"):
        second = cli("backbone", "--host-maddrs", taken, timeout=60)
        assert_one_line_error(second, f"--host-maddrs {taken}: TCP port {port} is already in use", code=1)
    joiner = cli("join", "--initial-peers", maddr, "--run", "r", "--name", "a", "--host-maddrs",
                 f"/ip4/127.0.0.1/tcp/{port}", timeout=60)
    assert_one_line_error(joiner, f"TCP port {port} is already in use", code=1)
    result = cli("status", "--initial-peers", maddr, "--run", "r", "--json", timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["peers"] == []


@pytest.mark.timeout(120)
def test_status_of_a_run_nobody_is_in(backbone):
    result = cli("status", "--initial-peers", backbone, "--run", "nobody-here", timeout=60)
    assert_one_line_error(result, "no peer of run nobody-here is live", "check the name", code=1)
    assert result.stdout == ""
    result = cli("status", "--initial-peers", backbone, "--run", "nobody-here", "--json", timeout=60)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert (document["run"], document["peers"], document["summary"]) == ("nobody-here", [], None)


def test_missing_identity_directory():
    result = cli("backbone", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--identity", "/nonexistent-dir/backbone.key")
    assert_one_line_error(result, "identity directory /nonexistent-dir does not exist", code=2)


def test_name_too_long():
    result = cli("join", "--initial-peers", DEAD_PEER.format(port=1), "--run", "r", "--name", "n" * 65)
    assert_one_line_error(result, "--name", code=2)


@pytest.mark.parametrize("args, fragment", [
    (["join", "--initial-peers", "/ip4/" + "x" * 5000, "--run", "r", "--name", "n"], "(5005 characters)"),
    (["join", "--initial-peers", DEAD_PEER.format(port=1), "--run", "r" * 5000, "--name", "n"], "(5000 characters)"),
    (["plan", "--nonsense-" + "q" * 5000], "(5011 characters)"),
])
def test_a_huge_value_in_an_error_is_shown_by_its_ends_and_length(args, fragment):
    """A 5,000-character --run or multiaddr was echoed whole: a screenful for one mistake."""
    result = cli(*args)
    assert_one_line_error(result, fragment, code=2)
    assert len(result.stderr.strip()) < 400, result.stderr


def test_an_apostrophe_in_the_text_of_an_error_is_no_quote_to_cut():
    """A review: the apostrophe of "lossy's" opened a "quoted value" that ran to the next quote and was cut."""
    from ravnest_swarm.errors import error_line

    text = ("error: model lossy's loss fails on the targets of --data /home/alice/projects/churn-prediction/data/"
            "train-2024/with/a/long/path: TypeError: 'str' object is not callable")
    assert error_line(text) == text


def test_a_line_break_in_a_value_stays_in_the_one_line_of_its_error(tmp_path):
    result = cli("sample", str(tmp_path / "a\nb"))
    assert_one_line_error(result, "a\\nb")
    assert result.stderr.count("\n") == 1, result.stderr


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


def test_update_spec_without_a_change_is_one_line():
    result = cli("update-spec", "--initial-peers", DEAD_PEER.format(port=free_port()), "--run", "r")
    assert_one_line_error(result, "--lr, --steps, --finish, --invite-only or --revoke", code=2)


def test_bench_quality_refuses_a_scheme_it_cannot_run_in_one_line():
    """``bench quality --scheme`` takes one scheme as ``bench speedup --schemes`` names it; anything else is one line
    naming the option, before any peer starts."""
    assert_one_line_error(cli("bench", "quality", "--scheme", "bogus"), "--scheme", "unknown scheme 'bogus'")
    assert_one_line_error(cli("bench", "quality", "--scheme", "today,new"), "--scheme names one scheme")
    assert_one_line_error(cli("bench", "quality", "--scheme", "mine:lr=fast"), "--scheme", "lr must be a float")
