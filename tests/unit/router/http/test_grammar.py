"""grammar.py: TGI's grammar shapes and OpenAI's response_format onto the wire's (type, value),
and every bad schema or regex refused with a message naming the problem (compiled by llguidance,
as the shards compile it): one that allows no output at all, or over the size limit, too."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from llguidance import LLMatcher

from pytgi_router.core.errors import ValidationError
from pytgi_router.http.grammar import (
    ANY_JSON_OBJECT,
    GRAMMAR_JSON,
    GRAMMAR_LARK,
    GRAMMAR_REGEX,
    Grammar,
    GrammarChecker,
    GrammarLimits,
    json_size_exceeds,
    parse_grammar,
    response_format_grammar,
)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CHECKER = GrammarChecker()


def llguidance_compiles(grammar: Grammar) -> bool:
    """Whether llguidance alone accepts the grammar, before any vocabulary or first mask."""
    if grammar.grammar_type == GRAMMAR_REGEX:
        source = LLMatcher.grammar_from_regex(grammar.value)
    elif grammar.grammar_type == GRAMMAR_LARK:
        source = LLMatcher.grammar_from_lark(grammar.value)
    else:
        source = LLMatcher.grammar_from_json_schema(grammar.value)
    is_error, _ = LLMatcher.validate_grammar_with_warnings(source)
    return not is_error


def wire(grammar: dict[str, Any], checker: GrammarChecker = CHECKER) -> tuple[int, Any]:
    g = parse_grammar(grammar)
    checker.check(g)
    return g.grammar_type, g.value if g.grammar_type != GRAMMAR_JSON else json.loads(g.value)


@pytest.mark.parametrize("grammar", [
    {"type": "json", "value": SCHEMA},
    {"type": "json", "value": json.dumps(SCHEMA)},
    {"type": "json_object", "value": SCHEMA},
    {"type": "json_schema", "value": {"name": "x", "schema": SCHEMA}},
    {"type": "json_schema", "value": {"schema": json.dumps(SCHEMA)}},
])
def test_every_json_form_sends_the_schema(grammar: dict[str, Any]) -> None:
    assert wire(grammar) == (GRAMMAR_JSON, SCHEMA)


def test_json_without_a_schema_is_any_object_and_regex_goes_as_is() -> None:
    assert wire({"type": "json_object"}) == (GRAMMAR_JSON, ANY_JSON_OBJECT)
    assert wire({"type": "json_schema", "value": {"name": "x"}}) == (GRAMMAR_JSON, ANY_JSON_OBJECT)
    assert wire({"type": "regex", "value": r"\d{3}-[a-z]+"}) == (GRAMMAR_REGEX, r"\d{3}-[a-z]+")
    lark = 'start: "<think>" /[a-z]+/'
    assert wire({"type": "lark", "value": lark}) == (GRAMMAR_LARK, lark)


def test_the_wire_text_is_compact_and_keeps_unicode() -> None:
    g = parse_grammar({"type": "json", "value": {"enum": ["é", "ü"]}})
    assert g == Grammar(GRAMMAR_JSON, '{"enum":["é","ü"]}')


@pytest.mark.parametrize(("grammar", "message"), [
    ({"type": "regex", "value": "("}, "grammar is not valid: invalid regex '(': unclosed group"),
    ({"type": "regex", "value": "a{3,"},
     "grammar is not valid: invalid regex 'a{3,': unclosed counted repetition"),
    ({"type": "regex", "value": "(?<=a)b"}, "look-around, including look-ahead and look-behind, "
                                             "is not supported"),
    ({"type": "regex", "value": 5}, "grammar is not valid: a regex grammar needs a string value"),
    ({"type": "json", "value": "{not json"}, "grammar is not valid: Expecting property name"),
    ({"type": "json", "value": [1]}, "grammar is not valid: the JSON schema must be an object"),
    ({"type": "json", "value": {"type": "integr"}}, "grammar is not valid: Invalid type: integr"),
    ({"type": "json", "value": {"type": "object", "properties": []}},
     "grammar is not valid: properties must be an object"),
    ({"type": "json", "value": {"type": "string", "minLength": "x"}}, "minLength"),
    ({"type": "json", "value": {"type": "array", "minItems": 3, "maxItems": 1}},
     "Unsatisfiable schema: minItems (3) is greater than maxItems (1)"),
    ({"type": "json", "value": {"$ref": "#/$defs/missing"}}, "'/$defs/missing' does not exist"),
    ({"type": "json", "value": {"not": {"type": "string"}}},
     'grammar is not valid: unsupported JSON Schema feature: Unimplemented keys: ["not"]'),
    ({"type": "json", "value": {"type": "string", "format": "color"}},
     "unsupported JSON Schema feature: Unknown format: color"),
    ({"type": "json", "value": {"type": "string", "pattern": "["}},
     "grammar is not valid: invalid regex in the JSON schema: unclosed character class"),
    ({"type": "json_schema", "value": "x"}, "a json_schema value must be an object"),
    ({"type": "gbnf", "value": "root ::= 'a'"}, "grammar is not valid: unknown type 'gbnf'"),
    ({"type": "lark", "value": "start: 'a'"}, "grammar is not valid: invalid lark grammar: "),
    ({"type": "lark", "value": {"start": "a"}}, "a lark grammar needs a string value"),
    ({"value": "a"}, "grammar is not valid: unknown type None"),
])
def test_bad_grammars_name_the_problem(grammar: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as info:
        wire(grammar)
    assert info.value.status_code == 422 and info.value.error_type == "validation"
    assert info.value.message.startswith("Input validation error: grammar is not valid: ")
    assert message in info.value.message


@pytest.mark.parametrize(("fmt", "grammar"), [
    (None, None),
    ({"type": "text"}, None),
    ({"type": "json_object"}, {"type": "json", "value": ANY_JSON_OBJECT}),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}},
     {"type": "json_schema", "value": {"name": "n", "schema": SCHEMA, "strict": True}}),
    ({"type": "json", "value": SCHEMA}, {"type": "json", "value": SCHEMA}),  # TGI's own form
    ({"type": "regex", "value": "a+"}, {"type": "regex", "value": "a+"}),
])
def test_response_format_maps_onto_a_grammar(
    fmt: dict[str, Any] | None, grammar: dict[str, Any] | None
) -> None:
    assert response_format_grammar(fmt) == grammar


def test_response_format_json_schema_needs_its_object() -> None:
    with pytest.raises(ValidationError, match="`response_format.json_schema` must be an object"):
        response_format_grammar({"type": "json_schema"})
    g = response_format_grammar({"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}})
    assert g is not None and wire(g) == (GRAMMAR_JSON, SCHEMA)


EMPTY_LANGUAGES = [
    {"type": "regex", "value": "[a&&b]"},
    {"type": "regex", "value": r"[^\x00-\x{10FFFF}]"},
    {"type": "json", "value": {"$ref": "#"}},
    {"type": "json", "value": {"$ref": "#/$defs/n", "$defs": {"n": {"$ref": "#/$defs/n"}}}},
]


@pytest.mark.parametrize("grammar", EMPTY_LANGUAGES)
def test_a_grammar_that_allows_no_output_is_refused(grammar: dict[str, Any]) -> None:
    """llguidance compiles these: on a shard their first mask was an error state that forced
    EOS at once, a 200 with empty text."""
    assert llguidance_compiles(parse_grammar(grammar))
    with pytest.raises(ValidationError) as info:
        wire(grammar)
    assert info.value.status_code == 422
    assert "grammar is not valid: no output can match it" in info.value.message


@pytest.mark.parametrize("grammar", [
    {"type": "regex", "value": ""},  # the empty output
    {"type": "regex", "value": "[a&&[ab]]x?"},
    {"type": "json", "value": {"type": "string", "maxLength": 0}},
    {"type": "json", "value": {"$ref": "#/$defs/n", "$defs": {"n": {"anyOf": [
        {"type": "null"}, {"type": "array", "items": {"$ref": "#/$defs/n"}}]}}}},
])
def test_a_grammar_with_some_output_is_accepted(grammar: dict[str, Any]) -> None:
    wire(grammar)


def test_a_grammar_over_the_size_limit_is_refused_before_it_compiles() -> None:
    checker = GrammarChecker(GrammarLimits(max_bytes=64))
    fits = {"type": "regex", "value": "a" * 64}
    assert wire(fits, checker) == (GRAMMAR_REGEX, "a" * 64)
    # The size is the wire's: compact JSON, UTF-8 bytes.
    schema = {"enum": ["é" * 23, "x"]}
    assert len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode()) == 63
    assert wire({"type": "json", "value": schema}, checker)[0] == GRAMMAR_JSON
    schema = {"enum": ["é" * 24, "x"]}  # 41 characters, 65 bytes
    big = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(9)}}
    for over in ({"type": "regex", "value": "(" * 65}, {"type": "json", "value": schema},
                 {"type": "json", "value": big}):  # fmt: skip
        with pytest.raises(ValidationError) as info:
            wire(over, checker)
        assert info.value.message == (
            "Input validation error: grammar is not valid: it is longer than 64 bytes, this "
            "server's limit (--max-grammar-bytes)"
        )


def test_the_default_limit_refuses_the_ten_thousand_property_schema() -> None:
    """0.27 MB compact: seconds to validate, tens to compile per request, and no output can get
    past its `{` (llguidance's row limit): refused by its size alone, before it is even written
    out as the wire's text."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(10_000)}}
    with pytest.raises(ValidationError, match="longer than 65536 bytes"):
        CHECKER.parse({"type": "json", "value": schema})


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=30,
)


