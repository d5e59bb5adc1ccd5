"""MOQT draft-16 subscription and fetch messages (§9.9–9.19).

Import them from :mod:`moqt.messages`, which also holds the dispatch table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Self

from .errors import ProtocolViolation, PublishDoneCode
from .messages_base import (
    FETCH_PARAMS,
    NO_PARAMS,
    PUBLISH_OK_PARAMS,
    PUBLISH_PARAMS,
    REPLY_PARAMS,
    SUBSCRIBE_PARAMS,
    UPDATE_PARAMS,
    ControlMessage,
    FetchType,
    MessageType,
    as_enum,
    push_track_extensions,
    read_track_extensions,
)
from .messages_params import MessageParameters, push_message_parameters, read_message_parameters
from .wire import (
    KeyValuePair,
    Location,
    Reader,
    TrackNamespace,
    Writer,
    push_full_track_name,
    push_location,
    push_reason,
    read_full_track_name,
    read_location,
    read_reason,
)

STREAM_COUNT_UNKNOWN = (1 << 62) - 1  # §9.15

# --- Subscriptions (§9.9–9.15) -----------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Subscribe(ControlMessage):
    """SUBSCRIBE (§9.9)."""

    TYPE: ClassVar[MessageType] = MessageType.SUBSCRIBE
    request_id: int
    track_namespace: TrackNamespace
    track_name: bytes
    parameters: MessageParameters = field(default_factory=MessageParameters)

    def _push(self, writer: Writer) -> None:
        writer.push_varint(self.request_id)
        push_full_track_name(writer, self.track_namespace, self.track_name)
        push_message_parameters(writer, self.parameters, SUBSCRIBE_PARAMS)

    @classmethod
    def _read(cls, reader: Reader) -> Self:
        request_id = reader.read_varint()
        namespace, name = read_full_track_name(reader)
        params = read_message_parameters(reader, SUBSCRIBE_PARAMS)
        return cls(
            request_id=request_id, track_namespace=namespace, track_name=name, parameters=params
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class SubscribeOk(ControlMessage):
    """SUBSCRIBE_OK (§9.10): the Track Alias, parameters and Track Extensions."""

    TYPE: ClassVar[MessageType] = MessageType.SUBSCRIBE_OK
    request_id: int
    track_alias: int
    parameters: MessageParameters = field(default_factory=MessageParameters)
    track_extensions: tuple[KeyValuePair, ...] = ()

    def _push(self, writer: Writer) -> None:
        writer.push_varint(self.request_id)
        writer.push_varint(self.track_alias)
        push_message_parameters(writer, self.parameters, REPLY_PARAMS)
        push_track_extensions(writer, self.track_extensions)

    @classmethod
    def _read(cls, reader: Reader) -> Self:
        request_id = reader.read_varint()
        alias = reader.read_varint()
        params = read_message_parameters(reader, REPLY_PARAMS)
        return cls(
            request_id=request_id,
            track_alias=alias,
            parameters=params,
            track_extensions=read_track_extensions(reader),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestUpdate(ControlMessage):
    """REQUEST_UPDATE (§9.11): new parameters for an existing request."""

    TYPE: ClassVar[MessageType] = MessageType.REQUEST_UPDATE
    request_id: int
    existing_request_id: int
    parameters: MessageParameters = field(default_factory=MessageParameters)

    def _push(self, writer: Writer) -> None:
        writer.push_varint(self.request_id)
        writer.push_varint(self.existing_request_id)
        push_message_parameters(writer, self.parameters, UPDATE_PARAMS)

    @classmethod
    def _read(cls, reader: Reader) -> Self:
        request_id = reader.read_varint()
        existing = reader.read_varint()
        params = read_message_parameters(reader, UPDATE_PARAMS)
        return cls(request_id=request_id, existing_request_id=existing, parameters=params)


@dataclass(frozen=True, slots=True, kw_only=True)
class Unsubscribe(ControlMessage):
    """UNSUBSCRIBE (§9.12)."""

    TYPE: ClassVar[MessageType] = MessageType.UNSUBSCRIBE
    request_id: int

    def _push(self, writer: Writer) -> None:
        writer.push_varint(self.request_id)

    @classmethod
    def _read(cls, reader: Reader) -> Self:
        return cls(request_id=reader.read_varint())


@dataclass(frozen=True, slots=True, kw_only=True)
class Publish(ControlMessage):
    """PUBLISH (§9.13): a publisher-initiated subscription."""

    TYPE: ClassVar[MessageType] = MessageType.PUBLISH
    request_id: int
    track_namespace: TrackNamespace
    track_name: bytes
    track_alias: int
    parameters: MessageParameters = field(default_factory=MessageParameters)
    track_extensions: tuple[KeyValuePair, ...] = ()

    def _push(self, writer: Writer) -> None:
        writer.push_varint(self.request_id)
        push_full_track_name(writer, self.track_namespace, self.track_name)
        writer.push_varint(self.track_alias)
        push_message_parameters(writer, self.parameters, PUBLISH_PARAMS)
        push_track_extensions(writer, self.track_extensions)

    @classmethod
    def _read(cls, reader: Reader) -> Self:
        request_id = reader.read_varint()
        namespace, name = read_full_track_name(reader)
        alias = reader.read_varint()
        params = read_message_parameters(reader, PUBLISH_PARAMS)
        return cls(
            request_id=request_id,
            track_namespace=namespace,
            track_name=name,
            track_alias=alias,
            parameters=params,
            track_extensions=read_track_extensions(reader),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class PublishOk(ControlMessage):
    """PUBLISH_OK (§9.14)."""

    TYPE: ClassVar[MessageType] = MessageType.PUBLISH_OK
    request_id: int
    parameters: MessageParameters = field(default_factory=MessageParameters)

    def _push(self, writer: Writer) -> None:
        writer.push_varint(self.request_id)
        push_message_parameters(writer, self.parameters, PUBLISH_OK_PARAMS)

    @classmethod
    def _read(cls, reader: Reader) -> Self:
        request_id = reader.read_varint()
        params = read_message_parameters(reader, PUBLISH_OK_PARAMS)
        return cls(request_id=request_id, parameters=params)


@dataclass(frozen=True, slots=True, kw_only=True)
class PublishDone(ControlMessage):
    """PUBLISH_DONE (§9.15); ``stream_count`` 2^62 - 1 means unknown."""

    TYPE: ClassVar[MessageType] = MessageType.PUBLISH_DONE
    request_id: int
    status_code: int
    stream_count: int
    reason: str = ""

    def _push(self, writer: Writer) -> None:
        writer.push_varint(self.request_id)
        writer.push_varint(self.status_code)
        writer.push_varint(self.stream_count)
        push_reason(writer, self.reason)

    @classmethod
    def _read(cls, reader: Reader) -> Self:
        request_id = reader.read_varint()
        status = as_enum(PublishDoneCode, reader.read_varint())
        count = reader.read_varint()
        return cls(
            request_id=request_id,
            status_code=status,
            stream_count=count,
            reason=read_reason(reader),
        )


# --- Fetch (§9.16–9.18) ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class StandaloneFetch:
    """Standalone Fetch (§9.16.1); ``end`` is the last Location plus one (Object 0 = whole
    group), so layers a..b of group g are ``start={g,a}``, ``end={g,b+1}``."""

    track_namespace: TrackNamespace
    track_name: bytes
    start: Location
    end: Location


@dataclass(frozen=True, slots=True, kw_only=True)
class JoiningFetch:
    """Joining Fetch (§9.16.2): relative (groups back from Largest) or absolute start group."""

    joining_request_id: int
    joining_start: int
    absolute: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Fetch(ControlMessage):
    """FETCH (§9.16): ``target`` is a :class:`StandaloneFetch` or a :class:`JoiningFetch`."""

    TYPE: ClassVar[MessageType] = MessageType.FETCH
    request_id: int
    target: StandaloneFetch | JoiningFetch
    parameters: MessageParameters = field(default_factory=MessageParameters)

    @property
    def fetch_type(self) -> FetchType:
        """The Fetch Type on the wire."""
        if isinstance(self.target, StandaloneFetch):
            return FetchType.STANDALONE
        return FetchType.ABSOLUTE_JOINING if self.target.absolute else FetchType.RELATIVE_JOINING

    def _push(self, writer: Writer) -> None:
        writer.push_varint(self.request_id)
        writer.push_varint(self.fetch_type)
        target = self.target
        if isinstance(target, StandaloneFetch):
            push_full_track_name(writer, target.track_namespace, target.track_name)
            push_location(writer, target.start)
            push_location(writer, target.end)
        else:
            writer.push_varint(target.joining_request_id)
            writer.push_varint(target.joining_start)
        push_message_parameters(writer, self.parameters, FETCH_PARAMS)

    @classmethod
    def _read(cls, reader: Reader) -> Self:
        request_id = reader.read_varint()
        fetch_type = reader.read_varint()
        target: StandaloneFetch | JoiningFetch
        if fetch_type == FetchType.STANDALONE:
            namespace, name = read_full_track_name(reader)
            start = read_location(reader)
            target = StandaloneFetch(
                track_namespace=namespace, track_name=name, start=start, end=read_location(reader)
            )
        elif fetch_type in (FetchType.RELATIVE_JOINING, FetchType.ABSOLUTE_JOINING):
            joining = reader.read_varint()
            target = JoiningFetch(
                joining_request_id=joining,
                joining_start=reader.read_varint(),
                absolute=fetch_type == FetchType.ABSOLUTE_JOINING,
            )
        else:
            # §9.16: a Fetch Type other than 1, 2, 3 MUST close with PROTOCOL_VIOLATION
            raise ProtocolViolation(f"unknown fetch type {fetch_type}")
        params = read_message_parameters(reader, FETCH_PARAMS)
        return cls(request_id=request_id, target=target, parameters=params)


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchOk(ControlMessage):
    """FETCH_OK (§9.17)."""

    TYPE: ClassVar[MessageType] = MessageType.FETCH_OK
    request_id: int
    end_of_track: bool
    end_location: Location
    parameters: MessageParameters = field(default_factory=MessageParameters)
    track_extensions: tuple[KeyValuePair, ...] = ()

    def _push(self, writer: Writer) -> None:
        writer.push_varint(self.request_id)
        writer.push_uint8(1 if self.end_of_track else 0)
        push_location(writer, self.end_location)
        push_message_parameters(writer, self.parameters, NO_PARAMS)
        push_track_extensions(writer, self.track_extensions)

    @classmethod
    def _read(cls, reader: Reader) -> Self:
        request_id = reader.read_varint()
        end_of_track = reader.read_uint8()
        if end_of_track > 1:
            raise ProtocolViolation(f"FETCH_OK End Of Track = {end_of_track}, not 0 or 1")
        end = read_location(reader)
        params = read_message_parameters(reader, NO_PARAMS)
        return cls(
            request_id=request_id,
            end_of_track=end_of_track == 1,
            end_location=end,
            parameters=params,
            track_extensions=read_track_extensions(reader),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchCancel(ControlMessage):
    """FETCH_CANCEL (§9.18)."""

    TYPE: ClassVar[MessageType] = MessageType.FETCH_CANCEL
    request_id: int

    def _push(self, writer: Writer) -> None:
        writer.push_varint(self.request_id)

    @classmethod
    def _read(cls, reader: Reader) -> Self:
        return cls(request_id=reader.read_varint())


@dataclass(frozen=True, slots=True, kw_only=True)
class TrackStatus(ControlMessage):
    """TRACK_STATUS (§9.19): laid out as SUBSCRIBE; answered by REQUEST_OK or REQUEST_ERROR."""

    TYPE: ClassVar[MessageType] = MessageType.TRACK_STATUS
    request_id: int
    track_namespace: TrackNamespace
    track_name: bytes
    parameters: MessageParameters = field(default_factory=MessageParameters)

    def _push(self, writer: Writer) -> None:
        writer.push_varint(self.request_id)
        push_full_track_name(writer, self.track_namespace, self.track_name)
        push_message_parameters(writer, self.parameters, SUBSCRIBE_PARAMS)

    @classmethod
    def _read(cls, reader: Reader) -> Self:
        request_id = reader.read_varint()
        namespace, name = read_full_track_name(reader)
        params = read_message_parameters(reader, SUBSCRIBE_PARAMS)
        return cls(
            request_id=request_id, track_namespace=namespace, track_name=name, parameters=params
        )
