"""Shared pieces of the benchmark programs: the machine's ceilings, workloads and in-process engine runs."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a refrigerator works in simple terms.",
    "List five tips for writing clean Python code.",
    "What are the main causes of the French Revolution?",
    "Describe the water cycle step by step.",
    "Give me a recipe for a simple tomato soup.",
    "Summarize the plot of Romeo and Juliet.",
    "How do vaccines train the immune system?",
]


def machine_description() -> str:
    """The CPU, the flags that decide our fast paths, the kernels' instruction set, threads and torch: the line
    every benchmark program prints beside its figures."""
    from benchmarks.core.machine import machine_info

    info = machine_info(torch.get_num_threads())
    return (
        f"CPU {info['host_cpu']} ({info['logical_cpus']} logical CPUs), flags {' '.join(info['cpu_flags'])}, "
        f"kernels {info['kernel_isa']}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"
    )


def median(values):
    return statistics.median(values) if values else float("nan")


def run_engine(engine, prompts: list[str], params: dict, concurrency: int) -> LoadResult:
    """Feed `prompts` (all with params["max_tokens"]) to an in-process engine, `concurrency` in flight."""
    return run_engine_requests(engine, [(p, params["max_tokens"]) for p in prompts], params, concurrency)


# The seed workload of the seed text continuous_batching_from_scratch.txt ("8. Code Snippets"): 32
# (prompt, max_tokens) requests, batch size 8. Listed there in full; copied verbatim.
SEED_WORKLOAD: list[tuple[str, int]] = [
    ("Explain the concept of supply and demand", 255),
    ("Write a short story about a time traveler", 39),
    ("Explain how a computer processor works", 26),
    ("Write a brief biography of Marie Curie", 83),
    ("Describe the process of photosynthesis", 72),
    ("Explain the rules of chess", 98),
    ("Write a recipe for chocolate chip cookies", 30),
    ("Describe the water cycle", 37),
    ("Explain the theory of relativity", 87),
    ("Write a short essay on climate change", 62),
    ("Describe the structure of a cell", 24),
    ("List the main events of World War II", 75),
    ("Compose a haiku about autumn", 17),
    ("Summarize the plot of Romeo and Juliet", 291),
    ("Describe the process of making coffee", 46),
    ("Write a short story about a time traveler", 68),
    ("Explain the concept of supply and demand", 13),
    ("Describe the water cycle", 95),
    ("Explain how a computer processor works", 58),
    ("Write a brief biography of Marie Curie", 42),
    ("Compose a haiku about autumn", 81),
    ("Explain the rules of chess", 33),
    ("Write a recipe for chocolate chip cookies", 77),
    ("Describe the structure of a cell", 50),
    ("Summarize the plot of Romeo and Juliet", 222),
    ("List the main events of World War II", 66),
    ("Describe the process of photosynthesis", 89),
    ("Write a short essay on climate change", 35),
    ("Explain the theory of relativity", 70),
    ("Describe the process of making coffee", 19),
    ("Write a short story about a time traveler", 93),
    ("Explain the concept of supply and demand", 448),
]
SEED_BATCH_SIZE = 8
SEED_SPEEDUP = 88.22 / 52.36  # the seed's synchronous / continuous durations: 1.68x (the issue rounds to 1.69x)


@dataclass
class LoadResult:
    """A closed-loop run of requests at a fixed concurrency (through Triton, or any other client)."""

    wall_s: float
    output_tokens: int
    num_requests: int
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)  # per gap, GenAI-Perf: gap / tokens in the later response
    e2e_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    engine_steps: float = float("nan")  # forward passes the engine ran during the run, where known
    step_sequences: float = float("nan")  # sequences summed over those steps (their mean batch: / engine_steps)
    thread_times: dict = field(default_factory=dict)  # through Triton: thread_cpu group -> ThreadTimes
    # in process: request i's ("r{i}") time to first token and inter-token gaps, for a workload's subsets
    ttft_by_id: dict[str, float] = field(default_factory=dict)
    itl_by_id: dict[str, list[float]] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.wall_s if self.wall_s > 0 else float("nan")


def run_engine_requests(
    engine, requests: list[tuple[str, int]], params: dict, concurrency: int, lora_names=(None,), overrides=None
) -> LoadResult:
    """Feed (prompt, max_tokens) requests to an in-process engine keeping `concurrency` in flight; request i runs
    with the LoRA adapter lora_names[i % len(lora_names)] (None: the base model) and the sampling parameters
    `params` updated with `overrides(i)` where given."""
    from backend import SamplingParams

    pending = list(enumerate(requests))
    in_flight = 0
    arrival, first, last, done = {}, {}, {}, {}
    itl: list[float] = []
    itl_by_id: dict[str, list[float]] = {}
    output_tokens = 0
    start = time.perf_counter()
    while pending or engine.has_work():
        while pending and in_flight < concurrency:
            i, (prompt, max_tokens) = pending.pop(0)
            request = engine.build_request(
                f"r{i}",
                prompt,
                SamplingParams.from_dict({**params, **(overrides(i) if overrides else {}), "max_tokens": max_tokens}),
                lora_names[i % len(lora_names)],
                stream=True,
            )
            engine.add_request(request)
            arrival[request.request_id] = time.perf_counter()
            in_flight += 1
        for out in engine.step():
            now = time.perf_counter()
            tokens = sum(len(s.token_ids) for s in out.samples)
            rid = out.request_id
            if tokens:
                if rid not in first:
                    first[rid] = now
                else:
                    itl.append((now - last[rid]) / tokens)
                    itl_by_id.setdefault(rid, []).append(itl[-1])
                last[rid] = now
                output_tokens += tokens
            if out.finished:
                done[rid] = now
                in_flight -= 1
    wall = time.perf_counter() - start
    return LoadResult(
        wall,
        output_tokens,
        len(requests),
        [first[r] - arrival[r] for r in first],
        itl,
        [done[r] - arrival[r] for r in done],
        ttft_by_id={r: first[r] - arrival[r] for r in first},
        itl_by_id=itl_by_id,
    )


def run_closed_loop(requests: list[tuple[str, int]], concurrency: int, make_sender) -> LoadResult:
    """Send (prompt, max_tokens) requests with at most `concurrency` in flight: one thread per stream, each
    sending the queue's next request as soon as its previous one finished. `make_sender()` is called once per
    stream and returns (send, close): `send(prompt, max_tokens)` returns a client.api Completion."""
    import threading

    lock = threading.Lock()
    queue = list(requests)
    completions, errors = [], []
    senders = [make_sender() for _ in range(max(1, concurrency))]

    def worker(send) -> None:
        while True:
            with lock:
                if not queue:
                    return
                prompt, max_tokens = queue.pop(0)
            try:
                completion = send(prompt, max_tokens)
            except Exception as exc:  # noqa: BLE001  (reported, the run goes on)
                with lock:
                    errors.append(str(exc))
                continue
            with lock:
                completions.append(completion)

    threads = [threading.Thread(target=worker, args=(send,), daemon=True) for send, _ in senders]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    for _, close in senders:
        close()
    return LoadResult(
        wall,
        sum(c.num_output_tokens for c in completions),
        len(completions),
        [c.ttft_s for c in completions if c.ttft_s is not None],
        [x for c in completions for x in c.itl_s],
        [c.e2e_s for c in completions],
        errors,
    )


def run_triton(
    grpc_url: str, model: str, requests: list[tuple[str, int]], params: dict, concurrency: int, timeout_s: float = 600.0
) -> LoadResult:
    """`run_closed_loop` over gRPC streaming, one reused channel per stream."""
    import tritonclient.grpc as grpcclient

    from client.api import GrpcStream

    def make_sender():
        client = grpcclient.InferenceServerClient(grpc_url)

        def send(prompt: str, max_tokens: int):
            return GrpcStream(
                prompt,
                grpc_url,
                model,
                stream=True,
                client=client,
                timeout_s=timeout_s,
                **{**params, "max_tokens": max_tokens},
            ).completion()

        return send, client.close

    return run_closed_loop(requests, concurrency, make_sender)


def measure_ceilings(
    seconds: float = 1.0, size: int = 1024, read_mib: int = 256, matmuls: tuple[str, ...] = ("fp32", "bf16")
) -> dict[str, float]:
    """The machine's ceilings at the current torch thread count: matmul GFLOP/s in each of `matmuls` (square
    matmuls of `size`) and memory read bandwidth GB/s (summing a `read_mib` MiB fp32 tensor, much larger than
    the caches). Each is the median of repeated timings over about `seconds`."""
    out = {}
    for name in matmuls:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
        a = torch.randn(size, size, dtype=dtype)
        b = torch.randn(size, size, dtype=dtype)
        a @ b  # warm-up
        out[f"matmul_{name}_gflops"] = 2 * size**3 / _median_time(lambda a=a, b=b: a @ b, seconds) / 1e9
    x = torch.ones(read_mib * 2**20 // 4, dtype=torch.float32)
    x.sum()
    out["mem_read_gbs"] = x.numel() * 4 / _median_time(x.sum, seconds) / 1e9
    return out


def _median_time(fn, seconds: float) -> float:
    times = []
    deadline = time.perf_counter() + seconds
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 1000):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)
