"""backend/sampling/structured_output.py: the client keys, the masks (exactly the grammar's next tokens, checked by
brute force on a small vocabulary), compile errors, caching, and a compiler crash that fails only its request. In
the engine: test_structured_output_engine.py."""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import pytest
import torch

from backend import InvalidRequest, SamplingParams
from backend.core.scheduler_output import Draft, SchedulerOutput
from backend.protocol.guided_decoding import pop_guided_decoding
from backend.sampling.structured_output import GrammarCompiler, StructuredOutput, advance, grammar_text

# ----------------------------------------------------------------------------------------------- client keys

POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
# vLLM's structural tag: free text, in which JSON fitting the schema follows "<point>" up to "</point>"
STRUCTURAL_TAG = {
    "type": "structural_tag",
    "structures": [{"begin": "<point>", "schema": POINT, "end": "</point>"}],
    "triggers": ["<point"],
}


@pytest.mark.parametrize(
    "values, kind",
    [
        ({"guided_json": {"type": "object"}}, "json"),
        ({"guided_json": '{"type": "integer"}'}, "json"),
        ({"guided_json_object": True}, "json_object"),
        ({"guided_json_object": "true"}, "json_object"),
        ({"guided_regex": "[0-9]+"}, "regex"),
        ({"guided_choice": ["yes", "no"]}, "choice"),
        ({"guided_grammar": 'root ::= "a" | "b"'}, "grammar"),
        ({"guided_grammar": 'start: "a" | "b"'}, "grammar"),
        ({"structured_outputs": {"regex": "[a-z]"}}, "regex"),
        ({"structured_outputs": '{"choice": ["x"]}'}, "choice"),
        ({"structured_outputs": {"json_object": True}}, "json_object"),
        ({"structured_outputs": json.dumps({"choice": ["Positive", "Negative"]})}, "choice"),  # vllm_backend's CI
        ({"guided_decoding": json.dumps({"choice": ["Positive", "Negative"]})}, "choice"),  # its releases <= 25.10
        ({"guided_decoding": {"regex": "[0-9]+", "backend": "outlines", "disable_fallback": True}}, "regex"),
        ({"structured_outputs": {"grammar": 'root ::= "a"', "whitespace_pattern": " ?"}}, "grammar"),
        ({"structured_outputs": {"structural_tag": json.dumps(STRUCTURAL_TAG)}}, "structural_tag"),
        ({"structured_outputs": {"structural_tag": STRUCTURAL_TAG, "json": None}}, "structural_tag"),
    ],
)
def test_client_keys(values, kind):
    values = {**values, "temperature": 0}
    guided = pop_guided_decoding(values)
    assert guided.kind == kind and grammar_text(guided)
    assert values == {"temperature": 0}  # the constraint's keys are consumed, the rest is left


def test_sampling_params_carry_the_constraint():
    params = SamplingParams.from_dict({"guided_regex": "[0-9]+", "max_tokens": "5"})
    assert params.guided_decoding.kind == "regex" and params.max_tokens == 5
    assert SamplingParams.from_dict({"max_tokens": 5}).guided_decoding is None
    with pytest.raises(InvalidRequest) as info:
        SamplingParams.from_dict({"guided_xml": "<a/>"})
    assert "unknown sampling parameter(s) ['guided_xml']" in str(info.value)
    assert "'guided_json', 'guided_json_object', 'guided_regex'" in str(info.value)


def test_no_constraint():
    assert pop_guided_decoding({"max_tokens": 3}) is None
    assert pop_guided_decoding({"guided_json_object": False, "guided_regex": None}) is None


