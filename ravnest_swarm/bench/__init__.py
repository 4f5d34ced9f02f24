"""Benchmarks, network labs and the test peers they start. Production code never imports this package."""
