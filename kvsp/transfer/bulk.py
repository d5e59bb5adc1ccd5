"""The bulk HTTP/1.1 client for block bodies (spec §6.7; DESIGN.md §7, "choose the bulk client
by measurement").

``bench/bench_blocks.py`` chose it: against a holder it moves block bodies faster than httpx
and aiohttp, close to a bare blocking socket. :class:`BulkClient` keeps a keep-alive pool of
connections per origin; each connection is an ``asyncio.BufferedProtocol`` that lets the
kernel write body octets straight into the memory a
:class:`~kvsp.transfer.http11.BodyConsumer` hands out (for a block: the container's own
buffer), so a body is copied once, from the socket. Framing and headers go through a small
scratch buffer and :class:`~kvsp.transfer.http11.ResponseParser`. Every request runs under one
deadline; all failures are :class:`~kvsp.errors.TransportError` subclasses.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl as _ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

from kvsp.errors import TransportError
from kvsp.transfer.http11 import (
    DEFAULT_LIMITS,
    SCRATCH_SIZE,
    BodyConsumer,
    Buffer,
    BulkLimits,
    BytesBody,
    ConnectionClosed,
    ConsumerFactory,
    HTTPProtocolError,
    ParserEvent,
    ResponseHead,
    ResponseParser,
)

DEFAULT_TIMEOUT_S = 30.0
IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})


class RequestTimeout(TransportError):
    """The request did not complete within its deadline."""


# -- the connection ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Origin:
    """Scheme, host and port: what a pooled connection is for."""

    scheme: str
    host: str
    port: int

    @property
    def authority(self) -> str:
        """The ``Host`` field value."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


class _Exchange:
    """One request in flight on a connection."""

    def __init__(
        self, parser: ResponseParser, factory: ConsumerFactory, done: asyncio.Future[None]
    ) -> None:
        self.parser = parser
        self.factory = factory
        self.consumer: BodyConsumer | None = None
        self.done = done


