"""Benchmarks (``ft bench``)."""
