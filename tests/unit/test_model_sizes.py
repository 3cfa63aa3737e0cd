"""benchmarks/tools/shaped_models.py and benchmarks/tools/model_sizes.py on the tiny shape: the generated file is a
llama GGUF that transformers and our loader read alike, and the sizes benchmark's measuring and reporting code runs."""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks.core.common import LoadResult
from benchmarks.tools import model_sizes, shaped_models
from testkit.tiny_gguf import smollm2_gguf


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shaped")
    return shaped_models.write_f16(folder / "tiny.gguf", shaped_models.SHAPES["tiny"], smollm2_gguf(), seed=1)


def test_the_shaped_file_serves_what_transformers_computes_from_it(tiny_file):
    from backend.model import model_source
    from backend.model.runner import ForwardItem, ModelRunner

    runner = ModelRunner(str(tiny_file), "float32", 16, 8, quantization="gguf")
    assert runner.fused is not None and runner.shape.num_layers == shaped_models.SHAPES["tiny"].layers
    reference = model_source.load_model(model_source.resolve(tiny_file), dtype=torch.float32).eval()
    ids = [1, 5, 9, 200, 17]
    ours = runner.forward([ForwardItem(ids, 0, [0], len(ids))])
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0]
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    assert (ours - theirs).abs().max() < 1e-4 * theirs.abs().max()


def test_the_kv_cache_is_sized_for_the_context(tiny_file):
    shape = shaped_models.SHAPES["tiny"]
    per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * 4  # fp32 keys and values
    assert model_sizes.kv_cache_parameters(tiny_file, 1024) == {"kv_cache_memory_bytes": str(1024 * per_token)}


def test_the_workload_runs_through_any_client_and_the_report_shows_ratios():
    calls = []

    def run(requests, concurrency):
        calls.append((len(requests), concurrency))
        tokens = sum(m for _, m in requests)
        n = len(requests)
        return LoadResult(1.0, tokens, n, [0.1] * n, [], [0.1 + (m - 1) * 0.01 for _, m in requests])

    work = model_sizes.workload("tiny")
    figures = model_sizes._runs(run, work)
    assert calls == [(1, 1)] * work.decode_requests + [(2, 2), (1, 1)]
    assert figures["batch1_tok_s"] == pytest.approx(100.0)
    assert figures["long_ttft_s"] == pytest.approx(0.1)
    ours = {**figures, "ready_s": 5.0, "peak_bytes": 3 * 2**20, "steady_bytes": 2 * 2**20}
    theirs = {
        **figures,
        "llama_bench_tok_s": 90.0,
        "ready_s": 1.0,
        "peak_bytes": 2**21,
        "steady_bytes": 2**21,
        "note": "",
    }
    machine = {
        "date": "now",
        "host_cpu": "cpu",
        "logical_cpus": 2,
        "memory_gib": 1.0,
        "cpu_flags": ["avx2"],
        "kernel_isa": "avx2",
        "torch": "2",
        "load_average_start": [0, 0, 0],
    }
    text = model_sizes.report(
        [{"size": "tiny", "kind": "F16", "file_bytes": 2**20, "ours": ours, "llama": theirs}], machine
    )
    assert "| tiny F16 | 1 | 5.0 / 1.0 | 3 / 2 (1.50x) | 2 / 2 | 100.0 / 100.0 / 90.0 (1.00x) |" in text
    assert "CPU flags avx2" in text


def test_tree_memory_sums_a_process_tree():
    memory = model_sizes.TreeMemory(period_s=0.01)
    memory.watch(os.getpid())
    try:
        now = memory.now()
        assert now > 10 * 2**20  # this interpreter, with torch
    finally:
        memory.stop()
