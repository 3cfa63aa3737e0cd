"""The model's deltas in OpenAI's response shapes: chat completions and (legacy) completions, whole or as
stream chunks, with usage and logprobs."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from .openai_protocol import Generation
from .tokenizer import ModelTokenizer
from .tools import ToolCallParser
from .triton_stream import SampleDelta


@dataclass
class Choice:
    """One choice, gathered from its deltas (non-streaming answers)."""

    text: str = ""
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, delta: SampleDelta) -> None:
        self.text += delta.text
        self.logprobs += delta.logprobs or []
        self.finish_reason = delta.finish_reason or self.finish_reason


class Usage:
    """Prompt tokens (each prompt once, whatever n) and completion tokens (every choice)."""

    def __init__(self):
        self.prompt: dict[int, int] = {}
        self.completion: dict[int, int] = {}

    def add(self, prompt_index: int, choice_index: int, delta: SampleDelta) -> None:
        self.prompt[prompt_index] = delta.num_input_tokens
        self.completion[choice_index] = delta.num_output_tokens

    def body(self) -> dict:
        prompt, completion = sum(self.prompt.values()), sum(self.completion.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


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

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.generation.model,
                "choices": choices}

    def chunk(self, choices: list[dict]) -> dict:
        body = self._envelope(self.chunk_object_name, choices)
        if self.generation.include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the last
        return body

    def usage_chunk(self, usage: Usage) -> dict:
        return {**self._envelope(self.chunk_object_name, []), "usage": usage.body()}

    def whole(self, choices: dict[int, Choice], usage: Usage) -> dict:
        return {**self._envelope(self.object_name, [self.whole_choice(i, choices[i])
                                                     for i in sorted(choices)]), "usage": usage.body()}

    def token_text(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.generation.tokens_as_ids else self.tokenizer.token_text(token_id)

    def prompt_of(self, choice_index: int) -> str:
        return self.generation.prompts[choice_index // self.generation.n]

    def opening_choices(self) -> list[dict]:
        """Stream chunks sent before the first token (chat: the role; completions with echo: the prompt)."""
        return []

    def delta_choice(self, index: int, delta: SampleDelta) -> dict:
        raise NotImplementedError

    def whole_choice(self, index: int, choice: Choice) -> dict:
        raise NotImplementedError


class ChatFormat(ResponseFormat):
    """Chat answers; with tools, each choice's text goes through a ToolCallParser: the calls it finds become
    `tool_calls` (finish_reason `tool_calls`) and the rest stays content."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, generation: Generation, tokenizer: ModelTokenizer):
        super().__init__(generation, tokenizer)
        self._parsers: dict[int, ToolCallParser] = {}  # streaming: one per choice

    def opening_choices(self) -> list[dict]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(self.generation.num_choices)]

    def delta_choice(self, index: int, delta: SampleDelta) -> dict:
        content, calls, finish_reason = delta.text, [], delta.finish_reason
        tools = self.generation.tool_calling
        if tools is not None:
            parser = self._parsers.setdefault(index, ToolCallParser(tools.names))
            content, calls = parser.feed(delta.text)
            if tools.choice != "auto" and not content.strip():
                content = ""  # forced calls: only the newlines between them
            if finish_reason is not None:
                content += parser.finish()
                finish_reason = _finish_reason(finish_reason, parser.num_calls)
        message = {"content": content} if content else {}
        if calls:
            message["tool_calls"] = calls
        return {"index": index, "delta": message, "logprobs": self._logprobs(delta.logprobs or []),
                "finish_reason": finish_reason}

    def whole_choice(self, index: int, choice: Choice) -> dict:
        message = {"role": "assistant", "content": choice.text}
        finish_reason = choice.finish_reason
        tools = self.generation.tool_calling
        if tools is not None:
            parser = ToolCallParser(tools.names)
            content, calls = parser.feed(choice.text)
            content += parser.finish()
            if calls:
                message = {"role": "assistant", "content": content.strip() or None,
                           "tool_calls": [{k: v for k, v in call.items() if k != "index"} for call in calls]}
                finish_reason = _finish_reason(finish_reason, len(calls))
        return {"index": index, "message": message, "logprobs": self._logprobs(choice.logprobs),
                "finish_reason": finish_reason}

    def _logprobs(self, entries: list[dict]) -> dict | None:
        if self.generation.logprobs is None:
            return None
        return {"content": [
            {**self._token(entry["token_id"], entry["logprob"]),
             "top_logprobs": [self._token(int(t), lp) for t, lp in (entry.get("top_logprobs") or {}).items()]}
            for entry in entries
        ]}

    def _token(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _finish_reason(engine_reason: str, num_calls: int) -> str:
    """`tool_calls` when the model stopped after calling (a call cut off by max_tokens is left as text)."""
    return "tool_calls" if num_calls and engine_reason == "stop" else engine_reason


class CompletionFormat(ResponseFormat):
    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def opening_choices(self) -> list[dict]:
        if not self.generation.echo:
            return []
        return [{"index": i, "text": self.prompt_of(i), "logprobs": None, "finish_reason": None}
                for i in range(self.generation.num_choices)]

    def delta_choice(self, index: int, delta: SampleDelta) -> dict:
        # text_offset counts from the start of this chunk's text (OpenAI's streams do the same)
        return {"index": index, "text": delta.text, "logprobs": self._logprobs(delta.logprobs or [], 0),
                "finish_reason": delta.finish_reason}

    def whole_choice(self, index: int, choice: Choice) -> dict:
        prefix = self.prompt_of(index) if self.generation.echo else ""
        return {"index": index, "text": prefix + choice.text,
                "logprobs": self._logprobs(choice.logprobs, len(prefix)), "finish_reason": choice.finish_reason}

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
            "top_logprobs": [{self.token_text(int(t)): lp for t, lp in (entry.get("top_logprobs") or {}).items()}
                             for entry in entries],
            "text_offset": offsets,
        }
