"""Several replicas on one machine behind a real proxy: N supervised launches (llm-serve: tritonserver,
restarted by its supervisor, and the OpenAI front door), each on its own ports, behind Debian's HAProxy.

    make serve-replicas N=2           # or: .venv/bin/llm-serve-replicas --replicas 2

The proxy (--port, default $OPENAI_PORT or 9000) balances by least connections, checks each front door's
/health/ready every second (a replica whose tritonserver is down or loading answers 503 and is taken out after two
checks, put back after two good ones), and retries a request onto another replica when the connection failed, the
replica closed it without answering, or it answered 503 (Triton unreachable, or its queue full): a front door
sends its 200 and headers only with the first token, so a retried request never had a byte of its answer sent.
A stream that has started is never retried; if its replica's tritonserver dies it ends with an error event. Every
answer carries `X-Served-By: r<i>`. HAProxy's statistics: http://127.0.0.1:8404/stats (`;csv` for CSV).

Replica i (from 1) listens on BASE + 100 * (i - 1) + 0 / 1 / 2 (Triton HTTP / gRPC / metrics, loopback) and + 10
(its front door); BASE is --base-port (8100). With --pin-cpus the machine's CPUs are dealt out between the
replicas (each engine sizes its threads to its share). One Ctrl-C stops everything: the proxy, then each replica
(the front door drains its streams, then tritonserver stops).

Library use (loadtest/failover.py)::

    with running_replicas(2, base_port=18100, proxy_port=19000, stats_port=18404, log_dir=...) as cluster:
        cluster.proxy_url, cluster.replicas[0].openai_port, cluster.tritonserver_pid(cluster.replicas[0])
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from launcher.paths import DEFAULT_MODEL_REPOSITORY, REPO_ROOT, VENV
from launcher.readiness import ServerError, log_tail, wait_until_frontend_ready

HAPROXY_HINT = "install Debian's haproxy (`make haproxy`, or apt-get install haproxy) or set $HAPROXY"


@dataclass
class Replica:
    index: int  # from 1
    http_port: int
    grpc_port: int
    metrics_port: int
    openai_port: int
    log_path: Path
    cpus: set[int] | None = None
    proc: subprocess.Popen | None = None  # llm-serve

    @property
    def name(self) -> str:
        return f"r{self.index}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


def replica_ports(index: int, base_port: int) -> tuple[int, int, int, int]:
    """(HTTP, gRPC, metrics, front door) of replica `index` (from 1)."""
    first = base_port + 100 * (index - 1)
    return first, first + 1, first + 2, first + 10


def share_cpus(n: int, cpus: list[int] | None = None) -> list[set[int]]:
    """The CPUs dealt out between n replicas (round robin; a replica gets at least one)."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    if n >= len(cpus):
        return [{cpus[i % len(cpus)]} for i in range(n)]
    return [set(cpus[i::n]) for i in range(n)]


def haproxy_config(replicas: list[Replica], port: int, stats_port: int, host: str = "127.0.0.1") -> str:
    servers = "\n".join(f"    server {r.name} 127.0.0.1:{r.openai_port} check" for r in replicas)
    return f"""# Written by llm-serve-replicas (launcher/replicas.py).
global
    maxconn 4096
    # A request is retried from HAProxy's buffer: it must fit (OpenAI requests are small; larger ones are sent
    # once, not retried).
    tune.bufsize 65536
    log stdout format raw local0 info

defaults
    mode http
    log global
    timeout connect 2s
    timeout client 10m
    # Generous: a long prefill, or a stream between two tokens, must not be cut by the proxy.
    timeout server 10m
    timeout http-request 30s
    timeout queue 30s
    # Retry a request that failed to connect, that the replica closed without a byte of answer, or that it
    # refused with 503 (its Triton unreachable, or full): up to 3 times, each on another replica.
    retries 3
    option redispatch 1
    retry-on conn-failure empty-response 503
    option http-buffer-request
    # One line per request: the request id, the replica that answered, status, retries, total time.
    log-format "%ID %s %ST %rc %Tt %{{+Q}}r"
    unique-id-format %[req.hdr(x-request-id)]

frontend openai
    bind {host}:{port}
    default_backend replicas

backend replicas
    balance leastconn
    option httpchk GET /health/ready
    http-check expect status 200
    default-server inter 1s fastinter 500ms downinter 1s fall 2 rise 2
    http-response set-header X-Served-By %[srv_name]
{servers}

frontend stats
    bind 127.0.0.1:{stats_port}
    option dontlog-normal
    stats enable
    stats uri /stats
    stats refresh 5s
"""