@pytest.mark.parametrize(
    "values, fragment",
    [
        ({"guided_regex": "a", "guided_choice": ["b"]}, "at most one output constraint"),
        ({"guided_json": '{"type": '}, "guided_json must be a JSON schema"),
        ({"guided_json": [1, 2]}, "guided_json must be a JSON schema (an object), got list"),
        ({"guided_choice": "yes"}, "guided_choice must be a non-empty list of non-empty strings"),
        ({"guided_choice": ["yes", ""]}, "guided_choice must be a non-empty list of non-empty strings"),
        ({"guided_regex": ""}, "guided_regex must be a non-empty string"),
        ({"guided_json_object": "maybe"}, "guided_json_object must be true or false"),
        ({"structured_outputs": {"xml": "<a/>"}}, "unknown structured_outputs key(s) ['xml']"),
        ({"structured_outputs": "[1]"}, "structured_outputs must be an object, got list"),
        ({"structured_outputs": "{"}, "structured_outputs must be a JSON object"),
        ({"structured_outputs": {}}, "structured_outputs names no constraint: give one of ['json', 'json_object'"),
        ({"guided_decoding": {"disable_any_whitespace": True}}, "guided_decoding names no constraint"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "give at most one output constraint, got ['structured_outputs.regex', 'structured_outputs.choice']",
        ),
        (
            {"structured_outputs": {"regex": "a"}, "guided_decoding": {"regex": "b"}},
            "give at most one output constraint, got ['structured_outputs.regex', 'guided_decoding.regex']",
        ),
        (
            {"structured_outputs": {"regex": "a", "backend": "xgrammar"}},
            "unknown structured_outputs key(s) ['backend']",
        ),
        ({"guided_decoding": {"regex": "a", "backend": "tensorrt"}}, "guided_decoding.backend must be one of ['auto'"),
        ({"guided_decoding": {"regex": "a", "backend": "xgrammar:fast"}}, "option 'fast' is not one of"),
        ({"structured_outputs": {"json": POINT, "disable_any_whitespace": "sometimes"}}, "must be true or false"),
        ({"structured_outputs": {"json": POINT, "whitespace_pattern": ""}}, "whitespace_pattern must be a non-empty"),
        ({"structured_outputs": {"structural_tag": "{"}}, "structured_outputs.structural_tag must be JSON"),
        (
            {"structured_outputs": {"structural_tag": {"type": "structural_tag", "format": {"type": "any_text"}}}},
            "the 'format' form of a structural tag (xgrammar's) is not served",
        ),
        (
            {"structured_outputs": {"structural_tag": {**STRUCTURAL_TAG, "triggers": ["<fn"]}}},
            "structural_tag.structures[0].begin '<point>' starts with none of the triggers ['<fn']",
        ),
        (
            {"structured_outputs": {"structural_tag": {**STRUCTURAL_TAG, "structures": [{"begin": "<point>"}]}}},
            "structures[0] must be an object with exactly begin, schema and end",
        ),
        (
            {"structured_outputs": {"structural_tag": {**STRUCTURAL_TAG, "triggers": []}}},
            "structural_tag.triggers must be a non-empty list of non-empty strings",
        ),
    ],
)
def test_malformed_constraints(values, fragment):
    with pytest.raises(InvalidRequest) as info:
        pop_guided_decoding(values)
    assert fragment in str(info.value)


def test_the_objects_options():
    """disable_any_whitespace given false allows any whitespace, true (or absent) keeps JSON compact; a
    whitespace_pattern is kept; disable_additional_properties closes every object schema that lists properties
    and leaves alone one that says what others may be; a backend's options apply as the options would."""
    compact = pop_guided_decoding({"structured_outputs": {"json": POINT, "disable_any_whitespace": True}})
    assert not compact.any_whitespace and compact == pop_guided_decoding({"structured_outputs": {"json": POINT}})
    assert pop_guided_decoding(
        {"structured_outputs": {"json_object": True, "disable_any_whitespace": False}}
    ).any_whitespace
    assert (
        pop_guided_decoding({"structured_outputs": {"json": POINT, "whitespace_pattern": "[ ]?"}}).whitespace_pattern
        == "[ ]?"
    )
    open_schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
            "c": {"type": "array", "items": {"$ref": "#/$defs/d"}},
            "e": {"anyOf": [{"type": "object", "properties": {"f": {"type": "string"}}}, {"type": "null"}]},
            "g": {"type": "object", "properties": {}, "additionalProperties": {"type": "integer"}},
        },
        "$defs": {"d": {"type": "object", "properties": {"h": {"type": "boolean"}}}},
    }
    closed = json.loads(
        pop_guided_decoding({"structured_outputs": {"json": open_schema, "disable_additional_properties": True}}).spec
    )
    props = closed["properties"]
    assert closed["additionalProperties"] is False and props["a"]["additionalProperties"] is False
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert (
        props["e"]["anyOf"][0]["additionalProperties"] is False and "additionalProperties" not in props["e"]["anyOf"][1]
    )
    assert props["g"]["additionalProperties"] == {"type": "integer"}  # said what others may be: left alone
    assert "additionalProperties" not in open_schema["properties"]["a"]  # the client's object is not changed
    legacy = pop_guided_decoding(
        {"guided_decoding": {"json": open_schema, "backend": "xgrammar:no-additional-properties,no-fallback"}}
    )
    assert json.loads(legacy.spec) == closed and legacy.key == "guided_decoding.json"
    tag = json.loads(
        pop_guided_decoding(
            {"structured_outputs": {"structural_tag": STRUCTURAL_TAG, "disable_additional_properties": True}}
        ).spec
    )
    assert tag == {
        "structures": [
            {
                "trigger": "<point",
                "begin": "<point>",
                "schema": {**POINT, "additionalProperties": False},
                "end": "</point>",
            }
        ]
    }


