"""GDN state snapshots taken partway through a step, for the prefix cache.

A prefix-cache hit on a hybrid model needs the recurrent state (conv history and delta-rule
state) at the end of the cached prefix, a block boundary. That boundary usually falls inside a
prefill chunk: a 1,024-token prompt with 16-token blocks is cached up to token 1,008. Rather than
end the chunk there (two forwards: 1,008 tokens, then 16), the chunk runs as one forward and each
GDN layer splits only its delta rule at the snapshot points:

- the conv history at a point is the last Kc-1 conv inputs before it, copied from the chunk (or,
  within Kc-1 tokens of the chunk's start, from the slot's history, read before the conv runs);
- the delta rule runs twice: the *head* batch (each snapshotted sequence up to its point, from
  its slot's state) leaves the state at the point in the slot, which is copied to the snapshot
  row; the *tail* batch (every sequence's remaining tokens) continues from the slot.

Everything else in the layer (projections, conv, norms, attention, experts) sees one batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ft.forward_context import ForwardBatch
from ft.utils import upload_lists


@dataclass(frozen=True)
class SnapshotPoint:
    seq: int  # index of the sequence in the batch
    offset: int  # tokens of this step's chunk before the point, 1..query_len
    slot: int  # the sequence's state slot
    row: int  # state row the snapshot goes to


@dataclass
class StateSnapshots:
    points: list[SnapshotPoint]
    bos: list[int]  # each point's sequence's first token row in the step's batch
    rows: torch.Tensor  # [S] int64, the points' state rows
    head: ForwardBatch  # one sequence per point: its tokens before the point
    head_index: torch.Tensor | slice  # the head tokens' rows in the step's batch (a slice if contiguous)
    tail: ForwardBatch | None  # every sequence's tokens after its point (whole when unsnapshotted)
    tail_index: torch.Tensor | slice | None


def _starts(lens: list[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def _sub_batch(batch: ForwardBatch, seqs: list[int], starts: list[int], lens: list[int]) -> tuple:
    """Sequences ``seqs`` restricted to tokens [start, start + len) of their chunks, as
    (ForwardBatch, the tokens' rows in ``batch``: a slice when contiguous, so no gather)."""
    bos = _starts(batch.query_lens_cpu)
    index = [bos[i] + s + j for i, s, n in zip(seqs, starts, lens) for j in range(n)]
    ctx = [batch.context_lens_cpu[i] + s for i, s in zip(seqs, starts)]
    b, i64, i32 = len(seqs), torch.int64, torch.int32
    index_t, seq_t, cu, ctx_t, seq_lens = upload_lists(
        [
            (index, i64, (len(index),)),
            (seqs, i64, (b,)),
            (_starts(lens), i32, (b + 1,)),
            (ctx, i32, (b,)),
            ([c + n for c, n in zip(ctx, lens)], i32, (b,)),
        ],
        batch.positions.device,
    )
    rows = slice(index[0], index[-1] + 1) if index == list(range(index[0], index[-1] + 1)) else index_t
    sub = ForwardBatch(
        positions=batch.positions.index_select(0, index_t),
        cu_seqlens=cu,
        context_lens=ctx_t,
        seq_lens=seq_lens,
        block_tables=batch.block_tables.index_select(0, seq_t),
        slot_mapping=batch.slot_mapping.index_select(0, index_t),
        state_slots=batch.state_slots.index_select(0, seq_t),
        prev_token_ids=batch.prev_token_ids.index_select(0, seq_t),
        block_size=batch.block_size,
        query_lens_cpu=list(lens),
        context_lens_cpu=ctx,
    )
    return sub, rows


def state_snapshots(batch: ForwardBatch, points: list[SnapshotPoint]) -> StateSnapshots:
    qlens = batch.query_lens_cpu
    assert len({p.seq for p in points}) == len(points), "one snapshot per sequence per step"
    for p in points:
        assert 0 < p.offset <= qlens[p.seq], f"snapshot at {p.offset} outside a {qlens[p.seq]}-token chunk"
    head, head_index = _sub_batch(
        batch, [p.seq for p in points], [0] * len(points), [p.offset for p in points]
    )
    cut = {p.seq: p.offset for p in points}
    rest = [(i, cut.get(i, 0), n - cut.get(i, 0)) for i, n in enumerate(qlens) if n > cut.get(i, 0)]
    tail, tail_index = _sub_batch(batch, *map(list, zip(*rest))) if rest else (None, None)
    (rows,) = upload_lists([([p.row for p in points], torch.int64, (len(points),))], batch.positions.device)
    bos = _starts(qlens)
    return StateSnapshots(points, [bos[p.seq] for p in points], rows, head, head_index, tail, tail_index)


def save_conv_snapshots(
    x: torch.Tensor, conv_state: torch.Tensor, batch: ForwardBatch, snaps: StateSnapshots
) -> None:
    """Write each point's conv history (the Kc-1 conv inputs before it) to its row. Call before
    the conv updates the slots: a point within Kc-1 tokens of its chunk's start reads them."""
    kc1 = conv_state.shape[-1]
    for p, bos in zip(snaps.points, snaps.bos):
        seq = x[bos : bos + p.offset].t()  # [C, offset]
        if p.offset < kc1:
            hist = conv_state[p.slot]
            if batch.context_lens_cpu[p.seq] == 0:
                hist = torch.zeros_like(hist)
            seq = torch.cat([hist, seq.to(hist.dtype)], dim=-1)
        conv_state[p.row] = seq[:, -kc1:]
