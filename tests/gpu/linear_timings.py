"""Timing of the Triton GEMV against cuBLAS (``F.linear``) for the dense projections of a decode
step (not a test): ``python tests/gpu/linear_timings.py``. Per call of a CUDA graph of calls back
to back over distinct weights (over 200 MB in all: HBM, not L2), median of 20 replays, as a decode
step runs them; the floor is the weight's bytes at 4.22 TB/s. The last line says up to how many
rows the GEMV wins on every shape, for ``ft.layers.triton_gemv.GEMV_MAX_TOKENS``.

Until 2026-11-30 this timed one call per graph replay: the replay's own ~10 us hid every
difference (both columns read 10-20 us for weights of 1-50 MB)."""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from ft.layers.triton_gemv import gemv  # noqa: E402
from tests.gpu.kernel_timings import HBM, bench_series, series_copies  # noqa: E402

SHAPES = {  # (N, K) of one rank's weight, bf16
    "qwen3-next in_proj (qkvz+ba)": (12352, 2048),
    "qwen3-next attn qkv (q+gate, k, v)": (9216, 2048),
    "qwen3-next out_proj / o_proj": (2048, 4096),
    "router + shared gate (513)": (513, 2048),
    "shared expert gate_up": (1024, 2048),
    "shared expert down": (2048, 512),
    "qwen3-30b qkv": (5120, 2048),
    "qwen3-30b o_proj": (2048, 4096),
}


def main() -> None:
    print(f"dense GEMV vs cuBLAS, bf16, {torch.cuda.get_device_name()}")
    wins, last = 0, 0
    for m in (1, 2, 4, 8, 16):
        all_win = True
        for name, (n, k) in SHAPES.items():
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            copies = series_copies(n * k * 2)
            ws = [(torch.randn(n, k, device="cuda") * k**-0.5).to(torch.bfloat16) for _ in range(copies)]
            cublas = bench_series([lambda x=x, w=w: F.linear(x, w) for w in ws]) * 1e3
            ours = bench_series([lambda x=x, w=w: gemv(x, w) for w in ws]) * 1e3
            del ws
            floor = n * k * 2 / HBM * 1e6
            all_win &= ours < cublas
            print(
                f"M={m:<2d} {name:36s} N={n:<6d} K={k:<5d} | cuBLAS {cublas:7.1f} us | gemv {ours:7.1f} us"
                f" | floor {floor:6.1f} us ({floor / min(ours, cublas):5.1%} of the better)",
                flush=True,
            )
        if all_win and wins == last:
            wins = m  # the GEMV has won on every shape at every M so far
        last = m
    print(f"GEMV faster on every shape up to M = {wins}")


if __name__ == "__main__":
    main()
