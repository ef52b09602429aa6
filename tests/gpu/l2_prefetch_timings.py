"""Does a weight prefetched into L2 while the GPU waits make the next GEMV faster? (a probe, not a test)

A batch-1 decode step moves its bytes in ~1.2 ms of HBM time but takes ~2.9 ms: between the big
GEMVs run chains of latency-bound kernels (router, MoE GEMV, norms) that leave HBM idle. If a
prefetch issued before such a chain brings the next projection's weight into L2, the GEMV after it
reads from L2. This times, in CUDA graphs, on a cold L2 (a 256 MB read first):

    flush; [prefetch F MB of W]; spin S µs; [traffic 24 MB]; GEMV over W

for the 80B's in_proj (12352 x 2048, 50.6 MB) and out_proj (2048 x 4096, 16.8 MB), minus the same
graph without the GEMV, at each prefetched size with and without an evict-last hint (the
prefetch kernels are in both graphs). The spin kernel (one program reading the global timer)
stands for the latency-bound chain; the traffic (a 24 MB read) for the experts that chain reads.
Then the same for the MoE GEMV at one token (NVFP4, 512 experts of 2 x 512 x 2048, top-10, a bf16
shared pair), its ten experts' codes and scales prefetched or not: whether L2 hits shorten the
latency-bound kernels too (what a router that prefetched its picks would gain). The prefetch is
``ft.layers.l2_prefetch.prefetch_l2``, the norms' (``l2_prefetch.MB``). Last, the MoE GEMV right
after 0, 16 or 32 MB of another weight were asked for: what prefetches still in flight cost a
latency-bound kernel.

    python tests/gpu/l2_prefetch_timings.py
"""

from __future__ import annotations

import functools
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from ft.layers import l2_prefetch, triton_gemv
from ft.layers.l2_prefetch import CHUNK, prefetch_l2
from ft.moe.kernels import triton_moe_gemv


@triton.jit
def _prefetch_kernel(base, nbytes, PER_PROG: tl.constexpr, HINT: tl.constexpr):
    # program p: chunks [p * PER_PROG, (p + 1) * PER_PROG) of base
    off = tl.program_id(0).to(tl.int64) * PER_PROG * CHUNK
    prefetch_l2(base + off, nbytes - off, PER_PROG, HINT)


@triton.jit
def _spin_kernel(ns):
    t0 = tl.extra.cuda.globaltimer()
    t = t0
    while t - t0 < ns:
        t = tl.extra.cuda.globaltimer()


def prefetch(w: torch.Tensor, nbytes: int, hint: bool) -> None:
    nbytes = min(nbytes, w.numel() * w.element_size())
    if nbytes > 0:
        per_prog = 32
        grid = (triton.cdiv(triton.cdiv(nbytes, l2_prefetch.CHUNK_BYTES), per_prog),)
        _prefetch_kernel[grid](w.view(torch.uint8), nbytes, PER_PROG=per_prog, HINT=hint, num_warps=1)


