"""The token embedding: dense fp32 rows, or the model's own blocks de-quantized row by row as a step looks them up.

A GGUF stores the embedding in blocks (Q8_0, Q6_K, Q4_K, ...), and a tied LM head reads the same blocks on the
low-bit kernel. Looking rows up from the blocks (`kernels.lowbit_rows`, bit for bit the reference de-quantization)
means no fp32 copy of a [vocab, hidden] table (400 MiB at a 1B model's 49k x 2048, 2 GiB at 8B's 128k x 4096).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backend.model import kernels
from backend.model.weight_blocks import FORMATS, Packed

DENSE_ROWS = -1  # the decoder stack's format code for fp32 rows


class TokenEmbedding:
    def __init__(self, dense: torch.Tensor | None = None, blocks: Packed | None = None, width: int = 0):
        if (dense is None) == (blocks is None):
            raise ValueError("a token embedding is either dense rows or packed blocks")
        self.dense, self.blocks = dense, blocks
        self.vocab_size = dense.shape[0] if dense is not None else blocks.rows
        self.width = dense.shape[1] if dense is not None else width
        self.dtype = dense.dtype if dense is not None else torch.float32
        self.kernel = None if blocks is None else kernels.load()
        if blocks is not None and self.kernel is None:
            raise ValueError("an embedding in blocks needs the low-bit kernels")

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T, width] rows of `input_ids` [T], as F.embedding over the de-quantized table gives them."""
        if self.dense is not None:
            return F.embedding(input_ids, self.dense)
        b = self.blocks
        return self.kernel.lowbit_rows(b.data, b.rows, self.width, FORMATS[b.format], input_ids)

    def native(self) -> tuple[torch.Tensor, int, int]:
        """(data, format code, vocabulary) for the decoder stack."""
        if self.dense is not None:
            return self.dense, DENSE_ROWS, self.vocab_size
        return self.blocks.data, FORMATS[self.blocks.format], self.vocab_size

    @property
    def nbytes(self) -> int:
        data = self.dense if self.dense is not None else self.blocks.data
        return data.numel() * data.element_size()
