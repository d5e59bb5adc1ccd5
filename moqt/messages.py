"""MOQT draft-16 control messages (§9): one frozen dataclass per message, encode and decode.

``msg.encode()`` returns the whole framed message (``Type (i), Length (16), Payload``);
:func:`decode_control_message` turns a type and payload back into a message, and
:class:`ControlMessageParser` does the same for a stream fed in arbitrary chunks. This module
holds the session, reply and namespace messages and re-exports the subscription and fetch ones
from :mod:`moqt.messages_track`.

Notes on the draft: a NAMESPACE / NAMESPACE_DONE suffix may have 0 fields (a published
namespace equal to the SUBSCRIBE_NAMESPACE prefix); TRACK_STATUS accepts SUBSCRIBE's parameters;
REQUEST_OK accepts EXPIRES and LARGEST_OBJECT (it carries SUBSCRIBE_OK's parameters for
TRACK_STATUS).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Self

from .errors import ProtocolViolation, RequestErrorCode
from .messages_base import (
    AUTH_ONLY_PARAMS,
    REPLY_PARAMS,
    SUBSCRIBE_NAMESPACE_PARAMS,
    ControlMessage,
    FetchType,
    MessageType,
    SubscribeOptions,
    as_enum,
)
from .messages_params import (
    AuthToken,
    FilterType,
    GroupOrder,
    MessageParameters,
    SetupParameters,
    SubscriptionFilter,
    TokenAliasType,
    push_message_parameters,
    push_setup_parameters,
    read_message_parameters,
    read_setup_parameters,
)
from .messages_track import (
    STREAM_COUNT_UNKNOWN,
    Fetch,
    FetchCancel,
    FetchOk,
    JoiningFetch,
    Publish,
    PublishDone,
    PublishOk,
    RequestUpdate,
    StandaloneFetch,
    Subscribe,
    SubscribeOk,
    TrackStatus,
    Unsubscribe,
)
from .wire import (
    Bytes,
    ControlStreamParser,
    Reader,
    TrackNamespace,
    Writer,
    push_namespace,
    push_reason,
    read_namespace,
    read_reason,
)

__all__ = [
    "STREAM_COUNT_UNKNOWN",
    "AuthToken",
    "ClientSetup",
    "ControlMessage",
    "ControlMessageParser",
    "Fetch",
    "FetchCancel",
    "FetchOk",
    "FetchType",
    "FilterType",
    "Goaway",
    "GroupOrder",
    "JoiningFetch",
    "MaxRequestId",
    "MessageParameters",
    "MessageType",
    "Namespace",
    "NamespaceDone",
    "Publish",
    "PublishDone",
    "PublishNamespace",
    "PublishNamespaceCancel",
    "PublishNamespaceDone",
    "PublishOk",
    "RequestError",
    "RequestOk",
    "RequestUpdate",
    "RequestsBlocked",
    "ServerSetup",
    "SetupParameters",
    "StandaloneFetch",
    "Subscribe",
    "SubscribeNamespace",
    "SubscribeOk",
    "SubscribeOptions",
    "SubscriptionFilter",
    "TokenAliasType",
    "TrackStatus",
    "Unsubscribe",
    "decode_control_message",
]

GOAWAY_URI_MAX = 8192  # §9.4

# --- Session (§9.3–9.6) ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientSetup(ControlMessage):
    """CLIENT_SETUP (§9.3): Setup Parameters only; d16 has no version list."""

    TYPE: ClassVar[MessageType] = MessageType.CLIENT_SETUP
    parameters: SetupParameters = field(default_factory=SetupParameters)

    def _push(self, writer: Writer) -> None:
        push_setup_parameters(writer, self.parameters)

    @classmethod
    def _read(cls, reader: Reader) -> Self:
        params = read_setup_parameters(reader)
        for token in params.authorization_tokens:
            if token.alias_type in (TokenAliasType.DELETE, TokenAliasType.USE_ALIAS):
                # §9.2.2.1: DELETE or USE_ALIAS in CLIENT_SETUP MUST be a PROTOCOL_VIOLATION
                raise ProtocolViolation(f"{token.alias_type.name} token in CLIENT_SETUP")
        return cls(parameters=params)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerSetup(ControlMessage):
    """SERVER_SETUP (§9.3): Setup Parameters only; d16 has no selected version."""

    TYPE: ClassVar[MessageType] = MessageType.SERVER_SETUP
    parameters: SetupParameters = field(default_factory=SetupParameters)

    def _push(self, writer: Writer) -> None:
        push_setup_parameters(writer, self.parameters)

    @classmethod
    def _read(cls, reader: Reader) -> Self:
        return cls(parameters=read_setup_parameters(reader))


@dataclass(frozen=True, slots=True, kw_only=True)
class Goaway(ControlMessage):
    """GOAWAY (§9.4): an optional new session URI (empty = reuse the current one)."""

    TYPE: ClassVar[MessageType] = MessageType.GOAWAY
    new_session_uri: str = ""

    def _push(self, writer: Writer) -> None:
        data = self.new_session_uri.encode("utf-8")
        if len(data) > GOAWAY_URI_MAX:
            raise ValueError("GOAWAY URI longer than 8192 bytes")
        writer.push_length_prefixed(data)

    @classmethod
    def _read(cls, reader: Reader) -> Self:
        length = reader.read_varint()
        if length > GOAWAY_URI_MAX:
            # §9.4: a URI longer than 8192 bytes MUST close with PROTOCOL_VIOLATION
            raise ProtocolViolation("GOAWAY URI longer than 8192 bytes")
        try:
            uri = str(reader.read_bytes(length), "utf-8")
        except UnicodeDecodeError:
            raise ProtocolViolation("GOAWAY URI is not UTF-8") from None
        return cls(new_session_uri=uri)


@dataclass(frozen=True, slots=True, kw_only=True)
class MaxRequestId(ControlMessage):
    """MAX_REQUEST_ID (§9.5): the new maximum Request ID plus one."""

    TYPE: ClassVar[MessageType] = MessageType.MAX_REQUEST_ID
    max_request_id: int

    def _push(self, writer: Writer) -> None:
        writer.push_varint(self.max_request_id)

    @classmethod
    def _read(cls, reader: Reader) -> Self:
        return cls(max_request_id=reader.read_varint())


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestsBlocked(ControlMessage):
    """REQUESTS_BLOCKED (§9.6): the Maximum Request ID the sender is blocked on."""

    TYPE: ClassVar[MessageType] = MessageType.REQUESTS_BLOCKED
    maximum_request_id: int

    def _push(self, writer: Writer) -> None:
        writer.push_varint(self.maximum_request_id)

    @classmethod
    def _read(cls, reader: Reader) -> Self:
        return cls(maximum_request_id=reader.read_varint())


# --- Generic replies (§9.7–9.8) ----------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestOk(ControlMessage):
    """REQUEST_OK (§9.7): answers REQUEST_UPDATE, TRACK_STATUS, SUBSCRIBE_NAMESPACE and
    PUBLISH_NAMESPACE; for TRACK_STATUS it carries SUBSCRIBE_OK's parameters."""

    TYPE: ClassVar[MessageType] = MessageType.REQUEST_OK
    request_id: int
    parameters: MessageParameters = field(default_factory=MessageParameters)

    def _push(self, writer: Writer) -> None:
        writer.push_varint(self.request_id)
        push_message_parameters(writer, self.parameters, REPLY_PARAMS)

    @classmethod
    def _read(cls, reader: Reader) -> Self:
        request_id = reader.read_varint()
        return cls(request_id=request_id, parameters=read_message_parameters(reader, REPLY_PARAMS))


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestError(ControlMessage):
    """REQUEST_ERROR (§9.8): answers any request. ``retry_interval`` is ms + 1 (0 = never)."""

    TYPE: ClassVar[MessageType] = MessageType.REQUEST_ERROR
    request_id: int
    error_code: int
    retry_interval: int = 0
    reason: str = ""

    def _push(self, writer: Writer) -> None:
        writer.push_varint(self.request_id)
        writer.push_varint(self.error_code)
        writer.push_varint(self.retry_interval)
        push_reason(writer, self.reason)

    @classmethod
    def _read(cls, reader: Reader) -> Self:
        request_id = reader.read_varint()
        code = as_enum(RequestErrorCode, reader.read_varint())
        retry = reader.read_varint()
        return cls(
            request_id=request_id, error_code=code, retry_interval=retry, reason=read_reason(reader)
        )


