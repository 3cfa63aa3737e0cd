"""The documented launch (`llm-serve`, what `make serve` runs) survives what kills a Triton 2.51 server
or model: the request body that segfaults its HTTP server, a dead engine thread, a killed Python stub. Each
time the supervisor restarts tritonserver, readiness shows the gap, and the launch serves again within 60 s.

Its own launch (not the session's shared server, which must not be crashed): one small fp32 model, with the
test-only engine_death fault armed."""

from __future__ import annotations

import http.client
import os
import signal
import time
import urllib.request

import psutil
import pytest

import launcher
from client import ServerError, generate_http, stream_grpc
from launcher.model_config import TENSORRT_LLM_MODELS, write_model_repository
from launcher.supervisor import stub_processes
from testkit.launch import start_launch

pytestmark = pytest.mark.integration

RECOVERY_LIMIT_S = 60.0
# Triton 2.51's HTTP server parses a generate body as JSON recursively: an ~8 MB body of nested arrays
# overflows its stack (SIGSEGV). (A plain 8 MB prompt is answered: 400, over max_prompt_bytes.)
CRASH_BODY_BYTES = 8 * 1024 * 1024
DEATH_MARKER = "<<KILL THE ENGINE>>"


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """`llm-serve` on free ports over a one-engine repository (`llm` and the forwarding models beside it); yields
    (process, ports, output)."""
    tmp_path = tmp_path_factory.mktemp("supervised")
    repository = write_model_repository(
        tmp_path / "repository",
        {
            "llm": {
                "dtype": "float32",
                "kv_cache_blocks": "128",
                "max_num_seqs": "4",
                "fault_injection": f"engine_death:{DEATH_MARKER}",
            },
        },
    )
    served = start_launch(repository, tmp_path / "serve.out")
    try:
        yield served.proc, (served.http_port, served.grpc_port, served.metrics_port), served.output
    finally:
        launcher.stop_server(served.proc, timeout_s=60)  # SIGINT: llm-serve stops its tritonserver, then exits


def wait_ready(port: int, proc, timeout_s: float, output) -> None:
    deadline = time.monotonic() + timeout_s
    while not launcher.is_ready(port):
        assert proc.poll() is None, f"llm-serve exited ({proc.returncode}):\n{output.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"not ready after {timeout_s} s:\n{output.read_text()[-4000:]}"
        time.sleep(0.1)


def good_request(port: int) -> None:
    got = generate_http("The capital of France is", f"127.0.0.1:{port}", "llm", max_tokens=3, temperature=0.0)
    assert len(got.token_ids) == 3


def send_crash_body(port: int) -> None:
    """POST the ~8 MB generate body that crashes Triton; the server dies on it, so no answer is expected."""
    body = b'{"text_input":' + b"[" * (CRASH_BODY_BYTES - 14)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/v2/models/llm/generate", body=body, headers={"Content-Type": "application/json"})
        conn.getresponse().read()
    except (OSError, http.client.HTTPException):
        pass
    finally:
        conn.close()


def recover(launch, started: float, what: str) -> float:
    """Readiness goes away, then comes back; a good request is answered: seconds since `started`."""
    proc, (http_port, _, metrics_port), output = launch
    saw_gap = False
    deadline = started + RECOVERY_LIMIT_S
    while time.monotonic() < deadline:
        ready = launcher.is_ready(http_port, timeout_s=0.5)
        saw_gap = saw_gap or not ready
        if saw_gap and ready:
            break
        time.sleep(0.1)
    assert saw_gap, f"{what} did not take the server down"
    assert launcher.is_ready(http_port), f"not READY {RECOVERY_LIMIT_S} s after {what}:\n{output.read_text()[-4000:]}"
    good_request(http_port)
    recovered_s = time.monotonic() - started
    assert recovered_s < RECOVERY_LIMIT_S
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
        assert b'llm_engine_alive{model="llm",version="1"} 1' in resp.read()
    print(f"\nthe launch served again (READY, a good request answered) {recovered_s:.1f} s after {what}")
    return recovered_s


def test_launch_serves_again_after_the_body_that_crashes_triton(launch):
    proc, (http_port, _, _), output = launch
    wait_ready(http_port, proc, float(os.environ.get("LLM_READY_TIMEOUT_S", "300")), output)
    good_request(http_port)
    started = time.monotonic()
    send_crash_body(http_port)
    recover(launch, started, "the ~8 MB body")
    log = output.read_text()
    assert "tritonserver exited unexpectedly (killed by signal 11 (SIGSEGV))" in log, log[-4000:]


def test_launch_serves_again_after_the_engine_thread_dies(launch):
    proc, (http_port, _, _), output = launch
    wait_ready(http_port, proc, RECOVERY_LIMIT_S, output)
    started = time.monotonic()
    with pytest.raises(ServerError, match="the engine stopped"):
        generate_http(DEATH_MARKER, f"127.0.0.1:{http_port}", "llm", max_tokens=2)
    recover(launch, started, "the engine thread's death")
    assert "has a model whose engine thread died" in output.read_text()


def test_launch_serves_again_after_the_python_stub_is_killed(launch):
    proc, (http_port, grpc_port, _), output = launch
    wait_ready(http_port, proc, RECOVERY_LIMIT_S, output)
    server_pid = next(c.pid for c in psutil.Process(proc.pid).children() if "tritonserver" in c.name())
    stubs = {name: pid for pid, name in stub_processes(server_pid).items()}
    # TensorRT-LLM's model names, beside llm
    assert set(stubs) == {f"{name}_0_0" for name in ("llm", *TENSORRT_LLM_MODELS)}
    stub_pid = stubs["llm_0_0"]
    in_flight = stream_grpc(
        "Write a long story about a lighthouse.",
        f"127.0.0.1:{grpc_port}",
        "llm",
        max_tokens=400,
        ignore_eos=True,
        temperature=0.0,
        timeout_s=RECOVERY_LIMIT_S,
    )
    chunks = iter(in_flight)
    next(chunks)
    logged_before = len(output.read_text())
    started = time.monotonic()
    os.kill(stub_pid, signal.SIGKILL)
    with pytest.raises(ServerError):  # the stream in flight ends with an error (no hang)
        for _ in chunks:
            pass
    failed_s = time.monotonic() - started
    recover(launch, started, "the stub's death")
    # Either reason is a recovery: the supervisor's poll finds the lost stub, or Triton 2.51 aborts on its own
    # (SIGABRT, about a second after the kill) before that poll comes round.
    logged_after = output.read_text()[logged_before:]
    assert (
        f"lost Python stub process(es) llm_0_0 (pid {stub_pid})" in logged_after
        or "tritonserver exited unexpectedly (killed by signal 6 (SIGABRT))" in logged_after
    ), logged_after[-4000:]
    print(f"the stream in flight failed {failed_s:.1f} s after the stub was killed")
