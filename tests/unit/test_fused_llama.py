"""backend/model/fused_llama.py: the Llama-family fast path computes what the generic path (Hugging Face's own
modules with our paged attention) computes, on a ragged batch of chunked prefills and decodes."""

from __future__ import annotations

import pytest
import torch

from backend.model import fused_llama, huge_pages, model_source
from backend.model.linear import LowBitLinear
from backend.model.runner import ModelRunner
from backend.model.weight_blocks import FORMATS
from tests.unit.paged_cases import BLOCK, NUM_BLOCKS, ragged_step_items


def ragged_steps(runner: ModelRunner) -> list[torch.Tensor]:
    """Logits of paged_cases' three ragged steps: prompt chunks, decodes and a verification of three positions."""
    return [runner.forward(items) for items in ragged_step_items()]


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3"])
def test_fused_equals_generic_in_float32(family, tiny_model_factory):
    path = tiny_model_factory(family)
    fused = ModelRunner(path, "float32", BLOCK, NUM_BLOCKS, model_impl="fused")
    generic = ModelRunner(path, "float32", BLOCK, NUM_BLOCKS, model_impl="hf")
    assert fused.impl == "fused" and generic.impl == "hf"
    for got, want in zip(ragged_steps(fused), ragged_steps(generic)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_follows_llama_3_rope_scaling_and_an_untied_head(tmp_path):
    """Llama-3's rope scaling (the rotary tables come from the model's own rotary module) and a separate LM head,
    at positions past the original context length, where the scaling changes the frequencies."""
    from tests.unit.conftest import make_tiny_model

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    path = make_tiny_model(
        tmp_path / "llama3",
        "llama",
        rope_scaling={**scaling, "original_max_position_embeddings": 8},
        tie_word_embeddings=False,
    )
    fused = ModelRunner(path, "float32", BLOCK, NUM_BLOCKS, model_impl="fused")
    generic = ModelRunner(path, "float32", BLOCK, NUM_BLOCKS, model_impl="hf")
    assert fused.model.config.rope_parameters["rope_type"] == "llama3"
    assert fused.fused.lm_head.weight.data_ptr() != fused.fused.embed.dense.data_ptr()
    for got, want in zip(ragged_steps(fused), ragged_steps(generic)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_is_close_to_generic_in_bfloat16(tiny_llama):
    fused = ModelRunner(tiny_llama, "bfloat16", BLOCK, NUM_BLOCKS, model_impl="fused")
    generic = ModelRunner(tiny_llama, "bfloat16", BLOCK, NUM_BLOCKS, model_impl="hf")
    for got, want in zip(ragged_steps(fused), ragged_steps(generic)):
        scale = want.abs().max()
        assert (got - want).abs().max() <= 0.05 * scale  # bf16 rounding of differently-shaped matmuls
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


def test_quantized_runner_stays_close_to_bfloat16(tiny_llama):
    dense = ModelRunner(tiny_llama, "bfloat16", BLOCK, NUM_BLOCKS)
    quantized = ModelRunner(tiny_llama, "bfloat16", BLOCK, NUM_BLOCKS, quantization="int4")
    for got, want in zip(ragged_steps(quantized), ragged_steps(dense)):
        assert (got - want).abs().max() <= 0.15 * want.abs().max()


def test_auto_picks_the_fused_path_only_for_supported_families(tiny_model_factory):
    assert ModelRunner(tiny_model_factory("llama"), "float32", BLOCK, 8).impl == "fused"
    gpt2 = tiny_model_factory("gpt2")
    assert ModelRunner(gpt2, "float32", BLOCK, 8).impl == "hf"
    with pytest.raises(ValueError, match="fused path supports"):
        ModelRunner(gpt2, "float32", BLOCK, 8, model_impl="fused")


def test_supports_rejects_what_it_does_not_compute():
    class Config:
        architectures = ["LlamaForCausalLM"]
        hidden_act = "silu"

    assert fused_llama.supports(Config())
    Config.hidden_act = "gelu"
    assert not fused_llama.supports(Config())
    Config.hidden_act, Config.architectures = "silu", ["GemmaForCausalLM"]
    assert not fused_llama.supports(Config())


def test_a_sliding_window_shorter_than_the_context_takes_hugging_faces_modules(tmp_path):
    """Mistral-7B-v0.1's 4096-token window in a 32k context: the fused forward would attend too far back."""
    from transformers import MistralConfig, Qwen2Config

    def config(cls, **kwargs):
        return cls(architectures=[cls.__name__.replace("Config", "ForCausalLM")], max_position_embeddings=512, **kwargs)

    assert not fused_llama.supports(config(MistralConfig, sliding_window=8))
    assert fused_llama.supports(config(MistralConfig, sliding_window=None))
    assert fused_llama.supports(config(MistralConfig, sliding_window=4096))  # never reached
    assert fused_llama.supports(config(Qwen2Config, sliding_window=8, use_sliding_window=False))
    assert not fused_llama.supports(config(Qwen2Config, sliding_window=8, use_sliding_window=True))


def test_q8_0_runner_computes_its_own_grid_exactly(tiny_llama):
    """quantization q8_0: the low-bit kernel (the 12- and 3-row steps) and the dense fallback (the 28-row step,
    over `max_lowbit_rows`) both compute the re-quantized model, which the generic path computes from the same
    de-quantized weights."""
    from backend.model.weight_blocks import quantize_q8_0

    quantized = ModelRunner(tiny_llama, "float32", BLOCK, NUM_BLOCKS, quantization="q8_0", max_lowbit_rows=16)
    threads = torch.get_num_threads()
    assert f"low-bit kernel for 9 of 9 layers, on {threads} thread{'s' * (threads > 1)};" in quantized.kernel
    assert quantized.kernel.endswith("decoder layers in one native call for steps of up to 16 rows")
    generic = ModelRunner(tiny_llama, "float32", BLOCK, NUM_BLOCKS, model_impl="hf")
    with torch.no_grad():
        for module in generic.model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(quantize_q8_0(module.weight).dequantize())
    for got, want in zip(ragged_steps(quantized), ragged_steps(generic)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_layer_ops_equal_torch_ops(tiny_llama):
    """The C++ decoder-layer ops (short-query steps) against the same fused path on torch ops."""
    with_ops = ModelRunner(tiny_llama, "float32", BLOCK, NUM_BLOCKS)
    assert with_ops.fused.ops is not None
    without = ModelRunner(tiny_llama, "float32", BLOCK, NUM_BLOCKS)
    without.fused.ops = None
    for got, want in zip(ragged_steps(with_ops), ragged_steps(without)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory) -> str:
    """A tiny Llama saved in bf16, as most checkpoints are."""
    from tests.unit.conftest import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("bf16"), "llama", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def tiny_bf16_in_fp32(tmp_path_factory) -> str:
    """The same model saved in fp32: weights that 16 bits hold exactly, in a checkpoint that does not say so."""
    from transformers import AutoModelForCausalLM

    from tests.unit.conftest import make_tiny_model

    folder = make_tiny_model(tmp_path_factory.mktemp("bf16-in-fp32"), "llama", dtype=torch.bfloat16)
    AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).save_pretrained(folder)
    return folder


def kernel_measured(monkeypatch, faster: bool) -> None:
    """What `quantization: half` measures at load, set: on tiny weights a call's overhead decides it."""
    monkeypatch.setattr(LowBitLinear, "one_row_timings", lambda self: (1.0, 2.0) if faster else (2.0, 1.0))


def test_half_serves_a_bf16_checkpoint_from_its_own_files(tiny_bf16, tiny_bf16_in_fp32, monkeypatch, caplog):
    """quantization half on a checkpoint stored in bf16: every projection, the embedding and the head on the
    kernel, read from the safetensors without an fp32 load (the modules stay meta tensors; the resident weights are
    the planned 16-bit bytes): the same logits, bit for bit, as the same values loaded in fp32 and served from their
    16-bit form, and the fp32 model that the generic path computes."""
    with caplog.at_level("INFO", logger="backend.model.runner"):
        half = ModelRunner(tiny_bf16, "float32", BLOCK, NUM_BLOCKS, quantization="half")
    assert "the checkpoint's own 16-bit weights, read from its files" in caplog.text
    assert "low-bit kernel for 9 of 9 layers" in half.kernel
    assert {f for lin in half.fused.linear_layers() for f in lin.formats} == {FORMATS["bf16"]}
    assert half.fused.embed.blocks is not None and half.fused.embed.blocks.format == "bf16"
    assert all(p.device.type == "meta" for p in half.model.parameters())
    assert half.weight_bytes == half.memory_plan.weights
    kernel_measured(monkeypatch, faster=True)
    loaded = ModelRunner(tiny_bf16_in_fp32, "float32", BLOCK, NUM_BLOCKS, quantization="half")
    assert "low-bit kernel for 9 of 9 layers" in loaded.kernel
    for got, want in zip(ragged_steps(half), ragged_steps(loaded)):
        assert torch.equal(got, want)
    generic = ModelRunner(tiny_bf16, "float32", BLOCK, NUM_BLOCKS, model_impl="hf")
    for got, want in zip(ragged_steps(half), ragged_steps(generic)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_half_keeps_dense_weights_where_they_measure_faster_or_are_not_16_bit(
    tiny_bf16_in_fp32, tiny_llama, monkeypatch, caplog
):
    """An fp32 checkpoint is loaded in fp32 first: its 16-bit form serves only where it measures faster."""
    kernel_measured(monkeypatch, faster=False)
    with caplog.at_level("INFO", logger="backend.model.runner"):
        assert ModelRunner(tiny_bf16_in_fp32, "float32", BLOCK, NUM_BLOCKS, quantization="half").kernel == "torch"
    assert "dense fp32 weights serve, faster on this CPU (one row through a" in caplog.text
    kernel_measured(monkeypatch, faster=True)
    with caplog.at_level("INFO", logger="backend.model.runner"):
        assert ModelRunner(tiny_llama, "float32", BLOCK, NUM_BLOCKS, quantization="half").kernel == "torch"
    assert "none of 15 linear weights is exact in 16 bits" in caplog.text


def test_only_a_16_bit_checkpoint_counts_as_one(tiny_bf16, tiny_llama):
    assert model_source.stored_in_16_bits(tiny_bf16)
    assert not model_source.stored_in_16_bits(tiny_llama)


@pytest.mark.parametrize(
    "forced,expected,same_as", [("avx2", "avx2 low-bit kernel", "q8_0"), ("none", "torch", "none")]
)
def test_a_cpu_without_the_fast_instruction_set(tiny_llama, monkeypatch, forced, expected, same_as):
    """Simulated by lowering the kernel's instruction set: AVX2 still runs the kernel on the Q8_0 grid; with
    none, q8_0 is not applied and the dense fp32 weights serve (the load log says so)."""
    reference = ModelRunner(tiny_llama, "float32", BLOCK, NUM_BLOCKS, quantization=same_as)
    monkeypatch.setenv("LLM_KERNEL_ISA", forced)
    runner = ModelRunner(tiny_llama, "float32", BLOCK, NUM_BLOCKS, quantization="q8_0")
    assert runner.kernel.startswith(expected)
    for got, want in zip(ragged_steps(runner), ragged_steps(reference)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class CountingStack:
    """A DecoderStack that counts its calls (so a test knows the native path ran)."""

    def __init__(self, stack):
        self.stack, self.calls = stack, 0

    def forward(self, *args):
        self.calls += 1
        return self.stack.forward(*args)


def assert_stack_is_the_python_loop(native: ModelRunner, python: ModelRunner) -> None:
    """`native` (its decoder stack in use) and `python` (the same model, its stack taken away) give the same bits
    over ragged steps, and the stack ran."""
    assert native.fused.stack is not None and native.fused.stack.layers() == len(native.fused.layers)
    native.fused.stack = counting = CountingStack(native.fused.stack)
    python.fused.stack, python.fused.stack_rows = None, 0
    for got, want in zip(ragged_steps(native), ragged_steps(python)):
        assert torch.equal(got, want)
    assert counting.calls >= 2


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_decoder_stack_is_the_python_layer_loop_bit_for_bit(family, tiny_model_factory):
    """Short steps run every decoder layer in one native call (kernels/decoder_stack.cpp) where all projections
    are low-bit kernel layers: the same calls as the Python loop, so the same bits (qwen2: with q/k/v biases;
    qwen3: with query and key head norms)."""
    path = tiny_model_factory(family)
    runners = [ModelRunner(path, "float32", BLOCK, NUM_BLOCKS, quantization="q8_0") for _ in range(2)]
    assert_stack_is_the_python_loop(*runners)


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_decoder_stack_over_a_16_bit_kv_cache_is_the_python_layer_loop_bit_for_bit(kv_dtype, tiny_llama):
    """kv_cache_dtype float16 / bfloat16: the stack writes and reads the 16-bit cache as the Python loop's
    rope_paged_attention calls do, so the same bits."""
    runners = [
        ModelRunner(tiny_llama, "float32", BLOCK, NUM_BLOCKS, quantization="q8_0", kv_dtype=kv_dtype) for _ in range(2)
    ]
    assert runners[0].kv_cache.dtype == getattr(torch, kv_dtype)
    assert_stack_is_the_python_loop(*runners)


def test_decoder_stack_over_a_q8_0_kv_cache_is_the_python_layer_loop_bit_for_bit(tiny_llama_head_32):
    """kv_cache_dtype q8_0: the stack quantizes into and reads from the records as the Python loop's
    rope_paged_attention calls do, so the same bits."""
    runners = [
        ModelRunner(tiny_llama_head_32, "float32", BLOCK, NUM_BLOCKS, quantization="q8_0", kv_dtype="q8_0")
        for _ in range(2)
    ]
    assert runners[0].kv_cache.dtype == torch.uint8
    assert_stack_is_the_python_loop(*runners)


def test_decoder_stack_writes_each_format_of_a_projection_into_its_columns(tmp_path):
    """A GGUF file's fused QKV holds segments of different block formats (here Q4_K queries, Q5_0 keys, Q6_K
    values): the stack writes each segment into its columns of one output, where the Python loop concatenates
    them, and gets the same bits."""
    from testkit.tiny_gguf import DEFAULT_TYPES, write_tiny_gguf

    low_bit = {role: kind for role, kind in DEFAULT_TYPES.items() if kind not in ("F32", "F16", "BF16")}
    path = str(write_tiny_gguf(tmp_path / "mixed.gguf", types=low_bit))
    runners = [ModelRunner(path, "float32", BLOCK, NUM_BLOCKS, quantization="gguf") for _ in range(2)]
    assert len(set(runners[0].fused.layers[0].qkv.formats)) == 3
    assert_stack_is_the_python_loop(*runners)


def test_no_decoder_stack_where_a_projection_is_dense(tiny_llama):
    """Without low-bit blocks (dense fp32 projections) the Python loop serves short steps."""
    assert ModelRunner(tiny_llama, "float32", BLOCK, NUM_BLOCKS).fused.stack is None


def test_low_bit_blocks_and_kv_cache_live_on_huge_pages(tiny_llama):
    """Every low-bit layer's blocks are copied into one region (huge pages where the system offers them), and the
    KV cache gets its own; the load log says which."""
    runner = ModelRunner(tiny_llama, "float32", BLOCK, NUM_BLOCKS, quantization="q8_0")
    blocks = [b for lin in runner.fused.linear_layers() for b in lin.blocks]
    assert len(blocks) == 9 and len({b.untyped_storage().data_ptr() for b in blocks}) == 1
    assert runner.fused.stack is not None  # built over the copies
    assert runner.memory == huge_pages.describe()
    if huge_pages.available():
        assert blocks[0].data_ptr() % huge_pages.HUGE_PAGE == 0
        assert runner.kv_cache.data_ptr() % huge_pages.HUGE_PAGE == 0
