"""How fast a GPU kernel reads pinned host memory directly (zero-copy, through unified addressing)
against a host-to-device DMA copy of the same bytes (not a test):

    python tests/gpu/zero_copy_bandwidth.py [GiB]

The offload backend copies each missed expert into a GPU slot before its kernel reads it, and
decides which at a host sync in every MoE layer; a kernel reading the missed experts' rows from
the host store itself would keep a decode step in one CUDA graph. That design is only worth
building if such reads come near the copy engine's bandwidth, which this measures: a Triton
kernel summing a pinned buffer (each program a contiguous slice, loads of 16 B per thread), and
the same kernel reading whole 6 MB expert blocks chosen at random (the decode access pattern),
beside ``copy_(non_blocking=True)`` of the same bytes. Prints one line each, GB/s.
"""

from __future__ import annotations

import sys
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _read_kernel(src, out, blocks, block_elems, BLOCK: tl.constexpr, PER_PROGRAM: tl.constexpr):
    # program p sums PER_PROGRAM chunks of BLOCK int32s of block blocks[p // programs_per_block]
    pid = tl.program_id(0)
    per_block = tl.cdiv(block_elems, BLOCK * PER_PROGRAM)
    block = tl.load(blocks + pid // per_block).to(tl.int64)
    start = block * block_elems + (pid % per_block) * BLOCK * PER_PROGRAM
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    end = block * block_elems + block_elems
    for i in range(PER_PROGRAM):
        idx = start + i * BLOCK + offs
        acc += tl.load(src + idx, mask=idx < end, other=0)
    tl.store(out + pid, tl.sum(acc, 0))


def read(src: torch.Tensor, blocks: torch.Tensor, block_elems: int) -> torch.Tensor:
    block, per = 4096, 16
    programs = len(blocks) * triton.cdiv(block_elems, block * per)
    out = torch.empty(programs, dtype=torch.int32, device="cuda")
    _read_kernel[(programs,)](src, out, blocks, block_elems, BLOCK=block, PER_PROGRAM=per, num_warps=8)
    return out


def timed(fn, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    nbytes = int(gib * (1 << 30)) // (6 << 20) * (6 << 20)  # whole 6 MB "experts"
    host = torch.ones(nbytes // 4, dtype=torch.int32, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    block_elems, nblocks = (6 << 20) // 4, nbytes // (6 << 20)
    every = torch.arange(nblocks, dtype=torch.int32, device="cuda")
    some = torch.randperm(nblocks, device="cuda")[: max(1, nblocks // 4)].to(torch.int32)
    dma = timed(lambda: dev.copy_(host, non_blocking=True))
    print(f"host->device copy (DMA), {nbytes / 1e9:.2f} GB: {nbytes / dma / 1e9:.1f} GB/s", flush=True)
    for label, blocks in (("all blocks in order", every), (f"{len(some)} random 6 MB blocks", some)):
        moved = len(blocks) * block_elems * 4
        try:
            want = len(blocks) * block_elems
            got = int(read(host, blocks, block_elems).sum())
            ok = "sum ok" if got == want else f"SUM WRONG ({got} != {want})"
            seconds = timed(lambda b=blocks: read(host, b, block_elems))
            print(
                f"kernel reading pinned host memory, {label}: {moved / seconds / 1e9:.1f} GB/s ({ok})",
                flush=True,
            )
        except Exception as e:  # Triton may refuse a host pointer: that is the answer too
            print(f"kernel reading pinned host memory, {label}: FAILED {type(e).__name__}: {str(e)[:300]}")
    seconds = timed(lambda: read(dev, every, block_elems))
    print(f"same kernel on device memory: {nbytes / seconds / 1e9:.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
