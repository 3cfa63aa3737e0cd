"""Speculative decoding benchmark: greedy output tokens/s on three workloads, input-grounded (rewrite, copy with
a replacement, summarise and extract from a paragraph given in the prompt; edit a code snippet given in the
prompt), open chat (a story, explanations, lists, a recipe) and agentic (a run of requests that each answer with
the same JSON tool-call shape, different arguments: what suffix decoding's store of earlier outputs is for), with
speculation off and, for each draft, at a fixed k and adaptive (`spec_adaptive`), in one process run. The modes
take turns prompt by prompt, so each ratio compares numbers taken at the same time on a noisy machine, and every
mode sees the agentic requests in the same order; the table shows medians over the runs.

    python benchmarks/sections/spec_decode.py [--model DIR] [--dtype D] [--quantization Q] [--draft ngram,suffix]
                                              [--k 4] [--runs 3] [--max-tokens 128] [--concurrency 1] [--no-fixed]
                                              [--workloads W,...] [--set KEY=VALUE]

The engine runs model_repository/llm/config.pbtxt's parameters, with the options above over them.

Prompts go through the model's chat template, as the OpenAI front door sends them. Requests stop at EOS;
greedy output does not depend on speculation (up to bf16 near-ties), so every mode generates the same tokens
(the table's token counts show it). `run(bench)` is the same
comparison as a section of the benchmark report (benchmarks/bench.py), on the served configuration.
"""

from __future__ import annotations

import argparse
import json
import time

from backend import EngineConfig, LLMEngine
from benchmarks.core.common import (
    PROMPTS,
    machine_description,
    median,
    run_engine_requests,
)
from benchmarks.core.progress import log
from benchmarks.core.variants import engine_parameters
from launcher.model_config import read_parameters
from launcher.paths import MODEL_DIR

TITLE = "Speculative decoding: input-grounded output and open chat"

PARAGRAPH = (
    "The city council met on Tuesday evening to discuss the new bicycle lanes on Main Street. Several residents "
    "said the lanes made the street safer for children walking to school, while shop owners worried that the "
    "loss of parking spaces would keep customers away. After two hours of debate, the council voted to keep "
    "the lanes for a trial period of six months and to review the number of visitors to the shops in March."
)
CODE = """def average(values):
    total = 0
    count = 0
    for value in values:
        total = total + value
        count = count + 1
    if count == 0:
        return 0
    return total / count


def largest(values):
    best = values[0]
    for value in values:
        if value > best:
            best = value
    return best
"""
GROUNDED = [
    f"Rewrite the following paragraph in the past perfect tense, keeping every detail:\n\n{PARAGRAPH}",
    f"Copy the following paragraph, replacing 'council' with 'committee':\n\n{PARAGRAPH}",
    f"Summarise the following paragraph in two sentences:\n\n{PARAGRAPH}",
    f"Extract, word for word, every sentence of this paragraph that mentions the shops:\n\n{PARAGRAPH}",
    f"Add a docstring to each function below and return the whole code:\n\n```python\n{CODE}```",
    f"Rename the variable `total` to `running_sum` in this code and return the whole code:\n\n```python\n{CODE}```",
]
OPEN_CHAT = PROMPTS  # a story, explanations, lists, a recipe
TOOLS = (
    'You are a function-calling assistant. Tools: get_weather(city: string, unit: "celsius" | "fahrenheit", '
    "days: integer). Reply with exactly one tool call as JSON and nothing else."
)
CITIES = "Paris Berlin Tokyo Lima Cairo Oslo Madrid Toronto Sydney Nairobi Seoul Dublin".split()


def tool_call(city: str, unit: str, days: int) -> str:
    return json.dumps({"name": "get_weather", "arguments": {"city": city, "unit": unit, "days": days}})