class _Connection(asyncio.BufferedProtocol):
    """One HTTP/1.1 connection; body octets land in the consumer's memory when framing allows."""

    def __init__(self, origin: Origin) -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.requests = 0
        self._scratch = memoryview(bytearray(SCRATCH_SIZE))
        self._direct = False
        self._exchange: _Exchange | None = None

    # asyncio callbacks: every exception is caught here (asyncio would log it as fatal)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # create_connection makes stream transports (uvloop's do not subclass asyncio's)
        self.transport = cast(asyncio.Transport, transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        ex = self._exchange
        self._direct = False
        if ex is not None and ex.consumer is not None and not ex.done.done():
            n = ex.parser.direct_body
            if n > 0:
                try:
                    view = ex.consumer.buffer(n)
                except BaseException as exc:
                    self._fail(exc)
                    return self._scratch
                if 0 < len(view) <= n:
                    self._direct = True
                    return view
                self._fail(HTTPProtocolError(f"consumer gave {len(view)} octets, 1..{n} fit"))
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        ex = self._exchange
        if ex is None or ex.done.done():
            self.abort()  # octets nobody asked for: the connection is out of step
            return
        try:
            if self._direct:
                if ex.consumer is None:
                    raise RuntimeError("direct body octets without a consumer")
                ex.consumer.written(nbytes)
                events = ex.parser.body_received(nbytes)
            else:
                events = ex.parser.feed(self._scratch[:nbytes])
            self._handle(ex, events)
        except BaseException as exc:
            self._fail(exc)

    def eof_received(self) -> bool:
        ex = self._exchange
        self.closed = True
        if ex is not None and not ex.done.done():
            try:
                self._handle(ex, ex.parser.eof())
            except BaseException as exc:
                self._fail(exc)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        ex = self._exchange
        if ex is not None and not ex.done.done():
            received = ex.parser.received
            why = f": {type(exc).__name__}: {exc}" if exc else ""
            self._fail(
                ConnectionClosed(f"connection lost after {received} octets{why}", received=received)
            )

    # the exchange

    def start(self, parser: ResponseParser, factory: ConsumerFactory) -> _Exchange:
        """Begin an exchange; its ``done`` future resolves when the response is complete."""
        loop = asyncio.get_running_loop()
        self._exchange = _Exchange(parser, factory, loop.create_future())
        self.requests += 1
        return self._exchange

    def finish(self) -> None:
        """End the current exchange (it completed or failed)."""
        self._exchange = None

    def _handle(self, ex: _Exchange, events: list[ParserEvent]) -> None:
        for event in events:
            if isinstance(event, memoryview):
                self._deliver(ex, event)
            elif isinstance(event, ResponseHead):
                ex.consumer = ex.factory(event, ex.parser.content_length)
            else:
                if ex.consumer is not None:
                    ex.consumer.finish()
                if not ex.done.done():
                    ex.done.set_result(None)

    @staticmethod
    def _deliver(ex: _Exchange, piece: memoryview) -> None:
        consumer = ex.consumer
        if consumer is None:
            raise RuntimeError("body octets before the head")
        while piece:
            dst = consumer.buffer(len(piece))
            n = len(dst)
            if not 0 < n <= len(piece):
                raise HTTPProtocolError(f"consumer gave {n} octets for {len(piece)}")
            dst[:] = piece[:n]
            consumer.written(n)
            piece = piece[n:]

    def _fail(self, exc: BaseException) -> None:
        ex = self._exchange
        self.abort()
        if ex is None:
            return
        if ex.consumer is not None:
            with contextlib.suppress(Exception):
                ex.consumer.fail(exc)
        if not ex.done.done():
            ex.done.set_exception(exc)

    def reusable(self, parser: ResponseParser) -> bool:
        """Whether another request may follow on this connection."""
        transport = self.transport
        return (
            not self.closed
            and transport is not None
            and not transport.is_closing()
            and parser.done
            and parser.keep_alive
            and parser.trailing == 0
        )

    def abort(self) -> None:
        """Close at once; a request in flight fails."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


# -- the client ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BulkResponse:
    """A complete response: its head and the consumer that holds its body."""

    head: ResponseHead
    body: BodyConsumer

    @property
    def status(self) -> int:
        """The status code."""
        return self.head.status


_TARGET = re.compile(r"[\x21-\x7e]+")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VALUE = re.compile(r"[\t\x20-\x7e]*")


def _request_head(
    method: str, target: str, origin: Origin, headers: Mapping[str, str], length: int | None
) -> bytes:
    if _TOKEN.fullmatch(method) is None or _TARGET.fullmatch(target) is None:
        raise ValueError(f"invalid request line {method[:20]!r} {target[:80]!r}")
    lines = [f"{method} {target} HTTP/1.1", f"Host: {origin.authority}"]
    for name, value in headers.items():
        if _TOKEN.fullmatch(name) is None or _VALUE.fullmatch(value) is None:
            raise ValueError(f"invalid header field {name[:40]!r}")
        lines.append(f"{name}: {value}")
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def split_url(url: str) -> tuple[Origin, str]:
    """The origin and request target of an ``http``/``https`` URL.

    Raises:
        ValueError: another scheme, no host, or a bad port.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL with a host: {url[:120]!r}")
    port = parts.port or (443 if scheme == "https" else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Origin(scheme, parts.hostname, port), target


class BulkClient:
    """HTTP/1.1 client for bulk bodies with a keep-alive pool per origin (use ``async with``).

    ``timeout`` bounds each request as a whole (connect, send, receive); ``ssl`` is the
    context for ``https`` origins (the default context when ``None``).
    """

    def __init__(
        self,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        limits: BulkLimits = DEFAULT_LIMITS,
        ssl: _ssl.SSLContext | None = None,
        max_idle_per_origin: int = 16,
    ) -> None:
        self.timeout = timeout
        self.limits = limits
        self._ssl = ssl
        self._max_idle = max_idle_per_origin
        self._idle: dict[Origin, list[_Connection]] = {}
        self._closed = False

    async def __aenter__(self) -> BulkClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every idle connection; the client takes no further requests."""
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                if conn.transport is not None:
                    conn.transport.close()
        if self._idle:
            await asyncio.sleep(0)  # let the transports finish closing their sockets
        self._idle.clear()

    async def request(
        self,
        method: str,
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
        body: Buffer | Sequence[Buffer] | None = None,
        consumer: ConsumerFactory | None = None,
        timeout: float | None = None,
    ) -> BulkResponse:
        """Send one request and receive the whole response; the body goes to ``consumer``'s.

        Idempotent requests that find a pooled connection closed by the peer before it sent
        any octet are retried once on a new connection. The default consumer keeps the body
        in memory, up to the body limit.

        Raises:
            ValueError: an unusable URL, method or header.
            RequestTimeout: the request outlived ``timeout`` (default: the client's).
            ConnectionClosed: the connection broke before the response was complete.
            HTTPProtocolError: the response is malformed or over a limit.
            TransportError: the connection could not be opened.
            Exception: whatever the consumer raised.
        """
        if self._closed:
            raise RuntimeError("BulkClient is closed")
        origin, target = split_url(url)
        parts = [] if body is None else [body] if isinstance(body, Buffer) else list(body)
        length = sum(memoryview(p).nbytes for p in parts) if body is not None else None
        if length is None and method in ("POST", "PUT"):
            length = 0
        head = _request_head(method, target, origin, headers or {}, length)
        factory = consumer or BytesBody.factory(self.limits.max_body)
        try:
            async with asyncio.timeout(self.timeout if timeout is None else timeout):
                return await self._send(method, origin, head, parts, factory)
        except TimeoutError:
            raise RequestTimeout(f"{method} {url[:200]}: no complete answer in time") from None

    async def _send(
        self,
        method: str,
        origin: Origin,
        head: bytes,
        parts: list[Buffer],
        factory: ConsumerFactory,
    ) -> BulkResponse:
        conn, reused = await self._acquire(origin)
        try:
            return await self._exchange(conn, method, head, parts, factory)
        except ConnectionClosed as exc:
            # a pooled connection the peer closed while idle: it never saw the request
            if not (reused and exc.received == 0 and method in IDEMPOTENT):
                raise
        conn, _ = await self._acquire(origin, pooled=False)
        return await self._exchange(conn, method, head, parts, factory)

    async def _exchange(
        self,
        conn: _Connection,
        method: str,
        head: bytes,
        parts: list[Buffer],
        factory: ConsumerFactory,
    ) -> BulkResponse:
        ok = False
        parser = ResponseParser(head_request=method == "HEAD", limits=self.limits)
        ex = conn.start(parser, factory)
        try:
            transport = conn.transport
            if transport is None or conn.closed:
                raise ConnectionClosed("connection closed before the request was sent")
            transport.write(head)
            for part in parts:
                transport.write(part)
            await ex.done
            ok = True
        finally:
            conn.finish()
            if ok and conn.reusable(parser):
                self._release(conn)
            else:
                conn.abort()
                if ex.consumer is not None and not ok:
                    with contextlib.suppress(Exception):
                        ex.consumer.fail(ConnectionClosed("request abandoned"))
        if parser.head is None or ex.consumer is None:
            raise RuntimeError("response complete without a head")
        return BulkResponse(parser.head, ex.consumer)

    async def _acquire(self, origin: Origin, pooled: bool = True) -> tuple[_Connection, bool]:
        idle = self._idle.get(origin) if pooled else None
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn, True
        loop = asyncio.get_running_loop()
        context = None
        if origin.scheme == "https":
            context = self._ssl or _ssl.create_default_context()
        try:
            _, conn = await loop.create_connection(
                lambda: _Connection(origin),
                origin.host,
                origin.port,
                ssl=context,
                server_hostname=origin.host if context is not None else None,
            )
        except OSError as exc:
            where = f"{origin.scheme}://{origin.authority}"
            raise TransportError(f"cannot connect to {where}: {exc}") from exc
        return conn, False

    def _release(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.origin, [])
        if self._closed or len(idle) >= self._max_idle:
            if conn.transport is not None:
                conn.transport.close()
            return
        idle.append(conn)
