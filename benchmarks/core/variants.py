"""The served configurations a benchmark run compares: the served one (model_repository/llm/config.pbtxt as it
stands) and its variants, each a name with the parameters it changes, and the parameters an in-process engine
takes to run the same configuration."""

from __future__ import annotations

from launcher.model_config import read_parameters

MAIN_MODEL = "llm"  # the served configuration, model_repository/llm/config.pbtxt as it stands
SEED_MODEL = "llm_seq8"  # section 1: max_num_seqs 8
FP32_MODEL = "llm_fp32"  # section 2's fp32 rows
BF16_INT4_MODEL = "llm_bf16_int4"  # section 7: bf16 + int4, the default's alternative where bf16 is native
THREADS_MODELS = {1: "llm_threads1", 2: "llm_threads2"}  # section 7: the served configuration at 1 / 2 threads
VARIANTS = {
    MAIN_MODEL: {},
    SEED_MODEL: {"max_num_seqs": "8"},
    FP32_MODEL: {"dtype": "float32", "quantization": "none"},
    BF16_INT4_MODEL: {"dtype": "bfloat16", "quantization": "int4"},
    **{name: {"num_threads": str(n)} for n, name in THREADS_MODELS.items()},
}


def engine_parameters(threads: int, variant: str = MAIN_MODEL) -> dict[str, str]:
    """A server variant's parameters: what an in-process engine uses to run the same configuration."""
    return {**read_parameters(), "num_threads": str(threads), **VARIANTS[variant]}


def resolved_dtype(variant: str = MAIN_MODEL) -> str:
    """The dtype a variant runs in on this machine (`auto` resolved as the engine resolves it)."""
    from backend.model.hardware import resolve_for_model

    params = engine_parameters(0, variant)
    return resolve_for_model(
        params["model"], params.get("dtype", "auto"), params.get("quantization", "auto"), params.get("device", "cpu")
    )[0]
