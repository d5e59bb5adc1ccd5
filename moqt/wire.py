"""MOQT draft-16 framing primitives (§1.4, §2.4.1, §9): varints, Key-Value-Pairs, names, framing.

Pure encode/decode, no I/O. :class:`Reader` walks a memoryview and raises
:class:`~moqt.errors.NeedMoreData` when the input is short; :class:`Writer` appends to a
bytearray. :class:`ControlStreamParser` cuts a control (or SUBSCRIBE_NAMESPACE) stream fed in
arbitrary chunks into whole ``Type (i), Length (16), Payload`` frames.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from .errors import KeyValueFormattingError, NeedMoreData, ProtocolViolation

VARINT_MAX = (1 << 62) - 1
KVP_TYPE_MAX = (1 << 64) - 1  # §1.4.2: previous Type + Delta MUST NOT exceed 2^64 - 1
KVP_VALUE_MAX_LENGTH = 0xFFFF  # §1.4.2: odd-type values are at most 2^16 - 1 bytes
REASON_PHRASE_MAX = 1024  # §1.4.3
NAMESPACE_MAX_FIELDS = 32  # §2.4.1
FULL_TRACK_NAME_MAX = 4096  # §2.4.1
CONTROL_PAYLOAD_MAX = 0xFFFF  # §9: Length is 16 bits

UINT16 = struct.Struct("!H")
VARINT_2 = struct.Struct("!H")
VARINT_4 = struct.Struct("!I")
VARINT_8 = struct.Struct("!Q")
CONTROL_LENGTH = UINT16  # §9 "Length (16)" after the message type

_VARINT_MASK = {1: 0x3F, 2: 0x3FFF, 4: 0x3FFFFFFF, 8: 0x3FFFFFFFFFFFFFFF}

Bytes: TypeAlias = bytes | bytearray | memoryview
KeyValuePair: TypeAlias = tuple[int, int | bytes]
"""A Key-Value-Pair with its absolute Type: even Type → int value, odd Type → bytes (§1.4.2)."""
TrackNamespace: TypeAlias = tuple[bytes, ...]


def varint_size(value: int) -> int:
    """Number of bytes of the minimal QUIC varint encoding of ``value`` (RFC 9000 §16).

    Raises:
        ValueError: ``value`` is negative or ≥ 2^62.
    """
    if value < 0:
        raise ValueError(f"varint cannot be negative: {value}")
    if value <= 0x3F:
        return 1
    if value <= 0x3FFF:
        return 2
    if value <= 0x3FFFFFFF:
        return 4
    if value <= VARINT_MAX:
        return 8
    raise ValueError(f"varint too large: {value}")


def encode_varint(value: int) -> bytes:
    """Minimal QUIC varint encoding (§1.4: varints SHOULD be minimal).

    Raises:
        ValueError: ``value`` is negative or ≥ 2^62.
    """
    size = varint_size(value)
    if size == 1:
        return bytes((value,))
    if size == 2:
        return VARINT_2.pack(value | 0x4000)
    if size == 4:
        return VARINT_4.pack(value | 0x80000000)
    return VARINT_8.pack(value | 0xC000000000000000)


def decode_varint(data: Bytes) -> tuple[int, int]:
    """Decode one varint at the start of ``data``; returns ``(value, size)``.

    Non-minimal encodings are accepted: minimality is only a SHOULD for the sender (§1.4).

    Raises:
        ProtocolViolation: ``data`` ends inside the varint.
    """
    reader = Reader(data)
    try:
        value = reader.read_varint()
    except NeedMoreData:
        raise ProtocolViolation("truncated varint") from None
    return value, reader.position


def as_byte_view(data: Bytes) -> memoryview:
    """A flat unsigned-byte memoryview over ``data`` (zero copy)."""
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


@dataclass(frozen=True, slots=True, order=True)
class Location:
    """``Location {Group (i), Object (i)}``, ordered lexicographically (§1.4.1)."""

    group: int
    object: int


class Reader:
    """Cursor over a memoryview; every ``read_*`` raises :class:`NeedMoreData` when short.

    Slices come back as memoryviews of the input, never copies.
    """

    __slots__ = ("_view", "_pos", "_end")

    def __init__(self, data: Bytes, start: int = 0) -> None:
        self._view = as_byte_view(data)
        self._pos = start
        self._end = len(self._view)

    @classmethod
    def at(cls, view: memoryview, start: int) -> Reader:
        """A reader of the flat byte view ``view`` from ``start`` (no re-wrapping, no slice:
        the data-stream parser reads every object header this way); ``position`` counts from
        the start of ``view``."""
        reader = cls.__new__(cls)
        reader._view = view
        reader._pos = start
        reader._end = len(view)
        return reader

    @property
    def position(self) -> int:
        """Where the cursor is: bytes consumed so far, plus ``start``."""
        return self._pos

    @property
    def remaining(self) -> int:
        """Bytes left after the cursor."""
        return self._end - self._pos

    def eof(self) -> bool:
        """True when every byte has been consumed."""
        return self._pos >= self._end

    def read_varint(self) -> int:
        """Read one QUIC varint (1, 2, 4 or 8 bytes by its 2-bit prefix)."""
        pos = self._pos
        if pos >= self._end:
            raise NeedMoreData
        first = self._view[pos]
        size = 1 << (first >> 6)
        if size == 1:
            self._pos = pos + 1
            return first
        if pos + size > self._end:
            raise NeedMoreData
        self._pos = pos + size
        return int.from_bytes(self._view[pos : pos + size], "big") & _VARINT_MASK[size]

    def read_uint8(self) -> int:
        """Read one byte as an unsigned integer, e.g. ``Publisher Priority (8)``."""
        pos = self._pos
        if pos >= self._end:
            raise NeedMoreData
        self._pos = pos + 1
        return self._view[pos]

    def read_uint16(self) -> int:
        """Read a big-endian 16-bit unsigned integer."""
        pos = self._pos
        if pos + 2 > self._end:
            raise NeedMoreData
        self._pos = pos + 2
        value: int = UINT16.unpack_from(self._view, pos)[0]
        return value

    def read_bytes(self, length: int) -> memoryview:
        """Read ``length`` bytes as a zero-copy memoryview slice."""
        pos = self._pos
        if length > self._end - pos:
            raise NeedMoreData
        self._pos = pos + length
        return self._view[pos : pos + length]

    def read_rest(self) -> memoryview:
        """Consume and return everything after the cursor (zero copy)."""
        return self.read_bytes(self._end - self._pos)

    def read_length_prefixed(self) -> memoryview:
        """Read ``Length (i)`` followed by that many bytes (zero copy)."""
        return self.read_bytes(self.read_varint())


class Writer:
    """Append-only encoder into a bytearray."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def __len__(self) -> int:
        return len(self._buf)

    @property
    def data(self) -> bytes:
        """The bytes written so far."""
        return bytes(self._buf)

    def push_varint(self, value: int) -> None:
        """Append a minimal QUIC varint.

        Raises:
            ValueError: ``value`` is negative or ≥ 2^62.
        """
        if 0 <= value <= 0x3F:
            self._buf.append(value)
        else:
            self._buf += encode_varint(value)

    def push_uint8(self, value: int) -> None:
        """Append one byte.

        Raises:
            ValueError: ``value`` is outside 0..255.
        """
        self._buf.append(value)

    def push_uint16(self, value: int) -> None:
        """Append a big-endian 16-bit unsigned integer.

        Raises:
            struct.error: ``value`` is outside 0..65535.
        """
        self._buf += UINT16.pack(value)

    def push_bytes(self, data: Bytes) -> None:
        """Append raw bytes."""
        self._buf += data

    def push_length_prefixed(self, data: Bytes) -> None:
        """Append ``Length (i)`` followed by ``data``."""
        self.push_varint(len(data))
        self._buf += data


