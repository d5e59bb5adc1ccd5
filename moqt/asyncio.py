"""Thin asyncio shell over :class:`~moqt.session.MOQTSession`: ``connect()`` and ``serve()``.

The QUIC library's own ``QuicConnectionProtocol`` (aioquic or qh3, see :mod:`moqt.backend` and
:mod:`moqt.transport`) drives the connection; ours feeds each QUIC event to the session. The
data events of a request go straight from the session to its :class:`TrackReader` (the
session's track sink); replies resolve futures; what the peer asks of us goes to the
connection's request queue.

Sending respects the transport: ``open_subgroup`` waits for stream credit (qh3 raises at the
peer's stream limit, and the failed send has already used the ID, so it is never retried), and
payloads are handed to QUIC while the stream's send buffer is below a high-water mark. Data
writes ask for one transmit at the end of the loop iteration, so the objects a publisher writes
in a row leave in full packets rather than one short packet per object; ``send_objects``
queues a run of whole objects (:class:`StreamObject`) per session call and transmit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar, cast

from .backend import TransportConfig, backend_of, get_backend
from .errors import SessionError, listening
from .messages import (
    AuthToken,
    FetchOk,
    MessageParameters,
    PublishOk,
    RequestOk,
    SubscribeOk,
    SubscribeOptions,
    TokenAliasType,
)
from .session import MOQTSession, SessionConfig
from .session_data import StreamObject
from .session_events import (
    DatagramReceived,
    DataStreamFinished,
    DataStreamReset,
    EndOfRangeReceived,
    FetchOkReceived,
    FetchStreamOpened,
    MalformedTrackDetected,
    MaxRequestIdReceived,
    MOQTEvent,
    NamespaceDoneReceived,
    NamespaceReceived,
    ObjectData,
    ObjectEnd,
    ObjectHeader,
    PublishDoneReceived,
    PublishOkReceived,
    RequestErrorReceived,
    RequestOkReceived,
    SessionClosed,
    SetupComplete,
    SubgroupStreamOpened,
    SubscribeNamespaceEnded,
    SubscribeOkReceived,
)
from .session_state import LocalProtocolError, RequestsBlockedError
from .transport import (
    SEND_HIGH_WATER,
    WRITE_CHUNK,
    MalformedTrackError,
    ObjectEndSink,
    ObjectRunSink,
    ObjectSender,
    Payload,
    PayloadSink,
    ProtocolSetup,
    ReceivedObject,
    RequestRejected,
    SessionClosedError,
    TrackReader,
    open_datagram_endpoint,
    protocol_class,
    quic_client,
    quic_server_class,
    tune_socket,
)
from .wire import KeyValuePair, Location, TrackNamespace

__all__ = [
    "SEND_HIGH_WATER",
    "WRITE_CHUNK",
    "FetchResponse",
    "MalformedTrackError",
    "MOQTConnection",
    "MOQTServer",
    "ObjectEndSink",
    "ObjectRunSink",
    "Payload",
    "PayloadSink",
    "Publication",
    "ReceivedObject",
    "RequestRejected",
    "SessionClosedError",
    "StreamObject",
    "Subscription",
    "TrackReader",
    "connect",
    "serve",
    "tune_socket",
]

log = logging.getLogger(__name__)
T = TypeVar("T")
ENDED_READERS_KEPT = 1024  # ended readers still answering ``track()`` and swallowing stragglers
_REPLIES = (
    SubscribeOkReceived,
    FetchOkReceived,
    RequestOkReceived,
    RequestErrorReceived,
    PublishOkReceived,
)
_TRACK_EVENTS = (
    SubgroupStreamOpened,
    FetchStreamOpened,
    ObjectHeader,
    ObjectData,
    ObjectEnd,
    EndOfRangeReceived,
    DataStreamFinished,
    DataStreamReset,
    PublishDoneReceived,
    DatagramReceived,
    MalformedTrackDetected,
)


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


@dataclass(frozen=True, slots=True)
class Publication:
    """An accepted PUBLISH: the subscriber's PUBLISH_OK; send objects with
    :meth:`MOQTConnection.open_subgroup` on ``request_id``."""

    request_id: int
    track_alias: int
    ok: PublishOk


class MOQTConnection(ObjectSender):
    """One live MOQT session (either side): requests, replies, objects, flow-aware sending."""

    def __init__(self, protocol: Any, session: MOQTSession) -> None:
        self._protocol = protocol
        self.session = session
        self._loop = loop = asyncio.get_running_loop()
        self._setup: asyncio.Future[SetupComplete] = loop.create_future()
        self._closed: asyncio.Future[SessionClosed] = loop.create_future()
        self._replies: dict[int, asyncio.Future[MOQTEvent]] = {}
        self._tracks: dict[int, TrackReader] = {}
        self._ended: OrderedDict[int, TrackReader] = OrderedDict()
        self._namespaces: dict[int, asyncio.Queue[MOQTEvent | None]] = {}
        self._requests: asyncio.Queue[MOQTEvent | None] = asyncio.Queue()
        self._tick: asyncio.Future[None] | None = None
        self._transmit_pending = False
        self._unyielded = [0, 0]  # payload bytes and writes since the writer last yielded
        self._handlers: dict[type, Callable[[Any], None]] = {
            SetupComplete: self._on_setup,
            SessionClosed: self._on_closed,
            NamespaceReceived: self._on_namespace_event,
            NamespaceDoneReceived: self._on_namespace_event,
            SubscribeNamespaceEnded: self._on_namespace_ended,
            MaxRequestIdReceived: lambda _event: None,
        }
        for reply in _REPLIES:
            self._handlers[reply] = self._on_reply_event
        for data_event in _TRACK_EVENTS:
            self._handlers[data_event] = self._on_track_event

    # --- plumbing --------------------------------------------------------------------------

    def _dispatch(self, events: list[MOQTEvent]) -> None:
        handlers = self._handlers
        for event in events:
            handler = handlers.get(type(event))
            if handler is None:
                self._requests.put_nowait(event)
            else:
                handler(event)

    def _on_setup(self, event: SetupComplete) -> None:
        if not self._setup.done():
            self._setup.set_result(event)

    def _on_reply_event(self, event: Any) -> None:
        request_id: int = event.request_id
        future = self._replies.pop(request_id, None)
        if future is None:  # a reply to a request sent with the session-level API
            self._requests.put_nowait(event)
            return
        if not future.done():
            future.set_result(event)
        reader = self._tracks.get(request_id)
        if reader is None:
            return
        if isinstance(event, RequestErrorReceived):
            reader._end()
        elif isinstance(event, FetchOkReceived):
            reader._fetch_done()

    def _on_track_event(self, event: Any) -> None:
        request_id: int | None = event.request_id
        if request_id is None:  # a reset stream that never named its request
            self._requests.put_nowait(event)
            return
        self.track(request_id).on_event(event)

    def _on_namespace_event(self, event: NamespaceReceived | NamespaceDoneReceived) -> None:
        self._namespaces.setdefault(event.request_id, asyncio.Queue()).put_nowait(event)

    def _on_namespace_ended(self, event: SubscribeNamespaceEnded) -> None:
        queue = self._namespaces.get(event.request_id)
        if queue is None:  # the peer's SUBSCRIBE_NAMESPACE
            self._requests.put_nowait(event)
        else:
            queue.put_nowait(event)
            queue.put_nowait(None)

    def _on_closed(self, event: SessionClosed) -> None:
        if not self._closed.done():
            self._closed.set_result(event)
        if not self._setup.done():
            self._setup.set_exception(SessionClosedError(event))
            self._setup.exception()  # retrieved: a failed connect raises it from wait_setup
        for future in self._replies.values():
            if not future.done():
                future.set_exception(SessionClosedError(event))
        self._replies.clear()
        for reader in list(self._tracks.values()):
            reader._end(SessionClosedError(event))
        for queue in self._namespaces.values():
            queue.put_nowait(None)
        self._requests.put_nowait(None)
        self._wake()

    def _reader_ended(self, reader: TrackReader) -> None:
        request_id = reader.request_id
        if self._tracks.pop(request_id, None) is None:
            return
        self._ended[request_id] = reader  # swallows what the peer still had in flight
        if len(self._ended) > ENDED_READERS_KEPT:
            old, _ = self._ended.popitem(last=False)
            self.session.set_track_sink(old, None)

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
            self._tick = self._loop.create_future()
        await self._tick

    def transmit(self) -> None:
        """Send what the session queued."""
        self._transmit_pending = False
        self._protocol.transmit()

    def track(self, request_id: int) -> TrackReader:
        """The reader for the objects of ``request_id`` (created on first use)."""
        reader = self._tracks.get(request_id) or self._ended.get(request_id)
        if reader is None:
            reader = TrackReader(request_id, on_end=self._reader_ended)
            self._tracks[request_id] = reader
            self.session.set_track_sink(request_id, reader)
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

    async def _request(
        self, send: Callable[[], int], on_cancel: Callable[[int], None] | None = None
    ) -> tuple[int, MOQTEvent]:
        """Send a request and wait for its reply; ``on_cancel(request_id)`` withdraws the
        request when the waiting task is cancelled (FETCH_CANCEL, UNSUBSCRIBE), so the peer
        does not keep serving a request nobody reads."""
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
        future = self._replies[request_id] = self._loop.create_future()
        self.transmit()
        try:
            reply = await future
        except asyncio.CancelledError:
            if on_cancel is not None and self.session.closed is None:
                with contextlib.suppress(LocalProtocolError):
                    on_cancel(request_id)
            raise
        finally:
            self._replies.pop(request_id, None)
        if isinstance(reply, RequestErrorReceived):
            raise RequestRejected(reply)
        return request_id, reply

    async def _reader_request(
        self,
        send: Callable[[], int],
        sink: PayloadSink | None,
        on_cancel: Callable[[int], None] | None = None,
        object_end: ObjectEndSink | None = None,
        runs: ObjectRunSink | None = None,
    ) -> tuple[int, MOQTEvent, TrackReader]:
        """A request whose objects arrive on a reader made (with its sink) before it is sent."""
        readers: list[TrackReader] = []

        def send_and_read() -> int:
            request_id = send()
            reader = self.track(request_id)
            if sink is not None:
                reader.set_payload_sink(sink, object_end=object_end, runs=runs)
            readers.append(reader)
            return request_id

        request_id, reply = await self._request(send_and_read, on_cancel)
        return request_id, reply, readers[0]

    async def subscribe(
        self,
        namespace: TrackNamespace,
        name: bytes,
        *,
        parameters: MessageParameters | None = None,
        payload_sink: PayloadSink | None = None,
        object_end: ObjectEndSink | None = None,
    ) -> Subscription:
        """SUBSCRIBE and wait for SUBSCRIBE_OK; ``payload_sink`` and ``object_end`` see
        :meth:`TrackReader.set_payload_sink`.

        Raises:
            RequestRejected: REQUEST_ERROR. SessionClosedError: the session ended.
        """
        params = parameters or MessageParameters()
        request_id, reply, reader = await self._reader_request(
            lambda: self.session.subscribe(namespace, name, parameters=params),
            payload_sink,
            self.unsubscribe,
            object_end,
        )
        return Subscription(request_id, cast(SubscribeOkReceived, reply).message, reader)

    async def fetch(
        self,
        namespace: TrackNamespace,
        name: bytes,
        start: Location,
        end: Location,
        *,
        parameters: MessageParameters | None = None,
        payload_sink: PayloadSink | None = None,
        object_end: ObjectEndSink | None = None,
        runs: ObjectRunSink | None = None,
    ) -> FetchResponse:
        """Standalone FETCH of ``start`` up to ``end`` (the last Location plus one);
        ``payload_sink``, ``object_end`` and ``runs`` see :meth:`TrackReader.set_payload_sink`.

        Raises:
            RequestRejected: REQUEST_ERROR. SessionClosedError: the session ended.
        """
        params = parameters or MessageParameters()
        request_id, reply, reader = await self._reader_request(
            lambda: self.session.fetch(namespace, name, start, end, parameters=params),
            payload_sink,
            self.fetch_cancel,
            object_end,
            runs,
        )
        return FetchResponse(request_id, cast(FetchOkReceived, reply).message, reader)

    async def joining_fetch(
        self,
        subscribe_request_id: int,
        joining_start: int,
        *,
        absolute: bool = False,
        parameters: MessageParameters | None = None,
        payload_sink: PayloadSink | None = None,
        object_end: ObjectEndSink | None = None,
    ) -> FetchResponse:
        """Joining FETCH (§9.16.2) for our subscription ``subscribe_request_id``: relative
        (``joining_start`` groups before its Largest) or ``absolute`` (from that group);
        ``payload_sink`` and ``object_end`` see :meth:`TrackReader.set_payload_sink`.

        Raises:
            RequestRejected: REQUEST_ERROR. SessionClosedError: the session ended.
            LocalProtocolError: not an open SUBSCRIBE of ours.
        """
        params = parameters or MessageParameters()
        request_id, reply, reader = await self._reader_request(
            lambda: self.session.joining_fetch(
                subscribe_request_id, joining_start, absolute=absolute, parameters=params
            ),
            payload_sink,
            None,
            object_end,
        )
        return FetchResponse(request_id, cast(FetchOkReceived, reply).message, reader)

    async def publish(
        self,
        namespace: TrackNamespace,
        name: bytes,
        *,
        track_alias: int | None = None,
        parameters: MessageParameters | None = None,
        track_extensions: tuple[KeyValuePair, ...] = (),
    ) -> Publication:
        """PUBLISH (§9.13) and wait for PUBLISH_OK.

        Raises:
            RequestRejected: REQUEST_ERROR. SessionClosedError: the session ended.
            LocalProtocolError: ``track_alias`` is in use.
        """
        params = parameters or MessageParameters()
        request_id, reply = await self._request(
            lambda: self.session.publish(
                namespace,
                name,
                track_alias=track_alias,
                parameters=params,
                track_extensions=track_extensions,
            )
        )
        request = self.session.requests.get(request_id)
        alias = request.track_alias if request is not None else None
        ok = cast(PublishOkReceived, reply).message
        return Publication(request_id, -1 if alias is None else alias, ok)

    async def publish_namespace(
        self, namespace: TrackNamespace, *, parameters: MessageParameters | None = None
    ) -> RequestOk:
        """PUBLISH_NAMESPACE and wait for REQUEST_OK.

        Raises:
            RequestRejected: REQUEST_ERROR. SessionClosedError: the session ended.
        """
        params = parameters or MessageParameters()
        _, reply = await self._request(
            lambda: self.session.publish_namespace(namespace, parameters=params)
        )
        return cast(RequestOkReceived, reply).message

    async def track_status(
        self, namespace: TrackNamespace, name: bytes, *, parameters: MessageParameters | None = None
    ) -> RequestOk:
        """TRACK_STATUS (§9.19) and wait for its REQUEST_OK.

        Raises:
            RequestRejected: REQUEST_ERROR. SessionClosedError: the session ended.
        """
        params = parameters or MessageParameters()
        _, reply = await self._request(
            lambda: self.session.track_status(namespace, name, parameters=params)
        )
        return cast(RequestOkReceived, reply).message

    async def subscribe_namespace(
        self,
        prefix: TrackNamespace,
        *,
        options: SubscribeOptions = SubscribeOptions.NAMESPACE,
        parameters: MessageParameters | None = None,
    ) -> tuple[int, asyncio.Queue[MOQTEvent | None]]:
        """SUBSCRIBE_NAMESPACE (§9.25) with ``options`` (NAMESPACE: NAMESPACE/NAMESPACE_DONE on
        its stream; PUBLISH: the peer PUBLISHes matching tracks, as requests; BOTH).

        Returns its Request ID and the queue of NAMESPACE/NAMESPACE_DONE events, which ends
        (SubscribeNamespaceEnded, then None) when the stream closes.

        Raises:
            RequestRejected: REQUEST_ERROR. SessionClosedError: the session ended.
            StreamsBlockedError: the peer's bidirectional stream limit is reached.
        """
        params = parameters or MessageParameters()
        request_id, _ = await self._request(
            lambda: self.session.subscribe_namespace(prefix, options=options, parameters=params)
        )
        return request_id, self._namespaces.setdefault(request_id, asyncio.Queue())

    def unsubscribe_namespace(self, request_id: int) -> None:
        """End our SUBSCRIBE_NAMESPACE (closes its stream); its queue ends now."""
        self.session.unsubscribe_namespace(request_id)
        self.transmit()
        queue = self._namespaces.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(None)

    def unsubscribe(self, request_id: int) -> None:
        """UNSUBSCRIBE; the track's reader ends now."""
        self.session.unsubscribe(request_id)
        self.transmit()
        reader = self._tracks.get(request_id)
        if reader is not None:
            reader._end()

    def fetch_cancel(self, request_id: int) -> None:
        """FETCH_CANCEL; the fetch's reader ends now."""
        self.session.fetch_cancel(request_id)
        self.transmit()
        reader = self._tracks.get(request_id)
        if reader is not None:
            reader._end()

    # --- the peer's requests ------------------------------------------------------------------

    async def next_request(self) -> MOQTEvent | None:
        """The next thing the peer asked or told us (SubscribeReceived, FetchReceived, ...);
        None once the session is closed."""
        return await self._requests.get()

    async def requests(self) -> AsyncIterator[MOQTEvent]:
        """Iterate :meth:`next_request` until the session closes."""
        while (event := await self.next_request()) is not None:
            yield event


