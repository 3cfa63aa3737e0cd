"""frontend/app.py over a real aiohttp server, with a stand-in for the Triton client (the real stack is in
tests/integration/test_openai_api.py): the body limit (413, nothing forwarded), server-sent events ending in
[DONE], errors before the first token keeping their status, and a client that leaves cancelling its request."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from backend.protocol.wire import INTERNAL, INVALID_REQUEST, SERVER_BUSY, UNAVAILABLE, error_text
from frontend import app as app_module
from frontend.app import Settings, create_app
from frontend.triton_stream import EngineError, SampleDelta


class Tokenizer:
    vocab_size = 100
    max_position_embeddings = 8192

    def render_chat(self, messages):
        return "|".join(m["content"] for m in messages)

    def token_text(self, token_id):
        return str(token_id)


class FakeLLM:
    """Answers each prompt with `tokens` one-token deltas per sample; records prompts and cancellations."""

    instances: list[FakeLLM] = []
    adapters: dict[str, str] = {}
    tokens = 3
    fail: str | None = None  # an engine error to raise before the first delta
    delay_s = 0.0
    cached = 0  # every delta's num_cached_tokens

    def __init__(self, url):
        self.prompts: list[tuple[str, dict]] = []
        self.models: list[str] = []
        self.cancelled = 0
        FakeLLM.instances.append(self)

    async def close(self):
        pass

    async def is_model_ready(self, model):
        return model == "llm"

    async def model_parameters(self, model):
        return {"max_queue_size": "4", "max_model_len": "2048"}

    async def lora_admin(self, model, action):
        """The model `llm` holding the adapters of `adapters` (name -> folder), as the Triton model answers."""
        name, status, message = action.get("lora_name"), 200, ""
        if action["action"] == "load":
            FakeLLM.adapters[name] = action["lora_path"]
            message = f"Success: LoRA adapter '{name}' added successfully."
        elif action["action"] == "unload":
            del FakeLLM.adapters[name]
            message = f"Success: LoRA adapter '{name}' removed successfully."
        held = [{"name": n, "path": p, "rank": 8} for n, p in FakeLLM.adapters.items()] if model == "llm" else []
        return {"status": status, "message": message, "adapters": held, "enabled": model == "llm"}

    async def generate(self, model, prompt, sampling, n):
        self.prompts.append((prompt, sampling))
        self.models.append(model)
        if self.fail:
            raise EngineError(self.fail)
        try:
            for step in range(self.tokens):
                await asyncio.sleep(self.delay_s)
                for i in range(n):
                    last = step == self.tokens - 1
                    reason = "length" if last else None
                    yield SampleDelta(i, f"t{step}", [step], 4, step + 1, reason, None, num_cached_tokens=self.cached)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


@pytest.fixture
def front_door(monkeypatch):
    FakeLLM.instances.clear()
    FakeLLM.tokens, FakeLLM.fail, FakeLLM.delay_s, FakeLLM.cached = 3, None, 0.0, 0
    FakeLLM.adapters = {"alpha": "/adapters/alpha"}
    monkeypatch.setattr(app_module, "TritonLLM", FakeLLM)

    async def start(**settings):
        settings = Settings("unused:1", ["llm"], "unused", max_body_bytes=1000, triton_metrics_url="", **settings)
        server = TestServer(create_app(settings, Tokenizer()), handler_cancellation=True)
        await server.start_server()
        return server

    return start


def run(coro):
    return asyncio.run(coro)


async def _post(session, server, path, body=None, data=None):
    async with session.post(server.make_url(path), json=body, data=data) as resp:
        return resp.status, await resp.text()


async def _post_json(session, server, path, body):
    status, text = await _post(session, server, path, body)
    return status, json.loads(text)


def test_whole_and_streamed_answers(front_door):
    async def main():
        server = await front_door()
        async with aiohttp.ClientSession() as session:
            status, text = await _post(
                session,
                server,
                "/v1/chat/completions",
                {"model": "llm", "messages": [{"role": "user", "content": "hi"}], "n": 2},
            )
            body = json.loads(text)
            assert status == 200 and [c["message"]["content"] for c in body["choices"]] == ["t0t1t2"] * 2
            assert body["usage"] == {
                "prompt_tokens": 4,
                "completion_tokens": 6,
                "total_tokens": 10,
                "prompt_tokens_details": {"cached_tokens": 0},
            }
            assert FakeLLM.instances[0].prompts[0] == ("hi", {"n": 2, "max_tokens": 256})

            status, text = await _post(
                session,
                server,
                "/v1/completions",
                {"model": "llm", "prompt": "p", "stream": True, "stream_options": {"include_usage": True}},
            )
            events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
            assert status == 200 and events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "t0t1t2"
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
        await server.close()

    run(main())


def sse_data(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_every_route_reports_the_prompt_tokens_the_prefix_cache_served(front_door):
    FakeLLM.cached = 2  # of the 4 prompt tokens

    async def main():
        server = await front_door()
        hi = [{"role": "user", "content": "hi"}]
        routes = {
            "/v1/chat/completions": {"messages": hi},
            "/v1/completions": {"prompt": ["p", "q"]},
            "/v1/responses": {"input": "hi"},
            "/v1/messages": {"messages": hi, "max_tokens": 3},
        }
        async with aiohttp.ClientSession() as session:
            for path, body in routes.items():
                body = {"model": "llm", **body}
                status, whole = await _post_json(session, server, path, body)
                assert status == 200, whole
                stream = {**body, "stream": True}
                if path in ("/v1/chat/completions", "/v1/completions"):
                    stream["stream_options"] = {"include_usage": True}
                status, text = await _post(session, server, path, stream)
                assert status == 200, text
                events = sse_data(text)
                prompts = 2 if path == "/v1/completions" else 1
                if path == "/v1/responses":
                    usages = [whole["usage"], events[-1]["response"]["usage"]]
                    assert [u["input_tokens_details"]["cached_tokens"] for u in usages] == [2, 2]
                    assert [u["input_tokens"] for u in usages] == [4, 4]
                elif path == "/v1/messages":
                    usages = [whole["usage"], events[0]["message"]["usage"], events[-2]["usage"]]
                    assert [(u["input_tokens"], u["cache_read_input_tokens"]) for u in usages] == [(2, 2)] * 3
                else:
                    usages = [whole["usage"], events[-1]["usage"]]
                    assert [u["prompt_tokens_details"] for u in usages] == [{"cached_tokens": 2 * prompts}] * 2
                    assert [u["prompt_tokens"] for u in usages] == [4 * prompts] * 2
        await server.close()

    run(main())


def test_body_over_the_limit_is_413_and_not_forwarded(front_door):
    async def main():
        server = await front_door()
        async with aiohttp.ClientSession() as session:
            big = json.dumps({"model": "llm", "prompt": "x" * 5000}).encode()
            status, text = await _post(session, server, "/v1/completions", data=big)
            assert status == 413 and json.loads(text)["error"]["code"] == "request_too_large"

            async def chunked():  # no Content-Length: the limit applies while reading
                for _ in range(10):
                    yield b" " * 200

            status, text = await _post(session, server, "/v1/completions", data=chunked())
            assert status == 413
            assert FakeLLM.instances[0].prompts == []
            status, _ = await _post(session, server, "/v1/completions", {"model": "llm", "prompt": "ok"})
            assert status == 200
        await server.close()

    run(main())


@pytest.mark.parametrize(
    "kind, message, status, type_",
    [
        (
            SERVER_BUSY,
            "server busy: 4 requests are already waiting (max_queue_size=4); retry later",
            503,
            "server_busy",
        ),
        (UNAVAILABLE, "the server is shutting down", 503, "service_unavailable"),
        (INTERNAL, "internal error while generating: boom", 500, "internal_server_error"),
        (INVALID_REQUEST, "n must be between 1 and 8, got 9", 400, "invalid_request_error"),
        (None, "unexpected inference input 'x' for model 'llm'", 400, "invalid_request_error"),  # Triton's own
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_engine_refusals_keep_their_status_when_streaming(front_door, kind, message, status, type_, stream):
    """The model's error kind (backend/protocol/wire.py) decides the status; the client sees the message alone."""

    async def main():
        server = await front_door()
        FakeLLM.fail = error_text(message, kind) if kind else message
        async with aiohttp.ClientSession() as session:
            got, text = await _post(
                session, server, "/v1/completions", {"model": "llm", "prompt": "p", "stream": stream}
            )
            error = json.loads(text)["error"]
            assert (got, error["message"], error["type"]) == (status, message, type_)
        await server.close()

    run(main())


