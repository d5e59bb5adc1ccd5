"""moqt.qmux_frames: QMux records, the QUIC v1 frames they carry and transport parameters
(draft-ietf-quic-qmux-01 §3.2, §4, §5; RFC 9000 §18, §19; RFC 9221 §4).

Every frame kind round-trips through a record (hypothesis); record streams parse the same fed
whole, one byte at a time and in random chunks; malformed input raises :class:`QMuxError` with
the draft's code, never anything else.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moqt.qmux import QMuxConfig
from moqt.qmux_frames import (
    DEFAULT_MAX_RECORD_SIZE,
    FORBIDDEN_PARAMETERS,
    PROHIBITED_FRAMES,
    ConnectionClose,
    DataBlocked,
    Datagram,
    Frame,
    MaxData,
    MaxStreamData,
    MaxStreams,
    Padding,
    QMuxError,
    QxPing,
    QxTransportParameters,
    ResetStream,
    StopSending,
    StreamDataBlocked,
    StreamFrame,
    StreamsBlocked,
    TransportErrorCode,
    TransportParameters,
    decode_frames,
    decode_transport_parameters,
    encode_frame,
    encode_record,
    encode_transport_parameters,
    stream_frame_header,
)
from moqt.qmux_reader import RECORD_END, Received, RecordReader, StreamPiece
from moqt.wire import encode_varint

VARINT = st.integers(0, (1 << 62) - 1)
COUNT = st.integers(0, 1 << 60)
NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-.", min_size=1, max_size=20)

TRANSPORT_PARAMETERS = st.builds(
    TransportParameters,
    max_idle_timeout=st.none() | VARINT,
    initial_max_data=st.none() | VARINT,
    initial_max_stream_data_bidi_local=st.none() | VARINT,
    initial_max_stream_data_bidi_remote=st.none() | VARINT,
    initial_max_stream_data_uni=st.none() | VARINT,
    initial_max_streams_bidi=st.none() | COUNT,
    initial_max_streams_uni=st.none() | COUNT,
    max_datagram_frame_size=st.none() | VARINT,
    max_record_size=st.none() | st.integers(DEFAULT_MAX_RECORD_SIZE, (1 << 62) - 1),
    application_protocols=st.none() | st.lists(NAMES, min_size=1, max_size=5).map(tuple),
)
FRAMES: st.SearchStrategy[Frame] = st.one_of(
    st.integers(1, 5).map(Padding),
    st.builds(ResetStream, VARINT, VARINT, VARINT),
    st.builds(StopSending, VARINT, VARINT),
    st.builds(StreamFrame, VARINT, st.integers(0, 1 << 40), st.binary(max_size=300), st.booleans()),
    st.builds(MaxData, VARINT),
    st.builds(MaxStreamData, VARINT, VARINT),
    st.builds(MaxStreams, COUNT, st.booleans()),
    st.builds(DataBlocked, VARINT),
    st.builds(StreamDataBlocked, VARINT, VARINT),
    st.builds(StreamsBlocked, COUNT, st.booleans()),
    st.builds(ConnectionClose, VARINT, st.none() | VARINT, st.binary(max_size=40)),
    st.builds(Datagram, st.binary(max_size=200)),
    st.builds(QxTransportParameters, TRANSPORT_PARAMETERS),
    st.builds(QxPing, VARINT, st.booleans()),
)
RECORDS = st.lists(st.lists(FRAMES, min_size=1, max_size=6), min_size=1, max_size=4)


def merged(frames: Sequence[Frame]) -> list[Frame]:
    """Adjacent PADDING frames decode as one run."""
    out: list[Frame] = []
    for frame in frames:
        if isinstance(frame, Padding) and out and isinstance(out[-1], Padding):
            out[-1] = Padding(out[-1].length + frame.length)
        else:
            out.append(frame)
    return out


def feed_chunks(data: bytes, cuts: Sequence[int], max_record: int = 1 << 20) -> list[Received]:
    reader = RecordReader(max_record)
    out: list[Received] = []
    start = 0
    for cut in [*sorted(cuts), len(data)]:
        out += reader.feed(data[start:cut])
        start = cut
    assert reader.buffered == 0
    return out


def reassemble(items: Sequence[Received]) -> list[list[Frame]]:
    """Records of whole frames from the reader's output (STREAM pieces joined)."""
    records: list[list[Frame]] = [[]]
    piece_frame: StreamFrame | None = None
    for item in items:
        if item is RECORD_END:
            records.append([])
        elif isinstance(item, StreamPiece):
            if piece_frame is None or item.offset != piece_frame.offset + len(piece_frame.data):
                piece_frame = StreamFrame(item.stream_id, item.offset, b"", item.fin)
                records[-1].append(piece_frame)
                head = piece_frame
            else:
                head = piece_frame
            joined = StreamFrame(
                head.stream_id, head.offset, bytes(head.data) + bytes(item.data), item.fin
            )
            records[-1][records[-1].index(head)] = joined
            piece_frame = joined
            if item.offset + len(item.data) == item.frame_end:
                piece_frame = None
        else:
            records[-1].append(item)
    assert records[-1] == []
    return records[:-1]


