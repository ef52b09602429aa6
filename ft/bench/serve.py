"""``ft bench serve``: a load client for any OpenAI-compatible server (ft's, vLLM's, SGLang's).

It sends ``num_prompts`` streamed completions of random tokens, ``concurrency`` at a time, and
measures on the client's clock: time to first token (TTFT), the gaps between streamed chunks
(inter-token latency, ITL), end-to-end latency, and request and token throughput over the whole
run. Prompts go as token-id lists (exactly ``input_len`` tokens) or, with a tokenizer, as the text
of random tokens. Output lengths are fixed with ``ignore_eos`` (vLLM's extension; ft's too).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np


@dataclass(frozen=True)
class BenchConfig:
    base_url: str
    num_prompts: int = 100
    concurrency: int = 8
    input_len: int = 512
    output_len: int = 128
    model: str | None = None  # default: the first model the server lists
    prompt_format: str = "ids"  # ids | text
    tokenizer: str | None = None  # for prompt_format "text"
    vocab_size: int | None = None  # token ids are drawn below this (default: the server's, else 1000)
    temperature: float = 0.0
    seed: int = 0
    api_key: str | None = None
    timeout_s: float = 600.0


@dataclass
class RequestResult:
    ok: bool
    input_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    e2e: float = 0.0
    error: str | None = None


async def run(cfg: BenchConfig) -> dict:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency)
    async with httpx.AsyncClient(
        base_url=cfg.base_url.rstrip("/"), headers=headers, limits=limits, timeout=cfg.timeout_s
    ) as client:
        model, vocab = await _discover(client, cfg)
        prompts = make_prompts(cfg, vocab)
        gate = asyncio.Semaphore(cfg.concurrency)

        async def one(prompt) -> RequestResult:
            async with gate:
                return await _request(client, cfg, model, prompt)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        duration = time.perf_counter() - start
    return summarize(cfg, model, results, duration)


async def _discover(client: httpx.AsyncClient, cfg: BenchConfig) -> tuple[str, int]:
    cards = []
    try:
        r = await client.get("/v1/models")
        if r.status_code == 200:
            cards = r.json().get("data", [])
    except httpx.HTTPError:
        pass
    model = cfg.model or (cards[0]["id"] if cards else None)
    if model is None:
        raise SystemExit("ft bench serve: the server lists no model: give --model")
    card = next((c for c in cards if c.get("id") == model), {})
    return model, cfg.vocab_size or int(card.get("vocab_size") or 1000)


def make_prompts(cfg: BenchConfig, vocab: int) -> list[list[int] | str]:
    rng = random.Random(cfg.seed)
    ids = [[rng.randrange(vocab) for _ in range(cfg.input_len)] for _ in range(cfg.num_prompts)]
    if cfg.prompt_format == "ids":
        return ids  # type: ignore[return-value]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.tokenizer)
    return [tok.decode(p, skip_special_tokens=True) for p in ids]


async def _request(client: httpx.AsyncClient, cfg: BenchConfig, model: str, prompt) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": cfg.output_len,
        "temperature": cfg.temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res = RequestResult(ok=False, input_tokens=len(prompt) if isinstance(prompt, list) else 0)
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    res.error = str(event["error"])
                    return res
                now = time.perf_counter()
                if event.get("choices"):
                    chunks += 1
                    if res.ttft is None:
                        res.ttft = now - start
                    else:
                        res.gaps.append(now - last)
                    last = now
                usage = event.get("usage")
                if usage:
                    res.output_tokens = usage.get("completion_tokens", 0)
                    res.input_tokens = usage.get("prompt_tokens", res.input_tokens)
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - start
    res.output_tokens = res.output_tokens or chunks
    res.ok = True
    return res


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values)
    return {"mean": float(a.mean())} | {f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}


def summarize(cfg: BenchConfig, model: str, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    inp, out = sum(r.input_tokens for r in ok), sum(r.output_tokens for r in ok)
    return {
        "config": asdict(cfg) | {"api_key": None, "model": model},
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:10],
        "duration_s": duration,
        "input_tokens": inp,
        "output_tokens": out,
        "request_throughput": len(ok) / duration,
        "output_throughput": out / duration,
        "total_token_throughput": (inp + out) / duration,
        "ttft_s": _stats([r.ttft for r in ok if r.ttft is not None]),
        "itl_s": _stats([g for r in ok for g in r.gaps]),
        "e2e_s": _stats([r.e2e for r in ok]),
    }


def format_report(result: dict) -> str:
    cfg = result["config"]

    def ms(v):
        return f"{v * 1e3:9.1f}" if v is not None else "        -"

    lines = [
        f"ft bench serve: {cfg['base_url']}  model {cfg['model']}",
        f"  {result['completed']} requests done, {result['failed']} failed, in {result['duration_s']:.2f} s "
        f"(concurrency {cfg['concurrency']}, input {cfg['input_len']}, output {cfg['output_len']})",
        f"  tokens: {result['input_tokens']} in, {result['output_tokens']} out",
        f"  throughput: {result['request_throughput']:.2f} req/s, "
        f"{result['output_throughput']:.1f} output tok/s, {result['total_token_throughput']:.1f} total tok/s",
        f"  {'latency (ms)':<14}{'mean':>9}{'p50':>9}{'p90':>9}{'p99':>9}",
    ]
    for label, key in (("TTFT", "ttft_s"), ("ITL", "itl_s"), ("end-to-end", "e2e_s")):
        s = result[key]
        lines.append(f"  {label:<14}{ms(s['mean'])}{ms(s['p50'])}{ms(s['p90'])}{ms(s['p99'])}")
    lines += [f"  error: {e}" for e in result["errors"]]
    return "\n".join(lines)
