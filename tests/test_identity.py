"""A peer's identity (``net/identity.py``) and the rule that a record naming a peer is that peer's own
(``membership/identity.py``), without a network: the real-process attacks are in ``tests/test_attacks.py``,
``tests/test_hardening_records.py`` and ``tests/test_forged_summaries.py``."""

import dataclasses
import os

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer

from ravnest_swarm.errors import UserError
from ravnest_swarm.membership.identity import MISSHAPEN_SUBKEY, NOT_THE_NAMED_PEER, refusals, refusals_line
from ravnest_swarm.membership.records import (PeerRecord, make_validators, peers_key, plan_key, plan_subkey_prefix,
                                              round_key, spec_key, stage_subkey_prefix, stages_key, summary_key,
                                              summary_subkey_prefix)
from ravnest_swarm.net.identity import load_identity, open_identity, p2pd_identity_file, peer_id_of_owner
from ravnest_swarm.net.node import RememberingValidator, ValidRecords

RUN = "identity"


def record_of(peer_id: str) -> dict:
    return PeerRecord(peer_id=peer_id, name="p", state="training", ram_gb=1.0, bandwidth_mbps=1.0, gflops=1.0,
                      reachability="direct", maddrs=[], version="0.1.0", time=1.0).dict()


def signed(key: RSAPrivateKey, dht_key: str, value: dict, prefix: bytes = b"") -> DHTRecord:
    signer = RSASignatureValidator(key)
    record = DHTRecord(DHTID.generate(source=dht_key).to_bytes(),
                       MSGPackSerializer.dumps(prefix + signer.local_public_key), MSGPackSerializer.dumps(value), 1e10)
    return dataclasses.replace(record, value=signer.sign_value(record))


def test_the_peer_id_of_a_record_writer_is_its_p2pd_identitys(tmp_path):
    identity = load_identity(str(tmp_path / "peer.key"))  # created
    with open(identity.path, "rb") as f:
        assert identity.peer_id == PeerID.from_identity(f.read()).to_base58()
    again = load_identity(identity.path)  # a restart with --identity keeps the id
    assert again.peer_id == identity.peer_id and not again.new and identity.new
    fresh = open_identity(None)
    with p2pd_identity_file(fresh) as path:  # what p2pd starts with, removed once it has started
        with open(path, "rb") as f:
            assert PeerID.from_identity(f.read()).to_base58() == fresh.peer_id
        assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert not os.path.exists(path)
    assert peer_id_of_owner(b"ssh-rsa not a key") is None
    (tmp_path / "junk.key").write_bytes(b"not a key")
    with pytest.raises(UserError, match="not a private key file"):
        load_identity(str(tmp_path / "junk.key"))


def test_a_record_naming_a_peer_counts_only_when_that_peer_signed_it():
    honest, stranger = open_identity(None), open_identity(None)
    validators = make_validators(RUN, signing_key=stranger.key)
    node_validator = RememberingValidator(validators, ValidRecords())
    own = signed(honest.key, peers_key(RUN), record_of(honest.peer_id))
    assert node_validator.validate(own)
    copy = signed(stranger.key, peers_key(RUN), dict(record_of(honest.peer_id), state="leaving", time=2.0))
    made_up = signed(stranger.key, peers_key(RUN, 4, 1), record_of(open_identity(None).peer_id))
    endpoint = dict(peer_id=honest.peer_id, maddrs=[], model="mlp-digits", layers=[0, 1], version=1, time=1.0)
    foreign_endpoint = signed(stranger.key, stages_key(RUN, 3), endpoint, prefix=stage_subkey_prefix(3, 0))
    for refused in (copy, made_up, foreign_endpoint, copy):  # the copy twice: one record, counted once
        assert not node_validator.validate(refused)
    assert refusals(validators) == {NOT_THE_NAMED_PEER: 3}
    assert refusals_line(refusals(validators)) == f"refused 3 records: 3 {NOT_THE_NAMED_PEER}"
    # a stranger speaking for itself is no forgery: its own record, in its own name, is stored and read
    assert node_validator.validate(signed(stranger.key, peers_key(RUN), record_of(stranger.peer_id)))


def test_one_key_writes_one_record_a_key_under_the_subkey_of_its_shape():
    """hivemind's signature check takes any text before the writer's key in a subkey: one identity stored 200 peer
    records in one bucket (1 MB, read by every peer at every look) and 50 copies of the owner's spec. Each key takes
    the subkey its writers use: nothing before the key for peers, proposals and the spec; the round, the bucket or
    the slot where the record is of one."""
    peer = open_identity(None)
    validators = make_validators(RUN, signing_key=peer.key)
    node_validator = RememberingValidator(validators, ValidRecords())
    record = record_of(peer.peer_id)
    assert node_validator.validate(signed(peer.key, peers_key(RUN), record))
    assert node_validator.validate(signed(peer.key, peers_key(RUN, 4, 1), record))
    endpoint = dict(peer_id=peer.peer_id, maddrs=[], model="mlp-digits", layers=[0, 1], version=1, time=1.0)
    assert node_validator.validate(signed(peer.key, stages_key(RUN, 3), endpoint, prefix=stage_subkey_prefix(3, 0)))
    for copy in range(3):
        for key in (peers_key(RUN), peers_key(RUN, 4, 1)):
            assert not node_validator.validate(signed(peer.key, key, record, prefix=b"%08d" % copy))
    for key, prefix in ((spec_key(RUN), b"0"), (round_key(RUN), b"1."), (plan_key(RUN), b""),
                        (plan_key(RUN), b"x."), (summary_key(RUN), b"4.1"), (stages_key(RUN, 3), b"3.0.")):
        assert not node_validator.validate(signed(peer.key, key, {"any": "value"}, prefix=prefix)), (key, prefix)
    assert refusals(validators) == {MISSHAPEN_SUBKEY: 12}
    shapes = [v for v in validators if type(v).__name__ == "SubkeyShapeValidator"][0]
    for key, prefix in ((plan_key(RUN), plan_subkey_prefix(7)), (summary_key(RUN), summary_subkey_prefix(4, 1))):
        subkey = MSGPackSerializer.dumps(prefix + RSASignatureValidator(peer.key).local_public_key)
        assert shapes.validate(DHTRecord(DHTID.generate(source=key).to_bytes(), subkey, b"", 1e10)), key
