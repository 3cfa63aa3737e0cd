"""Failover under load (not in CI): two replicas (launcher/replicas.py: two supervised launches behind
Debian's HAProxy) under Locust users; one replica's tritonserver is killed (SIGKILL) mid-run, then, at the end,
the other replica is stopped gracefully (SIGTERM, as Kubernetes stops a pod).

    .venv/bin/llm-failover --users 4                   # about 5 minutes on 2 cores

Each user sends, one after the other, OpenAI requests through the proxy: a streamed chat completion or a whole
completion (half each by default), greedy, `ignore_eos` with max_tokens drawn from [--max-tokens-min,
--max-tokens-max], each tagged with an `X-Request-Id` that the proxy logs with the replica that answered it and
the retries it took. What is checked and reported (loadtest/results/<name>.md and .json):

- every request is counted as sent, succeeded (all its tokens, `[DONE]`, no error), failed with a clear error
  (an OpenAI error object: the HTTP status of a request that had not started, or an error event ending a stream
  that had), or failed unclearly (a reset, a truncated stream, a timeout: must be 0), and as retried when the
  proxy's log shows retries for it;
- the kill: requests that had not started when it hit are retried onto the survivor and succeed; streams on the
  killed replica end with an error event; the survivor keeps serving; the killed replica's supervisor restarts
  tritonserver, and the time from the kill until the proxy marks the replica up again, and until a request
  served by it succeeds, is the time to rejoin;
- the graceful stop: streams in flight on the stopped replica finish (the front door drains them), new requests
  go to the other one;
- `llm_kv_cache_blocks_used` (with running and waiting) of each replica once the users have stopped: 0 (no leak).

Exit status 0 when all of that holds.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import gevent
from gevent import monkey

monkey.patch_all()

REPO_ROOT = Path(__file__).resolve().parents[1]

from locust import User, constant, events, task  # noqa: E402
from locust.env import Environment  # noqa: E402

import launcher.replicas  # noqa: E402
from client.api import parse_sse  # noqa: E402
from loadtest.workload import SYNTHETIC_PROMPTS  # noqa: E402
from testkit import prometheus  # noqa: E402

RESULTS_DIR = REPO_ROOT / "loadtest" / "results"
KILLED, DRAINED = "r1", "r2"
_LOG_RE = re.compile(r"^(f\d+) (\S+) (-?\d+) (\+?-?\d+) (-?\d+) ")


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


# ------------------------------------------------------------------------------------------------- watching


def scrape(replica: launcher.replicas.Replica) -> dict:
    """The replica's KV blocks used, usage ratio, requests running and waiting (None where unknown)."""
    try:
        metrics = prometheus.scrape(replica.metrics_url, timeout_s=5)
    except OSError:
        return {"kv_blocks_used": None, "running": None, "waiting": None}
    return {
        key: prometheus.value(metrics, metric, None, model="llm", version="1")
        for key, metric in (
            ("kv_blocks_used", "llm_kv_cache_blocks_used"),
            ("running", "llm_requests_running"),
            ("waiting", "llm_requests_waiting"),
            ("kv_usage_ratio", "llm_kv_cache_usage_ratio"),
        )
    }


def watch(cluster: launcher.replicas.Cluster) -> None:
    """Every 0.25 s: the proxy's view of each replica (transitions become events); KV every 2 s."""
    last: dict[str, str] = {}
    n = 0
    while True:
        try:
            stats = cluster.stats()
        except OSError:
            stats = {}
        sample = {"t": RUN.t()}
        for r in cluster.replicas:
            status = stats.get(r.name, {}).get("status", "?")
            sample[r.name] = status
            if last.get(r.name) not in (None, status):
                RUN.event(f"proxy marks {r.name} {status}")
            last[r.name] = status
        if n % 8 == 0:
            for r in cluster.replicas:
                sample[f"{r.name}_metrics"] = scrape(r) if r.proc.poll() is None else None
        RUN.samples.append(sample)
        n += 1
        gevent.sleep(0.25)


