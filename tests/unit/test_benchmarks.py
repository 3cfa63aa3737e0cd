"""The benchmark and load-test programs: every module imports (a stale import breaks `llm-bench` long before
anyone runs it), and section 6 (llama.cpp) runs its whole code path, from finding the binaries to stopping
llama-server, against a fake llama.cpp folder whose programs answer as llama-bench and llama-server do; section 7
measures the kernel's distance to the exact product."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.core import llama_cpp_build
from benchmarks.core.common import LoadResult
from benchmarks.core.context import Bench
from benchmarks.core.settings import make_settings
from benchmarks.core.variants import MAIN_MODEL
from benchmarks.sections import roofline, threads_in_process, vs_llama_cpp
from tests.conftest import machine_lacks

FAKE_DECODE_TOK_S = 100.0

FAKE_LLAMA_BENCH = f"""
import json
import statistics
test = {{"avg_ts": {FAKE_DECODE_TOK_S}, "stddev_ts": 1.5, "build_commit": "fake0", "model_type": "llama ?B"}}
print(json.dumps([test]))
"""

# llama-server's streaming /completion: one event per token (`tokens` with return_tokens), then a final event
# with `stop` true and no token; /health answers 200 once loaded.
FAKE_LLAMA_SERVER = """
import argparse, json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ap = argparse.ArgumentParser()
ap.add_argument("--port", type=int)
args, _ = ap.parse_known_args()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        events = [{"content": "x", "tokens": [7], "stop": False}] * body["n_predict"] + [{"content": "", "stop": True}]
        payload = "".join(f"data: {json.dumps(e)}\\n\\n" for e in events).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(payload)


try:
    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
except KeyboardInterrupt:  # the benchmark stops it with SIGINT
    pass
"""


IMPORT_ALL = """
import importlib, pkgutil, sys
package = importlib.import_module(sys.argv[1])
for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
    importlib.import_module(module.name)
"""


@pytest.mark.parametrize("package", ["benchmarks", "loadtest"])
def test_every_module_imports(package):
    """In a fresh interpreter: locust (loadtest) monkey-patches threading with gevent for the whole process."""
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL, package], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


class FakeTriton:
    """Our side of section 6 (the server is the integration suite's business): every request of `tokens`
    output tokens, 0.5 s each, one stream at a time."""

    def __init__(self):
        self.calls: list[tuple[str, int, int]] = []

    def run(self, model: str, requests: list[tuple[str, int]], concurrency: int) -> LoadResult:
        self.calls.append((model, len(requests), concurrency))
        n = len(requests)
        return LoadResult(
            wall_s=0.5 * n / concurrency,
            output_tokens=sum(m for _, m in requests),
            num_requests=n,
            ttft_s=[0.05] * n,
            itl_s=[0.01] * n,
            e2e_s=[0.5] * n,
        )


# llama-batched-bench --output-format jsonl: one row per -npl value, S_TG (`speed_tg`) its decode tok/s.
FAKE_LLAMA_BATCHED_BENCH = f"""
import argparse, json
ap = argparse.ArgumentParser()
ap.add_argument("-npl")
args, _ = ap.parse_known_args()
for pl in args.npl.split(","):
    print(json.dumps({{"pl": int(pl), "speed_tg": {FAKE_DECODE_TOK_S} * int(pl) ** 0.5, "speed_pp": 1.0}}))
"""


def fake_llama_cpp(folder: Path) -> Path:
    for name, source in (
        ("llama-bench", FAKE_LLAMA_BENCH),
        ("llama-server", FAKE_LLAMA_SERVER),
        ("llama-batched-bench", FAKE_LLAMA_BATCHED_BENCH),
    ):
        program = folder / name
        program.write_text(f"#!{sys.executable}\n" + textwrap.dedent(source))
        program.chmod(0o755)
    return folder


def bench_with_fake_llama_cpp(tmp_path: Path, model: str) -> Bench:
    """A quick run's `Bench` on `model`, 2 peer threads, with the fake llama.cpp and a GGUF file in `tmp_path`."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    args = argparse.Namespace(
        quick=True,
        threads=1,
        engine_threads=0,
        peer_threads=2,
        model=model,
        llama_cpp_dir=str(fake_llama_cpp(tmp_path)),
        gguf=str(gguf),
    )
    return Bench(args, make_settings(args), tmp_path)


