"""What the scheduler hands every rank for one step: a ``ScheduledSeq`` per sequence, gathered in
a ``SchedulerOutput``. Plain picklable data, no tensors; the decisions that fill it live in
``ft.scheduler.scheduler``, the tensors built from it in ``ft.engine.batch_inputs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ft.sampling_params import SamplingParams

HISTORY = 8  # tokens before a chunk that every rank sees (n-gram embeddings need the last few)
PENDING_TOKEN = -1  # a decode-ahead step's input: sampled by the step still running, read on the device


@dataclass(frozen=True)
class ScheduledSeq:
    """What every rank needs to run one sequence for one step (picklable, no tensors)."""

    request_id: str
    token_ids: list[int]  # the tokens computed this step
    start: int  # position of token_ids[0]; tokens before it are cached
    # the request's KV blocks from index ``blocks_from`` on: those the ranks have not been sent
    # (all of them, from 0, when it is admitted); they keep its table (``ft.engine.block_tables``)
    new_blocks: list[int]
    blocks_from: int
    state_slot: int
    sample: bool  # this step reaches the last known token: sample the next one
    params: SamplingParams
    output_index: int  # how many tokens the request has generated so far (seeds sampling)
    prompt_targets: list[int] | None  # prompt tokens whose log-probs this chunk's logits give
    history: list[int] = field(default_factory=list)  # up to HISTORY tokens before ``start``
    restore_from: int | None = None  # copy this GDN snapshot into the state slot before running
    snapshot_to: int | None = None  # save the GDN state after ``snapshot_len`` tokens into this snapshot
    snapshot_len: int = 0

    @property
    def snapshot_after(self) -> bool:
        """Whether the snapshot point is the chunk's end (a decode step's): the slot's state after
        the step, copied once it ran (``ModelRunner.launch``), not split out of the GDN layers'
        delta rule (``ft.gdn.snapshots``); a captured decode graph can then run the step."""
        return self.snapshot_to is not None and self.snapshot_len == len(self.token_ids)

    # the first sampling row of a request with a penalty since it was admitted: its prompt and
    # output tokens so far (the request's own lists), from which the sampler keeps its counts
    # (``ft.layers.penalties.PenaltyState``)
    seen: tuple[list[int], list[int]] | None = None

    @property
    def num_blocks(self) -> int:
        """The KV blocks the request holds in this step."""
        return self.blocks_from + len(self.new_blocks)


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq]
    preempted: list[str]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)
