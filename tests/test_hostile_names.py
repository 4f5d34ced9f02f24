"""Names from the network are shown as they are: rich markup in them is text, wide characters keep the layout,
and control characters never reach a terminal (``join --name`` refuses them, every reader drops such records).

Hostile records come from ``join --name`` and from a stock hivemind client that signs its own records and
skips the run's schema (a backbone started without ``--run`` stores them; readers validate what they fetch).
"""

import asyncio
import io
import json
import re
import sys
import time

import pytest
from hivemind.utils.crypto import RSAPrivateKey
from rich.cells import cell_len
from rich.console import Console

from commands import ravnest
from ravnest_swarm.dashboard.peers_table import peers_table
from ravnest_swarm.dashboard.state import SwarmState
from ravnest_swarm.dashboard.view import render_text
from ravnest_swarm.membership.records import PeerRecord, peers_key
from ravnest_swarm.bench.records import store_as_signers
from ravnest_swarm.net.identity import peer_id_of_owner
from test_dashboard import PTY_WRAPPER, peer

RUN = "hostile"
JOINER = "x[/bold]y"  # crashed its own joiner and everyone's `status` while rich read it as markup
MARKUP = "[home] pc [red]not red[/red]"  # rich drew "[home]" as nothing
WIDE = "漢" * 64  # 64 characters, 128 columns
CONTROL = "evil\x1b[2Jname"  # ESC [2J clears the screen
SHOWN = (JOINER, MARKUP, WIDE)
ANSI_SEQUENCE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def wide_prefix(text):
    """Whether WIDE's start is in ``text``: it is cut with an ellipsis wherever it is shown (it takes 128 columns)."""
    return WIDE[:8] in text


def assert_fits(text, width):
    lines = text.rstrip("\n").splitlines()
    assert max(cell_len(line) for line in lines) <= width, text


def print_table(peers, width):
    console = Console(width=width, file=io.StringIO(), record=True, color_system=None)
    console.print(peers_table(RUN, peers))
    return console.export_text()


def test_the_table_and_the_dashboard_show_hostile_names_literally():
    """What `status` prints, and what `status --watch`, `join` and `local` draw (dashboard.view)."""
    spare = "spare " + WIDE[:58]
    peers = [peer(JOINER, "standby", rejected=2), peer(MARKUP, cluster=0, stage=0), peer(WIDE, cluster=0, stage=1),
             peer(spare, "standby")]
    table = print_table(peers, 120)
    assert JOINER in table and MARKUP in table and wide_prefix(table)
    assert f"refused poisoned or malformed input: {JOINER} 2" in table
    assert_fits(table, 120)
    narrow = print_table(peers, 80)  # the name column shrinks; every row keeps its cells
    assert_fits(narrow, 80)
    assert len(re.findall(r"\s(standby|training)\s+-/8\.0\s+100\s+500\s+direct\s", narrow)) == 4, narrow

    state = SwarmState(RUN)
    state.update(peers, at=1.0)
    dashboard = render_text(state, 80)
    # map cells are cut at 24 columns, the spares' line at 80
    assert JOINER in dashboard and MARKUP[:17] in dashboard and wide_prefix(dashboard) and spare[:10] in dashboard
    assert_fits(dashboard, 80)


async def write_records(maddr: str):
    """Three standby records of RUN, each signed by its own peer's key through a stock client: markup, wide, and a
    control character. The joiner's node refuses the control character, the backbone (no --run) stores everything."""
    keys = [RSAPrivateKey() for _ in range(3)]
    honest = PeerRecord(peer_id="QmStock", name="stock", state="standby", ram_gb=4.0, bandwidth_mbps=100.0,
                        gflops=100.0, reachability="direct", maddrs=[], version="0.1.0", time=time.time()).dict()
    await store_as_signers(maddr, [
        (peers_key(RUN), dict(honest, peer_id=peer_id_of_owner(key.get_public_key().to_bytes()), name=name), b"", key)
        for key, name in zip(keys, (MARKUP, WIDE, CONTROL))], lifetime=300)


def status(maddr, *flags):
    return ravnest("status", "--initial-peers", maddr, "--run", RUN, *flags, timeout=90, env={"COLUMNS": "120"})


@pytest.mark.timeout(240)
def test_status_watch_and_join_show_hostile_names_from_the_network(processes, backbone):
    refused = ravnest("join", "--initial-peers", backbone, "--run", RUN, "--name", CONTROL, timeout=90)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr.strip().splitlines() == [
        r"error: --name must not contain control characters: '\x1b' at position 4"]

    joiner = processes.start(["join", "--initial-peers", backbone, "--run", RUN, "--name", JOINER, "--no-dashboard",
                              "--ram-gb", "4", "--gflops", "100", "--bandwidth-mbps", "100", "--heartbeat", "1",
                              "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], "joiner")
    joiner.wait_for_output(re.escape(f"{JOINER} sees 1 peer(s): {JOINER}:"), 60, stream="stderr")
    asyncio.run(write_records(backbone))
    # the joiner's plain log lines: the two shown records join it, the control character's is dropped
    listed = r":\w+, ".join(re.escape(name) for name in sorted(SHOWN))
    joiner.wait_for_output(re.escape(f"{JOINER} sees 3 peer(s): ") + listed, 30, stream="stderr")

    table = status(backbone)
    assert table.returncode == 0, table.stderr
    assert JOINER in table.stdout and MARKUP in table.stdout and wide_prefix(table.stdout)
    assert "evil" not in table.stdout and "\x1b" not in table.stdout
    assert_fits(table.stdout, 120)
    document = status(backbone, "--json")
    assert sorted(p["name"] for p in json.loads(document.stdout)["peers"]) == sorted(SHOWN)

    watcher = processes.start(["status", "--initial-peers", backbone, "--run", RUN, "--watch"], "watcher",
                              prefix=[sys.executable, "-c", PTY_WRAPPER])
    watcher.wait_for_output(re.escape(JOINER), 60)
    watcher.wait_for_output(re.escape(MARKUP), 30)
    assert watcher.stop(grace=20) == 0
    screen = ANSI_SEQUENCE.sub("", watcher.stdout())
    assert wide_prefix(screen) and "evil" not in screen

    assert joiner.stop(grace=30) == 0
    assert f"{JOINER} left run {RUN}" in joiner.stderr()
