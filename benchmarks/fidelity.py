"""Reduced-precision fidelity: the near-tie rule, and a check of the engine against `transformers` `generate`.

The rule (as vLLM's `check_logprobs_close`, widened as docs/benchmarks.md explains): each greedy completion
is identical to Hugging Face's in the same dtype up to its first differing token, and there the two tokens
are a near-tie: each among the other side's top-5 candidates, and on each side their logits less than
`MAX_LOGIT_GAP` apart. (bf16 logits near 16 are 0.125 apart, and three-way ties occur.)

    python benchmarks/fidelity.py --dtype bfloat16 --quantization int4     # the 24-prompt set, in process

It also measures batch invariance: how often a completion (greedy, and seeded sampling) differs between
running alone and inside the busy batch of all 24.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
TOP_K = 5
MAX_LOGIT_GAP = 1.0


@dataclass
class Verdict:
    identical: bool
    near_tie: bool
    detail: str  # where and how the two differ ("" when identical)


def judge(ours: list[int], reference: list[int], our_top: dict[int, float], ref_logits: torch.Tensor | None
          ) -> Verdict:
    """Compare two greedy completions. `our_top`: our top-k {token: logprob} at the first differing position
    (log-probabilities differ by exactly the logits' difference); `ref_logits`: the reference's logits there."""
    position = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), None)
    if position is None:
        if len(ours) == len(reference):
            return Verdict(True, True, "")
        return Verdict(False, False, f"lengths differ ({len(ours)} vs {len(reference)}) with no differing token")
    mine, theirs = ours[position], reference[position]
    ref_top = torch.topk(ref_logits, TOP_K).indices.tolist()
    ref_gap = float(ref_logits[theirs] - ref_logits[mine])
    our_gap = our_top[mine] - our_top[theirs] if theirs in our_top else float("inf")
    ok = mine in ref_top and theirs in our_top and abs(ref_gap) < MAX_LOGIT_GAP and abs(our_gap) < MAX_LOGIT_GAP
    return Verdict(False, ok, f"token {position}: ours {mine}, reference {theirs}; logit gap reference "
                              f"{ref_gap:.3f}, ours {our_gap:.3f}; ours in reference top-{TOP_K}: {mine in ref_top}, "
                              f"reference in our top-{TOP_K}: {theirs in our_top}")


class HFReference:
    """Hugging Face greedy `generate` (batch 1, no padding) in a given dtype, and its logits at a position."""

    def __init__(self, model_dir: str | Path, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()

    @torch.inference_mode()
    def greedy(self, prompt: str, max_tokens: int) -> list[int]:
        ids = self.tokenizer(prompt, return_tensors="pt").input_ids
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=max_tokens, pad_token_id=self.tokenizer.eos_token_id)
        return out[0, ids.shape[1]:].tolist()

    @torch.inference_mode()
    def next_logits(self, prompt: str, prefix: list[int]) -> torch.Tensor:
        ids = self.tokenizer(prompt).input_ids + prefix
        return self.model(torch.tensor([ids])).logits[0, -1].float()

    def judge(self, prompt: str, ours: list[int], reference: list[int], our_logprobs: list[dict]) -> Verdict:
        """`our_logprobs`: per generated token, {"top_logprobs": {token: logprob}} as the engine returns them."""
        position = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), None)
        if position is None:
            return judge(ours, reference, {}, None)
        top = {int(k): v for k, v in our_logprobs[position]["top_logprobs"].items()}
        return judge(ours, reference, top, self.next_logits(prompt, reference[:position]))


def summarize(verdicts: list[Verdict]) -> str:
    identical = sum(v.identical for v in verdicts)
    ties = sum(v.near_tie and not v.identical for v in verdicts)
    bad = len(verdicts) - identical - ties
    return f"{identical} identical, {ties} near-ties, {bad} violations of {len(verdicts)}"


def _engine(model_dir: Path, dtype: str, quantization: str, draft_model: str, k: int):
    sys.path.insert(0, str(REPO_ROOT))
    from backend import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model=str(model_dir), dtype=dtype, quantization=quantization,
                                  draft_model=draft_model, num_speculative_tokens=k, max_num_batched_tokens=64))


def _cases():
    sys.path.insert(0, str(REPO_ROOT / "tests" / "integration"))
    from llm_testlib import MIXED_CASES

    return MIXED_CASES


def complete(engine, cases: list[tuple[str, int]], extras: list[dict]) -> list:
    """Run `cases` together through the engine, each with its own extra parameters; the final SampleOutput
    of each, in order."""
    from backend import SamplingParams

    outputs: dict[str, object] = {}
    for i, ((prompt, max_tokens), extra) in enumerate(zip(cases, extras)):
        params = SamplingParams.from_dict({"max_tokens": max_tokens, **extra})
        engine.add_request(engine.build_request(f"case-{i}", prompt, params))
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.samples[0]
    return [outputs[f"case-{i}"] for i in range(len(cases))]


def run_engine_check(engine, model_dir: Path, dtype: str) -> list[Verdict]:
    """Our engine (all prompts in one busy batch) against HF `generate` in the same dtype."""
    cases = _cases()
    samples = complete(engine, cases, [{"temperature": 0, "logprobs": TOP_K}] * len(cases))
    reference = HFReference(model_dir, getattr(torch, dtype))
    verdicts = []
    for i, ((prompt, max_tokens), sample) in enumerate(zip(cases, samples)):
        verdict = reference.judge(prompt, sample.token_ids, reference.greedy(prompt, max_tokens), sample.logprobs)
        verdicts.append(verdict)
        if not verdict.identical:
            print(f"  prompt {i}: {'near-tie' if verdict.near_tie else 'VIOLATION'}: {verdict.detail}")
    return verdicts


def batch_invariance(engine) -> dict[str, int]:
    """How many of the 24 completions differ between running alone and inside the busy batch of all 24:
    greedy, and seeded sampling (temperature 0.8, a seed per prompt)."""
    cases = _cases()
    differ = {}
    for label, extra in (("greedy", {"temperature": 0}), ("seeded", {"temperature": 0.8})):
        extras = [{**extra, "seed": 1000 + i} for i in range(len(cases))]
        busy = [s.token_ids for s in complete(engine, cases, extras)]
        alone = [complete(engine, [case], [e])[0].token_ids for case, e in zip(cases, extras)]
        differ[label] = sum(a != b for a, b in zip(alone, busy))
    return differ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO_ROOT / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--draft-model", default="")
    parser.add_argument("--num-speculative-tokens", type=int, default=0)
    args = parser.parse_args(argv)
    engine = _engine(Path(args.model), args.dtype, args.quantization, args.draft_model, args.num_speculative_tokens)
    verdicts = run_engine_check(engine, Path(args.model), args.dtype)
    print(f"{args.dtype} quantization={args.quantization}: {summarize(verdicts)}")
    differ = batch_invariance(engine)
    print(f"batch invariance (alone vs in the busy batch of {len(_cases())}): greedy {differ['greedy']} differ, "
          f"seeded sampling {differ['seeded']} differ")
    return 0 if all(v.near_tie for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
