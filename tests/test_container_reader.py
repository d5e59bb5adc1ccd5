"""Incremental KVB1 parsing (spec §4.3, §6.7; STYLE.md rule 2): kvsp/container_reader.py."""

from __future__ import annotations

import hashlib
import struct
import tracemalloc
from collections.abc import Iterable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsp.container import (
    Container,
    ContainerTooLarge,
    Geometry,
    Layer,
    decode_container,
    encode_container,
    header_size,
    layer_digest,
    replica_digest,
)
from kvsp.container_reader import ContainerReader
from kvsp.errors import ContainerError, DigestMismatch, Incompatible, KVSPError

SMALL = Geometry(layers=4, kv_heads=2, head_dim=4, element_size=2)  # 16 octets per token


def make_block(
    geometry: Geometry = SMALL, token_count: int = 2, first: int = 0, count: int | None = None
) -> tuple[bytes, list[bytes]]:
    """A container and the full record's layer digests (all ``geometry.layers`` layers)."""
    rng = np.random.default_rng(first * 100 + token_count)
    n = geometry.section_length(token_count)
    pairs = [(rng.bytes(n), rng.bytes(n)) for _ in range(geometry.layers)]
    count = geometry.layers - first if count is None else count
    data = encode_container(
        pairs[first : first + count], first_layer=first, token_count=token_count
    )
    return data, [layer_digest(k, v) for k, v in pairs]


def feed_all(reader: ContainerReader, chunks: Iterable[bytes | memoryview]) -> list[Layer]:
    out: list[Layer] = []
    for chunk in chunks:
        out.extend(reader.feed(chunk))
    reader.close()
    return out


def bytewise(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


def as_pairs(layers: Iterable[Layer]) -> list[tuple[int, bytes, bytes]]:
    return [(layer.index, bytes(layer.k), bytes(layer.v)) for layer in layers]


def expected_pairs(data: bytes) -> list[tuple[int, bytes, bytes]]:
    return as_pairs(decode_container(data).layers)


# -- parsing ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["whole", "bytes", "bytearray-3", "memoryview-7"])
def test_reader_matches_decode(mode: str) -> None:
    data, digests = make_block(first=1)
    chunks: list[bytes | memoryview]
    if mode == "whole":
        chunks = [data]
    elif mode == "bytes":
        chunks = list(bytewise(data))
    elif mode == "bytearray-3":
        chunks = [bytes(bytearray(data[i : i + 3])) for i in range(0, len(data), 3)]
    else:
        chunks = [memoryview(data)[i : i + 7] for i in range(0, len(data), 7)]
    reader = ContainerReader(SMALL, layer_digests=digests)
    assert as_pairs(feed_all(reader, chunks)) == expected_pairs(data)
    assert reader.done and reader.bytes_fed == len(data)
    assert reader.header == decode_container(data).header
    assert reader.digests == digests[1:]
    assert reader.container_digest() == hashlib.sha256(data).digest()


def test_each_layer_arrives_with_its_last_octet() -> None:
    data, _ = make_block(token_count=1, first=1)
    header = decode_container(data).header
    ends, pos = [], header.size
    for k_len, v_len in header.lengths:
        pos += k_len + v_len
        ends.append(pos - 1)
    reader = ContainerReader(SMALL)
    seen = []
    for i, chunk in enumerate(bytewise(data)):
        layers = reader.feed(chunk)
        assert (reader.header is None) == (i < header.size - 1)
        seen.extend((i, layer.index) for layer in layers)
    assert seen == list(zip(ends, [1, 2, 3], strict=True))
    reader.close()


def test_a_layer_inside_one_bytes_chunk_is_not_copied() -> None:
    data, _ = make_block()
    layers = feed_all(ContainerReader(SMALL), [data])
    assert all(layer.k.obj is data and layer.v.obj is data for layer in layers)
    buf = bytearray(data)  # mutable: the caller may reuse it, so the reader copies
    layers = feed_all(ContainerReader(SMALL), [buf])
    assert all(layer.k.obj is not buf for layer in layers)
    assert as_pairs(layers) == expected_pairs(data)


def test_a_section_inside_one_bytes_chunk_is_not_copied() -> None:
    data, _ = make_block()
    n = SMALL.section_length(2)
    cut = header_size(4) + n + n // 2  # inside layer 0's V
    first, second = data[:cut], data[cut:]
    layers = feed_all(ContainerReader(SMALL), [first, second])
    assert layers[0].k.obj is first  # K lay inside the first chunk
    assert layers[0].v.obj is not first and layers[0].v.obj is not second  # V was assembled
    assert all(layer.k.obj is second and layer.v.obj is second for layer in layers[1:])
    assert as_pairs(layers) == expected_pairs(data)


def test_staging_holds_at_most_one_layer() -> None:
    geometry = Geometry(layers=32, kv_heads=8, head_dim=128, element_size=2)
    data, digests = make_block(geometry, token_count=16)
    chunks = [data[i : i + 65536] for i in range(0, len(data), 65536)]
    reader = ContainerReader(geometry, layer_digests=digests)
    tracemalloc.start()
    try:
        for chunk in chunks:
            reader.feed(chunk)  # layers are dropped at once: only staging stays
        reader.close()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * 2 * geometry.section_length(16)


# -- sinks ------------------------------------------------------------------------------------


class ArraySink:
    """A paged buffer [layers, 2, bytes] standing in for a device cache page."""

    def __init__(self, layers: int, section: int) -> None:
        self.pages = np.zeros((layers, 2, section), np.uint8)
        self.calls: list[tuple[int, int, int]] = []

    def layer_buffer(self, index: int, k_len: int, v_len: int) -> tuple[memoryview, memoryview]:
        self.calls.append((index, k_len, v_len))
        return memoryview(self.pages[index, 0]), memoryview(self.pages[index, 1])


@pytest.mark.parametrize("chunk", [1, 5, 10_000])
def test_sink_receives_the_octets(chunk: int) -> None:
    data, digests = make_block(first=1)
    n = SMALL.section_length(2)
    sink = ArraySink(SMALL.layers, n)
    reader = ContainerReader(SMALL, sink=sink, layer_digests=digests)
    layers = feed_all(reader, [data[i : i + chunk] for i in range(0, len(data), chunk)])
    assert sink.calls == [(i, n, n) for i in (1, 2, 3)]
    assert as_pairs(layers) == expected_pairs(data)
    for layer in layers:
        for side, view in enumerate((layer.k, layer.v)):  # sink memory, not reader staging
            page = sink.pages[layer.index, side]
            assert np.frombuffer(view, np.uint8).ctypes.data == page.ctypes.data
            assert page.tobytes() == bytes(view)
    assert not sink.pages[0].any()


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(0, 300), max_size=12), first=st.integers(0, 3))
def test_sink_with_random_chunking(cuts: list[int], first: int) -> None:
    data, digests = make_block(token_count=1, first=first)
    sink = ArraySink(SMALL.layers, SMALL.section_length(1))
    reader = ContainerReader(SMALL, sink=sink, layer_digests=digests)
    assert as_pairs(feed_all(reader, split(data, cuts))) == expected_pairs(data)
    assert [index for index, _, _ in sink.calls] == list(range(first, 4))


