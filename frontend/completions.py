"""Running one generation against the model: every prompt's Triton request at once, answered whole or as
server-sent events (OpenAI's chunks here; an `EventAnswer`'s typed events for the Responses and Messages APIs).

A streamed answer's 200 and headers are sent only when the first token arrives, so a request the model
refuses on arrival (a prompt too long, an n above its limit, a full queue) still gets its error status. An
error after that ends the stream with an error event. When the client goes away, the handler is cancelled,
which cancels every Triton request of the generation (frontend/triton_stream.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Protocol

from aiohttp import web

from backend.protocol.wire import INTERNAL, SERVER_BUSY, UNAVAILABLE

from .admission import Admission
from .errors import APIError, bad_request, internal_error, server_busy, unavailable
from .generation import Generation
from .openai_responses import Choice, ResponseFormat, Usage
from .triton_stream import EngineError, SampleDelta, TritonLLM

_END = object()
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventAnswer(Protocol):
    """A one-prompt answer built from its deltas: whole (`body`) or as typed server-sent events (`sse`)."""

    def add(self, delta: SampleDelta) -> list[dict]: ...  # the events the delta makes

    def body(self) -> dict: ...

    def opening(self, first: SampleDelta) -> list[dict]: ...  # sent with the 200, at the first delta

    def closing(self) -> list[dict]: ...

    def failed(self, error: APIError) -> list[dict]: ...  # an engine failure after the 200

    def sse(self, events: list[dict]) -> bytes: ...


async def merged_deltas(
    llm: TritonLLM, generation: Generation, admission: Admission
) -> AsyncIterator[tuple[int, SampleDelta]]:
    """(prompt index, delta) of every prompt's request, as they come, once `admission` has taken them all;
    all are cancelled if one fails."""
    ticket = await admission.admit(generation.triton_model, len(generation.prompts))
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(prompt_index: int, prompt: str | list[int]) -> None:
        try:
            async for delta in llm.generate(generation.triton_model, prompt, generation.sampling, generation.n):
                ticket.started(prompt_index)
                queue.put_nowait((prompt_index, delta))
            queue.put_nowait(_END)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait(exc)
        finally:
            ticket.started(prompt_index)

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(generation.prompts)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
        ticket.release()


def api_error(exc: EngineError) -> APIError:
    if exc.kind == SERVER_BUSY:
        return server_busy(exc.message)
    if exc.kind == UNAVAILABLE:
        return unavailable(exc.message)
    if exc.kind == INTERNAL:
        return internal_error(exc.message)
    return bad_request(exc.message)


async def answer_whole(
    llm: TritonLLM, generation: Generation, fmt: ResponseFormat, admission: Admission
) -> web.Response:
    choices = {i: Choice() for i in range(generation.num_choices)}
    usage = Usage()
    try:
        async for prompt_index, delta in merged_deltas(llm, generation, admission):
            index = prompt_index * generation.n + delta.index
            choices[index].add(delta)
            usage.add(prompt_index, index, delta)
            fmt.observe(prompt_index, delta)
    except EngineError as exc:
        raise api_error(exc) from None
    return web.json_response(fmt.whole(choices, usage))


async def answer_stream(
    request: web.Request, llm: TritonLLM, generation: Generation, fmt: ResponseFormat, admission: Admission
) -> web.StreamResponse:
    response = web.StreamResponse(headers=SSE_HEADERS)
    usage = Usage()

    async def send(body: dict) -> None:
        await response.write(f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode())

    try:
        async for prompt_index, delta in merged_deltas(llm, generation, admission):
            if not response.prepared:
                await response.prepare(request)
                if fmt.opening_choices():
                    await send(fmt.chunk(fmt.opening_choices()))
            index = prompt_index * generation.n + delta.index
            usage.add(prompt_index, index, delta)
            fmt.observe(prompt_index, delta)
            await send(fmt.chunk([fmt.delta_choice(index, delta)]))
    except EngineError as exc:
        if not response.prepared:
            raise api_error(exc) from None
        await response.write(api_error(exc).sse())
    if generation.include_usage:
        await send(fmt.usage_chunk(usage))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def answer_events(
    request: web.Request, llm: TritonLLM, generation: Generation, admission: Admission, answer: EventAnswer
) -> web.StreamResponse:
    """`answer` whole, or as its events (`generation.stream`)."""
    if not generation.stream:
        try:
            async for _, delta in merged_deltas(llm, generation, admission):
                answer.add(delta)
        except EngineError as exc:
            raise api_error(exc) from None
        return web.json_response(answer.body())

    response = web.StreamResponse(headers=SSE_HEADERS)

    async def send(events: list[dict]) -> None:
        if events:
            await response.write(answer.sse(events))

    try:
        async for _, delta in merged_deltas(llm, generation, admission):
            if not response.prepared:
                await response.prepare(request)
                await send(answer.opening(delta))
            await send(answer.add(delta))
    except EngineError as exc:
        if not response.prepared:
            raise api_error(exc) from None
        await send(answer.failed(api_error(exc)))
    else:
        await send(answer.closing())
    await response.write_eof()
    return response
