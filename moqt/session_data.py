"""The data plane of :class:`~moqt.session.MOQTSession`: objects on streams and datagrams (§10).

Receiving: each unidirectional stream from the peer gets a
:class:`~moqt.objects.DataStreamParser`; its events become session events tagged with the
request the stream belongs to. A subgroup stream names a Track Alias, which SUBSCRIBE_OK (or
PUBLISH) binds to a request; a stream that arrives before that binding is held, parsed, until
the alias is bound. Payload chunks stay memoryview slices of the received data. A request
with a :class:`~moqt.session_events.TrackSink` gets its data events handed to the sink instead
of returned, its payload pieces as plain calls (no event object per chunk); a
:class:`~moqt.session_events.RunSink` gets the whole objects each piece of a FETCH stream holds
as one :class:`~moqt.objects.ObjectRun` (one call a piece, no event per object).

Sending: ``open_subgroup`` / ``open_fetch_stream`` write the stream header; ``begin_object``
writes an object's fields and ``write_payload`` its payload, in as many pieces as the caller
likes, so a header is never concatenated with a large payload into a new buffer.
``send_objects`` queues a run of whole objects (:class:`StreamObject`) in one call: every
header encoded in one pass, then headers and payloads handed to the transport together (one
call on a carrier that takes a list of buffers, QMux), so a publisher's Python work per object
is a header, not a chain of calls per buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, cast

from .backend import QuicConnectionLike, SessionBackend
from .errors import MalformedTrack, ObjectStatus, ProtocolViolation, StreamResetCode
from .messages import ControlMessage, FetchCancel, Unsubscribe
from .objects import (
    DataStreamEvent,
    DataStreamParser,
    EndOfRange,
    FetchHeader,
    FetchStreamWriter,
    ObjectChunk,
    ObjectDatagram,
    ObjectRun,
    ObjectStart,
    StreamFinished,
    SubgroupHeader,
    SubgroupIdMode,
    SubgroupWriter,
)
from .objects import ObjectEnd as ParsedObjectEnd
from .session_events import (
    DatagramReceived,
    DataStreamFinished,
    DataStreamReset,
    DataStreamStopped,
    EndOfRangeReceived,
    FetchStreamOpened,
    MalformedTrackDetected,
    MOQTEvent,
    ObjectData,
    ObjectEnd,
    ObjectHeader,
    SubgroupStreamOpened,
    TrackSink,
)
from .session_state import (
    LocalProtocolError,
    Request,
    RequestKind,
    RequestState,
    RequestTable,
    Signal,
    StreamClosedError,
    StreamsBlockedError,
)
from .wire import Bytes, KeyValuePair, as_byte_view

DEFAULT_PRIORITY = 128  # §7.1: publisher priority when nothing else is said
HELD_BYTES_MAX = 8 << 20  # streams held for an unbound alias; past this they are stopped


class StreamObject(NamedTuple):
    """One whole object of a run written with :meth:`DataPlane.send_objects`.

    ``payload`` is one buffer or several (K and V) sent one after another, never joined.
    ``group_id``, ``subgroup_id`` (None: a Datagram object) and ``publisher_priority`` are
    fields of a fetched object (§10.4.4); a subgroup stream's header fixes them and takes only
    ``object_id``, ``payload`` and ``extensions``.
    """

    object_id: int
    payload: Bytes | Sequence[Bytes]
    extensions: Sequence[KeyValuePair] = ()
    group_id: int = 0
    subgroup_id: int | None = 0
    publisher_priority: int = DEFAULT_PRIORITY


@dataclass(slots=True)
class _InStream:
    """A unidirectional stream the peer sends us."""

    parser: DataStreamParser = field(default_factory=DataStreamParser)
    request_id: int | None = None
    track_alias: int | None = None
    held: list[DataStreamEvent] | None = None  # events kept until the alias is bound
    held_bytes: int = 0
    ignored: bool = False
    ended: bool = False  # the FIN was fed to the parser


@dataclass(slots=True)
class _OutStream:
    """A data stream we send."""

    request_id: int
    writer: SubgroupWriter | FetchStreamWriter
    payload_left: int = 0
    closed: bool = False


class DataPlane:
    """Mixin: data streams and datagrams. :class:`~moqt.session.MOQTSession` provides the
    attributes declared here."""

    _quic: QuicConnectionLike
    _backend: SessionBackend
    requests: RequestTable
    _in_streams: dict[int, _InStream]
    _out_streams: dict[int, _OutStream]
    _aliases_in: dict[int, int]  # Track Alias of incoming objects -> request id
    _held_by_alias: dict[int, list[int]]  # alias -> stream ids held for it
    _sinks: dict[int, TrackSink]  # request id -> where its data events go
    _run_sinks: dict[int, Callable[[int, ObjectRun], bool]]  # request id -> RunSink.on_run

    if TYPE_CHECKING:  # provided by MOQTSession

        def _send_control(self, message: ControlMessage) -> None: ...

    def _init_data_plane(self) -> None:
        self._in_streams = {}
        self._out_streams = {}
        self._aliases_in = {}
        self._held_by_alias = {}
        self._sinks = {}
        self._run_sinks = {}
        self.payload_octets_sent = 0  # object payload octets, for operations metrics
        self.payload_octets_received = 0

    def set_track_sink(self, request_id: int, sink: TrackSink | None) -> None:
        """Hand the data events of ``request_id`` to ``sink`` as they happen (None: return
        them from ``handle_event`` again). A :class:`~moqt.session_events.RunSink` is also
        offered the runs of whole objects on the request's FETCH streams."""
        self._run_sinks.pop(request_id, None)
        if sink is None:
            self._sinks.pop(request_id, None)
            return
        self._sinks[request_id] = sink
        on_run = getattr(sink, "on_run", None)  # a RunSink (isinstance with a Protocol: slow)
        if on_run is not None:
            self._run_sinks[request_id] = on_run

    def _deliver(self, request_id: int, event: MOQTEvent, out: list[MOQTEvent]) -> None:
        sink = self._sinks.get(request_id)
        if sink is None:
            out.append(event)
        else:
            sink.on_event(event)

    # --- receiving ---------------------------------------------------------------------------

    def _on_data_stream(
        self, stream_id: int, data: bytes, end_stream: bool, out: list[MOQTEvent]
    ) -> None:
        stream = self._in_streams.get(stream_id)
        if stream is None:
            stream = self._in_streams[stream_id] = _InStream()
        if stream.ignored:
            if end_stream:
                del self._in_streams[stream_id]
            return
        stream.ended = end_stream
        if not end_stream and self._payload_to_sink(stream_id, stream, data):
            return
        try:
            parsed = stream.parser.feed(data, end_stream=end_stream, runs=True)
        except MalformedTrack as exc:
            self._malformed(stream_id, stream, exc.reason, out)
            return
        bound = self._bound_sink(stream)
        if bound is None:
            for at, event in enumerate(parsed):
                self._route(stream_id, stream, event, out)
                if type(event) is FetchHeader or type(event) is SubgroupHeader:
                    # the stream is bound now: what the same piece holds after its header
                    # (often the whole FETCH of a small block) goes the sink's way too
                    bound = self._bound_sink(stream)
                    if bound is not None and at + 1 < len(parsed):
                        rest = parsed[at + 1 :]
                        self._to_sink(stream_id, stream, bound[0], bound[1], rest, out)
                        break
        else:
            self._to_sink(stream_id, stream, bound[0], bound[1], parsed, out)
        if end_stream and stream.held is None:
            self._in_streams.pop(stream_id, None)

    def _bound_sink(self, stream: _InStream) -> tuple[int, TrackSink] | None:
        """The request ``stream`` is bound to and its sink, if it has one and the stream is
        not held (a subgroup waiting for its SUBSCRIBE_OK) or ignored."""
        request_id = stream.request_id
        if request_id is None or stream.held or stream.ignored:
            return None
        sink = self._sinks.get(request_id)
        return None if sink is None else (request_id, sink)

    def _to_sink(
        self,
        stream_id: int,
        stream: _InStream,
        request_id: int,
        sink: TrackSink,
        parsed: list[DataStreamEvent],
        out: list[MOQTEvent],
    ) -> None:
        """A bound stream with a sink: pieces and object bounds go straight to it (what
        :meth:`_route` and :meth:`_emit` would deliver, without their dispatch)."""
        on_payload, on_event = sink.on_payload, sink.on_event
        for event in parsed:
            if type(event) is ObjectRun:
                on_run = self._run_sinks.get(request_id)
                if on_run is not None and on_run(stream_id, event):
                    self.payload_octets_received += event.octets
                else:
                    self._to_sink(stream_id, stream, request_id, sink, event.events(), out)
            elif type(event) is ObjectChunk:
                self.payload_octets_received += len(event.data)
                on_payload(stream_id, event.data, event.offset)
            elif type(event) is ObjectStart:
                on_event(ObjectHeader(stream_id, request_id, stream.track_alias, event))
            elif type(event) is ParsedObjectEnd:
                on_event(ObjectEnd(stream_id, request_id, event.group_id, event.object_id))
            else:
                self._route(stream_id, stream, event, out)

    def _payload_to_sink(self, stream_id: int, stream: _InStream, data: bytes) -> bool:
        """The hot path, on a bound stream whose track has a sink: a piece wholly inside one
        object's payload, or one crossing one object boundary (the end of a payload, the next
        header, the start of its payload), goes straight to the sink without the parser's
        events (what :meth:`_to_sink` would deliver, in the same order)."""
        request_id = stream.request_id
        if request_id is None or stream.held:
            return False
        sink = self._sinks.get(request_id)
        if sink is None:
            return False
        parser = stream.parser
        offset = parser.payload_within(len(data))
        if offset >= 0:
            self.payload_octets_received += len(data)
            sink.on_payload(stream_id, as_byte_view(data), offset)
            return True
        view = as_byte_view(data)
        try:
            crossing = parser.cross_boundary(view)
        except MalformedTrack:
            return False  # feed() raises it again, and the stream is handled as malformed
        if crossing is None:
            return False
        tail, offset, ended, started, head = crossing
        self.payload_octets_received += tail + len(view) - head
        sink.on_payload(stream_id, view[:tail], offset)
        sink.on_event(ObjectEnd(stream_id, request_id, ended.group_id, ended.object_id))
        sink.on_event(ObjectHeader(stream_id, request_id, stream.track_alias, started))
        sink.on_payload(stream_id, view[head:], 0)
        return True

    def _route(
        self, stream_id: int, stream: _InStream, event: DataStreamEvent, out: list[MOQTEvent]
    ) -> None:
        if type(event) is ObjectChunk and stream.held is None:  # the hot path: payload
            request_id = stream.request_id
            if request_id is not None and not stream.ignored:
                self._payload(stream_id, request_id, event, out)
        elif type(event) is ObjectRun:
            for each in event.events():
                self._route(stream_id, stream, each, out)
        elif isinstance(event, SubgroupHeader):
            self._open_subgroup_in(stream_id, stream, event, out)
        elif isinstance(event, FetchHeader):
            self._open_fetch_in(stream_id, stream, event.request_id, out)
        elif stream.held is not None:
            stream.held.append(event)
            if isinstance(event, ObjectChunk):
                stream.held_bytes += len(event.data)
                if stream.held_bytes > HELD_BYTES_MAX:
                    self._drop_held(stream_id, stream)
        elif stream.request_id is not None and not stream.ignored:
            self._emit(stream_id, stream, stream.request_id, event, out)

    def _open_subgroup_in(
        self, stream_id: int, stream: _InStream, header: SubgroupHeader, out: list[MOQTEvent]
    ) -> None:
        alias = stream.track_alias = header.track_alias
        request_id = self._aliases_in.get(alias)
        if request_id is None:
            stream.held = [header]  # §10.4.2: the SUBSCRIBE_OK may still be on its way
            self._held_by_alias.setdefault(alias, []).append(stream_id)
            return
        stream.request_id = request_id
        self._deliver(request_id, SubgroupStreamOpened(stream_id, request_id, header), out)

    def _open_fetch_in(
        self, stream_id: int, stream: _InStream, request_id: int, out: list[MOQTEvent]
    ) -> None:
        request = self.requests.get(request_id)
        if request is None:
            if not self.requests.ids.is_past_local(request_id):
                raise ProtocolViolation(f"FETCH_HEADER names request {request_id}, not our fetch")
            stream.ignored = True  # a fetch we cancelled
            self._quic.stop_stream(stream_id, StreamResetCode.CANCELLED)
            return
        if request.kind != RequestKind.FETCH or not request.local:
            raise ProtocolViolation(f"FETCH_HEADER names {request.kind.name} {request_id}")
        stream.request_id = request_id
        self._deliver(request_id, FetchStreamOpened(stream_id, request_id), out)

    def _emit(
        self,
        stream_id: int,
        stream: _InStream,
        request_id: int,
        event: DataStreamEvent,
        out: list[MOQTEvent],
    ) -> None:
        emitted: MOQTEvent
        if isinstance(event, ObjectChunk):
            self._payload(stream_id, request_id, event, out)
            return
        if isinstance(event, ObjectStart):
            emitted = ObjectHeader(stream_id, request_id, stream.track_alias, event)
        elif isinstance(event, ParsedObjectEnd):
            emitted = ObjectEnd(stream_id, request_id, event.group_id, event.object_id)
        elif isinstance(event, EndOfRange):
            emitted = EndOfRangeReceived(
                stream_id, request_id, event.group_id, event.object_id, event.unknown
            )
        elif isinstance(event, StreamFinished):
            if stream.track_alias is None:  # a fetch stream: the fetch is complete
                self.requests.apply(request_id, Signal.FETCH_COMPLETE, by_local=False)
            emitted = DataStreamFinished(stream_id, request_id)
        else:
            return
        self._deliver(request_id, emitted, out)

    def _payload(
        self, stream_id: int, request_id: int, chunk: ObjectChunk, out: list[MOQTEvent]
    ) -> None:
        self.payload_octets_received += len(chunk.data)
        sink = self._sinks.get(request_id)
        if sink is None:
            out.append(ObjectData(stream_id, request_id, chunk.data, chunk.offset))
        else:
            sink.on_payload(stream_id, chunk.data, chunk.offset)

    def _bind_alias(self, alias: int, request_id: int, out: list[MOQTEvent]) -> None:
        """Route the Track Alias to ``request_id`` and release streams held for it."""
        self._aliases_in[alias] = request_id
        for stream_id in self._held_by_alias.pop(alias, []):
            stream = self._in_streams.get(stream_id)
            if stream is None or stream.held is None:
                continue
            held, stream.held, stream.request_id = stream.held, None, request_id
            for event in held:
                if isinstance(event, SubgroupHeader):
                    opened = SubgroupStreamOpened(stream_id, request_id, event)
                    self._deliver(request_id, opened, out)
                else:
                    self._emit(stream_id, stream, request_id, event, out)
            if stream.ended:
                del self._in_streams[stream_id]

    def _alias_in_use(self, alias: int) -> bool:
        """True when an open subscription receives objects with this Track Alias."""
        request_id = self._aliases_in.get(alias)
        return request_id is not None and request_id in self.requests

    def _drop_held(self, stream_id: int, stream: _InStream) -> None:
        stream.held, stream.ignored = None, True
        self._quic.stop_stream(stream_id, StreamResetCode.INTERNAL_ERROR)

    def _malformed(
        self, stream_id: int, stream: _InStream, reason: str, out: list[MOQTEvent]
    ) -> None:
        """§11: a malformed track ends the subscription or fetch, not the session."""
        stream.ignored, stream.held = True, None
        self._quic.stop_stream(stream_id, StreamResetCode.MALFORMED_TRACK)
        request_id = stream.request_id
        header = stream.parser.header  # the error may come in the feed that held the header
        if request_id is None and isinstance(header, SubgroupHeader):
            stream.track_alias = header.track_alias  # a subgroup stream, not a fetch's
            request_id = self._aliases_in.get(header.track_alias)
        elif request_id is None and isinstance(header, FetchHeader):
            request_id = header.request_id
        if request_id is None:
            return
        stream.request_id = request_id  # the peer's RESET of this stream names the request
        request = self.requests.get(request_id)
        if request is not None:
            self._cancel_malformed(request)
        self._deliver(request_id, MalformedTrackDetected(request_id, stream_id, reason), out)

    def _cancel_malformed(self, request: Request) -> None:
        kind, request_id = request.kind, request.request_id
        if kind == RequestKind.FETCH and request.local:
            self.requests.apply(request_id, Signal.FETCH_CANCEL, by_local=True)
            self._send_control(FetchCancel(request_id=request_id))
        elif kind in (RequestKind.SUBSCRIBE, RequestKind.PUBLISH):
            if kind == RequestKind.PUBLISH and request.state != RequestState.ESTABLISHED:
                return
            self.requests.apply(request_id, Signal.UNSUBSCRIBE, by_local=True)
            self._send_control(Unsubscribe(request_id=request_id))

    def _on_data_stream_reset(self, stream_id: int, error_code: int, out: list[MOQTEvent]) -> None:
        stream = self._in_streams.pop(stream_id, None)
        request_id = None if stream is None else stream.request_id
        if stream is not None and request_id is not None and stream.track_alias is None:
            self.requests.apply(request_id, Signal.FETCH_COMPLETE, by_local=False)
        reset = DataStreamReset(stream_id, request_id, error_code)
        if request_id is None:
            out.append(reset)
        else:
            self._deliver(request_id, reset, out)

    def _on_stop_sending(self, stream_id: int, error_code: int, out: list[MOQTEvent]) -> None:
        stream = self._out_streams.pop(stream_id, None)
        if stream is None or stream.closed:
            return
        stream.closed = True
        self._quic.reset_stream(stream_id, error_code)
        out.append(DataStreamStopped(stream_id, stream.request_id, error_code))

    def _on_datagram(self, data: bytes, out: list[MOQTEvent]) -> None:
        try:
            datagram = ObjectDatagram.decode(data)
        except MalformedTrack:
            return  # one lost datagram; datagrams carry no delivery promise
        request_id = self._aliases_in.get(datagram.track_alias)
        if request_id is not None:  # an unknown alias may precede its SUBSCRIBE_OK: drop
            self._deliver(request_id, DatagramReceived(request_id, datagram), out)

    # --- sending -------------------------------------------------------------------------------

    def _publishing(self, request_id: int) -> Request:
        """The open request whose objects we publish: a SUBSCRIBE we accepted, or our PUBLISH."""
        request = self.requests.get(request_id)
        if request is None:
            raise LocalProtocolError(f"request {request_id} is not open")
        accepted = request.kind == RequestKind.SUBSCRIBE and not request.local
        if accepted and request.state == RequestState.ESTABLISHED:
            return request
        if request.kind == RequestKind.PUBLISH and request.local:
            return request
        raise LocalProtocolError(f"we do not publish objects for request {request_id}")

    def _open_stream(self) -> int:
        if not self._backend.can_open_stream(self._quic, unidirectional=True):
            raise StreamsBlockedError("the peer's unidirectional stream limit is reached")
        return self._quic.get_next_available_stream_id(is_unidirectional=True)

    def can_open_data_stream(self) -> bool:
        """Whether a data stream can be opened now without passing the peer's stream limit."""
        return self._backend.can_open_stream(self._quic, unidirectional=True)

    def open_subgroup(
        self,
        request_id: int,
        group_id: int,
        *,
        subgroup_id: int = 0,
        publisher_priority: int | None = DEFAULT_PRIORITY,
        extensions: bool = True,
        end_of_group: bool = False,
    ) -> int:
        """Open a subgroup stream (§10.4.2) for a subscription we serve; returns its stream ID.

        ``extensions`` makes every object carry an Extensions field; ``end_of_group`` says the
        FIN ends the group.

        Raises:
            LocalProtocolError: the request is not one whose objects we publish.
            StreamsBlockedError: the peer's stream limit is reached (wait, then retry).
        """
        request = self._publishing(request_id)
        if request.track_alias is None:
            raise LocalProtocolError(f"request {request_id} has no track alias")
        header = SubgroupHeader(
            track_alias=request.track_alias,
            group_id=group_id,
            subgroup_id_mode=SubgroupIdMode.ZERO if subgroup_id == 0 else SubgroupIdMode.EXPLICIT,
            subgroup_id=subgroup_id,
            publisher_priority=publisher_priority,
            has_extensions=extensions,
            end_of_group=end_of_group,
        )
        writer = SubgroupWriter(header)
        stream_id = self._open_stream()
        self._quic.send_stream_data(stream_id, writer.header_bytes())
        self._out_streams[stream_id] = _OutStream(request_id, writer)
        request.streams_opened += 1
        return stream_id

    def open_fetch_stream(self, request_id: int) -> int:
        """Open the response stream (§10.4.4) of a FETCH we answered with ``fetch_ok``.

        Raises:
            LocalProtocolError: no such established fetch from the peer.
            StreamsBlockedError: the peer's stream limit is reached (wait, then retry).
        """
        request = self.requests.get(request_id)
        if request is None or request.kind != RequestKind.FETCH or request.local:
            raise LocalProtocolError(f"request {request_id} is not a fetch from the peer")
        if request.state != RequestState.ESTABLISHED:
            raise LocalProtocolError(f"fetch {request_id}: send FETCH_OK first")
        writer = FetchStreamWriter(request_id)
        stream_id = self._open_stream()
        self._quic.send_stream_data(stream_id, writer.header_bytes())
        self._out_streams[stream_id] = _OutStream(request_id, writer)
        return stream_id

    def _writable(self, stream_id: int) -> _OutStream:
        stream = self._out_streams.get(stream_id)
        if stream is None or stream.closed:
            raise StreamClosedError(f"data stream {stream_id} is not open")
        return stream

    def begin_object(
        self,
        stream_id: int,
        object_id: int,
        payload_length: int,
        *,
        extensions: Sequence[KeyValuePair] = (),
        status: ObjectStatus = ObjectStatus.NORMAL,
    ) -> None:
        """Write a subgroup object's fields; its ``payload_length`` bytes follow by
        :meth:`write_payload`.

        Raises:
            StreamClosedError: the stream is closed.
            LocalProtocolError: the previous object's payload is incomplete, or this is a fetch
                stream.
            ValueError: Object IDs not ascending, or extensions the stream type cannot carry.
        """
        stream = self._writable(stream_id)
        writer = stream.writer
        if stream.payload_left or not isinstance(writer, SubgroupWriter):
            raise LocalProtocolError(f"stream {stream_id}: cannot start a subgroup object now")
        fields = writer.object_header(
            object_id, payload_length, extensions=extensions, status=status
        )
        self._quic.send_stream_data(stream_id, fields)
        stream.payload_left = payload_length

    def begin_fetch_object(
        self,
        stream_id: int,
        *,
        group_id: int,
        object_id: int,
        payload_length: int,
        subgroup_id: int | None = 0,
        publisher_priority: int = DEFAULT_PRIORITY,
        extensions: Sequence[KeyValuePair] = (),
    ) -> None:
        """Write a fetched object's fields (§10.4.4); the payload follows by
        :meth:`write_payload`.

        Raises:
            StreamClosedError: the stream is closed.
            LocalProtocolError: the previous payload is incomplete, or not a fetch stream.
        """
        stream = self._writable(stream_id)
        writer = stream.writer
        if stream.payload_left or not isinstance(writer, FetchStreamWriter):
            raise LocalProtocolError(f"stream {stream_id}: cannot start a fetch object now")
        fields = writer.object_header(
            group_id=group_id,
            object_id=object_id,
            subgroup_id=subgroup_id,
            publisher_priority=publisher_priority,
            payload_length=payload_length,
            extensions=extensions,
        )
        self._quic.send_stream_data(stream_id, fields)
        stream.payload_left = payload_length

    def write_payload(self, stream_id: int, data: Bytes, *, end_stream: bool = False) -> None:
        """Send the next piece of the current object's payload (passed on without copying).

        ``end_stream`` (allowed once the payload is complete) sends the FIN with it.

        Raises:
            StreamClosedError: the stream is closed.
            LocalProtocolError: more bytes than the object has left, or a FIN before its end.
        """
        stream = self._writable(stream_id)
        size = len(data)
        if size > stream.payload_left:
            raise LocalProtocolError(f"stream {stream_id}: {size} bytes, object has fewer left")
        if end_stream and size != stream.payload_left:
            raise LocalProtocolError(f"stream {stream_id}: FIN inside an object")
        stream.payload_left -= size
        self.payload_octets_sent += size
        self._quic.send_stream_data(stream_id, data, end_stream)
        if end_stream:
            self._close_out(stream_id, stream)

    def begin_stream_object(self, stream_id: int, obj: StreamObject, payload_length: int) -> None:
        """Write the fields of ``obj`` (its payload not included) on a subgroup or fetch
        stream: :meth:`begin_object` or :meth:`begin_fetch_object`, by the stream's type.

        Raises:
            see :meth:`begin_object` and :meth:`begin_fetch_object`.
        """
        stream = self._writable(stream_id)
        if isinstance(stream.writer, FetchStreamWriter):
            self.begin_fetch_object(
                stream_id,
                group_id=obj.group_id,
                object_id=obj.object_id,
                payload_length=payload_length,
                subgroup_id=obj.subgroup_id,
                publisher_priority=obj.publisher_priority,
                extensions=obj.extensions,
            )
        else:
            self.begin_object(stream_id, obj.object_id, payload_length, extensions=obj.extensions)

    def send_objects(
        self, stream_id: int, objects: Sequence[StreamObject], *, end_stream: bool = False
    ) -> int:
        """A run of whole objects on one stream, queued at once; returns their payload bytes.

        Every object's fields are encoded first, then the headers and payload buffers go to the
        transport in order: a carrier that takes a list of buffers
        (``send_stream_buffers``, QMux) gets them in one call, QUIC one call per buffer. The
        payloads are passed on without copying. ``end_stream`` sends the FIN after the last
        object (with no objects, at once). Nothing is sent when an object is refused.

        Raises:
            StreamClosedError: the stream is closed.
            LocalProtocolError: inside an object (a payload begun with :meth:`begin_object`
                is incomplete).
            ValueError: Object IDs not ascending on a subgroup stream, extensions the stream
                type cannot carry, or a field out of range.
        """
        stream = self._writable(stream_id)
        if stream.payload_left:
            raise LocalProtocolError(f"stream {stream_id}: an object's payload is incomplete")
        writer = stream.writer
        mark = writer.mark()
        try:
            buffers, total = _encode_run(writer, objects)
        except BaseException:
            writer.rewind(mark)
            raise
        quic = self._quic
        send_buffers = getattr(quic, "send_stream_buffers", None)
        if send_buffers is not None:
            send_buffers(stream_id, buffers, end_stream)
        else:
            last = len(buffers) - 1
            for index, buffer in enumerate(buffers):
                quic.send_stream_data(stream_id, buffer, end_stream and index == last)
            if end_stream and not buffers:
                quic.send_stream_data(stream_id, b"", True)
        self.payload_octets_sent += total
        if end_stream:
            self._close_out(stream_id, stream)
        return total

    def send_object(
        self,
        stream_id: int,
        object_id: int,
        payload: Bytes,
        *,
        extensions: Sequence[KeyValuePair] = (),
        end_stream: bool = False,
    ) -> None:
        """One whole subgroup object: its fields, then ``payload`` as a separate write.

        Raises:
            see :meth:`begin_object` and :meth:`write_payload`.
        """
        self.begin_object(stream_id, object_id, len(payload), extensions=extensions)
        if payload:
            self.write_payload(stream_id, payload, end_stream=end_stream)
        elif end_stream:
            self.finish_stream(stream_id)

    def send_fetch_object(
        self,
        stream_id: int,
        *,
        group_id: int,
        object_id: int,
        payload: Bytes,
        subgroup_id: int | None = 0,
        publisher_priority: int = DEFAULT_PRIORITY,
        extensions: Sequence[KeyValuePair] = (),
        end_stream: bool = False,
    ) -> None:
        """One whole fetched object.

        Raises:
            see :meth:`begin_fetch_object` and :meth:`write_payload`.
        """
        self.begin_fetch_object(
            stream_id,
            group_id=group_id,
            object_id=object_id,
            payload_length=len(payload),
            subgroup_id=subgroup_id,
            publisher_priority=publisher_priority,
            extensions=extensions,
        )
        if payload:
            self.write_payload(stream_id, payload, end_stream=end_stream)
        elif end_stream:
            self.finish_stream(stream_id)

    def send_end_of_range(
        self, stream_id: int, group_id: int, object_id: int, *, unknown: bool = False
    ) -> None:
        """A FETCH End of Range marker (§10.4.4.2).

        Raises:
            StreamClosedError: the stream is closed.
            LocalProtocolError: inside an object, or not a fetch stream.
        """
        stream = self._writable(stream_id)
        writer = stream.writer
        if stream.payload_left or not isinstance(writer, FetchStreamWriter):
            raise LocalProtocolError(f"stream {stream_id}: cannot end a range now")
        self._quic.send_stream_data(
            stream_id, writer.end_of_range(group_id, object_id, unknown=unknown)
        )

    def finish_stream(self, stream_id: int) -> None:
        """FIN the data stream on an object boundary.

        Raises:
            StreamClosedError: the stream is closed.
            LocalProtocolError: inside an object (§10.4: a FIN mid-object is a violation).
        """
        stream = self._writable(stream_id)
        if stream.payload_left:
            raise LocalProtocolError(f"stream {stream_id}: FIN inside an object")
        self._quic.send_stream_data(stream_id, b"", True)
        self._close_out(stream_id, stream)

    def reset_data_stream(
        self, stream_id: int, error_code: int = StreamResetCode.INTERNAL_ERROR
    ) -> None:
        """Abort a data stream we send (RESET_STREAM with a §10.4.3 code); no-op when closed."""
        stream = self._out_streams.pop(stream_id, None)
        if stream is not None and not stream.closed:
            stream.closed = True
            self._quic.reset_stream(stream_id, error_code)

    def _close_out(self, stream_id: int, stream: _OutStream) -> None:
        stream.closed = True
        del self._out_streams[stream_id]
        request = self.requests.get(stream.request_id)
        if isinstance(stream.writer, FetchStreamWriter) and request is not None:
            self.requests.apply(stream.request_id, Signal.FETCH_COMPLETE, by_local=True)

    def _reset_streams_of(self, request_id: int, error_code: int) -> None:
        for stream_id, stream in list(self._out_streams.items()):
            if stream.request_id == request_id:
                self.reset_data_stream(stream_id, error_code)

    def send_buffered(self, stream_id: int) -> int:
        """Bytes of a stream still held by QUIC (for flow-control aware senders)."""
        return self._backend.send_buffer_size(self._quic, stream_id)

    def open_data_streams(self, request_id: int | None = None) -> list[int]:
        """Our open data streams (of one request, or all)."""
        return [
            stream_id
            for stream_id, stream in self._out_streams.items()
            if request_id is None or stream.request_id == request_id
        ]

    def send_datagram(
        self,
        request_id: int,
        group_id: int,
        object_id: int,
        payload: Bytes,
        *,
        publisher_priority: int | None = DEFAULT_PRIORITY,
        extensions: Sequence[KeyValuePair] = (),
        end_of_group: bool = False,
    ) -> None:
        """One OBJECT_DATAGRAM (§10.3.1) for a subscription we serve.

        Raises:
            LocalProtocolError: the request is not one whose objects we publish.
        """
        request = self._publishing(request_id)
        if request.track_alias is None:
            raise LocalProtocolError(f"request {request_id} has no track alias")
        datagram = ObjectDatagram(
            track_alias=request.track_alias,
            group_id=group_id,
            object_id=object_id,
            publisher_priority=publisher_priority,
            extensions=tuple(extensions),
            end_of_group=end_of_group,
            payload=payload,
        )
        self._quic.send_datagram_frame(datagram.encode())


def _encode_run(
    writer: SubgroupWriter | FetchStreamWriter, objects: Sequence[StreamObject]
) -> tuple[list[Bytes], int]:
    """Every object's fields followed by its payload buffers (flat byte views, empty ones
    left out), and the payload bytes in all."""
    fetch = type(writer) is FetchStreamWriter
    buffers: list[Bytes] = []
    append = buffers.append
    total = 0
    for obj in objects:
        payload = obj.payload
        parts = (payload,) if isinstance(payload, bytes | bytearray | memoryview) else payload
        size = 0
        for part in parts:
            size += part.nbytes if type(part) is memoryview else len(part)
        if fetch:
            header = cast(FetchStreamWriter, writer).object_header(
                group_id=obj.group_id,
                object_id=obj.object_id,
                subgroup_id=obj.subgroup_id,
                publisher_priority=obj.publisher_priority,
                payload_length=size,
                extensions=obj.extensions,
            )
        else:
            header = cast(SubgroupWriter, writer).object_header(
                obj.object_id, size, extensions=obj.extensions
            )
        append(header)
        for part in parts:
            if type(part) is memoryview and (part.ndim != 1 or part.format != "B"):
                part = as_byte_view(part)
            if len(part):
                append(part)
        total += size
    return buffers, total
