"""The host side of segmented decode graphs on CPU: the order in which a replay runs its segments,
its breaks and the work a break defers, and, in an eager decode step, the next layer's prefetch
issued after this layer's expert kernel (so the host work overlaps the GPU's)."""

from __future__ import annotations

from ft import LLM, SamplingParams
from ft.moe.backends.graph_split import SegmentedGraph, split_point
from ft.moe.backends.runtime import moe_blocks
from tests.checkpoints import write_checkpoint


class FakeGraph:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def replay(self) -> None:
        self.log.append(self.name)


def test_a_replay_runs_a_breaks_deferred_work_after_launching_the_next_segment():
    log: list[str] = []
    graph = SegmentedGraph(pool=None)
    graph.graphs = [FakeGraph(f"segment {i}", log) for i in range(3)]

    def brk(i: int, defer: bool):
        def fn():
            log.append(f"break {i}")
            return (lambda: log.append(f"deferred {i}")) if defer else None

        return fn

    graph.breaks = [brk(0, True), brk(1, False)]
    graph.replay()
    assert log == ["segment 0", "break 0", "segment 1", "deferred 0", "break 1", "segment 2"]


def test_outside_capture_split_point_runs_now_and_returns_the_deferred_work():
    log: list[str] = []
    later = split_point(lambda: log.append("now") or (lambda: log.append("later")))
    assert log == ["now"]
    later()
    assert log == ["now", "later"] and split_point(lambda: None) is None


def test_an_eager_decode_step_prefetches_after_the_experts_kernel(tmp_path, copying_decode):
    write_checkpoint(tmp_path, "qwen3_moe", seed=4)
    with LLM(model=str(tmp_path), device="cpu", dtype="float32", progress=False,
             moe_backend="offload", expert_cache_fraction=0.5, decode_ahead=False) as llm:  # fmt: skip
        log: list[tuple[str, int]] = []
        blocks = moe_blocks(llm.engine.executor.runner.model)
        for i, block in enumerate(blocks):
            spy(block.experts, "kernel", ("kernel", i), log)
            if block.backend.prefetch is not None:
                spy(block.backend.prefetch, "start", ("prefetch", i), log)
        engine = llm.engine
        engine.add_request([5, 17, 3], SamplingParams(max_tokens=3, temperature=0.0))
        engine.step()  # the prefill
        log.clear()
        engine.step()  # one decode step
    layers = len(blocks)
    assert [e for e in log if e[0] == "kernel"] == [("kernel", i) for i in range(layers)]
    for i in range(layers - 1):  # layer i's kernel is launched before its prefetch of layer i + 1
        assert log.index(("kernel", i)) < log.index(("prefetch", i)) < log.index(("kernel", i + 1))


def spy(obj, name: str, entry, log: list) -> None:
    real = getattr(obj, name)

    def wrapper(*args, **kwargs):
        log.append(entry)
        return real(*args, **kwargs)

    setattr(obj, name, wrapper)