# one worked example, then the request (the shipped 135M model follows the shape only when shown it once)
AGENTIC = [
    [
        {"role": "system", "content": TOOLS},
        {"role": "user", "content": "What's the weather in Rome tomorrow, in celsius?"},
        {"role": "assistant", "content": tool_call("Rome", "celsius", 1)},
        {
            "role": "user",
            "content": f"What will the weather be like in {city} over the next {1 + i % 5} days, in "
            f"{('celsius', 'fahrenheit')[i % 2]}?",
        },
    ]
    for i, city in enumerate(CITIES + CITIES[::-1])
]
WORKLOADS = {"input-grounded": GROUNDED, "open chat": OPEN_CHAT, "agentic": AGENTIC}


def modes(drafts: list[str], k: int, fixed: bool = True) -> dict[str, dict[str, str]]:
    """Each mode's engine parameters over the base configuration: off, then each draft at a fixed k (unless not
    `fixed`) and adaptive."""
    result = {"off": {"draft_model": "", "num_speculative_tokens": "0", "spec_adaptive": "false", "draft_head": ""}}
    for draft in drafts:
        spec = {"draft_model": draft, "num_speculative_tokens": str(k)}
        if draft != "auto":
            spec["draft_head"] = ""  # the head `--set draft_head=` names drafts under auto only
        if fixed:
            result[f"{draft} fixed k={k}"] = {**spec, "spec_adaptive": "false"}
        result[f"{draft} adaptive k<={k}"] = {**spec, "spec_adaptive": "true"}
    return result


