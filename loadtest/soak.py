"""Soak test (not in CI): N minutes at saturation against a server of its own, with a mix of users of which
a share cancel or drop their connection mid-stream; reports failures (anything but the intended
cancellations), the server's RSS over time (tritonserver, its Python stubs and the OpenAI front door), TTFT
p50/p99 per minute, and whether `llm_kv_cache_blocks_used` is back to 0 at the end. It starts tritonserver
and the front door on free ports. Writes a Markdown report, the raw samples (JSON) and a plot (PNG) under
loadtest/results/.

    .venv/bin/llm-soak --minutes 10 --users 16
    .venv/bin/llm-soak --mix GrpcStreamUser:3,HttpStreamUser:2,CancellingGrpcUser:1

The user mix is pluggable: `--mix NAME:WEIGHT,...` picks from USER_CLASSES (the load test's users and the
cancelling and dropping ones below, OpenAI users included); `--user-module pkg.module` adds the Locust User
classes a module exports to the names `--mix` can use.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
import time
from pathlib import Path

import gevent
from gevent import monkey

monkey.patch_all()

import psutil  # noqa: E402
from locust import User  # noqa: E402
from locust.env import Environment  # noqa: E402

import launcher  # noqa: E402
from client.api import Completion, GrpcStream, stream_http  # noqa: E402
from launcher.paths import REPO_ROOT  # noqa: E402
from loadtest import locustfile  # noqa: E402
from loadtest.locustfile import (  # noqa: E402
    GrpcStreamUser,
    HttpGenerateUser,
    HttpStreamUser,
    OpenAIChatUser,
    _http_url,
)
from loadtest.soak_recording import SAMPLE_INTERVAL_S, Recorder, scrape  # noqa: E402
from loadtest.soak_report import analyse, plot, report_text  # noqa: E402

RESULTS_DIR = REPO_ROOT / "loadtest" / "results"
RESPONSES_BEFORE_LEAVING = 3


class _LeavesMidStream:
    """A user that cancels or drops its stream on purpose: its answer is cut short, so nothing is checked."""

    def check(self, completion, max_tokens):
        pass


class CancellingGrpcUser(_LeavesMidStream, GrpcStreamUser):
    """Streams over gRPC, then cancels after a few responses (stop_stream(cancel_requests=True))."""

    request_type = "grpc_cancel"

    def call(self, prompt, params):
        stream = GrpcStream(
            prompt, self.grpc_url, self.options.model, stream=True, timeout_s=self.options.request_timeout, **params
        )
        for i, _chunk in enumerate(stream):
            if i + 1 >= RESPONSES_BEFORE_LEAVING:
                stream.cancel()
                break
        return Completion.from_chunks(stream.chunks, stream.started_at)


class DroppingHttpStreamUser(_LeavesMidStream, HttpStreamUser):
    """Streams over HTTP (server-sent events), then drops the connection after a few events."""

    request_type = "http_drop"

    def call(self, prompt, params):
        chunks, started = [], time.perf_counter()
        events = stream_http(
            prompt, _http_url(self.host), self.options.model, timeout_s=self.options.request_timeout, **params
        )
        for chunk in events:
            chunks.append(chunk)
            if len(chunks) >= RESPONSES_BEFORE_LEAVING:
                break
        events.close()  # closes the socket mid-stream
        return Completion.from_chunks(chunks, started)


class DroppingOpenAIUser(_LeavesMidStream, OpenAIChatUser):
    """Streams a chat completion from the OpenAI front door, then drops the connection after a few chunks."""

    request_type = "openai_drop"
    drop_after_chunks = RESPONSES_BEFORE_LEAVING


USER_CLASSES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        GrpcStreamUser,
        HttpStreamUser,
        HttpGenerateUser,
        OpenAIChatUser,
        CancellingGrpcUser,
        DroppingHttpStreamUser,
        DroppingOpenAIUser,
    )
}
DEFAULT_MIX = (
    "GrpcStreamUser:3,HttpStreamUser:2,HttpGenerateUser:2,OpenAIChatUser:3,CancellingGrpcUser:1,"
    "DroppingHttpStreamUser:1,DroppingOpenAIUser:1"
)


def user_mix(spec: str, modules: list[str]) -> list[type]:
    """`Name:weight,...` -> User subclasses with those weights (from USER_CLASSES and `modules`)."""
    known = dict(USER_CLASSES)
    for name in modules:
        for attr, obj in vars(importlib.import_module(name)).items():
            if inspect.isclass(obj) and issubclass(obj, User) and not getattr(obj, "abstract", False):
                known[attr] = obj
    classes = []
    for item in filter(None, (p.strip() for p in spec.split(","))):
        name, _, weight = item.partition(":")
        if name not in known:
            raise SystemExit(f"unknown user class {name!r}; known: {sorted(known)}")
        classes.append(type(name, (known[name],), {"weight": int(weight or 1), "__module__": __name__}))
    return classes


# ---------------------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--users", type=int, default=16, help="concurrent users (default 16: past the CPU's saturation)")
    ap.add_argument("--spawn-rate", type=float, default=4.0)
    ap.add_argument("--mix", default=DEFAULT_MIX, help="user classes and weights, Name:weight,...")
    ap.add_argument("--user-module", action="append", default=[], help="a module whose Locust users --mix may name")
    ap.add_argument("--model-repository", default=str(launcher.DEFAULT_MODEL_REPOSITORY))
    ap.add_argument("--model", default="llm")
    ap.add_argument("--max-tokens-min", type=int, default=16)
    ap.add_argument("--max-tokens-max", type=int, default=128)
    ap.add_argument("--out", default=str(RESULTS_DIR), help="directory for the report, samples and plot")
    ap.add_argument("--name", default="", help="file name stem (default soak-<UTC time>)")
    args = ap.parse_args(argv)

    classes = user_mix(args.mix, args.user_module)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or time.strftime("soak-%Y%m%dT%H%MZ", time.gmtime())
    with launcher.running_server(args.model_repository, out / f"{stem}.server.log") as srv:
        port = launcher.free_port()
        frontend = launcher.start_frontend(
            srv.grpc_url, port, out / f"{stem}.frontend.log", models=[args.model], metrics_url=srv.metrics_url
        )
        try:
            launcher.wait_until_frontend_ready(port, frontend)
            return run(args, classes, srv, frontend, out, stem)
        finally:
            launcher.stop_server(frontend, timeout_s=10)


def run(args, classes, srv, frontend, out: Path, stem: str) -> int:
    options = argparse.Namespace(
        grpc_url=srv.grpc_url,
        openai_url=f"http://127.0.0.1:{frontend.port}/v1",
        model=args.model,
        prompts_file="",
        input_words="",
        max_tokens_dist="uniform",
        max_tokens_min=args.max_tokens_min,
        max_tokens_max=args.max_tokens_max,
        ignore_file_max_tokens=False,
        ignore_eos="true",
        temperature=0.0,
        wait_time=0.0,
        request_timeout=600.0,
        failure_backoff=0.1,
        throughput_interval=0.0,
        workload_seed=1,
    )
    env = Environment(
        user_classes=classes, host=f"http://{srv.http_url}", parsed_options=options, events=locustfile.events
    )
    rec = Recorder()
    env.events.request.add_listener(rec.on_request)
    server = [psutil.Process(srv.proc.pid), psutil.Process(frontend.pid)]
    runner = env.create_local_runner()
    env.events.test_start.fire(environment=env)

    def sampler():
        while True:
            try:
                rec.sample(server, srv.metrics_url, args.model)
            except OSError as exc:
                print(f"sample failed: {exc}", file=sys.stderr)
            gevent.sleep(SAMPLE_INTERVAL_S)

    sampling = gevent.spawn(sampler)
    runner.start(args.users, spawn_rate=args.spawn_rate)
    duration = args.minutes * 60
    while time.monotonic() - rec.started < duration:
        gevent.sleep(5)
        minute = (time.monotonic() - rec.started) / 60
        print(
            f"[soak] {minute:5.1f} min: {len(rec.requests)} events, RSS "
            f"{rec.samples[-1]['rss_mb'] if rec.samples else 0:.0f} MiB",
            flush=True,
        )
    runner.stop()  # users are killed mid-request: those requests are dropped connections too
    elapsed = time.monotonic() - rec.started
    stopped = time.monotonic()
    settled = scrape(srv.metrics_url, args.model)
    while (settled["kv_blocks_used"], settled["running"], settled["waiting"]) != (
        0,
        0,
        0,
    ) and time.monotonic() - stopped < 60:
        gevent.sleep(0.5)
        settled = scrape(srv.metrics_url, args.model)
    settled["after_s"] = round(time.monotonic() - stopped, 1)
    sampling.kill()
    rec.sample(server, srv.metrics_url, args.model)
    summary = analyse(rec, elapsed, settled)
    png = out / f"{stem}.png"
    plot(rec, summary, png)
    (out / f"{stem}.json").write_text(json.dumps({"summary": summary, "samples": rec.samples}, indent=1))
    (out / f"{stem}.md").write_text(report_text(summary, args, classes, png))
    print(report_text(summary, args, classes, png))
    ok = summary["failures"] == 0 and settled["kv_blocks_used"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
