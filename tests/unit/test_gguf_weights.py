"""The GGUF's own blocks are the reference weights: read under Hugging Face's names, rows un-permuted for
RoPE, and checked bit for bit against the converted fp32 folder before they are served."""

from __future__ import annotations

import pytest
import torch

from backend.model.gguf_weights import find_gguf, hf_name, verified_blocks
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
    assert hf_name("blk.0.attn_norm.weight") is None


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


def test_the_packed_cache_returns_what_it_stored(smol, tmp_path, monkeypatch):
    from backend.model.gguf_weights import verified_packed

    monkeypatch.setenv("LLM_WEIGHT_CACHE", str(tmp_path))
    first, why = verified_packed(SMOL_DIR, smol)
    assert len(list(tmp_path.glob("*.safetensors"))) == 1
    again, why_again = verified_packed(SMOL_DIR, smol)
    assert "checked when" in why_again and why in why_again
    assert first.keys() == again.keys()
    for name, packed in first.items():
        assert (again[name].format, again[name].rows) == (packed.format, packed.rows)
        assert torch.equal(again[name].data, packed.data), name
