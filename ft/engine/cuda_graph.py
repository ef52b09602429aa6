"""CUDA graphs for decode: one captured forward (model + lm_head) per padded batch size.

Decode steps are hundreds of small kernels; launched one by one from Python they cost ~18 µs
each on our machines, more than the kernels themselves. Each graph reads its inputs from static
buffers that ``run`` refills, so replay launches the whole step at once. Padded rows write no KV
(slot -1), read block 0 and use the scratch state slot, and their logits are dropped.

Only pure decode batches (one new token per sequence) without prefix-cache state copies are
graphed; anything else runs eagerly. Kernels used inside must not synchronise with the host.
"""

from __future__ import annotations

import torch

from ft.forward_context import ForwardBatch, ForwardContext, forward_context
from ft.scheduler.scheduler import HISTORY, ScheduledSeq


def graph_sizes(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 16))
    return sorted(set(sizes + [max_bs]))


class CudaGraphRunner:
    def __init__(self, runner, max_bs: int, max_blocks: int) -> None:
        self.runner, self.max_bs, self.max_blocks = runner, max_bs, max_blocks
        dev = runner.device
        self.sizes = graph_sizes(max_bs)

        def buf(*shape, dtype=torch.int64, fill=0):
            return torch.full(shape, fill, dtype=dtype, device=dev)

        n = max_bs
        self.ids = buf(n)
        self.positions = buf(n)
        self.slots = buf(n, fill=-1)
        self.block_tables = buf(n, max_blocks, dtype=torch.int32)
        self.seq_lens = buf(n, dtype=torch.int32, fill=1)
        self.context_lens = buf(n, dtype=torch.int32)
        self.state_slots = buf(n, fill=runner.scratch_slot)
        self.history = buf(n, HISTORY, fill=-1)
        self.cu_seqlens = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            self._capture(bs)

    def _batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            positions=self.positions[:bs],
            cu_seqlens=self.cu_seqlens[: bs + 1],
            context_lens=self.context_lens[:bs],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            slot_mapping=self.slots[:bs],
            state_slots=self.state_slots[:bs],
            prev_token_ids=self.history[:bs],
            block_size=self.runner.cfg.block_size,
            query_lens_cpu=[1] * bs,
            context_lens_cpu=[0] * bs,
        )

    def _forward(self, bs: int) -> torch.Tensor:
        r = self.runner
        with forward_context(ForwardContext(self._batch(bs), r.attention, r.gdn)):
            hidden = r.model(self.ids[:bs], self.positions[:bs])
        return r.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture(self, bs: int) -> None:
        for _ in range(2):  # warm up: autotuning and lazy initialisation happen outside capture
            self._forward(bs)
        torch.cuda.synchronize(self.runner.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.logits[bs] = self._forward(bs)
        self.pool = graph.pool()
        self.graphs[bs] = graph

    def can_run(self, seqs: list[ScheduledSeq]) -> bool:
        return (
            len(seqs) <= self.max_bs
            and all(len(s.token_ids) == 1 and s.restore_from is None and s.snapshot_to is None for s in seqs)
            and all(not s.prompt_targets for s in seqs)
            and max(len(s.block_ids) for s in seqs) <= self.max_blocks
        )

    @torch.inference_mode()
    def run(self, seqs: list[ScheduledSeq]) -> torch.Tensor:
        """Logits [B, V] for a decode batch."""
        b = len(seqs)
        bs = next(s for s in self.sizes if s >= b)
        bsz = self.runner.cfg.block_size
        table = torch.zeros(bs, self.max_blocks, dtype=torch.int32)
        rows = {"ids": [], "pos": [], "slots": [], "lens": [], "ctx": [], "state": [], "hist": []}
        for i, s in enumerate(seqs):
            p = s.start
            table[i, : len(s.block_ids)] = torch.tensor(s.block_ids, dtype=torch.int32)
            rows["ids"].append(s.token_ids[0])
            rows["pos"].append(p)
            rows["slots"].append(s.block_ids[p // bsz] * bsz + p % bsz)
            rows["lens"].append(p + 1)
            rows["ctx"].append(p)
            rows["state"].append(s.state_slot)
            rows["hist"].append([-1] * (HISTORY - len(s.history)) + s.history)
        pad = bs - b
        host = {
            "ids": rows["ids"] + [0] * pad,
            "pos": rows["pos"] + [0] * pad,
            "slots": rows["slots"] + [-1] * pad,
            "lens": rows["lens"] + [1] * pad,
            "ctx": rows["ctx"] + [0] * pad,
            "state": rows["state"] + [self.runner.scratch_slot] * pad,
            "hist": rows["hist"] + [[-1] * HISTORY] * pad,
        }
        nb = True
        self.ids[:bs].copy_(torch.tensor(host["ids"]), non_blocking=nb)
        self.positions[:bs].copy_(torch.tensor(host["pos"]), non_blocking=nb)
        self.slots[:bs].copy_(torch.tensor(host["slots"]), non_blocking=nb)
        self.seq_lens[:bs].copy_(torch.tensor(host["lens"], dtype=torch.int32), non_blocking=nb)
        self.context_lens[:bs].copy_(torch.tensor(host["ctx"], dtype=torch.int32), non_blocking=nb)
        self.state_slots[:bs].copy_(torch.tensor(host["state"]), non_blocking=nb)
        self.history[:bs].copy_(torch.tensor(host["hist"]), non_blocking=nb)
        self.block_tables[:bs].copy_(table, non_blocking=nb)
        self.graphs[bs].replay()
        return self.logits[bs][:b]
