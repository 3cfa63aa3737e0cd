"""The record of an lm-eval comparison: versions of lm-eval's environment, the machine, the git revision, and
results.md / results.json beside this file. Standard library only (run.py imports it in lm-eval's own environment)."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
TASK = "qa20"
VERSION_PACKAGES = ["lm_eval", "torch", "transformers", "tokenizers", "datasets", "numpy"]


def venv_versions(lm_eval: str) -> dict:
    python = Path(lm_eval).parent / "python"
    code = (
        "import importlib.metadata as m, json, platform, sys\n"
        f"v = {{p: m.version(p) for p in {VERSION_PACKAGES!r}}}\n"
        "v['python'] = platform.python_version()\nprint(json.dumps(v))"
    )
    try:
        return json.loads(
            subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout
        )
    except (OSError, subprocess.SubprocessError, json.JSONDecodeError) as e:
        return {"error": str(e)}


def machine() -> dict:
    info = {"cores": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and "cpu_model" not in info:
                info["cpu_model"] = value.strip()
            elif key == "flags" and "cpu_flags" not in info:
                info["cpu_flags"] = value.split()
    except OSError:
        pass
    return info


def git_revision() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
        return rev + ("+uncommitted changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def model_args(run: dict | None, loaded: dict | None) -> str:
    """The model_args of a run made now, else those recorded in its results file."""
    if run:
        return run["model_args"]
    recorded = (loaded or {}).get("config", {}).get("model_args")
    if isinstance(recorded, dict):
        return ",".join(f"{k}={v}" for k, v in recorded.items())
    return str(recorded) if recorded else "(not run)"


def n_requests(run: dict | None) -> str:
    return str(sum(len(d["requests"]) for d in run["docs"].values())) if run else ""


def mark(pred: bool) -> str:
    return " ◀" if pred else ""


def question(item: dict) -> str:
    """The question on an item's first row only."""
    return item["question"].replace("|", "\\|") if item["choice"] == 0 else ""


def fmt(x: float) -> str:
    return "n/a" if x is None else f"{x:.6f}"


def write_record(args, versions, hf, served, served_run, hf_run, comparison, models) -> None:
    mach = machine()
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    record = {
        "date": now,
        "git": git_revision(),
        "task": TASK,
        "versions": versions,
        "machine": mach,
        "settings": {
            "model": args.model,
            "base_url": args.base_url,
            "served_model": args.served_model,
            "atol": args.atol,
            "threads_in_process": args.threads,
            "limit": args.limit,
        },
        "hf": {
            "acc": hf and hf["acc"],
            "n_docs": hf and hf["n_docs"],
            "run": hf_run,
            "samples_file": hf and hf["samples_file"],
        },
        "served": {
            "acc": served and served["acc"],
            "n_docs": served and served["n_docs"],
            "run": served_run,
            "samples_file": served and served["samples_file"],
            "v1_models": models,
        },
        "comparison": comparison and {k: v for k, v in comparison.items() if k != "items"},
        "items": comparison["items"]
        if comparison
        else [
            {
                "doc_id": d,
                "item": doc["doc"].get("id", d),
                "question": doc["doc"]["question"],
                "choice": i,
                "continuation": req[1],
                "gold": i == doc["target"],
                "hf_loglikelihood": ll,
                "hf_pred": ll == max(doc["loglikelihoods"]),
            }
            for d, doc in sorted((hf or {"docs": {}})["docs"].items())
            for i, (req, ll) in enumerate(zip(doc["requests"], doc["loglikelihoods"]))
        ],
    }
    record["passed"] = bool(comparison and comparison["passed"])
    (HERE / "results.json").write_text(json.dumps(record, indent=1) + "\n")

    v = versions
    lines = [
        f"# lm-eval: in process (`hf`) vs. the front door (`local-completions`), task `{TASK}`",
        "",
        f"Written by `python -m benchmarks.lm_eval.run` on {now} (repository {record['git']}); "
        "the data behind it is in [results.json](results.json).",
        "",
        f"- lm-eval {v.get('lm_eval')}, torch {v.get('torch')}, transformers {v.get('transformers')}, "
        f"tokenizers {v.get('tokenizers')}, datasets {v.get('datasets')}, Python {v.get('python')} "
        "(`.venv-lmeval`)",
        f"- CPU: {mach.get('cpu_model', '?')}, {mach.get('cores')} cores; flags: "
        + " ".join(f for f in mach.get("cpu_flags", []) if f.startswith(("avx", "fma", "f16c", "amx"))),
        f"- in process: `hf`, `{model_args(hf_run, hf)}`, batch 1, CPU",
        f"- served: `local-completions`, `{model_args(served_run, served)}`",
        "",
        "| | accuracy | requests |",
        "|---|---|---|",
        f"| in process (`hf`) | {hf['acc'] if hf else 'not run'} | {n_requests(hf)} |",
        f"| served (`local-completions`) | {served['acc'] if served else 'not run'} | {n_requests(served)} |",
        "",
    ]
    if served_run and served_run.get("error"):
        lines += [f"**The served run failed** (lm-eval rc {served_run['rc']}): `{served_run['error']}`", ""]
    if comparison:
        verdict = "PASSED" if comparison["passed"] else "FAILED"
        lines += [
            f"**Check {verdict}**: max |Δ loglikelihood| = {comparison['max_abs_delta']:.3g} "
            f"(tolerance {comparison['atol']:g}; {comparison['within_tight']} of {comparison['n_requests']} "
            f"requests within {comparison['tight']:g}; max relative {comparison['max_rel_delta']:.3g}); "
            f"accuracies {'equal' if comparison['acc_equal'] else 'DIFFERENT'}.",
            "",
        ]
        lines += [f"- {p}" for p in comparison["problems"][:20]] + ([""] if comparison["problems"] else [])
        lines += ["| item | question | choice | gold | in process | served | Δ |", "|---|---|---|---|---|---|---|"]
        for it in comparison["items"]:
            lines.append(
                f"| {it['item']} | {question(it)} | {it['continuation'].strip()} | "
                f"{'✓' if it['gold'] else ''} | {fmt(it['hf_loglikelihood'])}{mark(it['hf_pred'])} | "
                f"{fmt(it['served_loglikelihood'])}{mark(it['served_pred'])} | {it['delta']:+.2e} |"
            )
    elif hf:
        lines += ["| item | question | choice | gold | in process |", "|---|---|---|---|---|"]
        for it in record["items"]:
            lines.append(
                f"| {it['item']} | {question(it)} | {it['continuation'].strip()} | "
                f"{'✓' if it['gold'] else ''} | {fmt(it['hf_loglikelihood'])}{mark(it['hf_pred'])} |"
            )
    if hf:
        lines += [
            "",
            'Each row: the loglikelihood of " <choice>" after "Question: <question>\\nAnswer:". '
            "◀: the item's highest (the model's answer); acc counts the items whose ◀ is on ✓.",
        ]
    (HERE / "results.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {HERE / 'results.md'} and results.json", flush=True)
