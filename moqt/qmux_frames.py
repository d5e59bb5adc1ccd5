"""QMux records and the QUIC v1 frames they may carry (draft-ietf-quic-qmux-01 §3–§5, §7.1).

Pure encode/decode, no I/O. A QMux Record is ``Size (i)`` followed by whole QUIC v1 frames
(§3.2); only the frames of §4 and the QMux frames (QX_TRANSPORT_PARAMETERS §4.2, QX_PING §4.3)
are accepted, plus DATAGRAM (RFC 9221, §7.1). Transport parameters use the RFC 9000 §18
encoding with QMux's permitted/forbidden list (§5.1) and ``max_record_size`` (§5.2).

Shaped for bulk data: :func:`stream_frame_header` encodes only a STREAM frame's header, so the
payload stays the caller's buffer (``[header, payload view]`` for writev). Records arriving in
pieces are parsed by :class:`moqt.qmux_reader.RecordReader` with the decoders here.

Errors the peer caused raise :class:`QMuxError` carrying the QUIC transport error code
(RFC 9000 §20.1) and frame type the connection closes with.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TypeAlias

from .errors import NeedMoreData
from .wire import VARINT_MAX, Bytes, Reader, as_byte_view, encode_varint

QMUX_DRAFT = "draft-ietf-quic-qmux-01"
DEFAULT_MAX_RECORD_SIZE = 16382  # §5.2: a 2-byte Size plus 16,382 bytes = one TLS record
MAX_STREAMS_LIMIT = 1 << 60  # RFC 9000 §4.6


class TransportErrorCode(IntEnum):
    """QUIC transport error codes (RFC 9000 §20.1) QMux closes with."""

    NO_ERROR = 0x0
    INTERNAL_ERROR = 0x1
    CONNECTION_REFUSED = 0x2
    FLOW_CONTROL_ERROR = 0x3
    STREAM_LIMIT_ERROR = 0x4
    STREAM_STATE_ERROR = 0x5
    FINAL_SIZE_ERROR = 0x6
    FRAME_ENCODING_ERROR = 0x7
    TRANSPORT_PARAMETER_ERROR = 0x8
    PROTOCOL_VIOLATION = 0xA
    CRYPTO_ERROR = 0x100  # + TLS alert; 0x178 = no_application_protocol (RFC 9001 §4.8)


NO_APPLICATION_PROTOCOL = TransportErrorCode.CRYPTO_ERROR + 120  # RFC 7301 §3.2 alert 120


class FrameType(IntEnum):
    """Frame types QMux uses (RFC 9000 §19, RFC 9221 §4, qmux §4.2–§4.3)."""

    PADDING = 0x00
    RESET_STREAM = 0x04
    STOP_SENDING = 0x05
    STREAM = 0x08  # 0x08–0x0f: OFF 0x04, LEN 0x02, FIN 0x01
    MAX_DATA = 0x10
    MAX_STREAM_DATA = 0x11
    MAX_STREAMS_BIDI = 0x12
    MAX_STREAMS_UNI = 0x13
    DATA_BLOCKED = 0x14
    STREAM_DATA_BLOCKED = 0x15
    STREAMS_BLOCKED_BIDI = 0x16
    STREAMS_BLOCKED_UNI = 0x17
    CONNECTION_CLOSE = 0x1C
    CONNECTION_CLOSE_APP = 0x1D
    DATAGRAM = 0x30
    DATAGRAM_LEN = 0x31
    QX_TRANSPORT_PARAMETERS = 0x3F5153300D0A0D0A
    QX_PING_REQUEST = 0x348C67529EF8C7BD
    QX_PING_RESPONSE = 0x348C67529EF8C7BE


# §4: frames QMux forbids; receiving one is FRAME_ENCODING_ERROR
PROHIBITED_FRAMES = {
    0x01: "PING",
    0x02: "ACK",
    0x03: "ACK",
    0x06: "CRYPTO",
    0x07: "NEW_TOKEN",
    0x18: "NEW_CONNECTION_ID",
    0x19: "RETIRE_CONNECTION_ID",
    0x1A: "PATH_CHALLENGE",
    0x1B: "PATH_RESPONSE",
    0x1E: "HANDSHAKE_DONE",
}
STREAM_OFF, STREAM_LEN, STREAM_FIN = 0x04, 0x02, 0x01


class TransportParameterId(IntEnum):
    """Transport parameter IDs (RFC 9000 §18.2, RFC 9221 §3, qmux §5.2, moq-dev)."""

    MAX_IDLE_TIMEOUT = 0x01
    INITIAL_MAX_DATA = 0x04
    INITIAL_MAX_STREAM_DATA_BIDI_LOCAL = 0x05
    INITIAL_MAX_STREAM_DATA_BIDI_REMOTE = 0x06
    INITIAL_MAX_STREAM_DATA_UNI = 0x07
    INITIAL_MAX_STREAMS_BIDI = 0x08
    INITIAL_MAX_STREAMS_UNI = 0x09
    MAX_DATAGRAM_FRAME_SIZE = 0x20
    MAX_RECORD_SIZE = 0x0571C59429CD0845
    APPLICATION_PROTOCOLS = 0x3D4F9C2A8B1E6075  # moq-dev: the application protocol without ALPN


# §5.1: RFC 9000 parameters a QMux endpoint must refuse with TRANSPORT_PARAMETER_ERROR
FORBIDDEN_PARAMETERS = {
    0x00: "original_destination_connection_id",
    0x02: "stateless_reset_token",
    0x03: "max_udp_payload_size",
    0x0A: "ack_delay_exponent",
    0x0B: "max_ack_delay",
    0x0C: "disable_active_migration",
    0x0D: "preferred_address",
    0x0E: "active_connection_id_limit",
    0x0F: "initial_source_connection_id",
    0x10: "retry_source_connection_id",
}


class QMuxError(Exception):
    """A peer error: close the connection with ``error_code`` (RFC 9000 §20.1)."""

    def __init__(self, error_code: int, reason: str, frame_type: int | None = None) -> None:
        self.error_code = error_code
        self.reason = reason
        self.frame_type = frame_type
        super().__init__(f"{reason} (QUIC error {error_code:#x})")


def frame_encoding_error(reason: str, frame_type: int | None = None) -> QMuxError:
    """A FRAME_ENCODING_ERROR (RFC 9000 §12.4, qmux §3.2, §4)."""
    return QMuxError(TransportErrorCode.FRAME_ENCODING_ERROR, reason, frame_type)


# --- frames ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Padding:
    """A run of PADDING frames (RFC 9000 §19.1), one byte each."""

    length: int = 1


@dataclass(frozen=True, slots=True)
class ResetStream:
    """RESET_STREAM (RFC 9000 §19.4)."""

    stream_id: int
    error_code: int
    final_size: int


@dataclass(frozen=True, slots=True)
class StopSending:
    """STOP_SENDING (RFC 9000 §19.5)."""

    stream_id: int
    error_code: int


@dataclass(frozen=True, slots=True)
class StreamFrame:
    """A whole STREAM frame (RFC 9000 §19.8)."""

    stream_id: int
    offset: int
    data: Bytes
    fin: bool = False


@dataclass(frozen=True, slots=True)
class MaxData:
    """MAX_DATA (RFC 9000 §19.9)."""

    maximum: int


@dataclass(frozen=True, slots=True)
class MaxStreamData:
    """MAX_STREAM_DATA (RFC 9000 §19.10)."""

    stream_id: int
    maximum: int


@dataclass(frozen=True, slots=True)
class MaxStreams:
    """MAX_STREAMS bidi (0x12) or uni (0x13) (RFC 9000 §19.11)."""

    maximum: int
    unidirectional: bool


@dataclass(frozen=True, slots=True)
class DataBlocked:
    """DATA_BLOCKED (RFC 9000 §19.12)."""

    limit: int


@dataclass(frozen=True, slots=True)
class StreamDataBlocked:
    """STREAM_DATA_BLOCKED (RFC 9000 §19.13)."""

    stream_id: int
    limit: int


@dataclass(frozen=True, slots=True)
class StreamsBlocked:
    """STREAMS_BLOCKED bidi (0x16) or uni (0x17) (RFC 9000 §19.14)."""

    limit: int
    unidirectional: bool


@dataclass(frozen=True, slots=True)
class ConnectionClose:
    """CONNECTION_CLOSE (RFC 9000 §19.19): ``frame_type`` None is the application's (0x1d)."""

    error_code: int
    frame_type: int | None = None
    reason: bytes = b""


