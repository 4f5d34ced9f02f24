"""Who decides what a run does, without a network: the owner's signed spec (membership/owner.py, swarm/spec.py)
and the plan that counts (membership/reader.adopted_plan). The same rules against real processes:
tests/test_attacks.py and tests/test_hardening_records.py."""

import os
import time

import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer

from ravnest_swarm.errors import UserError
from ravnest_swarm.membership.owner import (OwnerSpecValidator, fingerprint, load_or_create_owner_key,
                                            load_owner_key, sign_spec, spec_owner)
from ravnest_swarm.membership.reader import adopted_plan
from ravnest_swarm.membership.records import RunAddress, parse_run_address, spec_key
from ravnest_swarm.swarm.spec import RunSpec, choose_spec

OWNER = RSAPrivateKey()
OWNER_FINGERPRINT = fingerprint(OWNER.get_public_key().to_bytes())


def travelled(record: dict) -> dict:
    """A record as a reader gets it: through msgpack (tuples become lists)."""
    return MSGPackSerializer.loads(MSGPackSerializer.dumps(record))


def test_run_addresses_name_the_owner_or_give_one_line():
    assert parse_run_address("demo") == RunAddress("demo")
    assert parse_run_address("demo@0123456789abcdef") == RunAddress("demo", "0123456789abcdef")
    assert str(RunAddress("demo", "0123456789abcdef")) == "demo@0123456789abcdef"
    for bad, says in (("demo@", "16 hex digits"), ("demo@XYZ", "16 hex digits"), ("de mo", "invalid run name"),
                      ("demo@0123456789ABCDEF", "16 hex digits"), ("@0123456789abcdef", "invalid run name")):
        with pytest.raises(UserError, match=says) as error:
            parse_run_address(bad)
        assert "\n" not in str(error.value)


def test_the_owner_key_is_made_once_kept_private_and_a_corrupt_one_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # `--owner-key owner.key`, a bare name: an unexpected FileNotFoundError of ''
    assert load_or_create_owner_key("owner.key").to_bytes() == load_owner_key(str(tmp_path / "owner.key")).to_bytes()
    path = str(tmp_path / "owners" / "demo.key")
    assert load_owner_key(path) is None
    first = load_or_create_owner_key(path)
    assert load_or_create_owner_key(path).to_bytes() == first.to_bytes()  # reused, not replaced
    assert os.stat(path).st_mode & 0o077 == 0
    assert os.listdir(tmp_path / "owners") == ["demo.key"]  # no temporary file left behind
    with open(path, "wb") as f:
        f.write(b"not a key")
    with pytest.raises(UserError, match="not a DER RSA private key") as error:
        load_owner_key(path)
    assert "\n" not in str(error.value)


def test_a_spec_counts_only_as_its_owner_signed_it():
    record = travelled(RunSpec("mlp-digits").record(OWNER, "demo"))
    assert spec_owner(record) == OWNER_FINGERPRINT
    assert spec_owner(dict(record, lr=0.5)) is None  # altered after signing
    assert spec_owner(dict(record, owner=RSAPrivateKey().get_public_key().to_bytes().decode())) is None
    assert spec_owner(dict(record, signature="garbage")) is None
    assert spec_owner(dict(record, owner="not a key")) is None
    # the key with a comment after it verifies, and had a fingerprint of its own: only the key as written counts
    commented = dict(record, owner=record["owner"] + " a-comment", signature="")
    assert spec_owner(sign_spec(commented, OWNER) | {"owner": commented["owner"]}) is None