def settle(replicas: list[launcher.replicas.Replica], timeout_s: float = 60.0) -> dict[str, dict]:
    """Each replica's KV / running / waiting once they read 0 (or after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = {r.name: scrape(r) for r in replicas}
        if (
            all((v["kv_blocks_used"], v["running"], v["waiting"]) == (0, 0, 0) for v in values.values())
            or time.monotonic() > deadline
        ):
            return values
        gevent.sleep(0.5)


def stop_accepting_and_wait(timeout_s: float = 300.0) -> None:
    RUN.accepting = False
    deadline = time.monotonic() + timeout_s
    while RUN.in_flight and time.monotonic() < deadline:
        gevent.sleep(0.2)


def read_proxy_log(path: Path) -> dict[str, tuple[str, int, int]]:
    """{request id: (server, status, retries)} from the proxy's log."""
    out = {}
    for line in path.read_text(errors="replace").splitlines():
        match = _LOG_RE.match(line)
        if match:
            rid, server, status, retries, _ = match.groups()
            out[rid] = (server.split("/")[-1], int(status), int(retries.lstrip("+")))
    return out


# ------------------------------------------------------------------------------------------------- scenario


def scenario(cluster: launcher.replicas.Cluster, args) -> dict:
    env = Environment(user_classes=[FailoverUser], host=cluster.proxy_url, events=events)
    runner = env.create_local_runner()
    watcher = gevent.spawn(watch, cluster)
    killed, drained = cluster.replicas[0], cluster.replicas[1]
    timeline: dict[str, float | None] = {}

    RUN.event("users start", users=args.users)
    runner.start(args.users, spawn_rate=args.users)
    gevent.sleep(args.warmup)

    # Kill while a stream is under way on the replica (so that the cut of a started stream is exercised).
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(
        r.kind == "stream" and r.started_streaming and not r.ended and r.served_by == killed.name for r in RUN.records
    ):
        gevent.sleep(0.05)
    old_pid = cluster.tritonserver_pid(killed)
    old_stubs = launcher.replicas.child_pids(old_pid, "triton_python_backend_stub")
    timeline["kill"] = RUN.event(f"SIGKILL {killed.name}'s tritonserver", pid=old_pid, stubs=old_stubs)["t"]
    in_flight_at_kill = [r.id for r in RUN.records if not r.ended]
    os.kill(old_pid, signal.SIGKILL)
    deadline = time.monotonic() + args.rejoin_timeout
    while time.monotonic() < deadline:
        pid = cluster.tritonserver_pid(killed)
        if pid and pid != old_pid and "restarted" not in timeline:
            timeline["restarted"] = RUN.event(f"{killed.name}'s supervisor started a new tritonserver", pid=pid)["t"]
        status = RUN.samples[-1].get(killed.name) if RUN.samples else None
        if status == "DOWN" and "down" not in timeline:
            timeline["down"] = RUN.t()
        if "down" in timeline and status == "UP" and "up" not in timeline:
            timeline["up"] = RUN.t()
        served = [
            r for r in RUN.records if r.served_by == killed.name and r.outcome == "ok" and r.started > timeline["kill"]
        ]
        if "up" in timeline and served:
            timeline["first_success_after"] = min(r.ended for r in served)
            RUN.event(
                f"first request served by {killed.name} after the kill succeeded",
                id=min(served, key=lambda r: r.ended).id,
            )
            break
        gevent.sleep(0.25)
    else:
        RUN.event(f"{killed.name} did not rejoin within {args.rejoin_timeout:.0f} s")
    orphans = [pid for pid in old_stubs if Path(f"/proc/{pid}").exists()]
    RUN.event("the killed tritonserver's Python stubs still running", pids=orphans)
    gevent.sleep(args.after_rejoin)
    timeline["main_end"] = RUN.event("stop starting requests; wait for those in flight")["t"]
    stop_accepting_and_wait()
    kv_after_main = settle(cluster.replicas)
    RUN.event("KV after the main phase", **{k: v["kv_blocks_used"] for k, v in kv_after_main.items()})

    # Graceful stop of the other replica while streams run on it.
    RUN.accepting = True
    timeline["drain_load"] = RUN.event("users resume")["t"]
    gevent.sleep(args.drain_after)
    timeline["sigterm"] = RUN.event(f"SIGTERM {drained.name}'s llm-serve (graceful stop)")["t"]
    in_flight_at_sigterm = [r.id for r in RUN.records if not r.ended]
    stopper = gevent.spawn(launcher.replicas.stop_replica, drained)
    gevent.sleep(args.drain_load)
    timeline["drain_end"] = RUN.event("stop starting requests; wait for those in flight")["t"]
    stop_accepting_and_wait()
    stopper.join(timeout=120)
    RUN.event(f"{drained.name} exited", code=drained.proc.returncode)
    kv_end = settle([killed])
    RUN.event("KV at the end", **{k: v["kv_blocks_used"] for k, v in kv_end.items()})
    runner.stop()
    watcher.kill()

    proxy = read_proxy_log(cluster.haproxy_log)
    for r in RUN.records:
        server, _status, retries = proxy.get(r.id, ("", 0, 0))
        r.proxy_server, r.retries = server, retries
    summary = analyse(timeline, in_flight_at_kill, in_flight_at_sigterm, kv_after_main, kv_end, killed, drained)
    summary["orphaned_stubs_after_restart"] = orphans
    summary["checks"]["no stub of the killed server left running"] = not orphans
    return summary


