"""The bulk HTTP/1.1 path for block bodies (spec §6.7; DESIGN.md §7, "choose the bulk client by
measurement"; RFC 9112 message syntax).

Chosen by ``bench/bench_blocks.py``: against a holder, this client moves block bodies faster
than httpx and aiohttp, close to a bare blocking socket and at little more CPU per block. So
the bulk path is this small client, with no added dependency:

* :class:`ResponseParser` is a sans-I/O HTTP/1.1 response parser with limits: status line and
  fields strictly checked, the header block at most 64 KiB, ``Content-Length``, ``chunked``
  and close-delimited bodies, interim 1xx responses skipped. Arbitrary octets either parse or
  raise :class:`HTTPProtocolError`; nothing else.
* :class:`BulkClient` keeps a keep-alive pool of connections per origin. Each connection is an
  ``asyncio.BufferedProtocol`` that lets the kernel write body octets straight into the memory
  a :class:`BodyConsumer` hands out (for a block: the container's own buffer), so a body is
  copied once, from the socket. Framing and headers go through a small scratch buffer.
* Every request runs under one deadline; all failures are :class:`TransportError` subclasses.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import re
import ssl as _ssl
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias, cast
from urllib.parse import urlsplit

from kvsp.errors import TransportError

Buffer: TypeAlias = bytes | bytearray | memoryview

DEFAULT_TIMEOUT_S = 30.0
SCRATCH_SIZE = 64 * 1024
IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})


class HTTPProtocolError(TransportError):
    """The peer sent octets that are not a valid HTTP/1.1 response (or beyond the limits)."""


class HeaderTooLarge(HTTPProtocolError):
    """A header block, trailer section or chunk-size line beyond its limit."""


class ConnectionClosed(TransportError):
    """The connection closed before the response was complete."""

    def __init__(self, detail: str, *, received: int = 0) -> None:
        super().__init__(detail)
        self.received = received
        """Response octets received before the close (0: the peer never answered)."""


class RequestTimeout(TransportError):
    """The request did not complete within its deadline."""


@dataclass(frozen=True, slots=True)
class BulkLimits:
    """Bounds on what a response may declare or send."""

    max_head: int = 64 * 1024
    """Octets of a header block (status line and fields) or of a trailer section."""
    max_body: int = 1 << 30
    """Octets of a body (the container limit of :class:`~kvsp.container.ContainerLimits`)."""
    max_chunk_line: int = 4096
    """Octets of one chunk-size line, extensions included."""
    max_interim: int = 16
    """Interim (1xx) responses accepted before the final one."""


DEFAULT_LIMITS = BulkLimits()


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """A final response's status line and fields; names are lowercase, in received order."""

    status: int
    reason: str
    version: str
    headers: tuple[tuple[str, str], ...]

    def get(self, name: str) -> str | None:
        """The field's value, repeated lines joined with ``", "``; ``None`` when absent."""
        values = [v for k, v in self.headers if k == name]
        return ", ".join(values) if values else None


class EndOfMessage:
    """Parser event: the response is complete."""


END_OF_MESSAGE = EndOfMessage()
ParserEvent: TypeAlias = ResponseHead | memoryview | EndOfMessage


class _State(enum.Enum):
    HEAD = "head"
    BODY_LENGTH = "body with Content-Length"
    BODY_CLOSE = "body delimited by close"
    CHUNK_SIZE = "chunk-size line"
    CHUNK_DATA = "chunk data"
    CHUNK_END = "CRLF after chunk data"
    TRAILERS = "trailer section"
    DONE = "done"
    FAILED = "failed"


