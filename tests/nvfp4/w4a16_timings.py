"""Timing of the Triton W4A16 MoE next to the bf16 Triton MoE, each by its MMA path and, up to
T=64, by the GEMV path (``triton_moe_gemv``) (not a test): ``python tests/nvfp4/w4a16_timings.py``.
The last line says up to which T the GEMV path wins, for each format's ``GEMV_MAX_TOKENS``.

Qwen3-Next's shape (E=512, I=512, H=2048, top-10) at T = 1 .. 64 (decode; eager and CUDA graph)
and 4096 (prefill), or the sizes FT_TIMINGS_T lists (e.g. 64,4096,8192,16384: prefill chunks;
FT_W4A16_LUT=0 times the byte decode instead of the table's; from 1,024 tokens a column
dequantises the bank to bf16 first, then runs bf16's MMA path); the graph column is per call of
eight back to back, each with its own routing (until 2026-11-30 it timed one call per replay, the
replay's ~10 us included, on the same experts every call, so they sat in L2). The floor is the
larger of the hit experts' bytes over HBM (4.22 TB/s) and the FLOPs at 783 TFLOP/s, from
DESIGN.md; NVFP4 bytes count codes and scales.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from ft.moe.kernels import triton_moe, triton_w4a16  # noqa: E402
from ft.moe.kernels.triton_moe import fused_moe_triton  # noqa: E402
from ft.moe.kernels.triton_moe_gemv import fused_moe_gemv  # noqa: E402
from ft.moe.kernels.triton_w4a16 import fused_moe_w4a16  # noqa: E402
from ft.moe.kernels.w4a16_dequantize import dequantize_bank  # noqa: E402
from tests.gpu.kernel_timings import FLOPS, HBM, bench, bench_series, routings  # noqa: E402
from tests.nvfp4.test_w4a16_gpu import random_bank  # noqa: E402

_buffers: dict = {}


def dequantized_bf16(x, w13, w2, weights, ids):
    """The bf16 MMA path on the NVFP4 bank dequantised first, into buffers kept across calls."""
    d13 = dequantize_bank(w13, out=_buffers.get(13))
    d2 = dequantize_bank(w2, out=_buffers.get(2))
    _buffers.update({13: d13, 2: d2})
    return fused_moe_triton(x, d13, d2, weights, ids)


def main() -> None:
    e, inter, h, k = 512, 512, 2048, 10
    gen = torch.Generator(device="cuda").manual_seed(0)
    q13, q2 = random_bank(e, 2 * inter, h, gen), random_bank(e, h, inter, gen)
    b13 = (torch.randn(e, 2 * inter, h, device="cuda") * h**-0.5).to(torch.bfloat16)
    b2 = (torch.randn(e, h, inter, device="cuda") * inter**-0.5).to(torch.bfloat16)
    print(f"moe E={e} I={inter} H={h} top{k}, {torch.cuda.get_device_name()}")
    triton_moe.GEMV_MAX_TOKENS = triton_w4a16.GEMV_MAX_TOKENS = 0  # the MMA columns are MMA only
    wins, last = {"w4a16": 0, "bf16": 0}, 0
    sizes = [int(v) for v in os.environ.get("FT_TIMINGS_T", "1,2,4,8,16,32,64,4096").split(",")]
    for t in sizes:
        x = torch.randn(t, h, device="cuda").to(torch.bfloat16)
        routes = routings(t, e, k)  # the graph column: eight calls, each its own experts
        weights, ids = routes[0]
        hit = sum(i.unique().numel() for _, i in routes) / len(routes)
        flops = t * k * 3 * 2 * inter * h / FLOPS * 1e6
        row = [f"T={t:<5d} hit {hit:5.1f}"]
        graphs = {}
        for name, fn, w13, w2, bytes_per_weight in (
            ("w4a16", fused_moe_w4a16, q13, q2, 0.5 + 1 / 16),
            # prefill sizes: the whole bank dequantised to bf16 (``dequantize_bank``), then bf16's MMA
            *([("dequant+bf16", dequantized_bf16, q13, q2, 0.5 + 1 / 16)] if t >= 1024 else []),
            *([("w4a16 gemv", fused_moe_gemv, q13, q2, 0.5 + 1 / 16)] if t <= 64 else []),
            ("bf16", fused_moe_triton, b13, b2, 2.0),
            *([("bf16 gemv", fused_moe_gemv, b13, b2, 2.0)] if t <= 64 else []),
        ):
            floor = max(hit * 3 * inter * h * bytes_per_weight / HBM * 1e6, flops)

            def call(fn=fn, x=x, w13=w13, w2=w2, w=weights, i=ids):
                return fn(x, w13, w2, w, i)

            series = [lambda fn=fn, x=x, w13=w13, w2=w2, w=w, i=i: fn(x, w13, w2, w, i) for w, i in routes]
            eager = bench(call) * 1e3
            graph = graphs[name] = bench_series(series) * 1e3
            row.append(
                f"| {name} eager {eager:8.1f} us graph {graph:8.1f} us floor {floor:7.1f} us "
                f"({floor / graph:5.1%})"
            )
        print(" ".join(row), flush=True)
        for fmt in wins:
            if f"{fmt} gemv" in graphs and graphs[f"{fmt} gemv"] < graphs[fmt] and wins[fmt] == last:
                wins[fmt] = t  # the GEMV path has won at every T so far
        last = t
    print(f"GEMV faster in a graph up to T = {wins['w4a16']} (NVFP4), {wins['bf16']} (bf16)")


if __name__ == "__main__":
    main()
