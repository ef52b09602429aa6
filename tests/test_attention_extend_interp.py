"""The paged extend kernel (``ft.attention.triton_kernels.extend_kernel``) run by Triton's
interpreter on CPU tensors: prefill chunks after cached context, over shuffled pages, against
causal attention computed in fp64 from the same cache.

Cases: fp32 heads of 32 (32-query, 64-key tiles; chunks after 0, 5, 64 and 300 cached tokens), and
fp16 heads of 128 at the tiles Qwen3-Next's bf16 prefill takes (128 x 64), 16 q / 2 kv heads (the
interpreter's bf16 products are not the GPU's). ``tests/gpu/test_kernels.py`` checks the
compiled kernel against the torch backend in bf16.

Tried and left out (2026-12-04, compiled for sm_90, not timed): the whole key tiles before a
program's first query in a loop of their own, without load masks or the causal select. At
Qwen3-Next's tiles (heads of 256, 128 x 64, 8 warps: 255 registers, spilling) ptxas then
serialised every wgmma of both loops (warning C7515; 40 waits for 40 wgmmas, against 2 for 20 in
the one loop), which would cost more than the ~2 instructions an element the select saves.
"""

from __future__ import annotations

import pytest
import torch

from tests.interpreter import INTERPRETER, run_check

pytestmark = INTERPRETER
PAGE = 16


def chunk_batch(specs: list[tuple[int, int]], hq: int, hkv: int, d: int, dtype, gen: torch.Generator):
    """Sequences (cached context, new queries): a cache holding all their keys on shuffled pages,
    the queries, the block tables, cu_seqlens and context lengths."""
    need = [-(-(c + n) // PAGE) for c, n in specs]
    free = torch.randperm(sum(need) + 3, generator=gen).tolist()
    tables = []
    for n in need:
        blocks = [free.pop() for _ in range(n)]
        tables.append(blocks + [0] * (max(need) - n))
    cache = torch.randn(2, sum(need) + 3, PAGE, hkv, d, generator=gen).to(dtype)
    q = torch.randn(sum(n for _, n in specs), hq, d, generator=gen).to(dtype)
    cu = torch.tensor([0] + [sum(n for _, n in specs[: i + 1]) for i in range(len(specs))], dtype=torch.int32)
    ctx = torch.tensor([c for c, _ in specs], dtype=torch.int32)
    return cache, q, torch.tensor(tables, dtype=torch.int32), cu, ctx


def reference(cache, q, tables, cu, ctx, scale: float) -> torch.Tensor:
    # each query attends to its sequence's keys up to its own position, in fp64
    hq, hkv = q.shape[1], cache.shape[3]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(len(ctx)):
        lo, hi, c = int(cu[i]), int(cu[i + 1]), int(ctx[i])
        total = c + hi - lo
        pos = torch.arange(total)
        slots = tables[i][pos // PAGE].long() * PAGE + pos % PAGE
        k, v = (cache[j].reshape(-1, hkv, cache.shape[-1])[slots].double() for j in (0, 1))
        k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)  # [S, Hq, d]
        s = torch.einsum("thd,shd->hts", q[lo:hi].double(), k) * scale
        s = s.masked_fill(pos[None, None, :] > (c + torch.arange(hi - lo))[None, :, None], float("-inf"))
        out[lo:hi] = torch.einsum("hts,shd->thd", s.softmax(-1), v)
    return out


def check_extend(dtype, d: int, hq: int, hkv: int, specs: list[tuple[int, int]], tol: float) -> None:
    from ft.attention import triton_paged

    gen = torch.Generator().manual_seed(d)
    cache, q, tables, cu, ctx = chunk_batch(specs, hq, hkv, d, dtype, gen)
    max_q = max(n for _, n in specs)
    want = reference(cache, q, tables, cu, ctx, d**-0.5)
    got = triton_paged.paged_extend(q, cache, tables, cu, ctx, max_q, d**-0.5)
    err = (got.double() - want).abs().max().item()
    if not err < tol:  # raised, not asserted: the check may run under -O
        raise AssertionError(f"{dtype} d={d}: max error {err:.3g} against fp64")


def check_fp32_small_tiles() -> None:
    check_extend(torch.float32, 32, 4, 2, [(0, 37), (300, 70), (64, 40), (5, 1)], 1e-5)


def check_fp16_qwen3_next_tiles() -> None:
    check_extend(torch.float16, 128, 16, 2, [(200, 150), (0, 20)], 2e-2)


@pytest.mark.parametrize("check", ["check_fp32_small_tiles", "check_fp16_qwen3_next_tiles"])
def test_extend_under_the_interpreter(check):
    run_check("tests.test_attention_extend_interp", check)


def test_extend_tiles_from_the_environment():
    """FT_ATTN_EXTEND_TILES sets the 16-bit wide heads' tiles for a process, nothing else's."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    code = (
        "import torch; from ft.attention import triton_paged as t; "
        "print(t._extend_config(torch.bfloat16, 256, 8000), t._extend_config(torch.float32, 256, 8000))"
    )
    env = {k: v for k, v in os.environ.items() if k != "FT_ATTN_EXTEND_TILES"}
    runs = [
        subprocess.run([sys.executable, "-c", code], env=env | extra, capture_output=True, text=True)
        for extra in ({}, {"FT_ATTN_EXTEND_TILES": "64,32,4,3"})
    ]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    assert runs[0].stdout.strip() == "(128, 64, 8, 2) (32, 32, 8, 2)"
    assert runs[1].stdout.strip() == "(64, 32, 4, 3) (32, 32, 8, 2)"
