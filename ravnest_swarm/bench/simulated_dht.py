"""The simulated DHT of the membership simulation (``bench/simulation.py``): hivemind's storage rules, Kademlia-like
lookups with sampled latency and loss, and a count of every RPC each node serves and every byte each peer sends.

The model, as hivemind 1.1.12 behaves with ravnest-swarm's settings (``net/node.py``):

* node ids are random 160-bit numbers; a key's id is hivemind's ``DHTID.generate(source=key)``; distance is XOR;
* a lookup (a store's or a get's) walks to the key: at hop ``i`` it asks a random live node that shares the key's
  first ``i`` bits, while more than ``beam`` (hivemind's bucket size, 20) nodes share them, one hop after another
  (so about ``log2(N / 20)`` hops; a second request in parallel covers a lost one); then it asks the ``beam``
  nearest nodes, ``workers`` (4) at a time, a worker whose request was lost waiting out the timeout. A get with
  ``latest=True`` (what every membership read is) never stops early, so it asks all of them; each holder returns its
  value, and the reader merges the subkeys, the one that expires later winning;
* a store then sends the value to the ``replicas`` (5) nearest nodes, moving on to the next nearest for each one
  lost; ``store_record`` also sends it straight to every backbone; a node keeps a subkey's value only if it expires
  later than the one it has (hivemind's rule);
* with ``cache_nearest`` (hivemind's default 1; ``net/node.py`` sets 0), after a get that found something, the
  reader caches the merged value on the nearest node: one store RPC carrying the whole value, counted, its content
  not modelled (a cached copy only adds older subkeys, which the view rule ignores);
* an RPC's round trip is uniform between half and one and a half times ``latency``; an RPC is lost with probability
  ``loss``, and the caller then waits hivemind's ``wait_timeout`` (3 s) for it; a lost RPC is counted at the node
  (an upper bound);
* routing tables are perfect: lookups only ask live nodes (a real one also times out on peers that left).
"""

from __future__ import annotations

import asyncio
import bisect
import heapq
import random
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import msgpack
from hivemind.dht.node import DHTID
from hivemind.utils.timed_storage import ValueWithExpiration

ID_BITS = 160
# bytes on the wire besides values (protobuf framing, rounded up): a find request per key (key id, the asker's
# node info), a find reply's nearest nodes per key (hivemind returns bucket_size of them: 20-byte node id and a
# 38-byte peer id each), a store request's header, a store reply
FIND_REQUEST_BYTES = 100
FIND_REPLY_BYTES = 20 * (20 + 38) + 40
STORE_REQUEST_BYTES = 100
STORE_REPLY_BYTES = 20


class Entry(NamedTuple):
    """A subkey's value as a node holds it, and as a get returns it (named as hivemind's ``ValueWithExpiration``)."""

    value: Any
    expiration_time: float
    size: int  # bytes on the wire (:func:`entry_bytes`)


@dataclass(frozen=True)
class NetworkModel:
    latency: float = 0.1  # mean round trip of an RPC, seconds
    loss: float = 0.02  # probability that an RPC (its request or its reply) is lost
    timeout: float = 3.0  # what the caller then waits (hivemind's wait_timeout)
    replicas: int = 5  # hivemind's num_replicas
    beam: int = 20  # hivemind's bucket_size: the beam of a lookup
    workers: int = 4  # hivemind's num_workers: RPCs of a lookup in flight at once
    cache_nearest: int = 0  # hivemind's: nodes a get stores its result on (1 by default; ours set 0)


class NodeLoad:
    """What one DHT node served (RPCs, bytes) and, for a peer's node, what its peer sent and received."""

    __slots__ = ("node_id", "storage", "alive", "finds", "stores", "sent", "received", "served", "taken",
                 "renewed")

    def __init__(self, node_id: int):
        self.node_id, self.alive = node_id, True
        self.storage: Dict[int, Dict[Any, Entry]] = {}  # key id -> subkey -> entry
        self.finds = self.stores = 0  # RPCs served as a DHT node
        self.sent = self.received = 0  # bytes of the requests its peer made, and of their replies
        self.served = self.taken = 0  # bytes of its replies as a DHT node, and of the store requests it took
        self.renewed: Optional[float] = None  # when its peer last began to store its record