def test_sigterm_ends_a_run_through_its_finally_blocks(tmp_path):
    """llm-bench stops the servers it started in `finally` blocks; a SIGTERM must reach them as Ctrl-C does, not
    kill the process past them and leave tritonserver and llama-server running (they have sessions of their own)."""
    marker = tmp_path / "stopped"
    script = textwrap.dedent(
        """
        import sys, time
        from benchmarks.bench import exit_on_sigterm
        exit_on_sigterm()
        try:
            print("running", flush=True)
            time.sleep(60)
        finally:
            open(sys.argv[1], "w").write("servers stopped")
        """
    )
    repo = Path(__file__).parents[2]
    run = subprocess.Popen([sys.executable, "-c", script, str(marker)], stdout=subprocess.PIPE, cwd=repo)
    assert run.stdout.readline().strip() == b"running"
    run.terminate()
    assert run.wait(timeout=30) == 128 + 15
    assert marker.read_text() == "servers stopped"


def test_section_6_runs_against_a_fake_llama_cpp(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    bench = bench_with_fake_llama_cpp(tmp_path, str(tmp_path))
    bench.server = FakeTriton()
    bench.s.decode_rounds = 3  # rounds of llama-bench then one of our requests

    lines = vs_llama_cpp.run(bench)

    section = bench.results["sections"]["6"]
    assert section["llama_bench"]["tokens_per_s"] == FAKE_DECODE_TOK_S
    assert section["llama_bench"]["command"].startswith("llama-bench -m model.gguf -t 2 ")
    assert section["llama_bench"]["command"].endswith(" -r 1 -o json")
    # ours: 16 tokens in 0.5 s, the first at 0.05 s -> 15 tokens over 0.45 s
    assert section["ours_decode_tok_s"] == pytest.approx(15 / 0.45)
    rounds = section["batch_one_rounds"]
    assert [r["ratio"] for r in rounds] == pytest.approx([15 / 0.45 / FAKE_DECODE_TOK_S] * 3)
    p8 = next(t for t in bench.results["targets"] if t["id"] == "P8")
    assert p8["value"] == pytest.approx(15 / 0.45 / FAKE_DECODE_TOK_S)
    assert bench.server.calls[:3] == [(MAIN_MODEL, 1, 1)] * 3
    assert sorted(section["streams"]) == bench.s.concurrency
    for row in section["streams"].values():
        assert row["llama_server"]["output_tokens"] == row["ours"]["output_tokens"] > 0
        assert row["ratio"] == pytest.approx(row["ours"]["tokens_per_s"] / row["llama_server"]["tokens_per_s"])
    assert {model for model, _, _ in bench.server.calls} == {MAIN_MODEL}
    assert [t["id"] for t in bench.results["targets"]] == ["P8", "P9"]
    assert (tmp_path / "vs_llama_cpp.png").is_file()
    assert any("llama-bench decode tok/s" in line for line in lines)
    log = (tmp_path / "llama-server.log").read_text()
    assert "Traceback" not in log, log


def test_section_9_runs_our_engine_thread_by_thread_against_a_fake_llama_cpp(tmp_path, tiny_llama):
    bench = bench_with_fake_llama_cpp(tmp_path, tiny_llama)
    (tmp_path / "llama-server").unlink()  # section 9 runs llama-bench and llama-batched-bench only

    lines = threads_in_process.run(bench)

    section = bench.results["sections"]["9"]
    assert section["batches"] == bench.s.concurrency == [1, 4]
    assert sorted(section["threads"]) == threads_in_process.thread_counts(2) == [1, 2]
    for row in section["threads"].values():
        assert set(row["ours"]["decode_tok_s"]) == {1, 4} and min(row["ours"]["decode_tok_s"].values()) > 0
        assert row["llama_bench"] == FAKE_DECODE_TOK_S
        assert row["llama_batched"] == {1: FAKE_DECODE_TOK_S, 4: FAKE_DECODE_TOK_S * 2}
    table = [line for line in lines if line.startswith("| 2 |")]
    ours_b4 = section["threads"][2]["ours"]["decode_tok_s"][4]
    assert len(table) == 1 and f"**{ours_b4 / (FAKE_DECODE_TOK_S * 2):.2f}x**" in table[0]
    assert threads_in_process.thread_counts(16) == [1, 2, 8, 16]


def test_section_6_says_why_it_is_skipped(tmp_path):
    args = argparse.Namespace(
        quick=True, threads=1, engine_threads=0, peer_threads=2, model=str(tmp_path), llama_cpp_dir="", gguf=""
    )
    bench = Bench(args, make_settings(args), tmp_path)
    lines = vs_llama_cpp.run(bench)
    assert "no llama.cpp folder given" in lines[0]
    assert bench.results["sections"]["6"] == {"skipped": "no llama.cpp folder given (--llama-cpp-dir or LLAMA_CPP_DIR)"}
    assert json.dumps(bench.results)  # the report's JSON can hold it


def test_a_llama_cpp_build_for_another_cpu_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_CPP_CACHE", str(tmp_path))
    monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)
    bin_dir = Path(llama_cpp_build.default_bin_dir())
    assert bin_dir == tmp_path / "bin"
    assert "not found" in llama_cpp_build.why_unusable(bin_dir)
    bin_dir.mkdir()
    fake_llama_cpp(bin_dir)
    assert "another CPU" in llama_cpp_build.why_unusable(bin_dir)  # no record of its CPU
    (bin_dir / llama_cpp_build.FLAGS_FILE).write_text("fpu sse2\n")
    assert "another CPU" in llama_cpp_build.why_unusable(bin_dir)
    assert "another CPU" in vs_llama_cpp.LlamaCpp.find(str(bin_dir), str(bin_dir / "llama-bench"))
    (bin_dir / llama_cpp_build.FLAGS_FILE).write_text(llama_cpp_build.cpu_flags() + "\n")
    assert llama_cpp_build.why_unusable(bin_dir) == ""
    # a folder of the user's own is used as it is
    assert llama_cpp_build.why_unusable(fake_llama_cpp(tmp_path)) == ""


