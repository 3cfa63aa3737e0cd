"""What the engine loads besides the target model: the folder a `model` parameter names, the dtype and weight
kind a model is served in (logged with the reason), its end-of-sequence token ids, and the speculative proposer
its configuration asks for."""

from __future__ import annotations

import logging

from transformers import GenerationConfig

from backend.core.config import ConfigError, EngineConfig
from backend.model import kernels, model_source
from backend.model.hardware import KERNEL_KINDS, resolve_for_model
from backend.model.runner import ModelRunner
from backend.sampling.sampler import Sampler
from backend.spec import eagle_head
from backend.spec.auto_proposer import AutoProposer
from backend.spec.eagle_proposer import EagleProposer
from backend.spec.proposers import DraftModelProposer, NgramProposer, Proposer
from backend.spec.suffix_proposer import SuffixProposer

log = logging.getLogger(__name__)


def model_folder(model: str, parameter: str) -> str:
    """The folder `model` (a Hugging Face folder, a GGUF file or a folder holding one) is loaded from."""
    try:
        return str(model_source.resolve(model))
    except model_source.ModelSourceError as exc:
        raise ConfigError(f"parameter {parameter!r}: {exc}") from None


def resolve_weights(config: EngineConfig, model: str, dtype: str, quantization: str) -> tuple[str, str]:
    """The dtype and weight kind that `model` is served in, logged with the reason."""
    try:
        dtype, quantization, why, isa = resolve_for_model(model, dtype, quantization, config.device)
    except ValueError as exc:
        raise ConfigError(f"parameter 'quantization': {exc}") from None
    log.info(
        "%s: dtype %s, quantization %s (%s; kernel instruction set: %s)",
        model,
        dtype,
        quantization,
        why,
        kernels.ISA_NAMES[isa],
    )
    return dtype, quantization


def eos_token_ids(model_path: str, tokenizer) -> set[int]:
    """The model's generation config's EOS ids and the tokenizer's."""
    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        eos = None
    for value in (eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(value)
    return ids


def _eagle_proposer(
    folder: str, target: ModelRunner | None, sampler: Sampler, parameter: str = "draft_head"
) -> EagleProposer:
    if target is None:
        raise ConfigError(f"parameter {parameter!r}: an EAGLE draft head needs the target's runner")
    if not eagle_head.is_eagle_folder(folder):
        raise ConfigError(f"parameter {parameter!r}: {folder} holds no EAGLE draft head (make draft writes one)")
    try:
        return EagleProposer(folder, target, sampler)
    except ValueError as exc:
        raise ConfigError(f"parameter {parameter!r}: {exc}") from None


def make_proposer(
    config: EngineConfig,
    requested_quantization: str,
    num_blocks: int,
    vocab_size: int,
    sampler: Sampler,
    target: ModelRunner | None = None,
) -> Proposer | None:
    """The configured proposer: none, n-gram lookup, suffix decoding, `auto` (suffix decoding or the trained head, per
    sequence), or a draft model (the target's own weights for `self`) with a KV cache of `num_blocks` blocks, which
    must share the target's vocabulary of `vocab_size` tokens."""
    if not config.speculative:
        return None
    if config.draft_model == "ngram":
        return NgramProposer(config.ngram_min, config.ngram_max)
    if config.draft_model in ("suffix", "auto"):
        suffix = SuffixProposer(
            config.suffix_max_depth, config.suffix_min_token_prob, config.suffix_spec_factor, config.suffix_cache_tokens
        )
        if config.draft_model == "suffix":
            return suffix
        head = _eagle_proposer(config.draft_head, target, sampler) if config.draft_head else None
        return AutoProposer(suffix, head, config.spec_row_cost, config.spec_head_token_cost)
    path = config.model if config.draft_model == "self" else model_folder(config.draft_model, "draft_model")
    if config.draft_model != "self" and eagle_head.is_eagle_folder(path):
        return _eagle_proposer(path, target, sampler, "draft_model")
    requested = requested_quantization
    if requested in KERNEL_KINDS and config.draft_dtype != "float32":
        requested = "auto"  # fp32-activation kinds; a reduced-precision draft takes what its dtype allows
    dtype, quantization = resolve_weights(config, path, config.draft_dtype, requested)
    if (
        config.draft_model == "self"
        and target is not None
        and (dtype, quantization) == (config.dtype, config.quantization)
    ):
        # the target's own weights in the same form: shared, not loaded again (`target`'s runner, the config's
        # resolved dtype and quantization)
        log.info(
            "draft_model self: the target's weights, shared (dtype %s, quantization %s); its own KV cache",
            dtype,
            quantization,
        )
        runner = target.sharing_weights(num_blocks)
    else:
        if config.draft_model == "self":
            log.info(
                "draft_model self: a second copy of the target's weights in dtype %s, quantization %s (the target's: "
                "%s, %s; draft_dtype %s shares them)",
                dtype,
                quantization,
                config.dtype,
                config.quantization,
                config.dtype,
            )
        runner = ModelRunner(
            path,
            dtype,
            config.block_size,
            num_blocks,
            config.device,
            config.model_impl,
            quantization,
            config.max_lowbit_rows,
        )
    if runner.shape.vocab_size < vocab_size:
        raise ConfigError(
            f"parameter 'draft_model': its vocabulary ({runner.shape.vocab_size}) is smaller than the "
            f"target's ({vocab_size}); the draft must share the target's tokenizer"
        )
    return DraftModelProposer(runner, sampler)
