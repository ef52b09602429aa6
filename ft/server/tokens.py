"""POST /tokenize and /detokenize (vLLM's routes): a prompt, or a chat's messages through the chat
template, as the token ids the server would run, and token ids back to text. For clients that
count or cut prompts to the context (``max_model_len`` comes with the count) without the model's
tokenizer at hand."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ft.server.protocol import DetokenizeRequest, TokenizeRequest, parse
from ft.server.serving import ServerState


async def tokenize(state: ServerState, request: Request) -> Response:
    req: TokenizeRequest = parse(TokenizeRequest, await request.body())  # type: ignore[assignment]
    state.check_model(req.model)
    text, special = req.prompt, req.add_special_tokens
    if req.messages is not None:
        messages = [m.for_template() for m in req.messages]
        text = await state.chat_prompt(messages, req.add_generation_prompt, req.template_kwargs())
    ids = await state.encode(text, special if special is not None else req.messages is None)
    return JSONResponse({"count": len(ids), "max_model_len": state.info.max_request_tokens, "tokens": ids})


async def detokenize(state: ServerState, request: Request) -> Response:
    req: DetokenizeRequest = parse(DetokenizeRequest, await request.body())  # type: ignore[assignment]
    state.check_model(req.model)
    state.check_token_ids(req.tokens, "tokens")
    tok = state.need_tokenizer("detokenizing")
    return JSONResponse({"prompt": tok.decode(req.tokens, skip_special_tokens=False)})
