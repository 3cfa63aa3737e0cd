"""Multi-LoRA benchmark: output tokens/s of concurrent greedy streams on the base model against the same streams
spread over several LoRA adapters (made by PEFT at start: random A and B, the given rank on every projection),
in one process and one engine (the served configuration, LoRA on), the two workloads taking turns run by run so
each ratio compares numbers taken at the same time on a noisy machine; medians over the runs.

    python benchmarks/tools/lora_streams.py [--model DIR] [--streams 32] [--adapters 4] [--rank 16] [--runs 3]
                                      [--max-tokens 64] [--set KEY=VALUE]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from backend import EngineConfig, LLMEngine
from benchmarks.core.common import PROMPTS, machine_description, median, run_engine_requests
from launcher.model_config import read_parameters
from launcher.paths import MODEL_DIR

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(MODEL_DIR))
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an engine parameter over them")
    args = ap.parse_args(argv)
    from testkit.lora_adapters import make_adapter

    with tempfile.TemporaryDirectory() as folder:
        names = [f"adapter{i}" for i in range(args.adapters)]
        for i, name in enumerate(names):
            make_adapter(args.model, Path(folder) / name, rank=args.rank, targets=TARGETS, seed=i, b_scale=1.0)
        listing = Path(folder) / "multi_lora.json"
        listing.write_text(json.dumps({name: name for name in names}))
        parameters = {
            **read_parameters(),
            "model": args.model,
            "enable_lora": "true",
            "lora_modules": str(listing),
            "max_loras": str(args.adapters),
            "max_lora_rank": str(args.rank),
            "max_num_seqs": str(max(args.streams, 1)),
            **dict(item.split("=", 1) for item in args.set),
        }
        engine = LLMEngine(EngineConfig.from_parameters(parameters))
        requests = [(PROMPTS[i % len(PROMPTS)], args.max_tokens) for i in range(2 * args.streams)]
        run_engine_requests(engine, requests[:4], GREEDY, 4, names)  # warm-up
        rates: dict[str, list[float]] = {"base": [], "adapters": []}
        for _ in range(args.runs):
            for label, lora in (("base", (None,)), ("adapters", names)):
                result = run_engine_requests(engine, requests, GREEDY, args.streams, lora)
                rates[label].append(result.tokens_per_s)
    base, adapted = median(rates["base"]), median(rates["adapters"])
    print(machine_description())
    print(f"{args.runs} runs, {len(requests)} requests x {args.max_tokens} tokens each, {args.streams} in flight")
    print(
        f"| streams | base model tok/s | {args.adapters} adapters (rank {args.rank}, every projection) tok/s | ratio |"
    )
    print("|---|---|---|---|")
    print(f"| {args.streams} | {base:.1f} | {adapted:.1f} | {adapted / base:.2f}x |")
    print("runs:", json.dumps(rates))


if __name__ == "__main__":
    main()
