"""backend/model/runner.py + paged_attention.py: one ragged forward pass over a paged KV cache gives the same
tokens and logits as Hugging Face, for tiny random models of several architectures."""

from __future__ import annotations

import pytest
import torch

from backend.model.kv_formats import quantize_q8_0
from backend.model.runner import LOWBIT_ROWS, MANY_THREADS, ForwardItem, ModelRunner, ModelShape, default_lowbit_rows
from tests.unit.paged_cases import BLOCK, NUM_BLOCKS, PROMPTS, scattered_tables

# gemma2 (soft-capped scores), gemma3 and phi3 (sliding windows) on Hugging Face's modules with our paged attention
FAMILIES = ["llama", "qwen2", "mistral", "gpt2", "gemma2", "gemma3", "phi3"]


def paged_greedy(runner: ModelRunner, prompts: list[list[int]], max_new: int, first_chunk: int) -> list[list[int]]:
    """Greedy decoding of all prompts in one batch: the first prompt's prefill is split in two chunks (the
    second chunk runs together with the other prompts' first decode), then everyone decodes together."""
    tables = scattered_tables(len(prompts), 12)
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)

    def step(parts):  # parts: (index, number of tokens, wants logits)
        items = [
            ForwardItem(tokens[i][computed[i] : computed[i] + n], computed[i], tables[i], 1 if sample else 0)
            for i, n, sample in parts
        ]
        logits = runner.forward(items)
        assert logits.dtype == torch.float32
        assert logits.shape == (sum(1 for *_, s in parts if s), runner.shape.vocab_size)
        row = 0
        for i, n, sample in parts:
            computed[i] += n
            if sample:
                tokens[i].append(int(torch.argmax(logits[row])))
                row += 1

    step([(0, first_chunk, False)] + [(i, len(p), True) for i, p in enumerate(prompts) if i > 0])
    step([(0, len(prompts[0]) - first_chunk, True)] + [(i, 1, True) for i in range(1, len(prompts))])
    while any(len(t) - len(p) < max_new for t, p in zip(tokens, prompts)):
        step([(i, 1, True) for i, (t, p) in enumerate(zip(tokens, prompts)) if len(t) - len(p) < max_new])
    return [t[len(p) : len(p) + max_new] for t, p in zip(tokens, prompts)]


@pytest.mark.parametrize("family", FAMILIES)
def test_paged_greedy_matches_hf_generate(family, tiny_model_factory, hf_greedy):
    path = tiny_model_factory(family)
    runner = ModelRunner(path, "float32", BLOCK, NUM_BLOCKS)
    max_new = 8
    # first chunk of 18 tokens: a long query (its own attention call); the rest share the short-query call
    got = paged_greedy(runner, PROMPTS, max_new, first_chunk=18)
    for prompt, tokens in zip(PROMPTS, got):
        assert tokens == hf_greedy(path, prompt, max_new, stop_at_eos=False)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2"])
def test_logits_match_hf_forward(family, tiny_model_factory, hf_model_cache):
    path = tiny_model_factory(family)
    runner = ModelRunner(path, "float32", BLOCK, NUM_BLOCKS)
    prompt = PROMPTS[0]
    table = scattered_tables(1, 16, seed=3)[0]
    with torch.no_grad():
        reference = hf_model_cache(path)(torch.tensor([prompt])).logits[0].float()
    # 11 tokens without logits, then the rest asking logits for its last 4 positions (speculative-style)
    assert runner.forward([ForwardItem(prompt[:11], 0, table, 0)]).shape[0] == 0
    logits = runner.forward([ForwardItem(prompt[11:], 11, table, 4)])
    assert logits.shape == (4, runner.shape.vocab_size)
    assert torch.allclose(logits, reference[-4:], atol=1e-4, rtol=1e-4)
    # a single decode token continues from the cache
    logits = runner.forward([ForwardItem([7], len(prompt), table, 1)])
    with torch.no_grad():
        full = hf_model_cache(path)(torch.tensor([prompt + [7]])).logits[0, -1].float()
    assert torch.allclose(logits[0], full, atol=1e-4, rtol=1e-4)


def test_copy_blocks(tiny_llama):
    runner = ModelRunner(tiny_llama, "float32", BLOCK, 8)
    runner.kv_cache[:, :, 1] = 1.0
    runner.kv_cache[:, :, 2] = 2.0
    runner.copy_blocks([(1, 5), (2, 6)])
    assert torch.all(runner.kv_cache[:, :, 5] == 1.0) and torch.all(runner.kv_cache[:, :, 6] == 2.0)
    assert torch.all(runner.kv_cache[:, :, 1] == 1.0)
    assert torch.all(runner.kv_cache[:, :, 7] == 0.0)
    runner.copy_blocks([])


