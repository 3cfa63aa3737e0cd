"""backend/model/memory_plan.py: the load log's memory plan, and a model that does not fit refused with the
arithmetic before anything large is allocated."""

from __future__ import annotations

import pytest

from backend.model import memory_plan
from backend.model.memory_plan import MIB, MemoryPlan


def test_a_plan_that_fits_passes_and_one_that_does_not_says_what_to_change():
    plan = MemoryPlan(700 * MIB, 512 * MIB, 8192, 100 * MIB, 400 * MIB, 2000 * MIB)
    plan.check(64 * 1024)
    assert "weights 700 MiB + KV cache 512 MiB (8,192 tokens)" in plan.describe()
    assert "= 1,312 MiB to load" in plan.describe() and "of 2,000 MiB available" in plan.describe()
    tight = MemoryPlan(700 * MIB, 512 * MIB, 8192, 100 * MIB, 400 * MIB, 1000 * MIB)
    with pytest.raises(MemoryError) as refused:
        tight.check(64 * 1024)
    message = str(refused.value)
    assert "does not fit" in message and "1,312 MiB to load" in message and "1,000 MiB available" in message
    # 312 MiB short: the KV cache can give it up, 200 MiB (3,200 tokens) remain
    assert f"kv_cache_memory_bytes to at most {200 * MIB:,} (3,200 tokens" in message
    assert "smaller quantization" in message


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    from testkit.tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("plan") / "llama.gguf")


def test_this_machine_reports_its_memory():
    assert memory_plan.resident_bytes() > 10 * MIB
    assert memory_plan.available_bytes() > 100 * MIB


def test_the_plan_of_a_gguf_is_what_loading_holds(gguf_file):
    from backend.model.runner import ModelRunner

    runner = ModelRunner(str(gguf_file), "float32", 16, 8, quantization="gguf")
    assert runner.memory_plan.weights == runner.weight_bytes
    assert runner.memory_plan.kv_cache == runner.kv_cache.numel() * runner.kv_cache.element_size()


def test_an_engine_that_does_not_fit_is_refused_before_it_allocates(gguf_file, monkeypatch):
    from backend import EngineConfig, LLMEngine
    from backend.core.config import ConfigError

    monkeypatch.setattr(memory_plan, "available_bytes", lambda: 150 * MIB)
    with pytest.raises(ConfigError, match="the model does not fit in memory: weights .* MiB available; lower kv"):
        LLMEngine(EngineConfig(model=str(gguf_file), quantization="gguf", kv_cache_memory_bytes=64 * MIB))
