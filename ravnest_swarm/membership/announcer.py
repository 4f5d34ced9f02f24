"""Publishing this peer's record in its bucket of ``{run}_peers``, and keeping its view of the run.

Every heartbeat a peer renews its record and, side by side, reads the buckets it keeps a view of (all of them in a
run of at most :data:`FULL_VIEW_BUCKETS` buckets, else its own; at every bucket count the summaries say is in use),
writes its bucket's summary when it is the bucket's writer, and moves to another bucket count when its own bucket
says the swarm grew or shrank (``membership/buckets.py``). Its heartbeat slows as the swarm grows
(``membership/view.py``, :func:`timing_for`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Dict, Iterable, List, Optional, Set, Tuple

from hivemind.dht.node import DHTNode
from hivemind.utils.timed_storage import get_dht_time

from ravnest_swarm import __version__
from ravnest_swarm.devices import peak_memory
from ravnest_swarm.membership.buckets import (BUCKET_COUNTS, bucket_count_for, bucket_of, next_bucket_count, summarize,
                                              writes_summary)
from ravnest_swarm.membership.capabilities import Capabilities
from ravnest_swarm.membership.reader import read_bucket_counts, read_peers, read_summary
from ravnest_swarm.membership.own_record import RecordError, publishable
from ravnest_swarm.membership.records import (peers_key, signing_validator, summary_key,
                                              summary_subkey_prefix)
from ravnest_swarm.membership.tickets import admitted
from ravnest_swarm.membership.view import PeerView, Timing, timing_for
from ravnest_swarm.net.node import store_record

logger = logging.getLogger(__name__)

# Up to this many buckets (256 peers) every peer reads them all each heartbeat and knows everyone; beyond, it reads
# its own bucket, and the buckets of the peers it works with when it needs them (``read_peers(peer_ids=...)``).
FULL_VIEW_BUCKETS = 4
# Beyond FULL_VIEW_BUCKETS, a peer reads the summaries (which bucket counts are in use) every this many heartbeats,
# not every one: at 1,000 peers every peer reading them each heartbeat made the summary key's holders serve
# 5,279 RPCs a second in the simulation (docs/benchmarks.md); counts in use change over lifetimes, not heartbeats
SUMMARY_EVERY = 10
# A record is fresh when renewed within this many heartbeats: its writer is surely alive (a late renewal included)
FRESH_HEARTBEATS = 1.5
# A renewal that failed is tried again after this many seconds, not a heartbeat later: the record must be renewed
# before it expires, or everyone's view loses a peer that is still there
RENEWAL_RETRY_S = 1.0


class PeerAnnouncer:
    """Keeps this peer's signed record alive in the DHT, and its view of the run's peers.

    The record expires one lifetime (three heartbeats) after each renewal, so a peer that dies vanishes from
    everyone's view without anyone having to notice, and one renewal that comes late removes nobody.

    :param node: this peer's DHT node (its validators must include the run's)
    :param run: run name
    :param name: human-readable peer name
    :param capabilities: measured or overridden capabilities
    :param heartbeat: seconds between renewals in a swarm of up to ``view.PEERS_AT_BASE_HEARTBEAT`` peers
    :param store: how a record is stored (:func:`~ravnest_swarm.net.node.store_record`); with ``clock``, what the
        membership simulation (``bench/simulation.py``) replaces to drive this code under virtual time
    :param clock: DHT time, which records' ``time`` and expirations are taken from
    """

    def __init__(self, node: DHTNode, run: str, name: str, capabilities: Capabilities, heartbeat: float = 5.0, *,
                 store: Callable[..., Awaitable[bool]] = store_record, clock: Callable[[], float] = get_dht_time):
        self.node, self.run, self.base_heartbeat = node, run, heartbeat
        self.store, self.clock = store, clock
        # the key the node signs with: a process's own key for ``join``, each light peer's own in a bench
        self.subkey = signing_validator(node).local_public_key
        self.peer_id = node.peer_id.to_base58()
        self.record: Dict = dict(
            peer_id=self.peer_id,
            name=name,
            state="joining",
            version=__version__,
            maddrs=[],
            **capabilities.as_dict(),
        )
        self.view = PeerView()
        self.timing: Timing = timing_for(1, heartbeat)
        self.buckets = 1
        self._moved_from: Optional[Tuple[int, float]] = None  # (bucket count, DHT time until which we write there)
        self._counts_in_use: Set[int] = set()  # other bucket counts the last summaries we read named
        self._refreshes = 0
        self._has_read = False  # whether a read of the run's records has come back yet
        # (the count our bucket calls for, since when it has called for it without a pause)
        self._calls_for: Optional[Tuple[int, float]] = None
        # one store of our record at a time: a node keeps the value that expires last, so of two renewals in flight
        # (the heartbeat's and one at once, such as a new averaging round named) the one stored second was refused
        # whenever it had taken its expiration first, and the renewal "failed" (the NAT lab run saw it)
        self._publishing = asyncio.Lock()
        self.renewal_failures = 0  # renewals that failed, for any reason, since we started
        self.renewal_problem: Optional[str] = None  # why renewals fail, once said (renew); None once one succeeded
        self._failing_since: Optional[float] = None  # (event loop time) the first of the renewals failing in a row
        # told of each change of ``renewal_problem`` (a reason, or None when renewals work again): the volunteer
        # says it in its log and on its dashboard, so a record that cannot be renewed is never a silent vanishing
        self.on_renewal_problem: Optional[Callable[[Optional[str]], None]] = None

    @property
    def heartbeat(self) -> float:
        return self.timing.heartbeat

    def update(self, **fields) -> None:
        self.record.update(fields)

    async def find_bucket_count(self) -> None:
        """Start at the bucket count the run's summary names (a joiner of a large run must not write to the
        one-bucket key that nobody reads)."""
        summary = await read_summary(self.node, self.run, self.clock())
        if summary is not None:
            # a summary that misses a bucket (its writer just died; another takes over within a heartbeat or so)
            # counts only part of the run: scaled up, and never below the bucket count the run uses, or a joiner
            # would start at too few buckets, write where nobody reads, and from there see too few to move
            peers = summary["peers"] * summary["buckets"] / max(1, summary["buckets_summarized"]) + 1
            self.buckets = max(summary["buckets"], bucket_count_for(round(peers)))
            # the timing follows our own view from the first read on (refresh_view), not the summary's claim: a
            # stranger's summary of 10,000 peers set a joiner's first renewal 100 s away

    def bucket_counts_in_use(self) -> List[int]:
        """The bucket counts the run's records are at, as of our last read: ours, and any other a summary named
        (``reader.read_peers(bucket_counts=...)``: a trainer's reads of its partners skip the summary)."""
        return [self.buckets, *sorted(self._counts_in_use - {self.buckets})]

    async def read_peers(self, alive_at: Optional[float] = None,
                         peer_ids: Optional[Iterable[str]] = None) -> List[Dict]:
        """The run's live peer records (``reader.read_peers``) at :meth:`bucket_counts_in_use`, for a peer of the
        run: our own count is never one a summary named. Anyone can write summaries, and a reader that took the
        count from them alone read where a stranger said: 256 forged summaries won ``add_up``'s tie against a run
        of 2 buckets, and such a reader read 256 empty buckets and none of the run's."""
        return await read_peers(self.node, self.run, alive_at=alive_at, peer_ids=peer_ids,
                                bucket_counts=self.bucket_counts_in_use())

    def _bucket_counts(self) -> List[int]:
        """The bucket counts we write our record at: ours, and the one we moved from for one lifetime."""
        if self._moved_from is not None and self._moved_from[1] > self.clock():
            return [self.buckets, self._moved_from[0]]
        return [self.buckets]

    async def publish(self, lifetime: Optional[float] = None) -> bool:
        """Store the record now; returns whether at least one DHT node accepted it."""
        async with self._publishing:
            return await self._publish(lifetime)

    async def _publish(self, lifetime: Optional[float]) -> bool:
        self.record["time"] = self.clock()
        # measured, not declared: what this process has taken at most so far, renewed with every record
        self.record["peak_memory_gb"], self.record["device_peak_gb"] = peak_memory(self.record.get("device") or "cpu")
        # the schema validator compares the stored dict with its parsed form, so absent optionals go as None; a
        # figure out of its bounds goes clamped and named in ``out_of_range``, never as a renewal that fails
        value = publishable(self.record)
        expiration = self.clock() + (lifetime if lifetime is not None else self.timing.lifetime)
        stored = await asyncio.gather(*(
            self.store(self.node, peers_key(self.run, buckets, bucket_of(self.peer_id, buckets)), value,
                       expiration, subkey=self.subkey) for buckets in self._bucket_counts()))
        return stored[0]  # where readers of our bucket count look; the bucket we moved from is a courtesy

    def _buckets_read(self, count: int) -> Optional[List[int]]:
        """Which buckets of ``count`` we read: all of them while we know everyone, else the one that holds us."""
        if self.buckets <= FULL_VIEW_BUCKETS and count <= FULL_VIEW_BUCKETS:
            return None
        return [bucket_of(self.peer_id, count)]

    async def refresh_view(self) -> None:
        """Read the buckets we keep a view of, write our bucket's summary if it falls to us, and move to
        another bucket count when our own bucket says the swarm grew or shrank.

        Each peer moves on what its own bucket holds, so while a swarm splits or merges some peers write at another
        bucket count than ours: a reader of its own count alone lost them (a bucket of 60 taken past 64 by churn
        split in two while the other bucket stayed, and neither half saw the other). So we read, with our own
        count's buckets, the summaries, and then the buckets of every other count a summary says is in use.
        """
        buckets, own = self.buckets, bucket_of(self.peer_id, self.buckets)
        with_summaries = buckets <= FULL_VIEW_BUCKETS or self._refreshes % SUMMARY_EVERY == 0
        self._refreshes += 1
        summaries, entries = await read_bucket_counts(self.node, self.run, {buckets: self._buckets_read(buckets)},
                                                      with_summaries=with_summaries)
        if with_summaries:
            self._counts_in_use = {summary["buckets"] for summary in summaries if summary["buckets"] in BUCKET_COUNTS}
        others = self._counts_in_use - {buckets}
        if others:
            entries += (await read_bucket_counts(self.node, self.run,
                                                 {count: self._buckets_read(count) for count in others}))[1]
        self.view.merge(entries)
        self._has_read = True
        now = self.clock()
        members = admitted(self.node, self.view.members(now))
        own_members = [r for r in members if bucket_of(r["peer_id"], buckets) == own]
        if writes_summary(self.peer_id, own_members):
            await self.store(self.node, summary_key(self.run), summarize(buckets, own, own_members, now, self.peer_id),
                             now + self.timing.lifetime, subkey=summary_subkey_prefix(buckets, own) + self.subkey)
        renewed_within = FRESH_HEARTBEATS * self.timing.heartbeat
        fresh = sum(record["expires_in"] >= self.timing.lifetime - renewed_within for record in own_members)
        wanted = next_bucket_count(buckets, len(own_members), fresh)
        # a move waits until the bucket has called for it for a lifetime: a swarm that grew or shrank stays so, while
        # a moment of churn passes (a killed peer renewed just before, its replacement already in: a split for no
        # growth), and so do a joiner's first reads that came back thin (lost RPCs): merging at once, 9 of the 100
        # joiners after churn at 1,000 simulated peers fell from 16 or 32 buckets to 8 and 4
        if wanted == buckets:
            self._calls_for = None
        elif self._calls_for is None or self._calls_for[0] != wanted:
            self._calls_for = (wanted, now)
        moved = wanted if self._calls_for is not None and now - self._calls_for[1] >= self.timing.lifetime else buckets
        if moved != buckets:
            logger.info(f"{len(own_members)} peer(s) in our bucket of {buckets}: moving to {moved} bucket(s)")
            self._moved_from, self.buckets = (buckets, now + self.timing.lifetime), moved
        estimate = len(members) if buckets <= FULL_VIEW_BUCKETS else len(own_members) * buckets
        self.timing = timing_for(estimate, self.base_heartbeat)

    def members(self) -> List[Dict]:
        """The peers in our view now (``PeerView.members``), those with a valid ticket in an invite-only run."""
        return admitted(self.node, self.view.members(self.clock()))

    def records(self) -> Optional[List[Dict]]:
        """The records in our view now, ``leaving`` ones included (``PeerView.records``): what ``join`` logs.
        None until our first read has come back: an empty view then is not a run of nobody."""
        return admitted(self.node, self.view.records(self.clock())) if self._has_read else None

    async def heartbeat_forever(self) -> None:
        """Renew our record and refresh our view, each every heartbeat, side by side: one after the other, a read
        that waited on lost RPCs (3 s each) delayed the next renewal, and in the simulation renewals at 2 % loss came
        11 s apart at worst against a 5 s heartbeat."""
        await asyncio.gather(self._renew_forever(),
                             self._every_heartbeat(self.refresh_view, "reading the run's peer records"))

    async def renew(self, lifetime: Optional[float] = None) -> bool:
        """:meth:`publish` that never raises; whether the record was stored. A failure is counted and logged. It is
        an error, passed on (``on_renewal_problem``), where the record cannot be made valid (our own bug: no retry
        mends it) or where renewals have failed for a heartbeat: the record lives three, and a DHT that accepts it
        again at the retry :data:`RENEWAL_RETRY_S` later (a joiner's first store as its connections form, on a
        loaded NAT lab) lost nobody anything, so that one is a warning."""
        now = asyncio.get_running_loop().time()
        lasting = False
        try:
            problem = None if await self.publish(lifetime) else "no DHT node accepted it"
        except RecordError as e:
            problem, lasting = str(e), True
        except Exception as e:
            problem = f"{type(e).__name__}: {e}"
        if problem is None:
            self._failing_since = None
        else:
            self.renewal_failures += 1
            self._failing_since = now if self._failing_since is None else self._failing_since
            lasting = lasting or now - self._failing_since >= self.heartbeat
            (logger.error if lasting else logger.warning)(
                f"renewing our peer record failed ({problem}); trying again in {RENEWAL_RETRY_S:.0f}s")
        said = problem if problem is None or lasting else self.renewal_problem
        if said != self.renewal_problem:
            self.renewal_problem = said
            if self.on_renewal_problem is not None:
                self.on_renewal_problem(said)
        return problem is None

    async def _renew_forever(self) -> None:
        """Renew our record every heartbeat; after a renewal that failed, every :data:`RENEWAL_RETRY_S` until one
        works."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            wait = self.heartbeat if await self.renew() else RENEWAL_RETRY_S
            await asyncio.sleep(max(0.0, wait - (loop.time() - started)))

    async def _every_heartbeat(self, work: Callable[[], Awaitable[None]], what: str) -> None:
        loop = asyncio.get_running_loop()  # virtual time in the simulation
        while True:
            started = loop.time()
            try:
                await work()
            except Exception as e:  # a transient DHT error must not stop the heartbeats
                logger.warning(f"{what} failed: {e}")
            # every heartbeat from the last one's start: a store that took seconds (a busy machine, a slow DHT
            # node) must not stretch the gap between renewals past the record's lifetime
            await asyncio.sleep(max(0.0, self.heartbeat - (loop.time() - started)))

    async def leave(self) -> None:
        """Say ``leaving`` so others see a graceful exit, not a disappearance.

        A DHT value is only replaced by one that expires later, so this record must outlive the last
        heartbeat's; it still vanishes one lifetime after we go.
        """
        self.update(state="leaving")
        await self.renew(lifetime=self.timing.lifetime + 0.5)
