"""The fused forward pass for the Llama family (Llama, Mistral, Qwen2, Qwen3): the fast path beside the generic one.

The generic path runs Hugging Face's own modules with our paged attention plugged in; per layer it pays for
three q/k/v matmuls, two MLP input matmuls and a few dozen small ops through Python modules. Here the same
weights are laid out once at load: q/k/v fused into one matmul, gate/up into another (optionally with
low-bit copies for small batches, see `linear.py`), rotary cos and sin looked up once per step for all layers,
RoPE applied to queries and keys together (after Qwen3's per-head RMSNorm of each), and the residual stream kept
as one [T, hidden] tensor. The arithmetic is Hugging Face's, op for op (RMSNorm in float32, RoPE and residuals in
the model's dtype), so float32 results match the generic path. Three of the runner's four forward paths are
here (forward_plan.py: on torch ops, the Python loop over our layer ops, the native decoder stack); `forward` runs
the one the runner's plan names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backend.model import huge_pages, kernels
from backend.model.embedding import TokenEmbedding
from backend.model.forward_plan import ForwardPath
from backend.model.linear import DenseLinear, LowBitLinear, make_linear
from backend.model.lora import LoraStep
from backend.model.model_weights import ModelWeights
from backend.model.paged_attention import AttentionMetadata, paged_attention
from backend.model.rotary_table import RotaryTable

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def supports(config) -> bool:
    """Whether `config` describes a model this fused forward computes exactly like Hugging Face."""
    architectures = getattr(config, "architectures", None) or []
    return (
        bool(architectures)
        and architectures[0] in ARCHITECTURES
        and getattr(config, "hidden_act", "silu") == "silu"
        and not _sliding_window_applies(config)
    )


def _sliding_window_applies(config) -> bool:
    """Whether attention is limited to a window shorter than the context (Mistral's `sliding_window`; Qwen's only
    with `use_sliding_window`): the fused forward attends over the whole context, Hugging Face's modules on our
    paged attention honour the window."""
    window = getattr(config, "sliding_window", None)
    if not getattr(config, "use_sliding_window", True):
        window = None
    return window is not None and window < getattr(config, "max_position_embeddings", window + 1)


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: DenseLinear
    o_proj: DenseLinear
    post_norm: torch.Tensor
    gate_up: DenseLinear
    down: DenseLinear
    q_norm: torch.Tensor | None = None  # Qwen3: RMSNorm over each query / key head before RoPE
    k_norm: torch.Tensor | None = None


def _project(lora: LoraStep | None, layer: int, name: str, linear: DenseLinear, x: torch.Tensor) -> torch.Tensor:
    """A projection of layer `layer`, with the step's LoRA deltas on their rows."""
    out = linear(x)
    return out if lora is None else lora.add(layer, name, x, out)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm: normalise in float32, round to the model's dtype, then scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # the same arithmetic in one kernel
    normed = x.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


