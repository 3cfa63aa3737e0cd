"""The fused forward pass for the Llama family (Llama, Mistral, Qwen2): the fast path beside the generic one.

The generic path runs Hugging Face's own modules with our paged attention plugged in; per layer it pays for
three q/k/v matmuls, two MLP input matmuls and a few dozen small ops through Python modules. Here the same
weights are laid out once at load: q/k/v fused into one matmul, gate/up into another (optionally with
low-bit copies for small batches, see `linear.py`), rotary tables computed once per step for all layers,
RoPE applied to queries and keys together, and the residual stream kept as one [T, hidden] tensor. The
arithmetic is Hugging Face's, op for op (RMSNorm in float32, RoPE and residuals in the model's dtype), so
float32 results match the generic path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .linear import DenseLinear, make_linear
from .paged_attention import AttentionMetadata, paged_attention

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def supports(config) -> bool:
    """Whether `config` describes a model this fused forward computes exactly like Hugging Face."""
    architectures = getattr(config, "architectures", None) or []
    return (
        bool(architectures) and architectures[0] in ARCHITECTURES
        and getattr(config, "hidden_act", "silu") == "silu"
        and not getattr(config, "use_sliding_window", False)
    )


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: DenseLinear
    o_proj: DenseLinear
    post_norm: torch.Tensor
    gate_up: DenseLinear
    down: DenseLinear


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm: normalise in float32, round to the model's dtype, then scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # the same arithmetic in one kernel
    normed = x.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


class FusedLlama:
    def __init__(self, hf_model, quantization: str = "none"):
        config = hf_model.config
        inner = hf_model.model
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.intermediate = config.intermediate_size
        self.eps = inner.norm.variance_epsilon
        self.scale = self.head_dim**-0.5
        self.embed = inner.embed_tokens.weight
        self.rotary = inner.rotary_emb
        self.final_norm = inner.norm.weight
        self.layers = [self._fuse(layer, quantization) for layer in inner.layers]
        # The LM head stays dense: tied to the embedding, it holds the GGUF's 8-bit (Q8_0) grid, which neither
        # low-bit kind represents; re-quantized per row it turned near-ties into wrong tokens (measured).
        self.lm_head = make_linear([hf_model.lm_head.weight], [None])

    @staticmethod
    def _fuse(layer, quantization: str) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        return _Layer(
            input_norm=layer.input_layernorm.weight,
            qkv=make_linear([p.weight for p in projections], [p.bias for p in projections], quantization),
            o_proj=make_linear([attn.o_proj.weight], [attn.o_proj.bias], quantization),
            post_norm=layer.post_attention_layernorm.weight,
            gate_up=make_linear(
                [mlp.gate_proj.weight, mlp.up_proj.weight], [mlp.gate_proj.bias, mlp.up_proj.bias], quantization
            ),
            down=make_linear([mlp.down_proj.weight], [mlp.down_proj.bias], quantization),
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, keep: torch.Tensor
    ) -> torch.Tensor:
        """input_ids, positions [T] of the flat batch; returns logits [len(keep), vocab] of the rows `keep`."""
        total = input_ids.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qk_heads = heads + kv_heads
        hidden = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary(hidden, positions[None])
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # [T, 1, D], shared by every layer
        half = head_dim // 2
        for index, layer in enumerate(self.layers):
            qkv = layer.qkv(_rms_norm(hidden, layer.input_norm, self.eps))
            qk = qkv[:, : qk_heads * head_dim].view(total, qk_heads, head_dim)
            rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
            qk = qk * cos + rotated * sin
            value = qkv[:, qk_heads * head_dim :].view(total, kv_heads, head_dim)
            attended = paged_attention(index, qk[:, :heads], qk[:, heads:], value, meta, self.scale)
            hidden = hidden + layer.o_proj(attended.reshape(total, heads * head_dim))
            gate_up = layer.gate_up(_rms_norm(hidden, layer.post_norm, self.eps))
            hidden = hidden + layer.down(F.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :])
        return self.lm_head(_rms_norm(hidden[keep], self.final_norm, self.eps))
