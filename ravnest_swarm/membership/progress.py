"""What the peer records say about a run's progress. No network here: the dashboard imports it."""

from __future__ import annotations

from typing import Dict, List


def run_finished(peers: List[Dict], steps: int) -> bool:
    """A run is finished when it has placed peers and every one of them reached the run's length ``steps``
    (its spec's). ``peers``: live records (``membership.reader.read_peers``); a leaving peer no longer counts."""
    placed = [p for p in peers if p["state"] != "leaving" and p.get("cluster") is not None and p["cluster"] >= 0]
    return bool(placed) and all(p["state"] == "done" and (p.get("step") or 0) >= steps for p in placed)
