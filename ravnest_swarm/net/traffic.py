"""The bytes a node's own streams carry, by handler: what ``status`` shows as a peer's bytes per second up and down.

Counted where the bytes pass between us and p2pd, on the streams of the handlers others call on us (``Routes.gated``)
and of the calls we make (``Routes.call``, the pipeline's long-lived streams, layer downloads): pipeline messages,
ring messages, layer transfers and their replies, framing included. The DHT's own RPCs and what a backbone pipes for
others are not ours to count here. A counted stream is the stream itself with two additions per read or write.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Tuple


class Traffic:
    """Bytes sent and received, by handler name, since the node started."""

    def __init__(self):
        self.sent: Counter = Counter()
        self.received: Counter = Counter()

    def totals(self) -> Tuple[int, int]:
        """(bytes sent, bytes received), every handler's."""
        return sum(self.sent.values()), sum(self.received.values())

    def counted(self, handler: str, reader: asyncio.StreamReader,
                writer: asyncio.StreamWriter) -> Tuple["CountedReader", "CountedWriter"]:
        """The stream of one call or handler of ``handler``, counting what passes."""
        return CountedReader(reader, self.received, handler), CountedWriter(writer, self.sent, handler)


class CountedReader:
    """An ``asyncio.StreamReader`` that adds the bytes read to ``counts[handler]``."""

    def __init__(self, reader: asyncio.StreamReader, counts: Counter, handler: str):
        self._reader, self._counts, self._handler = reader, counts, handler

    async def readexactly(self, n: int) -> bytes:
        data = await self._reader.readexactly(n)
        self._counts[self._handler] += len(data)
        return data

    async def read(self, n: int = -1) -> bytes:
        data = await self._reader.read(n)
        self._counts[self._handler] += len(data)
        return data

    def __getattr__(self, name: str):
        return getattr(self._reader, name)  # at_eof and the rest read nothing


class CountedWriter:
    """An ``asyncio.StreamWriter`` that adds the bytes written to ``counts[handler]``."""

    def __init__(self, writer: asyncio.StreamWriter, counts: Counter, handler: str):
        self._writer, self._counts, self._handler = writer, counts, handler

    def write(self, data: bytes) -> None:
        self._counts[self._handler] += len(data)
        self._writer.write(data)

    def __getattr__(self, name: str):
        return getattr(self._writer, name)  # drain, close and the rest write nothing
