"""The front door's web page in a real headless Chromium, against the session's tritonserver and front door:
the page loads and connects to the live batch view, a prompt typed into it streams text back (the same text
as the non-streamed greedy answer), and several concurrent requests show up in the batch view as rows of
prefill chunks and decodes sharing steps. A screenshot is kept in the test's temporary folder.

No browser is a failure, not a skip: `make browser` installs Debian's chromium (or set CHROMIUM)."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid

import pytest

from tests.integration.headless_browser import HeadlessBrowser, find_chromium

PROMPT = "Name three colours of the rainbow."
# Longer than the `llm` variant's 64-token budget, so its prompt is prefilled in more than one chunk.
LONG_PROMPT = (
    "Here is a list of the planets of the solar system in order from the sun, with one fact about "
    "each: Mercury is the smallest, Venus is the hottest, Earth has liquid water, Mars is red, "
    "Jupiter is the largest, Saturn has bright rings, Uranus rolls on its side, and Neptune is the "
    "windiest. Which planet would you visit first, and why?"
)
COPIES = 4

# Per batch-view row: its key, and each step cell's kind and range.
ROWS_JS = """[...document.querySelectorAll('#batch-grid tbody tr[data-seq]')].map(tr => ({
  seq: tr.dataset.seq,
  cells: [...tr.querySelectorAll('td.cell')].map(td => ({
    kind: td.dataset.kind, start: Number(td.dataset.start), end: Number(td.dataset.end),
    column: [...tr.children].indexOf(td) }))
}))"""
CARDS_JS = """[...document.querySelectorAll('#outputs .output')].map(card => ({
  state: card.dataset.state, chunks: Number(card.dataset.chunks), text: card.querySelector('.text').textContent }))"""


@pytest.fixture(scope="module")
def front_door(server) -> str:
    """The front door's base URL, started by the shared fixture."""
    url = getattr(server, "openai_url", None)
    assert url, "the shared server fixture has no front door (server.openai_url)"
    return url.rstrip("/").removesuffix("/v1")


@pytest.fixture(scope="module")
def browser():
    binary = find_chromium()
    if binary is None:
        pytest.fail(
            "no headless browser for the web page test: run `make browser` (Debian: apt-get install -y "
            "chromium) or set CHROMIUM to a Chromium/Chrome binary",
            pytrace=False,
        )
    with HeadlessBrowser(binary) as page:
        yield page


def chat(front_door: str, model: str, prompt: str, **params) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], **params}
    request = urllib.request.Request(
        f"{front_door}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        return json.load(resp)["choices"][0]["message"]["content"]


def set_params(page: HeadlessBrowser, **values) -> None:
    for name, value in values.items():
        page.fill(f"#{name}", str(value))


def test_page_streams_a_typed_prompt_and_shows_concurrent_requests_in_the_batch(
    browser, front_door, tmp_path, record_property
):
    page = browser
    page.open(f"{front_door}/")
    page.wait_for("document.getElementById('batch-status').dataset.state === 'live'", 30)
    model = page.wait_for("batch.summary && batch.summary.model", 30)
    page.wait_for(f"document.getElementById('model').value === {json.dumps(model)}", 30)
    budget = page.evaluate("batch.summary.token_budget")

    # One prompt, typed and sent: the text streams in, then equals the non-streamed greedy answer.
    page.fill("#prompt", PROMPT)
    set_params(page, temperature=0, max_tokens=24, copies=1)
    page.click("#send")
    partial = []  # text lengths seen while the card was streaming
    deadline = time.monotonic() + 120
    while True:
        card = page.evaluate(CARDS_JS)[0]
        if card["state"] == "streaming" and card["text"]:
            partial.append(len(card["text"]))
        if card["state"] in ("done", "error") or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert card["state"] == "done", card
    assert card["chunks"] >= 2 and partial and min(partial) < len(card["text"]), (card, partial)
    assert card["text"] == chat(front_door, model, PROMPT, temperature=0, max_tokens=24)

    # Several at once: the batch view shows a row per request, prefill chunks then decodes, sharing steps.
    page.fill("#prompt", f"({uuid.uuid4().hex[:8]}) {LONG_PROMPT}")  # nothing but the chat template is cached
    set_params(page, max_tokens=12, copies=COPIES)
    page.click("#send")
    page.wait_for(
        f"document.querySelectorAll('#outputs .output').length === {1 + COPIES} && "
        "[...document.querySelectorAll('#outputs .output')].every(c => c.dataset.state === 'done')",
        180,
    )
    # the steps' records reach the page a moment after the outputs: wait until its grid shows every copy's row
    # with both its prefill chunks and its decodes
    page.wait_for(
        f"(batch.dirty = true, renderBatch(), {ROWS_JS}.filter(r => r.cells.some(c => c.kind === 'prefill') && "
        f"r.cells.some(c => c.kind === 'decode')).length >= {COPIES})",
        30,
    )
    screenshot = page.screenshot(tmp_path / "batch_view.png")
    record_property("screenshot", str(screenshot))
    print(f"screenshot: {screenshot}")

    rows = page.evaluate(ROWS_JS)
    both = [r for r in rows if {"prefill", "decode"} <= {c["kind"] for c in r["cells"]}]
    assert len(both) >= COPIES, rows
    for row in both:  # in each row, prefill chunks come first and are contiguous, then decodes
        kinds = [c["kind"] for c in row["cells"]]
        assert kinds == sorted(kinds, key=lambda k: k != "prefill"), row
        chunks = [c for c in row["cells"] if c["kind"] == "prefill"]
        assert all(a["end"] == b["start"] for a, b in zip(chunks, chunks[1:])), row
    chunked = [
        r
        for r in both
        if len([c for c in r["cells"] if c["kind"] == "prefill"]) >= 2
        and r["cells"][0]["end"] - r["cells"][0]["start"] == budget
    ]  # (the chat template's start may be cached)
    assert chunked, "no prompt was shown prefilled in chunks of the token budget"
    columns: dict[int, set] = {}
    for row in rows:
        for cell in row["cells"]:
            columns.setdefault(cell["column"], set()).add(cell["kind"])
    assert any(len(kinds) == 2 for kinds in columns.values()), "no step mixed a prefill chunk with decodes"
    tokens = page.evaluate(
        "[...document.querySelectorAll('#batch-grid tfoot tr[data-stat=tokens] td')]"
        ".slice(1).map(td => Number(td.textContent))"
    )
    assert tokens and max(tokens) <= budget and max(tokens) > 1
    kv = page.evaluate("document.getElementById('stat-kv-text').textContent")
    assert kv.split("/")[1].strip().isdigit(), kv
    assert page.exceptions == [], page.exceptions
