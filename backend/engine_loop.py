"""Runs the engine on its own thread: requests come in from any thread, outputs go out through each
request's `on_output` callback from the engine thread."""
from __future__ import annotations

import logging
import threading
from collections import deque

from .engine import LLMEngine
from .request import Request, RequestOutput

log = logging.getLogger(__name__)


class ServerBusy(Exception):
    """The waiting queue is full; the request is refused at once."""


class EngineLoop:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._incoming: deque[Request] = deque()
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llm-engine", daemon=True)

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    @property
    def num_waiting(self) -> int:
        return len(self._incoming) + len(self.engine.scheduler.waiting)

    def submit(self, request: Request) -> None:
        """Queue a request for the next step; raises ServerBusy past `max_queue_size` waiting requests."""
        limit = self.engine.config.max_queue_size
        with self._lock:
            if self._stopping.is_set():
                raise ServerBusy("the server is shutting down")
            if limit and self.num_waiting >= limit:
                self.engine.metrics.inc("llm_requests_rejected_total")
                self.engine.metrics.flush()
                raise ServerBusy(
                    f"server busy: {self.num_waiting} requests are already waiting (max_queue_size={limit}); "
                    "retry later"
                )
            self._incoming.append(request)
        self._wakeup.set()

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._admit()
            if not self.engine.has_work():
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            for output in self.engine.step():
                self._deliver(output)

    def _admit(self) -> None:
        while self._incoming:
            request = self._incoming.popleft()
            try:
                self.engine.add_request(request)
            except Exception as exc:  # e.g. a duplicate id: answer this request only
                self._deliver(_error_output(request, str(exc)))

    def _deliver(self, output: RequestOutput) -> None:
        try:
            output.request.on_output(output)
        except Exception:
            log.exception("sending a response for request %s failed; aborting it", output.request_id)
            if not output.finished:
                self.engine.abort(output.request_id)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the loop, then answer every request still in flight with an error."""
        with self._lock:
            self._stopping.set()
        self._wakeup.set()
        self._thread.join(timeout=timeout_s)
        message = "the server is shutting down"
        while self._incoming:  # never reached the engine
            self._deliver(_error_output(self._incoming.popleft(), message))
        for request in list(self.engine.requests.values()):
            request.error = message
            self._deliver(self.engine.abort(request.request_id))


def _error_output(request: Request, error: str) -> RequestOutput:
    return RequestOutput(request.request_id, [], len(request.prompt_token_ids), True, error, request)
