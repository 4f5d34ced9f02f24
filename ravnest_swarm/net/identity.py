"""A peer's identity: one RSA key that is both its p2pd identity (its peer id) and the key it signs DHT records with.

A peer id is the sha256 multihash of the libp2p ``PublicKey`` protobuf of the key's DER SubjectPublicKeyInfo
(``hivemind.p2p.PeerID.from_identity``). hivemind signs a record under a subkey that embeds the writer's public key
(``[owner:ssh-rsa ...]``, ``RSASignatureValidator``). With one key for both, anyone can compute from a record's
subkey the peer id of its writer (:func:`peer_id_of_owner`), and a record that names another peer id than its
writer's is refused (``membership/identity.py``): a stranger cannot speak for an honest peer, nor for made-up ones.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator, Optional

import multihash
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from ravnest_swarm.errors import UserError

# distinct writer keys whose peer id is remembered: checking a record costs a dictionary look-up, not a hash and a
# key parse, for the keys of a bucket's peers many times over (every read of a bucket validates every record)
OWNER_PEER_IDS_CACHED = 65536


@dataclass(frozen=True)
class PeerIdentity:
    """A peer's RSA key, and the file p2pd reads it from (None: made for this process only, see
    :func:`p2pd_identity_file`); ``new``: made now, so no other peer can be using it."""

    key: RSAPrivateKey
    path: Optional[str] = None
    new: bool = True

    @property
    def peer_id(self) -> str:
        return peer_id_of_owner(self.key.get_public_key().to_bytes())


def libp2p_private_key(key: RSAPrivateKey) -> bytes:
    """``key`` as p2pd reads an identity file: a libp2p ``PrivateKey`` protobuf of its PKCS#1 DER form."""
    return crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=key.to_bytes()).SerializeToString()


def check_identity_file(path: str) -> None:
    """Raise a :class:`UserError` naming ``path`` unless it is a private key file, or a new file we can create.

    hivemind creates a missing one (an RSA key) and passes an existing one to p2pd, which would stop with
    "proto: cannot parse invalid wire-format data" for any other file, and a directory ended in a traceback.
    """
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(path):
        if not os.path.isdir(directory):
            raise UserError(f"identity directory {directory} does not exist: create it or pass another --identity")
        if not os.access(directory, os.W_OK):
            raise UserError(f"cannot create --identity {path}: directory {directory} is not writable by this user")
        return
    if os.path.isdir(path):
        raise UserError(f"--identity {path} is a directory: pass the path of a key file (created on the first start)")
    if not os.path.isfile(path):
        raise UserError(f"--identity {path} is not a regular file: pass the path of a key file")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UserError(f"cannot read --identity {path} ({e.strerror}): run as the user that owns it, or fix its "
                        f"permissions")
    try:
        PeerID.from_identity(data)
    except Exception:
        raise UserError(f"--identity {path} is not a private key file (ravnest-swarm writes an RSA key in libp2p's "
                        f"format there): pass the right file, or a new path to create one")


def load_identity(path: str) -> PeerIdentity:
    """The identity in the file at ``path`` (``join --identity``), created if there is none, so a peer restarted
    with it keeps its peer id; a file that is no such key is a one-line :class:`UserError`."""
    check_identity_file(path)
    if not os.path.exists(path):
        fresh = RSAPrivateKey()
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(libp2p_private_key(fresh))
        return PeerIdentity(fresh, path, new=True)
    with open(path, "rb") as f:
        stored = crypto_pb2.PrivateKey.FromString(f.read())
    if stored.key_type != crypto_pb2.KeyType.RSA:
        raise UserError(f"--identity {path} holds a {crypto_pb2.KeyType.Name(stored.key_type)} key: a peer of a run "
                        f"signs its records with its identity, which must be RSA (pass a new path to create one)")
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": stored.data})  # hivemind's own way back from its DER bytes
    return PeerIdentity(key, path, new=False)


def open_identity(path: Optional[str]) -> PeerIdentity:
    """The identity at ``path`` (:func:`load_identity`), or a new one for this process alone: a peer restarted
    without ``--identity`` gets a new peer id, as it always did."""
    return load_identity(path) if path is not None else PeerIdentity(RSAPrivateKey())


@contextmanager
def p2pd_identity_file(identity: PeerIdentity) -> Iterator[str]:
    """The file p2pd starts with: the identity's own, or, for one made for this process, a file readable by this
    user only that exists while p2pd starts (p2pd reads it once, at its start) and is removed after."""
    if identity.path is not None:
        yield identity.path
        return
    descriptor, path = tempfile.mkstemp(prefix="ravnest-identity-", suffix=".key")
    try:
        with os.fdopen(descriptor, "wb") as f:
            f.write(libp2p_private_key(identity.key))
        yield path
    finally:
        os.unlink(path)


@lru_cache(maxsize=OWNER_PEER_IDS_CACHED)
def peer_id_of_owner(public_key: bytes) -> Optional[str]:
    """The peer id of the peer whose identity is the RSA key ``public_key`` (ssh-rsa text, as a record's subkey
    embeds it), or None for what is not an RSA public key."""
    try:
        key = serialization.load_ssh_public_key(public_key)
    except (ValueError, TypeError, NotImplementedError):
        return None
    if not isinstance(key, rsa.RSAPublicKey):
        return None
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString()
    return PeerID(multihash.encode(hashlib.sha256(encoded).digest(), "sha2-256")).to_base58()
