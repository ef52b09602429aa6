"""POST /v1/completions: prompts (text or token ids, one or many) in, text out, streamed or not.

``logprobs`` uses OpenAI's legacy shape (tokens, token_logprobs, top_logprobs, text_offset).
With ``echo`` the prompt comes first, and with ``logprobs`` too its tokens' log-probs, the first
``null``: what lm-eval's loglikelihood requests (``max_tokens`` 0 or 1) read. A token's
``text_offset`` indexes the choice's ``text``, streamed or not (``TextOffsets``).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from ft.sampling_params import Logprobs
from ft.server.detokenizer import IncrementalDetokenizer
from ft.server.generation import Choice, Generation, Update
from ft.server.protocol import CompletionRequest, parse
from ft.server.serving import ServerState, usage
from ft.server.tokenizer import Tokenizer

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint


async def create_completion(state: ServerState, request: Request) -> Response:
    req: CompletionRequest = parse(CompletionRequest, await request.body())  # type: ignore[assignment]
    state.check_model(req.model)
    max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    texts, prompts = await _prompts(state, req)
    for ids in prompts:
        state.check_prompt(ids, max_tokens)
    echo_logprobs = req.logprobs if req.echo else None
    params = state.sampling_params(req, max_tokens, req.logprobs, echo_logprobs)
    gen = state.generation("cmpl", prompts, params, req)
    if texts is None and req.echo:
        texts = [_decode(state.tokenizer, ids) for ids in prompts]
    writer = _Writer(state, req, gen, texts)
    if req.stream:
        return await state.stream(request, gen, writer.events())
    return await state.complete(request, gen, writer.body)


async def _prompts(state: ServerState, req: CompletionRequest) -> tuple[list[str] | None, list[list[int]]]:
    """(the prompts' texts when given as text, their token ids)"""
    p = req.prompt
    if isinstance(p, str) or (p and isinstance(p[0], str)):
        texts = [p] if isinstance(p, str) else list(p)
        return texts, [await state.encode(t, req.add_special_tokens) for t in texts]
    if p and isinstance(p[0], list):
        return None, [list(ids) for ids in p]
    return None, [list(p)]  # type: ignore[arg-type]


def _decode(tok: Tokenizer | None, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False) if tok is not None else ""


class _Writer:
    """Turns a Generation's choices and updates into completion bodies and stream chunks."""

    def __init__(self, state: ServerState, req: CompletionRequest, gen: Generation, texts) -> None:
        self.state, self.req, self.gen = state, req, gen
        self.tok = state.tokenizer
        self.echo_texts = texts if req.echo else None
        self._echoed: set[int] = set()
        skip = req.skip_special_tokens
        self._offsets = {c.index: TextOffsets(self.tok, skip) for c in gen.choices}  # streamed: each choice's

    def _header(self, obj: str) -> dict:
        return {"id": self.gen.id, "object": obj, "created": self.gen.created, "model": self.state.model_name}

    def _prompt_text(self, c: Choice) -> str:
        return self.echo_texts[c.index // self.req.n] if self.echo_texts is not None else ""

    def body(self) -> dict:
        choices = []
        for c in self.gen.choices:
            prefix = self._prompt_text(c)
            entry = {
                "index": c.index,
                "text": prefix + c.text.text,
                "logprobs": None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if self.req.logprobs is not None:
                offsets = TextOffsets(self.tok, self.req.skip_special_tokens)
                where = offsets.prompt(c.prompt_token_ids, prefix) if self.req.echo else []
                where += offsets.generated(c.token_ids)
                ids, lps = self._logprob_rows(c, c.token_ids, c.logprobs, echo=self.req.echo)
                entry["logprobs"] = legacy_logprobs(self.tok, ids, lps, where)
            if self.req.return_token_ids:
                entry["prompt_token_ids"], entry["token_ids"] = c.prompt_token_ids, c.token_ids
            choices.append(entry)
        return self._header("text_completion") | {"choices": choices, "usage": usage(self.gen)}

    def _logprob_rows(self, c: Choice, ids: list[int], lps, echo: bool):
        ids, rows = list(ids), list(lps or [])
        if echo:
            ids = c.prompt_token_ids + ids
            rows = list(c.prompt_logprobs or [None] * len(c.prompt_token_ids)) + rows
        return ids, rows

    async def events(self):
        include_usage = self.req.include_usage
        async for u in self.gen.updates():
            chunk = self._header("text_completion") | {"choices": [self._chunk_choice(u)]}
            if include_usage:
                chunk["usage"] = None
            yield chunk
        if include_usage:
            yield self._header("text_completion") | {"choices": [], "usage": usage(self.gen)}

    def _chunk_choice(self, u: Update) -> dict:
        c = u.choice
        text, ids, lps = u.text, u.token_ids, u.logprobs
        echo = self.req.echo and c.index not in self._echoed
        if echo:
            self._echoed.add(c.index)
            text = self._prompt_text(c) + text
        entry = {
            "index": c.index,
            "text": text,
            "logprobs": None,
            "finish_reason": c.finish_reason if u.finished else None,
        }
        if u.finished:
            entry["stop_reason"] = c.stop_reason
        if self.req.logprobs is not None:
            offsets = self._offsets[c.index]
            where = offsets.prompt(c.prompt_token_ids, self._prompt_text(c)) if echo else []
            where += offsets.generated(ids)
            ids, rows = self._logprob_rows(c, ids, lps, echo)
            entry["logprobs"] = legacy_logprobs(self.tok, ids, rows, where)
        if self.req.return_token_ids:
            entry["token_ids"] = u.token_ids
            if echo:
                entry["prompt_token_ids"] = c.prompt_token_ids
        return entry


class TextOffsets:
    """Where each token's text begins in a choice's ``text``, token by token as they come: an
    echoed prompt's tokens as the echo shows them (special tokens and all), then the generated
    ones as the answer shows them (special tokens skipped unless the request keeps them). The
    offsets follow the tokens, not the text a stream has released (a stop string's start is held
    back), so a stream's add up to the whole answer's; a token that is half a character shares
    its character's offset."""

    def __init__(self, tok: Tokenizer | None, skip_special_tokens: bool = True) -> None:
        self.tok, self.at = tok, 0
        self._detok = IncrementalDetokenizer(tok, skip_special_tokens) if tok is not None else None

    def prompt(self, ids: list[int], text: str) -> list[int]:
        """The echoed prompt's offsets; the generated text begins after ``text``, the echo."""
        if self.tok is None:
            return [0] * len(ids)
        offsets, _ = _walk(IncrementalDetokenizer(self.tok, skip_special_tokens=False), ids, 0)
        # a text prompt's echo lacks the special tokens the tokenizer added to it (a BOS)
        decoded = self.tok.decode(ids, skip_special_tokens=False)
        shift = len(decoded) - len(text) if decoded.endswith(text) else 0
        self.at = len(text)
        return [max(0, o - shift) for o in offsets]

    def generated(self, ids: list[int]) -> list[int]:
        if self._detok is None:
            return [self.at] * len(ids)
        offsets, self.at = _walk(self._detok, ids, self.at)
        return offsets


def _walk(detok: IncrementalDetokenizer, ids: list[int], at: int) -> tuple[list[int], int]:
    """Each token's offset from ``at`` as ``detok`` releases their text; and where the text ends."""
    offsets = []
    for tid in ids:
        offsets.append(at)
        at += len(detok.add([tid]))
    return offsets, at


def legacy_logprobs(
    tok: Tokenizer | None, ids: list[int], rows: list[Logprobs | None], offsets: list[int]
) -> dict:
    """OpenAI's completion log-probs: one entry per token; a row of None (the first prompt
    token has no prediction) gives null log-probs; ``offsets`` from ``TextOffsets``."""
    name = tok.token_text if tok is not None else (lambda t: f"token_id:{t}")
    tokens, token_logprobs, top = [], [], []
    for tid, row in zip(ids, rows):
        tokens.append(name(tid))
        token_logprobs.append(row.get(tid) if row is not None else None)
        top.append({name(t): lp for t, lp in sorted(row.items(), key=lambda kv: -kv[1])} if row else None)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
