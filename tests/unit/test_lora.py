"""backend/model/lora.py: PEFT adapters on the fused forward, per row of a step, against transformers + PEFT."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from backend.model.lora import AdapterError, load_adapter
from backend.model.runner import ForwardItem, ModelRunner
from testkit.lora_adapters import make_adapter, reference_model
from tests.unit.paged_cases import BLOCK, NUM_BLOCKS, PROMPTS, scattered_tables

MAX_RANK = 16


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    """Two adapters of different ranks and target modules, and their PEFT reference models."""
    root = tmp_path_factory.mktemp("adapters")
    made = {
        "attn": make_adapter(tiny_llama, root / "attn", rank=8, targets=("q_proj", "k_proj", "v_proj", "o_proj")),
        "mlp": make_adapter(tiny_llama, root / "mlp", rank=16, targets=("gate_proj", "up_proj", "down_proj"), seed=1),
    }
    return {name: (path, reference_model(tiny_llama, path)) for name, path in made.items()}


@pytest.mark.parametrize("quantization", ["none", "q8_0"])
def test_rows_of_two_adapters_and_the_base_model_in_one_step(tiny_llama, adapters, quantization):
    """One ragged step holds a prefill under each adapter and one without: each row set gets its own model's
    logits (q8_0: the base model is the re-quantized one, and the adapters add to it)."""
    runner = ModelRunner(tiny_llama, "float32", BLOCK, NUM_BLOCKS, quantization=quantization)
    loaded = {name: load_adapter(name, path, runner.model, MAX_RANK) for name, (path, _) in adapters.items()}
    base = ModelRunner(tiny_llama, "float32", BLOCK, NUM_BLOCKS, quantization=quantization)
    tables = scattered_tables(3, 12, seed=4)
    prompt = PROMPTS[0]
    items = [
        ForwardItem(prompt, 0, tables[0], 4, loaded["attn"]),
        ForwardItem(prompt, 0, tables[1], 4),
        ForwardItem(prompt, 0, tables[2], 4, loaded["mlp"]),
    ]
    logits = runner.forward(items)
    assert logits.shape == (12, runner.shape.vocab_size)
    # the same step without adapters: the base rows are untouched, bit for bit
    plain = base.forward([ForwardItem(it.token_ids, 0, it.block_table, 4) for it in items])[4:8]
    assert torch.equal(logits[4:8], plain)
    references = {name: model for name, (_, model) in adapters.items()}
    if quantization == "q8_0":  # the runner re-quantized the base model's weights: so do the references
        from backend.model.weight_blocks import quantize_q8_0

        references = {name: copy.deepcopy(model) for name, model in references.items()}
        with torch.no_grad():
            for model in references.values():
                for name, module in model.base_model.model.named_modules():
                    if type(module) is torch.nn.Linear and "lora_" not in name and module.in_features % 32 == 0:
                        module.weight.copy_(quantize_q8_0(module.weight).dequantize())
    for rows, name in ((slice(0, 4), "attn"), (slice(8, 12), "mlp")):
        with torch.no_grad():
            want = references[name](torch.tensor([prompt])).logits[0, -4:]
        assert not torch.allclose(want, plain, atol=1e-2), "the adapter must change the model's output"
        torch.testing.assert_close(logits[rows], want, rtol=1e-4, atol=1e-4)
    # decoding continues from each row's own cache: one token each, short-query path
    step = runner.forward(
        [ForwardItem([7], len(prompt), tables[0], 1, loaded["attn"]), ForwardItem([7], len(prompt), tables[1], 1)]
    )
    with torch.no_grad():
        want = references["attn"](torch.tensor([prompt + [7]])).logits[0, -1]
    torch.testing.assert_close(step[0], want, rtol=1e-4, atol=1e-4)


def test_rank_stabilized_scaling(tiny_llama, tmp_path):
    """use_rslora: scaling alpha / sqrt(r), as PEFT computes it."""
    path = make_adapter(tiny_llama, tmp_path / "rs", rank=4, targets=("down_proj",), use_rslora=True)
    runner = ModelRunner(tiny_llama, "float32", BLOCK, NUM_BLOCKS)
    adapter = load_adapter("rs", path, runner.model, MAX_RANK)
    assert adapter.projections[(0, "down")].parts[0][3] == 16 / 2
    table = scattered_tables(1, 12, seed=1)[0]
    logits = runner.forward([ForwardItem(PROMPTS[0], 0, table, 2, adapter)])
    with torch.no_grad():
        want = reference_model(tiny_llama, path)(torch.tensor([PROMPTS[0]])).logits[0, -2:]
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)


def test_adapters_that_cannot_be_served_get_clear_errors(tiny_llama, adapters, tmp_path):
    runner = ModelRunner(tiny_llama, "float32", BLOCK, NUM_BLOCKS)
    path = adapters["mlp"][0]
    with pytest.raises(AdapterError, match="rank 16 is above max_lora_rank 8"):
        load_adapter("mlp", path, runner.model, 8)
    with pytest.raises(AdapterError, match="is not a folder"):
        load_adapter("x", tmp_path / "missing", runner.model, MAX_RANK)
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        load_adapter("x", tmp_path / "empty", runner.model, MAX_RANK)
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((path / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(AdapterError, match="use_dora"):
        load_adapter("x", dora, runner.model, MAX_RANK)
    (dora / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match="cannot read adapter_model.safetensors"):
        load_adapter("x", dora, runner.model, MAX_RANK)
    other = ModelRunner(make_wider_model(tmp_path), "float32", BLOCK, NUM_BLOCKS)
    with pytest.raises(AdapterError, match="do not fit the model's"):
        load_adapter("mlp", path, other.model, MAX_RANK)


def make_wider_model(tmp_path) -> str:
    from tests.unit.conftest import make_tiny_model

    return make_tiny_model(tmp_path / "wider", "llama", intermediate_size=96)


def test_a_bfloat16_model_adds_the_deltas_in_float32_as_peft_does(tiny_llama, adapters):
    """PEFT casts the adapter weights to fp32 and the layer's input to them, adds in fp32 and rounds the sum to the
    model's dtype once; on a bf16 model our rows follow it (bf16 + int4 is `auto`'s pick where bf16 is native and
    no kernel runs)."""
    from peft import PeftModel

    from backend.model import model_source

    runner = ModelRunner(tiny_llama, "bfloat16", BLOCK, NUM_BLOCKS)
    adapter = load_adapter("mlp", adapters["mlp"][0], runner.model, MAX_RANK)
    table = scattered_tables(1, 12, seed=2)[0]
    logits = runner.forward([ForwardItem(PROMPTS[0], 0, table, 3, adapter)])
    base = model_source.load_model(tiny_llama, dtype=torch.bfloat16)
    reference = PeftModel.from_pretrained(base, str(adapters["mlp"][0])).eval()
    with torch.no_grad():
        want = reference(torch.tensor([PROMPTS[0]])).logits[0, -3:].float()
    assert torch.equal(logits.argmax(-1), want.argmax(-1))
    assert (logits - want).abs().max() <= 0.05 * want.abs().max()  # bf16 summation orders
