"""Events a :class:`~moqt.session.MOQTSession` returns from ``handle_event`` (d16 §3, §9, §10).

Like aioquic's H3 events: frozen dataclasses, one per thing that happened, in wire order. Control
events carry the decoded message; data events carry the stream, the request the stream belongs
to (resolved from the Track Alias or the FETCH_HEADER) and payload chunks as memoryview slices
of the received QUIC data, so a 2 MiB object is consumed piece by piece without copies.

A request with a :class:`TrackSink` (``MOQTSession.set_track_sink``) gets its data events handed
to the sink as they happen instead of returned, and its payload as plain calls with no event
object per chunk; a sink that is also a :class:`RunSink` may take the whole objects a piece of a
FETCH stream holds in one call, with no event per object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .messages import (
    Fetch,
    FetchOk,
    Publish,
    PublishDone,
    PublishNamespace,
    PublishOk,
    RequestError,
    RequestOk,
    RequestUpdate,
    SetupParameters,
    Subscribe,
    SubscribeNamespace,
    SubscribeOk,
    TrackStatus,
)
from .objects import ObjectDatagram, ObjectRun, ObjectStart, SubgroupHeader
from .wire import TrackNamespace


@dataclass(frozen=True, slots=True)
class MOQTEvent:
    """Base of every session event."""


# --- Session -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SetupComplete(MOQTEvent):
    """The setup exchange finished; ``parameters`` are the peer's Setup Parameters (§9.3)."""

    parameters: SetupParameters


@dataclass(frozen=True, slots=True)
class GoawayReceived(MOQTEvent):
    """The peer sent GOAWAY (§9.4); no new requests may be sent on this session."""

    new_session_uri: str


@dataclass(frozen=True, slots=True)
class MaxRequestIdReceived(MOQTEvent):
    """The peer raised our request limit (§9.5): Request IDs below ``max_request_id`` are ok."""

    max_request_id: int


@dataclass(frozen=True, slots=True)
class RequestsBlockedReceived(MOQTEvent):
    """The peer is blocked on our limit (§9.6)."""

    maximum_request_id: int


@dataclass(frozen=True, slots=True)
class SessionClosed(MOQTEvent):
    """The session is over: closed by us (a violation we found, or ``close()``) or the peer."""

    error_code: int
    reason: str
    by_peer: bool


# --- Requests from the peer ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SubscribeReceived(MOQTEvent):
    """SUBSCRIBE (§9.9): answer with ``subscribe_ok`` or ``request_error``."""

    request_id: int
    message: Subscribe


@dataclass(frozen=True, slots=True)
class UnsubscribeReceived(MOQTEvent):
    """UNSUBSCRIBE (§9.12) for a subscription we serve (or a PUBLISH we sent)."""

    request_id: int


@dataclass(frozen=True, slots=True)
class PublishReceived(MOQTEvent):
    """PUBLISH (§9.13): answer with ``publish_ok`` or ``request_error``."""

    request_id: int
    message: Publish


@dataclass(frozen=True, slots=True)
class FetchReceived(MOQTEvent):
    """FETCH (§9.16); for a joining fetch ``joined`` is the SUBSCRIBE it joins."""

    request_id: int
    message: Fetch
    joined: Subscribe | None = None


@dataclass(frozen=True, slots=True)
class FetchCancelReceived(MOQTEvent):
    """FETCH_CANCEL (§9.18): stop the fetch stream."""

    request_id: int


@dataclass(frozen=True, slots=True)
class TrackStatusReceived(MOQTEvent):
    """TRACK_STATUS (§9.19): answer with ``request_ok`` or ``request_error``."""

    request_id: int
    message: TrackStatus


@dataclass(frozen=True, slots=True)
class RequestUpdateReceived(MOQTEvent):
    """REQUEST_UPDATE (§9.11): answer with ``request_ok`` or ``request_error``."""

    request_id: int
    message: RequestUpdate


@dataclass(frozen=True, slots=True)
class PublishNamespaceReceived(MOQTEvent):
    """PUBLISH_NAMESPACE (§9.20): answer with ``request_ok`` or ``request_error``."""

    request_id: int
    message: PublishNamespace


@dataclass(frozen=True, slots=True)
class PublishNamespaceDoneReceived(MOQTEvent):
    """PUBLISH_NAMESPACE_DONE (§9.22): the peer withdrew the namespace."""

    request_id: int
    track_namespace: TrackNamespace


@dataclass(frozen=True, slots=True)
class PublishNamespaceCancelReceived(MOQTEvent):
    """PUBLISH_NAMESPACE_CANCEL (§9.24): the peer no longer routes our namespace."""

    request_id: int
    error_code: int
    reason: str


@dataclass(frozen=True, slots=True)
class SubscribeNamespaceReceived(MOQTEvent):
    """SUBSCRIBE_NAMESPACE on its own bidi stream (§9.25): answer with ``request_ok`` or
    ``request_error``, then ``namespace`` / ``namespace_done``."""

    request_id: int
    message: SubscribeNamespace


@dataclass(frozen=True, slots=True)
class SubscribeNamespaceEnded(MOQTEvent):
    """A SUBSCRIBE_NAMESPACE stream closed (FIN, or reset with ``error_code``)."""

    request_id: int
    error_code: int | None = None


# --- Replies from the peer -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SubscribeOkReceived(MOQTEvent):
    """SUBSCRIBE_OK (§9.10); objects of the track arrive with ``message.track_alias``."""

    request_id: int
    message: SubscribeOk


