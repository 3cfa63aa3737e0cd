"""launcher/supervisor.py: restarts a server process that exits unexpectedly, with bounded back-off, one that
lost a Python stub, and one whose model reports a dead engine (a gauge at 0, or an engine that vanished); does not
restart a server that failed before it was ever ready; stops on request."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from launcher.readiness import free_port
from launcher.supervisor import Supervisor, dead_engines, describe_exit, engine_gauges, stub_processes


def python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def recorded(code: str) -> tuple[list[subprocess.Popen], Callable[[], subprocess.Popen]]:
    """A start function that runs `python -c code`, and the list of the processes it has started."""
    procs: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        procs.append(python(code))
        return procs[-1]

    return procs, start


def stop(proc: subprocess.Popen) -> int:
    proc.kill()
    return proc.wait()


def test_describe_exit_names_the_signal():
    assert describe_exit(-11) == "killed by signal 11 (SIGSEGV)"
    assert describe_exit(3) == "exit code 3"


def test_dead_engines_reads_the_gauge():
    text = (
        '# TYPE llm_engine_alive gauge\nllm_engine_alive{model="a",version="1"} 1\n'
        'llm_engine_alive{model="b",version="1"} 0\nllm_engine_alive_x{model="c"} 0\n'
    )
    assert dead_engines(text) == ['model="b",version="1"']
    assert engine_gauges(text) == {'model="a",version="1"': True, 'model="b",version="1"': False}
    # an engine seen alive whose gauge is gone: its model unloaded itself when the engine died
    assert dead_engines(text, {'model="a",version="1"', 'model="z",version="1"'}) == [
        'model="b",version="1"',
        'model="z",version="1"',
    ]


def wait_until(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(0.01)


def serve_metrics(body: dict) -> HTTPServer:
    """A metrics endpoint answering `body["text"]` (changed by the test as it goes)."""

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body["text"].encode())

        def log_message(self, *args):
            pass

    httpd = HTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def test_restarts_with_bounded_backoff_then_gives_up():
    log = io.StringIO()
    starts = []

    def start():
        starts.append(time.monotonic())
        return python("import os; os.kill(os.getpid(), 11)")  # dies like the segfaulting server

    sup = Supervisor(start, stop, backoff_initial_s=0.1, backoff_max_s=0.2, max_restarts=3, log=log)
    assert sup.run() == -11
    assert len(starts) == 4 and sup.restarts == 3
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps[0] >= 0.1 and gaps[1] >= 0.2 and gaps[2] >= 0.2 and max(gaps) < 2.0  # 0.1, 0.2, then capped
    text = log.getvalue()
    assert text.count("exited unexpectedly (killed by signal 11 (SIGSEGV))") == 4
    assert "restarting in 0.1 s" in text and "restarting in 0.2 s" in text and "not restarting" in text


def test_stop_ends_a_running_server():
    sup = Supervisor(lambda: python("import time; time.sleep(60)"), stop, health_interval_s=0.05, log=io.StringIO())
    runner = threading.Thread(target=sup.run)
    runner.start()
    while sup.proc is None:
        time.sleep(0.01)
    sup.stop()
    runner.join(10)
    assert not runner.is_alive() and sup.proc.poll() is not None and sup.restarts == 0


@pytest.mark.parametrize("death", ["gauge at 0", "gauge gone"])
def test_a_dead_engine_restarts_the_server(death):
    alive = 'llm_engine_alive{model="llm",version="1"} 1\n'
    body = {"text": alive}
    httpd = serve_metrics(body)
    log = io.StringIO()
    sup = Supervisor(
        lambda: python("import time; time.sleep(60)"),
        stop,
        health_interval_s=0.05,
        backoff_initial_s=0.01,
        metrics_url=f"http://127.0.0.1:{httpd.server_port}/metrics",
        log=log,
    )
    runner = threading.Thread(target=sup.run)
    runner.start()
    try:
        wait_until(lambda: sup.checks >= 3, "three health checks")
        assert sup.restarts == 0  # alive for three checks: left alone
        first = sup.proc
        body["text"] = 'llm_engine_alive{model="llm",version="1"} 0\n' if death == "gauge at 0" else "# nothing\n"
        wait_until(lambda: sup.restarts >= 1, "a restart")
        body["text"] = alive
        assert first.poll() is not None
        assert 'engine thread died (model="llm",version="1")' in log.getvalue()
    finally:
        sup.stop()
        runner.join(10)
        httpd.shutdown()


@pytest.mark.parametrize(
    "code, restarted",
    [("import sys; sys.exit(1)", False), ("import os; os.kill(os.getpid(), 11)", True)],
    ids=["exits-with-an-error", "killed-by-a-signal"],
)
def test_a_server_that_ends_before_it_is_ready(code, restarted):
    """Exiting with an error by itself before its ready URL ever answered is a start that failed (a model's
    configuration error): not restarted, the model's message logged. Killed by a signal (a crash while loading,
    or right after it got ready) is a crash: restarted."""
    log = io.StringIO()
    starts, start = recorded(code)
    sup = Supervisor(
        start,
        stop,
        health_interval_s=0.05,
        backoff_initial_s=0.01,
        ready_url=f"http://127.0.0.1:{free_port()}/v2/health/ready",
        max_restarts=1,
        describe=lambda proc: "failed to load 'llm': ConfigError: parameter 'model'",
        log=log,
    )
    code_returned = sup.run()
    text = log.getvalue()
    if restarted:
        assert code_returned == -11 and len(starts) == 2 and sup.restarts == 1
        assert "failed to start" not in text
    else:
        assert code_returned == 1 and len(starts) == 1 and sup.restarts == 0
        assert "before it was ready: it failed to start, and would again, so it is not restarted" in text, text
        assert "ConfigError: parameter 'model'" in text and "restarting in" not in text


def test_a_server_that_was_ready_is_restarted_when_it_exits():
    body = {"text": "ok"}
    httpd = serve_metrics(body)
    log = io.StringIO()
    starts, start = recorded("import time; time.sleep(0.5)")  # serves a moment, then exits

    sup = Supervisor(
        start,
        stop,
        health_interval_s=0.05,
        backoff_initial_s=0.01,
        ready_url=f"http://127.0.0.1:{httpd.server_port}/",
        max_restarts=1,
        log=log,
    )
    try:
        assert sup.run() == 1  # gave up after one restart: max_restarts
    finally:
        httpd.shutdown()
    assert len(starts) == 2 and sup.restarts == 1
    assert "exited unexpectedly (exit code 0) (consecutive failure 1)" in log.getvalue()


def test_a_lost_stub_process_restarts_the_server():
    """A fake server with one child named like Triton's Python stub; killing the child restarts the server."""
    code = (
        "import subprocess, time; subprocess.Popen(['/x/triton_python_backend_stub', '-c', 'sleep 60; true', "
        "'a', 'b', 'c', 'd', 'e', 'llm_0_0'], executable='/bin/bash'); time.sleep(60)"
    )
    log = io.StringIO()

    def start():
        return subprocess.Popen([sys.executable, "-c", code])

    def stop_tree(proc):
        for pid in stub_processes(proc.pid):
            os.kill(pid, signal.SIGKILL)
        return stop(proc)

    sup = Supervisor(start, stop_tree, health_interval_s=0.05, backoff_initial_s=0.01, log=log)
    runner = threading.Thread(target=sup.run)
    runner.start()
    try:
        deadline = time.monotonic() + 10
        while (sup.proc is None or not stub_processes(sup.proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.02)
        first = sup.proc
        ((stub_pid, name),) = stub_processes(first.pid).items()
        assert name == "llm_0_0"
        seen = sup.checks
        wait_until(lambda: sup.checks >= seen + 2, "the supervisor to have seen the stub")
        os.kill(stub_pid, signal.SIGKILL)
        while sup.restarts == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sup.restarts == 1 and first.poll() is not None
        assert f"lost Python stub process(es) llm_0_0 (pid {stub_pid})" in log.getvalue()
    finally:
        sup.stop()
        runner.join(10)


def test_an_unexpected_exit_is_cleaned_up():
    """The server's leftovers (its Python stubs survive a SIGKILL of tritonserver) are stopped with it."""
    stopped = []

    def record_stop(proc: subprocess.Popen) -> int:
        stopped.append(proc.pid)
        return stop(proc)

    procs, start = recorded("import sys; sys.exit(3)")

    sup = Supervisor(start, record_stop, backoff_initial_s=0.01, max_restarts=1, log=io.StringIO())
    assert sup.run() == 3
    assert stopped == [p.pid for p in procs] and len(procs) == 2
