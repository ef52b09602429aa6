"""The GDN input projection with the decode conv as its epilogue (``ft.gdn.triton_conv_proj``,
``CONV_IN_PROJ``) run by Triton's interpreter on CPU tensors: the kernel against the GEMV then the
decode conv kernel, bit for bit, and a model decoding with it against one without. fp16: the
interpreter truncates fp32 -> bf16 where a GPU rounds. Skipped without triton."""

from __future__ import annotations

import pytest
import torch

from tests.interpreter import INTERPRETER, run_check

pytestmark = INTERPRETER


def check_proj_conv() -> None:
    """``triton_conv_proj.launch_proj_conv`` (the input projection with the decode conv as its
    epilogue) equals ``launch_gemv`` then the decode conv kernel, bit for bit: the conv channels,
    the others, every sequence's history after (some sequences without context), in any program
    order. Conv channels ending inside a program's columns and at a boundary; 1..4 sequences."""
    import triton

    from ft.gdn import triton_conv, triton_conv_proj
    from ft.layers import triton_gemv
    from tests.test_moe_fusions_interp import programs_shuffled

    gen = torch.Generator().manual_seed(7)
    for b, n, k, c, kc in (
        (1, 100, 64, 40, 4),
        (3, 130, 300, 64, 4),
        (4, 96, 128, 80, 3),
        (2, 72, 256, 72, 4),
    ):
        x = torch.randn(b, k, generator=gen).half()
        w = (torch.randn(n, k, generator=gen) * k**-0.5).half()
        conv_w = torch.randn(c, kc, generator=gen).half()
        state = torch.randn(b + 3, c, kc - 1, generator=gen).half()
        slots = torch.randperm(b + 3, generator=gen)[:b]
        context = torch.randint(0, 3, (b,), generator=gen).int()
        context[0] = 0  # a sequence's first token: no history
        y = triton_gemv.launch_gemv(x, w)
        want_state = state.clone()
        want = torch.empty(b, c, dtype=x.dtype)
        triton_conv._conv_decode_kernel[(b, triton.cdiv(c, 256))](
            y, conv_w, want_state, context, slots, want, c, y.stride(0), want.stride(0), conv_w.stride(0),
            want_state.stride(0), want_state.stride(1), KC=kc, KP=triton.next_power_of_2(kc), BLOCK_C=256,
        )  # fmt: skip
        got_state = state.clone()
        with programs_shuffled(b + n):
            got = triton_conv_proj.launch_proj_conv(x, w, conv_w, got_state, context, slots)
        assert torch.equal(got[:, :c], want), (b, n, c)
        assert torch.equal(got[:, c:], y[:, c:]), (b, n, c)
        assert torch.equal(got_state, want_state), (b, n, c)


def check_model_with_conv_in_projection() -> None:
    """A Qwen3-Next model decoding on the CPU (fp16) with ``CONV_IN_PROJ`` on, the interpreter
    running the projection's kernel in place of the GEMV and the torch backend's conv: the same
    greedy tokens as with it off and log-probs within fp16 rounding, over steps whose histories
    the kernel shifted (a wrong shift or a skipped conv changes the tokens of this random model)."""
    import tempfile

    from ft import LLM, SamplingParams
    from ft.gdn import triton_conv_proj
    from ft.gdn.torch_ref import TorchGDN
    from tests.checkpoints import write_checkpoint

    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, ignore_eos=True)
    prompts = [[5, 17, 3, 88, 41, 9], [30, 1, 64]]
    calls = []
    launch = triton_conv_proj.launch_proj_conv
    triton_conv_proj.launch_proj_conv = lambda *args: calls.append(1) or launch(*args)
    triton_conv_proj.takes = lambda x, w: len(x) <= 4  # the CPU's fp16 tensors too
    TorchGDN.folds_decode_conv = True  # its decode conv stands in for triton_conv's
    with tempfile.TemporaryDirectory() as path:
        write_checkpoint(path, "qwen3_next", seed=3)
        outs = []
        for on in (False, True):
            triton_conv_proj.CONV_IN_PROJ = on
            with LLM(model=path, device="cpu", dtype="float16", progress=False) as llm:
                outs.append(llm.generate(prompts, params))
    assert calls, "the projection's kernel never ran"
    for off, on in zip(*outs):
        assert on.token_ids == off.token_ids
        for a, b, tok in zip(off.logprobs, on.logprobs, off.token_ids):
            assert abs(a[tok] - b[tok]) < 2e-2, (a[tok], b[tok])


CHECKS = ["check_proj_conv", "check_model_with_conv_in_projection"]


@pytest.mark.parametrize("check", CHECKS)
def test_kernel_under_the_interpreter(check):
    run_check("tests.test_conv_proj_interp", check)
