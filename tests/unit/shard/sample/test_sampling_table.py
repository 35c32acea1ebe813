"""The shard's SamplingParams is the parameter table's sampling rows (pytgi_proto.parameters):
one field per row, and a field the router never set reads as the row's neutral value."""

from __future__ import annotations

from dataclasses import fields

from pytgi_proto import generate_pb2
from pytgi_proto.parameters import SAMPLING, neutral_sampling
from pytgi_shard.sample.chooser import SamplingParams


def test_one_field_per_sampling_row_with_its_neutral_default() -> None:
    assert {f.name: f.default for f in fields(SamplingParams)} == {
        p.name: p.neutral for p in SAMPLING}


def test_an_unset_wire_field_reads_as_neutral() -> None:
    assert SamplingParams.from_pb(generate_pb2.NextTokenChooserParameters()) == SamplingParams()
    assert SamplingParams.from_pb(neutral_sampling()) == SamplingParams()
    given = SamplingParams.from_pb(neutral_sampling(top_k=3, seed=9, do_sample=True))
    assert (given.top_k, given.seed, given.do_sample, given.temperature) == (3, 9, True, 1.0)
