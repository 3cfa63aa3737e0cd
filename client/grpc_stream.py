"""The gRPC streaming client: one request over a bi-directional stream, iterated as it answers."""

from __future__ import annotations

import queue
import sys
import time
from collections.abc import Iterator
from typing import Any

from client.inputs import DEFAULT_OUTPUTS, DEFAULT_TIMEOUT_S, build_inputs
from client.results import Chunk, Completion, ServerError, chunk_from_outputs

_gevent_ready = False


def gevent_compat() -> None:
    """Under gevent monkey-patching (Locust), switch grpc to gevent once, else streams block the hub forever."""
    global _gevent_ready
    monkey = sys.modules.get("gevent.monkey")
    if not _gevent_ready and monkey is not None and monkey.is_module_patched("threading"):
        import grpc.experimental.gevent

        grpc.experimental.gevent.init_gevent()
        _gevent_ready = True


class GrpcStream:
    """One request over a gRPC bi-directional stream; iterate for Chunks, `cancel()` to abort.

    The request is sent when the object is made (one client and stream per request unless `client` is given).
    Iteration ends after the response flagged `triton_final_response`; an error response raises ServerError.
    Leaving the iteration early (break, close(), an exception) cancels the request on the server
    (`stop_stream(cancel_requests=True)`). Under gevent (Locust) grpc is first set up for gevent. The
    additional outputs of DEFAULT_OUTPUTS are asked for unless `flat` says otherwise.
    """

    def __init__(
        self,
        prompt: str,
        url: str = "localhost:8001",
        model: str = "llm",
        *,
        stream: bool = True,
        sampling: dict | str | None = None,
        request_id: str | None = None,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        client: Any = None,
        parameters: dict | None = None,
        **flat: Any,
    ):
        gevent_compat()
        import tritonclient.grpc as grpcclient

        self.timeout_s = timeout_s
        self.chunks: list[Chunk] = []
        self.done = False
        self._queue: queue.Queue = queue.Queue()
        self._own_client = client is None
        self._client = None
        inputs = build_inputs(prompt, stream, sampling, "grpc", **{**DEFAULT_OUTPUTS, **flat})
        self._client = client if client is not None else grpcclient.InferenceServerClient(url)
        self.started_at = 0.0  # perf_counter when the request was sent
        self.ended_at: float | None = None
        try:
            self._client.start_stream(callback=self._on_response)
            self.started_at = time.perf_counter()
            self._client.async_stream_infer(
                model, inputs, request_id=request_id or "", enable_empty_final_response=True, parameters=parameters
            )
        except Exception as e:
            self._close(cancel=True)
            raise ServerError(_message(e)) from e

    def _on_response(self, result: Any, error: Any) -> None:
        self._queue.put((time.perf_counter(), result, error))

    def __iter__(self) -> Iterator[Chunk]:
        try:
            while not self.done:
                try:
                    received_at, result, error = self._queue.get(timeout=self.timeout_s)
                except queue.Empty:
                    raise ServerError(f"no response within {self.timeout_s} s") from None
                if error is not None:
                    self.done = True  # an error is the request's final response: nothing left to cancel
                    raise ServerError(_message(error))
                chunk = _grpc_chunk(result, received_at)
                self.done = chunk.is_final
                if self.done:
                    self.ended_at = received_at
                self.chunks.append(chunk)
                yield chunk
        finally:
            self._close(cancel=not self.done)

    def cancel(self) -> None:
        """Cancel the request on the server and close the stream."""
        self._close(cancel=True)

    def completion(self) -> Completion:
        """Consume what is left and return the Completion."""
        for _ in self:
            pass
        return Completion.from_chunks(self.chunks, self.started_at, self.ended_at)

    def _close(self, cancel: bool) -> None:
        if self._client is None:
            return
        client, self._client = self._client, None
        self.done = True
        try:
            client.stop_stream(cancel_requests=cancel)
        finally:
            if self._own_client:
                client.close()

    def __enter__(self) -> GrpcStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._close(cancel=True)

    def __del__(self) -> None:
        try:
            self._close(cancel=True)
        except Exception:
            pass


def _message(error: Any) -> str:
    """The text of an InferenceServerException (or any exception)."""
    message = getattr(error, "message", None)
    return message() if callable(message) else str(error)


def _grpc_chunk(result: Any, received_at: float) -> Chunk:
    response = result.get_response()
    params = response.parameters
    final = "triton_final_response" in params and params["triton_final_response"].bool_param
    sample_index = params["sample_index"].int64_param if "sample_index" in params else None
    outputs = {o.name: result.as_numpy(o.name) for o in response.outputs}
    return chunk_from_outputs(outputs, received_at, is_final=final, sample_index=sample_index)


def stream_grpc(prompt: str, url: str = "localhost:8001", model: str = "llm", **kwargs: Any) -> GrpcStream:
    """Send one request over gRPC streaming; returns an iterable GrpcStream of Chunks (see GrpcStream)."""
    return GrpcStream(prompt, url, model, **kwargs)


def generate_grpc(
    prompt: str, url: str = "localhost:8001", model: str = "llm", *, stream: bool = True, **kwargs: Any
) -> Completion:
    """Send one request over gRPC and wait for the whole Completion (stream=False: one data response)."""
    return GrpcStream(prompt, url, model, stream=stream, **kwargs).completion()
