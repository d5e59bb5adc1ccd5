"""moqt.wire: varints, Key-Value-Pairs, names, reasons, control framing (d16 §1.4, §2.4.1, §9)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moqt.errors import (
    KeyValueFormattingError,
    MOQTError,
    NeedMoreData,
    ProtocolViolation,
    SessionError,
)
from moqt.wire import (
    VARINT_MAX,
    ControlFrame,
    ControlStreamParser,
    KeyValuePair,
    Location,
    Reader,
    Writer,
    decode_kvp_block,
    decode_varint,
    encode_kvps,
    encode_varint,
    frame_control_message,
    push_full_track_name,
    push_namespace,
    push_reason,
    read_full_track_name,
    read_kvps,
    read_kvps_to_end,
    read_namespace,
    read_reason,
    varint_size,
)

# --- varints -----------------------------------------------------------------------------------

VARINT_BOUNDARIES = [
    (0, "00"),
    (63, "3f"),
    (64, "4040"),
    (16383, "7fff"),
    (16384, "80004000"),
    (2**30 - 1, "bfffffff"),
    (2**30, "c000000040000000"),
    (2**62 - 1, "ffffffffffffffff"),
]


@pytest.mark.parametrize(("value", "hex_"), VARINT_BOUNDARIES)
def test_varint_boundaries(value: int, hex_: str) -> None:
    encoded = encode_varint(value)
    assert encoded.hex() == hex_
    assert varint_size(value) == len(encoded)
    assert decode_varint(encoded) == (value, len(encoded))
    writer = Writer()
    writer.push_varint(value)
    assert writer.data == encoded


@pytest.mark.parametrize("value", [2**62, 2**64, -1])
def test_varint_out_of_range_rejected(value: int) -> None:
    with pytest.raises(ValueError):
        encode_varint(value)
    with pytest.raises(ValueError):
        Writer().push_varint(value)


def test_rfc9000_sample_varints() -> None:
    # RFC 9000 §A.1 samples, including the non-minimal two-byte 37 (accepted on receipt, §1.4)
    assert decode_varint(bytes.fromhex("c2197c5eff14e88c")) == (151288809941952652, 8)
    assert decode_varint(bytes.fromhex("9d7f3e7d")) == (494878333, 4)
    assert decode_varint(bytes.fromhex("7bbd")) == (15293, 2)
    assert decode_varint(bytes.fromhex("25")) == (37, 1)
    assert decode_varint(bytes.fromhex("4025")) == (37, 2)


def test_truncated_varint() -> None:
    with pytest.raises(NeedMoreData):
        Reader(b"\x80\x00\x00").read_varint()
    with pytest.raises(ProtocolViolation):
        decode_varint(b"\xc0")


@given(st.integers(min_value=0, max_value=VARINT_MAX))
def test_varint_round_trip(value: int) -> None:
    assert decode_varint(encode_varint(value)) == (value, varint_size(value))


def test_reader_slices_are_zero_copy() -> None:
    data = bytearray(b"\x05hello world")
    reader = Reader(data)
    view = reader.read_length_prefixed()
    assert bytes(view) == b"hello"
    assert view.obj is data
    assert reader.remaining == 6
    assert reader.read_uint8() == ord(" ")
    with pytest.raises(NeedMoreData):
        reader.read_bytes(6)
    assert bytes(reader.read_rest()) == b"world"
    assert reader.eof()
    with pytest.raises(NeedMoreData):
        reader.read_uint16()


# --- Key-Value-Pairs (§1.4.2) ------------------------------------------------------------------


def test_kvp_delta_and_parity() -> None:
    # types 2 (even → varint), 5 (odd → length + bytes), 5 again (delta 0), 0x4B57 (odd)
    pairs: list[KeyValuePair] = [(2, 100), (5, b"ab"), (5, b""), (0x4B57, b"\x01")]
    encoded = encode_kvps(pairs)
    assert (
        encoded.hex()
        == "02" + "4064" + "03" + "02" + "6162" + "00" + "00" + "80004b52" + "01" + "01"
    )
    assert read_kvps(Reader(encoded), 4) == tuple(pairs)
    assert read_kvps_to_end(Reader(encoded)) == tuple(pairs)


def test_kvp_encoder_sorts_stably() -> None:
    pairs: list[KeyValuePair] = [(7, b"x"), (2, 1), (7, b"y")]
    assert decode_kvp_block(encode_kvps(pairs)) == ((2, 1), (7, b"x"), (7, b"y"))


@pytest.mark.parametrize("pair", [(2, b"bytes"), (3, 5)])
def test_kvp_encoder_rejects_wrong_parity(pair: tuple[int, int | bytes]) -> None:
    with pytest.raises(ValueError):
        encode_kvps([pair])


def test_kvp_value_length_limit() -> None:
    assert decode_kvp_block(encode_kvps([(1, b"x" * 0xFFFF)])) == ((1, b"x" * 0xFFFF),)
    with pytest.raises(ValueError):
        encode_kvps([(1, b"x" * 0x10000)])
    too_long = b"\x01" + encode_varint(0x10000) + b"x" * 0x10000
    with pytest.raises(ProtocolViolation) as info:
        read_kvps(Reader(too_long), 1)
    assert info.value.error_code == SessionError.PROTOCOL_VIOLATION


def test_kvp_type_sum_limit() -> None:
    big = encode_varint(VARINT_MAX)
    # four deltas of 2^62 - 1 stay within 2^64 - 1, a fifth goes beyond; "00" is an empty
    # value whichever the parity
    ok = (big + b"\x00") * 4
    assert read_kvps(Reader(ok), 4)[3][0] == 4 * VARINT_MAX
    with pytest.raises(ProtocolViolation):
        read_kvps(Reader(ok + big + b"\x00"), 5)


def test_kvp_block_truncated_is_formatting_error() -> None:
    with pytest.raises(KeyValueFormattingError) as info:
        decode_kvp_block(b"\x01\x05ab")
    assert info.value.error_code == SessionError.KEY_VALUE_FORMATTING_ERROR


kvp_lists = st.lists(
    st.one_of(
        st.tuples(st.integers(0, 2**40).map(lambda t: t * 2), st.integers(0, VARINT_MAX)),
        st.tuples(st.integers(0, 2**40).map(lambda t: t * 2 + 1), st.binary(max_size=40)),
    ),
    max_size=12,
).map(lambda pairs: sorted(pairs, key=lambda pair: pair[0]))


@given(kvp_lists)
def test_kvp_round_trip(pairs: list[tuple[int, int | bytes]]) -> None:
    encoded = encode_kvps(pairs)
    assert decode_kvp_block(encoded) == tuple(pairs)
    assert read_kvps(Reader(encoded), len(pairs)) == tuple(pairs)


def _cursor_decode(data: bytes) -> tuple[KeyValuePair, ...] | type[MOQTError]:
    """The Reader-based reading the fast block decoder must agree with."""
    try:
        return read_kvps_to_end(Reader(data))
    except NeedMoreData:
        return KeyValueFormattingError
    except MOQTError as exc:
        return type(exc)


@given(st.one_of(kvp_lists.map(encode_kvps), st.binary(max_size=64)))
def test_kvp_block_decoder_agrees_with_the_reader(data: bytes) -> None:
    """decode_kvp_block (the per-object fast path) parses or fails exactly as the Reader does,
    whether given bytes or a memoryview."""
    expected = _cursor_decode(data)
    for given_as in (data, memoryview(data), bytearray(data)):
        if isinstance(expected, tuple):
            assert decode_kvp_block(given_as) == expected
        else:
            with pytest.raises(expected):
                decode_kvp_block(given_as)


# --- Track Namespace / Full Track Name (§2.4.1) ------------------------------------------------


def _namespace_bytes(fields: list[bytes]) -> bytes:
    out = bytearray(encode_varint(len(fields)))
    for field in fields:
        out += encode_varint(len(field)) + field
    return bytes(out)


def test_namespace_round_trip() -> None:
    namespace = (b"kvsp", b"1", b"c0", b"s0", b"1")
    writer = Writer()
    push_namespace(writer, namespace)
    assert writer.data.hex() == "05046b76737001310263300273300131"
    assert read_namespace(Reader(writer.data)) == namespace


def test_namespace_field_count_limits() -> None:
    for count in (1, 32):
        fields = [b"a"] * count
        assert read_namespace(Reader(_namespace_bytes(fields))) == tuple(fields)
    for count in (0, 33):
        with pytest.raises(ProtocolViolation) as info:
            read_namespace(Reader(_namespace_bytes([b"a"] * count)))
        assert info.value.error_code == SessionError.PROTOCOL_VIOLATION
        with pytest.raises(ValueError):
            push_namespace(Writer(), [b"a"] * count)
    # a SUBSCRIBE_NAMESPACE prefix may have no fields, never 33
    assert read_namespace(Reader(b"\x00"), min_fields=0) == ()
    with pytest.raises(ProtocolViolation):
        read_namespace(Reader(_namespace_bytes([b"a"] * 33)), min_fields=0)


def test_namespace_empty_field_rejected() -> None:
    with pytest.raises(ProtocolViolation) as info:
        read_namespace(Reader(_namespace_bytes([b"a", b""])))
    assert info.value.error_code == SessionError.PROTOCOL_VIOLATION
    with pytest.raises(ValueError):
        push_namespace(Writer(), [b"a", b""])


def test_full_track_name_limit() -> None:
    namespace = [b"n" * 1000] * 4  # 4000 bytes
    for name, ok in ((b"t" * 96, True), (b"t" * 97, False)):
        data = _namespace_bytes(namespace) + encode_varint(len(name)) + name
        if ok:
            assert read_full_track_name(Reader(data)) == (tuple(namespace), name)
            writer = Writer()
            push_full_track_name(writer, namespace, name)
            assert writer.data == data
        else:
            with pytest.raises(ProtocolViolation) as info:
                read_full_track_name(Reader(data))
            assert info.value.error_code == SessionError.PROTOCOL_VIOLATION
            with pytest.raises(ValueError):
                push_full_track_name(Writer(), namespace, name)
    # the namespace alone beyond 4096 bytes
    with pytest.raises(ProtocolViolation):
        read_namespace(Reader(_namespace_bytes([b"n" * 4096, b"x"])))


def test_empty_track_name_allowed() -> None:
    data = _namespace_bytes([b"a"]) + b"\x00"
    assert read_full_track_name(Reader(data)) == ((b"a",), b"")


# --- Reason Phrase, Location (§1.4.1, §1.4.3) ----------------------------------------------------


def test_reason_phrase_limit() -> None:
    writer = Writer()
    push_reason(writer, "é" * 512)  # 1024 bytes of UTF-8
    assert read_reason(Reader(writer.data)) == "é" * 512
    writer = Writer()
    push_reason(writer, "x" * 1023 + "é")  # cut at a character boundary, not refused
    assert read_reason(Reader(writer.data)) == "x" * 1023
    with pytest.raises(ProtocolViolation):
        read_reason(Reader(encode_varint(1025) + b"x" * 1025))
    assert read_reason(Reader(b"\x02\xff\xfe")) == "\ufffd\ufffd"


def test_location_order() -> None:
    assert Location(1, 0) > Location(0, 99)
    assert Location(2, 3) < Location(2, 4)
    assert sorted([Location(1, 1), Location(0, 5), Location(1, 0)]) == [
        Location(0, 5),
        Location(1, 0),
        Location(1, 1),
    ]


# --- Control message framing (§9) --------------------------------------------------------------


def test_frame_control_message() -> None:
    assert frame_control_message(0x15, b"\x05").hex() == "15000105"
    assert len(frame_control_message(0x03, b"x" * 0xFFFF)) == 0xFFFF + 3
    with pytest.raises(ValueError):
        frame_control_message(0x03, b"x" * 0x10000)


def _stream() -> tuple[bytes, list[ControlFrame]]:
    frames = [ControlFrame(0x20, b"\x00"), ControlFrame(0x4000, b""), ControlFrame(3, b"x" * 300)]
    data = b"".join(frame_control_message(f.msg_type, f.payload) for f in frames)
    return data, frames


def _chunks(data: bytes, rng: random.Random) -> list[bytes]:
    out, pos = [], 0
    while pos < len(data):
        size = rng.randint(1, 40)
        out.append(data[pos : pos + size])
        pos += size
    return out


def test_control_stream_parser_chunkings() -> None:
    data, frames = _stream()
    assert ControlStreamParser().feed(data, end_stream=True) == frames
    parser = ControlStreamParser()
    got: list[ControlFrame] = []
    for i in range(len(data)):
        got += parser.feed(data[i : i + 1])
    assert got == frames and parser.buffered == 0
    rng = random.Random(7)
    for _ in range(20):
        parser, got = ControlStreamParser(), []
        for chunk in _chunks(data, rng):
            got += parser.feed(chunk)
        assert got == frames


def test_control_stream_end_inside_message() -> None:
    data, _ = _stream()
    parser = ControlStreamParser()
    parser.feed(data[:-1])
    with pytest.raises(ProtocolViolation):
        parser.feed(b"", end_stream=True)
    with pytest.raises(ValueError):
        parser.feed(b"x")


@given(st.binary(max_size=300), st.randoms(use_true_random=False))
def test_control_stream_parser_garbage(data: bytes, rng: random.Random) -> None:
    whole: list[ControlFrame] | None
    try:
        whole = ControlStreamParser().feed(data, end_stream=True)
    except MOQTError:
        whole = None
    parser, pieces = ControlStreamParser(), []
    try:
        for chunk in _chunks(data, rng):
            pieces += parser.feed(chunk)
        pieces += parser.feed(b"", end_stream=True)
    except MOQTError:
        assert whole is None
    else:
        assert pieces == whole
