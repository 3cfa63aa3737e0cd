"""A Llama-family GGUF's tensors (llama, mistral, qwen2, qwen3) under Hugging Face's parameter names, read from the
memory-mapped file into the form the fused path serves, with no dense copy of what the kernel covers.

Every weight of a block type `gguf_formats.py` decodes is packed for the low-bit kernel straight from the file's
blocks, one tensor at a time, into one arena on huge pages sized beforehand (`weight_blocks.packed_bytes`): the
resident weights are the packed blocks plus the small tensors (norms, biases) in fp32. Weights of other types
(Q2_K, Q3_K, the IQ types, F32) are de-quantized with gguf-py and served dense; where one part of a fused
projection (q/k/v, gate/up) is such a type, the whole projection is. The tied LM head reads the embedding's blocks.

The blocks are the reference weights: transformers' GGUF loader de-quantizes exactly these with gguf-py, and each
decoder is held to that bit for bit (tests/unit/test_gguf_formats.py). `verified_blocks` checks a model folder's
fp32 weights against its GGUF the same way (`python -m backend.model.gguf_weights --verify MODEL`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from backend.model import gguf_formats, huge_pages
from backend.model.gguf_file import read_gguf
from backend.model.model_source import GGUF_NAME
from backend.model.model_weights import ModelWeights
from backend.model.weight_blocks import BLOCK, Blocks, Packed, packed_bytes

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output": "lm_head", "output_norm": "model.norm"}
# Projections that the fused path computes as one matmul: served from blocks only all together.
_FUSED = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))
# llama.cpp's converter permutes q and k rows for these architectures only (not qwen2 / qwen3), and transformers'
# GGUF loader undoes it for them.
_ROPE_PERMUTED = ("llama", "mistral")


def find_gguf(model_dir: str | Path) -> Path | None:
    path = Path(model_dir) / GGUF_NAME
    return path if path.is_file() else None


def hf_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`, `output_norm.weight` ->
    `model.norm.weight`; None for tensors the fused path does not read."""
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def _rope_rows(rows: int, heads: int) -> torch.Tensor:
    """llama.cpp stores q and k rows permuted for its RoPE layout; row i of the Hugging Face weight is GGUF row
    `index[i]` (the inverse of the converter's permutation, as transformers' GGUF loader undoes it)."""
    dim = rows // heads // 2
    return torch.arange(rows).reshape(heads, dim, 2).transpose(1, 2).reshape(rows)


@dataclass
class _Tensor:
    name: str  # Hugging Face's
    type_name: str
    shape: tuple[int, ...]  # rows first
    raw: np.ndarray  # the file's bytes, [*shape[:-1], bytes per row], memory-mapped
    rows_index: torch.Tensor | None  # RoPE's un-permutation (q and k of llama / mistral)
    release: Callable[[], None]  # drops its mapped pages (RawTensor.release)
    format: str | None = None  # the record format, where the kernel serves it

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class GGUFFile:
    """The tensors of a GGUF the fused path reads, memory-mapped (nothing is read until a tensor is used)."""

    def __init__(self, path: Path, num_heads: int, num_kv_heads: int):
        self.path = path
        fields, tensors = read_gguf(path, arrays=False)
        self.architecture = fields["general.architecture"][0]
        permuted = self.architecture in _ROPE_PERMUTED
        self.tensors: dict[str, _Tensor] = {}
        self.roles: dict[str, str] = {}  # HF name -> GGUF role (attn_q, ffn_up, token_embd, ...)
        for gguf_name, tensor in tensors.items():
            name = hf_name(gguf_name)
            if name is None:
                continue
            role = gguf_name.split(".")[-2]
            index = None
            if permuted and role in ("attn_q", "attn_k") and gguf_name.endswith(".weight"):
                index = _rope_rows(tensor.shape[0], num_heads if role == "attn_q" else num_kv_heads)
            self.tensors[name] = _Tensor(name, tensor.type_name, tensor.shape, tensor.raw, index, tensor.release)
            self.roles[name] = role

    def kernel_formats(self) -> None:
        """Sets each weight's record format where the kernel serves it: a decoded type, 32-wide blocks, and every
        part of its fused projection served too."""
        for t in self.tensors.values():
            if t.name.endswith(".weight") and len(t.shape) == 2:
                fmt = gguf_formats.record_format(t.type_name, t.raw)
                t.format = fmt if fmt is not None and t.shape[1] % BLOCK == 0 else None
        for group in _FUSED:
            for layer in {n.split(".")[2] for n, r in self.roles.items() if r == group[0]}:
                parts = [self.tensors.get(f"model.layers.{layer}.{_LAYER_NAMES[role]}.weight") for role in group]
                if any(p is None or p.format is None for p in parts):
                    for p in parts:
                        if p is not None:
                            p.format = None

    def blocks(self, t: _Tensor) -> Blocks:
        b = gguf_formats.decode(t.type_name, t.raw)
        return b if t.rows_index is None else b.rows(t.rows_index)

    def dense(self, t: _Tensor) -> torch.Tensor:
        """The tensor in fp32, as transformers' GGUF loader de-quantizes it."""
        import gguf

        if t.type_name == "F32":
            values = torch.from_numpy(np.array(t.raw).view(np.float32).reshape(t.shape))
        elif t.type_name in gguf_formats.DECODERS and len(t.shape) == 2:
            values = gguf_formats.decode(t.type_name, t.raw).dequantize()
        else:
            qtype = gguf.GGMLQuantizationType[t.type_name]
            values = torch.from_numpy(np.array(gguf.quants.dequantize(t.raw, qtype), dtype=np.float32))
        values = values.reshape(t.shape)
        return values if t.rows_index is None else values[t.rows_index]


