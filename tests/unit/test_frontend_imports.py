"""The front door's process carries no torch, transformers or llguidance: a fresh interpreter builds the app as
`python -m frontend` does (its main(), with aiohttp's run_app caught instead of serving), with the real model
folder, starts it (the Triton client is made then, and connects lazily), answers /health and /detokenize, uses
every tokenizer method, and finds none of them in sys.modules."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from launcher.paths import MODEL_DIR as SMOL_DIR
from launcher.paths import REPO_ROOT

HEAVY = ("torch", "transformers", "llguidance")

SCRIPT = textwrap.dedent("""
    import asyncio, sys
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    import frontend.app, frontend.__main__
    from frontend.app import TOKENIZER

    apps = []
    web.run_app = lambda app, **kwargs: apps.append(app)  # main() builds the app, then would serve it
    assert frontend.__main__.main(["--triton-grpc", "127.0.0.1:9", "--triton-metrics", "",
                                   "--model-dir", {model_dir!r}]) == 0
    (app,) = apps
    tokenizer = app[TOKENIZER]
    ids = tokenizer.encode("Hello <|im_end|> world")
    assert tokenizer.decode(ids) == "Hello <|im_end|> world"
    assert [tokenizer.token_text(i) for i in tokenizer.encode("hi", add_special_tokens=False)] == ["hi"]
    assert tokenizer.render_chat([{{"role": "user", "content": "hi"}}]).endswith("<|im_start|>assistant\\n")
    assert tokenizer.vocab_size == 49152 and tokenizer.max_position_embeddings == 8192

    async def requests():
        async with TestClient(TestServer(app)) as client:
            assert (await client.get("/health")).status == 200
            answer = await client.post("/detokenize", json={{"model": "llm", "tokens": ids}})
            assert (await answer.json()) == {{"prompt": "Hello <|im_end|> world"}}, await answer.text()

    asyncio.run(requests())
    print("heavy:", sorted(m for m in {heavy!r} if m in sys.modules))
""")


def test_the_front_door_imports_no_torch_transformers_or_llguidance():
    script = SCRIPT.format(model_dir=str(SMOL_DIR), heavy=HEAVY)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "heavy: []" in result.stdout, result.stdout + result.stderr[-4000:]
