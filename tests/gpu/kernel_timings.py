"""Timing table for the GPU kernels (not a test): ``python tests/gpu/kernel_timings.py [OUT.txt]``.

MoE: E=512, I=512, H=2048, top-10, bf16 at T = 1, 64 (decode, eager and CUDA graph) and 4096
(prefill), the graph column per call of eight back to back with different routings; attention
decode at batch 1 and 64 with 1k context for the Qwen3-Next (16/2 heads x 256) and Qwen3-30B-A3B
(32/4 x 128) shapes. Times are medians of CUDA-event timings; the floors use the H200 figures of
DESIGN.md (4.22 TB/s, 783 TFLOP/s).
"""

from __future__ import annotations

import statistics
import sys

import torch

HBM, FLOPS = 4.22e12, 783e12
SERIES_BYTES = 200 << 20  # weights per timed series: four times the H200's 50 MB L2


def bench(fn, iters: int = 50, graph: bool = False) -> float:
    """Median milliseconds per call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    run = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def bench_series(calls, iters: int = 20) -> float:
    """Median milliseconds per call of ``calls`` run back to back in one CUDA graph, as the kernels
    of a decode step run. Timing one call per replay instead adds the replay's own ~8-10 us, which
    swamps kernels of a few microseconds; give the calls distinct weights (more bytes than the
    50 MB L2) so that each reads HBM, as a step's layers do."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in calls:
            fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / len(calls))
    return statistics.median(times)


def series_copies(nbytes: int) -> int:
    """Distinct weights of ``nbytes`` each for one ``bench_series``: over SERIES_BYTES in all."""
    return min(64, max(4, -(-SERIES_BYTES // nbytes)))


def routings(t: int, e: int, k: int, n: int = 8, device="cuda") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` random (weights, ids) [T, k] routings: consecutive calls hit different experts."""
    return [torch.softmax(torch.randn(t, e, device=device), -1).topk(k, -1) for _ in range(n)]


def moe_rows():
    from ft.moe.kernels.torch_ref import fused_moe_ref
    from ft.moe.kernels.triton_moe import fused_moe_triton

    e, inter, h, k = 512, 512, 2048, 10
    w13 = (torch.randn(e, 2 * inter, h, device="cuda") * h**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, inter, device="cuda") * inter**-0.5).to(torch.bfloat16)
    rows = []
    for t in (1, 64, 4096):
        x = torch.randn(t, h, device="cuda").to(torch.bfloat16)
        routes = routings(t, e, k)
        weights, ids = routes[0]
        distinct = sum(i.unique().numel() for _, i in routes) / len(routes)
        floor_bw = distinct * 3 * inter * h * 2 / HBM * 1e3
        floor_fl = t * k * 3 * 2 * inter * h / FLOPS * 1e3
        floor = max(floor_bw, floor_fl)
        eager = bench(lambda x=x, w=weights, i=ids: fused_moe_triton(x, w13, w2, w, i))
        graph = bench_series([lambda x=x, w=w, i=i: fused_moe_triton(x, w13, w2, w, i) for w, i in routes])
        ref = bench(lambda x=x, w=weights, i=ids: fused_moe_ref(x, w13, w2, w, i), iters=3)
        rows.append(
            f"moe E={e} I={inter} H={h} top{k}  T={t:<5d} experts hit {distinct:5.1f} | "
            f"triton eager {eager * 1e3:8.1f} us  graph {graph * 1e3:8.1f} us | torch ref {ref * 1e3:9.1f} us"
            f" | floor {floor * 1e3:7.1f} us ({'HBM' if floor_bw >= floor_fl else 'FLOP'}) -> "
            f"{floor / graph:5.1%} of roofline"
        )
    return rows


def attention_rows():
    from ft.attention.triton_paged import paged_decode

    rows = []
    for name, hq, hkv, d in (("qwen3-next", 16, 2, 256), ("qwen3-30b", 32, 4, 128)):
        for bsz in (1, 64):
            ctx, page = 1024, 16
            nblk = ctx // page
            cache = torch.randn(2, bsz * nblk, page, hkv, d, device="cuda").to(torch.bfloat16)
            tables = torch.randperm(bsz * nblk, device="cuda").view(bsz, nblk).to(torch.int32)
            seq_lens = torch.full((bsz,), ctx, dtype=torch.int32, device="cuda")
            q = torch.randn(bsz, hq, d, device="cuda").to(torch.bfloat16)
            ms = bench(lambda a=(q, cache, tables, seq_lens, d**-0.5): paged_decode(*a), graph=True)
            kv_bytes = 2 * bsz * ctx * hkv * d * 2
            rows.append(
                f"attn decode {name:10s} Hq={hq} Hkv={hkv} d={d} B={bsz:<3d} ctx={ctx} | "
                f"graph {ms * 1e3:7.1f} us | KV {kv_bytes / 2**20:6.1f} MiB -> "
                f"{kv_bytes / ms / 1e6:7.1f} GB/s ({kv_bytes / (ms * 1e-3) / HBM:5.1%} of HBM)"
            )
    return rows


def main() -> None:
    torch.manual_seed(0)
    lines = [f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}"]
    lines += moe_rows()
    lines += attention_rows()
    text = "\n".join(lines) + "\n"
    print(text)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
