"""A tiny byte-level BPE tokenizer with a ChatML chat template, built locally for tests.

It has the parts of a real Qwen tokenizer that the server depends on: 256 byte tokens (so any
text round-trips and a random model emits broken UTF-8 often), a few merges, among them
half-characters ("中" and "😀" each take two tokens, neither of which decodes alone), special
tokens that are skipped when decoding, and a chat template. ``VOCAB_SIZE`` tokens in all: a
checkpoint for it must use that vocabulary size.

(Named ``tiny_tokenizer`` rather than ``tokenizers``: pytest puts ``tests/`` on ``sys.path``,
where a ``tokenizers.py`` would shadow the Hugging Face library of that name.)
"""

from __future__ import annotations

import os

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 288

CHAT_TEMPLATE = (  # tools as Qwen's templates show them: a system turn listing their JSON schemas
    "{% if tools %}<|im_start|>system\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    # a thinking model's generation prompt opens its reasoning (Qwen3's ``enable_thinking``)
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking %}<think>\n{% endif %}{% endif %}"
)

# pairs of byte strings to merge, in priority order
_MERGES = [
    (b" ", b"t"),
    (b"h", b"e"),
    (b" t", b"he"),
    (b" ", b"a"),
    (b"i", b"n"),
    (b"e", b"r"),
    (b"o", b"n"),
    (b"r", b"e"),
    (b" ", b"s"),
    (b"a", b"t"),
    (b"e", b"n"),
    (b"o", b"r"),
    (b" ", b"w"),
    (b"e", b"s"),
    (b" ", b"o"),
    (b"i", b"s"),
    (b" ", b"c"),
    (b"e", b"d"),
    (b"i", b"t"),
    (b"a", b"l"),
    (b"a", b"n"),
    (b" ", b"h"),
    (b"l", b"l"),
    (b"he", b"ll"),
    (b"\xc3", b"\xa9"),  # é: one token
    (b"\xe4", b"\xb8"),  # 中 = [e4 b8] + [ad]: half a character per token
    (b"\xf0", b"\x9f"),
    (b"\x98", b"\x80"),  # 😀 = [f0 9f] + [98 80]
    (b"in", b"g"),
]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte (what ByteLevel tokenizers store)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def build_tokenizer():
    """The tokenizer as a transformers ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    b2u = _bytes_to_unicode()

    def spell(bs: bytes) -> str:
        return "".join(b2u[b] for b in bs)

    vocab = {b2u[b]: b for b in range(256)}
    merges = []
    for a, b in _MERGES:
        merges.append((spell(a), spell(b)))
        vocab.setdefault(spell(a + b), len(vocab))
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    assert len(vocab) == VOCAB_SIZE, f"tiny tokenizer has {len(vocab)} tokens, expected {VOCAB_SIZE}"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def write_tokenizer(path: str | os.PathLike):
    """Save the tokenizer into ``path`` (a checkpoint directory); returns it."""
    tok = build_tokenizer()
    tok.save_pretrained(str(path))
    return tok


def eos_token_id() -> int:
    return VOCAB_SIZE - 1  # "<|im_end|>", the last special token
