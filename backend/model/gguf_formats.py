"""GGUF block types as the kernels' records (`weight_blocks.Blocks`): one decoder per type.

Each decoder reads a tensor's bytes [N, bytes per row] in the layout llama.cpp writes and gguf-py reads, and
returns blocks whose `dequantize` is, bit for bit, what gguf-py's de-quantization gives (tests hold each to it):

- Q4_1, Q8_0, Q5_1: as stored.
- Q4_0 `d * (q - 8)`: Q4_1 records with m = -8d (exact in fp16), since d * q - 8d is the exact product again
  (where -8d overflows fp16, Q8_0 records of q - 8).
- Q5_0 `d * (q - 16)`: Q8_0 records of q - 16.
- Q4_K, Q5_K (super-blocks of 256 inputs, 8 sub-blocks of 32 with 6-bit scales and mins): kept as stored, d
  and dmin per super-block, the scales and mins as bytes; a sub-block's d = d_super * scale and m = -(dmin * min)
  are exact in fp32 (11 + 6 significant bits), so `d * q + m` is gguf-py's `d * q - dm`, the same single rounding.
- Q6_K (16 sub-blocks of 16 with int8 scales): q - 32 as int8, the scales as stored; d_super * scale is exact in
  fp32 (11 + 8 bits) and times q rounds once, as gguf-py's (d * scale) * q does.

- F16, BF16: the values as stored (`HalfWeights`), exact in fp32.

Other types (F32, Q2_K, Q3_K, the IQ types) have no decoder: those weights are served dense, as transformers
de-quantizes them.
"""

from __future__ import annotations

import numpy as np
import torch

from backend.model.weight_blocks import Blocks, HalfWeights

SUPER = 256  # inputs per K-quant super-block


def _half(raw: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte `start` of each block [..., bytes], as float16 [...]."""
    return np.ascontiguousarray(raw[..., start : start + 2]).view(np.float16)[..., 0]


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """16 bytes per 32 inputs: input i in the low nibble of byte i, input i + 16 in the high one."""
    return np.concatenate([packed & 0xF, packed >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """A 32-bit word per block (little-endian), bit i the fifth bit of input i, as 0 or 16 per input."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")
    return (bits << 4).astype(np.uint8)


def _blocks(format, d, m, q) -> Blocks:
    t = torch.from_numpy
    return Blocks(format, t(np.ascontiguousarray(d)), None if m is None else t(np.ascontiguousarray(m)), t(q))


def _q4_0_offset(raw) -> np.ndarray | None:
    """Q4_0's m = -8d in fp16, or None where it overflows fp16 (|d| above 8188)."""
    with np.errstate(over="ignore"):
        m = _half(raw, 0) * np.float16(-8)
    return m if np.isfinite(m).all() else None


def _q4_0(raw):
    m = _q4_0_offset(raw)
    if m is None:  # Q8_0 records of q - 8 instead: the same exact product d * (q - 8)
        return _blocks("q8_0", _half(raw, 0), None, (_nibbles(raw[..., 2:18]).astype(np.int8) - 8).astype(np.int8))
    return _blocks("q4_1", _half(raw, 0), m, _nibbles(raw[..., 2:18]))


def _q4_1(raw):
    return _blocks("q4_1", _half(raw, 0), _half(raw, 2), _nibbles(raw[..., 4:20]))


def _q5_0(raw):
    q = _nibbles(raw[..., 6:22]) | _high_bits(raw[..., 2:6])
    return _blocks("q8_0", _half(raw, 0), None, (q.astype(np.int8) - 16).astype(np.int8))


def _q5_1(raw):
    q = _nibbles(raw[..., 8:24]) | _high_bits(raw[..., 4:8])
    return _blocks("q5_1", _half(raw, 0), _half(raw, 2), q.astype(np.int8))


def _q8_0(raw):
    return _blocks("q8_0", _half(raw, 0), None, np.ascontiguousarray(raw[..., 2:34]).view(np.int8))


def _k_scales(raw: np.ndarray):
    """A Q4_K / Q5_K super-block's d and dmin (fp16, [...]) and its sub-blocks' 6-bit scales and mins (uint8,
    [..., 8]) from the 12 packed bytes."""
    packed = raw[..., 4:16]
    low, high, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scale = np.concatenate([low & 0x3F, (rest & 0x0F) | ((low >> 2) & 0x30)], axis=-1)
    minimum = np.concatenate([high & 0x3F, (rest >> 4) | ((high >> 2) & 0x30)], axis=-1)
    return _half(raw, 0), _half(raw, 2), scale, minimum


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes per super-block: sub-blocks 2c and 2c + 1 are the low and high nibbles of bytes 32c..32c+31."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    return (chunks & 0xF).reshape(*qs.shape[:-1], 8, 32)