_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([1-9][0-9]{2})(?: ([\t\x20-\x7e\x80-\xff]*))?")
_VCHARS = rb"[\x21-\x7e\x80-\xff]+"  # field-vchar and obs-text (RFC 9110 §5.5)
_FIELD_LINE = re.compile(
    rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*((?:"
    + _VCHARS
    + rb"(?:[ \t]+"
    + _VCHARS
    + rb")*)?)[ \t]*"
)
_CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;[\t\x20-\x7e\x80-\xff]*)?")
_DIGITS = re.compile(r"[0-9]{1,19}")
_TERMINATOR = b"\r\n\r\n"


def _fields(block: bytes, what: str) -> list[tuple[str, str]]:
    """Parse CRLF-separated field lines (RFC 9112 §5); obs-fold and bare CR/LF are refused."""
    out = []
    for line in block.split(b"\r\n"):
        match = _FIELD_LINE.fullmatch(line)
        if match is None:
            raise HTTPProtocolError(f"malformed {what} field line {line[:80]!r}")
        out.append((match.group(1).decode("ascii").lower(), match.group(2).decode("latin-1")))
    return out


class ResponseParser:
    """Sans-I/O parser of one HTTP/1.1 response (RFC 9112), strict and bounded.

    Feed octets with :meth:`feed`; body octets the caller received directly into the body's
    memory (while :attr:`direct_body` > 0) are reported with :meth:`body_received`; the end
    of the connection with :meth:`eof`. Each returns the events completed: one
    :class:`ResponseHead` (interim 1xx responses are skipped), body pieces as views of the fed
    octets, then :data:`END_OF_MESSAGE`. Octets after the end are counted in :attr:`trailing`
    and make the connection unfit for reuse.

    Raises (from every method):
        HTTPProtocolError: malformed or over-limit input, or a call after a failure.
        ConnectionClosed: :meth:`eof` before the response was complete.
    """

    def __init__(self, *, head_request: bool = False, limits: BulkLimits = DEFAULT_LIMITS) -> None:
        self._limits = limits
        self._head_request = head_request
        self._state = _State.HEAD
        self._buf = bytearray()
        self._remaining = 0
        self._body = 0
        self._received = 0
        self._interim = 0
        self.head: ResponseHead | None = None
        self.content_length: int | None = None
        """The declared body length, when the body is framed by ``Content-Length``."""
        self.keep_alive = True
        """Whether the connection may carry another request once this response is complete."""
        self.trailing = 0

    @property
    def done(self) -> bool:
        """Whether the whole response has been parsed."""
        return self._state is _State.DONE

    @property
    def received(self) -> int:
        """Octets of the response received so far (head, framing and body)."""
        return self._received

    @property
    def direct_body(self) -> int:
        """Body octets that may now be received straight into the body's memory (0: framing)."""
        if self._state in (_State.BODY_LENGTH, _State.CHUNK_DATA):
            return self._remaining
        if self._state is _State.BODY_CLOSE:
            return self._limits.max_body - self._body + 1  # one more shows the limit is passed
        return 0

    def feed(self, data: Buffer) -> list[ParserEvent]:
        """Parse ``data``; body pieces in the result are views of it, valid until it changes."""
        mv = memoryview(data).cast("B") if not isinstance(data, memoryview) else data
        self._received += len(mv)
        events: list[ParserEvent] = []
        try:
            while mv:
                mv = self._step(mv, events)
        except BaseException:
            self._state = _State.FAILED
            raise
        return events

    def body_received(self, n: int) -> list[ParserEvent]:
        """Account for ``n`` body octets received directly (at most :attr:`direct_body`)."""
        if not 0 < n <= self.direct_body:
            self._state = _State.FAILED
            raise HTTPProtocolError(f"{n} body octets received where {self.direct_body} fit")
        self._received += n
        return self._take_body(n, [])

    def eof(self) -> list[ParserEvent]:
        """The peer closed the connection: the end of a close-delimited body, else an error."""
        state = self._state
        if state is _State.BODY_CLOSE:
            self._state = _State.DONE
            self.keep_alive = False
            return [END_OF_MESSAGE]
        if state in (_State.DONE, _State.FAILED):
            return []
        self._state = _State.FAILED
        if self._received == 0:
            raise ConnectionClosed("connection closed before any response octet")
        raise ConnectionClosed(
            f"connection closed in the {state.value} after {self._received} octets "
            f"({self._body} of the body)",
            received=self._received,
        )

    # -- states ---------------------------------------------------------------------------------

    def _step(self, mv: memoryview, events: list[ParserEvent]) -> memoryview:
        state = self._state
        if state is _State.HEAD:
            return self._take_head(mv, events)
        if state in (_State.BODY_LENGTH, _State.BODY_CLOSE, _State.CHUNK_DATA):
            n = min(len(mv), self.direct_body)
            events.append(mv[:n])
            self._take_body(n, events)
            return mv[n:]
        if state is _State.CHUNK_SIZE:
            return self._take_line(mv, self._limits.max_chunk_line, b"\r\n", self._chunk_size)
        if state is _State.CHUNK_END:
            return self._take_chunk_end(mv)
        if state is _State.TRAILERS:
            return self._take_line(mv, self._limits.max_head, _TERMINATOR, self._trailers(events))
        if state is _State.DONE:
            self.trailing += len(mv)
            self.keep_alive = False
            return mv[len(mv) :]
        raise HTTPProtocolError("response parser used after a failure")

    def _take_line(
        self, mv: memoryview, limit: int, end: bytes, on_line: Callable[[bytes], None]
    ) -> memoryview:
        """Accumulate up to ``end``; call ``on_line`` with what precedes it."""
        start = max(0, len(self._buf) - len(end) + 1)
        room = limit + len(end) - len(self._buf)
        self._buf += mv[:room]
        at = self._buf.find(end, start)
        if at < 0:
            if len(self._buf) >= limit + len(end):
                raise HeaderTooLarge(f"{self._state.value} longer than {limit} octets")
            return mv[len(mv) :]
        used = at + len(end) - (len(self._buf) - min(len(mv), room))
        line = bytes(self._buf[:at])
        self._buf.clear()
        on_line(line)
        return mv[used:]

    def _take_head(self, mv: memoryview, events: list[ParserEvent]) -> memoryview:
        def on_head(block: bytes) -> None:
            head = self._parse_head(block)
            if head is not None:
                events.append(head)
                if self._state is _State.DONE:
                    events.append(END_OF_MESSAGE)

        return self._take_line(mv, self._limits.max_head, _TERMINATOR, on_head)

    def _parse_head(self, block: bytes) -> ResponseHead | None:
        status_line, _, rest = block.partition(b"\r\n")
        match = _STATUS_LINE.fullmatch(status_line)
        if match is None:
            raise HTTPProtocolError(f"malformed status line {status_line[:80]!r}")
        status = int(match.group(2))
        fields = _fields(rest, "header") if rest else []
        if 100 <= status < 200:
            if status == 101:
                raise HTTPProtocolError("101 Switching Protocols to a request that asked for none")
            self._interim += 1
            if self._interim > self._limits.max_interim:
                raise HTTPProtocolError(f"more than {self._limits.max_interim} 1xx responses")
            return None
        minor = match.group(1)
        head = ResponseHead(
            status=status,
            reason=(match.group(3) or b"").decode("latin-1"),
            version=f"HTTP/1.{minor.decode()}",
            headers=tuple(fields),
        )
        self.head = head
        self._frame(head, minor == b"1")
        return head

    def _frame(self, head: ResponseHead, http11: bool) -> None:
        """Pick the body framing (RFC 9112 §6.3) and whether the connection stays open."""
        tokens = {t.strip().lower() for t in (head.get("connection") or "").split(",")}
        self.keep_alive = "close" not in tokens and (http11 or "keep-alive" in tokens)
        coding = head.get("transfer-encoding")
        length = head.get("content-length")
        if self._head_request or head.status in (204, 304):
            self._state = _State.DONE
        elif coding is not None:
            if length is not None:  # RFC 9112 §6.3: a smuggling sign; refuse rather than guess
                raise HTTPProtocolError("both Transfer-Encoding and Content-Length")
            if coding.strip().lower() != "chunked":
                raise HTTPProtocolError(f"unsupported Transfer-Encoding {coding[:80]!r}")
            self._state = _State.CHUNK_SIZE
        elif length is not None:
            self._remaining = self.content_length = self._content_length(length)
            self._state = _State.BODY_LENGTH if self._remaining else _State.DONE
        else:
            self.keep_alive = False
            self._state = _State.BODY_CLOSE

    def _content_length(self, value: str) -> int:
        values = {v.strip() for v in value.split(",")}
        if len(values) != 1 or _DIGITS.fullmatch(text := values.pop()) is None:
            raise HTTPProtocolError(f"invalid Content-Length {value[:80]!r}")
        length = int(text)
        if length > self._limits.max_body:
            raise HTTPProtocolError(f"body of {length} octets over the {self._limits.max_body}")
        return length

    def _take_body(self, n: int, events: list[ParserEvent]) -> list[ParserEvent]:
        self._body += n
        state = self._state
        if state is _State.BODY_CLOSE:
            if self._body > self._limits.max_body:
                raise HTTPProtocolError(f"body over the limit of {self._limits.max_body} octets")
            return events
        self._remaining -= n
        if self._remaining == 0:
            if state is _State.BODY_LENGTH:
                self._state = _State.DONE
                events.append(END_OF_MESSAGE)
            else:
                self._state = _State.CHUNK_END
        return events

    def _chunk_size(self, line: bytes) -> None:
        match = _CHUNK_LINE.fullmatch(line)
        if match is None:
            raise HTTPProtocolError(f"malformed chunk-size line {line[:80]!r}")
        size = int(match.group(1), 16)
        if size > self._limits.max_body - self._body:
            raise HTTPProtocolError(f"body over the limit of {self._limits.max_body} octets")
        if size == 0:
            self._buf += b"\r\n"  # the trailer section then always ends in CRLF CRLF
            self._state = _State.TRAILERS
        else:
            self._remaining = size
            self._state = _State.CHUNK_DATA

    def _take_chunk_end(self, mv: memoryview) -> memoryview:
        need = 2 - len(self._buf)
        self._buf += mv[:need]
        if not b"\r\n".startswith(self._buf):
            raise HTTPProtocolError(f"chunk data not followed by CRLF: {bytes(self._buf)!r}")
        if len(self._buf) == 2:
            self._buf.clear()
            self._state = _State.CHUNK_SIZE
        return mv[need:]

    def _trailers(self, events: list[ParserEvent]) -> Callable[[bytes], None]:
        def on_trailers(block: bytes) -> None:
            if block:  # block is CRLF-prefixed: the last-chunk line's end was put in front
                _fields(block[2:], "trailer")
            self._state = _State.DONE
            events.append(END_OF_MESSAGE)

        return on_trailers


# -- body consumers ------------------------------------------------------------------------------


class BodyConsumer(Protocol):
    """Where a response body goes; made per response by a :data:`ConsumerFactory`."""

    def buffer(self, size: int) -> memoryview:
        """Writable memory for the next body octets: 1 to ``size`` octets."""
        ...

    def written(self, n: int) -> None:
        """``n`` octets were written at the start of the last :meth:`buffer`."""
        ...

    def finish(self) -> None:
        """The body is complete."""
        ...

    def fail(self, exc: BaseException) -> None:
        """The exchange failed; release whatever the body holds."""
        ...


ConsumerFactory: TypeAlias = Callable[[ResponseHead, "int | None"], BodyConsumer]
"""Makes the consumer of a response from its head and Content-Length (``None``: not known)."""


class BytesBody:
    """Collects a body in memory: into one buffer of the declared length, else in pieces.

    Raises (from :meth:`buffer`/:meth:`written`):
        HTTPProtocolError: the body passes ``limit`` octets.
    """

    def __init__(self, length: int | None, limit: int) -> None:
        if length is not None and length > limit:
            raise HTTPProtocolError(f"body of {length} octets over the limit of {limit}")
        self._limit = limit
        self._data = bytearray(length if length is not None else SCRATCH_SIZE)
        self._pieces: list[bytes] | None = None if length is not None else []
        self._fill = 0

    @classmethod
    def factory(cls, limit: int) -> ConsumerFactory:
        """A factory of consumers that keep at most ``limit`` octets."""
        return lambda head, length: cls(length, limit)

    @property
    def data(self) -> bytearray | bytes:
        """The body received so far (the buffer itself, not a copy, when its length was known)."""
        if self._pieces is None:
            return self._data if self._fill == len(self._data) else self._data[: self._fill]
        return b"".join(self._pieces)

    def buffer(self, size: int) -> memoryview:
        """Memory for the next octets."""
        return memoryview(self._data)[self._fill if self._pieces is None else 0 :][:size]

    def written(self, n: int) -> None:
        """Account for (and in pieces mode keep) ``n`` octets."""
        if self._pieces is None:
            self._fill += n
            return
        self._fill += n
        if self._fill > self._limit:
            raise HTTPProtocolError(f"body over the limit of {self._limit} octets")
        self._pieces.append(bytes(memoryview(self._data)[:n]))

    def finish(self) -> None:
        """Nothing to do: the body is in memory."""

    def fail(self, exc: BaseException) -> None:
        """Drop the partial body."""
        if self._pieces is not None:
            self._pieces.clear()


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