@dataclass(frozen=True, slots=True)
class Datagram:
    """DATAGRAM (RFC 9221 §4), written with a Length (0x31) unless ``with_length`` is False."""

    data: Bytes
    with_length: bool = True


@dataclass(frozen=True, slots=True)
class TransportParameters:
    """The QUIC transport parameters QMux uses (RFC 9000 §18.2, qmux §5).

    None means absent (the RFC 9000 default applies). ``application_protocols`` is the moq-dev
    list sent where no TLS ALPN exists (TCP, Unix sockets), in preference order.
    """

    max_idle_timeout: int | None = None  # milliseconds
    initial_max_data: int | None = None
    initial_max_stream_data_bidi_local: int | None = None
    initial_max_stream_data_bidi_remote: int | None = None
    initial_max_stream_data_uni: int | None = None
    initial_max_streams_bidi: int | None = None
    initial_max_streams_uni: int | None = None
    max_datagram_frame_size: int | None = None
    max_record_size: int | None = None
    application_protocols: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class QxTransportParameters:
    """QX_TRANSPORT_PARAMETERS (qmux §4.2): the first frame each endpoint sends."""

    parameters: TransportParameters = field(default_factory=TransportParameters)


@dataclass(frozen=True, slots=True)
class QxPing:
    """QX_PING request or response (qmux §4.3)."""

    sequence: int
    response: bool = False


