"""The state of a failover run that its parts share (loadtest/failover.py): one Record per request, the run's
events and samples, its options, and the Locust user that sends the requests through the proxy. Imported after
gevent's monkey patching (failover.py patches first)."""

from __future__ import annotations

import http.client
import itertools
import json
import random
import time
from dataclasses import dataclass, field

import gevent
from locust import User, constant, task

from client.api import parse_sse
from loadtest.workload import SYNTHETIC_PROMPTS

KILLED, DRAINED = "r1", "r2"  # the replica whose tritonserver is killed, the one stopped gracefully


@dataclass
class Record:
    id: str
    kind: str  # "stream" (chat, server-sent events) or "whole" (completion)
    max_tokens: int
    started: float
    ended: float = 0.0
    status: int = 0
    served_by: str = ""
    outcome: str = ""  # ok, error_clear, error_unclear
    started_streaming: bool = False  # the 200 and at least one event arrived
    tokens: int = 0
    error: str = ""
    retries: int = 0  # from the proxy's log
    proxy_server: str = ""  # from the proxy's log


@dataclass
class Run:
    started: float = field(default_factory=time.monotonic)
    records: list[Record] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)  # t, what
    samples: list[dict] = field(default_factory=list)  # t, replica states and KV
    accepting: bool = True  # users start new requests
    in_flight: int = 0

    def t(self) -> float:
        return round(time.monotonic() - self.started, 2)

    def event(self, what: str, **extra) -> dict:
        entry = {"t": self.t(), "what": what, **extra}
        self.events.append(entry)
        print(f"[failover] {entry['t']:7.1f} s  {what} {extra or ''}", flush=True)
        return entry


RUN = Run()
OPTIONS: dict = {}
_ids = itertools.count(1)


def _error_message(body: bytes) -> str | None:
    """The message of an OpenAI error object, or None when the body is not one."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return None


def call(record: Record, body: dict, path: str, url: str, timeout_s: float) -> None:
    """One request through the proxy; fills in the record."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request(
            "POST",
            path,
            body=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "X-Request-Id": record.id},
        )
        response = conn.getresponse()
        record.status, record.served_by = response.status, response.getheader("X-Served-By") or ""
        if response.status != 200:
            message = _error_message(response.read())
            record.outcome = "error_clear" if message else "error_unclear"
            record.error = message or f"HTTP {response.status} without an OpenAI error object"
            return
        if record.kind == "whole":
            answer = json.loads(response.read())
            record.tokens = answer["usage"]["completion_tokens"]
        else:
            done = False
            for payload in parse_sse(iter(response.readline, b"")):
                record.started_streaming = True
                if payload == "[DONE]":
                    done = True
                    break
                event = json.loads(payload)
                if "error" in event:
                    record.outcome, record.error = "error_clear", str(event["error"].get("message"))
                    return
                if event.get("usage"):
                    record.tokens = event["usage"]["completion_tokens"]
            if not done:
                record.outcome, record.error = "error_unclear", "the stream ended without [DONE] or an error event"
                return
        ok = record.tokens == record.max_tokens
        record.outcome = "ok" if ok else "error_unclear"
        record.error = "" if ok else f"{record.tokens} tokens, asked for {record.max_tokens}"
    except (OSError, http.client.HTTPException, ValueError, KeyError) as exc:
        record.outcome, record.error = "error_unclear", f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()


class FailoverUser(User):
    """Streamed chat completions and whole completions through the proxy, one after the other."""

    wait_time = constant(0)

    @task
    def one_request(self) -> None:
        if not RUN.accepting:
            gevent.sleep(0.2)
            return
        stream = random.random() < OPTIONS["stream_share"]
        max_tokens = random.randint(OPTIONS["max_tokens_min"], OPTIONS["max_tokens_max"])
        prompt = random.choice(SYNTHETIC_PROMPTS)
        record = Record(f"f{next(_ids)}", "stream" if stream else "whole", max_tokens, RUN.t())
        if stream:
            body = {
                "model": "llm",
                "messages": [{"role": "user", "content": prompt}],
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            path = "/v1/chat/completions"
        else:
            body, path = {"model": "llm", "prompt": prompt}, "/v1/completions"
        body.update(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        RUN.records.append(record)
        RUN.in_flight += 1
        try:
            call(record, body, path, OPTIONS["proxy_url"], OPTIONS["request_timeout"])
        finally:
            RUN.in_flight -= 1
            record.ended = RUN.t()
        self.environment.events.request.fire(
            request_type=record.kind,
            name=record.outcome,
            response_time=(record.ended - record.started) * 1000,
            response_length=record.tokens,
            exception=None if record.outcome == "ok" else Exception(record.error),
            context={},
        )
        if record.outcome != "ok":
            gevent.sleep(0.1)
