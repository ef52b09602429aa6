"""Fixtures of the offload equality tests: a tiny random checkpoint of each family (8 experts,
top-2) and the resident backend's outputs on it, one-shot and in chunks of 5 tokens."""

from __future__ import annotations

import pytest

from tests.checkpoints import family_checkpoints
from tests.offload.equality import generate

ckpt = family_checkpoints(seed=21)


@pytest.fixture(scope="module")
def refs(ckpt):
    return {chunk: generate(ckpt, moe_backend="gpu", max_num_batched_tokens=chunk)[0] for chunk in (8192, 5)}
