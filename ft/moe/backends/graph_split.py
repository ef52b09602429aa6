"""CUDA-graph decode with experts that are not all on the GPU: the step is split at each MoE layer.

Which experts a layer needs is known only once its router has run, on the device, in the middle
of the step; fetching the misses needs the host (it issues the copies and picks the victims).
So a decode step is captured as L + 1 graph *segments* with a host *break* between them, one per
MoE layer that needs the host:

    segment 0:  embed, layer 0 mixer, router 0 (and the prefetch router on the same input)
    break 0:    read ids 0 -> make them resident (copies on the side stream, victims by policy),
                write the device expert -> slot table, start layer 1's predicted copies
    segment 1:  slot ids = table[ids 0], MoE kernel 0 on the slots, layer 1 mixer, router 1 ...
    ...

A backend marks a break with ``split_point(fn)``: while a step is being captured it ends the
current segment and records ``fn`` to run at that point of every replay; outside capture (eager
steps, warm-up) it simply calls ``fn``. The model code is unchanged and ``fn`` only reads tensors
that live in the graphs' memory pool, whose addresses replay keeps. Every replay of a break
synchronises the host with the GPU once (reading the ids); misses are fetched there (they must
be, the kernel needs them), and the next layer's prefetch runs while the GPU computes.

``SegmentedGraphRunner`` is the decode graph runner with ``CudaGraphRunner``'s buffers and
batch-size ladder, capturing segmented graphs instead of whole ones. A batch can be graphed only
if its experts fit a layer's slots (the offload backend caps the graph batch size accordingly).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from ft.engine.cuda_graph import CudaGraphRunner

_CAPTURE: SegmentedGraph | None = None


def capturing() -> bool:
    return _CAPTURE is not None


def split_point(fn: Callable[[], Callable[[], None] | None]) -> Callable[[], None] | None:
    """Run ``fn`` now, or, while a segmented graph is being captured, at this point of each replay.

    ``fn`` may return more host work that the next kernels need not wait for (the next layer's
    prefetch): a replay runs it right after launching the next segment, so it overlaps the GPU;
    run now, it is returned, for the caller to run after its own launches."""
    if _CAPTURE is None:
        return fn()
    _CAPTURE.split(fn)
    return None


class SegmentedGraph:
    """Graphs replayed in order with host functions between them; quacks like ``CUDAGraph.replay``."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.breaks: list[Callable[[], None]] = []

    @contextlib.contextmanager
    def capture(self, stream: torch.cuda.Stream) -> Iterator[None]:
        global _CAPTURE
        if _CAPTURE is not None:
            raise RuntimeError("a segmented graph capture is already running; captures do not nest")
        with torch.cuda.stream(stream):
            self._begin()
            _CAPTURE = self
            try:
                yield
            finally:
                _CAPTURE = None
                self.graphs[-1].capture_end()

    def _begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(self.pool)
        self.graphs.append(graph)

    def split(self, fn: Callable[[], None]) -> None:
        self.graphs[-1].capture_end()
        self.breaks.append(fn)
        self._begin()

    def replay(self) -> None:
        later = None
        for i, graph in enumerate(self.graphs):
            graph.replay()
            if later is not None:  # the last break's deferred work, while this segment runs
                later()
            later = self.breaks[i]() if i < len(self.breaks) else None


class SegmentedGraphRunner(CudaGraphRunner):
    """``CudaGraphRunner`` whose graphs are ``SegmentedGraph``s (same buffers, same ``run``)."""

    @torch.inference_mode()
    def _capture(self, bs: int) -> None:
        for _ in range(2):  # warm up: autotuning and lazy initialisation happen outside capture
            self._forward(bs)
        torch.cuda.synchronize(self.runner.device)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        if not hasattr(self, "capture_stream"):
            self.capture_stream = torch.cuda.Stream(self.runner.device)
        graph = SegmentedGraph(self.pool)
        with graph.capture(self.capture_stream):
            self.logits[bs] = self._forward(bs)
        torch.cuda.synchronize(self.runner.device)
        self.graphs[bs] = graph
