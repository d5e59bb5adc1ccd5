"""moqt.objects: subgroup and fetch streams, datagrams, the KVSP digest extension (d16 §10, §11).

Every test runs twice: with object headers read by the native ``moqt._objscan`` (where it was
built) and with the Python reader alone (:func:`object_reader`).
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moqt.objects
from kvsp.moqt_mapping import find_layer_digest, layer_digest_extension
from moqt.errors import (
    KeyValueFormattingError,
    MalformedTrack,
    MOQTError,
    ObjectStatus,
    ProtocolViolation,
    SessionError,
    StreamResetCode,
)
from moqt.messages_params import ExtensionType
from moqt.objects import (
    DataStreamEvent,
    DataStreamParser,
    EndOfRange,
    FetchHeader,
    FetchStreamWriter,
    ObjectChunk,
    ObjectDatagram,
    ObjectEnd,
    ObjectStart,
    StreamFinished,
    SubgroupHeader,
    SubgroupIdMode,
    SubgroupWriter,
    encode_immutable_extensions,
    encode_object_header,
    encode_subgroup_header,
    immutable_extensions,
    is_datagram_type,
    is_subgroup_type,
)
from moqt.wire import VARINT_MAX, KeyValuePair, encode_kvps, encode_varint

# --- helpers -----------------------------------------------------------------------------------


@pytest.fixture(
    scope="module",
    autouse=True,
    params=[
        pytest.param(
            "native",
            marks=pytest.mark.skipif(not moqt.objects.NATIVE_HEADERS, reason="not built here"),
        ),
        "python",
    ],
)
def object_reader(request: pytest.FixtureRequest) -> Iterator[str]:
    """Who reads object headers: ``moqt._objscan`` with the Python reader behind it, or the
    Python reader alone."""
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "python":
            patch.setattr(moqt.objects, "_native", None)
        yield str(request.param)


def collect(events: Sequence[DataStreamEvent]) -> list[tuple[Any, ...]]:
    """Events folded into (kind, ...) tuples, each object's chunks joined, order checked."""
    out: list[tuple[Any, ...]] = []
    current: ObjectStart | None = None
    payload = bytearray()
    for event in events:
        if isinstance(event, ObjectStart):
            assert current is None
            current, payload = event, bytearray()
        elif isinstance(event, ObjectChunk):
            assert current is not None and event.offset == len(payload)
            payload += event.data
        elif isinstance(event, ObjectEnd):
            assert current is not None
            assert (event.group_id, event.object_id) == (current.group_id, current.object_id)
            assert len(payload) == current.payload_length
            out.append(("object", current, bytes(payload)))
            current = None
        else:
            assert current is None
            out.append(("event", event))
    if current is not None:
        out.append(("partial", current, bytes(payload)))
    return out


def feed_in(data: bytes, sizes: Sequence[int] | None = None, *, fin: bool = True) -> list[Any]:
    """Feed ``data`` in pieces of the given sizes (cycled), or whole; return collected events."""
    parser, events, pos = DataStreamParser(), [], 0
    if sizes is None:
        events += parser.feed(data)
    else:
        i = 0
        while pos < len(data):
            size = sizes[i % len(sizes)]
            events += parser.feed(data[pos : pos + size])
            pos += size
            i += 1
    if fin:
        events += parser.feed(b"", end_stream=True)
    return collect(events)


def random_sizes(rng: random.Random) -> list[int]:
    return [rng.choice([1, 1, 2, 3, 5, 17, 64, 300]) for _ in range(40)]


# --- SUBGROUP_HEADER (§10.4.2) -----------------------------------------------------------------

VALID_SUBGROUP_TYPES = [
    *range(0x10, 0x16),
    *range(0x18, 0x1E),
    *range(0x30, 0x36),
    *range(0x38, 0x3E),
]


def test_subgroup_type_table() -> None:
    assert [t for t in range(0x400) if is_subgroup_type(t)] == VALID_SUBGROUP_TYPES
    for reserved in (0x16, 0x17, 0x1E, 0x1F, 0x36, 0x37, 0x3E, 0x3F):
        assert not is_subgroup_type(reserved)


def _header_for_type(stream_type: int) -> SubgroupHeader:
    mode = SubgroupIdMode((stream_type & 0x06) >> 1)
    subgroup = {SubgroupIdMode.ZERO: 0, SubgroupIdMode.FIRST_OBJECT: None}.get(mode, 9)
    return SubgroupHeader(
        track_alias=7,
        group_id=300,
        subgroup_id_mode=mode,
        subgroup_id=subgroup,
        publisher_priority=None if stream_type & 0x20 else 5,
        has_extensions=bool(stream_type & 0x01),
        end_of_group=bool(stream_type & 0x08),
    )


