"""Low-bit weight blocks in GGUF's formats, as the linear kernels read them.

A weight [N, K] is held as blocks of 32 inputs per output row: Q4_1 (`w = d * q + m`, q in 0..15) or Q8_0
(`w = d * q`, q in -128..127), d and m fp16. `dequantize` computes exactly what Hugging Face's GGUF loader
computes (d * q is exact in fp32, so one rounding, in `+ m`), which is how a converted fp32 folder is checked
to hold these very blocks. `pack` lays blocks out for the C++ kernel (see `kernels/lowbit.cpp`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32  # inputs per block
TILE = 16  # output rows per kernel tile
FORMATS = {"q4_1": 0, "q8_0": 1}  # the kernel's format codes
Q4_1_INT8 = 2  # Q4_1 weights times activations rounded to int8 per block (quantization gguf_int8; not exact)


@dataclass
class Packed:
    """A weight's blocks in the kernel's layout (`Blocks.pack`): what a LowBitLinear holds."""

    format: str
    rows: int
    data: torch.Tensor  # uint8

    @staticmethod
    def cat(parts: list[Packed]) -> Packed | None:
        """Several weights' output rows one after another (fused projections): their records concatenated,
        which is the packing of the concatenation when every part but the last fills whole tiles. None where
        that does not hold or the formats differ (the layer then stays dense)."""
        if len({p.format for p in parts}) != 1 or any(p.rows % TILE for p in parts[:-1]):
            return None
        if len(parts) == 1:
            return parts[0]
        return Packed(parts[0].format, sum(p.rows for p in parts), torch.cat([p.data for p in parts]))


@dataclass
class Blocks:
    format: str  # "q4_1" or "q8_0"
    d: torch.Tensor  # [N, K / 32] float16
    m: torch.Tensor | None  # [N, K / 32] float16 (Q4_1 only)
    q: torch.Tensor  # [N, K / 32, 32]: uint8 0..15 (Q4_1) or int8 (Q8_0)

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * BLOCK

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K], bit for bit the reference de-quantization."""
        w = self.d.float()[..., None] * self.q.float()
        if self.m is not None:
            w = w + self.m.float()[..., None]
        return w.reshape(self.shape)

    def rows(self, index: torch.Tensor) -> Blocks:
        """The same blocks with output rows reordered (`index[i]` is the source row of row i)."""
        return Blocks(self.format, self.d[index], None if self.m is None else self.m[index], self.q[index])

    @staticmethod
    def cat(parts: list[Blocks]) -> Blocks:
        """Output rows of several weights with the same inputs, one after another (fused projections)."""
        formats = {p.format for p in parts}
        if len(formats) != 1:
            raise ValueError(f"cannot fuse blocks of formats {sorted(formats)}")
        m = None if parts[0].m is None else torch.cat([p.m for p in parts])
        return Blocks(parts[0].format, torch.cat([p.d for p in parts]), m, torch.cat([p.q for p in parts]))

    def packed(self) -> Packed:
        return Packed(self.format, self.shape[0], self.pack())

    def pack(self) -> torch.Tensor:
        """uint8 records for `lowbit_linear`: rows in tiles of 16 (the last padded with zero rows), per tile and
        block the tile's d (and m) then 32-bit words, 16 per group of consecutive inputs, one per row: Q4_1 words
        hold 8 inputs (input j in bits 4j..4j+3), Q8_0 words 4 (input j in byte j). See `kernels/lowbit.cpp`."""
        rows, _ = self.shape
        pad = -rows % TILE
        d, m, q = self.d, self.m, self.q
        if pad:
            d = torch.cat([d, d.new_zeros(pad, d.shape[1])])
            m = None if m is None else torch.cat([m, m.new_zeros(pad, m.shape[1])])
            q = torch.cat([q, q.new_zeros(pad, *q.shape[1:])])
        tiles, blocks = d.shape[0] // TILE, d.shape[1]

        def per_tile(t: torch.Tensor) -> torch.Tensor:  # [N, B] fp16 -> [T, B, 32 bytes]
            return t.view(tiles, TILE, blocks).transpose(1, 2).contiguous().view(torch.uint8)

        per_word = 8 if self.format == "q4_1" else 4
        # [T, B, word, row, input in the word]; little-endian bytes of each word
        words = q.view(torch.uint8).view(tiles, TILE, blocks, BLOCK // per_word, per_word).permute(0, 2, 3, 1, 4)
        if self.format == "q4_1":
            words = words[..., 0::2] | (words[..., 1::2] << 4)
            parts = [per_tile(d), per_tile(m)]
        else:
            parts = [per_tile(d)]
        parts.append(words.reshape(tiles, blocks, -1))
        return torch.cat(parts, dim=-1).contiguous().view(-1)


def from_gguf_rows(format: str, raw: np.ndarray) -> Blocks:
    """Blocks from a GGUF tensor's bytes [N, bytes per row]. GGUF's Q4_1 block is d, m (fp16) and 16 bytes
    holding input i in the low nibble and input i + 16 in the high nibble of byte i; Q8_0 is d and 32 int8."""
    rows = raw.shape[0]
    size = 20 if format == "q4_1" else 34
    data = torch.from_numpy(np.array(raw, copy=True)).view(rows, -1, size)
    d = data[..., 0:2].contiguous().view(torch.float16)[..., 0]
    if format == "q4_1":
        m = data[..., 2:4].contiguous().view(torch.float16)[..., 0]
        packed = data[..., 4:]
        q = torch.cat([packed & 0xF, packed >> 4], dim=-1)
        return Blocks("q4_1", d, m, q.contiguous())
    return Blocks("q8_0", d, None, data[..., 2:].contiguous().view(torch.int8))


def quantize_q8_0(weight: torch.Tensor) -> Blocks:
    """Q8_0 of a dense weight, as llama.cpp rounds it (per block: d = max|w| / 127, q = round(w / d)). For
    models not stored in low-bit blocks: the weights change, so such a model is held to the bf16 rule."""
    rows, cols = weight.shape
    w = weight.float().reshape(rows, cols // BLOCK, BLOCK)
    d = (w.abs().amax(-1) / 127).to(torch.float16)
    inverse = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    q = (w * inverse[..., None]).round().clamp(-127, 127).to(torch.int8)
    return Blocks("q8_0", d, None, q)
