"""Thin asyncio shell over :class:`~moqt.session.MOQTSession`: ``connect()`` and ``serve()``.

The QUIC library's own ``QuicConnectionProtocol`` (aioquic or qh3, see :mod:`moqt.backend`)
drives the connection; ours feeds each QUIC event to the session and hands the MOQT events to
futures (replies to our requests), :class:`TrackReader` queues (objects of one request) and the
connection's request queue (what the peer asks of us). Every QUIC socket gets
SO_RCVBUF/SO_SNDBUF of ``TransportConfig.socket_buffer``.

Sending respects the transport: ``open_subgroup`` waits for stream credit (qh3 raises at the
peer's stream limit, and the failed send has already used the ID, so it is never retried), and
payloads are written in pieces while the stream's send buffer is below a high-water mark.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar, cast

from .backend import Backend, TransportConfig, get_backend
from .errors import ObjectStatus, SessionError
from .messages import (
    STREAM_COUNT_UNKNOWN,
    AuthToken,
    FetchOk,
    MessageParameters,
    RequestOk,
    SubscribeOk,
    TokenAliasType,
)
from .session import MOQTSession, SessionConfig
from .session_events import (
    DataStreamFinished,
    DataStreamReset,
    FetchOkReceived,
    MaxRequestIdReceived,
    MOQTEvent,
    NamespaceDoneReceived,
    NamespaceReceived,
    ObjectData,
    ObjectEnd,
    ObjectHeader,
    PublishDoneReceived,
    RequestErrorReceived,
    RequestOkReceived,
    SessionClosed,
    SetupComplete,
    SubgroupStreamOpened,
    SubscribeOkReceived,
)
from .session_state import RequestsBlockedError
from .wire import Bytes, KeyValuePair, Location, TrackNamespace

log = logging.getLogger(__name__)
T = TypeVar("T")
WRITE_CHUNK = 256 << 10  # payload handed to QUIC per call
SEND_HIGH_WATER = 2 << 20  # wait while a stream holds more than this
_REPLIES = (
    SubscribeOkReceived,
    FetchOkReceived,
    RequestOkReceived,
    RequestErrorReceived,
)
_TRACK_EVENTS = (
    SubgroupStreamOpened,
    ObjectHeader,
    ObjectData,
    ObjectEnd,
    DataStreamFinished,
    PublishDoneReceived,
)


def _track_request(event: MOQTEvent) -> int | None:
    """The request whose object stream ``event`` belongs to, if it is a data event."""
    if isinstance(event, (*_TRACK_EVENTS, DataStreamReset)):
        return event.request_id
    return None


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
    as it counted have ended (at once when the count is unknown).
    """

    def __init__(self, request_id: int) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[MOQTEvent | Exception | None] = asyncio.Queue()
        self._streams_expected: int | None = None
        self._streams_ended = 0
        self.ended = False

    def _feed(self, event: MOQTEvent) -> None:
        self._queue.put_nowait(event)
        if isinstance(event, DataStreamFinished | DataStreamReset):
            self._streams_ended += 1
        elif isinstance(event, PublishDoneReceived):
            count = event.message.stream_count
            self._streams_expected = 0 if count == STREAM_COUNT_UNKNOWN else count
        expected = self._streams_expected
        if expected is not None and self._streams_ended >= expected:
            self._end()

    def _fetch_done(self) -> None:
        self._streams_expected = 1
        if self._streams_ended >= 1:
            self._end()

    def _end(self, error: Exception | None = None) -> None:
        if not self.ended:
            self.ended = True
            self._queue.put_nowait(error)

    async def events(self) -> AsyncIterator[MOQTEvent]:
        """The raw data events: stream opened, object header, payload pieces, ends.

        Raises:
            SessionClosedError: the session ended before the track did.
        """
        while (event := await self._queue.get()) is not None:
            if isinstance(event, Exception):
                raise event
            yield event

    async def objects(self) -> AsyncIterator[ReceivedObject]:
        """Whole objects (pieces joined); ends with the track, raising on a stream reset.

        Raises:
            ConnectionResetError: a data stream of the track was reset by the peer.
        """
        parts: dict[int, tuple[ObjectHeader, bytearray]] = {}
        async for event in self.events():
            if isinstance(event, ObjectHeader):
                parts[event.stream_id] = (event, bytearray())
            elif isinstance(event, ObjectData):
                parts[event.stream_id][1].extend(event.data)
            elif isinstance(event, ObjectEnd):
                header, payload = parts.pop(event.stream_id)
                obj = header.object
                yield ReceivedObject(
                    obj.group_id, obj.object_id, obj.extensions, obj.status, payload
                )
            elif isinstance(event, DataStreamReset):
                raise ConnectionResetError(f"stream {event.stream_id} reset: {event.error_code}")