class PeerIdText:
    """What the announcer asks of ``node.peer_id``."""

    def __init__(self, text: str):
        self._text = text

    def to_base58(self) -> str:
        return self._text


def entry_bytes(value: Any, subkey_bytes: int, signature_bytes: int) -> int:
    """Bytes of one signed subkey entry on the wire: the msgpack value, its subkey, signature and expiration."""
    return len(msgpack.packb(value, use_bin_type=True)) + subkey_bytes + signature_bytes + 9


class SimulatedDHT:
    """Every node of the simulated swarm, their storage and their load (see the module's docstring)."""

    def __init__(self, network: NetworkModel, rng: random.Random, clock: Callable[[], float],
                 subkey_bytes: int, signature_bytes: int):
        self.network, self.rng, self.clock = network, rng, clock
        self.subkey_bytes, self.signature_bytes = subkey_bytes, signature_bytes
        self.nodes: Dict[int, NodeLoad] = {}
        self.live_ids: List[int] = []  # sorted
        self.backbones: List[NodeLoad] = []
        self._nearest: Dict[int, List[int]] = {}  # key id -> its beam nearest live node ids, nearest first
        self._key_ids: Dict[str, int] = {}
        self._hops_of: Dict[int, Tuple[List[Tuple[int, int]], int]] = {}  # key id -> (its walk's ranges, version)
        self._version = 0  # of the set of live nodes
        self.rpcs_by_key: Dict[str, int] = {}
        self.get_durations: List[float] = []
        self.renewal_gaps: List[float] = []  # seconds between a peer's successive stores of its record

    # --- membership of the DHT itself

    def add_node(self, backbone: bool = False) -> NodeLoad:
        node_id = self.rng.getrandbits(ID_BITS)
        node = self.nodes[node_id] = NodeLoad(node_id)
        bisect.insort(self.live_ids, node_id)
        self._version += 1
        beam = self.network.beam
        for key_id, nearest in self._nearest.items():
            if len(nearest) < beam or node_id ^ key_id < nearest[-1] ^ key_id:
                nearest.append(node_id)
                nearest.sort(key=lambda other: other ^ key_id)
                del nearest[beam:]
        if backbone:
            self.backbones.append(node)
        return node

    def kill_node(self, node: NodeLoad) -> None:
        """The node is gone, and what it stored with it."""
        node.alive, node.storage = False, {}
        del self.live_ids[bisect.bisect_left(self.live_ids, node.node_id)]
        self._version += 1
        for key_id in [key_id for key_id, nearest in self._nearest.items() if node.node_id in nearest]:
            del self._nearest[key_id]

    def place(self, key: str, value: Any, expiration: float, subkey: Any) -> None:
        """Put a value where a store would, at once and uncounted: what the swarm left before the simulation."""
        key_id = self.key_id(key)
        entry = Entry(value, expiration, entry_bytes(value, self.subkey_bytes, self.signature_bytes))
        for node_id in self.nearest(key_id)[:self.network.replicas]:
            _keep(self.nodes[node_id], key_id, subkey, entry)
        for node in self.backbones:
            _keep(node, key_id, subkey, entry)

    def forget_everything(self) -> None:
        """Every node loses what it stored, as if all had restarted at once (a test of the view rule)."""
        for node in self.nodes.values():
            node.storage = {}

    def key_id(self, key: str) -> int:
        if key not in self._key_ids:
            self._key_ids[key] = int(DHTID.generate(source=key))
        return self._key_ids[key]

    def nearest(self, key_id: int) -> List[int]:
        if key_id not in self._nearest:
            self._nearest[key_id] = heapq.nsmallest(self.network.beam, self.live_ids, key=lambda n: n ^ key_id)
        return self._nearest[key_id]

    def _hops(self, key_id: int) -> List[Tuple[int, int]]:
        """The walk's hops to a key: the range of ``live_ids`` sharing the key's first 0, 1, 2 ... bits, while it
        holds more than a beam (kept until the DHT's nodes change)."""
        if self._hops_of.get(key_id, (None, -1))[1] != self._version:
            hops, bits, ids = [], 0, self.live_ids
            while True:
                shift = ID_BITS - bits
                prefix = (key_id >> shift) << shift if bits else 0
                lo, hi = bisect.bisect_left(ids, prefix), bisect.bisect_left(ids, prefix + (1 << shift))
                if hi - lo <= self.network.beam:
                    break
                hops.append((lo, hi))
                bits += 1
            self._hops_of[key_id] = (hops, self._version)
        return self._hops_of[key_id][0]

    # --- the network

    def _round_trip(self) -> Optional[float]:
        """A sampled round trip (uniform from half to one and a half times the mean), or None for a lost RPC."""
        if self.rng.random() < self.network.loss:
            return None
        return self.network.latency * (0.5 + self.rng.random())

    def _walk(self, key: str, key_id: int, client: NodeLoad) -> Tuple[float, List[Tuple[NodeLoad, bool]]]:
        """A lookup's walk to the key and its beam: (seconds it took, [(node asked, whether it answered)] of the
        beam, nearest first). Every node asked counts a find RPC."""
        network, ids, nodes, random = self.network, self.live_ids, self.nodes, self.rng.random
        elapsed, asked = 0.0, 0
        for lo, hi in self._hops(key_id):
            # a hop's answer comes from the first of the workers' parallel requests to answer: a lost one costs
            # a timeout only when the other request is lost too
            for attempt in range(2):
                hop = nodes[ids[lo + int(random() * (hi - lo))]]
                hop.finds, hop.served, asked = hop.finds + 1, hop.served + FIND_REPLY_BYTES, asked + 1
                rtt = self._round_trip()
                if rtt is not None or attempt == 1:
                    elapsed += network.timeout if rtt is None else rtt
                    break
        beam, free = [], [elapsed] * network.workers  # when each worker is free to ask the next node of the beam
        for node_id in self.nearest(key_id):
            node = nodes[node_id]
            rtt = self._round_trip()
            node.finds, node.served = node.finds + 1, node.served + FIND_REPLY_BYTES
            beam.append((node, rtt is not None))
            heapq.heappush(free, heapq.heappop(free) + (network.timeout if rtt is None else rtt))
        asked += len(beam)
        client.sent += asked * FIND_REQUEST_BYTES
        client.received += asked * FIND_REPLY_BYTES
        self.rpcs_by_key[key] = self.rpcs_by_key.get(key, 0) + asked
        return max(free), beam

    # --- what a peer's node calls

    async def get(self, client: NodeLoad, key: str) -> Optional[ValueWithExpiration]:
        """``node.get(key, latest=True)``: the subkeys of every holder that answered, merged."""
        key_id = self.key_id(key)
        elapsed, beam = self._walk(key, key_id, client)
        await asyncio.sleep(elapsed)
        now = self.clock()
        merged: Dict[Any, Entry] = {}
        for node, answered in beam:
            held = node.storage.get(key_id) if answered else None
            if not held:
                continue
            served = 0
            for subkey, entry in held.items():
                if entry.expiration_time > now:
                    served += entry.size
                    known = merged.get(subkey)
                    if known is None or (known is not entry and entry.expiration_time > known.expiration_time):
                        merged[subkey] = entry
            node.served += served
            client.received += served
        self.get_durations.append(elapsed)
        if not merged:
            return None
        value_bytes = sum(entry.size for entry in merged.values())
        cache = next((node for node, answered in beam if node is not client), None)
        if cache is not None and self.network.cache_nearest:
            cache.stores += 1
            cache.taken += STORE_REQUEST_BYTES + value_bytes
            client.sent += STORE_REQUEST_BYTES + value_bytes
            self.rpcs_by_key[key] += 1
        return ValueWithExpiration(merged, max(entry.expiration_time for entry in merged.values()))

    async def store(self, client: NodeLoad, key: str, value: Any, expiration: float, subkey: Any) -> bool:
        """``store_record``: to the ``replicas`` nearest nodes and straight to every backbone; whether any took it."""
        key_id, network = self.key_id(key), self.network
        if "peer_id" in value:  # a peer record: how long since the last one (two at once while changing buckets)
            now = self.clock()
            if client.renewed is not None and now > client.renewed:
                self.renewal_gaps.append(now - client.renewed)
            client.renewed = now
        size = entry_bytes(value, self.subkey_bytes, self.signature_bytes)
        elapsed, beam = self._walk(key, key_id, client)
        arrivals: List[Tuple[float, NodeLoad]] = []
        slots, candidates, requests = [0.0] * network.replicas, iter(node for node, _ in beam), 0
        for slot in range(network.replicas):
            for node in candidates:  # a lost store moves on to the next nearest node, as hivemind's store does
                requests, node.stores = requests + 1, node.stores + 1
                rtt = self._round_trip()
                if rtt is None:
                    slots[slot] += network.timeout
                    continue
                arrivals.append((elapsed + slots[slot] + rtt / 2, node))
                slots[slot] += rtt
                break
        finished = elapsed + max(slots)
        for node in self.backbones:  # store_record's copy, sent beside the lookup
            if node is client:
                continue
            requests, node.stores = requests + 1, node.stores + 1
            rtt = self._round_trip()
            finished = max(finished, network.timeout if rtt is None else rtt)
            if rtt is not None:
                arrivals.append((rtt / 2, node))
        loop = asyncio.get_running_loop()
        entry = Entry(value, expiration, size)
        for arrival, node in arrivals:
            node.taken += STORE_REQUEST_BYTES + size
            node.served += STORE_REPLY_BYTES
            loop.call_later(arrival, _keep, node, key_id, subkey, entry)
        client.sent += requests * (STORE_REQUEST_BYTES + size)
        client.received += len(arrivals) * STORE_REPLY_BYTES
        self.rpcs_by_key[key] += requests
        await asyncio.sleep(finished)
        return bool(arrivals)


