"""``ft serve`` runs a tiny qwen4_exp checkpoint like the other families: greedy completions,
plain and streamed, equal ``LLM.generate`` token for token."""

from __future__ import annotations

import signal

from transformers import AutoTokenizer

from tests.qwen4_exp.conftest import PROMPTS
from tests.reference.qwen4_exp_ckpt import tiny_qwen4_exp_config, write_qwen4_exp_checkpoint
from tests.server.harness import check_greedy_completions, offline_llm, start_server
from tests.tiny_tokenizer import VOCAB_SIZE, eos_token_id, write_tokenizer


def test_serve_matches_llm(tmp_path):
    model_dir = tmp_path / "model"
    config = tiny_qwen4_exp_config(vocab_size=VOCAB_SIZE) | {"eos_token_id": eos_token_id()}
    write_qwen4_exp_checkpoint(model_dir, config, seed=3)
    write_tokenizer(model_dir)
    server = start_server(model_dir, tmp_path / "serve.log")
    try:
        with offline_llm(model_dir) as llm:
            tok = AutoTokenizer.from_pretrained(str(model_dir))
            check_greedy_completions(server, llm, tok, [PROMPTS[0], "hello the world"], max_tokens=8)
    finally:
        assert server.stop(signal.SIGINT) == 0, server.output()
