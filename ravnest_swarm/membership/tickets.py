"""Admission tickets of invite-only runs: the owner's signed word that a peer may take part.

A run whose spec says ``invite_only`` counts only the peers that carry a ticket: the owner signs one with the
run's owner key (``ravnest-swarm invite``, offline), the volunteer passes it to ``join --ticket`` and publishes it
in its :class:`~ravnest_swarm.membership.records.PeerRecord`. A ticket names the run (name and owner fingerprint),
the peer id it is for (or none: any peer id, a bearer ticket), when it expires (wall-clock seconds) and its id,
which the owner can revoke (``update-spec --revoke ID``: the spec lists the revoked ids).

Every peer keeps an :class:`Admission` (on its node, ``node.admission``): the readers of peer records and stage
endpoints ignore what a peer without a valid ticket wrote, and the routes refuse its messages
(``Routes.gate``). The token is base64url text of the msgpack ``[payload, signature]``, the payload itself msgpack,
so what is signed is exactly the bytes that travel; nothing of it is ever unpickled.
"""

from __future__ import annotations

import base64
import logging
import os
import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import multihash
from hivemind.p2p import PeerID
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.serializer import MSGPackSerializer

import ravnest_swarm.net  # noqa: F401  (its import bounds MSGPackSerializer's depth: net/serializer.py)

from ravnest_swarm.errors import UserError
from ravnest_swarm.membership.owner import FINGERPRINT_RE, RUN_NAME_RE, fingerprint

logger = logging.getLogger(__name__)

MAX_TICKET_CHARS = 1024  # a 2048-bit RSA signature and a payload of about 120 bytes, in base64: about 600
TICKET_ID_RE = re.compile(r"^[0-9a-f]{16}\Z")
TICKET_TEXT_PATTERN = r"^[A-Za-z0-9_=-]*\Z"  # base64url, as a PeerRecord's ``ticket`` carries it
MAX_REVOKED = 256  # ticket ids a spec lists as revoked: a revocation past them is refused, never one dropped
MAX_EXPIRES = 1e11  # a ticket's expiry, in wall-clock seconds (the year 5138): any clock can print it
PEER_TEXT_RE = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{0,128}\Z")  # a ticket's peer: base58, or empty for any peer
_DURATION_RE = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])\Z")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_VERIFIED_KEPT = 4096  # signature checks remembered by token
IGNORED_PEERS_SAID = 64  # peers whose records an admission says it ignores, one line each; the rest silently


