"""The integration suite's model repository: every variant of `model_repository/llm` its one server loads
(model name -> engine parameters that differ from config.pbtxt), and the models its front door serves. Shared by
tests/integration/conftest.py and the start-stress check (loadtest/start_stress.py), so both start the same
repository."""

from __future__ import annotations

from pathlib import Path

# Every variant the session's server loads: model name -> engine parameters that differ from
# model_repository/llm/config.pbtxt (string values, as in config.pbtxt). `model` is always set to the
# absolute path of models/smollm2-135m-instruct unless a variant sets it.
# float32 variants are held to token-for-token equality with Hugging Face's float32 `generate`.
# Dense fp32 without speculation: the reference configuration every feature test holds token for token to
# transformers (the default repository's own settings, GGUF blocks and adaptive n-gram speculation, are
# `llm_default`'s, held to the rule of what it picks on the machine).
_FP32 = {"dtype": "float32", "quantization": "none", "draft_model": "", "num_speculative_tokens": "0"}
_FIXED_K = {"spec_adaptive": "false"}  # the speculative variants verify a fixed k every step
VARIANTS: dict[str, dict[str, str]] = {
    # Default-like, but a small token budget so that prompts longer than 64 tokens are prefilled in chunks.
    "llm": {**_FP32, "max_num_batched_tokens": "64", "max_num_seqs": "32"},
    # 24 blocks x 16 tokens = 384 tokens of KV: the largest request fits (13 blocks), 24 concurrent ones need 104,
    # and one step admits up to 512 prompt tokens, so the pool is full after the first steps and decodes preempt
    # (40 blocks once left room enough that a faster engine finished the load without preempting).
    "llm_small_kv": {**_FP32, "kv_cache_blocks": "24", "block_size": "16", "max_num_seqs": "32"},
    # Two running sequences and at most four waiting requests: a flood is partly refused.
    "llm_small_queue": {**_FP32, "max_queue_size": "4", "max_num_seqs": "2"},
    # The `llm` settings without a prefix cache: the cold-cache baseline for prefix-caching tests.
    "llm_no_prefix_cache": {**_FP32, "max_num_batched_tokens": "64", "enable_prefix_caching": "false"},
    # Speculative decoding: the target's weights in bf16 as the draft, n-gram drafts, and a draft identical
    # to the target. A large spec_max_batch_size keeps speculation on under load.
    "llm_spec_draft": {
        **_FP32,
        **_FIXED_K,
        "max_num_batched_tokens": "64",
        "draft_model": "self",
        "draft_dtype": "bfloat16",
        "num_speculative_tokens": "3",
        "spec_max_batch_size": "32",
    },
    "llm_spec_ngram": {
        **_FP32,
        **_FIXED_K,
        "max_num_batched_tokens": "64",
        "draft_model": "ngram",
        "num_speculative_tokens": "3",
        "spec_max_batch_size": "32",
    },
    "llm_spec_same": {
        **_FP32,
        **_FIXED_K,
        "draft_model": "self",
        "draft_dtype": "float32",
        "num_speculative_tokens": "4",
        "spec_max_batch_size": "32",
    },
    # The default model repository as shipped (quantization auto: the GGUF blocks where our kernel runs;
    # adaptive n-gram speculation), with a small token budget (chunked prefill) and speculation kept on for
    # the whole concurrent set: held to the rule of what `auto` picks here (test_default_fidelity.py).
    "llm_default": {"max_num_batched_tokens": "64", "spec_max_batch_size": "32"},
    # Test-only faults (test_engine_faults.py): a step holding a request whose prompt carries the step marker
    # raises; one carrying the death marker kills the engine thread. One sequence per step: the others wait.
    # vllm_backend's parameters under their names: its health check (a dead engine unloads the model) and metrics.
    "llm_faults": {
        **_FP32,
        "max_num_seqs": "1",
        "kv_cache_blocks": "64",
        "fault_injection": "step_error:<<FAIL THIS STEP>>,engine_death:<<KILL THE ENGINE>>",
        "ENABLE_VLLM_HEALTH_CHECK": "true",
        "REPORT_CUSTOM_METRICS": "true",
    },
}

# A tiny random llama written at session start as a GGUF file holding every block type (testkit.tiny_gguf),
# served straight from the file, K-quants on our kernel (test_gguf_model_e2e.py).
GGUF_MODEL = "llm_gguf"
GGUF_FILE = "tiny_every_block_type.gguf"
# LoRA adapters made by PEFT at session start on the default model (random A and B, fixed seeds), served by
# `llm_default` beside its base model (test_lora_e2e.py): name -> (rank, target modules, seed).
LORA_MODEL = "llm_default"
LORA_ADAPTERS = {
    "alpha": (8, ("q_proj", "v_proj"), 1),
    "beta": (16, ("gate_proj", "up_proj", "down_proj"), 2),
    "gamma": (8, ("q_proj", "k_proj", "v_proj", "o_proj"), 3),
}


def session_variants(folder: Path) -> dict[str, dict[str, str]]:
    """VARIANTS and the GGUF variant, its file written into `folder`, and `LORA_MODEL` with the adapters (made
    into `folder`, listed in its multi_lora.json): every model the session's server loads."""
    import json

    from launcher.paths import MODEL_DIR
    from testkit.lora_adapters import make_adapter
    from testkit.tiny_gguf import write_tiny_gguf

    folder = Path(folder)
    gguf = write_tiny_gguf(folder / GGUF_FILE)
    gguf_variant = {**_FP32, "model": str(gguf), "quantization": "gguf", "kv_cache_blocks": "64", "max_num_seqs": "8"}
    for name, (rank, targets, seed) in LORA_ADAPTERS.items():
        make_adapter(MODEL_DIR, folder / "loras" / name, rank=rank, targets=targets, seed=seed, b_scale=1.0)
    listing = folder / "loras" / "multi_lora.json"
    listing.write_text(json.dumps({name: name for name in LORA_ADAPTERS}))
    lora = {
        "enable_lora": "true",
        "lora_modules": str(listing),
        "max_loras": "4",
        "max_lora_rank": "16",
        "allow_runtime_lora_updating": "true",
    }
    return {**VARIANTS, GGUF_MODEL: gguf_variant, LORA_MODEL: {**VARIANTS[LORA_MODEL], **lora}}


# Triton models the session's front door serves (the first is the one its batch view shows).
FRONTEND_MODELS = ("llm", "llm_small_queue", "llm_default")
