"""backend/hardware.py: `dtype: auto` and quantization resolve by what the hardware computes natively."""
from backend.hardware import native_bf16, resolve_dtype, resolve_quantization


def test_auto_picks_bfloat16_only_with_native_bf16_instructions():
    assert resolve_dtype("auto", "cpu", {"avx512f", "avx512_bf16"})[0] == "bfloat16"
    assert resolve_dtype("auto", "cpu", {"amx_bf16", "amx_tile"})[0] == "bfloat16"
    dtype, why = resolve_dtype("auto", "cpu", {"avx2", "avx512f"})
    assert dtype == "float32" and "emulated" in why and "avx512_bf16" in why


def test_an_explicit_dtype_is_kept():
    assert resolve_dtype("float32", "cpu", {"avx512_bf16"}) == ("float32", "set in the configuration")
    assert resolve_dtype("bfloat16", "cpu", set())[0] == "bfloat16"


def test_native_bf16_names_the_flag():
    ok, why = native_bf16("cpu", {"avx512_bf16"})
    assert ok and "avx512_bf16" in why


def test_quantization_applies_to_bfloat16_on_cpu_only():
    assert resolve_quantization("int4", "bfloat16", "cpu")[0] == "int4"
    quantization, why = resolve_quantization("int4", "float32", "cpu")
    assert quantization == "none" and "bfloat16" in why
    assert resolve_quantization("int8", "bfloat16", "cuda")[0] == "none"
    assert resolve_quantization("none", "bfloat16", "cpu")[0] == "none"
