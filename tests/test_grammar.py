"""Grammar-constrained sampling with the real SmolLM2 tokenizer (CPU, a few seconds).

The random walks pick uniformly among the tokens a mask allows, so they visit far more of
the grammar than a model would; whatever they produce must still parse and validate.
"""

import json
import re

import pytest
import torch

from tierserve.errors import InvalidRequestError
from tierserve.structured import GrammarSpec, tool_calls_schema
from tierserve.worker.grammar import (
    GrammarCompiler,
    GrammarState,
    GrammarViolationError,
    apply_grammar_masks,
)

PADDED_VOCAB = 49152 + 40            # the model's logits are wider than the tokenizer
NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "owner": {"type": "object",
                  "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                 "active": {"type": "boolean"}},
                  "required": ["id", "active"], "additionalProperties": False},
    },
    "required": ["name", "kind", "age", "tags", "owner"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Small tensor ops on a shared 2-core box: torch's second thread makes them 100x
    slower (13 ms against 0.08 ms per isfinite over the vocabulary)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    from tierserve.model.tokenizer import Tokenizer
    return Tokenizer.load(default_model_path)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer)


def random_walk(compiler, tokenizer, spec, seed, max_tokens=400, close_after=None) -> str:
    """Samples uniformly among allowed tokens through apply_grammar_masks, with an
    unconstrained row in the middle of the batch that must come out untouched.

    A uniform walk over free JSON nests deeper faster than it closes; after `close_after`
    tokens it prefers, in order, EOS and tokens that close things (falling back to a
    uniform pick, e.g. inside an escape), so it ends while staying inside the grammar.
    """
    closers = [tokenizer.eos_token_id] + [
        tokenizer.encode(t, add_special_tokens=False)[0] for t in ('"', "}", "]", ":", "0")]
    state = GrammarState(compiler.compile(spec))
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(max_tokens):
        logits = torch.randn(3, PADDED_VOCAB, generator=gen)
        before = logits.clone()
        apply_grammar_masks(logits, [0, 2], [state, GrammarState(compiler.compile(spec))])
        assert torch.equal(logits[1], before[1])
        allowed = torch.isfinite(logits[0])
        assert torch.equal(allowed, state.allowed_mask(PADDED_VOCAB))
        assert not allowed[len(tokenizer.hf):].any()             # padding is never allowed
        assert bool(allowed[tokenizer.eos_token_id]) == state.can_end()
        choices = allowed.nonzero().flatten()
        token = int(choices[torch.randint(len(choices), (1,), generator=gen)])
        if close_after is not None and len(out) >= close_after:
            token = next((t for t in closers if allowed[t]), token)
        state.accept(token)
        if token == tokenizer.eos_token_id:
            break
        out.append(token)
        if state.is_done():
            break
    assert state.can_end(), "the walk did not finish"
    return tokenizer.decode(out)


