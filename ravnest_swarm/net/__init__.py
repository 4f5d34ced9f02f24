"""The network layer: p2pd and DHT nodes, the message envelope and bounded frames, and the routes to a peer
(direct, reversal, forwarding)."""

from ravnest_swarm.net.serializer import bound_extension_depth

bound_extension_depth()  # before any node decodes what a stranger stored (serializer.py)
