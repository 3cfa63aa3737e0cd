"""Starting and stopping the documented launch (`llm-serve`, what `make serve` runs), each on its own free ports with
one small model: an idle launch stops in under 3 s on SIGINT and on SIGTERM with exit code 0 for the launch and for
tritonserver; with streams in flight it lets them finish, then stops; a model whose configuration is wrong ends
the launch at once with the model's own message and a non-zero exit code (no restart loop)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

from client import stream_grpc
from launcher.model_config import write_model_repository
from testkit.launch import Launch, start_launch

pytestmark = pytest.mark.integration

IDLE_STOP_LIMIT_S = 3.0
READY_TIMEOUT_S = float(os.environ.get("LLM_READY_TIMEOUT_S", "300"))
SMALL = {"dtype": "float32", "quantization": "none", "draft_model": "", "kv_cache_blocks": "64", "max_num_seqs": "4"}


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    return write_model_repository(tmp_path_factory.mktemp("start_stop") / "repository", {"llm": SMALL})


def stop(launch: Launch, sig: signal.Signals, timeout_s: float = 60.0) -> tuple[int, float]:
    """Signal the launch (as a terminal's Ctrl-C or Kubernetes does); its exit code and the seconds it took."""
    started = time.monotonic()
    launch.proc.send_signal(sig)
    code = launch.wait_exit(timeout_s)
    return code, time.monotonic() - started


def triton_exit_code(launch: Launch) -> int:
    codes = re.findall(r"\[llm-serve\] tritonserver exited with code (-?\d+)", launch.text())
    assert codes, f"llm-serve did not say how tritonserver exited:\n{launch.tail()}"
    return int(codes[-1])


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_idle_launch_stops_in_under_3_s_with_exit_code_0(repository, tmp_path, sig):
    launch = start_launch(repository, tmp_path / "serve.out")
    try:
        launch.wait_ready(READY_TIMEOUT_S)
        code, took = stop(launch, sig)
    finally:
        if launch.proc.poll() is None:
            launch.proc.kill()
    print(f"\nidle launch stopped by {sig.name} in {took:.2f} s")
    assert code == 0, f"llm-serve exited with {code}:\n{launch.tail()}"
    assert triton_exit_code(launch) == 0, launch.tail()
    assert "the front door exited with code 0" in launch.text(), launch.tail()
    assert took < IDLE_STOP_LIMIT_S, f"an idle stop took {took:.2f} s:\n{launch.tail()}"


def test_streams_in_flight_finish_before_the_launch_stops(repository, tmp_path):
    launch = start_launch(repository, tmp_path / "serve.out")
    results: list = [None, None]
    generating = [threading.Event(), threading.Event()]

    def one(i: int) -> None:
        tokens = 0
        try:
            for chunk in stream_grpc(
                "Write a long story about a lighthouse.",
                f"127.0.0.1:{launch.grpc_port}",
                "llm",
                max_tokens=48,
                ignore_eos=True,
                temperature=0.0,
                timeout_s=120,
            ):
                tokens += len(chunk.token_ids)
                generating[i].set()
            results[i] = tokens
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            results[i] = exc
        finally:
            generating[i].set()

    try:
        launch.wait_ready(READY_TIMEOUT_S)
        streams = [threading.Thread(target=one, args=(i,)) for i in range(2)]
        for stream in streams:
            stream.start()
        for event in generating:
            assert event.wait(60), "a stream sent nothing in 60 s"
        assert results == [None, None], f"a stream ended before the stop: {results}"
        code, took = stop(launch, signal.SIGTERM)
        for stream in streams:
            stream.join(60)
    finally:
        if launch.proc.poll() is None:
            launch.proc.kill()
    print(f"\nwith 2 streams in flight the launch stopped in {took:.2f} s; tokens received: {results}")
    assert results == [48, 48], f"streams cut by the stop: {results}\n{launch.tail()}"
    assert code == 0 and triton_exit_code(launch) == 0, launch.tail()


def test_a_configuration_error_ends_the_launch_with_the_models_message(tmp_path):
    """A parameter the model's load refuses (a `model` the launcher cannot read fails before the server starts,
    tests/unit/test_gguf_models.py): the load fails, and the launch ends with that message and a non-zero exit
    code instead of restarting the server again and again."""
    bad = write_model_repository(tmp_path / "repository", {"llm": {**SMALL, "dtype": "float64"}})
    launch = start_launch(bad, tmp_path / "serve.out")
    try:
        code = launch.wait_exit(READY_TIMEOUT_S)
    finally:
        if launch.proc.poll() is None:
            launch.proc.kill()
    text = launch.text()
    assert code != 0, text[-4000:]
    assert "it failed to start, and would again, so it is not restarted; what failed:" in text, text[-4000:]
    assert "ConfigError: parameter 'dtype' must be one of" in text.split("not restarted")[-1], text
    assert "restarting in" not in text, text[-4000:]