# --- Namespaces (§9.20–9.25) -------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class PublishNamespace(ControlMessage):
    """PUBLISH_NAMESPACE (§9.20)."""

    TYPE: ClassVar[MessageType] = MessageType.PUBLISH_NAMESPACE
    request_id: int
    track_namespace: TrackNamespace
    parameters: MessageParameters = field(default_factory=MessageParameters)

    def _push(self, writer: Writer) -> None:
        writer.push_varint(self.request_id)
        push_namespace(writer, self.track_namespace)
        push_message_parameters(writer, self.parameters, AUTH_ONLY_PARAMS)

    @classmethod
    def _read(cls, reader: Reader) -> Self:
        request_id = reader.read_varint()
        namespace = read_namespace(reader)
        params = read_message_parameters(reader, AUTH_ONLY_PARAMS)
        return cls(request_id=request_id, track_namespace=namespace, parameters=params)


@dataclass(frozen=True, slots=True, kw_only=True)
class Namespace(ControlMessage):
    """NAMESPACE (§9.21): a namespace suffix after the SUBSCRIBE_NAMESPACE prefix.

    The suffix may have 0 fields (a namespace equal to the prefix); see the module notes.
    """

    TYPE: ClassVar[MessageType] = MessageType.NAMESPACE
    track_namespace_suffix: TrackNamespace

    def _push(self, writer: Writer) -> None:
        push_namespace(writer, self.track_namespace_suffix, min_fields=0)

    @classmethod
    def _read(cls, reader: Reader) -> Self:
        return cls(track_namespace_suffix=read_namespace(reader, min_fields=0))


