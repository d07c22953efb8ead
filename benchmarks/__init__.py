"""Benchmark scripts and the harness they share (not part of the installed package)."""
