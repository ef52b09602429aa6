"""Kernels that run an expert bank: ``kernel(x, bank, weights, ids) -> [T, H]`` (this rank's
partial sum over its intermediate shard). Selection lives in ``select``."""