def test_nodes_refuse_specs_not_signed_by_the_owner_they_know():
    def as_record(value, key=spec_key("demo")):
        return DHTRecord(key=DHTID.generate(source=key).to_bytes(), subkey=MSGPackSerializer.dumps(b"k"),
                         value=MSGPackSerializer.dumps(value), expiration_time=time.time() + 60)

    honest = RunSpec("mlp-digits").record(OWNER, "demo")
    stranger = RunSpec("mlp-digits", lr=9.0).record(RSAPrivateKey(), "demo")
    knows_owner, knows_name = OwnerSpecValidator(spec_key("demo"), OWNER_FINGERPRINT), OwnerSpecValidator(spec_key("demo"))
    assert knows_owner.validate(as_record(honest)) and knows_name.validate(as_record(honest))
    assert not knows_owner.validate(as_record(stranger)) and knows_name.validate(as_record(stranger))
    assert knows_owner.refused == {spec_owner(stranger): 1}  # one line in the log per signer, and a count
    for validator in (knows_owner, knows_name):
        assert not validator.validate(as_record(dict(honest, lr=9.0)))
        assert not validator.validate(as_record([honest]))
        assert not validator.validate(DHTRecord(key=as_record(honest).key, subkey=DHTProtocol.IS_REGULAR_VALUE,
                                                value=MSGPackSerializer.dumps(honest), expiration_time=0))
        assert validator.validate(as_record(stranger, key="demo_peers"))  # other keys are not its business


def test_a_spec_counts_for_the_run_it_was_signed_for_and_a_run_started_anew_outranks_a_replay_of_the_old():
    """An owner key that signed specs of two runs (one ``--owner-key``), or of one name started anew (the default key
    file is the run name's): the old run's last version (3, finished) stored again by anyone once outranked the new
    run's version 1, and running peers followed it. A spec now names its run, signed, and the run's ``origin``
    (version 1's time), which every version carries and ranks first."""
    from dataclasses import replace

    from ravnest_swarm.swarm.spec import spec_order

    def as_record(value):
        return DHTRecord(key=DHTID.generate(source=spec_key("demo")).to_bytes(), subkey=MSGPackSerializer.dumps(b"k"),
                         value=MSGPackSerializer.dumps(value), expiration_time=time.time() + 60)

    validator = OwnerSpecValidator(spec_key("demo"), OWNER_FINGERPRINT)
    other_run = travelled(RunSpec("mlp-digits", lr=9.0).record(OWNER, "other"))
    assert spec_owner(other_run) == OWNER_FINGERPRINT and not validator.validate(as_record(other_run))
    assert not validator.refused  # the owner's signature is no fault: the record is of another run
    first = RunSpec.from_record(travelled(RunSpec("mlp-digits").record(OWNER, "demo")))
    old_last = travelled(replace(first, version=3, finished=True).record(OWNER, "demo"))
    time.sleep(0.01)
    anew = travelled(RunSpec("mlp-digits").record(OWNER, "demo"))  # the same address, started again
    anew_2 = travelled(replace(RunSpec.from_record(anew), version=2, lr=0.5).record(OWNER, "demo"))
    assert all(validator.validate(as_record(r)) for r in (old_last, anew, anew_2))
    assert old_last["origin"] == first.origin and anew_2["origin"] == anew["origin"] == anew["created"]
    assert anew["origin"] > old_last["origin"]
    assert max([old_last, anew], key=spec_order) is anew
    assert max([old_last, anew, anew_2], key=spec_order) is anew_2


def test_joiners_follow_the_addressed_owner_or_the_only_one_or_their_own():
    ours, theirs = travelled(RunSpec("mlp-digits").record(OWNER, "demo")), travelled(RunSpec("gpt-tiny").record(RSAPrivateKey(), "demo"))
    specs = {OWNER_FINGERPRINT: ours, spec_owner(theirs): theirs}
    assert choose_spec(specs, RunAddress("demo", OWNER_FINGERPRINT)) is ours
    assert choose_spec(specs, RunAddress("demo", "0" * 16)) is None  # that owner has not started it (yet)
    assert choose_spec({OWNER_FINGERPRINT: ours}, RunAddress("demo")) is ours
    assert choose_spec(specs, RunAddress("demo"), own=OWNER_FINGERPRINT) is ours
    with pytest.raises(UserError, match=f"2 owners .*demo@{OWNER_FINGERPRINT}") as error:
        choose_spec(specs, RunAddress("demo"))
    assert "\n" not in str(error.value)


def plan(round_number, *clusters):
    return dict(round=round_number, time=0.0, clusters=[[dict(peer_id=peer, layers=layers) for peer, layers in cluster]
                                                       for cluster in clusters])


def record(peer, plan_round, cluster, stage, layers):
    return dict(peer_id=peer, plan_round=plan_round, cluster=cluster, stage=stage, layers=layers)


