"""The Hugging Face transformers model the report measures ours against, loaded as the peers run it."""

from __future__ import annotations

import torch


def load_hf(model_dir: str, dtype: torch.dtype):
    """(model, tokenizer) of Hugging Face transformers, sdpa attention, in `dtype`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").eval()
    return model, tok
