"""The engine as a transport sees it: one small facade over the engine and the thread that runs it.

The Triton model (model_repository/llm/1/model.py) talks to this and to Triton, nothing else of the engine: it
parses a request against the engine's limits, builds and submits it, answers LoRA admin actions and batch-view
watches, publishes the metrics, and shuts the engine down. The order of start-up is kept here: the engine is
built off the calling thread (`load_engine`), the metrics' first round trips are made by the calling thread, and
only then does the engine thread start (docs/engine.md, "Start and stop").
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import numpy as np

from backend.core.client_request import ClientRequest
from backend.core.config import EngineConfig
from backend.core.metrics import PeriodicPublisher
from backend.engine.loop import EngineLoop, load_engine
from backend.engine.output_sender import Transport
from backend.serving import lora_admin
from backend.serving.batch_view import WatchStream, engine_summary
from backend.serving.request_inputs import ParsedRequest, parse_request
from backend.serving.response_tensors import TokenTexts


class EngineClient:
    def __init__(self, config: EngineConfig, publisher: PeriodicPublisher, on_death: Callable[[str], None]):
        """Load the engine, publish its gauges once through `publisher` from this thread, start the engine thread
        (`on_death(failure)` is called from it if it dies)."""
        self._engine = load_engine(config)
        self.publisher = publisher
        self._engine.metrics.add_sink(publisher)
        publisher.publish()  # the gauges (llm_engine_alive 1 among them) are right once the model is READY
        self._loop = EngineLoop(self._engine, on_death=on_death).start()
        self.token_texts = TokenTexts(self._engine.tokenizer)  # decoded_token of the logprobs output

    def parse(self, tensors: dict[str, np.ndarray], parameters_json: str) -> ParsedRequest:
        """A request's inputs as one validated request; raises InvalidRequest."""
        return parse_request(tensors, parameters_json, self._engine.config.max_n, self._engine.max_model_len)

    def build_request(self, parsed: ParsedRequest) -> ClientRequest:
        """Tokenize and check `parsed` against the model, the pool and the adapters; raises InvalidRequest."""
        return self._engine.build_request(
            uuid.uuid4().hex,
            parsed.prompt,
            parsed.params,
            parsed.lora_name,
            parsed.lora_task_id,
            stream=parsed.stream,
            tracks_cumulative_logprob="cumulative_logprob" in parsed.outputs,
        )

    def submit(self, request: ClientRequest, transport: Transport) -> None:
        """Queue it for the engine thread, its outputs to go through `transport`; raises ServerBusy or
        EngineStopped."""
        self._loop.submit(request, transport)

    def publish_metrics(self) -> None:
        """Everything the engine has counted, published now (from the calling thread)."""
        self._engine.metrics.flush()
        self.publisher.publish()

    def lora_admin(self, action: dict) -> str:
        return lora_admin.answer(self._engine, action)

    def watch(self, send: Callable[[str], None], is_cancelled: Callable[[], bool], on_end: Callable[[], None]) -> None:
        """Stream the engine's step records (JSON text) to `send` until `is_cancelled()`."""
        WatchStream(self._engine.watchers, engine_summary(self._engine), send, is_cancelled, on_end).start()

    def close_watchers(self) -> None:
        """End every batch-view stream (an unload waits for every request in flight)."""
        self._engine.watchers.close()

    def shutdown(self) -> None:
        """Stop the engine thread (requests in flight get their error), then the metrics publishing."""
        self._engine.watchers.close()
        self._loop.shutdown()
        self.publisher.close()
        self._engine.metrics.sinks.clear()
