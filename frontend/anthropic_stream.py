"""Anthropic's Messages API answers, built from the model's deltas: the message object (whole) or its server-sent
events (streamed: `event: <type>` and `data: {..., "type"}`), in the shapes of the anthropic SDK's
`anthropic.types`. With tools, tool calls are parsed out of the text as on /v1/chat/completions (tools.py) and
become `tool_use` blocks; the text around them becomes `text` blocks. With `thinking: {"type": "enabled"}` the
model's reasoning (frontend/reasoning.py) is a `thinking` block first (`thinking_delta` events, then one
`signature_delta` with an empty signature: nothing is signed).

The events come in Anthropic's order: `message_start` (the message, empty content, input tokens), per block
`content_block_start`, `content_block_delta` (`text_delta`, or one `input_json_delta` with a call's whole
input: a call goes out when its closing tag arrives), `content_block_stop`, with one `ping` after the first
block's start; then `message_delta` (`stop_reason`, `stop_sequence`, usage) and `message_stop`. As on the
other routes the 200 is sent with the first token, so a refusal keeps its status (in Anthropic's error shape,
frontend/anthropic_errors.py); an engine failure after that is an `error` event that ends the stream.
"""

from __future__ import annotations

import json
import uuid

from aiohttp import web

from .admission import Admission
from .anthropic_errors import error_body
from .anthropic_messages import MessagesRequest
from .completions import answer_events
from .errors import APIError
from .reasoning import ReasoningSplit
from .tools import ToolCalling, ToolCallParser
from .triton_stream import SampleDelta, TritonLLM

PING = 'event: ping\ndata: {"type": "ping"}\n\n'


class MessageContent:
    """One answer's content blocks, built from the model's text as it arrives; `feed` returns the stream events
    each piece makes. A stop sequence the model wrote (the engine keeps it in the text) is taken off the end and
    kept in `stop_sequence`. With tools, whitespace outside a text block (between calls) is dropped."""

    def __init__(
        self,
        tool_calling: ToolCalling | None,
        stop_sequences: tuple[str, ...] = (),
        reasoning: ReasoningSplit | None = None,
    ):
        self.blocks: list[dict] = []
        self.reasoning = reasoning
        self._thinking = False  # the last block is a thinking block still being written
        self.stop_sequence: str | None = None
        self._parser = ToolCallParser(tool_calling.names) if tool_calling is not None else None
        self._stops = sorted(stop_sequences, key=len, reverse=True)  # the longest that matches is the one
        self._tail = ""  # the end of the text so far, as long as the longest stop sequence
        self._writing = False  # the last block is a text block still being written
        self._held = ""

    def feed(self, text: str, finish_reason: str | None, token_ids: list[int] = ()) -> list[dict]:
        if self._stops:
            text = self._without_stop(text, finish_reason == "stop")
        events: list[dict] = []
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text, list(token_ids))
            if finish_reason is not None:
                more_thought, more_text = self.reasoning.finish()
                thought, text = thought + more_thought, text + more_text
            events += self._think(thought) + (self._end_thought() if text or finish_reason is not None else [])
        pieces = [text] if self._parser is None else self._parser.pieces(text)
        for piece in pieces:
            events += self._write(piece) if isinstance(piece, str) else self._tool_use(piece)
        if finish_reason is not None:
            if self._parser is not None:
                events += self._write(self._parser.finish(cut=finish_reason == "length"))
            events += self._close()
        return events

    def stop_reason(self, finish_reason: str) -> str:
        if finish_reason == "length":
            return "max_tokens"
        if self.stop_sequence is not None:
            return "stop_sequence"
        return "tool_use" if any(block["type"] == "tool_use" for block in self.blocks) else "end_turn"

    def _without_stop(self, text: str, stopped: bool) -> str:
        seen = self._tail + text
        self._tail = seen[-len(self._stops[0]) :]
        if stopped:
            for stop in self._stops:
                if seen.endswith(stop):
                    self.stop_sequence = stop
                    return text[: max(0, len(text) - len(stop))]
        return text

    def _write(self, text: str) -> list[dict]:
        if not text:
            return []
        if not self._writing and self._parser is not None and not (self._held + text).strip():
            self._held += text
            return []
        text, self._held = self._held + text, ""
        events = []
        if not self._writing:
            self._writing = True
            self.blocks.append({"type": "text", "text": ""})
            events.append(self._start({"type": "text", "text": ""}))
        self.blocks[-1]["text"] += text
        return events + [self._delta({"type": "text_delta", "text": text})]

    def _think(self, text: str) -> list[dict]:
        if not text:
            return []
        events = []
        if not self._thinking:
            self._thinking = True
            self.blocks.append({"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._start({"type": "thinking", "thinking": "", "signature": ""}))
        self.blocks[-1]["thinking"] += text
        return events + [self._delta({"type": "thinking_delta", "thinking": text})]

    def _end_thought(self) -> list[dict]:
        if not self._thinking:
            return []
        self._thinking = False
        return [
            self._delta({"type": "signature_delta", "signature": ""}),
            {"type": "content_block_stop", "index": len(self.blocks) - 1},
        ]

    def _close(self) -> list[dict]:
        if not self._writing:
            return []
        self._writing = False
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _tool_use(self, call: dict) -> list[dict]:
        self._held = ""
        events = self._close()
        function = call["function"]
        block = {
            "type": "tool_use",
            "id": f"toolu_{uuid.uuid4().hex[:24]}",
            "name": function["name"],
            "input": json.loads(function["arguments"]),
        }
        self.blocks.append(block)
        return events + [
            self._start({**block, "input": {}}),
            self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}),
            {"type": "content_block_stop", "index": len(self.blocks) - 1},
        ]

    def _start(self, block: dict) -> dict:
        return {"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": block}

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}