def test_sink_with_wrong_buffers_is_a_programming_error() -> None:
    class Short:
        def layer_buffer(self, index: int, k: int, v: int) -> tuple[memoryview, memoryview]:
            return memoryview(bytearray(k)), memoryview(bytearray(v - 1))

    with pytest.raises(ValueError, match="sink gave layer 0 buffers of 32 and 31 octets"):
        ContainerReader(SMALL, sink=Short()).feed(make_block()[0])


# -- verification -----------------------------------------------------------------------------


def test_flipped_byte_raises_on_the_layer_that_holds_it() -> None:
    data, digests = make_block()
    bad = bytearray(data)
    n = SMALL.section_length(2)
    bad[header_size(4) + 2 * 2 * n + n + 3] ^= 0x80  # layer 2's V
    reader = ContainerReader(SMALL, layer_digests=digests, digest=replica_digest(digests))
    got: list[int] = []
    with pytest.raises(DigestMismatch, match="^layer 2: digest [0-9a-f]{64} differs"):
        for chunk in bytewise(bytes(bad)):
            got.extend(layer.index for layer in reader.feed(chunk))
    assert got == [0, 1]
    with pytest.raises(ContainerError, match="failed on earlier input"):
        reader.feed(b"")
    with pytest.raises(ContainerError, match="failed on earlier input"):
        reader.close()


def test_sub_range_against_the_full_list() -> None:
    data, digests = make_block(first=2)
    reader = ContainerReader(SMALL, layer_digests=digests, digest=replica_digest(digests))
    assert [layer.index for layer in feed_all(reader, [data])] == [2, 3]
    with pytest.raises(DigestMismatch, match="does not hash to the replica digest"):
        ContainerReader(layer_digests=[*digests[:3], bytes(32)], digest=replica_digest(digests))
    with pytest.raises(Incompatible, match="holds layers 2..3 but the replica record lists 3"):
        ContainerReader(layer_digests=digests[:3]).feed(data)
    with pytest.raises(ValueError, match="needs the layer_digests"):
        ContainerReader(digest=replica_digest(digests))


