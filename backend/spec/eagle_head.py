"""An EAGLE-style draft head (Li et al. 2024): one Llama decoder layer over the target's own last hidden state.

Row j of the head reads `fc([embed(x_{j+1}) ; f_j])`, where f_j is the target's feature at position j (the input
of its LM head: the final norm's output) and x_{j+1} the token the target chose there; the layer's output, normed,
is the head's guess of f_{j+1}, and the target's LM head rows of a reduced draft vocabulary (the most frequent
tokens of the target's own generations, mapped back to target ids) turn it into the next token's distribution.
Drafting a chain feeds each guessed feature back as the next row's f, as EAGLE does. The layer attends over the
last `window` rows of true features and the chain's own rows (the mask `chain_mask` builds), so the head needs no
KV of the prompt. The LM head rows are the target's (frozen, not saved); the folder holds the head's own weights,
the draft vocabulary and the rows the feature is recovered from (`eagle_proposer.py`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ARCHITECTURE = "EagleDraftHead"
CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"


@dataclass
class HeadShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    rope_theta: float
    target_vocab: int
    window: int = 32  # true-feature rows the layer attends over (training: the chunk length)

    @classmethod
    def of_target(cls, config, window: int = 32) -> HeadShape:
        heads = config.num_attention_heads
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta") or getattr(config, "rope_theta", 10000.0)
        return cls(
            hidden=config.hidden_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate=config.intermediate_size,
            eps=config.rms_norm_eps,
            rope_theta=float(theta),
            target_vocab=config.vocab_size,
            window=window,
        )


def chain_mask(length: int, depth: int) -> torch.Tensor:
    """[length, depth * length] bool: which keys row j of chain step `depth` (1-based) sees, keys being the rows of
    steps 1..depth in turn. Row j of step s drafts from anchor a = j - s + 1: it sees the true rows up to a, the
    chain's earlier rows j - s + t of steps t = 2..s - 1, and itself."""
    j = torch.arange(length)[:, None]
    i = torch.arange(length)[None, :]
    parts = [i <= j - depth + 1]
    parts += [i == j - depth + t for t in range(2, depth + 1)]
    return torch.cat(parts, dim=1)


