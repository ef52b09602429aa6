"""A thinking model's reasoning split from its answer (``ft serve --reasoning-parser qwen3``).

Qwen3's thinking models write their reasoning, then ``</think>``, then the answer; the chat
template of the newer ones ends the prompt with ``<think>`` (the model starts inside its
reasoning), the older ones let the model open it. So the reasoning is what comes before the first
``</think>`` when the prompt ends with ``<think>`` or the output starts with it (that tag
dropped); the answer is what follows, leading whitespace dropped. An output that thinks and is cut
before ``</think>`` is all reasoning; one that does not think (a prompt that closed the block
itself, as Qwen3's ``enable_thinking: false`` does) is all answer. ``ReasoningStream`` makes the
same split as text arrives, holding back what may be the start of a tag.
"""

from __future__ import annotations

from ft.server.detokenizer import held_back

START, END = "<think>", "</think>"


def thinks(prompt: str) -> bool:
    """Whether a chat prompt leaves the model inside its reasoning."""
    return prompt.rstrip().endswith(START)


class ReasoningStream:
    """(reasoning, answer) text from an output fed in pieces."""

    def __init__(self, thinking: bool) -> None:
        # "open": not yet known whether the output starts with <think>; "reasoning"; "answer"
        self._state = "reasoning" if thinking else "open"
        self._text = ""  # held back
        self._strip = False  # the answer after </think>: its leading whitespace dropped

    def feed(self, text: str) -> tuple[str, str]:
        self._text += text
        reasoning = ""
        if self._state == "open":
            head = self._text.lstrip()
            if head.startswith(START):
                self._state, self._text = "reasoning", head[len(START) :]
            elif START.startswith(head):  # whitespace, or the start of the tag: wait for more
                return "", ""
            else:
                self._state = "answer"
        if self._state == "reasoning":
            end = self._text.find(END)
            if end < 0:
                cut = len(self._text) - held_back(self._text, (END,))
                reasoning, self._text = self._text[:cut], self._text[cut:]
                return reasoning, ""
            reasoning, self._text = self._text[:end], self._text[end + len(END) :]
            self._state, self._strip = "answer", True
        if self._strip:
            self._text = self._text.lstrip()
            self._strip = not self._text
        answer, self._text = self._text, ""
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """What was held back: the end of a reasoning never closed, or an undecided start (answer)."""
        rest, self._text = self._text, ""
        return (rest, "") if self._state == "reasoning" else ("", rest)


def split_reasoning(text: str, thinking: bool) -> tuple[str | None, str]:
    """A finished output -> (its reasoning, None when it has none; its answer)."""
    stream = ReasoningStream(thinking)
    reasoning, answer = stream.feed(text)
    more = stream.finish()
    reasoning, answer = reasoning + more[0], answer + more[1]
    return (reasoning if thinking or text.lstrip().startswith(START) else None), answer
