"""The Locust load test (loadtest/locustfile.py) against the session's server and its OpenAI-compatible front
door: a few seconds headless, one user of each type, then its CSV stats must show successful requests for every
user type and the custom TTFT / ITL rows."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.paths import REPO_ROOT

LOCUSTFILE = REPO_ROOT / "loadtest" / "locustfile.py"

USER_TYPES = ("grpc_stream", "http_stream", "http_generate", "openai_chat", "trtllm_infer")
MODEL_OF = {"trtllm_infer": "tensorrt_llm_bls"}  # TensorRT-LLM's unary model; the others call llm
STREAMING = ("grpc_stream", "http_stream", "openai_chat")


def _read_stats(path: Path) -> dict[tuple[str, str], dict[str, str]]:
    with path.open(newline="") as f:
        return {(row["Type"], row["Name"]): row for row in csv.DictReader(f)}


@pytest.mark.integration
def test_locust_headless_run(server, tmp_path):
    prefix = tmp_path / "run"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt": "The capital of France is", "max_tokens": 4}\n'
        '{"text": "Once upon a time, in a small village by the sea,"}\n'
        '"Write a haiku about autumn leaves."\n'
    )
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "-u",
        "5",
        "-r",
        "5",
        "-t",
        "8s",
        "--stop-timeout",
        "30",
        "--host",
        f"http://{server.http_url}",
        "--grpc-url",
        server.grpc_url,
        "--openai-url",
        server.openai_url,
        "--prompts-file",
        str(prompts),
        "--max-tokens-min",
        "4",
        "--max-tokens-max",
        "8",
        "--throughput-interval",
        "2",
        "--workload-seed",
        "1",
        "--csv",
        str(prefix),
        "--html",
        str(tmp_path / "report.html"),
        "--exit-code-on-error",
        "3",
        "--only-summary",
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"locust exited with {proc.returncode}:\n{output[-6000:]}"

    stats = _read_stats(Path(f"{prefix}_stats.csv"))
    tail = f"\nstats rows: {sorted(stats)}\nlocust output:\n{output[-4000:]}"
    for kind in USER_TYPES:
        row = stats.get((kind, MODEL_OF.get(kind, "llm")))
        assert row is not None, f"no {kind} row{tail}"
        assert int(row["Request Count"]) > 0, f"no {kind} requests{tail}"
        assert int(row["Failure Count"]) == 0, f"{kind} failures{tail}"
        # response_length carries the output tokens: at least --max-tokens-min per request on average.
        assert float(row["Average Content Size"]) >= 4, f"{kind}: output tokens not recorded{tail}"
    for kind in STREAMING:
        for metric in ("TTFT", "ITL"):
            row = stats.get((metric, kind))
            assert row is not None and int(row["Request Count"]) > 0, f"no {metric} row for {kind}{tail}"
            assert float(row["Median Response Time"]) > 0, f"{metric} {kind} is zero{tail}"
        # TTFT comes before the whole answer.
        assert float(stats[("TTFT", kind)]["Average Response Time"]) <= float(
            stats[(kind, "llm")]["Average Response Time"]
        ), tail
    for unary in ("http_generate", "trtllm_infer"):
        assert ("ITL", unary) not in stats and ("TTFT", unary) not in stats
    assert any(t == "THROUGHPUT" for t, _ in stats), f"no THROUGHPUT rows{tail}"

    assert not [r for r in csv.DictReader(Path(f"{prefix}_failures.csv").open())], tail
    with Path(f"{prefix}_llm_summary.csv").open(newline="") as f:
        summary = {row["type"]: row for row in csv.DictReader(f)}
    assert float(summary["total"]["output_tokens_per_s"]) > 0, summary
    assert float(summary["total"]["requests_per_s"]) > 0, summary
    assert "TTFT" in (tmp_path / "report.html").read_text(), "custom rows missing from the HTML report"

    # Every request the run left behind (cut off at the time limit) was finished or cancelled on the server.
    m = server.wait_idle(timeout_s=60)
    assert m.get("llm_requests_running") == 0 and m.get("llm_kv_cache_blocks_used") == 0, server.log_tail()


# ---------------------------------------------------------------------------- the workload (no server needed)


def test_workload_files_and_distributions(tmp_path):
    import random

    from loadtest.workload import LengthDistribution, Workload, load_prompts

    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a", "max_tokens": 5}\n\n{"text": "b"}\n"c"\n')
    assert [(s.prompt, s.max_tokens) for s in load_prompts(jsonl)] == [("a", 5), ("b", None), ("c", None)]
    txt = tmp_path / "p.txt"
    txt.write_text("first\n\nsecond\\nline\n")
    assert [s.prompt for s in load_prompts(txt)] == ["first", "second\nline"]
    js = tmp_path / "p.json"
    js.write_text('{"data": [{"text_input": "x", "output_tokens": 3}]}')
    assert [(s.prompt, s.max_tokens) for s in load_prompts(js)] == [("x", 3)]
    (tmp_path / "bad.jsonl").write_text('{"nope": 1}\n')
    with pytest.raises(ValueError):
        load_prompts(tmp_path / "bad.jsonl")

    rng = random.Random(0)
    for spec in ("uniform", "fixed:7", "normal:20,5", "lognormal:20,0.5", "exponential:20", "choice:4,9"):
        values = [LengthDistribution(spec, 4, 30).draw(rng) for _ in range(200)]
        assert all(4 <= v <= 30 for v in values), spec
    assert {LengthDistribution("choice:4,9", 1, 100).draw(rng) for _ in range(50)} == {4, 9}
    assert LengthDistribution("fixed:500", 1, 64).draw(rng) == 64  # clamped
    for bad in ("normal:1", "zipf:2", "uniform:a,b"):
        with pytest.raises(ValueError):
            LengthDistribution(bad, 1, 10)

    w = Workload.from_options(prompts_file=str(jsonl), dist="fixed:9", low=1, high=64)
    drawn = {(s.prompt, s.max_tokens) for s in (w.draw(rng) for _ in range(100))}
    assert drawn == {("a", 5), ("b", 9), ("c", 9)}
    w = Workload.from_options(input_words="fixed:12", num_synthetic=5, dist="uniform", low=2, high=3)
    assert len(w.samples) == 5 and all(len(s.prompt.split()) == 12 + 3 for s in w.samples)  # + "Continue the text:"
