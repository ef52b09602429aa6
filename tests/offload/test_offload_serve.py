"""``ft serve --moe-backend offload``: answers as the resident engine does, and /metrics reports
where the experts are (residency, hit rate, bytes streamed) and which backend runs."""

from __future__ import annotations

import pytest

from tests.server.harness import MODEL, extra, greedy, make_model_dir, offline_llm, start_server

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("next"), "qwen3_next", seed=6)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    flags = ["--moe-backend", "offload", "--expert-cache-fraction", "0.25", "--num-tokens", "256"]
    s = start_server(model_dir, tmp_path_factory.mktemp("log") / "serve.log", *flags)
    s.at_start = s.metrics()  # before any request
    yield s
    assert s.stop() == 0, s.output()


def test_offload_serves_and_reports_residency(server, model_dir):
    with offline_llm(model_dir, moe_backend="gpu") as llm:
        want = llm.generate([PROMPT], greedy(8, ignore_eos=True))[0]
    r = server.client().completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert extra(r.choices[0], "token_ids") == want.token_ids
    m = server.wait_idle()
    assert m['ft_moe_backend_info{backend="offload"}'] == 1
    assert m["ft_moe_cache_slots_per_layer"] == 2  # a quarter of 8 experts
    assert m["ft_moe_expert_residency"] == 0.25  # decode filled every slot of every layer
    assert m["ft_moe_expert_hits_total"] + m["ft_moe_expert_misses_total"] > 0
    assert 0 <= m["ft_moe_expert_hit_rate"] <= 1
    assert m["ft_moe_bytes_streamed_total"] > 0 and m["ft_moe_bytes_per_token"] > 0
    assert m["ft_moe_bytes_host_read_total"] > 0  # its decode read missed experts in place
    assert "moe offload (lru, prefetch on): 4 layers x 2/8 experts resident" in server.output()


def test_metrics_before_the_first_request_say_where_the_experts_are(server):
    """A scrape before any request has the start-up placement and the pool, not zeros and the
    default backend (the engine's first stats came with its first step)."""
    m = server.at_start
    assert m['ft_moe_backend_info{backend="offload"}'] == 1 and 'ft_moe_backend_info{backend="gpu"}' not in m
    assert m["ft_moe_cache_slots_per_layer"] == 2 and m["ft_moe_resident_experts"] == 4 * 2
    assert m["ft_moe_expert_residency"] == 0.25 and m["ft_moe_expert_hit_rate"] == 1  # no use yet
    assert m["ft_kv_cache_free_tokens"] == 256 and m["ft_kv_cache_used_tokens"] == 0
    assert m["ft_moe_expert_hits_total"] == m["ft_moe_expert_misses_total"] == 0
