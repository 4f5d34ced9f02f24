"""What the dashboard knows about a swarm, derived from successive snapshots of the peer records.

The dashboard reads nothing but the ``{run}_peers`` records (what ``read_peers`` returns) and, when
there is one, the adopted ``{run}_plan`` record. Everything it shows is derived here from those
snapshots: the cluster map, the standby peers, the totals, a loss history and the events between
two snapshots. Memory stays bounded whatever the run's length: one snapshot is kept for diffing,
and the loss history and the events are fixed-length deques.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Deque, Dict, Iterable, List, Optional, Tuple

Slot = Tuple[int, int]  # (cluster, stage)

ACTIVE_STATES = ("training", "averaging", "done")
EVENT_KINDS = ("start", "joined", "left", "replaced", "round", "avg-fail", "rejected")


@dataclass(frozen=True)
class Event:
    """Something that changed between two snapshots.

    :param at: wall-clock time of the snapshot that showed the change
    :param kind: one of :data:`EVENT_KINDS`
    :param text: one line for people, without the time or the kind
    """

    at: float
    kind: str
    text: str


@dataclass(frozen=True)
class Totals:
    """Swarm-wide figures of the latest snapshot (see ``docs/dashboard.md`` for their sources).

    :param peers: live peer records, leaving ones included
    :param clusters: clusters with at least one placed peer
    :param standby: live peers that hold no cluster slot
    :param samples_per_s: sum over clusters of the last stage's ``samples_per_s``
    :param averaging_done: highest ``averaging_rounds`` any peer reports
    :param averaging_running: peers in state ``averaging`` now
    :param averaging_failures: sum of the peers' ``averaging_failures``
    :param plan_round: highest planning round seen in the plan record or any peer record
    """

    peers: int
    clusters: int
    standby: int
    samples_per_s: float
    averaging_done: int
    averaging_running: int
    averaging_failures: int
    plan_round: Optional[int]


def placement(peer: Dict) -> Optional[Slot]:
    """The (cluster, stage) a peer serves, or None for a peer outside every cluster (-1 also means none)."""
    cluster, stage = peer.get("cluster"), peer.get("stage")
    if cluster is None or stage is None or cluster < 0 or stage < 0:
        return None
    return cluster, stage


class SwarmState:
    """The dashboard's model of one run, fed one snapshot of peer records at a time.

    :param run: run name, shown in the title
    :param max_events: events kept (oldest dropped first)
    :param max_losses: loss-history points kept (one per snapshot that has a loss)
    """

    def __init__(self, run: str = "", max_events: int = 200, max_losses: int = 240):
        self.run = run
        self.max_events, self.max_losses = max_events, max_losses
        self.events: Deque[Event] = deque(maxlen=max_events)
        self.losses: Deque[Tuple[float, float]] = deque(maxlen=max_losses)  # (at, mean loss)
        self.peers: List[Dict] = []
        self.plan: Optional[Dict] = None
        self.at: Optional[float] = None
        self.snapshots = 0
        # the last peer seen at each slot, kept while the slot is vacant, so a stand-in that arrives after
        # the old holder's record expired still counts as a replacement; reset by every new round
        self.last_holders: Dict[Slot, Dict] = {}

    # --- feeding -------------------------------------------------------------------------------

    def update(self, peers: Iterable[Dict], plan: Optional[Dict] = None, at: Optional[float] = None) -> List[Event]:
        """Take a new snapshot; returns the events it caused (also appended to :attr:`events`).

        :param peers: peer records as ``read_peers`` returns them (dicts; ``expires_in`` optional)
        :param plan: the adopted plan record, or None when none is known
        :param at: wall-clock time of the snapshot; now when omitted (recordings pass their own)
        """
        at = time.time() if at is None else at
        peers = sorted((dict(p) for p in peers), key=lambda p: (p["name"], p["peer_id"]))
        before_round = self.plan_round()
        previous = {p["peer_id"]: p for p in self.peers}
        first = self.snapshots == 0
        self.peers, self.plan, self.at = peers, plan, at
        self.snapshots += 1

        new_events = []
        if first:
            totals = self.totals()
            new_events.append(Event(at, "start", f"watching {totals.peers} peer(s) in {totals.clusters} cluster(s)"))
        else:
            new_events += self._diff(previous, before_round, at)
        self.events.extend(new_events)
        if self.plan_round() != before_round:
            self.last_holders = {}
        self.last_holders.update({slot: dict(peer_id=p["peer_id"], name=p["name"])
                                  for slot, p in self.slot_holders().items()})

        losses = [p["loss"] for p in peers if p.get("loss") is not None and p["state"] in ACTIVE_STATES]
        if losses:
            self.losses.append((at, sum(losses) / len(losses)))
        return new_events

    def _diff(self, previous: Dict[str, Dict], before_round: Optional[int], at: float) -> List[Event]:
        events = []
        current = {p["peer_id"]: p for p in self.peers}
        for peer_id, peer in current.items():
            old = previous.get(peer_id)
            if old is None:
                where = _where(peer)
                events.append(Event(at, "joined", f"{peer['name']} joined ({peer['state']}{where})"))
            elif peer["state"] == "leaving" and old["state"] != "leaving":
                events.append(Event(at, "left", f"{peer['name']} is leaving{_where(old)}"))
        for peer_id, old in previous.items():
            if peer_id not in current and old["state"] != "leaving":
                # a peer that said "leaving" was already reported; its record expiring is expected
                events.append(Event(at, "left", f"{old['name']} vanished{_where(old)} (record expired)"))

        now_round = self.plan_round()
        if now_round is not None and (before_round is None or now_round > before_round):
            totals = self.totals()
            events.append(Event(at, "round", f"planning round {now_round} adopted: "
                                             f"{totals.clusters} cluster(s), {totals.standby} standby"))
        else:
            # a new round moves everyone at once; that is reported as the round, not as replacements
            for slot, holder in sorted(self.slot_holders().items()):
                old = self.last_holders.get(slot)
                if old is not None and old["peer_id"] != holder["peer_id"]:
                    events.append(Event(at, "replaced", f"{holder['name']} replaced {old['name']} "
                                                        f"at cluster {slot[0]} stage {slot[1]}"))

        failed = []
        for peer_id, peer in current.items():
            old = previous.get(peer_id)
            if old is not None and (peer.get("averaging_failures") or 0) > (old.get("averaging_failures") or 0):
                failed.append(f"{peer['name']} ({peer['averaging_failures']} so far)")
        if failed:
            events.append(Event(at, "avg-fail", "averaging failed on " + ", ".join(failed)))
        refusing = [f"{peer['name']} ({peer['rejected']} so far)" for peer_id, peer in current.items()
                    if (peer.get("rejected") or 0) > (previous.get(peer_id, {}).get("rejected") or 0)]
        if refusing:
            events.append(Event(at, "rejected", "poisoned or malformed input refused by " + ", ".join(refusing)))
        return events

    # --- derived views ------------------------------------------------------------------------

    def slots(self) -> Dict[Slot, List[Dict]]:
        """Peers by the (cluster, stage) they serve; several only during a handover, newest record first."""
        slots: Dict[Slot, List[Dict]] = {}
        for peer in self.peers:
            slot = placement(peer)
            if slot is not None:
                slots.setdefault(slot, []).append(peer)
        for holders in slots.values():
            holders.sort(key=lambda p: -p.get("time", 0.0))
        return slots

    def slot_holders(self) -> Dict[Slot, Dict]:
        return {slot: holders[0] for slot, holders in self.slots().items()}

    def clusters(self) -> Dict[int, Dict[int, List[Dict]]]:
        """Cluster -> stage -> peers serving it, including the plan's slots that no live peer serves (empty lists)."""
        clusters: Dict[int, Dict[int, List[Dict]]] = {}
        for cluster, stages in enumerate((self.plan or {}).get("clusters", [])):
            for stage in range(len(stages)):
                clusters.setdefault(cluster, {})[stage] = []
        for (cluster, stage), holders in self.slots().items():
            clusters.setdefault(cluster, {})[stage] = holders
        return {k: dict(sorted(stages.items())) for k, stages in sorted(clusters.items())}

    def planned_name(self, slot: Slot) -> Optional[str]:
        """Who the adopted plan put at ``slot``: a live peer's name, else the start of its peer id."""
        clusters = (self.plan or {}).get("clusters", [])
        cluster, stage = slot
        if cluster >= len(clusters) or stage >= len(clusters[cluster]):
            return None
        peer_id = clusters[cluster][stage]["peer_id"]
        names = {p["peer_id"]: p["name"] for p in self.peers}
        return names.get(peer_id, peer_id[:12])

    def unplaced(self) -> List[Dict]:
        """Live peers outside every cluster: standby spares, newcomers still joining, leavers."""
        return [p for p in self.peers if placement(p) is None]

    def plan_round(self) -> Optional[int]:
        rounds = [p["plan_round"] for p in self.peers if p.get("plan_round") is not None]
        if self.plan is not None and self.plan.get("round") is not None:
            rounds.append(self.plan["round"])
        return max(rounds) if rounds else None

    def cluster_samples_per_s(self, stages: Dict[int, List[Dict]]) -> Optional[float]:
        """A cluster's throughput: what its last stage reports, since every sample passes it exactly once."""
        served = [stage for stage, holders in stages.items() if holders]
        return stages[max(served)][0].get("samples_per_s") if served else None

    def totals(self) -> Totals:
        clusters = {k: v for k, v in self.clusters().items() if any(v.values())}
        rates = [self.cluster_samples_per_s(stages) for stages in clusters.values()]
        return Totals(
            peers=len(self.peers),
            clusters=len(clusters),
            standby=len(self.unplaced()),
            samples_per_s=sum(r for r in rates if r is not None),
            averaging_done=max((p.get("averaging_rounds") or 0 for p in self.peers), default=0),
            averaging_running=sum(p["state"] == "averaging" for p in self.peers),
            averaging_failures=sum(p.get("averaging_failures") or 0 for p in self.peers),
            plan_round=self.plan_round(),
        )

    # --- persistence --------------------------------------------------------------------------

    def to_json(self) -> Dict:
        """Everything needed to render this state again and to go on diffing from it."""
        return dict(
            run=self.run, max_events=self.max_events, max_losses=self.max_losses, snapshots=self.snapshots,
            at=self.at, peers=self.peers, plan=self.plan,
            losses=[list(point) for point in self.losses], events=[asdict(e) for e in self.events],
            last_holders=[[cluster, stage, holder] for (cluster, stage), holder in sorted(self.last_holders.items())],
        )

    @classmethod
    def from_json(cls, data: Dict) -> "SwarmState":
        state = cls(data.get("run", ""), data["max_events"], data["max_losses"])
        state.snapshots, state.at = data["snapshots"], data["at"]
        state.peers, state.plan = data["peers"], data["plan"]
        state.losses.extend(tuple(point) for point in data["losses"])
        state.events.extend(Event(**e) for e in data["events"])
        state.last_holders = {(cluster, stage): holder for cluster, stage, holder in data["last_holders"]}
        return state

    @classmethod
    def replay(cls, recording: Dict, **options) -> "SwarmState":
        """A state fed every snapshot of a recording: ``{"run": ..., "snapshots": [{"at", "peers", "plan"}]}``."""
        state = cls(recording.get("run", ""), **options)
        for snapshot in recording["snapshots"]:
            state.update(snapshot["peers"], snapshot.get("plan"), snapshot["at"])
        return state


def load_recording(path: str) -> Dict:
    with open(path) as f:
        return json.load(f)


def _where(peer: Dict) -> str:
    slot = placement(peer)
    return "" if slot is None else f" at cluster {slot[0]} stage {slot[1]}"
