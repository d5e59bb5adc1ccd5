"""MOQT draft-16 error codes and the exceptions that carry them (§3.4, §9.8, §9.15, §10.4.3, §13.4).

Like aioquic's H3 layer, each exception class stores the wire code it closes with. The session
turns a :class:`ProtocolViolation` into CONNECTION_CLOSE with ``exc.error_code``; a
:class:`MalformedTrack` ends one track (PUBLISH_DONE / REQUEST_ERROR / RESET_STREAM with code
0x12), not the session. :class:`NeedMoreData` is an internal signal of the incremental parsers
and never reaches a caller of the public decoders. :class:`ListenError` is no wire error: a
listener (QUIC, QMux, HTTP) that could not bind.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from enum import IntEnum
from typing import ClassVar


class SessionError(IntEnum):
    """Session termination error codes (§3.4, §13.4.1)."""

    NO_ERROR = 0x0
    INTERNAL_ERROR = 0x1
    UNAUTHORIZED = 0x2
    PROTOCOL_VIOLATION = 0x3
    INVALID_REQUEST_ID = 0x4
    DUPLICATE_TRACK_ALIAS = 0x5
    KEY_VALUE_FORMATTING_ERROR = 0x6
    TOO_MANY_REQUESTS = 0x7
    INVALID_PATH = 0x8
    MALFORMED_PATH = 0x9
    GOAWAY_TIMEOUT = 0x10
    CONTROL_MESSAGE_TIMEOUT = 0x11
    DATA_STREAM_TIMEOUT = 0x12
    AUTH_TOKEN_CACHE_OVERFLOW = 0x13
    DUPLICATE_AUTH_TOKEN_ALIAS = 0x14
    VERSION_NEGOTIATION_FAILED = 0x15
    MALFORMED_AUTH_TOKEN = 0x16
    UNKNOWN_AUTH_TOKEN_ALIAS = 0x17
    EXPIRED_AUTH_TOKEN = 0x18
    INVALID_AUTHORITY = 0x19
    MALFORMED_AUTHORITY = 0x1A


class RequestErrorCode(IntEnum):
    """REQUEST_ERROR codes (§9.8, §13.4.2); PUBLISH_NAMESPACE_CANCEL uses them too (§9.24)."""

    INTERNAL_ERROR = 0x0
    UNAUTHORIZED = 0x1
    TIMEOUT = 0x2
    NOT_SUPPORTED = 0x3
    MALFORMED_AUTH_TOKEN = 0x4
    EXPIRED_AUTH_TOKEN = 0x5
    DOES_NOT_EXIST = 0x10
    INVALID_RANGE = 0x11
    MALFORMED_TRACK = 0x12
    DUPLICATE_SUBSCRIPTION = 0x19
    UNINTERESTED = 0x20
    PREFIX_OVERLAP = 0x30
    INVALID_JOINING_REQUEST_ID = 0x32


class PublishDoneCode(IntEnum):
    """PUBLISH_DONE status codes (§9.15, §13.4.3)."""

    INTERNAL_ERROR = 0x0
    UNAUTHORIZED = 0x1
    TRACK_ENDED = 0x2
    SUBSCRIPTION_ENDED = 0x3
    GOING_AWAY = 0x4
    EXPIRED = 0x5
    TOO_FAR_BEHIND = 0x6
    UPDATE_FAILED = 0x8
    MALFORMED_TRACK = 0x12


class StreamResetCode(IntEnum):
    """RESET_STREAM / RESET_STREAM_AT codes for data streams, FETCH streams included (§10.4.3)."""

    INTERNAL_ERROR = 0x0
    CANCELLED = 0x1
    DELIVERY_TIMEOUT = 0x2
    SESSION_CLOSED = 0x3
    UNKNOWN_OBJECT_STATUS = 0x4
    MALFORMED_TRACK = 0x12


class ObjectStatus(IntEnum):
    """Object Status (§10.2.1.1); d16 removed 0x1 Does Not Exist."""

    NORMAL = 0x0
    END_OF_GROUP = 0x3
    END_OF_TRACK = 0x4


class NeedMoreData(Exception):
    """Internal signal: the input ends before the item being read. Not an error a caller sees."""


class MOQTError(Exception):
    """Root of every error the ``moqt`` wire layer raises on bad input from the peer.

    ``error_code`` is the wire code the error maps to; ``reason`` is the diagnostic text, short
    enough to send as a Reason Phrase.
    """

    default_code: ClassVar[int] = SessionError.PROTOCOL_VIOLATION

    def __init__(self, reason: str = "", *, error_code: int | None = None) -> None:
        self.reason = reason[:1024]
        self.error_code: int = self.default_code if error_code is None else error_code
        super().__init__(reason)


class ProtocolViolation(MOQTError):
    """The peer broke a MUST of the draft; close the session with ``error_code`` (§3.4).

    ``error_code`` is a :class:`SessionError`: PROTOCOL_VIOLATION unless the draft names a more
    specific code (KEY_VALUE_FORMATTING_ERROR, MALFORMED_PATH, ...).
    """

    default_code: ClassVar[int] = SessionError.PROTOCOL_VIOLATION


class KeyValueFormattingError(ProtocolViolation):
    """A known Key-Value-Pair type whose value does not match its serialization (§1.4.2)."""

    default_code: ClassVar[int] = SessionError.KEY_VALUE_FORMATTING_ERROR


class MalformedTrack(MOQTError):
    """The track, not the session, is malformed (§2.4.2, §11.2): code MALFORMED_TRACK (0x12).

    0x12 is MALFORMED_TRACK in the REQUEST_ERROR, PUBLISH_DONE and stream reset registries alike.
    """

    default_code: ClassVar[int] = StreamResetCode.MALFORMED_TRACK


class ListenError(OSError):
    """A listener that could not start: what it serves, where, and the system's reason (an
    address in use, a missing folder, a socket path too long). Not a wire error: it lives here
    because every package that listens (``moqt``, ``relay``, ``kvsp.web``) imports this one,
    and their command lines report it as one line, not a traceback."""

    def __init__(self, what: str, where: str, reason: str) -> None:
        self.what = what
        self.where = where
        self.reason = reason
        super().__init__(f"cannot listen for {what} on {where}: {reason}")


@contextlib.contextmanager
def listening(what: str, where: str | tuple[str, int]) -> Iterator[None]:
    """Turn an :class:`OSError` raised inside into a :class:`ListenError` for ``what`` on
    ``where`` (a socket path, or ``(host, port)``, written ``host:port`` or ``[v6]:port``); the
    reason is the system's text for its errno where it has one."""
    if isinstance(where, tuple):
        host, port = where
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        yield
    except ListenError:
        raise
    except OSError as exc:
        reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
        raise ListenError(what, where, reason) from exc
