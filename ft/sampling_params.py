"""SamplingParams (what a request asks for) and RequestOutput (what it got), shaped like vLLM's."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

# below this temperature a request is greedy, as in vLLM (its _SAMPLING_EPS): dividing the logits
# by ~1e-38 overflows them to inf and their softmax to NaN
GREEDY_BELOW = 1e-5


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
    # logits processing before a token is chosen (greedy or sampled; log-probs stay the model's):
    # ``logit_bias`` adds to given tokens' logits; ``repetition_penalty`` r divides a positive
    # logit by r and multiplies a negative one by r for every token of the prompt or the output so
    # far; ``frequency_penalty`` f and ``presence_penalty`` p take f x (its count in the output)
    # and p (once it is there) off a token's logit, in that order; then ``min_p`` drops the
    # tokens less likely than min_p x the likeliest (sampled rows, after temperature and before
    # top-k and top-p, as vLLM: top-p weighs what min-p keeps)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); a dict is taken too

    def __post_init__(self) -> None:
        for name in ("max_tokens", "top_k", "min_tokens", "logprobs", "prompt_logprobs", "seed"):
            v = getattr(self, name)  # a float here passed the range checks and failed mid-step
            if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral)):
                raise ValueError(f"SamplingParams.{name}={v!r} is not an integer")
            object.__setattr__(self, name, None if v is None else int(v))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        checks = [
            ("max_tokens", self.max_tokens >= 0),
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0),
            ("top_p", math.isfinite(self.top_p) and 0 < self.top_p <= 1),
            ("top_k", self.top_k == -1 or self.top_k >= 0),
            ("logprobs", self.logprobs is None or self.logprobs >= 0),
            ("prompt_logprobs", self.prompt_logprobs is None or self.prompt_logprobs >= 0),
            ("min_tokens", self.min_tokens >= 0),
            # a negative id would index the vocabulary from its end (``Sampler.banned``)
            ("stop_token_ids", all(t >= 0 for t in self.stop_token_ids)),
            ("presence_penalty", math.isfinite(self.presence_penalty)),
            ("frequency_penalty", math.isfinite(self.frequency_penalty)),
            ("repetition_penalty", math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0),
            ("min_p", 0 <= self.min_p <= 1),
            ("logit_bias", all(t >= 0 and math.isfinite(b) for t, b in self.logit_bias)),
        ]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} is out of range")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalises(self) -> bool:
        """Whether the logits depend on the tokens so far (a penalty)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def processes_logits(self) -> bool:
        return self.penalises or bool(self.logit_bias)


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
