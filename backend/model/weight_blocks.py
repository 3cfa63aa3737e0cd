"""Low-bit weights as the linear kernels read them: blocks of 32 inputs per output row, `w = d * q (+ m)`.

Every GGUF block type the kernels serve is decoded into one of six record formats (`gguf_formats.py`), each
weight exactly as gguf-py de-quantizes it: `dequantize` computes that reference (d * q is exact in fp32, so one
rounding at most, in `+ m`), which is how the loaded fp32 model is checked to hold these very blocks. `pack` lays
blocks out for the C++ kernel (see `kernels/lowbit.cpp`). `HalfWeights` are the 16-bit kinds (GGUF F16 / BF16, a
checkpoint's bf16 or fp16 weights): no blocks, the same interface.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # inputs per block
TILE = 16  # output rows per kernel tile
# format -> (the kernel's code, bits per q, whether blocks have m, the dtype of d and m)
RECORDS = {
    "q4_1": (0, 4, True, torch.float16),
    "q8_0": (1, 8, False, torch.float16),
    "q5_1": (3, 8, True, torch.float16),
    "q4_k": (4, 4, True, torch.float32),
    "q5_k": (5, 8, True, torch.float32),
    "q6_k": (6, 16, False, torch.float16),
}
HALVES = {"f16": (7, torch.float16), "bf16": (8, torch.bfloat16)}  # format -> (the kernel's code, dtype)
FORMATS = {name: record[0] for name, record in (RECORDS | HALVES).items()}  # the kernel's format codes
Q4_1_INT8 = 2  # Q4_1 weights times activations rounded to int8 per block (quantization gguf_int8; not exact)
_Q_DTYPES = {4: torch.uint8, 8: torch.int8, 16: torch.int16}


def packed_bytes(format: str, rows: int, cols: int) -> int:
    """Bytes of a [rows, cols] weight packed in `format` (a key of FORMATS): what `pack` makes, computed without it."""
    if format in HALVES:
        record = TILE * BLOCK * 2
    else:
        _, bits, with_m, scale = RECORDS[format]
        record = (2 if with_m else 1) * TILE * torch.empty((), dtype=scale).element_size() + TILE * BLOCK * bits // 8
    return -(-rows // TILE) * (cols // BLOCK) * record


@dataclass
class Packed:
    """A weight's blocks in the kernel's layout (`Blocks.pack`): what a LowBitLinear holds."""

    format: str
    rows: int
    data: torch.Tensor  # uint8

    @property
    def columns(self) -> int:
        """Inputs per row."""
        return self.data.numel() // packed_bytes(self.format, self.rows, BLOCK) * BLOCK

    @staticmethod
    def segments(parts: list[Packed]) -> list[Packed]:
        """Several weights' output rows one after another (fused projections) in as few kernel calls as their
        formats allow: a run of one format becomes one record set, its records concatenated (which is the packing
        of the concatenation where every part but the run's last fills whole tiles). Parts that already lie side
        by side in one buffer (a loaded model's arena) are joined as a view of it, without a copy."""
        runs = [parts[0]]
        for part in parts[1:]:
            last = runs[-1]
            if part.format == last.format and last.rows % TILE == 0:
                runs[-1] = Packed(last.format, last.rows + part.rows, _joined(last.data, part.data))
            else:
                runs.append(part)
        return runs


def _joined(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """first and second (1-D uint8) one after the other: a view where second follows first in the same storage."""
    same = first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    if same and first.is_contiguous() and second.storage_offset() == first.storage_offset() + first.numel():
        return first.new_empty(0).set_(
            first.untyped_storage(), first.storage_offset(), (first.numel() + second.numel(),)
        )
    return torch.cat([first, second])


@dataclass
class Blocks:
    format: str  # a key of RECORDS
    d: torch.Tensor  # [N, K / 32], the format's scale dtype
    m: torch.Tensor | None  # [N, K / 32] (formats with m), else None
    q: torch.Tensor  # [N, K / 32, 32]: uint8 0..15 (4-bit), int8 or int16

    def __post_init__(self):
        _, bits, with_m, scale = RECORDS[self.format]
        if self.d.dtype != scale or (self.m is not None) != with_m or (with_m and self.m.dtype != scale):
            raise ValueError(f"{self.format} blocks need d{' and m' if with_m else ''} of {scale}")
        if self.q.dtype != _Q_DTYPES[bits]:
            raise ValueError(f"{self.format} blocks need q of {_Q_DTYPES[bits]}, got {self.q.dtype}")

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

    def packed(self) -> Packed:
        return Packed(self.format, self.shape[0], self.pack())

    def pack(self) -> torch.Tensor:
        """uint8 records for `lowbit_linear`: rows in tiles of 16 (the last padded with zero rows), per tile and
        block the tile's d (and m) then 32-bit words, 16 per group of consecutive inputs, one per row: 4-bit words
        hold 8 inputs (input j in bits 4j..4j+3), 8-bit words 4 (input j in byte j), 16-bit words 2. See
        `kernels/lowbit.cpp`."""
        rows, _ = self.shape
        pad = -rows % TILE
        d, m, q = self.d, self.m, self.q
        if pad:
            d = torch.cat([d, d.new_zeros(pad, d.shape[1])])
            m = None if m is None else torch.cat([m, m.new_zeros(pad, m.shape[1])])
            q = torch.cat([q, q.new_zeros(pad, *q.shape[1:])])
        tiles, blocks = d.shape[0] // TILE, d.shape[1]

        def per_tile(t: torch.Tensor) -> torch.Tensor:  # [N, B] -> [T, B, 16 scales' bytes]
            return t.view(tiles, TILE, blocks).transpose(1, 2).contiguous().view(torch.uint8)

        per_word = 32 // RECORDS[self.format][1]
        # [T, B, word, row, input in the word]
        words = q.view(tiles, TILE, blocks, BLOCK // per_word, per_word).permute(0, 2, 3, 1, 4)
        if per_word == 8:
            words = words[..., 0::2] | (words[..., 1::2] << 4)  # two nibbles per byte
        words = words.contiguous().view(torch.uint8)  # little-endian: input 0 in the low bits
        parts = [per_tile(d)] + ([] if m is None else [per_tile(m)]) + [words.reshape(tiles, blocks, -1)]
        return torch.cat(parts, dim=-1).contiguous().view(-1)


@dataclass
class HalfWeights:
    """A weight stored in 16 bits (fp16 or bf16): each value converts to fp32 exactly, so the kernel reads two
    bytes per weight and computes the fp32 model (`Blocks`' interface)."""

    format: str  # a key of HALVES
    values: torch.Tensor  # [N, K] of the format's dtype

    def __post_init__(self):
        if self.values.dtype != HALVES[self.format][1]:
            raise ValueError(f"{self.format} weights need {HALVES[self.format][1]}, got {self.values.dtype}")

    @staticmethod
    def of(weight: torch.Tensor) -> HalfWeights | None:
        """The 16-bit form of an fp32 weight that one holds exactly (bf16 tried first), else None."""
        for name in ("bf16", "f16"):
            values = weight.to(HALVES[name][1])
            if torch.equal(values.float(), weight):
                return HalfWeights(name, values.contiguous())
        return None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    def dequantize(self) -> torch.Tensor:
        return self.values.float()

    def rows(self, index: torch.Tensor) -> HalfWeights:
        return HalfWeights(self.format, self.values[index])

    def packed(self) -> Packed:
        return Packed(self.format, self.shape[0], self.pack())

    def pack(self) -> torch.Tensor:
        """uint8: rows in tiles of 16 (the last padded with zero rows), each tile input-major (16 rows' input 0,
        then input 1, ...), as the kernel's dense tiles are laid out."""
        rows, cols = self.shape
        v = self.values.view(torch.int16)
        v = torch.cat([v, v.new_zeros(-rows % TILE, cols)])
        return v.view(-1, TILE, cols).transpose(1, 2).contiguous().view(torch.uint8).view(-1)


def quantize_q8_0(weight: torch.Tensor) -> Blocks:
    """Q8_0 of a dense weight, as llama.cpp rounds it (per block: d = max|w| / 127, q = round(w / d)). For
    models not stored in low-bit blocks: the weights change, so such a model is held to the bf16 rule."""
    rows, cols = weight.shape
    w = weight.float().reshape(rows, cols // BLOCK, BLOCK)
    d = (w.abs().amax(-1) / 127).to(torch.float16)
    inverse = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    q = (w * inverse[..., None]).round().clamp(-127, 127).to(torch.int8)
    return Blocks("q8_0", d, None, q)
