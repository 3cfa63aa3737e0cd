"""Delivers engine outputs from a thread of their own, and watches for cancelled requests.

In a Triton Python model every `send()` and every `is_cancelled()` is a blocking round trip to the server
process. Made on the engine thread, they stall the whole batch once per request per step. Here the engine
thread only queues outputs; this thread sends them, merging the outputs of one stream that are still
waiting into one response (as Triton's vLLM backend does), and every `sweep_interval_s` asks requests in
flight whether their client has cancelled (as TensorRT-LLM's model does): one round trip per request per
100 ms rather than one per response, and at most `checks_per_sweep` (8) a sweep, so that many streams do not
make the checks outnumber the responses (at 32 streams a check of each every 100 ms was 320 round trips a
second against about 200 responses, measured: docs/benchmarks.md); beyond 8 in flight each request is asked
every ceil(n / 8) x 100 ms (400 ms at 32).

The transport's handles of each request in flight (its `Transport`) are this thread's alone, keyed by the request's
key: the engine never holds them. A cancelled client, or one whose delivery raised, becomes a message to the engine
loop (`on_cancel`, the loop's `abort_requests`), which aborts the request at its next step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from backend.core.named_thread import NamedThread
from backend.core.request import RequestOutput

log = logging.getLogger(__name__)


def _never_cancelled() -> bool:
    return False


@dataclass(frozen=True)
class Transport:
    """Where one request's outputs go and how to ask whether its client is gone: a transport's handles (a Triton
    response sender's `send` and `is_cancelled`). Dropped once the final output is sent: Triton cannot unload a
    model while a response sender of one of its requests is alive."""

    send: Callable[[RequestOutput], None]
    is_cancelled: Callable[[], bool] = _never_cancelled


@dataclass
class _InFlight:
    request_id: str  # for the log: ids need not be unique, keys are
    transport: Transport
    cancelled: bool = False  # told to `on_cancel`: not asked again
    failed: bool = False  # a delivery raised: nothing more is sent to it


class OutputSender:
    """`on_cancel(keys)` is called from this thread with the keys of requests whose client cancelled or whose
    delivery failed."""

    def __init__(
        self,
        on_cancel: Callable[[Iterable[int]], None] = lambda keys: None,
        sweep_interval_s: float = 0.1,
        checks_per_sweep: int = 8,
    ):
        self.on_cancel = on_cancel
        self.sweep_interval_s = sweep_interval_s
        self.checks_per_sweep = checks_per_sweep
        self._asked: dict[int, float] = {}  # key -> when the sweep last asked it
        self._queue: deque[RequestOutput] = deque()
        self._in_flight: dict[int, _InFlight] = {}  # by ClientRequest.key: request ids need not be unique
        self._last_sweep = time.monotonic()
        self._ready = threading.Condition()
        self._closing = False
        self._thread = NamedThread(self._run, "llm-output-sender", service=True)
        self._thread.start()

    def track(self, key: int, request_id: str, transport: Transport) -> None:
        """Deliver the outputs of the request `key` (they name it by it) through `transport` and watch it for
        cancellation until its final output is sent; before its first output is put."""
        with self._ready:
            self._in_flight[key] = _InFlight(request_id, transport)

    def put(self, output: RequestOutput) -> None:
        with self._ready:
            self._queue.append(output)
            self._ready.notify()

    def close(self, timeout_s: float = 30.0) -> None:
        """Send everything queued, then stop the thread."""
        with self._ready:
            self._closing = True
            self._ready.notify()
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while True:
            with self._ready:
                if not self._queue and not self._closing:
                    self._ready.wait(timeout=self.sweep_interval_s)
                batch = list(self._queue)
                self._queue.clear()
                closing = self._closing
            for output in merge_outputs(batch):
                self._deliver(output)
            self._sweep()
            if closing and not self._queue:
                return

    def _deliver(self, output: RequestOutput) -> None:
        key = output.key
        with self._ready:
            request = self._in_flight.get(key)
        if request is None:
            log.error("an output for request %s, which is not tracked, was dropped", output.request_id)
            return
        if not request.failed:
            try:
                request.transport.send(output)
            except Exception:
                log.exception("sending a response for request %s failed; cancelling it", output.request_id)
                request.failed = True
                self._cancel([key])
        if output.finished:
            with self._ready:
                self._in_flight.pop(key, None)
            self._asked.pop(key, None)

    def _sweep(self) -> None:
        """Ask up to `checks_per_sweep` requests, the ones asked longest ago first: each request every
        `sweep_interval_s` while that many are in flight, every ceil(n / checks_per_sweep) sweeps beyond."""
        now = time.monotonic()
        if now - self._last_sweep < self.sweep_interval_s:
            return
        self._last_sweep = now
        with self._ready:
            watched = [(key, r) for key, r in self._in_flight.items() if not r.cancelled]
        watched.sort(key=lambda item: self._asked.get(item[0], 0.0))
        cancelled = []
        for key, request in watched[: self.checks_per_sweep]:
            self._asked[key] = now
            try:
                if request.transport.is_cancelled():
                    cancelled.append(key)
            except Exception:
                log.exception("checking request %s for cancellation failed", request.request_id)
        if cancelled:
            self._cancel(cancelled)

    def _cancel(self, keys: list[int]) -> None:
        """Tell the engine loop to abort these requests; they are not asked again."""
        with self._ready:
            for key in keys:
                self._in_flight[key].cancelled = True
        self.on_cancel(keys)


def merge_outputs(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """Fold the outputs of each request into one, in order (a stream's deltas concatenate)."""
    merged: dict[int, RequestOutput] = {}
    for output in outputs:
        earlier = merged.get(output.key)
        merged[output.key] = output if earlier is None else earlier.followed_by(output)
    return list(merged.values())
