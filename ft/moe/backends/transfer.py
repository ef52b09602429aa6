"""Moving experts: host store rows -> device rows over PCIe, on a side CUDA stream, counted.

Every copy is one row of the expert-major layout (one memcpy per expert) issued on the copy
stream, so it overlaps the compute on the main stream; the main stream waits (an event, not the
host) only where it reads what was copied. Bytes and the copy stream's busy time (CUDA events,
read back lazily once they have completed) give the effective PCIe bandwidth. On a CPU-only
machine the "device" is host memory too: copies are plain and immediate, timed by the clock.

Ordering rule for the expert cache: slot copies are issued right after the host has read the
batch's routing ids, i.e. after synchronising with the main stream, so no kernel that read the
slot's previous expert can still be running; the copy stream waits for the main stream anyway
(it is idle at that point, so this costs nothing). Staging buffers, refilled while the main
stream computes, use explicit events instead (``issue(..., after=...)``).
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Each run of rows copied by one cudaMemcpyAsync of torch's libcudart, called through ctypes with
# the pointers worked out here (``spans``), instead of a ``Tensor.copy_`` between two row slices.
# On an H200 (2026-12-03, tests/gpu/copy_issue_rate.py) issuing one 1.8 MB NVFP4 expert row took
# 10-16 us of host time by ``copy_`` and 3.4-5.4 us by the driver call, the same bytes at the same
# 50 GB/s; at batch 8 the NVFP4 80B under 48 GiB spent ~190 us a layer in ``copy_in`` while the
# link waited for the next layer's copies (docs/benchmarks.md). On from 2026-12-03 (FT_MOE_MEMCPY=0
# turns it off; read at each call): the same NVFP4 80B's batch-8 decode 136.2 -> 213.5 tok/s (56% ->
# 87% of its PCIe floor) and its 8k prefill 18,547 -> 23,460 tok/s; the full bf16 80B at 0.94
# decoded 62.3 -> 63.6 tok/s at batch 1 and prefilled 32k at 84% of the link, from 82%
# (docs/benchmarks.md). Without the library (not loaded, or a CPU) the copies go by ``copy_``.
MEMCPY = os.environ.get("FT_MOE_MEMCPY", "1") != "0"
MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction from the pointers (unified addressing)
_memcpy_async: Callable | None = None
_memcpy_looked = False


@dataclass
class TransferCounts:
    h2d_bytes: int = 0
    d2d_bytes: int = 0
    h2d_copies: int = 0
    copy_seconds: float = 0.0  # busy time of host-to-device copies (resolved events)


class Transfer:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.counts = TransferCounts()
        self._timing: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def issue(
        self,
        dst: torch.Tensor,
        dst_rows: list[int],
        src: torch.Tensor,
        src_rows: list[int],
        after: torch.cuda.Event | None = None,
        h2d: bool = True,
    ) -> torch.cuda.Event | None:
        """Copy ``src[src_rows[i]]`` into ``dst[dst_rows[i]]`` (rows of expert blocks; ``h2d``:
        from the host store, else device to device); returns an event the consumer waits on (None
        on CPU, where the copies are done on return). Runs of consecutive rows go as one copy."""
        return self.issue_many([(dst, dst_rows, src, src_rows)], after, h2d)

    def issue_many(
        self,
        jobs: list[tuple[torch.Tensor, list[int], torch.Tensor, list[int]]],
        after: torch.cuda.Event | None = None,
        h2d: bool = True,
    ) -> torch.cuda.Event | None:
        """``issue`` for several (dst, dst rows, src, src rows) at once: one wait, one pair of
        events (host reads' promotions of every layer between two steps)."""
        jobs = [j for j in jobs if j[1]]
        if not jobs:
            return None
        nbytes = sum(len(rows) * dst.shape[1] for dst, rows, _, _ in jobs)
        copies = sum(len(rows) for _, rows, _, _ in jobs)
        runs = [(dst, src, _runs(d_rows, s_rows)) for dst, d_rows, src, s_rows in jobs]
        if not self.cuda:
            t0 = time.perf_counter()
            for dst, src, rr in runs:
                for d, s, n in rr:
                    dst[d : d + n].copy_(src[s : s + n])
            self._count(h2d, nbytes, copies, time.perf_counter() - t0)
            return None
        main = torch.cuda.current_stream(self.device)
        if after is None:
            self.stream.wait_stream(main)
        else:
            self.stream.wait_event(after)
        with torch.cuda.stream(self.stream):
            start = torch.cuda.Event(enable_timing=True) if h2d else None
            if start is not None:
                start.record()
            memcpy = memcpy_async() if MEMCPY else None
            handle = self.stream.cuda_stream
            for dst, src, rr in runs:
                if memcpy is not None and rows_alike(dst, src):
                    for dst_ptr, src_ptr, size in spans(dst, src, rr):
                        err = memcpy(dst_ptr, src_ptr, size, MEMCPY_DEFAULT, handle)
                        if err:
                            raise RuntimeError(f"cudaMemcpyAsync of {size} bytes failed: error {err}")
                    continue
                for d, s, n in rr:
                    dst[d : d + n].copy_(src[s : s + n], non_blocking=True)
            done = torch.cuda.Event(enable_timing=h2d)
            done.record()
        if h2d:
            self._timing.append((start, done))
            if len(self._timing) > 512:  # nobody asked for stats lately: fold the finished ones
                self.resolve()
        self._count(h2d, nbytes, copies, 0.0)
        return done

    def wait(self, event: torch.cuda.Event | None = None) -> None:
        """The main stream waits for ``event``, or for every copy issued so far."""
        if not self.cuda:
            return
        main = torch.cuda.current_stream(self.device)
        if event is None:
            main.wait_stream(self.stream)
        else:
            main.wait_event(event)

    def record_copies(self) -> torch.cuda.Event | None:
        """An event at the copy stream's current position: every copy issued so far (``wait``
        on it leaves out those issued after)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def record_main(self) -> torch.cuda.Event | None:
        """An event at the main stream's current position (a staging buffer's last reader)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def _count(self, h2d: bool, nbytes: int, copies: int, seconds: float) -> None:
        if h2d:
            self.counts.h2d_bytes += nbytes
            self.counts.h2d_copies += copies
            self.counts.copy_seconds += seconds
        else:
            self.counts.d2d_bytes += nbytes

    def reset_counts(self) -> None:
        """Start the counts afresh (after the start-up fill of the caches, which is not streaming)."""
        self.counts = TransferCounts()
        self._timing = []

    def resolve(self) -> None:
        """Fold the timings of completed copies into ``counts`` (never waits)."""
        left = []
        for start, done in self._timing:
            if done.query():
                self.counts.copy_seconds += start.elapsed_time(done) / 1e3
            else:
                left.append((start, done))
        self._timing = left


