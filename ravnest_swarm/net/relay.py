"""A backbone's side of NAT traversal (see :mod:`ravnest_swarm.net.routes` for the volunteer's side): passing
reversal requests and forwarding streams between two peers behind NAT, capped per stream, in number, and in
number per caller (so one caller cannot take every forwarding slot)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from contextlib import closing
from typing import List, Optional

from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.proto import runtime_pb2

from ravnest_swarm.net.messages import Handler, MessageError, decode_message, register_handler
from ravnest_swarm.net.routes import (DIAL_ME, FORWARD, FORWARD_BUSY, FORWARD_REFUSED, FORWARDED,
                                      MAX_FORWARD_STREAMS, MAX_FORWARD_STREAMS_PER_CALLER, REVERSE_CONNECT,
                                      REVERSE_TIMEOUT, DialMeReply, DialRequest, ForwardedHeader, ForwardHeader,
                                      Relayed, ReverseConnectReply, error_text, read_header, refuse_stream)
from ravnest_swarm.net.transport import UNARY_MAX_BYTES, make_request, make_response

logger = logging.getLogger(__name__)

MAX_FORWARD_BYTES = 256 * 1024**2
# a reply is capped too, higher: a stage's optimizer state comes back in one message (AdamW's moments and the
# outer state: five copies of the stage's parameters, 860 MB for a stage of gpt-85m in two), and two peers in
# league, one answering without end, relayed 1.5 GB in 20 s through a backbone before there was a cap
MAX_FORWARD_REPLY_BYTES = 1024**3
# the caps on streams (MAX_FORWARD_STREAMS, MAX_FORWARD_STREAMS_PER_CALLER) are in routes.py: an honest caller
# (Routes.call) keeps within the one for a caller, which leaves the other half of the slots to everyone else

register_handler(Handler(REVERSE_CONNECT, DialRequest, ReverseConnectReply, UNARY_MAX_BYTES,
                         callers="any peer that cannot dial a peer behind NAT (Routes.connect)", owner=__name__))
register_handler(Handler(FORWARD, ForwardHeader, Relayed, MAX_FORWARD_BYTES,
                         callers="any peer, when neither it nor the target can dial the other (both behind NAT)",
                         owner=__name__))


class RelayServices:
    """A backbone's side of NAT traversal: passing reversal requests and forwarding streams, capped.

    :param p2p: the backbone's P2P instance
    :param max_forward_bytes: a forwarded stream that sends more than this towards the target is cut off
    :param max_forward_reply_bytes: ... and one whose target answers with more than this
    :param max_forward_streams: forwarded streams served at once; more are refused (the backbone carries
        every forwarded byte twice, in and out)
    :param max_forward_streams_per_caller: forwarded streams served at once for one caller (by its
        authenticated peer id); more from that caller are refused while the others keep their slots
    :param forward_timeout: seconds a forwarded stream may stay open
    """

    def __init__(self, p2p: P2P, max_forward_bytes: int = MAX_FORWARD_BYTES,
                 max_forward_streams: int = MAX_FORWARD_STREAMS,
                 max_forward_streams_per_caller: int = MAX_FORWARD_STREAMS_PER_CALLER, forward_timeout: float = 300.0,
                 max_forward_reply_bytes: int = MAX_FORWARD_REPLY_BYTES):
        self.p2p = p2p
        self.max_forward_bytes, self.max_forward_streams = max_forward_bytes, max_forward_streams
        self.max_forward_reply_bytes = max_forward_reply_bytes
        self.max_forward_streams_per_caller = max_forward_streams_per_caller
        self.forward_timeout = forward_timeout
        self.stats: Counter = Counter()  # reversals, forwarded_streams, forwarded_bytes, refused
        self._active = 0
        self._active_by_caller: Counter = Counter()  # caller -> its forwarded streams open now

    async def add_handlers(self) -> None:
        await self.p2p.add_protobuf_handler(REVERSE_CONNECT, self.rpc_reverse_connect, runtime_pb2.ExpertRequest)
        await self.p2p.add_binary_stream_handler(FORWARD, self.serve_forward)

    async def _observed_hosts(self, peer_id: PeerID) -> List[str]:
        hosts = []
        for info in await self.p2p.list_peers():
            if info.peer_id == peer_id:
                hosts += [str(addr).split("/")[2] for addr in info.addrs if str(addr).startswith("/ip")]
        return hosts

    async def rpc_reverse_connect(self, request: runtime_pb2.ExpertRequest,
                                  context: P2PContext) -> runtime_pb2.ExpertResponse:
        """Ask a connected peer to dial the caller back; say whether it is connected here and whether it dialled.

        Only the caller's addresses on the IPs it is connected from are passed on, so nobody can make a
        volunteer dial third parties through us.
        """
        try:
            asked = decode_message(DialRequest, request.metadata, REVERSE_CONNECT)
        except MessageError as e:
            self._refuse(context.remote_id, str(e))
            raise
        target = PeerID.from_base58(asked.peer)
        if not await self._observed_hosts(target):
            return make_response(ReverseConnectReply(connected=False).as_metadata())
        hosts = set(await self._observed_hosts(context.remote_id))
        maddrs = [m for m in asked.maddrs if _host_of(m) in hosts]
        if not maddrs:
            return make_response(ReverseConnectReply(
                connected=True, error="no announced address of the caller on an IP it connects from").as_metadata())
        self.stats["reversals"] += 1
        try:
            dial = DialRequest(peer=context.remote_id.to_base58(), maddrs=maddrs)
            response = await asyncio.wait_for(self.p2p.call_protobuf_handler(
                target, DIAL_ME, make_request(dial.as_metadata()), runtime_pb2.ExpertResponse), REVERSE_TIMEOUT)
            answer = decode_message(DialMeReply, response.metadata, DIAL_ME)
        except Exception as e:
            return make_response(ReverseConnectReply(connected=True, error=error_text(e)).as_metadata())
        return make_response(ReverseConnectReply(connected=True, dialed=answer.dialed, error=answer.error).as_metadata())

    async def serve_forward(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Pipe the caller's stream into the target's ``forwarded`` handler and its reply back, within the caps."""
        caller = info.peer_id
        with closing(writer):
            if self._active >= self.max_forward_streams:
                reason = f"{FORWARD_BUSY} {self.max_forward_streams} streams at once"
            elif self._active_by_caller[caller] >= self.max_forward_streams_per_caller:
                reason = f"{FORWARD_BUSY} {self.max_forward_streams_per_caller} streams at once for one caller"
            else:
                self._active += 1
                self._active_by_caller[caller] += 1
                try:
                    await self._forward(info, reader, writer)
                finally:
                    self._active -= 1
                    self._active_by_caller[caller] -= 1
                    if not self._active_by_caller[caller]:
                        del self._active_by_caller[caller]  # callers come and go: keep only those with streams
                return
            self._refuse(caller, reason)
            await refuse_stream(reader, writer, reason)

    def _refuse(self, caller: PeerID, reason: str) -> None:
        """Count a refused request and say why, in one line."""
        self.stats["refused"] += 1
        logger.info(f"relay: refused a request from {caller}: {reason}")

    async def _forward(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            header = await read_header(reader, ForwardHeader, FORWARD)
            target, name = PeerID.from_base58(header.to), header.handler
            if not await self._observed_hosts(target):
                raise ValueError(f"{FORWARD_REFUSED} to {target}: it is not connected to this backbone")
            _, target_reader, target_writer = await self.p2p.call_binary_stream_handler(target, FORWARDED)
        except Exception as e:  # a ValueError says what is wrong; anything else is a stream or target that broke off
            reason = str(e) if isinstance(e, ValueError) else f"{FORWARD_REFUSED}: {error_text(e)}"
            self._refuse(info.peer_id, reason)
            await refuse_stream(reader, writer, reason)
            return
        self.stats["forwarded_streams"] += 1
        with closing(target_writer):
            piped = ForwardedHeader(**{"from": info.peer_id.to_base58(), "handler": name})
            try:
                await P2P.send_protobuf(make_request(piped.as_metadata()), target_writer)
            except ConnectionError as e:  # the target went away: its fault, not the caller's, so not counted
                await refuse_stream(reader, writer,
                                    f"{FORWARD_REFUSED}: the stream to {target} closed ({error_text(e)})")
                return
            upstream = asyncio.create_task(self._pipe(reader, target_writer, self.max_forward_bytes))
            downstream = asyncio.create_task(self._pipe(target_reader, writer, self.max_forward_reply_bytes))
            try:
                # the reply ends the exchange: the target closes its side once it has answered. The caller's side
                # ending first means the caller went away (p2pd closes a stream both ways; a caller reads the
                # reply before it closes): the target's side is closed at once too, so the target sees the message
                # broken off, as it would have directly, instead of waiting out its timeout for the rest of it
                # while this stream holds a slot here
                done, _ = await asyncio.wait({upstream, downstream}, timeout=self.forward_timeout,
                                             return_when=asyncio.FIRST_COMPLETED)
                if upstream in done and upstream.exception() is not None:
                    downstream.cancel()  # our refusal is the caller's answer: no bytes of the target's may mix in
                    self._refuse(info.peer_id, str(upstream.exception()))
                    await refuse_stream(reader, writer, str(upstream.exception()))
                elif downstream in done and isinstance(downstream.exception(), ValueError):
                    # the caller's stream just ends; the log names the target that answered too much
                    self._refuse(target, f"its reply to {info.peer_id}: {downstream.exception()}")
            except (asyncio.TimeoutError, ConnectionError):
                pass
            finally:
                for task in (upstream, downstream):
                    task.cancel()
                await asyncio.gather(upstream, downstream, return_exceptions=True)

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, cap: Optional[int]) -> None:
        passed = 0
        while True:
            data = await source.read(1 << 16)
            if not data:
                return
            passed += len(data)
            if cap is not None and passed > cap:
                raise ValueError(f"forwarded stream exceeds this backbone's {cap}-byte cap")
            self.stats["forwarded_bytes"] += len(data)
            sink.write(data)
            await sink.drain()


def _host_of(maddr: str) -> str:
    """The host of an ``/ip4/HOST/...`` or ``/ip6/HOST/...`` address; empty for any other."""
    parts = maddr.split("/")
    return parts[2] if maddr.startswith("/ip") and len(parts) > 2 else ""