def load(model_dir: str | Path, num_heads: int, num_kv_heads: int) -> ModelWeights:
    """The model's weights from its GGUF (see the module's docstring): packed blocks in one huge-page arena, the
    rest in fp32."""
    started = time.perf_counter()
    file = GGUFFile(find_gguf(model_dir), num_heads, num_kv_heads)
    file.kernel_formats()
    served = [t for t in file.tensors.values() if t.format is not None]
    sizes = [packed_bytes(t.format, *t.shape) for t in served]
    arena = huge_pages.empty_bytes(sum(sizes))
    blocks, offset = {}, 0
    for t, size in zip(served, sizes):
        packed = file.blocks(t).pack()
        blocks[t.name] = Packed(t.format, t.shape[0], arena[offset : offset + size].copy_(packed))
        t.release()
        offset += size
    dense = {t.name: file.dense(t) for t in file.tensors.values() if t.format is None}
    return ModelWeights.read(dense, blocks, arena, file.path.name, started, tied=True)  # no output: tied


def planned_bytes(model_dir: str | Path, num_heads: int, num_kv_heads: int) -> int:
    """What `load` will hold resident for this model, from the file's tensor table (reads no weight but Q4_0's
    scales)."""
    file = GGUFFile(find_gguf(model_dir), num_heads, num_kv_heads)
    file.kernel_formats()
    return sum(packed_bytes(t.format, *t.shape) if t.format else 4 * t.numel for t in file.tensors.values())


def verified_blocks(model_dir: str | Path, hf_model) -> tuple[dict[str, Blocks], str]:
    """(blocks whose de-quantization equals the loaded fp32 weight bit for bit, a line saying how many differ):
    checks that a folder's fp32 weights are its GGUF's (transformers' GGUF loader gives them so)."""
    path = find_gguf(model_dir)
    if path is None:
        return {}, f"no {GGUF_NAME} beside the model"
    config = hf_model.config
    heads = config.num_attention_heads
    file = GGUFFile(path, heads, getattr(config, "num_key_value_heads", None) or heads)
    params = dict(hf_model.named_parameters(remove_duplicate=False))
    exact, mismatched = {}, []
    for name, t in file.tensors.items():
        weight = params.get(name)
        if weight is None or t.type_name not in gguf_formats.DECODERS or len(t.shape) != 2:
            continue
        b = file.blocks(t)
        if weight.dtype == torch.float32 and tuple(weight.shape) == b.shape and torch.equal(b.dequantize(), weight):
            exact[name] = b
        else:
            mismatched.append(name)
    embed, lm_head = hf_model.get_input_embeddings().weight, hf_model.get_output_embeddings().weight
    if "model.embed_tokens.weight" in exact and lm_head.data_ptr() == embed.data_ptr():
        exact["lm_head.weight"] = exact["model.embed_tokens.weight"]  # tied: the LM head is the embedding
    why = f"{len(exact)} weights in {path.name} equal the fp32 weights bit for bit"
    if mismatched:
        why += f"; {len(mismatched)} differ (first: {mismatched[0]})"
    return exact, why


def main(argv: list[str] | None = None) -> None:
    """`python -m backend.model.gguf_weights [--verify] MODEL`: say what the fused path reads from a model's GGUF;
    with --verify, also check every block against transformers' de-quantization of the file (loads the model in
    fp32: several times the GGUF's memory)."""
    import argparse

    from backend.model import model_source

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("model")
    ap.add_argument("--verify", action="store_true")
    args = ap.parse_args(argv)
    model_dir = model_source.resolve(args.model)
    if find_gguf(model_dir) is None:
        print(f"{model_dir}: no {GGUF_NAME}; nothing to read")
        return
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    print(f"{model_dir}: {planned_bytes(model_dir, heads, kv_heads) / 2**20:.1f} MiB of weights to serve")
    if args.verify:
        model = model_source.load_model(model_dir, dtype=torch.float32)
        _, why = verified_blocks(model_dir, model)
        print(why)
        if "differ" in why:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