@dataclass(frozen=True, slots=True)
class PublishOkReceived(MOQTEvent):
    """PUBLISH_OK (§9.14)."""

    request_id: int
    message: PublishOk


@dataclass(frozen=True, slots=True)
class FetchOkReceived(MOQTEvent):
    """FETCH_OK (§9.17)."""

    request_id: int
    message: FetchOk


@dataclass(frozen=True, slots=True)
class RequestOkReceived(MOQTEvent):
    """REQUEST_OK (§9.7) for our PUBLISH_NAMESPACE, SUBSCRIBE_NAMESPACE, TRACK_STATUS or
    REQUEST_UPDATE."""

    request_id: int
    message: RequestOk


@dataclass(frozen=True, slots=True)
class RequestErrorReceived(MOQTEvent):
    """REQUEST_ERROR (§9.8) for any of our requests."""

    request_id: int
    message: RequestError


@dataclass(frozen=True, slots=True)
class PublishDoneReceived(MOQTEvent):
    """PUBLISH_DONE (§9.15): the publisher ended the subscription (or its PUBLISH)."""

    request_id: int
    message: PublishDone


@dataclass(frozen=True, slots=True)
class NamespaceReceived(MOQTEvent):
    """NAMESPACE (§9.21) on our SUBSCRIBE_NAMESPACE stream."""

    request_id: int
    suffix: TrackNamespace


@dataclass(frozen=True, slots=True)
class NamespaceDoneReceived(MOQTEvent):
    """NAMESPACE_DONE (§9.23) on our SUBSCRIBE_NAMESPACE stream."""

    request_id: int
    suffix: TrackNamespace


# --- Data ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SubgroupStreamOpened(MOQTEvent):
    """A subgroup stream (§10.4.2) of the subscription (or PUBLISH) ``request_id``."""

    stream_id: int
    request_id: int
    header: SubgroupHeader


@dataclass(frozen=True, slots=True)
class FetchStreamOpened(MOQTEvent):
    """The response stream (§10.4.4) of our FETCH ``request_id``."""

    stream_id: int
    request_id: int


@dataclass(frozen=True, slots=True)
class ObjectHeader(MOQTEvent):
    """An object begins: its fields (§10.2.1); ``track_alias`` is None on a fetch stream."""

    stream_id: int
    request_id: int
    track_alias: int | None
    object: ObjectStart

    @property
    def group_id(self) -> int:
        """The object's Group ID."""
        return self.object.group_id

    @property
    def object_id(self) -> int:
        """The object's Object ID."""
        return self.object.object_id

    @property
    def payload_length(self) -> int:
        """The payload bytes that follow as :class:`ObjectData`."""
        return self.object.payload_length


@dataclass(frozen=True, slots=True)
class ObjectData(MOQTEvent):
    """A piece of the current object's payload; ``offset`` is its place in the payload.

    ``data`` is a slice of the received QUIC data: valid as long as you keep a reference.
    """

    stream_id: int
    request_id: int
    data: memoryview
    offset: int


@dataclass(frozen=True, slots=True)
class ObjectEnd(MOQTEvent):
    """The object's payload is complete."""

    stream_id: int
    request_id: int
    group_id: int
    object_id: int


@dataclass(frozen=True, slots=True)
class EndOfRangeReceived(MOQTEvent):
    """A FETCH End of Range marker (§10.4.4.2)."""

    stream_id: int
    request_id: int
    group_id: int
    object_id: int
    unknown: bool


@dataclass(frozen=True, slots=True)
class DataStreamFinished(MOQTEvent):
    """The data stream ended with a FIN on an object boundary."""

    stream_id: int
    request_id: int


@dataclass(frozen=True, slots=True)
class DataStreamReset(MOQTEvent):
    """The peer reset a data stream it was sending (§10.4.3 codes)."""

    stream_id: int
    request_id: int | None
    error_code: int


@dataclass(frozen=True, slots=True)
class DataStreamStopped(MOQTEvent):
    """The peer sent STOP_SENDING on a stream we send; we reset it with the same code."""

    stream_id: int
    request_id: int | None
    error_code: int


@dataclass(frozen=True, slots=True)
class DatagramReceived(MOQTEvent):
    """An OBJECT_DATAGRAM (§10.3.1) of the subscription ``request_id``."""

    request_id: int
    datagram: ObjectDatagram


@dataclass(frozen=True, slots=True)
class MalformedTrackDetected(MOQTEvent):
    """Objects of ``request_id`` broke §11 rules: the session stopped the stream and cancelled
    the request (UNSUBSCRIBE / FETCH_CANCEL)."""

    request_id: int
    stream_id: int | None
    reason: str


class TrackSink(Protocol):
    """Receives the data events of one request synchronously, in wire order.

    ``on_payload`` replaces :class:`ObjectData` (no event object per chunk); every other event
    of the request (stream opened, object header and end, End of Range, stream finished or
    reset, datagram, malformed track) goes to ``on_event``.
    """

    def on_event(self, event: MOQTEvent) -> None:
        """A data event of the request."""

    def on_payload(self, stream_id: int, data: memoryview, offset: int) -> None:
        """A piece of the current object's payload on ``stream_id``, at ``offset``."""


@runtime_checkable
class RunSink(TrackSink, Protocol):
    """A :class:`TrackSink` that may take a run of whole FETCH objects in one call."""

    def on_run(self, stream_id: int, run: ObjectRun) -> bool:
        """The whole objects of ``run``, in order, on FETCH stream ``stream_id``; False to
        decline them: the session then delivers them as events (:meth:`ObjectRun.events`)."""
