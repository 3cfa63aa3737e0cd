"""Loads a Hugging Face causal LM, owns its paged KV cache, and runs one ragged forward pass per step."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from backend.model import (
    fused_llama,
    gguf_weights,
    huge_pages,
    kernels,
    kv_formats,
    memory_plan,
    model_source,
    safetensors_weights,
)
from backend.model.forward_plan import ForwardPath, ForwardPlan, plan_forward
from backend.model.gguf_weights import find_gguf
from backend.model.hardware import KERNEL_KINDS
from backend.model.linear import LowBitLinear
from backend.model.lora import LoraAdapter, LoraStep
from backend.model.memory_plan import MemoryPlan
from backend.model.model_weights import ModelWeights
from backend.model.paged_attention import ATTENTION_NAME, AttentionMetadata, SeqSlice, build_metadata
from backend.model.weight_blocks import Q4_1_INT8, HalfWeights, Packed, quantize_q8_0

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Up to how many rows a step takes the low-bit weights (beyond, the dense GEMM is faster), by what serves them:
# our kernel per instruction set, torch's int4/int8 over bf16. Measured per step size on two cores
# (docs/benchmarks.md). On 8 threads and more torch's GEMM gains more than our kernel does: a 16-core Xeon
# measured the dense GEMM ahead at 64 rows there, so those counts stop at 32.
LOWBIT_ROWS = {"avx512": 128, "avx2": 128, "torch": 8}
MANY_THREADS, MANY_THREADS_LOWBIT_ROWS = 8, 32


def default_lowbit_rows(kernel: str, threads: int) -> int:
    """The measured crossover for `kernel` (a LOWBIT_ROWS key) on `threads` threads."""
    rows = LOWBIT_ROWS[kernel]
    return min(rows, MANY_THREADS_LOWBIT_ROWS) if threads >= MANY_THREADS else rows


@dataclass
class ModelShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int

    @classmethod
    def of(cls, config) -> ModelShape:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            num_layers=config.num_hidden_layers,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
            max_model_len=getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 2048),
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Of a KV cache of `dtype` (kv_formats.KV_DTYPES: uint8 is q8_0's records)."""
        return 2 * self.num_layers * self.num_kv_heads * kv_formats.row_bytes(dtype, self.head_dim)


@dataclass
class ForwardItem:
    """One sequence's part of a step: tokens to compute from position `start_pos`, and how many of its last
    positions need logits (1 to sample, k + 1 to verify k draft tokens, 0 for a mid-prompt chunk)."""

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    num_logits: int
    adapter: LoraAdapter | None = None  # the LoRA adapter its rows run with


@dataclass
class StepInputs:
    """A step's flat batch: `rows` tokens with their positions, attention metadata, the rows that get logits, and
    the rows of each LoRA adapter (by adapter uid)."""

    rows: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    keep: torch.Tensor
    adapted: dict[int, tuple[LoraAdapter, list[int]]]


