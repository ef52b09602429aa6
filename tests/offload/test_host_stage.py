"""Host staging (``ft.moe.backends.host_stage``): a host-read layer's host experts copied into a
device block before its MoE kernels, which read them there. The plan against a hand-worked case,
the copy, an engine with it on against the resident backend (exact, fp32) with each staged host row's
bytes counted once, and the GPU kernel against the torch version under
Triton's interpreter (``check_kernel``)."""

from __future__ import annotations

import pytest
import torch

from ft.moe.backends import host_prefetch, host_reads, host_stage
from ft.moe.backends.host_stage import StageBlock, plan, stage
from ft.moe.backends.layout import ExpertLayout, Part
from tests.interpreter import INTERPRETER, run_check
from tests.offload.equality import PARAMS, PROMPTS, assert_same, engine, generate

# pairs 0 and 3 read host row 2, pair 2 host row 0, pair 5 host row 3; pairs 1 and 4 read slots
ROWS = torch.tensor([[-3, 2, -1], [-3, 5, -4]])


def test_plan_gives_each_host_row_the_staging_row_of_its_first_reader():
    src, staged = plan(ROWS)
    assert src.tolist() == [2, -1, 0, -1, -1, 3]
    assert staged.tolist() == [[-1, 2, -3], [-1, 5, -6]]


def test_stage_copies_each_host_row_once_into_its_staging_row():
    layout = ExpertLayout((Part("w", (3,), torch.float32, 0),), 16)
    store = torch.randint(0, 255, (4, 16), dtype=torch.uint8)
    staging = StageBlock(layout, 6, torch.device("cpu"))
    staged = stage(ROWS, store, staging)
    assert torch.equal(staged, plan(ROWS)[1])
    for row, host_row in ((0, 2), (2, 0), (5, 3)):
        assert torch.equal(staging.block[row], store[host_row]), row
    assert not staging.block[[1, 3, 4]].any()  # rows no first reader takes stay as they were
    assert staging.tensors["w"].shape == (6, 3)
    with pytest.raises(AssertionError, match="pairs"):
        stage(torch.cat([ROWS, ROWS]), store, staging)


@pytest.fixture
def staging(monkeypatch):
    monkeypatch.setattr(host_reads, "ENABLED", True)
    monkeypatch.setattr(host_stage, "STAGE", True)


@pytest.mark.parametrize("prefetch_rows", [0, 2])
def test_host_reads_with_staging_equal_resident(ckpt, refs, staging, monkeypatch, prefetch_rows):
    """Exactly the resident backend's outputs, without host prefetch and beside whole-expert
    prefetch (its picks read from spare rows, the rest staged). The bytes over PCIe: a staged host
    expert's row once, however many pairs of the batch read it, where reading in place counts it
    for each pair (decode batches of three tokens share host experts here)."""
    monkeypatch.setattr(host_prefetch, "ROWS", prefetch_rows)
    monkeypatch.setattr(host_prefetch, "DOWN_ONLY", False)
    copied, pairs = [], []
    real_stage = host_stage.stage

    def spy(rows, store, st):
        copied.append(int((plan(rows)[0] >= 0).sum()))  # distinct host rows copied
        pairs.append(int((rows < 0).sum()))  # pairs that read them
        return real_stage(rows, store, st)

    monkeypatch.setattr(host_stage, "stage", spy)
    with engine(ckpt, moe_backend="offload", expert_cache_fraction=0.25) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
        s = llm.engine.stats()
        payload = llm.engine.executor.runner.moe.stores[0].layout.payload_bytes
    assert_same(outs, refs[8192])
    assert copied and s.moe_bytes_host_read > 0 and sum(pairs) > sum(copied)
    monkeypatch.setattr(host_stage, "STAGE", False)
    _, unstaged = generate(ckpt, moe_backend="offload", expert_cache_fraction=0.25)
    assert unstaged.moe_bytes_host_read - s.moe_bytes_host_read == (sum(pairs) - sum(copied)) * payload
    if prefetch_rows == 0:  # every byte read from the host was staged
        assert s.moe_bytes_host_read == sum(copied) * payload


def test_the_kernels_read_the_staged_rows(ckpt, refs, staging, monkeypatch):
    """With a stage that copies nothing (its rows stay zeros) the outputs change: the host
    experts are read from the staging block, not from the host store."""
    monkeypatch.setattr(host_stage, "stage", lambda rows, store, st: plan(rows)[1])
    outs, _ = generate(ckpt, moe_backend="offload", expert_cache_fraction=0.25)
    with pytest.raises(AssertionError):
        assert_same(outs, refs[8192])


def test_a_down_only_prefetch_reads_in_place(ckpt, refs, staging, monkeypatch):
    """Its down kernel reads other rows than gate/up: such a layer is not staged."""
    monkeypatch.setattr(host_prefetch, "ROWS", 2)
    monkeypatch.setattr(host_prefetch, "DOWN_ONLY", True)
    monkeypatch.setattr(host_stage, "stage", lambda *a: pytest.fail("staged beside a down-only prefetch"))
    outs, _ = generate(ckpt, moe_backend="offload", expert_cache_fraction=0.25)
    assert_same(outs, refs[8192])


@pytest.mark.parametrize("env, want", [({}, "False True"), ({"FT_MOE_HOST_STAGE": "0"}, "False False"),
                                       ({"FT_MOE_HOST_STAGE": "1"}, "True True")])  # fmt: skip
def test_staging_by_bank_format(env, want):
    """By default NVFP4 banks stage and bf16 banks read in place (what an H200 measured: staging
    the bf16 rows was slower); FT_MOE_HOST_STAGE sets both formats alike."""
    import os
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items() if k != "FT_MOE_HOST_STAGE"}
    code = "from ft.moe.backends import host_stage as h; print(h.stages('bf16'), h.stages('nvfp4'))"
    run = subprocess.run([sys.executable, "-c", code], env=clean | env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[0] == want


def check_kernel() -> None:
    """``_stage_kernel`` (interpreted) against the torch version, random cases with shared rows."""
    from ft.moe.backends.host_stage import _stage_kernel

    g = torch.Generator().manual_seed(0)
    for t, k, n, words, block in ((1, 10, 12, 40, 16), (2, 10, 6, 33, 16), (4, 2, 5, 8, 8)):
        rows = torch.randint(-n, 7, (t, k), generator=g)  # < 0: host rows, repeats likely
        store = torch.randint(-(2**62), 2**62, (n, words), generator=g)
        want_src, want_rows = plan(rows)
        got = torch.zeros(t * k, words, dtype=torch.int64)
        staged = torch.empty_like(rows)
        grid = (t * k, -(-words // block))
        _stage_kernel[grid](rows, staged, store, got, words, t * k, BLOCK_P=32, BLOCK=block)
        want = torch.zeros_like(got)
        take = want_src >= 0
        want[take] = store[want_src[take]]
        assert torch.equal(staged, want_rows) and torch.equal(got, want), (t, k, n)


@INTERPRETER[0]
@INTERPRETER[1]
def test_kernel_under_the_interpreter():
    run_check("tests.offload.test_host_stage", "check_kernel")
