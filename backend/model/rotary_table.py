"""Each position's rotary cos and sin, computed once by the model's own rotary embedding and looked up per step.

Hugging Face's rotary embedding recomputes cos and sin of every row's position on every call: a multiply, a
concatenation and two transcendental passes, 0.1 ms of a 5 ms batch-1 decode step (measured, docs/benchmarks.md).
Its arithmetic is element-wise (position * inverse frequency, then cos and sin of that, times a constant), so a
position's values do not depend on what else is in the call: the table holds exactly what a per-step call returns
(tests/unit/test_rotary_table.py holds it bit for bit). Rotary types whose frequencies change with the sequence
length (`dynamic`, `longrope`) are not element-wise in that sense and keep the per-step call.
"""

from __future__ import annotations

import torch

# Positions computed per call of the embedding while the table grows: calls as small as a step's (under torch's
# grain for splitting an element-wise op across threads, for head sizes up to 256), so every value goes through the
# same vector code a step's call takes.
_CHUNK = 64


class RotaryTable:
    def __init__(self, rotary: torch.nn.Module):
        self.rotary = rotary
        rope_type = getattr(rotary, "rope_type", "default")
        self.per_step = not isinstance(rope_type, str) or "dynamic" in rope_type or rope_type == "longrope"
        self.cos = self.sin = torch.empty(0, 0)

    def __call__(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] in `like`'s dtype for positions [T], as `rotary(like, positions[None])[i][0]`."""
        if self.per_step:
            cos, sin = self.rotary(like, positions[None])
            return cos[0], sin[0]
        cos, sin = self.tables(like, int(positions.max()) + 1 if positions.numel() else 0)
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def tables(self, like: torch.Tensor, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [P, head_dim] in `like`'s dtype for positions 0 .. P - 1, P >= `positions` (not `per_step`)."""
        if positions > self.cos.shape[0] or self.cos.dtype != like.dtype:
            self._grow(like, max(positions, 2 * self.cos.shape[0], _CHUNK))
        return self.cos, self.sin

    def _grow(self, like: torch.Tensor, size: int) -> None:
        """The table for positions 0 .. size - 1 (rounded up to whole chunks)."""
        size = -(-size // _CHUNK) * _CHUNK
        starts = range(0, size, _CHUNK)
        pieces = [self.rotary(like, torch.arange(i, i + _CHUNK, device=like.device)[None]) for i in starts]
        self.cos = torch.cat([cos[0] for cos, _ in pieces])
        self.sin = torch.cat([sin[0] for _, sin in pieces])
