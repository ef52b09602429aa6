"""POST /v1/chat/completions: messages through the tokenizer's chat template, then generation.

``logprobs: true`` with ``top_logprobs: k`` gives OpenAI's per-token entries (token, logprob,
bytes, top_logprobs). Without ``max_tokens`` a chat may run to the end of the context (or to the
checkpoint's ``max_new_tokens``, ``ft.generation_config``). With
``tools`` the template shows the model the functions and the answer's calls come back as
``tool_calls`` (``tool_calls.py``: the Hermes format of Qwen's templates), finish reason
``tool_calls``; streamed, each call is one delta once its block is complete. With
``--reasoning-parser`` a thinking model's reasoning comes back apart, as ``reasoning_content``
(``reasoning.py``), and only the answer is parsed for calls.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from ft.sampling_params import Logprobs
from ft.server.generation import Generation, Update
from ft.server.protocol import APIError, ChatCompletionRequest, parse
from ft.server.reasoning import ReasoningStream, split_reasoning, thinks
from ft.server.serving import ServerState, usage
from ft.server.tokenizer import Tokenizer
from ft.server.tool_calls import ToolCallStream, parse_tool_calls


async def create_chat_completion(state: ServerState, request: Request) -> Response:
    req: ChatCompletionRequest = parse(ChatCompletionRequest, await request.body())  # type: ignore[assignment]
    state.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    messages = [m.for_template() for m in req.messages]
    prompt = await state.chat_prompt(messages, req.add_generation_prompt, req.template_kwargs())
    ids = await state.encode(prompt, req.add_special_tokens)
    # vLLM's rule: max_completion_tokens when it is more than 0, else max_tokens
    limit = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    max_tokens = req.max_completion_tokens or req.max_tokens
    if max_tokens is None:
        max_tokens = state.chat_max_tokens(len(ids))
    state.check_prompt(ids, max_tokens, "messages", limit)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = state.sampling_params(req, max_tokens, logprobs, limit=limit)
    gen = state.generation("chatcmpl", [ids], params, req)
    writer = _Writer(state, req, gen, thinks(prompt) if state.reasoning_parser else None)
    if req.stream:
        return await state.stream(request, gen, writer.events())
    return await state.complete(request, gen, writer.body)


class _Writer:
    def __init__(
        self, state: ServerState, req: ChatCompletionRequest, gen: Generation, thinking: bool | None = None
    ) -> None:
        """``thinking``: None without a reasoning parser, else whether the prompt leaves the model
        in its reasoning (``reasoning.thinks``)."""
        self.state, self.req, self.gen, self.thinking = state, req, gen, thinking
        # each choice's reasoning and calls as its text streams (``events``)
        indices = [c.index for c in gen.choices]
        self.reasoning = {i: ReasoningStream(thinking) for i in indices} if thinking is not None else {}
        self.most_calls = 1 if req.parallel_tool_calls is False else None
        self.calls = {i: ToolCallStream(self.most_calls) for i in indices} if req.calls_tools else {}
        self._held: dict[int, tuple[list[int], list[Logprobs]]] = {}  # a stream's tokens of no chunk yet

    def _header(self, obj: str) -> dict:
        return {"id": self.gen.id, "object": obj, "created": self.gen.created, "model": self.state.model_name}

    def _logprobs(self, ids: list[int], rows: list[Logprobs] | None) -> dict | None:
        if not self.req.logprobs:
            return None
        return {"content": chat_logprobs(self.state.tokenizer, ids, rows or [], self.req.top_logprobs or 0)}

    def body(self) -> dict:
        choices = []
        for c in self.gen.choices:
            text, finish = c.text.text, c.finish_reason
            reasoning, calls = None, []
            if self.thinking is not None:
                reasoning, text = split_reasoning(text, self.thinking)
            if self.req.calls_tools:
                text, calls = parse_tool_calls(text, self.most_calls)
            message = {"role": "assistant", "content": text if text or reasoning is None else None}
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = [call.as_dict() for call in calls]
                finish = "tool_calls" if finish == "stop" else finish
            entry = {
                "index": c.index,
                "message": message,
                "logprobs": self._logprobs(c.token_ids, c.logprobs),
                "finish_reason": finish,
                "stop_reason": c.stop_reason,
            }
            if self.req.return_token_ids:
                entry["prompt_token_ids"], entry["token_ids"] = c.prompt_token_ids, c.token_ids
            choices.append(entry)
        return self._header("chat.completion") | {"choices": choices, "usage": usage(self.gen)}

    async def events(self):
        extra = {"usage": None} if self.req.include_usage else {}
        # the assistant's role first, once per choice (as OpenAI does)
        for c in self.gen.choices:
            first = {
                "index": c.index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            yield self._header("chat.completion.chunk") | {"choices": [first]} | extra
        async for u in self.gen.updates():
            choice = self._chunk_choice(u)
            if choice is not None:
                yield self._header("chat.completion.chunk") | {"choices": [choice]} | extra
        if self.req.include_usage:
            yield self._header("chat.completion.chunk") | {"choices": [], "usage": usage(self.gen)}

    def _chunk_choice(self, u: Update) -> dict | None:
        """The choice's chunk, or None while it has nothing to say (text held back as the start of
        a tag or a stop string, as vLLM sends no chunk then): its tokens go with the next one."""
        text, finish = u.text, u.choice.finish_reason if u.finished else None
        delta = {}
        thoughts = self.reasoning.get(u.choice.index)
        if thoughts is not None:  # the reasoning apart, as far as it cannot be a tag
            reasoning, text = thoughts.feed(text)
            if u.finished:
                more = thoughts.finish()
                reasoning, text = reasoning + more[0], text + more[1]
            if reasoning:
                delta["reasoning_content"] = reasoning
        stream = self.calls.get(u.choice.index)
        if stream is not None:  # content released as far as it cannot start a call; calls whole
            text, calls = stream.feed(text)
            if u.finished:
                text += stream.finish()
                finish = "tool_calls" if stream.calls and finish == "stop" else finish
            if calls:
                delta["tool_calls"] = [c.as_dict(stream.calls - len(calls) + i) for i, c in enumerate(calls)]
        if text:
            delta = {"content": text} | delta
        ids, rows = self._held.pop(u.choice.index, ([], []))
        ids, rows = ids + u.token_ids, rows + (u.logprobs or [])
        if not (delta or u.finished):
            self._held[u.choice.index] = ids, rows
            return None
        entry = {
            "index": u.choice.index,
            "delta": delta,
            "logprobs": self._logprobs(ids, rows),
            "finish_reason": finish,
        }
        if u.finished:
            entry["stop_reason"] = u.choice.stop_reason
        if self.req.return_token_ids:
            entry["token_ids"] = ids
        return entry


def chat_logprobs(tok: Tokenizer | None, ids: list[int], rows: list[Logprobs], top: int) -> list[dict]:
    def item(t: int, lp: float) -> dict:
        if tok is None:
            return {"token": f"token_id:{t}", "logprob": lp, "bytes": None}
        return {"token": tok.token_text(t), "logprob": lp, "bytes": list(tok.token_bytes(t))}

    out = []
    for tid, row in zip(ids, rows):
        best = sorted(row.items(), key=lambda kv: -kv[1])[:top]
        out.append(item(tid, row[tid]) | {"top_logprobs": [item(t, lp) for t, lp in best]})
    return out
