"""``ft serve`` on the hybrid qwen3_next model, driven by the official ``openai`` client: answers
equal ``LLM.generate`` token for token, streamed or not, alone or 16 at once; echo + logprobs
(lm-eval's loglikelihood request); stop strings; a client that leaves mid-stream frees its KV at
once; every bad input gets its 4xx and the server keeps serving; metrics; ``ft bench serve``."""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
import pytest

from ft.cli import main as ft_main
from ft.sampling_params import SamplingParams
from ft.server.tokenizer import Tokenizer
from tests.server.harness import (
    MODEL,
    chat_ids,
    check_greedy_completions,
    check_shared_prefix,
    extra,
    greedy,
    make_model_dir,
    read_stream,
    read_stream_async,
    start_server,
    stream_concurrently,
    visible_text,
)
from tests.tiny_tokenizer import VOCAB_SIZE

PROMPTS = [[(i * 7 + k * 31) % 280 for i in range(5 + 3 * k)] for k in range(16)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("next"), "qwen3_next", seed=3)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "serve.log"
    s = start_server(model_dir, log, "--max-request-bytes", "100000", "--reasoning-parser", "qwen3")
    yield s
    assert s.stop(signal.SIGINT) == 0, s.output()
    assert "ft serve: stopped" in s.output()


def test_completions_match_llm(server, llm, tok):
    check_greedy_completions(server, llm, tok, [PROMPTS[3], "hello the world, 中文 😀"], max_tokens=12)


def test_chat_matches_llm(server, llm, tok):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    want = llm.generate([chat_ids(tok, messages)], greedy(10))[0]
    client = server.client()
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, extra_body={"return_token_ids": True}
    )
    c = r.choices[0]
    assert extra(c, "token_ids") == want.token_ids
    assert c.message.role == "assistant" and c.message.content == visible_text(tok, want)
    assert c.finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    s = read_stream(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_completion_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True},
        )
    )
    assert (s.token_ids, s.text, s.finish_reason) == (
        want.token_ids,
        visible_text(tok, want),
        want.finish_reason,
    )
    assert s.usage.total_tokens == len(want.prompt_token_ids) + len(want.token_ids)


