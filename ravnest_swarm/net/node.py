"""Starting and stopping a DHT node on hivemind's p2pd, with the routes to its peers; multiaddr checks that
turn bad input into one line; storing a record on the backbones as well."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import os
import socket
import struct
import time
from collections import OrderedDict
from contextlib import closing, nullcontext
from typing import Any, Callable, List, Optional, Sequence

from hivemind.dht.node import DHTID, DHTNode
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.p2p.p2p_daemon import P2PD_FILENAME
from hivemind.utils.multiaddr import Multiaddr

from ravnest_swarm.errors import UserError
from ravnest_swarm.net.identity import PeerIdentity, check_identity_file, p2pd_identity_file
from ravnest_swarm.net.routes import Routes, start_routes

logger = logging.getLogger(__name__)

class SwarmNode(DHTNode):
    """hivemind's DHT node, with the :class:`~ravnest_swarm.net.routes.Routes` of its p2pd (set by :func:`start_node`)."""

    routes: Routes


class ValidRecords:
    """Digests of the records a node's validators accepted, the newest ``capacity`` of them.

    hivemind validates every record of every answer: a read of a bucket of 64 records asks each of the key's
    holders and checks the whole bucket from each (and again where it caches the merged bucket on the nearest
    node), so the same signed record is checked five times or more per read, an RSA verification each time. A
    record's validity depends on its bytes alone (key, subkey, value and expiration are what is signed; the
    run's schema and owner are fixed per node), so a record once accepted is accepted again by its digest.
    Refusals are not remembered: they are cheap, and our validators count them.
    """

    def __init__(self, capacity: int = 65536):
        self.capacity = capacity
        self._digests: "OrderedDict[bytes, None]" = OrderedDict()

    @staticmethod
    def digest(record: DHTRecord) -> bytes:
        lengths = struct.pack("<dII", record.expiration_time, len(record.subkey), len(record.value))
        return hashlib.blake2b(lengths + record.key + record.subkey + record.value, digest_size=32).digest()

    def __contains__(self, digest: bytes) -> bool:
        if digest in self._digests:
            self._digests.move_to_end(digest)
            return True
        return False

    def add(self, digest: bytes) -> None:
        self._digests[digest] = None
        if len(self._digests) > self.capacity:
            self._digests.popitem(last=False)


class RememberingValidator(CompositeValidator):
    """hivemind's composite of a node's validators that checks each distinct record once (:class:`ValidRecords`)."""

    def __init__(self, validators: Sequence, valid_records: ValidRecords):
        super().__init__(validators)
        self.valid_records = valid_records

    def validate(self, record: DHTRecord) -> bool:
        digest = ValidRecords.digest(record)
        if digest in self.valid_records:
            return True
        valid = super().validate(record)
        if valid:
            self.valid_records.add(digest)
        return valid


DEFAULT_HOST_MADDRS = ("/ip4/0.0.0.0/tcp/0",)
STOP_TIMEOUT = 5.0  # seconds each part of stopping a node may take (a dead p2pd never answers)
RETRY_FIRST_WAIT, RETRY_MAX_WAIT = 2.0, 30.0  # backoff between attempts to reach the initial peers


def parse_maddrs(maddrs: Sequence[str], *, what: str = "initial peer", need_peer_id: bool = True) -> List[Multiaddr]:
    """Parse user-given multiaddrs, or raise a :class:`UserError` naming the bad one and the expected form."""
    parsed = []
    for text in maddrs:
        try:
            maddr = Multiaddr(text.strip())
            if need_peer_id:
                PeerID.from_base58(maddr["p2p"])
        except Exception:
            example = "/ip4/203.0.113.5/tcp/31337/p2p/QmPeerId..." if need_peer_id else "/ip4/0.0.0.0/tcp/31337"
            raise UserError(f"malformed {what} multiaddr {text!r}: expected the form {example}")
        parsed.append(maddr)
    return parsed


def peer_id_of(maddr: Multiaddr) -> PeerID:
    return PeerID.from_base58(maddr["p2p"])


def maddrs_without_peer_id(maddrs: Sequence[str], peer_id: PeerID) -> List[Multiaddr]:
    """A record's announced addresses as ``connect`` takes them: without their ``/p2p/<peer_id>`` suffix."""
    suffix = Multiaddr(f"/p2p/{peer_id.to_base58()}")
    return [Multiaddr(text).decapsulate(suffix) if text.endswith(str(suffix)) else Multiaddr(text) for text in maddrs]


