"""KVB1 containers and their digests (spec §4.3, §6.7 verification): kvsp/container.py."""

from __future__ import annotations

import contextlib
import hashlib
import struct
import tracemalloc
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsp.container import (
    DEFAULT_LIMITS,
    Container,
    ContainerLimits,
    ContainerTooLarge,
    Geometry,
    decode_container,
    encode_container,
    encode_container_parts,
    header_size,
    layer_digest,
    replica_digest,
    verify_container,
    verify_layers,
)
from kvsp.errors import (
    ContainerError,
    DescriptorError,
    DigestMismatch,
    Incompatible,
    InvalidIdentifier,
    KVSPError,
    LayersUnavailable,
    PayloadTooLarge,
)

SHA256_EMPTY = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
SHA256_ABC = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


@dataclass(frozen=True)
class Descriptor:
    """Stands in for kvsp.compat.CompatibilityDescriptor: the members Geometry reads."""

    layers: int
    kv_heads: int
    head_dim: int
    kv_dtype: str


def make_layers(
    geometry: Geometry, token_count: int, count: int, seed: int = 0
) -> list[tuple[bytes, bytes]]:
    rng = np.random.default_rng(seed)
    n = geometry.section_length(token_count)
    return [(rng.bytes(n), rng.bytes(n)) for _ in range(count)]


def make_block(
    geometry: Geometry, token_count: int = 2, first: int = 0, count: int | None = None
) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    count = geometry.layers - first if count is None else count
    layers = make_layers(geometry, token_count, count)
    data = encode_container(layers, first_layer=first, token_count=token_count, geometry=geometry)
    return data, layers


SMALL = Geometry(layers=4, kv_heads=2, head_dim=4, element_size=2)  # 16-octet sections/token


def fixed_header(
    *,
    magic: int = 0x4B564231,
    version: int = 1,
    flags: int = 0,
    codec: int = 1,
    first: int = 0,
    count: int = 1,
    tokens: int = 1,
) -> bytes:
    return struct.pack("!IBBHIII", magic, version, flags, codec, first, count, tokens)


# -- known answers -------------------------------------------------------------------------------


def test_header_vector_is_byte_exact() -> None:
    geometry = Geometry(layers=4, kv_heads=1, head_dim=2, element_size=2)  # 4-octet sections
    expected = bytes.fromhex(
        "4b564231"  # magic "KVB1"
        "01"  # version 1
        "00"  # flags
        "0001"  # codec raw
        "00000002"  # first layer 2
        "00000002"  # layer count 2
        "00000001"  # token count 1
        "0000000000000004"
        "0000000000000004"  # layer 2: K, V lengths
        "0000000000000004"
        "0000000000000004"  # layer 3: K, V lengths
        "00010203"
        "04050607"  # layer 2 K, V
        "08090a0b"
        "0c0d0e0f"  # layer 3 K, V
    )
    layers = [
        (b"\x00\x01\x02\x03", b"\x04\x05\x06\x07"),
        (b"\x08\x09\x0a\x0b", b"\x0c\x0d\x0e\x0f"),
    ]
    assert encode_container(layers, first_layer=2, token_count=1, geometry=geometry) == expected
    c = decode_container(expected, geometry)
    assert (c.version, c.flags, c.codec) == (1, 0, 1)
    assert (c.first_layer, c.layer_count, c.token_count) == (2, 2, 1)
    assert [layer.index for layer in c.layers] == [2, 3]
    assert bytes(c.layers[1].v) == b"\x0c\x0d\x0e\x0f"
    assert c.header_bytes == expected[:52]
    assert header_size(2) == 52
    assert c.header.total_length == len(expected)


def test_digest_known_answers() -> None:
    assert layer_digest(b"", b"").hex() == SHA256_EMPTY
    assert layer_digest(b"abc", b"").hex() == SHA256_ABC
    assert layer_digest(b"a", b"bc").hex() == SHA256_ABC  # K then V, no separator
    assert layer_digest(memoryview(b"ab"), bytearray(b"c")).hex() == SHA256_ABC
    assert replica_digest([]).hex() == SHA256_EMPTY
    d0, d1 = bytes(range(32)), bytes(range(32, 64))
    assert replica_digest([d0, d1]) == hashlib.sha256(bytes(range(64))).digest()


