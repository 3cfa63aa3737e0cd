"""testkit/: the one percentile, the one Prometheus parser, the fidelity helpers and the one Hugging Face reference."""

from __future__ import annotations

import ast
import http.server
import json
import math
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from launcher.paths import REPO_ROOT
from testkit import prometheus
from testkit.concurrency import raise_first_error, run_concurrently
from testkit.fidelity import first_difference, first_mismatch, judge, summarize
from testkit.stats import percentile

# ------------------------------------------------------------------------------------------------ percentile


@pytest.mark.parametrize(
    "values",
    [
        [1.0],
        [3.0, 1.0],
        [5, 1, 4, 2, 3],
        [0.5, 10.0, 10.0, 2.5, -1.0, 7.25, 3.0],
        list(np.random.default_rng(0).exponential(size=101)),
    ],
)
@pytest.mark.parametrize("q", [0, 1, 25, 50, 75, 90, 99, 99.9, 100])
def test_percentile_is_numpys_linear_method(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q, method="linear")), abs=1e-12)


def test_percentile_by_hand():
    assert percentile([1, 2, 3, 4], 50) == 2.5  # between the closest ranks, not the nearest rank
    assert percentile([1, 2, 3, 4], 0) == 1 and percentile([1, 2, 3, 4], 100) == 4
    assert percentile([10, 20], 99) == pytest.approx(19.9)
    assert percentile([4, 1, 3, 2], 25) == pytest.approx(1.75)  # unsorted input
    assert percentile((x for x in [2.0, 1.0]), 50) == 1.5  # any iterable
    assert percentile([7.0], 99) == 7.0
    assert percentile([1.0, math.inf], 100) == math.inf and percentile([1.0, math.inf], 0) == 1.0


def test_percentile_of_nothing_is_nan_and_q_is_checked():
    assert math.isnan(percentile([], 50))
    for q in (-1, 100.5):
        with pytest.raises(ValueError):
            percentile([1.0], q)


# ------------------------------------------------------------------------------------------------ prometheus

EXPOSITION = """\
# HELP llm_requests_running Requests running.
# TYPE llm_requests_running gauge
llm_requests_running{model="llm",version="1"} 3
llm_requests_running{model="llm_default",version="1"} 0
# TYPE llm_step_num_sequences histogram
llm_step_num_sequences_bucket{model="llm",version="1",le="1"} 4
llm_step_num_sequences_bucket{model="llm",version="1",le="+Inf"} 9
llm_step_num_sequences_sum{version="1", model="llm"} 21.5
llm_step_num_sequences_count{model="llm",version="1"} 9
frontdoor_requests_in_flight 2
frontdoor_requests_total{route="/v1/completions",status="499"} 1 1712345678000
odd_label{path="C:\\\\dir\\"x\\"",text="a\\nb"} 1e3
weird_values{kind="nan"} NaN
weird_values{kind="inf"} +Inf
weird_values{kind="-inf"} -Inf
not_a_number{x="1"} abc

this line is not a sample
"""


def test_parse_prometheus_keys_and_values():
    m = prometheus.parse_prometheus(EXPOSITION)
    assert m[("llm_requests_running", frozenset({("model", "llm"), ("version", "1")}))] == 3.0
    assert m[prometheus.key("llm_requests_running", model="llm_default", version="1")] == 0.0
    assert m[prometheus.key("llm_step_num_sequences_bucket", model="llm", version="1", le="+Inf")] == 9.0
    assert m[prometheus.key("llm_step_num_sequences_sum", model="llm", version="1")] == 21.5  # label order, spaces
    assert m[("frontdoor_requests_in_flight", frozenset())] == 2.0  # no labels
    assert m[prometheus.key("frontdoor_requests_total", route="/v1/completions", status="499")] == 1.0  # timestamp
    assert m[prometheus.key("odd_label", path='C:\\dir"x"', text="a\nb")] == 1000.0  # unescaped label values
    assert math.isnan(m[prometheus.key("weird_values", kind="nan")])
    assert m[prometheus.key("weird_values", kind="inf")] == math.inf
    assert m[prometheus.key("weird_values", kind="-inf")] == -math.inf
    assert not any(name == "not_a_number" for name, _ in m)  # a value that does not parse is skipped
    assert len(m) == 12  # comments, blank lines and non-samples skipped


def test_value_is_an_exact_lookup_and_samples_a_selector():
    m = prometheus.parse_prometheus(EXPOSITION)
    assert prometheus.value(m, "llm_requests_running", model="llm", version="1") == 3.0
    assert math.isnan(prometheus.value(m, "llm_requests_running", model="llm"))  # labels must match exactly
    assert prometheus.value(m, "missing", -1.0, model="llm", version="1") == -1.0
    assert prometheus.value(m, "missing", None) is None
    assert sorted(prometheus.samples(m, "llm_requests_running")) == [0.0, 3.0]
    assert prometheus.samples(m, "llm_requests_running", model="llm") == [3.0]
    assert sorted(prometheus.samples(m, "llm_step_num_sequences_bucket", model="llm")) == [4.0, 9.0]
    assert prometheus.samples(m, "llm_requests_running", model="other") == []


def test_parse_prometheus_last_duplicate_wins_and_empty_text():
    assert prometheus.parse_prometheus("") == {}
    assert prometheus.parse_prometheus("a 1\na 2\n") == {("a", frozenset()): 2.0}


