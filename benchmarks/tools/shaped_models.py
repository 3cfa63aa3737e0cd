"""GGUF files of real model shapes with random weights, for speed and memory figures at the sizes people serve.

Each shape is a published model's (hidden size, layers, heads, KV heads, intermediate size, head size, tied
embeddings) with the shipped SmolLM2 tokenizer (49,152 tokens, so the embedding and LM head are smaller than the
original's 128k). The file is written in F16 one tensor at a time (an 8B file never sits in memory whole), then
quantized by llama.cpp's own `llama-quantize` into the kind asked for. Random weights are fine for speed and
memory; their logits are flatter than a trained model's, so near-ties are common in fidelity checks.

    python -m benchmarks.tools.shaped_models 1b Q4_K_M     prints the path of the quantized file (made once, cached)
"""

from __future__ import annotations

import argparse
import subprocess
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from backend.model.gguf_file import read_gguf
from benchmarks.core import llama_cpp_build


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    head_dim: int
    tied: bool
    rope_theta: float = 500000.0
    context: int = 131072


SHAPES = {
    "1b": Shape(2048, 16, 32, 8, 8192, 64, tied=True),  # Llama-3.2-1B
    "3b": Shape(3072, 28, 24, 8, 8192, 128, tied=True),  # Llama-3.2-3B
    "8b": Shape(4096, 32, 32, 8, 14336, 128, tied=False),  # Llama-3.1-8B
    "tiny": Shape(256, 2, 4, 2, 512, 64, tied=True, context=4096),  # for tests of this module
}
STD = 0.02  # the weights' standard deviation (norms are 1)


def _tensors(shape: Shape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, rows-first shape) of every tensor, in llama.cpp's order."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out = [("token_embd.weight", (vocab, h))]
    for i in range(shape.layers):
        out += [
            (f"blk.{i}.attn_norm.weight", (h,)),
            (f"blk.{i}.attn_q.weight", (q, h)),
            (f"blk.{i}.attn_k.weight", (kv, h)),
            (f"blk.{i}.attn_v.weight", (kv, h)),
            (f"blk.{i}.attn_output.weight", (h, q)),
            (f"blk.{i}.ffn_norm.weight", (h,)),
            (f"blk.{i}.ffn_gate.weight", (shape.intermediate, h)),
            (f"blk.{i}.ffn_up.weight", (shape.intermediate, h)),
            (f"blk.{i}.ffn_down.weight", (h, shape.intermediate)),
        ]
    out.append(("output_norm.weight", (h,)))
    if not shape.tied:
        out.append(("output.weight", (vocab, h)))
    return out


def write_f16(path: Path, shape: Shape, tokenizer_gguf: Path, seed: int = 0) -> Path:
    """A llama GGUF of `shape` with random F16 weights (F32 norms) and `tokenizer_gguf`'s tokenizer."""
    fields, _ = read_gguf(tokenizer_gguf)
    tokenizer = {k: v for k, v in fields.items() if k.startswith("tokenizer.")}
    vocab = len(tokenizer["tokenizer.ggml.tokens"][0])
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(f"random-llama-{shape.hidden}x{shape.layers}")
    writer.add_context_length(shape.context)
    writer.add_block_count(shape.layers)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, (value, vtype, item_type) in tokenizer.items():
        writer.add_key_value(key, value, vtype, item_type)
    tensors = _tensors(shape, vocab)
    for name, dims in tensors:
        norm = len(dims) == 1
        dtype, qtype = (
            (np.float32, gguf.GGMLQuantizationType.F32) if norm else (np.float16, gguf.GGMLQuantizationType.F16)
        )
        nbytes = int(np.prod(dims)) * np.dtype(dtype).itemsize
        writer.add_tensor_info(name, dims, np.dtype(dtype), nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, dims in tensors:
        if len(dims) == 1:
            writer.write_tensor_data(np.ones(dims, dtype=np.float32))
        else:
            writer.write_tensor_data((rng.standard_normal(dims, dtype=np.float32) * STD).astype(np.float16))
    writer.close()
    return path


def model_file(size: str, kind: str, bin_dir: Path | None = None, tokenizer_gguf: Path | None = None) -> Path:
    """The `size` model (a key of SHAPES) quantized to `kind` (a llama-quantize type, or F16), made once into the
    llama.cpp cache's models folder."""
    from launcher import prepare_model

    folder = llama_cpp_build.cache_dir() / "models"
    folder.mkdir(parents=True, exist_ok=True)
    f16 = folder / f"random-{size}.F16.gguf"
    if not f16.is_file():
        partial = f16.with_suffix(".part")
        write_f16(partial, SHAPES[size], tokenizer_gguf or prepare_model.gguf_dir() / prepare_model.GGUF_FILE)
        partial.replace(f16)
    if kind == "F16":
        return f16
    out = folder / f"random-{size}.{kind}.gguf"
    if not out.is_file():
        bin_dir = bin_dir or Path(llama_cpp_build.default_bin_dir())
        partial = out.with_suffix(".part")
        command = [str(bin_dir / "llama-quantize"), str(f16), str(partial), kind]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        partial.replace(out)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("size", choices=sorted(SHAPES))
    ap.add_argument("kind", help="a llama-quantize type (Q4_K_M, Q8_0, ...) or F16")
    args = ap.parse_args(argv)
    print(model_file(args.size, args.kind))


if __name__ == "__main__":
    main()
