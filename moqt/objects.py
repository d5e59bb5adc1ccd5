"""MOQT draft-16 data streams (§10.4): the incremental parser and its events, plus re-exports.

Feed a unidirectional stream to :class:`DataStreamParser` in chunks of any size. It emits the
stream header (:class:`SubgroupHeader` or :class:`FetchHeader`), then for every object
``ObjectStart``, zero or more ``ObjectChunk`` and ``ObjectEnd`` — status objects (END_OF_GROUP,
END_OF_TRACK) and empty objects included, with the status on ``ObjectStart`` — plus
``EndOfRange`` markers on FETCH streams and ``StreamFinished`` at the FIN. Asked to
(``feed(..., runs=True)``), it gives the whole objects a piece of a FETCH stream holds, header
and all of the payload, as one :class:`ObjectRun` each time, read by one native call, where it
would give the three events of each.

Payload chunks are memoryview slices of the buffers fed in, never copies, so a 2 MiB layer can be
hashed and copied into its destination piece by piece. A chunk stays valid as long as the buffer
it came from is not mutated. Only object and stream headers split across feeds are buffered.

Encoders, datagrams and the object extension helpers are in :mod:`moqt.objects_wire` and are
re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TypeAlias

from .errors import NeedMoreData, ObjectStatus, ProtocolViolation
from .objects_wire import (
    FETCH_DATAGRAM,
    FETCH_END_OF_NON_EXISTENT_RANGE,
    FETCH_END_OF_UNKNOWN_RANGE,
    FETCH_EXTENSIONS,
    FETCH_GROUP_ID,
    FETCH_HEADER_TYPE,
    FETCH_OBJECT_ID,
    FETCH_PRIORITY,
    FETCH_SUBGROUP_MASK,
    FETCH_SUBGROUP_NEXT,
    FETCH_SUBGROUP_PRESENT,
    FETCH_SUBGROUP_PRIOR,
    Extensions,
    FetchHeader,
    FetchStreamWriter,
    ObjectDatagram,
    SubgroupHeader,
    SubgroupIdMode,
    SubgroupWriter,
    check_object_id,
    encode_immutable_extensions,
    encode_object_header,
    encode_subgroup_header,
    immutable_extensions,
    is_datagram_type,
    is_subgroup_type,
    object_status,
    read_extensions,
)
from .wire import Bytes, Reader, as_byte_view

_native: ModuleType | None
try:
    from . import _objscan as _native
except ImportError:  # built optionally (setup.py): absent where it could not be compiled
    _native = None

NATIVE_HEADERS: bool = _native is not None
"""Whether object headers are read by the native module ``moqt._objscan`` (the same results as
the Python reader, which takes every header it declines: errors, edge cases, split headers)."""

__all__ = [
    "Crossing",
    "DataStreamEvent",
    "DataStreamParser",
    "EndOfRange",
    "FetchHeader",
    "FetchStreamWriter",
    "ObjectChunk",
    "ObjectDatagram",
    "ObjectEnd",
    "ObjectRun",
    "ObjectStart",
    "ObjectStatus",
    "RunObject",
    "StreamFinished",
    "StreamHeader",
    "SubgroupHeader",
    "SubgroupIdMode",
    "SubgroupWriter",
    "encode_immutable_extensions",
    "encode_object_header",
    "encode_subgroup_header",
    "immutable_extensions",
    "is_datagram_type",
    "is_subgroup_type",
]

StreamHeader: TypeAlias = SubgroupHeader | FetchHeader


@dataclass(frozen=True, slots=True, kw_only=True)
class ObjectStart:
    """An object's header fields (§10.2.1): what the stream said before the payload.

    ``subgroup_id`` is None for an object fetched with Datagram forwarding preference;
    ``publisher_priority`` None means "inherit" (DEFAULT_PRIORITY subgroup stream).
    """

    group_id: int
    subgroup_id: int | None
    object_id: int
    publisher_priority: int | None
    extensions: Extensions
    payload_length: int
    status: ObjectStatus = ObjectStatus.NORMAL


@dataclass(frozen=True, slots=True)
class ObjectChunk:
    """A piece of the current object's payload: a memoryview slice of the fed buffer.

    ``offset`` is where ``data`` starts within the object's payload.
    """

    data: memoryview
    offset: int


@dataclass(frozen=True, slots=True)
class ObjectEnd:
    """The current object's payload is complete."""

    group_id: int
    object_id: int


