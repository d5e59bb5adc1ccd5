"""MOQT draft-16 data-stream headers, object fields and datagrams (§10, §11): the encoders.

Senders get header bytes only (:class:`SubgroupWriter`, :class:`FetchStreamWriter`), so a large
payload goes to the transport as its own buffer, never concatenated. Datagrams decode here too
(:meth:`ObjectDatagram.decode`, payload as a memoryview slice). The stream parser and its
events are in :mod:`moqt.objects`, which re-exports everything public from this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import TypeAlias, cast

from .errors import (
    MalformedTrack,
    MOQTError,
    NeedMoreData,
    ObjectStatus,
    ProtocolViolation,
)
from .messages_params import ExtensionType
from .wire import (
    KVP_VALUE_MAX_LENGTH,
    VARINT_MAX,
    Bytes,
    KeyValuePair,
    Reader,
    Writer,
    decode_kvp_block,
    encode_kvps,
    encode_varint,
)

FETCH_HEADER_TYPE = 0x05  # §10.4.4

# SUBGROUP_HEADER type bits, form 0b00X1XXXX (§10.4.2)
SUBGROUP_EXTENSIONS = 0x01
SUBGROUP_ID_MODE_MASK = 0x06
SUBGROUP_END_OF_GROUP = 0x08
SUBGROUP_BASE = 0x10
SUBGROUP_DEFAULT_PRIORITY = 0x20

# OBJECT_DATAGRAM type bits, form 0b00X0XXXX (§10.3.1)
DATAGRAM_EXTENSIONS = 0x01
DATAGRAM_END_OF_GROUP = 0x02
DATAGRAM_ZERO_OBJECT_ID = 0x04
DATAGRAM_DEFAULT_PRIORITY = 0x08
DATAGRAM_STATUS = 0x20

# FETCH object Serialization Flags (§10.4.4.1–10.4.4.2)
FETCH_SUBGROUP_MASK = 0x03
FETCH_SUBGROUP_ZERO = 0x00
FETCH_SUBGROUP_PRIOR = 0x01
FETCH_SUBGROUP_NEXT = 0x02
FETCH_SUBGROUP_PRESENT = 0x03
FETCH_OBJECT_ID = 0x04
FETCH_GROUP_ID = 0x08
FETCH_PRIORITY = 0x10
FETCH_EXTENSIONS = 0x20
FETCH_DATAGRAM = 0x40
FETCH_END_OF_NON_EXISTENT_RANGE = 0x8C
FETCH_END_OF_UNKNOWN_RANGE = 0x10C


class SubgroupIdMode(IntEnum):
    """SUBGROUP_ID_MODE, ``(type & 0x06) >> 1`` (§10.4.2); 0b11 is reserved."""

    ZERO = 0
    FIRST_OBJECT = 1
    EXPLICIT = 2


Extensions: TypeAlias = tuple[KeyValuePair, ...]


def is_subgroup_type(stream_type: int) -> bool:
    """True for the valid SUBGROUP_HEADER types 0x10–0x15, 0x18–0x1D, 0x30–0x35, 0x38–0x3D."""
    return stream_type & ~0x2F == SUBGROUP_BASE and stream_type & SUBGROUP_ID_MODE_MASK != 0x06


def is_datagram_type(datagram_type: int) -> bool:
    """True for valid OBJECT_DATAGRAM types: 0b00X0XXXX without STATUS + END_OF_GROUP."""
    if datagram_type & ~0x2F:
        return False
    both = DATAGRAM_STATUS | DATAGRAM_END_OF_GROUP
    return datagram_type & both != both


def object_status(value: int) -> ObjectStatus:
    """``value`` as an :class:`ObjectStatus`.

    Raises:
        ProtocolViolation: not 0x0, 0x3 or 0x4 (§10.2.1.1).
    """
    if value not in ObjectStatus._value2member_map_:
        raise ProtocolViolation(f"unknown object status {value:#x}")
    return ObjectStatus(value)


_IMMUTABLE = int(ExtensionType.IMMUTABLE_EXTENSIONS)  # plain ints on the per-object path


def check_object_extensions(extensions: Extensions) -> Extensions:
    """Apply the per-object extension rules of §11.2–11.4; return ``extensions`` unchanged.

    Raises:
        MalformedTrack: two IMMUTABLE_EXTENSIONS, a nested one, an unparsable one, or a repeated
            PRIOR_GROUP_ID_GAP / PRIOR_OBJECT_ID_GAP.
    """
    if len(extensions) == 1:  # the common case (one IMMUTABLE_EXTENSIONS): no set
        ext_type, value = extensions[0]
        if ext_type == _IMMUTABLE and isinstance(value, bytes):
            _decode_immutable(value)
        return extensions
    seen: set[int] = set()
    for ext_type, value in extensions:
        if ext_type in (
            ExtensionType.IMMUTABLE_EXTENSIONS,
            ExtensionType.PRIOR_GROUP_ID_GAP,
            ExtensionType.PRIOR_OBJECT_ID_GAP,
        ):
            if ext_type in seen:
                raise MalformedTrack(f"object repeats extension {ext_type:#x}")
            seen.add(ext_type)
        if ext_type == ExtensionType.IMMUTABLE_EXTENSIONS and isinstance(value, bytes):
            _decode_immutable(value)
    return extensions


def _decode_immutable(value: bytes) -> Extensions:
    try:
        inner = decode_kvp_block(value)
    except MOQTError as exc:
        raise MalformedTrack(f"IMMUTABLE_EXTENSIONS cannot be parsed: {exc.reason}") from None
    for pair in inner:  # a loop, not any(): this runs once per object received
        if pair[0] == _IMMUTABLE:
            # §11.2: an Immutable Extensions header inside another makes the track malformed
            raise MalformedTrack("IMMUTABLE_EXTENSIONS nested inside IMMUTABLE_EXTENSIONS")
    return inner


def immutable_extensions(extensions: Sequence[KeyValuePair]) -> Extensions:
    """The Key-Value-Pairs inside the IMMUTABLE_EXTENSIONS extension, or () when absent.

    Raises:
        MalformedTrack: the extension cannot be parsed or nests another one (§11.2).
    """
    for ext_type, value in extensions:
        if ext_type == ExtensionType.IMMUTABLE_EXTENSIONS and isinstance(value, bytes):
            return _decode_immutable(value)
    return ()


def encode_immutable_extensions(inner: Sequence[KeyValuePair]) -> KeyValuePair:
    """The IMMUTABLE_EXTENSIONS extension holding the Key-Value-Pairs ``inner`` (§11.2).

    Raises:
        ValueError: ``inner`` holds an IMMUTABLE_EXTENSIONS (§11.2 forbids nesting one).
    """
    if any(pair[0] == _IMMUTABLE for pair in inner):
        raise ValueError("IMMUTABLE_EXTENSIONS may not nest inside IMMUTABLE_EXTENSIONS")
    return ExtensionType.IMMUTABLE_EXTENSIONS, encode_kvps(inner)


def encode_extensions(extensions: Sequence[KeyValuePair]) -> bytes:
    """``Extensions {Extension Headers Length (i), Extension Headers (..)}`` (§10.2.1.2).

    One extension (an object's IMMUTABLE_EXTENSIONS, the common case) is encoded without the
    general Key-Value-Pair writer's sort; the bytes are the same.

    Raises:
        ValueError: see :func:`~moqt.wire.encode_kvps`.
    """
    if len(extensions) == 1:
        ext_type, value = extensions[0]
        if ext_type & 1 and isinstance(value, bytes):
            size = len(value)
            if ext_type < 64 and size < 62:  # every length a one-byte varint
                return bytes((size + 2, ext_type, size)) + value
            if size <= KVP_VALUE_MAX_LENGTH:
                body = encode_varint(ext_type) + encode_varint(size) + value
                return encode_varint(len(body)) + body
    body = encode_kvps(extensions)
    return encode_varint(len(body)) + body


def push_extensions(writer: Writer, extensions: Sequence[KeyValuePair]) -> None:
    """Append ``Extensions {Extension Headers Length (i), Extension Headers (..)}`` (§10.2.1.2)."""
    writer.push_bytes(encode_extensions(extensions))


MAX_EXTENSIONS_LENGTH = 1 << 20
"""Ours: the longest Extension Headers block we take (sixteen 64 KiB values). A parser buffers
an object header until it is whole, so a longer declared length would buffer without bound."""


def read_extensions(reader: Reader) -> Extensions:
    """Read an Extensions structure and apply the per-object rules.

    Raises:
        NeedMoreData: the input ends inside it.
        ProtocolViolation: a declared length beyond :data:`MAX_EXTENSIONS_LENGTH`.
        KeyValueFormattingError: the block does not parse as whole Key-Value-Pairs.
        MalformedTrack: see :func:`check_object_extensions`.
    """
    length = reader.read_varint()
    if length > MAX_EXTENSIONS_LENGTH:
        raise ProtocolViolation(f"Extension Headers Length {length} > {MAX_EXTENSIONS_LENGTH}")
    block = reader.read_bytes(length)
    return check_object_extensions(decode_kvp_block(block))


# --- Subgroup streams (§10.4.2) ----------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class SubgroupHeader:
    """SUBGROUP_HEADER (§10.4.2); also the first event of a subgroup stream.

    ``subgroup_id`` is 0 in ZERO mode, the value in EXPLICIT mode and None in FIRST_OBJECT mode
    (the first ``ObjectStart`` carries it). ``publisher_priority`` None sets DEFAULT_PRIORITY
    (inherit from the control message). ``has_extensions`` makes every object carry an
    Extensions field; ``end_of_group`` means a FIN ends the group.
    """

    track_alias: int
    group_id: int
    subgroup_id_mode: SubgroupIdMode = SubgroupIdMode.ZERO
    subgroup_id: int | None = 0
    publisher_priority: int | None = None
    has_extensions: bool = False
    end_of_group: bool = False

    @property
    def stream_type(self) -> int:
        """The stream type varint this header starts with."""
        stream_type = SUBGROUP_BASE | (self.subgroup_id_mode << 1)
        if self.has_extensions:
            stream_type |= SUBGROUP_EXTENSIONS
        if self.end_of_group:
            stream_type |= SUBGROUP_END_OF_GROUP
        if self.publisher_priority is None:
            stream_type |= SUBGROUP_DEFAULT_PRIORITY
        return stream_type

    def encode(self) -> bytes:
        """The header bytes that open the stream.

        Raises:
            ValueError: ``subgroup_id`` does not fit the mode, or a field is out of range.
        """
        mode = self.subgroup_id_mode
        if mode == SubgroupIdMode.ZERO and self.subgroup_id not in (0, None):
            raise ValueError("ZERO subgroup id mode needs subgroup_id 0")
        if mode == SubgroupIdMode.EXPLICIT and self.subgroup_id is None:
            raise ValueError("EXPLICIT subgroup id mode needs a subgroup_id")
        writer = Writer()
        writer.push_varint(self.stream_type)
        writer.push_varint(self.track_alias)
        writer.push_varint(self.group_id)
        if mode == SubgroupIdMode.EXPLICIT and self.subgroup_id is not None:
            writer.push_varint(self.subgroup_id)
        if self.publisher_priority is not None:
            writer.push_uint8(self.publisher_priority)
        return writer.data

    @classmethod
    def read(cls, stream_type: int, reader: Reader) -> SubgroupHeader:
        """Read the fields after a SUBGROUP_HEADER ``stream_type`` (already read).

        Raises:
            NeedMoreData: the input ends first.
            ProtocolViolation: ``stream_type`` is not a valid SUBGROUP_HEADER type.
        """
        if not is_subgroup_type(stream_type):
            raise ProtocolViolation(f"invalid SUBGROUP_HEADER type {stream_type:#x}")
        mode = SubgroupIdMode((stream_type & SUBGROUP_ID_MODE_MASK) >> 1)
        alias = reader.read_varint()
        group = reader.read_varint()
        subgroup: int | None = 0 if mode == SubgroupIdMode.ZERO else None
        if mode == SubgroupIdMode.EXPLICIT:
            subgroup = reader.read_varint()
        priority = None
        if not stream_type & SUBGROUP_DEFAULT_PRIORITY:
            priority = reader.read_uint8()
        return cls(
            track_alias=alias,
            group_id=group,
            subgroup_id_mode=mode,
            subgroup_id=subgroup,
            publisher_priority=priority,
            has_extensions=bool(stream_type & SUBGROUP_EXTENSIONS),
            end_of_group=bool(stream_type & SUBGROUP_END_OF_GROUP),
        )


def encode_subgroup_header(header: SubgroupHeader) -> bytes:
    """The SUBGROUP_HEADER bytes that open a subgroup stream (see :meth:`SubgroupHeader.encode`).

    Raises:
        ValueError: ``subgroup_id`` does not fit the mode, or a field is out of range.
    """
    return header.encode()


def encode_object_header(
    object_id_delta: int,
    payload_length: int,
    *,
    extensions: Sequence[KeyValuePair] | None = None,
    status: ObjectStatus = ObjectStatus.NORMAL,
) -> bytes:
    """Subgroup object fields before the payload (§10.4.2, Figure 29).

    ``extensions`` None leaves the Extensions field out (stream type without EXTENSIONS); a
    sequence, even empty, writes it. The payload itself is not included.

    Raises:
        ValueError: a status object with a payload or extensions, or a field out of range.
    """
    if status != ObjectStatus.NORMAL and (payload_length or extensions):
        raise ValueError("a status object has no payload and no extensions (§10.2.1)")
    writer = Writer()
    writer.push_varint(object_id_delta)
    if extensions is not None:
        push_extensions(writer, extensions)
    writer.push_varint(payload_length)
    if payload_length == 0:
        writer.push_varint(status)
    return writer.data


class SubgroupWriter:
    """Header bytes for one subgroup stream: the SUBGROUP_HEADER, then each object's fields.

    Tracks the previous Object ID for the delta encoding; payloads are sent separately.
    """

    __slots__ = ("header", "_previous")

    def __init__(self, header: SubgroupHeader) -> None:
        self.header = header
        self._previous: int | None = None

    def header_bytes(self) -> bytes:
        """The SUBGROUP_HEADER that opens the stream."""
        return self.header.encode()

    def mark(self) -> object:
        """The writer's state, for :meth:`rewind` (headers encoded but never sent)."""
        return self._previous

    def rewind(self, mark: object) -> None:
        """Return to the state :meth:`mark` returned."""
        self._previous = cast("int | None", mark)

    def object_header(
        self,
        object_id: int,
        payload_length: int,
        *,
        extensions: Sequence[KeyValuePair] = (),
        status: ObjectStatus = ObjectStatus.NORMAL,
    ) -> bytes:
        """Fields of the next object, to be followed by ``payload_length`` payload bytes.

        Raises:
            ValueError: Object IDs not ascending, extensions on a stream without them, a first
                object that contradicts a FIRST_OBJECT subgroup id, or a bad status object.
        """
        previous = self._previous
        if previous is not None and object_id <= previous:
            raise ValueError(f"object {object_id} after {previous}: ids must ascend")
        header = self.header
        if extensions and not header.has_extensions:
            raise ValueError("this subgroup stream's type carries no extensions")
        if (
            previous is None
            and header.subgroup_id_mode == SubgroupIdMode.FIRST_OBJECT
            and header.subgroup_id not in (None, object_id)
        ):
            raise ValueError("FIRST_OBJECT mode: first object id must equal the subgroup id")
        delta = object_id if previous is None else object_id - previous - 1
        data = encode_object_header(
            delta,
            payload_length,
            extensions=tuple(extensions) if header.has_extensions else None,
            status=status,
        )
        self._previous = object_id
        return data


# --- Fetch streams (§10.4.4) -------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchHeader:
    """FETCH_HEADER (§10.4.4): the stream answers the FETCH with ``request_id``."""

    request_id: int

    def encode(self) -> bytes:
        """The header bytes that open the stream."""
        writer = Writer()
        writer.push_varint(FETCH_HEADER_TYPE)
        writer.push_varint(self.request_id)
        return writer.data


_FetchPrior: TypeAlias = tuple[int, int, int | None, int]  # group, object, subgroup, priority


class FetchStreamWriter:
    """Header bytes for one FETCH stream; picks the shortest Serialization Flags per object.

    It omits a field only when the prior object determines it unambiguously (same group for an
    implied Object ID; after an End of Range, the next object is written in full).
    """

    __slots__ = ("request_id", "_prior")

    def __init__(self, request_id: int) -> None:
        self.request_id = request_id
        self._prior: _FetchPrior | None = None

    def header_bytes(self) -> bytes:
        """The FETCH_HEADER that opens the stream."""
        return FetchHeader(request_id=self.request_id).encode()

    def mark(self) -> object:
        """The writer's state, for :meth:`rewind` (headers encoded but never sent)."""
        return self._prior

    def rewind(self, mark: object) -> None:
        """Return to the state :meth:`mark` returned."""
        self._prior = cast("_FetchPrior | None", mark)

    def object_header(
        self,
        *,
        group_id: int,
        object_id: int,
        subgroup_id: int | None,
        publisher_priority: int,
        payload_length: int,
        extensions: Sequence[KeyValuePair] = (),
    ) -> bytes:
        """Fields of the next fetched object; ``subgroup_id`` None marks a Datagram object.

        Raises:
            ValueError: a field out of range.
        """
        prior = self._prior
        if (
            prior is not None
            and subgroup_id == 0
            and prior[0] == group_id
            and prior[1] + 1 == object_id
            and prior[3] == publisher_priority
        ):  # the next object of the same group and priority: flags and fields implied
            head = b"\x20" + encode_extensions(extensions) if extensions else b"\x00"
        else:
            flags, fields = self._full_fields(
                prior, group_id, object_id, subgroup_id, publisher_priority
            )
            if extensions:
                flags |= FETCH_EXTENSIONS
                fields += encode_extensions(extensions)
            head = encode_varint(flags) + fields
        self._prior = (group_id, object_id, subgroup_id, publisher_priority)
        return head + encode_varint(payload_length)

    @staticmethod
    def _full_fields(
        prior: _FetchPrior | None,
        group_id: int,
        object_id: int,
        subgroup_id: int | None,
        priority: int,
    ) -> tuple[int, bytes]:
        """Serialization Flags (without EXTENSIONS) and the fields they say are present."""
        same_group = prior is not None and prior[0] == group_id
        flags = 0 if same_group else FETCH_GROUP_ID
        writer = Writer()
        if not same_group:
            writer.push_varint(group_id)
        prior_subgroup = None if prior is None else prior[2]
        if subgroup_id is None:
            flags |= FETCH_DATAGRAM
        elif subgroup_id == 0:
            flags |= FETCH_SUBGROUP_ZERO
        elif prior_subgroup is not None and subgroup_id == prior_subgroup:
            flags |= FETCH_SUBGROUP_PRIOR
        elif prior_subgroup is not None and subgroup_id == prior_subgroup + 1:
            flags |= FETCH_SUBGROUP_NEXT
        else:
            flags |= FETCH_SUBGROUP_PRESENT
            writer.push_varint(subgroup_id)
        if not (same_group and prior is not None and object_id == prior[1] + 1):
            flags |= FETCH_OBJECT_ID
            writer.push_varint(object_id)
        if prior is None or prior[3] != priority:
            flags |= FETCH_PRIORITY
            writer.push_uint8(priority)
        return flags, writer.data

    def end_of_range(self, group_id: int, object_id: int, *, unknown: bool = False) -> bytes:
        """An End of Non-Existent (or, with ``unknown``, Unknown) Range marker (§10.4.4.2)."""
        writer = Writer()
        writer.push_varint(
            FETCH_END_OF_UNKNOWN_RANGE if unknown else FETCH_END_OF_NON_EXISTENT_RANGE
        )
        writer.push_varint(group_id)
        writer.push_varint(object_id)
        self._prior = None  # the next object is written in full
        return writer.data


# --- Datagrams (§10.3.1) -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ObjectDatagram:
    """OBJECT_DATAGRAM (§10.3.1). ``publisher_priority`` None = DEFAULT_PRIORITY; a non-NORMAL
    ``status`` travels instead of a payload; decoded payloads are memoryview slices."""

    track_alias: int
    group_id: int
    object_id: int
    publisher_priority: int | None = None
    extensions: Extensions = ()
    status: ObjectStatus = ObjectStatus.NORMAL
    end_of_group: bool = False
    payload: Bytes = b""

    @property
    def datagram_type(self) -> int:
        """The type varint this datagram starts with."""
        datagram_type = DATAGRAM_EXTENSIONS if self.extensions else 0
        if self.end_of_group:
            datagram_type |= DATAGRAM_END_OF_GROUP
        if self.object_id == 0:
            datagram_type |= DATAGRAM_ZERO_OBJECT_ID
        if self.publisher_priority is None:
            datagram_type |= DATAGRAM_DEFAULT_PRIORITY
        if self.status != ObjectStatus.NORMAL:
            datagram_type |= DATAGRAM_STATUS
        return datagram_type

    def encode(self) -> bytes:
        """The whole datagram.

        Raises:
            ValueError: a status datagram with a payload, extensions or END_OF_GROUP, or a field
                out of range.
        """
        if self.status != ObjectStatus.NORMAL and (
            self.payload or self.extensions or self.end_of_group
        ):
            raise ValueError("a status datagram has no payload, extensions or END_OF_GROUP")
        writer = Writer()
        writer.push_varint(self.datagram_type)
        writer.push_varint(self.track_alias)
        writer.push_varint(self.group_id)
        if self.object_id != 0:
            writer.push_varint(self.object_id)
        if self.publisher_priority is not None:
            writer.push_uint8(self.publisher_priority)
        if self.extensions:
            push_extensions(writer, self.extensions)
        if self.status != ObjectStatus.NORMAL:
            writer.push_varint(self.status)
        else:
            writer.push_bytes(self.payload)
        return writer.data

    @classmethod
    def decode(cls, data: Bytes) -> ObjectDatagram:
        """Parse a whole datagram; the payload is a zero-copy slice of ``data``.

        Raises:
            ProtocolViolation: an invalid type, a truncated header, an empty Extensions block
                under the EXTENSIONS bit, an unknown status, or extensions on a status object.
            KeyValueFormattingError: unparsable extensions.
            MalformedTrack: see :func:`check_object_extensions`.
        """
        reader = Reader(data)
        try:
            return cls._read(reader)
        except NeedMoreData:
            raise ProtocolViolation("datagram shorter than its header") from None

    @classmethod
    def _read(cls, reader: Reader) -> ObjectDatagram:
        datagram_type = reader.read_varint()
        if not is_datagram_type(datagram_type):
            raise ProtocolViolation(f"invalid OBJECT_DATAGRAM type {datagram_type:#x}")
        alias = reader.read_varint()
        group = reader.read_varint()
        object_id = 0 if datagram_type & DATAGRAM_ZERO_OBJECT_ID else reader.read_varint()
        priority = None
        if not datagram_type & DATAGRAM_DEFAULT_PRIORITY:
            priority = reader.read_uint8()
        extensions: Extensions = ()
        if datagram_type & DATAGRAM_EXTENSIONS:
            extensions = read_extensions(reader)
            if not extensions:
                # §10.3.1: EXTENSIONS bit with Extension Headers Length 0 is a violation
                raise ProtocolViolation("datagram EXTENSIONS bit with an empty block")
        status = ObjectStatus.NORMAL
        payload: Bytes = b""
        if datagram_type & DATAGRAM_STATUS:
            status = object_status(reader.read_varint())
            if not reader.eof():
                raise ProtocolViolation("status datagram has bytes after the status")
            if status != ObjectStatus.NORMAL and extensions:
                # §10.2.1.2: extensions only on Normal objects
                raise ProtocolViolation("extensions on a status object")
        else:
            payload = reader.read_rest()
        return cls(
            track_alias=alias,
            group_id=group,
            object_id=object_id,
            publisher_priority=priority,
            extensions=extensions,
            status=status,
            end_of_group=bool(datagram_type & DATAGRAM_END_OF_GROUP),
            payload=payload,
        )


def check_object_id(object_id: int) -> int:
    """Reject a computed Object ID beyond the varint range.

    Raises:
        ProtocolViolation: ``object_id`` ≥ 2^62.
    """
    if object_id > VARINT_MAX:
        raise ProtocolViolation(f"object id {object_id} beyond 2^62 - 1")
    return object_id
