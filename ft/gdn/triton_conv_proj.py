"""A decode batch's GDN input projection with the causal conv as the GEMV's epilogue, one launch
where there were two (``CONV_IN_PROJ``, on).

The in_proj GEMV (``triton_gemv``: a program per BLOCK_N output columns, every row) stores its
rows, then a program whose columns include conv channels (the first C, ``[q | k | v]`` heads
first) reads them back and overwrites them with ``silu(conv)`` of each sequence's history, shifting
the history in ``conv_state[slot]`` (``triton_conv.conv_decode_channels``, the decode conv
kernel's arithmetic: the same bits). A program owns its channels of every sequence's history, as
the conv kernel's (sequence, channel block) programs own theirs, so no program waits for another.
Rows are sequences of one token each (a decode batch). The census of issue 5's batch-1 step has 36
decode conv launches at 2.6 us each (94 of 3,052 us, docs/benchmarks.md 2026-12-04 05:19).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ft.gdn.triton_conv import conv_decode_channels, store_history
from ft.layers import gemv_tiles, triton_gemv
from ft.layers.pdl import pdl_args, wait_for_previous

# On from 2026-12-05 (FT_GDN_CONV_IN_PROJ=0 turns it off for a process and the ranks it spawns): the
# 80B's batch-1 decode with NVFP4 experts on an H200, rows of one load in turn, 335.8 / 335.7 tok/s
# off against 343.6 / 343.7 on (+2.3%), greedy tokens the same (docs/benchmarks.md, 2026-12-05
# 04:10-04:35 UTC); its GPU tests (tests/gpu/test_gdn_decode.py, test_engine_cuda.py) passed.
CONV_IN_PROJ = os.environ.get("FT_GDN_CONV_IN_PROJ", "1") != "0"


@triton.jit
def _proj_conv_kernel(
    x, w, out, conv_w, conv_state, context_lens, state_slots, M, N, K, C, s_xm, s_wn, s_om, s_wc, s_ss, s_sc,
    M_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, KC: tl.constexpr,
    KP: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_previous(USE_PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, M_P)
    acc = gemv_tiles.gemv_tile(x, w, n, M, N, 0, K, s_xm, s_wn, M_P, BLOCK_N, BLOCK_K, EVEN_K)
    tl.store(out + m[:, None].to(tl.int64) * s_om + n[None, :], acc.to(out.dtype.element_ty),
             mask=(m < M)[:, None] & (n < N)[None, :])  # fmt: skip
    if tl.program_id(0) * BLOCK_N < C:  # this program's conv channels, sequence by sequence
        cmask = n < C
        # a plain loop: with num_stages the pipeliner could hoist the next row's loads above the
        # barrier that orders them after this program's stores
        for t in range(0, M):
            tl.debug_barrier()  # the rows this program stored, before its threads read them back
            has_hist = tl.load(context_lens + t) > 0
            base = conv_state + tl.load(state_slots + t).to(tl.int64) * s_ss + n[:, None] * s_sc
            row = out + t * s_om
            y, shifted = conv_decode_channels(row, conv_w, base, n, cmask, has_hist, s_wc, KC, KP)
            tl.debug_barrier()  # every thread's loads of the row and the history before any store
            tl.store(row + n, y.to(out.dtype.element_ty), mask=cmask)
            store_history(base, shifted, cmask, KC, KP)


takes = triton_gemv.takes  # the projections it runs are the GEMV's


def launch_proj_conv(
    x: torch.Tensor,
    w: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    context_lens: torch.Tensor,
    state_slots: torch.Tensor,
) -> torch.Tensor:
    """x [B, K] (a token of each of B sequences), w [N, K] -> [B, N] = x @ w.T with columns :C
    replaced by the decode conv's output (``causal_conv1d_silu`` of them), conv_weight [C, Kc],
    conv_state [slots, C, Kc-1] updated in place at the sequences' ``state_slots`` (history read
    where ``context_lens`` > 0). Without the device check (the interpreter runs it)."""
    x, w = triton_gemv.check_operands(x, w)
    (b, k), n = x.shape, w.shape[0]
    c, kc = conv_weight.shape
    assert c <= n and conv_state.shape[1:] == (c, kc - 1), (
        f"conv weight {tuple(conv_weight.shape)} and state {tuple(conv_state.shape)} do not fit {n} outputs"
    )
    assert conv_state.stride(-1) == 1 and conv_weight.stride(-1) == 1, "conv weight and state rows contiguous"
    assert context_lens.shape == state_slots.shape == (b,), "a context length and a state slot a sequence"
    out = torch.empty(b, n, dtype=x.dtype, device=x.device)
    p = triton_gemv.plan(n, k, 1)
    _proj_conv_kernel[(p.blocks,)](
        x, w, out, conv_weight, conv_state, context_lens, state_slots, b, n, k, c, x.stride(0), w.stride(0),
        out.stride(0), conv_weight.stride(0), conv_state.stride(0), conv_state.stride(1),
        M_P=triton_gemv.MAX_M, BLOCK_N=p.block_n, BLOCK_K=p.block_k, EVEN_K=p.even_k, KC=kc,
        KP=triton.next_power_of_2(kc), num_warps=p.num_warps, num_stages=p.num_stages, **pdl_args(x),
    )  # fmt: skip
    return out