@pytest.mark.parametrize("stream_type", VALID_SUBGROUP_TYPES, ids=hex)
def test_every_subgroup_header_type(stream_type: int) -> None:
    header = _header_for_type(stream_type)
    assert header.stream_type == stream_type
    data = encode_subgroup_header(header)
    assert data[0] == stream_type
    assert feed_in(data) == [("event", header), ("event", StreamFinished())]
    assert feed_in(data, [1]) == [("event", header), ("event", StreamFinished())]


@pytest.mark.parametrize("stream_type", [0x00, 0x04, 0x06, 0x0F, 0x16, 0x1F, 0x3E, 0x40, 0x50])
def test_invalid_stream_types(stream_type: int) -> None:
    with pytest.raises(ProtocolViolation) as info:
        DataStreamParser().feed(encode_varint(stream_type) + b"\x00" * 8)
    assert info.value.error_code == SessionError.PROTOCOL_VIOLATION


def test_moqt_md_subgroup_vector() -> None:
    """research/moqt.md: header ``15 07 00 00 00``, object 0 with a 0x3D extension, object 1."""
    wire = bytes.fromhex("1507000000" + "00063d04aaaaaaaa024b56" + "0000024b56")
    header = SubgroupHeader(
        track_alias=7,
        group_id=0,
        subgroup_id_mode=SubgroupIdMode.EXPLICIT,
        subgroup_id=0,
        publisher_priority=0,
        has_extensions=True,
    )
    writer = SubgroupWriter(header)
    built = (
        writer.header_bytes()
        + writer.object_header(0, 2, extensions=[(0x3D, b"\xaa" * 4)])
        + b"KV"
        + writer.object_header(1, 2)
        + b"KV"
    )
    assert built == wire
    start0 = ObjectStart(
        group_id=0,
        subgroup_id=0,
        object_id=0,
        publisher_priority=0,
        extensions=((0x3D, b"\xaa" * 4),),
        payload_length=2,
    )
    expected = [
        ("event", header),
        ("object", start0, b"KV"),
        ("object", ObjectStart(**{**_fields(start0), "object_id": 1, "extensions": ()}), b"KV"),
        ("event", StreamFinished()),
    ]
    assert feed_in(wire) == expected
    assert feed_in(wire, [1]) == expected


def _fields(start: ObjectStart) -> dict[str, Any]:
    return {name: getattr(start, name) for name in ObjectStart.__dataclass_fields__}


def test_draft_section_10_5_example() -> None:
    """§10.5: type 0x14, alias 2, group 0, subgroup 0, priority 0, objects "abcd" and "efgh"."""
    wire = bytes.fromhex("1402000000" + "0004" + b"abcd".hex() + "0004" + b"efgh".hex())
    header = SubgroupHeader(
        track_alias=2,
        group_id=0,
        subgroup_id_mode=SubgroupIdMode.EXPLICIT,
        subgroup_id=0,
        publisher_priority=0,
    )
    writer = SubgroupWriter(header)
    assert (
        writer.header_bytes()
        + writer.object_header(0, 4)
        + b"abcd"
        + writer.object_header(1, 4)
        + b"efgh"
        == wire
    )
    objects = [item for item in feed_in(wire, [3]) if item[0] == "object"]
    assert [(item[1].object_id, item[2]) for item in objects] == [(0, b"abcd"), (1, b"efgh")]


def test_kvsp_block_stream_with_end_of_group() -> None:
    """A KVSP block: subgroup 0 of group 0, one object per layer, END_OF_GROUP, FIN."""
    layers = [bytes([layer]) * (100 + layer) for layer in range(4)]
    header = SubgroupHeader(
        track_alias=3, group_id=0, publisher_priority=64, has_extensions=True, end_of_group=True
    )
    assert header.stream_type == 0x19
    writer = SubgroupWriter(header)
    parts = [writer.header_bytes()]
    for index, layer in enumerate(layers):
        digest = hashlib.sha256(layer).digest()
        parts += [
            writer.object_header(index, len(layer), extensions=[layer_digest_extension(digest)]),
            layer,
        ]
    parts.append(writer.object_header(4, 0, status=ObjectStatus.END_OF_GROUP))
    wire = b"".join(parts)
    for sizes in (None, [1], [7, 100, 3]):
        got = feed_in(wire, sizes)
        assert got[0] == ("event", header)
        objects = got[1:-1]
        assert [item[1].object_id for item in objects] == [0, 1, 2, 3, 4]
        for index, (_, start, payload) in enumerate(objects[:4]):
            assert payload == layers[index]
            assert find_layer_digest(start.extensions) == hashlib.sha256(payload).digest()
            assert start.subgroup_id == 0 and start.publisher_priority == 64
        status = objects[4][1]
        assert status.status == ObjectStatus.END_OF_GROUP and status.payload_length == 0
        assert got[-1] == ("event", StreamFinished())


