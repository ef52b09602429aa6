"""The Python API with a tokenizer: string prompts, text out, eos stops."""

from __future__ import annotations

from ft import LLM, SamplingParams
from tests.checkpoints import write_checkpoint
from tests.tiny_tokenizer import VOCAB_SIZE, build_tokenizer, eos_token_id, write_tokenizer


def test_string_prompts_and_text(tmp_path):
    write_checkpoint(tmp_path, "qwen3_moe", seed=3, vocab_size=VOCAB_SIZE, eos_token_id=eos_token_id())
    write_tokenizer(tmp_path)
    tok = build_tokenizer()
    text = "hello world, this is ft"
    ids = tok.encode(text, add_special_tokens=False)
    with LLM(model=str(tmp_path), device="cpu", dtype="float32", progress=False) as llm:
        by_text, by_ids = llm.generate([text, ids], SamplingParams(max_tokens=12, temperature=0.0))
    assert by_text.prompt_token_ids == ids
    assert by_text.token_ids == by_ids.token_ids
    assert by_text.text == tok.decode(by_text.token_ids, skip_special_tokens=True)
    if eos_token_id() in by_text.token_ids:  # stopping at eos keeps it as the last token
        assert by_text.token_ids[-1] == eos_token_id() and by_text.finish_reason == "stop"


def test_chat_is_generate_on_the_templates_prompt(tmp_path):
    """``LLM.chat``: one conversation or several, each through the chat template (its keyword
    arguments too) as the server builds a chat's prompt, then generated as those ids are."""
    write_checkpoint(tmp_path, "qwen3_moe", seed=4, vocab_size=VOCAB_SIZE, eos_token_id=eos_token_id())
    write_tokenizer(tmp_path)
    tok = build_tokenizer()
    talk = [{"role": "user", "content": "hello there"}]
    other = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why"}]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def ids(messages, **kw):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
        return tok.encode(text, add_special_tokens=False)

    with LLM(model=str(tmp_path), device="cpu", dtype="float32", progress=False) as llm:
        one = llm.chat(talk, params)
        both = llm.chat([talk, other], params)
        thinking = llm.chat(talk, params, chat_template_kwargs={"enable_thinking": True})[0]
        want = llm.generate([ids(talk), ids(other)], params)
    assert [o.prompt_token_ids for o in both] == [ids(talk), ids(other)]
    assert [o.token_ids for o in both] == [w.token_ids for w in want]
    assert one[0].token_ids == want[0].token_ids
    assert thinking.prompt_token_ids == ids(talk, enable_thinking=True) != ids(talk)


def test_no_tokenizer_needs_token_ids(tmp_path):
    write_checkpoint(tmp_path, "qwen3_moe", seed=3)
    with LLM(model=str(tmp_path), device="cpu", dtype="float32", progress=False) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0))[0]
        assert out.text is None and len(out.token_ids) == 3
        try:
            llm.generate(["text"], SamplingParams(max_tokens=3))
        except ValueError as e:
            assert "token ids" in str(e)
        else:
            raise AssertionError("a string prompt without a tokenizer must be refused")
        try:
            llm.chat([{"role": "user", "content": "hi"}])
        except ValueError as e:
            assert "chat template" in str(e)
        else:
            raise AssertionError("a chat without a tokenizer must be refused")


def test_shutdown_frees_the_runner_without_the_cycle_collector(tmp_path):
    """The CUDA graph runners hold the model runner; shutdown breaks that cycle, so the weights and
    pools go when the engine closes, not at some later collection (a second engine in the same
    process once found its GPU budget spent on a closed one)."""
    import gc
    import types
    import weakref

    write_checkpoint(tmp_path, "qwen3_next", seed=0)
    gc.collect()
    gc.disable()
    try:
        llm = LLM(model=str(tmp_path), progress=False)
        runner = llm.engine.executor.runner
        runner.graphs = types.SimpleNamespace(runner=runner)  # as CudaGraphRunner(runner, ...) does
        ref = weakref.ref(runner)
        del runner
        llm.shutdown()
        assert ref() is None
    finally:
        gc.enable()


def test_a_text_prompt_gets_the_tokenizers_special_tokens_as_the_servers_completions_do():
    """vLLM's ``LLM.generate`` and ``/v1/completions`` encode a text prompt with the tokenizer's
    special tokens (a BOS where the tokenizer adds one); ``LLM`` did not, so one prompt gave two
    token sequences for a tokenizer that adds a BOS."""

    class BosTokenizer:
        def encode(self, text, add_special_tokens=True):
            ids = [ord(c) for c in text]
            return [1, *ids] if add_special_tokens else ids

    llm = LLM.__new__(LLM)  # encode needs only the tokenizer
    llm.tokenizer = BosTokenizer()
    assert llm.encode("hi") == [1, ord("h"), ord("i")]
    assert llm.encode([5, 6]) == [5, 6]
