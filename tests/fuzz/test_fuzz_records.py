"""Garbage in, protocol errors out: every record parser (spec §4.4 and the bodies of §6).

Mutated valid JSON octets go through both body readers (``kvsp.records.loads`` and the HTTP
edge's ``parse_json``) and then every ``from_json``; arbitrary JSON trees and valid documents
with one member replaced or removed go through every ``from_json``. Only
:class:`~kvsp.errors.KVSPError` may come out, and whatever is accepted round-trips through
``to_json`` (``targets.records_target`` / ``targets.parse_value``).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvsp.errors import BadRequest, KVSPError, RecordError
from kvsp.records import Sampler, SessionCheckpoint, loads
from kvsp.web.http import parse_json
from tests.support.fuzz_strategies import (
    DELETE,
    json_values,
    mutate_tree,
    mutated,
    paths_in,
    targets,
)

SEEDS = targets.record_seeds()
DOCUMENTS = targets.record_documents()
FUZZ = settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _accepted_by(value: Any) -> list[str]:
    names = []
    for parse in targets.RECORD_PARSERS:
        try:
            record = parse(value)
        except KVSPError:
            continue
        if record is not None:
            names.append(getattr(parse, "__qualname__", repr(parse)))
    return names


@pytest.mark.parametrize("index", range(len(DOCUMENTS)))
def test_every_seed_document_is_a_valid_record(index: int) -> None:
    assert _accepted_by(DOCUMENTS[index]), json.dumps(DOCUMENTS[index])[:200]


@FUZZ
@given(mutated(SEEDS))
@example(b"1" * 5000)  # past the interpreter's int-conversion limit: once a 500 at the edge
@example(b'{"ttl_ms": ' + b"9" * 4301 + b"}")
@example(b'{"a": 1, "a": 2}')
@example(b"[" * 100_000)
@example(b"\xef\xbb\xbf{}")
def test_mutated_json_octets_parse_or_raise_kvsp_errors(data: bytes) -> None:
    targets.records_target(data)


@FUZZ
@given(json_values)
def test_arbitrary_json_trees_parse_or_raise_kvsp_errors(value: Any) -> None:
    targets.parse_value(value)


@FUZZ
@given(st.data())
def test_mutated_documents_parse_or_raise_kvsp_errors(data: st.DataObject) -> None:
    document = data.draw(st.sampled_from(DOCUMENTS))
    for _ in range(data.draw(st.integers(1, 3))):
        paths = paths_in(document)
        if not paths:
            break
        where = data.draw(st.sampled_from(paths))
        document = mutate_tree(document, where, data.draw(st.just(DELETE) | json_values))
    targets.parse_value(document)


def test_huge_integers_are_a_bad_request_at_the_edge() -> None:
    for body in (b"1" * 5000, b'{"ttl_ms": ' + b"9" * 4400 + b"}"):
        with pytest.raises(BadRequest) as info:
            parse_json(body)
        assert info.value.path == "$"
        with pytest.raises(RecordError):
            loads(body)


def test_a_sampler_without_params_is_held_to_its_method_rules() -> None:
    """Absent params read as {}; top-p without p was accepted, then refused once written."""
    document = targets.record_documents()[2]
    del document["sampler"]["params"]
    with pytest.raises(RecordError) as info:
        SessionCheckpoint.from_json(document)
    assert info.value.path == "$.sampler.params.p"
    greedy = {"method": "greedy", "step": 0, "deterministic": True}
    sampler = Sampler.from_json(greedy)
    assert Sampler.from_json(sampler.to_json()) == sampler
