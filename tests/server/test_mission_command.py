"""The command line of our mission statement, on CPU with a tiny qwen4_exp checkpoint:

    ft serve --model DIR --tp-size 2 --moe-backend offload --ple-backend pinned \\
             --num-tokens 262144 --memory-ratio 0.94 --moe-prefill-hit-d2d

serves (two gloo ranks, the offload backend, the PLE table in host memory, a 262,144-token KV
pool) the answers ``LLM.generate`` gives at TP 1 with everything resident, and reports its expert
placement in /metrics."""

from __future__ import annotations

import signal

import pytest

from tests.server.harness import check_greedy_completions, make_model_dir, start_server

MISSION = ["--tp-size", "2", "--moe-backend", "offload", "--ple-backend", "pinned", "--num-tokens", "262144",
           "--memory-ratio", "0.94", "--moe-prefill-hit-d2d"]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("q4"), "qwen4_exp", seed=3)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = start_server(model_dir, tmp_path_factory.mktemp("log") / "serve.log", *MISSION)
    yield s
    s.stop(signal.SIGTERM)


def test_the_mission_command_serves_the_tp1_answers(server, llm, tok):
    check_greedy_completions(server, llm, tok, [[3, 1, 4, 1, 5, 9, 2, 6], "hello the world"], max_tokens=8)
    m = server.wait_idle()
    assert m['ft_moe_backend_info{backend="offload"}'] == 1
    out = server.output()
    assert "ft rank 0/2: moe offload" in out and "ft rank 1/2: moe offload" in out
    assert "262144 tokens" in out