# --- Key-Value-Pairs (§1.4.2) -----------------------------------------------------------------


def push_kvps(writer: Writer, pairs: Iterable[KeyValuePair]) -> None:
    """Append Key-Value-Pairs with delta-encoded Types, in ascending Type order (§1.4.2).

    The pairs are sorted by Type (stably, so repeated Types keep their order); no count is
    written (callers that need ``Number of Parameters`` write it themselves).

    Raises:
        ValueError: a Type's parity does not match its value (even → int, odd → bytes), or an
            odd value is longer than 65535 bytes.
    """
    previous = 0
    for kvp_type, value in sorted(pairs, key=lambda pair: pair[0]):
        writer.push_varint(kvp_type - previous)
        previous = kvp_type
        if kvp_type % 2 == 0:
            if not isinstance(value, int):
                raise ValueError(f"KVP type {kvp_type:#x} is even: value must be an int")
            writer.push_varint(value)
        else:
            if not isinstance(value, bytes | bytearray | memoryview):
                raise ValueError(f"KVP type {kvp_type:#x} is odd: value must be bytes")
            if len(value) > KVP_VALUE_MAX_LENGTH:
                raise ValueError(f"KVP type {kvp_type:#x}: value longer than 65535 bytes")
            writer.push_length_prefixed(value)


