"""``ft serve --tp-size 2`` on CPU (gloo): the same answers as ``LLM.generate`` at TP 1, streamed
and not, and SIGTERM stops the server, its engine process and both rank workers."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.server.harness import (
    MODEL,
    chat_ids,
    check_greedy_completions,
    extra,
    greedy,
    make_model_dir,
    read_stream,
    start_server,
    visible_text,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("next"), "qwen3_next", seed=8)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = start_server(model_dir, tmp_path_factory.mktemp("log") / "serve.log", "--tp-size", "2")
    yield s
    s.stop(signal.SIGTERM)


def test_tp2_completions_match_tp1(server, llm, tok):
    check_greedy_completions(server, llm, tok, [[3, 1, 4, 1, 5, 9, 2, 6], "hello the world"], max_tokens=10)


def test_tp2_chat_stream_matches_tp1(server, llm, tok):
    messages = [{"role": "user", "content": "what is this?"}]
    want = llm.generate([chat_ids(tok, messages)], greedy(10, ignore_eos=True))[0]
    s = read_stream(
        server.client().chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
    )
    assert s.token_ids == want.token_ids and s.text == visible_text(tok, want)


def test_sigterm_stops_engine_and_workers(server):
    r = server.client().completions.create(
        model=MODEL, prompt=[1, 2, 3], max_tokens=2, extra_body={"return_token_ids": True}
    )
    assert len(extra(r.choices[0], "token_ids")) == 2
    children = server.descendants()
    assert len(children) >= 3, children  # the engine process and two ranks (plus a resource tracker)
    assert server.stop(signal.SIGTERM) == 0, server.output()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if _alive(pid)], server.output()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_rank_killed_while_idle_stops_the_server(model_dir, tmp_path):
    """A rank that dies while no request runs: the idle engine notices within its poll and the
    server exits 1 naming the rank, so a supervisor restarts it (before, it kept answering /health
    and failed the next request)."""
    s = start_server(model_dir, tmp_path / "serve.log", "--tp-size", "2")
    try:
        ranks = [pid for pid in s.descendants() if _is_rank(pid)]
        assert len(ranks) == 2, (ranks, s.output())
        os.kill(ranks[1], signal.SIGKILL)
        s.proc.wait(timeout=30)
        assert s.proc.returncode == 1, s.output()
        assert "died" in s.output() and "rank" in s.output(), s.output()
    finally:
        s.stop(signal.SIGTERM)


def _is_rank(pid: int) -> bool:
    """A tensor-parallel worker: a spawned child of the engine process (not its resource tracker)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().decode(errors="replace")
        with open(f"/proc/{pid}/stat") as f:
            parent = int(f.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{parent}/cmdline", "rb") as f:
            parent_cmd = f.read().decode(errors="replace")
    except OSError:
        return False
    return "spawn_main" in cmd and "spawn_main" in parent_cmd
