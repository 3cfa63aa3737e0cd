"""lm-evaluation-harness through the OpenAI front door vs. in process: the same task, the same loglikelihoods.

    python -m benchmarks.lm_eval.run                  # both runs + the comparison (needs `make serve`)
    python -m benchmarks.lm_eval.run --skip-served    # only the in-process run (no server needed)
    python -m benchmarks.lm_eval.run --compare-only   # re-compare the last two runs' sample logs

1. lm-eval's `hf` model scores the task `qa20` (tasks/qa20.yaml: 20 questions of our own, 72 (question,
   choice) loglikelihood requests) in process on models/smollm2-135m-instruct, float32, CPU, batch 1.
2. lm-eval's `local-completions` model scores the same task through the front door's /v1/completions, with
   the same Hugging Face tokenizer and `tokenized_requests=True`: each request is one POST of token ids
   (lm_eval/models/openai_completions.py, LocalCompletionsAPI._create_payload, loglikelihood branch):

       {"model": "llm", "prompt": [[<context + continuation token ids>]], "temperature": 0,
        "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": true}

   and it reads only (LocalCompletionsAPI.parse_logprobs), with ctxlen = the number of context tokens:

       choices sorted by "index"; for each: sum(choice["logprobs"]["token_logprobs"][ctxlen:-1]) and, for
       is_greedy, choice["logprobs"]["top_logprobs"][ctxlen:-1] (a dict per position; greedy when the
       token's logprob equals max(top.values()))

   so the answer must echo the prompt's tokens (the first one's logprob null) *followed by the one generated
   token*: the slice's `-1` drops the last entry, which must be that generated token, not the prompt's last.
3. The two runs' sample logs are compared request by request: |Δ loglikelihood| within --atol (float32 on
   both sides over the same weights), and the same accuracy. Writes results.md and results.json beside this
   file; exits 1 when the check fails, 2 when a run fails.

lm-eval runs from its own virtual environment (.venv-lmeval, `make lm-eval-venv`; pins in requirements.txt
beside this file), offline (HF_DATASETS_OFFLINE=1, HF_HUB_OFFLINE=1): the task's data is the JSONL here.
It needs only the standard library; run it from the repository root, where the package `benchmarks` is.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from benchmarks.lm_eval.comparison import RUNS_DIR, compare, load_run
from benchmarks.lm_eval.record import HERE, REPO_ROOT, TASK, venv_versions, write_record

DEFAULT_MODEL = "models/smollm2-135m-instruct"
DEFAULT_BASE_URL = "http://127.0.0.1:9000/v1/completions"
DEFAULT_LM_EVAL = REPO_ROOT / ".venv-lmeval" / "bin" / "lm-eval"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="HF model folder (also the served model's tokenizer)")
    p.add_argument("--base-url", default=DEFAULT_BASE_URL, help="the front door's /v1/completions URL")
    p.add_argument("--served-model", default="llm", help="the `model` field sent to the front door")
    p.add_argument("--lm-eval", default=str(DEFAULT_LM_EVAL), help="lm-eval executable (of .venv-lmeval)")
    p.add_argument("--atol", type=float, default=2e-3, help="largest allowed |Δ loglikelihood| per request")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="OMP/torch threads of the in-process run (default 1: the machine is shared); 0: torch's",
    )
    p.add_argument("--max-retries", type=int, default=2, help="lm-eval's retries per request to the server")
    p.add_argument("--timeout", type=int, default=120, help="seconds per request to the server")
    p.add_argument("--limit", type=int, default=None, help="only the first N questions (a quick try)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--skip-served", action="store_true", help="only the in-process run; no comparison")
    mode.add_argument("--skip-hf", action="store_true", help="reuse the last in-process run's samples")
    mode.add_argument("--compare-only", action="store_true", help="run nothing; compare the last two runs")
    return p.parse_args()


# --- running lm-eval ----------------------------------------------------------------------------------------


def api_key() -> str:
    """The front door's key (make serve API_KEY=... / LLM_API_KEY); lm-eval sends OPENAI_API_KEY as a bearer."""
    return os.environ.get("OPENAI_API_KEY") or os.environ.get("LLM_API_KEY", "")


