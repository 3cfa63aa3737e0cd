"""The GGUF's own blocks are the reference weights: read under Hugging Face's names, rows un-permuted for
RoPE, straight from the file into one arena, and bit for bit the converted fp32 folder's weights."""

from __future__ import annotations

import pytest
import torch

from backend.model import gguf_weights, kernels
from backend.model.gguf_weights import find_gguf, hf_name, verified_blocks
from backend.model.weight_blocks import FORMATS
from launcher.paths import MODEL_DIR as SMOL_DIR


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoModelForCausalLM

    assert find_gguf(SMOL_DIR) is not None, f"no model.gguf in {SMOL_DIR}: run `make model`"
    return AutoModelForCausalLM.from_pretrained(SMOL_DIR, dtype=torch.float32)


def test_names():
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.29.ffn_down.weight") == "model.layers.29.mlp.down_proj.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.0.attn_norm.weight") == "model.layers.0.input_layernorm.weight"
    assert hf_name("blk.1.attn_q.bias") == "model.layers.1.self_attn.q_proj.bias"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("rope_freqs.weight") is None


def test_every_linear_weight_and_the_tied_head_are_exact(smol):
    blocks, why = verified_blocks(SMOL_DIR, smol)
    layers = smol.config.num_hidden_layers
    assert len(blocks) == 7 * layers + 2, why  # 7 projections per layer, the embedding, the tied LM head
    assert "differ" not in why
    assert blocks["lm_head.weight"].format == "q8_0"
    assert blocks["model.layers.0.self_attn.q_proj.weight"].format == "q4_1"
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight"):
        assert torch.equal(blocks[name].dequantize(), smol.get_parameter(name))  # RoPE rows un-permuted


def test_a_changed_weight_is_not_served_from_the_blocks(smol):
    name = "model.layers.2.mlp.up_proj.weight"
    weight = smol.get_parameter(name)
    saved = weight.data[0, 0].item()
    weight.data[0, 0] += 1e-3
    try:
        blocks, why = verified_blocks(SMOL_DIR, smol)
    finally:
        weight.data[0, 0] = saved
    assert name not in blocks
    assert "1 differ" in why


def test_the_file_read_straight_holds_the_fp32_models_tensors_and_nothing_twice(smol):
    """What `load` serves, read back row by row through the kernel's own lookup (the embedding's path), is the
    converted fp32 folder bit for bit: every weight in blocks, every norm in fp32, the tied head the embedding."""
    module = kernels.load()
    assert module is not None, kernels.load_error()
    config = smol.config
    weights = gguf_weights.load(SMOL_DIR, config.num_attention_heads, config.num_key_value_heads)
    params = dict(smol.named_parameters(remove_duplicate=False))
    assert set(weights.blocks) | set(weights.dense) == set(params)
    assert weights.blocks["lm_head.weight"] is weights.blocks["model.embed_tokens.weight"]
    for name, packed in weights.blocks.items():
        rows = module.lowbit_rows(
            packed.data, packed.rows, packed.columns, FORMATS[packed.format], torch.arange(packed.rows)
        )
        assert torch.equal(rows, params[name]), name
    for name, tensor in weights.dense.items():
        assert torch.equal(tensor, params[name]), name
    first = weights.blocks["model.layers.0.self_attn.q_proj.weight"].data
    assert weights.arena_bytes == sum(p.data.numel() for p in {id(p): p for p in weights.blocks.values()}.values())
    assert first.untyped_storage().data_ptr() == weights.blocks["lm_head.weight"].data.untyped_storage().data_ptr()
    planned = gguf_weights.planned_bytes(SMOL_DIR, config.num_attention_heads, config.num_key_value_heads)
    assert planned == weights.arena_bytes + weights.dense_bytes
