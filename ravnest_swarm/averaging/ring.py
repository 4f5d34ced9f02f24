"""One ring in one round: wait for its members, then reduce-scatter and all-gather its segment with them.

A ring of C members splits its segment into C chunks. Member i, in reduce-scatter step t, sends chunk
(i - t) mod C to member i+1 and adds the chunk (i - t - 1) mod C it receives from member i-1; after C-1 steps
it holds the full sum of chunk (i + 1) mod C and divides it by C. In all-gather step t it sends chunk
(i + 1 - t) mod C and stores the chunk (i - t) mod C it receives. A run whose spec asks for a robust
``aggregation`` reduces another way (``robust_ring.py``: each chunk straight to its owner), then gathers alike.

Over 400 lines because a ring's round and its attempt (the steps, their pipelining and the checks that
refuse a poisoned chunk) are one protocol, read top to bottom.

Faults. Each ring has its own deadline, from the moment every member arrived: a member that does not answer
in time ends that ring for whoever waited on it, the segment keeps its local value, and the other members are
told that the ring ended for that one (with a caller's ``Patience``, once every member of the attempt answers a
note: one that does not may have crashed, below). A member that never arrives (the wait for it, and the patience
its caller gives it, ran out; or, sooner, the caller found it gone: ``Patience.gone``, a crash) is voted out by each
member that waited for it, where those that came are a majority of the ring: the others average without it
(``RingRound._leave_out``); so is one that crashed amid an attempt, by each member whose attempt failed and whose
caller found it gone (``RingRound._gone_amid``). A received chunk with NaN or Inf, a part that does
not decode in its codec, or absurdly scaled (its largest magnitude above ``max_scale`` times
what that many contributions of our own size could sum to), is refused: in a ring every forwarded partial
sum was checked by its receiver, so such a chunk can only come from the sender's own contribution. The
receiver votes against that sender and tells the ring.

Votes (``mailbox.RingState.view``). A note speaks only for its sender (libp2p authenticates it): a member can
vote against others and leave, never remove anyone. A member is excluded once a majority of the ring's members
voted against it (distinct senders, its own vote not counted); a member that ended the ring for itself (a
timeout or failed send it saw, or its answer that the round is over for it) is left out; and a member that
refused one the majority has not excluded waits out (nobody can tell which of the two lies) while the others run
the ring again with the accused, and comes back if their own checks exclude it. So one hostile member's abort
or vote against an honest one takes only itself out of the ring: the others average without it. A poisoner is
caught by each member that receives its values in turn; in a ring of two nobody can tell which member lies,
and both keep their local values. A member still in an attempt when a member, already told, answers that the
round is over for it waits for that note; with no note, that member has left the ring (it says so of itself).
A vote that comes while a member checks the chunk owners of its attempt (``robust_ring.py``) waits for that
check, so each honest member votes on what it saw itself; a note that leaves an attempt's members as they are
(a vote against, or the withdrawal of, a member already out of it) does not end the attempt; a member waiting out asks the one it accused, every
``ACCUSED_ASKED_EVERY`` seconds, whether it is still in the round (a hostile owner can finish its own attempt), and
so does a member whose attempt goes on with a member another one accused: the accuser learns that the accused left,
but a withdrawal is the leaver's own word, which the accuser cannot pass on.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Coroutine, Dict, List, NamedTuple, Optional, Protocol, Sequence, Set, Tuple

import torch
from hivemind.p2p import P2PHandlerError
from hivemind.proto import runtime_pb2

from ravnest_swarm.averaging.mailbox import Mailbox, MessageKey, RingView, UndecodablePart, majority
from ravnest_swarm.averaging.segments import Ring, chunk_bounds
from ravnest_swarm.averaging.wire import (CONTROL_TIMEOUT, FAILURE_CHARS, GATHER, REDUCE, ROUND_OVER, Outbox, RingAbort,
                                          RingArrive, RingPart, RingSender, decode_part, serialize_part)
from ravnest_swarm.codecs.codec import RAW, Codec
from ravnest_swarm.net.routes import FORWARD_REFUSED

logger = logging.getLogger(__name__)

PARAMETERS, PSEUDO_GRADIENTS = "parameters", "pseudo_gradients"  # what a ring's attempt averages

NEVER_COMING_LOOK_S = 2.0  # seconds between a waiting ring's questions whether a missing member will never come


class Patience(Protocol):
    """How long a ring waits for members that have not reached its round: the caller (a volunteer) knows them from
    their records."""

    async def more(self, step: int, missing: List[str]) -> float:
        """Asked once the wait passed the ring timeout: seconds more (their steps left at their pace); 0 gives up."""

    async def never_coming(self, step: int, missing: List[str]) -> List[str]:
        """Asked every ``NEVER_COMING_LOOK_S`` before that: those of them that will never reach round ``step`` (they
        trained the run's length, or left their stage)."""

    def gone(self, missing: List[str]) -> List[str]:
        """Asked with ``never_coming``, and by a member whose attempt failed about the attempt's members: those of
        them the caller found gone (its planning missed their records: a crash). Unlike those that will never come by
        their own word, they are voted out where the ring can, and fail the ring where it cannot (a ring of two)."""


ACCUSED_ASKED_EVERY = 1.0  # seconds between a refusing member's questions to the accused: still in the round?
CANCEL_AGAIN_AFTER = 0.1  # seconds a cancelled step may take to end before it is cancelled again


class MemberPastRound(Exception):
    """``member`` answered that the round is over for it: it says so of itself, so it has left the ring."""

    def __init__(self, member: str, reason: str):
        super().__init__(reason)
        self.member = member


def past_round_or(error: Exception, member: str) -> Exception:
    """What a send to ``member`` that raised ``error`` means for the ring: the member left, or the error."""
    return MemberPastRound(member, str(error)) if ROUND_OVER in str(error) else error


class ContributionRejected(Exception):
    """A chunk from ``peer`` held NaN or Inf, was absurdly scaled or longer than any honest member sends, or did
    not decode."""

    def __init__(self, peer: str, reason: str):
        super().__init__(reason)
        self.peer = peer


class RingDisagreement(Exception):
    """A chunk of another size than ours, within what an honest member sends: its sender runs this attempt with
    other members, under the same name (it follows another plan, or saw a peer gone at another moment: a 30-minute
    soak saw it at plan changes). Not a vote against the sender, which may be honest; the ring fails, as a hostile
    sender could make it fail by going silent. A chunk longer than any attempt of two members sends is refused."""

    def __init__(self, sender: str, received: str, length: int):
        super().__init__(f"a chunk of {received} elements from {sender[-8:]}, {length} expected: it runs the ring with "
                         f"other members (another plan, or a peer seen gone at another moment)")


@dataclass
class SegmentResult:
    """How one ring ended for this peer.

    ``status`` is ``ok`` (averaged), ``timeout`` (a member did not answer in time), ``failed`` (a send
    failed), ``excluded`` (a majority of the ring refused our contribution), ``refused`` (we refused a
    member's contribution and the ring's majority did not exclude it in time), ``alone`` (every other
    member was excluded or left) or ``finished`` (every other member's record says it will never come: its
    cluster trained the run's length, or it left its stage); all but ``ok`` keep the local value. ``mode``: what
    its last attempt averaged, :data:`PARAMETERS` or :data:`PSEUDO_GRADIENTS` (see :class:`RingRound`).
    """

    index: int
    start: int
    end: int
    status: str
    members: int
    detail: str = ""
    mode: str = "parameters"

    def as_dict(self) -> dict:
        return dict(index=self.index, start=self.start, end=self.end, status=self.status, members=self.members,
                    detail=self.detail, mode=self.mode)


@dataclass
class RoundLog:
    """What a round's rings note as they go: refused contributions and ring streams sent again."""

    rejected: List[dict] = field(default_factory=list)
    resends: int = 0


@dataclass(frozen=True)
class RingPeer:
    """What a ring needs of the peer that runs it: who it is, its mailbox and sender, and its settings.

    ``background`` runs a note's send beyond the ring's end (the averager's shutdown waits for them).
    """

    peer_id: str
    mailbox: Mailbox
    sender: RingSender
    background: Callable[[Coroutine], None]
    timeout: float
    compression: Codec
    part_bytes: int
    max_scale: float
    # how an attempt reduces the segment: RingAttempt sums along the ring (the mean); robust_ring.attempt_for
    # gives the attempt that sends each chunk to its owner to aggregate robustly
    attempt: Callable[["RingRound", List[str], float], "RingAttempt"]


class RingRound:
    """One ring of one round as this peer runs it: members arrive, then attempts until one settles it.

    What it averages. Without ``pseudo`` its ``parameters``, in the averager's codec (as always). With it (a
    compressing codec: ``swarm/stage_averaging.py``), each member tells the others, as it arrives, the digest of
    its ``anchor`` (its outer state over the segment; None: it has none); an attempt whose members all told the
    same digest as ours averages their ``pseudo_gradient`` in the averager's codec, any other averages the
    parameters in float32
    (``none``), so that members whose outer states differ (a newcomer, one that missed a round) end the round on
    the same parameters and can compress again the round after. Every honest member decides alike: it knows
    every member's digest once all arrived, and the attempt's members are the same for all. A member that told
    different digests to different members makes them run one attempt in two codecs: its parts are refused
    (``Mailbox.receive``) and the ring fails, as a member that does not answer would make it.
    Whichever it averages is written in place once the ring completes.
    """

    def __init__(self, peer: RingPeer, step: int, ring: Ring, segment: torch.Tensor, log: RoundLog,
                 pseudo: bool = False, pseudo_gradient: Optional[torch.Tensor] = None, anchor: Optional[str] = None):
        self.peer, self.step, self.ring, self.log = peer, step, ring, log
        self.parameters, self.pseudo, self.pseudo_gradient, self.anchor = segment, pseudo, pseudo_gradient, anchor
        # what the next attempt averages, and in which codec (``_choose``)
        self.segment, self.codec, self.mode = segment, peer.compression, PARAMETERS
        self.state = peer.mailbox.ring_state(step, ring.index)
        self.absent: Set[str] = set()  # members we voted out for not coming or going amid an attempt (``_leave_out``)
        self.renew_deadline = False  # our last attempt ended in a vote or failed, and the ring went on (``_gone_amid``)
        self.gone_until: Optional[float] = None  # how long failed attempts wait for a silent member to be found gone

    async def run(self, started: float, patience: Optional[Patience]) -> SegmentResult:
        """Wait for every member (``timeout``, then as long as ``patience`` says), then run the ring until an
        attempt completes, fails, or leaves us alone; the segment is written only when it completes."""
        try:
            return await self._run(started, patience)
        finally:
            self.state.settled = True  # the round's owner no longer counts this ring's members (``StageAveraging``)

    async def _run(self, started: float, patience: Optional[Patience]) -> SegmentResult:
        self._say_arrived(started + self.peer.timeout)
        waiting_until: Optional[float] = started + self.peer.timeout  # for members not in the round yet
        deadline: Optional[float] = None  # the ring's own, from the moment every member is here
        voted_until = False  # ``deadline`` is a vote's wait for the others' votes, not yet an attempt's
        while True:
            self.state.changed.clear()  # before looking: a note that comes while we look wakes the waits below
            self.state.arrival.clear()
            view = self.state.view(self.ring.members)
            members = list(view.members)
            settled = self._settled(view)
            if settled is not None:
                return settled
            if self.peer.peer_id in view.refusing:  # only our own vote makes us refuse: an attempt set deadline
                # the accused may have ended its round (a hostile owner completes its own attempt): it says so
                # of itself when asked, which takes it out of the ring and brings us back
                self._ask_whether_in_round(self.state.refusals[self.peer.peer_id] & set(view.members), deadline)
                if not await self.state.news(max(0.0, min(ACCUSED_ASKED_EVERY, deadline - time.monotonic()))):
                    if time.monotonic() >= deadline:
                        return self._refused(view)
                continue
            missing = [member for member in members if member != self.peer.peer_id and member not in self.state.arrived]
            if missing:
                waiting_until, ended, gone = await self._wait_for(missing, waiting_until, patience)
                if ended and set(ended) >= set(members) - {self.peer.peer_id}:
                    # nobody is left to average with, and nobody failed: the end of a run for a cluster behind
                    return self._result("finished", len(members), f"every other member will never reach round "
                                                                  f"{self.step} ({', '.join(m[-8:] for m in ended)})")
                for member in ended:
                    # its own signed record says so: it left the ring, as by a note of its own, and no vote is
                    # needed (a majority of a ring of four is three: two clusters behind two that finished the
                    # run could never vote them out)
                    self.state.withdraw(member, f"{member[-8:]} will never reach round {self.step} (its record)")
                view = self.state.view(self.ring.members) if ended else view
                if gone:
                    # a crashed member: we vote now, as at the end of the wait (a killed peer's record said it trained
                    # on until it expired, so each of its rings waited, and every partner's round failed), once
                    # enough members are here to; where too few are left to ever vote, the ring fails now
                    if self._leave_out(gone, view):
                        deadline, voted_until = time.monotonic() + self.peer.timeout, True
                    elif len(self._could_come(view, gone)) < self._votes_needed():
                        return self._never_came(members, gone, started)
                if ended or gone:
                    continue
                if waiting_until is None:
                    if not self._leave_out(missing, view):
                        return self._never_came(members, missing, started)
                    # we wait out, as any member that refused one, until the others' votes leave them out too
                    deadline = waiting_until = time.monotonic() + self.peer.timeout
                    voted_until = True
                continue
            if deadline is None or voted_until:
                deadline, voted_until = time.monotonic() + self.peer.timeout, False
            self.renew_deadline = False
            result = await self._attempt(members, deadline, patience)
            if result is not None:
                return result
            if self.renew_deadline:  # we voted out a member gone amid the attempt, or our attempt failed and the ring
                deadline, voted_until = time.monotonic() + self.peer.timeout, True  # went on: a whole timeout again

    def _result(self, status: str, members: int, detail: str = "") -> SegmentResult:
        return SegmentResult(self.ring.index, self.ring.start, self.ring.end, status, members, detail, self.mode)

    def _choose(self, members: List[str]) -> None:
        """What an attempt with ``members`` averages: pseudo-gradients where every member told our anchor's digest."""
        if not self.pseudo:
            self.segment, self.codec, self.mode = self.parameters, self.peer.compression, PARAMETERS
        elif self.anchor is not None and self.pseudo_gradient is not None and all(self.state.anchors.get(member) == self.anchor
                                             for member in members if member != self.peer.peer_id):
            self.segment, self.codec, self.mode = self.pseudo_gradient, self.peer.compression, PSEUDO_GRADIENTS
        else:
            if self.mode != PARAMETERS or self.codec is not RAW:  # said once per ring and round
                logger.info(f"ring {self.ring.index} at round {self.step}: its members' outer states differ (or one "
                            f"has none): averaging parameters in float32 this round")
            self.segment, self.codec, self.mode = self.parameters, RAW, PARAMETERS

    def _settled(self, view: RingView) -> Optional[SegmentResult]:
        """The ring's end that the notes decided: a majority excluded us, it ended for us, or nobody is left."""
        if self.peer.peer_id in view.excluded:
            return self._result("excluded", len(view.members), "a majority of the ring left us out (it refused our "
                                                                "contribution, or stopped waiting for us)")
        if self.state.failure is not None:
            return self._result("failed", len(view.members), self.state.failure)
        if self.peer.peer_id in view.members and len(view.members) < 2:
            why = "; ".join(self.state.withdrawn[member] for member in sorted(view.withdrawn))
            return self._result("alone", 1, f"every other member was excluded or left{f' ({why})' if why else ''}"[:300])
        return None

    def _refused(self, view: RingView) -> SegmentResult:
        refused = sorted(self.state.refusals.get(self.peer.peer_id, set()) - view.excluded)
        absent = [member for member in refused if member in self.absent]
        if absent:  # our votes were against members that had not come, or went amid an attempt (``_leave_out``)
            return self._timed_out(len(view.members), f"{', '.join(member[-8:] for member in absent)} did not reach "
                                   f"round {self.step} or went amid it, and no majority of the ring left "
                                   f"{'them' if len(absent) > 1 else 'it'} out within the ring timeout")
        reason = (f"we refused {', '.join(member[-8:] for member in refused)} and no majority of the ring did "
                  f"within the ring timeout")
        logger.warning(f"ring {self.ring.index} (elements {self.ring.start}-{self.ring.end}) refused: {reason}")
        return self._result("refused", len(view.members), reason)

    async def _wait_for(self, missing: List[str], until: float,
                        patience: Optional[Patience]) -> Tuple[Optional[float], List[str], List[str]]:
        """Wait for news until ``until``, then ask ``patience`` for more: until when to wait on (None: give up), the
        missing members that will never come, and those found gone. Those two ``patience`` is asked for every
        ``NEVER_COMING_LOOK_S`` while we wait, and the wait ends as it names one: a partner whose cluster finished
        the run made the others wait the whole ring timeout (20 s) at the end of every run."""
        while True:
            left = until - time.monotonic()
            look = patience is not None and left > NEVER_COMING_LOOK_S
            if await self.state.news(max(0.0, NEVER_COMING_LOOK_S if look else left)):
                return until, [], []
            if not look:
                break
            ended = await patience.never_coming(self.step, missing)
            gone = [member for member in patience.gone(missing) if member not in ended and member not in self.absent]
            if ended or gone:
                return until, ended, gone
        more = await patience.more(self.step, missing) if patience is not None else 0.0
        return (time.monotonic() + more if more > 0 else None), [], []

    def _leave_out(self, missing: List[str], view: RingView, why: str = "did not come") -> bool:
        """The wait for ``missing`` ran out (or they went amid an attempt: ``_gone_amid``): vote them out of the
        ring, where the members here can (a majority of the ring's members arrived, two at least, not counting
        ``missing``), and tell the ring; whether we did. A ring used to fail for all
        when one member did not come (its cluster waited for a stage a churned peer left, or counted its rounds
        apart): in a 30-minute soak on the GPT most of the 22 % of rounds that failed ended so. Every member votes
        on what it saw itself (the absent one never reached it), and a majority's votes exclude it, as for a
        refused contribution (``mailbox.RingState.view``): the others average without it, under one attempt name.
        One that arrives after all gets the votes and ends ``excluded``, keeping its own values."""
        here = [member for member in self._could_come(view, missing)
                if member == self.peer.peer_id or member in self.state.arrived]
        if len(here) < self._votes_needed():
            return False
        logger.info(f"ring {self.ring.index} at round {self.step}: {', '.join(m[-8:] for m in missing)} {why}; "
                    f"voting to average without {'them' if len(missing) > 1 else 'it'}")
        self.absent.update(missing)
        self.state.vote(self.peer.peer_id, missing)
        self._tell_ring(excluded=sorted(self.state.refusals[self.peer.peer_id]))
        return True

    def _could_come(self, view: RingView, gone: Sequence[str]) -> List[str]:
        """The ring's members neither excluded, withdrawn, nor in ``gone``: those that may still average."""
        return [member for member in self.ring.members
                if member not in view.excluded and member not in view.withdrawn and member not in gone]

    def _votes_needed(self) -> int:
        """Members that must be here to vote absent ones out: a majority of the ring, two at least."""
        return max(2, majority(len(self.ring.members)))

    def _never_came(self, members: List[str], missing: List[str], started: float) -> SegmentResult:
        reason = (f"{', '.join(member[-8:] for member in missing)} did not reach round {self.step} within "
                  f"{time.monotonic() - started:.0f}s")
        self._tell_ring(failure=reason)
        return self._timed_out(len(members), reason)

    def _timed_out(self, members: int, reason: str) -> SegmentResult:
        logger.warning(f"ring {self.ring.index} (elements {self.ring.start}-{self.ring.end}) timeout: {reason}")
        return self._result("timeout", members, reason[:300])

    async def _attempt(self, members: List[str], deadline: float,
                       patience: Optional[Patience]) -> Optional[SegmentResult]:
        """One attempt with ``members``, unless a note changes the ring first; None: decide again."""
        self._choose(members)  # before the attempt is made: it reads what the round averages, and in which codec
        if logger.isEnabledFor(logging.DEBUG):  # the text walks the ring's state: built only when it is shown
            view = self.state.view(self.ring.members)
            logger.debug(f"{self.peer.peer_id[-8:]}: ring {self.ring.index} round {self.step} attempt with "
                         f"{[member[-8:] for member in members]} (excluded {sorted(m[-8:] for m in view.excluded)}, "
                         f"withdrawn {sorted(self.state.withdrawn.values())}, votes "
                         f"{ {v[-8:]: sorted(a[-8:] for a in accused) for v, accused in self.state.refusals.items()} })")
        running = self.peer.attempt(self, members, deadline)
        attempt = asyncio.create_task(running.run())
        try:
            while not attempt.done():
                # the accuser waits out and asks the accused, and learns so that it left (an accused poisoner
                # completes its own attempt and keeps its values), but cannot tell us: a withdrawal counts only as
                # the leaver's own word. Without asking too, we would wait out the ring's timeout for a chunk the
                # accused will never send (CI saw the NaN test's two honest members each wait 40 s apart)
                accused = set().union(*(votes for voter, votes in self.state.refusals.items()
                                        if voter != self.peer.peer_id))
                self._ask_whether_in_round(accused & set(members), deadline)
                interrupted = asyncio.create_task(self.state.changed.wait())
                try:
                    await asyncio.wait({attempt, interrupted}, timeout=ACCUSED_ASKED_EVERY,
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    interrupted.cancel()
                if not attempt.done() and not running.checking and \
                        await self._vote_with_others(accused & set(members), patience):
                    break  # a member that others voted out went amid this attempt: our planning says so too
                if not attempt.done() and not self.state.changed.is_set():
                    continue  # a second without news: the accused are asked again
                if not attempt.done() and running.checking:
                    # a member's vote came while we check the chunk owners of this very attempt: our check ends
                    # first, so that our own vote (or none) says what we saw, as the accuser's says what it saw;
                    # cancelled here, an honest member would never check the accused, and the votes against it
                    # never reach a majority
                    check_ended = asyncio.create_task(running.check_ended.wait())
                    try:
                        await asyncio.wait({attempt, check_ended}, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        check_ended.cancel()
                if attempt.done() or self._changes_attempt(members):
                    break
                # a note that leaves this attempt as it is (a vote against, or the withdrawal of, a member already
                # out of it): the attempt goes on. Started again, it would be named as before, find the parts its
                # predecessor sent already taken, and blame that member for a chunk of 0 elements
                self.state.changed.clear()
        finally:
            # also when the round itself is cancelled (its peer stops, or leaves its stage): an attempt left
            # running would end later on its own, its exception never retrieved, its streams still open
            await cancel_until_ended([attempt])
        if attempt.cancelled():
            logger.debug(f"{self.peer.peer_id[-8:]}: ring {self.ring.index} round {self.step}: attempt with "
                         f"{[member[-8:] for member in members]} given up: the ring's notes changed it")
            return None  # membership changed or the ring was ended: decide again from the state
        if attempt.exception() is not None:
            logger.debug(f"{self.peer.peer_id[-8:]}: ring {self.ring.index} round {self.step}: attempt with "
                         f"{[member[-8:] for member in members]} ended: {attempt.exception()!r}")
        try:
            averaged = attempt.result()
        except ContributionRejected as e:
            self._exclude(e)
            return None
        except MemberPastRound as e:
            if not await self._note_on_its_way(deadline):  # no vote or end of the ring explains it: it left
                self.state.withdraw(e.member, f"{e.member[-8:]} is past round {self.step}")
            return None
        except (asyncio.TimeoutError, Exception) as e:
            gone: Optional[List[str]] = []
            if not isinstance(e, RingDisagreement) and not (isinstance(e, P2PHandlerError) and member_answered(e)):
                gone = await self._gone_amid(members, patience)
                if gone is None or (gone and self._leave_out(gone, self.state.view(self.ring.members),
                                                             "went amid an attempt")):
                    self.renew_deadline = True
                    return None  # the ring's notes changed it, or we voted out those gone: decide again
            status = "timeout" if isinstance(e, asyncio.TimeoutError) else "failed"
            reason = str(e) or type(e).__name__
            reason = f"{reason} ({', '.join(m[-8:] for m in gone)} gone)" if gone else reason
            logger.warning(f"ring {self.ring.index} (elements {self.ring.start}-{self.ring.end}) {status}: {reason}")
            self._tell_ring(failure=reason)
            return self._result(status, len(members), reason[:300])
        if not math.isfinite(largest(averaged)):
            # only our own contribution can be non-finite here (every received chunk was checked): the
            # others refuse the chunk we finalized and go on without us, so we keep our local value
            return self._result("excluded", len(members), "our own values are not finite")
        self.segment.copy_(averaged)
        return self._result("ok", len(members))

    async def _gone_amid(self, members: List[str], patience: Optional[Patience]) -> Optional[List[str]]:
        """Our attempt with ``members`` failed (a member we could not reach, a chunk that never came): did one of them
        crash amid it? Its parts never come, and every member's attempt fails: the ring failed at every partner of a
        peer killed amid a round. Where enough members would be left to vote one out, we ask the others whether they
        are there (a note, ``_silent``); where all answer, nobody crashed and the ring fails for us at once, as before
        (the others go on without us). Else ``patience`` is asked every NEVER_COMING_LOOK_S which of the silent our
        planning found gone, until one ring timeout after our first failed attempt of the round (a killed peer's
        record says it trains on until it expires: about 16 s in the soak), and they are voted out (``_leave_out``);
        the others vote as their own attempts fail, and the ring goes on without them. None: notes changed the
        attempt meanwhile. A ring of two fails at once: nobody would be left to vote. A member that answers is never
        voted out so: one whose record expired while it still sends (its writes to the DHT failed) is alive."""
        if patience is None or len(self._could_come(self.state.view(self.ring.members), ())) <= self._votes_needed():
            return []
        silent = await self._silent([member for member in members if member != self.peer.peer_id])
        if not silent:
            return []
        if self.gone_until is None:  # one wait per ring and round: a second failed attempt does not start it anew
            self.gone_until = time.monotonic() + self.peer.timeout
        while True:
            self.state.changed.clear()  # before looking, as in ``_run``
            self.state.arrival.clear()
            if self._changes_attempt(members):
                return None
            gone = [member for member in patience.gone(silent) if member not in self.absent]
            if gone or time.monotonic() >= self.gone_until:
                return gone
            await self.state.news(max(0.0, min(NEVER_COMING_LOOK_S, self.gone_until - time.monotonic())))

    async def _vote_with_others(self, accused: Set[str], patience: Optional[Patience]) -> bool:
        """Members of our running attempt that others voted against, that our planning found gone, and that do not
        answer a note (``_silent``): they went amid an earlier attempt (``_gone_amid``), and this one, which the first
        votes made without their voters, waits for them in vain until its timeout; vote them out now
        (``_leave_out``), as the voters did. Whether we did. One that answers is alive (its record may have expired
        while its writes to the DHT failed) and is never voted out of an attempt that goes on."""
        gone = [] if patience is None else [member for member in patience.gone(sorted(accused))
                                            if member not in self.absent]
        gone = await self._silent(gone) if gone else gone
        if gone and self._leave_out(gone, self.state.view(self.ring.members), "went amid an attempt"):
            self.renew_deadline = True
            return True
        return False

    async def _silent(self, others: List[str]) -> List[str]:
        """Those of ``others`` that do not answer a note within CONTROL_TIMEOUT: a crashed member never does. Any
        answer of its own counts, a refusal too (the round is over for it): its peer is alive; a backbone's refusal
        to forward to it does not."""
        note = self._arrive_note()

        async def answers(member: str) -> bool:
            try:
                await self.peer.sender.send_note(member, note, time.monotonic() + CONTROL_TIMEOUT)
            except P2PHandlerError as e:
                return member_answered(e)
            except Exception:
                return False
            return True

        answered = await asyncio.gather(*(answers(member) for member in others))
        return [member for member, answer in zip(others, answered) if not answer]

    def _ask_whether_in_round(self, accused: Set[str], deadline: float) -> None:
        """Ask each of ``accused`` (members whose contribution was refused), in the background, whether it is
        still in the round: its answer that the round is over withdraws it (``_tell_arrived``), which changes our
        attempt. Asked again every ``ACCUSED_ASKED_EVERY`` seconds while our attempt or our refusal lasts."""
        asked_until = min(deadline, time.monotonic() + CONTROL_TIMEOUT)
        for member in accused - {self.peer.peer_id}:
            self.peer.background(self._tell_arrived(member, asked_until))

    def _changes_attempt(self, members: List[str]) -> bool:
        """Whether the ring's notes now end it for us or make its next attempt another than ``members``'."""
        view = self.state.view(self.ring.members)
        return (self._settled(view) is not None or self.peer.peer_id in view.refusing
                or list(view.members) != members)

    async def _note_on_its_way(self, deadline: float) -> bool:
        """A member of our attempt answered that the round is over for it. An honest one cannot have completed
        the ring without us: another member refused its contribution (its own round ended when it was told) or it
        ended the ring, and either way a note to us is on its way, which may come after its answer (it was sent in
        the background). Wait for it, at most as long as a note may take; whether it came. (A hostile chunk owner
        can complete its own attempt while the others refuse it: no note comes, and it has left the ring.)"""
        try:
            async with asyncio.timeout(max(0.0, min(CONTROL_TIMEOUT, deadline - time.monotonic()))):  # not wait_for:
                await self.state.changed.wait()  # see mailbox.receive
            return True
        except TimeoutError:
            return False

    def _exclude(self, rejected: ContributionRejected) -> None:
        self.log.rejected.append(dict(peer=rejected.peer, ring=self.ring.index, reason=str(rejected)))
        logger.warning(f"ring {self.ring.index}: refused the contribution of {rejected.peer[-8:]}: {rejected}")
        self.state.vote(self.peer.peer_id, [rejected.peer])
        self._tell_ring(excluded=sorted(self.state.refusals[self.peer.peer_id]))

    # ---- notes to the other members ------------------------------------------------------------------

    def _say_arrived(self, deadline: float) -> None:
        """Tell every other member, in the background, that we reached the round: each starts the ring once
        all have. A member that refuses it as a round it has finished will never come: it has left the ring. One
        that answers it is here already counts as arrived: its own note may have reached us before we expected
        this round's messages, and been refused. One that answers that the round is over for it has left the
        ring: it says so of itself only, so a hostile member cannot end the ring for us this way."""
        self.state.anchor = self.anchor  # told with ``here`` to a member whose note comes before ours reaches it
        self.state.here = True
        for member in self.ring.members:
            if member != self.peer.peer_id:
                self.peer.background(self._tell_arrived(member, deadline))

    def _arrive_note(self) -> RingArrive:
        """That we reached this ring's round, with our anchor's digest: told as we arrive, and asked again of a member
        that may have left or crashed (``_ask_whether_in_round``, ``_silent``)."""
        return RingArrive(run=self.peer.sender.run, step=self.step, ring=self.ring.index, position=0, attempt=[],
                          anchor=self.anchor)

    async def _tell_arrived(self, member: str, deadline: float) -> None:
        try:
            reply = await self.peer.sender.send_note(member, self._arrive_note(), deadline)
            if reply.arrived:
                self.state.arrive(member, reply.anchor)
        except P2PHandlerError as e:
            if ROUND_OVER in str(e):
                self.state.withdraw(member, f"{member[-8:]} is past round {self.step}")
        except Exception as e:  # unreachable: the wait for its own note, or the ring, runs out of time
            logger.debug(f"could not tell {member[-8:]} we reached round {self.step}: {e}")

    def _tell_ring(self, excluded: Optional[List[str]] = None, failure: Optional[str] = None) -> None:
        """Our votes (``excluded``) or that the ring ended for us (``failure``), to every other member of the
        ring, those waiting out included (a vote may bring them back). Best effort, in the background: the
        ring's result does not wait for these notes to arrive. Each is tried for as long as a ring waits, not a
        note's usual moment: a member that never hears of a vote waits out the ring for a chunk its accused will
        not send (CI saw a vote note lost on a loaded machine, and the honest members' ring time out)."""
        note = RingAbort(run=self.peer.sender.run, step=self.step, ring=self.ring.index, position=0, attempt=[],
                         excluded=excluded, failure=None if failure is None else failure[:FAILURE_CHARS])

        async def tell(member: str) -> None:
            try:
                reply = await self.peer.sender.send_note(member, note, time.monotonic() + self.peer.timeout)
            except Exception as e:
                logger.debug(f"could not tell {member[-8:]} about ring {self.ring.index}: {e}")
                return
            # names of our vote that its rings leave out already (a cluster it found gone before we did): its vote
            # too, in its own words, so that the members that still count that cluster reach a majority
            agreed = [peer for peer in reply.left_out or () if peer in self.ring.members and peer != member]
            if agreed:
                self.state.vote(member, agreed)

        for member in self.ring.members:
            if member != self.peer.peer_id:
                self.peer.background(tell(member))


class RingStep(NamedTuple):
    """One step of the ring as this member sees it: which chunk it sends and which it receives."""

    phase: str  # REDUCE or GATHER
    position: int  # the step's number within its phase
    sends: int  # chunk index
    receives: int


class Progress:
    """How many elements of its chunk a step has handled; others wait for a mark."""

    def __init__(self):
        self.value, self.done = 0, False
        self.changed = asyncio.Event()

    def advance(self, value: int, done: bool = False) -> None:
        self.value, self.done = value, self.done or done
        self.changed.set()

    async def reach(self, mark: int) -> None:
        while self.value < mark and not self.done:
            self.changed.clear()
            await self.changed.wait()


class RingAttempt:
    """Reduce-scatter then all-gather over ``members``: 2(n-1) steps, each moving one chunk of segment/n.

    Every step has its own sending stream and receiving coroutine, all started at once. A chunk moves in
    parts: when step i has a part of its chunk (received and summed, or final), the same part goes out in
    step i+1, so consecutive steps overlap. Step i handles a part only after step i-1 handled the same
    elements, which keeps every read and write of ``work`` in the order of the unpipelined algorithm.

    Nothing the size of the segment is done before the streams open, because a peer's link is idle until
    then (in the bench a peer of three rings spent 0.2-0.3 s cloning, scanning and serializing them first):
    step 0's parts are serialized one at a time while the streams start, ``work`` is filled as parts arrive
    instead of starting as a copy of the segment, and a chunk's scale is taken when its first part arrives.
    """

    def __init__(self, ring_round: RingRound, members: List[str], deadline: float):
        self.round, self.peer, self.segment, self.codec = ring_round, ring_round.peer, ring_round.segment, ring_round.codec
        self.members, self.deadline = members, deadline
        count, me = len(members), members.index(self.peer.peer_id)
        self.count = count
        self.following, self.preceding = members[(me + 1) % count], members[(me - 1) % count]
        self.chunks = [slice(lo, hi) for lo, hi in chunk_bounds(self.segment.numel(), count)]
        self.longest_honest = chunk_bounds(self.segment.numel(), 2)[0][1]  # an attempt of two members' first chunk
        self.excluded_before = sorted(set(ring_round.ring.members) - set(members))  # names the attempt
        # every element is written once the ring completes: reduce steps write segment + received into all
        # chunks but our own, the gather steps write every chunk but the one we finalized. The segment itself
        # keeps its local values until then, so a failed ring leaves it as it was.
        self.work = torch.empty_like(self.segment)
        self.steps = [RingStep(REDUCE, t, (me - t) % count, (me - t - 1) % count) for t in range(count - 1)]
        self.steps += [RingStep(GATHER, t, (me + 1 - t) % count, (me - t) % count) for t in range(count - 1)]
        self.outboxes = [Outbox() for _ in self.steps]
        self.handled = [Progress() for _ in self.steps]  # elements of its received chunk each step has handled
        # honest partial sums stay within `contributions` times values of our own scale (the infinity norm:
        # one pass, no temporary the size of the chunk); taken per chunk when the first part of it arrives
        self.scales: Dict[int, float] = {}
        # a robust attempt checks the chunk owners once its gather is complete (robust_ring.py): while it does, a
        # change of the ring waits for the check to end (RingRound._attempt)
        self.checking = False
        self.check_ended = asyncio.Event()

    async def run(self) -> torch.Tensor:
        """Every step's send and receive at once; the averaged segment, or the first failure."""
        tasks = [asyncio.create_task(work) for work in self._tasks()]
        try:
            # the first failure (a refused contribution, a timeout, a failed send) ends the attempt
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in tasks:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()
        finally:
            for task in tasks:
                task.cancel()
            for outbox in self.outboxes:
                outbox.abandon()
            await cancel_until_ended(tasks)
        return self.work

    def _tasks(self) -> List[Coroutine]:
        steps = range(len(self.steps))
        return [self._send(i) for i in steps] + [self._receive(i) for i in steps] + [self._send_own_chunk()]

    async def _send(self, index: int) -> None:
        step = self.steps[index]
        message = RingPart(run=self.peer.sender.run, step=self.round.step, ring=self.round.ring.index,
                           position=step.position, attempt=self.excluded_before, phase=step.phase, codec=self.codec.name)
        try:
            resent = await self.peer.sender.send_chunk(self.following, message, self.outboxes[index], self.deadline)
        except P2PHandlerError as e:
            raise past_round_or(e, self.following)
        self.round.log.resends += resent  # not `+= await`: that would read the count before other sends added theirs

    async def _send_own_chunk(self) -> None:
        """Step 0 sends our own values (the segment, unchanged during the attempt), a part at a time: between
        parts the other rings' coroutines run, so every stream opens and starts sending at once."""
        first = self.chunks[self.steps[0].sends]
        part_elements = max(1, self.peer.part_bytes // 4)
        bounds = range(first.start, first.stop, part_elements) if first.stop > first.start else [first.start]
        for lo in bounds:
            self.outboxes[0].put(serialize_part(self.segment[lo:min(lo + part_elements, first.stop)],
                                                self.codec))
            await asyncio.sleep(0)
        self.outboxes[0].close()

    async def _receive(self, index: int) -> None:
        """Step ``index``'s chunk from our predecessor, part by part: checked, summed or stored, passed on."""
        step = self.steps[index]
        chunk = self.chunks[step.receives]
        length, offset = chunk.stop - chunk.start, 0
        key: MessageKey = (self.round.step, self.round.ring.index, tuple(self.excluded_before), step.phase,
                           step.position, self.preceding)
        async for received, as_sent in self._parts(key):
            received = self._checked(step, received, offset, length)
            if index > 0:
                previous = self.chunks[self.steps[index - 1].receives]
                await self.handled[index - 1].reach(min(offset + received.numel(), previous.stop - previous.start))
            self._take(index, slice(chunk.start + offset, chunk.start + offset + received.numel()), received, as_sent)
            offset += received.numel()
            self.handled[index].advance(offset)
        if offset != length:
            raise RingDisagreement(self.preceding, str(offset), length)
        if index + 1 < len(self.steps):
            self.outboxes[index + 1].close()
        self.handled[index].advance(length, done=True)

    async def _parts(self, key: MessageKey) -> AsyncIterator[Tuple[torch.Tensor, runtime_pb2.Tensor]]:
        """The parts of the message ``key`` names as they arrive; one that does not decode is its sender's."""
        try:
            async for received, as_sent in self.peer.mailbox.receive(key, self.deadline, self.codec):
                yield received, as_sent
        except UndecodablePart as e:
            raise ContributionRejected(key[-1], f"a part does not decode: {e}")

    def _checked(self, step: RingStep, received: torch.Tensor, offset: int, length: int) -> torch.Tensor:
        """A received part as flat float32; :class:`RingDisagreement` for a chunk longer than ours (its sender counts
        the ring apart), :class:`ContributionRejected` for one longer than any honest member sends, non-finite or
        absurdly scaled."""
        n = received.numel()
        if offset + n > length:
            # a member that counts fewer members in the ring sends longer chunks, but no attempt of two or more
            # members has one longer than half the segment: such a chunk is its sender's own doing
            if offset + n > self.longest_honest:
                raise ContributionRejected(self.preceding, f"chunk of more than {self.longest_honest} elements, more "
                                                           f"than any attempt of two members sends (ours: {length})")
            raise RingDisagreement(self.preceding, f"more than {length}", length)
        if received.dtype != torch.float32:
            received = received.float()
        received = received.reshape(-1)
        magnitude = largest(received)
        if not math.isfinite(magnitude):
            raise ContributionRejected(self.preceding, f"{step.phase} chunk {step.position} holds NaN or Inf")
        if n:
            contributions = step.position + 1 if step.phase == REDUCE else 1
            ours = self._our_scale(step.receives)
            if magnitude > self.peer.max_scale * contributions * ours:
                raise ContributionRejected(self.preceding, f"{step.phase} chunk {step.position} is absurdly scaled "
                                                           f"(magnitude {magnitude:.3g}, ours {ours:.3g})")
        return received

    def _our_scale(self, chunk: int) -> float:
        if chunk not in self.scales:
            self.scales[chunk] = max(largest(self.segment[self.chunks[chunk]]), 1.0)
        return self.scales[chunk]

    def _take(self, index: int, elements: slice, received: torch.Tensor, as_sent: runtime_pb2.Tensor) -> None:
        """Write a received part into ``work`` (summed with ours while reducing) and pass it to the next step."""
        step = self.steps[index]
        last_reduce = step.phase == REDUCE and step.position == self.count - 2
        values = self.work[elements]
        if step.phase == REDUCE:
            torch.add(self.segment[elements], received, out=values)
            if last_reduce:
                values /= self.count
        else:
            values.copy_(received)
        if index + 1 == len(self.steps):
            return
        if step.phase == GATHER:
            self.outboxes[index + 1].put(as_sent)  # forwarded exactly as the owner compressed it
            return
        part = serialize_part(values, self.codec)
        if last_reduce and self.codec is not RAW:
            # the others get our chunk through the compression: keep the same value so all agree
            values.copy_(decode_part(part, self.codec))
        self.outboxes[index + 1].put(part)


async def cancel_until_ended(tasks: List[asyncio.Task]) -> None:
    """Cancel ``tasks`` and wait until every one has ended, its exception retrieved.

    Cancelled again while one goes on: a library's ``asyncio.wait_for`` (Python 3.11) returns, dropping the
    cancellation, when what it awaits ends at the moment it is cancelled (CPython gh-86296). One cancel was all an
    attempt gave its steps: a receiving step resumed that way waited for ever on a step that had ended, and held
    its ring until the round's timeout."""
    pending = [task for task in tasks if not task.done()]
    while pending:
        for task in pending:
            task.cancel()
        _, still = await asyncio.wait(pending, timeout=CANCEL_AGAIN_AFTER)
        pending = list(still)
    await asyncio.gather(*tasks, return_exceptions=True)


def member_answered(error: P2PHandlerError) -> bool:
    """Whether a handler error came from the member itself (alive), not from a backbone that could not forward to
    it (a member behind NAT that crashed)."""
    return FORWARD_REFUSED not in str(error)


def largest(values: torch.Tensor) -> float:
    """The largest magnitude in one pass without temporaries; NaN if any element is NaN, Inf if any is infinite."""
    return torch.linalg.vector_norm(values, float("inf")).item() if values.numel() else 0.0
