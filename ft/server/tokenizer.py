"""The server's view of a Hugging Face tokenizer: prompts to token ids, chat messages to a
prompt, and each token's text and bytes for log-prob answers.

It is not the incremental detokenizer (``ft.server.detokenizer``), and it holds no model state.
Without tokenizer files in the checkpoint the server still runs: prompts must then be token-id
lists, and answers carry empty text (``return_token_ids`` gives the ids).
"""

from __future__ import annotations

import re
from functools import lru_cache


class TokenizerError(ValueError):
    """A prompt or chat the tokenizer cannot turn into token ids; the client's mistake (HTTP 400)."""


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE's printable character for each byte, reversed."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_DECODER = _byte_decoder()
_SENTENCEPIECE_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Tokenizer:
    def __init__(self, hf_tokenizer) -> None:
        self.hf = hf_tokenizer
        self.token_text = lru_cache(maxsize=1 << 16)(self._token_text)
        self.special_ids = frozenset(hf_tokenizer.all_special_ids)  # read by every request's detokenizer

    @classmethod
    def load(cls, path: str | None) -> Tokenizer | None:
        from ft.api import load_tokenizer

        hf = load_tokenizer(path)
        return cls(hf) if hf is not None else None

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool, kwargs: dict) -> str:
        """``kwargs`` (the request's ``chat_template_kwargs``, its tools) come last, as in vLLM: they
        may set ``add_generation_prompt`` too; one the call cannot take is the client's mistake."""
        if not self.has_chat_template:
            raise TokenizerError("this model's tokenizer has no chat template: use /v1/completions")
        try:
            return self.hf.apply_chat_template(
                messages, tokenize=False, **({"add_generation_prompt": add_generation_prompt} | kwargs)
            )
        except Exception as e:  # the template rejected the conversation (jinja raise_exception, ...)
            raise TokenizerError(f"the chat template rejected the messages: {e}") from e

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for; a token that is half a character gives its half."""
        text = self.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode()
        raw = self.hf.convert_ids_to_tokens(token_id)
        if isinstance(raw, str) and (m := _SENTENCEPIECE_BYTE.fullmatch(raw)):
            return bytes([int(m.group(1), 16)])
        if isinstance(raw, str) and raw and all(c in _BYTE_DECODER for c in raw):
            return bytes(_BYTE_DECODER[c] for c in raw)
        return text.encode()

    def _token_text(self, token_id: int) -> str:
        """A token's text, or ``bytes:\\xe4\\xb8`` for a token that is not whole UTF-8 characters
        (so distinct tokens keep distinct names as keys of top-log-prob tables)."""
        text = self.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text
        return "bytes:" + "".join(f"\\x{b:02x}" for b in self.token_bytes(token_id))