class InitialPeersUnavailable(UserError):
    """No initial peer answered in time: the backbone may still be starting, or too busy; worth trying again
    (:func:`start_node_patiently`). A malformed address or a port in use is a plain :class:`UserError`."""

    def __init__(self, message: str):
        super().__init__(message, exit_code=1)


def explain_daemon_error(error: Exception, initial_peers: Sequence[Multiaddr]) -> UserError:
    """Turn p2pd's start-up failure into one line that says which address, what was tried, what to do."""
    text = str(error).split(": ", 1)[-1]
    tried = ", ".join(str(m) for m in initial_peers) or "no initial peers"
    if "bootstrap" in text:
        return InitialPeersUnavailable(
            f"could not reach any initial peer (tried {tried}): check that the backbone is running and its "
            f"port is open, or run `ravnest-swarm doctor --initial-peers ...`")
    if "failed to start in" in text and initial_peers:
        # p2pd reports ready only after bootstrapping, so a silent initial peer looks like a slow start
        return InitialPeersUnavailable(
            f"no answer from the initial peers within the timeout (tried {tried}): check the address and that "
            f"the backbone's port is reachable from here, or raise --timeout")
    if "address already in use" in text or "bind" in text:
        return UserError(f"p2pd could not listen: {text.strip()} (choose another --host-maddrs port)", exit_code=1)
    return UserError(f"p2pd failed to start ({text.strip()}); tried initial peers: {tried}", exit_code=1)


def check_ports_free(host_maddrs: Sequence[str]) -> None:
    """Raise a :class:`UserError` for a TCP port of ``host_maddrs`` (other than 0) that is taken on this machine.

    p2pd listens with SO_REUSEPORT, so a second p2pd on a port in use starts "ready" and takes over part of
    the first one's connections. A plain socket (SO_REUSEADDR only, so connections of a previous run in
    TIME_WAIT do not count) cannot bind a port another socket listens on.
    """
    for text in host_maddrs:
        maddr = Multiaddr(str(text))
        try:
            port = int(maddr["tcp"])
        except LookupError:
            continue
        if port == 0:
            continue
        try:
            host, family = maddr["ip4"], socket.AF_INET
        except LookupError:
            try:
                host, family = maddr["ip6"], socket.AF_INET6
            except LookupError:
                continue
        with closing(socket.socket(family, socket.SOCK_STREAM)) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise UserError(f"--host-maddrs {text}: TCP port {port} is already in use on {host} (another "
                                    f"backbone or peer?): stop it, or choose another port", exit_code=1)
                raise UserError(f"cannot listen on --host-maddrs {text} ({e.strerror}): choose another address "
                                f"or port", exit_code=1)


