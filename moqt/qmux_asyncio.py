"""MOQT over QMux on asyncio: TLS 1.3 over TCP, plain TCP and Unix domain sockets.

The carriers of draft-ietf-quic-qmux-01 §3.1 under the same :class:`~moqt.asyncio.MOQTConnection`
as QUIC (FETCH, SUBSCRIBE, track readers, flow-aware object sending work unchanged), following
draft-nandakumar-moq-qmux-moqt-00 for MOQT over QMux:

* ``tls``: TLS 1.3 over TCP with ALPN :data:`~moqt.qmux.ALPN_MOQT_16_QMUX` (qmux §7.1: a QMux
  mapping has its own identifier, and both sides abort when ALPN is not agreed). Python's TLS
  server cannot send the no_application_protocol alert, so a server that agreed no ALPN drops
  the connection right after the handshake, before any QMux byte, and the client does the same.
* ``tcp``: plain TCP, refused on a non-loopback address unless ``trusted_network=True``
  (nothing protects the bytes); the application protocol is agreed with the
  ``application_protocols`` transport parameter (see :mod:`moqt.qmux`).
* ``unix``: a Unix domain socket; the socket file's permissions (0600 by default) are the
  access boundary, and MOQT authorization tokens still apply.

:class:`QMuxProtocol` is the pump, an :class:`asyncio.BufferedProtocol`: the carrier reads
straight into a large buffer (``recv_into`` on a plain socket; over TLS the records are
decrypted into one, see :data:`DEFAULT_TLS_ENGINE`), up to a MiB a read, and the bytes go to
the :class:`~moqt.qmux.QMuxConnection` as read-only slices that are never overwritten
(:class:`~moqt.receive_buffers.ReceiveBuffers`), so stream data stays slices of them; events go
to the MOQT session, and one transmit follows each read. Writes are lists of buffers: on a plain
socket they go out with one ``sendmsg`` while the transport holds nothing (asyncio 3.11's
``writelines`` would join them), over TLS through ``writelines``, which encrypts each buffer as
it is (joining them first into larger chunks costs more than the small records it saves) in
batches of :data:`TLS_WRITE_BATCH` bytes: the TLS transport encrypts all it is handed before it
sends any of it, so a whole block handed at once would reach the peer only when all of it is
encrypted (:data:`DEFAULT_TLS_ENGINE` says who processes the records). ``pause_writing`` stops
the pump; ``resume_writing`` transmits and wakes the connection's writers. The idle timeout
runs on ``loop.call_at``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import ssl
import stat
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from .asyncio import Handler, MOQTConnection, client_session_config, run_handler
from .backend import DEFAULT_SOCKET_BUFFER
from .errors import SessionError, listening
from .qmux import (
    ALPN_MOQT_16_QMUX,
    APP_PROTOCOL_MOQT_16,
    QMUX_BACKEND,
    QMuxConfig,
    QMuxConnection,
)
from .qmux_tls import TLSWorkerTransport, open_tls_connection, serve_tls
from .receive_buffers import ReceiveBuffers
from .session import MOQTSession, SessionConfig
from .transport import tune_socket
from .wire import Bytes

__all__ = [
    "DEFAULT_TLS_ENGINE",
    "QMuxEndpoint",
    "QMuxProtocol",
    "QMuxServer",
    "ReceiveBuffers",
    "TLSEngine",
    "client_ssl_context",
    "connect_qmux",
    "require_loopback",
    "serve_qmux",
    "server_ssl_context",
]

log = logging.getLogger(__name__)
Carrier = Literal["tls", "tcp", "unix"]
TLSEngine = Literal["inline", "thread", "asyncio"]
DEFAULT_TLS_ENGINE: TLSEngine = "inline"
"""Who processes a tls carrier's records: ``inline``, our record pump on the event loop with
records decrypted in bulk (:mod:`moqt.qmux_tls`); ``thread``, the same pump on a worker thread
per connection; or ``asyncio``, asyncio's own TLS transport. ``inline`` is the default: it
does per chunk what asyncio's transport does per record, and sends ciphertext without joining
it; ``thread`` overlaps the records with the loop but costs more CPU in all (its hand-offs),
so it only pays where a core would otherwise be idle."""
WRITE_BATCH = 4 << 20  # bytes framed per data_to_send call while the carrier takes them
TLS_WRITE_BATCH = 256 << 10  # over TLS: each batch is encrypted, then sent (see transmit)
WRITE_HIGH_WATER = 8 << 20  # the transport's buffer above which the pump pauses
IOV_MAX = 512  # buffers per sendmsg (Linux allows 1024)
CLOSE_WAIT = 2.0  # seconds to wait for the carrier to close after CONNECTION_CLOSE
UNIX_MODE = 0o600
SETUP_TIMEOUT = 10.0
"""Seconds an accepted connection has to finish its TLS handshake and MOQT setup."""


@dataclass(frozen=True, slots=True)
class QMuxEndpoint:
    """Where a QMux carrier listens or connects: ``host``/``port`` for tls and tcp, ``path``
    (the socket file) for unix.

    Raises:
        ValueError: an unknown carrier or a missing address part.
    """

    carrier: Carrier
    host: str | None = None
    port: int | None = None
    path: str | None = None

    def __post_init__(self) -> None:
        if self.carrier not in ("tls", "tcp", "unix"):
            raise ValueError(f"unknown QMux carrier {self.carrier!r}")
        if self.carrier == "unix" and not self.path:
            raise ValueError("a unix endpoint needs a path")
        if self.carrier != "unix" and (self.host is None or self.port is None):
            raise ValueError(f"a {self.carrier} endpoint needs a host and a port")


def client_ssl_context(cafile: str | None = None, verify: bool = True) -> ssl.SSLContext:
    """A TLS 1.3 client context offering ALPN ``qmux-01.moqt-16``; ``cafile`` pins the
    server's certificate, ``verify`` False turns checks off (tests only)."""
    context = ssl.create_default_context(cafile=cafile)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.set_alpn_protocols([ALPN_MOQT_16_QMUX])
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def server_ssl_context(certificate: str, private_key: str) -> ssl.SSLContext:
    """A TLS 1.3 server context (PEM paths) selecting ALPN ``qmux-01.moqt-16``; it sends no
    session tickets (QMux connections are long-lived and not resumed), which lets
    :mod:`moqt.qmux_tls` take the records over from OpenSSL after the handshake."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.num_tickets = 0
    context.load_cert_chain(certificate, private_key)
    context.set_alpn_protocols([ALPN_MOQT_16_QMUX])
    return context


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine: a loopback address or ``localhost``."""
    if host.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_loopback(host: str, trusted_network: bool) -> None:
    """Refuse plain TCP on an address that is not loopback, unless ``trusted_network``.

    Raises:
        ValueError: ``host`` is not a loopback address (or "localhost").
    """
    if trusted_network:
        return
    loopback = is_loopback(host)
    if not loopback:
        raise ValueError(
            f"plain TCP on {host!r} would carry MOQT unprotected off this host: use TLS, "
            "or pass trusted_network=True on a network you trust"
        )