class EagleHead(nn.Module):
    def __init__(self, shape: HeadShape, draft_vocab: torch.Tensor, head_rows: torch.Tensor):
        super().__init__()
        s = self.shape = shape
        h, kv = s.hidden, s.kv_heads * s.head_dim
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.input_norm = nn.Parameter(torch.ones(h))
        self.q_proj = nn.Linear(h, s.heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(h, kv, bias=False)
        self.v_proj = nn.Linear(h, kv, bias=False)
        self.o_proj = nn.Linear(s.heads * s.head_dim, h, bias=False)
        self.post_norm = nn.Parameter(torch.ones(h))
        self.gate_proj = nn.Linear(h, s.intermediate, bias=False)
        self.up_proj = nn.Linear(h, s.intermediate, bias=False)
        self.down_proj = nn.Linear(s.intermediate, h, bias=False)
        self.out_norm = nn.Parameter(torch.ones(h))
        self.register_buffer("draft_vocab", draft_vocab.long(), persistent=False)
        self.register_buffer("head", head_rows.float(), persistent=False)  # the target's LM head rows [N, hidden]
        self.head_linear = None  # serving: the head rows on the low-bit kernel (eagle_proposer.py)
        inv = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float32) / s.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def init_from_target(self, state: dict[str, torch.Tensor], layer: int, residual_rms: float) -> None:
        """The layer from the target's layer `layer`, the output norm from its final norm, and fc passing the
        feature through (the embedding's half small) un-normed to the scale `residual_rms` of the residual stream
        that layer reads: at step 0 the head re-reads the target's feature through the target's last layer."""
        at = f"model.layers.{layer}"
        names = {
            "q_proj": "self_attn.q_proj",
            "k_proj": "self_attn.k_proj",
            "v_proj": "self_attn.v_proj",
            "o_proj": "self_attn.o_proj",
            "gate_proj": "mlp.gate_proj",
            "up_proj": "mlp.up_proj",
            "down_proj": "mlp.down_proj",
        }
        with torch.no_grad():
            for ours, theirs in names.items():
                getattr(self, ours).weight.copy_(state[f"{at}.{theirs}.weight"])
            self.input_norm.copy_(state[f"{at}.input_layernorm.weight"])
            self.post_norm.copy_(state[f"{at}.post_attention_layernorm.weight"])
            self.out_norm.copy_(state["model.norm.weight"])
            h = self.shape.hidden
            self.fc.weight.normal_(0.0, 0.02 / h**0.5)
            self.fc.weight[:, h:] = torch.eye(h) * residual_rms / self.out_norm.abs().clamp(min=1e-3)[None, :]

    # ---- the layer, over [B, T, hidden] rows -----------------------------------------------------------------
    def rows(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([embeds, features], dim=-1))

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, T, heads, D], positions [T] or [B, T]."""
        angles = positions.float()[..., None] * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if cos.dim() == 2:
            cos, sin = cos[None], sin[None]
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def keys_values(self, normed: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = normed.shape
        s = self.shape
        k = self.rope(self.k_proj(normed).view(b, t, s.kv_heads, s.head_dim), positions)
        return k, self.v_proj(normed).view(b, t, s.kv_heads, s.head_dim)

    def layer(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        prior_k: torch.Tensor | None,
        prior_v: torch.Tensor | None,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows x [B, T, hidden] attending over keys [prior ; their own] as `mask` [T, P + T] (or [B, T, P + T])
        allows. Returns the layer's output and the rows' own keys and values [B, T, kv_heads, D]."""
        s = self.shape
        b, t, _ = x.shape
        normed = F.rms_norm(x, (s.hidden,), self.input_norm, s.eps)
        q = self.rope(self.q_proj(normed).view(b, t, s.heads, s.head_dim), positions)
        k, v = self.keys_values(normed, positions)
        keys = k if prior_k is None else torch.cat([prior_k, k], dim=1)
        values = v if prior_v is None else torch.cat([prior_v, v], dim=1)
        group = s.heads // s.kv_heads
        keys = keys.repeat_interleave(group, dim=2).transpose(1, 2)
        values = values.repeat_interleave(group, dim=2).transpose(1, 2)
        if mask.dim() == 3:
            mask = mask[:, None]
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask)
        x = x + self.o_proj(attended.transpose(1, 2).reshape(b, t, s.heads * s.head_dim))
        normed = F.rms_norm(x, (s.hidden,), self.post_norm, s.eps)
        x = x + self.down_proj(F.silu(self.gate_proj(normed)) * self.up_proj(normed))
        return x, k, v

    def predict(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the guessed feature, logits over the draft vocabulary) of layer outputs."""
        feature = F.rms_norm(out, (self.shape.hidden,), self.out_norm, self.shape.eps)
        if self.head_linear is not None:
            return feature, self.head_linear(feature)
        return feature, feature @ self.head.T

    def unroll(self, embeds: torch.Tensor, features: torch.Tensor, depth: int) -> list[tuple[torch.Tensor, ...]]:
        """Training-time test (EAGLE-3): chain steps 1..depth over chunks [B, L] at once. Step 1 reads the true
        features; step s row j reads step s - 1's guess of row j's feature (its row j - 1). Returns per step
        (guessed features, logits) [B, L, ...]; rows j < s - 1 of step s have no anchor and are not to be scored."""
        length = embeds.shape[1]
        positions = torch.arange(length)
        keys, values, steps = [], [], []
        feats = features
        for step in range(1, depth + 1):
            out, k, v = self.layer(
                self.rows(embeds, feats),
                positions,
                torch.cat(keys, dim=1) if keys else None,
                torch.cat(values, dim=1) if values else None,
                chain_mask(length, step),
            )
            keys.append(k)
            values.append(v)
            guessed, logits = self.predict(out)
            steps.append((guessed, logits))
            feats = torch.cat([torch.zeros_like(guessed[:, :1]), guessed[:, :-1]], dim=1)
        return steps


def is_eagle_folder(path: str | Path) -> bool:
    config = Path(path) / CONFIG_NAME
    if not config.is_file():
        return False
    try:
        return ARCHITECTURE in (json.loads(config.read_text()).get("architectures") or [])
    except (OSError, ValueError):
        return False


def save(folder: Path, head: EagleHead, recovery_rows: torch.Tensor, meta: dict) -> None:
    """The head's weights in bf16, its draft vocabulary and recovery rows, its shape and how it was made."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().to(torch.bfloat16).contiguous() for name, p in head.named_parameters()}
    tensors["draft_vocab"] = head.draft_vocab.to(torch.int32)
    tensors["recovery_rows"] = recovery_rows.to(torch.int32)
    save_file(tensors, str(folder / WEIGHTS_NAME))
    config = {"architectures": [ARCHITECTURE], "model_type": "eagle_draft", "shape": asdict(head.shape), **meta}
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")


def load(folder: str | Path, target_rows) -> tuple[EagleHead, torch.Tensor, dict]:
    """(the head in fp32, its recovery rows, its config); `target_rows(ids)` gives the target's LM head rows."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = json.loads((folder / CONFIG_NAME).read_text())
    tensors = load_file(str(folder / WEIGHTS_NAME))
    vocab = tensors.pop("draft_vocab").long()
    recovery = tensors.pop("recovery_rows").long()
    head = EagleHead(HeadShape(**config["shape"]), vocab, target_rows(vocab))
    head.load_state_dict({k: v.float() for k, v in tensors.items()})
    return head.eval(), recovery, config