def test_a_client_that_leaves_cancels_its_request(front_door):
    async def main():
        server = await front_door()
        FakeLLM.tokens, FakeLLM.delay_s = 1000, 0.01
        async with aiohttp.ClientSession() as session:
            async with session.post(
                server.make_url("/v1/completions"), json={"model": "llm", "prompt": "p", "stream": True}
            ) as resp:
                await resp.content.readline()
            # leaving the block closes the connection mid-stream
        llm = FakeLLM.instances[0]
        for _ in range(100):
            if llm.cancelled:
                break
            await asyncio.sleep(0.02)
        assert llm.cancelled == 1
        async with aiohttp.ClientSession() as session:
            async with session.get(server.make_url("/metrics")) as resp:
                text = await resp.text()
        assert 'frontdoor_requests_total{route="/v1/completions",status="499"} 1' in text
        assert "frontdoor_requests_in_flight 0" in text
        await server.close()

    run(main())


def test_health_models_and_unknown_routes(front_door):
    async def main():
        server = await front_door()
        async with aiohttp.ClientSession() as session:
            async with session.get(server.make_url("/health/ready")) as resp:
                assert resp.status == 200 and (await resp.json())["models"] == {"llm": True}
            async with session.get(server.make_url("/v1/models")) as resp:
                cards = (await resp.json())["data"]
            assert [(m["id"], m["max_model_len"], m.get("parent")) for m in cards] == [
                ("llm", 2048, None),
                ("alpha", 2048, "llm"),  # a LoRA adapter, as vLLM lists one
            ]
            assert cards[1]["root"] == "/adapters/alpha"
            async with session.get(server.make_url("/v1/models/other")) as resp:
                assert resp.status == 404 and (await resp.json())["error"]["code"] == "model_not_found"
            async with session.head(server.make_url("/metrics")) as resp:
                assert resp.status == 200
            async with session.get(server.make_url("/v1/nothing")) as resp:
                assert resp.status == 404 and "error" in await resp.json()
        await server.close()

    run(main())


