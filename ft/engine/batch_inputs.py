"""Scheduler output into tensors on the device: the input ids and the flattened varlen
``ForwardBatch`` of one scheduled batch (``batch_inputs``), the only place that does so.

Sequence i's tokens follow sequence i - 1's; their KV slots and block table rows come from the
rows every rank keeps (``BlockTables``), every field crosses to the device in one upload
(``upload_lists``), and GDN layers get the batch's prefix snapshot points. Not here: which
sequences run (``ft.scheduler``), the forward itself (``ModelRunner``).
"""

from __future__ import annotations

import torch

from ft.engine.block_tables import BlockTables
from ft.forward_context import ForwardBatch
from ft.gdn.snapshots import SnapshotPoint, state_snapshots
from ft.scheduler.step import HISTORY, ScheduledSeq
from ft.utils import upload_lists


def batch_inputs(
    seqs: list[ScheduledSeq], tables: BlockTables, snapshot_base: int, gdn: bool, device: torch.device
) -> tuple[torch.Tensor, ForwardBatch]:
    """The input ids [T] and the ``ForwardBatch`` of ``seqs`` (``tables`` updated for them);
    ``snapshot_base``: the state row of snapshot 0; ``gdn``: the model has GDN layers."""
    bs = tables.block_size
    ids, pos, qlens, ctx = [], [], [], []
    for s in seqs:
        n = len(s.token_ids)
        ids += s.token_ids
        pos += range(s.start, s.start + n)
        qlens.append(n)
        ctx.append(s.start)
    slots = tables.kv_slots(seqs)
    table = tables.table(seqs, max(s.num_blocks for s in seqs))
    width = table.shape[1]
    history = [h for s in seqs for h in [-1] * (HISTORY - len(s.history)) + s.history]
    cu = [0]
    for q in qlens:
        cu.append(cu[-1] + q)
    i64, i32, t, b = torch.int64, torch.int32, len(ids), len(seqs)
    fields = upload_lists(
        [
            (ids, i64, (t,)),
            (pos, i64, (t,)),
            (slots, i64, (t,)),
            ([s.state_slot for s in seqs], i64, (b,)),
            (history, i64, (b, HISTORY)),
            (cu, i32, (b + 1,)),
            (ctx, i32, (b,)),
            ([c + q for c, q in zip(ctx, qlens)], i32, (b,)),
            (table, i32, (b, width)),
        ],
        device,
    )
    ids_t, positions, slot_mapping, state_slots, prev, cu_t, ctx_t, seq_lens, block_tables = fields
    batch = ForwardBatch(
        positions=positions,
        cu_seqlens=cu_t,
        context_lens=ctx_t,
        seq_lens=seq_lens,
        block_tables=block_tables,
        slot_mapping=slot_mapping,
        state_slots=state_slots,
        prev_token_ids=prev,
        block_size=bs,
        query_lens_cpu=qlens,
        context_lens_cpu=ctx,
    )
    points = [
        SnapshotPoint(i, s.snapshot_len, s.state_slot, snapshot_base + s.snapshot_to)
        for i, s in enumerate(seqs)
        if s.snapshot_to is not None and not s.snapshot_after  # those: copied after the step
    ]
    if points and gdn:
        batch.snapshots = state_snapshots(batch, points)
    return ids_t, batch
