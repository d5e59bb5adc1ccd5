"""The asyncio plumbing under :mod:`moqt.asyncio`: track readers, object sending, errors, and
the QUIC glue.

:class:`TrackReader` is the session's :class:`~moqt.session_events.TrackSink` for one request:
the session hands it the request's data events synchronously from the QUIC event handler, so a
payload piece costs a deque append, not an event object, a queue put and a task switch. A
reader with a payload sink (:meth:`TrackReader.set_payload_sink`) passes the pieces straight on
and queues only object boundaries and stream events; one given a run sink too takes the whole
objects a piece of a FETCH stream holds in one call (a :class:`~moqt.session_events.RunSink`).

:class:`ObjectSender` writes objects as the transport allows: a stream opens once the peer's
stream limit allows it, payload (one buffer or several, e.g. K and V, never joined) goes to QUIC
while the stream holds less than a high-water mark, and writes ask for one transmit at the end
of the loop iteration, so the objects a publisher writes in a row leave in full packets instead
of one short packet per object.

The glue is the QUIC library's own ``QuicConnectionProtocol`` (aioquic or qh3) subclassed to run
a session, and for qh3 a ``QuicServer`` that validates the client's address with Retry when its
Initial datagram is padded outside the packet (see :mod:`moqt.backend`), listening on qh3's
batched GRO/GSO datagram transport (one ``sendmsg`` for many datagrams, as qh3's own client
does). A qh3 transmit sends its datagrams in batches as its connection builds them
(:meth:`moqt.backend.Backend.send_as_built`), not all of them once all are built. Datagrams
are read in batches and each connection transmits once per batch on aioquic's
client and server (:mod:`moqt.udp_endpoint`'s endpoint); qh3's server keeps its library's
per-datagram dispatch. Every QUIC socket gets SO_RCVBUF/SO_SNDBUF of
``TransportConfig.socket_buffer``. A session ends as soon as its connection starts closing
(e.g. the peer's CONNECTION_CLOSE read), not three PTOs later when the library reports the
connection drained (RFC 9000 §10.2).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import socket
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar, cast

from .backend import Backend, TransportConfig, initial_padded_outside_packets
from .errors import ObjectStatus
from .messages import STREAM_COUNT_UNKNOWN
from .objects import ObjectRun
from .session import MOQTSession, SessionConfig
from .session_data import StreamObject
from .session_events import (
    DatagramReceived,
    DataStreamFinished,
    DataStreamReset,
    MalformedTrackDetected,
    MOQTEvent,
    ObjectData,
    ObjectEnd,
    ObjectHeader,
    PublishDoneReceived,
    RequestErrorReceived,
    SessionClosed,
)
from .udp_endpoint import aioquic_client, open_batched_endpoint
from .wire import Bytes, KeyValuePair, as_byte_view

T = TypeVar("T")
PayloadSink: TypeAlias = Callable[[ObjectHeader, memoryview, int], None]
"""``sink(header, data, offset)``: a payload piece of the object ``header`` describes."""
ObjectEndSink: TypeAlias = Callable[[ObjectHeader], None]
"""``object_end(header)``: the object ``header`` describes is complete."""
ObjectRunSink: TypeAlias = Callable[[ObjectRun], None]
"""``runs(run)``: whole objects of a FETCH stream, each header with all of its payload."""
_Piece: TypeAlias = tuple[ObjectHeader, memoryview, int]  # a queued payload piece
_Item: TypeAlias = MOQTEvent | _Piece


class SessionClosedError(ConnectionError):
    """The MOQT session ended; ``closed`` says how."""

    def __init__(self, closed: SessionClosed) -> None:
        self.closed = closed
        super().__init__(f"MOQT session closed: {closed.error_code:#x} {closed.reason}")


class RequestRejected(Exception):
    """The peer answered our request with REQUEST_ERROR."""

    def __init__(self, event: RequestErrorReceived) -> None:
        self.error_code = int(event.message.error_code)
        self.reason = event.message.reason
        self.retry_interval = event.message.retry_interval
        super().__init__(f"request {event.request_id} refused: {self.error_code:#x} {self.reason}")


class MalformedTrackError(Exception):
    """The session found the track malformed (§11), stopped its stream and cancelled the
    request; ``event`` says where."""

    def __init__(self, event: MalformedTrackDetected) -> None:
        self.event = event
        self.request_id = event.request_id
        self.stream_id = event.stream_id
        self.reason = event.reason
        super().__init__(f"request {event.request_id}: malformed track: {event.reason}")


@dataclass(frozen=True, slots=True)
class ReceivedObject:
    """A whole object, its payload joined from the pieces that arrived."""

    group_id: int
    object_id: int
    extensions: tuple[KeyValuePair, ...]
    status: ObjectStatus
    payload: bytearray


class TrackReader:
    """The objects of one subscription, fetch or PUBLISH, in arrival order.

    A fetch ends with its stream; a subscription once PUBLISH_DONE arrived and as many streams
    as it counted have ended (at once when the count is unknown). A malformed track ends the
    reader with :class:`MalformedTrackError`, a closed session with :class:`SessionClosedError`.
    """

    def __init__(
        self, request_id: int, *, on_end: Callable[[TrackReader], None] | None = None
    ) -> None:
        self.request_id = request_id
        self.ended = False
        self._items: deque[_Item] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._finish_waiters: list[asyncio.Future[None]] = []  # finished() callers
        self._error: Exception | None = None
        self._streams_expected: int | None = None
        self._streams_ended = 0
        self._current: dict[int, ObjectHeader] = {}  # stream id -> the object arriving on it
        self._sink: PayloadSink | None = None
        self._bounds = True  # object headers and ends go to the iterators
        self._on_object_end: ObjectEndSink | None = None
        self._runs: ObjectRunSink | None = None
        self._on_end = on_end

    # --- fed by the session (TrackSink), synchronously ------------------------------------------

    def on_event(self, event: MOQTEvent) -> None:
        """A data event of the track (see :class:`~moqt.session_events.TrackSink`)."""
        if self.ended:
            return
        if type(event) is ObjectHeader:  # the per-object events first: most of what arrives
            self._current[event.stream_id] = event
            if self._bounds:
                self._push(event)
            return
        if type(event) is ObjectEnd:
            if self._bounds:
                self._push(event)
            elif self._on_object_end is not None:
                self._on_object_end(self._current[event.stream_id])
            return
        self._on_stream_event(event)

    def _on_stream_event(self, event: MOQTEvent) -> None:
        if isinstance(event, ObjectData):  # from the session's event list, not the sink path
            self.on_payload(event.stream_id, event.data, event.offset)
            return
        self._push(event)
        if isinstance(event, DataStreamFinished | DataStreamReset):
            self._current.pop(event.stream_id, None)
            self._streams_ended += 1
        elif isinstance(event, PublishDoneReceived):
            count = event.message.stream_count
            self._streams_expected = 0 if count == STREAM_COUNT_UNKNOWN else count
        elif isinstance(event, MalformedTrackDetected):
            self._end(MalformedTrackError(event))
            return
        expected = self._streams_expected
        if expected is not None and self._streams_ended >= expected:
            self._end()

    def on_payload(self, stream_id: int, data: memoryview, offset: int) -> None:
        """A payload piece: to the payload sink, or queued for the iterators."""
        if self.ended:
            return
        sink = self._sink
        if sink is not None:
            sink(self._current[stream_id], data, offset)
        else:
            self._items.append((self._current[stream_id], data, offset))
            self._wake()

    def on_run(self, stream_id: int, run: ObjectRun) -> bool:
        """Whole FETCH objects (:class:`~moqt.session_events.RunSink`): to the run sink, if
        one is set; otherwise declined, for the session to deliver them as events."""
        if self.ended:
            return True
        runs = self._runs
        if runs is None:
            return False
        self._current.pop(stream_id, None)  # the run's objects are complete: none is arriving
        runs(run)
        return True

    _feed = on_event  # the name the connection used before the sink path

    def _push(self, item: _Item) -> None:
        self._items.append(item)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fetch_done(self) -> None:
        self._streams_expected = 1
        if self._streams_ended >= 1:
            self._end()

    def _end(self, error: Exception | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        self._error = error
        self._release_sinks()
        self._wake()
        waiters, self._finish_waiters = self._finish_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end(self)

    def _release_sinks(self) -> None:
        """Forget the sinks (an ended reader calls none): the connection keeps an ended
        reader a while, to swallow what the peer still had in flight, and a sink may hold a
        whole block (a relay's forwarder holds the objects it cached)."""
        self._sink = self._on_object_end = self._runs = None

    # --- read by the application ------------------------------------------------------------------

    def set_payload_sink(
        self,
        sink: PayloadSink | None,
        *,
        object_end: ObjectEndSink | None = None,
        runs: ObjectRunSink | None = None,
    ) -> None:
        """Hand payload pieces to ``sink(header, data, offset)`` as they arrive, from the QUIC
        event handler; the iterators then carry object boundaries and stream events only.

        With ``object_end`` the object boundaries stay in the event handler too: each object's
        end calls ``object_end(header)`` (zero-length objects included), and the iterators
        carry only the stream events (opened, End of Range, finished, reset), datagrams and
        the track's end (:meth:`objects` then yields datagram objects only), so a consumer that
        works in the callbacks is not woken per object.

        With ``runs`` as well, the whole objects a piece of a FETCH stream holds go to
        ``runs(run)`` in one call (:class:`~moqt.objects.ObjectRun`), in their place among the
        other calls, instead of a header, a piece and an end each.

        ``data`` is a slice of the received QUIC data (valid while referenced). Pieces and
        object ends queued before the sink was set go to it now, in order.
        """
        self._sink = sink
        self._bounds = sink is None or object_end is None
        self._on_object_end = None if sink is None else object_end
        self._runs = None if self._bounds else runs
        if sink is None or not self._items:
            if self.ended:
                self._release_sinks()
            return
        kept: list[_Item] = []
        headers: dict[int, ObjectHeader] = {}  # the object each queued end closes
        for item in self._items:
            if isinstance(item, tuple):
                sink(*item)
            elif object_end is not None and isinstance(item, ObjectHeader):
                headers[item.stream_id] = item  # its pieces carry it
            elif object_end is not None and isinstance(item, ObjectEnd):
                object_end(headers.get(item.stream_id) or self._current[item.stream_id])
            else:
                kept.append(item)
        self._items.clear()  # in place: an iterator may hold this deque
        self._items.extend(kept)
        if self.ended:  # what was queued went to the sinks; nothing more will
            self._release_sinks()

    def current_object(self, stream_id: int) -> ObjectHeader | None:
        """The header of the object arriving on ``stream_id`` (already received, maybe not yet
        read), or None."""
        return self._current.get(stream_id)

    async def _drain(self) -> AsyncIterator[_Item]:
        items = self._items
        while True:
            while items:
                yield items.popleft()
            if self.ended:
                if self._error is not None:
                    raise self._error
                return
            await self._wait()

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def finished(self) -> None:
        """Wait until the track has ended, without reading it: for a reader whose payload and
        object ends go to sinks (:meth:`set_payload_sink` with ``object_end``), where the
        iterators would only wake for each stream's opening and end. Those events stay queued
        for the iterators.

        Raises:
            SessionClosedError, MalformedTrackError: the track ended so (as :meth:`events`).
        """
        if not self.ended:
            waiter = asyncio.get_running_loop().create_future()
            self._finish_waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._finish_waiters:
                    self._finish_waiters.remove(waiter)
        if self._error is not None:
            raise self._error

    async def events(self) -> AsyncIterator[MOQTEvent]:
        """The raw data events: stream opened, object header, payload pieces, ends.

        Raises:
            SessionClosedError: the session ended before the track did.
            MalformedTrackError: the session found the track malformed (after yielding the
                :class:`~moqt.session_events.MalformedTrackDetected` event).
        """
        request_id = self.request_id
        while True:  # _drain() inlined: one generator hop less per payload piece
            items = self._items
            while items:
                item = items.popleft()
                if type(item) is tuple:
                    yield ObjectData(item[0].stream_id, request_id, item[1], item[2])
                else:
                    yield cast(MOQTEvent, item)
            if self.ended:
                if self._error is not None:
                    raise self._error
                return
            await self._wait()

    async def objects(self) -> AsyncIterator[ReceivedObject]:
        """Whole objects (pieces joined, datagrams included); ends with the track, raising on
        a stream reset.

        With a payload sink set, the objects carry no payload.

        Raises:
            ConnectionResetError: a data stream of the track was reset by the peer.
            SessionClosedError, MalformedTrackError: as :meth:`events`.
        """
        parts: dict[int, tuple[ObjectHeader, bytearray]] = {}
        async for item in self._drain():
            if isinstance(item, tuple):
                header, data, offset = item
                parts[header.stream_id][1][offset : offset + len(data)] = data
            elif isinstance(item, ObjectHeader):
                size = 0 if self._sink is not None else item.payload_length
                parts[item.stream_id] = (item, bytearray(size))
            elif isinstance(item, ObjectEnd):
                header, payload = parts.pop(item.stream_id)
                obj = header.object
                yield ReceivedObject(
                    obj.group_id, obj.object_id, obj.extensions, obj.status, payload
                )
            elif isinstance(item, DatagramReceived):
                d = item.datagram
                yield ReceivedObject(
                    d.group_id, d.object_id, d.extensions, d.status, bytearray(d.payload)
                )
            elif isinstance(item, DataStreamReset):
                raise ConnectionResetError(f"stream {item.stream_id} reset: {item.error_code}")


# --- sockets and the QUIC library's protocol ------------------------------------------------------


def tune_socket(sock: Any, size: int) -> None:
    """Set SO_RCVBUF and SO_SNDBUF (perf.md: the default buffer drops datagrams)."""
    if sock is None or size <= 0:
        return
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, size)


