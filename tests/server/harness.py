"""A real ``ft serve`` process for tests: a tiny random checkpoint with the tiny tokenizer, started
on a free loopback port (``--port 0``; the URL is read from its output), stopped by a signal.

Each test module starts one server in a module-scoped fixture and computes the answers it
expects with ``ft.LLM`` on the same checkpoint (float32 on CPU, as the server runs it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import torch

from ft import LLM, SamplingParams
from tests.checkpoints import write_checkpoint
from tests.tiny_tokenizer import VOCAB_SIZE, eos_token_id, write_tokenizer

MODEL = "tiny"
# one thread per process: the test process, the server and its engine (and ranks) share two CI
# cores, and oversubscribed OpenMP threads make a tiny model's steps tens of times slower
ENV = {"OMP_NUM_THREADS": "1"}
READY = re.compile(r"ready at (http://\S+)")


def make_model_dir(path: Path, model_type: str = "qwen3_next", seed: int = 0) -> Path:
    """A random checkpoint whose eos is the tokenizer's <|im_end|>, with the tokenizer beside it
    (qwen4_exp: the spec reference's tiny checkpoint; the others: transformers')."""
    if model_type == "qwen4_exp":
        from tests.reference.qwen4_exp_ckpt import tiny_qwen4_exp_config, write_qwen4_exp_checkpoint

        write_qwen4_exp_checkpoint(path, tiny_qwen4_exp_config(vocab_size=VOCAB_SIZE), seed=seed)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(config | {"eos_token_id": eos_token_id()}))
    else:
        write_checkpoint(path, model_type, seed=seed, vocab_size=VOCAB_SIZE, eos_token_id=eos_token_id())
    write_tokenizer(path)
    return path


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: Path
    api_key: str | None = None

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0, timeout=120, **kw
        )

    def async_client(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0, timeout=120, **kw
        )

    def post(self, path: str, body: dict | bytes, headers: dict | None = None) -> httpx.Response:
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        return httpx.post(f"{self.url}{path}", headers=auth | (headers or {}), timeout=120, **kw)

    def metrics(self) -> dict[str, float]:
        """/metrics as series -> value, the model_name label left out:
        ``ft_kv_cache_used_tokens``, ``ft_requests_total{finish_reason="abort"}``, ..."""
        out = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=30).text.splitlines():
            if line and not line.startswith("#"):
                series, value = line.rsplit(" ", 1)
                series = re.sub(r'model_name="[^"]*",?', "", series).replace(",}", "}").replace("{}", "")
                out[series] = float(value)
        return out

    def wait_idle(self, timeout: float = 30) -> dict[str, float]:
        """Metrics once no request is running or waiting."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["ft_num_requests_running"] == 0 and m["ft_num_requests_waiting"] == 0:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout} s: {m}")
            time.sleep(0.05)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def descendants(self) -> list[int]:
        """Process ids of the server's children, grandchildren, ... (the engine and its workers)."""
        parents: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text()
                except OSError:
                    continue
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                parents.setdefault(ppid, []).append(int(entry))
        found, todo = [], [self.proc.pid]
        while todo:
            kids = parents.get(todo.pop(), [])
            found += kids
            todo += kids
        return found

    def stop(self, sig: int = signal.SIGINT, timeout: float = 60) -> int:
        """Signal the server and wait; returns its exit code (killed after ``timeout``: -9)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(
    model_dir: Path, log: Path, *flags: str, api_key: str | None = None, timeout: float = 180
) -> Server:
    cmd = [
        sys.executable,
        "-m",
        "ft",
        "serve",
        "--model",
        str(model_dir),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--port",
        "0",
        "--served-model-name",
        MODEL,
        *flags,
    ]
    if api_key:
        cmd += ["--api-key", api_key]
    env = os.environ | {"PYTHONUNBUFFERED": "1"} | ENV
    env.pop("FT_API_KEY", None)
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = READY.search(log.read_text(errors="replace"))
        if m:
            server = Server(m.group(1), proc, log, api_key)
            if httpx.get(f"{server.url}/health", timeout=10).status_code == 200:
                return server
        if proc.poll() is not None:
            raise RuntimeError(f"ft serve exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"ft serve was not ready in {timeout} s:\n{log.read_text(errors='replace')}")


@contextlib.contextmanager
def offline_llm(model_dir: Path, **options) -> Iterator[LLM]:
    """``ft.LLM`` on the server's checkpoint, run on one thread (see ENV) while it lives."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with LLM(model=str(model_dir), device="cpu", dtype="float32", progress=False, **options) as llm:
            yield llm
    finally:
        torch.set_num_threads(threads)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt the server builds for a chat: the template's text, encoded without extras."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def visible_text(tokenizer, out) -> str:
    """What the server answers for an output: the text of its tokens, a final stop token left out."""
    ids = out.token_ids[:-1] if out.finish_reason == "stop" else out.token_ids
    return tokenizer.decode(ids, skip_special_tokens=True)


