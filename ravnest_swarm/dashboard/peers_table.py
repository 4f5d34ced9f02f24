"""A rich table of the peers of a run: what ``status`` prints once (the live views use the dashboard).

A large run's table would scroll thousands of rows past: above :data:`SCREENFUL_ROWS` peers it shows the peers
that matter (:func:`peers_that_matter`: a note, refusals, failed averaging rounds, not placed or leaving), under a
line that adds up the whole run (its summary, ``membership/buckets.py``) and one that says how many rows it shows
(``--all``: every one). :func:`status_document` is what ``status --json`` prints.
"""

from __future__ import annotations

from collections import Counter
from typing import Dict, List, Optional, Tuple

from rich import box
from rich.table import Table
from rich.text import Text

from ravnest_swarm.membership.buckets import run_samples_per_s
from ravnest_swarm.membership.progress import TIME_USES, placed_use

# (header, justify): short headers so that the table fits 80 columns with names up to ~16 characters
# a table this long (plus its title, header and caption) fits a 24-row terminal
SCREENFUL_ROWS = 18
COLUMNS = (("name", "left"), ("state", "left"), ("mem GB", "right"), ("Mb/s", "right"), ("GF/s", "right"),
           ("reach", "left"), ("c/s", "left"), ("step", "right"), ("loss", "right"), ("ttl", "right"))
# the table of where each peer's time and traffic go: the shares of TIME_USES but computing and sending, shortened
IDLE_HEADERS = dict(download="dl", plan="plan", averaging="avg", neighbour="nbr", other="oth")


def status_document(run: str, steps: Optional[int], finished: bool, summary: Optional[Dict],
                    peers: List[Dict], refused: Optional[Dict[str, int]] = None) -> Dict:
    """What ``status --json`` prints: the run's length and whether it is finished, its totals (counted from the
    records read, ``membership.buckets.totals``; None without any), every record read, and the records refused,
    by reason (``membership.identity.PeerIdentityValidator``), and where the placed stages' time goes
    (``membership.progress.placed_use``: None while no record says)."""
    return dict(run=run, steps=steps, finished=finished, summary=summary, peers=peers, refused=refused or {},
                use=placed_use(peers))


def _matters(peer: Dict) -> int:
    """How much a peer's row matters to someone debugging a run: 0 (most) to 4 (a peer placed and quiet)."""
    if peer.get("note"):
        return 0  # the cause of its last failure or refusal
    if peer.get("rejected"):
        return 1
    if peer.get("averaging_failures"):
        return 2
    if peer["state"] in ("joining", "standby", "leaving") or (
            peer["state"] != "done" and (peer.get("cluster") is None or peer["cluster"] < 0)):
        return 3  # not (yet) placed, or going
    return 4


def peers_that_matter(peers: List[Dict], limit: int) -> List[Dict]:
    """At most ``limit`` of ``peers``: those with a note, then refusals, failed averaging rounds, not placed (joining,
    standby) or leaving, then the rest, each group by name."""
    return sorted(peers, key=lambda peer: (_matters(peer), peer["name"], peer["peer_id"]))[:limit]


def swarm_line(summary: Optional[Dict], peers: List[Dict]) -> str:
    """One line that adds up the run: peers by state, clusters and samples/s from its summary (every bucket's
    counts), or from the records read where it has none yet."""
    if summary is not None:
        total, states, clusters = summary["peers"], summary["states"], summary["clusters"]
        rate = f" │ {summary['samples_per_s']:.1f} samples/s"
        coverage = (f" │ {summary['buckets_summarized']} of {summary['buckets']} buckets summarized"
                    if summary["buckets_summarized"] < summary["buckets"] else "")
    else:
        live = [p for p in peers if p["state"] != "leaving"]
        total, states = len(live), Counter(p["state"] for p in live)
        clusters = len({p["cluster"] for p in live if p.get("cluster") is not None and p["cluster"] >= 0})
        rate = f" │ {run_samples_per_s(live):.1f} samples/s"
        coverage = ""
    by_state = ", ".join(f"{count} {state}" for state, count in sorted(states.items(), key=lambda item: -item[1]))
    return f"{total} peer(s){f' ({by_state})' if by_state else ''} │ {clusters} cluster(s){rate}{coverage}"


def status_view(run: str, summary: Optional[Dict], peers: List[Dict], show_all: bool = False) -> Tuple[Text, Table]:
    """What ``status`` prints: a line adding up the run (and one saying how many rows the table shows, where not
    every one), and the table of the peers that matter (every peer of a run of at most :data:`SCREENFUL_ROWS`, or
    with ``show_all``), in the order :func:`peers_that_matter` ranks them."""
    shown = peers if show_all or len(peers) <= SCREENFUL_ROWS else peers_that_matter(peers, SCREENFUL_ROWS)
    line = swarm_line(summary, peers)
    if len(shown) < len(peers):
        line += f"\nshowing {len(shown)} of {len(peers)} peers read, those that matter first (--all: every one)"
    return Text(line, style="bold"), peers_table(run, shown, len(peers))


