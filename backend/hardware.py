"""What the machine computes fast: resolves `dtype: auto` and whether weight-only quantization applies.

Each answer comes with the reason, for the load log."""
from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # x86: native bf16 dot products
_ARM_BF16_FEATURE = "bf16"  # aarch64: BFDOT/BFMMLA


def _cpu_flags() -> set[str]:
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
    flags = _cpu_flags() if cpu_flags is None else cpu_flags
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


def resolve_quantization(requested: str, dtype: str, device: str) -> tuple[str, str]:
    """(quantization, reason): the weight-only kernels are CPU kernels over bfloat16 activations."""
    if requested == "none":
        return "none", "set in the configuration"
    if device != "cpu":
        return "none", f"{requested} weights use CPU kernels; dense weights on {device}"
    if dtype != "bfloat16":
        return "none", f"{requested} weights need dtype bfloat16 (the dtype is {dtype}); dense weights instead"
    return requested, "set in the configuration"


def serving_threads() -> int:
    """torch intra-op threads for `num_threads: 0`: every core but one. The server's own threads (HTTP/gRPC,
    response sending, metrics) need a core; when they take one from torch's workers, each op waits for the
    preempted worker (measured on 2 cores through Triton: 82 tok/s at batch 1 with one thread, 56 with two)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores - 1)
