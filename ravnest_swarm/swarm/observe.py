"""What ``status`` and the dashboards read from the DHT: the run's summary, and the peer records they show.

A run's peer records spread over buckets (``membership/buckets.py``), up to 256 keys at 10,000 peers, and the
run's summary adds up every bucket's counts. ``status`` reads the summary and every bucket at once, and every
bucket again only where it found fewer peers than the summaries count (:func:`read_status`); the figures it shows
are counted from the records themselves. A dashboard redraws
every period for as long as it is up, so in a run of more than :data:`FULL_READ_BUCKETS` buckets it reads
(:class:`SnapshotReader`) the summary, the viewer's own bucket, the buckets of its pipeline and ring neighbours
(from the plan it follows), and :data:`ROTATING_BUCKETS` more in turn: a bounded read whatever the run's size,
which still meets every bucket within a few dozen periods, so the slowest and failing clusters it shows are found
among all of them.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Dict, Iterable, List, Optional, Set, Tuple

from hivemind.dht.node import DHTNode
from hivemind.utils.timed_storage import get_dht_time

from ravnest_swarm.dashboard.focus import FULL_READ_BUCKETS  # as the peers' own views (announcer.FULL_VIEW_BUCKETS)
from ravnest_swarm.membership.buckets import add_up, bucket_of, confirmed, counts_named, totals
from ravnest_swarm.membership.identity import node_refusals
from ravnest_swarm.membership.reader import (RECORD_SNAPSHOTS_ENV, adopted_plan, plan_digest, read_bucket_counts,
                                             read_buckets, read_plans, read_summaries)
from ravnest_swarm.membership.view import PeerView

# beyond, each redraw also reads this many buckets in turn: 256 buckets are all met within 32 redraws (160 s at
# join's 5 s), well inside a record's lifetime at that size (three heartbeats of 100 s: membership/view.py)
ROTATING_BUCKETS = 8


async def _look(node: DHTNode, run: str, view: PeerView) -> List[Dict]:
    """Every bucket of every bucket count a summary names, merged into ``view``; the summaries read."""
    summaries, entries = await read_bucket_counts(node, run, {1: None})
    view.merge(entries)
    more = {count: None for count in counts_named(summaries) if count > 1}
    if more:
        view.merge((await read_bucket_counts(node, run, more, with_summaries=False))[1])
    return summaries


async def read_status(node: DHTNode, run: str) -> Tuple[Optional[Dict], List[Dict]]:
    """The run's totals counted from the peer records read (``buckets.totals``; None without any record) and every
    live peer record found, the newest copy of each, sorted by name.

    Reads every bucket of every bucket count a summary names, then, where that found fewer peers than the
    summaries of the run's own peers count (or there is no such summary to tell), all of them once more (one read
    can miss records that a DHT node did not answer in time). Not two looks always: checking a record's schema
    costs milliseconds (membership/records.py), so a look at 10,000 records costs seconds of CPU. A summary
    counts nothing but where to look: anyone can write one, and 256 forged summaries made ``status`` show a run
    of 10,240 peers that did not exist. The totals say how many summaries were ignored (``ignored_summaries``:
    their writer's record is not in the bucket they summarize)."""
    view = PeerView()
    summaries = await _look(node, run, view)
    counted = add_up(confirmed(summaries, view.records(get_dht_time())))
    if counted is None or len(view.members(get_dht_time())) < counted["peers"]:
        summaries = await _look(node, run, view)
    records = view.records(get_dht_time())
    if not records:
        return None, records
    trusted = confirmed(summaries, records)
    counted = add_up(trusted)
    return dict(totals(records, counted["buckets"] if counted else 1, get_dht_time()),
                ignored_summaries=len(summaries) - len(trusted)), records


def neighbour_ids(plan: Optional[Dict], peer_id: str) -> Set[str]:
    """The peers ``peer_id`` works with under ``plan``: its cluster's other stages (its pipeline), and the same
    stage in the clusters just before and after its own (its neighbours in the averaging rings' order)."""
    clusters = (plan or {}).get("clusters", [])
    for index, cluster in enumerate(clusters):
        stages = [entry["peer_id"] for entry in cluster]
        if peer_id in stages:
            stage = stages.index(peer_id)
            around = [clusters[(index + step) % len(clusters)] for step in (-1, 1)]
            return set(stages) | {other[stage]["peer_id"] for other in around if stage < len(other)}
    return set()


class SnapshotReader:
    """Reads a dashboard's snapshots, ``{"run", "at", "peers", "plan", "summary"}`` (``SwarmState.feed``).

    With ``RAVNEST_RECORD_SNAPSHOTS=FILE`` every snapshot is also appended to FILE as a JSON line, the recording the
    dashboard test replays (docs/dashboard.md).

    :param viewer: the peer id of the volunteer whose dashboard this is (None: an observer, ``status --watch``)
    :param with_plan: whether snapshots hold the adopted plan (``join --no-dashboard``'s log lines need none, and
        without it a large run's reader knows no neighbours: it reads the viewer's bucket and buckets in turn)
    """

    def __init__(self, node: DHTNode, run: str, viewer: Optional[str] = None, with_plan: bool = True):
        self.node, self.run, self.viewer, self.with_plan = node, run, viewer, with_plan
        self.view = PeerView()  # kept between reads: a bucket read in turn stays shown until its records expire
        self.plan: Optional[Dict] = None
        self.turn = 0  # the next bucket read in turn

    def buckets_to_read(self, buckets: int) -> List[int]:
        """The buckets of a run of ``buckets`` that the next snapshot reads (every one in a small run)."""
        if buckets <= FULL_READ_BUCKETS:
            return list(range(buckets))
        wanted = {bucket_of(peer_id, buckets) for peer_id in self._viewers_peers()}
        wanted.update((self.turn + offset) % buckets for offset in range(ROTATING_BUCKETS))
        self.turn = (self.turn + ROTATING_BUCKETS) % buckets
        return sorted(wanted)

    def _viewers_peers(self) -> Iterable[str]:
        if self.viewer is None:
            return []
        return {self.viewer} | neighbour_ids(self.plan, self.viewer)

    def _followed_plan(self, plans: List[Dict], peers: List[Dict]) -> Optional[Dict]:
        """The plan the viewer's own record says it follows (its round, placing it at its slot), where the peers
        read are too few to confirm any plan (a large run read in part): it names the viewer's neighbours."""
        own = next((p for p in peers if p["peer_id"] == self.viewer and p.get("plan_round") is not None), None)
        if own is None or own.get("cluster") is None or own.get("stage") is None:
            return None
        cluster, stage = own["cluster"], own["stage"]
        for plan in plans:
            clusters = plan["clusters"]
            if plan["round"] == own["plan_round"] and 0 <= cluster < len(clusters) and \
                    0 <= stage < len(clusters[cluster]) and clusters[cluster][stage]["peer_id"] == self.viewer and \
                    own.get("plan_digest") in (None, plan_digest(plan)):  # not a stranger's copy that places it alike
                return plan
        return None

    async def _plans(self) -> List[Dict]:
        return await read_plans(self.node, self.run) if self.with_plan else []

    async def snapshot(self) -> Dict:
        summaries, plans, small_run = await asyncio.gather(read_summaries(self.node, self.run), self._plans(),
                                                           read_buckets(self.node, self.run, 1))
        self.view.merge(small_run)
        for count in counts_named(summaries):
            if count > 1:
                self.view.merge(await read_buckets(self.node, self.run, count, self.buckets_to_read(count)))
        peers = self.view.records(get_dht_time())
        # the buckets not read this time are counted by the summaries of their own peers, as a record read earlier
        # and still live confirms them; anyone else's count nothing
        summary = add_up(confirmed(summaries, peers))
        plan = adopted_plan(plans, peers)
        followed = plan if plan is not None else self._followed_plan(plans, peers)
        if followed is not None and (self.plan is None or followed["round"] >= self.plan["round"]):
            self.plan = followed
        snapshot = dict(run=self.run, at=time.time(), peers=peers, plan=plan, summary=summary,
                        refused=node_refusals(self.node))
        recording = os.environ.get(RECORD_SNAPSHOTS_ENV)
        if recording:
            with open(recording, "a") as f:
                f.write(json.dumps(snapshot) + "\n")
        return snapshot