def find_haproxy() -> str:
    for path in (os.environ.get("HAPROXY"), shutil.which("haproxy"), "/usr/sbin/haproxy"):
        if path and Path(path).is_file() and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError(f"no haproxy: {HAPROXY_HINT}")


def start_replica(replica: Replica, model_repository: Path | str, exit_timeout_s: int = 10) -> subprocess.Popen:
    """llm-serve for `replica` (its own process group; output to its log); on its CPUs when given."""
    argv = [
        str(VENV / "bin" / "python"),
        "-m",
        "launcher.serve",
        "--model-repository",
        str(model_repository),
        "--http-port",
        str(replica.http_port),
        "--grpc-port",
        str(replica.grpc_port),
        "--metrics-port",
        str(replica.metrics_port),
        "--openai-port",
        str(replica.openai_port),
        "--exit-timeout-secs",
        str(exit_timeout_s),
    ]
    cpus = replica.cpus
    replica.log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(replica.log_path, "ab") as log:
        replica.proc = subprocess.Popen(
            argv,
            cwd=str(REPO_ROOT),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
    return replica.proc


def stop_replica(replica: Replica, timeout_s: float = 90.0) -> int | None:
    """SIGTERM to llm-serve (it drains the front door, then stops tritonserver); SIGKILL of its group after
    `timeout_s`."""
    proc = replica.proc
    if proc is None:
        return None
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    return proc.returncode


def child_pids(pid: int, name: str) -> list[int]:
    """Children of `pid` whose executable's name is `name` (Linux /proc)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            comm = stat[stat.index(b"(") + 1 : stat.rindex(b")")].decode()
            ppid = int(stat.rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        if ppid == pid and comm == name[:15]:
            found.append(int(entry))
    return found


def haproxy_stats(stats_port: int) -> dict[str, dict[str, str]]:
    """The proxy's statistics: {server or BACKEND/FRONTEND row name: its CSV fields} of the `replicas` backend."""
    with urllib.request.urlopen(f"http://127.0.0.1:{stats_port}/stats;csv", timeout=5) as resp:
        text = resp.read().decode()
    rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
    return {row["svname"]: row for row in rows if row["pxname"] == "replicas"}


@dataclass
class Cluster:
    replicas: list[Replica]
    proxy_port: int
    stats_port: int
    haproxy: subprocess.Popen
    haproxy_log: Path
    config_path: Path
    started: float = field(default_factory=time.monotonic)

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def tritonserver_pid(self, replica: Replica) -> int | None:
        pids = child_pids(replica.proc.pid, "tritonserver") if replica.proc is not None else []
        return pids[0] if pids else None

    def stats(self) -> dict[str, dict[str, str]]:
        return haproxy_stats(self.stats_port)


def wait_all_ready(replicas: list[Replica], timeout_s: float) -> None:
    for replica in replicas:
        wait_until_frontend_ready(replica.openai_port, replica.proc, timeout_s)


@contextlib.contextmanager
def running_replicas(
    n: int,
    *,
    base_port: int = 8100,
    proxy_port: int = 9000,
    stats_port: int = 8404,
    model_repository: Path | str = DEFAULT_MODEL_REPOSITORY,
    log_dir: Path | str,
    pin_cpus: bool = False,
    ready_timeout_s: float = 900.0,
    host: str = "127.0.0.1",
    exit_timeout_s: int = 10,
) -> Iterator[Cluster]:
    """Start n replicas and the proxy, wait until every replica is ready and the proxy sees them up; stop all."""
    haproxy = find_haproxy()
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    shares = share_cpus(n) if pin_cpus else [None] * n
    replicas = [
        Replica(i, *replica_ports(i, base_port), log_dir / f"replica-{i}.log", shares[i - 1]) for i in range(1, n + 1)
    ]
    config = log_dir / "haproxy.cfg"
    config.write_text(haproxy_config(replicas, proxy_port, stats_port, host))
    check = subprocess.run([haproxy, "-c", "-q", "-f", str(config)], capture_output=True, text=True)
    if check.returncode != 0:
        raise RuntimeError(f"haproxy refused {config}: {check.stdout}{check.stderr}")
    proxy = None
    try:
        for replica in replicas:
            start_replica(replica, model_repository, exit_timeout_s)
        wait_all_ready(replicas, ready_timeout_s)
        haproxy_log = log_dir / "haproxy.log"
        with open(haproxy_log, "ab") as log:
            proxy = subprocess.Popen(
                [haproxy, "-db", "-f", str(config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        cluster = Cluster(replicas, proxy_port, stats_port, proxy, haproxy_log, config)
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError):
                if all(cluster.stats().get(r.name, {}).get("status") == "UP" for r in replicas):
                    break
            if proxy.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"haproxy did not bring every replica up; log:\n{log_tail(haproxy_log)}")
            time.sleep(0.25)
        yield cluster
    finally:
        if proxy is not None and proxy.poll() is None:
            proxy.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proxy.wait(timeout=10)
        for replica in replicas:
            stop_replica(replica)


def usage_text(cluster: Cluster) -> str:
    lines = [
        f"=== {len(cluster.replicas)} replicas behind HAProxy: {cluster.proxy_url}/v1 "
        f"(statistics: http://127.0.0.1:{cluster.stats_port}/stats) ==="
    ]
    for r in cluster.replicas:
        cpus = f", CPUs {sorted(r.cpus)}" if r.cpus else ""
        lines.append(
            f"  {r.name}: front door :{r.openai_port}, Triton :{r.http_port}/:{r.grpc_port}, metrics "
            f":{r.metrics_port}{cpus}; log {r.log_path}"
        )
    lines += [
        f"  curl -s {cluster.proxy_url}/v1/completions -H 'Content-Type: application/json' "
        '-d \'{"model":"llm","prompt":"Hello","max_tokens":8}\' -D - | grep -i x-served-by',
        "Stop with Ctrl-C.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", "-n", type=int, default=2)
    ap.add_argument(
        "--port",
        type=int,
        default=int(os.environ.get("OPENAI_PORT") or 9000),
        help="the proxy's port (default $OPENAI_PORT or 9000)",
    )
    ap.add_argument("--host", default="127.0.0.1", help="the proxy's bind address (default 127.0.0.1)")
    ap.add_argument("--stats-port", type=int, default=8404)
    ap.add_argument("--base-port", type=int, default=8100, help="replica i uses BASE + 100 * (i - 1) + 0/1/2/10")
    ap.add_argument("--model-repository", default=os.environ.get("MODEL_REPOSITORY") or str(DEFAULT_MODEL_REPOSITORY))
    ap.add_argument("--log-dir", default=str(REPO_ROOT / ".cache" / "replicas"))
    ap.add_argument("--pin-cpus", action="store_true", help="deal the CPUs out between the replicas")
    ap.add_argument("--ready-timeout", type=float, default=900.0)
    args = ap.parse_args(argv)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        with running_replicas(
            args.replicas,
            base_port=args.base_port,
            proxy_port=args.port,
            stats_port=args.stats_port,
            model_repository=args.model_repository,
            log_dir=args.log_dir,
            pin_cpus=args.pin_cpus,
            ready_timeout_s=args.ready_timeout,
            host=args.host,
        ) as cluster:
            print(usage_text(cluster), flush=True)
            while cluster.haproxy.poll() is None and all(r.proc.poll() is None for r in cluster.replicas):
                time.sleep(0.5)
            print("[llm-serve-replicas] the proxy or a replica exited; stopping", file=sys.stderr, flush=True)
            return 1
    except KeyboardInterrupt:
        print("\n[llm-serve-replicas] stopping ...", file=sys.stderr, flush=True)
        return 0
    except (FileNotFoundError, RuntimeError, ServerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
