"""One relayed track: a single upstream subscription (or PUBLISH) fanned out to many
downstream subscribers, its objects cached on the way (d16 relay rules; asyncio shell).

The first SUBSCRIBE for a track makes the relay SUBSCRIBE upstream (to the publisher that
announced the namespace, or to the upstream relay); later SUBSCRIBEs for the same track attach
to that subscription. Downstream SUBSCRIBE_OK is sent only once the upstream subscription is
established (d16: a relay needs an Established upstream subscription first). A PUBLISH from a
publisher is a track that is established from the start. When the last subscriber leaves, an
upstream SUBSCRIBE is ended with UNSUBSCRIBE; a PUBLISH keeps flowing into the cache.

Every data event of the upstream request reaches :meth:`RelayedTrack.pump` through the
request's :class:`~moqt.asyncio.TrackReader`, datagrams included: an OBJECT_DATAGRAM is cached
and forwarded to each subscriber as a datagram (d16: a relay keeps an object's forwarding
preference; KV tracks use one subgroup stream, DESIGN §4, so only plain tracks carry them).

A track is malformed (d16 §2.4.2) when a cached object arrives again with a different payload
(found here, before the differing bytes are forwarded), or when the session finds it so while
parsing (an object breaking the extension rules; the session has then stopped the upstream
stream with MALFORMED_TRACK and cancelled the request). Either way the downstream streams are
reset and the subscriptions ended with MALFORMED_TRACK, the upstream request is cancelled, and
the cache tombstones the track. The sessions stay up: a malformed track is not a protocol
violation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from moqt.asyncio import (
    MalformedTrackError,
    MOQTConnection,
    RequestRejected,
    SessionClosedError,
    TrackReader,
)
from moqt.errors import PublishDoneCode, RequestErrorCode, StreamResetCode
from moqt.messages import MessageParameters, PublishOk, Subscribe
from moqt.objects import ObjectDatagram, SubgroupHeader
from moqt.session_events import (
    DatagramReceived,
    DataStreamFinished,
    DataStreamReset,
    MalformedTrackDetected,
    MOQTEvent,
    ObjectData,
    ObjectEnd,
    ObjectHeader,
    PublishDoneReceived,
    SubgroupStreamOpened,
)
from moqt.session_state import LocalProtocolError
from moqt.wire import KeyValuePair, Location

from .cache import ObjectCache, TrackKey
from .downstream import DEFAULT_QUEUE_LIMIT, Downstream
from .ingest import Ended, ObjectIngest
from .kv import KVReplica
from .routing import DeliveryFilter

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TrackHooks:
    """What a relayed track needs from the relay."""

    cache: ObjectCache
    now_ms: Callable[[], int]
    on_replica: Callable[[KVReplica], None]
    on_cached: Callable[[], None]
    on_ended: Callable[[RelayedTrack], None]
    queue_limit: int = DEFAULT_QUEUE_LIMIT


class TrackState(Enum):
    """Where the upstream side of a relayed track is."""

    PENDING = "pending"
    ESTABLISHED = "established"
    ENDED = "ended"


class RelayedTrack:
    """One track flowing through the relay (see the module docstring)."""

    def __init__(self, key: TrackKey, hooks: TrackHooks, *, published: bool = False) -> None:
        self.key = key
        self.hooks = hooks
        self.published = published  # a PUBLISH from the source, not our SUBSCRIBE
        self.state = TrackState.PENDING
        self.source: MOQTConnection | None = None
        self.request_id: int | None = None
        self.extensions: tuple[KeyValuePair, ...] = ()
        self.downstreams: dict[tuple[int, int], Downstream] = {}
        self._waiting: list[tuple[MOQTConnection, Subscribe]] = []
        self._headers: dict[int, SubgroupHeader] = {}
        self._ingest = ObjectIngest(hooks.cache, key)
        self._pump: asyncio.Task[None] | None = None
        self._done: tuple[int, str] | None = None

    # --- downstream subscribers ---------------------------------------------------------------

    def attach(self, connection: MOQTConnection, message: Subscribe) -> None:
        """A downstream SUBSCRIBE for this track: accept it now, or once upstream is ready."""
        if self.state == TrackState.ESTABLISHED:
            self._accept(connection, message)
        else:
            self._waiting.append((connection, message))

    def _accept(self, connection: MOQTConnection, message: Subscribe) -> None:
        params, largest = message.parameters, self._largest()
        delivery = DeliveryFilter.of(params.subscription_filter, largest, params.forward)
        try:
            connection.session.subscribe_ok(
                message.request_id,
                parameters=MessageParameters(largest_object=largest),
                track_extensions=self.extensions,
            )
        except LocalProtocolError:
            return  # the subscriber left meanwhile
        connection.transmit()
        self._deliver(connection, message.request_id, delivery, largest)

    def _largest(self) -> Location | None:
        entry = self.hooks.cache.track(self.key)
        return None if entry is None else entry.largest

    def _deliver(
        self,
        connection: MOQTConnection,
        request_id: int,
        delivery: DeliveryFilter,
        joined_at: Location | None = None,
    ) -> None:
        downstream = Downstream(
            connection,
            request_id,
            delivery,
            joined_at=joined_at,
            queue_limit=self.hooks.queue_limit,
        )
        self.downstreams[downstream.session_key] = downstream
        downstream.start()

    def accepted(self, connection: MOQTConnection, request_id: int, ok: PublishOk) -> bool:
        """A PUBLISH we sent for this track (to a SUBSCRIBE_NAMESPACE session) was accepted
        with PUBLISH_OK: deliver objects on it. False when the track has ended."""
        if self.state != TrackState.ESTABLISHED:
            return False
        params = ok.parameters
        delivery = DeliveryFilter.of(params.subscription_filter, self._largest(), params.forward)
        self._deliver(connection, request_id, delivery)
        return True

    def detach(self, connection: MOQTConnection, request_id: int) -> bool:
        """The subscriber left (UNSUBSCRIBE, or its session ended); True when it was ours."""
        self._waiting = [
            (c, m) for c, m in self._waiting if not (c is connection and m.request_id == request_id)
        ]
        downstream = self.downstreams.pop((id(connection), request_id), None)
        if downstream is None:
            return False
        downstream.stop()
        if not self.downstreams and not self.published:
            self._cancel_upstream()
        return True

    def _refuse_waiting(self, code: int, reason: str) -> None:
        waiting, self._waiting = self._waiting, []
        for connection, message in waiting:
            with contextlib.suppress(LocalProtocolError):
                connection.session.request_error(message.request_id, code, reason)
                connection.transmit()

    # --- upstream --------------------------------------------------------------------------------

    async def subscribe(self, source: MOQTConnection, first: Subscribe) -> bool:
        """SUBSCRIBE upstream on ``source`` for the waiting subscribers, then relay objects.

        Returns False, with the track still pending, when ``source``'s session closed before
        it answered (a publisher leaving as the request was routed to it): the caller may
        route the track to another source. True once the track was served or failed.
        """
        self.source = source
        namespace, name = self.key
        params = MessageParameters(
            forward=1, subscription_filter=first.parameters.subscription_filter
        )
        try:
            subscription = await source.subscribe(namespace, name, parameters=params)
        except RequestRejected as exc:
            self.fail(exc.error_code, exc.reason)
            return True
        except SessionClosedError:
            self.source = None
            return False
        except (LocalProtocolError, ValueError) as exc:
            self.fail(RequestErrorCode.INTERNAL_ERROR, f"upstream unavailable: {exc}")
            return True
        self.request_id = subscription.request_id
        self._established(subscription.ok.track_extensions)
        await self.pump(subscription.track)
        return True

    def adopt(
        self, source: MOQTConnection, request_id: int, extensions: tuple[KeyValuePair, ...]
    ) -> None:
        """Take over a PUBLISH we accepted; call :meth:`pump` with its reader next."""
        self.source, self.request_id = source, request_id
        self._established(extensions)

    def _established(self, extensions: tuple[KeyValuePair, ...]) -> None:
        self.state = TrackState.ESTABLISHED
        self.extensions = extensions
        self.hooks.cache.open_track(self.key, extensions)
        waiting, self._waiting = self._waiting, []
        for connection, message in waiting:
            self._accept(connection, message)
        if not self.downstreams and not self.published:
            self._cancel_upstream()

    def fail(self, code: int, reason: str) -> None:
        """The upstream request failed: refuse the waiting subscribers with ``code``."""
        self.state = TrackState.ENDED
        self._refuse_waiting(code, reason)
        self.hooks.on_ended(self)

    def _cancel_upstream(self) -> None:
        source, request_id = self.source, self.request_id
        if source is None or request_id is None or self.state != TrackState.ESTABLISHED:
            return
        with contextlib.suppress(LocalProtocolError):
            source.unsubscribe(request_id)

    async def pump(self, reader: TrackReader) -> None:
        """Read the upstream objects: cache them and post them to every subscriber."""
        self._pump = asyncio.current_task()
        code: int = PublishDoneCode.TRACK_ENDED
        reason = ""
        try:
            async for event in reader.events():
                if not self._on_event(event):
                    return
            if self._done is not None:
                code, reason = self._done
        except SessionClosedError:
            code, reason = PublishDoneCode.GOING_AWAY, "the publisher's session ended"
        except MalformedTrackError as exc:  # normally seen first as MalformedTrackDetected
            self.malformed(exc.reason, stream=exc.stream_id, cancelled=True)
            return
        except asyncio.CancelledError:
            if self.state == TrackState.ENDED:
                return  # ended on purpose (malformed, or the relay closes)
            raise
        self._end(code, reason)

    def _on_event(self, event: MOQTEvent) -> bool:
        """Handle one upstream data event; False once the track is malformed."""
        now = self.hooks.now_ms()
        if isinstance(event, SubgroupStreamOpened):
            self._headers[event.stream_id] = event.header
        elif isinstance(event, ObjectHeader):
            return self._on_object(event, now)
        elif isinstance(event, ObjectData):
            reason = self._ingest.data(event.stream_id, event.data, now)
            if reason is not None:
                return self.malformed(reason, stream=event.stream_id)
            for downstream in self.downstreams.values():
                downstream.chunk(event.stream_id, event.data)
        elif isinstance(event, ObjectEnd):
            return self._ended(self._ingest.end(event.stream_id, now), event.stream_id)
        elif isinstance(event, DataStreamFinished | DataStreamReset):
            self._on_stream_end(event)
        elif isinstance(event, PublishDoneReceived):
            self._done = (int(event.message.status_code), event.message.reason)
        elif isinstance(event, DatagramReceived):
            return self.datagram(event.datagram)
        elif isinstance(event, MalformedTrackDetected):
            # the session stopped the stream (MALFORMED_TRACK) and cancelled the request
            return self.malformed(event.reason, stream=event.stream_id, cancelled=True)
        return True

    def _on_object(self, event: ObjectHeader, now: int) -> bool:
        reason = self._ingest.begin(event.stream_id, event.object, now)
        if reason is not None:
            return self.malformed(reason, stream=event.stream_id)
        header = self._headers.get(event.stream_id)
        if header is not None:
            for downstream in self.downstreams.values():
                downstream.begin(event.stream_id, header, event.object)
        return True

    def _on_stream_end(self, event: DataStreamFinished | DataStreamReset) -> None:
        header = self._headers.pop(event.stream_id, None)
        if isinstance(event, DataStreamFinished):
            self._ingest.stream_finished(
                event.stream_id, header is not None and header.end_of_group
            )
            for downstream in self.downstreams.values():
                downstream.finish(event.stream_id)
        else:
            self._ingest.stream_reset(event.stream_id)
            for downstream in self.downstreams.values():
                downstream.reset(event.stream_id, event.error_code)

    def _ended(self, ended: Ended, stream: int | None) -> bool:
        if ended.malformed is not None:
            return self.malformed(ended.malformed, stream=stream)
        if ended.replica is not None:
            self.hooks.on_replica(ended.replica)
        self.hooks.on_cached()
        return True

    def datagram(self, datagram: ObjectDatagram) -> bool:
        """An upstream datagram of this track: cached, then forwarded as a datagram.
        False once the track is malformed (a differing copy of a cached object)."""
        if self.state != TrackState.ESTABLISHED:
            return True
        if not self._ended(self._ingest.datagram(datagram, self.hooks.now_ms()), None):
            return False
        for downstream in self.downstreams.values():
            downstream.datagram(datagram)
        return True

    def malformed(self, reason: str, *, stream: int | None = None, cancelled: bool = False) -> bool:
        """End the track as malformed (d16): reset what was being forwarded, PUBLISH_DONE
        MALFORMED_TRACK downstream, cancel upstream. Returns False (stop reading)."""
        log.warning("track %r is malformed: %s", self.key, reason)
        self.hooks.cache.mark_malformed(self.key, self.hooks.now_ms(), reason)
        for downstream in self.downstreams.values():
            if stream is not None:
                downstream.reset(stream, StreamResetCode.MALFORMED_TRACK)
        if not cancelled:
            self._cancel_upstream()
        self._end(PublishDoneCode.MALFORMED_TRACK, reason)
        pump = self._pump
        if pump is not None and pump is not asyncio.current_task():
            pump.cancel()
        return False

    def _end(self, code: int, reason: str) -> None:
        if self.state == TrackState.ENDED:
            return
        self.state = TrackState.ENDED
        self._refuse_waiting(RequestErrorCode.INTERNAL_ERROR, reason or "the track ended")
        for downstream in self.downstreams.values():
            downstream.done(code, reason)
        self.hooks.on_ended(self)

    def close(self) -> None:
        """The relay is closing: stop everything without further messages."""
        self.state = TrackState.ENDED
        for downstream in self.downstreams.values():
            downstream.stop()
        if self._pump is not None:
            self._pump.cancel()
