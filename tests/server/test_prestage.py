"""Pre-staging while idle (``staging.PRESTAGE``) in a served engine: the serving loop tells the
engine it is idle once a request's outputs are out, the engine stages its first layers' host
experts then, and the next request's prefill computes them there with the resident answers."""

from __future__ import annotations

import signal

import pytest

from tests.server.harness import check_greedy_completions, make_model_dir, start_server


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("next"), "qwen3_next", seed=7)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FT_MOE_PRESTAGE", "1")  # the server's processes read it at start
        s = start_server(
            model_dir, tmp_path_factory.mktemp("log") / "serve.log", "--moe-backend", "offload",
            "--expert-cache-fraction", "0.25",
        )  # fmt: skip
    yield s
    s.stop(signal.SIGTERM)


def test_an_idle_server_stages_the_next_prefills_experts(server, llm, tok):
    check_greedy_completions(server, llm, tok, [[3, 1, 4, 1, 5, 9, 2, 6]], max_tokens=4)
    before = server.wait_idle()["ft_moe_prestaged_layers_total"]
    check_greedy_completions(server, llm, tok, ["hello the world", [7, 7, 2]], max_tokens=4)
    assert server.wait_idle()["ft_moe_prestaged_layers_total"] > before