def test_compute_digests_without_a_record() -> None:
    data, digests = make_block()
    reader = ContainerReader(compute_digests=True, hash_container=False)
    feed_all(reader, [data])
    assert reader.digests == digests
    assert replica_digest(reader.digests) == decode_container(data).digest()
    with pytest.raises(ValueError, match="hash_container=False"):
        reader.container_digest()
    plain = ContainerReader()
    feed_all(plain, [data])
    assert plain.digests == []


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("cut", range(len(make_block(token_count=1)[0])))
def test_close_reports_truncation_at_every_cut(cut: int) -> None:
    data, _ = make_block(token_count=1)
    reader = ContainerReader(SMALL)
    for chunk in bytewise(data[:cut]):
        reader.feed(chunk)
    what = "header" if cut < header_size(4) else "data"
    with pytest.raises(ContainerError, match=f"truncated {what}"):
        reader.close()
    with pytest.raises(ContainerError, match="before the container was complete"):
        reader.container_digest()


def test_trailing_bytes_and_feeding_after_close() -> None:
    data, _ = make_block()
    with pytest.raises(ContainerError, match="trailing bytes: 1 after the last layer"):
        ContainerReader().feed(data + b"\x00")
    reader = ContainerReader()
    feed_all(reader, [data])
    reader.feed(b"")
    with pytest.raises(ContainerError, match="trailing bytes: 2"):
        reader.feed(b"ab")


FLAGS_1 = struct.pack("!IBBHIII", 0x4B564231, 1, 1, 1, 0, 1, 1)


@pytest.mark.parametrize(
    ("data", "fails_at", "message"),
    [
        (b"X" + bytes(40), 0, "bad magic"),
        (b"KVB2" + bytes(40), 3, "bad magic"),
        (b"KVB1\x02" + bytes(40), 19, "unsupported version 2"),
        (FLAGS_1 + bytes(40), 19, "reserved flags must be zero"),
    ],
)
def test_bad_input_is_rejected_as_soon_as_it_shows(
    data: bytes, fails_at: int, message: str
) -> None:
    reader = ContainerReader(SMALL)
    for i, octet in enumerate(bytewise(data)):
        if i == fails_at:
            with pytest.raises(ContainerError, match=message):
                reader.feed(octet)
            return
        assert reader.feed(octet) == []


def test_huge_declared_lengths_allocate_nothing() -> None:
    header = struct.pack("!IBBHIIIQQ", 0x4B564231, 1, 0, 1, 0, 1, 1, 2**63, 2**63)
    tracemalloc.start()
    try:
        reader = ContainerReader()
        with pytest.raises(ContainerTooLarge, match="exceeds the limit"):
            for chunk in bytewise(header + bytes(64)):
                reader.feed(chunk)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024


# -- properties -------------------------------------------------------------------------------


def outcome(data: bytes, chunks: list[bytes]) -> list[tuple[int, bytes, bytes]] | str:
    try:
        return as_pairs(feed_all(ContainerReader(), chunks))
    except KVSPError as exc:
        return type(exc).__name__


def decoded(data: bytes) -> list[tuple[int, bytes, bytes]] | None:
    try:
        container: Container = decode_container(data)
    except KVSPError:
        return None
    return as_pairs(container.layers)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in zip(points, points[1:], strict=False)]


@settings(max_examples=150, deadline=None)
@given(blob=st.binary(max_size=160), cuts=st.lists(st.integers(0, 400), max_size=8))
def test_arbitrary_bytes_parse_or_raise_like_decode(blob: bytes, cuts: list[int]) -> None:
    for data in (blob, b"KVB1\x01\x00\x00\x01" + blob):
        want = decoded(data)
        for chunks in ([data], bytewise(data), split(data, cuts)):
            got = outcome(data, chunks)
            assert got == want if want is not None else isinstance(got, str)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_mutated_and_chunked_containers(data: st.DataObject) -> None:
    blob = bytearray(make_block(token_count=1)[0])
    for _ in range(data.draw(st.integers(0, 3))):
        blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    whole = (bytes(blob) + b"\x07")[: data.draw(st.integers(0, len(blob) + 1))]
    cuts = data.draw(st.lists(st.integers(0, len(whole)), max_size=10))
    want = decoded(whole)
    got = outcome(whole, split(whole, cuts))
    assert got == want if want is not None else isinstance(got, str)
