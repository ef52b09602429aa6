"""Tensor parallelism on CPU (gloo): TP=2 and TP=4 equal TP=1, and a dead rank fails fast."""

from __future__ import annotations

import functools
import itertools
import time

import pytest
import torch

from ft import LLM, SamplingParams
from ft.distributed import TPInfo, all_reduce, recording_all_reduces
from ft.engine import executor
from ft.engine.executor import WorkerError
from tests.checkpoints import write_checkpoint

PROMPTS = [[5, 17, 3, 88, 41, 9, 2, 60, 33], [30, 1, 64, 19, 7]]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=2, logprobs=2, ignore_eos=True)


def run(path, tp: int):
    with LLM(model=str(path), tp_size=tp, device="cpu", dtype="float32", progress=False) as llm:
        return llm.generate(PROMPTS, PARAMS)


def assert_close(a, b, tol=1e-5):
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        for da, db in zip(x.prompt_logprobs[1:] + x.logprobs, y.prompt_logprobs[1:] + y.logprobs):
            assert da.keys() == db.keys()
            for k in da:
                assert abs(da[k] - db[k]) < tol


@pytest.mark.parametrize(
    "model_type,tp,overrides",
    [
        # 4 kv heads split over 2; GDN key heads 2 -> 1 per rank
        ("qwen3_next", 2, dict(num_key_value_heads=4)),
        # 2 kv heads replicated over 4 ranks, GDN 4 key heads / 8 value heads split by 4, odd vocab
        ("qwen3_next", 4, dict(linear_num_key_heads=4, linear_num_value_heads=8, vocab_size=94)),
        ("qwen3_moe", 2, dict(num_key_value_heads=1)),  # one kv head replicated on both ranks
        # TP=8 as on an 8-GPU node: 8 q heads one per rank, 2 kv heads each on 4 ranks, GDN 8 key /
        # 16 value heads one / two per rank, experts and the shared expert at I=2 per rank
        ("qwen3_next", 8, dict(num_attention_heads=8, linear_num_key_heads=8, linear_num_value_heads=16)),
    ],
)
def test_tp_equals_tp1(tmp_path, model_type, tp, overrides):
    write_checkpoint(tmp_path, model_type, seed=tp, **overrides)
    assert_close(run(tmp_path, tp), run(tmp_path, 1))


def test_dead_rank_raises_quickly(tmp_path):
    write_checkpoint(tmp_path, "qwen3_moe")
    with LLM(model=str(tmp_path), tp_size=2, device="cpu", dtype="float32", progress=False) as llm:
        victim = llm.engine.executor.procs[1]
        start = time.monotonic()
        victim.kill()
        with pytest.raises(WorkerError, match="rank 1"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))
        assert time.monotonic() - start < 10


def test_dead_rank_while_idle_is_reported_by_the_statistics(tmp_path):
    """An idle offload engine asks every rank to count its deferred step (``flush_moe``) when its
    statistics are read: a rank dead by then is reported as such, not as a broken pipe."""
    write_checkpoint(tmp_path, "qwen3_moe")
    with LLM(model=str(tmp_path), tp_size=2, device="cpu", dtype="float32", progress=False,
             moe_backend="offload", expert_cache_fraction=0.5) as llm:  # fmt: skip
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0))
        victim = llm.engine.executor.procs[1]
        victim.kill()
        victim.join()
        with pytest.raises(WorkerError, match="rank 1"):
            llm.engine.stats()


def test_checkpoint_error_on_a_rank_is_reported(tmp_path):
    from safetensors.torch import load_file, save_file

    write_checkpoint(tmp_path, "qwen3_moe")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.gate.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(WorkerError, match=r"missing tensor 'model\.layers\.1\.mlp\.gate\.weight'"):
        LLM(model=str(tmp_path), tp_size=2, device="cpu", dtype="float32", progress=False)


