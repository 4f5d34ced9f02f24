"""Records a node's validators accepted are checked once (net.node.ValidRecords): the cache must never let through
a record that differs in any signed part from one it accepted, nor remember a refusal."""

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer

from ravnest_swarm.membership.records import make_validators, peers_key
from ravnest_swarm.net.node import RememberingValidator, ValidRecords


class CountingValidator(RSASignatureValidator):
    """The signature check, counting how often it runs."""

    def __init__(self, key):
        super().__init__(key)
        self.checks = 0

    def validate(self, record):
        self.checks += 1
        return super().validate(record)


def signed_record(validator, value: dict, expiration: float) -> DHTRecord:
    record = DHTRecord(DHTID.generate(source=peers_key("cached")).to_bytes(),
                       MSGPackSerializer.dumps(validator.local_public_key), MSGPackSerializer.dumps(value), expiration)
    return DHTRecord(record.key, record.subkey, validator.sign_value(record), expiration)


def test_a_record_is_checked_once_and_any_change_to_a_signed_part_is_checked_again():
    counting = CountingValidator(RSAPrivateKey())
    validator = RememberingValidator([counting], ValidRecords())
    record = signed_record(counting, {"name": "v0"}, 1e9)
    assert validator.validate(record) and validator.validate(record)
    assert counting.checks == 1
    # each part of the record is signed: a change to any one is a new record, checked (and refused) again
    for changed in (DHTRecord(record.key, record.subkey, record.value, record.expiration_time + 1),
                    DHTRecord(record.key, record.subkey, record.value.replace(b"v0", b"v1"), record.expiration_time),
                    DHTRecord(DHTID.generate(source="other").to_bytes(), record.subkey, record.value,
                              record.expiration_time)):
        checks = counting.checks
        assert not validator.validate(changed)
        assert counting.checks == checks + 1
    # a refusal is not remembered: the same bad record is checked each time
    assert not validator.validate(changed) and counting.checks == checks + 2


def test_nodes_sharing_valid_records_check_a_record_once_and_the_oldest_digests_go_first():
    shared = ValidRecords(capacity=2)
    first, second = CountingValidator(RSAPrivateKey()), CountingValidator(RSAPrivateKey())
    a, b = RememberingValidator([first], shared), RememberingValidator([second], shared)
    records = [signed_record(first, {"n": n}, 1e9) for n in range(3)]
    assert a.validate(records[0]) and b.validate(records[0])
    assert (first.checks, second.checks) == (1, 0)
    assert a.validate(records[1]) and a.validate(records[2])  # records[0] is the oldest of three: forgotten
    assert b.validate(records[0]) and second.checks == 1


def test_the_run_validators_remembered_still_refuse_what_the_schema_refuses():
    key = RSAPrivateKey()
    validator = RememberingValidator(make_validators("cached", signing_key=key), ValidRecords())
    signer = RSASignatureValidator(key)
    assert not validator.validate(signed_record(signer, {"not": "a peer record"}, 1e9))


def test_the_schema_refuses_addresses_that_do_not_parse_and_plans_or_proposals_past_a_rounds_peers():
    """Bounds a review asked for, on the records themselves (test_hardening_records writes them as a stranger,
    whose identity check refuses them first): an address that is no multiaddr failed every ring of its writer; a
    plan of 4,096 stages was 600 KB and eight emptied the plan key; a proposal placed 16,384 peers (2 MB)."""
    import time

    import pydantic.v1 as pydantic

    from ravnest_swarm.membership.records import MAX_ROUND_PEERS, PeerRecord, PlanRecord, RoundProposal

    peer = dict(peer_id="QmPeer", name="p", state="training", ram_gb=1.0, bandwidth_mbps=1.0, gflops=1.0,
                reachability="direct", version="0.1.0", time=time.time())
    assert PeerRecord(**peer, maddrs=["/ip4/127.0.0.1/tcp/4001"])
    for garbage in ("/ip4/1.2.3.4/tcp/x", "/garbage", "not a multiaddr"):
        with pytest.raises(pydantic.ValidationError, match="not a multiaddr"):
            PeerRecord(**peer, maddrs=[garbage])
    stage = dict(peer_id="QmPeer", layers=[0, 1])
    assert PlanRecord(round=1, time=1.0, clusters=[[stage] * 64] * 4)  # 256: a round's peers
    with pytest.raises(pydantic.ValidationError, match="at most 256 stages"):
        PlanRecord(round=1, time=1.0, clusters=[[stage] * 64] * 4 + [[stage]])
    proposal = dict(round=1, deadline=1.0, peer_id="QmPeer", ram_gb=1.0, gflops=1.0, bandwidth_mbps=1.0, fitness=1.0,
                    time=1.0)
    assert RoundProposal(**proposal, clusters=[["QmPeer"] * 64] * (MAX_ROUND_PEERS // 64))
    with pytest.raises(pydantic.ValidationError, match="at most 256 peers"):
        RoundProposal(**proposal, clusters=[["QmPeer"] * 64] * (MAX_ROUND_PEERS // 64) + [["QmPeer"]])