def peers_table(run: str, peers: List[Dict], read: Optional[int] = None) -> Table:
    """One row per peer: capabilities, placement (cluster/stage), progress, and seconds until its record expires.

    :param read: how many peer records were read, where ``peers`` are only some of them (the title says both)

    The caption names every peer that refused poisoned or malformed input, with its count. Only the
    name column may shrink (cut with an ellipsis, or wrapped at its spaces); every other cell
    is a short word or number that rich must never fold into fragments. Names (and the caption that
    lists them) are :class:`Text`, so that rich shows them as they are instead of reading markup in them.
    """
    refusing = [f"{peer['name']} {peer['rejected']}" for peer in peers if peer.get("rejected")]
    caption = (Text(f"refused poisoned or malformed input: {', '.join(refusing)}", style="table.caption")
               if refusing else None)
    title = f"run {run}: {len(peers)} peer(s)" if read is None or read == len(peers) else \
        f"run {run}: {len(peers)} of {read} peer(s)"
    table = Table(title=title, caption=caption, box=box.SIMPLE_HEAD, pad_edge=False,
                  padding=(0, 1, 0, 0), expand=False)
    for header, justify in COLUMNS:
        shrinkable = header == "name"
        table.add_column(header, justify=justify, no_wrap=not shrinkable, overflow="ellipsis",
                         min_width=8 if shrinkable else None)
    for peer in peers:
        # a leaving peer's record says cluster -1 and no stage: in no cluster, shown as one in none ("-", not -1/None)
        placed = peer.get("cluster") is not None and peer["cluster"] >= 0 and peer.get("stage") is not None
        placement = f"{peer['cluster']}/{peer['stage']}" if placed else "-"
        # three significant digits: a small model's compute (0.4 GF/s) and a trained model's loss (0.0003) are
        # not 0 (a walkthrough's status read "GF/s 0" and "loss 0.000" for peers that trained)
        loss = "-" if peer.get("loss") is None else f"{peer['loss']:.3g}"
        table.add_row(
            Text(peer["name"]),
            peer["state"],
            memory_cell(peer),
            f"{peer['bandwidth_mbps']:.0f}",
            f"{peer['gflops']:.3g}" if peer["gflops"] < 100 else f"{peer['gflops']:.0f}",
            peer["reachability"],
            placement,
            str(peer.get("step") if peer.get("step") is not None else "-"),
            loss,
            f"{peer.get('expires_in', 0):.0f}s",
        )
    return table


def memory_cell(peer: Dict) -> str:
    """``peak/offer`` in GB: what the peer measurably took at most, and the memory the planner sizes its stages by.
    A GPU peer's are its GPU's (peak allocation, total memory), marked ``g``; ``-`` for a record without them."""
    def gb(value) -> str:
        return "-" if value is None else f"{value:.1f}" if value < 10 else f"{value:.0f}"

    if peer.get("device_peak_gb") is not None:
        return f"g{gb(peer['device_peak_gb'])}/{gb(peer.get('device_memory_gb'))}"
    offer = peer.get("device_memory_gb")
    return f"{gb(peer.get('peak_memory_gb'))}/{gb(peer['ram_gb'] if offer is None else offer)}"


def use_table(peers: List[Dict]) -> Optional[Table]:
    """Where each peer's time and traffic go, for the peers whose records say (None if none does): ``busy``, its
    share computing or sending (layer downloads left out); ``comp`` and ``send``; the idle shares by cause (a
    download of layers to move, a plan's move, averaging, waiting for a neighbour, other); kB/s out and in;
    the codecs of its pipeline messages (forward/backward) and of its averaging ring. A title line gives the
    placed stages' mean."""
    shown = [p for p in peers if p.get("time_shares") or p.get("bytes_up_per_s") is not None]
    if not shown:
        return None
    run_use = placed_use(peers)
    title = "time and traffic" + ("" if run_use is None else
                                  f": placed stages {run_use['utilisation']:.0%} busy (mean of {run_use['stages']})")
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0), expand=False)
    headers = ["name", "busy", "comp", "send"] + [IDLE_HEADERS[use] for use in TIME_USES[2:]] + \
        ["kB/s ↑/↓", "codecs"]
    for header in headers:
        table.add_column(header, justify="left" if header in ("name", "codecs") else "right",
                         no_wrap=header != "name", overflow="ellipsis", min_width=8 if header == "name" else None)
    for peer in sorted(shown, key=lambda p: (p["name"], p["peer_id"])):
        shares = peer.get("time_shares") or {}
        busy = "-" if peer.get("utilisation") is None else f"{peer['utilisation']:.0%}"
        table.add_row(Text(peer["name"]), busy, *(f"{shares[use]:.0%}" if use in shares else "-" for use in TIME_USES),
                      f"{_per_second(peer.get('bytes_up_per_s'))}/{_per_second(peer.get('bytes_down_per_s'))}",
                      codecs_cell(peer))
    return table


def _per_second(value: Optional[float]) -> str:
    return "-" if value is None else f"{value / 1000:.0f}" if value >= 10_000 else f"{value / 1000:.1f}"


def codecs_cell(peer: Dict) -> str:
    """``forward/backward ring``: the codecs of the peer's pipeline messages (one where both are the same) and of its
    averaging ring's parts; ``-`` for what its record does not say."""
    codecs = peer.get("codecs") or {}
    pipeline = sorted(set(codecs.values()))
    shown = codecs.get("forward", "-") + "/" + codecs.get("backward", "-") if len(pipeline) > 1 else \
        (pipeline[0] if pipeline else "-")
    return f"{shown} {peer.get('averaging_codec') or '-'}"
