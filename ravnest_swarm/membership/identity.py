"""Records bound to their writer's identity: a record that names a peer counts only when that peer wrote it.

hivemind's ``RSASignatureValidator`` proves which key signed a record (its subkey embeds the key,
``[owner:ssh-rsa ...]``), not that the key belongs to the peer the record names. A peer of a run signs with its
p2pd identity (``net/identity.py``), so the key alone gives its peer id: :class:`PeerIdentityValidator` refuses a
peer record, stage endpoint, planning proposal or bucket summary whose ``peer_id`` is not its signer's. Installed
by ``records.make_validators`` on every node of a run, it applies where a record is stored and where it is read,
so a stranger can neither make an honest peer look ``leaving`` nor fill a run with made-up peers.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from typing import Dict, Iterable, Mapping

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer

from ravnest_swarm.net.identity import peer_id_of_owner
from ravnest_swarm.net.node import ValidRecords

logger = logging.getLogger(__name__)

NOT_THE_NAMED_PEER = "written by a key that is not the peer they name"
UNSIGNED = "not signed by any peer"
MISSHAPEN_SUBKEY = "under a subkey of another shape than their key's"
REFUSALS_REMEMBERED = 65536  # distinct refused records counted; beyond, the oldest are forgotten (and may recount)


class PeerIdentityValidator(RecordValidatorBase):
    """Refuses a value of ``keys`` unless its ``peer_id`` is the peer id of the key that signed it.

    Runs after the signature validator (which strips the signature, so the value here is plain msgpack) and beside
    the schema's. Counts what it refused, each distinct record once (a read validates the same record from every
    node that holds it), by reason (:attr:`refused`): ``status`` says them.

    :param keys: the DHT keys whose values name a peer (``records.identity_bound_keys``)
    """

    def __init__(self, keys: Iterable[str]):
        self.key_ids = {DHTID.generate(source=key).to_bytes() for key in keys}
        self.refused: Dict[str, int] = {}
        self._refused_records: "OrderedDict[bytes, None]" = OrderedDict()

    def validate(self, record: DHTRecord) -> bool:
        if record.key not in self.key_ids:
            return True
        owners = RSASignatureValidator._PUBLIC_KEY_RE.findall(record.subkey or b"")
        if len(owners) != 1:
            return self._refuse(record, UNSIGNED)
        try:
            value = MSGPackSerializer.loads(record.value)
        except Exception:  # anything a stranger can send: the schema validator refuses it as well
            return False
        named = value.get("peer_id") if isinstance(value, dict) else None
        if named is None or named != peer_id_of_owner(owners[0]):
            return self._refuse(record, NOT_THE_NAMED_PEER)
        return True

    def _refuse(self, record: DHTRecord, reason: str) -> bool:
        digest = ValidRecords.digest(record)
        if digest not in self._refused_records:
            self._refused_records[digest] = None
            if len(self._refused_records) > REFUSALS_REMEMBERED:
                self._refused_records.popitem(last=False)
            if reason not in self.refused:  # one line per reason: a stranger repeating itself does not flood the log
                logger.warning(f"refused a record {reason}")
            self.refused[reason] = self.refused.get(reason, 0) + 1
        return False

    def merge_with(self, other) -> bool:
        return False  # each run's keys are its own: another run's validator stays beside this one


class SubkeyShapeValidator(PeerIdentityValidator):
    """Refuses a value of one of ``shapes``' keys whose subkey is not that key's prefix (a regex over bytes) followed
    by exactly one signed public key: each writer has one subkey a key (one a round's plan, a bucket's summary, a
    stage's slot). hivemind's signature check takes any text before the key, so one key could fill a bucket of peer
    records, or the run's spec key, with as many copies as it liked, each read by every peer at every look.

    :param shapes: DHT key -> the pattern of what comes before ``[owner:...]`` in its subkeys
    """

    def __init__(self, shapes: Mapping[str, bytes]):
        super().__init__(())
        self.shapes = {DHTID.generate(source=key).to_bytes(): re.compile(prefix + rb"\[owner:[^\]]+\]")
                       for key, prefix in shapes.items()}

    def validate(self, record: DHTRecord) -> bool:
        shape = self.shapes.get(record.key)
        if shape is None:
            return True
        try:
            subkey = MSGPackSerializer.loads(record.subkey)  # a record carries its subkey serialized
        except Exception:
            subkey = None
        if isinstance(subkey, bytes) and shape.fullmatch(subkey):
            return True
        return self._refuse(record, MISSHAPEN_SUBKEY)


def refusals(validators: Iterable) -> Dict[str, int]:
    """What the :class:`PeerIdentityValidator` among a node's ``validators`` refused so far, by reason."""
    counts: Dict[str, int] = {}
    for validator in validators:
        if isinstance(validator, PeerIdentityValidator):
            for reason, count in validator.refused.items():
                counts[reason] = counts.get(reason, 0) + count
    return counts


def node_refusals(node) -> Dict[str, int]:
    """:func:`refusals` of a hivemind ``DHTNode``'s validators (its CompositeValidator keeps its parts in
    ``_validators``): what an observer's or a volunteer's dashboard says it refused."""
    validator = node.protocol.record_validator
    return refusals(getattr(validator, "_validators", [validator]))


def refusals_line(refused: Dict[str, int]) -> str:
    """``refused 12 records: 12 written by a key that is not the peer they name`` (empty without refusals)."""
    total = sum(refused.values())
    if not total:
        return ""
    return f"refused {total} record{'s' if total != 1 else ''}: " + "; ".join(
        f"{count} {reason}" for reason, count in sorted(refused.items(), key=lambda item: -item[1]))