def _accepts(tokenizer, values: dict, text: str) -> bool:
    """Whether the constraint's grammar takes `text` (tokenized as the model would write it) and may end there."""
    import llguidance.hf
    from llguidance import LLMatcher

    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer)
    matcher = LLMatcher(ll_tokenizer, grammar_text(pop_guided_decoding(dict(values))), log_level=0)
    return all(matcher.consume_token(t) for t in ll_tokenizer.tokenize_str(text)) and matcher.is_accepting()


@pytest.mark.parametrize(
    "options, text, accepted",
    [
        ({}, '{"x": 1}', True),  # compact: one space after each separator, none elsewhere
        ({}, '{ "x": 1}', False),
        ({"disable_any_whitespace": False}, '{ "x" :\n 1 }', True),
        ({"whitespace_pattern": "[ ]{0,2}"}, '{"x":1}', True),
        ({"whitespace_pattern": "[ ]{0,2}"}, '{  "x"  :  1}', True),
        ({"whitespace_pattern": "[ ]{0,2}"}, '{\n"x":1}', False),
        ({}, '{"x": 1, "y": 2}', True),  # the schema says nothing of other properties
        ({"disable_additional_properties": True}, '{"x": 1, "y": 2}', False),
    ],
)
def test_the_options_change_the_json_taken(tokenizer, options, text, accepted):
    assert _accepts(tokenizer, {"structured_outputs": {"json": POINT, **options}}, text) is accepted


@pytest.mark.parametrize(
    "text, accepted",
    [
        ("No point here.", True),  # free text
        ('Here: <point>{"x": 3}</point> and more text', True),
        ('<point>{"x": 3}</point><point>{"x": -1}</point>', True),
        ('Here: <point>{"y": 3}</point>', False),  # the schema holds after the trigger
        ('Here: <point>{"x": 3}', False),  # and the end text must follow
    ],
)
def test_a_structural_tag_constrains_only_what_follows_its_trigger(tokenizer, text, accepted):
    assert _accepts(tokenizer, {"structured_outputs": {"structural_tag": json.dumps(STRUCTURAL_TAG)}}, text) is accepted


# --------------------------------------------------------------------------- masks on a small vocabulary