def test_object_id_deltas_and_first_object_mode() -> None:
    header = SubgroupHeader(
        track_alias=1, group_id=2, subgroup_id_mode=SubgroupIdMode.FIRST_OBJECT, subgroup_id=None
    )
    writer = SubgroupWriter(header)
    wire = writer.header_bytes()
    for object_id in (5, 6, 10):
        wire += writer.object_header(object_id, 1) + b"x"
    assert wire[len(writer.header_bytes()) :: 3] == bytes([5, 0, 3])  # deltas
    objects = [item[1] for item in feed_in(wire) if item[0] == "object"]
    assert [(o.object_id, o.subgroup_id) for o in objects] == [(5, 5), (6, 5), (10, 5)]
    with pytest.raises(ValueError):
        writer.object_header(10, 1)
    with pytest.raises(ValueError):
        SubgroupWriter(header).object_header(0, 1, extensions=[(2, 1)])


def test_status_objects() -> None:
    header = SubgroupHeader(track_alias=1, group_id=0, has_extensions=True)
    base = encode_subgroup_header(header)
    # END_OF_TRACK, then an empty Normal object
    wire = base + encode_object_header(0, 0, extensions=(), status=ObjectStatus.END_OF_TRACK)
    [_, (_, start, payload), _] = feed_in(wire)
    assert start.status == ObjectStatus.END_OF_TRACK and payload == b""
    wire = base + encode_object_header(0, 0, extensions=())
    assert feed_in(wire)[1][1].status == ObjectStatus.NORMAL
    # extensions on a status object, unknown status 0x1 (removed in d16)
    with pytest.raises(ProtocolViolation):
        feed_in(base + b"\x00" + b"\x02\x02\x01" + b"\x00" + b"\x03")
    with pytest.raises(ProtocolViolation):
        feed_in(base + b"\x00\x00\x00\x01")
    with pytest.raises(ValueError):
        encode_object_header(0, 5, status=ObjectStatus.END_OF_GROUP)


def test_extension_rules() -> None:
    header = SubgroupHeader(track_alias=1, group_id=0, has_extensions=True)
    base = encode_subgroup_header(header)

    def with_extensions(block: bytes) -> bytes:
        return base + b"\x00" + encode_varint(len(block)) + block + b"\x01x"

    immutable = encode_kvps([(0x0B, encode_kvps([(0x4B57, b"d" * 32)]))])
    assert feed_in(with_extensions(immutable))[1][2] == b"x"
    with pytest.raises(MalformedTrack) as info:  # two IMMUTABLE_EXTENSIONS
        feed_in(with_extensions(encode_kvps([(0x0B, b""), (0x0B, b"")])))
    assert info.value.error_code == StreamResetCode.MALFORMED_TRACK
    with pytest.raises(MalformedTrack):  # nested IMMUTABLE_EXTENSIONS
        feed_in(with_extensions(encode_kvps([(0x0B, encode_kvps([(0x0B, b"")]))])))
    with pytest.raises(MalformedTrack):  # IMMUTABLE_EXTENSIONS that does not parse
        feed_in(with_extensions(encode_kvps([(0x0B, b"\x01\x05")])))
    with pytest.raises(MalformedTrack):  # repeated PRIOR_OBJECT_ID_GAP
        feed_in(with_extensions(encode_kvps([(0x3E, 1), (0x3E, 1)])))
    with pytest.raises(KeyValueFormattingError) as kvf:  # block ends inside a pair
        feed_in(with_extensions(b"\x03\x05ab"))
    assert kvf.value.error_code == SessionError.KEY_VALUE_FORMATTING_ERROR


def test_immutable_extensions_round_trip() -> None:
    ext = encode_immutable_extensions([(0x4B56, 3), (0x4B57, b"digest")])
    assert ext[0] == ExtensionType.IMMUTABLE_EXTENSIONS
    assert immutable_extensions([(2, 1), ext]) == ((0x4B56, 3), (0x4B57, b"digest"))
    assert immutable_extensions([(2, 1)]) == ()
    with pytest.raises(ValueError):
        encode_immutable_extensions([ext])  # §11.2: never nested