class QMuxProtocol(asyncio.BufferedProtocol):
    """The asyncio pump of one QMux connection running a MOQT session; ``moqt`` is its
    :class:`~moqt.asyncio.MOQTConnection`."""

    def __init__(
        self,
        *,
        is_client: bool,
        carrier: Carrier,
        qmux: QMuxConfig | None = None,
        session_config: SessionConfig | None = None,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._carrier = carrier
        config = qmux or QMuxConfig()
        if carrier == "tls":  # ALPN agreed on the protocol
            config = replace(config, application_protocols=())
        elif not config.application_protocols:
            config = replace(config, application_protocols=(APP_PROTOCOL_MOQT_16,))
        alpn = APP_PROTOCOL_MOQT_16 if carrier == "tls" else None
        self.quic = QMuxConnection(is_client=is_client, config=config, alpn_protocol=alpn)
        self.session = MOQTSession(
            self.quic, is_client=is_client, config=session_config, backend=QMUX_BACKEND
        )
        self.moqt = MOQTConnection(self, self.session)
        self.moqt.first_piece_at_once = False  # frames, not packets: batch every write
        self._buffers = ReceiveBuffers()
        self._batch = TLS_WRITE_BATCH if carrier == "tls" else WRITE_BATCH
        self._transport: asyncio.Transport | None = None
        self._sock: socket.socket | None = None  # the raw socket, for sendmsg
        self._tls: TLSWorkerTransport | None = None  # a server's, before its handshake
        self._paused = False
        self._closing = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self.lost: asyncio.Future[None] = self._loop.create_future()
        self.on_made: Callable[[QMuxProtocol], object] | None = None
        """Called first in :meth:`connection_made` (a server registers a connection there when
        the carrier connects the protocol only after a handshake that may fail)."""

    # --- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Check ALPN (tls), tune the socket, send our transport parameters."""
        if self.on_made is not None:
            self.on_made(self)
        self._transport = transport = _as_transport(transport)
        if self._carrier == "tls":
            agreed = _agreed_alpn(transport)
            if agreed != ALPN_MOQT_16_QMUX:  # qmux §7.1 MUST: both sides abort
                self.quic.carrier_closed(f"TLS ALPN {ALPN_MOQT_16_QMUX!r} not agreed ({agreed!r})")
                self._process_events()
                transport.abort()
                return
        else:
            self._sock = _raw_socket(transport)
        sock = transport.get_extra_info("socket")
        tune_socket(sock, DEFAULT_SOCKET_BUFFER)
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        self.quic.connection_made(self._loop.time())
        self.transmit()

    def get_buffer(self, sizehint: int) -> memoryview:
        """Where the carrier writes what it read next (see :class:`ReceiveBuffers`)."""
        return self._buffers.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        """Feed what was read to the connection, hand its events to the session, transmit
        once."""
        self.data_received(self._buffers.filled(nbytes))

    def data_received(self, data: Bytes) -> None:
        """Feed bytes that will not change (stream data events are slices of them), hand the
        connection's events to the session, transmit once."""
        self.quic.receive_data(data, self._loop.time())
        self._process_events()
        self.transmit()

    def eof_received(self) -> bool:
        """The peer shut its sending side: the connection ends (qmux §6.3)."""
        self.quic.carrier_closed("the peer closed the carrier")
        self._process_events()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        """The carrier is gone: end the connection and the session if still open."""
        self.quic.carrier_closed(f"the carrier failed: {exc}" if exc else "")
        self._process_events()
        self._cancel_timer()
        self._sock = None
        if not self.lost.done():
            self.lost.set_result(None)
        self.moqt._wake()

    def pause_writing(self) -> None:
        """The carrier's buffer is full: stop framing."""
        self._paused = True

    def resume_writing(self) -> None:
        """The carrier drained: frame more and wake waiting writers."""
        self._paused = False
        self.transmit()

    # --- the pump ------------------------------------------------------------------------------

    def transmit(self) -> None:
        """Write what the connection has to send (while the carrier takes it); close the
        carrier once the connection is closed."""
        transport = self._transport
        if transport is None or self._closing:
            return
        quic = self.quic
        batch = self._batch
        while not self._paused or quic.closed:
            buffers = quic.data_to_send(batch, self._loop.time())
            if not buffers:
                break
            self._write(transport, buffers)
        if quic.closed:
            self._closing = True
            self._cancel_timer()
            transport.close()
        else:
            self._schedule_timer()
        if self.moqt._tick is not None:  # a writer waits for the connection to move
            self.moqt._wake()

    def _write(self, transport: asyncio.Transport, buffers: list[Bytes]) -> None:
        sock = self._sock
        if sock is None or transport.get_write_buffer_size():
            transport.writelines(buffers)
            return
        for start in range(0, len(buffers), IOV_MAX):
            batch = buffers[start : start + IOV_MAX]
            try:
                sent = sock.sendmsg(batch)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:  # the transport reports the error on its own write
                transport.writelines(buffers[start:])
                return
            rest = _skip(batch, sent)
            if rest:  # the socket is full: the transport keeps (copies) the rest
                transport.writelines(rest + buffers[start + IOV_MAX :])
                return

    def _process_events(self) -> None:
        quic, session, dispatch = self.quic, self.session, self.moqt._dispatch
        while (event := quic.next_event()) is not None:
            moqt_events = session.handle_event(event)
            if moqt_events:
                dispatch(moqt_events)

    def _schedule_timer(self) -> None:
        deadline = self.quic.get_timer()
        if deadline is None:
            self._cancel_timer()
        elif self._timer is None or self._timer_at is None or deadline < self._timer_at:
            self._cancel_timer()  # a later deadline waits for the armed timer to fire
            self._timer_at = deadline
            self._timer = self._loop.call_at(deadline, self._on_timer)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._timer_at = None

    def _on_timer(self) -> None:
        self._timer = self._timer_at = None
        self.quic.handle_timer(self._loop.time())
        self._process_events()
        self.transmit()

    async def wait_lost(self, timeout: float = CLOSE_WAIT) -> None:
        """Wait (at most ``timeout``) for the carrier to close; abort it after that."""
        try:
            await asyncio.wait_for(asyncio.shield(self.lost), timeout)
        except TimeoutError:
            if self._transport is not None:
                self._transport.abort()
            elif self._tls is not None:  # still in its TLS handshake
                self._tls.abort()


def _agreed_alpn(transport: asyncio.Transport) -> str | None:
    """The ALPN identifier the TLS handshake agreed (None: none)."""
    if isinstance(transport, TLSWorkerTransport):
        agreed: str | None = transport.get_extra_info("alpn_protocol")
        return agreed
    ssl_object = transport.get_extra_info("ssl_object")
    return ssl_object.selected_alpn_protocol() if ssl_object is not None else None


def _as_transport(transport: asyncio.BaseTransport) -> asyncio.Transport:
    if not isinstance(transport, asyncio.Transport):
        raise TypeError(f"QMux needs a stream transport, got {transport!r}")
    return transport


def _raw_socket(transport: asyncio.Transport) -> socket.socket | None:
    """The plain socket under a selector transport (None elsewhere, e.g. uvloop)."""
    sock = getattr(transport, "_sock", None)
    return sock if isinstance(sock, socket.socket) else None


def _skip(buffers: list[Bytes], sent: int) -> list[Bytes]:
    """What of ``buffers`` is left after ``sent`` bytes went out (slices, no copies)."""
    for index, buffer in enumerate(buffers):
        size = len(buffer)
        if sent < size:
            head = memoryview(buffer)[sent:] if sent else buffer
            return [head, *buffers[index + 1 :]]
        sent -= size
    return []


# --- connect --------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def connect_qmux(
    endpoint: QMuxEndpoint,
    *,
    ssl_context: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
    path: str | None = None,
    auth_token: bytes | None = None,
    session_config: SessionConfig | None = None,
    qmux: QMuxConfig | None = None,
    setup_timeout: float = 10.0,
    trusted_network: bool = False,
    tls_engine: TLSEngine | None = None,
) -> AsyncIterator[MOQTConnection]:
    """Connect over ``endpoint``'s carrier, complete the MOQT setup, yield the connection;
    close it on exit. ``path`` and ``auth_token`` go into CLIENT_SETUP as with
    :func:`moqt.asyncio.connect`; ``ssl_context`` defaults to :func:`client_ssl_context`;
    ``tls_engine`` (default :data:`DEFAULT_TLS_ENGINE`) picks who processes TLS records.

    Raises:
        ValueError: plain TCP to a non-loopback host without ``trusted_network``.
        SessionClosedError: the session ended during setup (ALPN or protocol not agreed).
        ssl.SSLError: the TLS handshake failed (ssl.SSLCertVerificationError: the server's
            certificate). OSError: the carrier could not connect. TimeoutError: no setup in
            time.
    """
    loop = asyncio.get_running_loop()
    authority = None if endpoint.carrier == "unix" else f"{endpoint.host}:{endpoint.port}"
    config = client_session_config(session_config, authority, path, auth_token)

    def factory() -> QMuxProtocol:
        return QMuxProtocol(
            is_client=True, carrier=endpoint.carrier, qmux=qmux, session_config=config
        )

    engine = tls_engine or DEFAULT_TLS_ENGINE
    protocol = await _open(
        loop, endpoint, factory, ssl_context, server_hostname, trusted_network, engine
    )
    connection = protocol.moqt
    try:
        await asyncio.wait_for(connection.wait_setup(), setup_timeout)
        yield connection
    finally:
        if connection.session.closed is None:
            connection.close()
        elif protocol._transport is not None:
            protocol._transport.close()
        await protocol.wait_lost()


