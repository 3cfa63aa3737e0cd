"""The web page and the live batch view at the front door.

`add_routes` serves the page (`/`, files under `static/`) and `GET /v1/batch/stream`, server-sent events
carrying the engine's step records. One upstream watch, a gRPC streaming request to the model marked with
the request parameter `"batch_view": true` (docs/batch_view.md), is opened when the first viewer connects,
fanned out to every viewer through a bounded queue of its own (a slow viewer loses its oldest records and
never holds up the others or the engine), and cancelled when the last viewer leaves, so the engine builds
no records while nobody watches.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from pathlib import Path

import numpy as np
import tritonclient.grpc.aio as grpcclient
from aiohttp import web

from backend.protocol import wire

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static"
STREAM_PATH = "/v1/batch/stream"
KEEPALIVE_S = 15.0


class Viewer:
    """One connected page: a bounded queue of records; the oldest goes when it is full."""

    def __init__(self, capacity: int):
        self.records: deque[dict] = deque(maxlen=capacity)
        self.dropped = 0
        self.closed = False
        self._ready = asyncio.Event()

    def put(self, record: dict) -> None:
        if len(self.records) == self.records.maxlen:
            self.dropped += 1
        self.records.append(record)
        self._ready.set()

    def close(self) -> None:
        self.closed = True
        self._ready.set()

    async def take(self, timeout_s: float) -> list[dict]:
        """Every waiting record (waits up to `timeout_s` for one; empty after a timeout or once closed)."""
        if not self.records and not self.closed:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._ready.wait(), timeout_s)
        self._ready.clear()
        records = list(self.records)
        self.records.clear()
        return records


class BatchViewHub:
    """One upstream watch shared by every viewer, alive only while there are viewers."""

    def __init__(self, triton_grpc_url: str, model: str, capacity: int = 256, retry_s: float = 1.0):
        self.triton_grpc_url = triton_grpc_url
        self.model = model
        self.capacity = capacity
        self.retry_s = retry_s
        self.viewers: set[Viewer] = set()
        self.summary: dict | None = None  # the engine's limits, sent first to every new viewer
        self.engine_dropped = 0  # records the engine dropped because this front door read too slowly
        self._task: asyncio.Task | None = None
        self._closed = False

    @property
    def watching(self) -> bool:
        return self._task is not None and not self._task.done()

    def join(self) -> Viewer:
        viewer = Viewer(self.capacity)
        if self._closed:
            viewer.close()
            return viewer
        if self.summary is not None:
            viewer.put(self.summary)
        self.viewers.add(viewer)
        if not self.watching:
            self._task = asyncio.get_running_loop().create_task(self._watch())
        return viewer

    async def leave(self, viewer: Viewer) -> None:
        self.viewers.discard(viewer)
        viewer.close()
        if not self.viewers:
            await self._stop()

    async def close(self) -> None:
        """Close every viewer (their streams end) and the upstream watch; for the app's shutdown."""
        self._closed = True
        for viewer in list(self.viewers):
            viewer.close()
        self.viewers.clear()
        await self._stop()

    async def _stop(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _fan_out(self, record: dict) -> None:
        for viewer in self.viewers:
            viewer.put(record)

    async def _watch(self) -> None:
        """Stream the model's step records to the viewers; reconnect after an error (a server restart)."""
        while True:
            try:
                await self._watch_once()
                message = "the batch view stream ended"
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - shown to the viewers, retried
                message = f"batch view stream failed: {exc}"
            log.info("%s; retrying in %.1f s", message, self.retry_s)
            self._fan_out({"type": "error", "message": message})
            await asyncio.sleep(self.retry_s)

    async def _watch_once(self) -> None:
        text = grpcclient.InferInput("text_input", [1], wire.INPUTS["text_input"][0])
        text.set_data_from_numpy(np.array([b""], dtype=object))
        request = {"model_name": self.model, "inputs": [text], "parameters": {wire.WATCH_PARAMETER: True}}

        async def requests():
            yield request
            await asyncio.Event().wait()  # keep the stream open until cancelled

        async with grpcclient.InferenceServerClient(self.triton_grpc_url) as client:
            async for result, error in client.stream_infer(requests()):
                if error is not None:
                    raise RuntimeError(error.message())
                payload = json.loads(result.as_numpy("text_output")[0])
                self.engine_dropped = payload["dropped"]
                for record in payload["records"]:
                    if record.get("type") == "config":
                        record["model"] = self.model  # the model whose batch this is
                        self.summary = record
                    self._fan_out(record)


HUB_KEY = web.AppKey("batch_view_hub", BatchViewHub)


async def _index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


async def _stream(request: web.Request) -> web.StreamResponse:
    """Server-sent events: each `data:` line is `{"records": [...], "dropped": {"engine": n, "viewer": m}}`."""
    hub = request.app[HUB_KEY]
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        }
    )
    await response.prepare(request)
    viewer = hub.join()
    idle_s = 0.0
    try:
        while not viewer.closed and request.transport is not None and not request.transport.is_closing():
            records = await viewer.take(1.0)  # at most a second to notice a viewer that left
            if records:
                dropped = {"engine": hub.engine_dropped, "viewer": viewer.dropped}
                await response.write(f"data: {json.dumps({'records': records, 'dropped': dropped})}\n\n".encode())
                idle_s = 0.0
            else:
                idle_s += 1.0
                if idle_s >= KEEPALIVE_S:
                    await response.write(b": keep-alive\n\n")
                    idle_s = 0.0
    except ConnectionResetError:
        pass
    finally:
        await hub.leave(viewer)
    return response


def add_routes(app: web.Application, triton_grpc_url: str, model: str) -> None:
    """The page at `/` (and `/static/`) and the live step-record stream at `/v1/batch/stream`."""
    hub = BatchViewHub(triton_grpc_url, model)
    app[HUB_KEY] = hub

    async def close_hub(_app: web.Application) -> None:
        await hub.close()

    app.router.add_get("/", _index)
    app.router.add_static("/static/", STATIC_DIR)
    app.router.add_get(STREAM_PATH, _stream)
    app.on_shutdown.append(close_hub)
