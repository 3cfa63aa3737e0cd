"""The start-stress check: start and stop the integration suite's model repository (testkit.server_variants, the
nine models the suite's one server loads) many times in a row while other processes keep every core busy, and
check that every model is READY every time and that every stop is clean. Run by hand, not by `make test`::

    llm-start-stress [--starts 20] [--hog-processes 2] [--ready-timeout 600] [--out DIR]

Each start prints its time to READY and its stop (time and exit code). A start that is not READY in time is a
hang: the Python and native stacks of every stub and of tritonserver (py-spy, else gdb, where installed) go to
--out before the server is stopped, so the hang can be read, not guessed. Exit status 1 if any start failed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from launcher.model_config import write_model_repository
from launcher.processes import start_server, stop_server
from launcher.readiness import ServerError, free_port, url_ok, wait_until_ready
from launcher.supervisor import stub_processes
from testkit.server_variants import session_variants


def _spin() -> None:  # a CPU hog (multiprocessing target)
    while True:
        pass


def start_hogs(count: int) -> list[multiprocessing.Process]:
    """`count` processes that keep a core busy each (Debian's stress-ng does the same; this needs nothing)."""
    hogs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(count)]
    for hog in hogs:
        hog.start()
    return hogs


def dump_stacks(server_pid: int, out: Path) -> list[Path]:
    """The stacks of tritonserver and each of its Python stubs, one file per process (py-spy shows Python and
    native frames of a stub; gdb the native threads of tritonserver)."""
    written = []
    pids = {server_pid: "tritonserver", **stub_processes(server_pid)}
    for pid, name in pids.items():
        commands = []
        if name != "tritonserver" and shutil.which("py-spy"):
            commands.append(["py-spy", "dump", "--native", "--pid", str(pid)])
        if shutil.which("gdb"):
            commands.append(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt"])
        for argv in commands:
            path = out / f"stacks-{name}-{pid}-{argv[0]}.txt"
            result = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
            path.write_text(result.stdout + result.stderr)
            written.append(path)
    return written


def models_ready(http_port: int, names) -> list[str]:
    """The models among `names` whose `/v2/models/<name>/ready` does not answer 200."""
    return [name for name in names if not url_ok(f"http://127.0.0.1:{http_port}/v2/models/{name}/ready")]


def one_start(repository: Path, variants: dict, out: Path, index: int, ready_timeout_s: float) -> dict:
    ports = [free_port() for _ in range(3)]
    log_path = out / f"tritonserver-{index}.log"
    started = time.monotonic()
    proc = start_server(repository, *ports, log_path)
    record: dict = {"start": index, "log": str(log_path), "models": len(variants)}
    try:
        wait_until_ready(ports[0], proc, ready_timeout_s, metrics_port=ports[2])
        record["ready_s"] = round(time.monotonic() - started, 1)
        record["not_ready_models"] = models_ready(ports[0], variants)
        with urllib.request.urlopen(f"http://127.0.0.1:{ports[2]}/metrics", timeout=10) as resp:
            alive = resp.read().decode().count("llm_engine_alive{")
        record["engines_alive"] = alive
    except ServerError as exc:
        record["error"] = str(exc).splitlines()[0]
        if proc.poll() is None:  # a hang: keep its stacks before stopping it
            record["stacks"] = [str(p) for p in dump_stacks(proc.pid, out)]
    stopping = time.monotonic()
    record["exit_code"] = stop_server(proc, timeout_s=30)
    record["stop_s"] = round(time.monotonic() - stopping, 1)
    record["ok"] = (
        "error" not in record
        and not record["not_ready_models"]
        and record["engines_alive"] == len(variants)
        and record["exit_code"] == 0
    )
    return record


def describe(record: dict, total: int) -> str:
    head = f"start {record['start']}/{total}:"
    if "error" in record:
        return f"{head} FAILED: {record['error']} (stacks: {record.get('stacks', [])})"
    ready = record["models"] - len(record["not_ready_models"])
    return (
        f"{head} READY in {record['ready_s']} s ({ready}/{record['models']} models READY, "
        f"{record['engines_alive']} engines alive); stopped in {record['stop_s']} s (exit code {record['exit_code']})"
        + ("" if record["ok"] else "  <-- FAILED")
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--starts", type=int, default=20)
    ap.add_argument("--hog-processes", type=int, default=os.cpu_count() or 2, help="CPU hogs beside the server")
    ap.add_argument("--ready-timeout", type=float, default=600.0, help="seconds until a start counts as a hang")
    ap.add_argument("--out", type=Path, default=None, help="logs, stacks and results.json (default: a temp dir)")
    args = ap.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="start-stress-"))
    out.mkdir(parents=True, exist_ok=True)
    variants = session_variants(out)
    repository = write_model_repository(out / "model_repository", variants)
    print(f"{len(variants)} models, {args.starts} starts, {args.hog_processes} CPU hog process(es); output in {out}")
    hogs = start_hogs(args.hog_processes)
    records = []
    try:
        for index in range(1, args.starts + 1):
            records.append(one_start(repository, variants, out, index, args.ready_timeout))
            print(describe(records[-1], args.starts), flush=True)
    finally:
        for hog in hogs:
            hog.terminate()
    (out / "results.json").write_text(json.dumps(records, indent=2))
    ready = [r["ready_s"] for r in records if "ready_s" in r]
    stops = [r["stop_s"] for r in records]
    failed = [r["start"] for r in records if not r["ok"]]
    print(
        f"{len(records) - len(failed)} of {len(records)} starts clean; READY median {statistics.median(ready):.1f} s "
        f"(max {max(ready):.1f} s); stop median {statistics.median(stops):.1f} s (max {max(stops):.1f} s)"
        if ready
        else f"no start became READY ({len(records)} tried)"
    )
    if failed:
        print(f"failed starts: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