@dataclass(frozen=True, slots=True)
class EndOfRange:
    """FETCH End of Range (§10.4.4.2): objects up to this Location, inclusive, do not exist
    (or, with ``unknown``, have unknown status)."""

    group_id: int
    object_id: int
    unknown: bool


RunObject: TypeAlias = tuple[int, int | None, int, int, Extensions, int, int]
"""A whole FETCH object of an :class:`ObjectRun`: ``(group_id, subgroup_id, object_id,
publisher_priority, extensions, payload_start, payload_length)``, its payload at
``run.data[payload_start : payload_start + payload_length]``."""


@dataclass(frozen=True, slots=True)
class ObjectRun:
    """Whole objects one after another in a piece of a FETCH stream (§10.4.4): for each, what
    the parser gives otherwise as :class:`ObjectStart`, one :class:`ObjectChunk` holding its
    whole payload (none when it is empty) and :class:`ObjectEnd` (:meth:`events`).

    ``data`` is the piece (a memoryview of the fed buffer); ``octets`` the payload octets of
    all the objects.
    """

    data: memoryview
    objects: list[RunObject]
    octets: int

    def events(self) -> list[DataStreamEvent]:
        """The events the run stands for, in stream order."""
        data = self.data
        events: list[DataStreamEvent] = []
        for group, subgroup, object_id, priority, extensions, start, length in self.objects:
            events.append(
                ObjectStart(
                    group_id=group,
                    subgroup_id=subgroup,
                    object_id=object_id,
                    publisher_priority=priority,
                    extensions=extensions,
                    payload_length=length,
                )
            )
            if length:
                events.append(ObjectChunk(data[start : start + length], 0))
            events.append(ObjectEnd(group, object_id))
        return events


@dataclass(frozen=True, slots=True)
class StreamFinished:
    """The stream ended with a FIN on an object boundary."""


DataStreamEvent: TypeAlias = (
    SubgroupHeader
    | FetchHeader
    | ObjectStart
    | ObjectChunk
    | ObjectEnd
    | EndOfRange
    | StreamFinished
    | ObjectRun
)
_Unit: TypeAlias = SubgroupHeader | FetchHeader | ObjectStart | EndOfRange


@dataclass(frozen=True, slots=True)
class _Prior:
    """What later FETCH objects may inherit from an End of Range (§10.4.4.1); after an object,
    the object's own :class:`ObjectStart` plays this part (no second record per object)."""

    group_id: int
    object_id: int
    subgroup_id: int | None
    publisher_priority: int | None


_Last: TypeAlias = ObjectStart | _Prior

Crossing: TypeAlias = tuple[int, int, ObjectStart, ObjectStart, int]
"""What :meth:`DataStreamParser.cross_boundary` took from a piece: ``(tail, offset, ended,
started, head)``. ``piece[:tail]`` ends the payload of ``ended`` at payload offset ``offset``;
``started`` begins, its payload from ``piece[head:]`` at offset 0."""


_MIN_WINDOW = 64


