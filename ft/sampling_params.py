"""SamplingParams (what a request asks for) and RequestOutput (what it got), shaped like vLLM's."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k cut
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n log-probs for each generated token
    prompt_logprobs: int | None = None  # top-n log-probs for each prompt position
    min_tokens: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        checks = [
            ("max_tokens", self.max_tokens >= 0),
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0),
            ("top_p", math.isfinite(self.top_p) and 0 < self.top_p <= 1),
            ("top_k", self.top_k == -1 or self.top_k >= 0),
            ("logprobs", self.logprobs is None or self.logprobs >= 0),
            ("prompt_logprobs", self.prompt_logprobs is None or self.prompt_logprobs >= 0),
            ("min_tokens", self.min_tokens >= 0),
        ]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} is out of range")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


Logprobs = dict[int, float]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    logprobs: list[Logprobs] | None = None
    prompt_logprobs: list[Logprobs | None] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_cached_tokens: int = 0
