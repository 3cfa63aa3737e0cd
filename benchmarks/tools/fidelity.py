"""Reduced-precision fidelity: the engine against `transformers` `generate`, by the near-tie rule.

The rule (testkit/fidelity.py, as vLLM's `check_logprobs_close`, widened as docs/benchmarks.md explains): each
greedy completion is identical to Hugging Face's in the same dtype up to its first differing token, and there
the two tokens are a near-tie: each among the other side's top-5 candidates, and on each side their logits less
than `MAX_LOGIT_GAP` apart. (bf16 logits near 16 are 0.125 apart, and three-way ties occur.)

    python benchmarks/tools/fidelity.py --dtype bfloat16 --quantization int4     # the 24-prompt set, in process

It also measures batch invariance: how often a completion (greedy, and seeded sampling) differs between
running alone and inside the busy batch of all 24.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from launcher.paths import MODEL_DIR
from testkit.fidelity import TOP_K, Verdict, summarize
from testkit.hf_reference import HFReference
from testkit.prompts import MIXED_CASES


def _engine(model_dir: Path, dtype: str, quantization: str, draft_model: str, k: int):
    from backend import EngineConfig, LLMEngine

    return LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype=dtype,
            quantization=quantization,
            draft_model=draft_model,
            num_speculative_tokens=k,
            max_num_batched_tokens=64,
        )
    )


def complete(engine, cases: list[tuple[str, int]], extras: list[dict]) -> list:
    """Run `cases` together through the engine, each with its own extra parameters; the final SampleOutput
    of each, in order."""
    from backend import SamplingParams

    outputs: dict[str, object] = {}
    for i, ((prompt, max_tokens), extra) in enumerate(zip(cases, extras, strict=True)):
        params = SamplingParams.from_dict({"max_tokens": max_tokens, **extra})
        engine.add_request(engine.build_request(f"case-{i}", prompt, params))
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.samples[0]
    return [outputs[f"case-{i}"] for i in range(len(cases))]


def run_engine_check(engine, model_dir: Path, dtype: str, reference: HFReference | None = None) -> list[Verdict]:
    """Our engine (all prompts in one busy batch) against HF `generate` in the same dtype (`reference`, where one
    is loaded already)."""
    cases = MIXED_CASES
    samples = complete(engine, cases, [{"temperature": 0, "logprobs": TOP_K}] * len(cases))
    reference = reference or HFReference(model_dir, dtype)
    verdicts = []
    for i, ((prompt, max_tokens), sample) in enumerate(zip(cases, samples, strict=True)):
        verdict = reference.judge(prompt, sample.token_ids, reference.greedy(prompt, max_tokens), sample.logprobs)
        verdicts.append(verdict)
        if not verdict.identical:
            print(f"  prompt {i}: {'near-tie' if verdict.near_tie else 'VIOLATION'}: {verdict.detail}")
    return verdicts


def batch_invariance(engine) -> dict[str, int]:
    """How many of the 24 completions differ between running alone and inside the busy batch of all 24:
    greedy, and seeded sampling (temperature 0.8, a seed per prompt)."""
    cases = MIXED_CASES
    differ = {}
    for label, extra in (("greedy", {"temperature": 0}), ("seeded", {"temperature": 0.8})):
        extras = [{**extra, "seed": 1000 + i} for i in range(len(cases))]
        busy = [s.token_ids for s in complete(engine, cases, extras)]
        alone = [complete(engine, [case], [e])[0].token_ids for case, e in zip(cases, extras, strict=True)]
        differ[label] = sum(a != b for a, b in zip(alone, busy, strict=True))
    return differ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(MODEL_DIR))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--draft-model", default="")
    parser.add_argument("--num-speculative-tokens", type=int, default=0)
    args = parser.parse_args(argv)
    engine = _engine(Path(args.model), args.dtype, args.quantization, args.draft_model, args.num_speculative_tokens)
    verdicts = run_engine_check(engine, Path(args.model), args.dtype)
    print(f"{args.dtype} quantization={args.quantization}: {summarize(verdicts)}")
    differ = batch_invariance(engine)
    print(
        f"batch invariance (alone vs in the busy batch of {len(MIXED_CASES)}): greedy {differ['greedy']} differ, "
        f"seeded sampling {differ['seeded']} differ"
    )
    return 0 if all(v.near_tie for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
