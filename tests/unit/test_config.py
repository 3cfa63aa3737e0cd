"""backend/core/config.py: EngineConfig.from_parameters parses Triton's string parameters and validates them; every
error is a ConfigError that names the parameter."""

import dataclasses
import json
from pathlib import Path

import pytest

from backend.core.config import ConfigError, EngineConfig


@pytest.fixture
def model_dir(tmp_path):
    folder = tmp_path / "models" / "m"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return folder


def params(model_dir, **extra):
    return {"model": str(model_dir), **{k: str(v) for k, v in extra.items()}}


def test_defaults_and_string_values(model_dir):
    config = EngineConfig.from_parameters(
        params(
            model_dir,
            block_size=" 32 ",
            kv_cache_blocks="100",
            enable_prefix_caching="false",
            log_batch_visualization="YES",
            max_num_seqs="4",
            dtype="bfloat16",
        )
    )
    assert config.block_size == 32 and isinstance(config.block_size, int)
    assert config.kv_cache_blocks == 100
    assert config.enable_prefix_caching is False
    assert config.log_batch_visualization is True
    assert config.max_num_seqs == 4
    assert config.dtype == "bfloat16"
    # untouched fields keep their defaults
    assert config.max_num_batched_tokens == EngineConfig.__dataclass_fields__["max_num_batched_tokens"].default
    assert config.speculative is False


@pytest.mark.parametrize(
    "raw, expected",
    [("1", True), ("true", True), ("On", True), ("0", False), ("FALSE", False), ("off", False), ("no", False)],
)
def test_bool_spellings(model_dir, raw, expected):
    assert EngineConfig.from_parameters(params(model_dir, enable_prefix_caching=raw)).enable_prefix_caching is expected


def test_relative_model_path_resolves_against_base_dir(model_dir):
    base = model_dir.parent.parent / "repo" / "llm"
    base.mkdir(parents=True)
    config = EngineConfig.from_parameters({"model": "../../models/m"}, base_dir=base)
    assert Path(config.model) == model_dir.resolve()
    # without a base dir the relative path is taken as is (and here it does not exist)
    with pytest.raises(ConfigError, match="'model'"):
        EngineConfig.from_parameters({"model": "../../models/definitely-missing"})


def test_draft_model_special_values_not_resolved(model_dir):
    for value in ("self", "ngram"):
        config = EngineConfig.from_parameters(
            params(model_dir, draft_model=value, num_speculative_tokens=3), base_dir=model_dir.parent
        )
        assert config.draft_model == value
        assert config.speculative is True


def test_unknown_parameter_named(model_dir):
    with pytest.raises(ConfigError, match="max_batch_tokens"):
        EngineConfig.from_parameters(params(model_dir, max_batch_tokens=4))


def test_extra_is_not_a_parameter(model_dir):
    with pytest.raises(ConfigError, match="extra"):
        EngineConfig.from_parameters(params(model_dir, extra="{}"))


def test_model_required():
    with pytest.raises(ConfigError, match="'model'"):
        EngineConfig.from_parameters({})
    with pytest.raises(ConfigError, match="'model'"):
        EngineConfig.from_parameters({"model": ""})


def test_model_folder_without_config_json(tmp_path):
    with pytest.raises(ConfigError, match="'model'.*config.json"):
        EngineConfig.from_parameters({"model": str(tmp_path)})


@pytest.mark.parametrize(
    "name, raw, fragment",
    [
        ("block_size", "sixteen", "'block_size' must be an integer"),
        ("block_size", "1.5", "'block_size' must be an integer"),
        ("block_size", "24", "'block_size' must be a power of two"),
        ("block_size", "512", "'block_size' must be a power of two"),
        ("block_size", "0", "'block_size'"),
        ("enable_prefix_caching", "maybe", "'enable_prefix_caching' must be true or false"),
        ("dtype", "float64", "'dtype' must be one of"),
        ("draft_dtype", "int8", "'draft_dtype' must be one of"),
        ("draft_dtype", "auto", "'draft_dtype' must be one of"),
        (
            "kv_cache_dtype",
            "q4_0",
            "'kv_cache_dtype' must be one of ['auto', 'float32', 'bfloat16', 'float16', 'q8_0']",
        ),
        (
            "quantization",
            "int3",
            "'quantization' must be one of ['auto', 'gguf', 'gguf_int8', 'half', 'q8_0', 'int4', 'int8', 'none']",
        ),
        ("model_impl", "vllm", "'model_impl' must be one of ['auto', 'fused', 'hf']"),
        ("max_num_seqs", "0", "'max_num_seqs' must be between 1 and"),
        ("max_num_batched_tokens", "0", "'max_num_batched_tokens' must be between"),
        ("kv_cache_blocks", "-1", "'kv_cache_blocks' must be between"),
        ("kv_cache_memory_bytes", "0", "'kv_cache_memory_bytes' must be between"),
        ("max_model_len", "-5", "'max_model_len' must be between"),
        ("max_queue_size", "-1", "'max_queue_size' must be between"),
        ("max_n", "0", "'max_n' must be between"),
        ("max_n", "257", "'max_n' must be between"),
        ("num_threads", "-1", "'num_threads' must be between"),
        ("num_speculative_tokens", "17", "'num_speculative_tokens' must be between"),
        ("ngram_min", "0", "'ngram_min' must be between"),
        ("spec_max_batch_size", "0", "'spec_max_batch_size' must be between"),
        ("draft_model", "/no/such/folder", "'draft_model': model '/no/such/folder' does not exist"),
    ],
)
def test_bad_values_name_the_parameter(model_dir, name, raw, fragment):
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_parameters(params(model_dir, **{name: raw}))
    assert fragment in str(info.value)
    assert repr(raw.strip()) in str(info.value) or raw.strip() in str(info.value)


def test_ngram_max_below_ngram_min(model_dir):
    with pytest.raises(ConfigError, match="'ngram_max' must be between 3"):
        EngineConfig.from_parameters(params(model_dir, ngram_min=3, ngram_max=2))


def test_every_field_but_extra_is_settable(model_dir):
    names = {f.name for f in dataclasses.fields(EngineConfig)} - {"extra", "model"}
    assert {"block_size", "kv_cache_blocks", "max_num_seqs", "max_queue_size", "max_n"} <= names
    # each accepts its own default written as a string
    values = {}
    for f in dataclasses.fields(EngineConfig):
        if f.name in ("extra", "model", "draft_model"):
            continue
        default = f.default
        values[f.name] = ("true" if default else "false") if isinstance(default, bool) else str(default)
    config = EngineConfig.from_parameters({"model": str(model_dir), **values})
    for name, raw in values.items():
        assert str(getattr(config, name)).lower() == raw.lower()


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)