def _counts(records: list[Record]) -> dict:
    return {
        "sent": len(records),
        "succeeded": sum(r.outcome == "ok" for r in records),
        "retried": sum(r.retries > 0 for r in records),
        "retried_and_succeeded": sum(r.retries > 0 and r.outcome == "ok" for r in records),
        "failed_with_clear_error": sum(r.outcome == "error_clear" for r in records),
        "failed_unclearly": sum(r.outcome == "error_unclear" for r in records),
    }


def analyse(timeline, at_kill, at_sigterm, kv_after_main, kv_end, killed, drained) -> dict:
    records = RUN.records
    by_id = {r.id: r for r in records}
    kill, up = timeline["kill"], timeline.get("up")
    outage = [r for r in records if kill <= r.started < (up or float("inf"))]
    cut = [
        by_id[i]
        for i in at_kill
        if by_id[i].served_by == killed.name and by_id[i].kind == "stream" and by_id[i].started_streaming
    ]
    draining = [by_id[i] for i in at_sigterm if by_id[i].served_by == drained.name]
    after_sigterm = [r for r in records if r.started > timeline["sigterm"] + 1]
    phases = {
        "before the kill": [r for r in records if r.started < kill],
        "kill until rejoin": outage,
        "after rejoin": [r for r in records if (up or float("inf")) <= r.started < timeline["main_end"]],
        "graceful stop phase": [r for r in records if r.started >= timeline["drain_load"]],
    }
    errors: dict[str, int] = {}
    for r in records:
        if r.outcome != "ok":
            key = f"{r.outcome}: {re.sub(r'127.0.0.1:[0-9]+', '127.0.0.1:<port>', r.error)[:160]}"
            errors[key] = errors.get(key, 0) + 1
    served_after_rejoin = [r for r in records if up is not None and r.started >= up and r.served_by == killed.name]
    summary = {
        "counts": _counts(records),
        "phases": {name: _counts(rs) for name, rs in phases.items()},
        "timeline_s": timeline,
        "rejoin_s": {
            "kill_to_proxy_down": None if "down" not in timeline else round(timeline["down"] - kill, 2),
            "kill_to_new_tritonserver": None if "restarted" not in timeline else round(timeline["restarted"] - kill, 2),
            "kill_to_proxy_up": None if up is None else round(up - kill, 2),
            "kill_to_first_success_on_it": None
            if "first_success_after" not in timeline
            else round(timeline["first_success_after"] - kill, 2),
        },
        "streams_cut_by_the_kill": {
            "count": len(cut),
            "ended_with_error_event": sum(r.outcome == "error_clear" for r in cut),
            "examples": sorted({r.error for r in cut})[:3],
        },
        "requests_started_during_outage": _counts(outage)
        | {"served_by_survivor": sum(r.served_by == drained.name for r in outage)},
        "requests_on_rejoined_replica_after_up": _counts(served_after_rejoin),
        "graceful_stop": {
            "in_flight_on_stopped_replica": _counts(draining),
            "started_after_sigterm": _counts(after_sigterm)
            | {"served_by_stopped": sum(r.served_by == drained.name for r in after_sigterm)},
            "exit_code": drained.proc.returncode,
        },
        "kv_after_main_phase": kv_after_main,
        "kv_at_end": kv_end,
        "errors": errors,
    }
    c = summary["counts"]
    summary["checks"] = {
        "no unclear failure": c["failed_unclearly"] == 0,
        "every failure is a stream the kill cut": c["failed_with_clear_error"]
        == summary["streams_cut_by_the_kill"]["ended_with_error_event"],
        "the kill cut a started stream, which ended with an error event": 0
        < len(cut)
        == summary["streams_cut_by_the_kill"]["ended_with_error_event"],
        "retried requests succeeded": c["retried"] == c["retried_and_succeeded"],
        "the survivor served during the outage": summary["requests_started_during_outage"]["served_by_survivor"] > 0,
        "the killed replica rejoined and served": up is not None and "first_success_after" in timeline,
        "graceful stop drained its streams": all(r.outcome == "ok" for r in draining),
        "no KV block held after the main phase": all(v["kv_blocks_used"] == 0 for v in kv_after_main.values()),
        "no KV block held at the end": all(v["kv_blocks_used"] == 0 for v in kv_end.values()),
    }
    return summary


