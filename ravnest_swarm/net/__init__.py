"""The network layer: p2pd and DHT nodes, the message envelope and bounded frames, and the routes to a peer
(direct, reversal, forwarding)."""
