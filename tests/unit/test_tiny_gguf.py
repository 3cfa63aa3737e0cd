"""testkit.tiny_gguf: our K-quant packers against gguf-py's de-quantizers, and each tiny arch written as GGUF,
loaded by transformers, with q/k rows un-permuted back to the intended weights."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from testkit.tiny_gguf import (
    DEFAULT_TYPES,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    SLIDING_WINDOW,
    quantize,
    random_weights,
    read_gguf,
    smollm2_gguf,
    write_tiny_gguf,
)

PROMPT, PROMPT_IDS = "The capital of France is", [504, 3575, 282, 4649, 314]


def _rows(seed: int = 0) -> np.ndarray:
    """4 x 512 weights: plain, shifted mostly positive, one super-block 50x louder than the rest, all negative."""
    rows = (0.02 * np.random.default_rng(seed).standard_normal((4, 512))).astype(np.float32)
    rows[1] += 0.03
    rows[2, :256] *= 50
    rows[3] = -np.abs(rows[3]) - 0.01
    return rows


# tolerance per 256-value super-block: of its range for the affine Q4_K/Q5_K, of its max |x| for symmetric Q6_K
K_TOLERANCE = {QT.Q4_K: 0.04, QT.Q5_K: 0.02, QT.Q6_K: 0.02}


def _k_errors(rows: np.ndarray, raw: np.ndarray, qtype: QT) -> np.ndarray:
    """Max abs error of each super-block over its scale (see K_TOLERANCE)."""
    blocks = rows.reshape(-1, 256)
    err = np.abs(gguf.quants.dequantize(raw, qtype).reshape(-1, 256) - blocks).max(1)
    scale = np.ptp(blocks, axis=1) if qtype != QT.Q6_K else np.abs(blocks).max(1)
    return err / scale


@pytest.mark.parametrize("qtype", list(K_TOLERANCE), ids=lambda t: t.name)
@pytest.mark.parametrize("seed", [0, 1])
def test_k_quant_packer_round_trips_through_gguf_py(qtype, seed):
    rows = _rows(seed)
    raw = quantize(rows, qtype)
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    assert raw.dtype == np.uint8 and raw.shape == (4, 2 * block_bytes)
    assert (_k_errors(rows, raw, qtype) <= K_TOLERANCE[qtype]).all()

    back = gguf.quants.dequantize(raw, qtype)
    assert np.array_equal(np.sign(back[0][np.abs(rows[0]) > 0.01]), np.sign(rows[0][np.abs(rows[0]) > 0.01]))
    assert (back[3] < 0).all() and (back[1] > 0).sum() > 256
    blocks = raw.reshape(-1, block_bytes)
    if qtype == QT.Q6_K:  # 6-bit q below and above its zero point 32, under positive int8 scales
        assert (blocks[:, 192:208].view(np.int8) > 0).all()
    else:  # negative values only come from the mins: dmin > 0 and 6-bit mins in use in every super-block
        assert (blocks[:, 2:4].view(np.float16) > 0).all()
        _, mins = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
        assert (mins.max(1) > 0).all()
    # the bound catches a garbled layout: the same bytes reversed within each block fail it
    garbled = np.ascontiguousarray(blocks[:, ::-1]).reshape(raw.shape)
    with np.errstate(all="ignore"):
        assert not (_k_errors(rows, garbled, qtype) <= K_TOLERANCE[qtype]).all()


def test_zero_rows_stay_zero():
    for qtype in K_TOLERANCE:
        back = gguf.quants.dequantize(quantize(np.zeros((2, 256), np.float32), qtype), qtype)
        assert np.array_equal(back, np.zeros((2, 256), np.float32)), qtype.name


def test_unknown_role_or_type_is_refused(tmp_path):
    with pytest.raises(ValueError, match="attn_qq"):
        write_tiny_gguf(tmp_path / "x.gguf", types={"attn_qq": "Q4_K"})
    with pytest.raises(ValueError, match="Q3_K"):
        write_tiny_gguf(tmp_path / "x.gguf", types={"attn_q": "Q3_K"})


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's RoPE row order back to Hugging Face's (written independently of testkit's permute)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_arch_loads_in_transformers(arch, tiny_gguf):
    tied = arch != "qwen2"  # one untied head
    path, model = tiny_gguf(arch)
    tensors = read_gguf(path)[1]
    expected = {"blk.1.ffn_gate.weight": QT.F32, "blk.0.attn_norm.weight": QT.F32, "blk.0.ffn_down.weight": QT.Q5_K}
    expected |= {f"blk.1.{k[6:]}.weight": QT[v] for k, v in DEFAULT_TYPES.items() if k.startswith("blk.1.")}
    assert {name: tensors[name][0] for name in expected} == expected
    assert ("output.weight" in tensors) != tied

    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (2, 256, 4)
    assert (config.num_key_value_heads, config.vocab_size, config.tie_word_embeddings) == (2, 49152, tied)
    assert (getattr(config, "head_dim", None) or 256 // 4) == HEAD_DIM[arch]

    intended = random_weights(arch, seed=0, tied=tied)
    attn = model.model.layers[0].self_attn
    for role, proj, n_head in (("attn_q", attn.q_proj, HEADS), ("attn_k", attn.k_proj, KV_HEADS)):
        qtype, raw = tensors[f"blk.0.{role}.weight"]
        stored = gguf.quants.dequantize(raw, qtype)
        unpermuted = _unpermute(stored, n_head) if arch == "llama" else stored
        assert torch.equal(proj.weight, torch.from_numpy(unpermuted)), role
        want = intended[f"blk.0.{role}.weight"]
        assert np.abs(unpermuted - want).max() < 0.1 * np.abs(want).max(), role  # quantization error only
        if arch == "llama":  # and the permutation matters: the stored rows are far from the intended ones
            assert np.abs(stored - want).max() > 0.5 * np.abs(want).max(), role
    if arch == "qwen2":
        assert torch.equal(attn.k_proj.bias, torch.from_numpy(intended["blk.0.attn_k.bias"]))
        qtype, raw = tensors["output.weight"]
        assert torch.equal(model.lm_head.weight, torch.from_numpy(gguf.quants.dequantize(raw, qtype)))
    if arch == "qwen3":
        assert torch.equal(attn.q_norm.weight, torch.from_numpy(intended["blk.0.attn_q_norm.weight"]))

    ids = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        first = model.generate(ids, max_new_tokens=8, do_sample=False)
        again = model.generate(ids, max_new_tokens=8, do_sample=False)
    new = first[0, len(PROMPT_IDS) :].tolist()
    assert len(new) == 8 and torch.equal(first, again)
    assert len(set(new)) > 2, new  # not one token repeated


def test_tokenizer_metadata_is_smollm2s_and_files_are_reproducible(tmp_path):
    from transformers import AutoTokenizer

    path = write_tiny_gguf(tmp_path / "tok.gguf", types={"token_embd": "Q4_0"})
    assert write_tiny_gguf(tmp_path / "again.gguf", types={"token_embd": "Q4_0"}).read_bytes() == path.read_bytes()
    copied = {key: field for key, field in read_gguf(path)[0].items() if key.startswith("tokenizer.")}
    source = {key: field for key, field in read_gguf(smollm2_gguf())[0].items() if key.startswith("tokenizer.")}
    assert copied == source and len(copied) == 12
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert len(tokenizer) == 49152
    assert tokenizer(PROMPT).input_ids == PROMPT_IDS
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3"])
def test_the_other_families_load_as_themselves(arch, tiny_gguf):
    """Gemma 2 and 3 (norm weights stored as 1 + w, as llama.cpp writes them; the sliding window) and Phi-3 (one
    qkv tensor, gate and up in ffn_up), as transformers reads them."""
    path, model = tiny_gguf(arch)
    config = model.config
    assert config.model_type in (arch, f"{arch}_text")
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (2, 256, 4)
    layer = model.model.layers[0]
    intended = random_weights(arch, seed=0, tied=arch != "phi3")
    if arch == "phi3":
        assert layer.self_attn.qkv_proj.weight.shape == ((HEADS + 2 * KV_HEADS) * HEAD_DIM[arch], 256)
        assert layer.mlp.gate_up_proj.weight.shape == (2 * 512, 256)
        return
    assert config.sliding_window == SLIDING_WINDOW
    stored = torch.from_numpy(intended["blk.0.post_attention_norm.weight"])
    torch.testing.assert_close(layer.post_attention_layernorm.weight + 1, stored)