async def _open(
    loop: asyncio.AbstractEventLoop,
    endpoint: QMuxEndpoint,
    factory: Any,
    ssl_context: ssl.SSLContext | None,
    server_hostname: str | None,
    trusted_network: bool,
    engine: TLSEngine,
) -> QMuxProtocol:
    protocol: QMuxProtocol
    if endpoint.carrier == "unix":
        _, protocol = await loop.create_unix_connection(factory, endpoint.path)
        return protocol
    host, port = str(endpoint.host), int(endpoint.port or 0)
    if endpoint.carrier == "tcp":
        require_loopback(host, trusted_network)
        _, protocol = await loop.create_connection(factory, host, port)
        return protocol
    context = ssl_context or client_ssl_context()
    if engine != "asyncio":
        protocol = factory()
        await open_tls_connection(
            protocol,
            host,
            port,
            context=context,
            server_hostname=server_hostname or host,
            plain_buffers=ReceiveBuffers(),
            threaded=engine == "thread",
        )
        return protocol
    _, protocol = await loop.create_connection(
        factory, host, port, ssl=context, server_hostname=server_hostname or host
    )
    return protocol


# --- serve ----------------------------------------------------------------------------------------


class QMuxServer:
    """A listening QMux carrier; each client's :class:`~moqt.asyncio.MOQTConnection` is given
    to the handler once its setup completes."""

    def __init__(self, server: asyncio.Server, endpoint: QMuxEndpoint) -> None:
        self._server = server
        self.endpoint = endpoint
        self.protocols: set[QMuxProtocol] = set()
        self.tasks: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> tuple[str, int] | str:
        """The bound (host, port), or the socket path of a unix server."""
        if self.endpoint.carrier == "unix":
            return str(self.endpoint.path)
        sockname = self._server.sockets[0].getsockname()
        return str(sockname[0]), int(sockname[1])

    def close(self) -> None:
        """Stop listening, close every connection (NO_ERROR) and cancel the handlers."""
        self._server.close()
        for protocol in list(self.protocols):
            if protocol.session.closed is None:
                protocol.moqt.close(SessionError.NO_ERROR, "server closing")
        for task in self.tasks:
            task.cancel()
        if self.endpoint.carrier == "unix" and self.endpoint.path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.endpoint.path)

    async def wait_closed(self) -> None:
        """Wait until the listener and every connection are closed."""
        await self._server.wait_closed()
        for protocol in list(self.protocols):
            await protocol.wait_lost()


