"""backend/model/hardware.py: `dtype: auto` and quantization resolve by what the hardware computes natively."""

import pytest

from backend.model.hardware import native_bf16, resolve_dtype, resolve_weights

AVX2 = {"avx2", "fma", "f16c"}
AVX512_BF16 = AVX2 | {"avx512f", "avx512_bf16"}
AMX = AVX512_BF16 | {"amx_bf16", "amx_tile"}


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


def test_bf16_quantization_applies_to_bfloat16_on_cpu_only():
    assert resolve_weights("bfloat16", "int4", "cpu", False, 0, AMX)[:2] == ("bfloat16", "int4")
    dtype, quantization, why = resolve_weights("float32", "int4", "cpu", True, 2, AMX)
    assert (dtype, quantization) == ("float32", "none") and "bfloat16" in why
    assert resolve_weights("bfloat16", "int8", "cuda", False, 0, AMX)[1] == "none"
    assert resolve_weights("bfloat16", "none", "cpu", True, 2, AMX)[1] == "none"


@pytest.mark.parametrize("flags", [AVX2, AVX512_BF16, AMX], ids=["avx2", "avx512_bf16", "amx"])
def test_auto_serves_the_exact_gguf_blocks_where_the_kernel_runs(flags):
    """On AMX too: there the exact path ran 3.0-3.5x / 1.3-1.7x / 2.1-2.4x the speed of bf16 + int4 at batch
    1 / 8 / 32."""
    dtype, quantization, why = resolve_weights("auto", "auto", "cpu", True, 1, flags)
    assert (dtype, quantization) == ("float32", "gguf") and "exact" in why


def test_auto_takes_bf16_int4_only_without_blocks_or_kernel():
    assert resolve_weights("auto", "auto", "cpu", False, 2, AMX)[:2] == ("bfloat16", "int4")
    assert resolve_weights("auto", "auto", "cpu", True, 0, AMX)[:2] == ("bfloat16", "int4")
    assert resolve_weights("auto", "auto", "cpu", False, 2, AVX512_BF16)[:2] == ("bfloat16", "int4")
    assert resolve_weights("auto", "auto", "cpu", True, 0, AVX2)[:2] == ("float32", "none")
    assert resolve_weights("auto", "auto", "cpu", False, 1, AVX2)[:2] == ("float32", "none")
    assert resolve_weights("auto", "auto", "cuda", True, 0, set())[1] == "none"


def test_an_explicit_bfloat16_keeps_bf16_int4_where_the_blocks_are():
    assert resolve_weights("bfloat16", "auto", "cpu", True, 2, AMX)[:2] == ("bfloat16", "int4")


def test_fp32_kinds_refuse_a_bf16_dtype():
    assert resolve_weights("auto", "q8_0", "cpu", False, 1, AVX2)[:2] == ("float32", "q8_0")
    with pytest.raises(ValueError, match="float32"):
        resolve_weights("bfloat16", "gguf", "cpu", True, 1, AVX512_BF16)


def test_serving_threads_are_every_core_this_process_may_use(monkeypatch):
    import os

    from backend.model.hardware import serving_threads

    assert serving_threads() == len(os.sched_getaffinity(0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5})
    assert serving_threads() == 3


def test_auto_serves_a_16_bit_checkpoint_from_its_own_weights_where_the_kernel_runs():
    assert resolve_weights("auto", "auto", "cpu", False, 1, AVX2, stored_16_bit=True)[:2] == ("float32", "half")
    assert resolve_weights("float32", "auto", "cpu", False, 2, AMX, stored_16_bit=True)[:2] == ("float32", "half")
    # on AMX too; bf16 + int4 where bf16 was asked for; dense where no kernel runs
    assert resolve_weights("auto", "auto", "cpu", False, 2, AMX, stored_16_bit=True)[:2] == ("float32", "half")
    assert resolve_weights("bfloat16", "auto", "cpu", False, 1, AVX2, stored_16_bit=True)[1] == "int4"
    assert resolve_weights("auto", "auto", "cpu", False, 0, AVX2, stored_16_bit=True)[:2] == ("float32", "none")
