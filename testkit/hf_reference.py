"""The one Hugging Face greedy reference: `transformers` `generate`, one prompt at a time, with one cache.

What every exactness check of the tests and benchmarks compares the engine with (float32 by default: the
dtype every fp32 path is held to token for token; the fidelity rule's reduced-precision checks pass bf16):

- batch 1, no padding, an all-ones attention mask, `do_sample=False`, at most `max_tokens` new tokens;
- a text prompt is tokenized as the server tokenizes it, `tokenizer(prompt).input_ids`, with no chat
  template (a caller that wants one renders it first: `apply_chat_template(..., tokenize=False)`); a prompt
  given as token ids is used as it is;
- `stop_at_eos=True` (the default): generation stops after the model's EOS (its generation config), the EOS
  included; `stop_at_eos=False`: EOS does not stop it (`eos_token_id=None`), every completion has max_tokens;
- `text` is the completion decoded as the server decodes it (special tokens skipped, no clean-up of spaces).

The cache: models are loaded once per (folder, dtype) and instance (`HFReference.shared` returns one instance
per (folder, dtype) for the whole process), completions are memoized per instance, and an instance given a
`cache_path` keeps them in that JSON file across sessions, valid while the model's files and the dtype are the
same (a fingerprint). An instance is thread-safe (one lock; a computation holds it).

torch and transformers are imported when a model is first needed, not when this module is imported.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from testkit import fidelity

if TYPE_CHECKING:
    import torch

CACHE_FORMAT = 2  # bumped when the cache file's layout or the reference's semantics change

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class RefOutput:
    token_ids: list[int]
    text: str  # decoded like the server (special tokens skipped)


def dtype_name(dtype: str | torch.dtype) -> str:
    """ "float32" for "float32" or torch.float32."""
    return str(dtype).removeprefix("torch.")


class HFReference:
    """Hugging Face greedy `generate` on the model of `model_dir` in `dtype` (the module docstring says how)."""

    _shared: dict[tuple[str, str], HFReference] = {}
    _shared_lock = threading.Lock()

    def __init__(
        self, model_dir: str | Path, dtype: str | torch.dtype = "float32", cache_path: str | Path | None = None
    ):
        self.model_dir = Path(model_dir)
        self.dtype = dtype_name(dtype)
        self.cache_path = Path(cache_path) if cache_path else None
        self._lock = threading.RLock()
        self._model = None
        self._tokenizer = None
        self._memo: dict[str, list[int]] = {}
        self._fingerprint = ""
        if self.cache_path is not None:
            self._fingerprint = self._model_fingerprint()
            if self.cache_path.exists():
                try:
                    data = json.loads(self.cache_path.read_text())
                    if data.get("fingerprint") == self._fingerprint:
                        self._memo = {k: list(v) for k, v in data["entries"].items()}
                except (ValueError, KeyError, TypeError, AttributeError):
                    pass

    @classmethod
    def shared(
        cls, model_dir: str | Path, dtype: str | torch.dtype = "float32", cache_path: str | Path | None = None
    ) -> HFReference:
        """The process's one instance for (model_dir, dtype): its model is loaded once, its completions computed
        once. `cache_path` applies when the instance is first made (later calls may leave it out; a different
        one is an error)."""
        key = (str(Path(model_dir).resolve()), dtype_name(dtype))
        with cls._shared_lock:
            ref = cls._shared.get(key)
            if ref is None:
                ref = cls._shared[key] = cls(model_dir, dtype, cache_path)
            elif cache_path and (ref.cache_path is None or Path(cache_path) != ref.cache_path):
                raise ValueError(
                    f"HFReference.shared({model_dir!r}, {key[1]}) was made with cache_path="
                    f"{ref.cache_path}, not {cache_path}"
                )
            return ref

    # ------------------------------------------------------------------------------------------- the model

    def _load(self):
        with self._lock:
            if self._model is None:
                import torch

                from backend.model import model_source

                # a GGUF's prepared folder loads the GGUF as transformers de-quantizes it
                self._model = model_source.load_model(self.model_dir, dtype=getattr(torch, self.dtype)).eval()
            return self._model

    @property
    def model(self):
        """The Hugging Face model, in eval mode (loaded on first use)."""
        return self._load()

    @property
    def tokenizer(self):
        """The model's Hugging Face tokenizer (loaded on first use)."""
        with self._lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            return self._tokenizer

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """Prompt token ids as the server makes them (`tokenizer(prompt).input_ids`); ids are kept as they are."""
        return self.tokenizer(prompt).input_ids if isinstance(prompt, str) else [int(t) for t in prompt]

    # ---------------------------------------------------------------------------------------- completions

    @staticmethod
    def _key(prompt: Prompt, max_tokens: int, stop_at_eos: bool) -> str:
        return json.dumps(
            [prompt if isinstance(prompt, str) else [int(t) for t in prompt], int(max_tokens), bool(stop_at_eos)]
        )

    def _generate(self, prompt: Prompt, max_tokens: int, stop_at_eos: bool) -> list[int]:
        import torch

        model = self._load()
        ids = torch.tensor([self.prompt_ids(prompt)], dtype=torch.long)
        eos = model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        pad = model.generation_config.pad_token_id
        extra = {} if stop_at_eos else {"eos_token_id": None}
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_tokens,
                pad_token_id=pad if pad is not None else min(eos_ids, default=0),
                **extra,
            )
        new = out[0, ids.shape[1] :].tolist()
        if stop_at_eos:  # (batch 1: generation stops there already)
            end = next((i for i, t in enumerate(new) if t in eos_ids), None)
            new = new if end is None else new[: end + 1]
        return new

    def greedy_many(
        self, cases: Sequence[tuple[Prompt, int]], *, stop_at_eos: bool = True, stop: threading.Event | None = None
    ) -> list[list[int]] | None:
        """The new token ids of each (prompt, max_tokens) case (computed once; kept in the cache file if any).
        `stop` (set) abandons the work between cases: None is returned."""
        keys = [self._key(p, m, stop_at_eos) for p, m in cases]
        with self._lock:
            missing = [(k, c) for k, c in dict(zip(keys, cases, strict=True)).items() if k not in self._memo]
            for k, (prompt, max_tokens) in missing:
                if stop is not None and stop.is_set():
                    return None
                self._memo[k] = self._generate(prompt, max_tokens, stop_at_eos)
            if missing and self.cache_path is not None:
                tmp = self.cache_path.with_suffix(".tmp")
                tmp.write_text(json.dumps({"fingerprint": self._fingerprint, "entries": self._memo}))
                tmp.replace(self.cache_path)
            return [list(self._memo[k]) for k in keys]

    def greedy(self, prompt: Prompt, max_tokens: int, *, stop_at_eos: bool = True) -> list[int]:
        """The new token ids of greedy `generate` on `prompt` (text or token ids)."""
        return self.greedy_many([(prompt, max_tokens)], stop_at_eos=stop_at_eos)[0]

    def decode(self, token_ids: list[int]) -> str:
        """Token ids as the server detokenizes a completion (special tokens skipped, spaces not cleaned up)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def many(self, cases: Sequence[tuple[Prompt, int]], stop: threading.Event | None = None) -> list[RefOutput]:
        """Reference outputs (token ids and text) of (prompt, max_tokens) cases, stopping at EOS; `stop` (set)
        abandons the work between cases ([] is returned)."""
        done = self.greedy_many(cases, stop=stop)
        return [] if done is None else [RefOutput(ids, self.decode(ids)) for ids in done]

    def get(self, prompt: Prompt, max_tokens: int) -> RefOutput:
        return self.many([(prompt, max_tokens)])[0]

    # ----------------------------------------------------------------------------- the near-tie rule

    def position_logits(self, prompt: Prompt, continuation: list[int]) -> torch.Tensor:
        """The model's float logits [positions, V] at every position of `prompt` followed by `continuation`."""
        import torch

        ids = self.prompt_ids(prompt) + list(continuation)
        with self._lock, torch.inference_mode():
            return self._load()(torch.tensor([ids])).logits[0].float()

    def next_logits(self, prompt: Prompt, prefix: list[int]) -> torch.Tensor:
        """The model's float logits for the token after `prompt` followed by `prefix`."""
        return self.position_logits(prompt, prefix)[-1]

    def judge(
        self, prompt: Prompt, ours: list[int], reference: list[int], our_logprobs: list[dict]
    ) -> fidelity.Verdict:
        """`ours` against `reference` (this model's greedy completion) by the near-tie rule (testkit.fidelity).
        `our_logprobs`: per generated token, {"top_logprobs": {token: logprob}} as the engine returns them."""
        position = fidelity.first_difference(ours, reference)
        if position is None:
            return fidelity.judge(ours, reference, {}, None)
        top = {int(k): v for k, v in our_logprobs[position]["top_logprobs"].items()}
        return fidelity.judge(ours, reference, top, self.next_logits(prompt, reference[:position]))

    # ---------------------------------------------------------------------------------------------- cache

    def _model_fingerprint(self) -> str:
        h = hashlib.sha256(f"{CACHE_FORMAT}:{self.dtype}".encode())
        for name in ("config.json", "tokenizer.json", "generation_config.json"):
            path = self.model_dir / name
            if path.exists():
                h.update(path.read_bytes())
        for weights in sorted([*self.model_dir.glob("*.safetensors"), *self.model_dir.glob("*.gguf")]):
            st = weights.stat()
            h.update(f"{weights.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        return h.hexdigest()[:16]