@dataclass(frozen=True, slots=True)
class Subscription:
    """An accepted SUBSCRIBE: the publisher's SUBSCRIBE_OK and the track's objects."""

    request_id: int
    ok: SubscribeOk
    track: TrackReader


@dataclass(frozen=True, slots=True)
class FetchResponse:
    """An accepted FETCH: the FETCH_OK and the fetched objects."""

    request_id: int
    ok: FetchOk
    track: TrackReader


class MOQTConnection:
    """One live MOQT session (either side): requests, replies, objects, flow-aware sending."""

    def __init__(self, protocol: Any, session: MOQTSession) -> None:
        self._protocol = protocol
        self.session = session
        loop = asyncio.get_running_loop()
        self._setup: asyncio.Future[SetupComplete] = loop.create_future()
        self._closed: asyncio.Future[SessionClosed] = loop.create_future()
        self._replies: dict[int, asyncio.Future[MOQTEvent]] = {}
        self._tracks: dict[int, TrackReader] = {}
        self._namespaces: dict[int, asyncio.Queue[MOQTEvent | None]] = {}
        self._requests: asyncio.Queue[MOQTEvent | None] = asyncio.Queue()
        self._tick: asyncio.Future[None] | None = None

    # --- plumbing --------------------------------------------------------------------------

    def _dispatch(self, events: list[MOQTEvent]) -> None:
        for event in events:
            if isinstance(event, SetupComplete):
                self._setup.set_result(event)
            elif isinstance(event, SessionClosed):
                self._on_closed(event)
            elif isinstance(event, _REPLIES) and event.request_id in self._replies:
                self._on_reply(event)
            elif (request_id := _track_request(event)) is not None:
                self.track(request_id)._feed(event)
            elif isinstance(event, NamespaceReceived | NamespaceDoneReceived):
                self._namespaces.setdefault(event.request_id, asyncio.Queue()).put_nowait(event)
            elif not isinstance(event, MaxRequestIdReceived):
                self._requests.put_nowait(event)

    def _on_reply(self, event: MOQTEvent) -> None:
        request_id = cast(int, getattr(event, "request_id"))  # noqa: B009 - every reply has one
        self._replies.pop(request_id).set_result(event)
        reader = self._tracks.get(request_id)
        if reader is None:
            return
        if isinstance(event, RequestErrorReceived):
            reader._end()
        elif isinstance(event, FetchOkReceived):
            reader._fetch_done()

    def _on_closed(self, event: SessionClosed) -> None:
        if not self._closed.done():
            self._closed.set_result(event)
        if not self._setup.done():
            self._setup.set_exception(SessionClosedError(event))
        for future in self._replies.values():
            if not future.done():
                future.set_exception(SessionClosedError(event))
        self._replies.clear()
        for reader in self._tracks.values():
            reader._end(SessionClosedError(event))
        for queue in self._namespaces.values():
            queue.put_nowait(None)
        self._requests.put_nowait(None)
        self._wake()

    def _wake(self) -> None:
        tick, self._tick = self._tick, None
        if tick is not None and not tick.done():
            tick.set_result(None)

    async def _progress(self) -> None:
        """Wait until the connection moves (a datagram, a timer, a transmit)."""
        closed = self.session.closed
        if closed is not None:
            raise SessionClosedError(closed)
        if self._tick is None:
            self._tick = asyncio.get_running_loop().create_future()
        await self._tick

    def transmit(self) -> None:
        """Send what the session queued."""
        self._protocol.transmit()

    def track(self, request_id: int) -> TrackReader:
        """The reader for the objects of ``request_id`` (created on first use)."""
        reader = self._tracks.get(request_id)
        if reader is None:
            reader = self._tracks[request_id] = TrackReader(request_id)
        return reader

    async def wait_setup(self) -> SetupComplete:
        """The setup exchange; raises :class:`SessionClosedError` if the session ends first."""
        return await self._setup

    async def wait_closed(self) -> SessionClosed:
        """How the session ended."""
        return await asyncio.shield(self._closed)

    def close(self, error_code: int = SessionError.NO_ERROR, reason: str = "") -> None:
        """Close the session now."""
        self.session.close(error_code, reason)
        self.transmit()
        self._on_closed(SessionClosed(error_code, reason, by_peer=False))

    # --- our requests ----------------------------------------------------------------------

    async def _request(self, send: Callable[[], int]) -> tuple[int, MOQTEvent]:
        closed = self.session.closed
        if closed is not None:
            raise SessionClosedError(closed)
        while True:
            try:
                request_id = send()
                break
            except RequestsBlockedError:
                self.transmit()
                await self._progress()
        future = self._replies[request_id] = asyncio.get_running_loop().create_future()
        self.transmit()
        reply = await future
        if isinstance(reply, RequestErrorReceived):
            raise RequestRejected(reply)
        return request_id, reply

    async def subscribe(
        self, namespace: TrackNamespace, name: bytes, *, parameters: MessageParameters | None = None
    ) -> Subscription:
        """SUBSCRIBE and wait for SUBSCRIBE_OK.

        Raises:
            RequestRejected: REQUEST_ERROR. SessionClosedError: the session ended.
        """
        params = parameters or MessageParameters()
        readers: list[TrackReader] = []

        def send() -> int:
            request_id = self.session.subscribe(namespace, name, parameters=params)
            readers.append(self.track(request_id))
            return request_id

        request_id, reply = await self._request(send)
        return Subscription(request_id, cast(SubscribeOkReceived, reply).message, readers[0])

    async def fetch(
        self,
        namespace: TrackNamespace,
        name: bytes,
        start: Location,
        end: Location,
        *,
        parameters: MessageParameters | None = None,
    ) -> FetchResponse:
        """Standalone FETCH of ``start`` up to ``end`` (the last Location plus one).

        Raises:
            RequestRejected: REQUEST_ERROR. SessionClosedError: the session ended.
        """
        params = parameters or MessageParameters()
        readers: list[TrackReader] = []

        def send() -> int:
            request_id = self.session.fetch(namespace, name, start, end, parameters=params)
            readers.append(self.track(request_id))
            return request_id

        request_id, reply = await self._request(send)
        return FetchResponse(request_id, cast(FetchOkReceived, reply).message, readers[0])

    async def publish_namespace(self, namespace: TrackNamespace) -> RequestOk:
        """PUBLISH_NAMESPACE and wait for REQUEST_OK.

        Raises:
            RequestRejected: REQUEST_ERROR. SessionClosedError: the session ended.
        """
        _, reply = await self._request(lambda: self.session.publish_namespace(namespace))
        return cast(RequestOkReceived, reply).message

    async def subscribe_namespace(
        self, prefix: TrackNamespace
    ) -> tuple[int, asyncio.Queue[MOQTEvent | None]]:
        """SUBSCRIBE_NAMESPACE; returns its Request ID and the queue of NAMESPACE events.

        Raises:
            RequestRejected: REQUEST_ERROR. SessionClosedError: the session ended.
        """
        request_id, _ = await self._request(lambda: self.session.subscribe_namespace(prefix))
        return request_id, self._namespaces.setdefault(request_id, asyncio.Queue())

    def unsubscribe(self, request_id: int) -> None:
        """UNSUBSCRIBE; the track's reader ends now."""
        self.session.unsubscribe(request_id)
        self.transmit()
        self.track(request_id)._end()

    def fetch_cancel(self, request_id: int) -> None:
        """FETCH_CANCEL; the fetch's reader ends now."""
        self.session.fetch_cancel(request_id)
        self.transmit()
        self.track(request_id)._end()

    # --- the peer's requests ------------------------------------------------------------------

    async def next_request(self) -> MOQTEvent | None:
        """The next thing the peer asked or told us (SubscribeReceived, FetchReceived, ...);
        None once the session is closed."""
        return await self._requests.get()

    async def requests(self) -> AsyncIterator[MOQTEvent]:
        """Iterate :meth:`next_request` until the session closes."""
        while (event := await self.next_request()) is not None:
            yield event

    # --- sending objects ----------------------------------------------------------------------

    async def _with_stream_credit(self, open_stream: Callable[[], T]) -> T:
        while not self.session.can_open_data_stream():
            self.transmit()
            await self._progress()
        result = open_stream()
        self.transmit()
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
        payload: Bytes,
        *,
        extensions: Sequence[KeyValuePair] = (),
        end_stream: bool = False,
    ) -> None:
        """One subgroup object, its payload written as the stream drains."""
        self.session.begin_object(stream_id, object_id, len(payload), extensions=extensions)
        await self.write_payload(stream_id, payload, end_stream=end_stream)

    async def send_fetch_object(
        self,
        stream_id: int,
        *,
        group_id: int,
        object_id: int,
        payload: Bytes,
        extensions: Sequence[KeyValuePair] = (),
        end_stream: bool = False,
    ) -> None:
        """One fetched object, its payload written as the stream drains."""
        self.session.begin_fetch_object(
            stream_id,
            group_id=group_id,
            object_id=object_id,
            payload_length=len(payload),
            extensions=extensions,
        )
        await self.write_payload(stream_id, payload, end_stream=end_stream)

    async def write_payload(
        self, stream_id: int, payload: Bytes, *, end_stream: bool = False
    ) -> None:
        """Hand ``payload`` to QUIC in pieces, waiting while the stream holds a lot."""
        view = memoryview(payload).cast("B")
        if not view:
            if end_stream:
                self.session.finish_stream(stream_id)
                self.transmit()
            return
        for offset in range(0, len(view), WRITE_CHUNK):
            while self.session.send_buffered(stream_id) > SEND_HIGH_WATER:
                await self._progress()
            piece = view[offset : offset + WRITE_CHUNK]
            last = offset + WRITE_CHUNK >= len(view)
            self.session.write_payload(stream_id, piece, end_stream=end_stream and last)
            self.transmit()
            await asyncio.sleep(0)  # let ACKs and other streams in between pieces