async def serve_qmux(
    endpoint: QMuxEndpoint,
    *,
    handler: Handler,
    ssl_context: ssl.SSLContext | None = None,
    session_config: SessionConfig | None = None,
    qmux: QMuxConfig | None = None,
    trusted_network: bool = False,
    unix_mode: int = UNIX_MODE,
    setup_timeout: float = SETUP_TIMEOUT,
    tls_engine: TLSEngine | None = None,
) -> QMuxServer:
    """Listen on ``endpoint`` (port 0 picks one) and call ``handler(connection)`` after each
    client's setup; a handler that raises closes its session with INTERNAL_ERROR. A tls
    endpoint needs ``ssl_context`` (:func:`server_ssl_context`); a unix socket file is
    created with ``unix_mode`` permissions; ``tls_engine`` (default
    :data:`DEFAULT_TLS_ENGINE`) picks who processes TLS records. A connection whose TLS
    handshake and MOQT setup are not complete ``setup_timeout`` seconds after it was accepted
    is aborted.

    Raises:
        ValueError: plain TCP on a non-loopback address without ``trusted_network``, or tls
            without a context.
        ListenError: the listener cannot bind (an address in use, a socket path whose folder
            is missing or that another file or a live server holds); it says which.
    """
    loop = asyncio.get_running_loop()
    holder: list[QMuxServer] = []

    def register(protocol: QMuxProtocol, accepted_at: float | None = None) -> QMuxProtocol:
        server = holder[0]
        server.protocols.add(protocol)
        protocol.lost.add_done_callback(lambda _: server.protocols.discard(protocol))
        task = loop.create_task(run_handler(protocol.moqt, handler))
        server.tasks.add(task)
        task.add_done_callback(server.tasks.discard)
        deadline = (loop.time() if accepted_at is None else accepted_at) + setup_timeout
        bound = loop.call_at(deadline, _abort_without_setup, protocol, setup_timeout)
        protocol.lost.add_done_callback(lambda _: bound.cancel())
        return protocol

    def new_protocol() -> QMuxProtocol:
        return QMuxProtocol(
            is_client=False, carrier=endpoint.carrier, qmux=qmux, session_config=session_config
        )

    def factory() -> QMuxProtocol:
        return register(new_protocol())

    def after_handshake() -> QMuxProtocol:
        """asyncio's TLS connects the protocol only after a handshake that succeeded, and
        never tells one whose handshake failed: such a protocol is registered when it connects
        (its handshake is bounded by ``ssl_handshake_timeout``), so that a failed handshake
        leaves nothing behind."""
        protocol = new_protocol()
        accepted_at = loop.time()
        protocol.on_made = lambda made: register(made, accepted_at)
        return protocol

    def tls_protocol() -> tuple[QMuxProtocol, ReceiveBuffers]:
        return factory(), ReceiveBuffers()

    def bind(tls: TLSWorkerTransport) -> None:  # before the handshake: the bound can abort it
        protocol = tls.get_protocol()
        assert isinstance(protocol, QMuxProtocol)
        protocol._tls = tls

    server: asyncio.Server
    host, port = str(endpoint.host), int(endpoint.port or 0)
    if endpoint.carrier == "unix":
        with listening("MOQT over QMux (Unix socket)", str(endpoint.path)):
            sock = _bind_unix(str(endpoint.path), unix_mode)
        server = await loop.create_unix_server(factory, sock=sock)
    elif endpoint.carrier == "tcp":
        require_loopback(host, trusted_network)
        with listening("MOQT over QMux (TCP)", (host, port)):
            server = await loop.create_server(factory, host, port)
    else:
        if ssl_context is None:
            raise ValueError("a tls endpoint needs ssl_context (server_ssl_context())")
        engine = tls_engine or DEFAULT_TLS_ENGINE
        with listening("MOQT over QMux (TLS)", (host, port)):
            if engine != "asyncio":
                server = await serve_tls(
                    tls_protocol,
                    host,
                    port,
                    context=ssl_context,
                    accepted=bind,
                    threaded=engine == "thread",
                )
            else:
                server = await loop.create_server(
                    after_handshake,
                    host,
                    port,
                    ssl=ssl_context,
                    ssl_handshake_timeout=setup_timeout,
                )
    holder.append(QMuxServer(server, endpoint))
    return holder[0]


def _abort_without_setup(protocol: QMuxProtocol, timeout: float) -> None:
    """Abort an accepted connection that has not completed its setup within ``timeout``."""
    if protocol.moqt._setup.done() or protocol.lost.done():
        return
    log.info("aborting a QMux connection without MOQT setup after %s s", timeout)
    transport = protocol._transport
    if transport is not None:
        transport.abort()
    elif protocol._tls is not None:  # the TLS handshake never finished (worker engine)
        protocol._tls.fail(TimeoutError(f"no TLS handshake within {timeout} s"))


def _bind_unix(path: str, mode: int) -> socket.socket:
    """A Unix stream socket bound at ``path`` with ``mode``: created owner-only (umask 0177
    around the bind) so no one else can connect before the chmod; a stale socket file is
    replaced, a live one or any other file is refused."""
    _remove_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o177)
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        os.chmod(path, mode)
    except BaseException:
        sock.close()
        raise
    return sock


def _remove_stale_socket(path: str) -> None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise FileExistsError("a file that is not a socket is there")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # nobody listens: a stale file
        return
    finally:
        probe.close()
    raise OSError("a server is already listening there")
