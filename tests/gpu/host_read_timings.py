"""How fast the MoE GEMV reads experts from the pinned host store in place (not a test):

    python tests/gpu/host_read_timings.py [bf16|nvfp4]

Qwen3-Next's layer shape (512 experts, H=2048, I=512, top-10), one token: the GEMV with h of its
10 experts on the host (h = 0..10) against the same call with every expert on the device, and a
DMA copy of those h experts (what the copying decode path moves instead). Each line gives the
call's time (50 calls in a CUDA graph, median of 20 replays), the bytes it read from the
host, and their rate over the time the host rows added. A batch-1 decode step of the 80B model
at 77% residency reads ~2.2 experts of each layer from the host (docs/benchmarks.md,
2026-12-01): if this rate is near the 51 GB/s that tests/gpu/zero_copy_bandwidth.py reads,
the step's remaining gap to its PCIe floor lies elsewhere. ``FT_MOE_GEMV_NVFP4_HOST_STAGES=G,D``
sets the NVFP4 host-read launches' loop stages (``triton_moe_gemv.NVFP4_HOST_STAGES``). The
"staged" line times ``host_stage``'s copy of the same rows into device memory, alone and followed
by the call on device rows (what ``FT_MOE_HOST_STAGE=1`` runs instead of reading in place).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from ft.moe.backends.host_stage import StageBlock, stage  # noqa: E402
from ft.moe.backends.layout import ExpertLayout, Part  # noqa: E402
from ft.moe.kernels.triton_moe_gemv import fused_moe_gemv  # noqa: E402
from tests.gpu.kernel_timings import bench_series  # noqa: E402
from tests.gpu.test_moe_gemv import problem  # noqa: E402


def replay_ms(fn) -> float:
    """Median milliseconds of one call, 50 in one CUDA graph (``kernel_timings.bench_series``)."""
    return bench_series([fn] * 50)


def pinned(w):
    from ft.quant.nvfp4 import NVFP4Tensor

    if isinstance(w, NVFP4Tensor):
        return NVFP4Tensor(*(p.cpu().pin_memory() for p in w.parts))
    return w.cpu().pin_memory()


def expert_bytes(w13, w2) -> int:
    """Bytes of one expert of ``w13`` and ``w2`` (either None: only the other)."""
    from ft.quant.nvfp4 import NVFP4Tensor

    parts = [w for w in (w13, w2) if w is not None]
    if isinstance(parts[0], NVFP4Tensor):
        parts = [p for w in parts for p in w.parts]
    return sum(p[0].numel() * p.element_size() for p in parts)


def kernel_us(fn, reps: int = 10) -> dict[str, float]:
    """Device microseconds a call of each kernel ``fn`` launches, over ``reps`` eager calls, each
    alone (synchronised: a kernel launched early by programmatic dependent launch would count
    its wait for the one before)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
            torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        total = getattr(e, "device_time_total", 0.0) or getattr(e, "cuda_time_total", 0.0)
        if total > 0:
            out[e.key] = total / reps
    return out


def main() -> None:
    fmt = sys.argv[1] if len(sys.argv) > 1 else "bf16"
    x, w13, w2, weights, ids = problem(fmt, 1, 512, 512, 2048, 10, seed=1)
    h13, h2 = pinned(w13), pinned(w2)
    per_expert = expert_bytes(w13, w2)
    resident = replay_ms(lambda: fused_moe_gemv(x, w13, w2, weights, ids))
    staging = torch.empty(10 * per_expert, dtype=torch.uint8, device="cuda")
    source = torch.empty(10 * per_expert, dtype=torch.uint8).pin_memory()
    print(f"{fmt}: all 10 experts on the device {1e3 * resident:.1f} us; {per_expert / 1e6:.2f} MB an expert")
    # host staging (``host_stage``): the h experts' rows copied by its kernel from a pinned block of
    # 512 rows into the staging block, then the call on device rows (timed on the resident bank)
    layout = ExpertLayout((Part("raw", (per_expert,), torch.uint8, 0),), -(-per_expert // 64) * 64)
    store = layout.allocate(512, "cpu", pin=True)
    stage_block = StageBlock(layout, 10, torch.device("cuda"))
    for h in (1, 2, 3, 5, 10):
        rows = ids.clone()
        rows[0, :h] = -ids[0, :h] - 1  # the first h experts of the token read from the host
        ms = replay_ms(lambda r=rows: fused_moe_gemv(x, w13, w2, weights, r, host=(h13, h2)))
        copy = replay_ms(
            lambda n=h: staging[: n * per_expert].copy_(source[: n * per_expert], non_blocking=True)
        )
        moved = h * per_expert
        rate = moved / ((ms - resident) * 1e-3) / 1e9 if ms > resident else float("inf")
        print(
            f"  {h:2d} on the host: {1e3 * ms:7.1f} us, {moved / 1e6:5.1f} MB read in place "
            f"({rate:5.1f} GB/s over the added time, {moved / (ms * 1e-3) / 1e9:5.1f} over the call); "
            f"a DMA copy of them {1e3 * copy:7.1f} us ({moved / (copy * 1e-3) / 1e9:5.1f} GB/s)"
        )
        staged = replay_ms(lambda r=rows: stage(r, store, stage_block))
        both = replay_ms(
            lambda r=rows: (stage(r, store, stage_block), fused_moe_gemv(x, w13, w2, weights, ids))
        )
        print(
            f"     staged   {1e3 * staged:7.1f} us for the copy ({moved / (staged * 1e-3) / 1e9:5.1f} GB/s), "
            f"{1e3 * both:7.1f} us with the call on device rows"
        )
        # each kernel alone: which of gate/up (the w13 rows) and down (the w2 rows) reads its host
        # bytes slower than the link (the offloaded decode's profile of 2026-12-02 had gate/up 238
        # us a layer against 180 us of link time for its host bytes, down 104 against 90)
        kernels = kernel_us(lambda r=rows: fused_moe_gemv(x, w13, w2, weights, r, host=(h13, h2)))
        for name, part in (("_gate_up", w13), ("_down", w2)):
            us = sum(t for k, t in kernels.items() if name in k)
            host_bytes = h * expert_bytes(part, None)
            rate = host_bytes / (us * 1e-6) / 1e9 if us else float("nan")
            mb = host_bytes / 1e6
            print(f"     {name[1:]:8s} {us:7.1f} us alone: its {mb:.2f} MB of host rows at {rate:5.1f} GB/s")


if __name__ == "__main__":
    main()
