"""Each running request's KV block table, as every rank keeps it from step to step.

The scheduler sends a request's blocks once (``ScheduledSeq.new_blocks``: those added since the
ranks last saw it, all of them when it is admitted or re-admitted after a preemption), and the
rows here, one per state slot (a running request holds one), are kept up to date in the order the
batches are launched. Rebuilding every row each step from the requests' lists cost 10.2 ms of a
64-sequence decode step at 32k tokens each on this project's CPU machine (a Python list of
131,072 block ids, then a tensor of it), and sent 530 KB to each rank.

Not here: the block pool (``ft.scheduler.kv_pool``), what a block holds (the attention layers).
"""

from __future__ import annotations

import numpy as np


class BlockTables:
    """Rows [state slots, max blocks] of int32 block ids, -1 past a request's own blocks."""

    def __init__(self, num_rows: int, max_blocks: int, block_size: int) -> None:
        self.rows = np.full((num_rows, max_blocks), -1, dtype=np.int32)
        self.lens = np.zeros(num_rows, dtype=np.int64)
        self.block_size = block_size

    def update(self, seqs) -> None:
        """Take each sequence's new blocks into its row (``blocks_from`` 0: a new row; below the
        row's length: the request took cached copies of blocks it held, ``insert_computed``)."""
        for s in seqs:
            row, end = self.rows[s.state_slot], s.blocks_from + len(s.new_blocks)
            assert s.blocks_from <= self.lens[s.state_slot] <= end or s.blocks_from == 0, (
                f"request {s.request_id!r}: new blocks from {s.blocks_from} to {end}, its slot "
                f"{s.state_slot} holds {self.lens[s.state_slot]}: a batch was skipped or launched "
                "out of order"
            )
            if s.blocks_from == 0:  # the slot's last request may have held more
                row[end : self.lens[s.state_slot]] = -1
            if s.new_blocks:
                row[s.blocks_from : end] = s.new_blocks
            self.lens[s.state_slot] = end

    def table(self, seqs, width: int) -> np.ndarray:
        """The batch's block table [len(seqs), width]."""
        return self.rows[[s.state_slot for s in seqs], :width]

    def kv_slots(self, seqs) -> np.ndarray:
        """The KV cache slot (block · block_size + offset) of every token the batch computes, in
        order [T]."""
        bs, b = self.block_size, len(seqs)
        counts = np.fromiter((len(s.token_ids) for s in seqs), np.int64, b)
        starts = np.fromiter((s.start for s in seqs), np.int64, b)
        first = np.cumsum(counts) - counts  # each sequence's first token in the batch
        pos = np.repeat(starts - first, counts) + np.arange(int(counts.sum()))  # [T] positions
        slots = np.repeat(np.fromiter((s.state_slot for s in seqs), np.int64, b), counts)
        return self.rows[slots, pos // bs].astype(np.int64) * bs + pos % bs