Frame: TypeAlias = (
    Padding
    | ResetStream
    | StopSending
    | StreamFrame
    | MaxData
    | MaxStreamData
    | MaxStreams
    | DataBlocked
    | StreamDataBlocked
    | StreamsBlocked
    | ConnectionClose
    | Datagram
    | QxTransportParameters
    | QxPing
)


# --- encoding -------------------------------------------------------------------------------

_v = encode_varint


def stream_frame_header(stream_id: int, offset: int, length: int, fin: bool) -> bytes:
    """The header of a STREAM frame with an explicit Length (the payload follows unjoined)."""
    kind = FrameType.STREAM | STREAM_LEN | (STREAM_FIN if fin else 0)
    if offset:
        return b"".join((_v(kind | STREAM_OFF), _v(stream_id), _v(offset), _v(length)))
    return b"".join((_v(kind), _v(stream_id), _v(length)))


def encode_transport_parameters(params: TransportParameters) -> bytes:
    """RFC 9000 §18 encoding: ``ID (i), Length (i), Value`` per present parameter."""
    out = bytearray()
    for member in TransportParameterId:
        value = getattr(params, member.name.lower())
        if value is None:
            continue
        if member is TransportParameterId.APPLICATION_PROTOCOLS:
            data = encode_application_protocols(value)
        else:
            data = _v(value)
        out += _v(member) + _v(len(data)) + data
    return bytes(out)


def encode_application_protocols(names: Iterable[str]) -> bytes:
    """The moq-dev list: each name as ``Length (8)`` + ASCII bytes, in preference order.

    Raises:
        ValueError: an empty name or one longer than 255 bytes.
    """
    out = bytearray()
    for name in names:
        raw = name.encode("ascii")
        if not 0 < len(raw) < 256:
            raise ValueError(f"application protocol name must be 1-255 bytes: {name!r}")
        out.append(len(raw))
        out += raw
    return bytes(out)


