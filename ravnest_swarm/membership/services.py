"""Small RPC services a backbone offers to volunteers: ping, a bandwidth probe and a reachability dial-back.

They use raw protobuf fields only (no torch), so a backbone process stays light.
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Awaitable, Callable, Dict, List, Optional, TypeVar

from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.multiaddr import Multiaddr
from pydantic import Field

from ravnest_swarm.net.messages import Handler, Message, decode_message, register_handler
from ravnest_swarm.net.relay import RelayServices
from ravnest_swarm.net.routes import ProbeFrame, ProbeReply, Routes, probe_handler, send_probe
from ravnest_swarm.net.transport import UNARY_MAX_BYTES, call_handler, make_request, make_response, reply_lost

PING = "ravnest.ping"
BANDWIDTH_PROBE = "ravnest.bandwidth_probe"
DIAL_BACK = "ravnest.dial_back"

MAX_PROBE_BYTES = 16 * 1024 * 1024
PROBE_TIMEOUT = 60.0  # a probe slower than 16 MiB a minute is not worth measuring; nor is a silent stream
DIAL_BACK_TIMEOUT = 3.0
MAX_DIAL_BACK_PORTS = 4  # of the ports a caller lists, the first this many are tried
MAX_LISTED_PORTS = 64  # more than a node listens on
MAX_TRIED_ADDRESSES = 256
MEASUREMENT_TRIES = 3  # a backbone's reply can be lost under load (below); a lost reply costs a try, not the join
RETRY_PAUSE = 1.0  # seconds before the second try, twice that before the third
AddressText = Annotated[str, Field(max_length=100)]  # host:port


class PingRequest(Message):
    """A ping carries nothing."""


class RelayCounters(Message):
    """A backbone's NAT-traversal counters since it started."""

    reversals: int = Field(default=0, ge=0)
    forwarded_streams: int = Field(default=0, ge=0)
    forwarded_bytes: int = Field(default=0, ge=0)
    refused: int = Field(default=0, ge=0)


class PingReply(Message):
    """The backbone's clock, and what NAT traversal has cost it (operators and tests read the counters)."""

    time: float = Field(ge=0, allow_inf_nan=False)
    relay: RelayCounters


class DialBackRequest(Message):
    """The TCP ports the caller listens on; the backbone tries the first few on the IPs the caller connects from."""

    ports: List[Annotated[int, Field(gt=0, lt=65536)]] = Field(default_factory=list, max_length=MAX_LISTED_PORTS)


class DialBackReply(Message):
    """Whether a TCP connection to the caller succeeded: at ``address``, or none of those ``tried``."""

    reachable: bool
    address: Optional[AddressText] = None
    tried: List[AddressText] = Field(default_factory=list, max_length=MAX_TRIED_ADDRESSES)


register_handler(Handler(PING, PingRequest, PingReply, UNARY_MAX_BYTES,
                         callers="any peer (doctor's latency, probe's relay counters)", owner=__name__))
register_handler(Handler(BANDWIDTH_PROBE, ProbeFrame, ProbeReply, MAX_PROBE_BYTES + 64 * 1024,
                         callers="any peer measuring its bandwidth (join, doctor)", owner=__name__))
register_handler(Handler(DIAL_BACK, DialBackRequest, DialBackReply, UNARY_MAX_BYTES,
                         callers="any peer checking its reachability (join, doctor, probe); only the caller's "
                                 "own IPs are dialled", owner=__name__))