# --- QUIC protocol glue --------------------------------------------------------------------------


def tune_socket(sock: Any, size: int) -> None:
    """Set SO_RCVBUF and SO_SNDBUF (perf.md: the default buffer drops datagrams)."""
    if sock is None or size <= 0:
        return
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, size)


def _transport_socket(transport: Any) -> Any:
    return transport.get_extra_info("socket") or getattr(transport, "_sock", None)


_PROTOCOLS: dict[str, type] = {}


def _protocol_class(backend: Backend) -> type:
    """A ``QuicConnectionProtocol`` subclass of the backend's library that runs a session."""
    cached = _PROTOCOLS.get(backend.name)
    if cached is not None:
        return cached
    base: Any = importlib.import_module(f"{backend.name}.asyncio.protocol").QuicConnectionProtocol

    def __init__(self: Any, quic: Any, stream_handler: Any = None, *, setup: Any) -> None:
        base.__init__(self, quic, stream_handler)
        session = MOQTSession(
            quic, is_client=setup.is_client, config=setup.session, backend=backend
        )
        self.moqt = MOQTConnection(self, session)
        self._moqt_setup = setup

    def connection_made(self: Any, transport: Any) -> None:
        base.connection_made(self, transport)
        tune_socket(_transport_socket(transport), self._moqt_setup.transport.socket_buffer)

    def quic_event_received(self: Any, event: Any) -> None:
        self.moqt._dispatch(self.moqt.session.handle_event(event))

    def transmit(self: Any) -> None:
        base.transmit(self)
        self.moqt._wake()

    namespace = {
        "__init__": __init__,
        "connection_made": connection_made,
        "quic_event_received": quic_event_received,
        "transmit": transmit,
    }
    cls = type(f"MOQTProtocol_{backend.name}", (base,), namespace)
    _PROTOCOLS[backend.name] = cls
    return cls