def test_sixteen_concurrent_streams(server, llm, tok):
    lengths = [4 + k // 2 for k in range(16)]
    wants = llm.generate(PROMPTS, [greedy(n, ignore_eos=True) for n in lengths])

    for got, want in zip(stream_concurrently(server, MODEL, PROMPTS, lengths), wants):
        assert got.token_ids == want.token_ids
        assert got.text == tok.decode(want.token_ids, skip_special_tokens=True)
        assert got.finish_reason == "length"


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_match_prompt_logprobs(server, llm, tok, max_tokens):
    ids = PROMPTS[5]
    want = llm.generate([ids], greedy(1, prompt_logprobs=2, logprobs=2))[0]
    r = server.client().completions.create(
        model=MODEL, prompt=ids, max_tokens=max_tokens, temperature=0, echo=True, logprobs=2
    )
    lp = r.choices[0].logprobs
    names = Tokenizer(tok).token_text
    assert len(lp.tokens) == len(ids) + max_tokens
    assert lp.tokens[: len(ids)] == [names(t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for pos in range(1, len(ids)):
        row = want.prompt_logprobs[pos]
        assert abs(lp.token_logprobs[pos] - row[ids[pos]]) < 1e-4
        assert {names(t): v for t, v in row.items()}.keys() == lp.top_logprobs[pos].keys()
    if max_tokens:
        gen = want.token_ids[0]
        assert lp.tokens[-1] == names(gen)
        assert abs(lp.token_logprobs[-1] - want.logprobs[0][gen]) < 1e-4
    assert r.choices[0].text.startswith(tok.decode(ids))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == max_tokens


def test_text_offsets_index_the_text(server, tok):
    """A token's text_offset is where its text begins in the choice's text: the echoed prompt's
    special tokens count (the echo shows them), the answer begins after the echo, and a stream's
    offsets are the whole answer's though it holds back text that may begin a stop string."""
    prompt = "<|im_start|>hi there"
    ids = tok.encode(prompt)
    # every printable character may begin a stop string: the stream holds each back a while
    stop = [chr(c) + "\x00\x00\x00" for c in range(32, 127)]
    body = {
        "prompt": prompt,
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
        "echo": True,
        "logprobs": 0,
        "stop": stop,
    }
    whole = server.post(C, body).json()["choices"][0]
    offsets = whole["logprobs"]["text_offset"]
    echo = [len(tok.decode(ids[:i], skip_special_tokens=False)) for i in range(len(ids))]
    assert offsets[: len(ids)] == echo == [0, 12, 13, 14, 18]
    assert offsets[len(ids)] == len(prompt)
    streamed = server.post(C, body | {"stream": True})
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]] == offsets


def test_stop_string_is_cut_and_stops(server, llm, tok):
    ids = PROMPTS[7]
    full = llm.generate([ids], greedy(40, ignore_eos=True))[0]
    text = tok.decode(full.token_ids)
    # a character that first appears a few characters in, as the stop string
    cut = next(i for i in range(3, len(text)) if text[i].isalnum() and text.index(text[i]) == i)
    stop = text[cut]
    client = server.client()
    r = client.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=40,
        temperature=0,
        stop=[stop, "@@@@"],
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == text[:cut] and r.choices[0].finish_reason == "stop"
    s = read_stream(
        client.completions.create(
            model=MODEL,
            prompt=ids,
            max_tokens=40,
            temperature=0,
            stop=stop,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert s.text == text[:cut] and s.finish_reason == "stop"


def test_n_samples_with_seed(server, llm):
    ids = PROMPTS[2]
    r = server.client().completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=10,
        n=3,
        temperature=1.0,
        seed=7,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    for i, c in enumerate(r.choices):
        want = llm.generate(
            [ids], SamplingParams(max_tokens=10, temperature=1.0, seed=7 + i, ignore_eos=True)
        )
        assert extra(c, "token_ids") == want[0].token_ids
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 30


def test_penalties_and_logit_bias_reach_the_sampler(server, llm):
    """presence / frequency / repetition penalties, min_p and logit_bias from the request give the
    tokens ``LLM.generate`` gives for the same ``SamplingParams``."""
    ids = PROMPTS[1]
    knobs = dict(presence_penalty=0.5, frequency_penalty=1.5, repetition_penalty=1.3, min_p=0.05)
    openai_knobs = {k: knobs[k] for k in ("presence_penalty", "frequency_penalty")}  # the rest: extra_body
    extras = {"return_token_ids": True, "ignore_eos": True, "repetition_penalty": 1.3, "min_p": 0.05}
    bias = {"7": 5.0, "9": -100}
    r = server.client().completions.create(
        model=MODEL, prompt=ids, max_tokens=8, temperature=0.8, seed=3, logit_bias=bias, **openai_knobs,
        extra_body=extras,
    )  # fmt: skip
    params = SamplingParams(
        max_tokens=8, temperature=0.8, seed=3, ignore_eos=True, logit_bias={7: 5.0, 9: -100.0}, **knobs
    )
    want = llm.generate([ids], params)[0].token_ids
    assert extra(r.choices[0], "token_ids") == want and 9 not in want


def test_tokenize_and_detokenize(server, llm, tok):
    """/tokenize gives the ids the server runs for a prompt (special tokens added, as completions
    add them) or a chat (the template's, none added), with the context; /detokenize reverses it."""
    text = "hello the world, 中文 😀"
    r = server.post("/tokenize", {"model": MODEL, "prompt": text}).json()
    assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == server.client().models.list().data[0].model_extra["max_model_len"]
    messages = [{"role": "user", "content": "hello there"}]
    assert server.post("/tokenize", {"messages": messages}).json()["tokens"] == chat_ids(tok, messages)
    with_tools = tok.apply_chat_template(messages, tools=[TOOL], tokenize=False, add_generation_prompt=True)
    got = server.post("/tokenize", {"messages": messages, "tools": [TOOL]}).json()["tokens"]
    assert got == tok.encode(with_tools, add_special_tokens=False)  # what the chat runs with tools
    back = server.post("/detokenize", {"tokens": r["tokens"]}).json()["prompt"]
    assert back == tok.decode(r["tokens"], skip_special_tokens=False)
    for path, body, param in (
        ("/tokenize", {"prompt": "x", "messages": messages}, None),
        ("/tokenize", {}, None),
        ("/detokenize", {"tokens": [1, 10_000]}, "tokens"),
        ("/detokenize", {"tokens": "12"}, "tokens"),
    ):
        got = server.post(path, body)
        assert got.status_code == 400 and got.json()["error"]["param"] == param, (path, body, got.text)


def test_chat_template_kwargs_come_last(server, tok):
    """As in vLLM, ``chat_template_kwargs`` reach the template after the request's own arguments,
    so they may set ``add_generation_prompt`` too; a chat's prompt is then the template's with it."""
    messages = [{"role": "user", "content": "hello there"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    body = {"messages": messages, "chat_template_kwargs": {"add_generation_prompt": False}}
    r = server.post("/tokenize", body)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == tok.encode(text, add_special_tokens=False)
    r = server.post(X, HI | body | {"return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["prompt_token_ids"] == tok.encode(text, add_special_tokens=False)


def test_response_format_text_is_accepted(server):
    r = server.post(X, HI | {"response_format": {"type": "text"}})
    assert r.status_code == 200, r.text


def test_chat_tools_reach_the_template(server, llm, tok):
    """``tools`` are shown to the model through the chat template (the prompt is the template's
    with them), and the answer is the model's as without tools; ``tool_choice: none`` leaves them
    out of the prompt."""
    messages = [{"role": "user", "content": "weather in Paris?"}]
    client = server.client()
    for choice, shown in (("auto", True), ("none", False)):
        r = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, temperature=0, tools=[TOOL], tool_choice=choice,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )  # fmt: skip
        text = tok.apply_chat_template(messages, tools=[TOOL] if shown else None, tokenize=False,
                                       add_generation_prompt=True)  # fmt: skip
        ids = tok.encode(text, add_special_tokens=False)
        assert extra(r.choices[0], "prompt_token_ids") == ids and ("# Tools" in text) == shown
        want = llm.generate([ids], greedy(6, ignore_eos=True))[0]
        assert extra(r.choices[0], "token_ids") == want.token_ids


def test_chat_reasoning_apart(server, llm, tok):
    """With ``--reasoning-parser qwen3`` (this server's) a prompt that opens the reasoning (the
    template's ``enable_thinking``) has the whole answer, cut before ``</think>``, as
    ``reasoning_content`` and no content, whole and streamed; without it, content as ever."""
    messages = [{"role": "user", "content": "think about it"}]
    kwargs = {"enable_thinking": True}
    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs))
    want = tok.decode(llm.generate([ids], greedy(8, ignore_eos=True))[0].token_ids, skip_special_tokens=True)
    body = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    extra_body = {"chat_template_kwargs": kwargs, "ignore_eos": True}
    r = server.client().chat.completions.create(**body, extra_body=extra_body)
    message = r.choices[0].message
    assert extra(message, "reasoning_content") == want and message.content is None
    stream = server.client().chat.completions.create(**body, extra_body=extra_body, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(extra(d, "reasoning_content") or "" for d in deltas) == want
    assert not "".join(d.content or "" for d in deltas)


def test_chat_logprobs(server, llm, tok):
    messages = [{"role": "user", "content": "a b c"}]
    want = llm.generate([chat_ids(tok, messages)], greedy(6, logprobs=3, ignore_eos=True))[0]
    r = server.client().chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for entry, tok_id, row in zip(content, want.token_ids, want.logprobs):
        assert abs(entry.logprob - row[tok_id]) < 1e-4
        assert len(entry.top_logprobs) == 3
        best = sorted(row.values(), reverse=True)[:3]
        assert all(abs(a.logprob - b) < 1e-4 for a, b in zip(entry.top_logprobs, best))
    assert b"".join(bytes(e.bytes) for e in content).decode(errors="replace") == tok.decode(want.token_ids)


def test_disconnect_mid_stream_frees_kv(server, llm):
    idle = server.wait_idle()
    others = [PROMPTS[9], PROMPTS[10]]
    wants = llm.generate(others, greedy(40, ignore_eos=True))

    async def other(client, prompt):
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=40,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        return await read_stream_async(stream)

    async def leaver(client):
        stream = await client.completions.create(
            model=MODEL,
            prompt=PROMPTS[11],
            max_tokens=400,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        n = 0
        async for _ in stream:
            n += 1
            if n == 3:
                break
        await stream.close()

    async def run():
        client = server.async_client()
        return await asyncio.gather(other(client, others[0]), leaver(client), other(client, others[1]))

    got = asyncio.run(run())
    for g, want in zip([got[0], got[2]], wants):
        assert g.token_ids == want.token_ids
    after = server.wait_idle(timeout=10)
    assert after["ft_kv_cache_used_tokens"] == idle["ft_kv_cache_used_tokens"]
    assert after["ft_kv_cache_free_tokens"] == idle["ft_kv_cache_free_tokens"]
    aborted = 'ft_requests_total{finish_reason="abort"}'
    assert after.get(aborted, 0) == idle.get(aborted, 0) + 1
    # the leaver was stopped early, not run to its 400 tokens
    assert after["ft_generation_tokens_total"] - idle["ft_generation_tokens_total"] < 80 + 100


C, X = "/v1/completions", "/v1/chat/completions"
OK = {"model": MODEL, "prompt": [1, 2, 3]}
HI = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TOOL = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
BAD = {
    "malformed-json": (C, b'{"model": "tiny", "prompt": [1, 2', 400, None),
    "not-an-object": (C, b"[1, 2, 3]", 400, None),
    "prompt-wrong-type": (C, {"model": MODEL, "prompt": 5}, 400, "prompt"),
    "max-tokens-string": (C, OK | {"max_tokens": "ten"}, 400, "max_tokens"),
    "messages-wrong-type": (X, {"model": MODEL, "messages": "hi"}, 400, "messages"),
    "empty-prompt-text": (C, OK | {"prompt": ""}, 400, "prompt"),
    "empty-prompt-ids": (C, OK | {"prompt": []}, 400, "prompt"),
    "empty-messages": (X, {"model": MODEL, "messages": []}, 400, "messages"),
    "beyond-context": (C, OK | {"prompt": [1] * 500, "max_tokens": 100}, 400, "max_tokens"),
    # a prompt that no max_tokens makes fit names the prompt (a chat's: its messages), not max_tokens
    "prompt-beyond-context": (C, OK | {"prompt": [1] * 600}, 400, "prompt"),
    "prompt-fills-context": (C, OK | {"prompt": [1] * 512, "max_tokens": 1}, 400, "prompt"),
    "chat-beyond-context": (X, {"messages": [{"role": "user", "content": "a " * 600}]}, 400, "messages"),
    "temperature-negative": (C, OK | {"temperature": -1}, 400, "temperature"),
    "temperature-nan": (C, b'{"prompt": [1, 2], "temperature": NaN}', 400, "temperature"),
    "top-p-infinite": (C, b'{"prompt": [1, 2], "top_p": Infinity}', 400, "top_p"),
    "top-p-zero": (C, OK | {"top_p": 0}, 400, "top_p"),
    "top-k": (C, OK | {"top_k": -5}, 400, "top_k"),
    "n-zero": (C, OK | {"n": 0}, 400, "n"),
    "logprobs-too-many": (C, OK | {"logprobs": 50}, 400, "logprobs"),
    "max-tokens-negative": (C, OK | {"max_tokens": -1}, 400, "max_tokens"),
    "token-outside-vocab": (C, OK | {"prompt": [1, 100000]}, 400, "prompt"),
    "unknown-model": (C, OK | {"model": "gpt-4"}, 404, "model"),  # as OpenAI: the client's NotFoundError
    "unknown-model-chat": (X, HI | {"model": "gpt-4"}, 404, "model"),
    "presence-penalty-range": (C, OK | {"presence_penalty": 2.5}, 400, "presence_penalty"),
    "repetition-penalty-zero": (C, OK | {"repetition_penalty": 0}, 400, "repetition_penalty"),
    "min-p-range": (C, OK | {"min_p": 1.5}, 400, "min_p"),
    "logit-bias-key": (C, OK | {"logit_bias": {"a": 1}}, 400, "logit_bias"),
    "logit-bias-range": (C, OK | {"logit_bias": {"5": 101}}, 400, "logit_bias.5"),
    "logit-bias-outside-vocab": (C, OK | {"logit_bias": {"100000": 1}}, 400, "logit_bias"),
    "logit-bias-key-not-ascii": (C, OK | {"logit_bias": {"²": 1}}, 400, "logit_bias"),  # isdigit(), no int
    "logit-bias-key-huge": (C, OK | {"logit_bias": {"9" * 5000: 1}}, 400, "logit_bias"),  # past int()'s limit
    "top-logprobs-alone": (
        X,
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    "tool-choice-required": (X, HI | {"tools": [TOOL], "tool_choice": "required"}, 400, "tool_choice"),
    "tool-choice-named": (
        X,
        HI | {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "weather"}}},
        400,
        "tool_choice",
    ),
    "tool-without-name": (
        X,
        HI | {"tools": [{"type": "function", "function": {}}]},
        400,
        "tools.0.function.name",
    ),
    "tool-wrong-type": (X, HI | {"tools": [TOOL | {"type": "retrieval"}]}, 400, "tools.0.type"),
    "chat-template-kwargs-messages": (X, HI | {"chat_template_kwargs": {"messages": []}}, 400, "messages"),
    # a template of nested range(10**5) loops would render for ever
    "chat-template-replaced": (
        X,
        HI | {"chat_template_kwargs": {"chat_template": "{% for i in range(9) %}{{ i }}{% endfor %}"}},
        400,
        "chat_template_kwargs",
    ),
    "tokenize-template-replaced": (
        "/tokenize",
        {"prompt": "hi", "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
        400,
        "chat_template_kwargs",
    ),
    "response-format-json": (X, HI | {"response_format": {"type": "json_object"}}, 400, "response_format"),
    "min-tokens-over-max": (C, OK | {"max_tokens": 3, "min_tokens": 4}, 400, "min_tokens"),  # as vLLM
    "min-tokens-over-max-chat": (X, HI | {"max_completion_tokens": 2, "min_tokens": 5}, 400, "min_tokens"),
    "stream-options-unstreamed": (C, OK | {"stream_options": {"include_usage": True}}, 400, "stream_options"),
    "body-too-large": (C, json.dumps(OK | {"prompt": "a" * 200_000}).encode(), 413, None),
    "unknown-route": ("/v1/embeddings", OK, 404, None),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused_and_server_keeps_serving(server, llm, case):
    path, body, status, param = BAD[case]
    r = server.post(path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    want = llm.generate([[1, 2, 3]], greedy(4, ignore_eos=True))[0]
    ok = server.post(
        C, OK | {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["token_ids"] == want.token_ids


def test_prompt_beyond_the_context_says_so(server):
    """A chat without max_tokens whose prompt is longer than the context: the answer says the prompt
    is too long, not that a max_tokens the client never sent is."""
    r = server.post(X, {"messages": [{"role": "user", "content": "a " * 600}]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded", r.text
    assert "max_tokens" not in err["message"] and "longer than the model's context of 512" in err["message"]


BUT_7 = [t for t in range(VOCAB_SIZE) if t != 7]


@pytest.mark.parametrize(
    "extreme",
    [
        {"top_p": 1e-300},  # more than 0, as the check asks, but 0 in float32
        # a float32 inf: a banned token's -inf over it was NaN, and a row of NaN kept no token
        # either; every token but 7 banned until the end (min_tokens)
        {"temperature": 1e39, "min_tokens": 6, "top_p": 0.9, "stop_token_ids": BUT_7},
    ],
)
def test_sampling_extremes_keep_the_likeliest_and_the_engine_serving(server, llm, extreme):
    """top-p keeps at least the likeliest token, as vLLM's: it kept none here, and its threshold
    read index -1, which failed the step and so stopped the engine and the server. A temperature
    past float32's range divides as its largest: inf made the banned tokens NaN, which argmax took."""
    body = OK | {"prompt": PROMPTS[3], "max_tokens": 6, "temperature": 1.0, "return_token_ids": True}
    r = server.post(C, body | extreme)
    assert r.status_code == 200, r.text
    # only the likeliest kept: greedy's tokens; or the only one not banned
    want = [7] * 6 if "min_tokens" in extreme else llm.generate([PROMPTS[3]], greedy(6))[0].token_ids
    assert r.json()["choices"][0]["token_ids"] == want
    assert server.post(C, OK).status_code == 200


def test_models_health_metrics(server):
    assert [m.id for m in server.client().models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    m = server.metrics()
    for name in [
        "ft_num_requests_running",
        "ft_num_requests_waiting",
        "ft_kv_cache_used_tokens",
        "ft_kv_cache_free_tokens",
        "ft_prefix_cache_hit_tokens_total",
        "ft_prompt_tokens_total",
        "ft_generation_tokens_total",
        "ft_time_to_first_token_seconds_count",
        "ft_inter_token_latency_seconds_count",
    ]:
        assert name in m, name


def test_prefix_cache_hits_answer_as_misses(server, llm, tok):
    assert check_shared_prefix(server, llm, tok) > 0


def test_cached_tokens_count_each_prompt_once(server):
    """A prompt's n choices share it: usage counts its tokens once, and its cached tokens too (so
    never more than the prompt's), though every choice found them in the prefix cache."""
    ids = [(i * 13 + 5) % 280 for i in range(100)]
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "n": 4}
    assert server.post(C, body).status_code == 200  # the prompt is cached now
    usage = server.post(C, body).json()["usage"]
    assert usage["prompt_tokens"] == len(ids)
    assert 0 < usage["prompt_tokens_details"]["cached_tokens"] <= len(ids), usage


def test_bench_serve(server, tmp_path):
    out = tmp_path / "bench.json"
    code = ft_main(
        [
            "bench",
            "serve",
            "--base-url",
            server.url,
            "--model",
            MODEL,
            "--num-prompts",
            "6",
            "--concurrency",
            "3",
            "--input-len",
            "12",
            "--output-len",
            "5",
            "--output-json",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["output_tokens"] == 30
    for key in ["ttft_s", "itl_s", "e2e_s"]:
        assert set(result[key]) >= {"p50", "p90", "p99", "mean"}
    assert result["request_throughput"] > 0 and result["output_throughput"] > 0
