"""What a verified draft token costs the target: the served model's step for one sequence at 1 to 17 rows (a decode
verifying 0 to 16 drafts), against the one-row step, in the same process and interleaved.

    python -m benchmarks.tools.verify_rows [--model DIR] [--quantization gguf] [--context 256] [--repeats 40]

Speculation gains only what a verified row costs less than a plain step: with per-token acceptance a and a row
costing r one-row steps, a one-token draft pays when a > r. The figure for `spec_row_cost` (draft_model `auto`)
is the table's "extra row" column: (step at n rows / step at 1 row - 1) / (n - 1). Each row is timed in the wall
clock and in the process's CPU time (less disturbed by other work on a shared machine); medians of `--repeats`.
"""

from __future__ import annotations

import argparse
import time

from backend.model.runner import ForwardItem, ModelRunner
from benchmarks.core.common import machine_description, median
from launcher.paths import MODEL_DIR

ROWS = (1, 2, 3, 5, 9, 13, 17)


def step_times(runner: ModelRunner, context: int, repeats: int) -> dict[int, tuple[float, float]]:
    """{rows: (median wall s, median CPU s)} of a step computing `rows` tokens at the end of a `context`-token
    sequence (its KV written once, by a prefill), the row counts taking turns."""
    blocks = -(-(context + max(ROWS)) // runner.block_size)
    table = list(range(blocks))
    runner.forward([ForwardItem([1 + i % 500 for i in range(context)], 0, table, 1)])
    samples: dict[int, list[tuple[float, float]]] = {n: [] for n in ROWS}
    for _ in range(repeats):
        for n in ROWS:
            wall, cpu = time.perf_counter(), time.process_time()
            runner.forward([ForwardItem([7] * n, context, table, n)])
            samples[n].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {n: (median([w for w, _ in s]), median([c for _, c in s])) for n, s in samples.items()}


def table(times: dict[int, tuple[float, float]]) -> list[str]:
    lines = [
        "| rows (drafts verified + 1) | wall ms | vs 1 row | CPU ms | vs 1 row | extra row (wall) | extra row (CPU) |",
        "|---|---|---|---|---|---|---|",
    ]
    one_wall, one_cpu = times[1]
    for n, (wall, cpu) in times.items():
        extra = [f"{(t / one - 1) / (n - 1):.2f}" if n > 1 else "" for t, one in ((wall, one_wall), (cpu, one_cpu))]
        lines.append(
            f"| {n} | {wall * 1e3:.2f} | {wall / one_wall:.2f}x | {cpu * 1e3:.2f} | {cpu / one_cpu:.2f}x | "
            f"{extra[0]} | {extra[1]} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(MODEL_DIR))
    parser.add_argument("--quantization", default="gguf")
    parser.add_argument("--context", type=int, default=256, help="tokens already in the sequence's KV cache")
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    runner = ModelRunner(args.model, "float32", 16, 64, quantization=args.quantization)
    times = step_times(runner, args.context, args.repeats)
    print(f"# {machine_description()}")
    print(f"# {args.model}, quantization {args.quantization}, context {args.context}, {args.repeats} repeats")
    print("\n".join(table(times)))


if __name__ == "__main__":
    main()
