"""Incremental detokenisation never releases half a UTF-8 character and adds up to the full
decode; stop strings are cut and never leak out, even when split across tokens."""

from __future__ import annotations

import random

import pytest

from ft.server.completions import TextOffsets
from ft.server.detokenizer import IncrementalDetokenizer, TextOptions, TextStream
from ft.server.tokenizer import Tokenizer
from tests.tiny_tokenizer import VOCAB_SIZE, build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(build_tokenizer())


def feed(detok, ids):
    parts = [detok.add([t]) for t in ids]
    return parts, parts + [detok.flush()]


def test_multibyte_characters_split_across_tokens(tok):
    text = "héllo 中文 😀! the end"
    ids = tok.encode(text, add_special_tokens=False)
    # 中 and 😀 each take two tokens, neither a whole character
    assert "\ufffd" in tok.decode([tok.encode("中", False)[0]]) and len(tok.encode("😀", False)) == 2
    parts, all_parts = feed(IncrementalDetokenizer(tok), ids)
    assert "".join(all_parts) == text
    assert not any("\ufffd" in p for p in parts)
    assert "中" in parts and "😀" in parts  # released whole, the moment the second half arrives


def test_random_tokens_add_up_to_the_full_decode(tok):
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randrange(1, 40))]
        _, all_parts = feed(IncrementalDetokenizer(tok), ids)
        assert "".join(all_parts) == tok.decode(ids)


def test_held_back_character_is_released_at_the_end(tok):
    first_half = tok.encode("😀", False)[0]
    detok = IncrementalDetokenizer(tok)
    assert detok.add(tok.encode("ok", False)) == "ok"
    assert detok.add([first_half]) == ""
    assert detok.flush() == "\ufffd"


def byte_token(tok, b: int) -> int:
    """The id of the tiny tokenizer's token for the single byte ``b``."""
    from ft.server.tokenizer import _BYTE_DECODER

    return tok.hf.convert_tokens_to_ids(next(c for c, v in _BYTE_DECODER.items() if v == b))


class Counting:
    """A tokenizer whose decodes count the tokens they read."""

    def __init__(self, tok):
        self.tok, self.read = tok, 0
        self.special_ids = tok.special_ids

    def decode(self, ids, skip_special_tokens=True):
        self.read += len(ids)
        return self.tok.decode(ids, skip_special_tokens)


def test_invalid_utf8_is_decoded_in_bounded_windows(tok):
    """Output that keeps ending in U+FFFD (continuation bytes with no lead, which ``logit_bias``
    can force) held every token since the last release, and each new token decoded all of them
    again: quadratic, on the server's event loop (4,000 tokens took 2.4 s). The tokens read stay
    linear in the output, and the deltas still add up to the full decode."""
    ids = [byte_token(tok, 0x80)] * 3000
    counting = Counting(tok)
    _, all_parts = feed(IncrementalDetokenizer(counting), ids)
    assert "".join(all_parts) == tok.decode(ids)
    assert counting.read < 20 * len(ids), counting.read


def test_held_windows_release_only_final_text(tok):
    """Runs of invalid bytes mixed with characters split into single bytes (a character's last
    byte may come just after a long invalid run), special tokens among them, skipped or not: the
    windows released early add up with the rest to the full decode (a half character released as
    U+FFFD, or text released twice, would not)."""
    rng = random.Random(1)
    special = sorted(tok.special_ids)
    for _ in range(300):
        ids = []
        while len(ids) < 60:
            kind = rng.random()
            if kind < 0.4:
                ids += [byte_token(tok, rng.choice([0x80, 0xBF, 0xFF]))] * rng.randrange(1, 12)
            elif kind < 0.8:
                ids += [byte_token(tok, b) for b in rng.choice(["中", "😀", "é", "a"]).encode()]
            elif kind < 0.9:
                ids.append(rng.choice(special))
            else:
                ids += [byte_token(tok, rng.choice([0xE4, 0xF0]))]  # a lead byte left alone
        for skip in (True, False):
            _, all_parts = feed(IncrementalDetokenizer(tok, skip), ids)
            assert "".join(all_parts) == tok.decode(ids, skip)


