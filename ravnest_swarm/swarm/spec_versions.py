"""New versions of a running run's spec, which only its owner signs: a new lr, length or end, who is admitted
(``update-spec``), and the end its owner's own peer signs once the run reached its length (``swarm/volunteer.py``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Optional, Sequence

from hivemind.dht.node import DHTNode
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from ravnest_swarm.errors import UserError
from ravnest_swarm.membership.owner import fingerprint, required_owner_key
from ravnest_swarm.membership.reader import why_finished
from ravnest_swarm.membership.records import RunAddress, signing_validator, spec_key
from ravnest_swarm.membership.tickets import MAX_REVOKED, TICKET_ID_RE
from ravnest_swarm.net.node import store_record
from ravnest_swarm.swarm.spec import FOLLOWED, SPEC_LIFETIME, RunSpec, read_specs, run_length


async def publish_spec_version(node: DHTNode, address: RunAddress, changes: Dict, key: RSAPrivateKey,
                               revoke: Sequence[str] = ()) -> RunSpec:
    """Sign and publish the next version of the run's spec with ``changes`` (fields of ``FOLLOWED`` only), and the
    ticket ids ``revoke`` added to those it revokes (at most ``tickets.MAX_REVOKED`` in all: a one-line refusal past
    them).

    Only the run's owner can: a key whose fingerprint is not the run's gets a one-line :class:`UserError`.
    """
    own = fingerprint(key.get_public_key().to_bytes())
    if address.owner is not None and address.owner != own:
        raise UserError(f"your owner key is {address.name}@{own}, not the owner of run {address}: only the key that "
                        f"started the run can change its spec", exit_code=1)
    unchangeable = sorted(set(changes) - set(FOLLOWED))
    if unchangeable:
        raise UserError(f"a running run can change only {', '.join(FOLLOWED)}, not {', '.join(unchangeable)}",
                        exit_code=1)
    specs = await read_specs(node, address.name)
    current = specs.get(own)
    if current is None:
        raise UserError(f"run {address.name!r} has no spec signed by your owner key ({address.name}@{own})"
                        + (f"; its owners: {', '.join(sorted(specs))}" if specs else ""), exit_code=1)
    finished = await why_finished(node, address.name, current) if "steps" in changes else None
    if finished is not None:  # its stages stopped and only serve their layers: a new length would train nothing
        raise UserError(f"run {address.name} is finished ({finished}): a new length would train nothing; to train on, "
                        f"start a new run from its model: ravnest-swarm export, then join --init-from DIR", exit_code=1)
    spec = replace(RunSpec.from_record(current), **changes, version=current["version"] + 1)
    if revoke:
        revoked = [ticket for ticket in spec.revoked if ticket not in revoke] + list(dict.fromkeys(revoke))
        if len(revoked) > MAX_REVOKED:  # dropping the oldest would admit its ticket again, unsaid
            raise UserError(f"run {address} would revoke {len(revoked)} tickets, over the {MAX_REVOKED} a spec lists: "
                            f"a revoked ticket stays revoked; give new tickets shorter --expires", exit_code=1)
        spec = replace(spec, revoked=revoked)
    if not await store_record(node, spec_key(address.name), spec.record(key, address.name),
                              get_dht_time() + SPEC_LIFETIME, subkey=signing_validator(node).local_public_key):
        raise UserError(f"no DHT node stored the new spec of run {address}: check the --initial-peers", exit_code=1)
    return spec


async def update_spec(initial_peers: List[str], run: str, changes: Dict, owner_key_file: Optional[str],
                      timeout: float, revoke: Sequence[str] = ()) -> None:
    """``ravnest-swarm update-spec``: sign and publish the next spec version of the run at ``run``, revoking the
    tickets ``revoke``."""
    from ravnest_swarm.membership.records import make_validators, parse_run_address
    from ravnest_swarm.net.node import parse_maddrs, start_node, stop_node

    if not changes and not revoke:
        raise UserError("say what to change: --lr, --steps, --finish, --invite-only or --revoke")
    for ticket in revoke:
        if not TICKET_ID_RE.match(ticket):
            raise UserError(f"--revoke {ticket!r}: a ticket id is 16 hex digits, as `invite` printed it")
    revoke = list(dict.fromkeys(revoke))  # a ticket given twice is revoked (and said) once
    address = parse_run_address(run)
    key = required_owner_key(address.name, owner_key_file)
    node = await start_node(parse_maddrs(initial_peers), record_validators=make_validators(address.name, address.owner),
                            client_mode=True, timeout=timeout)
    try:
        spec = await publish_spec_version(node, address, changes, key, revoke)
    finally:
        await stop_node(node)
    said = {"finished": lambda value: "finished" if value else "not finished",
            "invite_only": lambda value: "invite-only" if value else "open to anyone",
            "steps": lambda value: f"steps={run_length(value)}"}
    print(f"run {address.name}@{fingerprint(key.get_public_key().to_bytes())} spec version {spec.version}: "
          + ", ".join([said[name](value) if name in said else f"{name}={value}" for name, value in changes.items()]
                      + [f"ticket {ticket} revoked" for ticket in revoke]), flush=True)