class DataStreamParser:
    """Incremental parser for one unidirectional data stream (SUBGROUP_HEADER or FETCH_HEADER).

    Call :meth:`feed` with each chunk as it arrives; each call returns the events it completes.
    """

    __slots__ = ("_header", "_pending", "_payload_left", "_offset", "_current", "_last", "_done")

    def __init__(self) -> None:
        self._header: StreamHeader | None = None
        self._pending = bytearray()  # a header split across feeds, never payload
        self._payload_left = 0
        self._offset = 0
        self._current: ObjectStart | None = None
        self._last: _Last | None = None
        self._done = False

    @property
    def header(self) -> StreamHeader | None:
        """The stream header, once parsed."""
        return self._header

    def feed(
        self, data: Bytes, *, end_stream: bool = False, runs: bool = False
    ) -> list[DataStreamEvent]:
        """Consume ``data``; return the events it completes, in stream order. With ``runs``
        the whole objects of a FETCH stream come as :class:`ObjectRun` events (never
        without the native reader).

        Raises:
            ProtocolViolation: an invalid stream type, field or object status, or a FIN inside
                a header or a payload (§10.4).
            KeyValueFormattingError: unparsable extension headers.
            MalformedTrack: an object breaking the extension rules of §11.2–11.4.
            ValueError: data fed after ``end_stream``.
        """
        if self._done:
            raise ValueError("data stream already ended")
        view = as_byte_view(data)
        events: list[DataStreamEvent] = []
        pos, end = 0, len(view)
        scan = _native.fetch_objects if runs and _native is not None else None
        while pos < end:
            if self._payload_left:
                pos = self._take_payload(view, pos, events)
                continue
            if scan is not None and type(self._header) is FetchHeader and not self._pending:
                found = scan(view, pos, self._last)
                if found is not None:
                    pos, objects, octets = found
                    events.append(ObjectRun(view, objects, octets))
                    group, subgroup, object_id, priority = objects[-1][:4]
                    self._last = _Prior(group, object_id, subgroup, priority)
                    continue
            step = self._parse_unit(view, pos)
            if step is None:
                break
            pos, unit = step
            self._commit(unit, events)
        if end_stream:
            self._finish(events)
        return events

    def payload_within(self, size: int) -> int:
        """The fast path of :meth:`feed` for ``size`` octets that lie wholly inside the
        current object's payload, short of its end: takes them and returns their payload
        offset (what :meth:`feed` would give as one :class:`ObjectChunk`), or returns -1
        and takes nothing when they do not (a header, an object end, an ended stream)."""
        left = self._payload_left
        if size >= left or self._done or size <= 0:
            return -1
        offset = self._offset
        self._offset = offset + size
        self._payload_left = left - size
        return offset

    def cross_boundary(self, view: memoryview) -> Crossing | None:
        """The fast path of :meth:`feed` for a piece that crosses one object boundary: it ends
        the current object's payload, then holds the next object's whole header and the start
        (not all) of its payload. Takes it and returns what :meth:`feed` would give as an
        :class:`ObjectChunk`, :class:`ObjectEnd`, :class:`ObjectStart` and :class:`ObjectChunk`
        (see :class:`Crossing`); or returns None and takes nothing for any other piece (more
        or fewer boundaries, a header cut short, a marker, a status object).

        Raises:
            as :meth:`feed` would for the same piece (the next object's header is invalid).
        """
        left, size = self._payload_left, len(view)
        if not left or left >= size or self._done:
            return None
        read = self._attempt(view, left)
        if read is None:
            return None
        unit, head = read
        rest = size - head
        if type(unit) is not ObjectStart or rest <= 0 or unit.payload_length <= rest:
            return None
        ended, offset = self._current, self._offset
        assert ended is not None  # inside a payload
        self._last = self._current = unit
        self._offset = rest
        self._payload_left = unit.payload_length - rest
        return left, offset, ended, unit, head

    def _take_payload(self, view: memoryview, pos: int, events: list[DataStreamEvent]) -> int:
        take = min(self._payload_left, len(view) - pos)
        events.append(ObjectChunk(view[pos : pos + take], self._offset))
        self._offset += take
        self._payload_left -= take
        if not self._payload_left:
            self._end_object(events)
        return pos + take

    def _parse_unit(self, view: memoryview, pos: int) -> tuple[int, _Unit] | None:
        """Parse the next header unit at ``view[pos:]``; (new pos, unit) or None when short.

        A unit split across feeds is finished in ``_pending`` by appending the new chunk a
        doubling window at a time, so payload bytes after it are never copied.
        """
        if not self._pending:
            result = self._attempt(view, pos)
            if result is None:
                self._pending += view[pos:]
                return None
            return result[1], result[0]
        available = len(view) - pos
        window = max(_MIN_WINDOW, len(self._pending))
        taken = 0
        while taken < available:
            step = min(window, available - taken)
            self._pending += view[pos + taken : pos + taken + step]
            taken += step
            result = self._attempt(memoryview(self._pending), 0)
            if result is not None:
                used = result[1] - (len(self._pending) - taken)
                self._pending.clear()
                return pos + used, result[0]
            window *= 2
        return None

    def _attempt(self, view: memoryview, start: int) -> tuple[_Unit, int] | None:
        """The unit at ``view[start:]`` and the position after it, or None when short."""
        header = self._header
        if header is not None and _native is not None:
            native = self._native_object(_native, header, view, start)
            if native is not None:
                return native
        reader = Reader.at(view, start)
        try:
            unit = self._read_unit(reader)
        except NeedMoreData:
            return None
        return unit, reader.position

    def _read_unit(self, reader: Reader) -> _Unit:
        header = self._header
        if header is None:
            return _read_stream_header(reader)
        if isinstance(header, SubgroupHeader):
            return self._read_subgroup_object(header, reader)
        return self._read_fetch_object(reader)

    def _native_object(
        self, native: ModuleType, header: StreamHeader, view: memoryview, start: int
    ) -> tuple[ObjectStart, int] | None:
        """The object header at ``view[start:]`` read by ``moqt._objscan``, or None where it
        leaves the header to the Python reader (see ``moqt/_objscan.c``)."""
        last = self._last
        if type(header) is FetchHeader:
            got = native.fetch_object(view, start, last)
            if got is None:
                return None
            end, group, subgroup, object_id, priority, extensions, length = got
            unit = ObjectStart(
                group_id=group,
                subgroup_id=subgroup,
                object_id=object_id,
                publisher_priority=priority,
                extensions=extensions,
                payload_length=length,
            )
            return unit, end
        assert isinstance(header, SubgroupHeader)
        got = native.subgroup_object(view, start, header.has_extensions, last)
        if got is None:
            return None
        end, object_id, extensions, length = got
        return _subgroup_object(header, last, object_id, extensions, length), end

    def _read_subgroup_object(self, header: SubgroupHeader, reader: Reader) -> ObjectStart:
        """Subgroup object fields (§10.4.2, Figure 29)."""
        delta = reader.read_varint()
        last = self._last
        object_id = check_object_id(delta if last is None else last.object_id + delta + 1)
        extensions = read_extensions(reader) if header.has_extensions else ()
        length = reader.read_varint()
        status = ObjectStatus.NORMAL
        if length == 0:
            status = object_status(reader.read_varint())
            if status != ObjectStatus.NORMAL and extensions:
                # §10.2.1.2: extensions on a non-Normal object MUST be a PROTOCOL_VIOLATION
                raise ProtocolViolation("extension headers on a status object")
        return _subgroup_object(header, last, object_id, extensions, length, status)

    def _read_fetch_object(self, reader: Reader) -> ObjectStart | EndOfRange:
        """Fetch object fields after the Serialization Flags (§10.4.4, Figure 31)."""
        flags = reader.read_varint()
        if flags in (FETCH_END_OF_NON_EXISTENT_RANGE, FETCH_END_OF_UNKNOWN_RANGE):
            group = reader.read_varint()
            return EndOfRange(group, reader.read_varint(), flags == FETCH_END_OF_UNKNOWN_RANGE)
        if flags >= 128:
            raise ProtocolViolation(f"invalid fetch serialization flags {flags:#x}")
        prior = self._last
        group = reader.read_varint() if flags & FETCH_GROUP_ID else _prior(prior).group_id
        subgroup = self._fetch_subgroup(flags, prior, reader)
        if flags & FETCH_OBJECT_ID:
            object_id = reader.read_varint()
        else:
            object_id = check_object_id(_prior(prior).object_id + 1)
        if flags & FETCH_PRIORITY:
            priority: int | None = reader.read_uint8()
        else:
            priority = _prior(prior).publisher_priority
            if priority is None:
                raise ProtocolViolation("fetch object inherits a priority no object set")
        extensions = read_extensions(reader) if flags & FETCH_EXTENSIONS else ()
        return ObjectStart(
            group_id=group,
            subgroup_id=subgroup,
            object_id=object_id,
            publisher_priority=priority,
            extensions=extensions,
            payload_length=reader.read_varint(),
        )

    @staticmethod
    def _fetch_subgroup(flags: int, prior: _Last | None, reader: Reader) -> int | None:
        if flags & FETCH_DATAGRAM:
            return None  # §10.4.4.1: a Datagram object has no subgroup; ignore the low bits
        mode = flags & FETCH_SUBGROUP_MASK
        if mode == FETCH_SUBGROUP_PRESENT:
            return reader.read_varint()
        if mode in (FETCH_SUBGROUP_PRIOR, FETCH_SUBGROUP_NEXT):
            base = _prior(prior).subgroup_id
            if base is None:
                raise ProtocolViolation("fetch object inherits a subgroup the prior lacks")
            return base if mode == FETCH_SUBGROUP_PRIOR else base + 1
        return 0

    def _commit(self, unit: _Unit, events: list[DataStreamEvent]) -> None:
        events.append(unit)
        if isinstance(unit, SubgroupHeader | FetchHeader):
            self._header = unit
        elif isinstance(unit, EndOfRange):
            # the next object may inherit Group and Object ID from the range end
            last = self._last
            subgroup = None if last is None else last.subgroup_id
            priority = None if last is None else last.publisher_priority
            self._last = _Prior(unit.group_id, unit.object_id, subgroup, priority)
        else:
            self._last = self._current = unit
            self._offset = 0
            self._payload_left = unit.payload_length
            if not unit.payload_length:
                self._end_object(events)

    def _end_object(self, events: list[DataStreamEvent]) -> None:
        current = self._current
        if current is not None:
            events.append(ObjectEnd(current.group_id, current.object_id))
        self._current = None

    def _finish(self, events: list[DataStreamEvent]) -> None:
        self._done = True
        if self._header is None:
            raise ProtocolViolation("stream ended before its header")
        if self._payload_left or self._pending:
            # §10.4: a FIN inside a serialized Object SHOULD be a PROTOCOL_VIOLATION
            raise ProtocolViolation("stream ended inside an object")
        events.append(StreamFinished())


