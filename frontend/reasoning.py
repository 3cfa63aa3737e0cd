"""Reasoning models: a choice's text split into its reasoning (what the model wrote inside `<think>` ...
`</think>`) and its answer, whole or as it streams, with the tokens of the reasoning counted.

The front door's `--reasoning-parser` picks the parser: `qwen3` and `deepseek_r1` both read think tags; `auto`
(the default) is `qwen3` when the chat template handles `<think>` tags and none otherwise; `none` leaves every
answer as it is. A choice starts inside the reasoning when the prompt ends with an open `<think>` (a template
that opens it, as DeepSeek-R1's does, or Qwen3's without `enable_thinking: false`, which writes an empty closed
pair instead), and always with `deepseek_r1` (its model often writes no opening tag); an opening `<think>` at the
start of the output is read either way. With no closing tag (max_tokens cut the answer mid-thought) all of the
text is reasoning. Whitespace between `</think>` and the answer is dropped.

Reasoning tokens are counted from the token ids each delta carries: a delta whose text is all reasoning counts
all its tokens, one that writes only tags or answer counts none, and one that straddles the closing tag counts the
tokens whose text reaches into the reasoning (found by decoding its ids). The tags themselves are not counted
when they are tokens of their own (as in Qwen3's and DeepSeek-R1's vocabularies).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("auto", "qwen3", "deepseek_r1", "none")


@dataclass(frozen=True)
class Reasoning:
    """One request's reasoning parser: whether its output starts inside the reasoning; `decode` (the tokenizer's)
    counts the tokens of a delta that straddles the closing tag."""

    starts_inside: bool
    decode: Callable[[list[int]], str] | None = None

    def split(self) -> ReasoningSplit:
        """A parser for one choice."""
        return ReasoningSplit(self.starts_inside, self.decode)


class ReasoningParser:
    """The front door's setting, resolved against the model's chat template: `for_prompt` gives the request's
    `Reasoning`, or None when answers are left as they are."""

    def __init__(
        self,
        setting: str,
        chat_template: str | dict[str, str] | None,
        decode: Callable[[list[int]], str] | None = None,
    ):
        if setting not in PARSERS:
            raise ValueError(f"reasoning parser must be one of {list(PARSERS)}, got {setting!r}")
        if setting == "auto":
            sources = chat_template.values() if isinstance(chat_template, dict) else [chat_template or ""]
            setting = "qwen3" if any(OPEN in source or CLOSE in source for source in sources) else "none"
        self.name = setting
        self.decode = decode

    def for_prompt(self, prompt: str | list[int]) -> Reasoning | None:
        if self.name == "none":
            return None
        opened = isinstance(prompt, str) and prompt.rfind(OPEN) > prompt.rfind(CLOSE)
        return Reasoning(self.name == "deepseek_r1" or opened, self.decode)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ThinkTags:
    """Splits one choice's text, fed in pieces, into (reasoning, content); text that may be the start of a tag
    is held back until it is known."""

    def __init__(self, starts_inside: bool):
        self._inside = starts_inside
        self._state = "start"  # start (an opening tag may come), reasoning, after (the closing tag), content
        self.held = ""

    @property
    def thinking(self) -> bool:
        """Inside the reasoning, its closing tag not yet read."""
        return self._state == "reasoning"

    def feed(self, text: str) -> tuple[str, str]:
        buffer, self.held = self.held + text, ""
        reasoning = content = ""
        if self._state == "start":
            stripped = buffer.lstrip()
            if stripped.startswith(OPEN):
                buffer, self._state = stripped[len(OPEN) :], "reasoning"
            elif OPEN.startswith(stripped):
                self.held = buffer  # whitespace, or part of an opening tag
                return "", ""
            else:
                self._state = "reasoning" if self._inside else "content"
        if self._state == "reasoning":
            end = buffer.find(CLOSE)
            if end < 0:
                keep = _partial_suffix(buffer, CLOSE)
                reasoning, self.held = buffer[: len(buffer) - keep], buffer[len(buffer) - keep :]
                return reasoning, ""
            reasoning, buffer, self._state = buffer[:end], buffer[end + len(CLOSE) :], "after"
        if self._state == "after":
            if not buffer.strip():
                self.held = buffer
                return reasoning, ""
            buffer, self._state = buffer.lstrip(), "content"
        return reasoning, content + buffer

    def finish(self) -> tuple[str, str]:
        """The text still held back: a start that never opened a tag, or an unfinished closing tag (reasoning)."""
        held, self.held = self.held, ""
        if self._state == "start":
            return (held, "") if self._inside else ("", held)
        return (held, "") if self._state == "reasoning" else ("", "")


class ReasoningSplit:
    """ThinkTags over a choice's deltas, counting the reasoning's tokens from each delta's token ids; `decode`
    (the tokenizer's) is needed only for a delta that straddles the closing tag."""

    def __init__(self, starts_inside: bool, decode: Callable[[list[int]], str] | None = None):
        self.tags = ThinkTags(starts_inside)
        self.decode = decode
        self.reasoning = ""
        self.tokens = 0
        self._pending = 0  # tokens of deltas whose text is held back, not yet known to be reasoning

    def feed(self, text: str, token_ids: list[int]) -> tuple[str, str]:
        held_before = len(self.tags.held)
        reasoning, content = self.tags.feed(text)
        if reasoning:
            closed = not self.tags.thinking  # the closing tag is in this delta: count up to it
            self.tokens += self._pending + (
                self._covering(token_ids, len(reasoning) - held_before) if closed else len(token_ids)
            )
            self._pending = 0
        elif content or not self.tags.held:
            self._pending = 0  # answer, or tags and whitespace
        else:
            self._pending += len(token_ids)
        self.reasoning += reasoning
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        reasoning, content = self.tags.finish()
        if reasoning:
            self.tokens += self._pending
        self._pending = 0
        self.reasoning += reasoning
        return reasoning, content

    def _covering(self, token_ids: list[int], chars: int) -> int:
        """How many of a delta's tokens it takes to write its first `chars` characters."""
        if chars <= 0:
            return 0
        if self.decode is None:
            return len(token_ids)
        for k in range(1, len(token_ids) + 1):
            if len(self.decode(token_ids[:k])) >= chars:
                return k
        return len(token_ids)