@given(JSON_VALUES)
def test_the_size_bound_never_exceeds_the_written_size(value: Any) -> None:
    size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
    assert not json_size_exceeds(value, size)
    plain = json.dumps(value, separators=(",", ":"))
    if not _has_scalars(value) and plain.isascii() and "\\" not in plain:
        # Only containers and strings, nothing escaped: the bound is the size.
        assert json_size_exceeds(value, size - 1)


def _has_scalars(value: Any) -> bool:
    """Numbers, booleans or null anywhere: the bound counts them as one byte."""
    if isinstance(value, dict):
        return any(_has_scalars(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_scalars(v) for v in value)
    return not isinstance(value, str)


def test_a_grammar_sent_again_is_not_compiled_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The verdict on each grammar is kept (valid or not) for the last `memo_bytes` of
    grammar text: a large schema sent with every request costs one compile."""
    checker = GrammarChecker(memo_bytes=40)
    compiled: list[str] = []
    compile_once = checker._compile

    def counted(grammar: Grammar) -> str | None:
        compiled.append(grammar.value)
        return compile_once(grammar)

    monkeypatch.setattr(checker, "_compile", counted)
    good, bad = Grammar(GRAMMAR_REGEX, "[0-9]{20}"), Grammar(GRAMMAR_REGEX, "[a&&b]")
    for _ in range(3):
        checker.check(good)
        with pytest.raises(ValidationError, match="no output can match it"):
            checker.check(bad)
    assert compiled == ["[0-9]{20}", "[a&&b]"]
    checker.check(Grammar(GRAMMAR_REGEX, "x" * 30))  # 9 + 6 + 30 > 40: the oldest goes
    checker.check(good)
    assert compiled == ["[0-9]{20}", "[a&&b]", "x" * 30, "[0-9]{20}"]