class BackboneServices:
    """Handlers a backbone serves; volunteers use them while measuring themselves and in ``doctor``.

    :param p2p: the node's P2P instance to register handlers on
    :param probe_timeout: seconds a bandwidth probe may take before it is refused
    :param relay: connection reversal and capped stream forwarding for volunteers behind NAT
    """

    def __init__(self, p2p: P2P, probe_timeout: float = PROBE_TIMEOUT, relay: Optional[RelayServices] = None):
        self.p2p, self.probe_timeout = p2p, probe_timeout
        self.relay = relay or RelayServices(p2p)

    async def add_handlers(self) -> None:
        await self.p2p.add_protobuf_handler(PING, self.rpc_ping, runtime_pb2.ExpertRequest)
        # frame headers are checked before reading: a probe cannot make us buffer more than MAX_PROBE_BYTES
        await self.p2p.add_binary_stream_handler(BANDWIDTH_PROBE, probe_handler(
            BANDWIDTH_PROBE, MAX_PROBE_BYTES + 64 * 1024, self.probe_timeout))
        await self.p2p.add_protobuf_handler(DIAL_BACK, self.rpc_dial_back, runtime_pb2.ExpertRequest)
        await self.relay.add_handlers()

    async def rpc_ping(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        decode_message(PingRequest, request.metadata, PING)
        # the relay counters let operators (and tests) see what NAT traversal costs this backbone
        return make_response(PingReply(time=time.time(), relay=RelayCounters(**self.relay.stats)).as_metadata())

    async def rpc_dial_back(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        """Try to open a TCP connection to the caller, to tell it whether it is reachable from outside.

        We dial only the IP address the caller is connected from (so the backbone cannot be used to
        probe third parties), on the TCP ports the caller says it listens on.
        """
        ports = decode_message(DialBackRequest, request.metadata, DIAL_BACK).ports[:MAX_DIAL_BACK_PORTS]
        hosts = await self._observed_hosts(context.remote_id)
        for host in hosts:
            for port in ports:
                if await _tcp_connects(host, port):
                    return make_response(DialBackReply(reachable=True, address=f"{host}:{port}").as_metadata())
        tried = [f"{host}:{port}" for host in hosts for port in ports][:MAX_TRIED_ADDRESSES]
        return make_response(DialBackReply(reachable=False, tried=tried).as_metadata())

    async def _observed_hosts(self, peer_id: PeerID) -> List[str]:
        hosts = []
        for info in await self.p2p.list_peers():
            if info.peer_id == peer_id:
                for addr in info.addrs:
                    for proto in ("ip4", "ip6"):
                        if _has(addr, proto) and addr[proto] not in hosts:
                            hosts.append(addr[proto])
        return hosts


def _has(addr: Multiaddr, proto: str) -> bool:
    try:
        addr[proto]
        return True
    except Exception:
        return False


async def _tcp_connects(host: str, port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), DIAL_BACK_TIMEOUT)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return True


T = TypeVar("T")


async def retried(call: Callable[[], Awaitable[T]], tries: int = MEASUREMENT_TRIES) -> T:
    """``call()``, tried again when it fails other than by a timeout: p2pd under load closes a stream now and then
    before the reply (hivemind's "asingle() ... empty iterable"), as when several volunteers measure themselves
    against one backbone at once. A timeout is not tried again: the caller's patience is already spent."""
    for attempt in range(1, tries + 1):
        try:
            return await call()
        except asyncio.TimeoutError:
            raise
        except Exception:
            if attempt == tries:
                raise
        await asyncio.sleep(RETRY_PAUSE * attempt)
    raise AssertionError("unreachable: the last try returns or raises")


def failure_reason(error: Exception, timeout: float) -> str:
    """One line on why a call to a backbone failed (``timeout``: the seconds it was given)."""
    if reply_lost(error):
        return f"the stream closed without a reply, {MEASUREMENT_TRIES} times"
    if isinstance(error, asyncio.TimeoutError):
        return f"no reply within {timeout:.0f}s"
    return f"{type(error).__name__}: {error}"


async def ping(p2p: P2P, peer_id: PeerID, timeout: float) -> float:
    """Round-trip time to a backbone in seconds."""
    started = time.perf_counter()
    await asyncio.wait_for(p2p.call_protobuf_handler(
        peer_id, PING, make_request(PingRequest().as_metadata()), runtime_pb2.ExpertResponse), timeout)
    return time.perf_counter() - started


async def measure_bandwidth(p2p: P2P, peer_id: PeerID, total_bytes: int, timeout: float, on_progress=None) -> float:
    """Stream ``total_bytes`` to a backbone's probe handler (:func:`~ravnest_swarm.net.routes.send_probe`) and
    return the rate in Mbit/s."""
    received, seconds = await send_probe(
        lambda stream: call_handler(p2p, peer_id, BANDWIDTH_PROBE, stream, runtime_pb2.ExpertResponse),
        BANDWIDTH_PROBE, total_bytes, timeout, on_progress)
    return 8 * received / 1e6 / max(seconds, 1e-9)


async def check_reachability(routes: Routes, peer_id: PeerID, timeout: float) -> str:
    """Ask a backbone to dial us back: ``"direct"`` if it can, ``"relay"`` if it cannot (kept in ``routes``)."""
    p2p = routes.p2p
    ports = sorted({int(m["tcp"]) for m in await p2p.get_visible_maddrs() if _has(m, "tcp")})
    response = await asyncio.wait_for(
        p2p.call_protobuf_handler(peer_id, DIAL_BACK, make_request(DialBackRequest(ports=ports).as_metadata()),
                                  runtime_pb2.ExpertResponse),
        timeout,
    )
    verdict = "direct" if decode_message(DialBackReply, response.metadata, DIAL_BACK).reachable else "relay"
    routes.reachability = verdict  # a peer that cannot be dialled asks for forwarding, not reversal
    return verdict


async def relay_stats(p2p: P2P, peer_id: PeerID, timeout: float) -> Dict[str, int]:
    """A backbone's NAT-traversal counters: reversals passed, streams and bytes forwarded, refusals."""
    response = await asyncio.wait_for(p2p.call_protobuf_handler(
        peer_id, PING, make_request(PingRequest().as_metadata()), runtime_pb2.ExpertResponse), timeout)
    return decode_message(PingReply, response.metadata, PING).relay.as_metadata()
