"""A Hugging Face folder's 16-bit safetensors (bf16 / fp16) under their own names, read memory-mapped into the form
the fused path serves, with no fp32 copy of what the kernel covers.

Every 2-D weight whose rows are a whole number of 32-input blocks (the projections, the embedding, an untied LM
head) is packed for the low-bit kernel in its stored format, one tensor at a time, into one arena on huge pages
sized beforehand: each 16-bit value widens to fp32 exactly, so the kernel computes the fp32 model (up to summation
order) while reading two bytes a weight. Norms, biases and anything narrower are held in fp32. A tied LM head reads
the embedding's blocks. This is `quantization: half` for a checkpoint stored in 16 bits; the resident weights are
about the checkpoint's own size, where loading it in fp32 first would hold twice that, then three times beside
the kernel's copy.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from backend.model import huge_pages
from backend.model.model_weights import ModelWeights
from backend.model.weight_blocks import BLOCK, HalfWeights, Packed, packed_bytes

_FORMATS = {"BF16": "bf16", "F16": "f16"}  # safetensors dtype -> the kernel's 16-bit format


def _tensors(model_dir: str | Path) -> list[tuple[Path, str, str, list[int]]]:
    """(file, name, safetensors dtype, shape) of every tensor in the folder's safetensors (headers only)."""
    from safetensors import safe_open

    out = []
    for file in sorted(Path(model_dir).expanduser().glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                part = f.get_slice(name)
                out.append((file, name, part.get_dtype(), list(part.get_shape())))
    return out


def _kernel_format(dtype: str, shape: list[int]) -> str | None:
    """The kernel's format for a tensor it serves, None for one held in fp32."""
    return _FORMATS.get(dtype) if len(shape) == 2 and shape[1] % BLOCK == 0 else None


def load(model_dir: str | Path, tied: bool) -> ModelWeights:
    """The model's weights from its safetensors (see the module's docstring): packed 16-bit weights in one
    huge-page arena, the rest in fp32; `tied`: the LM head is the embedding where the files hold none."""
    from safetensors import safe_open

    started = time.perf_counter()
    table = _tensors(model_dir)
    formats = {name: _kernel_format(dtype, shape) for _, name, dtype, shape in table}
    sizes = {name: packed_bytes(formats[name], *shape) for _, name, _, shape in table if formats[name]}
    arena = huge_pages.empty_bytes(sum(sizes.values()))
    blocks, dense, offset = {}, {}, 0
    for file in dict.fromkeys(file for file, *_ in table):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                values, fmt = f.get_tensor(name), formats[name]
                if fmt is None:
                    dense[name] = values.float()
                    continue
                packed = HalfWeights(fmt, values).pack()
                blocks[name] = Packed(fmt, values.shape[0], arena[offset : offset + sizes[name]].copy_(packed))
                offset += sizes[name]
    return ModelWeights.read(dense, blocks, arena, f"{Path(model_dir).name}'s safetensors", started, tied)


def planned_bytes(model_dir: str | Path) -> int:
    """What `load` will hold resident for this model, from the safetensors headers."""
    total = 0
    for _, _, dtype, shape in _tensors(model_dir):
        fmt = _kernel_format(dtype, shape)
        total += packed_bytes(fmt, *shape) if fmt else 4 * torch.Size(shape).numel()
    return total
