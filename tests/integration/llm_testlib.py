"""Shared material for the integration tests: prompts, concurrency helpers and a few assertions."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

_PARAGRAPHS = [
    "The history of the bicycle begins in the early nineteenth century, when inventors in Germany and France "
    "built wooden running machines that riders pushed along with their feet. Pedals attached to the front "
    "wheel came decades later, and the chain drive that powers modern bicycles was only perfected in the "
    "1880s. Within a few years, cycling clubs had appeared in almost every large city, and the bicycle "
    "changed how ordinary people travelled to work, visited friends and explored the countryside.",
    "Photosynthesis is the process by which green plants, algae and some bacteria turn light into chemical "
    "energy. Inside the chloroplasts, chlorophyll absorbs sunlight and uses its energy to split water "
    "molecules, releasing oxygen. The hydrogen and the energy captured in this way are then used to convert "
    "carbon dioxide from the air into sugars, which the plant uses to grow. In short, photosynthesis",
    "Dear hiring manager,\n\nI am writing to apply for the position of junior software engineer at your "
    "company. During my studies I built several web applications, contributed to two open source projects "
    "and worked as a teaching assistant for the introductory programming course. I enjoy solving problems "
    "with other people and I learn new tools quickly. I would welcome the chance to",
]

_CODE = '''def merge_sorted(a, b):
    """Merge two sorted lists into one sorted list."""
    result = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            result.append(a[i])
            i += 1
        else:
            result.append(b[j])
            j += 1
    result.extend(a[i:])
    result.extend(b[j:])
    return result


def binary_search(items, target):
    """Return the index of target in the sorted list items, or -1."""
'''

_LIST = (
    "Shopping list for the week:\n1. Apples\n2. Bread\n3. Milk\n4. Eggs\n5. Rice\n6. Tomatoes\n7. Onions\n"
    "8. Cheese\n9. Coffee\n10. Pasta\n11. Olive oil\n12. Carrots\n13. Yogurt\n14. Bananas\n15. Chicken\n16."
)

_TABLE = (
    "| Country | Capital | Continent |\n|---|---|---|\n| France | Paris | Europe |\n| Japan | Tokyo | Asia |\n"
    "| Kenya | Nairobi | Africa |\n| Brazil | Brasilia | South America |\n| Canada | Ottawa | North America |\n"
    "| Australia | Canberra | Oceania |\n| Germany | Berlin | Europe |\n| India |"
)

_CHAT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat are three good habits for staying healthy?<|im_end|>\n<|im_start|>assistant\n"
)

# (prompt, max_tokens): 24 cases of mixed lengths (7 of them longer than 64 tokens, so the `llm` variant
# prefills them in chunks) and mixed max_tokens (8 to 40).
MIXED_CASES: list[tuple[str, int]] = [
    ("The capital of France is", 8),
    ("Once upon a time, in a small village by the sea,", 24),
    ("def fibonacci(n):", 32),
    ("The three primary colors are", 12),
    ("Water boils at", 10),
    (_PARAGRAPHS[0] + " The next big change came", 32),
    (_PARAGRAPHS[1], 24),
    (_PARAGRAPHS[2], 40),
    (_CODE, 40),
    (_LIST, 20),
    (_TABLE, 16),
    (_CHAT, 40),
    ("List five animals that live in the ocean:\n1.", 30),
    ("Translate to French: 'Good morning, how are you?'\nFrench:", 16),
    ("The quick brown fox", 8),
    ("In mathematics, a prime number is", 28),
    (_PARAGRAPHS[0] + "\n\n" + _PARAGRAPHS[1] + "\n\nQuestion: what do the two texts above describe?\nAnswer:", 20),
    ("import numpy as np\n\n# Compute the mean of each row of a matrix\n", 24),
    ("Q: What is 12 times 12?\nA:", 8),
    ("My favourite season is autumn because", 36),
    ("Here is a haiku about the moon:\n", 20),
    ("SELECT name, email FROM users WHERE", 16),
    ("The most important invention of the twentieth century was", 40),
    ("1, 2, 3, 5, 8, 13, 21,", 12),
]

# Reference outputs computed while the server starts (any test may ask for others; they are computed then).
REFERENCE_PREFETCH: list[tuple[str, int]] = list(MIXED_CASES)

LONG_PROMPT_TOKENS = 64  # the `llm` variant's max_num_batched_tokens


def run_concurrently(fn: Callable[..., Any], arg_list: list[tuple], timeout_s: float = 300.0) -> list[Any]:
    """Call fn(*args) for every args at once (one thread each, released together by a barrier).

    Returns the results in order; an exception is returned in its slot (not raised), so a caller sees all.
    """
    barrier = threading.Barrier(len(arg_list))

    def call(args):
        barrier.wait(timeout=60)
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            return exc

    with ThreadPoolExecutor(max_workers=len(arg_list)) as pool:
        futures = [pool.submit(call, args) for args in arg_list]
        return [f.result(timeout=timeout_s) for f in futures]


def raise_first_error(results: list[Any], what: str = "request") -> None:
    errors = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
    if errors:
        lines = [f"  #{i}: {type(e).__name__}: {e}" for i, e in errors[:8]]
        raise AssertionError(f"{len(errors)} of {len(results)} {what}s failed:\n" + "\n".join(lines))


def first_mismatch(got: list[int], want: list[int]) -> str:
    """A readable description of where two token id lists diverge."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return f"first difference at output token {i}: got {a}, reference {b}"
    return f"lengths differ: got {len(got)} tokens, reference {len(want)}"


class Stopwatch:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.elapsed = time.perf_counter() - self.start


# ------------------------------------------------------------------------------------- the front door's HTTP

def post(server, path: str, body, *, raw: bytes | None = None, method: str = "POST") -> tuple[int, dict | str]:
    """(status, JSON body) of a request to the front door, errors included."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(server.openai_url.removesuffix("/v1") + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def sse_events(server, path: str, body: dict) -> list[str]:
    """The `data:` payloads of a streamed answer, in order (raw, to see the wire format)."""
    request = urllib.request.Request(server.openai_url.removesuffix("/v1") + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        return [line[len("data: "):] for line in resp.read().decode().splitlines() if line.startswith("data: ")]