def _faulty_worker(fault, rank, *args):
    """The real worker, except that rank ``bad_rank`` raises ``message`` at its ``call``-th launch
    and takes half a second to exit after reporting it, as a CUDA process tearing down its context
    does (``fault`` = (bad_rank, call, message))."""
    import os

    from ft.engine import executor
    from ft.engine.model_runner import ModelRunner

    bad_rank, call, message = fault
    if rank == bad_rank:
        launch, calls, exit_now = ModelRunner.launch, itertools.count(1), os._exit

        def failing(self, *a, **k):
            if next(calls) == call:
                raise RuntimeError(message)
            return launch(self, *a, **k)

        def slow_exit(code):
            time.sleep(0.5)
            exit_now(code)

        ModelRunner.launch, os._exit = failing, slow_exit
    executor._worker_main(rank, *args)


def generate_with_fault(tmp_path, monkeypatch, fault, **options) -> str:
    """The WorkerError a generation on two ranks meets when one raises (``_faulty_worker``)."""
    write_checkpoint(tmp_path, "qwen3_moe")
    monkeypatch.setattr(executor, "_worker_main", functools.partial(_faulty_worker, fault))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with (
        LLM(model=str(tmp_path), tp_size=2, device="cpu", dtype="float32", progress=False, **options) as llm,
        pytest.raises(WorkerError) as failed,
    ):
        llm.generate([[1, 2, 3], [4, 5]], params)
    return str(failed.value)


def test_the_rank_that_raised_is_reported_not_the_others_broken_collective(tmp_path, monkeypatch):
    """The first rank raises before its forward: the other, in an all-reduce, fails too once it
    has gone (gloo: connection reset), but what the caller reads is the first rank's error. The
    caller looks a moment after each wake-up, as on a busy host: the echo was reported then (and
    about a third of the time without the delay)."""
    wait = executor.wait

    def busy_wait(*args, **kwargs):
        ready = wait(*args, **kwargs)
        time.sleep(0.1)
        return ready

    monkeypatch.setattr(executor, "wait", busy_wait)
    why = generate_with_fault(tmp_path, monkeypatch, (0, 2, "injected fault on rank 0"))
    assert "injected fault on rank 0" in why, why


def test_a_rank_raising_a_long_error_in_a_forward_does_not_hang_the_others(tmp_path, monkeypatch):
    """An error larger than a pipe holds (a compiler's log, say) is read while the first rank
    waits in the forward's all-reduce: the caller fails at once, not at the collective's timeout."""
    start = time.monotonic()
    why = generate_with_fault(
        tmp_path, monkeypatch, (1, 2, "injected fault " + "x" * (1 << 20)), dist_timeout_s=30
    )
    assert "injected fault" in why, why[:500]
    assert time.monotonic() - start < 20


def test_all_reduce_recording_notes_only_real_reduces_and_does_not_nest():
    """The census's record of a step's all-reduces: one rank reduces nothing, so notes nothing."""
    with recording_all_reduces() as calls:
        x = torch.ones(2, 3)
        assert all_reduce(x, TPInfo(0, 1)) is x and x.sum() == 6
        with pytest.raises(RuntimeError, match="do not nest"), recording_all_reduces():
            pass
    assert calls == []


def test_a_strided_tensor_is_refused_before_any_backend_sums_it():
    """gloo sums a view's storage as if it were contiguous (other rows' values: a TP=2 offload
    bug's cause, e5db9b6): the all-reduce refuses one before reaching a backend."""
    from ft.distributed import group_all_reduce

    view = torch.zeros(4, 3, 5)[:, 0]
    with pytest.raises(ValueError, match="contiguous"):
        group_all_reduce(view, group=None)


def _agree(rank: int, init: str, out) -> None:
    from ft.distributed import init_process_group, min_over_ranks

    tp = init_process_group(rank, 3, init, torch.device("cpu"), 60)
    out.put((rank, min_over_ranks([1000 - 7 * rank, 4 + rank], tp, torch.device("cpu"))))


def test_ranks_agree_on_the_least_pool(tmp_path):
    """Each rank sizes its pools from what its own device has left; the scheduler hands them all
    the same block and slot ids, so they take the least of any rank (``pools.plan_pools``)."""
    import torch.multiprocessing as mp

    from ft.distributed import min_over_ranks

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_agree, args=(r, f"file://{tmp_path}/rdv", out)) for r in range(3)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert got == {r: [986, 4] for r in range(3)}
    assert min_over_ranks([5, 6], TPInfo(0, 1), torch.device("cpu")) == [5, 6]  # one rank: as given
