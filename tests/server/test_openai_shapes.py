"""The shapes and meanings of the server's answers as the ``openai`` client reads them, over a
scripted engine (``scripted.py``): which chunk says what, usage, log-probs, finish reasons, errors,
and how a conversation the client sends back reaches the chat template."""

from __future__ import annotations

import json

import openai
import pytest

from ft.server.app import build_app
from ft.server.metrics import Metrics
from ft.server.serving import ServerState
from tests.server.scripted import EOS, MODEL, ScriptedEngine, client, collect, make_app, raw, run, tokenizer

TOK = tokenizer()
HI = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


def ids(text: str) -> list[int]:
    return TOK.encode(text, False)


def test_streams_open_with_the_role_and_end_with_usage_alone():
    """Chat: each choice's first chunk is the assistant's role; every choice's finish reason comes
    on its own last chunk; with include_usage every chunk has usage null but the last, which has
    no choices and counts the prompt once and every choice's tokens."""
    app, _ = make_app(ids("hello world") + [EOS])

    async def main():
        stream = await client(app).chat.completions.create(
            model=MODEL, messages=HI, n=2, stream=True, stream_options={"include_usage": True}
        )
        return await collect(stream)

    chunks = run(main())
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    firsts = {}
    for c in chunks:
        for ch in c.choices:
            firsts.setdefault(ch.index, ch.delta)
    assert {i: (d.role, d.content) for i, d in firsts.items()} == {0: ("assistant", ""), 1: ("assistant", "")}
    *body, last = chunks
    assert all(c.usage is None and len(c.choices) == 1 for c in body)
    for i in (0, 1):
        mine = [c.choices[0] for c in body if c.choices[0].index == i]
        assert "".join(ch.delta.content or "" for ch in mine) == "hello world"
        assert [ch.finish_reason for ch in mine] == [None] * (len(mine) - 1) + ["stop"]
    assert last.choices == [] and last.usage.completion_tokens == 2 * (len(ids("hello world")) + 1)
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens


def test_a_stream_never_shows_part_of_a_stop_string():
    """A stop string that spans tokens is cut from the text, and no chunk shows its beginning."""
    app, _ = make_app(ids("hello world, the end") + [EOS])

    async def main():
        stream = await client(app).completions.create(
            model=MODEL, prompt="x", max_tokens=30, stream=True, stop=["orld,"]
        )
        return await collect(stream)

    chunks = run(main())
    assert "".join(c.choices[0].text for c in chunks) == "hello w"  # what was sent stays sent
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_assistant_tool_calls_reach_the_template_with_their_arguments_as_objects():
    """A conversation sent back with the assistant's calls (``arguments`` as OpenAI sends them,
    JSON text) shows the template each call's arguments as an object, as vLLM and transformers'
    tool-use templates expect: a template writing ``arguments | tojson`` gets the JSON once, not a
    quoted string of it."""
    template = (
        "{% for m in messages %}{{ m.content or '' }}{% for c in m.tool_calls or [] %}"
        "<call>{{ c.function.arguments | tojson }}</call>{% endfor %}{% endfor %}"
    )
    call = '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'
    app, _ = make_app(ids(call) + [EOS])
    app.state.ft.tokenizer.hf.chat_template = template

    async def main():
        c = client(app)
        first = await c.chat.completions.create(model=MODEL, messages=HI, tools=[TOOL], max_tokens=99)
        message = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls" and message.tool_calls[0].function.name
        again = HI + [message.model_dump(exclude_none=True)]
        body = {"messages": again, "tools": [TOOL]}
        return (await raw(app).post("/tokenize", json=body)).json()["tokens"]

    prompt = TOK.decode(run(main()))
    assert prompt.startswith("hi<call>") and prompt.endswith("</call>"), prompt
    assert json.loads(prompt.removeprefix("hi<call>").removesuffix("</call>")) == {"city": "Paris"}


def test_a_limit_too_long_is_named_as_the_client_sent_it():
    """A chat whose max_completion_tokens passes the context, or is under its min_tokens: the 400
    (the client's BadRequestError) names max_completion_tokens, the field the client sent."""
    app, _ = make_app(ids("x"))

    async def refused(**kw) -> dict:
        with pytest.raises(openai.BadRequestError) as e:
            await client(app).chat.completions.create(model=MODEL, messages=HI, **kw)
        return e.value.body

    e = run(refused(max_completion_tokens=600))
    assert e["param"] == "max_completion_tokens" and e["code"] == "context_length_exceeded"
    assert "max_completion_tokens (600)" in e["message"] and "512" in e["message"], e
    e = run(refused(max_completion_tokens=2, extra_body={"min_tokens": 3}))
    assert e["param"] == "min_tokens" and "max_completion_tokens (2)" in e["message"], e


def test_suffix_is_refused_saying_why():
    app, _ = make_app(ids("x"))

    async def main():
        with pytest.raises(openai.BadRequestError) as e:
            await client(app).completions.create(model=MODEL, prompt="def f(", suffix="return 1")
        return e.value.body

    e = run(main())
    assert e["param"] == "suffix" and "not supported" in e["message"], e