def test_replica_digest_rejects_short_entries() -> None:
    with pytest.raises(InvalidIdentifier, match="layer digest 1 has 31 octets"):
        replica_digest([bytes(32), bytes(31)])


# -- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kv_dtype", "numpy_dtype"),
    [("fp32", "<f4"), ("fp16", "<f2"), ("bf16", "<u2"), ("int8", "i1"), ("fp8_e4m3", "u1")],
)
@pytest.mark.parametrize(("first", "count"), [(0, 6), (2, 3), (5, 1)])
def test_round_trip_dtypes_and_ranges(
    kv_dtype: str, numpy_dtype: str, first: int, count: int
) -> None:
    geometry = Geometry.from_descriptor(Descriptor(6, 2, 8, kv_dtype))
    tokens = 3
    shape = (tokens, geometry.kv_heads, geometry.head_dim)  # kvsp-layout-1: token slowest
    arrays = [
        (
            np.arange(np.prod(shape), dtype=numpy_dtype).reshape(shape) + i,
            np.full(shape, 7 - i, dtype=numpy_dtype),
        )
        for i in range(count)
    ]
    data = encode_container(
        [(memoryview(k), memoryview(v)) for k, v in arrays],  # typed views, not bytes
        first_layer=first,
        token_count=tokens,
        geometry=geometry,
    )
    assert len(data) == header_size(count) + count * 2 * geometry.section_length(tokens)
    c = decode_container(data, geometry)
    assert (c.first_layer, c.layer_count, c.token_count) == (first, count, tokens)
    for (k, v), layer, i in zip(arrays, c.layers, range(first, first + count), strict=True):
        assert layer.index == i
        np.testing.assert_array_equal(np.frombuffer(layer.k, numpy_dtype).reshape(shape), k)
        np.testing.assert_array_equal(np.frombuffer(layer.v, numpy_dtype).reshape(shape), v)
        assert layer.digest() == layer_digest(k.tobytes(), v.tobytes())
    assert c.encode() == data


def test_round_trip_without_geometry() -> None:
    data, layers = make_block(SMALL, token_count=3, first=1)
    c = decode_container(data)
    assert [(bytes(layer.k), bytes(layer.v)) for layer in c.layers] == layers


@settings(max_examples=60, deadline=None)
@given(
    kv_heads=st.integers(1, 3),
    head_dim=st.integers(1, 5),
    dtype=st.sampled_from(["fp32", "fp16", "bf16", "int8", "fp8_e5m2"]),
    layers=st.integers(1, 6),
    data=st.data(),
)
def test_round_trip_property(
    kv_heads: int, head_dim: int, dtype: str, layers: int, data: st.DataObject
) -> None:
    geometry = Geometry.from_descriptor(Descriptor(layers, kv_heads, head_dim, dtype))
    first = data.draw(st.integers(0, layers - 1))
    count = data.draw(st.integers(1, layers - first))
    tokens = data.draw(st.integers(1, 4))
    n = geometry.section_length(tokens)
    pairs = [(data.draw(st.binary(min_size=n, max_size=n)),) * 2 for _ in range(count)]
    blob = encode_container(pairs, first_layer=first, token_count=tokens, geometry=geometry)
    for g in (geometry, None):
        c = decode_container(blob, g)
        assert [(bytes(layer.k), bytes(layer.v)) for layer in c.layers] == pairs
        assert c.layer_digests() == [layer_digest(k, v) for k, v in pairs]


# -- zero copy -----------------------------------------------------------------------------------


def test_decoded_layers_are_views_of_the_input() -> None:
    data, _ = make_block(SMALL)
    c = decode_container(data, SMALL)
    assert all(layer.k.obj is data and layer.v.obj is data for layer in c.layers)

    buf = bytearray(data)
    c = decode_container(buf, SMALL)
    base = np.frombuffer(buf, np.uint8).ctypes.data
    offset = header_size(SMALL.layers)
    n = SMALL.section_length(2)
    for i, layer in enumerate(c.layers):
        assert np.frombuffer(layer.k, np.uint8).ctypes.data == base + offset + 2 * i * n
        assert np.frombuffer(layer.v, np.uint8).ctypes.data == base + offset + (2 * i + 1) * n
    buf[offset] ^= 0xFF  # a write to the input shows through the view
    assert c.layers[0].k[0] == data[offset] ^ 0xFF


