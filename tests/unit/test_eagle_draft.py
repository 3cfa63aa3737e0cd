"""The trained EAGLE-style draft: the chain mask, feature recovery from logits, a tiny training run whose folder
loads as a `draft_model`, the served head on the kernels against torch, and speculation with it exact against
plain decoding (greedy) and running sampled."""

import json

import pytest
import torch

from backend import EngineConfig, LLMEngine, SamplingParams
from backend.spec import draft_data, eagle_head, train_draft
from backend.spec.draft_data import FeatureRecovery
from backend.spec.eagle_head import chain_mask
from tests.unit.conftest import make_tiny_model

PROMPTS = ["Hello there, how are you today?", "1 2 3 4 5 6 7 8", "Write a poem about the sea."]


def test_chain_mask_sees_true_rows_to_the_anchor_and_the_chain():
    mask = chain_mask(5, 3)  # keys: steps 1, 2, 3 of 5 rows each
    row = 4  # anchor 2: true rows 0..2, step 2's row 3, itself
    assert mask[row].nonzero().flatten().tolist() == [0, 1, 2, 5 + 3, 10 + 4]
    assert chain_mask(4, 1).equal(torch.ones(4, 4, dtype=torch.bool).tril())


def test_features_recovered_from_logits():
    torch.manual_seed(0)
    head = torch.randn(2000, 64)
    features = torch.randn(5, 64)
    rows = FeatureRecovery.pick_rows(2000, 64, seed=0)
    recovered = FeatureRecovery(head[rows], rows)(features @ head.T)
    assert torch.allclose(recovered, features, atol=1e-4)


def test_built_in_prompts_are_every_template_over_every_topic():
    cases = draft_data.prompts(seed=3)
    assert len(cases) == len(set(cases)) == len(draft_data.TOPICS) * len(draft_data.TEMPLATES)
    assert not any("{t}" in c for c in cases) and cases == draft_data.prompts(seed=3) != draft_data.prompts(seed=4)


def test_recorded_command_repeats_the_run():
    import shlex

    given = ["--minutes", "5", "--prompts", "my prompts.jsonl", "--seed", "3", "--started", "1700000000"]
    args = train_draft.parser().parse_args(given)
    recorded = shlex.split(train_draft.command(args))
    again = train_draft.parser().parse_args(recorded[3:])
    assert "--started" not in recorded and vars(again) == {**vars(args), "started": 0.0}


def test_heldout_prompts_train_no_answer_of_theirs():
    origins = [
        draft_data.Origin(p, g) for p, g in [(0, True), (1, True), (2, False), (0, False), (1, False), (2, False)]
    ]
    data = [(None, torch.tensor([i])) for i in range(len(origins))]
    heldout, training = train_draft.split_heldout(data, origins, every=2)
    assert [int(t) for _, t in heldout] == [0]  # prompt 0's greedy answer; its sampled one (3) trains nothing
    assert [int(t) for _, t in training] == [1, 2, 4, 5]


def test_budget_spent_before_training_is_refused_with_the_minutes():
    import time

    args = train_draft.parser().parse_args(["--minutes", "2", "--started", str(time.time() - 150)])
    with pytest.raises(SystemExit, match=r"budget of 2 minutes was spent before training began \(2\.5 minutes"):
        train_draft.train(args)


def test_prompts_file_takes_strings_prompts_and_messages_in_order(tmp_path):
    path = tmp_path / "p.jsonl"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    path.write_text(f'"one"\n\n{{"prompt": "two"}}\n{json.dumps({"messages": messages})}\n')
    assert draft_data.prompts(seed=0, path=str(path)) == ["one", "two", messages]


@pytest.mark.parametrize(
    "line,fragment",
    [("not json", "p.jsonl:2: not JSON"), ('{"text": "x"}', "p.jsonl:2: expected a string"), ("[1, 2]", "p.jsonl:2")],
)
def test_bad_prompts_file_line_says_which_and_what_is_allowed(tmp_path, line, fragment):
    path = tmp_path / "p.jsonl"
    path.write_text(f'"fine"\n{line}\n')
    with pytest.raises(ValueError, match=fragment):
        draft_data.read_prompts(str(path))