async def start_node(
    initial_peers: Sequence[Multiaddr] = (),
    *,
    record_validators: Sequence = (),
    client_mode: bool = False,
    host_maddrs: Sequence[str] = DEFAULT_HOST_MADDRS,
    announce_maddrs: Optional[Sequence[str]] = None,
    identity_path: Optional[str] = None,
    identity: Optional[PeerIdentity] = None,
    timeout: float = 15.0,
    rpc_timeout: Optional[float] = None,
    valid_records: Optional[ValidRecords] = None,
    **p2p_kwargs,
) -> "SwarmNode":
    """Start p2pd and a DHT node in this process's event loop, with the routes to its peers.

    :param initial_peers: full multiaddrs (with ``/p2p/ID``) of backbones or other peers
    :param record_validators: validators for this node (see ``membership.records.make_validators``)
    :param client_mode: a DHT client (observer) stores nothing for others and accepts no DHT requests
    :param host_maddrs: where p2pd listens
    :param announce_maddrs: addresses others should dial (a server's public address)
    :param identity_path: private key file; created if missing, so the peer id stays the same
    :param identity: the key p2pd starts with instead, the one the node's records are signed with
        (``make_validators(signing_key=identity.key)``): a peer of a run (``net/identity.py``)
    :param timeout: seconds to wait for p2pd and the initial peers
    :param rpc_timeout: seconds to wait for one DHT request (hivemind's ``wait_timeout``, 3 s by default); a node
        that does not answer in time is left out of that read and of the next ones for a while (hivemind's
        blacklist), so a one-shot reader of many records on a busy backbone (``status``) waits longer
    :param valid_records: the records this node's validators accepted; nodes of one run in one process (light
        peers) may share one, so a record is checked once per process. By default the node's own.
    :param p2p_kwargs: passed to ``hivemind.P2P.create`` (relay and NAT options)
    """
    if identity_path is not None:
        check_identity_file(identity_path)
    check_ports_free(host_maddrs)
    try:
        spare_p2pd_from_ctrl_c(asyncio.get_running_loop())
        if identity is not None:
            # a key made just now is free: hivemind's check that no peer uses it (a second p2pd) is for saved ones
            p2p_kwargs.setdefault("check_if_identity_free", not identity.new)
        with p2pd_identity_file(identity) if identity is not None else nullcontext(identity_path) as p2pd_identity:
            p2p = await asyncio.wait_for(P2P.create(
                initial_peers=list(initial_peers),
                host_maddrs=list(host_maddrs),
                announce_maddrs=list(announce_maddrs) if announce_maddrs else None,
                identity_path=p2pd_identity,
                startup_timeout=timeout,
                dht_mode="client" if client_mode else "server",
                **p2p_kwargs,
            ), timeout=timeout + 5)
    except asyncio.TimeoutError:
        tried = ", ".join(str(m) for m in initial_peers)
        raise InitialPeersUnavailable(
            f"no answer from the initial peers within {timeout:.0f}s (tried {tried}): check the address and "
            f"that the backbone's port is reachable from here, or raise --timeout")
    except P2PDaemonError as e:
        raise explain_daemon_error(e, initial_peers)
    # our initial peers are our backbones: they reverse connections to us and forward streams if we are NATed
    routes = await start_routes(p2p, [peer_id_of(m) for m in initial_peers])
    try:
        node = await asyncio.wait_for(
            SwarmNode.create(
                p2p=p2p,
                initial_peers=[str(m) for m in initial_peers],
                client_mode=client_mode,
                record_validator=(RememberingValidator(record_validators, valid_records or ValidRecords())
                                  if record_validators else None),
                ensure_bootstrap_success=bool(initial_peers),
                # hivemind stores each value it finds on the nearest node that lacked it: for a bucket of peer
                # records, one more upload of the whole bucket per read, to the key's busiest node, and one more
                # validation of it there; every record is already on its key's replicas and our backbones
                cache_nearest=0,
                **({} if rpc_timeout is None else dict(wait_timeout=rpc_timeout)),
            ),
            timeout=timeout,
        )
    except asyncio.CancelledError:  # a stop while we wait for the DHT: our p2pd goes with us
        await p2p.shutdown()
        raise
    except (asyncio.TimeoutError, RuntimeError) as e:
        await p2p.shutdown()
        tried = ", ".join(str(m) for m in initial_peers)
        raise InitialPeersUnavailable(f"the DHT did not answer through the initial peers (tried {tried}): "
                                      f"{e or 'timeout'}")
    node.routes = routes
    return node


def spare_p2pd_from_ctrl_c(loop: asyncio.AbstractEventLoop) -> None:
    """Every p2pd that hivemind starts on ``loop`` from now on runs in a process group of its own.

    Ctrl-C (and a closed terminal's SIGHUP) signals the terminal's foreground process group, and p2pd was in
    ours: it closed at once, so a volunteer's graceful leave had no network left to hand its layers over with
    or to say ``leaving`` (a race the one ``leaving`` record sometimes won). Neither SIG_IGN nor a blocked
    mask survives p2pd's own start (it traps SIGINT itself); only a group the signal is not sent to does.
    We stop p2pd ourselves when we stop (hivemind's ``P2P.shutdown``, or its finaliser at exit), and every
    stop signal is a stop for us (``lifecycle``); what kills a peer's processes from outside must name p2pd
    too (``processes.PeerProcess.kill_group``). hivemind has no option for it: its
    ``asyncio.create_subprocess_exec`` calls the loop's ``subprocess_exec``, wrapped here for p2pd alone.
    """
    spawn = loop.subprocess_exec
    if getattr(spawn, "spares_p2pd", False):
        return

    async def spawn_sparing_p2pd(protocol_factory, program, *args, **kwargs):
        if os.path.basename(str(program)) == P2PD_FILENAME:
            kwargs["process_group"] = 0
        return await spawn(protocol_factory, program, *args, **kwargs)

    spawn_sparing_p2pd.spares_p2pd = True
    loop.subprocess_exec = spawn_sparing_p2pd


