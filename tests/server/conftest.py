"""Fixtures every server test module shares: the offline engine and the tokenizer for the
module's own ``model_dir`` (each module writes its checkpoint and starts its own server)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tests.server.harness import offline_llm


@pytest.fixture(scope="module")
def llm(model_dir):
    with offline_llm(model_dir) as llm:
        yield llm


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(str(model_dir))
