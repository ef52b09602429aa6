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
from ft.scheduler.step import HISTORY, ScheduledSeq


def graph_sizes(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 16))
    return sorted(set(sizes + [max_bs]))


class CudaGraphRunner:
    def __init__(self, runner, max_bs: int, max_blocks: int) -> None:
        self.runner, self.max_bs, self.max_blocks = runner, max_bs, max_blocks
        dev = runner.device
        self.sizes = graph_sizes(max_bs)

        # every per-step input lives in one of two packed device buffers (int64 and int32 fields,
        # each a contiguous [n] or [n, w] segment), refilled by one copy each from pinned host
        # twins: a step pays two host-to-device copies, not one pageable copy per field
        n = max_bs
        self.wide = Packed({"ids": 1, "positions": 1, "slots": 1, "state_slots": 1, "history": HISTORY},
                           n, torch.int64, dev)  # fmt: skip
        self.narrow = Packed(
            {"seq_lens": 1, "context_lens": 1, "block_tables": max_blocks}, n, torch.int32, dev
        )
        self.ids, self.positions, self.slots, self.state_slots, self.history = self.wide.views()
        self.seq_lens, self.context_lens, self.block_tables = self.narrow.views()
        self.table_width = 0  # the widest block table a step has written: zeros beyond
        self._host_rows(0, n)  # capture with padding rows only
        self.wide.upload(n)
        self.narrow.upload(n)
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
            and all(len(s.token_ids) == 1 and s.restore_from is None for s in seqs)
            and all(s.snapshot_to is None or s.snapshot_after for s in seqs)  # copied after the graph
            and all(not s.prompt_targets for s in seqs)
            and max(s.num_blocks for s in seqs) <= self.max_blocks
        )

    def _host_rows(self, first: int, rows: int) -> list:
        """The host views of the first ``rows`` rows of every input, with rows ``first..rows`` set
        to padding: token 0 at position 0, no KV write (slot -1), block 0, the scratch state."""
        ids, pos, slots, state, hist = wide = self.wide.host_views(rows)
        lens, ctx, table = narrow = self.narrow.host_views(rows)
        ids[first:], pos[first:], slots[first:], lens[first:], ctx[first:], hist[first:] = 0, 0, -1, 1, 0, -1
        state[first:], table[first:] = self.runner.scratch_slot, 0
        return wide + narrow

    @torch.inference_mode()
    def run(self, seqs: list[ScheduledSeq], ids_now: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, V] for a decode batch (``ids_now``: its token ids [B] already on the device,
        written over the uploaded ones before the replay)."""
        b = len(seqs)
        bs = next(s for s in self.sizes if s >= b)
        ids, pos, slots, state, hist, lens, ctx, table = self._host_rows(b, bs)
        tables, width = self.runner.tables, max(s.num_blocks for s in seqs)
        table[:b, :width] = tables.table(seqs, width)  # -1 past a row's blocks, as eager batches
        table[:b, width : self.table_width] = 0  # what wider steps left there
        self.table_width = max(self.table_width, width)
        slots[:b] = tables.kv_slots(seqs)
        for i, s in enumerate(seqs):
            p = s.start
            ids[i], pos[i], ctx[i], lens[i], state[i] = s.token_ids[0], p, p, p + 1, s.state_slot
            hist[i, : HISTORY - len(s.history)] = -1
            hist[i, HISTORY - len(s.history) :] = s.history
        self.wide.upload(bs)
        self.narrow.upload(bs)
        if ids_now is not None:
            self.ids[:b].copy_(ids_now)
        self.graphs[bs].replay()
        return self.logits[bs][:b]


class Packed:
    """Named int fields, each a contiguous ``[n, width]`` (width 1: ``[n]``) segment of one device
    buffer, with a pinned host twin; ``upload(bs)`` copies the first ``bs`` rows of every field in
    one transfer (the whole span up to the last field's rows: a few KiB)."""

    def __init__(self, widths: dict[str, int], n: int, dtype: torch.dtype, device: torch.device) -> None:
        self.widths, self.n = widths, n
        size = n * sum(widths.values())
        self.device = torch.zeros(size, dtype=dtype, device=device)
        self.host = torch.zeros(size, dtype=dtype, pin_memory=torch.cuda.is_available())
        self.host_np = self.host.numpy()
        self.offsets, at = [], 0
        for w in widths.values():
            self.offsets.append(at)
            at += n * w
        # recorded after each upload's copy: the host twin is not refilled before it has been read
        # (waiting on it before its first record returns at once)
        self.uploaded = torch.cuda.Event() if self.device.is_cuda else None

    def _views(self, buf, rows: int):
        return [
            buf[o : o + rows * w].reshape(rows, w) if w > 1 else buf[o : o + rows]
            for o, w in zip(self.offsets, self.widths.values())
        ]

    def views(self) -> list[torch.Tensor]:
        """Device views of every field, all n rows (what the graphs read)."""
        return self._views(self.device, self.n)

    def host_views(self, rows: int) -> list:
        """numpy views of the host twin's first ``rows`` rows of every field, to fill: once the
        last upload has read them (a step issued ahead fills them while the step before may still
        be queued behind the one running)."""
        if self.uploaded is not None:
            self.uploaded.synchronize()
        return self._views(self.host_np, rows)

    def upload(self, rows: int) -> None:
        last, w = self.offsets[-1], list(self.widths.values())[-1]
        end = last + rows * w
        self.device[:end].copy_(self.host[:end], non_blocking=True)
        if self.uploaded is not None:
            self.uploaded.record()