# ---- reading answers


def extra(obj, name: str):
    """A field beyond OpenAI's (``token_ids``, ...) from an ``openai`` client object."""
    return (obj.model_extra or {}).get(name)


@dataclass
class Streamed:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: object | None
    chunks: int


def read_stream(stream) -> Streamed:
    """Fold a completions or chat stream (one choice) into its text, token ids and finish reason."""
    text, ids, finish, usage, n = "", [], None, None, 0
    for chunk in stream:
        n += 1
        usage = chunk.usage or usage
        for ch in chunk.choices:
            text += ch.text if hasattr(ch, "text") else (ch.delta.content or "")
            ids += extra(ch, "token_ids") or []
            finish = ch.finish_reason or finish
    return Streamed(text, ids, finish, usage, n)


async def read_stream_async(stream) -> Streamed:
    text, ids, finish, usage, n = "", [], None, None, 0
    async for chunk in stream:
        n += 1
        usage = chunk.usage or usage
        for ch in chunk.choices:
            text += ch.text if hasattr(ch, "text") else (ch.delta.content or "")
            ids += extra(ch, "token_ids") or []
            finish = ch.finish_reason or finish
    return Streamed(text, ids, finish, usage, n)


def check_greedy_completions(server: Server, llm: LLM, tokenizer, prompts: list, max_tokens: int) -> None:
    """Greedy completions of ``prompts``, plain and streamed, give exactly LLM.generate's tokens."""
    client = server.client()
    ids = [tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
    wants = llm.generate(ids, greedy(max_tokens))
    for prompt, want in zip(prompts, wants):
        r = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        c = r.choices[0]
        assert extra(c, "token_ids") == want.token_ids
        assert c.text == visible_text(tokenizer, want)
        assert c.finish_reason == want.finish_reason
        assert r.usage.prompt_tokens == len(want.prompt_token_ids)
        assert r.usage.completion_tokens == len(want.token_ids)
        s = read_stream(
            client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"return_token_ids": True},
            )
        )
        assert s.token_ids == want.token_ids
        assert s.text == visible_text(tokenizer, want)
        assert s.finish_reason == want.finish_reason
        assert s.usage.completion_tokens == len(want.token_ids)


def check_shared_prefix(server: Server, llm: LLM, tokenizer) -> float:
    """Requests sharing a long prefix, one after another (a prefix cache can hit), answer as alone;
    returns the prefix-cache hit tokens /metrics counted meanwhile."""
    hits = server.metrics()["ft_prefix_cache_hit_tokens_total"]
    prefix = [(i * 37 + 11) % 280 for i in range(45)]
    prompts = [prefix + [5, 6], prefix + [9], prefix + [5, 6], prefix[:20] + [1]]
    wants = [llm.generate([p], greedy(8, ignore_eos=True, logprobs=2))[0] for p in prompts]
    client = server.client()
    for prompt, want in zip(prompts, wants):
        r = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            logprobs=2,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        c = r.choices[0]
        assert extra(c, "token_ids") == want.token_ids
        for got, tok, row in zip(c.logprobs.token_logprobs, want.token_ids, want.logprobs, strict=True):
            assert abs(got - row[tok]) < 1e-4
    return server.metrics()["ft_prefix_cache_hit_tokens_total"] - hits


def stream_concurrently(server, model: str, prompts, lengths) -> list[Streamed]:
    """Greedy streamed completions of every prompt at once (eos ignored), read to the end."""

    async def one(client, prompt, n):
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=n,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        return await read_stream_async(stream)

    async def run():
        client = server.async_client()
        return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths)))

    return asyncio.run(run())