@dataclass(frozen=True, slots=True, kw_only=True)
class PublishNamespaceDone(ControlMessage):
    """PUBLISH_NAMESPACE_DONE (§9.22): the Request ID of the PUBLISH_NAMESPACE withdrawn."""

    TYPE: ClassVar[MessageType] = MessageType.PUBLISH_NAMESPACE_DONE
    request_id: int

    def _push(self, writer: Writer) -> None:
        writer.push_varint(self.request_id)

    @classmethod
    def _read(cls, reader: Reader) -> Self:
        return cls(request_id=reader.read_varint())


@dataclass(frozen=True, slots=True, kw_only=True)
class NamespaceDone(ControlMessage):
    """NAMESPACE_DONE (§9.23): a namespace suffix no longer published."""

    TYPE: ClassVar[MessageType] = MessageType.NAMESPACE_DONE
    track_namespace_suffix: TrackNamespace

    def _push(self, writer: Writer) -> None:
        push_namespace(writer, self.track_namespace_suffix, min_fields=0)

    @classmethod
    def _read(cls, reader: Reader) -> Self:
        return cls(track_namespace_suffix=read_namespace(reader, min_fields=0))


@dataclass(frozen=True, slots=True, kw_only=True)
class PublishNamespaceCancel(ControlMessage):
    """PUBLISH_NAMESPACE_CANCEL (§9.24): REQUEST_ERROR codes."""

    TYPE: ClassVar[MessageType] = MessageType.PUBLISH_NAMESPACE_CANCEL
    request_id: int
    error_code: int
    reason: str = ""

    def _push(self, writer: Writer) -> None:
        writer.push_varint(self.request_id)
        writer.push_varint(self.error_code)
        push_reason(writer, self.reason)

    @classmethod
    def _read(cls, reader: Reader) -> Self:
        request_id = reader.read_varint()
        code = as_enum(RequestErrorCode, reader.read_varint())
        return cls(request_id=request_id, error_code=code, reason=read_reason(reader))


