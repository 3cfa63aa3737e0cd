"""The low-bit blocks of a Llama-family GGUF (llama, mistral, qwen2, qwen3), under Hugging Face's parameter names.

A model folder converted from a GGUF (launcher/prepare_model.py) keeps the GGUF beside it as `model.gguf`;
its Q4_1 / Q8_0 blocks are the reference weights (the fp32 safetensors are these blocks de-quantized), so the
low-bit kernels can serve them exactly. `verified_blocks` proves that per weight, bit for bit, before a block
is served: a folder whose fp32 weights differ (fine-tuned after conversion, another GGUF) is never served
from the blocks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np
import torch

from backend.model import gguf_formats
from backend.model.model_source import GGUF_NAME
from backend.model.weight_blocks import Blocks, Packed

log = logging.getLogger(__name__)

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def find_gguf(model_dir: str | Path) -> Path | None:
    path = Path(model_dir) / GGUF_NAME
    return path if path.is_file() else None


def hf_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; the token embedding is also the
    (tied) LM head. None for tensors the kernels do not serve."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    return None


# llama.cpp's converter permutes q and k rows for these architectures only (not qwen2 / qwen3), and transformers'
# GGUF loader undoes it for them.
_ROPE_PERMUTED = ("llama", "mistral")


def _rope_rows(rows: int, heads: int) -> torch.Tensor:
    """llama.cpp stores q and k rows permuted for its RoPE layout; row i of the Hugging Face weight is GGUF row
    `index[i]` (the inverse of the converter's permutation, as transformers' GGUF loader undoes it)."""
    dim = rows // heads // 2
    return torch.arange(rows).reshape(heads, dim, 2).transpose(1, 2).reshape(rows)


def read_blocks(path: Path, num_heads: int, num_kv_heads: int) -> dict[str, Blocks]:
    """Every tensor the kernels serve (a block type `gguf_formats` decodes), keyed by Hugging Face parameter name."""
    import gguf  # only needed for models converted from a GGUF

    reader = gguf.GGUFReader(str(path))
    architecture = reader.fields["general.architecture"].contents()
    blocks = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        b = None if name is None else gguf_formats.decode(tensor.tensor_type.name, np.asarray(tensor.data))
        if b is None:
            continue
        if architecture in _ROPE_PERMUTED and ".attn_q." in tensor.name:
            b = b.rows(_rope_rows(b.shape[0], num_heads))
        elif architecture in _ROPE_PERMUTED and ".attn_k." in tensor.name:
            b = b.rows(_rope_rows(b.shape[0], num_kv_heads))
        blocks[name] = b
    return blocks


def verified_blocks(model_dir: str | Path, hf_model) -> tuple[dict[str, Blocks], str]:
    """(blocks whose de-quantization equals the loaded fp32 weight bit for bit, a line for the load log)."""
    path = find_gguf(model_dir)
    if path is None:
        return {}, f"no {GGUF_NAME} beside the model"
    config = hf_model.config
    heads = config.num_attention_heads
    blocks = read_blocks(path, heads, getattr(config, "num_key_value_heads", None) or heads)
    params = dict(hf_model.named_parameters(remove_duplicate=False))
    exact, mismatched = {}, []
    for name, b in blocks.items():
        weight = params.get(name)
        if weight is None:
            continue
        if weight.dtype == torch.float32 and tuple(weight.shape) == b.shape and torch.equal(b.dequantize(), weight):
            exact[name] = b
        else:
            mismatched.append(name)
    embed, lm_head = hf_model.get_input_embeddings().weight, hf_model.get_output_embeddings().weight
    if "model.embed_tokens.weight" in exact and lm_head.data_ptr() == embed.data_ptr():
        exact["lm_head.weight"] = exact["model.embed_tokens.weight"]  # tied: the LM head is the embedding
    why = f"{len(exact)} weights in {path.name} equal the fp32 weights bit for bit"
    if mismatched:
        why += f"; {len(mismatched)} differ and stay dense (first: {mismatched[0]})"
    return exact, why


def cache_dir() -> Path:
    """`LLM_WEIGHT_CACHE`, else `.cache/weights` in the checkout."""
    return Path(os.environ.get("LLM_WEIGHT_CACHE") or Path(__file__).resolve().parents[2] / ".cache" / "weights")


def _cache_key(model_dir: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted([model_dir / GGUF_NAME, *model_dir.glob("*.safetensors")]):
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    for source in (Path(__file__), *(Path(__file__).with_name(n) for n in ("weight_blocks.py", "gguf_formats.py"))):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:20]


def verified_packed(model_dir: str | Path, hf_model) -> tuple[dict[str, Packed], str]:
    """`verified_blocks`, packed for the kernel, through the cache (see the module's docstring)."""
    from safetensors.torch import load_file, save_file

    model_dir = Path(model_dir)
    if find_gguf(model_dir) is None:
        return {}, f"no {GGUF_NAME} beside the model"
    path = cache_dir() / f"{_cache_key(model_dir)}.safetensors"
    if path.is_file():
        tensors = load_file(path)
        meta = json.loads(tensors.pop("__meta__").numpy().tobytes().decode())
        packed = {name: Packed(m["format"], m["rows"], tensors[m["data"]]) for name, m in meta["weights"].items()}
        return packed, f"{meta['why']} (checked when {path.name} was cached)"
    blocks, why = verified_blocks(model_dir, hf_model)
    packed, tensors, meta = {}, {}, {}
    for name, b in blocks.items():
        key = next((k for k, other in tensors.items() if blocks[k] is b), name)  # the tied head: stored once
        packed[name] = b.packed() if key == name else packed[key]
        tensors.setdefault(key, packed[name].data)
        meta[name] = {"format": b.format, "rows": b.shape[0], "data": key}
    header = json.dumps({"weights": meta, "why": why}).encode()
    tensors["__meta__"] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    save_file(tensors, str(tmp))
    tmp.rename(path)  # atomic: models loading side by side never read a half-written cache
    log.info("packed GGUF blocks cached in %s", path)
    return packed, why


def main(argv: list[str] | None = None) -> None:
    """`python -m backend.model.gguf_weights MODEL_DIR`: check and pack a model's GGUF blocks into the cache now (set-up
    does this once, so that servers start without it)."""
    import sys

    from backend.model import model_source

    model_dir = model_source.resolve((argv if argv is not None else sys.argv[1:])[0])
    if find_gguf(model_dir) is None:
        print(f"{model_dir}: no {GGUF_NAME}; nothing to pack")
        return
    model = model_source.load_model(model_dir, dtype=torch.float32)
    packed, why = verified_packed(model_dir, model)
    print(f"{model_dir}: {why}; {len(packed)} packed weights in {cache_dir()}")


if __name__ == "__main__":
    main()