def error_of(data: bytes, max_record: int = 1 << 20) -> QMuxError:
    with pytest.raises(QMuxError) as caught:
        RecordReader(max_record).feed(data)
    return caught.value


def record(payload: bytes) -> bytes:
    return encode_varint(len(payload)) + payload


# --- round trips ----------------------------------------------------------------------------


@settings(max_examples=300)
@given(FRAMES)
def test_every_frame_round_trips_through_a_record(frame: Frame) -> None:
    data = encode_record([frame])
    size = data[0] >> 6
    assert decode_frames(data[1 << size :]) == [frame]


@given(TRANSPORT_PARAMETERS)
def test_transport_parameters_round_trip(params: TransportParameters) -> None:
    assert decode_transport_parameters(encode_transport_parameters(params)) == params


@settings(max_examples=200)
@given(RECORDS, st.data())
def test_records_parse_the_same_in_any_chunking(
    records: list[list[Frame]], data: st.DataObject
) -> None:
    stream = b"".join(encode_record(frames) for frames in records)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=12))
    assert reassemble(feed_chunks(stream, cuts)) == [merged(frames) for frames in records]


@settings(max_examples=30)
@given(RECORDS)
def test_records_parse_one_byte_at_a_time(records: list[list[Frame]]) -> None:
    stream = b"".join(encode_record(frames) for frames in records)
    assert reassemble(feed_chunks(stream, range(len(stream)))) == [
        merged(frames) for frames in records
    ]


def test_stream_payload_in_one_chunk_is_a_slice_of_it() -> None:
    payload = bytes(range(256)) * 64
    chunk = encode_record([StreamFrame(4, 0, payload, True)])
    piece, end = RecordReader(1 << 20).feed(chunk)
    assert isinstance(piece, StreamPiece) and end is RECORD_END
    assert piece.data.obj is chunk and piece.data == payload and piece.fin


def test_stream_payload_across_chunks_is_handed_out_as_it_arrives() -> None:
    payload = b"x" * 100_000
    data = encode_record([StreamFrame(2, 7, payload)])
    reader = RecordReader(1 << 20)
    first = reader.feed(data[:50_000])
    assert isinstance(first[0], StreamPiece) and first[0].frame_end == 7 + len(payload)
    assert reader.buffered == 0  # nothing copied: the payload went out as a slice
    rest = reader.feed(data[50_000:])
    got = b"".join(bytes(p.data) for p in [*first, *rest] if isinstance(p, StreamPiece))
    assert got == payload and rest[-1] is RECORD_END


def test_frames_without_length_run_to_the_record_end() -> None:
    stream = bytes([0x08]) + encode_varint(8) + b"abc"  # STREAM without OFF and LEN
    assert decode_frames(stream) == [StreamFrame(8, 0, b"abc")]
    pieces = [i for i in feed_chunks(record(stream), [1, 3]) if isinstance(i, StreamPiece)]
    assert b"".join(bytes(p.data) for p in pieces) == b"abc"
    assert {p.frame_end for p in pieces} == {3}
    datagram = bytes([0x30]) + b"dgram"
    items = feed_chunks(record(datagram), [1, 3])
    assert items == [Datagram(b"dgram", with_length=False), RECORD_END]


# --- malformed input ------------------------------------------------------------------------


def test_truncated_last_frame_is_a_frame_encoding_error() -> None:
    whole = encode_frame(MaxStreamData(4, 1 << 20))
    for cut in range(1, len(whole)):
        error = error_of(record(whole[:cut]))
        assert error.error_code == TransportErrorCode.FRAME_ENCODING_ERROR


def test_stream_frame_running_past_its_record_is_a_frame_encoding_error() -> None:
    frame = stream_frame_header(0, 0, 10, False) + b"12345"
    assert error_of(record(frame)).error_code == TransportErrorCode.FRAME_ENCODING_ERROR