def test_fin_rules() -> None:
    header = SubgroupHeader(track_alias=1, group_id=0)
    wire = encode_subgroup_header(header) + encode_object_header(0, 4) + b"abcd"
    assert feed_in(wire)[-1] == ("event", StreamFinished())
    for cut in (1, len(wire) - 1, len(wire) - 5, 0):
        with pytest.raises(ProtocolViolation):
            feed_in(wire[:cut])
    parser = DataStreamParser()
    parser.feed(wire, end_stream=True)
    with pytest.raises(ValueError):
        parser.feed(b"")


# --- a 2 MiB object, chunk by chunk, zero copy --------------------------------------------------


def test_two_mib_object_is_sliced_not_copied() -> None:
    payload = random.Random(1).randbytes(2 * 1024 * 1024)
    header = SubgroupHeader(track_alias=1, group_id=0, publisher_priority=1, has_extensions=True)
    writer = SubgroupWriter(header)
    ext = [layer_digest_extension(hashlib.sha256(payload).digest())]
    head = writer.header_bytes() + writer.object_header(0, len(payload), extensions=ext)
    wire = head + payload + writer.object_header(1, 3) + b"end"
    parser = DataStreamParser()
    sha = hashlib.sha256()
    chunks: list[tuple[ObjectChunk, bytes]] = []
    end = None
    for pos in range(0, len(wire), 1452):
        piece = wire[pos : pos + 1452]
        for event in parser.feed(piece):
            if isinstance(event, ObjectChunk) and end is None:
                chunks.append((event, piece))
                sha.update(event.data)
            elif isinstance(event, ObjectEnd) and end is None:
                end = event
    assert end == ObjectEnd(0, 0)
    assert sum(len(chunk.data) for chunk, _ in chunks) == len(payload)
    assert sha.digest() == hashlib.sha256(payload).digest()
    for chunk, piece in chunks:
        assert chunk.data.obj is piece  # a view of the fed buffer, never a copy
    # the same with one big buffer fed as memoryview slices: every chunk points into it
    big = bytearray(wire)
    view = memoryview(big)
    parser = DataStreamParser()
    total = 0
    for pos in range(0, len(big), 1452):
        for event in parser.feed(view[pos : pos + 1452]):
            if isinstance(event, ObjectChunk):
                assert event.data.obj is big
                total += len(event.data)
    assert total == len(payload) + 3


# --- FETCH streams (§10.4.4) -------------------------------------------------------------------


def test_fetch_stream_flags() -> None:
    writer = FetchStreamWriter(request_id=4)
    parts = [writer.header_bytes()]
    assert parts[0] == b"\x05\x04"
    # first object: everything explicit (group, subgroup 0 via flags 0, object, priority)
    first = writer.object_header(
        group_id=0, object_id=2, subgroup_id=0, publisher_priority=128, payload_length=3
    )
    assert first == bytes([0x08 | 0x04 | 0x10, 0, 2, 128, 3])
    # next object in the same group and subgroup: only flags + length
    second = writer.object_header(
        group_id=0, object_id=3, subgroup_id=0, publisher_priority=128, payload_length=1
    )
    assert second == b"\x00\x01"
    third = writer.object_header(
        group_id=0,
        object_id=4,
        subgroup_id=1,
        publisher_priority=128,
        payload_length=0,
        extensions=[(0x3C, 1)],
    )
    assert third == bytes([0x02 | 0x20, 2, 0x3C, 1, 0])
    fourth = writer.object_header(
        group_id=1, object_id=0, subgroup_id=None, publisher_priority=7, payload_length=2
    )
    assert fourth == encode_varint(0x40 | 0x08 | 0x04 | 0x10) + bytes([1, 0, 7, 2])
    marker = writer.end_of_range(1, 9)
    assert marker == encode_varint(0x8C) + b"\x01\x09"
    unknown = writer.end_of_range(2, 3, unknown=True)
    assert unknown == encode_varint(0x10C) + b"\x02\x03"
    wire = b"".join([parts[0], first, b"abc", second, b"d", third, fourth, b"ef", marker, unknown])
    got = feed_in(wire, [1])
    assert got == feed_in(wire)
    assert got[0] == ("event", FetchHeader(request_id=4))
    objects = [
        (item[1].group_id, item[1].subgroup_id, item[1].object_id, item[2]) for item in got[1:5]
    ]
    assert objects == [(0, 0, 2, b"abc"), (0, 0, 3, b"d"), (0, 1, 4, b""), (1, None, 0, b"ef")]
    assert got[3][1].extensions == ((0x3C, 1),) and got[4][1].publisher_priority == 7
    assert got[5:] == [
        ("event", EndOfRange(1, 9, False)),
        ("event", EndOfRange(2, 3, True)),
        ("event", StreamFinished()),
    ]


