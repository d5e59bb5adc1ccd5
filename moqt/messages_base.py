"""MOQT draft-16 control-message basics (§9): type codes, the base class, parameter scopes.

The message classes live in :mod:`moqt.messages` (session, replies, namespaces, dispatch) and
:mod:`moqt.messages_track` (subscriptions and fetches); import them from :mod:`moqt.messages`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import IntEnum
from typing import ClassVar, Self

from .errors import NeedMoreData, ProtocolViolation
from .messages_params import MessageParameter, check_track_extensions
from .wire import (
    Bytes,
    KeyValuePair,
    Reader,
    Writer,
    frame_control_message,
    push_kvps,
    read_kvps_to_end,
)


class MessageType(IntEnum):
    """Control message types (§9, d16)."""

    REQUEST_UPDATE = 0x02
    SUBSCRIBE = 0x03
    SUBSCRIBE_OK = 0x04
    REQUEST_ERROR = 0x05
    PUBLISH_NAMESPACE = 0x06
    REQUEST_OK = 0x07
    NAMESPACE = 0x08
    PUBLISH_NAMESPACE_DONE = 0x09
    UNSUBSCRIBE = 0x0A
    PUBLISH_DONE = 0x0B
    PUBLISH_NAMESPACE_CANCEL = 0x0C
    TRACK_STATUS = 0x0D
    NAMESPACE_DONE = 0x0E
    GOAWAY = 0x10
    SUBSCRIBE_NAMESPACE = 0x11
    MAX_REQUEST_ID = 0x15
    FETCH = 0x16
    FETCH_CANCEL = 0x17
    FETCH_OK = 0x18
    REQUESTS_BLOCKED = 0x1A
    PUBLISH = 0x1D
    PUBLISH_OK = 0x1E
    CLIENT_SETUP = 0x20
    SERVER_SETUP = 0x21


class FetchType(IntEnum):
    """Fetch Type (§9.16)."""

    STANDALONE = 0x1
    RELATIVE_JOINING = 0x2
    ABSOLUTE_JOINING = 0x3


class SubscribeOptions(IntEnum):
    """SUBSCRIBE_NAMESPACE Subscribe Options (§9.25)."""

    PUBLISH = 0x00
    NAMESPACE = 0x01
    BOTH = 0x02


_P = MessageParameter
SUBSCRIBE_PARAMS = frozenset(
    {
        _P.DELIVERY_TIMEOUT,
        _P.AUTHORIZATION_TOKEN,
        _P.FORWARD,
        _P.SUBSCRIBER_PRIORITY,
        _P.SUBSCRIPTION_FILTER,
        _P.GROUP_ORDER,
        _P.NEW_GROUP_REQUEST,
    }
)
REPLY_PARAMS = frozenset({_P.EXPIRES, _P.LARGEST_OBJECT})
UPDATE_PARAMS = SUBSCRIBE_PARAMS - {_P.GROUP_ORDER}
PUBLISH_PARAMS = frozenset({_P.AUTHORIZATION_TOKEN, _P.EXPIRES, _P.LARGEST_OBJECT, _P.FORWARD})
PUBLISH_OK_PARAMS = (SUBSCRIBE_PARAMS - {_P.AUTHORIZATION_TOKEN}) | {_P.EXPIRES}
FETCH_PARAMS = frozenset({_P.AUTHORIZATION_TOKEN, _P.SUBSCRIBER_PRIORITY, _P.GROUP_ORDER})
AUTH_ONLY_PARAMS = frozenset({_P.AUTHORIZATION_TOKEN})
SUBSCRIBE_NAMESPACE_PARAMS = frozenset({_P.AUTHORIZATION_TOKEN, _P.FORWARD})
NO_PARAMS: frozenset[MessageParameter] = frozenset()


def as_enum(enum: type[IntEnum], value: int) -> int:
    """``value`` as a member of ``enum`` when it is one, else the plain int (codes may grow)."""
    return enum(value) if value in enum._value2member_map_ else value


class ControlMessage(ABC):
    """Base of every control message: ``encode()`` gives the framed bytes (§9)."""

    __slots__ = ()
    TYPE: ClassVar[MessageType]

    def encode(self) -> bytes:
        """The whole message: ``Type (i), Length (16), Payload``.

        Raises:
            ValueError: a field cannot be represented (out of range, too long, invalid name,
                a parameter the message does not define).
        """
        writer = Writer()
        self._push(writer)
        return frame_control_message(self.TYPE, writer.data)

    @abstractmethod
    def _push(self, writer: Writer) -> None:
        """Write the payload's fields."""

    @classmethod
    @abstractmethod
    def _read(cls, reader: Reader) -> Self:
        """Read the payload's fields."""

    @classmethod
    def decode(cls, payload: Bytes) -> Self:
        """Decode this message type from its payload (the bytes after ``Length (16)``).

        Raises:
            ProtocolViolation: payload shorter or longer than the message's fields, or a field
                the draft forbids (carrying KEY_VALUE_FORMATTING_ERROR, MALFORMED_PATH, ...
                where the draft names that code).
        """
        reader = Reader(payload)
        try:
            message = cls._read(reader)
        except NeedMoreData:
            # §9: a Length that does not match the fields is a PROTOCOL_VIOLATION
            raise ProtocolViolation(f"{cls.TYPE.name} payload shorter than its fields") from None
        if not reader.eof():
            raise ProtocolViolation(f"{cls.TYPE.name} payload has {reader.remaining} extra bytes")
        return message


def push_track_extensions(writer: Writer, extensions: tuple[KeyValuePair, ...]) -> None:
    """Append Track Extensions: Key-Value-Pairs to the end of the message, no count (§9.10)."""
    push_kvps(writer, extensions)


def read_track_extensions(reader: Reader) -> tuple[KeyValuePair, ...]:
    """Read Track Extensions to the end of the message and range-check the known ones.

    Raises:
        NeedMoreData: the last pair is truncated.
        ProtocolViolation: a bad Type, length or known-extension value.
    """
    return check_track_extensions(read_kvps_to_end(reader))
