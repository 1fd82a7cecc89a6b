"""Benchmarks, run on demand (not in the test suite); each prints one JSON object."""