def test_a_plan_counts_only_when_most_of_the_peers_it_places_follow_it():
    honest = plan(3, [("a", [0, 4]), ("b", [4, 8])], [("c", [0, 8])])
    peers = [record("a", 3, 0, 0, [0, 4]), record("b", 3, 0, 1, [4, 8]), record("c", 3, 1, 0, [0, 8])]
    far_ahead = dict(honest, round=10**15)  # a stranger's copy of the plan under a huge round
    invented = plan(4, [("mallory", [0, 8])])  # the next round, placing a peer that says nothing of it
    rewritten = plan(3, [("a", [0, 2]), ("b", [2, 8])], [("c", [0, 8])])  # same round, other layers
    assert adopted_plan([honest, far_ahead, invented, rewritten], peers) == honest
    assert adopted_plan([far_ahead, invented, rewritten], peers) is None
    # most, not all: a placed peer whose record is gone or late does not unseat the plan
    assert adopted_plan([honest], peers[1:]) == honest
    # most of the live ones: peers that are gone confirm nothing either way (the plan c still follows when a and b
    # left), but live peers that follow another plan are a majority against it
    assert adopted_plan([honest], peers[2:]) == honest
    assert adopted_plan([honest], [record("a", 2, 0, 0, [0, 4]), record("b", 2, 0, 1, [4, 8])] + peers[2:]) is None
    assert adopted_plan([invented], peers) is None and adopted_plan([honest], []) is None
    # a peer that follows round 4 confirms it, and a planner that adopted round 3 may follow round 4, not 6
    moved = [record("a", 4, 0, 0, [0, 8])]
    assert adopted_plan([honest, plan(4, [("a", [0, 8])])], moved + peers[1:], live_round=3)["round"] == 4
    assert adopted_plan([honest, plan(6, [("a", [0, 8])])], [record("a", 6, 0, 0, [0, 8])] + peers[1:],
                        live_round=3) == honest


@pytest.mark.timeout(60)
def test_a_peer_stores_the_spec_it_follows_again_where_no_copy_outlives_the_renewal_margin():
    """Nothing stored a spec again: the owner's newest version expired a week after it was signed, and an older one
    a stranger kept storing became the run's. ``keep_spec_alive`` stores the followed record as it is, once no copy
    of it (another version is no copy) outlives the margin. Real DHT nodes on 127.0.0.1."""
    import asyncio

    from hivemind.utils.timed_storage import get_dht_time

    from ravnest_swarm.membership.records import make_validators, signing_validator
    from ravnest_swarm.net.node import parse_maddrs, start_node, stop_node
    from ravnest_swarm.swarm.spec import keep_spec_alive

    version_1 = RunSpec("mlp-digits").record(OWNER, "demo")
    version_2 = RunSpec.from_record(version_1)
    version_2.version, version_2.lr = 2, 0.5
    version_2 = version_2.record(OWNER, "demo")

    async def scenario():
        first = await start_node(host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=make_validators("demo"))
        maddrs = [str(m) for m in await first.p2p.get_visible_maddrs()]
        peer = await start_node(parse_maddrs(maddrs), host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                record_validators=make_validators("demo"))
        try:
            # the newest version, about to expire; the peer's own copy of an older one, which counts for nothing
            assert await first.store(spec_key("demo"), version_2, get_dht_time() + 30,
                                     subkey=signing_validator(first).local_public_key)
            assert await peer.store(spec_key("demo"), version_1, get_dht_time() + 3000,
                                    subkey=signing_validator(peer).local_public_key)
            renewed = await keep_spec_alive(peer, "demo", version_2, renew_before=60, lifetime=6000)
            found = await peer.get(spec_key("demo"), latest=True)
            expirations = sorted(item.expiration_time - get_dht_time() for item in found.value.values()
                                 if item.value == version_2)
            again = await keep_spec_alive(peer, "demo", version_2, renew_before=60, lifetime=6000)
            return renewed, expirations, again
        finally:
            await stop_node(peer)
            await stop_node(first)

    renewed, expirations, again = asyncio.run(scenario())
    assert renewed and expirations[-1] > 5000, expirations  # stored again for the lifetime, beside the old copy
    assert not again  # a copy outlives the margin now: nobody stores it again
