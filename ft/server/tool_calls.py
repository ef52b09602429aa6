"""Tool calls in a chat's output, in the Hermes format that Qwen's chat templates ask the model for:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``ToolCallStream`` splits text as it arrives into content and calls, holding back what may be
the start of a tag; ``parse_tool_calls`` does the same for a finished text. A block whose body is
not a JSON object with a string ``name`` (and ``arguments`` an object, or a string) stays in the
content as the model wrote it, as does a block the output ends inside. Whitespace around calls (the
template's newlines) is dropped. With ``most`` (``parallel_tool_calls: false``: 1) the calls after
that many are dropped, as vLLM does. Not here: other models' call formats, constraining the output to
a call (``tool_choice: "required"`` or a named function).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from ft.server.detokenizer import held_back

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str

    def as_dict(self, index: int | None = None) -> dict:
        function = {"name": self.name, "arguments": self.arguments}
        out = {"id": self.id, "type": "function", "function": function}
        return out if index is None else {"index": index} | out


def _call(body: str) -> ToolCall | None:
    """The call a block's body describes, or None when it describes none."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # nested too deep for json: not a call either
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not _utf8(obj["name"]):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    text = json.dumps(args, ensure_ascii=False)
    if not _utf8(text):  # half a character the model escaped ("\ud83d") stays escaped: UTF-8 has none
        text = json.dumps(args)
    return ToolCall(obj["name"], text, f"call_{uuid.uuid4().hex[:24]}")


def _utf8(text: str) -> bool:
    """Whether the answer, sent as UTF-8, can carry ``text``: json reads an escaped lone surrogate
    (``"\\udc00"``) into a string that it cannot."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


class ToolCallStream:
    """Content and calls from text fed in pieces: ``feed`` returns what can be released now,
    ``finish`` what was held back when the output ends."""

    def __init__(self, most: int | None = None) -> None:
        self.most = most  # calls released at most; later ones are dropped
        self.calls = 0  # calls released so far
        self._text = ""  # not yet released: a partial tag, a block being read, whitespace
        self._inside = False
        self._gap = ""  # the whitespace before the block being read: dropped if it is a call

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._text += text
        content, calls = "", []
        while True:
            if self._inside:
                end = self._text.find(CLOSE)
                if end < 0:
                    return content, calls
                body, self._text = self._text[:end], self._text[end + len(CLOSE) :]
                self._inside = False
                call = _call(body)
                if call is None:  # not a call after all: the model's own text
                    content += self._gap + OPEN + body + CLOSE
                elif self.most is None or self.calls < self.most:
                    calls.append(call)
                    self.calls += 1
                continue
            start = self._text.find(OPEN)
            if start >= 0:
                before, self._text = self._text[:start], self._text[start + len(OPEN) :]
                text = before.rstrip()
                content, self._gap, self._inside = content + text, before[len(text) :], True
                continue
            # released up to its last non-space character: trailing whitespace goes with what follows
            # it, or is dropped if a call does; a possible tag's start waits for the rest of it
            head = self._text[: len(self._text) - held_back(self._text, (OPEN,))]
            text = head.rstrip()
            content, self._text = content + text, self._text[len(text) :]
            return content, calls

    def finish(self) -> str:
        """What was held back, as content: an unfinished block as the model wrote it, a partial
        tag, whitespace (dropped after a call)."""
        rest = (self._gap + OPEN if self._inside else "") + self._text
        self._text, self._inside = "", False
        return "" if self.calls and not rest.strip() else rest


def parse_tool_calls(text: str, most: int | None = None) -> tuple[str | None, list[ToolCall]]:
    """A finished output -> (its content, None when it is only calls; its calls in order)."""
    stream = ToolCallStream(most)
    content, calls = stream.feed(text)
    content += stream.finish()
    return (content or None, calls) if calls else (text, [])
