"""The shipped fused MoE's MMA path (grouped GEMMs) on Qwen3-Next's bank shapes at prefill sizes, a
few calls, for a kernel profiler (not a test):

    ncu -k regex:"_grouped_gemm_kernel|_w4a16_gemm_kernel" --launch-skip 4 --launch-count 2 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python tests/gpu/grouped_once.py [bf16|nvfp4] [TOKENS]

512 experts of 2 x 512 x 2048, top-10 (``config_sweep.moe_problem``; FT_SWEEP_MOE=E,I,H,k for
another shape), the tiles as shipped (or as FT_MOE_PREFILL / FT_W4A16_PREFILL set them). Each call
launches gate/up then down, so with two warm-up calls ``--launch-skip 4 --launch-count 2`` profiles
one of each. Prints the mean time a call from CUDA events (with what a profiler adds)."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from ft.moe.kernels import triton_moe, triton_w4a16  # noqa: E402
from tests.gpu.config_sweep import moe_problem  # noqa: E402


def main() -> None:
    fmt = sys.argv[1] if len(sys.argv) > 1 else "bf16"
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 16384
    banks, x, routes = moe_problem(tokens)
    w13, w2 = banks[fmt]
    fused = triton_moe.fused_moe_triton if fmt == "bf16" else triton_w4a16.fused_moe_w4a16
    for w, i in routes[:2]:  # compile, warm
        fused(x, w13, w2, w, i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for c in range(4):
        fused(x, w13, w2, *routes[c % len(routes)])
    end.record()
    torch.cuda.synchronize()
    print(f"{fmt} T={tokens}: {start.elapsed_time(end) / 4 * 1e3:.1f} us a call (sort, gate/up, down, sum)")


if __name__ == "__main__":
    main()
