"""What only the integration suite uses: the reference outputs prefetched while the server starts, and the front
door's HTTP from a test. Everything tests and benchmarks share (prompts, the Hugging Face reference, concurrency
helpers, the fidelity rule, Prometheus parsing, percentiles) is in testkit/."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from testkit.prompts import MIXED_CASES

# Reference outputs computed while the server starts (any test may ask for others; they are computed then).
REFERENCE_PREFETCH: list[tuple[str, int]] = list(MIXED_CASES)


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
