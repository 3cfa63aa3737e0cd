"""Structured output benchmark: output tokens/s of 32 constrained streams against 32 free ones, in one
in-process engine, and what the per-step masking costs. Writes benchmarks/results/structured_output.md.

Every row sends the same chat prompts, greedy, `ignore_eos`, 64 tokens at most, 32 in flight (64 requests):
free text, a JSON schema (arrays of objects: long outputs) and a regular expression. A constrained stream ends
when its grammar is complete, so the rows also give the mean output length.

    python benchmarks/tools/structured_output.py [--model DIR] [--dtype auto] [--quantization int4] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from backend import EngineConfig, LLMEngine, SamplingParams
from benchmarks.core.common import PROMPTS, machine_description, run_engine
from launcher.paths import MODEL_DIR

RESULTS = Path(__file__).resolve().parents[1] / "results" / "structured_output.md"
SCHEMA = {
    "type": "array",
    "minItems": 3,
    "items": {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", "age", "tags"],
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
        },
    },
}
ROWS = [
    ("free text", "", {}),
    (
        "JSON schema",
        "Reply in JSON: a list of people with their names, ages and favourite colours.",
        {"guided_json": SCHEMA},
    ),
    ("regular expression", "Reply in words.", {"guided_regex": "[A-Z][A-Za-z ,.]+"}),
]


class MaskTimer:
    """Wraps the engine's logits masking: total seconds and steps it ran in."""

    def __init__(self, engine: LLMEngine):
        self.seconds, self.calls, self.rows = 0.0, 0, 0
        self._mask = engine.structured.mask_logits
        engine.structured.mask_logits = self

    def __call__(self, sched, logits):
        start = time.perf_counter()
        self._mask(sched, logits)
        constrained = sum(
            s.num_spec_tokens + 1
            for s in sched.scheduled
            if s.samples and sched.sequences[s.seq_id].matcher is not None
        )
        if constrained:
            self.seconds += time.perf_counter() - start
            self.calls += 1
            self.rows += constrained


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(MODEL_DIR))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="int4")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64)
    args = parser.parse_args()
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            quantization=args.quantization,
            max_num_seqs=args.streams,
            kv_cache_blocks=4096,
        )
    )
    timer = MaskTimer(engine)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    base = {"temperature": 0, "max_tokens": args.max_tokens, "ignore_eos": True}
    run_engine(engine, prompts[:2], {**base, "max_tokens": 4}, 2)  # warm-up
    lines = [
        f"# Structured output: {args.streams} constrained streams vs {args.streams} free ones",
        "",
        f"In-process engine, {args.model.rsplit('/', 1)[-1]}, dtype {engine.config.dtype}, quantization "
        f"{engine.config.quantization}; {args.requests} requests, {args.streams} in flight, greedy, ignore_eos, "
        f"max_tokens {args.max_tokens}. {machine_description()}.",
        "",
        "| output | tok/s | vs free | mean output tokens | masking ms per step (rows per step) | share of wall time |",
        "|---|---|---|---|---|---|",
    ]
    free_tps = None
    for name, instruction, constraint in ROWS:
        if constraint:  # compiled outside the timed run (a cache hit from then on)
            engine.structured.compile(SamplingParams.from_dict(constraint).guided_decoding).result()
        before = (timer.seconds, timer.calls, timer.rows)
        asked = [f"{instruction} {p}".strip() for p in prompts]
        result = run_engine(engine, asked, {**base, **constraint}, args.streams)
        seconds, calls, rows = (now - then for now, then in zip((timer.seconds, timer.calls, timer.rows), before))
        free_tps = free_tps or result.tokens_per_s
        masking = f"{1000 * seconds / calls:.2f} ({rows / calls:.0f})" if calls else "-"
        share = f"{100 * seconds / result.wall_s:.1f} %" if calls else "-"
        lines.append(
            f"| {name} | {result.tokens_per_s:.1f} | {result.tokens_per_s / free_tps:.2f}x | "
            f"{result.output_tokens / result.num_requests:.1f} | {masking} | {share} |"
        )
        print(lines[-1], flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