def _q4_k(raw):
    return _super_blocks("q4_k", *_k_scales(raw), _k_low_nibbles(raw[..., 16:144]))


def _q5_k(raw):
    qh = raw[..., 16:48][..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]  # bit j: sub-block j
    q = _k_low_nibbles(raw[..., 48:176]) | ((qh & 1) << 4)
    return _super_blocks("q5_k", *_k_scales(raw), q.astype(np.int8))


def _q6_k(raw):
    lead = raw.shape[:-1]
    low = raw[..., :128].reshape(*lead, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    high = raw[..., 128:192].reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    q6 = ((low & 0xF).reshape(*lead, SUPER) | ((high & 3).reshape(*lead, SUPER) << 4)).astype(np.int8) - 32
    scales = np.ascontiguousarray(raw[..., 192:208]).view(np.int8)
    return _super_blocks("q6_k", _half(raw, 208), None, scales, None, q6.astype(np.int8).reshape(*lead, 8, 32))


def _super_blocks(format, d, dmin, scales, mins, q) -> Blocks:
    """Per super-block d, dmin [N, S], scales, mins [N, S, n] and q [N, S, 8, 32] -> Blocks."""
    t = torch.from_numpy
    rows = q.shape[0]
    return Blocks(
        format,
        t(np.ascontiguousarray(d)),
        None if dmin is None else t(np.ascontiguousarray(dmin)),
        t(np.ascontiguousarray(q.reshape(rows, -1, 32))),
        t(np.ascontiguousarray(scales)),
        None if mins is None else t(np.ascontiguousarray(mins)),
    )


def _half_weights(format: str, dtype: torch.dtype):
    def decoder(raw):
        # a copy: gguf-py maps the file read-only
        values = torch.from_numpy(raw.reshape(raw.shape[0], -1).copy()).view(dtype)
        return HalfWeights(format, values)

    return decoder


# GGUF type name -> (bytes per block, inputs per block, decoder)
DECODERS = {
    "F16": (2, 1, _half_weights("f16", torch.float16)),
    "BF16": (2, 1, _half_weights("bf16", torch.bfloat16)),
    "Q4_0": (18, 32, _q4_0),
    "Q4_1": (20, 32, _q4_1),
    "Q5_0": (22, 32, _q5_0),
    "Q5_1": (24, 32, _q5_1),
    "Q8_0": (34, 32, _q8_0),
    "Q4_K": (144, SUPER, _q4_k),
    "Q5_K": (176, SUPER, _q5_k),
    "Q6_K": (210, SUPER, _q6_k),
}


# GGUF type name -> the record format its decoder makes (Q4_0: q8_0 where -8d overflows fp16, `record_format`)
RECORD_FORMATS = {
    "F16": "f16",
    "BF16": "bf16",
    "Q4_0": "q4_1",
    "Q4_1": "q4_1",
    "Q5_0": "q8_0",
    "Q5_1": "q5_1",
    "Q8_0": "q8_0",
    "Q4_K": "q4_k",
    "Q5_K": "q5_k",
    "Q6_K": "q6_k",
}


def record_format(type_name: str, raw: np.ndarray) -> str | None:
    """The record format `decode` gives a tensor of `type_name` with bytes `raw`, without decoding it; None for
    types served dense."""
    if type_name == "Q4_0" and _q4_0_offset(_as_blocks(type_name, raw)) is None:
        return "q8_0"
    return RECORD_FORMATS.get(type_name)


def _as_blocks(type_name: str, raw: np.ndarray) -> np.ndarray:
    size = DECODERS[type_name][0]
    raw = np.ascontiguousarray(raw).view(np.uint8)  # gguf-py reads F16 tensors as float16, the rest as bytes
    return raw.reshape(raw.shape[0], -1, size)


def decode(type_name: str, raw: np.ndarray) -> Blocks | HalfWeights | None:
    """Blocks of a GGUF tensor of type `type_name` from its bytes [N, bytes per row]; None for types served dense."""
    if type_name not in DECODERS:
        return None
    return DECODERS[type_name][2](_as_blocks(type_name, raw))