def test_completion_choices_stream_as_they_answer_whole():
    """Two prompts, n=2, echo and log-probs: choice p*n+i answers prompt p, streamed or not; a
    stream's chunks per index add up to the whole answer's text and tokens; usage counts each
    prompt once and every choice's tokens."""
    app, _ = make_app(lambda prompt: prompt[::-1] + [EOS])
    body = dict(model=MODEL, prompt=["ab", "cde"], max_tokens=3, n=2, echo=True, logprobs=1)

    async def main():
        c = client(app)
        whole = await c.completions.create(**body)
        stream = await c.completions.create(**body, stream=True, stream_options={"include_usage": True})
        return whole, await collect(stream)

    whole, chunks = run(main())
    assert [(ch.index, ch.text, ch.finish_reason) for ch in whole.choices] == [
        (0, "abba", "stop"), (1, "abba", "stop"), (2, "cdeedc", "length"), (3, "cdeedc", "length")
    ]  # fmt: skip
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (5, 12)
    for want in whole.choices:
        mine = [ch for c in chunks for ch in c.choices if ch.index == want.index]
        assert "".join(ch.text for ch in mine) == want.text
        assert [t for ch in mine for t in ch.logprobs.tokens] == want.logprobs.tokens
        assert [ch.finish_reason for ch in mine][-1] == want.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_text_parts_reach_the_template_a_line_apart():
    """A message's content as a list of text parts is one text, the parts joined by newlines, as
    vLLM joins them: the same request gives the same prompt."""
    app, engine = make_app(ids("ok") + [EOS])
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]

    async def main():
        await client(app).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}])

    run(main())
    prompt = TOK.decode(engine.added[0][1], skip_special_tokens=False)
    assert "<|im_start|>user\none\ntwo<|im_end|>" in prompt, prompt


def test_max_completion_tokens_0_gives_way_to_max_tokens():
    """vLLM takes ``max_completion_tokens or max_tokens``: a 0 there leaves max_tokens in force."""
    app, engine = make_app(ids("abcdef"))

    async def main():
        return await client(app).chat.completions.create(
            model=MODEL, messages=HI, max_completion_tokens=0, max_tokens=3
        )

    answer = run(main())
    assert engine.added[0][2].max_tokens == 3
    assert answer.choices[0].message.content == "abc" and answer.choices[0].finish_reason == "length"


def test_stop_token_ids_outside_the_vocabulary_are_refused():
    """A stop token the model cannot emit is the client's mistake: a 400 naming the field and the
    id, on both endpoints, before anything reaches the engine."""
    app, engine = make_app(ids("x"))

    async def main():
        c, extra = client(app), {"stop_token_ids": [5, 100000]}
        with pytest.raises(openai.BadRequestError) as chat:
            await c.chat.completions.create(model=MODEL, messages=HI, extra_body=extra)
        with pytest.raises(openai.BadRequestError) as completion:
            await c.completions.create(model=MODEL, prompt="x", extra_body=extra)
        return chat.value.body, completion.value.body

    for e in run(main()):
        assert e["param"] == "stop_token_ids" and "100000" in e["message"] and "5," not in e["message"], e
    assert engine.added == []


def test_stop_strings_without_a_tokenizer_are_refused():
    """A checkpoint without a tokenizer has no text to find a stop string in: the request is
    refused, as vLLM refuses it without detokenizing (it ran to max_tokens, the stop ignored)."""
    engine = ScriptedEngine(lambda _prompt: [5, 6, 7, 8])
    app = build_app(ServerState(engine, None, Metrics(MODEL, lambda: {}), MODEL))

    async def main():
        async with raw(app) as c:
            body = {"prompt": [1, 2], "max_tokens": 4}
            refused = await c.post("/v1/completions", json=body | {"stop": ["x"]})
            served = await c.post("/v1/completions", json=body | {"stop": "", "stop_token_ids": [7]})
            return refused, served

    refused, served = run(main())
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stop", refused.text
    assert served.status_code == 200 and served.json()["choices"][0]["finish_reason"] == "stop", served.text
    assert len(engine.added) == 1


def test_a_chat_stream_sends_no_empty_chunks():
    """While text is held back (the start of a stop string here) no chunk is sent, as in vLLM: every
    chunk but the role's first and the finish reason's last has content. The held tokens' ids and
    log-probs come with the next chunk, so a stream's still add up to the whole answer's."""
    app, _ = make_app(ids("hello world. the end") + [EOS])
    body = dict(
        model=MODEL, messages=HI, stop=["world!"], logprobs=True, extra_body={"return_token_ids": True}
    )

    async def main():
        c = client(app)
        whole = await c.chat.completions.create(**body)
        return whole, await collect(await c.chat.completions.create(**body, stream=True))

    whole, chunks = run(main())
    first, *middle, last = [c.choices[0] for c in chunks]
    assert first.delta.role == "assistant" and last.finish_reason == "stop"
    assert all(ch.delta.content for ch in middle) and len(middle) < len(whole.choices[0].token_ids) - 1
    streamed = middle + [last]
    assert "".join(ch.delta.content or "" for ch in streamed) == "hello world. the end"
    assert [t for ch in streamed for t in ch.token_ids] == whole.choices[0].token_ids
    assert [t for ch in streamed for t in ch.logprobs.content] == whole.choices[0].logprobs.content