@pytest.mark.parametrize("flags", [0x01, 0x02, 0x0C, 0x1B, 0x07])
def test_fetch_first_object_may_not_reference_prior(flags: int) -> None:
    # each of these omits a field (group, object or priority) or inherits the subgroup
    wire = b"\x05\x00" + encode_varint(flags) + b"\x00" * 6
    with pytest.raises(ProtocolViolation):
        DataStreamParser().feed(wire)


@pytest.mark.parametrize("flags", [0x80, 0x8B, 0x8D, 0x100, 0x10B, 0x3FFF])
def test_fetch_invalid_flags(flags: int) -> None:
    with pytest.raises(ProtocolViolation):
        DataStreamParser().feed(b"\x05\x00" + encode_varint(flags) + b"\x00" * 6)


# --- hypothesis: streams round-trip under any chunking ------------------------------------------

varints = st.integers(0, VARINT_MAX)
safe_extensions = st.tuples(
    st.lists(
        st.one_of(
            st.tuples(st.integers(0x20, 2**16).map(lambda t: t * 2), varints),
            st.tuples(st.integers(0x20, 2**16).map(lambda t: t * 2 + 1), st.binary(max_size=12)),
        ),
        max_size=3,
    ),
    st.lists(st.binary(min_size=32, max_size=32).map(layer_digest_extension), max_size=1),
).map(lambda parts: tuple(sorted(parts[0] + parts[1], key=lambda pair: pair[0])))


@st.composite
def subgroup_streams(draw: st.DrawFn) -> tuple[bytes, list[tuple[Any, ...]]]:
    mode = draw(st.sampled_from(SubgroupIdMode))
    subgroup = {SubgroupIdMode.ZERO: 0, SubgroupIdMode.FIRST_OBJECT: None}.get(mode)
    if mode == SubgroupIdMode.EXPLICIT:
        subgroup = draw(varints)
    header = SubgroupHeader(
        track_alias=draw(varints),
        group_id=draw(varints),
        subgroup_id_mode=mode,
        subgroup_id=subgroup,
        publisher_priority=draw(st.none() | st.integers(0, 255)),
        has_extensions=draw(st.booleans()),
        end_of_group=draw(st.booleans()),
    )
    writer = SubgroupWriter(header)
    wire = [writer.header_bytes()]
    expected: list[tuple[Any, ...]] = [("event", header)]
    object_id = draw(st.integers(0, 2**40))
    for index in range(draw(st.integers(0, 6))):
        if index:
            object_id += 1 + draw(st.integers(0, 1000))
        status = draw(st.sampled_from(ObjectStatus))
        payload = b"" if status != ObjectStatus.NORMAL else draw(st.binary(max_size=200))
        extensions: tuple[KeyValuePair, ...] = ()
        if header.has_extensions and status == ObjectStatus.NORMAL:
            extensions = draw(safe_extensions)
        wire += [
            writer.object_header(object_id, len(payload), extensions=extensions, status=status),
            payload,
        ]
        first = expected[1][1].object_id if len(expected) > 1 else object_id
        start = ObjectStart(
            group_id=header.group_id,
            subgroup_id=first if subgroup is None else subgroup,
            object_id=object_id,
            publisher_priority=header.publisher_priority,
            extensions=extensions,
            payload_length=len(payload),
            status=status,
        )
        expected.append(("object", start, payload))
    expected.append(("event", StreamFinished()))
    return b"".join(wire), expected