def _runs(dst_rows: list[int], src_rows: list[int]) -> list[tuple[int, int, int]]:
    """(dst start, src start, length) of the runs where both row lists step by one."""
    runs: list[list[int]] = []
    for d, s in zip(dst_rows, src_rows):
        if runs and runs[-1][0] + runs[-1][2] == d and runs[-1][1] + runs[-1][2] == s:
            runs[-1][2] += 1
        else:
            runs.append([d, s, 1])
    return [tuple(r) for r in runs]


def rows_alike(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether two blocks copy row for row as bytes: contiguous, 2-D, rows of the same size."""
    return (
        dst.dim() == src.dim() == 2
        and dst.is_contiguous()
        and src.is_contiguous()
        and dst.shape[1] * dst.element_size() == src.shape[1] * src.element_size()
    )


def spans(
    dst: torch.Tensor, src: torch.Tensor, runs: list[tuple[int, int, int]]
) -> list[tuple[int, int, int]]:
    """(dst address, src address, bytes) of each run (dst start, src start, rows) between two
    blocks ``rows_alike``: the bytes ``dst[d : d + n].copy_(src[s : s + n])`` moves."""
    width = dst.shape[1] * dst.element_size()
    base_d, base_s = dst.data_ptr(), src.data_ptr()
    return [(base_d + d * width, base_s + s * width, n * width) for d, s, n in runs]


def memcpy_async() -> Callable | None:
    """cudaMemcpyAsync(dst, src, bytes, kind, stream) of the libcudart this process loaded (torch's),
    found once in its memory map; None where there is none."""
    global _memcpy_async, _memcpy_looked
    if not _memcpy_looked:
        _memcpy_looked = True
        _memcpy_async = _load_memcpy_async()
    return _memcpy_async


def _load_memcpy_async() -> Callable | None:
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({p[5] for p in map(str.split, f) if len(p) > 5 and "libcudart.so" in p[5]})
    except OSError:
        return None
    for path in paths:
        try:
            fn = ctypes.CDLL(path).cudaMemcpyAsync
        except (OSError, AttributeError):
            continue
        ptr = ctypes.c_void_p
        fn.argtypes = [ptr, ptr, ctypes.c_size_t, ctypes.c_int, ptr]
        fn.restype = ctypes.c_int
        return fn
    return None
