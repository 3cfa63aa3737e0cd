"""Shared fixtures for the unit tests: tiny random Hugging Face models (with the real SmolLM2 tokenizer, so
detokenization is real), Hugging Face greedy references, the served model's tokenizer as the front door loads
it and as transformers does, and our built C++ kernels."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from launcher.paths import MODEL_DIR as SMOL_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
VOCAB_SIZE = 49152  # SmolLM2's vocabulary
EOS_ID = 2  # <|im_end|>


@pytest.fixture(scope="session", autouse=True)
def real_threads():
    """The engine's tests need OS threads: importing locust (or anything calling gevent's monkey.patch_all) in
    the pytest process turns them into greenlets, and the thread-ordering tests then hang."""
    import threading

    assert threading.Thread.__module__ == "threading", (
        f"threading is monkey-patched ({threading.Thread.__module__}): run locust in a subprocess, never import it"
    )


def _tiny_config(family: str, **overrides):
    import transformers

    common = dict(vocab_size=VOCAB_SIZE, bos_token_id=1, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    if family == "gpt2":
        kwargs = dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, n_inner=128)
        return transformers.GPT2Config(**{**common, **kwargs, **overrides})
    kwargs = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
        "qwen3": transformers.Qwen3Config,
        "gemma2": transformers.Gemma2Config,
        "gemma3": transformers.Gemma3TextConfig,
        "phi3": transformers.Phi3Config,
    }[family]
    if family in ("qwen3", "gemma2", "gemma3"):
        kwargs["head_dim"] = 16  # (their default is 128 or 256)
    if family in ("gemma2", "gemma3", "phi3"):
        # windows shorter than the test prompts, so that the sliding layers' masks matter
        kwargs["sliding_window"] = 8
    if family == "gemma2":
        kwargs["attn_logit_softcapping"] = 0.5  # small enough to change random scores (the default is 50)
    if family in ("gemma2", "gemma3"):
        kwargs["query_pre_attn_scalar"] = 16
        kwargs["layer_types"] = ["sliding_attention", "full_attention"]
    return cls(**{**common, **kwargs, **overrides})


def make_tiny_model(folder: Path, family: str = "llama", seed: int = 0, dtype=None, **overrides) -> str:
    """A randomly initialised model of `family` saved in `folder` (weights in `dtype`, default float32) with
    SmolLM2's tokenizer files."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_tiny_config(family, **overrides)).to(dtype or torch.float32)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(SMOL_DIR / name, folder / name)
    return str(folder)


@pytest.fixture(scope="session")
def built_kernels():
    """The compiled kernels module (backend/model/kernels), built here if the cache has none."""
    from backend.model import kernels

    built = kernels.load()
    assert built is not None, f"the kernels did not build: {kernels.load_error()}"
    return built


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """family -> path of a tiny random model of that family (created once per session)."""
    if not (SMOL_DIR / "tokenizer.json").exists():
        pytest.skip(f"no tokenizer at {SMOL_DIR} (make model)")
    cache: dict[str, str] = {}

    def get(family: str = "llama") -> str:
        if family not in cache:
            cache[family] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{family}"), family)
        return cache[family]

    return get


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def tiny_llama_head_32(tmp_path_factory) -> str:
    """A tiny Llama whose heads are 32 wide (hidden 128, 4 heads): the shortest a q8_0 KV cache holds."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama-head-32"), "llama", hidden_size=128)


@pytest.fixture(scope="session")
def tokenizer():
    if not (SMOL_DIR / "tokenizer.json").exists():
        pytest.skip(f"no tokenizer at {SMOL_DIR} (make model)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SMOL_DIR)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """arch -> (path, transformers' float32 model of it) of a tiny random GGUF with every block type
    (testkit.tiny_gguf; qwen2's head untied), written and loaded once per session: transformers reads a GGUF's
    49152-token vocabulary item by item, 15-20 s a load on 2 cores."""
    cache: dict = {}

    def get(arch: str):
        if arch not in cache:
            from testkit.tiny_gguf import reference_model, write_tiny_gguf

            path = write_tiny_gguf(
                tmp_path_factory.mktemp(f"gguf-{arch}") / f"{arch}.gguf", arch=arch, tied=arch not in ("qwen2", "phi3")
            )
            cache[arch] = path, reference_model(path)
        return cache[arch]

    return get


@pytest.fixture(scope="module")
def ours():
    """The front door's tokenizer (frontend/tokenizer.py) of the served model's folder, compared with `theirs`."""
    from frontend.tokenizer import ModelTokenizer

    return ModelTokenizer(SMOL_DIR)


@pytest.fixture(scope="module")
def theirs():
    """transformers' AutoTokenizer of the served model's folder, one per test module (a test warms it up)."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(SMOL_DIR))


@pytest.fixture(scope="session")
def hf_model_cache():
    """path -> the Hugging Face model (float32, eval mode), loaded once (testkit.hf_reference's cache)."""
    from testkit.hf_reference import HFReference

    return lambda path: HFReference.shared(path).model


@pytest.fixture(scope="session")
def hf_greedy():
    """(path, prompt ids, max_new_tokens) -> the new tokens of HF greedy `generate` (float32), stopping after EOS
    (testkit.hf_reference: the one reference, memoized)."""
    from testkit.hf_reference import HFReference

    def run(path: str, prompt_ids: list[int], max_new_tokens: int, stop_at_eos: bool = True) -> list[int]:
        return HFReference.shared(path).greedy(prompt_ids, max_new_tokens, stop_at_eos=stop_at_eos)

    return run


def pytest_configure(config):
    """One intra-op thread: the tiny models gain nothing from more, and on a shared 2-core machine torch's
    spinning worker threads make every small matmul several times slower."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def make_engine(tiny_llama):
    """config overrides -> an engine on the tiny model, one per distinct config, cleaned up between tests."""
    engines: dict = {}

    from backend import EngineConfig, LLMEngine

    def get(**overrides) -> LLMEngine:
        settings = dict(
            model=tiny_llama,
            dtype="float32",
            block_size=4,
            kv_cache_blocks=256,
            max_num_batched_tokens=64,
            max_num_seqs=16,
            seed=1234,
        )
        settings.update(overrides)
        key = tuple(sorted(settings.items()))
        if key not in engines:
            engines[key] = LLMEngine(EngineConfig(**settings))
        engine = engines[key]
        for request_id in list(engine.requests):  # leftovers of a failed test
            engine.abort(request_id)
        assert not engine.has_work()
        return engine

    return get
