"""moqt._objscan: object headers read in C give exactly what the Python reader gives (d16 §10.4,
§11.2-11.4), and everything it does not take is left to that reader.

The native functions take a header only when it is whole and valid; for every other input they
return None and :class:`~moqt.objects.DataStreamParser` reads it in Python. So these tests feed
the same streams (valid, corrupted, cut short; whole, byte by byte, in random pieces) to a parser
with the native reader and to one without, and require the same events or the same error, reason
included; and they check, header by header, what the native functions decline.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_objects import feed_in, fetch_streams, random_sizes, subgroup_streams

import moqt.objects
from kvsp.moqt_mapping import layer_digest_extension
from moqt.errors import MalformedTrack, MOQTError, ProtocolViolation
from moqt.objects import (
    DataStreamParser,
    FetchHeader,
    FetchStreamWriter,
    ObjectChunk,
    ObjectEnd,
    ObjectRun,
    ObjectStart,
    StreamFinished,
    SubgroupHeader,
    SubgroupWriter,
)
from moqt.objects_wire import FETCH_SUBGROUP_PRIOR
from moqt.wire import VARINT_MAX, Reader, encode_kvps, encode_varint

pytestmark = pytest.mark.skipif(
    not moqt.objects.NATIVE_HEADERS, reason="moqt._objscan was not built here (no C compiler)"
)

DIGEST = layer_digest_extension(hashlib.sha256(b"layer").digest())


def fetch(data: bytes, pos: int, prior: Any) -> Any:
    """``moqt._objscan.fetch_object``."""
    assert moqt.objects._native is not None
    return moqt.objects._native.fetch_object(data, pos, prior)


def subgroup(data: bytes, pos: int, has_extensions: bool, last: Any) -> Any:
    """``moqt._objscan.subgroup_object``."""
    assert moqt.objects._native is not None
    return moqt.objects._native.subgroup_object(data, pos, has_extensions, last)


@contextmanager
def reader(native: bool) -> Iterator[None]:
    """Parsers made inside read object headers natively first (``native``) or in Python only."""
    with pytest.MonkeyPatch.context() as patch:
        if not native:
            patch.setattr(moqt.objects, "_native", None)
        yield


def outcome(data: bytes, sizes: Sequence[int] | None, *, native: bool) -> tuple[str, Any]:
    """What :func:`feed_in` makes of ``data`` with this reader, or the error it raised: its
    type, code and reason."""
    with reader(native):
        try:
            return "ok", feed_in(data, sizes)
        except MOQTError as exc:
            return "error", (type(exc), exc.error_code, exc.reason)


def same_both_ways(data: bytes, rng: random.Random) -> tuple[str, Any]:
    result = outcome(data, None, native=True)
    for sizes in (None, [1], random_sizes(rng)):
        assert outcome(data, sizes, native=True) == result
        assert outcome(data, sizes, native=False) == result
    return result


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(subgroup_streams(), fetch_streams()), st.randoms(use_true_random=False))
def test_valid_streams_read_the_same(
    stream: tuple[bytes, list[tuple[Any, ...]]], rng: random.Random
) -> None:
    wire, expected = stream
    assert same_both_ways(wire, rng) == ("ok", expected)


def corrupted(data: bytes, rng: random.Random) -> bytes:
    """``data`` with one to four random changes: an octet replaced, the tail cut, or a few
    octets inserted."""
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        roll = rng.random()
        if buf and roll < 0.6:
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        elif buf and roll < 0.8:
            del buf[rng.randrange(len(buf)) :]
        else:
            at = rng.randrange(len(buf) + 1)
            buf[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
    return bytes(buf)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(subgroup_streams(), fetch_streams()), st.randoms(use_true_random=False))
def test_corrupted_streams_give_the_same_events_or_error(
    stream: tuple[bytes, list[tuple[Any, ...]]], rng: random.Random
) -> None:
    same_both_ways(corrupted(stream[0], rng), rng)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from([b"\x05\x00", b"\x11\x07\x00\x80", b"\x10\x07\x00\x80", b"\x15\x07\x00"]),
    st.binary(max_size=80),
    st.randoms(use_true_random=False),
)
def test_arbitrary_objects_give_the_same_events_or_error(
    head: bytes, tail: bytes, rng: random.Random
) -> None:
    same_both_ways(head + tail, rng)


# --- what the native functions take and decline ---------------------------------------------------


def kvsp_block_stream(layers: int = 32, size: int = 64) -> bytes:
    """A fetch stream as a KVSP publisher writes one block: object = layer, digest extension."""
    writer = FetchStreamWriter(request_id=3)
    wire = [writer.header_bytes()]
    for layer in range(layers):
        extension = layer_digest_extension(hashlib.sha256(b"%d" % layer).digest())
        wire.append(
            writer.object_header(
                group_id=0,
                object_id=layer,
                subgroup_id=0,
                publisher_priority=128,
                payload_length=size,
                extensions=[extension],
            )
        )
        wire.append(bytes([layer]) * size)
    return b"".join(wire)


def test_a_kvsp_block_has_every_header_read_natively(monkeypatch: pytest.MonkeyPatch) -> None:
    native = moqt.objects._native
    assert native is not None
    taken: list[bool] = []

    class Spy:
        @staticmethod
        def fetch_object(data: Any, pos: int, prior: Any) -> Any:
            got = native.fetch_object(data, pos, prior)
            taken.append(got is not None)
            return got

    monkeypatch.setattr(moqt.objects, "_native", Spy)
    wire = kvsp_block_stream()
    events = DataStreamParser().feed(wire, end_stream=True)
    starts = [event for event in events if isinstance(event, ObjectStart)]
    assert [start.object_id for start in starts] == list(range(32))
    assert taken == [True] * 32


def python_read(wire: bytes, pos: int, prior: Any = None) -> tuple[ObjectStart, int]:
    """The fetch object header at ``wire[pos:]`` as the Python reader reads it."""
    parser = DataStreamParser()
    parser.feed(b"\x05\x00")
    parser._last = prior
    reader = Reader.at(memoryview(wire), pos)
    unit = parser._read_fetch_object(reader)
    assert isinstance(unit, ObjectStart)
    return unit, reader.position


def test_fetch_object_matches_the_python_reader_field_by_field() -> None:
    writer = FetchStreamWriter(request_id=1)
    first = writer.object_header(
        group_id=9,
        object_id=5,
        subgroup_id=2,
        publisher_priority=7,
        payload_length=1 << 20,
        extensions=[(0x3C, 4), DIGEST],
    )
    got = fetch(first, 0, None)
    unit, end = python_read(first, 0)
    assert got == (
        end,
        unit.group_id,
        unit.subgroup_id,
        unit.object_id,
        unit.publisher_priority,
        unit.extensions,
        unit.payload_length,
    )
    # the next object inherits group, subgroup (NEXT), object id + 1 and priority
    second = writer.object_header(
        group_id=9, object_id=6, subgroup_id=3, publisher_priority=7, payload_length=0
    )
    assert second[0] == 0x02  # flags: subgroup = prior + 1, all else inherited
    padded = b"xx" + second
    assert fetch(padded, 2, unit) == (len(padded), 9, 3, 6, 7, (), 0)


def test_a_header_cut_short_is_declined_at_every_cut() -> None:
    wire = FetchStreamWriter(request_id=1).object_header(
        group_id=1, object_id=2, subgroup_id=5, publisher_priority=1, payload_length=70000,
        extensions=[DIGEST, (0x3E, 1)],
    )  # fmt: skip
    assert fetch(wire, 0, None) is not None
    for cut in range(len(wire)):
        assert fetch(wire[:cut], 0, None) is None
    header = SubgroupHeader(track_alias=1, group_id=0, has_extensions=True)
    object_wire = SubgroupWriter(header).object_header(3, 500, extensions=[DIGEST])
    assert subgroup(object_wire, 0, True, None) == (
        len(object_wire),
        3,
        (DIGEST,),
        500,
    )
    for cut in range(len(object_wire)):
        assert subgroup(object_wire[:cut], 0, True, None) is None


def fetch_with(flags: int, *fields: bytes) -> bytes:
    return encode_varint(flags) + b"".join(fields)


def ext_block(*pairs: tuple[int, int | bytes]) -> bytes:
    block = encode_kvps(pairs)
    return encode_varint(len(block)) + block


DECLINED_FETCH = {
    # End of Range markers and invalid flags
    "end of non-existent range": fetch_with(0x8C, b"\x01\x02"),
    "end of unknown range": fetch_with(0x10C, b"\x01\x02"),
    "flags 0x80": fetch_with(0x80, b"\x00" * 8),
    # inherited fields with no prior object
    "group from no prior": fetch_with(0x04 | 0x10, b"\x01\x07\x05"),
    "object from no prior": fetch_with(0x08 | 0x10, b"\x01\x07\x05"),
    "priority from no prior": fetch_with(0x08 | 0x04, b"\x01\x01\x05"),
    "subgroup from no prior": fetch_with(0x08 | 0x04 | 0x10 | 0x01, b"\x01\x01\x07\x05"),
    # per-object extension rules (§11.2-11.4)
    "two IMMUTABLE_EXTENSIONS": fetch_with(0x3C, b"\x01\x01\x07", ext_block((11, b""), (11, b""))),
    "nested IMMUTABLE_EXTENSIONS": fetch_with(
        0x3C, b"\x01\x01\x07", ext_block((11, encode_kvps([(11, b"")])))
    ),
    "unparsable IMMUTABLE_EXTENSIONS": fetch_with(0x3C, b"\x01\x01\x07", ext_block((11, b"\x01"))),
    "repeated PRIOR_GROUP_ID_GAP": fetch_with(
        0x3C, b"\x01\x01\x07", ext_block((0x3C, 1), (0x3C, 2))
    ),
    "a pair cut inside the block": fetch_with(0x3C, b"\x01\x01\x07", b"\x02\x03\x05"),
    "an odd value over 65535": fetch_with(0x3C, b"\x01\x01\x07", b"\x05\x03\x80\x01\x00\x00"),
    "extensions over the cap": fetch_with(0x3C, b"\x01\x01\x07", encode_varint((1 << 20) + 1)),
}


@pytest.mark.parametrize("name", list(DECLINED_FETCH))
def test_fetch_object_declines_what_python_must_decide(name: str) -> None:
    wire = DECLINED_FETCH[name] + b"\x05" + bytes(8)  # a payload length, then room to spare
    assert fetch(wire, 0, None) is None


def test_declined_fetch_headers_raise_in_python_as_before() -> None:
    for name, wire in DECLINED_FETCH.items():
        if name.startswith("end of"):
            continue  # a valid marker, which the Python reader takes
        with reader(native=True), pytest.raises(MOQTError):
            DataStreamParser().feed(b"\x05\x00" + wire + b"\x05" + bytes(8), end_stream=True)


def test_fetch_object_declines_an_inherited_field_the_prior_lacks() -> None:
    prior = ObjectStart(
        group_id=0,
        subgroup_id=None,
        object_id=VARINT_MAX,
        publisher_priority=None,
        extensions=(),
        payload_length=0,
    )
    assert fetch(fetch_with(0x1C, b"\x00\x00\x01\x05"), 0, prior) == (
        5, 0, 0, 0, 1, (), 5,
    )  # fmt: skip
    # object id prior + 1 beyond 2^62 - 1; subgroup from a prior without one; priority None
    assert fetch(fetch_with(0x18, b"\x00\x01\x05"), 0, prior) is None
    assert fetch(fetch_with(0x1D, b"\x00\x00\x01\x05"), 0, prior) is None
    assert fetch(fetch_with(0x0C, b"\x00\x00\x05"), 0, prior) is None


def test_subgroup_object_declines_status_objects_and_id_overflow() -> None:
    status = b"\x00\x00\x03"  # object 0, no payload, status END_OF_GROUP
    assert subgroup(status, 0, False, None) is None
    last = ObjectStart(
        group_id=0,
        subgroup_id=0,
        object_id=VARINT_MAX - 1,
        publisher_priority=1,
        extensions=(),
        payload_length=1,
    )
    assert subgroup(b"\x00\x01", 0, False, last) == (2, VARINT_MAX, (), 1)
    assert subgroup(b"\x01\x01", 0, False, last) is None


def test_bad_calls_raise_not_crash() -> None:
    native = moqt.objects._native
    assert native is not None
    with pytest.raises(ValueError):
        native.fetch_object(b"\x00\x01", 3, None)
    with pytest.raises(ValueError):
        native.subgroup_object(b"\x00\x01", -1, False, None)
    with pytest.raises(TypeError):
        native.fetch_object(b"\x00\x01", 0)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        native.fetch_object("text", 0, None)  # type: ignore[arg-type]
    with pytest.raises(AttributeError):  # a prior without the fields the header inherits
        native.fetch_object(b"\x00\x05", 0, object())  # type: ignore[arg-type]


def test_a_malformed_track_error_names_the_same_rule() -> None:
    header = SubgroupHeader(track_alias=1, group_id=0, has_extensions=True)
    wire = (
        SubgroupWriter(header).header_bytes() + b"\x00" + ext_block((11, b""), (11, b"")) + b"\x01x"
    )
    for native in (True, False):
        with reader(native), pytest.raises(MalformedTrack) as info:
            DataStreamParser().feed(wire)
        assert "0xb" in info.value.reason


# --- runs of whole FETCH objects (fetch_objects, feed(..., runs=True)) -------------------------


def flat(events: Sequence[Any]) -> list[Any]:
    """Events as comparable values, each :class:`ObjectRun` replaced by the events it stands for
    and each chunk by its octets and offset."""
    out: list[Any] = []
    for event in events:
        if isinstance(event, ObjectRun):
            out += flat(event.events())
        elif isinstance(event, ObjectChunk):
            out.append(("chunk", bytes(event.data), event.offset))
        else:
            out.append(event)
    return out


def feed_each(data: bytes, sizes: Sequence[int] | None, *, runs: bool) -> list[Any]:
    """What each feed of ``data`` (in pieces of ``sizes``, cycled, or whole, then the FIN)
    gives, flattened, up to the error that ends it (its type, code and reason)."""
    parser, results = DataStreamParser(), []
    pieces = [data] if sizes is None else []
    pos = i = 0
    while sizes is not None and pos < len(data):
        pieces.append(data[pos : pos + sizes[i % len(sizes)]])
        pos, i = pos + sizes[i % len(sizes)], i + 1
    try:
        for piece in pieces:
            results.append(flat(parser.feed(piece, runs=runs)))
        results.append(flat(parser.feed(b"", end_stream=True, runs=runs)))
    except MOQTError as exc:
        results.append(("error", type(exc), exc.error_code, exc.reason))
    return results


def same_with_runs(data: bytes, rng: random.Random) -> None:
    for sizes in (None, [1], random_sizes(rng)):
        assert feed_each(data, sizes, runs=True) == feed_each(data, sizes, runs=False)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(fetch_streams(), st.randoms(use_true_random=False))
def test_runs_give_each_feed_the_same_events(
    stream: tuple[bytes, list[tuple[Any, ...]]], rng: random.Random
) -> None:
    same_with_runs(stream[0], rng)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(fetch_streams(), st.randoms(use_true_random=False))
def test_runs_of_corrupted_streams_give_the_same_events_or_error(
    stream: tuple[bytes, list[tuple[Any, ...]]], rng: random.Random
) -> None:
    same_with_runs(corrupted(stream[0], rng), rng)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=120), st.randoms(use_true_random=False))
def test_runs_of_arbitrary_objects_give_the_same_events_or_error(
    tail: bytes, rng: random.Random
) -> None:
    same_with_runs(b"\x05\x00" + tail, rng)


def test_a_kvsp_block_fed_whole_is_one_run() -> None:
    wire = kvsp_block_stream()
    events = DataStreamParser().feed(wire, end_stream=True, runs=True)
    assert [type(event) for event in events] == [FetchHeader, ObjectRun, StreamFinished]
    run = events[1]
    assert isinstance(run, ObjectRun)
    assert [item[2] for item in run.objects] == list(range(32))
    assert run.octets == 32 * 64
    for group, subgroup, object_id, priority, extensions, start, length in run.objects:
        assert (group, subgroup, priority, length) == (0, 0, 128, 64)
        assert len(extensions) == 1
        assert bytes(run.data[start : start + length]) == bytes([object_id]) * 64


def test_a_run_stops_before_an_object_the_piece_does_not_hold_whole() -> None:
    wire = kvsp_block_stream(layers=3, size=10)
    header = len(FetchStreamWriter(request_id=3).header_bytes())
    parser = DataStreamParser()
    events = parser.feed(wire[:-4], runs=True)  # the last object lacks 4 payload octets
    assert [type(event) for event in events] == [FetchHeader, ObjectRun, ObjectStart, ObjectChunk]
    run = events[1]
    assert isinstance(run, ObjectRun) and [item[2] for item in run.objects] == [0, 1]
    assert flat(parser.feed(wire[-4:], end_stream=True, runs=True)) == [
        ("chunk", bytes([2]) * 4, 6),
        ObjectEnd(0, 2),
        StreamFinished(),
    ]
    # the native function itself: None where no whole object starts
    assert moqt.objects._native is not None
    scan = moqt.objects._native.fetch_objects
    assert scan(wire[:-4], len(wire) - 4, None) is None
    assert scan(wire, header, None) is not None
    assert scan(wire[: header + 5], header, None) is None


def test_fetch_objects_inherits_from_object_to_object_and_from_the_prior() -> None:
    writer = FetchStreamWriter(request_id=1)
    wire = b"".join(
        writer.object_header(
            group_id=4, object_id=i, subgroup_id=sub, publisher_priority=9, payload_length=1
        )
        + b"x"
        for i, sub in ((7, 2), (8, 2), (9, 3), (10, None), (11, 0))
    )
    assert moqt.objects._native is not None
    found = moqt.objects._native.fetch_objects(wire, 0, None)
    assert found is not None
    end, objects, octets = found
    assert (end, octets) == (len(wire), 5)
    assert [item[:4] for item in objects] == [
        (4, 2, 7, 9), (4, 2, 8, 9), (4, 3, 9, 9), (4, None, 10, 9), (4, 0, 11, 9),
    ]  # fmt: skip
    # what the second object inherits may come from the prior given
    second = 1 + len(
        FetchStreamWriter(request_id=1).object_header(
            group_id=4, object_id=7, subgroup_id=2, publisher_priority=9, payload_length=1
        )
    )
    prior = ObjectStart(
        group_id=4,
        subgroup_id=2,
        object_id=7,
        publisher_priority=9,
        extensions=(),
        payload_length=1,
    )
    found = moqt.objects._native.fetch_objects(wire, second, prior)
    assert found is not None and found[1] == objects[1:]
    # a Datagram object leaves no subgroup to inherit: the run ends before the object that
    # asks for one, which the Python reader then refuses
    datagram = fetch_with(0x40 | 0x08 | 0x04 | 0x10, b"\x00\x00\x01\x00")
    wire = datagram + fetch_with(FETCH_SUBGROUP_PRIOR, b"\x00")
    found = moqt.objects._native.fetch_objects(wire, 0, None)
    assert found == (len(datagram), [(0, None, 0, 1, (), len(datagram), 0)], 0)
    with pytest.raises(ProtocolViolation):
        DataStreamParser().feed(b"\x05\x00" + wire, runs=True)


def test_fetch_objects_bad_calls_raise_not_crash() -> None:
    native = moqt.objects._native
    assert native is not None
    with pytest.raises(ValueError):
        native.fetch_objects(b"\x00\x01", 3, None)
    with pytest.raises(TypeError):
        native.fetch_objects(b"\x00\x01", 0)  # type: ignore[call-arg]
    with pytest.raises(AttributeError):
        native.fetch_objects(b"\x00\x05", 0, object())  # type: ignore[arg-type]


def test_without_the_native_reader_runs_are_never_given() -> None:
    with reader(native=False):
        events = DataStreamParser().feed(kvsp_block_stream(), end_stream=True, runs=True)
    assert not any(isinstance(event, ObjectRun) for event in events)
