"""The Gluon W4A16 kernel's launcher on the CPU, the kernel replaced by a recorder: each launch
passes exactly its kernel's parameters (positional then by name, none missing or extra), the grid
its tiles need, its own copy slots and layouts, for gate/up and for down through row maps. On a
GPU a mismatch would surface only when the kernel compiles there."""

from __future__ import annotations

import pytest
import torch

from tests.nvfp4.test_w4a16_gpu import random_bank

triton = pytest.importorskip("triton")


class Recorder:
    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


def test_launch_passes_the_kernels_parameters(monkeypatch):
    from ft.moe.kernels import gluon_w4a16, gluon_w4a16_kernel

    recorder = Recorder(gluon_w4a16_kernel._w4a16_wgmma_kernel)
    monkeypatch.setattr(gluon_w4a16, "_w4a16_wgmma_kernel", recorder)  # where ``launch`` looks it up
    launch, configs = gluon_w4a16.launch, gluon_w4a16.CONFIGS["default"]
    gen = torch.Generator().manual_seed(0)
    w13, w2 = random_bank(8, 512, 256, gen), random_bank(8, 256, 256, gen)
    em, pairs = 256, 200
    align = (
        torch.zeros(em, dtype=torch.int32),
        torch.zeros(4, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
    )
    a, c, topk_w = torch.zeros(100, 256, dtype=torch.bfloat16), torch.zeros(pairs, 256), torch.zeros(pairs)
    for _, up, down in configs:
        launch(a, w13, c, topk_w, align, pairs, 256, 256, 2, True, True, False, up)
        launch(
            a,
            w2,
            c,
            topk_w,
            align,
            pairs,
            256,
            256,
            1,
            False,
            False,
            True,
            down,
            a_map=align[0],
            c_map=align[0],
        )
    params = recorder.kernel.arg_names
    tiles = [cfg for _, up, down in configs for cfg in (up, down)]
    assert len(recorder.calls) == len(tiles)
    for (grid, args, kwargs), cfg in zip(recorder.calls, tiles):
        named = {k for k in kwargs if k != "num_warps"}
        assert named == set(params[len(args) :]), named ^ set(params[len(args) :])
        assert grid == (triton.cdiv(em, cfg[0]) * triton.cdiv(256, cfg[1]),)
        assert (kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs["BLOCK_K"]) == cfg[:3] and kwargs[
            "num_warps"
        ] == cfg[4]
        assert kwargs["STAGES"] == gluon_w4a16.STAGES
    up, down = recorder.calls[0][2], recorder.calls[1][2]
    assert (up["A_MAP"], up["C_MAP"], up["SWIGLU"]) == (False, False, True)
    assert (down["A_MAP"], down["C_MAP"], down["SWIGLU"]) == (True, True, False)
