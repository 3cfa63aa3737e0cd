"""Incremental detokenization with stop strings.

Text is produced token by token from a small window of ids (as vLLM does), so a step costs the same however
long the output is; a token that ends inside a multi-byte UTF-8 character yields no text until the character
completes. Stop strings are matched on the text; the part of the text that could still be the start of a
stop string is held back until the next token decides it, so a stop string never leaks to the client.
"""

from __future__ import annotations

_PROMPT_CONTEXT_TOKENS = 6  # prompt tail decoded with the output, so a leading space is rendered right
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        self.include_stop = include_stop_str_in_output
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        self.num_sent_chars = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def append(self, token_id: int) -> bool:
        """Add one generated token; returns True when a stop string has just been matched."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_INCOMPLETE):
            return False  # a character still in progress: wait for the rest of its bytes
        new_text = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return self._add_text(new_text)

    def flush(self) -> None:
        """At the end of a sequence: keep whatever bytes are still pending (as a full decode would)."""
        if self._read_offset < len(self._ids):
            prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
            full_text = self._decode(self._ids[self._prefix_offset :])
            self._read_offset = len(self._ids)
            self._add_text(full_text[len(prefix_text) :])

    def _add_text(self, new_text: str) -> bool:
        if not self.stop:
            self.text += new_text
            return False
        search_from = max(0, len(self.text) - self.hold_back)
        self.text += new_text
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) != -1]
        if not hits:
            return False
        index, stop = min(hits)
        self.text = self.text[: index + len(stop)] if self.include_stop else self.text[:index]
        return True

    def _pending_stop_prefix_len(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        for size in range(min(self.hold_back, len(self.text)), 0, -1):
            tail = self.text[-size:]
            if any(stop.startswith(tail) for stop in self.stop):
                return size
        return 0

    def take_new_text(self, finished: bool) -> str:
        """Text not yet sent; while running, hold back what might be the start of a stop string."""
        end = len(self.text) if finished else len(self.text) - self._pending_stop_prefix_len()
        end = max(end, self.num_sent_chars)
        delta = self.text[self.num_sent_chars : end]
        self.num_sent_chars = end
        return delta