def transport_socket(transport: Any) -> Any:
    """The UDP socket under an asyncio datagram transport (qh3's own transport hides it)."""
    return transport.get_extra_info("socket") or getattr(transport, "_sock", None)


@dataclass(frozen=True, slots=True)
class ProtocolSetup:
    """What a protocol instance needs: its role, settings and how to wrap its session."""

    is_client: bool
    session: SessionConfig
    transport: TransportConfig
    make_connection: Callable[[Any, MOQTSession], Any]


_PROTOCOLS: dict[str, type] = {}
SEND_BATCH = 64
"""Datagrams a qh3 transmit builds before it hands them to the transport: one UDP GSO send at
most (the kernel's ``UDP_MAX_SEGMENTS``), so the first leave while the rest are being built."""


def protocol_class(backend: Backend) -> type:
    """A ``QuicConnectionProtocol`` subclass of the backend's library that runs a session;
    instances take ``(quic, stream_handler, *, setup: ProtocolSetup)`` and expose the wrapped
    session as ``.moqt``.

    A datagram that arrives while its endpoint's :class:`~moqt.udp_endpoint.TransmitBatch` is
    open is fed to QUIC and its events handled at once; the transmit waits for the batch's end
    (one per batch). The batch is the transport's (``transmit_batch``), or one a server sets as
    ``_moqt_batch``. On qh3's batched transport a transmit sends :data:`SEND_BATCH` datagrams at
    a time as they are built (:meth:`~moqt.backend.Backend.send_as_built`), then re-arms the
    connection's timer as the library's transmit does.

    The session ends as soon as its connection starts closing (the peer's CONNECTION_CLOSE
    read, a local close), fed the ``ConnectionTerminated`` the library holds back until the
    connection has drained (:meth:`~moqt.backend.Backend.closing_event`, RFC 9000 §10.2):
    until then the session would look open while nothing it sends can arrive (qh3 refuses
    it), and a relay would route requests to a publisher that has left."""
    cached = _PROTOCOLS.get(backend.name)
    if cached is not None:
        return cached
    base: Any = importlib.import_module(f"{backend.name}.asyncio.protocol").QuicConnectionProtocol

    def __init__(self: Any, quic: Any, stream_handler: Any = None, *, setup: Any) -> None:
        base.__init__(self, quic, stream_handler)
        backend.quiet(quic)
        session = MOQTSession(
            quic, is_client=setup.is_client, config=setup.session, backend=backend
        )
        self.moqt = setup.make_connection(self, session)
        self._moqt_setup = setup
        self._moqt_batch = None

    def connection_made(self: Any, transport: Any) -> None:
        base.connection_made(self, transport)
        batch = getattr(transport, "transmit_batch", None)
        if batch is not None:
            self._moqt_batch = batch
        tune_socket(transport_socket(transport), self._moqt_setup.transport.socket_buffer)

    def datagram_received(self: Any, data: bytes, addr: Any) -> None:
        batch = self._moqt_batch
        if batch is None or not batch.open:
            base.datagram_received(self, data, addr)
            return
        self._quic.receive_datagram(data, addr, now=self._loop.time())
        self._process_events()
        batch.defer(self)

    def quic_event_received(self: Any, event: Any) -> None:
        events = self.moqt.session.handle_event(event)
        if events:
            self.moqt._dispatch(events)

    def _process_events(self: Any) -> None:
        base._process_events(self)
        _end_if_closing(self, backend)

    def transmit(self: Any) -> None:
        _transmit(self, backend, base)
        connection = self.moqt
        if connection._tick is not None:  # a writer waits for the connection to move
            connection._wake()

    namespace = {
        "__init__": __init__,
        "connection_made": connection_made,
        "datagram_received": datagram_received,
        "quic_event_received": quic_event_received,
        "_process_events": _process_events,
        "transmit": transmit,
    }
    cls = type(f"MOQTProtocol_{backend.name}", (base,), namespace)
    _PROTOCOLS[backend.name] = cls
    return cls


