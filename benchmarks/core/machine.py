"""The machine a report ran on: CPU model and the flags that decide our fast paths (and llama.cpp's), memory,
the kernel instruction set our low-bit kernel picks, library versions, and the load average at the start."""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path

# The CPU flags that decide our fast paths (and llama.cpp's), recorded with every report.
REPORTED_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


def machine_info(threads: int) -> dict:
    cpu, mem_gib = platform.processor() or platform.machine(), float("nan")
    for path, key in (("/proc/cpuinfo", "model name"), ("/proc/meminfo", "MemTotal")):
        try:
            line = next(x for x in Path(path).read_text().splitlines() if x.startswith(key))
        except (OSError, StopIteration):
            continue
        if key == "MemTotal":
            mem_gib = int(line.split()[1]) / 2**20
        else:
            cpu = line.split(":", 1)[1].strip()
    import torch
    import transformers

    from backend.model import kernels
    from backend.model.hardware import cpu_flags_of_this_machine

    flags = cpu_flags_of_this_machine()
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host_cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "memory_gib": round(mem_gib, 1),
        "cpu_flags": [f for f in REPORTED_FLAGS if f in flags],
        "kernel_isa": kernels.ISA_NAMES[kernels.best_isa()],
        "torch_threads": threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
    }