class FusedLlama:
    """The forward of a Llama-family `config` over `weights` (`model_weights.py`): its blocks are served by the
    low-bit kernel on instruction set `isa` (for steps of up to `max_m` rows where a dense copy exists, at every
    size where none does); other weights follow `quantization`. `rotary` is the model's rotary embedding module."""

    def __init__(
        self,
        config,
        weights: ModelWeights,
        rotary: torch.nn.Module,
        quantization: str = "none",
        isa: int = 0,
        max_m: int = 8,
        use_layer_ops: bool = True,
    ):
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.intermediate = config.intermediate_size
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.rotary = RotaryTable(rotary)
        self.final_norm = weights.dense["model.norm.weight"]
        self.dtype = self.final_norm.dtype
        embed_blocks = weights.blocks.get("model.embed_tokens.weight")
        self.embed = (
            TokenEmbedding(blocks=embed_blocks, width=config.hidden_size)
            if embed_blocks is not None
            else TokenEmbedding(dense=weights.dense["model.embed_tokens.weight"])
        )

        def linear(prefixes: tuple[str, ...], kind: str = quantization) -> DenseLinear:
            names = [f"{p}.weight" for p in prefixes]
            return make_linear(
                [weights.get(n) for n in names],
                [weights.get(f"{p}.bias") for p in prefixes],
                kind,
                max_m,
                [weights.blocks.get(n) for n in names],
                isa,
            )

        def layer(i: int) -> _Layer:
            at = f"model.layers.{i}"
            attn, mlp = f"{at}.self_attn", f"{at}.mlp"
            return _Layer(
                input_norm=weights.dense[f"{at}.input_layernorm.weight"],
                qkv=linear((f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj")),
                o_proj=linear((f"{attn}.o_proj",)),
                post_norm=weights.dense[f"{at}.post_attention_layernorm.weight"],
                gate_up=linear((f"{mlp}.gate_proj", f"{mlp}.up_proj")),
                down=linear((f"{mlp}.down_proj",)),
                q_norm=weights.get(f"{attn}.q_norm.weight"),
                k_norm=weights.get(f"{attn}.k_norm.weight"),
            )

        self.layers = [layer(i) for i in range(config.num_hidden_layers)]
        # Without blocks the LM head stays dense: tied to the embedding, it holds the GGUF's 8-bit (Q8_0) grid,
        # which neither int4 nor int8 represents; re-quantized per row it turned near-ties into wrong tokens
        # (measured). With the GGUF's own blocks it is exact.
        self.lm_head = linear(("lm_head",), "none")
        # Our C++ layer ops (fp32 on the CPU) for steps of short queries; None: torch ops only.
        fp32_cpu = self.dtype == torch.float32 and self.final_norm.device.type == "cpu"
        self.ops = kernels.load() if fp32_cpu and use_layer_ops else None
        if not weights.arena_bytes:
            self._blocks_on_huge_pages()
        self.stack, self.stack_rows = self._decoder_stack(max_m)

    def _blocks_on_huge_pages(self) -> None:
        """Every low-bit layer's blocks, which each step streams, in one region on huge pages."""
        low_bit = [lin for lin in self.linear_layers() if isinstance(lin, LowBitLinear)]
        copies = iter(huge_pages.gather([blocks for lin in low_bit for blocks in lin.blocks]))
        for lin in low_bit:
            lin.blocks = [next(copies) for _ in lin.blocks]

    def _decoder_stack(self, max_m: int):
        """The decoder layers, the final norm and the LM head as one native call (`kernels/decoder_stack.cpp`) for
        short steps of up to `max_m` rows, where every projection and the LM head run on the low-bit kernel at
        that size; else (None, 0)."""
        projections = self.linear_layers()
        if self.ops is None or self.rotary.per_step or not all(type(lin) is LowBitLinear for lin in projections):
            return None, 0
        if len({lin.isa for lin in projections}) != 1 or any(lin.max_m < max_m for lin in projections):
            return None, 0
        norms = [norm for layer in self.layers for norm in (layer.input_norm, layer.post_norm)] + [self.final_norm]
        head_norms = [norm for layer in self.layers for norm in (layer.q_norm, layer.k_norm) if norm is not None]
        stack = self.ops.DecoderStack(
            *self.embed.native(),
            norms,
            head_norms,
            [lin.blocks for lin in projections],
            [lin.rows for lin in projections],
            [lin.formats for lin in projections],
            [lin.bias for lin in projections],
            projections[0].isa,
            self.num_heads,
            self.num_kv_heads,
            self.scale,
            self.eps,
        )
        return stack, max_m

    def _forward_native(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, keep: torch.Tensor
    ) -> torch.Tensor:
        """NATIVE_STACK: the whole pass (embedding, layers, final norm, LM head) in one call of `self.stack`, the
        calls `_forward_loop` makes from Python, so the same bits. float32 logits on the CPU; no autograd inside,
        so the caller needs no inference mode."""
        cos, sin = self.rotary.tables(self.final_norm, max(s.start_pos + s.num_tokens for s in meta.slices))
        return self.stack.forward(
            input_ids, cos, sin, meta.kv_cache, meta.slot_mapping, positions, meta.row_seq, meta.block_tables, keep
        )

    def linear_layers(self) -> list[DenseLinear]:
        """Every linear layer a step runs, in order, LM head last."""
        return [lin for layer in self.layers for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)] + [
            self.lm_head
        ]

    def _forward_loop(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        keep: torch.Tensor,
        lora: LoraStep | None,
    ) -> torch.Tensor:
        """NATIVE_LOOP, for a step of decodes and verifications: per layer five calls into our kernels (norms fused
        with the residual adds, RoPE with the KV write and attention over the blocks in place, SiLU with the
        product) between the four projections. `_forward_native` makes the same calls in one native call; this
        loop serves the short steps the stack does not take (forward_plan.py: LoRA rows, more rows than the stack
        takes, projections not all on the low-bit kernel, rotary tables computed per step), and it is the stack's
        reference and what the decode profile (benchmarks/sections/decode_profile.py) times op by op."""
        ops, eps = self.ops, self.eps
        hidden = self.embed(input_ids)
        cos, sin = self.rotary(hidden, positions)
        normed = ops.add_rms_norm(hidden, None, self.layers[0].input_norm, eps)
        for index, layer in enumerate(self.layers):
            attended = ops.rope_paged_attention(
                self._head_normed(layer, _project(lora, index, "qkv", layer.qkv, normed)),
                cos,
                sin,
                meta.kv_cache[index],
                meta.slot_mapping,
                positions,
                meta.row_seq,
                meta.block_tables,
                self.num_heads,
                self.num_kv_heads,
                self.scale,
            )
            normed = ops.add_rms_norm(
                hidden, _project(lora, index, "o_proj", layer.o_proj, attended), layer.post_norm, eps
            )
            gated = ops.silu_mul(_project(lora, index, "gate_up", layer.gate_up, normed))
            delta = _project(lora, index, "down", layer.down, gated)
            if index + 1 < len(self.layers):
                normed = ops.add_rms_norm(hidden, delta, self.layers[index + 1].input_norm, eps)
        last = hidden[keep]
        return self.lm_head(ops.add_rms_norm(last, delta[keep], self.final_norm, eps))

    def _head_normed(self, layer: _Layer, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [T, (heads + 2 kv heads) * head_dim] with each query and key head RMS-normed (Qwen3), else as is."""
        if layer.q_norm is None:
            return qkv
        rows, q_width, k_width = qkv.shape[0], self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_width, k_width, k_width], dim=1)
        q = self.ops.add_rms_norm(q.reshape(-1, self.head_dim), None, layer.q_norm, self.eps).view(rows, q_width)
        k = self.ops.add_rms_norm(k.reshape(-1, self.head_dim), None, layer.k_norm, self.eps).view(rows, k_width)
        return torch.cat([q, k, v], dim=1)

    def forward(
        self,
        path: ForwardPath,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        keep: torch.Tensor,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] of the flat batch; returns logits [len(keep), vocab] of the rows `keep`, computed
        on `path` (the runner's plan for the step, forward_plan.py), with `lora`'s adapters added to their rows'
        projections (never on NATIVE_STACK)."""
        if path is ForwardPath.NATIVE_STACK:
            return self._forward_native(input_ids, positions, meta, keep)
        if path is ForwardPath.NATIVE_LOOP:
            return self._forward_loop(input_ids, positions, meta, keep, lora)
        # FUSED_TORCH: every op in torch, attention through SDPA over the gathered blocks (`paged_attention`)
        total = input_ids.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qk_heads = heads + kv_heads
        hidden = self.embed(input_ids)
        cos, sin = self.rotary(hidden, positions)
        cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, D], shared by every layer
        half = head_dim // 2
        for index, layer in enumerate(self.layers):
            qkv = _project(lora, index, "qkv", layer.qkv, _rms_norm(hidden, layer.input_norm, self.eps))
            qk = qkv[:, : qk_heads * head_dim].view(total, qk_heads, head_dim)
            if layer.q_norm is not None:
                qk = torch.cat(
                    [
                        _rms_norm(qk[:, :heads], layer.q_norm, self.eps),
                        _rms_norm(qk[:, heads:], layer.k_norm, self.eps),
                    ],
                    dim=1,
                )
            rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
            qk = qk * cos + rotated * sin
            value = qkv[:, qk_heads * head_dim :].view(total, kv_heads, head_dim)
            attended = paged_attention(index, qk[:, :heads], qk[:, heads:], value, meta, self.scale)
            hidden = hidden + _project(lora, index, "o_proj", layer.o_proj, attended.reshape(total, heads * head_dim))
            gate_up = _project(lora, index, "gate_up", layer.gate_up, _rms_norm(hidden, layer.post_norm, self.eps))
            gated = F.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :]
            hidden = hidden + _project(lora, index, "down", layer.down, gated)
        return self.lm_head(_rms_norm(hidden[keep], self.final_norm, self.eps))
