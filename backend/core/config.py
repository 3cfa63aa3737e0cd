"""Engine configuration: every knob of `config.pbtxt` `parameters`, parsed and validated at load."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from backend.core.metrics import METRIC_NAMES
from backend.model import model_source


class ConfigError(ValueError):
    """A bad engine setting; the message names the parameter."""


_DTYPES = ("float32", "bfloat16", "float16")
MODEL_IMPLS = ("auto", "fused", "hf")
QUANTIZATIONS = ("auto", "gguf", "gguf_int8", "half", "q8_0", "int4", "int8", "none")
# draft_model values that name no model: "self" (the target's weights), n-gram lookup, suffix decoding, and "auto"
# (per sequence: suffix decoding, the trained head `draft_head` names, or none)
MODEL_FREE_DRAFTS = ("self", "ngram", "suffix", "auto")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"  # "auto": bfloat16 where the hardware computes it natively, else float32
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"
    model_impl: str = "auto"  # "auto", "fused" (Llama-family fast path) or "hf" (Hugging Face's modules)
    # "auto" (exact GGUF blocks where the model has them and our kernel runs, else int4 over native bf16, else
    # none), "gguf" (the model's own Q4_1/Q8_0 blocks, fp32 activations), "gguf_int8" (the same blocks, Q4_1
    # layers with activations rounded to int8 per 32: faster, not exact), "q8_0" (re-quantized, fp32
    # activations), "int4"/"int8" (bf16 activations), "none" (dense)
    quantization: str = "auto"
    # low-bit weights serve steps of up to this many rows, larger steps run dense; 0: measured defaults
    # (model_runner.LOWBIT_ROWS)
    max_lowbit_rows: int = 0
    draft_model: str = ""  # a folder, "self", "ngram", "suffix", "auto", or "" for no speculation
    draft_dtype: str = "bfloat16"
    num_speculative_tokens: int = 0
    ngram_min: int = 1
    ngram_max: int = 4
    # suffix decoding (draft_model "suffix", backend/spec/suffix_proposer.py): the longest context matched, the
    # path probability a draft token needs, draft tokens per matched token, the global store's cap in tokens (0: none)
    suffix_max_depth: int = 24
    suffix_min_token_prob: float = 0.1
    suffix_spec_factor: float = 1.0
    suffix_cache_tokens: int = 1 << 18
    # draft_model "auto" (backend/spec/auto_proposer.py): the EAGLE head folder `make draft` wrote ("": suffix decoding
    # or none), and what a drafted token costs in one-row target steps: its verification row, the head's pass
    draft_head: str = ""
    spec_row_cost: float = 0.3
    spec_head_token_cost: float = 0.2
    spec_max_batch_size: int = 2  # speculation turns off for a step whose batch is larger (docs/benchmarks.md)
    spec_adaptive: bool = False  # each sequence's draft length follows its acceptance (spec/policy.py)
    spec_min_acceptance: float = 0.3  # adaptive: a sequence accepting less stops drafting until a probe
    spec_probe_interval: int = 8  # adaptive: decode steps between probes of a sequence that stopped drafting
    block_size: int = 16
    kv_cache_blocks: int = 0  # 0: derive from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 256 * 1024 * 1024
    # what the KV cache holds: "auto" the model's dtype (float32 for an fp32 model: exact), or "float32", or
    # "float16" / "bfloat16" (half the bytes per token; keys and values rounded when written, so not exact), or
    # "q8_0" (llama.cpp's 8-bit blocks with an fp16 scale per 32 values: 34 bytes per 32 values; not exact)
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int = 0  # 0: the model's own limit
    enable_prefix_caching: bool = True
    max_queue_size: int = 256
    max_n: int = 8
    max_prompt_bytes: int = 0  # prompts longer (UTF-8 bytes) are refused before tokenizing; 0: 16 x max_model_len
    # return_context_logits / return_generation_logits: a request whose logits (rows x vocabulary x 4 bytes) could
    # pass this many MiB is refused; 0 refuses every such request
    max_logits_mb: int = 256
    log_batch_visualization: bool = False
    # Besides ours, the metric names exported: "vllm" and / or "tensorrt_llm" (comma-separated), or "none".
    metric_names: str = "vllm,tensorrt_llm"
    # LoRA adapters (PEFT folders) served beside the base model, requested by name (lora_name); the names and
    # folders come from `lora_modules`, a JSON object {name: folder} (vllm_backend's multi_lora.json; relative
    # folders are relative to that file)
    enable_lora: bool = False
    lora_modules: str = ""
    max_loras: int = 4  # adapters in one step; requests of others wait
    max_lora_rank: int = 16
    max_cpu_loras: int = 8  # adapters loaded at once
    # adapters loaded and unloaded while serving (the front door's /v1/load_lora_adapter; vLLM's
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING): off, since it reads folders of the server's disk on a client's word
    allow_runtime_lora_updating: bool = False
    num_threads: int = 0  # torch intra-op threads; 0: every core (hardware.serving_threads)
    seed: int = 0
    fault_injection: str = ""  # test only: see fault_injection.py

    @property
    def metric_dialects(self) -> tuple[str, ...]:
        """The ALIASES dialects of `metric_names` (backend/core/metrics.py)."""
        names = [n.strip() for n in self.metric_names.split(",") if n.strip()]
        return () if names == ["none"] else tuple(names)

    @property
    def speculative(self) -> bool:
        return bool(self.draft_model) and self.num_speculative_tokens > 0

    @classmethod
    def from_parameters(
        cls, params: dict[str, str], base_dir: Path | None = None, lora_listing: Path | None = None
    ) -> EngineConfig:
        """Build from string key/values (Triton `parameters`); unknown keys and bad values raise ConfigError.
        `lora_listing`: the adapters file taken with enable_lora where `lora_modules` is not set, if it exists."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(params) - set(fields))
        if unknown:
            raise ConfigError(f"unknown parameter(s) {unknown}; allowed: {sorted(fields)}")
        if not params.get("model"):
            raise ConfigError("parameter 'model' is required: a Hugging Face model folder")
        values = {}
        for name, raw in params.items():
            values[name] = _parse_value(name, fields[name].type, str(raw).strip())
        for key in ("model", "draft_model", "draft_head", "lora_modules"):
            path = values.get(key, "")
            if path and path not in MODEL_FREE_DRAFTS and base_dir is not None and not Path(path).is_absolute():
                values[key] = str((base_dir / path).resolve())
        config = cls(**values)
        if config.enable_lora and not config.lora_modules and lora_listing is not None and lora_listing.is_file():
            config.lora_modules = str(lora_listing)
        config.validate()
        return config

    def validate(self) -> None:
        for name in ("model", "draft_model"):
            try:
                if name == "model" or self.draft_model not in ("", *MODEL_FREE_DRAFTS):
                    model_source.locate(getattr(self, name))
            except model_source.ModelSourceError as exc:
                raise ConfigError(f"parameter {name!r}: {exc}") from None
        if self.draft_head and (self.draft_model != "auto" or not Path(self.draft_head).is_dir()):
            raise ConfigError(
                f"parameter 'draft_head' ({self.draft_head!r}) names the trained head folder that draft_model 'auto' "
                f"drafts with (make draft); draft_model is {self.draft_model!r}"
                + ("" if Path(self.draft_head).is_dir() else " and the folder does not exist")
            )
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ConfigError(f"parameter 'device' must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        for name, allowed in (
            ("dtype", ("auto", *_DTYPES)),
            ("draft_dtype", _DTYPES),
            ("kv_cache_dtype", ("auto", *_DTYPES, "q8_0")),
        ):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"parameter '{name}' must be one of {list(allowed)}, got {getattr(self, name)!r}")
        if self.model_impl not in MODEL_IMPLS:
            raise ConfigError(f"parameter 'model_impl' must be one of {list(MODEL_IMPLS)}, got {self.model_impl!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(
                f"parameter 'quantization' must be one of {list(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.quantization in ("gguf", "gguf_int8") and not model_source.has_gguf(self.model):
            raise ConfigError(
                f"parameter 'quantization' is {self.quantization!r} but the model is no GGUF file and its folder has "
                "no model.gguf (the GGUF it was converted from; launcher/prepare_model.py keeps it there); use "
                "'auto', 'q8_0' or 'none'"
            )
        _check_range("max_lowbit_rows", self.max_lowbit_rows, 0, 4096)
        _check_range("num_speculative_tokens", self.num_speculative_tokens, 0, 16)
        _check_range("ngram_min", self.ngram_min, 1, 64)
        _check_range("ngram_max", self.ngram_max, self.ngram_min, 64)
        _check_range("suffix_max_depth", self.suffix_max_depth, 2, 256)
        _check_range("suffix_cache_tokens", self.suffix_cache_tokens, 0, 1 << 30)
        for name, high in (
            ("suffix_min_token_prob", 1.0),
            ("suffix_spec_factor", 64.0),
            ("spec_row_cost", 16.0),
            ("spec_head_token_cost", 16.0),
        ):
            if not 0.0 <= getattr(self, name) <= high:
                raise ConfigError(f"parameter '{name}' must be between 0 and {high:g}, got {getattr(self, name)}")
        _check_range("spec_max_batch_size", self.spec_max_batch_size, 1, 4096)
        if not 0.0 <= self.spec_min_acceptance <= 1.0:
            raise ConfigError(
                f"parameter 'spec_min_acceptance' must be between 0 and 1, got {self.spec_min_acceptance}"
            )
        _check_range("spec_probe_interval", self.spec_probe_interval, 1, 1 << 20)
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ConfigError(f"parameter 'block_size' must be a power of two from 1 to 256, got {self.block_size}")
        _check_range("kv_cache_blocks", self.kv_cache_blocks, 0, 1 << 24)
        _check_range("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1, 1 << 40)
        _check_range("max_num_seqs", self.max_num_seqs, 1, 4096)
        _check_range("max_num_batched_tokens", self.max_num_batched_tokens, 1, 1 << 20)
        _check_range("max_model_len", self.max_model_len, 0, 1 << 20)
        _check_range("max_queue_size", self.max_queue_size, 0, 1 << 20)
        _check_range("max_n", self.max_n, 1, 256)
        _check_range("max_prompt_bytes", self.max_prompt_bytes, 0, 1 << 30)
        _check_range("max_logits_mb", self.max_logits_mb, 0, 1 << 20)
        _check_range("num_threads", self.num_threads, 0, 1024)
        _check_range("max_loras", self.max_loras, 1, 256)
        _check_range("max_lora_rank", self.max_lora_rank, 1, 1024)
        _check_range("max_cpu_loras", self.max_cpu_loras, self.max_loras, 4096)
        if self.lora_modules and not self.enable_lora:
            raise ConfigError("parameter 'lora_modules' is set but enable_lora is false: set enable_lora to true")
        if self.lora_modules and not Path(self.lora_modules).is_file():
            raise ConfigError(
                f"parameter 'lora_modules': {self.lora_modules} is not a file (a JSON object of adapter names to "
                "folders)"
            )
        unknown = sorted(set(self.metric_dialects) - set(METRIC_NAMES))
        if unknown or not self.metric_names.strip():
            raise ConfigError(
                f"parameter 'metric_names' must list some of {list(METRIC_NAMES)} (comma-separated) or be 'none', "
                f"got {self.metric_names!r}"
            )


def _check_range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise ConfigError(f"parameter '{name}' must be between {low} and {high}, got {value}")


def _parse_value(name: str, type_name: str, raw: str):
    if type_name == "bool":
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ConfigError(f"parameter '{name}' must be true or false, got {raw!r}")
    if type_name == "int":
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"parameter '{name}' must be an integer, got {raw!r}") from None
    if type_name == "float":
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"parameter '{name}' must be a number, got {raw!r}") from None
    return raw