@dataclass(frozen=True, slots=True)
class _Setup:
    is_client: bool
    session: SessionConfig
    transport: TransportConfig


@contextlib.asynccontextmanager
async def connect(
    host: str,
    port: int,
    *,
    configuration: Any,
    backend: str = "aioquic",
    path: str | None = None,
    auth_token: bytes | None = None,
    session_config: SessionConfig | None = None,
    transport: TransportConfig | None = None,
    setup_timeout: float = 10.0,
) -> AsyncIterator[MOQTConnection]:
    """Connect, complete the MOQT setup, yield the connection; close it on exit.

    ``configuration`` is a client ``QuicConfiguration`` of ``backend``
    (:meth:`moqt.backend.Backend.configuration`); ``auth_token`` travels as an AUTHORIZATION
    TOKEN setup parameter (USE_VALUE, type 0).

    Raises:
        SessionClosedError: the session ended during setup. ConnectionError: no handshake.
    """
    quic_backend = get_backend(backend)
    config = session_config or SessionConfig()
    tokens = config.authorization_tokens
    if auth_token is not None:
        token = AuthToken(
            alias_type=TokenAliasType.USE_VALUE, token_type=0, token_value=bytes(auth_token)
        )
        tokens = (*tokens, token)
    authority = config.authority if config.authority is not None else f"{host}:{port}"
    config = replace(
        config,
        path=path if path is not None else config.path,
        authority=authority,
        authorization_tokens=tokens,
    )
    setup = _Setup(True, config, transport or TransportConfig())
    library = importlib.import_module(f"{quic_backend.name}.asyncio.client")
    cls = _protocol_class(quic_backend)
    async with library.connect(
        host,
        port,
        configuration=configuration,
        create_protocol=lambda quic, stream_handler=None: cls(quic, stream_handler, setup=setup),
    ) as protocol:
        connection: MOQTConnection = protocol.moqt
        await asyncio.wait_for(connection.wait_setup(), setup_timeout)
        try:
            yield connection
        finally:
            if connection.session.closed is None:
                connection.close()


