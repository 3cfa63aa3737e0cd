"""What the fused forward is built from: a model's tensors by Hugging Face parameter name, each held once."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from backend.model.weight_blocks import Packed

log = logging.getLogger(__name__)


@dataclass
class ModelWeights:
    """`blocks`: the weights the low-bit kernel serves, packed; `dense`: every other tensor the forward reads (norms,
    biases, weights served dense). A tied LM head is the same entry as the embedding. `arena_bytes`: where the
    blocks already lie side by side in one huge-page arena (a GGUF read by `gguf_weights.load`), its size; 0 where
    they were packed one by one."""

    dense: dict[str, torch.Tensor]
    blocks: dict[str, Packed]
    arena_bytes: int = 0

    @classmethod
    def of_model(cls, hf_model, blocks: dict[str, Packed]) -> ModelWeights:
        """A loaded Hugging Face model's parameters (their tensors, which outlive the modules' own: the runner
        then empties the modules), with `blocks` for the weights the kernel serves."""
        return cls({n: p.detach() for n, p in hf_model.named_parameters(remove_duplicate=False)}, blocks)

    @classmethod
    def read(
        cls, dense: dict, blocks: dict, arena: torch.Tensor, source: str, started: float, tied: bool
    ) -> ModelWeights:
        """Weights read from a file (`source`, since `started`) with the blocks in `arena`: a tied LM head (`tied`
        and none read) is the embedding's entry; the read is logged."""
        served = len(blocks)
        if tied and "lm_head.weight" not in blocks and "lm_head.weight" not in dense:
            where = blocks if "model.embed_tokens.weight" in blocks else dense
            where["lm_head.weight"] = where["model.embed_tokens.weight"]
        weights = cls(dense, blocks, arena_bytes=arena.numel())
        log.info(
            "read %s in %.1f s: %d weights on the kernel (%.1f MiB), %d tensors in fp32 (%.1f MiB)",
            source,
            time.perf_counter() - started,
            served,
            arena.numel() / 2**20,
            len(dense),
            weights.dense_bytes / 2**20,
        )
        return weights

    def get(self, name: str) -> torch.Tensor | None:
        return self.dense.get(name)

    @property
    def dense_bytes(self) -> int:
        unique = {t.data_ptr(): t for t in self.dense.values()}
        return sum(t.numel() * t.element_size() for t in unique.values())

    @property
    def block_bytes(self) -> int:
        unique = {p.data.data_ptr(): p.data for p in self.blocks.values()}
        return self.arena_bytes or sum(t.numel() for t in unique.values())