# --- connect and serve ---------------------------------------------------------------------------


def client_session_config(
    config: SessionConfig | None,
    authority: str | None,
    path: str | None,
    auth_token: bytes | None,
) -> SessionConfig:
    """A client's session settings: ``path`` and ``authority`` (unless ``config`` names one)
    as setup parameters, ``auth_token`` appended as an AUTHORIZATION TOKEN (USE_VALUE, type 0).
    """
    config = config or SessionConfig()
    tokens = config.authorization_tokens
    if auth_token is not None:
        token = AuthToken(
            alias_type=TokenAliasType.USE_VALUE, token_type=0, token_value=bytes(auth_token)
        )
        tokens = (*tokens, token)
    return replace(
        config,
        path=path if path is not None else config.path,
        authority=config.authority if config.authority is not None else authority,
        authorization_tokens=tokens,
    )


@contextlib.asynccontextmanager
async def connect(
    host: str,
    port: int,
    *,
    configuration: Any,
    backend: str | None = None,
    path: str | None = None,
    auth_token: bytes | None = None,
    session_config: SessionConfig | None = None,
    transport: TransportConfig | None = None,
    setup_timeout: float = 10.0,
) -> AsyncIterator[MOQTConnection]:
    """Connect, complete the MOQT setup, yield the connection; close it on exit.

    ``configuration`` is a client ``QuicConfiguration`` of ``backend`` (None: the backend it
    belongs to, :func:`moqt.backend.backend_of`; :meth:`moqt.backend.Backend.configuration`);
    ``auth_token`` travels as an AUTHORIZATION TOKEN setup parameter (USE_VALUE, type 0).

    Raises:
        SessionClosedError: the session ended during setup. ConnectionError: no handshake.
    """
    quic_backend = get_backend(backend_of(configuration) if backend is None else backend)
    config = client_session_config(session_config, f"{host}:{port}", path, auth_token)
    setup = ProtocolSetup(True, config, transport or TransportConfig(), MOQTConnection)
    cls = protocol_class(quic_backend)
    async with quic_client(
        quic_backend,
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
    backend: str | None = None,
    session_config: SessionConfig | None = None,
    transport: TransportConfig | None = None,
) -> MOQTServer:
    """Listen on ``host:port`` (port 0 picks one); call ``handler(connection)`` after each
    client's setup (``backend`` None: the one ``configuration`` belongs to,
    :func:`moqt.backend.backend_of`). A handler that raises closes its session with
    INTERNAL_ERROR.

    Raises:
        ListenError: the UDP socket cannot bind (e.g. the port is in use); it says where.
    """
    quic_backend = get_backend(backend_of(configuration) if backend is None else backend)
    setup = ProtocolSetup(
        False, session_config or SessionConfig(), transport or TransportConfig(), MOQTConnection
    )
    cls = protocol_class(quic_backend)
    server_class = quic_server_class(quic_backend)
    loop = asyncio.get_running_loop()
    holder: list[MOQTServer] = []

    def create_protocol(quic: Any, stream_handler: Any = None, **_: Any) -> Any:
        protocol = cls(quic, stream_handler, setup=setup)
        task = loop.create_task(run_handler(protocol.moqt, handler))
        holder[0].tasks.add(task)
        task.add_done_callback(holder[0].tasks.discard)
        return protocol

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with listening("MOQT over QUIC", (host, port)):
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            tune_socket(sock, setup.transport.socket_buffer)
            sock.bind((host, port))
        except BaseException:
            sock.close()
            raise
    endpoint, quic_server = await open_datagram_endpoint(
        quic_backend,
        lambda: server_class(configuration=configuration, create_protocol=create_protocol),
        sock,
    )
    holder.append(MOQTServer(quic_server, endpoint))
    return holder[0]


async def run_handler(connection: MOQTConnection, handler: Handler) -> None:
    """Wait for ``connection``'s setup, then run ``handler`` on it; a handler that raises
    closes the session with INTERNAL_ERROR."""
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
