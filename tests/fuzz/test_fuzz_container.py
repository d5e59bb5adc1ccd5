"""Garbage in, protocol errors out: the KVB1 container parsers (spec §4.3) under mutation.

Every input either parses or raises a :class:`~kvsp.errors.KVSPError`; ``decode_container``
and the incremental :class:`~kvsp.container_reader.ContainerReader` (fed whole, one octet at a
time and in uneven chunks) agree on every input, layer for layer (``targets.container_target``).
"""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvsp.container import (
    KVB1_HEADER,
    KVB1_LAYER_LENGTHS,
    KVB1_MAGIC,
    decode_container,
    encode_container,
)
from kvsp.container_reader import EAGER_SECTION, ContainerReader
from kvsp.errors import ContainerError, KVSPError
from tests.support.fuzz_strategies import mutated, targets

SEEDS = targets.container_seeds()
FUZZ = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_the_seeds_are_valid_containers() -> None:
    for seed in SEEDS:
        assert decode_container(seed, targets.GEOMETRY).layer_count >= 1
        targets.container_target(seed)


@FUZZ
@given(mutated(SEEDS))
def test_mutated_containers_parse_or_raise_kvsp_errors(data: bytes) -> None:
    targets.container_target(data)


@st.composite
def headers(draw: st.DrawFn) -> bytes:
    """A KVB1 header with fields drawn around their boundaries, then some data octets."""
    count = draw(st.sampled_from([0, 1, 2, 3, 4, 5, 65, 2**31, 2**32 - 1]))
    fixed = KVB1_HEADER.pack(
        KVB1_MAGIC,
        draw(st.sampled_from([1, 1, 1, 0, 2, 255])),
        draw(st.sampled_from([0, 0, 0, 1, 0x80])),
        draw(st.sampled_from([1, 1, 0, 2, 0xFFFF])),
        draw(st.sampled_from([0, 1, 3, 4, 2**32 - 1])),
        count,
        draw(st.sampled_from([0, 1, 2, 3, 2**32 - 1])),
    )
    length = st.sampled_from([0, 1, 4, 8, 12, 2**20, 2**40, 2**63, 2**64 - 1])
    entries = draw(st.lists(st.tuples(length, length), max_size=min(count, 5)))
    body = b"".join(KVB1_LAYER_LENGTHS.pack(k, v) for k, v in entries)
    return fixed + body + draw(st.binary(max_size=64))


@FUZZ
@given(headers())
def test_headers_with_boundary_fields_parse_or_raise_kvsp_errors(data: bytes) -> None:
    targets.container_target(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
@example(b"KVB")
@example(b"KVB1" + b"\x01\x00\x00\x01" + b"\x00" * 12)
def test_arbitrary_bytes_parse_or_raise_kvsp_errors(data: bytes) -> None:
    targets.container_target(data)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.data())
def test_sections_beyond_the_eager_size_grow_as_they_arrive(
    layers: int, data: st.DataObject
) -> None:
    """Sections longer than EAGER_SECTION take the growing path; the layers come out the same
    whichever way the octets are cut."""
    section = EAGER_SECTION + data.draw(st.integers(1, 4096))
    parts = [bytes([i]) * section for i in range(2 * layers)]
    pairs = [(parts[2 * i], parts[2 * i + 1]) for i in range(layers)]
    wire = encode_container(pairs, first_layer=0, token_count=1)
    cut = sorted(data.draw(st.lists(st.integers(1, len(wire) - 1), max_size=8, unique=True)))
    reader = ContainerReader(compute_digests=True)
    got = []
    for start, end in zip([0, *cut], [*cut, len(wire)], strict=True):
        got += reader.feed(bytearray(wire[start:end]))  # mutable chunks: never kept as views
    reader.close()
    assert [(bytes(x.k), bytes(x.v)) for x in got] == pairs
    assert reader.digests == [hashlib.sha256(k + v).digest() for k, v in pairs]


def test_a_failed_reader_stays_failed() -> None:
    reader = ContainerReader()
    with pytest.raises(ContainerError):
        reader.feed(b"KVB2")
    for attempt in (lambda: reader.feed(SEEDS[0]), reader.close):
        with pytest.raises(KVSPError):
            attempt()
