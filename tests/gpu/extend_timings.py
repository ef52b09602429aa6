"""The prefill (extend) attention kernels timed side by side (not a test):

    python tests/gpu/extend_timings.py [CHUNK ...]      # default: 1024 8000 16384+16384

A CHUNK is T queries, or T+C for T queries after C cached tokens (16384+16384: a 32k prompt's
second chunk), one sequence, Qwen3-Next's heads (FT_SWEEP_ATTN=Hq,Hkv,d; 16,2,256), pages of 16.
For each: the Triton kernel at its shipped tiles, the Gluon one (``gluon_extend``) and its
warp-specialised form (``gluon_extend_ws.WS``), each in a CUDA graph (``kernel_timings.bench_series``),
with the TFLOP/s of the causal work (4 · d · Hq · the visible query-key pairs) and the Gluon
outputs' relative error against the Triton one's.
"""

from __future__ import annotations

import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from ft.attention import gluon_extend, gluon_extend_ws, triton_paged  # noqa: E402
from tests.gpu.kernel_timings import bench_series  # noqa: E402


def main() -> None:
    hq, hkv, d = (int(v) for v in os.environ.get("FT_SWEEP_ATTN", "16,2,256").split(","))
    page = 16
    for shape in sys.argv[1:] or ["1024", "8000", "16384+16384"]:
        t, c = (int(v) for v in (shape + "+0").split("+")[:2])
        q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
        blocks = triton.cdiv(c + t, page)
        cache = torch.randn(2, blocks, page, hkv, d, device="cuda", dtype=torch.bfloat16)
        table = torch.randperm(blocks, device="cuda", dtype=torch.int32)[None]  # pages out of order
        cu = torch.tensor([0, t], device="cuda", dtype=torch.int32)
        ctx = torch.full((1,), c, device="cuda", dtype=torch.int32)
        flops = 4 * d * hq * (t * c + t * (t + 1) / 2)

        def call(q=q, cache=cache, table=table, cu=cu, ctx=ctx, t=t) -> torch.Tensor:
            return triton_paged.paged_extend(q, cache, table, cu, ctx, t, d**-0.5)

        assert gluon_extend.supports(q, cache, table)
        got = {}
        line = f"{t} queries after {c}, {hq}/{hkv} heads of {d}:"
        for name, gluon, ws in (("Triton", False, False), ("Gluon", True, False), ("Gluon WS", True, True)):
            triton_paged.GLUON_EXTEND, gluon_extend_ws.WS = gluon, ws
            got[name] = call()
            ms = bench_series([call] * 3)
            line += f" {name} {ms * 1e3:,.1f} us ({flops / ms / 1e9:,.0f} TFLOP/s) |"
        want = got["Triton"].float()
        err = " ".join(
            f"{k} {((got[k].float() - want).norm() / want.norm()).item():.2e}" for k in ("Gluon", "Gluon WS")
        )
        print(f"{line} relative error against Triton: {err}", flush=True)


if __name__ == "__main__":
    main()
