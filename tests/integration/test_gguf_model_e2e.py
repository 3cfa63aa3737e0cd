"""A GGUF file as `model`, through Triton: the session's tiny random llama written with every block type
(K-quants included, testkit.tiny_gguf), served straight from the file on our kernel. Concurrent greedy gRPC
streams equal transformers loading the same file in float32, up to counted near-ties (the kernel computes the
fp32 model up to summation order), and the load log says what served which layers."""

import pytest
import torch

from backend.model import model_source
from client import stream_grpc
from testkit.concurrency import raise_first_error, run_concurrently
from testkit.fidelity import TOP_K, summarize
from testkit.hf_reference import HFReference
from testkit.server_variants import GGUF_FILE, GGUF_MODEL
from tests.integration.llm_testlib import top_logprobs

pytestmark = pytest.mark.integration

# (prompt, max_tokens), sent as one busy batch; the tiny model has SmolLM2's tokenizer (and random weights).
CASES = [
    ("The capital of France is", 16),
    ("Hi", 12),
    ("Once upon a time, in a land far away, there lived a very curious cat who wanted to see the sea.", 10),
    ("1 2 3 4 5 6 7 8 9 10", 16),
]


def test_a_gguf_file_through_triton_follows_transformers(server):
    server.wait_idle(GGUF_MODEL)
    folder = model_source.resolve(server.variants[GGUF_MODEL]["model"])
    reference = HFReference(folder, torch.float32)

    def one(prompt, max_tokens):
        return stream_grpc(
            prompt,
            server.grpc_url,
            GGUF_MODEL,
            max_tokens=max_tokens,
            temperature=0.0,
            sampling={"logprobs": TOP_K, "ignore_eos": True},
            return_logprobs=True,
        ).completion()

    completions = run_concurrently(one, CASES)
    raise_first_error(completions, "gRPC stream")
    verdicts = []
    for (prompt, max_tokens), got in zip(CASES, completions):
        assert len(got.token_ids) == max_tokens
        want = reference.greedy(prompt, max_tokens, stop_at_eos=False)
        verdicts.append(reference.judge(prompt, got.token_ids, want, top_logprobs(got, TOP_K)))
    print(f"\n[{GGUF_MODEL}, tiny GGUF with every block type] {summarize(verdicts)}")
    assert all(v.near_tie for v in verdicts), [v.detail for v in verdicts if not v.near_tie]
    server.wait_idle(GGUF_MODEL)


def test_the_load_log_names_the_gguf_and_the_layers_on_the_kernel(server):
    log = server.log_path.read_text(errors="replace")
    assert "reading the configuration and tokenizer of" in log and GGUF_FILE in log
    # layer 1's gate/up holds an F32 weight (dense); every other projection (F16 and BF16 ones too) and the Q6_K
    # head on the kernel
    assert "low-bit kernel for 8 of 9 layers" in log