class MessageAnswer:
    """One message: its id, content and usage as the deltas arrive, and its opening and closing events."""

    def __init__(self, parsed: MessagesRequest):
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.model = parsed.generation.model
        reasoning = parsed.generation.reasoning
        self.content = MessageContent(
            parsed.generation.tool_calling, parsed.stop_sequences, reasoning.split() if reasoning else None
        )
        self.input_tokens = 0  # the whole prompt; usage splits it into cache reads and the rest
        self.cached_tokens = 0
        self.output_tokens = 0
        self.finish_reason: str | None = None
        self.pinged = False

    def add(self, delta: SampleDelta) -> list[dict]:
        self.input_tokens, self.output_tokens = delta.num_input_tokens, delta.num_output_tokens
        self.cached_tokens = delta.num_cached_tokens
        self.finish_reason = delta.finish_reason or self.finish_reason
        return self.content.feed(delta.text, delta.finish_reason, delta.token_ids)

    def body(self) -> dict:
        """The message object; before the end (`message_start`) with no content and no stop reason."""
        done = self.finish_reason is not None
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": json.loads(json.dumps(self.content.blocks)) if done else [],
            "stop_reason": self.content.stop_reason(self.finish_reason) if done else None,
            "stop_sequence": self.content.stop_sequence if done else None,
            "usage": {**self._usage(), "service_tier": "standard"},
        }

    def opening(self, first: SampleDelta) -> list[dict]:
        self.input_tokens, self.cached_tokens = first.num_input_tokens, first.num_cached_tokens
        return [{"type": "message_start", "message": self.body()}]

    def closing(self) -> list[dict]:
        body = self.body()
        return [
            {
                "type": "message_delta",
                "delta": {"stop_reason": body["stop_reason"], "stop_sequence": body["stop_sequence"]},
                "usage": self._usage(),
            },
            {"type": "message_stop"},
        ]

    def failed(self, error: APIError) -> list[dict]:
        """An engine failure after the 200: one `error` event ends the stream."""
        return [error_body(error)]

    def sse(self, events: list[dict]) -> bytes:
        """The events as server-sent events, a ping after the first block's start."""
        chunks = []
        for event in events:
            chunks.append(f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n")
            if not self.pinged and event["type"] == "content_block_start":
                self.pinged = True
                chunks.append(PING)
        return "".join(chunks).encode()

    def _usage(self) -> dict:
        """Anthropic's split of the prompt: `cache_read_input_tokens` the tokens the engine's prefix cache served,
        `input_tokens` the rest (their sum is the prompt, count_tokens' answer); the engine's cache needs no
        writes asked for, so `cache_creation_input_tokens` is 0."""
        return {
            "input_tokens": self.input_tokens - self.cached_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": self.cached_tokens,
            "output_tokens": self.output_tokens,
        }


async def answer_messages(
    request: web.Request, llm: TritonLLM, parsed: MessagesRequest, admission: Admission
) -> web.StreamResponse:
    """The message, whole or as server-sent events (`stream: true`)."""
    return await answer_events(request, llm, parsed.generation, admission, MessageAnswer(parsed))
