"""Fixtures of the offload tests: a tiny random checkpoint of each family (8 experts, top-2), the
resident backend's outputs on it, one-shot and in chunks of 5 tokens, and ``copying_decode`` for
the tests of the decode path that copies misses into the cache (host reads off)."""

from __future__ import annotations

import pytest

from ft.moe.backends import host_reads
from tests.checkpoints import family_checkpoints
from tests.offload.equality import generate

ckpt = family_checkpoints(seed=21)


@pytest.fixture
def copying_decode(monkeypatch):
    """Decode makes each layer's experts resident before its kernel (``host_reads.ENABLED`` off,
    here and in the ranks an engine spawns)."""
    monkeypatch.setattr(host_reads, "ENABLED", False)
    monkeypatch.setenv("FT_MOE_HOST_READS", "0")


@pytest.fixture(scope="module")
def refs(ckpt):
    return {chunk: generate(ckpt, moe_backend="gpu", max_num_batched_tokens=chunk)[0] for chunk in (8192, 5)}