def encode_kvps(pairs: Iterable[KeyValuePair]) -> bytes:
    """Key-Value-Pairs as bytes (no count), see :func:`push_kvps`."""
    writer = Writer()
    push_kvps(writer, pairs)
    return writer.data


def _read_kvp(reader: Reader, previous: int) -> KeyValuePair:
    kvp_type = previous + reader.read_varint()
    if kvp_type > KVP_TYPE_MAX:
        # §1.4.2: a Type above 2^64 - 1 MUST close the session with PROTOCOL_VIOLATION
        raise ProtocolViolation(f"Key-Value-Pair type {kvp_type:#x} exceeds 2^64 - 1")
    if kvp_type % 2 == 0:
        return kvp_type, reader.read_varint()
    length = reader.read_varint()
    if length > KVP_VALUE_MAX_LENGTH:
        # §1.4.2: a length above 2^16 - 1 MUST close the session with PROTOCOL_VIOLATION
        raise ProtocolViolation(f"Key-Value-Pair type {kvp_type:#x}: length {length} > 65535")
    return kvp_type, bytes(reader.read_bytes(length))


def read_kvps(reader: Reader, count: int) -> tuple[KeyValuePair, ...]:
    """Read ``count`` delta-encoded Key-Value-Pairs.

    Raises:
        NeedMoreData: the input ends first.
        ProtocolViolation: a Type above 2^64 - 1, or a value length above 65535.
    """
    pairs: list[KeyValuePair] = []
    previous = 0
    for _ in range(count):
        pair = _read_kvp(reader, previous)
        previous = pair[0]
        pairs.append(pair)
    return tuple(pairs)


def read_kvps_to_end(reader: Reader) -> tuple[KeyValuePair, ...]:
    """Read delta-encoded Key-Value-Pairs until the reader is exhausted (Track Extensions).

    Raises:
        NeedMoreData: the last pair is truncated.
        ProtocolViolation: a Type above 2^64 - 1, or a value length above 65535.
    """
    pairs: list[KeyValuePair] = []
    previous = 0
    while not reader.eof():
        pair = _read_kvp(reader, previous)
        previous = pair[0]
        pairs.append(pair)
    return tuple(pairs)


