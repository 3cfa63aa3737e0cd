"""frontend/batch_view.py with a stand-in for the model's watch stream: one upstream watch, started by the
first viewer and stopped when the last leaves; records fanned out to every viewer through bounded queues
(a viewer that does not read loses its oldest records, the others get everything); the SSE route and the
page's files over a real aiohttp server."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from frontend import batch_view
from frontend.batch_view import BatchViewHub, Viewer


class FakeUpstream:
    """Replaces BatchViewHub._watch_once: counts starts and cancellations, forwards what the test feeds."""

    def __init__(self, hub: BatchViewHub):
        self.hub = hub
        self.feed: asyncio.Queue = asyncio.Queue()
        self.starts = 0
        self.cancelled = 0
        self.live = asyncio.Event()

    async def __call__(self) -> None:
        self.starts += 1
        self.live.set()
        try:
            while True:
                item = await self.feed.get()
                if isinstance(item, Exception):
                    raise item
                self.hub._fan_out(item)
        except asyncio.CancelledError:
            self.cancelled += 1
            self.live.clear()
            raise


def make_hub(capacity: int = 256) -> tuple[BatchViewHub, FakeUpstream]:
    hub = BatchViewHub("127.0.0.1:1", "llm", capacity=capacity, retry_s=0.01)
    upstream = FakeUpstream(hub)
    hub._watch_once = upstream
    return hub, upstream


def step(n: int) -> dict:
    return {"type": "step", "step": n, "seqs": []}


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_one_upstream_started_by_the_first_viewer_and_stopped_by_the_last():
    async def scenario():
        hub, upstream = make_hub()
        await settle()
        assert upstream.starts == 0 and not hub.watching  # nobody watches: no upstream watch
        first = hub.join()
        second = hub.join()
        await asyncio.wait_for(upstream.live.wait(), 5)
        assert upstream.starts == 1 and hub.watching
        await upstream.feed.put(step(1))
        await settle()
        assert await first.take(0) == [step(1)] and await second.take(0) == [step(1)]
        await hub.leave(first)
        assert hub.watching and upstream.cancelled == 0
        await hub.leave(second)
        assert not hub.watching and upstream.cancelled == 1
        third = hub.join()  # a new viewer starts a new watch
        await asyncio.wait_for(upstream.live.wait(), 5)
        assert upstream.starts == 2
        await hub.close()
        assert third.closed and not hub.watching

    asyncio.run(scenario())


def test_a_viewer_that_does_not_read_drops_its_oldest_records_and_holds_up_nobody():
    async def scenario():
        hub, upstream = make_hub(capacity=4)
        slow, fast = hub.join(), hub.join()
        await asyncio.wait_for(upstream.live.wait(), 5)
        got = []
        for n in range(10):
            await upstream.feed.put(step(n))
            await settle()
            got += await fast.take(0)
        assert [r["step"] for r in got] == list(range(10))
        assert [r["step"] for r in await slow.take(0)] == [6, 7, 8, 9] and slow.dropped == 6 and fast.dropped == 0
        await hub.close()

    asyncio.run(scenario())


def test_upstream_errors_reach_the_viewers_and_the_watch_is_retried():
    async def scenario():
        hub, upstream = make_hub()
        viewer = hub.join()
        await asyncio.wait_for(upstream.live.wait(), 5)
        await upstream.feed.put(RuntimeError("server restarting"))
        for _ in range(100):
            if upstream.starts >= 2:
                break
            await asyncio.sleep(0.01)
        assert upstream.starts == 2
        records = await viewer.take(0)
        assert records[0]["type"] == "error" and "server restarting" in records[0]["message"]
        await hub.close()

    asyncio.run(scenario())


def test_the_engine_summary_greets_every_new_viewer():
    async def scenario():
        hub, _ = make_hub()
        hub.summary = {"type": "config", "token_budget": 64, "model": "llm"}
        viewer = hub.join()
        assert await viewer.take(0) == [hub.summary]
        await hub.close()

    asyncio.run(scenario())


def test_viewer_take_waits_for_a_record_or_the_timeout():
    async def scenario():
        viewer = Viewer(capacity=2)
        assert await viewer.take(0.01) == []
        asyncio.get_running_loop().call_later(0.02, viewer.put, step(1))
        assert await viewer.take(5) == [step(1)]
        viewer.close()
        assert await viewer.take(5) == []

    asyncio.run(scenario())


def test_routes_serve_the_page_and_stream_records_until_the_viewer_leaves():
    async def scenario():
        app = web.Application()
        batch_view.add_routes(app, "127.0.0.1:1", "llm")
        hub = app[batch_view.HUB_KEY]
        upstream = FakeUpstream(hub)
        hub._watch_once = upstream
        async with TestServer(app) as server, aiohttp.ClientSession() as session:
            async with session.get(server.make_url("/")) as resp:
                assert resp.status == 200 and 'id="batch-grid"' in await resp.text()
            async with session.get(server.make_url("/static/app.js")) as resp:
                assert resp.status == 200 and "EventSource" in await resp.text()
            resp = await session.get(server.make_url(batch_view.STREAM_PATH))
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            await asyncio.wait_for(upstream.live.wait(), 5)
            await upstream.feed.put(step(7))
            line = await asyncio.wait_for(resp.content.readline(), 5)
            payload = json.loads(line.decode().removeprefix("data: "))
            assert payload == {"records": [step(7)], "dropped": {"engine": 0, "viewer": 0}}
            resp.close()  # the viewer leaves: the upstream watch stops within a second or two
            for _ in range(300):
                if not hub.watching:
                    break
                await asyncio.sleep(0.01)
            assert not hub.watching and upstream.cancelled == 1

    asyncio.run(scenario())