async def open_datagram_endpoint(
    backend: Backend, protocol_factory: Callable[[], Any], sock: socket.socket
) -> tuple[Any, Any]:
    """A datagram endpoint on the bound ``sock``: for aioquic :mod:`moqt.udp_endpoint`'s
    (a batch of datagrams per wake-up, one transmit per batch per connection); for qh3 its
    batched GRO/GSO transport (the one its own client uses; one ``sendmsg`` for many
    datagrams) where available, else asyncio's."""
    loop = asyncio.get_running_loop()
    if backend.name == "aioquic":
        return await open_batched_endpoint(protocol_factory, sock)
    if backend.name == "qh3":
        with contextlib.suppress(ImportError, AttributeError):
            module: Any = importlib.import_module("qh3.asyncio._transport")
            create = module.create_optimized_datagram_transport
            return cast(tuple[Any, Any], await create(loop, protocol_factory, sock=sock))
    return await loop.create_datagram_endpoint(protocol_factory, sock=sock)


def quic_client(
    backend: Backend,
    host: str,
    port: int,
    *,
    configuration: Any,
    create_protocol: Callable[..., Any],
) -> contextlib.AbstractAsyncContextManager[Any]:
    """The backend's QUIC client, yielding the connected protocol: aioquic's steps on
    :mod:`moqt.udp_endpoint`'s batched endpoint, or qh3's own ``connect`` (its GRO transport
    hands its protocol a batch at once)."""
    if backend.name == "aioquic":
        return aioquic_client(
            host, port, configuration=configuration, create_protocol=create_protocol
        )
    library: Any = importlib.import_module(f"{backend.name}.asyncio.client")
    made: list[Any] = []

    def create(*args: Any, **kwargs: Any) -> Any:
        made.append(create_protocol(*args, **kwargs))
        return made[-1]

    return _closing_socket(
        library.connect(host, port, configuration=configuration, create_protocol=create), made
    )