# -- strict decoding -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b"KVB2" + b[4:], "bad magic"),
        (lambda b: b[:4] + b"\x02" + b[5:], "unsupported version 2"),
        (lambda b: b[:5] + b"\x01" + b[6:], "reserved flags must be zero, got 0x01"),
        (lambda b: b[:6] + b"\x00\x02" + b[8:], "unknown codec 0x0002"),
        (lambda b: b + b"\x00", "trailing bytes: 1 after the last layer"),
        (lambda b: b[:-1], "truncated data"),
        (lambda b: b[: header_size(4)], "truncated data"),
    ],
    ids=["magic", "version", "flags", "codec", "trailing", "short-data", "no-data"],
)
def test_invalid_containers(mutate: object, message: str) -> None:
    data, _ = make_block(SMALL)
    bad = mutate(data)  # type: ignore[operator]
    for geometry in (SMALL, None):
        with pytest.raises(ContainerError, match=message):
            decode_container(bad, geometry)


@pytest.mark.parametrize("cut", range(header_size(SMALL.layers)))
def test_truncated_at_every_header_cut(cut: int) -> None:
    data, _ = make_block(SMALL)
    with pytest.raises(ContainerError, match="truncated header"):
        decode_container(data[:cut], SMALL)


def test_geometry_mismatches() -> None:
    data, _ = make_block(SMALL, token_count=2)
    other = Geometry(layers=4, kv_heads=2, head_dim=4, element_size=1)
    with pytest.raises(ContainerError, match=r"layer 0: K length 32 differs from 16 \(2 tokens"):
        decode_container(data, other)
    with pytest.raises(ContainerError, match="layers 0..3 exceed the descriptor's 3 layers"):
        decode_container(data, Geometry(3, 2, 4, 2))
    sub, _ = make_block(SMALL, first=3, count=1)
    with pytest.raises(ContainerError, match="layers 3..3 exceed the descriptor's 3 layers"):
        decode_container(sub, Geometry(3, 2, 4, 2))


@pytest.mark.parametrize(
    ("header", "lengths", "message"),
    [
        (fixed_header(count=0), [], "layer count is zero"),
        (fixed_header(tokens=0), [(4, 4)], "token count is zero"),
        (fixed_header(), [(4, 5)], r"layer 0: V length 5 differs from 4"),
        (fixed_header(count=2), [(4, 4), (8, 8)], r"layer 1: K length 8 differs from 4"),
        (fixed_header(tokens=3), [(4, 4)], "not a positive multiple of token count 3"),
        (fixed_header(), [(0, 0)], "not a positive multiple"),
        (fixed_header(first=0xFFFFFFFF, count=2), [(4, 4)] * 2, "exceed uint32"),
    ],
)
def test_raw_rules_without_geometry(
    header: bytes, lengths: list[tuple[int, int]], message: str
) -> None:
    body = b"".join(struct.pack("!QQ", k, v) for k, v in lengths)
    data = header + body + bytes(sum(k + v for k, v in lengths))
    with pytest.raises(ContainerError, match=message):
        decode_container(data)


