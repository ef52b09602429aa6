"""The W4A16 kernel's own tile table: the bf16 table's values but for its own prefill row (swept
with the table decode, 2026-12-04), and FT_W4A16_PREFILL sets that row (gate/up and down) for a
process without touching bf16's; FT_MOE_PREFILL sets bf16's without touching it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CODE = (
    "from ft.moe.kernels import triton_moe as m, triton_w4a16 as w\n"
    "print(w.CONFIGS == m.CONFIGS)\n"
    "print(m.pick_config(8192, 512, w.CONFIGS))\n"
    "print(m.pick_config(8192, 512))\n"
    "print(m.pick_config(64, 512, w.CONFIGS) == m.pick_config(64, 512))\n"
    "print(m.pick_config(8192, 128, w.CONFIGS))\n"
)


def run(env: dict) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("FT_W4A16_PREFILL", "FT_MOE_PREFILL")}
    proc = subprocess.run([sys.executable, "-c", CODE], env=clean | env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_the_w4a16_table_is_bf16s_but_for_its_prefill_row():
    pytest.importorskip("triton")
    same, w4, bf16, decode_same, e128 = run({})
    assert same == "False" and w4 != bf16 and decode_same == "True"
    assert w4 == "((128, 128, 128, 8, 8, 3), (64, 128, 64, 8, 4, 3))"
    assert e128 == "((128, 64, 64, 8, 8, 3), (128, 128, 64, 8, 8, 3))"  # Qwen3-30B's: bf16's, unswept


def test_ft_w4a16_prefill_sets_the_last_rows_of_its_table_alone():
    pytest.importorskip("triton")
    env = {"FT_W4A16_PREFILL": "256,64,64,8,8,3/128,128,128,8,8,4"}
    same, w4, bf16, decode_same, e128 = run(env)
    want = "((256, 64, 64, 8, 8, 3), (128, 128, 128, 8, 8, 4))"
    assert same == "False" and w4 == want and e128 == want
    assert bf16 != want and decode_same == "True"


def test_ft_moe_prefill_sets_bf16s_last_rows_alone():
    pytest.importorskip("triton")
    env = {"FT_MOE_PREFILL": "64,128,64,8,4,4/128,64,128,8,8,3"}
    same, w4, bf16, decode_same, e128 = run(env)
    want = "((64, 128, 64, 8, 4, 4), (128, 64, 128, 8, 8, 3))"
    assert same == "False" and bf16 == want
    assert w4 == "((128, 128, 128, 8, 8, 3), (64, 128, 64, 8, 4, 3))"  # the W4A16 table's own
    assert e128 == "((128, 64, 64, 8, 8, 3), (128, 128, 64, 8, 8, 3))" and decode_same == "True"


def test_the_gluon_kernel_takes_the_banks_its_copies_fit():
    """``gluon_w4a16.supports``: K (H for gate/up, I for down) a multiple of 256, so that every code
    and scale row is a whole number of 16-byte copies, and at least STAGES - 1 steps of 64;
    Qwen3-Next's bank and its TP=2 shard fit, a TP=4 shard (I = 128: 8-byte scale rows), a
    48-row shard, an unaligned bank and activations whose rows are not 16-element multiples take the
    Triton kernel. Its layouts ask for one wgmma row
    block of 16 a warp."""
    pytest.importorskip("triton.experimental.gluon")
    import torch

    from ft.moe.kernels import gluon_w4a16
    from ft.quant.nvfp4 import NVFP4Tensor

    def bank(e: int, n: int, k: int) -> NVFP4Tensor:
        codes = torch.zeros(e, n, k // 2, dtype=torch.uint8)
        return NVFP4Tensor(codes, torch.zeros(e, n, k // 16, dtype=torch.float8_e4m3fn), torch.ones(e, n))

    def fits(h: int, inter: int) -> bool:
        return gluon_w4a16.supports(bank(2, 2 * inter, h), bank(2, h, inter))

    assert fits(2048, 512) and fits(2048, 256) and fits(256, 256)
    assert not fits(2048, 128) and not fits(2048, 48) and not fits(2000, 512) and not fits(128, 256)
    w13, w2 = bank(3, 1024, 2048), bank(3, 2048, 512)
    moved = torch.zeros(w2.weight.numel() + 8, dtype=torch.uint8)[8:].view(w2.weight.shape)  # 8 B off
    assert gluon_w4a16.supports(w13, w2) and gluon_w4a16.supports(w13, w2, torch.zeros(4, 2048))
    assert not gluon_w4a16.supports(w13, w2, torch.zeros(4, 2056)[:, :2048])  # rows 8 elements off
    assert not gluon_w4a16.supports(w13, NVFP4Tensor(moved, w2.weight_scale, w2.weight_scale_2))
    assert gluon_w4a16.layouts(128, 128, 64, 8)["MMA"].warps_per_cta == [8, 1]
    with pytest.raises(AssertionError):
        gluon_w4a16.layouts(128, 128, 64, 4)


@pytest.mark.parametrize("w4a16", [False, True])
def test_a_call_on_part_of_a_batch_takes_the_batchs_tiles(monkeypatch, w4a16):
    """A call over some of a batch's pairs (the offload backend's streamed groups: ``batch_tokens``)
    from a bank of other rows (a staging buffer of 3: ``batch_experts``, the model's 512) runs at
    the tiles of the whole batch's call. A tile's K step orders each row's sums, so at other tiles
    a pair's term lost the bits the resident call gives it, and an offloaded prompt's log-probs
    followed what the expert cache held (the 80B's rows parted, 2026-12-06)."""
    pytest.importorskip("triton")
    import torch

    from ft.moe.kernels import triton_moe, triton_w4a16
    from ft.moe.kernels.into import Into

    taken = []
    monkeypatch.setattr(triton_moe, "align_by_expert", lambda ids, e, bm: None)

    def launch(*args, **kwargs):
        taken.append(args[12])  # the tiles

    e, inter, h, batch = 3, 64, 32, 200
    x = torch.zeros(batch, h, dtype=torch.bfloat16)
    ids = torch.tensor([[3], [7], [7]])  # three pairs of the batch, k = 1 each
    weights = torch.ones(3, 1)
    terms = torch.zeros(3 * batch, h, dtype=torch.bfloat16)
    into = Into(torch.tensor([0, 5, 9]), terms, torch.tensor([0, 1, 2]))
    configs = triton_w4a16.CONFIGS if w4a16 else triton_moe.CONFIGS
    triton_moe.mma_path(launch, x, None, None, weights, ids, e, inter, into, configs, batch, 512)
    assert taken == list(triton_moe.pick_config(batch, 512, configs))
    assert taken != list(triton_moe.pick_config(len(ids), 512, configs))  # the call's own count's
    assert taken != list(triton_moe.pick_config(batch, e, configs))  # the rows' own (the E128 table)