@contextlib.asynccontextmanager
async def _closing_socket(client: Any, made: list[Any]) -> AsyncIterator[Any]:
    """``client`` (a library's ``connect``, whose protocol lands in ``made``), with its socket
    closed on exit even when the exit's wait for the connection's end (three PTOs of closing,
    RFC 9000 §10.2) is cancelled, during the handshake or after: the library closes its
    transport only after that wait, and a cancelled one left the socket open."""
    try:
        async with client as protocol:
            yield protocol
    finally:
        for protocol in made:
            transport = getattr(protocol, "_transport", None)
            if transport is not None:
                transport.close()  # a no-op when the library closed it


def quic_server_class(backend: Backend) -> type:
    """The backend's ``QuicServer``; for qh3 one that sends Retry to a client whose Initial
    datagram is padded outside its packets (aioquic's), so qh3's anti-amplification accounting
    cannot stall the handshake (:mod:`moqt.backend`). aioquic's listens on
    :mod:`moqt.udp_endpoint`'s endpoint, whose batch its connections defer to."""
    base: Any = importlib.import_module(f"{backend.name}.asyncio.server").QuicServer
    if backend.name != "qh3":
        return cast(type, base)
    return _qh3_retry_server(base)


def _transmit(protocol: Any, backend: Backend, base: Any) -> None:
    """The library's transmit (``base.transmit``), or on qh3's batched transport its datagrams
    sent as built (:meth:`~moqt.backend.Backend.send_as_built`) and its timer re-armed."""
    send = getattr(protocol, "_sendto_many", None)
    if send is None:
        base.transmit(protocol)
        return
    protocol._transmit_task = None  # as the library's transmit: a later write schedules one
    if backend.send_as_built(protocol._quic, protocol._loop.time(), send, SEND_BATCH):
        _rearm_timer(protocol)
    else:
        base.transmit(protocol)


