"""Delivers engine outputs from a thread of their own, and watches for cancelled requests.

In a Triton Python model every `send()` and every `is_cancelled()` is a blocking round trip to the server
process. Made on the engine thread, they stall the whole batch once per request per step. Here the engine
thread only queues outputs; this thread sends them, merging the outputs of one stream that are still
waiting into one response (as Triton's vLLM backend does), and every `sweep_interval_s` asks each request
in flight whether its client has cancelled (as TensorRT-LLM's model does): one round trip per request per
100 ms rather than one per response. A cancellation becomes `request.cancelled`, which the engine reads at
its next step.

`response_arrays` is what one response holds, in Triton's vLLM backend's terms (docs/interface.md): the
additional outputs only when asked for, `num_output_tokens` and `logprobs` counting this response's tokens,
`prompt_logprobs` JSON null except in the one response that carries them.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from typing import Callable

import numpy as np

from .request import Request, RequestOutput, SampleOutput

log = logging.getLogger(__name__)


class OutputSender:
    def __init__(self, sweep_interval_s: float = 0.1):
        self.sweep_interval_s = sweep_interval_s
        self._queue: deque[RequestOutput] = deque()
        self._in_flight: dict[int, Request] = {}  # by id(): request ids need not be unique
        self._last_sweep = time.monotonic()
        self._failed: set[int] = set()  # requests whose delivery raised: nothing more is sent to them
        self._ready = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="llm-output-sender", daemon=True)
        self._thread.start()

    def track(self, request: Request) -> None:
        """Watch `request` for cancellation until its final output is sent."""
        with self._ready:
            self._in_flight[id(request)] = request

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
        request = output.request
        key = id(request)
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

    def _sweep(self) -> None:
        now = time.monotonic()
        if now - self._last_sweep < self.sweep_interval_s:
            return
        self._last_sweep = now
        with self._ready:
            watched = [r for r in self._in_flight.values() if not r.cancelled]
        for request in watched:
            try:
                request.cancelled = request.is_cancelled()
            except Exception:
                log.exception("checking request %s for cancellation failed", request.request_id)


def merge_outputs(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """Fold the outputs of each request into one, in order (a stream's deltas concatenate)."""
    merged: dict[int, RequestOutput] = {}
    for output in outputs:
        key = id(output.request)
        earlier = merged.get(key)
        merged[key] = output if earlier is None else earlier.followed_by(output)
    return list(merged.values())


class TokenTexts:
    """The text of single tokens (vLLM's `decoded_token`), cached by id. Uses the engine thread's tokenizer
    from the sender thread: decoding only reads it (no truncation or padding state is touched)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[tuple[int, bool], str] = {}

    def __call__(self, token_id: int, skip_special_tokens: bool = True) -> str:
        key = (token_id, skip_special_tokens)
        text = self._cache.get(key)
        if text is None:
            text = self._cache[key] = self.tokenizer.decode(
                [token_id], skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
            )
        return text


def vllm_logprobs(entries: list[dict] | None, token_text: Callable[[int], str]) -> list[dict] | None:
    """Engine logprob entries as vLLM's backend sends them: per token, {"<id>": {"logprob", "rank",
    "decoded_token"}} for the sampled token (first) and the top alternatives; None without logprobs."""
    if entries is None:
        return None

    def one(token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": token_text(token_id)}

    out = []
    for entry in entries:
        by_id = {str(entry["token_id"]): one(entry["token_id"], entry["logprob"], entry["rank"])}
        for rank, (token_id, logprob) in enumerate((entry.get("top_logprobs") or {}).items(), start=1):
            by_id.setdefault(str(token_id), one(token_id, logprob, rank))
        out.append(by_id)
    return out


def prompt_logprobs(entries: list[dict | None] | None, token_text: TokenTexts) -> list[dict | None] | None:
    """The prompt's logprobs in vLLM's shape: None for the first token, then one `vllm_logprobs` entry per
    token; None in every response but the one that carries them."""
    if entries is None:
        return None
    return [None] + vllm_logprobs(entries[1:], lambda t: token_text(t, False))


def response_arrays(output: RequestOutput, samples: list[SampleOutput], wanted: frozenset[str],
                    token_text: TokenTexts, prefix: str = "") -> dict[str, np.ndarray]:
    """The output tensors of one response for `samples` (one per stream response, all `n` otherwise):
    text_output, output_ids and sample_index always, each name in `wanted` (request_inputs.OPTIONAL_OUTPUTS)
    besides. `samples` carry this response's tokens, so their count is the response's num_output_tokens."""
    ids = [s.token_ids for s in samples]
    width = max(len(x) for x in ids)
    id_array = np.array([x + [-1] * (width - len(x)) for x in ids], dtype=np.int32)
    skip_special = output.request.params.skip_special_tokens if output.request is not None else True

    def texts(values) -> np.ndarray:
        return np.array([v.encode() for v in values], dtype=object)

    optional = {
        "finish_reason": lambda: texts(s.finish_reason.value if s.finish_reason else "None" for s in samples),
        "cumulative_logprob": lambda: np.array([s.cumulative_logprob for s in samples], dtype=np.float32),
        "logprobs": lambda: texts(
            json.dumps(vllm_logprobs(s.logprobs, lambda t: token_text(t, skip_special))) for s in samples
        ),
        "num_input_tokens": lambda: np.array([output.num_input_tokens], dtype=np.uint32),
        "num_output_tokens": lambda: np.array([len(s.token_ids) for s in samples], dtype=np.uint32),
        "prompt_logprobs": lambda: texts([json.dumps(prompt_logprobs(output.prompt_logprobs, token_text))]),
    }
    arrays = {
        "text_output": texts(prefix + s.text for s in samples),
        "output_ids": id_array[0] if len(samples) == 1 else id_array,
        "sample_index": np.array([s.sample_index for s in samples], dtype=np.int32),
    }
    arrays.update((name, make()) for name, make in optional.items() if name in wanted)
    return arrays