def test_huge_declared_lengths_allocate_nothing() -> None:
    data = fixed_header() + struct.pack("!QQ", 2**63, 2**63) + b"\x00" * 64
    tracemalloc.start()
    try:
        with pytest.raises(ContainerTooLarge, match="exceeds the limit of 1073741824"):
            decode_container(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024
    with pytest.raises(ContainerError, match="K length 9223372036854775808 differs from 16"):
        decode_container(data, Geometry(1, 2, 4, 2))


def test_limits() -> None:
    many = fixed_header(count=5000)
    with pytest.raises(ContainerTooLarge, match="layer count 5000 exceeds the limit 4096"):
        decode_container(many)
    data, _ = make_block(SMALL)
    tight = ContainerLimits(max_layer_count=4, max_total_bytes=len(data) - 1)
    with pytest.raises(ContainerTooLarge, match="layer 3: declared size exceeds"):
        decode_container(data, limits=tight)
    assert decode_container(data, limits=ContainerLimits(4, len(data))).layer_count == 4
    err = ContainerTooLarge("x")
    assert isinstance(err, ContainerError) and isinstance(err, PayloadTooLarge)
    assert err.status == 413
    assert ContainerLimits(4096, 1 << 30) == DEFAULT_LIMITS


def test_decode_rejects_non_contiguous_buffers() -> None:
    strided = np.zeros(64, np.uint8)[::2]
    with pytest.raises(ContainerError, match="not a contiguous"):
        decode_container(strided)  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_parse_or_raise_container_errors(blob: bytes) -> None:
    for data in (blob, b"KVB1\x01\x00\x00\x01" + blob):
        with contextlib.suppress(KVSPError):
            decode_container(data)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_mutated_containers_parse_or_raise_container_errors(data: st.DataObject) -> None:
    blob = bytearray(make_block(SMALL, token_count=1)[0])
    for _ in range(data.draw(st.integers(1, 4))):
        blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(blob) + 2))
    for geometry in (SMALL, None):
        try:
            c = decode_container(bytes(blob[:cut]) + b"\x00" * max(0, cut - len(blob)), geometry)
        except KVSPError:
            continue
        assert c.header.total_length == cut