def test_the_llama_cpp_sdist_unpacks_only_inside_its_folder(tmp_path):
    """`make llama-cpp` unpacks a downloaded archive: a member pointing outside the folder is refused (by tarfile's
    data filter, or by hand on Python < 3.11.4, which has none)."""
    import io
    import tarfile

    def archive(name: str) -> Path:
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.tar.gz"
        with tarfile.open(path, "w:gz") as tar:
            info = tarfile.TarInfo(name)
            info.size = 2
            tar.addfile(info, io.BytesIO(b"ok"))
        return path

    llama_cpp_build._extract(archive("pkg/file.txt"), tmp_path / "good")
    assert (tmp_path / "good" / "pkg" / "file.txt").read_bytes() == b"ok"
    with pytest.raises((SystemExit, tarfile.FilterError) if hasattr(tarfile, "FilterError") else SystemExit):
        llama_cpp_build._extract(archive("../escaped.txt"), tmp_path / "bad")
    assert not (tmp_path / "escaped.txt").exists()


def test_section_7_measures_the_kernels_distance_to_the_exact_product():
    """The kernel regroups its sums; section 7 reports its error and torch fp32's against float64, per layer."""
    from backend.model import kernels
    from backend.model.linear import make_linear
    from benchmarks.sections import kernels_threads
    from benchmarks.sections.kernels_threads import exactness_rows
    from tests.unit.test_lowbit_kernels import random_blocks

    if kernels.best_isa() == 0:
        pytest.skip(machine_lacks("AVX2, which our low-bit kernel needs"))
    layers = []
    for seed, fmt in enumerate(["q4_1", "q8_0"]):
        blocks = random_blocks(fmt, 48, 96, seed=seed)
        layers.append(make_linear([blocks.dequantize()], [None], "none", 64, [blocks.packed()], kernels.best_isa()))
    engine = SimpleNamespace(runner=SimpleNamespace(fused=SimpleNamespace(linear_layers=lambda: layers)))
    lines, data = exactness_rows(engine, rows=(1, 5))
    assert 0 < data["ours"] < 1e-4 and 0 < data["torch_fp32"] < 1e-4
    assert data["ratio_median"] <= data["ratio_max"] < 10
    assert "2 low-bit layers at M = 1, 5" in lines[0]

    # with no server (`--no-server`) the section reports its rows in process and says what it left out
    engine.runner.max_lowbit_rows = 32
    bench = SimpleNamespace(
        s=SimpleNamespace(peer_threads=1, threads=1),
        engine=lambda variant: engine,
        server=None,
        results={"sections": {}},
    )
    lines = kernels_threads.run(bench)
    section = bench.results["sections"]["7"]
    assert set(section) == {"linear_ms", "exactness"}
    assert set(section["linear_ms"][1]) == {
        "dense fp32",
        *(f"ours, {kernels.ISA_NAMES[i]}" for i in (1, 2) if i <= kernels.best_isa()),
    }
    assert all(ms > 0 for by_rows in section["linear_ms"][1].values() for ms in by_rows.values())
    assert lines[-1] == "Rows through Triton: not run (--no-server)."


