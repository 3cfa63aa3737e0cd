"""LoRA adapters made at test time by PEFT, with random A and B (PEFT's `init_lora_weights=False`), and their
reference: transformers + PEFT in float32.

    make_adapter(model_dir, folder, rank=8, targets=("q_proj", "v_proj"), seed=0, alpha=16) -> Path
    reference_model(model_dir, adapter)     the base model with the adapter, float32, eval mode
"""

from __future__ import annotations

from pathlib import Path


def make_adapter(
    model_dir,
    folder,
    rank: int = 8,
    targets=("q_proj", "v_proj"),
    seed: int = 0,
    alpha: int = 16,
    b_scale: float = 4.0,
    **options,
) -> Path:
    """A PEFT LoRA adapter for the model in `model_dir`, saved to `folder` (PEFT's own `save_pretrained`). B is
    random too (PEFT's default makes it zero, an adapter that changes nothing), times `b_scale`: enough to move
    a tiny random model's greedy output; a trained model's moves at about 1 without turning to noise."""
    import torch
    from peft import LoraConfig, get_peft_model

    from backend.model import model_source

    torch.manual_seed(seed)
    base = model_source.load_model(model_source.resolve(model_dir), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False, **options)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(b_scale)
    folder = Path(folder)
    model.save_pretrained(folder)
    return folder


def reference_model(model_dir, adapter):
    """transformers + PEFT: the base model in float32 with `adapter` applied, eval mode."""
    import torch
    from peft import PeftModel

    from backend.model import model_source

    base = model_source.load_model(model_source.resolve(model_dir), dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter)).eval()


def greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """`model`'s greedy continuation of `prompt_ids`, exactly `max_new_tokens` long (past end-of-sequence, as
    requests with ignore_eos run)."""
    import torch

    ids = torch.tensor([prompt_ids])
    eos = model.generation_config.eos_token_id
    pad = model.generation_config.pad_token_id
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=pad if pad is not None else (eos[0] if isinstance(eos, list) else eos or 0),
        )
    return out[0, len(prompt_ids) :].tolist()