class ModelRunner:
    """`model_impl`: "fused" runs the Llama-family fast path (`fused_llama.py`), "hf" Hugging Face's own
    modules with our attention plugged in, "auto" the fused path where it supports the model. Each pass computes
    on `threads` threads (0: torch's current count). The KV cache holds `kv_dtype` (None: the model's dtype;
    "q8_0": llama.cpp's 8-bit records, kv_formats.py); attention computes in the model's dtype whatever the cache
    holds."""

    def __init__(
        self,
        model_path: str,
        dtype: str,
        block_size: int,
        num_blocks: int,
        device: str = "cpu",
        model_impl: str = "auto",
        quantization: str = "none",
        max_lowbit_rows: int = 0,
        threads: int = 0,
        step_tokens: int = 512,
        kv_dtype: str | None = None,
    ):
        self.threads = threads or torch.get_num_threads()
        kernels.set_threads(self.threads)
        self.dtype = DTYPES[dtype]
        self.kv_dtype = kv_formats.KV_DTYPES[kv_dtype] if kv_dtype else self.dtype
        self.device = torch.device(device)
        self.block_size = block_size
        model_path = str(model_source.resolve(model_path))
        config = AutoConfig.from_pretrained(model_path)
        fused = model_impl == "fused" or (model_impl == "auto" and fused_llama.supports(config))
        if model_impl == "fused" and not fused_llama.supports(config):
            raise ValueError(f"the fused path supports {fused_llama.ARCHITECTURES}, not this model")
        isa = kernels.best_isa() if fused and quantization in KERNEL_KINDS else 0
        # Straight from the file: the GGUF's blocks, or a 16-bit checkpoint's own weights (no fp32 load).
        from_file = ""
        if fused and isa and quantization in ("gguf", "gguf_int8") and find_gguf(model_path) is not None:
            from_file = "gguf"
        elif fused and isa and quantization == "half" and model_source.stored_in_16_bits(model_path):
            from_file = "safetensors"
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.shape = ModelShape.of(config)
        kv_formats.row_width(self.kv_dtype, self.shape.head_dim)  # refuses q8_0 where head_dim % 32, before loading
        self.memory_plan = self._plan(config, model_path, from_file, quantization, num_blocks, block_size, step_tokens)
        if from_file:
            # Straight from the file: the Hugging Face model is only names and shapes (meta tensors, no memory).
            with torch.device("meta"):
                self.model = AutoModelForCausalLM.from_config(config, dtype=self.dtype)
            if from_file == "gguf":
                weights = gguf_weights.load(model_path, heads, kv_heads)
                log.info("quantization %s: the GGUF's own blocks, read from the file", quantization)
            else:
                weights = safetensors_weights.load(model_path, config.tie_word_embeddings)
                log.info("quantization half: the checkpoint's own 16-bit weights, read from its files")
            rotary = type(self.model.model.rotary_emb)(config=config)
        else:
            self.model = (
                model_source.load_model(model_path, dtype=self.dtype, attn_implementation=ATTENTION_NAME)
                .to(self.device)
                .eval()
            )
            blocks, isa = self._low_bit_blocks(quantization) if fused else ({}, 0)
            weights = ModelWeights.of_model(self.model, blocks)
            rotary = type(self.model.model.rotary_emb)(config=config).to(self.device) if fused else None
        self.queries_per_kv = heads // self.shape.num_kv_heads
        blocks = weights.blocks
        kernel = kernels.ISA_NAMES[isa] if blocks else "torch"
        self.max_lowbit_rows = max_lowbit_rows or default_lowbit_rows(kernel, self.threads)
        self.fused = None
        if fused:
            self.fused = fused_llama.FusedLlama(
                self.model.config, weights, rotary, quantization, isa, self.max_lowbit_rows
            )
            # the fused forward holds what it reads; the modules' own tensors would be a second copy
            self.model.to("meta")
        self.weight_bytes = weights.block_bytes + weights.dense_bytes
        self.impl = "fused" if fused else "hf"
        self.kernel = "torch"
        if self.fused is not None and blocks:
            layers = self.fused.linear_layers()
            low_bit = sum(isinstance(lin, LowBitLinear) for lin in layers)
            threads = kernels.threads()
            self.kernel = (
                f"{kernels.ISA_NAMES[isa]} low-bit kernel for {low_bit} of {len(layers)} layers, on "
                f"{threads} thread{'' if threads == 1 else 's'}"
            )
            int8 = sum(Q4_1_INT8 in lin.formats for lin in layers if isinstance(lin, LowBitLinear))
            if int8:
                self.kernel += (
                    f"; {int8} of them with activations rounded to int8 (gguf_int8: not exact), "
                    f"multiplied with {kernels.int8_products(isa)}"
                )
            if self.fused.stack is not None:
                self.kernel += f"; decoder layers in one native call for steps of up to {self.fused.stack_rows} rows"
        self._allocate_kv_cache(num_blocks)

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        s = self.shape
        cache_shape = (
            s.num_layers,
            2,
            num_blocks,
            self.block_size,
            s.num_kv_heads,
            kv_formats.row_width(self.kv_dtype, s.head_dim),
        )
        self.memory = "the KV cache on the device"
        if self.device.type == "cpu":
            self.kv_cache = huge_pages.zeros(cache_shape, self.kv_dtype)
            self.memory = huge_pages.describe()
        else:
            self.kv_cache = torch.zeros(cache_shape, dtype=self.kv_dtype, device=self.device)

    def sharing_weights(self, num_blocks: int) -> ModelRunner:
        """A runner of these very weights (the model, the fused forward and its kernel blocks: no copy) with a KV
        cache of its own of `num_blocks` blocks: `draft_model: self` served as the target is. Passes run one at a
        time on the engine thread, so the two never compute at once."""
        twin = copy.copy(self)
        twin._allocate_kv_cache(num_blocks)
        return twin

    def _plan(self, config, model_path, from_file, quantization, num_blocks, block_size, step_tokens) -> MemoryPlan:
        """What loading will hold (memory_plan.py), logged, and refused (MemoryError) where it does not fit."""
        s = self.shape
        heads = config.num_attention_heads
        if from_file == "gguf":
            weights = gguf_weights.planned_bytes(model_path, heads, s.num_kv_heads)
        elif from_file == "safetensors":
            weights = safetensors_weights.planned_bytes(model_path)
        else:  # the model's parameters in its dtype, and the kernel's copies (at most half of fp32's bytes)
            with torch.device("meta"):
                skeleton = AutoModelForCausalLM.from_config(config)
            numel = sum(p.numel() for p in skeleton.parameters())
            weights = numel * self.dtype.itemsize + (numel * 2 if quantization in KERNEL_KINDS else 0)
        per_token = s.kv_bytes_per_token(self.kv_dtype)
        hidden, attention = config.hidden_size, heads * s.head_dim
        intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
        widths = attention + 2 * s.num_kv_heads * s.head_dim + 2 * attention + 3 * hidden + 3 * intermediate
        activations = step_tokens * 4 * (widths + s.vocab_size)
        plan = MemoryPlan(
            weights,
            num_blocks * block_size * per_token,
            num_blocks * block_size,
            activations,
            memory_plan.resident_bytes(),
            memory_plan.available_bytes(),
        )
        log.info("memory plan: %s", plan.describe())
        plan.check(per_token)
        return plan

    def _low_bit_blocks(self, quantization: str) -> tuple[dict[str, Packed], int]:
        """For a loaded model, the weights the low-bit kernel serves ("half": its 16-bit weights; "q8_0": every
        linear weight re-quantized) and the instruction set it runs on; none where no kernel runs (a GGUF whose
        blocks it serves is read by `gguf_weights.load` instead)."""
        if quantization not in KERNEL_KINDS:
            return {}, 0
        isa = kernels.best_isa()
        if not isa or quantization in ("gguf", "gguf_int8"):
            log.warning(
                "quantization %s: no low-bit kernel on this CPU (%s); dense fp32 weights serve",
                quantization,
                kernels.load_error() or "neither AVX2+FMA nor AVX-512",
            )
            return {}, 0
        if quantization == "half":
            return self._half_weights(isa), isa
        blocks = {}
        for name, module in self._linear_modules():
            if module.in_features % 32 == 0:
                q8 = quantize_q8_0(module.weight.detach())
                blocks[f"{name}.weight"] = q8.packed()
                # The dense weights become the same grid, so steps past max_lowbit_rows compute the same model.
                module.weight.data.copy_(q8.dequantize())
        log.info("quantization q8_0: %d weights re-quantized (not exact: the bf16 fidelity rule)", len(blocks))
        return blocks, isa

    def _linear_modules(self) -> list[tuple[str, torch.nn.Linear]]:
        return [(n, m) for n, m in self.model.named_modules() if isinstance(m, torch.nn.Linear)]

    def _half_weights(self, isa: int) -> dict[str, Packed]:
        """Every linear weight that 16 bits hold exactly (a bf16 / fp16 checkpoint, loaded in fp32), for the kernel,
        where it measures faster than dense fp32 on this CPU (one row through the largest such weight)."""
        halves, total = {}, 0
        for name, module in self._linear_modules():
            total += 1
            half = HalfWeights.of(module.weight.detach()) if module.in_features % 32 == 0 else None
            if half is not None:
                halves[f"{name}.weight"] = (half.packed(), module.weight.detach())
        if not halves:
            log.info("quantization half: none of %d linear weights is exact in 16 bits; dense fp32 weights", total)
            return {}
        packed, weight = max(halves.values(), key=lambda pair: pair[1].numel())
        kernel_ms, dense_ms = LowBitLinear(weight, None, [packed], isa, max_m=1).one_row_timings()
        measured = (
            f"one row through a {weight.shape[0]}x{weight.shape[1]} weight: {kernel_ms:.3f} ms on the kernel, "
            f"{dense_ms:.3f} ms dense fp32"
        )
        if kernel_ms >= dense_ms:
            log.info("quantization half: dense fp32 weights serve, faster on this CPU (%s)", measured)
            return {}
        formats = sorted({p.format for p, _ in halves.values()})
        log.info(
            "quantization half: %d of %d linear weights exact in 16 bits (%s), served from them (%s)",
            len(halves),
            total,
            ", ".join(formats),
            measured,
        )
        return {name: p for name, (p, _) in halves.items()}

    @staticmethod
    def read_shape(model_path: str) -> ModelShape:
        return ModelShape.of(AutoConfig.from_pretrained(model_source.resolve(model_path)))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            src = torch.tensor([c[0] for c in copies], device=self.device)
            dst = torch.tensor([c[1] for c in copies], device=self.device)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def step_inputs(self, items: list[ForwardItem]) -> StepInputs:
        """The flat batch of `items`, as the forward reads it."""
        tokens, positions, slices, keep = [], [], [], []
        adapted: dict[int, tuple[LoraAdapter, list[int]]] = {}
        for item in items:
            start_row = len(tokens)
            n = len(item.token_ids)
            if item.adapter is not None:
                adapted.setdefault(item.adapter.uid, (item.adapter, []))[1].extend(range(start_row, start_row + n))
            tokens.extend(item.token_ids)
            positions.extend(range(item.start_pos, item.start_pos + n))
            slices.append(SeqSlice(start_row, n, item.start_pos, item.block_table))
            keep.extend(range(start_row + n - item.num_logits, start_row + n))
        return StepInputs(
            len(tokens),
            torch.tensor(tokens, device=self.device),
            torch.tensor(positions, device=self.device),
            build_metadata(slices, self.block_size, self.kv_cache, self.queries_per_kv),
            torch.tensor(keep, dtype=torch.long, device=self.device),
            adapted,
        )

    def plan(self, step: StepInputs) -> ForwardPlan:
        """Which forward path computes `step`, and why (forward_plan.py)."""
        short_queries = step.meta.block_tables is not None
        return plan_forward(self.fused, step.rows, short_queries, bool(step.adapted), self.threads)

    def forward(self, items: list[ForwardItem]) -> torch.Tensor:
        """Run one pass over all items on the path `plan` picks; returns float32 logits [sum(num_logits), vocab] on
        the CPU."""
        step = self.step_inputs(items)
        plan = self.plan(step)
        # torch's pool for the pass and the sampling after it; set per step, as others in the process may change it
        if torch.get_num_threads() != plan.torch_threads:
            torch.set_num_threads(plan.torch_threads)
        if plan.path is ForwardPath.NATIVE_STACK:
            # outside inference mode, which cost a one-row step about 30 us to enter (docs/benchmarks.md)
            return self.fused.forward(plan.path, step.input_ids, step.positions, step.meta, step.keep)
        return self._forward_torch(plan.path, step)

    @torch.inference_mode()
    def _forward_torch(self, path: ForwardPath, step: StepInputs) -> torch.Tensor:
        """`forward` on `path` in inference mode: Hugging Face's modules, or the fused forward on torch ops or on the
        Python loop over our layer ops."""
        if path is ForwardPath.HF_MODULES:
            out = self.model(
                input_ids=step.input_ids[None],
                position_ids=step.positions[None],
                use_cache=False,
                logits_to_keep=step.keep,
                paged_attention=step.meta,
            )
            return out.logits[0].float().cpu()
        lora = None
        if step.adapted:
            lora = LoraStep(
                [(adapter, torch.tensor(rows, device=self.device)) for adapter, rows in step.adapted.values()]
            )
        logits = self.fused.forward(path, step.input_ids, step.positions, step.meta, step.keep, lora)
        return logits.float().cpu()
