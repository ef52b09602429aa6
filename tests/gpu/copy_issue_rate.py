"""What issuing an expert copy costs the host, and what each way of copying gets from the link
(not a test):

    python tests/gpu/copy_issue_rate.py [OUT.log]

The offload backend's copying path (decode batches the MoE GEMV does not take, prefill) copies
each missed or prefetched expert row from the pinned host store with its own ``Tensor.copy_``
(``transfer.Transfer.issue_many``). On an H200 (2026-12-03, the 80B with NVFP4 experts under 48
GiB, batch 8) that call took ~175 us of host time for ~9 rows, and the link idled between the
layers' copies while the host issued them. Rows of one expert's bytes (NVFP4 and bf16 sizes of
Qwen3-Next-80B), ``N`` of them a call, from a registered host block (as ``layout.pin_in_place``
registers the store) into a device block, three ways:

- ``copy_``: ``dst[d].copy_(src[s], non_blocking=True)`` per row on a side stream (today's way);
- ``memcpy``: ``cudaMemcpyAsync`` per row through ctypes, from the libcudart torch loaded;
- ``kernel P``: one launch of ``host_prefetch``'s copy kernel, ``P`` programs reading the host
  rows through unified addressing (its source rows an int64 device tensor, uploaded first).

For each: host time per call and per row (the issue alone, no synchronisation), then the device
time of the call's copies (events around it on the copy stream) and the GB/s that gives."""

from __future__ import annotations

import ctypes
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from ft.moe.backends import host_prefetch  # noqa: E402
from ft.moe.backends.layout import pin_in_place  # noqa: E402
from tests.gpu.profiling import logger  # noqa: E402

ROW_BYTES = {"nvfp4": 1_769_472, "bf16": 6_291_456}  # an 80B expert: 3 x 512 x 2048 weights
HOST_ROWS, DEVICE_ROWS, REPS = 48, 32, 20


def cudart() -> ctypes.CDLL:
    """The libcudart this process has loaded (torch's), found in its memory map."""
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcudart" in line}
    if not paths:
        raise RuntimeError("no libcudart in this process's memory map")
    lib = ctypes.CDLL(sorted(paths)[0])
    ptr = ctypes.c_void_p
    lib.cudaMemcpyAsync.argtypes = [ptr, ptr, ctypes.c_size_t, ctypes.c_int, ptr]
    lib.cudaMemcpyAsync.restype = ctypes.c_int
    return lib


def measure(log, name: str, issue, rows: int, row_bytes: int, stream: torch.cuda.Stream) -> None:
    issue()  # warm (compiles the kernel)
    torch.cuda.synchronize()
    host = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        issue()
        host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for _ in range(REPS):
        issue()
    end.record(stream)
    torch.cuda.synchronize()
    dev = start.elapsed_time(end) / 1e3 / REPS
    h = sorted(host)[len(host) // 2]
    log(f"  {name:12s} host {h * 1e6:8.1f} us a call ({h / rows * 1e6:6.1f} a row), "
        f"device {dev * 1e6:8.1f} us a call, {rows * row_bytes / dev / 1e9:5.1f} GB/s")  # fmt: skip


def case(log, lib: ctypes.CDLL, stream, src: torch.Tensor, dst: torch.Tensor, rows: int) -> None:
    """One row count: ``rows`` host rows into device rows, each of the ways."""
    row_bytes = src.shape[1]
    src_rows = [(7 * i + 3) % len(src) for i in range(rows)]
    dst_rows = [(5 * i + 1) % (len(dst) - 1) for i in range(rows)]
    pairs = [(dst[d].data_ptr(), src[s].data_ptr()) for d, s in zip(dst_rows, src_rows)]

    def by_copy():
        with torch.cuda.stream(stream):
            for d, s in zip(dst_rows, src_rows):
                dst[d].copy_(src[s], non_blocking=True)

    def by_memcpy():
        h = stream.cuda_stream
        for d, s in zip(dst_rows, src_rows):
            err = lib.cudaMemcpyAsync(dst[d].data_ptr(), src[s].data_ptr(), row_bytes, 1, h)
            if err:
                raise RuntimeError(f"cudaMemcpyAsync: error {err}")

    def by_memcpy_ptrs():  # the pointers worked out once: the driver call alone
        h = stream.cuda_stream
        for d, s in pairs:
            lib.cudaMemcpyAsync(d, s, row_bytes, 1, h)

    measure(log, "copy_", by_copy, rows, row_bytes, stream)
    measure(log, "memcpy", by_memcpy, rows, row_bytes, stream)
    measure(log, "memcpy ptrs", by_memcpy_ptrs, rows, row_bytes, stream)
    # the kernel copies into consecutive rows from row 0: the same bytes moved
    idx = torch.tensor(src_rows, dtype=torch.int64)
    idx_dev = torch.empty(rows, dtype=torch.int64, device=dst.device)
    for programs in (16, 32, 66, 132, 264):

        def by_kernel(programs=programs):
            host_prefetch.COPY_PROGRAMS = programs
            with torch.cuda.stream(stream):
                idx_dev.copy_(idx, non_blocking=True)
                host_prefetch.copy_rows(src, dst, 0, idx_dev)

        measure(log, f"kernel {programs}", by_kernel, rows, row_bytes, stream)


def main() -> None:
    log = logger(sys.argv[1] if len(sys.argv) > 1 else None)
    dev = torch.device("cuda")
    stream = torch.cuda.Stream(dev)
    lib = cudart()
    for fmt, row_bytes in ROW_BYTES.items():
        src = torch.empty(HOST_ROWS, row_bytes, dtype=torch.uint8)
        src.view(-1)[::4096].fill_(1)  # touch every page before registering
        pin_in_place(src)
        dst = torch.empty(DEVICE_ROWS + 1, row_bytes, dtype=torch.uint8, device=dev)
        for rows in (4, 10, 20):
            log(f"== {fmt}: {rows} rows of {row_bytes / 1e6:.2f} MB a call")
            case(log, lib, stream, src, dst, rows)
    log("(the kernel's row upload is from pageable memory here: a pinned one would cost less host time)")


if __name__ == "__main__":
    main()
