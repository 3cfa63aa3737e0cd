"""Reasoning through the real stack, on the session's `llm` model (no model of its own): a second front door
reads the served model's tokenizer with a DeepSeek-R1-style chat template, one that opens `<think>` in the
prompt, so everything the model writes before `</think>` is reasoning. With max_tokens small the whole greedy
answer is reasoning: `reasoning_content` is the text /v1/completions gives for the same prompt, `content` is
null, and every completion token is a reasoning token; the Responses API's reasoning item holds the same text.
"""

from __future__ import annotations

import shutil

import openai
import pytest

import launcher
from frontend.tokenizer import ModelTokenizer
from launcher.paths import MODEL_DIR

pytestmark = pytest.mark.integration

MODEL = "llm"
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]
MAX_TOKENS = 8
OPEN_THINK = "{% if add_generation_prompt %}<think>\n{% endif %}"


@pytest.fixture(scope="module")
def thinking_door(server, tmp_path_factory):
    """(a client of a front door whose chat template opens <think> for the answer, the rendered prompt)."""
    folder = tmp_path_factory.mktemp("thinking_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(MODEL_DIR / name, folder / name)
    (folder / "chat_template.jinja").write_text((MODEL_DIR / "chat_template.jinja").read_text() + OPEN_THINK)
    port = launcher.free_port()
    proc = launcher.start_frontend(
        server.grpc_url, port, folder / "frontend.log", models=(MODEL,), model_dir=folder, metrics_url=""
    )
    try:
        launcher.wait_until_frontend_ready(port, proc, 120)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
        yield client, ModelTokenizer(folder).render_chat(MESSAGES)
    finally:
        launcher.stop_server(proc, timeout_s=10)


def test_an_answer_that_starts_inside_the_reasoning(server, thinking_door):
    door, prompt = thinking_door
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    plain = openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=300)
    greedy = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0}
    text = plain.completions.create(prompt=prompt, **greedy).choices[0].text  # the text_input the door sends
    whole = door.chat.completions.create(messages=MESSAGES, **greedy)
    message, usage = whole.choices[0].message, whole.usage
    assert "</think>" not in text and whole.choices[0].finish_reason == "length"
    assert (message.reasoning_content, message.content) == (text, None)
    assert usage.completion_tokens == MAX_TOKENS
    assert usage.completion_tokens_details.reasoning_tokens == MAX_TOKENS
    stream = door.chat.completions.create(
        messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **greedy
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == text
    assert not any(d.content for d in deltas)
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == MAX_TOKENS
    response = door.responses.create(model=MODEL, input=MESSAGES, max_output_tokens=MAX_TOKENS, temperature=0)
    [thought] = response.output
    assert thought.type == "reasoning" and thought.content[0].text == text and thought.status == "incomplete"
    assert response.usage.output_tokens_details.reasoning_tokens == MAX_TOKENS
    assert server.wait_idle(MODEL).get("llm_kv_cache_blocks_used", MODEL) == 0
