"""Does a weight prefetched into L2 while the GPU waits make the next GEMV faster? (a probe, not a test)

A batch-1 decode step moves its bytes in ~1.2 ms of HBM time but takes ~2.9 ms: between the big
GEMVs run chains of latency-bound kernels (router, MoE GEMV, norms) that leave HBM idle. If a
prefetch issued before such a chain brings the next projection's weight into L2, the GEMV after it
reads from L2. This times, in CUDA graphs, on a cold L2 (a 256 MB read first):

    flush; [prefetch F MB of W]; spin S µs; [traffic 24 MB]; GEMV over W

for the 80B's in_proj (12352 x 2048, 50.6 MB) and out_proj (2048 x 4096, 16.8 MB), minus the same
graph without the GEMV. The spin kernel (one program reading the global timer) stands for the
latency-bound chain; the traffic (a 24 MB read) for the experts that chain reads.

    python tests/gpu/l2_prefetch_timings.py
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ft.layers import triton_gemv

# cp.async.bulk.prefetch.L2 (sm_90): one instruction a chunk; ``.L2::cache_hint`` with an
# evict_last policy in HINT mode
_BULK = tl.constexpr(
    "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }"
)
_BULK_LAST = tl.constexpr(
    "{ .reg .pred p; .reg .b64 pol; setp.ne.b32 p, $2, 0;"
    " createpolicy.fractional.L2::evict_last.b64 pol, 1.0;"
    " @p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }"
)


@triton.jit
def _prefetch_kernel(base, nbytes, CHUNK: tl.constexpr, PER_PROG: tl.constexpr, HINT: tl.constexpr):
    off = (tl.program_id(0) * PER_PROG + tl.arange(0, PER_PROG)).to(tl.int64) * CHUNK
    size = tl.minimum(tl.maximum(nbytes - off, 0), CHUNK).to(tl.int32)
    if HINT:
        tl.inline_asm_elementwise(
            _BULK_LAST, "=r,l,r", [base + off, size], dtype=tl.int32, is_pure=False, pack=1
        )
    else:
        tl.inline_asm_elementwise(_BULK, "=r,l,r", [base + off, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _spin_kernel(ns):
    t0 = tl.extra.cuda.globaltimer()
    t = t0
    while t - t0 < ns:
        t = tl.extra.cuda.globaltimer()


def prefetch(w: torch.Tensor, nbytes: int, hint: bool, chunk: int = 1 << 16) -> None:
    nbytes = min(nbytes, w.numel() * w.element_size())
    if nbytes <= 0:
        return
    per_prog = 32
    grid = (triton.cdiv(triton.cdiv(nbytes, chunk), per_prog),)
    _prefetch_kernel[grid](
        w.view(torch.uint8), nbytes, CHUNK=chunk, PER_PROG=per_prog, HINT=hint, num_warps=1
    )


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


def main() -> None:
    dev = torch.device("cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    flushed = torch.empty((), dtype=torch.int64, device=dev)
    traffic = torch.randn(12 << 20, dtype=torch.bfloat16, device=dev)  # 24 MB
    traffic_out = torch.empty((), dtype=torch.float32, device=dev)
    x = torch.randn(1, 2048, dtype=torch.bfloat16, device=dev)
    x4 = torch.randn(1, 4096, dtype=torch.bfloat16, device=dev)
    shapes = {"in_proj": (torch.randn(12352, 2048, dtype=torch.bfloat16, device=dev) * 0.02, x),
              "out_proj": (torch.randn(2048, 4096, dtype=torch.bfloat16, device=dev) * 0.02, x4)}  # fmt: skip
    rows = []
    for spin in (10_000, 25_000):
        for with_traffic in (False, True):

            def body(w, xin, mb, hint, gemv, spin=spin, with_traffic=with_traffic):
                torch.sum(flush.view(torch.int64), dim=0, out=flushed)
                prefetch(w, int(mb * (1 << 20)), hint)
                _spin_kernel[(1,)](spin)
                if with_traffic:
                    torch.sum(traffic, dim=0, dtype=torch.float32, out=traffic_out)
                if gemv:
                    triton_gemv.gemv(xin, w)

            for name, (w, xin) in shapes.items():
                base = graph_us(functools.partial(body, w, xin, 0, False, False))
                for mb, hint in SIZES:
                    if mb > w.numel() * 2 / (1 << 20) + 1:
                        continue
                    t = graph_us(functools.partial(body, w, xin, mb, hint, True)) - base
                    rows.append((name, spin // 1000, with_traffic, mb, hint, t))
                    print(*rows[-1], f"{t:.2f} us", flush=True)
    print("\n| weight | spin µs | 24 MB traffic | prefetched MB | evict_last | GEMV µs |")
    print("|---|---|---|---|---|---|")
    for name, spin, traffic_on, mb, hint, t in rows:
        yes = {True: "yes", False: "no"}
        print(f"| {name} | {spin} | {yes[traffic_on]} | {mb} | {yes[hint]} | {t:.2f} |")


if __name__ == "__main__":
    main()
