"""Tensor-parallel building blocks: each layer allocates its own shard and loads it."""