@st.composite
def fetch_streams(draw: st.DrawFn) -> tuple[bytes, list[tuple[Any, ...]]]:
    writer = FetchStreamWriter(request_id=draw(varints))
    wire = [writer.header_bytes()]
    expected: list[tuple[Any, ...]] = [("event", FetchHeader(request_id=writer.request_id))]
    group, object_id = draw(st.integers(0, 50)), 0
    subgroup: int | None = 0
    for _ in range(draw(st.integers(0, 8))):
        kind = draw(st.sampled_from(["same", "same", "next_group", "range"]))
        if kind == "range":
            group += draw(st.integers(0, 3))
            object_id += draw(st.integers(1, 5))
            unknown = draw(st.booleans())
            wire.append(writer.end_of_range(group, object_id, unknown=unknown))
            expected.append(("event", EndOfRange(group, object_id, unknown)))
            continue
        if kind == "next_group":
            group, object_id = group + draw(st.integers(1, 5)), draw(st.integers(0, 3))
        else:
            object_id += draw(st.integers(1, 3))
        base = 0 if subgroup is None else subgroup
        subgroup = draw(st.sampled_from([0, base, base + 1, None, 77]))
        priority = draw(st.sampled_from([0, 128, 255]))
        extensions = draw(safe_extensions)
        payload = draw(st.binary(max_size=100))
        wire += [
            writer.object_header(
                group_id=group,
                object_id=object_id,
                subgroup_id=subgroup,
                publisher_priority=priority,
                payload_length=len(payload),
                extensions=extensions,
            ),
            payload,
        ]
        start = ObjectStart(
            group_id=group,
            subgroup_id=subgroup,
            object_id=object_id,
            publisher_priority=priority,
            extensions=extensions,
            payload_length=len(payload),
        )
        expected.append(("object", start, payload))
    expected.append(("event", StreamFinished()))
    return b"".join(wire), expected


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(subgroup_streams(), fetch_streams()), st.randoms(use_true_random=False))
def test_stream_round_trip_any_chunking(
    stream: tuple[bytes, list[tuple[Any, ...]]], rng: random.Random
) -> None:
    wire, expected = stream
    assert feed_in(wire) == expected
    assert feed_in(wire, [1]) == expected
    assert feed_in(wire, random_sizes(rng)) == expected


def feed_fast(data: bytes, sizes: Sequence[int], crossed: list[int] | None = None) -> list[Any]:
    """As :func:`feed_in`, but each piece first tries the session's sink paths:
    :meth:`DataStreamParser.payload_within` (an ObjectChunk stands in for what it takes) and
    :meth:`DataStreamParser.cross_boundary` (the four events it stands for); ``crossed``
    collects the sizes of the pieces the latter took."""
    parser = DataStreamParser()
    events: list[DataStreamEvent] = []
    pos, i = 0, 0
    while pos < len(data):
        piece = data[pos : pos + sizes[i % len(sizes)]]
        pos, i = pos + len(piece), i + 1
        end = pos == len(data)
        offset = -1 if end else parser.payload_within(len(piece))
        crossing = None if end or offset >= 0 else parser.cross_boundary(memoryview(piece))
        if offset >= 0:
            events.append(ObjectChunk(memoryview(piece), offset))
        elif crossing is not None:
            tail, at, ended, started, head = crossing
            events += [
                ObjectChunk(memoryview(piece)[:tail], at),
                ObjectEnd(ended.group_id, ended.object_id),
                started,
                ObjectChunk(memoryview(piece)[head:], 0),
            ]
            if crossed is not None:
                crossed.append(len(piece))
        else:
            events += parser.feed(piece, end_stream=end)
    return collect(events)


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(subgroup_streams(), fetch_streams()), st.randoms(use_true_random=False))
def test_payload_fast_path_gives_what_feed_gives(
    stream: tuple[bytes, list[tuple[Any, ...]]], rng: random.Random
) -> None:
    wire, expected = stream
    assert feed_fast(wire, [1]) == expected
    assert feed_fast(wire, random_sizes(rng)) == expected
    assert feed_fast(wire, [rng.randint(20, 400) for _ in range(20)]) == expected


def test_a_piece_crossing_one_boundary_takes_the_boundary_path() -> None:
    writer = FetchStreamWriter(request_id=4)
    wire = [writer.header_bytes()]
    cuts = []  # the middle of each payload: every boundary falls inside one piece, whole
    for object_id in range(8):
        digest = layer_digest_extension(hashlib.sha256(b"%d" % object_id).digest())
        fields = writer.object_header(
            group_id=0,
            object_id=object_id,
            subgroup_id=0,
            publisher_priority=1,
            payload_length=1000,
            extensions=[digest],
        )
        wire += [fields, bytes([object_id]) * 1000]
        cuts.append(sum(map(len, wire)) - 500)
    data = b"".join(wire)
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    crossed: list[int] = []
    assert feed_fast(data, sizes, crossed) == feed_in(data)
    assert crossed == sizes[1:-1]  # each boundary but the stream's end (feed takes the FIN)


