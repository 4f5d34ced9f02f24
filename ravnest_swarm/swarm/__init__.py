"""The swarm end to end: the volunteer lifecycle, the run spec, state transfer and the local demo."""
