"""The run owner: the key that alone may decide what a run trains.

Whoever starts a run creates (or reuses) an RSA owner key, kept in a file on their machine. The run's
address, ``demo@<fingerprint>``, names that key: the fingerprint is the first 16 hex digits of the
sha256 of its public key. Every spec the run follows is signed by it (:func:`sign_spec`); the owner can
sign a newer version (``ravnest-swarm update-spec``), nobody else can. A node that knows the run's
address installs :class:`OwnerSpecValidator`, so it neither stores nor reads a spec signed by anyone
else; one that knows only the name still refuses specs whose signature does not match their own key.

Why a signature inside the value and not hivemind's signed subkeys: those are signed by each process's own
key (``RSASignatureValidator``), so they say who wrote a record, not who may decide; the owner's key never
leaves the owner's machine, and any process may carry its signed spec.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from typing import Dict, Optional

from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.serializer import MSGPackSerializer

import ravnest_swarm.net  # noqa: F401  (its import bounds MSGPackSerializer's depth: net/serializer.py)

from ravnest_swarm.errors import UserError

logger = logging.getLogger(__name__)

FINGERPRINT_RE = re.compile(r"^[0-9a-f]{16}\Z")
RUN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,47}$")  # the other half of a run's address
OWNER_KEYS_ENV = "RAVNEST_OWNER_KEYS"  # where owner keys live; default ~/.config/ravnest-swarm/owners
MAX_SIGNERS_COUNTED = 64  # distinct signers of refused specs a validator names; the rest count as "others"


def fingerprint(public_key: bytes) -> str:
    """A public key's short name in run addresses: 16 hex digits of its sha256."""
    return hashlib.sha256(public_key).hexdigest()[:16]


def owner_key_path(run: str) -> str:
    folder = os.environ.get(OWNER_KEYS_ENV) or os.path.join(os.path.expanduser("~"), ".config", "ravnest-swarm",
                                                            "owners")
    return os.path.join(folder, f"{run}.key")


def load_owner_key(path: str) -> Optional[RSAPrivateKey]:
    """The owner key kept at ``path``, or None if there is none; an unreadable key is one line."""
    try:
        with open(path, "rb") as f:
            der = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise UserError(f"cannot read the run owner key {path}: {e.strerror}")
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    try:
        key.__setstate__({"_private_key": der})  # hivemind's own way back from its DER bytes
    except ValueError:
        raise UserError(f"the run owner key {path} is not a DER RSA private key (corrupt?): move it away to start "
                        f"a new run, or restore it to publish this run's specs")
    return key


def required_owner_key(run: str, path: Optional[str]) -> RSAPrivateKey:
    """The owner key a command that signs for run ``run`` needs (``path``, else the run's default file), or a
    one-line :class:`UserError` where this machine has none."""
    path = path or owner_key_path(run)
    key = load_owner_key(path)
    if key is None:
        raise UserError(f"no run owner key at {path}: only the machine that started the run holds it "
                        f"(--owner-key names another file)")
    return key


def load_or_create_owner_key(path: str) -> RSAPrivateKey:
    """The owner key at ``path``, created (readable by this user only) if there is none.

    Created atomically: peers started at once on one machine (``local``, tests) all end with the same key.
    """
    key = load_owner_key(path)
    if key is not None:
        return key
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)  # a bare file name is in the current directory
    fresh = RSAPrivateKey()
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(fresh.to_bytes())
    try:
        os.link(temporary, path)  # fails if another process made one first: then theirs is the key
    except FileExistsError:
        pass
    finally:
        os.unlink(temporary)
    return load_owner_key(path)


def public_key_text(key: RSAPrivateKey) -> str:
    return key.get_public_key().to_bytes().decode()


def _signed_bytes(record: dict) -> bytes:
    """The bytes an owner signs: every field of the record but the signature, sorted by name (msgpack keeps
    the order, so signer and verifier agree whatever order the record travelled in)."""
    return MSGPackSerializer.dumps({name: record[name] for name in sorted(record) if name != "signature"})


def sign_spec(record: dict, key: RSAPrivateKey) -> dict:
    """``record`` with ``owner`` (the key's public half) and ``signature`` set."""
    record = dict(record, owner=public_key_text(key), signature="")
    return dict(record, signature=key.sign(_signed_bytes(record)).decode())


def spec_owner(record: dict) -> Optional[str]:
    """The fingerprint of the key that signed the spec ``record``, or None if its signature does not hold."""
    try:
        public = RSAPublicKey.from_bytes(record["owner"].encode())
        # the key as its holder writes it, nothing around it: a trailing comment made a new fingerprint of one key,
        # so finding a key whose address matches a run's took hashes, not key generations
        if public.to_bytes() != record["owner"].encode():
            return None
        if not public.verify(_signed_bytes(record), record["signature"].encode()):
            return None
    except Exception:  # anything a stranger can put in a record: a malformed key or signature is no owner
        return None
    return fingerprint(record["owner"].encode())


class OwnerSpecValidator(RecordValidatorBase):
    """Refuses a value of the run's spec key not signed by the key it names, or (``owner`` given) by another owner, or
    signed for another run (its ``run``: an owner key that signs two runs' specs has each count for its own).

    :param spec_key: the run's spec key (``records.spec_key``: ``{run}_spec``)
    :param owner: the fingerprint of the run's owner, from its address; None accepts any self-consistent owner
    """

    def __init__(self, spec_key: str, owner: Optional[str] = None):
        self.spec_key, self.owner = spec_key, owner
        self.run = spec_key.removesuffix("_spec")
        self.key_id = DHTID.generate(source=spec_key).to_bytes()
        self.refused: Dict[str, int] = {}  # who signed the specs we refused ("unsigned": nobody valid) -> count

    def validate(self, record: DHTRecord) -> bool:
        if record.key != self.key_id:
            return True
        if record.subkey in DHTProtocol.RESERVED_SUBKEYS:
            return False  # a spec lives under a subkey; the schema refuses the rest too
        try:
            value = MSGPackSerializer.loads(record.value)
        except Exception:
            return False
        signed_by = spec_owner(value) if isinstance(value, dict) else None
        if signed_by is not None and (self.owner is None or signed_by == self.owner):
            return value.get("run") == self.run  # another run's spec, replayed here: its signature is no fault
        culprit = signed_by or "unsigned"
        if culprit not in self.refused and len(self.refused) >= MAX_SIGNERS_COUNTED:
            culprit = "others"  # keys are free: a stranger making a new one per record must not grow this map
        if culprit not in self.refused:  # one line per signer: a stranger repeating itself does not flood the log
            logger.warning(f"refused a {self.spec_key} record signed by {culprit}, not by the run's owner "
                           f"{self.owner or '(any valid signature)'}")
        self.refused[culprit] = self.refused.get(culprit, 0) + 1
        return False
