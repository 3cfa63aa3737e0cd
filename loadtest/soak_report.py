"""What a soak run showed (loadtest/soak.py): requests and failures by type, intended cancellations, memory
(RSS) of the server's processes over the run, KV blocks settling to 0, TTFT per minute; the plot and the markdown
report."""

from __future__ import annotations

from pathlib import Path

from launcher.paths import REPO_ROOT
from loadtest.soak_recording import KV_METRIC, Recorder
from loadtest.throughput import THROUGHPUT_TYPE
from testkit.stats import percentile

CANCEL_TYPES = ("grpc_cancel", "http_drop", "openai_drop")  # the requests the leaving users meant to cut short
WARMUP_S = 60.0  # memory is compared from the end of the first minute


def analyse(rec: Recorder, duration_s: float, settled: dict) -> dict:
    e2e = [r for r in rec.requests if r["type"] not in ("TTFT", "ITL", THROUGHPUT_TYPE)]
    failures = [r for r in e2e if r["error"] is not None]
    cancels = [r for r in e2e if r["type"] in CANCEL_TYPES and r["error"] is None]
    by_type: dict[str, int] = {}
    for r in e2e:
        by_type[r["type"]] = by_type.get(r["type"], 0) + 1
    minutes = []
    for m in range(int(duration_s // 60 + (duration_s % 60 > 1))):
        ttft = [r["ms"] for r in rec.requests if r["type"] == "TTFT" and m * 60 <= r["t"] < (m + 1) * 60]
        done = [r for r in e2e if m * 60 <= r["t"] < (m + 1) * 60]
        rss = [s["rss_mb"] for s in rec.samples if m * 60 <= s["t"] < (m + 1) * 60]
        minutes.append(
            {
                "minute": m + 1,
                "requests": len(done),
                "ttft_p50_ms": percentile(ttft, 50),
                "ttft_p99_ms": percentile(ttft, 99),
                "rss_mb_max": max(rss, default=float("nan")),
            }
        )
    warm = [s for s in rec.samples if s["t"] >= WARMUP_S]
    growth = (warm[-1]["rss_mb"] - warm[0]["rss_mb"]) / warm[0]["rss_mb"] * 100 if len(warm) > 1 else float("nan")
    return {
        "duration_s": round(duration_s, 1),
        "requests": len(e2e),
        "by_type": by_type,
        "intended_cancellations": len(cancels),
        "failures": len(failures),
        "failure_examples": sorted({r["error"] for r in failures})[:10],
        "rss_mb_start": rec.samples[0]["rss_mb"] if rec.samples else None,
        "rss_mb_after_warmup": warm[0]["rss_mb"] if warm else None,
        "rss_mb_end": rec.samples[-1]["rss_mb"] if rec.samples else None,
        "rss_growth_after_warmup_pct": round(growth, 2),
        "minutes": minutes,
        "settled": settled,
    }


def plot(rec: Recorder, summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    t = [s["t"] / 60 for s in rec.samples]
    ax1.plot(t, [s["rss_mb"] for s in rec.samples], label="server RSS (MiB, tritonserver + stubs + front door)")
    ax1.axvline(WARMUP_S / 60, color="grey", linestyle=":", label="end of warm-up")
    ax1.set_ylabel("MiB")
    kv = ax1.twinx()
    kv.plot(t, [s["kv_blocks_used"] for s in rec.samples], color="tab:orange", alpha=0.5, label=KV_METRIC)
    kv.set_ylabel("KV blocks used")
    ax1.legend(loc="upper left")
    kv.legend(loc="lower right")
    mids = [m["minute"] - 0.5 for m in summary["minutes"]]
    ax2.plot(mids, [m["ttft_p50_ms"] for m in summary["minutes"]], marker="o", label="TTFT p50")
    ax2.plot(mids, [m["ttft_p99_ms"] for m in summary["minutes"]], marker="o", label="TTFT p99")
    ax2.set_ylabel("ms")
    ax2.set_xlabel("minutes")
    ax2.legend()
    fig.suptitle(
        f"soak: {summary['requests']} requests, {summary['failures']} unintended failures, "
        f"RSS growth after warm-up {summary['rss_growth_after_warmup_pct']:.2f} %"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _shown_path(path: str) -> str:
    """A path relative to the repository when it is inside it (reports are committed)."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(REPO_ROOT)) if resolved.is_relative_to(REPO_ROOT) else resolved.name


def _mb(value) -> str:
    return "-" if value is None else f"{value:.0f}"


def report_text(summary: dict, args, classes, png: Path) -> str:
    s = summary
    lines = [
        f"# Soak: {args.minutes:g} minutes, {args.users} users",
        "",
        f"Mix: `{args.mix}`; model `{args.model}` from `{_shown_path(args.model_repository)}`; max_tokens uniform in "
        f"[{args.max_tokens_min}, {args.max_tokens_max}] with ignore_eos; cancelling users stop after 3 responses.",
        "",
        "| | result |",
        "|---|---|",
        f"| duration | {s['duration_s']:.0f} s |",
        f"| requests (finished or cancelled) | {s['requests']} "
        f"({', '.join(f'{k} {v}' for k, v in sorted(s['by_type'].items()))}) |",
        f"| intended cancellations | {s['intended_cancellations']} |",
        f"| unintended failures | {s['failures']} |",
        f"| server RSS start / after warm-up ({WARMUP_S:.0f} s) / end | {_mb(s['rss_mb_start'])} / "
        f"{_mb(s['rss_mb_after_warmup'])} / {_mb(s['rss_mb_end'])} MiB |",
        f"| RSS growth after warm-up | {s['rss_growth_after_warmup_pct']:.2f} % |",
        f"| `{KV_METRIC}` at the end | {s['settled']['kv_blocks_used']:.0f} (running {s['settled']['running']:.0f}, "
        f"waiting {s['settled']['waiting']:.0f}; {s['settled']['after_s']:.1f} s after the users stopped) |",
        "",
        "| minute | requests | TTFT p50 (ms) | TTFT p99 (ms) | RSS max (MiB) |",
        "|---|---|---|---|---|",
    ]
    for m in s["minutes"]:
        lines.append(
            f"| {m['minute']} | {m['requests']} | {m['ttft_p50_ms']:.0f} | {m['ttft_p99_ms']:.0f} | "
            f"{m['rss_mb_max']:.0f} |"
        )
    if s["failure_examples"]:
        lines += ["", "Failures (distinct messages):", ""] + [f"- `{e}`" for e in s["failure_examples"]]
    lines += ["", f"![RSS, KV blocks and TTFT over time]({png.name})", ""]
    return "\n".join(lines)
