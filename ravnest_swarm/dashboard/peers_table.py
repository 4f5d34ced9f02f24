"""A rich table of the peers of a run: what ``status`` prints once (the live views use the dashboard)."""

from __future__ import annotations

from typing import Dict, List

from rich import box
from rich.table import Table
from rich.text import Text

# (header, justify): short headers so that the table fits 80 columns with names up to ~16 characters
COLUMNS = (("name", "left"), ("state", "left"), ("mem GB", "right"), ("Mb/s", "right"), ("GF/s", "right"),
           ("reach", "left"), ("c/s", "left"), ("step", "right"), ("loss", "right"), ("ttl", "right"))


def peers_table(run: str, peers: List[Dict]) -> Table:
    """One row per peer: capabilities, placement (cluster/stage), progress, and seconds until its record expires.

    The caption names every peer that refused poisoned or malformed input, with its count. Only the
    name column may shrink (cut with an ellipsis, or wrapped at its spaces); every other cell
    is a short word or number that rich must never fold into fragments. Names (and the caption that
    lists them) are :class:`Text`, so that rich shows them as they are instead of reading markup in them.
    """
    refusing = [f"{peer['name']} {peer['rejected']}" for peer in peers if peer.get("rejected")]
    caption = (Text(f"refused poisoned or malformed input: {', '.join(refusing)}", style="table.caption")
               if refusing else None)
    table = Table(title=f"run {run}: {len(peers)} peer(s)", caption=caption, box=box.SIMPLE_HEAD, pad_edge=False,
                  padding=(0, 1, 0, 0), expand=False)
    for header, justify in COLUMNS:
        shrinkable = header == "name"
        table.add_column(header, justify=justify, no_wrap=not shrinkable, overflow="ellipsis",
                         min_width=8 if shrinkable else None)
    for peer in peers:
        placement = "-" if peer.get("cluster") is None else f"{peer['cluster']}/{peer.get('stage')}"
        loss = "-" if peer.get("loss") is None else f"{peer['loss']:.3f}"
        table.add_row(
            Text(peer["name"]),
            peer["state"],
            memory_cell(peer),
            f"{peer['bandwidth_mbps']:.0f}",
            f"{peer['gflops']:.0f}",
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
