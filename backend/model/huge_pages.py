"""Tensors on transparent huge pages (2 MiB) where the operating system offers them.

A decode step reads every weight block once and the KV cache at blocks scattered over the whole cache. torch
allocates on 4 KiB pages, and with the system's transparent huge pages in `madvise` mode (the common default)
they stay 4 KiB: a one-row step then crosses about 23,000 pages of weights, each a TLB entry to find. The
same weights on 2 MiB pages made the one-row pass over the linear layers about 5 % faster (docs/benchmarks.md).
Where huge pages are not offered (not Linux, or `never`), the same calls return ordinary torch tensors."""

from __future__ import annotations

import ctypes
import math
import mmap
import re
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # where each tensor of `gather` starts: a cache line
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def mode() -> str:
    """The system's transparent huge page setting ("always", "madvise", "never"), or "unavailable"."""
    try:
        found = re.search(r"\[(\w+)\]", THP_SETTING.read_text())
    except OSError:
        return "unavailable"
    return found.group(1) if found else "unavailable"


def available() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and mode() in ("always", "madvise")


def describe() -> str:
    """For the load log: where the weights and the KV cache live, and why."""
    if available():
        return f"weights and KV cache on 2 MiB pages (transparent huge pages: {mode()})"
    return f"weights and KV cache on the default pages (transparent huge pages: {mode()})"


def empty_bytes(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of `nbytes` starting on a huge page boundary, its pages advised to the kernel
    as huge (madvise MADV_HUGEPAGE) before anything touches them, so that their first use faults in 2 MiB pages.
    An ordinary torch tensor (torch allocates it; it frees as any other), a little over one huge page larger."""
    if not available() or nbytes == 0:
        return torch.empty(nbytes, dtype=torch.uint8)
    length = math.ceil(nbytes / HUGE_PAGE) * HUGE_PAGE
    whole = torch.empty(length + HUGE_PAGE, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    _madvise(whole.data_ptr() + start, length, mmap.MADV_HUGEPAGE)  # on failure the pages stay 4 KiB
    return whole[start : start + nbytes]


def _madvise(address: int, length: int, advice: int) -> None:
    libc = ctypes.CDLL(None)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise(address, length, advice)


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on huge pages; every page is written now, at load, not at its first step."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return empty_bytes(nbytes).view(dtype).view(shape).zero_()


def gather(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` side by side in one huge-page region (so small ones share pages), each starting on a
    64-byte boundary; equal to the originals element for element."""
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end = math.ceil((end + t.numel() * t.element_size()) / ALIGN) * ALIGN
    region = empty_bytes(end)
    copies = []
    for t, offset in zip(tensors, offsets):
        copy = region[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        copies.append(copy.copy_(t))
    return copies
