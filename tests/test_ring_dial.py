"""A ring message to a member our daemon cannot dial for a moment is sent once the member can be reached again.

CI saw a ring ended by one failed dial between two live peers on a loaded machine: after a dial fails, libp2p
refuses every dial to that address for about 6 s ("dial backoff"), and the resends (0.6 s in all) gave up long
before. Here the member really goes away (its p2pd stops) and comes back on the same address with the same key:
our note reaches it within the ring's deadline. Real p2pd processes, in this process.
"""

import asyncio
import socket
import time

import pytest
from hivemind.p2p import P2PHandlerError

from ravnest_swarm.averaging.averager import MultiRingAverager
from ravnest_swarm.averaging.wire import NOT_DIALED, RingArrive
from ravnest_swarm.net.node import maddrs_without_peer_id, start_node, stop_node


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.timeout(120)
def test_a_note_to_a_member_that_could_not_be_dialed_for_seconds_reaches_it_once_it_can(tmp_path):
    port, key = free_port(), str(tmp_path / "member.key")

    async def member():
        node = await start_node(host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"], identity_path=key)
        averager = MultiRingAverager(node.routes, "dial")
        await averager.start()
        return node, averager

    async def scenario():
        sender_node = await start_node(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        node, averager = await member()
        member_id = node.peer_id
        maddrs = maddrs_without_peer_id([str(m) for m in await node.p2p.get_visible_maddrs()], member_id)
        ours = MultiRingAverager(sender_node.routes, "dial")
        note = RingArrive(run="dial", step=1, ring=0, position=0, attempt=[])

        async def reached(deadline: float) -> str:
            try:
                await ours.sender.send_note(member_id.to_base58(), note, deadline)
                return "answered"
            except P2PHandlerError:  # its mailbox refused the note (it expects no round): it was reached
                return "refused there"

        try:
            await sender_node.routes.connect(member_id, maddrs, "direct")
            assert await reached(time.monotonic() + 10) in ("answered", "refused there")
            await averager.shutdown()
            await stop_node(node)
            # dialled while it is away: every dial fails, then libp2p backs off dialling its address

            async def back_in_two_seconds():
                await asyncio.sleep(2.0)
                return await member()

            started = time.monotonic()
            # the member that comes back is stopped below even when the note fails (gather waits for both)
            sent, returned = await asyncio.gather(reached(started + 30), back_in_two_seconds(),
                                                  return_exceptions=True)
            if not isinstance(returned, BaseException):
                node, averager = returned
            if isinstance(sent, BaseException):
                raise sent
            return sent, time.monotonic() - started
        finally:
            await averager.shutdown()
            await stop_node(node)
            await stop_node(sender_node)

    sent, took = asyncio.run(scenario())
    assert sent in ("answered", "refused there")
    assert took >= 2.0  # it was away, and the note waited for it (not a failure message, NOT_DIALED: {NOT_DIALED})