def test_the_boundary_path_takes_nothing_it_cannot_take_whole() -> None:
    def headers(*lengths: int) -> list[bytes]:
        """Object headers 0, 1, ... of a new fetch stream, with these payload lengths."""
        writer = FetchStreamWriter(request_id=4)
        return [writer.header_bytes()] + [
            writer.object_header(
                group_id=0, object_id=i, subgroup_id=0, publisher_priority=1, payload_length=n
            )
            for i, n in enumerate(lengths)
        ]

    def second(length: int) -> bytes:
        """Object 1's header, after an object 0 of 10 octets."""
        return headers(10, length)[2]

    def parser_inside() -> DataStreamParser:
        parser = DataStreamParser()
        parser.feed(b"".join(headers(10)) + b"abcd")  # 6 payload octets left
        return parser

    cases = {
        "the payload does not end here": b"efgh",
        "it ends exactly here": b"efghij",
        "the next header is cut short": b"efghij" + second(50)[:-1],
        "the next header ends the piece": b"efghij" + second(50),
        "the next object ends in it too": b"efghij" + second(2) + b"xy",
        "a zero-length object follows": b"efghij" + b"".join(headers(10, 0, 50)[2:]) + b"z",
        "an End of Range marker follows": b"efghij" + FetchStreamWriter(4).end_of_range(0, 5),
    }
    for name, piece in cases.items():
        parser = parser_inside()
        assert parser.cross_boundary(memoryview(piece)) is None, name
        events = parser.feed(piece)  # nothing was taken: feed sees the whole piece
        assert isinstance(events[0], ObjectChunk) and events[0].offset == 4, name
    parser = parser_inside()
    took = parser.cross_boundary(memoryview(b"efghij" + second(50) + b"xyz"))
    assert took is not None
    tail, offset, ended, started, head = took
    assert (tail, offset, ended.object_id, started.object_id) == (6, 4, 0, 1)
    assert head == 6 + len(second(50))
    assert parser.payload_within(46) == 3  # the rest of object 1's payload, after "xyz"


def test_the_boundary_path_raises_what_feed_raises() -> None:
    header = SubgroupHeader(track_alias=1, group_id=0, has_extensions=True)
    writer = SubgroupWriter(header)
    start = writer.header_bytes() + writer.object_header(0, 4) + b"ab"
    repeated = b"\x00" + encode_varint(4) + encode_kvps([(0x0B, b""), (0x0B, b"")]) + b"\x05"
    for piece in (b"cd" + repeated + b"xyz", b"cd\x00\x80"):  # malformed track; a bad varint?
        errors = []
        for path in ("feed", "cross_boundary"):
            parser = DataStreamParser()
            parser.feed(start)
            try:
                if path == "feed":
                    parser.feed(piece)
                else:
                    parser.cross_boundary(memoryview(piece))
            except MOQTError as exc:
                errors.append((type(exc), exc.reason))
            else:
                errors.append(None)
        assert errors[0] == errors[1]


def test_payload_fast_path_takes_only_what_lies_inside_a_payload() -> None:
    writer = FetchStreamWriter(request_id=4)
    head = writer.header_bytes() + writer.object_header(
        group_id=0, object_id=0, subgroup_id=0, publisher_priority=1, payload_length=10
    )
    parser = DataStreamParser()
    assert parser.payload_within(1) == -1  # the stream header comes first
    assert len(parser.feed(head + b"ab")) == 3  # header, object start, a first chunk
    assert parser.payload_within(0) == -1
    assert parser.payload_within(8) == -1  # "cdefghij" would end the object: feed's job
    assert parser.payload_within(3) == 2 and parser.payload_within(4) == 5
    events = parser.feed(b"j", end_stream=True)  # the tenth octet ends it
    assert [type(e).__name__ for e in events] == ["ObjectChunk", "ObjectEnd", "StreamFinished"]
    assert events[0].offset == 9  # type: ignore[union-attr]
    assert parser.payload_within(1) == -1  # ended


# --- datagrams (§10.3.1) -----------------------------------------------------------------------

VALID_DATAGRAM_TYPES = [
    *range(0x00, 0x10),
    0x20,
    0x21,
    0x24,
    0x25,
    0x28,
    0x29,
    0x2C,
    0x2D,
]


def test_datagram_type_table() -> None:
    assert [t for t in range(0x400) if is_datagram_type(t)] == VALID_DATAGRAM_TYPES


