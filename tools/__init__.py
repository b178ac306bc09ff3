"""Benchmarks, fault injection and inspectors (run as python -m tools.<name>)."""