SMALL_TOKENS = ["<eos>", "a", "b", "c", "y", "e", "s", "n", "o", "ab", "bc", "abc", "ye", "yes", "no", "on"]
SMALL_EOS = 0


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory) -> str:
    """A folder with a 16-token byte-level BPE tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    merges = [("a", "b"), ("b", "c"), ("ab", "c"), ("y", "e"), ("ye", "s"), ("n", "o"), ("o", "n")]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(SMALL_TOKENS)}, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    folder = tmp_path_factory.mktemp("small-vocab")
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>").save_pretrained(folder)
    return str(folder)


def expected_mask(language: set[str], text: str) -> set[int]:
    """Brute force: the tokens that keep `text` a prefix of a word of the finite `language`; EOS if it is one."""
    allowed = {
        i for i, t in enumerate(SMALL_TOKENS) if i != SMALL_EOS and any(w.startswith(text + t) for w in language)
    }
    return allowed | ({SMALL_EOS} if text in language else set())


def scheduled(matcher, drafts=()):
    """What mask_logits reads of a scheduled sequence that samples (k draft tokens: k + 1 rows), and the sequence
    (`seq`) its id names."""
    return SimpleNamespace(
        seq_id=next(_seq_ids),
        seq=SimpleNamespace(matcher=matcher),
        samples=True,
        draft=Draft(list(drafts)),
        num_sampled_rows=len(drafts) + 1,
    )


_seq_ids = itertools.count()


def allowed_rows(logits: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(row > float("-inf")).flatten().tolist()) for row in logits]


# a choice list and a regex over the same finite language, so the brute force knows every word
LANGUAGE = {"ab", "abc", "yes", "no", "noon", "bc"}


@pytest.mark.parametrize(
    "values",
    [
        {"guided_choice": sorted(LANGUAGE)},
        {"guided_regex": "ab|abc|yes|no(on)?|bc"},
        {"guided_grammar": 'root ::= "ab" "c"? | "yes" | "no" | "noon" | "bc"'},
    ],
)
def test_masks_allow_exactly_the_grammars_next_tokens(small_vocab, values):
    structured = StructuredOutput(small_vocab, len(SMALL_TOKENS))
    compiled = structured.compiler.compile(pop_guided_decoding(values)).result(timeout=30)
    tok = {t: i for i, t in enumerate(SMALL_TOKENS)}
    # one batch: an unconstrained row, three constrained sequences at different states, one with drafts
    states = [[], ["a"], ["no"], ["ye"]]
    matchers = []
    for consumed in states:
        matcher = compiled.deep_copy()
        assert all(matcher.consume_token(tok[t]) for t in consumed)
        matchers.append(matcher)
    drafts = ["no", "a", "n", "yes"]  # "no", then "noa" breaks the grammar (later rows are never used)
    batch = (
        [scheduled(None)]
        + [scheduled(m) for m in matchers]
        + [scheduled(compiled.deep_copy(), [tok[d] for d in drafts])]
    )
    logits = torch.randn(1 + len(states) + len(drafts) + 1, len(SMALL_TOKENS))
    unconstrained = logits[0].clone()
    structured.mask_logits(SchedulerOutput(batch, sequences={s.seq_id: s.seq for s in batch}), logits)
    rows = allowed_rows(logits)
    assert torch.equal(logits[0], unconstrained)
    for i, consumed in enumerate(states):
        assert rows[1 + i] == expected_mask(LANGUAGE, "".join(consumed)), consumed
    first = 1 + len(states)
    assert rows[first] == expected_mask(LANGUAGE, "")  # before any draft
    assert rows[first + 1] == expected_mask(LANGUAGE, "no")  # after the draft "no"
    assert tok["a"] not in rows[first + 1]  # so the draft "a" gets probability 0 and is rejected
    assert batch[-1].seq.matcher.is_accepting() is False  # the drafts did not move the matcher
    allowed = logits[1:first][torch.isfinite(logits[1:first])]
    assert torch.equal(allowed, logits[1:first][torch.isfinite(logits[1:first])])  # allowed logits untouched


def test_a_complete_grammar_stops_the_sequence(small_vocab):
    structured = StructuredOutput(small_vocab, len(SMALL_TOKENS))
    compiled = structured.compiler.compile(pop_guided_decoding({"guided_choice": ["ab", "abc"]})).result(timeout=30)
    matcher = compiled.deep_copy()
    tok = {t: i for i, t in enumerate(SMALL_TOKENS)}
    assert not advance(matcher, tok["ab"])  # "ab" is a word, but "abc" may follow
    assert advance(matcher, tok["c"])  # "abc": nothing but EOS may follow
    assert advance(compiled.deep_copy(), tok["yes"])  # a token the grammar forbids also stops it


@pytest.mark.parametrize(
    "values, fragment",
    [
        ({"guided_regex": "(abc"}, "the regular expression does not compile: "),
        ({"guided_json": {"type": "foo"}}, "the JSON schema does not compile: Invalid type: foo"),
        ({"guided_grammar": "start: foo bar ::="}, "the grammar does not compile: 1(17): Expected token 'rule_name'"),
        (
            {"guided_grammar": "root ::= undefined_rule"},
            "guided_grammar is not a valid grammar: Failed to convert the "
            "grammar from GBNF to Lark: Rule 'undefined_rule' not found",
        ),
    ],
)
def test_compile_errors_name_the_problem(small_vocab, values, fragment):
    """Every grammar is turned into llguidance's and compiled off the request path; its errors name the problem."""
    compiler = GrammarCompiler(small_vocab, len(SMALL_TOKENS))
    with pytest.raises(InvalidRequest) as info:
        compiler.compile(pop_guided_decoding(values)).result(timeout=30)
    assert str(info.value).startswith(fragment)


def test_each_grammar_compiles_once(small_vocab):
    compiler = GrammarCompiler(small_vocab, len(SMALL_TOKENS), cache_size=2)
    a, b, c = (pop_guided_decoding({"guided_choice": [w]}) for w in ("ab", "yes", "no"))
    first = compiler.compile(a)
    assert compiler.compile(pop_guided_decoding({"guided_choice": ["ab"]})) is first  # cached by its text
    evicted = compiler.compile(b)
    compiler.compile(a)  # a is now the most recently used
    compiler.compile(c)  # evicts b
    assert list(compiler._cache) == [(a.kind, a.spec, False, None), (c.kind, c.spec, False, None)]
    assert compiler.compile(a) is first and compiler.compile(b) is not evicted


def test_a_compiler_crash_fails_only_its_request(small_vocab):
    from concurrent.futures import Future

    crashed, compiled = Future(), Future()
    crashed.set_exception(RuntimeError("out of memory"))
    compiled.set_result(
        GrammarCompiler(small_vocab, len(SMALL_TOKENS))
        .compile(pop_guided_decoding({"guided_choice": ["ab"]}))
        .result(timeout=30)
    )
    seqs = [SimpleNamespace(matcher=None) for _ in range(2)]
    requests = [
        SimpleNamespace(compiling=True, grammar=crashed, error=None, sequences=[]),
        SimpleNamespace(compiling=True, grammar=compiled, error=None, sequences=seqs),
    ]
    StructuredOutput(small_vocab, len(SMALL_TOKENS)).prepare(requests)
    assert requests[0].error == "the output constraint could not be compiled: out of memory"
    assert requests[1].error is None and seqs[0].matcher is not seqs[1].matcher  # a matcher each
    assert seqs[0].matcher is not compiled.result() and seqs[0].matcher.is_accepting() is False