def lm_eval_env(threads: int) -> dict[str, str]:
    env = dict(
        os.environ,
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    if api_key():
        env["OPENAI_API_KEY"] = api_key()
    if threads > 0:
        env["OMP_NUM_THREADS"] = str(threads)
        env["MKL_NUM_THREADS"] = str(threads)
    return env


def run_lm_eval(args: argparse.Namespace, side: str, model: str, model_args: str) -> dict:
    """One `lm-eval run` into runs/<side>/ (emptied first); its log in runs/<side>.log."""
    out = RUNS_DIR / side
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [
        args.lm_eval,
        "run",
        "--model",
        model,
        "--model_args",
        model_args,
        "--tasks",
        TASK,
        "--include_path",
        str(HERE / "tasks"),
        "--batch_size",
        "1",
        "--log_samples",
        "--output_path",
        str(out),
    ]
    if model == "hf":
        cmd += ["--device", "cpu"]
    if args.limit:
        cmd += ["--limit", str(args.limit)]
    log_path = RUNS_DIR / f"{side}.log"
    print(f"[{side}] {' '.join(cmd)}", flush=True)
    start = time.monotonic()
    with open(log_path, "w") as log:
        # cwd = the repository root: the task's data_files and the model path are relative to it.
        proc = subprocess.run(
            cmd,
            cwd=REPO_ROOT,
            env=lm_eval_env(args.threads if model == "hf" else 1),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    seconds = time.monotonic() - start
    text = log_path.read_text(errors="replace")
    run = {
        "side": side,
        "model": model,
        "model_args": model_args,
        "command": cmd,
        "rc": proc.returncode,
        "seconds": round(seconds, 1),
        "log": str(log_path.relative_to(REPO_ROOT)),
    }
    if proc.returncode != 0:
        run["error"] = failure_summary(text)
        print(f"[{side}] lm-eval failed (rc {proc.returncode}, log {log_path}):\n  {run['error']}", flush=True)
        return run
    print(f"[{side}] done in {seconds:.1f} s", flush=True)
    return run


def failure_summary(log_text: str) -> str:
    """The server's answer when a request failed (lm-eval logs it before retrying), else the log's last line."""
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    for marker in ("API request failed with error message:", "API request failed!"):
        hits = [line for line in lines if marker in line]
        if hits:
            return hits[-1][hits[-1].index(marker) :][:2000]
    return lines[-1][:2000] if lines else "(empty log)"


def server_root(base_url: str) -> str:
    parts = urllib.parse.urlsplit(base_url)
    return f"{parts.scheme}://{parts.netloc}"


def get_json(url: str, timeout: float = 5.0):
    headers = {"Authorization": f"Bearer {api_key()}"} if api_key() else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as response:
        body = response.read()
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        return body.decode(errors="replace")


def check_server(base_url: str) -> tuple[bool, str, object]:
    root = server_root(base_url)
    try:
        get_json(root + "/health")
    except (urllib.error.URLError, OSError) as e:
        return False, f"no server answers {root}/health ({e}); start it with `make serve`", None
    try:
        models = get_json(root + "/v1/models")
    except (urllib.error.URLError, OSError):
        models = None
    return True, "", models


def main() -> int:
    args = parse_args()
    if not args.compare_only and not Path(args.lm_eval).exists():
        print(f"error: {args.lm_eval} not found; build it with `make lm-eval-venv`", file=sys.stderr)
        return 2
    if not args.compare_only and not (REPO_ROOT / args.model / "config.json").exists():
        print(f"error: no model at {args.model}; prepare it with `make model`", file=sys.stderr)
        return 2
    versions = venv_versions(args.lm_eval)
    hf_model_args = f"pretrained={args.model},dtype=float32"
    served_model_args = (
        f"model={args.served_model},base_url={args.base_url},tokenizer_backend=huggingface,"
        f"tokenizer={args.model},tokenized_requests=True,num_concurrent=1,"
        f"max_retries={args.max_retries},timeout={args.timeout}"
    )
    hf_run = served_run = None
    failed = False
    models = None
    if not (args.skip_hf or args.compare_only):
        hf_run = run_lm_eval(args, "hf", "hf", hf_model_args)
        failed |= hf_run["rc"] != 0
    if not (args.skip_served or args.compare_only or failed):
        up, why, models = check_server(args.base_url)
        if up:
            served_run = run_lm_eval(args, "served", "local-completions", served_model_args)
        else:
            served_run = {"side": "served", "model_args": served_model_args, "rc": None, "error": why}
            print(f"[served] {why}", flush=True)
        failed |= served_run["rc"] != 0
    hf = served = comparison = None
    try:
        hf = load_run("hf") if not (hf_run and hf_run["rc"] != 0) else None
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        failed = True
    if not args.skip_served and not failed:
        try:
            served = load_run("served")
        except FileNotFoundError as e:
            print(f"error: {e}", file=sys.stderr)
            failed = True
    if hf and served:
        comparison = compare(hf, served, args.atol)
    write_record(args, versions, hf, served, served_run, hf_run, comparison, models)
    if hf:
        print(f"in process: acc {hf['acc']}")
    if comparison:
        print(
            f"served: acc {served['acc']}; max |Δ loglikelihood| {comparison['max_abs_delta']:.3g} "
            f"(tolerance {args.atol:g}): {'PASSED' if comparison['passed'] else 'FAILED'}"
        )
        for problem in comparison["problems"][:20]:
            print(f"  {problem}")
    if failed:
        return 2
    if comparison and not comparison["passed"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