@pytest.fixture(scope="module")
def tiny_tied(tmp_path_factory, tiny_model_factory):
    tiny_model_factory("llama")  # skips without the tokenizer
    return make_tiny_model(tmp_path_factory.mktemp("tiny-tied"), "llama", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def trained_draft(tiny_tied, tmp_path_factory):
    """A tiny training run on a prompts file (`--prompts`: plain prompts and chat messages, a deployment's own)."""
    folder = tmp_path_factory.mktemp("eagle")
    out, prompts = folder / "draft", folder / "prompts.jsonl"
    cases = [*PROMPTS, {"messages": [{"role": "user", "content": "Name three colours."}]}] * 6
    prompts.write_text("".join(json.dumps(c) + "\n" for c in cases))
    lines = []
    args = train_draft.parser().parse_args(
        [
            "--model", tiny_tied, "--out", str(out), "--minutes", "0.3", "--data-share", "0.5",
            "--quantization", "none", "--vocab", "256", "--window", "8", "--max-steps", "3", "--log-seconds", "0",
            "--prompts", str(prompts),
        ]
    )  # fmt: skip
    train_draft.train(args, log=lines.append)
    assert "--prompts" in json.loads((out / "config.json").read_text())["trained_with"]["command"]
    assert any("rows/s" in line and "accepted length" in line for line in lines), lines
    return out, lines


def test_training_saves_a_draft_model_folder(trained_draft):
    out, lines = trained_draft
    assert eagle_head.is_eagle_folder(out)
    head, recovery, config = eagle_head.load(out, lambda ids: torch.zeros(len(ids), 64))
    assert len(head.draft_vocab) == 256 and len(recovery) == 1024 and head.shape.window == 8
    assert config["trained_with"]["seed"] == 0 and config["trained_with"]["tokens"] > 0
    assert "saved" in lines[-1]


def _engine(model: str, **overrides) -> LLMEngine:
    settings = dict(model=model, dtype="float32", kv_cache_blocks=128, block_size=4, max_num_seqs=4)
    return LLMEngine(EngineConfig(**{**settings, **overrides}))


def _outputs(engine: LLMEngine, **params) -> dict[str, list[int]]:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(engine.build_request(str(i), prompt, SamplingParams.from_dict(params), stream=True))
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            for sample in out.samples:
                tokens.setdefault(out.request_id, []).extend(sample.token_ids)
    assert engine.block_manager.num_used_blocks == 0
    return tokens


@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_with_the_eagle_draft_equals_plain_decoding(tiny_tied, trained_draft, adaptive):
    plain = _outputs(_engine(tiny_tied), temperature=0, max_tokens=20, ignore_eos=True)
    engine = _engine(
        tiny_tied,
        draft_model=str(trained_draft[0]),
        num_speculative_tokens=3,
        spec_max_batch_size=4,
        spec_adaptive=adaptive,
    )
    spec = _outputs(engine, temperature=0, max_tokens=20, ignore_eos=True)
    assert spec == plain
    assert engine.metrics.total("llm_spec_decode_num_draft_tokens_total") > 0


def test_the_head_on_the_kernels_predicts_as_in_torch(tiny_tied, trained_draft):
    """The served head (its projections and LM head rows as Q8_0 blocks, where this CPU has a kernel) against the
    same folder in fp32 torch: the same layer outputs and logits up to Q8_0's rounding, and no fp32 copy kept."""
    engine = _engine(tiny_tied, draft_model=str(trained_draft[0]), num_speculative_tokens=3)
    proposer = engine.spec.proposer
    served = proposer.head
    reference, _, _ = eagle_head.load(trained_draft[0], proposer.target_rows)
    if proposer.kernel == "torch":
        assert served.head_linear is None and served.head is not None
        pytest.skip("no low-bit kernel for this CPU: the head runs as trained")
    assert proposer.kernel.startswith("q8_0 on the ") and served.head is None
    assert all(getattr(served, n).linear.weight is None for n in ("fc", "q_proj", "down_proj", "head_linear"))
    torch.manual_seed(0)
    x = torch.randn(2, 5, served.shape.hidden)
    positions = torch.arange(5).expand(2, 5)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    with torch.no_grad():
        out, k, _ = served.layer(x, positions, None, None, mask)
        want_out, want_k, _ = reference.layer(x, positions, None, None, mask)
        logits, want_logits = served.predict(out)[1], reference.predict(want_out)[1]
    for got, want in ((out, want_out), (k, want_k), (logits, want_logits)):
        assert (got - want).norm() <= 0.02 * want.norm()
    assert (logits.argmax(-1) == want_logits.argmax(-1)).float().mean() >= 0.8


def test_sampled_requests_draft_and_finish(tiny_tied, trained_draft):
    engine = _engine(tiny_tied, draft_model=str(trained_draft[0]), num_speculative_tokens=3, spec_max_batch_size=4)
    out = _outputs(engine, temperature=0.8, top_p=0.9, seed=3, max_tokens=16, ignore_eos=True)
    assert all(len(tokens) == 16 for tokens in out.values())
    assert engine.metrics.total("llm_spec_decode_num_draft_tokens_total") > 0


def test_auto_picks_per_sequence_and_stays_exact(tiny_tied, trained_draft):
    """draft_model auto with the trained head: greedy output equals plain decoding while the sources take turns
    (free verification rows, a head trusted until measured: it drafts where suffix decoding finds little)."""
    plain = _outputs(_engine(tiny_tied), temperature=0, max_tokens=20, ignore_eos=True)
    engine = _engine(
        tiny_tied,
        draft_model="auto",
        draft_head=str(trained_draft[0]),
        num_speculative_tokens=3,
        spec_max_batch_size=4,
        spec_row_cost=0.0,
        spec_head_token_cost=0.0,
    )
    engine.spec.proposer.head_prior = 0.9
    assert _outputs(engine, temperature=0, max_tokens=20, ignore_eos=True) == plain
    picks = engine.spec.proposer.picks
    assert picks["head"] > 0, picks


def test_agreement_tool_scores_the_head_on_workload_answers(tiny_tied, trained_draft):
    """benchmarks/tools/draft_agreement.py: the target's greedy answers, the head's agreement by chain step and its
    vocabulary's share of the answers' tokens, a table row per workload."""
    from benchmarks.tools import draft_agreement

    out, _ = trained_draft
    workloads = {"chat": PROMPTS, "messages": [[{"role": "user", "content": "Count: 1 2 3"}]]}
    results = draft_agreement.agreement(tiny_tied, str(out), 12, 8, 2, workloads, quantization="none")
    assert results["chat"]["answers"] == len(PROMPTS) and results["messages"]["answers"] == 1
    for r in results.values():
        assert 0 < r["tokens"] <= 12 * r["answers"] and 1 <= r["window"] <= 8
        assert len(r["by_step"]) == 2 and all(0.0 <= a <= 1.0 for a in r["by_step"])
        assert 0.0 <= r["accepted_length"] <= 2.0
        # the head's 256-token vocabulary is what this target's own answers used most: its answers here use it
        assert 0.0 < r["vocab_share"] <= 1.0
    lines = draft_agreement.table(results, 2)
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| chat", "| messages"]


def test_a_grammar_masked_row_restarts_the_heads_context(tiny_tied, trained_draft):
    """A row whose logits a grammar masked (-inf in the recovery's columns) gives no feature: the head drafts from
    the rows after it, and not at all while the newest row is one."""
    from types import SimpleNamespace

    from backend.core.runner_output import ModelRunnerOutput, SampledTokens

    proposer = _engine(tiny_tied, draft_model=str(trained_draft[0]), num_speculative_tokens=2).spec.proposer
    generator = torch.Generator().manual_seed(0)

    def observe(position: int, token: int, masked: bool = False) -> None:
        logits = torch.randn(1, proposer.embed.vocab_size, generator=generator)
        if masked:
            logits[0, proposer.recovery.rows[::3]] = float("-inf")
        proposer.observe(ModelRunnerOutput(logits=logits, sampled=[SampledTokens(7, [token], [0], position)]))

    def draft(tokens: list[int]) -> list[int]:
        seq = SimpleNamespace(seq_id=7, num_tokens=len(tokens), token_ids=tokens, params=SimpleNamespace(greedy=True))
        return proposer.propose([(seq, 2)])[0].token_ids

    tokens = list(range(20, 30))  # positions 0..9; the rows observed are positions 6..9, each choosing the next
    for position in range(6, 9):
        observe(position, tokens[position + 1], masked=position == 7)
    assert len(draft(tokens[:10])) == 2
    state = proposer._states[7]
    assert state.keys.shape[1] == 1  # row 8 alone: rows 6 and 7 (masked) are not its context
    observe(9, 31, masked=True)
    assert draft(tokens + [31]) == [] and state.keys is None
    observe(10, 32)
    assert len(draft(tokens + [31, 32])) == 2 and proposer._states[7].keys.shape[1] == 1
