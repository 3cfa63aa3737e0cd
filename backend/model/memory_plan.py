"""The memory a model will hold, said before anything large is allocated, and a model that does not fit refused with
the arithmetic (never left to the kernel's OOM killer).

Weights come from the file's tensor table (`gguf_weights.planned_bytes`) or the model's parameter count; the KV
cache from its configured size; the runtime is this process's resident memory when planning (interpreter, torch,
tokenizers, whatever else the process already holds); the step's activations from the largest step the scheduler
may run. Available memory is the system's MemAvailable, or the cgroup's limit less its use where that is lower.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

MIB = 2**20


def resident_bytes() -> int:
    """This process's resident memory."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def available_bytes() -> int | None:
    """What this process may still allocate: MemAvailable, or the cgroup (v2) limit less its use where lower; None
    where neither can be read (not Linux)."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        group = Path("/proc/self/cgroup").read_text().strip().split("::", 1)[1]
        folder = Path("/sys/fs/cgroup") / group.lstrip("/")
        limit = (folder / "memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int((folder / "memory.current").read_text()))
    except (OSError, IndexError, ValueError):
        pass
    return min(found) if found else None


@dataclass
class MemoryPlan:
    weights: int
    kv_cache: int
    kv_tokens: int
    activations: int
    runtime: int
    available: int | None

    @property
    def needed(self) -> int:
        """What loading will add to this process."""
        return self.weights + self.kv_cache + self.activations

    def describe(self) -> str:
        parts = (
            f"weights {self.weights / MIB:,.0f} MiB + KV cache {self.kv_cache / MIB:,.0f} MiB ({self.kv_tokens:,} "
            f"tokens) + the largest step's activations {self.activations / MIB:,.0f} MiB = {self.needed / MIB:,.0f} "
            f"MiB to load, beside the {self.runtime / MIB:,.0f} MiB this process holds"
        )
        if self.available is None:
            return parts + " (available memory unknown here)"
        return parts + f", of {self.available / MIB:,.0f} MiB available"

    def check(self, kv_bytes_per_token: int) -> None:
        """Raises MemoryError (the arithmetic and what to change) where the plan does not fit."""
        if self.available is None or self.needed <= self.available:
            return
        short = self.needed - self.available
        advice = []
        if self.kv_cache > short:
            fits = (self.kv_cache - short) // kv_bytes_per_token
            advice.append(
                f"lower kv_cache_memory_bytes to at most {self.kv_cache - short:,} ({fits:,} tokens at "
                f"{kv_bytes_per_token:,} bytes each)"
            )
        advice.append("serve a smaller quantization of the model (fewer bits per weight)")
        advice.append("or free memory on this machine")
        raise MemoryError(f"the model does not fit in memory: {self.describe()}; {', '.join(advice)}")
