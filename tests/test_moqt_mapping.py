"""kvsp.moqt_mapping: the KV-to-MOQT mapping of DESIGN.md §4 (names, ranges, the in-band layer
digest, object ↔ layer)."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp.container import Geometry, encode_container
from kvsp.errors import ContainerError, InvalidIdentifier
from kvsp.ids import BlockKey, CompatId, ScopeId, uri_id
from kvsp.moqt_mapping import (
    LAYER_DIGEST_TYPE,
    Broad,
    LayerAssembler,
    Plain,
    Scoped,
    classify,
    decode_moqt_namespace,
    encode_moqt_namespace,
    fetch_layer_range,
    find_layer_digest,
    is_kv_namespace,
    is_live_track_name,
    kv_namespace,
    kv_scope_prefix,
    layer_digest_extension,
    layer_range_locations,
    live_track_name,
    parse_kv_namespace,
    parse_stored_track_name,
    split_layer_payload,
    stored_track_name,
)
from moqt.errors import KeyValueFormattingError
from moqt.messages_params import ExtensionType
from moqt.objects import immutable_extensions
from moqt.wire import Location, encode_kvps

COMPAT = CompatId(bytes(range(32)))
SCOPE = ScopeId(bytes(range(100, 116)))
KEY = BlockKey(bytes(range(200, 232)))
GEOMETRY = Geometry(layers=4, kv_heads=1, head_dim=2, element_size=2)  # 4 octets per token


def test_namespace_round_trips() -> None:
    fields = kv_namespace(COMPAT, SCOPE, KEY)
    assert fields[:4] == kv_scope_prefix(COMPAT, SCOPE)
    assert fields == (
        b"kvsp",
        b"1",
        COMPAT.hex().encode(),
        SCOPE.hex().encode(),
        KEY.hex().encode(),
    )
    assert parse_kv_namespace(fields) == (COMPAT, SCOPE, KEY)
    assert decode_moqt_namespace(encode_moqt_namespace(fields)) == fields


@pytest.mark.parametrize(
    "fields",
    [
        (b"kvsp", b"1", b"c"),
        (b"kvsp", b"2", COMPAT.hex().encode(), SCOPE.hex().encode(), KEY.hex().encode()),
        (b"KVSP", b"1", COMPAT.hex().encode(), SCOPE.hex().encode(), KEY.hex().encode()),
        (b"kvsp", b"1", COMPAT.hex().upper().encode(), SCOPE.hex().encode(), KEY.hex().encode()),
        (b"kvsp", b"1", COMPAT.hex().encode(), KEY.hex().encode(), KEY.hex().encode()),
        (b"kvsp", b"1", COMPAT.hex().encode(), SCOPE.hex().encode(), KEY.hex().encode() + b"0"),
        (b"kvsp", b"1", COMPAT.hex().encode(), SCOPE.hex().encode(), KEY.hex().encode(), b"x"),
    ],
)
def test_parse_is_strict(fields: tuple[bytes, ...]) -> None:
    with pytest.raises(InvalidIdentifier):
        parse_kv_namespace(fields)
    assert not is_kv_namespace(fields)


@given(st.lists(st.binary(max_size=70), max_size=7))
def test_garbage_namespaces_parse_or_raise_invalid_identifier(fields: list[bytes]) -> None:
    try:
        compat, scope, key = parse_kv_namespace(fields)
    except InvalidIdentifier:
        return
    assert kv_namespace(compat, scope, key) == tuple(fields)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (kv_namespace(COMPAT, SCOPE, KEY), Scoped(SCOPE)),
        (kv_scope_prefix(COMPAT, SCOPE), Scoped(SCOPE)),
        ((*kv_namespace(COMPAT, SCOPE, KEY), b"x"), Scoped(SCOPE)),  # the prefix decides
        ((b"kvsp", b"1", "é".encode() * 32, SCOPE.hex().encode()), Broad()),
        ((b"kvsp", b"1", COMPAT.hex().encode()), Broad()),
        ((b"kvsp",), Broad()),
        ((b"kvs", b"1"), Plain()),
        ((), Plain()),
    ],
)
def test_classify(fields: tuple[bytes, ...], expected: object) -> None:
    assert classify(fields) == expected


def test_wrong_identifier_lengths_are_refused() -> None:
    with pytest.raises(InvalidIdentifier):
        kv_namespace(COMPAT, KEY, KEY)
    with pytest.raises(InvalidIdentifier):
        stored_track_name(b"\x00" * 31)


def test_track_names() -> None:
    digest = hashlib.sha256(b"replica").digest()
    name = stored_track_name(digest)
    assert name == digest.hex().encode() and parse_stored_track_name(name) == digest
    live = live_track_name("http://a.example/kvsp/")
    assert live == b"live-" + uri_id("http://a.example/kvsp/").encode()
    assert is_live_track_name(live) and parse_stored_track_name(live) is None
    assert not is_live_track_name(name) and parse_stored_track_name(name.upper()) is None


@pytest.mark.parametrize(
    ("start", "end", "expected"),
    [
        (Location(0, 3), Location(0, 8), (3, 7)),
        (Location(0, 0), Location(0, 0), (0, 31)),  # End Object 0: the whole group
        (Location(0, 30), Location(1, 0), (30, 31)),
        (Location(0, 30), Location(0, 99), (30, 31)),
        (Location(0, 5), Location(0, 5), None),
        (Location(0, 32), Location(1, 0), None),
        (Location(1, 0), Location(2, 0), None),
    ],
)
def test_fetch_ranges(start: Location, end: Location, expected: tuple[int, int] | None) -> None:
    assert fetch_layer_range(start, end, 32) == expected


def test_layer_range_locations_round_trip() -> None:
    start, end = layer_range_locations(3, 7)
    assert (start, end) == (Location(0, 3), Location(0, 8))
    assert fetch_layer_range(start, end, 32) == (3, 7)
    with pytest.raises(ValueError):
        layer_range_locations(4, 3)


def test_layer_digest_extension() -> None:
    digest = hashlib.sha256(b"layer").digest()
    ext = layer_digest_extension(digest, others=[(0x4B56, 3)])
    assert ext[0] == ExtensionType.IMMUTABLE_EXTENSIONS
    assert LAYER_DIGEST_TYPE % 2 == 1 and LAYER_DIGEST_TYPE >= 16384
    assert immutable_extensions([(2, 1), ext]) == ((0x4B56, 3), (LAYER_DIGEST_TYPE, digest))
    assert find_layer_digest([ext, (0x3D, b"z")]) == digest
    assert find_layer_digest([(0x3D, b"z")]) is None
    with pytest.raises(ValueError):
        layer_digest_extension(b"short")
    bad = (0x0B, encode_kvps([(LAYER_DIGEST_TYPE, b"x" * 31)]))
    with pytest.raises(KeyValueFormattingError):
        find_layer_digest([bad])


def layers(tokens: int) -> list[tuple[bytes, bytes]]:
    size = GEOMETRY.section_length(tokens)
    return [(bytes([i]) * size, bytes([0x80 | i]) * size) for i in range(GEOMETRY.layers)]


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_assembler_rebuilds_layers_fed_in_pieces(piece: int) -> None:
    source = layers(3)
    assembler = LayerAssembler(GEOMETRY, 1, 3)
    for index in (3, 1, 2):  # any order: each layer has its place
        payload = memoryview(source[index][0] + source[index][1])
        assembler.begin(0, index, len(payload))
        for offset in range(0, len(payload), piece):
            assembler.feed(payload[offset : offset + piece])
        layer, digest = assembler.end()
        assert layer.index == index and digest == hashlib.sha256(payload).digest()
        assert split_layer_payload(payload) == (layer.k, layer.v)
    assert assembler.complete and assembler.token_count == 3
    got = [(bytes(layer.k), bytes(layer.v)) for layer in assembler.layers()]
    assert got == source[1:]
    expected = encode_container(source[1:], first_layer=1, token_count=3, geometry=GEOMETRY)
    rebuilt = encode_container(got, first_layer=1, token_count=assembler.token_count)
    assert rebuilt == expected


class Sink:
    def __init__(self) -> None:
        self.memory: dict[int, tuple[bytearray, bytearray]] = {}

    def layer_buffer(self, index: int, k_len: int, v_len: int) -> tuple[memoryview, memoryview]:
        k, v = self.memory[index] = (bytearray(k_len), bytearray(v_len))
        return memoryview(k), memoryview(v)


def test_assembler_writes_into_a_sink() -> None:
    source = layers(2)
    sink = Sink()
    assembler = LayerAssembler(GEOMETRY, 0, 0, token_count=2, sink=sink)
    assembler.begin(0, 0, 2 * GEOMETRY.section_length(2))
    assembler.feed(memoryview(source[0][0] + source[0][1]))
    assembler.end()
    assert sink.memory[0] == (bytearray(source[0][0]), bytearray(source[0][1]))


@pytest.mark.parametrize(
    ("group", "obj", "length", "message"),
    [
        (1, 0, 16, "not a layer"),
        (0, 3, 16, "not a layer"),
        (0, 0, 15, "not K and V"),
        (0, 0, 18, "whole tokens"),
        (0, 0, 0, "whole tokens"),
    ],
)
def test_assembler_refuses_objects_that_are_not_layers(
    group: int, obj: int, length: int, message: str
) -> None:
    with pytest.raises(ContainerError, match=message):
        LayerAssembler(GEOMETRY, 0, 2).begin(group, obj, length)


def test_assembler_checks_lengths_and_repeats() -> None:
    assembler = LayerAssembler(GEOMETRY, 0, 1, token_count=2)
    with pytest.raises(ContainerError, match="need 16"):
        assembler.begin(0, 0, 24)
    assembler.begin(0, 0, 16)
    with pytest.raises(ContainerError, match="more payload"):
        assembler.feed(memoryview(bytes(17)))
    assembler.feed(memoryview(bytes(16)))
    assembler.end()
    with pytest.raises(ContainerError, match="twice"):
        assembler.begin(0, 0, 16)
    assembler.begin(0, 1, 16)
    with pytest.raises(ContainerError, match="before its payload"):
        assembler.end()
