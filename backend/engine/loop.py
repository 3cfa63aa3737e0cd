"""Runs the engine on its own thread: requests and aborts come in from any thread as messages the loop takes at
the top of each step; outputs go out through each request's transport from the output sender's thread
(`output_sender.py`), which also watches each client for cancellation, so the engine thread never waits on one."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable

from backend.core.client_request import ClientRequest
from backend.core.config import EngineConfig
from backend.core.named_thread import NamedThread
from backend.core.request import RequestOutput
from backend.engine.llm_engine import LLMEngine
from backend.engine.output_sender import OutputSender, Transport
from backend.protocol.wire import INTERNAL, SERVER_BUSY, UNAVAILABLE, ErrorText

log = logging.getLogger(__name__)


class ServerBusy(Exception):
    """The waiting queue is full; the request is refused at once."""

    kind = SERVER_BUSY


class EngineStopped(Exception):
    """The engine thread is gone (it died, or the model is shutting down); the request is refused at once."""

    kind = UNAVAILABLE


SHUTTING_DOWN = ErrorText("the server is shutting down", UNAVAILABLE)


def load_engine(config: EngineConfig) -> LLMEngine:
    """`LLMEngine(config)`, built on a thread of its own that ends when it is done, so that the engine thread is the
    one thread of the process that runs torch's parallel regions.

    OpenMP (libgomp) keeps a pool of worker threads for each thread that has run a parallel region, for as long as
    that thread lives. Loading runs such regions; built on the Triton stub's main thread, its pool stayed beside the
    engine thread's, which put more OpenMP threads than cores on a 2-core machine, and libgomp then stops spinning
    between regions: every kernel call of a step woke a sleeping worker (measured at batch 1: 60 tok/s through
    Triton against 91 in process). A pool goes with its thread."""
    built: list[LLMEngine] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            built.append(LLMEngine(config))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
            errors.append(exc)

    loader = NamedThread(build, "llm-engine-load", daemon=False)
    loader.start()
    loader.join()
    if errors:
        raise errors[0]
    return built[0]


class EngineLoop:
    """`on_death`, if given, is called once from the dying engine thread after every request in flight has had its
    error queued for the output sender (the Triton model uses it to stop reporting READY)."""

    def __init__(self, engine: LLMEngine, on_death: Callable[[ErrorText], None] | None = None):
        self.engine = engine
        self.on_death = on_death
        self._incoming: deque[ClientRequest] = deque()
        self._aborts: deque[int] = deque()  # keys of requests to abort, taken after the requests that came before
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._thread = NamedThread(self._run, "llm-engine")
        self.sender = OutputSender(on_cancel=self.abort_requests)
        self.failure: ErrorText | None = None  # why the engine thread died, once it has

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    @property
    def num_waiting(self) -> int:
        return len(self._incoming) + len(self.engine.scheduler.waiting)

    def submit(self, request: ClientRequest, transport: Transport) -> None:
        """Queue a request for the next step, its outputs to go through `transport`; raises ServerBusy past
        `max_queue_size` waiting requests and EngineStopped once the engine thread is gone."""
        limit = self.engine.config.max_queue_size
        with self._lock:
            if self.failure is not None:
                raise EngineStopped(self.failure)
            if self._stopping.is_set():
                raise EngineStopped(SHUTTING_DOWN)
            if limit and self.num_waiting >= limit:
                self.engine.metrics.inc("llm_requests_rejected_total")
                self.engine.metrics.flush()
                raise ServerBusy(
                    f"server busy: {self.num_waiting} requests are already waiting (max_queue_size={limit}); "
                    "retry later"
                )
            self._incoming.append(request)
            self.sender.track(request.key, request.request_id, transport)
        self._wakeup.set()

    def abort_requests(self, keys: Iterable[int]) -> None:
        """Abort these requests (by `ClientRequest.key`) at the engine's next step, from any thread: a message to
        the engine thread, which alone changes the engine's state."""
        with self._lock:
            self._aborts.extend(keys)
        self._wakeup.set()

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - the thread is dying: say so to every request
            log.exception("the engine thread died")
            with self._lock:
                self.failure = ErrorText(
                    f"the engine stopped after an internal error ({type(exc).__name__}: {exc}); "
                    "the model must be reloaded (restart the server)",
                    UNAVAILABLE,
                )
            self._fail_in_flight(self.failure)
            self.engine.metrics.set("llm_engine_alive", 0)
            self.engine.update_gauges()  # the blocks the failed requests held are free again
            self.engine.metrics.flush()
            if self.on_death is not None:
                self.on_death(self.failure)

    def _serve(self) -> None:
        while not self._stopping.is_set():
            self._admit()
            if not self.engine.has_work():
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            for output in self.engine.step():
                self.sender.put(output)

    def _admit(self) -> None:
        """Take the messages in: new requests first, then the aborts, which name only requests submitted before
        them (so none is lost to a request not yet admitted)."""
        with self._lock:
            aborts = list(self._aborts)
            self._aborts.clear()
        while self._incoming:
            request = self._incoming.popleft()
            try:
                self.engine.add_request(request)
            except Exception as exc:  # e.g. a duplicate id: answer this request only
                self.sender.put(_error_output(request, ErrorText(str(exc), getattr(exc, "kind", INTERNAL))))
        if aborts:
            self.engine.abort_requests(aborts)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the loop, then answer every request still in flight with an error."""
        with self._lock:
            self._stopping.set()
        self._wakeup.set()
        self._thread.join(timeout=timeout_s)
        self._fail_in_flight(SHUTTING_DOWN)
        self.sender.close(timeout_s)

    def _fail_in_flight(self, message: ErrorText) -> None:
        """Answer every request not yet finished with `message`, freeing what the engine holds for it."""
        with self._lock:
            incoming = list(self._incoming)
            self._incoming.clear()
        for request in incoming:  # never reached the engine
            self.sender.put(_error_output(request, message))
        for request in list(self.engine.requests.values()):
            request.error = message
            try:
                output = self.engine.abort(request.request_id)
            except Exception:  # noqa: BLE001 - a broken engine must not keep the client waiting
                log.exception("aborting request %s failed", request.request_id)
                self.engine.requests.pop(request.request_id, None)
                output = _error_output(request, message)
            self.sender.put(output)


def _error_output(request: ClientRequest, error: str) -> RequestOutput:
    return RequestOutput(request.request_id, [], len(request.prompt_token_ids), True, error, request.key)
