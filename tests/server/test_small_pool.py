"""``ft serve`` with a KV pool too small for its requests at once (4 blocks of 16 tokens, two
running at most), prefill in chunks of 8 tokens, no prefix cache, an API key and a waiting-queue
limit: every request still completes with ``LLM.generate``'s tokens (one-shot prefill, roomy
pool); a full queue answers 503 with Retry-After; a missing or wrong key answers 401."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.server.harness import (
    MODEL,
    check_greedy_completions,
    check_shared_prefix,
    extra,
    greedy,
    make_model_dir,
    start_server,
    stream_concurrently,
)

KEY = "sk-test-key"
MAX_WAITING = 6
PROMPTS = [[(i * 13 + k * 29) % 280 for i in range(6 + 5 * k)] for k in range(MAX_WAITING)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("next"), "qwen3_next", seed=5)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    flags = [
        "--num-tokens",
        "64",
        "--max-running-requests",
        "2",
        "--chunked-prefill-size",
        "8",
        "--disable-prefix-cache",
        "--max-waiting-requests",
        str(MAX_WAITING),
    ]
    s = start_server(model_dir, tmp_path_factory.mktemp("log") / "serve.log", *flags, api_key=KEY)
    yield s
    assert s.stop() == 0, s.output()


def test_pool_too_small_for_all_still_completes_every_request(server, llm):
    lengths = [24 - 2 * k for k in range(len(PROMPTS))]  # prompt + output: 30 to 41 tokens, 2-3 blocks
    wants = llm.generate(PROMPTS, [greedy(n, ignore_eos=True) for n in lengths])

    for got, want in zip(stream_concurrently(server, MODEL, PROMPTS, lengths), wants):
        assert got.token_ids == want.token_ids and got.finish_reason == "length"
    assert server.wait_idle()["ft_kv_cache_used_tokens"] == 0


def test_chunked_prefill_equals_one_shot(server, llm, tok):
    long_prompt = [(i * 17 + 3) % 280 for i in range(41)]  # six chunks of 8 tokens, the last of 1
    check_greedy_completions(server, llm, tok, [long_prompt, "the cat sat on the mat again"], max_tokens=8)


def test_chunked_prefill_prompt_logprobs(server, llm):
    ids = [(i * 11 + 5) % 280 for i in range(30)]
    want = llm.generate([ids], greedy(1, prompt_logprobs=1))[0]
    r = server.client().completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    got = r.choices[0].logprobs.token_logprobs
    assert got[0] is None
    assert all(abs(got[i] - want.prompt_logprobs[i][ids[i]]) < 1e-4 for i in range(1, len(ids)))


def test_a_request_that_fills_the_pool_is_served_and_one_beyond_is_400(server, llm):
    """The 64-token pool holds a 60-token prompt and 5 tokens (the last is never cached) and, alone, a
    64-token prompt's log-probs; one token more of either is a 400 naming the field."""
    ids = [(i * 19 + 2) % 280 for i in range(65)]
    want = llm.generate([ids[:60]], greedy(5, ignore_eos=True))[0]
    client = server.client()
    r = client.completions.create(
        model=MODEL,
        prompt=ids[:60],
        max_tokens=5,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert extra(r.choices[0], "token_ids") == want.token_ids
    r = client.completions.create(model=MODEL, prompt=ids[:64], max_tokens=0, echo=True, logprobs=1)
    assert len(r.choices[0].logprobs.token_logprobs) == 64
    for prompt, max_tokens, param in ((ids[:60], 6, "max_tokens"), (ids, 0, "prompt")):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
        got = httpx.post(
            f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
        )
        assert got.status_code == 400 and got.json()["error"]["param"] == param, got.text


def test_shared_prefix_without_cache(server, llm, tok):
    assert check_shared_prefix(server, llm, tok) == 0


def test_full_queue_answers_503_with_retry_after(server, llm):
    prompts = [[(i * 7 + k) % 280 for i in range(10)] for k in range(16)]
    auth = {"Authorization": f"Bearer {KEY}"}

    async def one(client, prompt):
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": 20,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        return await client.post(f"{server.url}/v1/completions", json=body, headers=auth)

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    answers = asyncio.run(run())
    busy = [r for r in answers if r.status_code == 503]
    done = [(p, r) for p, r in zip(prompts, answers) if r.status_code == 200]
    assert busy and done and len(busy) + len(done) == len(prompts)
    for r in busy:
        assert r.headers["retry-after"] and r.json()["error"]["code"] == "queue_full"
    for p, r in done:
        want = llm.generate([p], greedy(20, ignore_eos=True))[0]
        assert r.json()["choices"][0]["token_ids"] == want.token_ids
    server.wait_idle()


@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_missing_or_wrong_api_key_is_401(server, key):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key or "unused", max_retries=0)
    if key is None:
        r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": [1, 2]})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    else:
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=2)
    assert httpx.get(f"{server.url}/health").status_code == 200  # probes need no key
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "x"}).status_code == 401  # the rest does
    r = server.client().completions.create(
        model=MODEL, prompt=[1, 2], max_tokens=2, extra_body={"return_token_ids": True}
    )
    assert len(extra(r.choices[0], "token_ids")) == 2