def test_a_character_around_skipped_special_tokens_is_not_cut(tok):
    """A skipped special token adds no byte, so the tokens after a cut may not yet hold the rest
    of a character begun before it: 中 (E4 B8 AD) with special tokens between its bytes, after a
    long invalid run, comes out whole when they are skipped."""
    invalid, special = byte_token(tok, 0x80), sorted(tok.special_ids)[0]
    lead, rest = byte_token(tok, 0xE4), [byte_token(tok, 0xB8), byte_token(tok, 0xAD)]
    for k in range(8):
        ids = [invalid] * 12 + [lead] + [special] * k + rest + [invalid] * 12
        for skip in (True, False):
            _, all_parts = feed(IncrementalDetokenizer(tok, skip), ids)
            assert "".join(all_parts) == tok.decode(ids, skip), (k, skip)
        assert "中" in tok.decode(ids)


def stream(tok, text, stop, final=True):
    s = TextStream(tok, TextOptions(tuple(stop)))
    ids = tok.encode(text, add_special_tokens=False)
    out = [s.add([t], final=final and i == len(ids) - 1) for i, t in enumerate(ids)]
    return s, out


def test_stop_string_is_cut_and_never_released(tok):
    s, out = stream(tok, "hello there, world", ["re, w"], final=False)
    assert s.stopped and s.text == "hello the"
    assert "".join(out) == "hello the"


def test_partial_stop_string_is_held_until_it_cannot_match(tok):
    s = TextStream(tok, TextOptions(("ab!",)))
    assert s.add(tok.encode("xa", False), final=False) == "x"  # "a" might begin "ab!"
    assert s.add(tok.encode("b", False), final=False) == ""  # "ab" still might
    assert s.add(tok.encode("c", False), final=False) == "abc"
    assert s.add(tok.encode("a", False), final=True) == "a"  # the end releases everything
    assert not s.stopped


def test_earliest_of_several_stop_strings_wins(tok):
    s, out = stream(tok, "one two three", ["three", "two"])
    assert s.stopped and "".join(out) == "one "


def test_a_stop_string_kept_ends_the_text_and_nothing_waits_for_it(tok):
    """``include_stop`` (vLLM's include_stop_str_in_output): the text ends just after the stop
    string, and text that may begin one is released at once, since it stays either way."""
    s = TextStream(tok, TextOptions(("ab!", "b!"), include_stop=True))
    assert s.add(tok.encode("xa", False), final=False) == "xa"
    assert s.add(tok.encode("b!cd", False), final=False) == "b!"
    assert s.stop_string == "ab!" and s.text == "xab!"  # two end there: the earliest start wins


def test_no_stop_string_ends_before_min_tokens(tok):
    """Below ``min_tokens`` no stop string counts (vLLM's rule): one that ends within the first
    tokens is passed over; one that begins there and ends after is found and cut; with
    ``generated`` given, the count is the request's (a stop token is not part of the text)."""
    ids = tok.encode("ab, ab, ab", False)
    s = TextStream(tok, TextOptions((", ",)), min_tokens=len(ids))
    out = [s.add([t], final=False) for t in ids[:-1]]
    assert not s.stopped
    out.append(s.add(ids[-1:], final=True))
    assert not s.stopped and "".join(out) == "ab, ab, ab"
    # ", a" begins before the min_tokens-th token and ends after: found once the count is reached
    ids = tok.encode("xy, az", False)
    first = next(i for i in range(len(ids)) if ", a" in tok.decode(ids[: i + 1]))
    s = TextStream(tok, TextOptions((", a",)), min_tokens=first + 1)
    out = [s.add([t], final=False) for t in ids]
    assert s.stopped and "".join(out) == "xy"
    s = TextStream(tok, TextOptions((", ",)), min_tokens=3)
    assert s.add(tok.encode("q, ", False), final=False, generated=1) == "q, "  # ended too soon: text
    assert not s.stopped


def test_text_offsets_of_an_echo_without_the_added_special_tokens(tok):
    """A text prompt's echo is the text as sent: a special token the tokenizer added (a BOS) is
    not in it, so the tokens after it begin where their text does in the echo."""
    ids = tok.encode("<|im_start|>hi", add_special_tokens=False)
    offsets = TextOffsets(tok)
    assert offsets.prompt(ids, "hi") == [0, 0, 1]
    assert offsets.generated(tok.encode("a b", add_special_tokens=False)) == [2, 3, 4]