def encode_frame(frame: Frame) -> bytes:
    """One frame's bytes (a STREAM frame with its payload joined: small frames and tests)."""
    if isinstance(frame, StreamFrame):
        return stream_frame_header(frame.stream_id, frame.offset, len(frame.data), frame.fin) + (
            bytes(frame.data)
        )
    if isinstance(frame, Padding):
        return bytes(frame.length)
    if isinstance(frame, Datagram):
        if frame.with_length:
            return _v(FrameType.DATAGRAM_LEN) + _v(len(frame.data)) + bytes(frame.data)
        return _v(FrameType.DATAGRAM) + bytes(frame.data)
    return b"".join(_v(part) if isinstance(part, int) else part for part in _fields(frame))


def _fields(frame: Frame) -> Sequence[int | bytes]:  # noqa: C901 - one arm per frame type
    if isinstance(frame, ResetStream):
        return (FrameType.RESET_STREAM, frame.stream_id, frame.error_code, frame.final_size)
    if isinstance(frame, StopSending):
        return (FrameType.STOP_SENDING, frame.stream_id, frame.error_code)
    if isinstance(frame, MaxData):
        return (FrameType.MAX_DATA, frame.maximum)
    if isinstance(frame, MaxStreamData):
        return (FrameType.MAX_STREAM_DATA, frame.stream_id, frame.maximum)
    if isinstance(frame, MaxStreams):
        kind = FrameType.MAX_STREAMS_UNI if frame.unidirectional else FrameType.MAX_STREAMS_BIDI
        return (kind, frame.maximum)
    if isinstance(frame, DataBlocked):
        return (FrameType.DATA_BLOCKED, frame.limit)
    if isinstance(frame, StreamDataBlocked):
        return (FrameType.STREAM_DATA_BLOCKED, frame.stream_id, frame.limit)
    if isinstance(frame, StreamsBlocked):
        uni = frame.unidirectional
        return (
            FrameType.STREAMS_BLOCKED_UNI if uni else FrameType.STREAMS_BLOCKED_BIDI,
            frame.limit,
        )
    if isinstance(frame, ConnectionClose):
        if frame.frame_type is None:
            head: tuple[int, ...] = (FrameType.CONNECTION_CLOSE_APP, frame.error_code)
        else:
            head = (FrameType.CONNECTION_CLOSE, frame.error_code, frame.frame_type)
        return (*head, len(frame.reason), frame.reason)
    if isinstance(frame, QxTransportParameters):
        data = encode_transport_parameters(frame.parameters)
        return (FrameType.QX_TRANSPORT_PARAMETERS, len(data), data)
    if isinstance(frame, QxPing):
        kind = FrameType.QX_PING_RESPONSE if frame.response else FrameType.QX_PING_REQUEST
        return (kind, frame.sequence)
    raise TypeError(f"not a QMux frame: {frame!r}")


def encode_record(frames: Sequence[Frame]) -> bytes:
    """One QMux record holding ``frames`` (§3.2)."""
    body = b"".join(encode_frame(frame) for frame in frames)
    return _v(len(body)) + body


# --- decoding -------------------------------------------------------------------------------


def decode_transport_parameters(data: Bytes) -> TransportParameters:
    """Parse RFC 9000 §18 transport parameters with QMux's rules (§5.1–§5.2).

    Unknown parameters are ignored (RFC 9000 §7.4.2).

    Raises:
        QMuxError: TRANSPORT_PARAMETER_ERROR for a forbidden, repeated, malformed or
            out-of-range parameter.
    """
    reader = Reader(data)
    seen: set[int] = set()
    values: dict[str, object] = {}
    try:
        while not reader.eof():
            param_id = reader.read_varint()
            value = reader.read_length_prefixed()
            if param_id in seen:
                raise _tp_error(f"transport parameter {param_id:#x} sent twice")
            seen.add(param_id)
            if param_id in FORBIDDEN_PARAMETERS:  # §5.1 MUST
                raise _tp_error(f"{FORBIDDEN_PARAMETERS[param_id]} is forbidden in QMux")
            _decode_parameter(param_id, value, values)
    except NeedMoreData:
        raise _tp_error("truncated transport parameters") from None
    params = TransportParameters(**values)  # type: ignore[arg-type]
    _check_parameters(params)
    return params


