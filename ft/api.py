"""The offline Python API, in the shape vLLM users know.

from ft import LLM, SamplingParams
with LLM(model="path/to/checkpoint", tp_size=2, device="cpu", dtype="float32") as llm:
    outs = llm.generate(["some text", [1, 2, 3]], SamplingParams(max_tokens=16, temperature=0.0))
    reply = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=32))[0]
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from ft.config import TOKENIZER_FILES, EngineConfig
from ft.engine.engine import LLMEngine
from ft.generation_config import describe, sampling_defaults
from ft.sampling_params import RequestOutput, SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def load_tokenizer(path: str | None):
    """The checkpoint's tokenizer, or None when the directory has no tokenizer files."""
    if path is None or not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class LLM:
    def __init__(self, model: str | None = None, **options) -> None:
        self.config = EngineConfig(model=model, **options)
        defaults = sampling_defaults(self.config.generation_config, self.config.model)
        self.default_params = SamplingParams(**defaults)
        if defaults and self.config.progress:
            print(f"ft: {describe(defaults)}", flush=True)
        self.tokenizer = load_tokenizer(self.config.tokenizer or self.config.model)
        self.engine = LLMEngine(self.config)

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use without params: ft's defaults, with the checkpoint's
        generation_config.json over them (``generation_config``, ``ft.generation_config``)."""
        return self.default_params

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer files: pass prompts as lists of token ids")
            return self.tokenizer.encode(prompt)  # with its special tokens, as completions and vLLM do
        return [int(t) for t in prompt]

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = params or self.default_params
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        order: list[str] = []
        try:
            for p, sp in zip(prompts, plist):
                order.append(self.engine.add_request(self.encode(p), sp))
        except Exception:  # a bad prompt refuses the whole call: leave nothing queued behind
            for rid in order:
                self.engine.abort_request(rid)
            raise
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        self.engine.idle()  # the next call's first experts, staged while the caller reads these
        results = [final[r] for r in order]
        if self.tokenizer is not None:
            for out in results:
                out.text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        return results

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """``generate`` on conversations (one, or a list of them) through the tokenizer's chat
        template, as the server's chat endpoint builds their prompts (``chat_template_kwargs``:
        e.g. ``tools`` or ``enable_thinking``)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this checkpoint's tokenizer has no chat template: use generate")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            self.tokenizer.encode(
                self.tokenizer.apply_chat_template(
                    list(c), tokenize=False, add_generation_prompt=add_generation_prompt,
                    **(chat_template_kwargs or {}),
                ),
                add_special_tokens=False,
            )
            for c in conversations
        ]  # fmt: skip
        return self.generate(prompts, params)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass
