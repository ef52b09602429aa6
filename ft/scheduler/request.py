"""A request's life: its tokens, what of them is cached, and the blocks and state slot it holds."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ft.sampling_params import Logprobs, SamplingParams

if TYPE_CHECKING:
    from ft.scheduler.radix_cache import Node


def kv_tokens(prompt_len: int, max_tokens: int) -> int:
    """The KV-cache tokens a request holds at most: its prompt and every generated token but the
    last, which is sampled and never fed back (no step, not even one scheduled ahead, runs past a
    request's last token by length: ``Scheduler.schedule_ahead``)."""
    return prompt_len + max(max_tokens, 1) - 1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens whose KV / state are in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at its first admission
    block_ids: list[int] = field(default_factory=list)
    blocks_sent: int = 0  # how many of block_ids the ranks have been sent (``ScheduledSeq.new_blocks``)
    penalties_sent: bool = (
        False  # its tokens went to the sampler since it was admitted (``ScheduledSeq.seen``)
    )
    state_slot: int | None = None
    logprobs: list[Logprobs] = field(default_factory=list)
    prompt_logprobs: list[Logprobs | None] = field(default_factory=list)
    finish_reason: str | None = None
    num_preemptions: int = 0
    cache_nodes: list = field(default_factory=list)  # prefix-cache nodes held, of its leading blocks
    restore_snapshot: int | None = None  # GDN state snapshot to start from after a prefix hit
    decode_snapshot: Node | None = None  # the cached block of its path holding its latest decode snapshot

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def decodes(self, start: int, n: int) -> bool:
        """Whether a step of its tokens [start, start + n) is a decode step: one generated token."""
        return n == 1 and start >= self.prompt_len

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, start: int, stop: int) -> list[int]:
        """``all_token_ids[start:stop]`` without building the whole list first (a decode step
        asks for one token of a sequence thousands long)."""
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p : stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.prompt_len