# -------------------------------------------------------------------------------------------------- report


def machine() -> dict:
    info = {"python": platform.python_version(), "kernel": platform.release()}
    text = Path("/proc/cpuinfo").read_text()
    info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    info["cpus"] = text.count("\nprocessor") + text.startswith("processor")
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    info["cpu_flags"] = " ".join(flags)
    mem = Path("/proc/meminfo").read_text().split("\n", 1)[0]
    info["memory_gib"] = round(int(mem.split()[1]) / 2**20, 1)
    return info


def report(summary: dict, meta: dict) -> str:
    c, r, g = summary["counts"], summary["rejoin_s"], summary["graceful_stop"]
    m = meta["machine"]
    simd = [f for f in m["cpu_flags"].split() if f.startswith(("avx", "amx", "fma", "f16c"))]
    lines = [
        "# Failover: two replicas behind HAProxy, one tritonserver killed under load",
        "",
        f"`.venv/bin/llm-failover {meta['argv']}` ({meta['date']}). Machine: {m['cpu']}, "
        f"{m['cpus']} CPUs, {m['memory_gib']} GiB; SIMD flags: {' '.join(simd)} (all flags in the .json). "
        f"{meta['haproxy']}. Replicas: `llm-serve-replicas`, the default model repository, "
        f"{meta['replicas']}; {meta['users']} Locust users, half streamed chat completions, half whole "
        f"completions, greedy, max_tokens {meta['max_tokens']} with ignore_eos. Both replicas were ready behind the "
        f"proxy {meta['replicas_ready_s']} s after the start; 1-minute load average before / after the run "
        f"{meta['load_average_before_after'][0]} / {meta['load_average_before_after'][1]} (the machine is shared).",
        "",
        "| | requests |",
        "|---|---|",
        f"| sent | {c['sent']} |",
        f"| succeeded | {c['succeeded']} |",
        f"| retried by the proxy (of which succeeded) | {c['retried']} ({c['retried_and_succeeded']}) |",
        f"| failed with a clear error | {c['failed_with_clear_error']} |",
        f"| failed unclearly (reset, truncated, timeout) | {c['failed_unclearly']} |",
        "",
        "| phase | sent | succeeded | retried | clear error | unclear |",
        "|---|---|---|---|---|---|",
    ]
    for name, p in summary["phases"].items():
        lines.append(
            f"| {name} | {p['sent']} | {p['succeeded']} | {p['retried']} | {p['failed_with_clear_error']} "
            f"| {p['failed_unclearly']} |"
        )
    cut = summary["streams_cut_by_the_kill"]
    outage = summary["requests_started_during_outage"]
    kv_main, kv_end = summary["kv_after_main_phase"], summary["kv_at_end"]
    lines += [
        "",
        f"Time to rejoin after the SIGKILL of {KILLED}'s tritonserver: proxy marks it down after "
        f"{r['kill_to_proxy_down']} s; its supervisor starts a new tritonserver after "
        f"{r['kill_to_new_tritonserver']} s; "
        f"the proxy marks it up after **{r['kill_to_proxy_up']} s**; the first request it serves after the kill "
        f"succeeds at {r['kill_to_first_success_on_it']} s.",
        "",
        f"- Streams on {KILLED} when it was killed: {cut['count']}, each ended with an error event "
        f"({cut['ended_with_error_event']}), e.g. `{(cut['examples'] or ['-'])[0]}`.",
        f"- Requests started between the kill and the rejoin: {outage['sent']}, succeeded {outage['succeeded']} "
        f"(served by {DRAINED}: {outage['served_by_survivor']}; retried {outage['retried']}).",
        f"- After the rejoin {KILLED} served {summary['requests_on_rejoined_replica_after_up']['sent']} requests "
        f"({summary['requests_on_rejoined_replica_after_up']['succeeded']} succeeded).",
        f"- Graceful stop (SIGTERM) of {DRAINED} under load: {g['in_flight_on_stopped_replica']['sent']} requests in "
        f"flight on it, {g['in_flight_on_stopped_replica']['succeeded']} finished normally; of the "
        f"{g['started_after_sigterm']['sent']} started after it, {g['started_after_sigterm']['succeeded']} succeeded "
        f"and {g['started_after_sigterm']['served_by_stopped']} were served by {DRAINED}; its llm-serve exited with "
        f"code {g['exit_code']}.",
        f"- Python stubs of the killed tritonserver still running after the restart: "
        f"{summary['orphaned_stubs_after_restart'] or 'none'}.",
        f"- `llm_kv_cache_blocks_used` once the users stopped: after the kill phase {KILLED} "
        f"{kv_main[KILLED]['kv_blocks_used']:.0f}, {DRAINED} {kv_main[DRAINED]['kv_blocks_used']:.0f}; at the end "
        f"{KILLED} {kv_end[KILLED]['kv_blocks_used']:.0f} (running and waiting 0 on each).",
        "",
        "Checks: " + "; ".join(f"{name}: {'yes' if ok else 'NO'}" for name, ok in summary["checks"].items()) + ".",
        "",
    ]
    if summary["errors"]:
        lines += ["Failures, by message:", ""]
        lines += [f"- {n} x `{e}`" for e, n in sorted(summary["errors"].items())] + [""]
    lines += ["Timeline (s from the start of the load):", ""]
    for e in RUN.events:
        extra = {k: v for k, v in e.items() if k not in ("t", "what")}
        lines.append(f"- {e['t']:.1f}: {e['what']}" + (f" {json.dumps(extra)}" if extra else ""))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--warmup", type=float, default=30.0, help="seconds of load before the kill")
    ap.add_argument("--after-rejoin", type=float, default=30.0, help="seconds of load after the replica is back")
    ap.add_argument("--rejoin-timeout", type=float, default=600.0)
    ap.add_argument("--drain-after", type=float, default=8.0, help="seconds of load before the graceful stop")
    ap.add_argument("--drain-load", type=float, default=20.0, help="seconds of load after it")
    ap.add_argument("--stream-share", type=float, default=0.5)
    ap.add_argument("--max-tokens-min", type=int, default=16)
    ap.add_argument("--max-tokens-max", type=int, default=64)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--base-port", type=int, default=18100)
    ap.add_argument("--proxy-port", type=int, default=19000)
    ap.add_argument("--stats-port", type=int, default=18404)
    ap.add_argument("--no-pin-cpus", action="store_true", help="let both replicas use every CPU")
    ap.add_argument("--out", default=str(RESULTS_DIR))
    ap.add_argument("--name", default="failover")
    args = ap.parse_args(argv)
    OPTIONS.update(
        stream_share=args.stream_share,
        max_tokens_min=args.max_tokens_min,
        max_tokens_max=args.max_tokens_max,
        request_timeout=args.request_timeout,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_dir = REPO_ROOT / ".cache" / "failover"
    haproxy_version = (
        subprocess.run([launcher.replicas.find_haproxy(), "-v"], capture_output=True, text=True)
        .stdout.splitlines()[0]
        .split(" - ")[0]
    )
    t0, load_before = time.monotonic(), os.getloadavg()
    with launcher.replicas.running_replicas(
        2,
        base_port=args.base_port,
        proxy_port=args.proxy_port,
        stats_port=args.stats_port,
        log_dir=log_dir,
        pin_cpus=not args.no_pin_cpus,
    ) as cluster:
        ready_s = round(time.monotonic() - t0, 1)
        RUN.started = time.monotonic()
        RUN.event("replicas ready behind the proxy", after_s=ready_s)
        OPTIONS["proxy_url"] = cluster.proxy_url
        summary = scenario(cluster, args)
        replicas = ", ".join(f"{r.name} on CPU {sorted(r.cpus)}" if r.cpus else r.name for r in cluster.replicas)
    meta = {
        "argv": " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "haproxy": haproxy_version,
        "replicas": replicas,
        "users": args.users,
        "max_tokens": f"{args.max_tokens_min}-{args.max_tokens_max}",
        "replicas_ready_s": ready_s,
        "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
    }
    text = report(summary, meta)
    (out / f"{args.name}.md").write_text(text)
    (out / f"{args.name}.json").write_text(
        json.dumps(
            {
                "meta": meta,
                "summary": summary,
                "events": RUN.events,
                "requests": [asdict(r) for r in RUN.records],
                "samples": RUN.samples,
            },
            indent=1,
        )
    )
    print(text)
    return 0 if all(summary["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
