"""The two lm-eval runs' outputs and their comparison: accuracy and per-request loglikelihoods read from a run's
results and sample logs under runs/<side>/, and the in-process run against the served one request by request.
Standard library only (run.py imports it in lm-eval's own environment)."""

from __future__ import annotations

import glob
import json
import math
from pathlib import Path

from benchmarks.lm_eval.record import HERE, REPO_ROOT, TASK

RUNS_DIR = HERE / "runs"  # lm-eval's outputs (results_*.json, samples_*.jsonl); not kept in git
TIGHT = 1e-4  # what float32 against float32 over identical weights should reach; reported, not enforced


def load_run(side: str) -> dict:
    """accuracy and per-request loglikelihoods from runs/<side>/ (the newest results/samples files)."""
    out = RUNS_DIR / side
    results_files = sorted(glob.glob(str(out / "**" / "results_*.json"), recursive=True))
    samples_files = sorted(glob.glob(str(out / "**" / f"samples_{TASK}_*.jsonl"), recursive=True))
    if not results_files or not samples_files:
        raise FileNotFoundError(f"no lm-eval results/samples under {out}: run that side first")
    results = json.loads(Path(results_files[-1]).read_text())
    docs = {}
    with open(samples_files[-1]) as f:
        for line in f:
            sample = json.loads(line)
            requests = [
                (a["arg_0"], a["arg_1"])
                for _, a in sorted(sample["arguments"].items(), key=lambda kv: int(kv[0].rsplit("_", 1)[1]))
            ]
            # resps: one [[loglikelihood, is_greedy]] per request (lm-eval writes them as strings)
            resps = [r[0] for r in sample["resps"]]
            docs[sample["doc_id"]] = {
                "doc": sample["doc"],
                "target": int(sample["target"]),
                "requests": requests,
                "loglikelihoods": [float(r[0]) for r in resps],
                "is_greedy": [str(r[1]) == "True" for r in resps],
                "acc": float(sample["acc"]),
            }
    return {
        "acc": results["results"][TASK]["acc,none"],
        "n_docs": len(docs),
        "docs": docs,
        "results_file": str(Path(results_files[-1]).relative_to(REPO_ROOT)),
        "samples_file": str(Path(samples_files[-1]).relative_to(REPO_ROOT)),
        "config": results.get("config", {}),
    }


def compare(hf: dict, served: dict, atol: float) -> dict:
    problems, items = [], []
    if sorted(hf["docs"]) != sorted(served["docs"]):
        problems.append(f"different documents: {sorted(hf['docs'])} vs {sorted(served['docs'])}")
    max_abs, max_rel, n, tight = 0.0, 0.0, 0, 0
    for doc_id in sorted(set(hf["docs"]) & set(served["docs"])):
        a, b = hf["docs"][doc_id], served["docs"][doc_id]
        if a["requests"] != b["requests"]:
            problems.append(f"doc {doc_id}: the two runs scored different (context, continuation) pairs")
            continue
        pred_a = max(range(len(a["loglikelihoods"])), key=a["loglikelihoods"].__getitem__)
        pred_b = max(range(len(b["loglikelihoods"])), key=b["loglikelihoods"].__getitem__)
        if pred_a != pred_b:
            problems.append(f"doc {doc_id}: predicted choice {pred_a} in process, {pred_b} served")
        for i, ((_context, continuation), la, lb) in enumerate(
            zip(a["requests"], a["loglikelihoods"], b["loglikelihoods"])
        ):
            delta = lb - la
            ok = math.isfinite(delta) and abs(delta) <= atol
            n += 1
            tight += abs(delta) <= TIGHT
            max_abs = max(max_abs, abs(delta)) if math.isfinite(delta) else math.inf
            max_rel = max(max_rel, abs(delta) / max(abs(la), 1e-12)) if math.isfinite(delta) else math.inf
            if not ok:
                problems.append(f"doc {doc_id} choice {i}: |Δ| = {abs(delta):.3g} > {atol:g}")
            items.append(
                {
                    "doc_id": doc_id,
                    "item": a["doc"].get("id", doc_id),
                    "question": a["doc"]["question"],
                    "choice": i,
                    "continuation": continuation,
                    "gold": i == a["target"],
                    "hf_loglikelihood": la,
                    "served_loglikelihood": lb,
                    "delta": delta,
                    "hf_is_greedy": a["is_greedy"][i],
                    "served_is_greedy": b["is_greedy"][i],
                    "hf_pred": i == pred_a,
                    "served_pred": i == pred_b,
                    "within": ok,
                }
            )
    if hf["acc"] != served["acc"]:
        problems.append(f"accuracy differs: {hf['acc']} in process, {served['acc']} served")
    return {
        "n_requests": n,
        "max_abs_delta": max_abs,
        "max_rel_delta": max_rel,
        "atol": atol,
        "within_tight": tight,
        "tight": TIGHT,
        "acc_equal": hf["acc"] == served["acc"],
        "passed": not problems,
        "problems": problems,
        "items": items,
    }