@dataclass(frozen=True, slots=True, kw_only=True)
class SubscribeNamespace(ControlMessage):
    """SUBSCRIBE_NAMESPACE (§9.25): first message of its own bidi stream; prefix 0..32 fields."""

    TYPE: ClassVar[MessageType] = MessageType.SUBSCRIBE_NAMESPACE
    request_id: int
    track_namespace_prefix: TrackNamespace
    subscribe_options: SubscribeOptions = SubscribeOptions.BOTH
    parameters: MessageParameters = field(default_factory=MessageParameters)

    def _push(self, writer: Writer) -> None:
        writer.push_varint(self.request_id)
        push_namespace(writer, self.track_namespace_prefix, min_fields=0)
        writer.push_varint(self.subscribe_options)
        push_message_parameters(writer, self.parameters, SUBSCRIBE_NAMESPACE_PARAMS)

    @classmethod
    def _read(cls, reader: Reader) -> Self:
        request_id = reader.read_varint()
        prefix = read_namespace(reader, min_fields=0)
        options = reader.read_varint()
        if options not in SubscribeOptions._value2member_map_:
            raise ProtocolViolation(f"unknown SUBSCRIBE_NAMESPACE options {options}")
        params = read_message_parameters(reader, SUBSCRIBE_NAMESPACE_PARAMS)
        return cls(
            request_id=request_id,
            track_namespace_prefix=prefix,
            subscribe_options=SubscribeOptions(options),
            parameters=params,
        )


# --- Dispatch ----------------------------------------------------------------------------------

MESSAGE_CLASSES: dict[int, type[ControlMessage]] = {
    cls.TYPE: cls
    for cls in (
        ClientSetup,
        ServerSetup,
        Goaway,
        MaxRequestId,
        RequestsBlocked,
        RequestOk,
        RequestError,
        Subscribe,
        SubscribeOk,
        RequestUpdate,
        Unsubscribe,
        Publish,
        PublishOk,
        PublishDone,
        Fetch,
        FetchOk,
        FetchCancel,
        TrackStatus,
        PublishNamespace,
        Namespace,
        PublishNamespaceDone,
        NamespaceDone,
        PublishNamespaceCancel,
        SubscribeNamespace,
    )
}


def decode_control_message(msg_type: int, payload: Bytes) -> ControlMessage:
    """Decode the payload of a control message of type ``msg_type`` (§9).

    Raises:
        ProtocolViolation: unknown type, payload shorter or longer than the message's fields,
            or a field the draft forbids (carrying KEY_VALUE_FORMATTING_ERROR, MALFORMED_PATH,
            ... where the draft names that code).
    """
    cls = MESSAGE_CLASSES.get(msg_type)
    if cls is None:
        # §9: an unknown message type MUST close the session
        raise ProtocolViolation(f"unknown control message type {msg_type:#x}")
    return cls.decode(payload)


class ControlMessageParser:
    """Turns a control stream (or SUBSCRIBE_NAMESPACE stream) fed in chunks into messages."""

    __slots__ = ("_frames",)

    def __init__(self) -> None:
        self._frames = ControlStreamParser()

    def feed(self, data: Bytes, *, end_stream: bool = False) -> list[ControlMessage]:
        """Add ``data``; return the messages it completes.

        Raises:
            ProtocolViolation: a malformed message, or a stream ending inside one.
        """
        return [
            decode_control_message(frame.msg_type, frame.payload)
            for frame in self._frames.feed(data, end_stream=end_stream)
        ]
