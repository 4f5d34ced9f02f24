"""A rich table of the peers of a run, shared by ``status`` and ``join``."""

from __future__ import annotations

from typing import Dict, List

from rich.table import Table


def peers_table(run: str, peers: List[Dict]) -> Table:
    table = Table(title=f"run {run}: {len(peers)} peer(s)", expand=False)
    for column in ("name", "state", "RAM GB", "Mbit/s", "GFLOP/s", "reach", "cluster/stage", "step", "loss", "seen"):
        table.add_column(column, overflow="fold")
    for peer in peers:
        placement = "-" if peer.get("cluster") is None else f"{peer['cluster']}/{peer.get('stage')}"
        loss = "-" if peer.get("loss") is None else f"{peer['loss']:.3f}"
        table.add_row(
            peer["name"],
            peer["state"],
            f"{peer['ram_gb']:.1f}",
            f"{peer['bandwidth_mbps']:.0f}",
            f"{peer['gflops']:.1f}",
            peer["reachability"],
            placement,
            str(peer.get("step") if peer.get("step") is not None else "-"),
            loss,
            f"{peer.get('expires_in', 0):.0f}s left",
        )
    return table
