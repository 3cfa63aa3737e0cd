"""backend/model/huge_pages.py: tensors equal to torch's, in memory the kernel backs with 2 MiB pages where it
offers them, and plain torch tensors where it does not."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from backend.model import huge_pages
from tests.conftest import machine_lacks

needs_huge_pages = pytest.mark.skipif(not huge_pages.available(), reason=machine_lacks("huge pages"))


def mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding `address`."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            if inside:
                break
            inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


@pytest.mark.parametrize("available", [True, False])
def test_gather_copies_side_by_side_each_on_a_cache_line(monkeypatch, available):
    if available and not huge_pages.available():
        pytest.skip(machine_lacks("huge pages"))
    monkeypatch.setattr(huge_pages, "available", lambda: available)
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randint(0, 255, (1000,), dtype=torch.uint8, generator=g),
        torch.randn(3, 5, generator=g),
        torch.empty(0, dtype=torch.uint8),
        torch.randn(4, 6, generator=g)[:, ::2],  # not contiguous
        torch.arange(7, dtype=torch.int64),
    ]
    copies = huge_pages.gather(tensors)
    base = copies[0].data_ptr()
    for original, copy in zip(tensors, copies):
        assert copy.dtype == original.dtype and copy.shape == original.shape and copy.is_contiguous()
        assert torch.equal(copy, original)
        assert copy.data_ptr() % huge_pages.ALIGN == 0
        if copy.numel():
            assert copy.untyped_storage().data_ptr() == copies[0].untyped_storage().data_ptr()  # one region
    assert copies[1].data_ptr() - base == 1024  # 1000 bytes rounded up to the next cache line
    original = tensors[0].clone()
    copies[0].zero_()
    assert torch.equal(tensors[0], original)  # copies, not views


@needs_huge_pages
def test_the_region_is_aligned_to_and_eligible_for_huge_pages():
    cache = huge_pages.zeros((3, 2, 700, 16, 64), torch.float32)
    assert cache.shape == (3, 2, 700, 16, 64) and cache.dtype == torch.float32
    assert not cache.any()
    assert cache.data_ptr() % huge_pages.HUGE_PAGE == 0
    smaps = mapping_of(cache.data_ptr())
    assert "hg" in smaps["VmFlags"].split()  # madvise(MADV_HUGEPAGE) took
    if "THPeligible" in smaps:
        assert smaps["THPeligible"] == "1"


def test_without_huge_pages_zeros_is_torch_zeros(monkeypatch):
    monkeypatch.setattr(huge_pages, "available", lambda: False)
    cache = huge_pages.zeros((2, 3, 4), torch.bfloat16)
    assert torch.equal(cache, torch.zeros(2, 3, 4, dtype=torch.bfloat16))
    assert "default pages" in huge_pages.describe()


@pytest.mark.parametrize(
    "setting,mode",
    [
        ("always [madvise] never\n", "madvise"),
        ("[always] madvise never\n", "always"),
        ("always madvise [never]\n", "never"),
    ],
)
def test_mode_reads_the_systems_setting(tmp_path, monkeypatch, setting, mode):
    path = tmp_path / "enabled"
    path.write_text(setting)
    monkeypatch.setattr(huge_pages, "THP_SETTING", path)
    assert huge_pages.mode() == mode
    assert huge_pages.available() == (mode != "never")
    assert f"transparent huge pages: {mode}" in huge_pages.describe()


def test_mode_without_the_setting_is_unavailable(tmp_path, monkeypatch):
    monkeypatch.setattr(huge_pages, "THP_SETTING", tmp_path / "absent")
    assert huge_pages.mode() == "unavailable" and not huge_pages.available()
