"""How fast the GPU's own copy kernels move expert rows from the pinned host store (not a test):

    python tests/gpu/host_copy_timings.py [expert MB, default 1.77: an NVFP4 expert of the 80B]

Host reads' prefetch (``host_prefetch.copy_rows``) copies a layer's picked rows with
``COPY_PROGRAMS`` programs, few so that the mixer it runs beside keeps the SMs; host staging
(``host_stage.stage``) copies a layer's host rows with a program per 16 KB. Each line times a
copy of n rows (random rows of a 512-row pinned block, 20 copies back to back in a CUDA graph,
each its own rows), by each kernel and its programs, against a DMA copy of the same bytes: what
a row costs each way when nothing else runs.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from ft.moe.backends import host_prefetch  # noqa: E402
from ft.moe.backends.host_stage import StageBlock, stage  # noqa: E402
from ft.moe.backends.layout import ExpertLayout, Part  # noqa: E402
from tests.gpu.kernel_timings import bench_series  # noqa: E402


def main() -> None:
    mb = float(sys.argv[1]) if len(sys.argv) > 1 else 1.77
    row = int(mb * 1e6) // 64 * 64
    layout = ExpertLayout((Part("raw", (row,), torch.uint8, 0),), row)
    store = layout.allocate(512, "cpu", pin=True)
    dst = layout.allocate(16, "cuda")
    staging = StageBlock(layout, 16, torch.device("cuda"))
    gen = torch.Generator().manual_seed(0)
    print(f"rows of {row / 1e6:.2f} MB from pinned memory, {torch.cuda.get_device_name()}")
    for n in (1, 2, 4, 10):
        picks = [torch.randperm(512, generator=gen)[:n].cuda() for _ in range(20)]
        moved = n * row
        line = [f"{n:2d} rows:"]
        for programs in (8, 16, 32, 64, 132):
            host_prefetch.COPY_PROGRAMS = programs
            ms = bench_series([lambda p=p: host_prefetch.copy_rows(store, dst, 0, p) for p in picks])
            line.append(f"copy_rows {programs:3d} programs {1e3 * ms:6.1f} us ({moved / ms / 1e6:4.1f} GB/s)")
        rows = [-(p[None, :] + 1) for p in picks]  # [1, n]: every pair on the host
        ms = bench_series([lambda r=r: stage(r, store, staging) for r in rows])
        line.append(f"stage {1e3 * ms:6.1f} us ({moved / ms / 1e6:4.1f} GB/s)")
        src = torch.empty(n, row, dtype=torch.uint8).pin_memory()
        ms = bench_series([lambda n=n, src=src: dst[:n].copy_(src, non_blocking=True)] * 20)
        line.append(f"DMA {1e3 * ms:6.1f} us ({moved / ms / 1e6:4.1f} GB/s)")
        print("\n    ".join(line), flush=True)


if __name__ == "__main__":
    main()
