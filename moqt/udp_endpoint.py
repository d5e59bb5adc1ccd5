"""The UDP side of the QUIC shell: a datagram endpoint that reads every pending datagram on a
wake-up and transmits once per batch per connection, and the aioquic client that runs on it.

asyncio's own datagram transport reads one datagram per event-loop pass, and aioquic's
``QuicConnectionProtocol.datagram_received`` then handles its events and calls ``transmit()``
at once, so a receiver pays a loop pass and a transmit (building ACKs, re-arming the timer,
most of the time sending nothing) per datagram, all of it Python. Here one readable wake-up
reads up to :data:`RECEIVE_BATCH` datagrams (``recvfrom`` until the socket would block; Python
has no ``recvmmsg``), hands each to its protocol, which feeds its QUIC connection
and handles the events, and defers its transmit to the :class:`TransmitBatch`; when the batch
ends every connection that received something transmits once, so one ACK frame covers the
batch's packets (RFC 9000 §13.2.1, §13.2.2: the ACK leaves within the same wake-up). A
server's ``QuicServer`` keeps dispatching by connection ID, Retry and version negotiation as its
library does; only the per-connection transmit moves to the end of the batch.

qh3 reads in batches already (its GRO/GSO transport, ``recvmmsg`` in Rust) and its client
protocol takes a batch at once (``datagrams_received``); its ``QuicServer`` dispatches the
batch one datagram at a time, each connection transmitting after each of its datagrams, and
:mod:`moqt.transport` keeps that: a relay that forwards an object and then finds the next one
malformed resets its downstream stream in a later transmit than the object's, so the
subscriber receives the stream before its reset (tests/relay/test_relay_events.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

RECEIVE_BATCH = 64
"""Datagrams read per wake-up at most; the rest wait for the next loop pass, so timers and
other tasks (and the ACKs this batch owes) are not held back by a busy socket."""
MAX_DATAGRAM = 65535  # the largest UDP payload


log = logging.getLogger(__name__)


class TransmitBatch:
    """The connections that received datagrams in the batch being read; each transmits once
    when the batch ends (:meth:`end`), not once per datagram."""

    __slots__ = ("open", "_pending")

    def __init__(self) -> None:
        self.open = False
        """True while a batch is being read: a protocol defers its transmit (:meth:`defer`)."""
        self._pending: dict[Any, None] = {}

    def begin(self) -> None:
        """Start a batch."""
        self.open = True

    def defer(self, protocol: Any) -> None:
        """``protocol`` received a datagram in this batch: transmit it once the batch ends."""
        self._pending[protocol] = None

    def end(self) -> None:
        """End the batch: every connection that received something transmits once. A
        connection whose transmit fails (one the peer or the library already closed) is
        logged and skipped: it must not stop the endpoint reading for the others."""
        self.open = False
        pending, self._pending = self._pending, {}
        for protocol in pending:
            try:
                protocol.transmit()
            except Exception:  # noqa: BLE001 - one connection's failure is its own
                log.debug("transmit after a batch failed", exc_info=True)


class BatchedDatagramTransport(asyncio.DatagramTransport):
    """An asyncio datagram transport on a bound UDP socket that reads up to
    :data:`RECEIVE_BATCH` datagrams per readable wake-up inside a :class:`TransmitBatch`
    (:attr:`transmit_batch`, which the QUIC protocols on it defer their transmit to).

    Sending goes straight to the socket; what the kernel refuses (a full send buffer) is queued
    and sent when the socket is writable again. Closing flushes that queue, then closes the
    socket and calls ``connection_lost``.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        protocol: asyncio.DatagramProtocol,
        *,
        batch_size: int = RECEIVE_BATCH,
    ) -> None:
        extra = {"socket": sock, "sockname": sock.getsockname(), "peername": None}
        super().__init__(extra)
        sock.setblocking(False)
        self.transmit_batch = TransmitBatch()
        self._loop = loop
        self._sock: socket.socket | None = sock
        self._fd = sock.fileno()
        self._protocol = protocol
        self._batch_size = batch_size
        self._queue: deque[tuple[bytes, Any]] = deque()
        self._queued = 0
        self._closing = False
        self._reading = False

    def _start(self) -> None:
        self._protocol.connection_made(self)
        self.resume_reading()

    # reading

    def _read_ready(self) -> None:
        sock, protocol, batch = self._sock, self._protocol, self.transmit_batch
        if sock is None:
            return
        recvfrom = sock.recvfrom
        batch.begin()
        try:
            for _ in range(self._batch_size):
                if self._closing:
                    break  # closed by what the last datagram caused
                try:
                    data, addr = recvfrom(MAX_DATAGRAM)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:  # e.g. an ICMP error queued on the socket
                    protocol.error_received(exc)
                    break
                protocol.datagram_received(data, addr)
        finally:
            batch.end()

    def pause_reading(self) -> None:
        """Stop reading until :meth:`resume_reading`."""
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._fd)

    def resume_reading(self) -> None:
        """Read again (each readable wake-up: one batch)."""
        if not self._reading and not self._closing and self._sock is not None:
            self._reading = True
            self._loop.add_reader(self._fd, self._read_ready)

    def is_reading(self) -> bool:
        """Whether the socket is being read."""
        return self._reading

    # writing

    def sendto(self, data: Any, addr: Any = None) -> None:
        """Send ``data`` to ``addr`` now, or queue it while the socket's send buffer is full."""
        sock = self._sock
        if sock is None:
            return  # the connection is lost: nothing is sent any more, as asyncio's transport
        if not self._queue:
            try:
                sock.sendto(data, addr)
                return
            except (BlockingIOError, InterruptedError):
                self._loop.add_writer(self._fd, self._write_ready)
            except OSError as exc:
                self._protocol.error_received(exc)
                return
        self._queue.append((bytes(data), addr))
        self._queued += len(data)

    def _write_ready(self) -> None:
        sock, queue = self._sock, self._queue
        if sock is None:
            return
        while queue:
            data, addr = queue[0]
            try:
                sock.sendto(data, addr)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._protocol.error_received(exc)
            queue.popleft()
            self._queued -= len(data)
        self._loop.remove_writer(self._fd)
        if self._closing:
            self._loop.call_soon(self._connection_lost, None)

    def get_write_buffer_size(self) -> int:
        """Bytes queued for a writable socket."""
        return self._queued

    # closing

    def is_closing(self) -> bool:
        """Whether :meth:`close` or :meth:`abort` was called."""
        return self._closing

    def close(self) -> None:
        """Stop reading; close the socket once the queued datagrams are sent."""
        if self._closing:
            return
        self.pause_reading()
        self._closing = True
        if not self._queue:
            self._loop.call_soon(self._connection_lost, None)

    def abort(self) -> None:
        """Close now, dropping what is queued."""
        self._queue.clear()
        self._queued = 0
        if self._sock is not None:
            self._loop.remove_writer(self._fd)
        self.pause_reading()
        self._closing = True
        self._loop.call_soon(self._connection_lost, None)

    def _connection_lost(self, exc: Exception | None) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            return
        try:
            self._protocol.connection_lost(exc)
        finally:
            sock.close()

    def get_protocol(self) -> asyncio.BaseProtocol:
        """The protocol datagrams go to."""
        return self._protocol

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        """Send datagrams to ``protocol`` from now on."""
        self._protocol = protocol  # type: ignore[assignment]


