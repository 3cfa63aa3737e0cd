"""Workloads for the load test: prompts (a built-in synthetic set or a file) and output lengths drawn from a
distribution. Standard library only, so it imports without Locust (and is easy to test).

Prompt files:
    .txt    one prompt per line (blank lines skipped; a literal "\\n" in a line becomes a newline)
    .jsonl  one record per line: a JSON string, or an object with the prompt under "prompt", "text_input",
            "text" or "input" (GenAI-Perf input files use "text"), and optionally "max_tokens" (or
            "output_tokens" / "output_length"): a record's own max_tokens wins over the distribution
    .json   a list of such records, or {"data": [...]} / {"prompts": [...]}

Output-length distributions (`--max-tokens-dist`), always clamped to [min, max]:
    uniform               an integer drawn uniformly from [min, max] (the default)
    fixed:N               always N
    normal:MEAN,STD       rounded normal
    lognormal:MEDIAN,SIGMA  rounded log-normal (long tail, like real chat answers)
    exponential:MEAN      rounded exponential
    choice:A,B,C          one of the listed values, equally likely
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Sample", "Workload", "LengthDistribution", "load_prompts", "synthetic_prompts", "SYNTHETIC_PROMPTS"]

_PROMPT_KEYS = ("prompt", "text_input", "text", "input")
_LENGTH_KEYS = ("max_tokens", "output_tokens", "output_length")

# The built-in set: short questions, chat-formatted turns and longer passages (prompt lengths from a few tokens
# to a few hundred), so prefill and decode both show up in the load.
_PASSAGE = (
    "The history of the bicycle begins in the early nineteenth century, when inventors in Germany and France "
    "built wooden running machines that riders pushed along with their feet. Pedals attached to the front wheel "
    "came decades later, and the chain drive that powers modern bicycles was only perfected in the 1880s. Within "
    "a few years, cycling clubs had appeared in almost every large city, and the bicycle changed how ordinary "
    "people travelled to work, visited friends and explored the countryside. Photosynthesis is the process by "
    "which green plants, algae and some bacteria turn light into chemical energy. Inside the chloroplasts, "
    "chlorophyll absorbs sunlight and uses its energy to split water molecules, releasing oxygen. The hydrogen "
    "and the energy captured in this way are then used to convert carbon dioxide from the air into sugars, which "
    "the plant uses to grow. A refrigerator moves heat from its inside to the room: a compressor squeezes a "
    "refrigerant gas, which gets hot and gives its heat away in the coils at the back, then the liquid expands "
    "through a valve, becomes very cold and takes heat from the food compartment as it evaporates again."
)


def _chat(user: str) -> str:
    return (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    )


SYNTHETIC_PROMPTS: list[str] = [
    "How do I track my order?",
    "What's your return policy?",
    "Is this product available in red?",
    "Explain the features of the latest smartphone model.",
    "How long does shipping take?",
    "I received a damaged item. What should I do?",
    "Explain the concept of supply and demand",
    "Write a short story about a time traveler",
    "Describe the process of photosynthesis",
    "Summarize the plot of Romeo and Juliet",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "List five animals that live in the ocean:\n1.",
    "Translate to French: 'Good morning, how are you?'\nFrench:",
    _chat("What are three good habits for staying healthy?"),
    _chat("Write a haiku about autumn leaves."),
    _chat("Explain recursion to a ten-year-old."),
    _PASSAGE[:600] + "\n\nSummarize the text above in one sentence:",
    _PASSAGE + "\n\nQuestion: what three topics does the text above describe?\nAnswer:",
    "| Country | Capital |\n|---|---|\n| France | Paris |\n| Japan | Tokyo |\n| Kenya | Nairobi |\n| Canada |",
    "Once upon a time, in a small village by the sea,",
]


def synthetic_prompts(
    num: int = 0, words: LengthDistribution | None = None, rng: random.Random | None = None
) -> list[str]:
    """The built-in set; with `words`, `num` prompts (default 100) whose word counts follow `words`: windows of
    a fixed passage, then a question (GenAI-Perf style synthetic inputs of controlled length)."""
    if words is None:
        return list(SYNTHETIC_PROMPTS)
    rng = rng or random.Random(0)
    corpus = _PASSAGE.split()
    out = []
    for _ in range(num or 100):
        n = max(1, words.draw(rng))
        start = rng.randrange(len(corpus))
        body = [corpus[(start + i) % len(corpus)] for i in range(n)]
        out.append(" ".join(body) + "\n\nContinue the text:")
    return out


@dataclass(frozen=True)
class Sample:
    prompt: str
    max_tokens: int | None = None  # None: draw from the distribution


def _unescape(line: str) -> str:
    return line.replace("\\n", "\n").replace("\\t", "\t")


def _record(obj, where: str) -> Sample:
    if isinstance(obj, str):
        return Sample(obj)
    if isinstance(obj, dict):
        prompt = next((obj[k] for k in _PROMPT_KEYS if isinstance(obj.get(k), str)), None)
        if prompt is None:
            raise ValueError(f"{where}: no prompt under any of {list(_PROMPT_KEYS)}")
        length = next((obj[k] for k in _LENGTH_KEYS if obj.get(k) is not None), None)
        if length is not None:
            length = int(length)
            if length < 1:
                raise ValueError(f"{where}: max_tokens must be >= 1, got {length}")
        return Sample(prompt, length)
    raise ValueError(f"{where}: expected a string or an object, got {type(obj).__name__}")


def load_prompts(path: str | Path) -> list[Sample]:
    """Prompts (with optional per-prompt max_tokens) from a .txt, .jsonl or .json file."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        samples = [
            _record(json.loads(line), f"{path}:{i}") for i, line in enumerate(text.splitlines(), 1) if line.strip()
        ]
    elif suffix == ".json":
        data = json.loads(text)
        if isinstance(data, dict):
            data = data.get("data", data.get("prompts"))
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a list of prompts (or {{'data': [...]}})")
        samples = [_record(obj, f"{path}[{i}]") for i, obj in enumerate(data)]
    else:
        samples = [Sample(_unescape(line)) for line in text.splitlines() if line.strip()]
    samples = [s for s in samples if s.prompt]
    if not samples:
        raise ValueError(f"{path}: no prompts")
    return samples


