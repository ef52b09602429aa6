"""The folded pre-norms (``ft.layers.norm.FoldedNorm``, ``FOLD_INPUT_NORM``, ``FOLD_POST_NORM``) on
the CPU: a model whose norms are all left to their readers gives the unfolded model's tokens and
log-probs bit for bit (on a CPU every reader computes the norm itself, ``FoldedNorm.tensor``, so
this checks the plumbing: each residual stream ``h`` written before it is read, the MoE block's experts and
shared expert given the normed input); the kernels that fold it are checked under Triton's
interpreter (tests/test_folded_norm_interp.py) and on a GPU (tests/gpu/test_gemv.py,
tests/gpu/test_router_fold.py)."""

from __future__ import annotations

import pytest

from ft import LLM, SamplingParams
from ft.layers import norm as norm_module
from ft.models import decoder
from tests.checkpoints import write_checkpoint


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_moe"])
def test_folded_norms_change_nothing_on_a_cpu(tmp_path, model_type, monkeypatch):
    write_checkpoint(tmp_path, model_type, seed=11)
    prompts = [[5, 17, 3, 88, 41, 9, 2, 60], [30, 1, 64, 19]]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, prompt_logprobs=2, ignore_eos=True)

    def run():
        with LLM(model=str(tmp_path), device="cpu", dtype="bfloat16", progress=False) as llm:
            return [(o.token_ids, o.logprobs, o.prompt_logprobs) for o in llm.generate(prompts, params)]

    unfolded = run()
    made = []
    folded_init = norm_module.FoldedNorm.__init__

    def counted(self, *args):
        folded_init(self, *args)
        made.append(self)

    monkeypatch.setattr(norm_module.FoldedNorm, "__init__", counted)
    # every norm with a residual before a reader that takes it, whatever the batch and device
    folds = staticmethod(lambda x, reader: getattr(reader, "takes_folded_norm", False))
    monkeypatch.setattr(decoder.DecoderLayer, "_folds", folds)
    monkeypatch.setattr(norm_module, "FOLD_INPUT_NORM", True)
    monkeypatch.setattr(norm_module, "FOLD_POST_NORM", True)
    assert run() == unfolded
    assert made and all(f.a is not None for f in made)  # each one computed by a reader