def _rearm_timer(protocol: Any) -> None:
    """What qh3's ``QuicConnectionProtocol.transmit`` does after sending: (re)arm the call of
    its ``_handle_timer`` at the connection's next timer (loss detection, ACK delay, pacing,
    idle), cancelling one armed for another time."""
    timer_at = protocol._quic.get_timer()
    if protocol._timer is not None and protocol._timer_at != timer_at:
        protocol._timer.cancel()
        protocol._timer = None
    if protocol._timer is None and timer_at is not None:
        protocol._timer = protocol._loop.call_at(timer_at, protocol._handle_timer)
    protocol._timer_at = timer_at


def _end_if_closing(protocol: Any, backend: Backend) -> None:
    """End the session of a connection that has started closing, with the
    ``ConnectionTerminated`` its library reports only once the connection has drained
    (:meth:`~moqt.backend.Backend.closing_event`)."""
    if protocol.moqt.session.closed is None:
        closing = backend.closing_event(protocol._quic)
        if closing is not None:
            protocol.quic_event_received(closing)


def _qh3_retry_server(base: Any) -> type:
    cached = _PROTOCOLS.get("qh3-server")
    if cached is not None:
        return cached

    def __init__(self: Any, **kwargs: Any) -> None:
        base.__init__(self, retry=True, **kwargs)
        self._moqt_retry = self._retry

    def datagram_received(self: Any, data: bytes, addr: Any) -> None:
        # qh3 consults ``_retry`` only for an Initial that opens a connection; a qh3 client
        # pads inside its packets and keeps the 1-RTT handshake
        self._retry = self._moqt_retry if initial_padded_outside_packets(data) else None
        base.datagram_received(self, data, addr)

    namespace = {"__init__": __init__, "datagram_received": datagram_received}
    cls = type("MOQTQuicServer_qh3", (base,), namespace)
    _PROTOCOLS["qh3-server"] = cls
    return cls