@pytest.mark.parametrize("frame_type", sorted(PROHIBITED_FRAMES))
def test_prohibited_frames_are_frame_encoding_errors(frame_type: int) -> None:
    error = error_of(record(encode_varint(frame_type) + bytes(16)))
    assert error.error_code == TransportErrorCode.FRAME_ENCODING_ERROR
    assert error.frame_type == frame_type


def test_unknown_frame_type_is_a_frame_encoding_error() -> None:
    error = error_of(record(encode_varint(0x24) + bytes(8)))  # RESET_STREAM_AT, not negotiated
    assert error.error_code == TransportErrorCode.FRAME_ENCODING_ERROR


def test_record_above_our_max_record_size_is_a_frame_encoding_error() -> None:
    data = encode_record([Datagram(b"x" * (DEFAULT_MAX_RECORD_SIZE + 1))])
    error = error_of(data[:8], max_record=DEFAULT_MAX_RECORD_SIZE)
    assert error.error_code == TransportErrorCode.FRAME_ENCODING_ERROR


def test_empty_record_is_a_frame_encoding_error() -> None:
    assert error_of(b"\x00").error_code == TransportErrorCode.FRAME_ENCODING_ERROR


def test_stream_count_above_2_60_is_a_frame_encoding_error() -> None:
    data = record(encode_varint(0x12) + encode_varint((1 << 60) + 1))
    assert error_of(data).error_code == TransportErrorCode.FRAME_ENCODING_ERROR


def tp_bytes(*pairs: tuple[int, bytes]) -> bytes:
    return b"".join(encode_varint(pid) + encode_varint(len(v)) + v for pid, v in pairs)


@pytest.mark.parametrize("param_id", sorted(FORBIDDEN_PARAMETERS))
def test_forbidden_transport_parameters_are_refused(param_id: int) -> None:
    with pytest.raises(QMuxError) as caught:
        decode_transport_parameters(tp_bytes((param_id, encode_varint(1))))
    assert caught.value.error_code == TransportErrorCode.TRANSPORT_PARAMETER_ERROR


def test_max_record_size_below_the_default_is_refused() -> None:
    small = encode_varint(DEFAULT_MAX_RECORD_SIZE - 1)
    with pytest.raises(QMuxError) as caught:
        decode_transport_parameters(tp_bytes((0x0571C59429CD0845, small)))
    assert caught.value.error_code == TransportErrorCode.TRANSPORT_PARAMETER_ERROR
    with pytest.raises(ValueError, match="max_record_size"):
        QMuxConfig(max_record_size=DEFAULT_MAX_RECORD_SIZE - 1)


@pytest.mark.parametrize(
    "data",
    [
        tp_bytes((0x04, encode_varint(1)), (0x04, encode_varint(2))),  # twice
        tp_bytes((0x04, encode_varint(1) + b"x")),  # trailing bytes
        tp_bytes((0x04, b"")),  # empty value
        tp_bytes((0x08, encode_varint((1 << 60) + 1))),  # stream count above 2^60
        tp_bytes((0x3D4F9C2A8B1E6075, b"\x05moq")),  # truncated protocol list
        encode_varint(0x04) + encode_varint(4) + b"\x01",  # truncated parameter
    ],
)
def test_malformed_transport_parameters_are_refused(data: bytes) -> None:
    with pytest.raises(QMuxError) as caught:
        decode_transport_parameters(data)
    assert caught.value.error_code == TransportErrorCode.TRANSPORT_PARAMETER_ERROR


def test_unknown_transport_parameters_are_ignored() -> None:
    data = tp_bytes((0x1B, b"\x01\x02"), (0x04, encode_varint(9)), (0x20 + 31 * 5, b""))
    assert decode_transport_parameters(data) == TransportParameters(initial_max_data=9)


@settings(max_examples=300)
@given(st.binary(max_size=200), st.lists(st.integers(0, 200), max_size=6))
def test_garbage_parses_or_raises_qmux_error(data: bytes, cuts: list[int]) -> None:
    reader = RecordReader(DEFAULT_MAX_RECORD_SIZE)
    start = 0
    try:
        for cut in [*sorted(c for c in cuts if c <= len(data)), len(data)]:
            reader.feed(data[start:cut])
            start = cut
    except QMuxError as exc:
        assert exc.error_code in (
            TransportErrorCode.FRAME_ENCODING_ERROR,
            TransportErrorCode.TRANSPORT_PARAMETER_ERROR,
        )