def test_scrape_fetches_and_parses():
    body = EXPOSITION.encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the http.server API
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_port}/metrics"
        assert prometheus.fetch(url) == EXPOSITION
        scraped = {k: repr(v) for k, v in prometheus.scrape(url).items()}  # (repr: NaN is not equal to NaN)
        assert scraped == {k: repr(v) for k, v in prometheus.parse_prometheus(EXPOSITION).items()}
    finally:
        httpd.shutdown()
        httpd.server_close()
    with pytest.raises(OSError):
        prometheus.scrape(url, timeout_s=2)


# ------------------------------------------------------------------------------------- fidelity, concurrency


def test_first_mismatch_and_difference():
    assert first_difference([1, 2, 3], [1, 2, 4]) == 2
    assert first_difference([1, 2], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 2, 4]) == "first difference at output token 2: got 3, reference 4"
    assert first_mismatch([1, 2], [1, 2, 3]) == "lengths differ: got 2 tokens, reference 3"


def test_judge_near_tie_rule():
    import torch

    assert judge([1, 2], [1, 2], {}, None).identical
    assert not judge([1, 2], [1, 2, 3], {}, None).near_tie  # no differing token, but shorter
    logits = torch.tensor([0.0, 5.0, 4.6, 1.0, -1.0, -2.0, -3.0])
    tie = judge([1, 2], [1, 1], {2: -0.5, 1: -0.9}, logits)  # ours 2, reference 1: 0.4 apart on both sides
    assert not tie.identical and tie.near_tie and "token 1" in tie.detail
    far = judge([1, 3], [1, 1], {3: -0.1, 1: -5.0}, logits)  # 4 apart in the reference
    assert not far.near_tie
    missing = judge([1, 2], [1, 1], {2: -0.1}, logits)  # the reference's token is not in our top
    assert not missing.near_tie
    assert summarize([tie, far, judge([1], [1], {}, None)]) == "1 identical, 1 near-ties, 1 violations of 3"


def test_run_concurrently_and_raise_first_error():
    results = run_concurrently(lambda a, b: a // b, [(4, 2), (1, 0), (9, 3)])
    assert results[0] == 2 and results[2] == 3 and isinstance(results[1], ZeroDivisionError)
    with pytest.raises(AssertionError, match=r"1 of 3 divisions failed:\n  #1: ZeroDivisionError"):
        raise_first_error(results, "division")
    raise_first_error([1, 2], "fine")


# ----------------------------------------------------------------------------------------------- the package


def test_testkit_imports_light_and_never_imports_tests():
    code = (
        "import sys, testkit, testkit.prompts, testkit.hf_reference, testkit.prometheus, testkit.stats, "
        "testkit.fidelity, testkit.concurrency; print(sorted(m for m in ('torch', 'transformers', 'numpy') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    for path in (REPO_ROOT / "testkit").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not [n for n in names if n.split(".")[0] in ("tests", "llm_testlib", "conftest", "benchmarks")], (
                f"{path.name} imports {names}"
            )


def test_mixed_cases(tokenizer):
    from testkit.prompts import LONG_PROMPT_TOKENS, MIXED_CASES

    assert len(MIXED_CASES) == 24 and len({p for p, _ in MIXED_CASES}) == 24
    assert {m for _, m in MIXED_CASES} <= set(range(8, 41))
    assert sum(len(tokenizer(p).input_ids) > LONG_PROMPT_TOKENS for p, _ in MIXED_CASES) == 7


# -------------------------------------------------------------------------------------- the HF reference


def test_hf_reference_is_transformers_greedy_generate(tiny_llama, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from testkit.hf_reference import HFReference

    ref = HFReference(tiny_llama, "float32", cache_path=tmp_path / "cache.json")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    prompt = "The capital of France is"
    ids = ref.tokenizer(prompt).input_ids
    assert ref.prompt_ids(prompt) == ids and ref.prompt_ids(ids) == ids
    with torch.no_grad():
        want = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=12,
            eos_token_id=None,
            pad_token_id=2,
        )[0, len(ids) :]
    assert ref.greedy(ids, 12, stop_at_eos=False) == want.tolist()
    assert ref.greedy(prompt, 12, stop_at_eos=False) == want.tolist()  # text is tokenized as the server does
    got = ref.get(prompt, 12)
    eos = 2
    expected = want.tolist()[: want.tolist().index(eos) + 1] if eos in want.tolist() else want.tolist()
    assert got.token_ids == expected  # stops after EOS
    assert got.text == ref.tokenizer.decode(expected, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert torch.allclose(
        ref.next_logits(prompt, want[:3].tolist()),
        model(torch.tensor([ids + want[:3].tolist()])).logits[0, -1],
        atol=1e-5,
    )

    # The cache file: a new instance answers from it without loading the model.
    entries = json.loads((tmp_path / "cache.json").read_text())["entries"]
    assert len(entries) == 3
    again = HFReference(tiny_llama, torch.float32, cache_path=tmp_path / "cache.json")
    assert again.greedy(ids, 12, stop_at_eos=False) == want.tolist() and again._model is None
    # Another dtype does not read float32's entries.
    assert HFReference(tiny_llama, "bfloat16", cache_path=tmp_path / "cache.json")._memo == {}
    stop = threading.Event()
    stop.set()
    assert HFReference(tiny_llama).many([(prompt, 5)], stop=stop) == []


def test_hf_reference_shared_is_one_instance_per_model_and_dtype(tiny_llama):
    from testkit.hf_reference import HFReference

    a = HFReference.shared(tiny_llama)
    assert HFReference.shared(Path(tiny_llama), "float32") is a and HFReference.shared(tiny_llama, "bfloat16") is not a
    assert a.model is HFReference.shared(tiny_llama).model
