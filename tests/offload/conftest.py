"""Fixtures of the offload equality tests: a tiny random checkpoint of each family (8 experts,
top-2) and the resident backend's outputs on it, one-shot and in chunks of 5 tokens."""

from __future__ import annotations

import pytest

from tests.checkpoints import write_checkpoint
from tests.offload.equality import generate


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_moe"])
def ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    write_checkpoint(path, request.param, seed=21)
    return path


@pytest.fixture(scope="module")
def refs(ckpt):
    return {chunk: generate(ckpt, moe_backend="gpu", max_num_batched_tokens=chunk)[0] for chunk in (8192, 5)}