@pytest.mark.parametrize("datagram_type", VALID_DATAGRAM_TYPES, ids=hex)
def test_every_datagram_type(datagram_type: int) -> None:
    status = datagram_type & 0x20
    datagram = ObjectDatagram(
        track_alias=9,
        group_id=4,
        object_id=0 if datagram_type & 0x04 else 3,
        publisher_priority=None if datagram_type & 0x08 else 200,
        extensions=((0x3D, b"e"),) if datagram_type & 0x01 else (),
        status=ObjectStatus.END_OF_TRACK
        if status and not datagram_type & 0x01
        else ObjectStatus.NORMAL,
        end_of_group=bool(datagram_type & 0x02),
        payload=b"" if status else b"payload",
    )
    if status and datagram_type & 0x01:
        # STATUS with extensions: only a Normal status may carry them; encoders never pick it
        wire = bytes([datagram_type, 9, 4]) + (b"" if datagram_type & 0x04 else b"\x03")
        wire += b"" if datagram_type & 0x08 else b"\xc8"
        wire += b"\x03\x3d\x01e" + b"\x00"
        decoded = ObjectDatagram.decode(wire)
        assert decoded.extensions == ((0x3D, b"e"),) and decoded.status == ObjectStatus.NORMAL
        return
    assert datagram.datagram_type == datagram_type
    wire = datagram.encode()
    assert wire[0] == datagram_type
    assert ObjectDatagram.decode(wire) == datagram


def test_datagram_errors() -> None:
    for bad_type in (0x10, 0x22, 0x23, 0x2E, 0x30, 0x40):
        with pytest.raises(ProtocolViolation):
            ObjectDatagram.decode(encode_varint(bad_type) + b"\x00" * 6)
    with pytest.raises(ProtocolViolation):  # EXTENSIONS bit, empty block
        ObjectDatagram.decode(bytes([0x0D, 1, 1, 0]) + b"payload")
    with pytest.raises(ProtocolViolation):  # unknown status
        ObjectDatagram.decode(bytes([0x2C, 1, 1, 1]))
    with pytest.raises(ProtocolViolation):  # extensions on END_OF_GROUP status
        ObjectDatagram.decode(bytes([0x2D, 1, 1, 2, 0x3C, 1, 3]))
    with pytest.raises(ProtocolViolation):  # truncated
        ObjectDatagram.decode(bytes([0x00, 1]))
    with pytest.raises(ValueError):
        ObjectDatagram(
            track_alias=1, group_id=1, object_id=1, status=ObjectStatus.END_OF_GROUP, payload=b"x"
        ).encode()


def test_datagram_payload_is_a_view() -> None:
    wire = bytearray(
        ObjectDatagram(track_alias=1, group_id=2, object_id=3, payload=b"abc").encode()
    )
    decoded = ObjectDatagram.decode(wire)
    assert isinstance(decoded.payload, memoryview) and decoded.payload.obj is wire
    assert bytes(decoded.payload) == b"abc"


datagrams = st.builds(
    ObjectDatagram,
    track_alias=varints,
    group_id=varints,
    object_id=varints,
    publisher_priority=st.none() | st.integers(0, 255),
    extensions=safe_extensions,
    end_of_group=st.booleans(),
    payload=st.binary(max_size=100),
) | st.builds(
    ObjectDatagram,
    track_alias=varints,
    group_id=varints,
    object_id=varints,
    publisher_priority=st.none() | st.integers(0, 255),
    status=st.sampled_from([ObjectStatus.END_OF_GROUP, ObjectStatus.END_OF_TRACK]),
)


@given(datagrams)
def test_datagram_round_trip(datagram: ObjectDatagram) -> None:
    assert ObjectDatagram.decode(datagram.encode()) == datagram


# --- garbage in: parse or raise MOQTError, nothing else -----------------------------------------


def _outcome(data: bytes, sizes: Sequence[int] | None) -> tuple[str, Any]:
    try:
        return "ok", feed_in(data, sizes)
    except MOQTError as exc:
        return "error", type(exc)


def _check_garbage(data: bytes, rng: random.Random) -> None:
    whole = _outcome(data, None)
    for sizes in ([1], random_sizes(rng)):
        assert _outcome(data, sizes) == whole
    with contextlib.suppress(MOQTError):
        ObjectDatagram.decode(data)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.binary(max_size=120),
        st.sampled_from([b"\x05", b"\x10", b"\x15", b"\x19", b"\x3d", b"\x05\x00"]).flatmap(
            lambda prefix: st.binary(max_size=120).map(lambda tail: prefix + tail)
        ),
    ),
    st.randoms(use_true_random=False),
)
def test_arbitrary_bytes_parse_or_raise(data: bytes, rng: random.Random) -> None:
    _check_garbage(data, rng)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(subgroup_streams(), fetch_streams()), st.randoms(use_true_random=False))
def test_mutated_streams_parse_or_raise(
    stream: tuple[bytes, list[tuple[Any, ...]]], rng: random.Random
) -> None:
    buf = bytearray(stream[0])
    for _ in range(rng.randint(1, 3)):
        if buf and rng.random() < 0.7:
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        elif buf:
            del buf[rng.randrange(len(buf)) :]
    _check_garbage(bytes(buf), rng)
