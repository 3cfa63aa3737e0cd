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
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import gevent
from gevent import monkey

monkey.patch_all()

from locust import events  # noqa: E402
from locust.env import Environment  # noqa: E402

import launcher.replicas  # noqa: E402
from launcher.paths import REPO_ROOT  # noqa: E402
from loadtest.failover_report import analyse, machine, report  # noqa: E402
from loadtest.failover_run import OPTIONS, RUN, FailoverUser  # noqa: E402
from testkit import prometheus  # noqa: E402

RESULTS_DIR = REPO_ROOT / "loadtest" / "results"
_LOG_RE = re.compile(r"^(f\d+) (\S+) (-?\d+) (\+?-?\d+) (-?\d+) ")


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