class LengthDistribution:
    """An integer distribution clamped to [low, high]; see the module docstring for the specs."""

    def __init__(self, spec: str = "uniform", low: int = 1, high: int = 128):
        if low < 1 or high < low:
            raise ValueError(f"need 1 <= min <= max, got min={low} max={high}")
        self.spec, self.low, self.high = spec.strip() or "uniform", int(low), int(high)
        kind, _, args = self.spec.partition(":")
        kind = kind.strip().lower()
        try:
            values = [float(a) for a in args.split(",")] if args.strip() else []
        except ValueError:
            raise ValueError(f"bad distribution {spec!r}: arguments must be numbers") from None
        self._draw = self._make(kind, values, spec)

    def _make(self, kind: str, v: list[float], spec: str) -> Callable[[random.Random], float]:
        def need(n: int) -> None:
            if len(v) != n:
                raise ValueError(f"bad distribution {spec!r}: {kind} takes {n} argument(s)")

        if kind == "uniform":
            if v:
                need(2)
                lo, hi = int(v[0]), int(v[1])
                return lambda r: r.randint(lo, hi)
            return lambda r: r.randint(self.low, self.high)
        if kind == "fixed":
            need(1)
            return lambda r: v[0]
        if kind == "normal":
            need(2)
            return lambda r: r.gauss(v[0], v[1])
        if kind == "lognormal":
            need(2)
            if v[0] <= 0:
                raise ValueError(f"bad distribution {spec!r}: the median must be > 0")
            return lambda r: r.lognormvariate(math.log(v[0]), v[1])
        if kind == "exponential":
            need(1)
            if v[0] <= 0:
                raise ValueError(f"bad distribution {spec!r}: the mean must be > 0")
            return lambda r: r.expovariate(1.0 / v[0])
        if kind == "choice":
            if not v:
                raise ValueError(f"bad distribution {spec!r}: choice needs values")
            return lambda r: r.choice(v)
        raise ValueError(
            f"unknown distribution {spec!r}: use uniform, fixed:N, normal:MEAN,STD, lognormal:MEDIAN,SIGMA, "
            "exponential:MEAN or choice:A,B,..."
        )

    def draw(self, rng: random.Random) -> int:
        return min(self.high, max(self.low, int(round(self._draw(rng)))))

    def __repr__(self) -> str:
        return f"LengthDistribution({self.spec!r}, {self.low}, {self.high})"


class Workload:
    """Prompts and output lengths; `draw(rng)` gives the next (prompt, max_tokens)."""

    def __init__(self, samples: list[Sample], lengths: LengthDistribution, use_file_lengths: bool = True):
        if not samples:
            raise ValueError("a workload needs at least one prompt")
        self.samples = samples
        self.lengths = lengths
        self.use_file_lengths = use_file_lengths

    @classmethod
    def from_options(
        cls,
        prompts_file: str = "",
        dist: str = "uniform",
        low: int = 16,
        high: int = 128,
        use_file_lengths: bool = True,
        input_words: str = "",
        num_synthetic: int = 0,
        seed: int = 0,
    ) -> Workload:
        lengths = LengthDistribution(dist, low, high)
        if prompts_file:
            samples = load_prompts(prompts_file)
        else:
            words = LengthDistribution(input_words, 1, 100_000) if input_words else None
            samples = [Sample(p) for p in synthetic_prompts(num_synthetic, words, random.Random(seed))]
        return cls(samples, lengths, use_file_lengths)

    def draw(self, rng: random.Random) -> Sample:
        sample = rng.choice(self.samples)
        if sample.max_tokens is not None and self.use_file_lengths:
            return sample
        return Sample(sample.prompt, self.lengths.draw(rng))