def chat_prompt(engine: LLMEngine, prompt: str | list[dict]) -> str:
    """The text as one user turn (or the messages as given) in the model's chat template, ready for the
    assistant's answer."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


SPEC_COUNTERS = (
    "llm_spec_decode_num_drafts_total",
    "llm_spec_decode_num_draft_tokens_total",
    "llm_spec_decode_num_accepted_tokens_total",
)
SUMS = ("wall_s", "cpu_s", "draft_s", "output_tokens", "steps", "requests", "ttft_s", "e2e_s", *SPEC_COUNTERS)


class DraftClock:
    """Wall seconds the engine spends in its proposer (drafting, and a head's reading of the target's output)."""

    def __init__(self, engine: LLMEngine):
        self.seconds = 0.0
        proposer = engine.spec.proposer if engine.spec is not None else None
        for name in ("propose", "observe", "finish") if proposer is not None else ():
            setattr(proposer, name, self.timed(getattr(proposer, name)))

    def timed(self, method):
        def call(*args):
            started = time.perf_counter()
            try:
                return method(*args)
            finally:
                self.seconds += time.perf_counter() - started

        return call


def measure(
    engine: LLMEngine, prompts: list[str], max_tokens: int, concurrency: int, clock: DraftClock | None = None
) -> dict[str, float]:
    """One closed-loop run: wall and process CPU seconds, the proposer's wall seconds (`clock`), output tokens,
    engine steps, requests, their times to first token and end-to-end times summed, speculation counters."""
    before = [engine.metrics.total(name) for name in SPEC_COUNTERS]
    drafting = clock.seconds if clock else 0.0
    steps, cpu = engine.num_steps, time.process_time()
    result = run_engine_requests(
        engine, [(chat_prompt(engine, p), max_tokens) for p in prompts], {"temperature": 0}, concurrency
    )
    return {
        "wall_s": result.wall_s,
        "cpu_s": time.process_time() - cpu,
        "draft_s": (clock.seconds if clock else 0.0) - drafting,
        "output_tokens": result.output_tokens,
        "steps": engine.num_steps - steps,
        "requests": result.num_requests,
        "ttft_s": sum(result.ttft_s),
        "e2e_s": sum(result.e2e_s),
        **{n: engine.metrics.total(n) - b for n, b in zip(SPEC_COUNTERS, before)},
    }


def compare(
    base: dict[str, str],
    mode_parameters: dict[str, dict[str, str]],
    runs: int,
    max_tokens: int,
    concurrency: int,
    progress=print,
    workloads: dict | None = None,
) -> dict:
    """{workload: {mode: [summed measure() per run]}}. At batch 1 the modes take turns prompt by prompt (the
    first mode rotating), so a burst of load on the shared machine hits every mode alike. Each run has engines of
    its own: what suffix decoding stores of one run's outputs never drafts the next run's identical requests."""
    workloads = WORKLOADS if workloads is None else workloads
    names = list(mode_parameters)
    results = {w: {m: [] for m in names} for w in workloads}
    for run in range(runs):
        engines = None  # the last run's, freed before the next are loaded
        engines = {m: LLMEngine(EngineConfig.from_parameters({**base, **mode_parameters[m]})) for m in names}
        clocks = {m: DraftClock(engine) for m, engine in engines.items()}
        for engine in engines.values():
            measure(engine, ["Say hello."], 4, 1)  # warm-up, on a prompt of no workload
        for workload, prompts in workloads.items():
            sums = {m: dict.fromkeys(SUMS, 0.0) for m in names}
            groups = [prompts[i : i + concurrency] for i in range(0, len(prompts), concurrency)]
            for i, group in enumerate(groups):
                for mode in names[i % len(names) :] + names[: i % len(names)]:
                    for key, value in measure(engines[mode], group, max_tokens, concurrency, clocks[mode]).items():
                        sums[mode][key] += value
            for mode in names:
                results[workload][mode].append(sums[mode])
                progress(
                    f"run {run + 1}/{runs} {workload} {mode}: {tokens_per_s(sums[mode]):.1f} tok/s, "
                    f"{tokens_per_s(sums[mode], 'cpu_s'):.1f} tok per CPU s, {sums[mode]['output_tokens']:.0f} "
                    f"tokens, {sums[mode]['steps']:.0f} steps"
                )
    return results


def tokens_per_s(r: dict, clock: str = "wall_s") -> float:
    return r["output_tokens"] / r[clock] if r[clock] else float("nan")


def decode_tokens_per_s(r: dict) -> float:
    """Output tokens after each request's first, per second of request time after its first token: the decode
    phase alone, which speculation speeds up (the first token comes from the prompt's pass, which it does not)."""
    decode = r["e2e_s"] - r["ttft_s"]
    return (r["output_tokens"] - r["requests"]) / decode if decode > 0 else float("nan")


def table(results: dict, concurrency: int) -> list[str]:
    """Medians over the runs; a mode's ratio to speculation off is the median of the per-run ratios."""
    num_runs = len(next(iter(next(iter(results.values())).values())))
    lines = [
        f"Greedy, {concurrency} stream(s), medians of {num_runs} interleaved runs. Tok per CPU s: output "
        "tokens per second of the process's CPU time, which a busy shared machine disturbs less than the "
        "wall clock. Decode tok/s: the tokens after each request's first per second of request time after it "
        "(the decode phase alone); prompt share: the requests' time to first token over their whole time (the "
        "prompt's pass, which speculation leaves as it is, bounds the end-to-end ratio).",
        "",
        "| workload | speculation | output tok/s | vs off | tok per CPU s | vs off | decode tok/s | vs off | "
        "prompt share | acceptance rate | draft tokens per step | mean acceptance length | draft's share of the time "
        "| output tokens | engine steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for workload, by_mode in results.items():
        off = by_mode["off"]
        for mode, runs in by_mode.items():
            cells = []
            for clock in ("wall_s", "cpu_s"):
                ratios = [tokens_per_s(r, clock) / tokens_per_s(o, clock) for r, o in zip(runs, off)]
                cells += [f"{median([tokens_per_s(r, clock) for r in runs]):.1f}", f"{median(ratios):.2f}x"]
            decode = [decode_tokens_per_s(r) for r in runs]
            ratios = [d / decode_tokens_per_s(o) for d, o in zip(decode, off)]
            cells += [
                f"{median(decode):.1f}",
                f"{median(ratios):.2f}x",
                f"{sum(r['ttft_s'] for r in runs) / sum(r['e2e_s'] for r in runs):.0%}",
            ]
            drafts, drafted, accepted = (sum(r[n] for r in runs) for n in SPEC_COUNTERS)
            steps = sum(r["steps"] for r in runs)
            cells += [
                f"{accepted / drafted:.3f}" if drafted else "",
                f"{drafted / steps:.2f}" if steps else "",
                f"{1 + accepted / drafts:.2f}" if drafts else "1.00",
                f"{sum(r['draft_s'] for r in runs) / sum(r['wall_s'] for r in runs):.1%}",
                f"{median([r['output_tokens'] for r in runs]):.0f}",
                f"{median([r['steps'] for r in runs]):.0f}",
            ]
            lines.append(f"| {workload} | {mode} | " + " | ".join(cells) + " |")
    return lines + [""]


def run(bench) -> list[str]:
    """The report section: the served configuration (its draft model and k, else n-gram with k 4) and suffix
    decoding at the same k, at batch 1."""
    params = {**engine_parameters(bench.s.engine_threads), "model": bench.model_dir}
    draft = params.get("draft_model") or "ngram"
    drafts = list(dict.fromkeys([draft, "suffix"]))
    k = int(params.get("num_speculative_tokens", "0")) or 4
    runs, max_tokens = (1, 16) if bench.s.quick else (3, 128)
    results = compare(params, modes(drafts, k), runs, max_tokens, 1, progress=log)
    bench.results["sections"]["8"] = results
    return [
        f"Drafts {', '.join(f'`{d}`' for d in drafts)}, k = {k}; {max_tokens} tokens at most per request, stopping "
        "at EOS; input-grounded: rewrite, replace, summarise, extract and code-edit prompts that quote their input; "
        "open chat: the throughput prompts; agentic: 24 requests answering with the same JSON tool-call shape.",
        "",
        *table(results, 1),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(MODEL_DIR))
    parser.add_argument("--dtype", default="", help="default: the served configuration's")
    parser.add_argument("--quantization", default="", help="default: the served configuration's")
    parser.add_argument(
        "--draft",
        default="ngram,suffix",
        help="comma-separated: ngram, suffix, auto (with --set draft_head=FOLDER for the trained head), self, a folder",
    )
    parser.add_argument("--no-fixed", action="store_true", help="only the adaptive mode of each draft")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"some of {', '.join(WORKLOADS)}")
    parser.add_argument("--draft-dtype", default="bfloat16")
    parser.add_argument("--k", type=int, default=4, help="the fixed k, and the adaptive mode's largest")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: the engine's default)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other engine parameter, e.g. --set spec_min_acceptance=0.4",
    )
    args = parser.parse_args()
    base = {
        **read_parameters(),
        "model": args.model,
        "draft_dtype": args.draft_dtype,
        "num_threads": str(args.threads),
        "kv_cache_blocks": "2048",
        "max_num_seqs": str(max(args.concurrency, 1)),
        "spec_max_batch_size": "64",
        **{k: v for k, v in (("dtype", args.dtype), ("quantization", args.quantization)) if v},
        **dict(item.split("=", 1) for item in args.set),
    }
    print(
        f"# Speculative decoding, target {args.model} dtype {base.get('dtype')} quantization "
        f"{base.get('quantization')}, draft {args.draft} {args.draft_dtype}",
        flush=True,
    )
    results = compare(
        base,
        modes(args.draft.split(","), args.k, not args.no_fixed),
        args.runs,
        args.max_tokens,
        args.concurrency,
        progress=lambda m: print(f"# {m}", flush=True),
        workloads={w: WORKLOADS[w] for w in args.workloads.split(",")},
    )
    print(f"# {machine_description()}")
    print("\n".join(table(results, args.concurrency)))


if __name__ == "__main__":
    main()
