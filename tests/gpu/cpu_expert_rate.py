"""How fast this machine's CPU computes one routed expert, against the PCIe copy of its weights
(not a test; what the hybrid and cpu backends' decode depends on):

    python tests/gpu/cpu_expert_rate.py [HIDDEN] [INTER] [THREADS]

Defaults: Qwen3-Next-80B's experts (hidden 2,048, intermediate 512), every core. For bf16 and
fp32 weights and 1, 20 and 156 tokens (a decode step; a 1k prompt's and an 8k prompt's tokens
per expert at top-10 of 512) it prints the time per expert, the weight bytes read per second and
the TFLOPS, the weights in cache; then bf16 with 64 experts' weights read in turn (out of cache, as
a host store's are); then the host's memory copy rate. Compare the first with the pinned host-to-device
rate `ft bench` measures (55 GB/s on the H200 machines): a CPU reading an expert faster than
the link copies it is what makes computing misses there pay."""

from __future__ import annotations

import os
import sys
import time

import torch


def expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate, up = (x @ w13.t()).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ w2.t()


def main() -> None:
    args = [int(a) for a in sys.argv[1:]]
    h, inter, threads = (args + [2048, 512, os.cpu_count() or 1][len(args) :])[:3]
    torch.set_num_threads(threads)
    print(f"{threads} threads; expert {h} x {inter}")
    for dtype in (torch.bfloat16, torch.float32):
        w13 = torch.randn(2 * inter, h, dtype=dtype)
        w2 = torch.randn(h, inter, dtype=dtype)
        nbytes = (w13.numel() + w2.numel()) * w13.element_size()
        for tokens in (1, 20, 156):
            x = torch.randn(tokens, h, dtype=dtype)

            for _ in range(5):
                expert(x, w13, w2)
            n = 50
            t0 = time.perf_counter()
            for _ in range(n):
                expert(x, w13, w2)
            dt = (time.perf_counter() - t0) / n
            flops = 2 * 3 * h * inter * tokens
            print(f"{str(dtype):15} T={tokens:4}: {dt * 1e6:9.1f} us an expert, "
                  f"{nbytes / dt / 1e9:7.1f} GB/s of weights, {flops / dt / 1e12:6.2f} TFLOPS")  # fmt: skip
    # bf16 weights out of cache, as a host store's are: 64 experts (~400 MB for the 80B's), each
    # read once in turn, as a layer's share would
    cold = [(torch.randn(2 * inter, h).bfloat16(), torch.randn(h, inter).bfloat16()) for _ in range(64)]
    nbytes = (cold[0][0].numel() + cold[0][1].numel()) * 2
    for tokens in (1, 20, 156):
        x = torch.randn(tokens, h).bfloat16()
        for w13, w2 in cold[:4]:
            expert(x, w13, w2)
        t0 = time.perf_counter()
        for w13, w2 in cold:
            expert(x, w13, w2)
        dt = (time.perf_counter() - t0) / len(cold)
        print(f"bf16, cold      T={tokens:4}: {dt * 1e6:9.1f} us an expert, "
              f"{nbytes / dt / 1e9:7.1f} GB/s of weights (64 experts in turn)")  # fmt: skip
    a = torch.empty(1 << 28, dtype=torch.uint8)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    t0 = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    print(f"host memory copy: {5 * 2 * a.numel() / (time.perf_counter() - t0) / 1e9:.1f} GB/s (read + write)")


if __name__ == "__main__":
    main()
