"""backend/serving/tokenizer_models.py, the Triton glue of TensorRT-LLM's preprocessing and postprocessing models,
with test_forwarding_model.py's fake `triton_python_backend_utils`, in a process of its own as a stub runs it: each
loads the served model's tokenizer from its shipped config's `tokenizer_dir` and answers a request, and neither
imports torch or transformers (the real server: tests/integration/test_trtllm_contract_e2e.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from launcher.model_config import get_parameter
from launcher.paths import DEFAULT_MODEL_REPOSITORY, MODEL_DIR, REPO_ROOT

PROMPT = "What is machine learning?"
# Both models' initialize and one execute each, in a fresh interpreter; prints what came back and what was imported
CHILD = r"""
import json, sys

import numpy as np

from tests.unit.test_forwarding_model import FakePb, Request

pb = sys.modules["triton_python_backend_utils"] = FakePb()

from backend.serving.tokenizer_models import Postprocessing, Preprocessing


def loaded(cls, folder, tokenizer_dir):
    model = cls()
    config = {"parameters": {"tokenizer_dir": {"string_value": tokenizer_dir}}}
    model.initialize({"model_config": json.dumps(config), "model_repository": folder})
    return model


def output(response, name):
    return pb.get_output_tensor_by_name(response, name).as_numpy()


(pre_folder, pre_dir), (post_folder, post_dir), prompt = json.loads(sys.argv[1])
query = Request(None, QUERY=np.array([[prompt.encode()]], dtype=object), REQUEST_OUTPUT_LEN=np.array([[4]], np.int32))
(pre,) = loaded(Preprocessing, pre_folder, pre_dir).execute([query])
ids, lengths = output(pre, "INPUT_ID"), output(pre, "REQUEST_INPUT_LEN").reshape(-1)
answer = Request(None, TOKENS_BATCH=ids, SEQUENCE_LENGTH=lengths)
(post,) = loaded(Postprocessing, post_folder, post_dir).execute([answer])
print(json.dumps({
    "ids": ids[0].tolist(),
    "end": int(output(pre, "OUT_END_ID")[0, 0]),
    "text": output(post, "OUTPUT")[0].decode(),
    "imported": [name for name in ("torch", "transformers") if name in sys.modules],
}))
"""


def test_the_models_answer_without_torch_or_transformers(tokenizer):
    if not (MODEL_DIR / "tokenizer.json").exists():
        pytest.skip(f"no tokenizer at {MODEL_DIR} (make model)")
    models = []
    for name in ("preprocessing", "postprocessing"):
        folder = DEFAULT_MODEL_REPOSITORY / name
        models.append([str(folder), get_parameter((folder / "config.pbtxt").read_text(), "tokenizer_dir")])
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps([*models, PROMPT])],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["imported"] == []
    assert answer["ids"] == tokenizer.encode(PROMPT) and answer["end"] == tokenizer.eos_token_id
    assert answer["text"] == PROMPT