def test_a_multi_prompt_request_is_admitted_whole_or_refused_whole(front_door):
    """max_queue_size 4 (FakeLLM's config): 5 prompts can never be queued (400); 3 prompts while 2 are
    waiting for their first token is a 503 with Retry-After, and none of the 3 is sent."""

    async def main():
        server = await front_door()
        FakeLLM.tokens, FakeLLM.delay_s = 2, 0.5
        async with aiohttp.ClientSession() as session:
            status, text = await _post(session, server, "/v1/completions", {"model": "llm", "prompt": ["p"] * 5})
            assert status == 400 and json.loads(text)["error"]["code"] == "too_many_prompts"
            waiting = asyncio.ensure_future(
                _post(session, server, "/v1/completions", {"model": "llm", "prompt": ["a", "b"]})
            )
            await asyncio.sleep(0.2)  # both sent, neither has its first token
            async with session.post(
                server.make_url("/v1/completions"), json={"model": "llm", "prompt": ["c", "d", "e"]}
            ) as resp:
                assert resp.status == 503 and resp.headers["Retry-After"] == "1"
                assert "2 prompts are already waiting" in (await resp.json())["error"]["message"]
            assert sorted(p for p, _ in FakeLLM.instances[0].prompts) == ["a", "b"]
            assert (await waiting)[0] == 200
            status, _ = await _post(session, server, "/v1/completions", {"model": "llm", "prompt": ["c", "d", "e"]})
            assert status == 200  # the places were given back
        await server.close()

    run(main())