async def open_batched_endpoint(
    protocol_factory: Callable[[], Any], sock: socket.socket
) -> tuple[BatchedDatagramTransport, Any]:
    """A :class:`BatchedDatagramTransport` on the bound ``sock`` and the protocol it feeds
    (``connection_made`` already called, as after ``loop.create_datagram_endpoint``)."""
    loop = asyncio.get_running_loop()
    protocol = protocol_factory()
    transport = BatchedDatagramTransport(loop, sock, protocol)
    try:
        transport._start()
    except BaseException:
        transport.abort()
        raise
    return transport, protocol


@contextlib.asynccontextmanager
async def aioquic_client(
    host: str,
    port: int,
    *,
    configuration: Any,
    create_protocol: Callable[..., Any],
) -> AsyncIterator[Any]:
    """Connect as ``aioquic.asyncio.client.connect`` does (a dual-stack socket, the server name
    defaulting to ``host``, the handshake completed before the protocol is yielded, closed and
    waited for on exit), on a :class:`BatchedDatagramTransport`, whose socket is closed on exit
    even when the wait for the connection's end is cancelled.

    Raises:
        ConnectionError: the handshake failed.
    """
    from aioquic.quic.connection import QuicConnection

    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    found: Any = infos[0][4]
    addr = ("::ffff:" + str(found[0]), found[1], 0, 0) if len(found) == 2 else found
    if configuration.server_name is None:
        configuration.server_name = host
    connection = QuicConnection(configuration=configuration)
    sock = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(("::", 0, 0, 0))
    except BaseException:
        sock.close()
        raise
    transport, protocol = await open_batched_endpoint(lambda: create_protocol(connection), sock)
    try:
        protocol.connect(addr)
        await protocol.wait_connected()
        yield protocol
    finally:
        try:
            protocol.close()
            await protocol.wait_closed()
        finally:  # also when that wait is cancelled: the socket must not outlive the client
            transport.close()