def test_no_server_runs_the_sections_that_need_no_tritonserver():
    from benchmarks import bench

    assert bench.parse_args(["--no-server"]).only == [4, 7, 8, 9]
    assert bench.server_variants([7, 9], bench.parse_args(["--no-server", "--only", "7,9"])) == []
    assert bench.parse_args([]).only == list(range(1, 10))
    with pytest.raises(SystemExit):
        bench.parse_args(["--no-server", "--only", "2,9"])  # section 2 needs the server: an error, not a silent skip


FAKE_LLAMA_QUANTIZE = """
    import sys
    flag, source, out, kind = sys.argv[1:]
    assert flag == "--allow-requantize"
    with open(source, "rb") as f, open(out, "wb") as g:
        g.write(f.read() + kind.encode())
    with open(out + ".runs", "a") as log:
        log.write("run\\n")
"""


def test_the_k_quant_file_is_made_once_by_the_builds_llama_quantize(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_CPP_CACHE", str(tmp_path / "cache"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    program = bin_dir / "llama-quantize"
    program.write_text(f"#!{sys.executable}\n" + textwrap.dedent(FAKE_LLAMA_QUANTIZE))
    program.chmod(0o755)
    source = tmp_path / "model.Q4_1.gguf"
    source.write_bytes(b"GGUF")
    out = llama_cpp_build.quantized(bin_dir, source, "Q4_K_M")
    assert out == tmp_path / "cache" / "models" / "model.Q4_1.Q4_K_M.gguf"
    assert out.read_bytes() == b"GGUFQ4_K_M"
    assert not out.with_suffix(".part").exists()  # written beside, then moved into place
    assert llama_cpp_build.quantized(bin_dir, source, "Q4_K_M") == out  # made once
    assert (tmp_path / "cache" / "models" / "model.Q4_1.Q4_K_M.part.runs").read_text() == "run\n"


def test_the_roofline_summary_counts_the_low_bit_kernel_as_matmuls():
    from benchmarks.sections.decode_profile import LOWBIT_MATMUL, MATMUL
    from benchmarks.sections.roofline import _profile_summary

    data = {1: {"fraction": 0.45, "bound": "memory", "linear_only_ms": 5.6, "step_ms": 7.3}}
    profiles = {1: {"step_ms": 10.0, "categories": {LOWBIT_MATMUL: 5.0, MATMUL: 1.0, "sampling": 4.0}}}
    summary = _profile_summary(data, profiles)
    assert "the step is 60 % matmuls" in summary, summary
    assert "the largest parts being matmuls (our low-bit kernel) 50 %, sampling 40 %" in summary


def test_section_4_shares_come_from_rounds_of_ceilings_and_steps(tmp_path, tiny_llama):
    """Each P5 / P6 share divides a round's rate by the ceiling measured in the same round; the section reports
    the median of those shares (the machine's speed drifts between rounds)."""
    import matplotlib

    matplotlib.use("Agg")
    bench = bench_with_fake_llama_cpp(tmp_path, tiny_llama)
    bench.s.roofline_rounds = 3
    bench.ceilings()

    lines = roofline.run(bench)

    decode = bench.results["sections"]["4"]["decode"]
    targets = {t["id"]: t["value"] for t in bench.results["targets"]}
    for batch, goal, ceiling in ((1, "P5", "memory"), (bench.s.roofline_batch, "P6", "compute")):
        rounds = decode[batch]["rounds"]
        assert len(rounds) == 3 and all(r["rate"] == pytest.approx(batch / r["step_s"]) for r in rounds)
        assert targets[goal] == pytest.approx(statistics.median(r["rate"] / r[ceiling] for r in rounds))
        assert decode[batch]["decode_tok_s"] == pytest.approx(statistics.median(r["rate"] for r in rounds))
    assert any(line.startswith("| 1 |") and ", rounds " in line for line in lines)
    assert (tmp_path / "roofline.png").is_file()