def _tp_error(reason: str) -> QMuxError:
    return QMuxError(
        TransportErrorCode.TRANSPORT_PARAMETER_ERROR, reason, FrameType.QX_TRANSPORT_PARAMETERS
    )


def _decode_parameter(param_id: int, value: memoryview, values: dict[str, object]) -> None:
    try:
        member = TransportParameterId(param_id)
    except ValueError:
        return  # unknown: ignored (RFC 9000 §7.4.2, qmux §5.1)
    if member is TransportParameterId.APPLICATION_PROTOCOLS:
        values["application_protocols"] = decode_application_protocols(value)
        return
    reader = Reader(value)
    try:
        number = reader.read_varint()
    except NeedMoreData:
        raise _tp_error(f"{member.name.lower()}: empty value") from None
    if not reader.eof():
        raise _tp_error(f"{member.name.lower()}: trailing bytes")
    values[member.name.lower()] = number


def _check_parameters(params: TransportParameters) -> None:
    for name in ("initial_max_streams_bidi", "initial_max_streams_uni"):
        value = getattr(params, name)
        if value is not None and value > MAX_STREAMS_LIMIT:  # RFC 9000 §4.6
            raise _tp_error(f"{name} above 2^60")
    size = params.max_record_size
    if size is not None and size < DEFAULT_MAX_RECORD_SIZE:  # §5.2 MUST
        raise _tp_error(f"max_record_size {size} below the default {DEFAULT_MAX_RECORD_SIZE}")


def decode_application_protocols(data: Bytes) -> tuple[str, ...]:
    """Parse the moq-dev application-protocol list.

    Raises:
        QMuxError: TRANSPORT_PARAMETER_ERROR for a truncated list or a non-ASCII name.
    """
    view = as_byte_view(data)
    names: list[str] = []
    pos = 0
    while pos < len(view):
        end = pos + 1 + view[pos]
        if end > len(view) or view[pos] == 0:
            raise _tp_error("malformed application_protocols")
        try:
            names.append(bytes(view[pos + 1 : end]).decode("ascii"))
        except UnicodeDecodeError:
            raise _tp_error("non-ASCII application protocol name") from None
        pos = end
    return tuple(names)


def decode_frames(payload: Bytes) -> list[Frame]:
    """Every frame of one record's Frames field, STREAM payloads as slices of ``payload``.

    Raises:
        QMuxError: FRAME_ENCODING_ERROR for a prohibited, unknown or truncated frame.
    """
    view = as_byte_view(payload)
    frames: list[Frame] = []
    pos, end = 0, len(view)
    while pos < end:
        frame, pos = _decode_frame(view, pos, end)
        frames.append(frame)
    return frames


def _decode_frame(view: memoryview, pos: int, end: int) -> tuple[Frame, int]:
    """One whole frame at ``pos``; the record (or its end) is at ``end``."""
    reader = Reader.at(view[:end], pos)
    try:
        kind = reader.read_varint()
        if STREAM_LEN & kind and FrameType.STREAM <= kind <= 0x0F:
            stream_id, offset, length, fin = read_stream_header(reader, kind)
            data = reader.read_bytes(length)
            return StreamFrame(stream_id, offset, data, fin), reader.position
        if FrameType.STREAM <= kind <= 0x0F:  # no Length: up to the end of the record
            stream_id, offset, _, fin = read_stream_header(reader, kind)
            return StreamFrame(stream_id, offset, reader.read_rest(), fin), end
        return decode_other_frame(kind, reader, view, pos, end)
    except NeedMoreData:
        raise frame_encoding_error("truncated frame at the end of a record") from None


