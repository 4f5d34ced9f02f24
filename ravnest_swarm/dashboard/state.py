"""What the dashboard knows about a swarm, derived from successive snapshots of the peer records.

The dashboard is fed snapshots of the run's peer records, the adopted ``{run}_plan`` record when there
is one, and the run's summary (``{run}_summary``: every bucket's counts added up, ``membership/buckets.py``);
``swarm.observe.SnapshotReader`` reads them, the dashboard never touches the network. In a large run a
snapshot holds only some of the peer records (the viewer's bucket, its neighbours', a few more in turn):
the summary says how many there are in all. Everything it shows is derived here from those snapshots:
the cluster map, the standby peers, the totals, a loss history and the events between two snapshots.
Memory stays bounded whatever the run's length: one snapshot is kept for diffing, the loss history and
the events are fixed-length deques, and the names of peers seen are capped.

A DHT read can miss records (a node that holds some of them did not answer in time, which a busy
machine makes common): a read is merged into what is known, and a record missing from it stays until
its own expiration time passes. So a peer vanishes only when its record really expired.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Callable, Deque, Dict, Iterable, List, Optional, Set, Tuple

from ravnest_swarm.membership.progress import TRAINING_STATES, run_finished

Slot = Tuple[int, int]  # (cluster, stage)
# a volunteer's record ``note`` says what last went wrong, starting with one of these
AVERAGING_NOTE = "averaging"
REFUSAL_NOTE = "refused"
DIVERGED_NOTE = "diverged"

EVENT_KINDS = ("start", "joined", "left", "replaced", "round", "avg-fail", "rejected", "diverged")
# a peer's counter that grew: (field, event kind, text, its note's kind, only for a peer seen before: a joiner's)
COUNTED_EVENTS = (("averaging_failures", "avg-fail", "averaging failed on", AVERAGING_NOTE, True),
                  ("rejected", "rejected", "poisoned or malformed input refused by", REFUSAL_NOTE, False),
                  ("divergences", "diverged", "training diverged and restored on", DIVERGED_NOTE, False))
# beyond this many peers joining (or vanishing) in one snapshot, one event counts them: each bucket read in turn
PEER_EVENTS = 8


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
    :param clusters: the adopted plan's clusters (without a plan: clusters with at least one placed peer)
    :param placed: live peers the adopted plan places (without a plan: live peers that report a slot)
    :param standby: live peers the adopted plan leaves out, leaving ones not counted (a round's event said
        ``1 standby`` for a peer that had just left its slot); without a plan: live peers that report no slot
    :param samples_per_s: sum over clusters of the last stage's ``samples_per_s``
    :param averaging_done: highest ``averaging_rounds`` any peer reports (rounds it averaged in full)
    :param averaging_running: peers in state ``averaging`` now
    :param averaging_failures: highest ``averaging_failures`` any peer reports (rounds in which one of its
        rings failed), so that it compares with ``averaging_done``
    :param plan_round: highest planning round seen in the plan record or any peer record
    """

    peers: int
    clusters: int
    placed: int
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
    :param max_names: names of peers seen kept (to name a planned slot whose peer is gone), oldest dropped first
    :param steps: the run's length (its spec's), to tell when the run is finished; None: not known
    """

    def __init__(self, run: str = "", max_events: int = 200, max_losses: int = 240, max_names: int = 4096,
                 steps: Optional[int] = None):
        self.run, self.steps, self.ended = run, steps, False  # ended: its owner signed its end into its spec
        self.refused: Dict[str, int] = {}  # records the observer's validator refused, by reason (membership/identity.py)
        self.max_events, self.max_losses, self.max_names = max_events, max_losses, max_names
        self.events: Deque[Event] = deque(maxlen=max_events)
        self.losses: Deque[Tuple[float, float]] = deque(maxlen=max_losses)  # (at, mean loss)
        self.peers: List[Dict] = []
        self.plan: Optional[Dict] = None
        self.summary: Optional[Dict] = None  # the run's totals (membership.buckets.add_up), the last one read
        self.at, self.snapshots = None, 0  # the last snapshot's time, and how many were fed
        # the last peer seen at each slot, kept while the slot is vacant, so a stand-in that arrives after
        # the old holder's record expired still counts as a replacement; reset by every new round
        self.last_holders: Dict[Slot, Dict] = {}
        self.expiry: Dict[str, float] = {}  # peer id -> wall-clock time its known record expires
        self.names: Dict[str, str] = {}  # peer id -> name, most recently seen last
        # the slots, cluster map and totals of the latest snapshot, derived once (by name): a large run's update
        # and redraw ask for them often
        self._derived: Dict[str, Any] = {}

    @property
    def finished(self) -> bool:
        """Its owner ended the run, or every placed peer reached its length (``progress.run_finished``)."""
        return self.ended or (self.steps is not None and run_finished(self.peers, self.steps))

    # --- feeding -------------------------------------------------------------------------------

    def feed(self, snapshot: Dict) -> List[Event]:
        """Take one snapshot as ``swarm.observe.SnapshotReader`` makes it and recordings hold it:
        ``{"run", "at", "peers", "plan", "summary", "refused"}`` (see :meth:`update`; old recordings lack the last
        two), and from ``status --watch`` the spec's ``"steps"`` and ``"finished"`` (signed by its owner)."""
        if snapshot.get("steps") is not None:
            self.steps = snapshot["steps"]
        self.ended, self.refused = self.ended or bool(snapshot.get("finished")), snapshot.get("refused") or self.refused
        return self.update(snapshot["peers"], snapshot.get("plan"), snapshot["at"], snapshot.get("summary"))

    def update(self, peers: Iterable[Dict], plan: Optional[Dict] = None, at: Optional[float] = None,
               summary: Optional[Dict] = None) -> List[Event]:
        """Take a new snapshot; returns the events it caused (also appended to :attr:`events`).

        :param peers: peer records as ``read_peers`` returns them (dicts). With ``expires_in`` (seconds
            until the record expires) a record that a later read misses stays until then; without it, it
            is gone from the next snapshot that lacks it
        :param plan: the adopted plan record, or None when the read found none (the last one known stays,
            as does a newer one than an older round read from a lagging node)
        :param at: wall-clock time of the snapshot; now when omitted (recordings pass their own)
        :param summary: the run's totals (``membership.buckets.add_up``), or None when the read found none (the
            last one known stays)
        """
        at = time.time() if at is None else at
        before_round, before_adopted = self.plan_round(), self.adopted_round()
        previous = {p["peer_id"]: p for p in self.peers}
        first = self.snapshots == 0
        self.peers = self._merge(peers, previous, at)
        self._derived = {}
        if plan is not None and (self.plan is None or plan["round"] >= self.plan["round"]):
            self.plan = plan
            self._derived = {}
        if summary is not None:
            self.summary = summary
        self.at = at
        self.snapshots += 1

        new_events = []
        if first:
            totals = self.totals()
            new_events.append(Event(at, "start", f"watching {totals.peers} peer(s) in {totals.clusters} cluster(s)"))
        else:
            new_events += self._diff(previous, before_round, before_adopted, at)
        self.events.extend(new_events)
        if self.plan_round() != before_round:
            self.last_holders = {}
        self.last_holders.update({slot: dict(peer_id=p["peer_id"], name=p["name"])
                                  for slot, p in self.slot_holders().items()})

        losses = [p["loss"] for p in self.peers if p.get("loss") is not None and p["state"] in TRAINING_STATES]
        if losses:
            self.losses.append((at, sum(losses) / len(losses)))
        return new_events

    def _merge(self, read: Iterable[Dict], known: Dict[str, Dict], at: float) -> List[Dict]:
        """The live records after a read: what it found, except a copy older than the record known (a node
        that missed the last renewal), and every known record it missed whose expiration time is still ahead."""
        merged: Dict[str, Dict] = {}
        for record in read:
            peer_id = record["peer_id"]
            old = known.get(peer_id)
            if old is not None and old.get("time", 0.0) > record.get("time", 0.0) and self.expiry.get(peer_id, at) > at:
                merged[peer_id] = dict(old, expires_in=round(self.expiry[peer_id] - at, 1))
                continue
            merged[peer_id] = dict(record)
            if record.get("expires_in") is None:
                self.expiry.pop(peer_id, None)
            else:
                self.expiry[peer_id] = at + record["expires_in"]
        for peer_id, old in known.items():
            if peer_id not in merged and self.expiry.get(peer_id, at) > at:
                merged[peer_id] = dict(old, expires_in=round(self.expiry[peer_id] - at, 1))
        for peer_id in set(self.expiry) - set(merged):
            del self.expiry[peer_id]
        for peer_id, record in merged.items():
            self.names.pop(peer_id, None)
            self.names[peer_id] = record["name"]
        if len(self.names) > self.max_names:  # the oldest dropped at once: one by one is quadratic at 10,000 peers
            self.names = dict(list(self.names.items())[-self.max_names:])
        return sorted(merged.values(), key=lambda p: (p["name"], p["peer_id"]))

    def _diff(self, previous: Dict[str, Dict], before_round: Optional[int], before_adopted: Optional[int],
              at: float) -> List[Event]:
        events = []
        current = {p["peer_id"]: p for p in self.peers}
        joined = [peer for peer_id, peer in current.items() if peer_id not in previous]
        if len(joined) > PEER_EVENTS:
            events.append(Event(at, "joined", f"{len(joined)} peers joined or came into view"))
        else:
            events += [Event(at, "joined", f"{peer['name']} joined ({peer['state']}{_where(peer)})") for peer in joined]
        # standbys and done peers leave when the run is finished; the event says so, as their own logs do
        why = " (the run is finished)" if self.finished else ""
        for peer_id, peer in current.items():
            old = previous.get(peer_id)
            if old is not None and peer["state"] == "leaving" and old["state"] != "leaving":
                events.append(Event(at, "left", f"{peer['name']} is leaving{_where(old)}{why}"))
        # a peer that said "leaving" was already reported; its record expiring is expected
        vanished = [old for peer_id, old in previous.items() if peer_id not in current and old["state"] != "leaving"]
        if len(vanished) > PEER_EVENTS:
            events.append(Event(at, "left", f"{len(vanished)} peers vanished (records expired)"))
        else:
            events += [Event(at, "left", f"{old['name']} vanished{_where(old)} (record expired)") for old in vanished]

        adopted = self.adopted_round()
        if adopted is not None and (before_adopted is None or adopted > before_adopted):
            totals = self.totals()
            events.append(Event(at, "round", f"planning round {adopted} adopted: {totals.clusters} cluster(s), "
                                             f"{totals.placed} placed, {totals.standby} standby"))
        if self.plan_round() == before_round and adopted == before_adopted:
            # a new round moves everyone at once; that is reported as the round, not as replacements
            for slot, holder in sorted(self.slot_holders().items()):
                old = self.last_holders.get(slot)
                if old is not None and old["peer_id"] != holder["peer_id"]:
                    events.append(Event(at, "replaced", f"{holder['name']} replaced {old['name']} "
                                                        f"at cluster {slot[0]} stage {slot[1]}"))

        # one event per peer, with the cause it gives: several at once are usually one ring's members
        for peer_id, peer in current.items():
            old = previous.get(peer_id, {})
            for field, kind, what, note, seen_before in COUNTED_EVENTS:
                if (old or not seen_before) and (peer.get(field) or 0) > (old.get(field) or 0):
                    events.append(Event(at, kind, f"{what} {peer['name']} ({peer[field]} so far){_cause(peer, note)}"))
        return events

    # --- derived views ------------------------------------------------------------------------

    def _once(self, name: str, derive: Callable[[], Any]) -> Any:
        if name not in self._derived:
            self._derived[name] = derive()
        return self._derived[name]

    def slots(self) -> Dict[Slot, List[Dict]]:
        """Peers by the (cluster, stage) they serve; several only during a handover, newest record first.
        Derived once per snapshot, as are :meth:`clusters` and :meth:`totals`: not to be changed by the caller."""
        return self._once("slots", self._derive_slots)

    def _derive_slots(self) -> Dict[Slot, List[Dict]]:
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
        return self._once("clusters", self._derive_clusters)

    def _derive_clusters(self) -> Dict[int, Dict[int, List[Dict]]]:
        clusters: Dict[int, Dict[int, List[Dict]]] = {}
        for cluster, stages in enumerate((self.plan or {}).get("clusters", [])):
            for stage in range(len(stages)):
                clusters.setdefault(cluster, {})[stage] = []
        for (cluster, stage), holders in self.slots().items():
            clusters.setdefault(cluster, {})[stage] = holders
        return {k: dict(sorted(stages.items())) for k, stages in sorted(clusters.items())}

    def planned_ids(self) -> Set[str]:
        """Peer ids the adopted plan places (empty without a plan)."""
        return {stage["peer_id"] for cluster in (self.plan or {}).get("clusters", []) for stage in cluster}

    def planned_peer(self, slot: Slot) -> Optional[Tuple[str, Optional[Dict]]]:
        """Who the adopted plan put at ``slot``: its name (else the start of its peer id, for a peer never seen)
        and its live record (None when it is gone); None when the plan has no such slot."""
        clusters = (self.plan or {}).get("clusters", [])
        cluster, stage = slot
        if cluster >= len(clusters) or stage >= len(clusters[cluster]):
            return None
        peer_id = clusters[cluster][stage]["peer_id"]
        live = next((p for p in self.peers if p["peer_id"] == peer_id), None)
        return self.names.get(peer_id, peer_id[:12]), live

    def unplaced(self) -> List[Dict]:
        """Live peers outside every cluster: those the adopted plan leaves out (standby spares, newcomers,
        leavers), or without a plan those whose record names no slot."""
        if self.plan is None:
            return [p for p in self.peers if placement(p) is None]
        planned = self.planned_ids()
        return [p for p in self.peers if p["peer_id"] not in planned]

    def plan_round(self) -> Optional[int]:
        rounds = [p["plan_round"] for p in self.peers if p.get("plan_round") is not None]
        if self.plan is not None and self.plan.get("round") is not None:
            rounds.append(self.plan["round"])
        return max(rounds) if rounds else None

    def adopted_round(self) -> Optional[int]:
        """The round of the adopted plan record, which a round event announces with the plan's counts. Peers'
        records alone never make one: a peer publishes the round it adopted before it takes its place in it
        (a placed one fetches its layers first), so their counts are the last round's (such an event once said
        ``0 cluster(s), 0 placed, 3 standby`` for a round that placed two). The header's plan round follows the
        peers (:meth:`plan_round`)."""
        return None if self.plan is None else self.plan["round"]

    def cluster_samples_per_s(self, stages: Dict[int, List[Dict]]) -> Optional[float]:
        """A cluster's throughput: what its last stage reports, since every sample passes it exactly once."""
        served = [stage for stage, holders in stages.items() if holders]
        return stages[max(served)][0].get("samples_per_s") if served else None

    def totals(self) -> Totals:
        return self._once("totals", self._derive_totals)

    def _derive_totals(self) -> Totals:
        clusters = {k: v for k, v in self.clusters().items() if any(v.values())}
        rates = [self.cluster_samples_per_s(stages) for stages in clusters.values()]
        unplaced = self.unplaced()
        return Totals(
            peers=len(self.peers),
            clusters=len(clusters) if self.plan is None else len(self.plan["clusters"]),
            placed=len(self.peers) - len(unplaced),
            standby=sum(p["state"] != "leaving" for p in unplaced),
            samples_per_s=sum(r for r in rates if r is not None),
            averaging_done=max((p.get("averaging_rounds") or 0 for p in self.peers), default=0),
            averaging_running=sum(p["state"] == "averaging" for p in self.peers),
            averaging_failures=max((p.get("averaging_failures") or 0 for p in self.peers), default=0),
            plan_round=self.plan_round(),
        )

    # --- persistence --------------------------------------------------------------------------

    def to_json(self) -> Dict:
        """Everything needed to render this state again and to go on diffing from it."""
        return dict(
            run=self.run, steps=self.steps, max_events=self.max_events, max_losses=self.max_losses,
            max_names=self.max_names,
            snapshots=self.snapshots, at=self.at, peers=self.peers, plan=self.plan, summary=self.summary,
            losses=[list(point) for point in self.losses], events=[asdict(e) for e in self.events],
            last_holders=[[cluster, stage, holder] for (cluster, stage), holder in sorted(self.last_holders.items())],
            expiry=self.expiry, names=self.names,
        )

    @classmethod
    def from_json(cls, data: Dict) -> "SwarmState":
        state = cls(data.get("run", ""), data["max_events"], data["max_losses"], data["max_names"], data.get("steps"))
        state.snapshots, state.at = data["snapshots"], data["at"]
        state.peers, state.plan, state.summary = data["peers"], data["plan"], data.get("summary")
        state.losses.extend(tuple(point) for point in data["losses"])
        state.events.extend(Event(**e) for e in data["events"])
        state.last_holders = {(cluster, stage): holder for cluster, stage, holder in data["last_holders"]}
        state.expiry, state.names = dict(data["expiry"]), dict(data["names"])
        return state

    @classmethod
    def replay(cls, snapshots: List[Dict], **options) -> "SwarmState":
        """A state fed every snapshot of a recording (:func:`load_recording`), in order."""
        state = cls(snapshots[0]["run"] if snapshots else "", **options)
        for snapshot in snapshots:
            state.feed(snapshot)
        return state


def load_recording(path: str) -> List[Dict]:
    """The snapshots of a recording: one JSON object a line, as ``RAVNEST_RECORD_SNAPSHOTS`` writes them."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _where(peer: Dict) -> str:
    slot = placement(peer)
    return "" if slot is None else f" at cluster {slot[0]} stage {slot[1]}"


def _cause(peer: Dict, kind: str) -> str:
    """The cause a peer gives in its record's ``note`` for the last failure or refusal it saw (without the
    ``kind`` the note starts with), or nothing when its note is of another kind."""
    note = peer.get("note") or ""
    return f": {note[len(kind):].lstrip(' :')}" if note.startswith(kind) else ""
