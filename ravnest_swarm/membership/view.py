"""Who is in the run, as one reader sees it: the view rule, and the timing that adapts to the swarm's size.

Pure: no network; the DHT times are passed in, so the rule is tested exactly (``tests/test_view_rule.py``) and the
membership simulation (``bench/simulation.py``) drives this same code.

The rule (docs/records.md, "Views"):

* a peer enters the view with the first record of it that a read finds, and stays until that record expires, even
  when later reads miss it: a read that did not reach the DHT node holding the renewal, or a renewal that came late,
  must not make a peer flicker out of everyone's view;
* a newer record (greater ``time``) replaces an older one of the same writer; an older copy still held by a slow DHT
  node never wins;
* ``leaving`` removes the peer at once; the leaving record is kept until it expires, so an older copy of the peer's
  training record cannot bring it back;
* a peer that comes back with the same identity (peer id) publishes a record newer than its leaving one, and is back.

Records are kept per peer id and writer (the record's signed subkey). Every node refuses a record whose writer is
not the peer it names (``membership/identity.py``), so a stranger's ``leaving`` record naming an honest peer never
reaches a view; keeping writers apart still holds where a reader got one anyway (a record under a prefixed subkey
of the same writer, a copy kept from before a peer's key changed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Tuple

# Up to this many peers, records renew every base heartbeat; beyond it, heartbeats slow in proportion, so that the
# stores and gets each DHT node serves per second stay bounded as the swarm grows (docs/benchmarks.md, simulation).
PEERS_AT_BASE_HEARTBEAT = 500
# A record outlives its renewal by three heartbeats: one renewal lost or late (seconds of DHT latency on the
# internet) and the next still arrives before the record expires.
LIFETIME_HEARTBEATS = 3.0
# How long after its own ``time`` a record counts at most, whatever expiration its writer stored it with: one stored
# to expire in a year kept its writer alive in every view and plan after it had gone (a review). An honest renewal
# lives three heartbeats: six hours is a heartbeat of two hours (720,000 peers at join's 5 s, 6,000 at its most).
MAX_RECORD_LIFETIME_S = 6 * 3600.0
# How far ahead of the reader's clock a record's ``time`` may be (a clock an hour fast still counts): a record dated
# further ahead would outlive the cap above
MAX_CLOCK_LEAD_S = 3600.0


@dataclass(frozen=True)
class Timing:
    """How often a peer renews its record, and how long each renewal lives (seconds)."""

    heartbeat: float
    lifetime: float


def timing_for(peers: int, base_heartbeat: float) -> Timing:
    """The timing for a swarm of about ``peers`` peers: the base heartbeat up to :data:`PEERS_AT_BASE_HEARTBEAT`
    peers, slower in proportion beyond."""
    heartbeat = base_heartbeat * max(1.0, peers / PEERS_AT_BASE_HEARTBEAT)
    return Timing(heartbeat=heartbeat, lifetime=LIFETIME_HEARTBEATS * heartbeat)


@dataclass
class _Seen:
    record: Dict
    expiration: float  # DHT time at which this record stops counting


class PeerView:
    """One reader's view of a run's peers, built from the records its reads find (the rule above)."""

    def __init__(self):
        self._seen: Dict[Tuple[str, Any], _Seen] = {}

    def merge(self, found: Iterable[Tuple[Any, Dict, float]]) -> None:
        """Take what a read found: ``(writer, record, expiration)``, records as the schema validated them (the
        writer: the subkey a record was signed under)."""
        for writer, record, expiration in found:
            expiration = min(expiration, record["time"] + MAX_RECORD_LIFETIME_S)
            slot = (record["peer_id"], writer)
            known = self._seen.get(slot)
            if known is None or record["time"] > known.record["time"] or (
                    record["time"] == known.record["time"] and expiration > known.expiration):
                self._seen[slot] = _Seen(record, expiration)

    def forget_expired(self, now: float) -> None:
        self._seen = {slot: seen for slot, seen in self._seen.items() if seen.expiration > now}

    def records(self, now: float, alive_at: Optional[float] = None) -> List[Dict]:
        """One record per peer: the newest of those not ``leaving``, else its ``leaving`` one (a dashboard shows
        who is leaving); each with ``expires_in`` (seconds), sorted by name.

        :param alive_at: only records still valid at this DHT time (a planning round's view of who is alive)
        """
        self.forget_expired(now)
        cutoff = now if alive_at is None else max(now, alive_at)
        shown: Dict[str, _Seen] = {}
        for (peer_id, _), seen in self._seen.items():
            if seen.expiration <= cutoff or seen.record["time"] > now + MAX_CLOCK_LEAD_S:
                continue
            known = shown.get(peer_id)
            rank = (seen.record["state"] != "leaving", seen.record["time"])
            if known is None or rank > (known.record["state"] != "leaving", known.record["time"]):
                shown[peer_id] = seen
        found = [dict(seen.record, expires_in=round(seen.expiration - now, 1)) for seen in shown.values()]
        return sorted(found, key=lambda record: (record["name"], record["peer_id"]))

    def members(self, now: float) -> List[Dict]:
        """The peers in the run: those with an unexpired record that is not ``leaving``."""
        return [record for record in self.records(now) if record["state"] != "leaving"]

    def __len__(self) -> int:
        return len(self._seen)