async def answering_initial_peer(node: DHTNode, initial_peers: Sequence[Multiaddr]) -> Optional[PeerID]:
    """The first of ``initial_peers`` we are connected to (the one that answered), else the first of them."""
    if not initial_peers:
        return None
    connected = {info.peer_id for info in await node.p2p.list_peers()}
    return next((peer_id_of(m) for m in initial_peers if peer_id_of(m) in connected), peer_id_of(initial_peers[0]))


async def start_node_patiently(initial_peers: Sequence[Multiaddr], patience: float,
                               on_wait: Callable[[str, int, float, float], None], **options) -> "SwarmNode":
    """:func:`start_node`, tried again with backoff while no initial peer answers, for up to ``patience`` seconds.

    A backbone that is still starting, restarting or too busy to answer (a hundred volunteers starting at
    once) is no reason to give up: the volunteer waits and says so. Anything else (a malformed address, a
    port in use, a bad identity file) ends at once, in one line, as does the last failure once ``patience``
    has run out.

    :param on_wait: called before each wait with (the reason, the attempt that failed, seconds until the next
        attempt, seconds of patience left)
    :param options: passed to :func:`start_node`
    """
    deadline = time.monotonic() + patience
    backoff, attempt = RETRY_FIRST_WAIT, 1
    while True:
        try:
            return await start_node(initial_peers, **options)
        except InitialPeersUnavailable as e:
            left = deadline - time.monotonic()
            if left <= 0:
                raise InitialPeersUnavailable(f"{e} (tried {attempt} time(s) over {patience:.0f}s; --patience "
                                              f"waits longer)")
            wait = min(backoff, left)
            on_wait(str(e), attempt, wait, left)
            await asyncio.sleep(wait)
            backoff, attempt = min(2 * backoff, RETRY_MAX_WAIT), attempt + 1


async def stop_node(node: DHTNode, timeout: float = STOP_TIMEOUT) -> None:
    """Stop the DHT node and its p2pd (a node created on a given P2P does not stop it itself).

    Each part is given ``timeout`` seconds: a node whose p2pd already died (killed, crashed) waits forever
    on the daemon to remove its handlers, and a stop signal must still end the process.
    """
    try:
        await asyncio.wait_for(node.shutdown(), timeout)
    except asyncio.TimeoutError:
        logger.warning(f"the DHT node did not stop within {timeout:.0f}s (is its p2pd gone?); stopping p2pd anyway")
    try:
        await asyncio.wait_for(node.p2p.shutdown(), timeout)
    except asyncio.TimeoutError:
        logger.warning(f"p2pd did not exit within {timeout:.0f}s of being told to")


async def store_record(node: "SwarmNode", key: str, value: Any, expiration: float, subkey: Any = None) -> bool:
    """``node.store``, and the same signed record stored on each of our backbones (initial peers) as well.

    hivemind stores a record on the few nodes nearest its key and never copies it again, so once those
    volunteers leave, the record is gone before it expires: a peer's final report (how many poisoned
    contributions it refused, that it is leaving) vanished with them. Backbones are the swarm's
    long-lived nodes, so a record they also hold lasts its whole lifetime. Returns whether any node took it.
    """
    protocol = node.protocol
    key_id = DHTID.generate(source=key)
    record = DHTRecord(key_id.to_bytes(), protocol.serializer.dumps(subkey), protocol.serializer.dumps(value),
                       expiration)
    signed = protocol.record_validator.sign_value(record) if protocol.record_validator is not None else record.value
    backbones = [peer for peer in node.routes.backbones if peer != node.peer_id]
    stored, *replies = await asyncio.gather(
        node.store(key, value, expiration, subkey=subkey),
        *(protocol.call_store(peer, [key_id], [signed], expiration, subkeys=[subkey]) for peer in backbones))
    return bool(stored) or any(reply and reply[0] for reply in replies)