def _keep(node: NodeLoad, key_id: int, subkey: Any, entry: Entry) -> None:
    """A store arriving at ``node``: kept if the node is alive and the entry expires later than what it holds."""
    if not node.alive:
        return
    held = node.storage.setdefault(key_id, {})
    known = held.get(subkey)
    if known is None or entry.expiration_time > known.expiration_time:
        held[subkey] = entry


class SimulatedNode:
    """What the announcer and the reader call on a peer's DHT node, answered by the simulated DHT."""

    # no validators: records are checked where they are made (``PeerRecord.parse_obj`` in every publish), and each
    # peer's writer key is given to its announcer
    protocol = SimpleNamespace(record_validator=None)

    def __init__(self, dht: SimulatedDHT, load: NodeLoad, peer_id: str):
        self.dht, self.load, self.peer_id = dht, load, PeerIdText(peer_id)
        # the peers the last read of records found: a view that held only these would be the rule before #20
        self.last_read: set = set()

    async def get(self, key: str, latest: bool = False) -> Optional[ValueWithExpiration]:
        return await self.dht.get(self.load, key)  # every membership read asks for the latest

    async def get_many(self, keys, sufficient_expiration_time: Optional[float] = None) -> Dict[str, Any]:
        if len(keys) == 1:
            found = {keys[0]: await self.dht.get(self.load, keys[0])}
        else:
            found = dict(zip(keys, await asyncio.gather(*(self.dht.get(self.load, key) for key in keys))))
        self.last_read = {item.value["peer_id"] for value in found.values() if value is not None
                          for item in value.value.values() if "peer_id" in item.value}  # not the summaries
        return found


async def store_on_simulated_dht(node: SimulatedNode, key: str, value: Any, expiration: float,
                                 subkey: Any = None) -> bool:
    """The simulation's ``store_record`` (``PeerAnnouncer(store=...)``)."""
    return await node.dht.store(node.load, key, value, expiration, subkey)