def conforms(value, schema) -> bool:
    """The subset of JSON-schema validation NESTED_SCHEMA uses (jsonschema is not a
    dependency)."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "object":
        props = schema["properties"]
        return (isinstance(value, dict) and set(schema["required"]) <= set(value)
                and set(value) <= set(props)
                and all(conforms(v, props[k]) for k, v in value.items()))
    if kind == "array":
        return (isinstance(value, list) and len(value) <= schema.get("maxItems", 1 << 30)
                and all(conforms(v, schema["items"]) for v in value))
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", 1 << 30)
    if kind == "integer":
        return (type(value) is int and schema.get("minimum", value) <= value
                <= schema.get("maximum", value))
    return kind == "boolean" and type(value) is bool


@pytest.mark.parametrize("seed", range(8))
def test_random_walk_under_nested_schema_validates(compiler, tokenizer, seed):
    text = random_walk(compiler, tokenizer, GrammarSpec.json_schema(NESTED_SCHEMA), seed)
    assert conforms(json.loads(text), NESTED_SCHEMA), text


@pytest.mark.parametrize("seed", range(2))
def test_json_object_gives_an_object(compiler, tokenizer, seed):
    text = random_walk(compiler, tokenizer, ("json_object", None), seed, close_after=30)
    assert isinstance(json.loads(text), dict)


def test_choice_yields_one_of_the_choices(compiler, tokenizer):
    choices = ("positive", "negative", "neutral \"quoted\"")
    seen = {random_walk(compiler, tokenizer, ("choice", choices), seed) for seed in range(6)}
    assert seen <= set(choices) and len(seen) > 1


def test_regex_walk_matches(compiler, tokenizer):
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    for seed in range(3):
        assert re.fullmatch(pattern, random_walk(compiler, tokenizer, ("regex", pattern), seed))


def test_tool_call_schema_constrains_name_and_arguments(compiler, tokenizer):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"], "additionalProperties": False}}},
        {"type": "function", "function": {"name": "noop", "parameters": {
            "type": "object", "properties": {}, "additionalProperties": False}}}]
    spec = GrammarSpec.json_schema(tool_calls_schema(tools))
    for seed in range(3):
        calls = json.loads(random_walk(compiler, tokenizer, spec, seed))
        assert isinstance(calls, list) and calls
        for call in calls:
            assert call["name"] in ("get_weather", "noop")
            assert set(call["arguments"]) == ({"city"} if call["name"] == "get_weather"
                                              else set())


def test_eos_only_when_complete_and_done_after(compiler, tokenizer):
    state = GrammarState(compiler.compile(("regex", "ab")))
    eos = tokenizer.eos_token_id
    assert not state.allowed_mask(PADDED_VOCAB)[eos] and not state.is_done()
    for token in tokenizer.encode("ab", add_special_tokens=False):
        state.accept(token)
    mask = state.allowed_mask(PADDED_VOCAB)
    assert state.is_done() and mask[eos] and mask.sum() == 1


@pytest.mark.parametrize("spec", [
    ("json_schema", '{"type": "no-such-type"}'),
    ("json_schema", '{"type": "string", "pattern": "[a-"}'),
    ("regex", "[a-z"),
    ("grammar", "start: undefined_rule"),
    ("choice", ()),
])
def test_invalid_specs_raise_invalid_request(compiler, spec):
    with pytest.raises(InvalidRequestError) as info:
        compiler.compile(GrammarSpec(*spec, param="guided_x"))
    assert info.value.param == "guided_x"


def test_schema_that_is_not_json_names_its_param():
    with pytest.raises(InvalidRequestError) as info:
        GrammarSpec.from_request(guided_json="{not json")
    assert info.value.param == "guided_json"


def test_cache_returns_the_same_grammar_and_counts(tokenizer):
    compiler = GrammarCompiler(tokenizer, max_cached=2)
    first = compiler.compile(GrammarSpec.json_schema(NESTED_SCHEMA))
    again = compiler.compile(GrammarSpec.json_schema(json.dumps(NESTED_SCHEMA, indent=2),
                                                     param="guided_json"))
    assert again is first
    assert (compiler.stats.num_compiled, compiler.stats.num_cache_hits) == (1, 1)
    compiler.compile(("choice", ["a", "b"]))                   # a list is keyed as a tuple
    assert compiler.compile(("choice", ("a", "b"))) is compiler.compile(("choice", ["a", "b"]))
    compiler.compile(("regex", "b+"))                          # evicts the schema
    assert compiler.compile(GrammarSpec.json_schema(NESTED_SCHEMA)) is not first


def test_unconstrained_rows_untouched_and_no_rows_is_a_no_op(compiler):
    logits = torch.randn(4, PADDED_VOCAB)
    before = logits.clone()
    apply_grammar_masks(logits, [], [])
    assert torch.equal(logits, before)
    state = GrammarState(compiler.compile(("choice", ("yes", "no"))))
    apply_grammar_masks(logits, [2], [state])
    assert torch.equal(logits[[0, 1, 3]], before[[0, 1, 3]])
    assert 0 < torch.isfinite(logits[2]).sum() <= 8    # y, ye, yes, n, no...


def test_accepting_a_forbidden_token_raises(compiler, tokenizer):
    state = GrammarState(compiler.compile(("regex", "ab")))
    with pytest.raises(GrammarViolationError):
        state.accept(tokenizer.encode("zz", add_special_tokens=False)[0])
    assert state.is_done() and state.error
    mask = state.allowed_mask(PADDED_VOCAB)                    # EOS alone: the request ends
    assert mask.sum() == 1 and mask[tokenizer.eos_token_id]


def test_from_request_maps_openai_and_vllm_fields():
    schema = {"type": "object"}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert GrammarSpec.from_request(response_format=rf) == GrammarSpec.json_schema(schema)
    assert GrammarSpec.from_request(response_format={"type": "text"}) is None
    assert GrammarSpec.from_request(response_format={"type": "json_object"}).kind == \
        "json_object"
    assert GrammarSpec.from_request(guided_choice=["a", "b"]).value == ("a", "b")
    assert GrammarSpec.from_request(structured_outputs={"regex": "a+"}).kind == "regex"
    with pytest.raises(InvalidRequestError):
        GrammarSpec.from_request(guided_regex="a", guided_choice=["a"])
