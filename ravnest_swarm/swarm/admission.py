"""Admission to an invite-only run, from both ends: the owner signs tickets (``ravnest-swarm invite``,
:func:`print_invite`); a volunteer's ticket is checked before it trains, and again at each of the owner's spec
versions (a revoked ticket: it leaves with one line). What counts as admitted is ``membership/tickets.py``; this
installs it on the peer's node, where the readers and the routes' gate find it."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Callable, Optional

from ravnest_swarm.errors import UserError
from ravnest_swarm.membership.owner import fingerprint, load_owner_key, owner_key_path, required_owner_key
from ravnest_swarm.membership.records import RunAddress, parse_run_address
from ravnest_swarm.membership.tickets import Admission, admission_of, issue_ticket, parse_expiry
from ravnest_swarm.swarm.spec import RunSpec, read_specs

OWN_TICKET_SECONDS = 365 * 86400  # the owner's own peers admit themselves with a ticket they sign as they join
SPEC_READS = 5


def own_ticket(address: RunAddress, owner_key_file: Optional[str], peer_id: str) -> Optional[str]:
    """A ticket for our own peer id where this machine holds the run's owner key (the owner's peers need none
    given), else None."""
    key = load_owner_key(owner_key_file or owner_key_path(address.name))
    if key is None or fingerprint(key.get_public_key().to_bytes()) != address.owner:
        return None
    return issue_ticket(key, address.name, peer_id, time.time() + OWN_TICKET_SECONDS)[0]


async def enter(membership, spec: RunSpec, owner: str, ticket: Optional[str], owner_key_file: Optional[str],
                say: Callable[[str], None]) -> Admission:
    """Install the run's :class:`Admission` on our node (``node.admission``, and the routes' gate) and, in an
    invite-only run, publish our ticket: without one that admits us, a one-line :class:`UserError`.

    :param owner: the run owner's fingerprint, whose signed spec names the key tickets are checked against
    :param ticket: the token ``join --ticket`` gave (None: our own, where we hold the owner key)
    """
    node, address = membership.node, RunAddress(membership.options.run, owner)
    for _ in range(SPEC_READS):  # ensure_spec has just read it: a read that misses it now is a DHT hiccup
        record = (await read_specs(node, address.name)).get(owner)
        if record is not None:
            break
        await asyncio.sleep(1.0)
    else:
        raise UserError(f"could not read the spec of run {address} again after {SPEC_READS} tries: try joining again",
                        exit_code=1)
    admission = Admission(address.name, record["owner"], spec.invite_only, spec.revoked, say=say)
    node.admission = admission
    node.routes.gate = admission.refusal
    if spec.invite_only:
        await publish_ticket(membership.announcer, admission, address, ticket, owner_key_file)
    elif ticket is not None:
        membership.announcer.update(ticket=ticket)  # kept for when the owner makes the run invite-only
    return admission


async def publish_ticket(announcer, admission: Admission, address: RunAddress, ticket: Optional[str],
                         owner_key_file: Optional[str]) -> None:
    """Check that ``ticket`` (or our own, as the owner) admits us, and put it in our record at once."""
    token = ticket or own_ticket(address, owner_key_file, announcer.peer_id)
    if token is None:
        raise UserError(f"run {address} is invite-only: ask its owner for a ticket (`ravnest-swarm invite`) and "
                        f"join with --ticket", exit_code=1)
    problem = admission.problem(token, announcer.peer_id)
    if problem is not None:
        raise UserError(f"your ticket does not admit you to run {address}: {problem}", exit_code=1)
    announcer.update(ticket=token)
    await announcer.renew()


async def follow_admission(membership, spec: RunSpec, owner: str, owner_key_file: Optional[str]) -> None:
    """The owner's newer spec ``spec``: who is admitted follows it (a revoked ticket's peer is dropped); a run that
    became invite-only gets our ticket (the owner's peers sign their own); where ours no longer admits us, we leave
    with a one-line :class:`UserError`."""
    admission = admission_of(membership.node)
    if admission is None:
        return
    admission.follow(spec.invite_only, spec.revoked)
    if not spec.invite_only:
        return
    announcer, address = membership.announcer, RunAddress(membership.options.run, owner)
    token = announcer.record.get("ticket")
    if token is None:
        await publish_ticket(announcer, admission, address, None, owner_key_file)
        return
    problem = admission.problem(token, announcer.peer_id)
    if problem is not None:
        raise UserError(f"leaving run {address}: {problem} (the owner's spec version {spec.version})", exit_code=1)


def print_invite(run: str, peer: Optional[str], expires: str, owner_key_file: Optional[str]) -> None:
    """``ravnest-swarm invite``: a ticket to the run at ``run`` signed by its owner key, on stdout; what it admits, on
    stderr. Offline: the key signs, nothing is published."""
    address = parse_run_address(run)
    if address.owner is None:
        raise UserError(f"--run {run}: give the run's full address (name@owner), as `join` printed it when it started "
                        f"the run")
    until = parse_expiry(expires)
    key_file = owner_key_file or owner_key_path(address.name)
    key = required_owner_key(address.name, key_file)
    if fingerprint(key.get_public_key().to_bytes()) != address.owner:
        raise UserError(f"the owner key {key_file} is not run {address}'s (it is {address.name}@"
                        f"{fingerprint(key.get_public_key().to_bytes())}): only the run's owner signs its tickets")
    token, ticket = issue_ticket(key, address.name, peer, until)
    print(token, flush=True)
    print(f"{ticket.describe()}: pass it to `join --ticket`; revoke it with `update-spec --revoke {ticket.id}`",
          file=sys.stderr, flush=True)