def test_copied_block_continues_like_the_original(tiny_llama, hf_model_cache):
    """Copy-on-write at the model level: a forked sequence continues from a copy of the shared block."""
    runner = ModelRunner(tiny_llama, "float32", BLOCK, 16)
    prompt = [11, 22, 33, 44, 55, 66]
    runner.forward([ForwardItem(prompt, 0, [3, 4], 1)])
    runner.copy_blocks([(4, 9)])  # the child's copy of the partial block
    a = runner.forward([ForwardItem([1], 6, [3, 4], 1)])[0]
    b = runner.forward([ForwardItem([1], 6, [3, 9], 1)])[0]
    assert torch.allclose(a, b, atol=1e-5)
    with torch.no_grad():
        ref = hf_model_cache(tiny_llama)(torch.tensor([prompt + [1]])).logits[0, -1]
    assert torch.allclose(a, ref, atol=1e-4)


def test_bf16_runs(tiny_llama):
    runner = ModelRunner(tiny_llama, "bfloat16", BLOCK, 16)
    assert runner.kv_cache.dtype == torch.bfloat16
    assert next(runner.model.parameters()).dtype == torch.bfloat16
    logits = runner.forward([ForwardItem([1, 2, 3, 4, 5], 0, [0, 1], 1), ForwardItem([9, 8], 0, [2], 2)])
    assert logits.shape == (3, runner.shape.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    logits = runner.forward([ForwardItem([6], 5, [0, 1], 1)])
    assert logits.shape == (1, runner.shape.vocab_size) and torch.isfinite(logits).all()
    assert runner.kv_cache.abs().sum() > 0


@pytest.mark.parametrize("model_impl", ["fused", "hf"])
@pytest.mark.parametrize("kv_dtype,atol", [("float16", 2e-3), ("bfloat16", 2e-2)])
def test_a_16_bit_kv_cache_holds_the_float32_keys_rounded(tiny_llama, model_impl, kv_dtype, atol):
    """kv_cache_dtype float16 / bfloat16 on an fp32 model: the first layer's keys and values are the fp32 cache's
    rounded (bit for bit: nothing before them differs), and the logits of a prefill (torch ops) and of decodes
    (our kernels on the fused path) stay within the rounding of the fp32 cache's."""
    exact = ModelRunner(tiny_llama, "float32", BLOCK, NUM_BLOCKS, model_impl=model_impl)
    half = ModelRunner(tiny_llama, "float32", BLOCK, NUM_BLOCKS, model_impl=model_impl, kv_dtype=kv_dtype)
    assert half.kv_cache.dtype == getattr(torch, kv_dtype)
    assert model_impl == "hf" or half.fused.ops is not None  # decodes on our kernels
    assert half.memory_plan.kv_cache * 2 == exact.memory_plan.kv_cache
    prompt = list(range(3, 40))
    table = scattered_tables(1, 12, seed=5)[0]
    steps = [ForwardItem(prompt, 0, table, 2)] + [ForwardItem([7 + i], len(prompt) + i, table, 1) for i in range(3)]
    for item in steps:
        torch.testing.assert_close(half.forward([item]), exact.forward([item]), rtol=0, atol=atol)
    assert torch.equal(half.kv_cache[0], exact.kv_cache[0].to(half.kv_cache.dtype))


@pytest.mark.parametrize("model_impl", ["fused", "hf"])
def test_a_q8_0_kv_cache_holds_the_float32_keys_quantized(tiny_llama_head_32, model_impl):
    """kv_cache_dtype q8_0 on an fp32 model: the cache is uint8 rows of llama.cpp's block_q8_0 records (34 bytes
    per 32 values, which the memory plan counts); the first layer's rows are the fp32 cache's quantized by
    kv_formats.quantize_q8_0 (bit for bit: nothing before them differs), and the logits of a prefill (torch ops)
    and of decodes (our kernels on the fused path) stay within the quantization's error of the fp32 cache's."""
    exact = ModelRunner(tiny_llama_head_32, "float32", BLOCK, NUM_BLOCKS, model_impl=model_impl)
    q8 = ModelRunner(tiny_llama_head_32, "float32", BLOCK, NUM_BLOCKS, model_impl=model_impl, kv_dtype="q8_0")
    assert q8.kv_cache.dtype == torch.uint8 and q8.kv_cache.shape[-1] == 34
    assert model_impl == "hf" or q8.fused.ops is not None  # decodes on our kernels
    assert q8.memory_plan.kv_cache * 4 * 32 == exact.memory_plan.kv_cache * 34
    assert q8.shape.kv_bytes_per_token(torch.uint8) == 2 * 2 * 2 * 34
    prompt = list(range(3, 40))
    table = scattered_tables(1, 12, seed=5)[0]
    steps = [ForwardItem(prompt, 0, table, 2)] + [ForwardItem([7 + i], len(prompt) + i, table, 1) for i in range(3)]
    for item in steps:
        torch.testing.assert_close(q8.forward([item]), exact.forward([item]), rtol=0, atol=1e-2)  # measured 5e-3
    assert torch.equal(q8.kv_cache[0], quantize_q8_0(exact.kv_cache[0]))


def test_a_q8_0_kv_cache_needs_heads_of_whole_records(tiny_llama):
    """Refused at load, naming the parameter, where a head is not whole records (the tiny Llama's are 16 wide)."""
    from backend import EngineConfig, LLMEngine
    from backend.core.config import ConfigError

    message = "q8_0 KV cache needs a head_dim that is a multiple of 32, not 16"
    with pytest.raises(ValueError, match=message):
        ModelRunner(tiny_llama, "float32", BLOCK, NUM_BLOCKS, kv_dtype="q8_0")
    with pytest.raises(ConfigError, match="parameter 'kv_cache_dtype': a " + message):
        LLMEngine(EngineConfig(model=tiny_llama, kv_cache_dtype="q8_0"))


def test_model_shape(tiny_model_factory):
    llama = ModelRunner.read_shape(tiny_model_factory("llama"))
    assert isinstance(llama, ModelShape)
    assert (llama.num_layers, llama.num_kv_heads, llama.head_dim, llama.vocab_size, llama.max_model_len) == (
        2,
        2,
        16,
        49152,
        512,
    )
    assert llama.kv_bytes_per_token(torch.float32) == 2 * 2 * 2 * 16 * 4
    assert llama.kv_bytes_per_token(torch.bfloat16) == 2 * 2 * 2 * 16 * 2
    gpt2 = ModelRunner.read_shape(tiny_model_factory("gpt2"))
    assert gpt2.num_kv_heads == 4 and gpt2.head_dim == 16 and gpt2.max_model_len == 512


def test_kv_cache_shape(tiny_llama):
    runner = ModelRunner(tiny_llama, "float32", 8, 5)
    assert tuple(runner.kv_cache.shape) == (2, 2, 5, 8, 2, 16)


def test_torch_gets_the_threads_only_for_passes_it_computes(tiny_llama):
    """Our kernels' pool always has the runner's threads; torch's own pool runs on one thread in passes that our
    kernels carry whole (the decoder stack and a low-bit LM head), on all of them where torch's GEMM serves."""
    from backend.model import kernels

    saved = torch.get_num_threads()
    try:
        runner = ModelRunner(
            tiny_llama, "float32", BLOCK, NUM_BLOCKS, quantization="q8_0", max_lowbit_rows=4, threads=2
        )
        assert kernels.threads() == 2
        table = scattered_tables(1, 12)[0]
        runner.forward([ForwardItem(PROMPTS[0][:8], 0, table, 1)])  # 8 rows: dense GEMM
        assert torch.get_num_threads() == 2
        runner.forward([ForwardItem(PROMPTS[0][8:10], 8, table, 1)])  # 2 rows: our kernels only
        assert torch.get_num_threads() == 1
        assert kernels.threads() == 2
    finally:
        torch.set_num_threads(saved)
        kernels.set_threads(0)


def test_lowbit_rows_default_to_the_crossover_for_the_kernel_and_threads(tiny_llama):
    """Up to 7 threads our kernel serves steps of up to its instruction set's measured row count; from 8 threads
    on, where torch's GEMM scales further, at most 32 rows; a configured count always wins."""
    from backend.model import kernels

    for kernel, rows in LOWBIT_ROWS.items():
        assert default_lowbit_rows(kernel, 2) == rows
        assert default_lowbit_rows(kernel, MANY_THREADS) == min(rows, 32)
    saved = torch.get_num_threads()
    try:
        runner = ModelRunner(tiny_llama, "float32", BLOCK, NUM_BLOCKS, quantization="q8_0", threads=2)
        assert runner.max_lowbit_rows == LOWBIT_ROWS[kernels.ISA_NAMES[kernels.best_isa()]] == 128
        runner = ModelRunner(tiny_llama, "float32", BLOCK, NUM_BLOCKS, quantization="q8_0", threads=MANY_THREADS)
        assert runner.max_lowbit_rows == 32
        configured = ModelRunner(tiny_llama, "float32", BLOCK, NUM_BLOCKS, quantization="q8_0", max_lowbit_rows=5)
        assert configured.max_lowbit_rows == 5
    finally:
        torch.set_num_threads(saved)
        kernels.set_threads(0)


def test_attention_groups_are_built_only_when_sdpa_reads_them(tiny_llama):
    """A decode step's metadata holds the block tables our in-place attention reads; the SDPA groups (padded
    query index and masks) are built on first use only, and then cover the step as before."""
    from backend.model.paged_attention import SeqSlice, build_metadata

    runner = ModelRunner(tiny_llama, "float32", BLOCK, NUM_BLOCKS)
    tables = scattered_tables(2, 3)
    meta = build_metadata([SeqSlice(0, 1, 5, tables[0]), SeqSlice(1, 2, 9, tables[1])], BLOCK, runner.kv_cache)
    assert meta.block_tables.tolist() == tables and meta.row_seq.tolist() == [0, 1, 1]
    assert "groups" not in vars(meta)
    (group,) = meta.groups
    assert group.num_queries == 2 and group.out_rows.tolist() == [0, 1, 2]
