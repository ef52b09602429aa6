"""``ft.engine.allocator`` on a GPU: ``--max-gpu-memory`` holds torch's allocator to the cap while
an engine runs and lets go when it closes; ``FT_EXPANDABLE_SEGMENTS=1`` gives the engine's
allocations expandable segments and the same greedy tokens."""

from __future__ import annotations

import json

import pytest
import torch

from ft import LLM, SamplingParams
from tests.checkpoints import write_checkpoint
from tests.interpreter import run_fresh

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 3, 88, 41, 9, 2, 60, 33], list(range(1, 40))]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_the_cap_holds_the_allocator_until_the_engine_closes(tmp_path):
    write_checkpoint(tmp_path, "qwen3_next")
    big = 6 << 30  # more than the cap leaves
    options = dict(device="cuda", dtype="float32", max_gpu_memory="4GiB", progress=False)
    with LLM(model=str(tmp_path), **options) as llm:
        assert all(o.token_ids for o in llm.generate(PROMPTS, PARAMS))
        with pytest.raises(torch.cuda.OutOfMemoryError):
            torch.empty(big, dtype=torch.uint8, device="cuda")
    lifted = torch.empty(big, dtype=torch.uint8, device="cuda")
    del lifted


def test_expandable_segments_give_the_same_tokens(tmp_path):
    write_checkpoint(tmp_path, "qwen3_next")
    with LLM(model=str(tmp_path), device="cuda", dtype="float32", progress=False) as llm:
        want = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    out = tmp_path / "expandable.json"
    code = f"""
import json, torch
from ft import LLM
from tests.gpu.test_allocator_gpu import PROMPTS, PARAMS
with LLM(model={str(tmp_path)!r}, device="cuda", dtype="float32", progress=False) as llm:
    tokens = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    expandable = any(s.get("is_expandable") for s in torch.cuda.memory._snapshot()["segments"])
with open({str(out)!r}, "w") as f:
    json.dump(dict(tokens=tokens, expandable=expandable), f)
"""
    run_fresh(code, {"FT_EXPANDABLE_SEGMENTS": "1"})
    got = json.loads(out.read_text())
    assert got["expandable"], "no segment of the engine's is expandable"
    assert got["tokens"] == want
