"""Tool calls parsed from a chat's output (``ft.server.tool_calls``) and answered in OpenAI's
shape by the chat endpoint's writer, whole and streamed: a random model does not write calls, so
the writer is fed the text a model that does would write."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from ft.server.tool_calls import ToolCallStream, parse_tool_calls

CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>'
TWO = f"Let me look.\n\n{CALL}\n{CALL.replace('weather', 'time').replace('Paris', 'Oslo')}"


def streamed(text: str, cuts: list[int]) -> tuple[str, list]:
    """``text`` fed to a ToolCallStream in pieces split at ``cuts``: (content, calls)."""
    stream, content, calls = ToolCallStream(), "", []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        piece, new = stream.feed(text[a:b])
        content, calls = content + piece, calls + new
    return content + stream.finish(), calls


def names_and_args(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_calls_are_split_from_the_content():
    content, calls = parse_tool_calls(TWO)
    assert content == "Let me look."
    assert names_and_args(calls) == [
        ("weather", {"city": "Paris", "unit": "°C"}),
        ("time", {"city": "Oslo", "unit": "°C"}),
    ]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    assert parse_tool_calls(CALL)[0] is None  # calls alone: no content
    as_string = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'  # arguments as JSON text
    assert names_and_args(parse_tool_calls(as_string)[1]) == [("f", {"x": 1})]


@pytest.mark.parametrize(
    "text",
    [
        "no calls at all, <tool but not a tag",
        "<tool_call>not json</tool_call> and text",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>["weather"]</tool_call>',
        'an unfinished <tool_call>{"name": "weather"',
        "  \n ",
        # nested deeper than Python's json can parse (a model stuck repeating a bracket): no 500
        "<tool_call>" + "[" * 5000 + "</tool_call>",
        '<tool_call>{"name": "f", "arguments": "' + "[" * 5000 + '"}</tool_call>',
    ],
)
def test_what_is_not_a_call_stays_as_written(text):
    assert parse_tool_calls(text) == (text, [])


@pytest.mark.parametrize(
    "text", [TWO, CALL, f"{CALL} and after", "x <tool_call>bad</tool_call> y", "a <tool_c"]
)
def test_streamed_in_any_pieces_equals_whole(text):
    whole_content, whole_calls = parse_tool_calls(text)
    for cut in range(len(text) + 1):  # two pieces at every split, then one character at a time
        for cuts in ([cut], list(range(1, len(text)))):
            content, calls = streamed(text, cuts)
            assert (content or None if calls else content) == whole_content, cuts
            assert names_and_args(calls) == names_and_args(whole_calls), cuts


def test_no_partial_tag_is_released():
    stream = ToolCallStream()
    assert stream.feed("Sure.<tool") == ("Sure.", [])  # "<tool" could open a call: held back
    content, calls = stream.feed('_call>{"name": "f", "arguments": {}}</tool_call>')
    assert content == "" and [c.name for c in calls] == ["f"]
    assert stream.feed("\n") == ("", []) and stream.finish() == ""  # the template's newline after it


def writer(text: str, finish: str = "stop", tools: bool = True, thinking: bool | None = None, **fields):
    """The chat writer over one finished choice whose output is ``text`` (``thinking``: as the
    chat endpoint passes it with a reasoning parser, None without; ``fields``: more of the request)."""
    from ft.server.chat import _Writer
    from ft.server.generation import Update
    from ft.server.protocol import ChatCompletionRequest

    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True} | fields
    if tools:
        body["tools"] = [{"type": "function", "function": {"name": "weather"}}]
    req = ChatCompletionRequest.model_validate(body)
    choice = SimpleNamespace(index=0, text=SimpleNamespace(text=text), token_ids=[1], logprobs=[],
                             finish_reason=finish, stop_reason=None, prompt_token_ids=[1],
                             num_cached_tokens=0)  # fmt: skip
    pieces = [text[i : i + 7] for i in range(0, len(text), 7)] or [""]

    async def updates():
        for i, piece in enumerate(pieces):
            yield Update(choice, piece, [1], None, i == len(pieces) - 1)

    gen = SimpleNamespace(id="chatcmpl-1", created=0, choices=[choice], updates=updates,
                          prompt_tokens=1, completion_tokens=1, cached_tokens=0)  # fmt: skip
    state = SimpleNamespace(model_name="m", tokenizer=None)
    return _Writer(state, req, gen, thinking)


async def _events(w) -> list[dict]:
    return [e async for e in w.events()]


def test_the_writer_answers_calls_in_openai_shape():
    message = writer(TWO).body()["choices"][0]
    assert message["finish_reason"] == "tool_calls" and message["message"]["content"] == "Let me look."
    calls = message["message"]["tool_calls"]
    assert [(c["type"], c["function"]["name"]) for c in calls] == [
        ("function", "weather"),
        ("function", "time"),
    ]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "°C"}
    cut = writer(TWO, finish="length").body()["choices"][0]
    assert (
        cut["finish_reason"] == "length" and len(cut["message"]["tool_calls"]) == 2
    )  # a call cut off: length
    plain = writer(TWO, tools=False).body()["choices"][0]  # no tools asked: the text as it is
    assert plain["message"] == {"role": "assistant", "content": TWO} and plain["finish_reason"] == "stop"


def test_the_writer_streams_each_call_whole_once():
    events = asyncio.run(_events(writer(TWO)))
    deltas = [e["choices"][0]["delta"] for e in events[1:]]
    content = "".join(d.get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert content == "Let me look."
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "weather"), (1, "time")]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])


def test_parallel_tool_calls_false_answers_the_first_call_only():
    # as OpenAI and vLLM: the calls after the first are dropped, whole and streamed
    w = writer(TWO, parallel_tool_calls=False)
    message = w.body()["choices"][0]
    assert [c["function"]["name"] for c in message["message"]["tool_calls"]] == ["weather"]
    assert message["message"]["content"] == "Let me look." and message["finish_reason"] == "tool_calls"
    deltas = [e["choices"][0]["delta"] for e in asyncio.run(_events(w))[1:]]
    calls = [(c["index"], c["function"]["name"]) for d in deltas for c in d.get("tool_calls", [])]
    assert calls == [(0, "weather")] and "".join(d.get("content", "") for d in deltas) == "Let me look."
    assert len(writer(TWO, parallel_tool_calls=True).body()["choices"][0]["message"]["tool_calls"]) == 2


def test_a_call_with_half_a_character_escaped_can_be_sent():
    # json reads "\ud83d" (half of an emoji's UTF-16 pair) as a lone surrogate, which UTF-8 cannot
    # carry: the answer's encoding failed (a 500, or a stream cut off)
    text = '<tool_call>{"name": "weather", "arguments": {"city": "\\ud83d Paris"}}</tool_call>'
    w = writer(text)
    assert w.body()["choices"][0]["finish_reason"] == "tool_calls"
    json.dumps(w.body(), ensure_ascii=False).encode()
    for event in asyncio.run(_events(w)):
        json.dumps(event, ensure_ascii=False).encode()
    (call,) = parse_tool_calls(text)[1]
    assert json.loads(call.arguments) == {"city": "\ud83d Paris"}  # the same value, escaped
    named = '<tool_call>{"name": "w\\udc00", "arguments": {}}</tool_call>'  # no function is named so
    assert parse_tool_calls(named) == (named, [])