def test_api_key(front_door):
    async def main():
        server = await front_door(api_key="s3cret")
        body = {"model": "llm", "prompt": "p"}
        async with aiohttp.ClientSession() as session:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                async with session.post(server.make_url("/v1/completions"), json=body, headers=headers) as resp:
                    error = (await resp.json())["error"]
                    assert resp.status == 401 and error["code"] == "invalid_api_key", headers
                    assert "s3cret" not in json.dumps(error)
            for path in ("/v1/models", "/tokenize"):
                async with session.request("GET" if path == "/v1/models" else "POST", server.make_url(path)) as resp:
                    assert resp.status == 401
            async with session.post(
                server.make_url("/v1/completions"), json=body, headers={"Authorization": "Bearer s3cret"}
            ) as resp:
                assert resp.status == 200
            for path in ("/health", "/health/ready", "/metrics"):
                async with session.get(server.make_url(path)) as resp:
                    assert resp.status == 200, path
        assert FakeLLM.instances[0].prompts == [("p", {"max_tokens": 256})]
        await server.close()

    run(main())


def test_deeply_nested_json_is_a_400(front_door):
    async def main():
        server = await front_door()
        async with aiohttp.ClientSession() as session:
            status, text = await _post(session, server, "/v1/completions", data=b"[" * 500 + b"]" * 500)
            assert status == 400 and "more than 64 levels" in json.loads(text)["error"]["message"]
            nested = {"model": "llm", "prompt": "[[[[" * 100}  # brackets in a string do not count
            status, _ = await _post(session, server, "/v1/completions", nested)
            assert status == 200
        await server.close()

    run(main())


def test_an_adapter_is_a_model_of_its_own_and_can_be_added_and_removed(front_door):
    """vLLM's way: `model` names a LoRA adapter (sent to its base model with `lora_name`); /v1/load_lora_adapter
    and /v1/unload_lora_adapter add and remove one, with vLLM's answers."""

    async def main():
        server = await front_door()
        llm = FakeLLM.instances[-1]
        async with aiohttp.ClientSession() as session:
            body = {"model": "alpha", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            status, _ = await _post(session, server, "/v1/chat/completions", body)
            assert status == 200 and llm.models[-1] == "llm" and llm.prompts[-1][1]["lora_name"] == "alpha"
            status, _ = await _post(
                session, server, "/v1/completions", {"model": "llm", "prompt": "x", "max_tokens": 2}
            )
            assert status == 200 and "lora_name" not in llm.prompts[-1][1]
            add = {"lora_name": "beta", "lora_path": "/adapters/beta"}
            async with session.post(server.make_url("/v1/load_lora_adapter"), json=add) as resp:
                assert resp.status == 200 and await resp.text() == "Success: LoRA adapter 'beta' added successfully."
            status, answer = await _post_json(session, server, "/v1/load_lora_adapter", add)
            assert status == 400 and answer["error"]["message"] == "The lora adapter 'beta' has already been loaded."
            status, answer = await _post_json(session, server, "/v1/load_lora_adapter", {"lora_name": "gamma"})
            assert status == 400 and "Both 'lora_name' and 'lora_path' must be provided." in answer["error"]["message"]
            status, _ = await _post(
                session, server, "/v1/completions", {"model": "beta", "prompt": "x", "max_tokens": 2}
            )
            assert status == 200 and llm.prompts[-1][1]["lora_name"] == "beta"
            async with session.post(server.make_url("/v1/unload_lora_adapter"), json={"lora_name": "beta"}) as resp:
                assert resp.status == 200 and "removed successfully" in await resp.text()
            status, answer = await _post_json(session, server, "/v1/unload_lora_adapter", {"lora_name": "beta"})
            assert status == 404 and answer["error"]["message"] == "The lora adapter 'beta' cannot be found."
            status, answer = await _post_json(session, server, "/v1/completions", {"model": "beta", "prompt": "x"})
            assert status == 404 and answer["error"]["code"] == "model_not_found"
        await server.close()

    run(main())