# --- sending objects -----------------------------------------------------------------------------

WRITE_CHUNK = 256 << 10  # payload handed to QUIC per call
SEND_HIGH_WATER = 2 << 20  # wait while a stream holds more than this
YIELD_BYTES = 1 << 20  # let other tasks run after this much payload written in a row
YIELD_WRITES = 64  # ... or this many writes
SEND_AT_ONCE_SIZE = 16 << 10  # a payload this large, written to an idle stream, goes out at once
IDLE_STREAM_BYTES = 1200  # an idle stream holds less than one minimal QUIC datagram
STREAM_WRITE_BATCH = 256 << 10  # byte-stream carriers: transmit once a stream holds this much
RUN_OBJECT_MAX = 1 << 20  # send_objects: a larger object is written alone, in pieces

Payload: TypeAlias = Bytes | Sequence[Bytes]
"""An object payload: one buffer, or several (K and V) written one after another, unjoined."""


def _payload_size(payload: Payload) -> int:
    """Bytes in ``payload`` (one buffer or several)."""
    if isinstance(payload, bytes | bytearray):
        return len(payload)
    if isinstance(payload, memoryview):
        return payload.nbytes
    size = 0
    for part in payload:
        size += part.nbytes if type(part) is memoryview else len(part)
    return size


def _byte_parts(payload: Payload) -> list[Bytes]:
    """``payload`` as flat byte buffers (a typed memoryview is recast, never copied)."""
    parts = [payload] if isinstance(payload, bytes | bytearray | memoryview) else list(payload)
    return [
        as_byte_view(part) if isinstance(part, memoryview) and part.format != "B" else part
        for part in parts
    ]


