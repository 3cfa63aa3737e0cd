"""backend/serving/vllm_backend_parameters.py: vllm_backend's ENABLE_VLLM_HEALTH_CHECK and REPORT_CUSTOM_METRICS
are taken under their names, and every other parameter is left to EngineConfig."""

from __future__ import annotations

import pytest

from backend.core.config import ConfigError, EngineConfig
from backend.serving.vllm_backend_parameters import ParameterError, VllmBackendSettings, split


def test_without_them_nothing_changes():
    params = {"model": "m", "max_num_seqs": "4"}
    assert split(params) == (params, VllmBackendSettings(unload_on_engine_death=True))


@pytest.mark.parametrize("raw, unload", [("true", True), ("True", True), ("false", False), ("FALSE", False)])
def test_the_health_check_chooses_whether_a_dead_engine_unloads_its_model(raw, unload):
    engine, settings = split({"model": "m", "ENABLE_VLLM_HEALTH_CHECK": raw})
    assert engine == {"model": "m"} and settings.unload_on_engine_death is unload


@pytest.mark.parametrize(
    "params, metric_names",
    [
        ({"REPORT_CUSTOM_METRICS": "true"}, "vllm,tensorrt_llm"),
        ({"REPORT_CUSTOM_METRICS": "false"}, "tensorrt_llm"),
        ({"REPORT_CUSTOM_METRICS": "false", "metric_names": "vllm"}, "none"),
        ({"REPORT_CUSTOM_METRICS": "true", "metric_names": "none"}, "vllm"),
        ({"REPORT_CUSTOM_METRICS": "true", "metric_names": "tensorrt_llm"}, "vllm,tensorrt_llm"),
    ],
)
def test_custom_metrics_choose_the_vllm_names(params, metric_names):
    engine, _ = split({"model": "m", **params})
    assert engine == {"model": "m", "metric_names": metric_names}


@pytest.mark.parametrize("name", ["ENABLE_VLLM_HEALTH_CHECK", "REPORT_CUSTOM_METRICS"])
def test_a_value_that_is_no_flag_is_refused_naming_the_parameter(name):
    with pytest.raises(ParameterError, match=f"parameter '{name}' must be true or false, got 'sometimes'"):
        split({"model": "m", name: "sometimes"})


def test_vllm_backends_sample_config_parameters_load(tiny_llama):
    """Its check_health test's config.pbtxt parameters, with ours, make an EngineConfig; left in, EngineConfig
    would refuse them as unknown."""
    raw = {"model": tiny_llama, "ENABLE_VLLM_HEALTH_CHECK": "true", "REPORT_CUSTOM_METRICS": "false"}
    engine, _ = split(raw)
    assert EngineConfig.from_parameters(engine).metric_dialects == ("tensorrt_llm",)
    with pytest.raises(ConfigError, match="unknown parameter"):
        EngineConfig.from_parameters(raw)
