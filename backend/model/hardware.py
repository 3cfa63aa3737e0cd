"""What the machine computes fast: resolves `dtype: auto`, `quantization: auto` and whether weight-only
quantization applies.

Each answer comes with the reason, for the load log."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # x86: native bf16 dot products
_ARM_BF16_FEATURE = "bf16"  # aarch64: BFDOT/BFMMLA


def cpu_flags_of_this_machine() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return flags


def native_bf16(device: str, cpu_flags: set[str] | None = None) -> tuple[bool, str]:
    """Whether `device` computes bfloat16 natively, and what says so."""
    if device.startswith("cuda"):
        supported = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return supported, f"CUDA device {'supports' if supported else 'does not support'} bfloat16"
    flags = cpu_flags_of_this_machine() if cpu_flags is None else cpu_flags
    found = [f for f in _BF16_CPU_FLAGS if f in flags]
    if not found and platform.machine() in ("aarch64", "arm64") and _ARM_BF16_FEATURE in flags:
        found = [_ARM_BF16_FEATURE]
    if found:
        return True, f"the CPU has {', '.join(found)}"
    return False, f"the CPU has none of {', '.join(_BF16_CPU_FLAGS)}"


def resolve_dtype(requested: str, device: str, cpu_flags: set[str] | None = None) -> tuple[str, str]:
    """(dtype name, reason): `auto` becomes bfloat16 where the hardware computes it natively, else float32."""
    if requested != "auto":
        return requested, "set in the configuration"
    bf16, why = native_bf16(device, cpu_flags)
    return ("bfloat16", f"auto: {why}") if bf16 else ("float32", f"auto: {why}, so bf16 would be emulated")


# Measured on an AVX512_BF16 CPU without AMX (through Triton) and on an AMX CPU (in process, every core; the exact
# path 3.0-3.5x / 1.3-1.7x / 2.1-2.4x as fast as bf16 + int4 at batch 1 / 8 / 32 in two runs): the exact GGUF path
# beat bf16 + int4 everywhere it was measured on every core (docs/benchmarks.md), so `auto` takes it on every CPU
# the kernel runs on.
KERNEL_KINDS = ("gguf", "gguf_int8", "half", "q8_0")  # weights on our kernel, dtype float32
_BF16_KINDS = ("int4", "int8")  # low-bit weights with bf16 activations (torch's kernels)


def resolve_weights(
    dtype: str,
    quantization: str,
    device: str,
    has_gguf: bool,
    kernel_isa: int,
    cpu_flags: set[str] | None = None,
    *,
    stored_16_bit: bool = False,
) -> tuple[str, str, str]:
    """(dtype, quantization, reason). `quantization: auto` serves the model's own weights exactly (fp32
    activations, our kernel) where the kernel runs: its GGUF blocks, or a checkpoint's bf16 / fp16 weights
    (`stored_16_bit`); otherwise int4 over bf16 where bf16 is native, else dense. Re-quantizing (q8_0) changes
    the weights, so it is never picked for the user."""
    flags = cpu_flags_of_this_machine() if cpu_flags is None else cpu_flags
    if quantization == "auto":
        if device != "cpu":
            dtype, why = resolve_dtype(dtype, device, flags)
            return dtype, "none", f"auto: dense weights on {device}; dtype {why}"
        exact_path = kernel_isa and dtype in ("auto", "float32")
        if exact_path and has_gguf:
            return "float32", "gguf", "auto: the model's own GGUF blocks, exact, with fp32 activations"
        if exact_path and stored_16_bit:
            why = "auto: the checkpoint's own 16-bit weights, read as stored, exact, with fp32 activations"
            return "float32", "half", why
        dtype, why = resolve_dtype(dtype, device, flags)
        if dtype == "bfloat16":
            return dtype, "int4", f"auto: no GGUF blocks or no low-bit kernel; dtype {why}"
        return dtype, "none", f"auto: no GGUF blocks, no 16-bit weights or no kernel, dense weights; dtype {why}"
    if quantization in KERNEL_KINDS:
        if dtype not in ("auto", "float32"):
            raise ValueError(f"quantization {quantization} computes in float32; dtype {dtype} was set")
        if device != "cpu":
            return "float32", "none", f"{quantization} weights use CPU kernels; dense weights on {device}"
        return "float32", quantization, "set in the configuration"
    dtype, why = resolve_dtype(dtype, device, flags)
    if quantization in _BF16_KINDS and device != "cpu":
        return dtype, "none", f"{quantization} weights use CPU kernels; dense weights on {device}; dtype {why}"
    if quantization in _BF16_KINDS and dtype != "bfloat16":
        return dtype, "none", f"{quantization} weights need dtype bfloat16 (the dtype is {dtype}); dtype {why}"
    return dtype, quantization, f"set in the configuration; dtype {why}"


def serving_threads() -> int:
    """torch intra-op threads for `num_threads: 0`: every core this process may use, for every step. Leaving a core
    to the server's own threads (HTTP/gRPC, response sending, metrics) was measured once as the better default;
    since our kernels release the GIL those threads run beside a step instead of between its ops, and two threads
    were as fast as one at 8 streams and faster at 32 (docs/benchmarks.md, section 7)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def resolve_for_model(model_dir: str, dtype: str, quantization: str, device: str) -> tuple[str, str, str, int]:
    """`resolve_weights` for a model folder on this machine: (dtype, quantization, reason, kernel isa)."""
    from backend.model import kernels, model_source
    from backend.model.gguf_weights import find_gguf

    has_gguf = find_gguf(model_dir) is not None
    stored_16_bit = not has_gguf and quantization == "auto" and model_source.stored_in_16_bits(model_dir)
    isa = kernels.best_isa() if device == "cpu" and (has_gguf or stored_16_bit or quantization in KERNEL_KINDS) else 0
    return (*resolve_weights(dtype, quantization, device, has_gguf, isa, stored_16_bit=stored_16_bit), isa)