Handler = Callable[[MOQTConnection], Awaitable[None]]


class MOQTServer:
    """A listening MOQT server; one :class:`MOQTConnection` per client, each given to the
    handler once its setup completes."""

    def __init__(self, quic_server: Any, transport: Any) -> None:
        self._quic_server = quic_server
        self._transport = transport
        self.tasks: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port)."""
        sockname = self._transport.get_extra_info("sockname")
        return str(sockname[0]), int(sockname[1])

    def close(self) -> None:
        """Close every connection and the socket."""
        self._quic_server.close()
        for task in self.tasks:
            task.cancel()


async def serve(
    host: str,
    port: int,
    *,
    configuration: Any,
    handler: Handler,
    backend: str = "aioquic",
    session_config: SessionConfig | None = None,
    transport: TransportConfig | None = None,
) -> MOQTServer:
    """Listen on ``host:port`` (port 0 picks one); call ``handler(connection)`` after each
    client's setup. A handler that raises closes its session with INTERNAL_ERROR."""
    quic_backend = get_backend(backend)
    setup = _Setup(False, session_config or SessionConfig(), transport or TransportConfig())
    cls = _protocol_class(quic_backend)
    loop = asyncio.get_running_loop()
    holder: list[MOQTServer] = []

    def create_protocol(quic: Any, stream_handler: Any = None, **_: Any) -> Any:
        protocol = cls(quic, stream_handler, setup=setup)
        task = loop.create_task(_run_handler(protocol.moqt, handler))
        holder[0].tasks.add(task)
        task.add_done_callback(holder[0].tasks.discard)
        return protocol

    server_module = importlib.import_module(f"{quic_backend.name}.asyncio.server")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    tune_socket(sock, setup.transport.socket_buffer)
    sock.bind((host, port))
    endpoint, quic_server = await loop.create_datagram_endpoint(
        lambda: server_module.QuicServer(
            configuration=configuration, create_protocol=create_protocol
        ),
        sock=sock,
    )
    holder.append(MOQTServer(quic_server, endpoint))
    return holder[0]


async def _run_handler(connection: MOQTConnection, handler: Handler) -> None:
    try:
        await connection.wait_setup()
    except SessionClosedError:
        return
    try:
        await handler(connection)
    except SessionClosedError:
        pass
    except Exception:
        log.exception("MOQT handler failed")
        if connection.session.closed is None:
            connection.close(SessionError.INTERNAL_ERROR, "handler failed")