def read_stream_header(reader: Reader, kind: int) -> tuple[int, int, int, bool]:
    """A STREAM frame's Stream ID, Offset, Length (-1: none, up to the record end) and FIN."""
    stream_id = reader.read_varint()
    offset = reader.read_varint() if kind & STREAM_OFF else 0
    length = reader.read_varint() if kind & STREAM_LEN else -1
    if offset + max(length, 0) > VARINT_MAX:  # RFC 9000 §19.8
        raise frame_encoding_error("STREAM frame beyond 2^62", kind)
    return stream_id, offset, length, bool(kind & STREAM_FIN)


def decode_other_frame(  # noqa: C901 - one arm per frame type, like a dispatch table
    kind: int, reader: Reader, view: memoryview, pos: int, end: int
) -> tuple[Frame, int]:
    """A whole non-STREAM frame of type ``kind`` (read) at ``pos``; ``end`` ends its record.

    Raises:
        NeedMoreData: the frame is not complete before ``end``.
        QMuxError: a prohibited, unknown or malformed frame.
    """
    read = reader.read_varint
    frame: Frame
    if kind == FrameType.PADDING:
        stop = reader.position
        while stop < end and view[stop] == 0:
            stop += 1
        return Padding(stop - pos), stop
    if kind == FrameType.RESET_STREAM:
        frame = ResetStream(read(), read(), read())
    elif kind == FrameType.STOP_SENDING:
        frame = StopSending(read(), read())
    elif kind == FrameType.MAX_DATA:
        frame = MaxData(read())
    elif kind == FrameType.MAX_STREAM_DATA:
        frame = MaxStreamData(read(), read())
    elif kind in (FrameType.MAX_STREAMS_BIDI, FrameType.MAX_STREAMS_UNI):
        frame = MaxStreams(_stream_count(read(), kind), kind == FrameType.MAX_STREAMS_UNI)
    elif kind == FrameType.DATA_BLOCKED:
        frame = DataBlocked(read())
    elif kind == FrameType.STREAM_DATA_BLOCKED:
        frame = StreamDataBlocked(read(), read())
    elif kind in (FrameType.STREAMS_BLOCKED_BIDI, FrameType.STREAMS_BLOCKED_UNI):
        frame = StreamsBlocked(_stream_count(read(), kind), kind == FrameType.STREAMS_BLOCKED_UNI)
    elif kind in (FrameType.CONNECTION_CLOSE, FrameType.CONNECTION_CLOSE_APP):
        code = read()
        frame_type = read() if kind == FrameType.CONNECTION_CLOSE else None
        frame = ConnectionClose(code, frame_type, bytes(reader.read_length_prefixed()))
    elif kind == FrameType.DATAGRAM:
        return Datagram(bytes(reader.read_rest()), with_length=False), end
    elif kind == FrameType.DATAGRAM_LEN:
        frame = Datagram(bytes(reader.read_length_prefixed()))
    elif kind == FrameType.QX_TRANSPORT_PARAMETERS:
        frame = QxTransportParameters(decode_transport_parameters(reader.read_length_prefixed()))
    elif kind in (FrameType.QX_PING_REQUEST, FrameType.QX_PING_RESPONSE):
        frame = QxPing(read(), kind == FrameType.QX_PING_RESPONSE)
    elif kind in PROHIBITED_FRAMES:  # §4 MUST
        raise frame_encoding_error(f"{PROHIBITED_FRAMES[kind]} frames are prohibited in QMux", kind)
    else:  # RFC 9000 §12.4: unknown frame types
        raise frame_encoding_error(f"unknown frame type {kind:#x}", kind)
    return frame, reader.position


def _stream_count(value: int, kind: int) -> int:
    if value > MAX_STREAMS_LIMIT:  # RFC 9000 §19.11
        raise frame_encoding_error("stream count above 2^60", kind)
    return value
