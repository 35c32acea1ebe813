"""The parameter table (pytgi_proto.parameters) is the one declaration: the router's parsed
fields, the OpenAPI document and the wire's sampling message must all match it."""

from __future__ import annotations

from dataclasses import fields

from pytgi_proto import generate_pb2
from pytgi_proto.parameters import BY_NAME, PARAMETERS, SAMPLING, neutral_sampling, replace_sampling
from pytgi_router.http.openapi import openapi_document
from pytgi_router.http.schemas import GenerateParameters, parse_parameters

# The wire's sampling fields the table does not declare: the validator fills them from the
# compiled grammar, not from a parameter of their own.
GRAMMAR_FIELDS = {"grammar", "grammar_type"}


def test_the_openapi_parameters_are_the_tables() -> None:
    schema = openapi_document("test")["components"]["schemas"]["GenerateParameters"]
    names = {p.name for p in PARAMETERS} | {a for p in PARAMETERS for a in p.aliases}
    assert set(schema["properties"]) == names
    for param in PARAMETERS:
        assert schema["properties"][param.name] == param.schema()


def test_generate_parameters_has_one_field_per_row() -> None:
    assert {f.name for f in fields(GenerateParameters)} == set(BY_NAME)


def test_every_sampling_row_is_a_wire_field_and_back() -> None:
    wire = {f.name for f in generate_pb2.NextTokenChooserParameters.DESCRIPTOR.fields}
    assert {p.wire for p in SAMPLING} == wire - GRAMMAR_FIELDS


def test_neutral_sampling_is_the_tables_neutral_values() -> None:
    sampling = neutral_sampling()
    for param in SAMPLING:
        assert getattr(sampling, param.wire or param.name) == param.neutral
    assert neutral_sampling(seed=7).seed == 7


def test_replace_sampling_copies() -> None:
    first = neutral_sampling(seed=1, temperature=0.5)
    second = replace_sampling(first, seed=2)
    assert (first.seed, second.seed, second.temperature) == (1, 2, 0.5)


def test_bounds_hold_at_their_ends() -> None:
    top_p, typical_p = BY_NAME["top_p"], BY_NAME["typical_p"]
    assert top_p.violation(1.0) is None and top_p.violation(0.0) is not None
    assert typical_p.violation(1.0) == "`typical_p` must be > 0.0 and < 1.0"
    assert BY_NAME["repetition_penalty"].violation(2e3) == (
        "`repetition_penalty` must be >= 0.001 and <= 1000.0. Given: 2000.0")


def test_flags_read_their_aliases() -> None:
    assert parse_parameters({"ignore_eos_token": True}).ignore_eos
    assert not parse_parameters({}).ignore_eos and parse_parameters(None).do_sample
