"""LoRA adapters in PEFT's format, applied per row of a step: many fine-tunes of one model in one batch.

An adapter folder holds `adapter_config.json` and `adapter_model.safetensors` (what PEFT's `save_pretrained`
writes). For a projection `W` it adds `scaling * B (A x)` to `W x`, PEFT's LoRA (`scaling = lora_alpha / r`, or
`lora_alpha / sqrt(r)` with `use_rslora`), in PEFT's order of operations and in fp32: `(x A^T) B^T`, times the
scaling, added to the base layer's output. The base output is whatever serves the projection (our low-bit kernel,
dense); rows of other adapters and of none are never touched. A step's rows are grouped by adapter (`LoraStep`):
per adapter and projection one matmul with every adapted part's A stacked, one per part with its B.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

# PEFT target module -> (the fused forward's projection, the part's index in it)
TARGETS = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_uids = itertools.count(1)


class AdapterError(ValueError):
    """An adapter folder we cannot serve; the message says what is wrong and what is supported."""


@dataclass
class ProjectionLora:
    """One adapter's LoRA on one fused projection: `a` stacks the A of every adapted part; each part adds
    `(x a[ranks]^T) b^T * scaling` to the output columns `cols`."""

    a: torch.Tensor  # [sum of the parts' ranks, in_features]
    parts: list[tuple[slice, slice, torch.Tensor, float]]  # (output columns, rows of a, B [out, r], scaling)


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int
    uid: int  # never reused, so a reloaded adapter never meets the prefix-cache blocks of its predecessor
    projections: dict[tuple[int, str], ProjectionLora]  # (layer, projection) -> its LoRA

    @property
    def cache_salt(self) -> bytes:
        """What keys this adapter's prefix-cache blocks apart from the base model's and other adapters'."""
        return f"lora:{self.uid}".encode()


def projection_widths(hf_model) -> dict[str, list[int]]:
    """Output widths of each fused projection's parts, read off a Llama-family model's first layer."""
    layer = hf_model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    return {
        "qkv": [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features],
        "o_proj": [attn.o_proj.out_features],
        "gate_up": [mlp.gate_proj.out_features, mlp.up_proj.out_features],
        "down": [mlp.down_proj.out_features],
    }


def _config(path: Path, max_rank: int) -> dict:
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except FileNotFoundError:
        raise AdapterError(f"{path}: no adapter_config.json (a PEFT LoRA adapter folder is expected)") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{path}/adapter_config.json: {exc}") from None
    refusals = [
        (config.get("peft_type", "LORA") != "LORA", f"peft_type {config.get('peft_type')!r} (only LORA)"),
        (bool(config.get("use_dora")), "use_dora (DoRA is not supported)"),
        (config.get("bias", "none") != "none", f"bias {config.get('bias')!r} (only 'none')"),
        (bool(config.get("modules_to_save")), "modules_to_save (only LoRA weights are supported)"),
        (bool(config.get("fan_in_fan_out")), "fan_in_fan_out"),
        (bool(config.get("rank_pattern")) or bool(config.get("alpha_pattern")), "rank_pattern / alpha_pattern"),
    ]
    for refused, what in refusals:
        if refused:
            raise AdapterError(f"{path}: {what} is not supported")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{path}: adapter_config.json needs a positive integer r, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"{path}: rank {rank} is above max_lora_rank {max_rank}")
    return config


def load_adapter(name: str, path: str | Path, hf_model, max_rank: int) -> LoraAdapter:
    """The adapter in folder `path` for `hf_model` (shapes checked against its layers), or AdapterError."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path).expanduser()
    if not path.is_dir():
        raise AdapterError(f"adapter {name!r}: {path} is not a folder")
    config = _config(path, max_rank)
    rank = config["r"]
    scaling = config.get("lora_alpha", rank) / (math.sqrt(rank) if config.get("use_rslora") else rank)
    try:
        tensors = load_file(str(path / "adapter_model.safetensors"))
    except (FileNotFoundError, SafetensorError, OSError) as exc:
        raise AdapterError(f"{path}: cannot read adapter_model.safetensors ({exc})") from None
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in TARGETS:
            supported = ", ".join(TARGETS)
            raise AdapterError(f"{path}: weight {key} is not LoRA on one of {supported}")
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        pairs.setdefault((layer, module), {})[which] = tensor.float()
    layers = hf_model.model.layers
    widths = projection_widths(hf_model)
    by_projection: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{path}: layer {layer} {module} has lora_{''.join(ab)} without its pair")
        if layer >= len(layers):
            raise AdapterError(f"{path}: layer {layer} is past the model's {len(layers)} layers")
        base = getattr(
            layers[layer].self_attn if module in ("q_proj", "k_proj", "v_proj", "o_proj") else layers[layer].mlp, module
        )
        a, b = ab["A"], ab["B"]
        if a.shape != (rank, base.in_features) or b.shape != (base.out_features, rank):
            raise AdapterError(
                f"{path}: layer {layer} {module}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the model's "
                f"{base.out_features}x{base.in_features} weight at rank {rank}"
            )
        projection, part = TARGETS[module]
        by_projection.setdefault((layer, projection), []).append((part, a, b))
    projections = {}
    for (layer, projection), parts in by_projection.items():
        starts = list(itertools.accumulate(widths[projection], initial=0))
        placed = []
        for i, (part, _, b) in enumerate(sorted(parts, key=lambda p: p[0])):
            placed.append((slice(starts[part], starts[part + 1]), slice(i * rank, (i + 1) * rank), b, scaling))
        a = torch.cat([a for _, a, _ in sorted(parts, key=lambda p: p[0])]).contiguous()
        projections[(layer, projection)] = ProjectionLora(a, placed)
    if not projections:
        raise AdapterError(f"{path}: adapter_model.safetensors holds no LoRA weights")
    return LoraAdapter(name, str(path), rank, next(_uids), projections)


class LoraStep:
    """A step's rows grouped by adapter: `groups` of (adapter, rows of the flat batch)."""

    def __init__(self, groups: list[tuple[LoraAdapter, torch.Tensor]]):
        self.groups = groups

    def add(self, layer: int, projection: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the base projection of `x`) with each adapter's delta added to its own rows, in place. In fp32
        whatever the model's dtype, as PEFT computes it (its adapter weights are cast to fp32): a bf16 model's
        rows are summed in fp32 and rounded once."""
        for adapter, rows in self.groups:
            lora = adapter.projections.get((layer, projection))
            if lora is None:
                continue
            xa = x[rows].float() @ lora.a.T
            for cols, ranks, b, scaling in lora.parts:
                out[rows, cols] = (out[rows, cols].float() + (xa[:, ranks] @ b.T) * scaling).to(out.dtype)
        return out