class ObjectSender:
    """Mixin of :class:`~moqt.asyncio.MOQTConnection`: objects written as the transport allows.

    Streams open once the peer's stream limit allows; payloads go to QUIC while the stream holds
    less than a high-water mark; writes ask for one transmit at the end of the loop iteration,
    except the first piece of a large payload written to an idle stream (a new one, or one the
    network drained), which is sent at once: the first packets then leave while the rest is
    queued, not after up to :data:`YIELD_BYTES` more, which would delay a FETCH's first byte well
    behind raw QUIC's. A byte-stream carrier (QMux, :attr:`first_piece_at_once` False) drains
    a stream at every transmit, so there every stream would look idle and every piece would
    leave alone: instead the first large piece of a burst of writes goes at once (the reader
    starts), then one transmit per :data:`STREAM_WRITE_BATCH` bytes queued, so many objects'
    headers, K and V leave as one STREAM frame in one system call.
    """

    session: MOQTSession
    _loop: asyncio.AbstractEventLoop
    _transmit_pending: bool
    _unyielded: list[int]
    first_piece_at_once: bool = True
    """True: the first piece of a large payload on an idle stream goes at once (QUIC's first
    byte). False (byte-stream carriers): the first large piece of each burst of writes (what
    runs before the loop's next iteration) goes at once, then a transmit whenever the stream
    holds :data:`STREAM_WRITE_BATCH` bytes."""
    _burst_sent = False  # a byte-stream burst has transmitted (until the deferred transmit)

    if TYPE_CHECKING:  # provided by MOQTConnection

        def transmit(self) -> None: ...

        async def _progress(self) -> None: ...

    def _transmit_soon(self) -> None:
        """Transmit once this loop iteration's writes are queued (full packets)."""
        if not self._transmit_pending:
            self._transmit_pending = True
            self._loop.call_soon(self._transmit_deferred)

    def _transmit_deferred(self) -> None:
        self._burst_sent = False
        if self._transmit_pending:
            self.transmit()

    async def _with_stream_credit(self, open_stream: Callable[[], T]) -> T:
        while not self.session.can_open_data_stream():
            self.transmit()
            await self._progress()
        result = open_stream()
        self._transmit_soon()
        return result

    async def open_subgroup(self, request_id: int, group_id: int, **options: Any) -> int:
        """:meth:`MOQTSession.open_subgroup`, waiting for stream credit first."""
        return await self._with_stream_credit(
            lambda: self.session.open_subgroup(request_id, group_id, **options)
        )

    async def open_fetch_stream(self, request_id: int) -> int:
        """:meth:`MOQTSession.open_fetch_stream`, waiting for stream credit first."""
        return await self._with_stream_credit(lambda: self.session.open_fetch_stream(request_id))

    async def send_object(
        self,
        stream_id: int,
        object_id: int,
        payload: Payload,
        *,
        extensions: Sequence[KeyValuePair] = (),
        end_stream: bool = False,
    ) -> None:
        """One subgroup object, its payload (one buffer or several) written as the stream
        drains."""
        parts = _byte_parts(payload)
        size = sum(len(part) for part in parts)
        self.session.begin_object(stream_id, object_id, size, extensions=extensions)
        await self._write_parts(stream_id, parts, size, end_stream)

    async def send_fetch_object(
        self,
        stream_id: int,
        *,
        group_id: int,
        object_id: int,
        payload: Payload,
        extensions: Sequence[KeyValuePair] = (),
        end_stream: bool = False,
    ) -> None:
        """One fetched object, its payload (one buffer or several) written as the stream
        drains."""
        parts = _byte_parts(payload)
        size = sum(len(part) for part in parts)
        self.session.begin_fetch_object(
            stream_id,
            group_id=group_id,
            object_id=object_id,
            payload_length=size,
            extensions=extensions,
        )
        await self._write_parts(stream_id, parts, size, end_stream)

    async def send_objects(
        self,
        stream_id: int,
        objects: Iterable[StreamObject],
        *,
        end_stream: bool = False,
    ) -> None:
        """Whole objects on one stream (subgroup or fetch), in order, in runs: each run is
        queued with one :meth:`MOQTSession.send_objects` call (headers encoded in one pass,
        payloads unjoined), so the Python work per object is its header.

        A run takes objects while the stream's bytes stay under a limit (at least one object):
        :data:`SEND_HIGH_WATER`, or :data:`STREAM_WRITE_BATCH` for the first run of a burst
        (on an idle stream for QUIC; see :attr:`first_piece_at_once`), which is transmitted at
        once so the reader starts while the rest is queued. Later runs leave with the deferred
        transmit, or at once when the stream is over the high-water mark, where the sender
        waits. So the stream never holds more than :data:`SEND_HIGH_WATER` plus one object,
        and an object above :data:`RUN_OBJECT_MAX` is written alone, in pieces as the stream
        drains. ``end_stream`` sends the FIN with the last object (with none, at once).

        Raises:
            StreamClosedError: the stream closed (e.g. the peer's STOP_SENDING) meanwhile.
            LocalProtocolError, ValueError: see :meth:`MOQTSession.send_objects`.
        """
        session = self.session
        items = list(objects)
        count = len(items)
        if not count:
            session.send_objects(stream_id, (), end_stream=end_stream)
            self._transmit_soon()
            return
        sizes = [_payload_size(obj.payload) for obj in items]
        if self.first_piece_at_once:
            first = session.send_buffered(stream_id) < IDLE_STREAM_BYTES
        else:
            first = not self._burst_sent
        index = 0
        while index < count:
            buffered = session.send_buffered(stream_id)
            while buffered > SEND_HIGH_WATER:
                self.transmit()
                await self._progress()
                buffered = session.send_buffered(stream_id)
            size = sizes[index]
            if size > RUN_OBJECT_MAX:
                await self._send_alone(stream_id, items[index], end_stream and index == count - 1)
                index, first = index + 1, False
                continue
            room = (STREAM_WRITE_BATCH if first else SEND_HIGH_WATER) - buffered - size
            end = index + 1
            while end < count and sizes[end] <= room and sizes[end] <= RUN_OBJECT_MAX:
                room -= sizes[end]
                size += sizes[end]
                end += 1
            run_end = end_stream and end == count
            session.send_objects(stream_id, items[index:end], end_stream=run_end)
            index = end
            if first and size >= SEND_AT_ONCE_SIZE:
                self._burst_sent = True
                self.transmit()
            first = False
            await self._maybe_yield(size)
        self._transmit_soon()

    async def _send_alone(self, stream_id: int, obj: StreamObject, end_stream: bool) -> None:
        """One large object of a run: its fields, then its payload as the stream drains."""
        parts = _byte_parts(obj.payload)
        size = sum(len(part) for part in parts)
        self.session.begin_stream_object(stream_id, obj, size)
        await self._write_parts(stream_id, parts, size, end_stream)

    async def write_payload(
        self, stream_id: int, payload: Payload, *, end_stream: bool = False
    ) -> None:
        """Hand ``payload`` (one buffer or several) to QUIC in pieces, waiting while the stream
        holds a lot."""
        parts = _byte_parts(payload)
        await self._write_parts(stream_id, parts, sum(len(part) for part in parts), end_stream)

    async def _write_parts(
        self, stream_id: int, parts: list[Bytes], size: int, end_stream: bool
    ) -> None:
        session = self.session
        if not size:
            if end_stream:
                session.finish_stream(stream_id)
                self._transmit_soon()
            return
        left = size
        packets = self.first_piece_at_once
        if packets:
            send_now = size >= SEND_AT_ONCE_SIZE and (
                session.send_buffered(stream_id) < IDLE_STREAM_BYTES
            )
        else:
            send_now = size >= SEND_AT_ONCE_SIZE and not self._burst_sent
        for part in parts:
            length = len(part)
            view = None if length <= WRITE_CHUNK else as_byte_view(part)
            for start in range(0, length, WRITE_CHUNK):
                piece = part if view is None else view[start : start + WRITE_CHUNK]
                while session.send_buffered(stream_id) > SEND_HIGH_WATER:
                    self.transmit()
                    await self._progress()
                left -= len(piece)
                session.write_payload(stream_id, piece, end_stream=end_stream and not left)
                if send_now or (
                    not packets and session.send_buffered(stream_id) >= STREAM_WRITE_BATCH
                ):
                    send_now = False
                    self._burst_sent = True
                    self.transmit()
                await self._maybe_yield(len(piece))
        self._transmit_soon()

    async def _maybe_yield(self, written: int) -> None:
        """Let ACKs and other tasks in now and then, not after every object (the transmit
        that follows a yield flushes what was queued, so fewer short packets)."""
        counts = self._unyielded
        counts[0] += written
        counts[1] += 1
        if counts[0] >= YIELD_BYTES or counts[1] >= YIELD_WRITES:
            counts[0] = counts[1] = 0
            self._transmit_soon()
            await asyncio.sleep(0)