# -- encoding ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"first_layer": -1}, "first layer must be an integer"),
        ({"first_layer": 2**32}, "first layer must be an integer"),
        ({"token_count": 2**32}, "token count must be an integer"),
        ({"token_count": 0}, "token count is zero"),
        ({"codec": 2}, "unknown codec 0x0002"),
        ({"codec": 0x10000}, "codec must be an integer"),
        ({"layers": []}, "layer count is zero"),
        ({"layers": [(b"ab", b"ab")]}, "K length 2 differs from 16"),
        ({"first_layer": 3, "layers": [(bytes(16), bytes(16))] * 2}, "exceed the descriptor"),
        ({"layers": [(np.zeros(32, np.uint8)[::2], bytes(16))]}, "layer 0 K is not a contig"),
    ],
)
def test_encode_validates(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {
        "layers": [(bytes(16), bytes(16))],
        "first_layer": 0,
        "token_count": 1,
        "geometry": SMALL,
    }
    args.update(kwargs)
    layers = args.pop("layers")
    with pytest.raises(ContainerError, match=message):
        encode_container(layers, **args)  # type: ignore[arg-type]


def test_encode_parts_are_uncopied_views() -> None:
    _, layers = make_block(SMALL, first=1)
    parts = encode_container_parts(layers, first_layer=1, token_count=2, geometry=SMALL)
    assert b"".join(parts) == encode_container(layers, first_layer=1, token_count=2)
    assert len(parts) == 1 + 2 * len(layers)
    flat = [part for pair in layers for part in pair]
    assert all(
        isinstance(p, memoryview) and p.obj is o for p, o in zip(parts[1:], flat, strict=True)
    )
    c = decode_container(b"".join(parts), SMALL)
    assert b"".join(c.encode_parts()) == c.encode()


def test_encode_without_geometry_keeps_the_raw_rules() -> None:
    with pytest.raises(ContainerError, match="V length 3 differs from 4"):
        encode_container([(b"abcd", b"abc")], first_layer=0, token_count=1)
    blob = encode_container([(b"abcd", b"efgh")], first_layer=9, token_count=2)
    assert decode_container(blob).layers[0].index == 9


# -- geometry ------------------------------------------------------------------------------------


def test_geometry() -> None:
    g = Geometry.from_descriptor(Descriptor(32, 8, 128, "bf16"))
    assert g == Geometry(32, 8, 128, 2)
    assert g.section_length(16) == 32 * 1024
    with pytest.raises(DescriptorError, match="unknown kv_dtype 'fp64'"):
        Geometry.from_descriptor(Descriptor(32, 8, 128, "fp64"))
    with pytest.raises(DescriptorError, match=r"\$\.kv_heads: expected an integer"):
        Geometry(32, 0, 128, 2)
    with pytest.raises(DescriptorError, match=r"\$\.layers"):
        Geometry(True, 1, 1, 1)


# -- verification (§6.7) -------------------------------------------------------------------------


def full_record(geometry: Geometry = SMALL) -> tuple[bytes, list[bytes], bytes]:
    data, layers = make_block(geometry)
    digests = [layer_digest(k, v) for k, v in layers]
    return data, digests, replica_digest(digests)


def test_verify_full_and_sub_range() -> None:
    data, digests, digest = full_record()
    full = decode_container(data, SMALL)
    assert full.layer_digests() == digests and full.digest() == digest
    verify_container(full, digests, digest)
    verify_layers(full, digests)
    sub = decode_container(full.select(1, 2).encode(), SMALL)
    assert (sub.first_layer, sub.layer_count) == (1, 2)
    verify_container(sub, digests, digest)  # the list vouches for the range
    verify_container(sub, digests, None)
    assert sub.digest() != digest  # not the replica digest: only two layers


def test_verify_detects_a_flipped_byte_and_names_the_layer() -> None:
    data, digests, digest = full_record()
    bad = bytearray(data)
    bad[header_size(4) + 2 * SMALL.section_length(2) * 2 + 5] ^= 1  # in layer 2's K
    c = decode_container(bad, SMALL)
    with pytest.raises(DigestMismatch, match="^layer 2: digest "):
        verify_container(c, digests, digest)
    with pytest.raises(DigestMismatch, match="^layer 2: digest "):
        verify_layers(c.select(2, 3), digests)
    verify_layers(c.select(0, 1), digests)


def test_verify_checks_the_list_against_the_replica_digest() -> None:
    data, digests, digest = full_record()
    sub = decode_container(data, SMALL).select(0, 1)
    forged = [*digests[:3], bytes(32)]  # a layer outside the range changed
    with pytest.raises(DigestMismatch, match="does not hash to the replica digest"):
        verify_container(sub, forged, digest)
    with pytest.raises(Incompatible, match="holds layers 0..3 but the replica record lists 3"):
        verify_layers(decode_container(data, SMALL), digests[:3])


def test_select_outside_the_range() -> None:
    c: Container = decode_container(make_block(SMALL, first=1, count=2)[0], SMALL)
    for first, last in ((0, 1), (2, 3), (2, 1)):
        with pytest.raises(LayersUnavailable, match=f"layers {first}-{last} requested, 1-2 held"):
            c.select(first, last)


@pytest.mark.parametrize("count", [1, 2, 16, 33])
def test_the_header_lists_every_layers_lengths_in_the_figures_order(count: int) -> None:
    layers = [(bytes([i]) * 8, bytes([255 - i]) * 8) for i in range(count)]
    encoded = encode_container(layers, first_layer=7, token_count=4)
    fixed = struct.pack("!IBBHIII", 0x4B564231, 1, 0, 1, 7, count, 4)
    entries = b"".join(struct.pack("!QQ", len(k), len(v)) for k, v in layers)
    assert encoded == fixed + entries + b"".join(k + v for k, v in layers)


def test_encoding_takes_any_contiguous_sections_and_names_the_layer_of_one_that_is_not() -> None:
    k = np.arange(8, dtype=np.uint16)  # not octets: viewed as them
    v = memoryview(bytearray(range(16)))[:16]
    octets = k.tobytes()
    mixed = [(k, v), (octets, bytes(v)), (memoryview(octets), bytearray(v))]
    assert encode_container(mixed, first_layer=0, token_count=1) == encode_container(
        [(octets, bytes(v))] * 3, first_layer=0, token_count=1
    )
    strided = np.zeros(32, np.uint8)[::2]
    with pytest.raises(ContainerError, match="layer 5 V is not a contiguous"):
        encode_container([(octets, bytes(v)), (octets, strided)], first_layer=4, token_count=1)


def test_remembered_headers_never_let_a_bad_encoding_through() -> None:
    """The checked header of a shape is remembered: the same shape encodes byte-exactly again,
    a bool where an integer belongs is still refused after the integer's header was
    remembered, and lengths the codec forbids raise on every attempt."""
    k, v = bytes(range(8)), bytes(range(8, 16))
    first = encode_container([(k, v)], first_layer=1, token_count=2)
    assert encode_container([(k, v)], first_layer=1, token_count=2) == first
    assert decode_container(first).layers[0].k.tobytes() == k
    with pytest.raises(ContainerError):
        encode_container([(k, v)], first_layer=True, token_count=2)
    for _ in range(2):
        with pytest.raises(ContainerError, match="V length"):
            encode_container([(k, v[:6])], first_layer=1, token_count=2)