def _varint_at(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """The varint at ``buf[pos]`` and the position after it; NeedMoreData when short."""
    if pos >= end:
        raise NeedMoreData
    first = buf[pos]
    size = 1 << (first >> 6)
    if size == 1:
        return first, pos + 1
    if pos + size > end:
        raise NeedMoreData
    return int.from_bytes(buf[pos : pos + size], "big") & _VARINT_MASK[size], pos + size


def decode_kvp_block(data: Bytes) -> tuple[KeyValuePair, ...]:
    """Decode a block made only of Key-Value-Pairs (an Extensions body or a nested KVP value).

    The same rules as :func:`read_kvps_to_end`, over the block's octets directly: objects
    carry one such block (often two, nested), so this runs once or twice per object received.

    Raises:
        KeyValueFormattingError: the block does not parse as whole Key-Value-Pairs.
        ProtocolViolation: a Type above 2^64 - 1, or a value length above 65535.
    """
    buf = data if type(data) is bytes else bytes(data)
    end = len(buf)
    pos = previous = 0
    pairs: list[KeyValuePair] = []
    try:
        while pos < end:
            delta, pos = _varint_at(buf, pos, end)
            kvp_type = previous + delta
            if kvp_type > KVP_TYPE_MAX:
                # §1.4.2: a Type above 2^64 - 1 MUST close the session with PROTOCOL_VIOLATION
                raise ProtocolViolation(f"Key-Value-Pair type {kvp_type:#x} exceeds 2^64 - 1")
            value, pos = _varint_at(buf, pos, end)
            if kvp_type & 1:
                if value > KVP_VALUE_MAX_LENGTH:
                    raise ProtocolViolation(
                        f"Key-Value-Pair type {kvp_type:#x}: length {value} > 65535"
                    )
                if pos + value > end:
                    raise NeedMoreData
                pairs.append((kvp_type, buf[pos : pos + value]))
                pos += value
            else:
                pairs.append((kvp_type, value))
            previous = kvp_type
    except NeedMoreData:
        raise KeyValueFormattingError("Key-Value-Pair block ends inside a pair") from None
    return tuple(pairs)


# --- Track Namespace, Track Name, Reason Phrase (§1.4.3, §2.4.1) ------------------------------


def namespace_problem(namespace: Sequence[Bytes], *, min_fields: int = 1) -> str | None:
    """Why ``namespace`` breaks §2.4.1 (field count, empty field, 4096-byte total), or None."""
    if not min_fields <= len(namespace) <= NAMESPACE_MAX_FIELDS:
        return f"track namespace has {len(namespace)} fields, allowed {min_fields}..32"
    total = 0
    for field in namespace:
        if len(field) == 0:
            return "track namespace field is empty"
        total += len(field)
    if total > FULL_TRACK_NAME_MAX:
        return f"track namespace is {total} bytes, more than 4096"
    return None


def push_namespace(writer: Writer, namespace: Sequence[Bytes], *, min_fields: int = 1) -> None:
    """Append a Track Namespace: ``Number of Fields (i)`` then ``{Length (i), bytes}`` each.

    Raises:
        ValueError: the namespace breaks §2.4.1 (see :func:`namespace_problem`).
    """
    problem = namespace_problem(namespace, min_fields=min_fields)
    if problem is not None:
        raise ValueError(problem)
    writer.push_varint(len(namespace))
    for field in namespace:
        writer.push_length_prefixed(field)


def read_namespace(reader: Reader, *, min_fields: int = 1) -> TrackNamespace:
    """Read a Track Namespace (1..32 non-empty fields; ``min_fields=0`` for prefixes).

    Raises:
        NeedMoreData: the input ends first.
        ProtocolViolation: too few or too many fields, an empty field, more than 4096 bytes.
    """
    count = reader.read_varint()
    if not min_fields <= count <= NAMESPACE_MAX_FIELDS:
        # §2.4.1: 0 or more than 32 fields MUST close the session with PROTOCOL_VIOLATION
        raise ProtocolViolation(f"track namespace has {count} fields, allowed {min_fields}..32")
    fields: list[bytes] = []
    total = 0
    for _ in range(count):
        field = reader.read_length_prefixed()
        if len(field) == 0:
            # §2.4.1: a field of length 0 MUST close the session with PROTOCOL_VIOLATION
            raise ProtocolViolation("track namespace field is empty")
        total += len(field)
        if total > FULL_TRACK_NAME_MAX:
            raise ProtocolViolation("track namespace longer than 4096 bytes")
        fields.append(bytes(field))
    return tuple(fields)


def full_track_name_problem(namespace: Sequence[Bytes], name: Bytes) -> str | None:
    """Why ``(namespace, name)`` breaks §2.4.1, or None."""
    problem = namespace_problem(namespace)
    if problem is not None:
        return problem
    total = sum(len(field) for field in namespace) + len(name)
    if total > FULL_TRACK_NAME_MAX:
        return f"full track name is {total} bytes, more than 4096"
    return None


def push_full_track_name(writer: Writer, namespace: Sequence[Bytes], name: Bytes) -> None:
    """Append Track Namespace, Track Name Length (i), Track Name.

    Raises:
        ValueError: the Full Track Name breaks §2.4.1.
    """
    problem = full_track_name_problem(namespace, name)
    if problem is not None:
        raise ValueError(problem)
    push_namespace(writer, namespace)
    writer.push_length_prefixed(name)


def read_full_track_name(reader: Reader) -> tuple[TrackNamespace, bytes]:
    """Read Track Namespace, Track Name Length (i), Track Name (the name may be empty).

    Raises:
        NeedMoreData: the input ends first.
        ProtocolViolation: the namespace is invalid or the Full Track Name exceeds 4096 bytes.
    """
    namespace = read_namespace(reader)
    length = reader.read_varint()
    if sum(len(field) for field in namespace) + length > FULL_TRACK_NAME_MAX:
        # §2.4.1: a Full Track Name above 4096 bytes MUST close with PROTOCOL_VIOLATION
        raise ProtocolViolation("full track name longer than 4096 bytes")
    return namespace, bytes(reader.read_bytes(length))


def push_reason(writer: Writer, reason: str) -> None:
    """Append a Reason Phrase (``Length (i)`` ≤ 1024, UTF-8).

    The text is diagnostic only, so a longer one is cut at a character boundary rather than
    refused.
    """
    data = reason.encode("utf-8")
    if len(data) > REASON_PHRASE_MAX:
        data = data[:REASON_PHRASE_MAX].decode("utf-8", "ignore").encode("utf-8")
    writer.push_length_prefixed(data)


def read_reason(reader: Reader) -> str:
    """Read a Reason Phrase; invalid UTF-8 is replaced, since the text is diagnostic only.

    Raises:
        NeedMoreData: the input ends first.
        ProtocolViolation: the length exceeds 1024 (§1.4.3).
    """
    length = reader.read_varint()
    if length > REASON_PHRASE_MAX:
        raise ProtocolViolation(f"reason phrase length {length} > 1024")
    return str(reader.read_bytes(length), "utf-8", "replace")


def push_location(writer: Writer, location: Location) -> None:
    """Append ``Location {Group (i), Object (i)}``."""
    writer.push_varint(location.group)
    writer.push_varint(location.object)


def read_location(reader: Reader) -> Location:
    """Read ``Location {Group (i), Object (i)}``."""
    group = reader.read_varint()
    return Location(group, reader.read_varint())


# --- Control message framing (§9) --------------------------------------------------------------


def frame_control_message(msg_type: int, payload: Bytes) -> bytes:
    """``Type (i), Length (16), Payload``.

    Raises:
        ValueError: the payload exceeds 65535 bytes.
    """
    if len(payload) > CONTROL_PAYLOAD_MAX:
        raise ValueError(f"control message payload of {len(payload)} bytes exceeds 65535")
    return encode_varint(msg_type) + CONTROL_LENGTH.pack(len(payload)) + bytes(payload)


@dataclass(frozen=True, slots=True)
class ControlFrame:
    """One whole control message as framed on the stream: its type and payload bytes."""

    msg_type: int
    payload: bytes


class ControlStreamParser:
    """Cuts a control stream into :class:`ControlFrame` s; feed it chunks of any size.

    Partial input is kept until the rest arrives; at most one message (≤ 65535 + 10 bytes) is
    ever buffered.
    """

    __slots__ = ("_buf", "_ended")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._ended = False

    @property
    def buffered(self) -> int:
        """Bytes held back waiting for the rest of a message."""
        return len(self._buf)

    def feed(self, data: Bytes, *, end_stream: bool = False) -> list[ControlFrame]:
        """Add ``data``; return every message it completes, in order.

        Raises:
            ProtocolViolation: ``end_stream`` with a message still incomplete.
            ValueError: data fed after ``end_stream``.
        """
        if self._ended:
            raise ValueError("control stream already ended")
        self._buf += data
        frames: list[ControlFrame] = []
        reader = Reader(self._buf)
        consumed = 0
        while True:
            try:
                msg_type = reader.read_varint()
                length = reader.read_uint16()
                payload = bytes(reader.read_bytes(length))
            except NeedMoreData:
                break
            consumed = reader.position
            frames.append(ControlFrame(msg_type, payload))
        del reader  # release the export before resizing the buffer
        if consumed:
            del self._buf[:consumed]
        if end_stream:
            self._ended = True
            if self._buf:
                raise ProtocolViolation("stream ended inside a control message")
        return frames
