"""What only the integration suite uses: the reference outputs prefetched while the server starts, the front
door's HTTP from a test, a completion's top logprobs as the fidelity rule takes them, and a batch-view watch
(every engine step's record, over gRPC). Everything tests and benchmarks share (prompts, the Hugging Face
reference, concurrency helpers, the fidelity rule, Prometheus parsing, percentiles) is in testkit/."""

from __future__ import annotations

import json
import queue
import time
import urllib.error
import urllib.request

import numpy as np
import tritonclient.grpc as grpcclient

from testkit.prompts import MIXED_CASES

# Reference outputs computed while the server starts (any test may ask for others; they are computed then).
REFERENCE_PREFETCH: list[tuple[str, int]] = list(MIXED_CASES)


def top_logprobs(completion, top: int) -> list[dict]:
    """Per token, {"top_logprobs": {id: logprob}} (the `top` most likely, as `HFReference.judge` takes them) from the
    model's `logprobs` output (vLLM's shape: {"<id>": {"logprob", "rank", "decoded_token"}} per token)."""
    entries = []
    for chunk in completion.chunks:
        for text in chunk.raw.get("logprobs", []):
            for by_id in json.loads(text):
                ranked = sorted(by_id.items(), key=lambda item: item[1]["rank"])[:top]
                entries.append({"top_logprobs": {int(t): v["logprob"] for t, v in ranked}})
    return entries


# ------------------------------------------------------------------------------------- the front door's HTTP


def post(server, path: str, body, *, raw: bytes | None = None, method: str = "POST") -> tuple[int, dict | str]:
    """(status, JSON body) of a request to the front door, errors included."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(
        server.openai_url.removesuffix("/v1") + path,
        data=data,
        method=method,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def sse_events(server, path: str, body: dict) -> list[str]:
    """The `data:` payloads of a streamed answer, in order (raw, to see the wire format)."""
    request = urllib.request.Request(
        server.openai_url.removesuffix("/v1") + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        return [line[len("data: ") :] for line in resp.read().decode().splitlines() if line.startswith("data: ")]


# ------------------------------------------------------------------------------------------ the batch view

WATCH = {"batch_view": True}


class Watch:
    """One watch over gRPC streaming; records arrive on a queue."""

    def __init__(self, grpc_url: str, model: str):
        self.records: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(grpc_url)
        self.client.start_stream(callback=self._on_response)
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([b""], dtype=object))
        self.client.async_stream_infer(model, [text], parameters=WATCH)

    def _on_response(self, result, error) -> None:
        if error is not None:
            self.records.put({"type": "error", "message": str(error)})
            return
        for record in json.loads(result.as_numpy("text_output")[0])["records"]:
            self.records.put(record)

    def next(self, timeout_s: float = 30.0) -> dict:
        record = self.records.get(timeout=timeout_s)
        assert record["type"] != "error", record
        return record

    def steps_until_finished(self, num_seqs: int, timeout_s: float = 120.0) -> list[dict]:
        """Step records until `num_seqs` distinct sequences (request, sample) have finished."""
        steps, finished = [], set()
        deadline = time.monotonic() + timeout_s
        while len(finished) < num_seqs:
            steps.append(self.next(max(0.1, deadline - time.monotonic())))
            finished |= {(e["request_id"], e["sample"]) for e in steps[-1]["seqs"] if e["finished"]}
        return steps

    def close(self) -> None:
        self.client.stop_stream(cancel_requests=True)
        self.client.close()
