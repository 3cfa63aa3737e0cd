"""GGUF files as `model`: tiny random models of each architecture, written at test time with every block type
(testkit.tiny_gguf), served by our engine in process against transformers loading the same file in float32
(the near-tie rule, every near-tie counted: the engine computes the fp32 model up to summation order), and the
shipped SmolLM2 GGUF served straight from the file against today's converted folder."""

from __future__ import annotations

import pytest
import torch

from backend import EngineConfig, LLMEngine, SamplingParams
from backend.core.client_request import ClientRequest
from backend.core.config import ConfigError
from backend.model import model_source
from backend.model.linear import LowBitLinear
from launcher.paths import MODEL_DIR as SMOL_DIR
from testkit import fidelity
from testkit.tiny_gguf import smollm2_gguf

PROMPTS = [[504, 3575, 282, 4649, 314], [1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 300]]
NEW_TOKENS = 12
# arch -> (the model path the engine should take, layers on the kernel of 9: layer 1's gate/up holds an F32 weight;
# the families the fused forward does not compute run Hugging Face's modules on our paged cache, dense)
CASES = {
    "llama": ("fused", 8),
    "qwen2": ("fused", 8),
    "qwen3": ("fused", 8),
    "gemma2": ("hf", 0),
    "gemma3": ("hf", 0),
    "phi3": ("hf", 0),
}


@pytest.fixture(scope="module", autouse=True)
def caches(tmp_path_factory):
    """The prepared folders of this module's files in a folder of their own."""
    root = tmp_path_factory.mktemp("caches")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLM_MODEL_CACHE", str(root / "models"))
        yield


def greedy_with_logprobs(engine: LLMEngine, prompt_ids: list[int], tokens: int = NEW_TOKENS):
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=fidelity.TOP_K)
    engine.add_request(ClientRequest("r", "", prompt_ids, params))
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    sample = outputs[-1].samples[0]
    return sample.token_ids, sample.logprobs


def reference_judge(model, prompt_ids, ours, our_logprobs) -> fidelity.Verdict:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        want = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(ours), do_sample=False, eos_token_id=None
        )[0, len(prompt_ids) :].tolist()
        position = fidelity.first_difference(ours, want)
        if position is None:
            return fidelity.judge(ours, want, {}, None)
        logits = model(torch.tensor([prompt_ids + want[:position]])).logits[0, -1]
    top = {int(k): v for k, v in our_logprobs[position]["top_logprobs"].items()}
    return fidelity.judge(ours, want, top, logits)


@pytest.mark.parametrize("arch", CASES)
def test_a_gguf_file_is_served_as_transformers_computes_it(arch, tiny_gguf):
    impl, low_bit = CASES[arch]
    path, reference = tiny_gguf(arch)
    engine = LLMEngine(EngineConfig(model=str(path), kv_cache_blocks=32, quantization="gguf", max_num_seqs=4))
    assert engine.runner.impl == impl
    layers = engine.runner.fused.linear_layers() if engine.runner.fused else []
    assert sum(isinstance(lin, LowBitLinear) for lin in layers) == low_bit
    verdicts = [reference_judge(reference, ids, *greedy_with_logprobs(engine, ids)) for ids in PROMPTS]
    summary = fidelity.summarize(verdicts)
    print(f"{arch}: {summary}")  # the count of near-ties, for the report
    assert all(v.near_tie for v in verdicts), [v.detail for v in verdicts]


def test_the_shipped_gguf_file_serves_what_the_converted_folder_serves():
    from_file = LLMEngine(EngineConfig(model=str(smollm2_gguf()), kv_cache_blocks=32))
    assert "121 of 121 layers" in from_file.runner.kernel  # every weight from the file's own blocks
    got = [greedy_with_logprobs(from_file, PROMPTS[0], 24)[0]]
    del from_file
    from_folder = LLMEngine(EngineConfig(model=str(SMOL_DIR), kv_cache_blocks=32))
    assert got == [greedy_with_logprobs(from_folder, PROMPTS[0], 24)[0]]


def test_what_model_may_name(tmp_path):
    (tmp_path / "empty").mkdir()
    for bad, words in [
        (tmp_path / "missing", "does not exist"),
        (tmp_path / "empty", "no config.json"),
        (tmp_path / "notes.txt", "not a .gguf file"),
        (tmp_path / "m-00001-of-00002.gguf", "split GGUF"),
    ]:
        if bad.suffix:
            bad.write_bytes(b"")
        with pytest.raises(model_source.ModelSourceError, match=words) as error:
            model_source.resolve(bad)
        assert "a .gguf file" in str(error.value) or "merge" in str(error.value)
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(b"")
    with pytest.raises(model_source.ModelSourceError, match="2 .gguf files"):
        model_source.resolve(two)
    assert model_source.resolve(SMOL_DIR) == SMOL_DIR  # a Hugging Face folder is itself
    EngineConfig(model=str(smollm2_gguf()), quantization="gguf", draft_model=str(smollm2_gguf())).validate()
    with pytest.raises(ConfigError, match="parameter 'draft_model'.*is not a .gguf file"):
        EngineConfig(model=str(SMOL_DIR), draft_model=str(SMOL_DIR / "config.json")).validate()
    with pytest.raises(ConfigError, match="parameter 'model'.*does not exist"):
        LLMEngine(EngineConfig(model=str(tmp_path / "missing")))


def test_the_launcher_prepares_the_folder_the_front_door_reads(tmp_path, tiny_gguf):
    """`make serve` with a GGUF `model`: the launcher has the engine's code prepare the file's folder before the
    server starts, and hands it to the front door, whose tokenizer and chat template load from it."""
    from frontend.tokenizer import ModelTokenizer
    from launcher.model_config import served_model_folder, set_parameter
    from launcher.paths import DEFAULT_MODEL_REPOSITORY

    path = tiny_gguf("llama")[0]
    config = tmp_path / "llm" / "config.pbtxt"
    config.parent.mkdir()
    config.write_text(
        set_parameter((DEFAULT_MODEL_REPOSITORY / "llm" / "config.pbtxt").read_text(), "model", str(path))
    )
    folder = served_model_folder(config)
    assert folder == model_source.resolve(path) and (folder / model_source.GGUF_NAME).resolve() == path.resolve()
    tokenizer = ModelTokenizer(folder)
    assert tokenizer.chat_template and tokenizer.encode("Hello") == ModelTokenizer(SMOL_DIR).encode("Hello")
    config.write_text(set_parameter(config.read_text(), "model", str(tmp_path / "missing.gguf")))
    with pytest.raises(ValueError, match="parameter 'model'.*does not exist"):
        served_model_folder(config)
