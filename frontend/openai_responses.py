"""The model's deltas in OpenAI's response shapes: chat completions and (legacy) completions, whole or as
stream chunks, with usage and logprobs."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from .generation import Generation
from .reasoning import ReasoningSplit
from .tokenizer import ModelTokenizer
from .tools import ToolCallParser
from .triton_stream import SampleDelta


@dataclass
class Choice:
    """One choice, gathered from its deltas (non-streaming answers)."""

    text: str = ""
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    pieces: list[tuple[str, list[int]]] = field(default_factory=list)  # each delta's text and token ids

    def add(self, delta: SampleDelta) -> None:
        self.text += delta.text
        self.pieces.append((delta.text, delta.token_ids))
        self.logprobs += delta.logprobs or []
        self.finish_reason = delta.finish_reason or self.finish_reason


class Usage:
    """Prompt tokens (each prompt once, whatever n), of those the ones the engine's prefix cache served, and
    completion tokens (every choice)."""

    def __init__(self):
        self.prompt: dict[int, int] = {}
        self.cached: dict[int, int] = {}
        self.completion: dict[int, int] = {}

    def add(self, prompt_index: int, choice_index: int, delta: SampleDelta) -> None:
        self.prompt[prompt_index] = delta.num_input_tokens
        self.cached[prompt_index] = delta.num_cached_tokens
        self.completion[choice_index] = delta.num_output_tokens

    @property
    def cached_tokens(self) -> int:
        return sum(self.cached.values())

    def body(self) -> dict:
        prompt, completion = sum(self.prompt.values()), sum(self.completion.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class ResponseFormat:
    """What the chat and completion formats share: ids, envelopes, finish reasons."""

    object_name = ""
    chunk_object_name = ""
    id_prefix = ""

    def __init__(self, generation: Generation, tokenizer: ModelTokenizer):
        self.generation = generation
        self.tokenizer = tokenizer
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.prompt_logprobs: dict[int, list[dict | None]] = {}  # by prompt index, when the prompt was scored

    def observe(self, prompt_index: int, delta: SampleDelta) -> None:
        """Keep what a delta says of its whole prompt (its logprobs arrive once, with the first delta)."""
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_index] = delta.prompt_logprobs

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.generation.model,
            "choices": choices,
        }

    def chunk(self, choices: list[dict]) -> dict:
        body = self._envelope(self.chunk_object_name, choices)
        if self.generation.include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the last
        return body

    def usage_chunk(self, usage: Usage) -> dict:
        return {**self._envelope(self.chunk_object_name, []), "usage": self.usage_body(usage)}

    def whole(self, choices: dict[int, Choice], usage: Usage) -> dict:
        return {
            **self._envelope(self.object_name, [self.whole_choice(i, choices[i]) for i in sorted(choices)]),
            "usage": self.usage_body(usage),
        }

    def usage_body(self, usage: Usage) -> dict:
        return usage.body()

    def token_text(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.generation.tokens_as_ids else self.tokenizer.token_text(token_id)

    def prompt_of(self, choice_index: int) -> str:
        """The text of the choice's prompt (token-id prompts decoded)."""
        prompt = self.generation.prompts[choice_index // self.generation.n]
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    def opening_choices(self) -> list[dict]:
        """Stream chunks sent before the first token (chat: the role; completions with echo: the prompt)."""
        return []

    def delta_choice(self, index: int, delta: SampleDelta) -> dict:
        raise NotImplementedError

    def whole_choice(self, index: int, choice: Choice) -> dict:
        raise NotImplementedError


class ChatFormat(ResponseFormat):
    """Chat answers; with a reasoning parser (frontend/reasoning.py), each choice's reasoning is split off into
    `reasoning_content` and its tokens counted in `completion_tokens_details.reasoning_tokens`; with tools, the
    rest of the text goes through a ToolCallParser: the calls it finds become `tool_calls` (finish_reason
    `tool_calls`) and the rest stays content."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, generation: Generation, tokenizer: ModelTokenizer):
        super().__init__(generation, tokenizer)
        self._parsers: dict[int, ToolCallParser] = {}  # streaming: one per choice
        self._splits: dict[int, ReasoningSplit] = {}  # with a reasoning parser: one per choice

    def usage_body(self, usage: Usage) -> dict:
        body = usage.body()
        if self.generation.reasoning is not None:
            reasoning = sum(split.tokens for split in self._splits.values())
            body["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        return body

    def _split(self, index: int) -> ReasoningSplit:
        return self._splits.setdefault(index, self.generation.reasoning.split())

    def opening_choices(self) -> list[dict]:
        return [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(self.generation.num_choices)
        ]

    def delta_choice(self, index: int, delta: SampleDelta) -> dict:
        content, calls, finish_reason = delta.text, [], delta.finish_reason
        reasoning = ""
        if self.generation.reasoning is not None:
            split = self._split(index)
            reasoning, content = split.feed(delta.text, delta.token_ids)
            if finish_reason is not None:
                more_reasoning, more_content = split.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        tools = self.generation.tool_calling
        if tools is not None:
            parser = self._parsers.setdefault(index, ToolCallParser(tools.names))
            content, calls = parser.feed(content)
            if tools.choice != "auto" and not content.strip():
                content = ""  # forced calls: only the newlines between them
            if finish_reason is not None:
                content += parser.finish(cut=finish_reason == "length")
                finish_reason = _finish_reason(finish_reason, parser.num_calls)
        message = {"reasoning_content": reasoning} if reasoning else {}
        if content:
            message["content"] = content
        if calls:
            message["tool_calls"] = calls
        return {
            "index": index,
            "delta": message,
            "logprobs": self._logprobs(delta.logprobs or []),
            "finish_reason": finish_reason,
        }

    def whole_choice(self, index: int, choice: Choice) -> dict:
        text, reasoning = choice.text, {}
        if self.generation.reasoning is not None:
            split = self._split(index)
            text = "".join(split.feed(piece, ids)[1] for piece, ids in choice.pieces) + split.finish()[1]
            reasoning = {"reasoning_content": split.reasoning or None}
        message = {"role": "assistant", "content": text if text or not reasoning else None, **reasoning}
        finish_reason = choice.finish_reason
        tools = self.generation.tool_calling
        if tools is not None:
            parser = ToolCallParser(tools.names)
            content, calls = parser.feed(text)
            content += parser.finish(cut=finish_reason == "length")
            message["content"] = content
            if calls:
                message = {
                    "role": "assistant",
                    "content": content.strip() or None,
                    **reasoning,
                    "tool_calls": [{k: v for k, v in call.items() if k != "index"} for call in calls],
                }
                finish_reason = _finish_reason(finish_reason, len(calls))
        return {
            "index": index,
            "message": message,
            "logprobs": self._logprobs(choice.logprobs),
            "finish_reason": finish_reason,
        }

    def _logprobs(self, entries: list[dict]) -> dict | None:
        if self.generation.logprobs is None:
            return None
        return {
            "content": [
                {
                    **self._token(entry["token_id"], entry["logprob"]),
                    "top_logprobs": [self._token(int(t), lp) for t, lp in (entry.get("top_logprobs") or {}).items()],
                }
                for entry in entries
            ]
        }

    def _token(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _finish_reason(engine_reason: str, num_calls: int) -> str:
    """`tool_calls` when the model stopped after calling; `length` when max_tokens cut the answer (a call it cut
    off is dropped)."""
    return "tool_calls" if num_calls and engine_reason == "stop" else engine_reason


class CompletionFormat(ResponseFormat):
    """Completions; with `echo` each choice starts with its prompt (streamed: in the choice's first chunk), and
    with `logprobs` too, the prompt's tokens lead the logprobs (the first one's logprob null, as OpenAI's)."""

    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, generation: Generation, tokenizer: ModelTokenizer):
        super().__init__(generation, tokenizer)
        self._echoed: set[int] = set()  # streaming: choices whose prompt went out

    def delta_choice(self, index: int, delta: SampleDelta) -> dict:
        prefix, echoed = "", []
        if self.generation.echo and index not in self._echoed:
            self._echoed.add(index)
            prefix, echoed = self.prompt_of(index), self._prompt_entries(index)
        # text_offset counts from the start of this chunk's text (OpenAI's streams do the same)
        return {
            "index": index,
            "text": prefix + delta.text,
            "logprobs": self._logprobs(echoed + (delta.logprobs or []), 0),
            "finish_reason": delta.finish_reason,
        }

    def whole_choice(self, index: int, choice: Choice) -> dict:
        if not self.generation.echo:
            return {
                "index": index,
                "text": choice.text,
                "logprobs": self._logprobs(choice.logprobs, 0),
                "finish_reason": choice.finish_reason,
            }
        return {
            "index": index,
            "text": self.prompt_of(index) + choice.text,
            "logprobs": self._logprobs(self._prompt_entries(index) + choice.logprobs, 0),
            "finish_reason": choice.finish_reason,
        }

    def _prompt_entries(self, index: int) -> list[dict]:
        """The prompt's tokens as logprob entries (none unless logprobs were asked for): the first token, which
        nothing predicts, with a null logprob."""
        if self.generation.logprobs is None:
            return []
        prompt_index = index // self.generation.n
        scored = self.prompt_logprobs.get(prompt_index)
        if scored is None:
            raise ValueError(f"the model sent no prompt logprobs for prompt {prompt_index}")
        prompt = self.generation.prompts[prompt_index]
        first = prompt[0] if isinstance(prompt, list) else self.tokenizer.encode(prompt)[0]
        return [{"token_id": first, "logprob": None}] + scored[1:]

    def _logprobs(self, entries: list[dict], offset: int) -> dict | None:
        if self.generation.logprobs is None:
            return None
        tokens, offsets = [], []
        for entry in entries:
            offsets.append(offset)
            tokens.append(self.token_text(entry["token_id"]))
            offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [entry["logprob"] for entry in entries],
            "top_logprobs": [
                None
                if entry["logprob"] is None
                else {self.token_text(int(t)): lp for t, lp in (entry.get("top_logprobs") or {}).items()}
                for entry in entries
            ],
            "text_offset": offsets,
        }
