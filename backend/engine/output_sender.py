"""Delivers engine outputs from a thread of their own, and watches for cancelled requests.

In a Triton Python model every `send()` and every `is_cancelled()` is a blocking round trip to the server
process. Made on the engine thread, they stall the whole batch once per request per step. Here the engine
thread only queues outputs; this thread sends them, merging the outputs of one stream that are still
waiting into one response (as Triton's vLLM backend does), and every `sweep_interval_s` asks requests in
flight whether their client has cancelled (as TensorRT-LLM's model does): one round trip per request per
100 ms rather than one per response, and at most `checks_per_sweep` (8) a sweep, so that many streams do not
make the checks outnumber the responses (at 32 streams a check of each every 100 ms was 320 round trips a
second against about 200 responses, measured: docs/benchmarks.md); beyond 8 in flight each request is asked
every ceil(n / 8) x 100 ms (400 ms at 32). A cancellation becomes `request.cancelled`, which the engine reads
at its next step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from backend.core.named_thread import NamedThread
from backend.core.request import Request, RequestOutput

log = logging.getLogger(__name__)


class OutputSender:
    def __init__(self, sweep_interval_s: float = 0.1, checks_per_sweep: int = 8):
        self.sweep_interval_s = sweep_interval_s
        self.checks_per_sweep = checks_per_sweep
        self._asked: dict[int, float] = {}  # Request.key -> when the sweep last asked it
        self._queue: deque[RequestOutput] = deque()
        self._in_flight: dict[int, Request] = {}  # by Request.key: request ids need not be unique
        self._last_sweep = time.monotonic()
        self._failed: set[int] = set()  # requests whose delivery raised: nothing more is sent to them
        self._ready = threading.Condition()
        self._closing = False
        self._thread = NamedThread(self._run, "llm-output-sender", service=True)
        self._thread.start()

    def track(self, request: Request) -> None:
        """Deliver `request`'s outputs (they name it by its key) and watch it for cancellation until its final
        output is sent; before its first output is put."""
        with self._ready:
            self._in_flight[request.key] = request

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
        if key not in self._failed:
            try:
                request.on_output(output)
            except Exception:
                log.exception("sending a response for request %s failed; cancelling it", output.request_id)
                self._failed.add(key)
                request.cancelled = True
        if output.finished:
            with self._ready:
                self._in_flight.pop(key, None)
            self._failed.discard(key)
            self._asked.pop(key, None)
            request.release_transport()

    def _sweep(self) -> None:
        """Ask up to `checks_per_sweep` requests, the ones asked longest ago first: each request every
        `sweep_interval_s` while that many are in flight, every ceil(n / checks_per_sweep) sweeps beyond."""
        now = time.monotonic()
        if now - self._last_sweep < self.sweep_interval_s:
            return
        self._last_sweep = now
        with self._ready:
            watched = [r for r in self._in_flight.values() if not r.cancelled]
        watched.sort(key=lambda r: self._asked.get(r.key, 0.0))
        for request in watched[: self.checks_per_sweep]:
            self._asked[request.key] = now
            try:
                request.cancelled = request.is_cancelled()
            except Exception:
                log.exception("checking request %s for cancellation failed", request.request_id)


def merge_outputs(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """Fold the outputs of each request into one, in order (a stream's deltas concatenate)."""
    merged: dict[int, RequestOutput] = {}
    for output in outputs:
        earlier = merged.get(output.key)
        merged[output.key] = output if earlier is None else earlier.followed_by(output)
    return list(merged.values())