def graph_us(fn, reps: int = 20, iters: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (iters * reps)


SIZES = [(0, False), (8, False), (16, False), (24, False), (32, False), (48, False), (16, True), (32, True),
         (48, True)]  # (MB prefetched, evict_last)  # fmt: skip
YES = {True: "yes", False: "no"}


def timed(body, *args) -> float:
    """µs the last stage of ``body`` adds: the graph with it less the graph without."""
    return graph_us(functools.partial(body, *args, True)) - graph_us(functools.partial(body, *args, False))


def projections(cold, spins) -> list[tuple]:
    dev = torch.device("cuda")
    x, x4 = (torch.randn(1, k, dtype=torch.bfloat16, device=dev) for k in (2048, 4096))
    shapes = {"in_proj": (torch.randn(12352, 2048, dtype=torch.bfloat16, device=dev) * 0.02, x),
              "out_proj": (torch.randn(2048, 4096, dtype=torch.bfloat16, device=dev) * 0.02, x4)}  # fmt: skip
    rows = []
    for spin, with_traffic in spins:
        for name, (w, xin) in shapes.items():

            def body(mb, hint, last, w=w, xin=xin, spin=spin, with_traffic=with_traffic):
                cold(with_traffic, lambda: prefetch(w, int(mb * (1 << 20)), hint), spin)
                if last:
                    triton_gemv.gemv(xin, w)

            for mb, hint in SIZES:
                if mb <= w.numel() * 2 / (1 << 20) + 1:
                    rows.append((name, spin // 1000, with_traffic, mb, hint, timed(body, mb, hint)))
                    print(*rows[-1], flush=True)
    return rows


def experts(cold, spins) -> list[tuple]:
    """The MoE GEMV (gate/up + down, NVFP4, 512 experts of 2 x 512 x 2048, top-10, a bf16 shared
    pair) at one token, its ten experts' codes and scales prefetched or not."""
    from tests.gpu.config_sweep import moe_problem, shared_pair

    problem = moe_problem(1)
    banks, x, routes = problem
    w13, w2 = banks["nvfp4"]
    pair = shared_pair(problem)
    weights, ids = routes[0]
    picked = ids[0].tolist()  # before any capture: a read to the host is not allowed inside one
    rows = []
    for spin, with_traffic in spins:
        # "by gate/up": no prefetch before, the gate/up launch's own (triton_moe_gemv.PREFETCH_DOWN)
        for parts in ((), ("gate/up",), ("gate/up", "down"), ("down by gate/up",)):
            for hint in (False, True):
                if hint and parts in ((), ("down by gate/up",)):
                    continue

                def warm(parts=parts, hint=hint):
                    for e in picked:
                        for name, bank in (("gate/up", w13), ("down", w2)):
                            if name in parts:
                                for t in (bank.weight[e], bank.weight_scale[e]):
                                    prefetch(t, t.numel() * t.element_size(), hint)

                def body(last, warm=warm, spin=spin, with_traffic=with_traffic):
                    cold(with_traffic, warm, spin)
                    if last:
                        triton_moe_gemv.fused_moe_gemv(x, w13, w2, weights, ids, pair)

                triton_moe_gemv.PREFETCH_DOWN = parts == ("down by gate/up",)
                rows.append(("+".join(parts) or "none", spin // 1000, with_traffic, hint, timed(body)))
                triton_moe_gemv.PREFETCH_DOWN = False
                print(*rows[-1], flush=True)
    # the cost the 2026-12-01 experiment hit: the MoE GEMV right after a prefetch of another weight,
    # no spin (the prefetched lines still streaming in while its own loads wait)
    other = torch.empty(64 << 20, dtype=torch.uint8, device=x.device)
    for mb in (0, 16, 32):

        def body(last, mb=mb):
            cold(False, lambda: prefetch(other, mb << 20, False), 0)
            if last:
                triton_moe_gemv.fused_moe_gemv(x, w13, w2, weights, ids, pair)

        rows.append((f"none, {mb} MB of another weight in flight", 0, False, False, timed(body)))
        print(*rows[-1], flush=True)
    return rows


def main() -> None:
    dev = torch.device("cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    flushed = torch.empty((), dtype=torch.int64, device=dev)
    traffic = torch.randn(12 << 20, dtype=torch.bfloat16, device=dev)  # 24 MB
    traffic_out = torch.empty((), dtype=torch.float32, device=dev)

    def cold(with_traffic: bool, warm, spin_ns: int) -> None:
        # an L2 of other data, the prefetches, the latency-bound stretch (with its own traffic)
        torch.sum(flush.view(torch.int64), dim=0, out=flushed)
        warm()
        _spin_kernel[(1,)](spin_ns)
        if with_traffic:
            torch.sum(traffic, dim=0, dtype=torch.float32, out=traffic_out)

    spins = [(10_000, False), (10_000, True), (25_000, False), (25_000, True)]
    moe = experts(cold, spins)
    proj = projections(cold, spins)
    print("\n| weight | spin µs | 24 MB traffic | prefetched MB | evict_last | GEMV µs |")
    print("|---|---|---|---|---|---|")
    for name, spin, traffic_on, mb, hint, t in proj:
        print(f"| {name} | {spin} | {YES[traffic_on]} | {mb} | {YES[hint]} | {t:.2f} |")
    print("\n| experts prefetched | spin µs | 24 MB traffic | evict_last | MoE GEMV µs |")
    print("|---|---|---|---|---|")
    for parts, spin, traffic_on, hint, t in moe:
        print(f"| {parts} | {spin} | {YES[traffic_on]} | {YES[hint]} | {t:.2f} |")


if __name__ == "__main__":
    main()