def test_include_stop_str_in_output_keeps_what_stopped_the_text():
    """vLLM's include_stop_str_in_output: the stop string that ended a choice stays at the end of
    its text, streamed or not, chat or completion; so does a stop token's text."""
    app, _ = make_app(ids("hello world, the end") + [EOS])
    keep = {"include_stop_str_in_output": True}
    cases = [dict(stop=["orld"], extra_body=keep), dict(extra_body=keep | {"stop_token_ids": ids(",")})]

    async def texts(c, kw) -> tuple[str, str, str]:
        whole = await c.completions.create(model=MODEL, prompt="x", max_tokens=30, **kw)
        stream = await c.completions.create(model=MODEL, prompt="x", max_tokens=30, stream=True, **kw)
        chat = await c.chat.completions.create(model=MODEL, messages=HI, stream=True, **kw)
        return (
            whole.choices[0].text,
            "".join(ch.choices[0].text for ch in await collect(stream)),
            "".join(ch.choices[0].delta.content or "" for ch in await collect(chat)),
        )

    async def main():
        c = client(app)
        return [await texts(c, kw) for kw in cases]

    assert run(main()) == [("hello world",) * 3, ("hello world,",) * 3]


def test_skip_special_tokens_false_keeps_their_text():
    """vLLM's skip_special_tokens: by default a special token has no text; false keeps it, and the
    log-probs' text offsets follow. The stop token stays out unless include_stop_str_in_output;
    spaces_between_special_tokens changes nothing (no space either way, as vLLM's fast-tokenizer
    detokenizer) but a value that is not a bool is named."""
    start = TOK.hf.convert_tokens_to_ids("<|im_start|>")
    app, _ = make_app(ids("a") + [start] + ids("b") + [EOS])

    async def texts(c, extra) -> list[str]:
        kw = dict(model=MODEL, prompt="x", max_tokens=9, logprobs=0, extra_body=extra)
        whole = await c.completions.create(**kw)
        stream = await c.completions.create(**kw, stream=True)
        chat = await c.chat.completions.create(model=MODEL, messages=HI, stream=True, extra_body=extra)
        assert whole.choices[0].logprobs.text_offset[2] == len(whole.choices[0].text.split("b")[0])
        return [
            whole.choices[0].text,
            "".join(ch.choices[0].text for ch in await collect(stream)),
            "".join(ch.choices[0].delta.content or "" for ch in await collect(chat)),
        ]

    async def main():
        c, keep = client(app), {"skip_special_tokens": False, "spaces_between_special_tokens": False}
        out = [
            await texts(c, {}),
            await texts(c, keep),
            await texts(c, keep | {"include_stop_str_in_output": True}),
        ]
        with pytest.raises(openai.BadRequestError) as e:
            await c.completions.create(
                model=MODEL, prompt="x", extra_body={"spaces_between_special_tokens": "no"}
            )
        return out, e.value.body

    out, e = run(main())
    assert out == [["ab"] * 3, ["a<|im_start|>b"] * 3, ["a<|im_start|>b<|im_end|>"] * 3]
    assert e["param"] == "spaces_between_special_tokens", e


def test_stop_reason_says_what_ended_a_choice():
    """vLLM's stop_reason, on a choice and on a stream's last chunk for it: the stop string or the
    stop_token_ids id that ended the choice; null for eos (even one listed in stop_token_ids, as
    vLLM checks eos first) and for a length."""
    app, _ = make_app(ids("hello world, the end") + [EOS])
    comma = ids(",")[0]
    cases = {
        "orld": dict(stop=["orld"]),
        comma: dict(extra_body={"stop_token_ids": [comma]}),
        None: dict(extra_body={"stop_token_ids": [EOS]}),
        "length": dict(max_tokens=2),
    }

    async def reasons(c, kw) -> set:
        kw = {"max_tokens": 30} | kw
        whole = await c.completions.create(model=MODEL, prompt="x", **kw)
        stream = await collect(await c.completions.create(model=MODEL, prompt="x", stream=True, **kw))
        chat = await c.chat.completions.create(model=MODEL, messages=HI, **kw)
        chunks = await collect(await c.chat.completions.create(model=MODEL, messages=HI, stream=True, **kw))
        assert "stop_reason" not in (stream[0].choices[0].model_extra or {})  # not a last chunk
        finals = [whole.choices[0], stream[-1].choices[0], chat.choices[0], chunks[-1].choices[0]]
        return {ch.model_extra["stop_reason"] for ch in finals}

    async def main():
        c = client(app)
        return {want: await reasons(c, kw) for want, kw in cases.items()}

    assert run(main()) == {"orld": {"orld"}, comma: {comma}, None: {None}, "length": {None}}
