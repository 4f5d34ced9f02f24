"""What the peer records say about a run's progress. No network here: the dashboard imports it."""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional

# where a placed peer's wall time goes (``pipeline/counters.py``: ``WallTime``): working first, then the idle causes in
# the precedence a moment is charged by, then the rest
TIME_USES = ("computing", "sending", "download", "plan", "averaging", "neighbour", "other")
TRAINING_STATES = ("training", "averaging")  # the placed peers still at work: a finished ("done") peer's figures are old


def run_finished(peers: List[Dict], steps: int) -> bool:
    """A run is finished when it has placed peers and every one of them reached the run's length ``steps``
    (its spec's). ``peers``: live records (``membership.reader.read_peers``); a leaving peer no longer counts."""
    placed = [p for p in peers if p["state"] != "leaving" and p.get("cluster") is not None and p["cluster"] >= 0]
    return bool(placed) and all(p["state"] == "done" and (p.get("step") or 0) >= steps for p in placed)


def placed_use(peers: Iterable[Dict]) -> Optional[Dict]:
    """Where the run's placed stages' time goes, from their records (``utilisation``, ``time_shares``): the mean
    over the training or averaging peers that report them of each, with how many they are; None if none does."""
    placed = [p for p in peers if p["state"] in TRAINING_STATES and p.get("time_shares") and
              p.get("utilisation") is not None]
    if not placed:
        return None
    return dict(stages=len(placed), utilisation=sum(p["utilisation"] for p in placed) / len(placed),
                time_shares={use: sum(p["time_shares"].get(use, 0.0) for p in placed) / len(placed)
                             for use in TIME_USES})
