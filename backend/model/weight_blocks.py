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
SUPER = 8  # blocks per K-quant super-block (256 inputs)
# format -> (the kernel's code, bits per q, whether blocks have m); d and m are fp16
RECORDS = {
    "q4_1": (0, 4, True),
    "q8_0": (1, 8, False),
    "q5_1": (3, 8, True),
    "q4_k": (4, 4, True),
    "q5_k": (5, 8, True),
    "q6_k": (6, 8, False),
}
# K-quants keep two-level scales, as the file does: d (and m) per super-block, integer scales (and mins) per block
# (Q6_K: per 16-input half block) -> how many integer scales per block, and their dtype
K_SCALES = {"q4_k": (1, torch.uint8), "q5_k": (1, torch.uint8), "q6_k": (2, torch.int8)}
HALVES = {"f16": (7, torch.float16), "bf16": (8, torch.bfloat16)}  # format -> (the kernel's code, dtype)
FORMATS = {name: record[0] for name, record in (RECORDS | HALVES).items()}  # the kernel's format codes
Q4_1_INT8 = 2  # Q4_1 weights times activations rounded to int8 per block (quantization gguf_int8; not exact)
_Q_DTYPES = {4: torch.uint8, 8: torch.int8}


def packed_bytes(format: str, rows: int, cols: int) -> int:
    """Bytes of a [rows, cols] weight packed in `format` (a key of FORMATS): what `pack` makes, computed without it."""
    tiles = -(-rows // TILE)
    if format in HALVES:
        return tiles * cols * TILE * 2
    _, bits, with_m = RECORDS[format]
    words = TILE * BLOCK * bits // 8  # one block's
    scales = 2 if with_m else 1
    if format in K_SCALES:
        header = scales * TILE * 2 + scales * SUPER * K_SCALES[format][0] * TILE
        return tiles * (cols // (BLOCK * SUPER)) * (header + SUPER * words)
    return tiles * (cols // BLOCK) * (scales * TILE * 2 + words)


def _unit(format: str) -> int:
    """Inputs per record set of `format`: a block, or a K-quant's super-block."""
    return BLOCK * SUPER if format in K_SCALES else BLOCK


@dataclass
class Packed:
    """A weight's blocks in the kernel's layout (`Blocks.pack`): what a LowBitLinear holds."""

    format: str
    rows: int
    data: torch.Tensor  # uint8

    @property
    def columns(self) -> int:
        """Inputs per row."""
        unit = _unit(self.format)
        return self.data.numel() // packed_bytes(self.format, self.rows, unit) * unit

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
    """Blocks of 32 inputs per row. Plain formats: `d`, `m` [N, K / 32] fp16 per block. K-quants (K_SCALES): `d`,
    `m` [N, K / 256] fp16 per super-block and `scales`, `mins` [N, K / 256, 8 (Q6_K: 16)] integers, a block's scale
    being d * scale (m: -(m * min)), exact in fp32."""

    format: str  # a key of RECORDS
    d: torch.Tensor
    m: torch.Tensor | None
    q: torch.Tensor  # [N, K / 32, 32]: uint8 0..15 (4-bit) or int8
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None

    def __post_init__(self):
        _, bits, with_m = RECORDS[self.format]
        if (
            self.d.dtype != torch.float16
            or (self.m is not None) != with_m
            or (with_m and self.m.dtype != torch.float16)
        ):
            raise ValueError(f"{self.format} blocks need fp16 d{' and m' if with_m else ''}")
        if self.q.dtype != _Q_DTYPES[bits]:
            raise ValueError(f"{self.format} blocks need q of {_Q_DTYPES[bits]}, got {self.q.dtype}")
        if self.format in K_SCALES:
            per_block, dtype = K_SCALES[self.format]
            if self.scales is None or self.scales.dtype != dtype or self.scales.shape[-1] != SUPER * per_block:
                raise ValueError(f"{self.format} blocks need {dtype} scales, {SUPER * per_block} per super-block")
            if with_m and (self.mins is None or self.mins.dtype != dtype):
                raise ValueError(f"{self.format} blocks need {dtype} mins")

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * BLOCK

    def block_scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(d, m) in fp32 per block of 32 inputs ([N, K / 32]; Q6_K's d per 16 inputs, [N, K / 16]), exactly."""
        if self.format not in K_SCALES:
            return self.d.float(), None if self.m is None else self.m.float()
        rows = self.q.shape[0]
        d = (self.d.float()[..., None] * self.scales.float()).reshape(rows, -1)
        m = None if self.m is None else (-(self.m.float()[..., None] * self.mins.float())).reshape(rows, -1)
        return d, m

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K], bit for bit the reference de-quantization."""
        d, m = self.block_scales()
        rows, blocks = self.q.shape[:2]
        w = d[..., None] * self.q.float().reshape(rows, d.shape[1], -1)
        if m is not None:
            w = w + m[..., None]
        return w.reshape(self.shape)

    def rows(self, index: torch.Tensor) -> Blocks:
        """The same blocks with output rows reordered (`index[i]` is the source row of row i)."""
        pick = [None if t is None else t[index] for t in (self.d, self.m, self.q, self.scales, self.mins)]
        return Blocks(self.format, *pick)

    def packed(self) -> Packed:
        return Packed(self.format, self.shape[0], self.pack())

    def pack(self) -> torch.Tensor:
        """uint8 records for `lowbit_linear`: rows in tiles of 16 (the last padded with zero rows); per tile and
        block (K-quants: per tile and super-block, see `kernels/lowbit.cpp`) the tile's scales, then 32-bit words,
        16 per group of consecutive inputs, one per row: 4-bit words hold 8 inputs (input j in bits 4j..4j+3),
        8-bit words 4 (input j in byte j)."""
        rows, _ = self.shape
        pad = -rows % TILE
        fields = [self.d, self.m, self.q, self.scales, self.mins]
        if pad:
            fields = [None if t is None else torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) for t in fields]
        d, m, q, scales, mins = fields
        tiles, blocks = q.shape[0] // TILE, q.shape[1]

        def per_tile(t: torch.Tensor) -> torch.Tensor:  # [N, G, ...] -> [T, G, ... x 16 rows' bytes]
            groups = t.shape[1]
            moved = t.view(tiles, TILE, groups, -1).permute(0, 2, 3, 1).contiguous()
            return moved.view(torch.uint8).reshape(tiles, groups, -1)

        per_word = 32 // RECORDS[self.format][1]
        # [T, B, word, row, input in the word]
        words = q.view(tiles, TILE, blocks, BLOCK // per_word, per_word).permute(0, 2, 3, 1, 4)
        if per_word == 8:
            words = words[..., 0::2] | (words[..., 1::2] << 4)  # two nibbles per byte
        words = words.contiguous().view(torch.uint8).reshape(tiles, blocks, -1)  # little-endian: input 0 low
        if self.format not in K_SCALES:
            parts = [per_tile(d)] + ([] if m is None else [per_tile(m)]) + [words]
            return torch.cat(parts, dim=-1).contiguous().view(-1)
        supers = blocks // SUPER
        header = [per_tile(d)] + ([] if m is None else [per_tile(m)]) + [per_tile(scales)]
        header += [] if mins is None else [per_tile(mins)]
        parts = header + [words.reshape(tiles, supers, -1)]
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
