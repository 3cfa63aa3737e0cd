"""The settings of one benchmark run (a full run's or `--quick`'s, with the command line's overrides) and the
workloads they make: the requests of each section, sampled greedily."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.core.common import PROMPTS, SEED_WORKLOAD

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@dataclass
class Settings:
    threads: int  # our engine's torch threads (in process and in the server): its serving default
    engine_threads: int  # what the engine is configured with (`num_threads`): 0, its own per-step rule, unless
    # --threads fixes it
    peer_threads: int  # Hugging Face's and llama.cpp's: each peer at its own best, every core
    max_tokens: int  # sections 2, 3, 5, 6
    concurrency: list[int]  # sections 2, 3, 6
    load_levels: list[int]  # section 5
    requests_per_stream: float  # sections 2, 3, 6: a level sends max(min_requests, streams x this)
    load_requests_per_stream: float  # section 5: max(load_min_requests, streams x this)
    load_min_requests: int
    min_requests: int
    seed_requests: int  # section 1: the first n of the 32
    seed_token_scale: float  # section 1: max_tokens multiplied by this (quick mode shortens them)
    seed_repeats: list[int]  # section 1: the queue once (as listed), twice (as the seed's logs ran it), ...
    repeats: int  # section 3: runs per path and level (median)
    roofline_batch: int
    decode_steps: int  # section 4: timed decode steps a round
    roofline_rounds: int  # section 4: rounds of the ceilings, then decode steps
    profile_steps: int
    decode_tokens: int  # section 6: llama-bench -n, and our batch-1 requests' length
    decode_rounds: int  # section 6: rounds of one llama-bench run and one of our batch-1 requests
    llama_bench_repetitions: int
    quick: bool


def make_settings(args) -> Settings:
    if args.quick:
        s = Settings(
            threads=args.threads,
            engine_threads=args.engine_threads,
            peer_threads=args.peer_threads,
            max_tokens=8,
            concurrency=[1, 4],
            load_levels=[1, 2, 4],
            requests_per_stream=2,
            load_requests_per_stream=2,
            load_min_requests=2,
            min_requests=2,
            seed_requests=16,
            seed_token_scale=1 / 16,
            seed_repeats=[1],
            repeats=1,
            roofline_batch=8,
            decode_steps=4,
            roofline_rounds=1,
            profile_steps=2,
            decode_tokens=16,
            decode_rounds=1,
            llama_bench_repetitions=1,
            quick=True,
        )
    else:
        s = Settings(
            threads=args.threads,
            engine_threads=args.engine_threads,
            peer_threads=args.peer_threads,
            max_tokens=64,
            concurrency=[1, 8, 32],
            load_levels=[1, 2, 4, 8, 16, 32, 64],
            requests_per_stream=2,
            load_requests_per_stream=1.5,
            load_min_requests=8,
            min_requests=4,
            seed_requests=32,
            seed_token_scale=1.0,
            seed_repeats=[1, 2],
            repeats=2,
            roofline_batch=32,
            decode_steps=16,
            roofline_rounds=5,
            profile_steps=4,
            decode_tokens=128,
            decode_rounds=5,
            llama_bench_repetitions=5,
            quick=False,
        )
    for name in ("max_tokens", "repeats", "roofline_batch", "decode_steps"):
        if getattr(args, name, None):
            setattr(s, name, getattr(args, name))
    for name in ("concurrency", "load_levels", "seed_repeats"):
        if getattr(args, name, None):
            setattr(s, name, ints(getattr(args, name)))
    return s


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def throughput_requests(s: Settings, concurrency: int, load: bool = False) -> list[tuple[str, int]]:
    """The (prompt, max_tokens) requests of one concurrency level: PROMPTS cycled, each s.max_tokens long."""
    if load:
        n = max(s.load_min_requests, round(concurrency * s.load_requests_per_stream))
    else:
        n = max(s.min_requests, round(concurrency * s.requests_per_stream))
    return [(PROMPTS[i % len(PROMPTS)], s.max_tokens) for i in range(n)]


def seed_requests(s: Settings) -> list[tuple[str, int]]:
    return [(p, max(2, round(m * s.seed_token_scale))) for p, m in SEED_WORKLOAD[: s.seed_requests]]


def largest(levels: list[int], wanted: int) -> int:
    """`wanted` if it is among `levels`, else the largest level (a quick run has no 32 streams)."""
    return wanted if wanted in levels else max(levels)
