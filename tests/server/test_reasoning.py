"""A thinking model's reasoning split from its answer (``ft.server.reasoning``), whole and as text
arrives, and answered apart by the chat writer, its calls parsed from the answer alone."""

from __future__ import annotations

import asyncio

import pytest

from ft.server.reasoning import ReasoningStream, split_reasoning, thinks
from tests.server.test_tool_calls import CALL, writer

CASES = [  # (output, whether the prompt opened the reasoning, reasoning, answer)
    ("Let me see.\nTwo.</think>\n\nThe answer is 2.", True, "Let me see.\nTwo.", "The answer is 2."),
    ("<think>\nhmm</think>ok", False, "\nhmm", "ok"),  # an older template: the model opens it
    ("  plain answer </think> kept", False, None, "  plain answer </think> kept"),  # never opened
    ("cut in the middle of thinking <", True, "cut in the middle of thinking <", ""),  # no </think> yet
    ("<thinking is not the tag", False, None, "<thinking is not the tag"),
    ("</think>", True, "", ""),
    (" ", False, None, " "),
]


@pytest.mark.parametrize("output,thinking,reasoning,answer", CASES)
def test_reasoning_is_what_comes_before_the_end_tag(output, thinking, reasoning, answer):
    assert split_reasoning(output, thinking) == (reasoning, answer)


@pytest.mark.parametrize("output,thinking,reasoning,answer", CASES)
def test_streamed_in_any_pieces_equals_whole(output, thinking, reasoning, answer):
    for cuts in [[c] for c in range(len(output) + 1)] + [list(range(1, len(output)))]:
        stream, got = ReasoningStream(thinking), ["", ""]
        for a, b in zip([0, *cuts], [*cuts, len(output)]):
            for i, part in enumerate(stream.feed(output[a:b])):
                got[i] += part
        for i, part in enumerate(stream.finish()):
            got[i] += part
        assert got == [reasoning or "", answer], cuts


def test_no_partial_end_tag_is_released_as_reasoning():
    stream = ReasoningStream(thinking=True)
    assert stream.feed("so 2</thi") == ("so 2", "")
    assert stream.feed("nk>\n\nTwo") == ("", "Two")


def test_a_prompt_thinks_when_it_ends_inside_the_reasoning():
    assert thinks("<|im_start|>assistant\n<think>\n") and not thinks("<think>\n\n</think>\n\n")


def test_the_writer_gives_the_reasoning_apart_and_calls_from_the_answer():
    text = f"I should call it. <tool_call>not this</tool_call></think>\n\n{CALL}"
    message = writer(text, thinking=True).body()["choices"][0]
    assert message["message"]["reasoning_content"] == "I should call it. <tool_call>not this</tool_call>"
    assert message["message"]["content"] is None and message["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in message["message"]["tool_calls"]] == ["weather"]
    events = asyncio.run(_events(writer(text, thinking=True)))
    deltas = [e["choices"][0]["delta"] for e in events[1:]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["message"]["reasoning_content"]
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", [])] == ["weather"]
    assert not "".join(d.get("content", "") for d in deltas)
    plain = writer("no thoughts", tools=False, thinking=False).body()["choices"][0]["message"]
    assert plain == {"role": "assistant", "content": "no thoughts"}  # a parser, a model that did not think


async def _events(w) -> list[dict]:
    return [e async for e in w.events()]