def _subgroup_object(
    header: SubgroupHeader,
    last: _Last | None,
    object_id: int,
    extensions: Extensions,
    length: int,
    status: ObjectStatus = ObjectStatus.NORMAL,
) -> ObjectStart:
    """A subgroup stream's object: its own fields, and those its stream header gives."""
    subgroup = header.subgroup_id
    if subgroup is None:  # FIRST_OBJECT mode: the first object's id names the subgroup
        subgroup = object_id if last is None else last.subgroup_id
    return ObjectStart(
        group_id=header.group_id,
        subgroup_id=subgroup,
        object_id=object_id,
        publisher_priority=header.publisher_priority,
        extensions=extensions,
        payload_length=length,
        status=status,
    )


def _prior(prior: _Last | None) -> _Last:
    if prior is None:
        # §10.4.4.1: a first object that references the prior one MUST be a violation
        raise ProtocolViolation("first fetch object references a prior object")
    return prior


def _read_stream_header(reader: Reader) -> StreamHeader:
    """The stream type and header of a unidirectional stream (§10)."""
    stream_type = reader.read_varint()
    if stream_type == FETCH_HEADER_TYPE:
        return FetchHeader(request_id=reader.read_varint())
    if is_subgroup_type(stream_type):
        return SubgroupHeader.read(stream_type, reader)
    # §10: an unknown stream type MUST close the session
    raise ProtocolViolation(f"unknown data stream type {stream_type:#x}")
