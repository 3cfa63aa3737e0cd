"""Each GGUF block decoder against gguf-py's de-quantization (what transformers loads), bit for bit, and its
records through the kernel against the dense fp32 matmul."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from backend.model import gguf_formats, kernels
from backend.model.weight_blocks import FORMATS

ROWS, COLS = 24, 512


def encoded(type_name: str, seed: int = 0) -> np.ndarray:
    """A tensor of `type_name` [ROWS, bytes per row]: gguf-py's quantizer for 32-input types; for K-quants
    random bytes (every byte pattern is a valid encoding) with scales of a realistic size."""
    rng = np.random.default_rng(seed)
    if type_name not in ("Q4_K", "Q5_K", "Q6_K"):
        weights = (rng.standard_normal((ROWS, COLS)) * 0.05).astype(np.float32)
        return gguf.quants.quantize(weights, GGMLQuantizationType[type_name])
    size = gguf_formats.DECODERS[type_name][0]
    raw = rng.integers(0, 256, (ROWS, COLS // 256, size), dtype=np.uint8)
    for offset in (208,) if type_name == "Q6_K" else (0, 2):  # d (and dmin)
        scale = rng.uniform(2e-4, 2e-3, (ROWS, COLS // 256, 1)).astype(np.float16)
        raw[..., offset : offset + 2] = scale.view(np.uint8)
    return raw.reshape(ROWS, -1)


@pytest.mark.parametrize("type_name", gguf_formats.DECODERS)
def test_decoded_blocks_are_gguf_pys_weights_bit_for_bit(type_name):
    raw = encoded(type_name)
    reference = gguf.quants.dequantize(raw, GGMLQuantizationType[type_name])
    blocks = gguf_formats.decode(type_name, raw)
    assert blocks.shape == (ROWS, COLS)
    assert torch.equal(blocks.dequantize(), torch.from_numpy(reference))
    assert np.abs(reference).max() > 0 and (reference < 0).any() and (reference > 0).any()


def test_a_changed_byte_shows():
    """The comparison above can fail: one q bit changed in a K-quant block changes the weights."""
    raw = encoded("Q5_K")
    raw[3, 100] ^= 0x10
    reference = gguf.quants.dequantize(encoded("Q5_K"), GGMLQuantizationType.Q5_K)
    assert not torch.equal(gguf_formats.decode("Q5_K", raw).dequantize(), torch.from_numpy(reference))


def test_types_without_a_decoder_are_served_dense():
    raw = np.zeros((4, 2 * COLS), dtype=np.uint8)
    assert gguf_formats.decode("F32", raw) is None
    assert gguf_formats.decode("Q2_K", raw) is None


def test_q4_0_whose_offset_overflows_fp16_becomes_q8_0_records_of_the_same_weights():
    raw = encoded("Q4_0")
    raw[0, 0:2] = np.array([60000], dtype=np.float16).view(np.uint8)  # -8d is past fp16's range
    blocks = gguf_formats.decode("Q4_0", raw)
    assert blocks.format == "q8_0" == gguf_formats.record_format("Q4_0", raw)
    reference = gguf.quants.dequantize(raw, GGMLQuantizationType.Q4_0)
    assert torch.equal(blocks.dequantize(), torch.from_numpy(reference))
    assert gguf_formats.record_format("Q4_0", encoded("Q4_0")) == "q4_1"


@pytest.mark.parametrize("type_name", gguf_formats.DECODERS)
def test_record_format_names_what_decode_makes(type_name):
    raw = encoded(type_name)
    assert gguf_formats.record_format(type_name, raw) == gguf_formats.decode(type_name, raw).format


@pytest.mark.parametrize("type_name", gguf_formats.DECODERS)
def test_the_kernel_computes_each_decoded_type(type_name):
    module = kernels.load()
    assert module is not None, kernels.load_error()
    blocks = gguf_formats.decode(type_name, encoded(type_name, seed=1))
    x = torch.randn(9, COLS, generator=torch.Generator().manual_seed(3))
    exact = x.double() @ blocks.dequantize().double().T
    torch_error = ((x @ blocks.dequantize().T).double() - exact).abs().max().item()
    for m in (1, 4, 9):
        got = module.lowbit_linear(x[:m], blocks.pack(), ROWS, FORMATS[blocks.format], kernels.best_isa())
        assert (got.double() - exact[:m]).abs().max().item() <= 4 * torch_error
