"""Speculative decoding benchmark: greedy output tokens/s with speculation off and on (k = 1..5), the
acceptance rate and mean acceptance length, at 1, 4 and 16 concurrent requests, in one process run.

    python benchmarks/spec_decode.py [--model DIR] [--dtype auto] [--quantization int4] [--draft ngram]
                                     [--draft-dtype bfloat16] [--max-tokens 128]
"""
from __future__ import annotations

import argparse
import sys

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))

from backend import EngineConfig, LLMEngine  # noqa: E402
from benchmarks.common import DEFAULT_MODEL, PROMPTS, machine_description, run_engine  # noqa: E402


def measure(args, k: int, concurrency: int):
    engine = LLMEngine(EngineConfig(
        model=args.model, dtype=args.dtype, quantization=args.quantization, draft_model=args.draft if k else "",
        draft_dtype=args.draft_dtype, num_speculative_tokens=k,
        max_num_seqs=max(concurrency, 1), spec_max_batch_size=64, kv_cache_blocks=2048,
    ))
    prompts = (PROMPTS * 4)[: max(concurrency, 1) * args.repeats]
    params = {"temperature": 0, "max_tokens": args.max_tokens, "ignore_eos": True}
    run_engine(engine, prompts[:1], {**params, "max_tokens": 4}, 1)  # warm-up
    base = {name: engine.metrics.total(name) for name in (
        "llm_spec_decode_num_drafts_total", "llm_spec_decode_num_draft_tokens_total",
        "llm_spec_decode_num_accepted_tokens_total")}
    result = run_engine(engine, prompts, params, concurrency)
    drafts, draft_tokens, accepted = (engine.metrics.total(n) - base[n] for n in base)
    acceptance = accepted / draft_tokens if draft_tokens else float("nan")
    mean_len = 1 + accepted / drafts if drafts else 1.0  # tokens emitted per verification step
    return result.tokens_per_s, acceptance, mean_len


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="int4")
    parser.add_argument("--draft", default="ngram", help="ngram, self, or a model folder")
    parser.add_argument("--draft-dtype", default="bfloat16")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--ks", default="0,1,2,3,4,5")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--repeats", type=int, default=2, help="requests per concurrency slot")
    args = parser.parse_args()
    print(f"# Speculative decoding, target {args.model} dtype {args.dtype} quantization {args.quantization}, "
          f"draft {args.draft} {args.draft_dtype}")
    print(f"# {machine_description()}")
    print("| concurrency | k | output tok/s | speed-up | acceptance rate | mean acceptance length |")
    print("|---|---|---|---|---|---|")
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        baseline = None
        for k in (int(x) for x in args.ks.split(",")):
            tps, acceptance, mean_len = measure(args, k, concurrency)
            baseline = baseline or tps
            print(f"| {concurrency} | {k} | {tps:.1f} | {tps / baseline:.2f}x | "
                  f"{acceptance:.3f} | {mean_len:.2f} |", flush=True)


if __name__ == "__main__":
    main()
