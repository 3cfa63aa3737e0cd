"""The app served with a stand-in for its Triton client, for the SDK tests (test_responses_sdk.py,
test_anthropic_sdk.py): `ScriptedLLM` answers every request with the pieces of its `texts` and records it, and
`sdk_runner` runs a test coroutine against the app with an SDK client."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp.test_utils import TestServer

from frontend import app as app_module
from frontend.app import Settings, create_app
from frontend.triton_stream import EngineError, SampleDelta
from tests.unit.responses_requests import SERVED


class Tokenizer:
    vocab_size = 100

    def render_chat(self, messages):
        return "|".join(f"{m['role']}:{m['content']}" for m in messages)

    def encode(self, text):
        return list(range(len(text.split("|"))))  # a token per turn

    def token_text(self, token_id):
        return str(token_id)


class ScriptedLLM:
    """Answers with the pieces of `texts`, one delta each (the last with `reason`); records each request."""

    texts = ["Hel", "lo"]
    reason = "stop"
    fail: str | None = None  # an engine error, before the first delta
    fail_after: str | None = None  # an engine error, after the first delta
    requests: list = []

    def __init__(self, url):
        pass

    @classmethod
    def reset(cls) -> None:
        cls.texts, cls.reason, cls.fail, cls.fail_after, cls.requests = ["Hel", "lo"], "stop", None, None, []

    async def close(self):
        pass

    async def is_model_ready(self, model):
        return True

    async def model_parameters(self, model):
        return {}

    async def lora_admin(self, model, action):
        return {"status": 200, "message": "", "adapters": []}

    async def generate(self, model, prompt, sampling, n):
        ScriptedLLM.requests.append((prompt, sampling))
        if self.fail:
            raise EngineError(self.fail)
        for i, text in enumerate(self.texts):
            last = i == len(self.texts) - 1
            yield SampleDelta(0, text, [i], 4, i + 1, self.reason if last else None, None)
            if self.fail_after:
                raise EngineError(self.fail_after)


def sdk_runner(monkeypatch, make_client: Callable[[str], object], tokenizer=None, **settings) -> Callable:
    """run(test): test(client) with `make_client(the app's URL)`, the app served with ScriptedLLM (reset),
    `tokenizer` (default the stand-in above) and `settings` (Settings' fields)."""
    ScriptedLLM.reset()
    monkeypatch.setattr(app_module, "TritonLLM", ScriptedLLM)

    def run(test):
        async def main():
            app = create_app(Settings("unused:1", SERVED, "unused", **settings), tokenizer or Tokenizer())
            server = TestServer(app, handler_cancellation=True)
            await server.start_server()
            client = make_client(str(server.make_url("")).rstrip("/"))
            try:
                await test(client)
            finally:
                await client.close()
                await server.close()

        asyncio.run(main())

    return run
