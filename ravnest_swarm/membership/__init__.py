"""Membership: backbone peers, volunteers' signed records, observers and the preflight check."""
