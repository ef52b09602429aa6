"""A checkpoint's generation_config.json gives the sampling defaults of requests that leave them
out (``ft.generation_config``), in the offline API and the server; a request's own values win,
``--generation-config none`` keeps ft's, and a broken file is refused naming it and the key."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from ft import LLM, SamplingParams
from ft.generation_config import sampling_defaults
from ft.server.protocol import ChatCompletionRequest, CompletionRequest, parse
from ft.server.serving import ServerState
from tests.checkpoints import write_checkpoint

QWEN = {"bos_token_id": 1, "do_sample": True, "eos_token_id": [2, 3], "temperature": 0.7, "top_k": 20,
        "top_p": 0.8, "repetition_penalty": 1.05, "min_p": 0.01, "max_new_tokens": 9}  # fmt: skip


def write(path, config) -> str:
    path.mkdir(exist_ok=True)
    (path / "generation_config.json").write_text(json.dumps(config))
    return str(path)


def test_the_files_sampling_keys_and_only_those(tmp_path):
    d = write(tmp_path / "m", QWEN)
    want = {
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.8,
        "repetition_penalty": 1.05,
        "min_p": 0.01,
        "max_tokens": 9,
    }
    assert sampling_defaults("auto", d) == want
    assert sampling_defaults(d, None) == want  # a directory named instead
    assert sampling_defaults("none", d) == {}
    assert sampling_defaults("auto", str(tmp_path)) == {}  # no file: ft's own
    assert sampling_defaults("auto", None) == {}  # a config file alone (dummy weights)
    with pytest.raises(ValueError, match="no generation_config.json"):
        sampling_defaults(str(tmp_path), None)


@pytest.mark.parametrize(
    "key, value, says",
    [("temperature", "0.7", "not a number"), ("top_k", 20.5, "not an integer"),
     ("top_k", True, "not an integer"), ("top_p", 0.0, "top_p"), ("max_new_tokens", -1, "max_tokens")],
)  # fmt: skip
def test_a_bad_value_is_refused_naming_the_file_and_key(tmp_path, key, value, says):
    d = write(tmp_path / "m", {**QWEN, key: value})
    with pytest.raises(ValueError, match=f"generation_config.json: .*{says}"):
        sampling_defaults("auto", d)
    (tmp_path / "m" / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        sampling_defaults("auto", d)


def test_offline_api_uses_them_without_params(tmp_path):
    write_checkpoint(tmp_path, "qwen3_next", seed=3)
    write(tmp_path, {"temperature": 0.0, "max_new_tokens": 5})
    prompt = [4, 8, 15, 16, 23, 42]
    with LLM(model=str(tmp_path), device="cpu", dtype="float32", progress=False) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)
        got = llm.generate([prompt])[0]
        want = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5))[0]
        assert got.token_ids == want.token_ids and len(got.token_ids) <= 5
    with LLM(model=str(tmp_path), device="cpu", progress=False, generation_config="none") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()


def _state(defaults: dict) -> ServerState:
    info = SimpleNamespace(vocab_size=100, max_request_tokens=1000)
    return ServerState(SimpleNamespace(info=info), None, None, "m", defaults=defaults)


def test_server_requests_take_them_where_they_leave_fields_out():
    state = _state({"temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05, "min_p": 0.01,
                    "max_tokens": 9})  # fmt: skip
    chat = parse(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "hi"}], "top_k": null}')
    p = state.sampling_params(chat, 5, None)
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.min_p) == (0.7, 20, 0.8, 1.05, 0.01)
    given = parse(CompletionRequest, b'{"prompt": [1, 2], "temperature": 1.0, "top_p": 1.0, "top_k": -1}')
    p = state.sampling_params(given, 5, None)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (1.0, 1.0, -1, 1.05)  # theirs win
    assert state.chat_max_tokens(10) == 9 and state.chat_max_tokens(995) == 5  # less of both
    plain = _state({})
    assert plain.sampling_params(chat, 5, None) == SamplingParams(max_tokens=5)
    assert plain.chat_max_tokens(10) == 990


def test_serve_refuses_a_broken_file_before_loading(tmp_path):
    write(tmp_path, {"temperature": "hot"})
    cmd = [sys.executable, "-m", "ft", "serve", "--model", str(tmp_path), "--port", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "temperature = 'hot' is not a number" in out.stderr, out.stderr
