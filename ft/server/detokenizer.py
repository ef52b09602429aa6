"""Generated tokens to streamed text: whole characters only, stop strings cut off.

``IncrementalDetokenizer`` turns a growing list of token ids into text deltas. Byte-level tokens
can end in the middle of a UTF-8 character; the decoded text then ends in U+FFFD, and the delta
is held back until a later token completes the character (or the request ends). Each call
decodes only a short window, [prefix_offset, end), whose start is a point where earlier text was
released whole, so the deltas always add up to ``decode(all tokens)``. Output that keeps ending in
U+FFFD (invalid UTF-8, which a client can force with ``logit_bias``) would grow that window without
end, each token decoding all of it again; past ``HOLD_TOKENS`` held tokens the text before the last
``HOLD_TOKENS`` is released once it is final (a character is at most 4 bytes, a token at least 1),
so each call decodes a bounded window.

``TextStream`` sits on top and applies stop strings: text that might be the start of a stop
string is held back until it is known not to be one; when a stop string appears the text is cut
just before it (just after it with ``include_stop``, vLLM's ``include_stop_str_in_output``, which
holds nothing back) and the stream reports which one stopped it. Before a request's
``min_tokens`` tokens no stop string counts, as in vLLM: one that ends in them is passed over, one
that begins in them and ends after is still found.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ft.server.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
HOLD_TOKENS = 4  # the tokens a character cut at their start can still be waiting for (UTF-8: 3)


def held_back(text: str, tags: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that begins one of ``tags``: what a stream holds back
    until more text says whether it is one (stop strings here; tool-call and reasoning tags)."""
    for k in range(min(len(text), max((len(t) for t in tags), default=1) - 1), 0, -1):
        tail = text[-k:]
        if any(t.startswith(tail) for t in tags):
            return k
    return 0


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # start of the decode window: released whole up to here...
        self.read_offset = 0  # ...and up to here; text from here on is not released yet
        self.special = tokenizer.special_ids  # tokens that decode to nothing when skipped

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the text they complete (possibly empty)."""
        self.token_ids.extend(token_ids)
        return self._release(final=False)

    def flush(self) -> str:
        """The text still held back (an unfinished character decodes to U+FFFD)."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        ids = self.token_ids
        if self.read_offset == len(ids):
            return ""
        skip = self.skip_special_tokens
        prefix = self.tokenizer.decode(ids[self.prefix_offset : self.read_offset], skip)
        text = self.tokenizer.decode(ids[self.prefix_offset :], skip)
        if final or (len(text) > len(prefix) and not text.endswith(REPLACEMENT)):
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
            return text[len(prefix) :]
        return self._release_head(prefix, text)  # nothing new, or the last character is not whole

    def _release_head(self, prefix: str, text: str) -> str:
        """With more than 2 x ``HOLD_TOKENS`` tokens held, the text before the last ``HOLD_TOKENS``
        when it is final: no skipped special token, which adds no byte, is among the last ones (so
        no character they would complete is cut there), and what the window decodes to up to
        there begins ``text`` (a tokenizer's clean-up of spaces may differ across the cut)."""
        ids, skip = self.token_ids, self.skip_special_tokens
        cut = len(ids) - HOLD_TOKENS
        if cut - self.read_offset < HOLD_TOKENS or (skip and self.special.intersection(ids[cut:])):
            return ""
        head = self.tokenizer.decode(ids[self.prefix_offset : cut], skip)
        if len(head) <= len(prefix) or not text.startswith(head):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, cut
        return head[len(prefix) :]


@dataclass(frozen=True)
class TextOptions:
    """What a request asks of its text: ``stop`` strings end it; ``include_stop``: the stop string
    that ended it stays in it, and so does a stop token's text (vLLM's
    ``include_stop_str_in_output``); ``skip_special_tokens``: special tokens have no text."""

    stop: tuple[str, ...] = ()
    include_stop: bool = False
    skip_special_tokens: bool = True


class TextStream:
    """One choice's text: detokenized, cut at the first stop string, released when safe."""

    def __init__(self, tokenizer: Tokenizer | None, options: TextOptions, min_tokens: int = 0) -> None:
        skip = options.skip_special_tokens
        self.detok = IncrementalDetokenizer(tokenizer, skip) if tokenizer is not None else None
        self.stop = [s for s in options.stop if s]
        self.include_stop = options.include_stop
        self.min_tokens = min_tokens
        self.text = ""  # everything decoded so far (cut at the stop string once one is seen)
        self.sent = 0  # characters of ``text`` already released
        self.stop_string: str | None = None  # the stop string found
        self._searched = 0  # stop strings cannot start before this index

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    def add(self, token_ids: list[int], final: bool, generated: int | None = None) -> str:
        """Feed new tokens (``final``: the request has ended; ``generated``: the tokens it has
        generated so far, these included, when it differs from the text's: a stop token);
        return the text to release now."""
        if self.detok is None or self.stopped:
            return ""
        self.text += self.detok.add(token_ids)
        if final:
            self.text += self.detok.flush()
        generated = len(self.detok.token_ids) if generated is None else generated
        if self.stop and generated < self.min_tokens:  # no stop string yet: none may end before here
            self._searched = max(0, len(self.text) - max(len(s) for s in self.stop) + 1)
        elif self.stop and self._cut():
            final = True
        # what is released stays, so text that may begin a stop string waits, unless it is kept
        hold = 0 if final or self.include_stop else held_back(self.text, self.stop)
        end = len(self.text) - hold
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return out

    def _cut(self) -> bool:
        longest = max(len(s) for s in self.stop)
        # the earliest; of two at one place, the first listed (as vLLM, which tries them in order)
        hits = [(i, k) for k, s in enumerate(self.stop) if (i := self.text.find(s, self._searched)) >= 0]
        if hits:
            at, k = min(hits)
            self.stop_string = self.stop[k]
            self.text = self.text[: at + len(self.stop_string) if self.include_stop else at]
            return True
        self._searched = max(0, len(self.text) - longest + 1)
        return False