@dataclass(frozen=True)
class Ticket:
    """A decoded ticket: ``peer`` "" is any peer id; ``expires`` wall-clock seconds."""

    run: str
    owner: str  # the fingerprint of the owner key that must have signed it
    peer: str
    expires: float
    id: str
    payload: bytes
    signature: bytes

    def describe(self) -> str:
        until = datetime.fromtimestamp(self.expires, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        return f"ticket {self.id} of run {self.run}@{self.owner} for {self.peer or 'any peer'}, valid until {until}"


def parse_expiry(text: str, now: Optional[float] = None) -> float:
    """``--expires``: a duration from now (``90s``, ``30m``, ``12h``, ``7d``, ``2w``) or an ISO time
    (``2026-12-31T18:00``, UTC unless it names a zone); wall-clock seconds, or a one-line :class:`UserError`."""
    now = time.time() if now is None else now
    found = _DURATION_RE.match(text.strip())
    if found:
        expires = now + float(found.group(1)) * _UNITS[found.group(2)]
    else:
        try:
            when = datetime.fromisoformat(text.strip())
        except ValueError:
            raise UserError(f"--expires {text!r}: give a duration (90s, 30m, 12h, 7d, 2w) or a time "
                            f"(2026-12-31T18:00, UTC)") from None
        expires = (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()
    if expires <= now:
        raise UserError(f"--expires {text!r} is not in the future: the ticket would never admit anyone")
    if expires >= MAX_EXPIRES:
        raise UserError(f"--expires {text!r} is past the year 5000: give a shorter one")
    return expires


def issue_ticket(key: RSAPrivateKey, run: str, peer: Optional[str], expires: float) -> Tuple[str, Ticket]:
    """A ticket of ``run`` signed by the owner ``key``: its token text and its decoded form."""
    if peer is not None:  # an empty --peer (an unset variable in a script) must not issue a ticket for any peer
        check_peer_id(peer)
    payload = MSGPackSerializer.dumps(dict(run=run, owner=fingerprint(key.get_public_key().to_bytes()),
                                           peer=peer or "", expires=float(expires), id=os.urandom(8).hex()))
    token = base64.urlsafe_b64encode(MSGPackSerializer.dumps([payload, key.sign(payload)])).decode()
    return token, read_ticket(token)


def check_peer_id(text: str) -> str:
    """``text`` if it is a peer id (the base58 of a multihash), else a one-line :class:`UserError`."""
    try:
        multihash.decode(PeerID.from_base58(text).to_bytes())
    except Exception:  # base58's and multihash's errors alike
        raise UserError(f"--peer {text!r} is not a peer id (base58, as `join` prints it or `--identity` fixes it)") \
            from None
    return text


def read_ticket(token: str) -> Ticket:
    """Decode a ticket's token, or a one-line :class:`UserError` saying what is wrong (its signature is checked
    against the run's spec later, :meth:`Admission.problem`)."""
    token = token.strip()
    bad = UserError(f"the ticket is not one `ravnest-swarm invite` printed (garbled or cut short?): "
                    f"{token[:24] + '...' if len(token) > 24 else token!r}", exit_code=1)
    if not 0 < len(token) <= MAX_TICKET_CHARS or not re.match(TICKET_TEXT_PATTERN, token):
        raise bad
    try:
        payload, signature = MSGPackSerializer.loads(base64.urlsafe_b64decode(token.encode()))
        fields = MSGPackSerializer.loads(payload)
        ticket = Ticket(run=fields["run"], owner=fields["owner"], peer=fields["peer"], expires=fields["expires"],
                        id=fields["id"], payload=payload, signature=signature)
    except Exception:  # whatever a stranger typed: bad base64, msgpack, shape or fields
        raise bad from None
    # every field as a person may be shown it (a stranger's record carries a ticket that anyone can make up: its run
    # went into peers' logs with terminal escapes), its expiry a time a clock can print
    if not (isinstance(ticket.run, str) and RUN_NAME_RE.match(ticket.run) and isinstance(ticket.owner, str)
            and FINGERPRINT_RE.match(ticket.owner) and isinstance(ticket.peer, str) and PEER_TEXT_RE.match(ticket.peer)
            and isinstance(ticket.expires, float) and 0 < ticket.expires < MAX_EXPIRES
            and isinstance(ticket.id, str) and TICKET_ID_RE.match(ticket.id) and isinstance(signature, bytes)
            and isinstance(payload, bytes)):
        raise bad
    return ticket


def ticket_argument(value: str) -> str:
    """``join --ticket``: the token, or a file holding it."""
    if os.path.isfile(value):
        try:
            with open(value) as f:
                return f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--ticket {value}: cannot read it ({e})")
    return value.strip()


def check_ticket_for(token: str, run: str, owner: Optional[str], now: Optional[float] = None) -> Ticket:
    """What a joiner can check of its ticket before it starts: that it decodes, names this run (and its owner,
    where the address names one) and has not expired. One line otherwise."""
    ticket = read_ticket(token)
    if ticket.run != run or (owner is not None and ticket.owner != owner):
        raise UserError(f"your --ticket is for run {ticket.run}@{ticket.owner}, not {run}"
                        + (f"@{owner}" if owner else "") + ": ask this run's owner for one", exit_code=1)
    if ticket.expires <= (time.time() if now is None else now):
        raise UserError(f"your --ticket expired ({ticket.describe()}): ask the run's owner for a new one",
                        exit_code=1)
    return ticket


class Admission:
    """Who counts in a run, as one peer sees it: in an invite-only run, peers whose record carries a valid ticket.

    :param run: the run's name
    :param owner_key: the owner's public key (ssh-rsa text), as the run's signed spec names it
    :param invite_only: the spec's; False admits everyone (an open run)
    :param revoked: ticket ids the spec lists as revoked
    :param say: where a peer dropped for a revoked ticket is told of, one line each
    :param clock: wall-clock time, which tickets expire by
    """

    def __init__(self, run: str, owner_key: str, invite_only: bool, revoked: Sequence[str] = (),
                 say: Callable[[str], None] = logger.warning, clock: Callable[[], float] = time.time):
        self.run, self.clock, self.say = run, clock, say
        self.owner = fingerprint(owner_key.encode())
        self._public = RSAPublicKey.from_bytes(owner_key.encode())
        self.invite_only, self.revoked = invite_only, frozenset(revoked)
        self._verified: Dict[str, Optional[str]] = {}  # token -> None (good) or why not, signatures checked once
        self._members: Dict[str, Tuple[Ticket, float]] = {}  # peer id -> its ticket, until when its record counts
        self.ignored: Dict[str, str] = {}  # peer id -> why its records do not count (the first IGNORED_PEERS_SAID)

    def follow(self, invite_only: bool, revoked: Iterable[str]) -> None:
        """The owner's newer spec: members whose ticket it revokes are dropped at once, each said in one line."""
        self.invite_only, self.revoked = invite_only, frozenset(revoked)
        for peer_id, (ticket, _) in list(self._members.items()):
            if ticket.id in self.revoked:
                del self._members[peer_id]
                self.say(f"dropped peer {peer_id}: the run's owner revoked its ticket {ticket.id}")

    def problem(self, token: Optional[str], peer_id: str) -> Optional[str]:
        """Why ``token`` admits no ``peer_id`` to this run (None: it does)."""
        if not token:
            return "no ticket"
        if token not in self._verified:
            if len(self._verified) >= _VERIFIED_KEPT:
                self._verified.pop(next(iter(self._verified)))
            self._verified[token] = self._verify(token)
        if self._verified[token] is not None:
            return self._verified[token]
        ticket = read_ticket(token)
        if ticket.peer and ticket.peer != peer_id:
            return f"ticket {ticket.id} is for peer {ticket.peer}"
        if ticket.id in self.revoked:
            return f"ticket {ticket.id} was revoked"
        if ticket.expires <= self.clock():
            return f"ticket {ticket.id} expired"
        return None

    def _verify(self, token: str) -> Optional[str]:
        try:
            ticket = read_ticket(token)
        except UserError:
            return "a malformed ticket"
        if ticket.run != self.run or ticket.owner != self.owner:
            return f"a ticket of run {ticket.run}@{ticket.owner}"
        try:
            signed = self._public.verify(ticket.payload, ticket.signature)
        except Exception:  # a malformed signature is no signature
            signed = False
        return None if signed else f"ticket {ticket.id} not signed by the run's owner"

    def admitted(self, records: List[Dict]) -> List[Dict]:
        """The records that count (all of them in an open run); their peers may call our handlers until their record
        expires (``expires_in``, as ``PeerView.records`` gives it)."""
        if not self.invite_only:
            return records
        kept = []
        for record in records:
            problem = self.problem(record.get("ticket"), record["peer_id"])
            if problem is not None:
                if record["peer_id"] not in self.ignored and len(self.ignored) < IGNORED_PEERS_SAID:
                    self.ignored[record["peer_id"]] = problem  # said once: its record is read every heartbeat
                    logger.warning(f"ignoring the records of peer {record['peer_id']} in invite-only run {self.run}: "
                                   f"{problem}")
                continue
            kept.append(record)
            until = self.clock() + record.get("expires_in", 0.0)
            known = self._members.get(record["peer_id"])
            self._members[record["peer_id"]] = (read_ticket(record["ticket"]), max(until, known[1] if known else 0.0))
        return kept

    def admits_peer(self, peer_id: str) -> bool:
        """Whether ``peer_id`` has a record with a valid ticket that has not expired (an open run: anyone)."""
        if not self.invite_only:
            return True
        known = self._members.get(peer_id)
        if known is None:
            return False
        ticket, until = known
        if until <= self.clock() or ticket.expires <= self.clock() or ticket.id in self.revoked:
            del self._members[peer_id]
            return False
        return True

    def refusal(self, peer_id: PeerID, handler: str) -> Optional[str]:
        """The routes' gate (``Routes.gate``): why a message from ``peer_id`` is refused, in one line, or None."""
        if self.admits_peer(peer_id.to_base58()):
            return None
        return (f"{handler} from {peer_id}: not admitted to invite-only run {self.run} (no record with a valid "
                f"ticket from its owner)")


def admission_of(node) -> Optional[Admission]:
    """The :class:`Admission` a peer's node keeps (None: a node that reads as an observer of an open run)."""
    return getattr(node, "admission", None)


def admitted(node, records: List[Dict]) -> List[Dict]:
    """``records`` that count for ``node``'s peer (:meth:`Admission.admitted`; all where it keeps none)."""
    admission = admission_of(node)
    return records if admission is None else admission.admitted(records)
