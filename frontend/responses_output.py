"""The Responses API's answers, built from the model's deltas: the Response object (whole) or its server-sent
events (streamed: `event: <type>` and `data: {...}` with a `sequence_number`), in the shapes of the openai
SDK's `openai.types.responses`. With tools, tool calls are parsed out of the text as on /v1/chat/completions
(tools.py) and become `function_call` output items; the text around them becomes `message` items. With a
reasoning parser (frontend/reasoning.py), the reasoning is a `reasoning` item first, its text streamed as
`response.reasoning_text.delta` events.

A streamed answer's 200 is sent only when the first token arrives (a request the model refuses keeps its
status: completions.py's `answer_events` runs it); an engine failure after that is an `error` event, then
`response.failed`.
"""

from __future__ import annotations

import json
import time
import uuid

from aiohttp import web

from .admission import Admission
from .completions import answer_events
from .errors import APIError
from .openai_responses import Usage
from .reasoning import ReasoningSplit
from .responses_api import ResponsesRequest
from .tools import ToolCalling, ToolCallParser
from .triton_stream import SampleDelta, TritonLLM


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


class OutputItems:
    """One answer's output items, built from the model's text as it arrives. `feed` and `finish` return the
    stream events each step makes (without sequence numbers); `items` is the output so far. With tools,
    whitespace outside a message (between calls) is held back and dropped, as chat drops it."""

    def __init__(self, tool_calling: ToolCalling | None, reasoning: ReasoningSplit | None = None):
        self.items: list[dict] = []
        self.reasoning = reasoning
        self._parser = ToolCallParser(tool_calling.names) if tool_calling is not None else None
        self._message: dict | None = None  # the message item being written
        self._text = ""  # its text so far
        self._held = ""
        self._thought: dict | None = None  # the reasoning item being written

    def feed(self, text: str, token_ids: list[int] = ()) -> list[dict]:
        events: list[dict] = []
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text, list(token_ids))
            events += self._think(thought) + (self._close_thought("completed") if text else [])
        return events + self._answer(text)

    def _answer(self, text: str) -> list[dict]:
        """The answer's text: messages, and with tools, calls."""
        events: list[dict] = []
        pieces = [text] if self._parser is None else self._parser.pieces(text)
        for piece in pieces:
            events += self._write(piece) if isinstance(piece, str) else self._call(piece)
        return events

    def finish(self, finish_reason: str) -> list[dict]:
        """The events that end the output; every answer has at least one item (an empty message if need be)."""
        cut = finish_reason == "length"  # a call max_output_tokens cut off is dropped, not shown as text
        events = []
        if self.reasoning is not None:
            cut_mid_thought = cut and self.reasoning.tags.thinking
            thought, text = self.reasoning.finish()
            events += self._think(thought) + self._close_thought("incomplete" if cut_mid_thought else "completed")
            events += self._answer(text)
        events += self._write(self._parser.finish(cut)) if self._parser is not None else []
        if not self.items:
            events += self._open()
        if self._message is not None:
            events += self._write_now(self._held) + self._close("incomplete" if cut else "completed")
        self._held = ""
        return events

    def output(self) -> list[dict]:
        """A copy of the items; a message being written shows its text so far."""
        out = [json.loads(json.dumps(item)) for item in self.items]
        if self._message is not None:
            out[-1]["content"] = [_text_part(self._text)]
        if self._thought is not None:
            out[-1]["content"] = [_reasoning_part(self.reasoning.reasoning)]
        return out

    def _think(self, text: str) -> list[dict]:
        """The reasoning item (opened at its first text), written on."""
        if not text:
            return []
        events = []
        if self._thought is None:
            self._thought = {
                "type": "reasoning",
                "id": _id("rs"),
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
            self.items.append(self._thought)
            events += [
                {
                    "type": "response.output_item.added",
                    "output_index": len(self.items) - 1,
                    "item": dict(self._thought),
                },
                {"type": "response.content_part.added", **self._thought_at(), "part": _reasoning_part("")},
            ]
        return events + [{"type": "response.reasoning_text.delta", **self._thought_at(), "delta": text}]

    def _close_thought(self, status: str) -> list[dict]:
        if self._thought is None:
            return []
        where, item, text = self._thought_at(), self._thought, self.reasoning.reasoning
        item.update(status=status, content=[_reasoning_part(text)])
        self._thought = None
        return [
            {"type": "response.reasoning_text.done", **where, "text": text},
            {"type": "response.content_part.done", **where, "part": _reasoning_part(text)},
            {"type": "response.output_item.done", "output_index": where["output_index"], "item": dict(item)},
        ]

    def _thought_at(self) -> dict:
        return {"item_id": self._thought["id"], "output_index": len(self.items) - 1, "content_index": 0}

    @property
    def reasoning_tokens(self) -> int:
        return self.reasoning.tokens if self.reasoning is not None else 0

    def _write(self, text: str) -> list[dict]:
        if self._message is None and self._parser is not None and not (self._held + text).strip():
            self._held += text
            return []
        text, self._held = self._held + text, ""
        return self._write_now(text)

    def _write_now(self, text: str) -> list[dict]:
        if not text:
            return []
        events = self._open() if self._message is None else []
        self._text += text
        return events + [{"type": "response.output_text.delta", **self._where(), "delta": text, "logprobs": []}]

    def _open(self) -> list[dict]:
        self._message = {
            "type": "message",
            "id": _id("msg"),
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        self._text = ""
        self.items.append(self._message)
        return [
            {
                "type": "response.output_item.added",
                "output_index": len(self.items) - 1,
                "item": dict(self._message, content=[]),
            },
            {"type": "response.content_part.added", **self._where(), "part": _text_part("")},
        ]

    def _close(self, status: str) -> list[dict]:
        where, message = self._where(), self._message
        message.update(status=status, content=[_text_part(self._text)])
        self._message = None
        return [
            {"type": "response.output_text.done", **where, "text": self._text, "logprobs": []},
            {"type": "response.content_part.done", **where, "part": _text_part(self._text)},
            {
                "type": "response.output_item.done",
                "output_index": where["output_index"],
                "item": dict(message, content=[_text_part(self._text)]),
            },
        ]

    def _where(self) -> dict:
        return {"item_id": self._message["id"], "output_index": len(self.items) - 1, "content_index": 0}

    def _call(self, call: dict) -> list[dict]:
        self._held = ""
        events = self._close("completed") if self._message is not None else []
        function = call["function"]
        item = {
            "type": "function_call",
            "id": _id("fc"),
            "call_id": call["id"],
            "name": function["name"],
            "arguments": function["arguments"],
            "status": "completed",
        }
        self.items.append(item)
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        return events + [
            {
                "type": "response.output_item.added",
                "output_index": where["output_index"],
                "item": dict(item, arguments="", status="in_progress"),
            },
            {"type": "response.function_call_arguments.delta", **where, "delta": item["arguments"]},
            {"type": "response.function_call_arguments.done", **where, "arguments": item["arguments"]},
            {"type": "response.output_item.done", "output_index": where["output_index"], "item": dict(item)},
        ]


class ResponseAnswer:
    """One Response: its id, its output items and usage as the deltas arrive, and its lifecycle events."""

    def __init__(self, parsed: ResponsesRequest):
        self.parsed = parsed
        self.id = _id("resp")
        self.created_at = int(time.time())
        reasoning = parsed.generation.reasoning
        self.output = OutputItems(parsed.generation.tool_calling, reasoning.split() if reasoning else None)
        self.usage = Usage()
        self.finish_reason: str | None = None
        self.sequence_number = 0  # of the next event

    def add(self, delta: SampleDelta) -> list[dict]:
        self.usage.add(0, 0, delta)
        events = self.output.feed(delta.text, delta.token_ids)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            events += self.output.finish(delta.finish_reason)
        return events

    @property
    def status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"

    def body(self, status: str | None = None, error: dict | None = None) -> dict:
        """The Response object; `status` "in_progress" (no usage yet) or "failed" (with `error`), else final."""
        status = status or self.status
        usage = self.usage.body()
        done = status in ("completed", "incomplete")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": False,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.parsed.generation.model,
            "output": self.output.output(),
            **self.parsed.settings,
            "usage": {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": self.usage.cached_tokens, "cache_write_tokens": 0},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": self.output.reasoning_tokens},
                "total_tokens": usage["total_tokens"],
            }
            if done
            else None,
        }

    def opening(self, first: SampleDelta | None = None) -> list[dict]:
        return [
            {"type": kind, "response": self.body("in_progress")}
            for kind in ("response.created", "response.in_progress")
        ]

    def closing(self) -> list[dict]:
        """`response.completed`, or `response.incomplete` when max_output_tokens cut the answer."""
        return [{"type": f"response.{self.status}", "response": self.body()}]

    def failed(self, error: APIError) -> list[dict]:
        return [
            {"type": "error", "code": error.code or error.type, "message": error.message, "param": error.param},
            {
                "type": "response.failed",
                "response": self.body("failed", {"code": "server_error", "message": error.message}),
            },
        ]

    def sse(self, events: list[dict]) -> bytes:
        """The events as server-sent events, numbered on from the last."""
        chunks = []
        for event in events:
            event = {**event, "sequence_number": self.sequence_number}
            self.sequence_number += 1
            chunks.append(f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n")
        return "".join(chunks).encode()


async def answer_responses(
    request: web.Request, llm: TritonLLM, parsed: ResponsesRequest, admission: Admission
) -> web.StreamResponse:
    """The Response, whole or as server-sent events (`stream: true`)."""
    return await answer_events(request, llm, parsed.generation, admission, ResponseAnswer(parsed))
