"""A sans-I/O HTTP/1.1 response parser with limits, and the body consumers it feeds (RFC 9112
message syntax; spec §6.7 block bodies).

:class:`ResponseParser` takes octets in any chunking and returns events: the response head,
body pieces written straight into the memory a :class:`BodyConsumer` hands out, the end of the
message. The status line and fields are strictly checked, the header block is bounded,
``Content-Length``, ``chunked`` and close-delimited bodies are framed, and interim 1xx
responses are skipped. Arbitrary octets either parse or raise :class:`HTTPProtocolError`,
nothing else. It knows no socket: :mod:`kvsp.transfer.bulk` is its asyncio shell.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeAlias

from kvsp.errors import TransportError

Buffer: TypeAlias = bytes | bytearray | memoryview

SCRATCH_SIZE = 64 * 1024
"""Octets of the scratch buffer for framing and headers, and of a body's first piece."""


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
