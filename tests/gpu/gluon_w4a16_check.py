"""Where the Gluon W4A16 kernel and the Triton one disagree, projection by projection (not a test):

    python tests/gpu/gluon_w4a16_check.py [TOKENS] [EXPERTS]

For a GPU machine, to diagnose a failing ``tests/nvfp4/test_w4a16_gpu.py -k gluon`` without
spending a run per guess: Qwen3-Next's bank shapes (H=2048, I=512, top-10; EXPERTS, default 512),
the pairs sorted once and both launchers (``triton_w4a16._launch`` with LUT, ``gluon_w4a16.launch``)
given the same tiles, so that their outputs differ only by the order of a K step's products. For
the gate/up launch (its SwiGLU activations) and then the down launch (weighted terms, on the
Triton kernel's activations), prints the relative error, the worst element, the median ratio
got / want (a wrong scale shows as a constant ratio), and the error by 64-row block and by output
column mod 16 (a wrong input order within a K step shows as a pattern there)."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from ft.moe.kernels import gluon_w4a16, triton_moe, triton_w4a16  # noqa: E402
from ft.moe.kernels.align import align_by_expert  # noqa: E402
from tests.nvfp4.test_w4a16_gpu import random_bank, routing  # noqa: E402


def report(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    got, want = got.float(), want.float()
    err = (got - want).abs()
    rel = float(err.norm() / want.norm())
    worst = divmod(int(err.argmax()), want.shape[1])
    live = want.abs() > want.abs().mean()
    ratio = float((got[live] / want[live]).median()) if live.any() else float("nan")
    print(f"{name}: relative error {rel:.3g}, worst at {worst} ({got[worst]:.4g} vs {want[worst]:.4g}), "
          f"median got/want {ratio:.4f}")  # fmt: skip
    rows = err.shape[0] // 64 * 64
    by_block = err[:rows].view(-1, 64, err.shape[1]).pow(2).sum((1, 2)).sqrt()
    print(f"  error by 64-row block (first 8): {[round(float(v), 3) for v in by_block[:8]]}")
    cols = err.shape[1] // 16 * 16
    by_col = err[:, :cols].view(err.shape[0], -1, 16).pow(2).sum((0, 1)).sqrt()
    print(f"  error by column mod 16: {[round(float(v), 3) for v in by_col]}")


def main() -> None:
    t = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    e = int(sys.argv[2]) if len(sys.argv) > 2 else 512
    h, inter, k = 2048, 512, 10
    triton_w4a16.LUT = True
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13, w2 = random_bank(e, 2 * inter, h, gen), random_bank(e, h, inter, gen)
    x = torch.randn(t, h, generator=gen, device="cuda").to(torch.bfloat16)
    weights, ids = routing(t, e, k, gen)
    print(f"T={t} E={e}: the Gluon kernel takes these banks: {gluon_w4a16.supports(w13, w2, x)}")
    up_cfg, down_cfg = triton_moe.pick_config(t, e, gluon_w4a16.CONFIGS)
    pairs = t * k
    topk_w = weights.reshape(-1).float().contiguous()
    acts = {}
    for name, launch in (("triton", triton_w4a16._launch), ("gluon", gluon_w4a16.launch)):
        align = align_by_expert(ids, e, up_cfg[0])
        act = torch.zeros(pairs, inter, dtype=x.dtype, device=x.device)
        launch(x, w13, act, topk_w, align, pairs, inter, h, k, True, True, False, up_cfg)
        acts[name] = act
    report(f"gate/up {up_cfg}", acts["gluon"], acts["triton"])
    ys = {}
    for name, launch in (("triton", triton_w4a16._launch), ("gluon", gluon_w4a16.launch)):
        align = align_by_expert(ids, e, down_cfg[0])
        y = torch.zeros(pairs, h, dtype=x.dtype, device=x.device)
        launch(acts["triton"], w2, y, topk_w, align, pairs, h, inter, k, False, False, True, down_cfg)
        ys[name] = y
    report(f"down {down_cfg}", ys["gluon"], ys["triton"])


if __name__ == "__main__":
    main()
