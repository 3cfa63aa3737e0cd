"""How well a trained draft head (`make draft`) agrees with the target on the speculation benchmark's own
workloads, offline: the target's greedy answers to each workload's prompts (through the model runner, with the
features the serving proposer recovers from the logits), then per chain step the fraction of positions where the
head's token is the target's greedy one, the mean accepted length of a k-token chain, and the share of the answers'
tokens that are in the head's draft vocabulary (a token outside it is never drafted).

    python -m benchmarks.tools.draft_agreement --head DIR [--model DIR] [--quantization gguf] [--max-tokens 96]
                                               [--window 16] [--k 4]

It is the measure `make draft` prints for held-out answers to its own prompts, taken on the workloads the engine
serves in the benchmark: a head that agrees there and not here was trained on answers unlike these. The window
(true-feature rows the head attends over) is at most the shortest answer's length.
"""

from __future__ import annotations

import argparse

import torch

from backend.model.runner import ModelRunner
from backend.spec import draft_data, eagle_head
from backend.spec.train_draft import Chunks, acceptance, greedy_targets
from benchmarks.core.common import machine_description
from benchmarks.sections.spec_decode import WORKLOADS
from launcher.paths import MODEL_DIR


def agreement(
    model: str, head_dir: str, max_tokens: int, window: int, k: int, workloads: dict, quantization: str = "gguf"
) -> dict[str, dict]:
    """{workload: {"answers", "tokens", "vocab_share", "window", "by_step", "accepted_length"}}; the target runs
    as `quantization` says (the served configuration's `gguf` by default)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    runner = ModelRunner(model, "float32", 16, 16 * 64, quantization=quantization)
    rows = draft_data.target_head_rows(runner)
    head, recovery_rows, _ = eagle_head.load(head_dir, lambda ids: rows[ids.long()])
    recovery = draft_data.FeatureRecovery(rows[recovery_rows], recovery_rows)
    vocab = set(head.draft_vocab.tolist())
    eos = draft_data.stop_ids(model, tokenizer)
    results = {}
    for name, prompts in workloads.items():
        answers = []
        for first in range(0, len(prompts), 8):  # 8 answers per batch: the runner holds 64 blocks of 16 each
            ids = [draft_data.chat_ids(tokenizer, p) for p in prompts[first : first + 8]]
            answers += [(f, t) for _, f, t in draft_data.generate(runner, recovery, ids, max_tokens, 0.0, eos, 0)]
        tokens = torch.cat([t for _, t in answers]).tolist()
        length = min(window, min(len(t) for _, t in answers) - 1)
        with torch.no_grad():
            by_step, accepted = acceptance(head, greedy_targets(Chunks(answers, length, rows, 0).all(), rows), k)
        results[name] = {
            "answers": len(answers),
            "tokens": len(tokens),
            "vocab_share": sum(t in vocab for t in tokens) / len(tokens),
            "window": length,
            "by_step": by_step,
            "accepted_length": accepted,
        }
    return results


def table(results: dict[str, dict], k: int) -> list[str]:
    lines = [
        f"| workload | answers | tokens | in the draft vocabulary | window | agreement by chain step | accepted length "
        f"(k={k}) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        steps = " / ".join(f"{a:.3f}" for a in r["by_step"])
        lines.append(
            f"| {name} | {r['answers']} | {r['tokens']} | {r['vocab_share']:.1%} | {r['window']} | {steps} | "
            f"{r['accepted_length']:.2f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head", required=True, help="the draft head's folder (make draft's --out)")
    parser.add_argument("--model", default=str(MODEL_DIR))
    parser.add_argument("--quantization", default="gguf", help="how the target runs (the served default: gguf)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(2)
    results = agreement(args.model, args.head, args.max_tokens, args.window, args.k, WORKLOADS, args.quantization)
    print(f"# {machine_description()}")
    print(
        f"# head {args.head}, target {args.model} ({args.quantization}), greedy answers of at most "
        f"{args.max_tokens} tokens"
    )
    print("\n".join(table(results, args.k)))


if __name__ == "__main__":
    main()
