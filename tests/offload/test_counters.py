"""The offload statistics (EngineStats, which /metrics, the server's log line and ``ft bench
offline`` read) against an independent count: the routing a run recorded, replayed through a
model of the cache (``cache_model``), gives every counter exactly; tensor parallelism halves the
bytes a rank moves and nothing else; and on an engine with decode graphs (on a CPU, graphs that
run eagerly on the same padded buffers, ``graphed``), neither the forwards that warm the graphs
up at start-up nor the rows that pad a batch to its graph's size count."""

from __future__ import annotations

import pytest
import torch

from ft import LLM, SamplingParams
from ft.moe.backends import staging
from ft.moe.backends.graph_split import SegmentedGraphRunner
from ft.moe.backends.runtime import moe_blocks
from ft.utils import cdiv
from tests.checkpoints import write_checkpoint
from tests.offload.cache_model import expected, record

LONG = [(7 * i + 3) % 90 for i in range(40)]  # two prefill chunks of 16 and one of 8
PROMPTS = [[5, 17, 3, 88, 41, 9, 2, 60, 33], [30, 1, 64, 19, 7], LONG]
AGAIN = LONG[:32] + [4, 4]  # run after the others: 32 of its tokens from the prefix cache
PARAMS = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 4, 8, 5)]
COUNTERS = ("moe_hits", "moe_misses", "moe_evictions", "moe_prefetched", "moe_prefetch_hits",
            "moe_bytes_h2d", "moe_bytes_host_read", "moe_tokens")  # fmt: skip
# 8 of 16 experts a layer resident, prefills in chunks of 16, nothing streamed ahead
OPTIONS = dict(
    moe_backend="offload", expert_cache_fraction=0.5, max_num_batched_tokens=16, moe_stream_ahead=False
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe_16")
    write_checkpoint(path, "qwen3_moe", seed=21, num_experts=16)  # top-2 of 16: decode fits 8 slots
    return path


@pytest.fixture(autouse=True)
def no_prestaging(monkeypatch):
    """An idle engine's copies for the next prefill are bytes the model does not count."""
    monkeypatch.setattr(staging, "PRESTAGE", False)


def engine(path, tp: int = 1, **options) -> LLM:
    return LLM(model=str(path), tp_size=tp, device="cpu", dtype="float32", progress=False, **options)


def run(llm: LLM):
    llm.generate(PROMPTS, PARAMS[:3])
    llm.generate([AGAIN], PARAMS[3])
    return llm.engine.stats()


def computed_tokens(s, requests: int = len(PARAMS)) -> int:
    """Tokens through the model: prompts less their prefix-cache hits, and every generated token
    but each request's last (never fed back)."""
    return s.prompt_tokens + s.generation_tokens - requests


@pytest.fixture(params=[False, True], ids=["copying", "host-reads"])
def reads(request) -> bool:
    """Decode batches read missed experts in place (host reads), or copy them in (``copying_decode``)."""
    if not request.param:
        request.getfixturevalue("copying_decode")
    return request.param


@pytest.mark.parametrize("policy,prefetch", [("lru", False), ("lfu", True)])
def test_counters_equal_an_independent_count(ckpt, policy, prefetch, reads):
    with engine(ckpt, expert_cache_policy=policy, moe_prefetch=prefetch, **OPTIONS) as llm:
        runtime = llm.engine.executor.runner.moe
        calls = record(moe_blocks(llm.engine.executor.runner.model))
        s = run(llm)
        layout = runtime.stores[0].layout
    assert s.prefix_hit_tokens == 32 and s.moe_slots == 8
    want = expected(calls, 16, 8, policy, reads, layout.expert_bytes, layout.payload_bytes)
    assert {k: getattr(s, k) for k in COUNTERS} == want
    assert s.moe_tokens == computed_tokens(s) and s.moe_resident == s.moe_layers * 8
    assert s.moe_misses > 0 and s.moe_evictions > 0 and (s.moe_prefetched > 0) == prefetch
    assert s.moe_hit_rate == s.moe_hits / (s.moe_hits + s.moe_misses) and s.moe_residency == 0.5
    assert s.moe_bytes_per_token == (s.moe_bytes_h2d + s.moe_bytes_host_read) / s.moe_tokens


def test_tp2_moves_half_the_bytes_and_counts_the_rest_alike(ckpt):
    stats = {}
    for tp in (1, 2):
        with engine(ckpt, tp, **OPTIONS) as llm:
            stats[tp] = run(llm)
    one, two = stats[1], stats[2]
    for k in COUNTERS:
        want = getattr(one, k) // 2 if k.startswith("moe_bytes") else getattr(one, k)
        assert getattr(two, k) == want, k
    assert one.moe_bytes_h2d % 2 == 0 and one.moe_bytes_h2d > 0 and one.moe_bytes_host_read > 0


class EagerGraph:
    """A captured decode graph's stand-in on a CPU: a replay runs the forward eagerly on the padded
    buffers the graph runner filled (its copying layers find their experts as a break would)."""

    def __init__(self, graphs: SegmentedGraphRunner, bs: int) -> None:
        self.graphs, self.bs = graphs, bs

    def replay(self) -> None:
        self.graphs.logits[self.bs] = self.graphs._forward(self.bs)


def _capture(self, bs: int) -> None:
    for _ in range(2):  # as ``SegmentedGraphRunner._capture`` warms up, on padding rows only
        self._forward(bs)
    self.graphs[bs] = EagerGraph(self, bs)


def graphed(llm: LLM, monkeypatch) -> None:
    """What ``ModelRunner`` does on a GPU once the engine is built: capture the decode graphs of
    every size up to the largest whose experts fit a layer's slots, then ``discard_uses``."""
    monkeypatch.setattr(SegmentedGraphRunner, "_capture", _capture)
    r = llm.engine.executor.runner
    max_len = r.cfg.model_len(r.mc.max_position_embeddings)
    with torch.inference_mode():
        r.graphs = SegmentedGraphRunner(r, r.moe.max_graph_batch(), cdiv(max_len, r.cfg.block_size))
    r.moe.discard_uses()


@pytest.mark.parametrize("backend", ["offload", "hybrid"])
def test_the_decode_graphs_warm_up_counts_nothing(ckpt, backend, copying_decode, monkeypatch):
    with engine(ckpt, **OPTIONS | dict(moe_backend=backend)) as llm:
        graphed(llm, monkeypatch)
        s = llm.engine.stats()
        assert sorted(llm.engine.executor.runner.graphs.graphs)[-1] >= 4
        assert {k: getattr(s, k) for k in COUNTERS} == dict.fromkeys(COUNTERS, 0)
        assert s.moe_cpu_pairs == 0 and s.moe_copy_seconds == 0
        run(llm)  # and requests are counted after it
        s = llm.engine.stats()
    assert s.moe_hits > 0 and s.moe_misses > 0 and s.moe_tokens == computed_tokens(s)


def test_rows_that_pad_a_graphed_batch_are_no_tokens(ckpt, copying_decode, monkeypatch):
    padded = []
    real_run = SegmentedGraphRunner.run

    def run_graph(self, seqs, *args):
        padded.append(len(seqs))
        return real_run(self, seqs, *args)

    monkeypatch.setattr(SegmentedGraphRunner, "run", run_graph)
    with engine(ckpt, **OPTIONS) as llm:
        graphed(llm, monkeypatch)
        llm.generate([*PROMPTS[:2], [8, 8, 2, 91, 40, 3, 3]], PARAMS[:3])
        s = llm.engine.stats()
    assert 3 in padded  # a batch of three ran as the graph of four
    assert s.moe_tokens == computed_tokens(s, 3)
