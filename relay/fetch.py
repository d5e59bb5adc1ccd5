"""Standalone FETCH at the relay: answered from the cache, or passed upstream and cached on the
way (d16 relay rules; DESIGN.md §4 "stored block fetched by standalone FETCH"; asyncio shell).

From the cache: FETCH_OK with the last cached Location of the range and the track's
extensions, then one fetch stream with every object, its properties as cached. Upstream:
the same FETCH to the route's source; FETCH_OK is withheld until the source's arrives (its
End Location is then known), its objects are forwarded as they arrive, compared with cached
copies (a differing copy resets the stream with MALFORMED_TRACK and tombstones the track) and
cached. A track the session finds malformed while parsing (it has stopped the upstream stream
and sent FETCH_CANCEL) is tombstoned the same way and the downstream stream reset with
MALFORMED_TRACK. A REQUEST_ERROR upstream is passed on with its code.
"""

from __future__ import annotations

import contextlib
import logging

from moqt.asyncio import MalformedTrackError, MOQTConnection, RequestRejected, SessionClosedError
from moqt.errors import RequestErrorCode, StreamResetCode
from moqt.messages import StandaloneFetch
from moqt.session_events import (
    DataStreamFinished,
    DataStreamReset,
    MalformedTrackDetected,
    MOQTEvent,
    ObjectData,
    ObjectEnd,
    ObjectHeader,
)
from moqt.session_state import LocalProtocolError

from .cache import FetchPlan
from .ingest import ObjectIngest
from .track import TrackHooks

log = logging.getLogger(__name__)
DEFAULT_PRIORITY = 128


async def serve_cached(connection: MOQTConnection, request_id: int, plan: FetchPlan) -> None:
    """Answer a FETCH from the cache (``plan`` from :meth:`ObjectCache.lookup`)."""
    session = connection.session
    try:
        session.fetch_ok(
            request_id,
            end_location=plan.end_location,
            end_of_track=plan.end_of_track,
            track_extensions=plan.extensions,
        )
        stream = await connection.open_fetch_stream(request_id)
        last = len(plan.objects) - 1
        if last < 0:  # a joining FETCH with no history here: an empty stream
            session.finish_stream(stream)
            connection.transmit()
        for index, obj in enumerate(plan.objects):
            session.begin_fetch_object(
                stream,
                group_id=obj.group_id,
                object_id=obj.object_id,
                payload_length=len(obj.payload),
                subgroup_id=obj.subgroup_id,
                publisher_priority=DEFAULT_PRIORITY
                if obj.publisher_priority is None
                else obj.publisher_priority,
                extensions=obj.extensions,
            )
            await connection.write_payload(stream, obj.payload, end_stream=index == last)
    except LocalProtocolError:
        pass  # FETCH_CANCEL, or the session closed
    except SessionClosedError:
        pass


async def proxy_fetch(
    connection: MOQTConnection,
    request_id: int,
    target: StandaloneFetch,
    source: MOQTConnection,
    hooks: TrackHooks,
) -> bool:
    """Pass a FETCH to ``source`` and relay (and cache) its objects.

    Returns False, having answered nothing, when ``source``'s session closed before it
    answered (a publisher leaving as the request was routed to it): the caller may route the
    FETCH to another source. True once the FETCH was answered.
    """
    key = (target.track_namespace, target.track_name)
    session = connection.session
    try:
        response = await source.fetch(*key, target.start, target.end)
    except RequestRejected as exc:
        _refuse(connection, request_id, exc.error_code, exc.reason)
        return True
    except SessionClosedError:
        return False
    except (LocalProtocolError, ValueError) as exc:
        _refuse(connection, request_id, RequestErrorCode.INTERNAL_ERROR, f"upstream: {exc}")
        return True
    ok = response.ok
    hooks.cache.open_track(key, ok.track_extensions)
    if ok.end_of_track:
        hooks.cache.set_group_end(key, ok.end_location.group, ok.end_location.object)
    relay = _FetchRelay(connection, request_id, ObjectIngest(hooks.cache, key), hooks)
    try:
        session.fetch_ok(
            request_id,
            end_location=ok.end_location,
            end_of_track=ok.end_of_track,
            track_extensions=ok.track_extensions,
        )
        relay.stream = await connection.open_fetch_stream(request_id)
        async for event in response.track.events():
            if not await relay.on_event(event):
                break
    except (LocalProtocolError, SessionClosedError):
        relay.failed = True  # FETCH_CANCEL downstream, or a session closed
    except MalformedTrackError as exc:  # normally seen first as MalformedTrackDetected
        relay.malformed(exc.reason)
    finally:
        relay.close()
        if not relay.completed:  # failed, or cancelled (the subscriber left)
            with contextlib.suppress(LocalProtocolError, SessionClosedError):
                source.fetch_cancel(response.request_id)
    return True


def _refuse(connection: MOQTConnection, request_id: int, code: int, reason: str) -> None:
    with contextlib.suppress(LocalProtocolError):
        connection.session.request_error(request_id, code, reason)
        connection.transmit()


class _FetchRelay:
    """Forwards one upstream fetch stream downstream, through the cache."""

    def __init__(
        self, connection: MOQTConnection, request_id: int, ingest: ObjectIngest, hooks: TrackHooks
    ) -> None:
        self.connection = connection
        self.request_id = request_id
        self.ingest = ingest
        self.hooks = hooks
        self.stream: int | None = None
        self.finished = False  # our stream is closed (FIN or reset)
        self.completed = False  # the upstream stream ended with a FIN
        self.failed = False

    async def on_event(self, event: MOQTEvent) -> bool:
        """Forward one upstream event; False when the fetch must stop."""
        session, stream, now = self.connection.session, self.stream, self.hooks.now_ms()
        if stream is None:
            return False
        if isinstance(event, ObjectHeader):
            if (reason := self.ingest.begin(event.stream_id, event.object, now)) is not None:
                return self._malformed(reason)
            obj = event.object
            session.begin_fetch_object(
                stream,
                group_id=obj.group_id,
                object_id=obj.object_id,
                payload_length=obj.payload_length,
                subgroup_id=obj.subgroup_id,
                publisher_priority=DEFAULT_PRIORITY
                if obj.publisher_priority is None
                else obj.publisher_priority,
                extensions=obj.extensions,
            )
        elif isinstance(event, ObjectData):
            if (reason := self.ingest.data(event.stream_id, event.data, now)) is not None:
                return self._malformed(reason)
            await self.connection.write_payload(stream, event.data)
        elif isinstance(event, ObjectEnd):
            ended = self.ingest.end(event.stream_id, now)
            if ended.malformed is not None:
                return self._malformed(ended.malformed)
            if ended.replica is not None:
                self.hooks.on_replica(ended.replica)
            self.hooks.on_cached()
        elif isinstance(event, DataStreamFinished):
            self.ingest.stream_finished(event.stream_id, False)
            session.finish_stream(stream)
            self.finished = self.completed = True
            self.connection.transmit()
            return False
        elif isinstance(event, DataStreamReset):
            self.ingest.stream_reset(event.stream_id)
            self._reset(event.error_code)
            return False
        elif isinstance(event, MalformedTrackDetected):
            return self.malformed(event.reason)
        return True

    def malformed(self, reason: str) -> bool:
        """The session found the upstream track malformed: tombstone it, reset downstream."""
        self.hooks.cache.mark_malformed(self.ingest.key, self.hooks.now_ms(), reason)
        return self._malformed(reason)

    def _malformed(self, reason: str) -> bool:
        log.warning("fetched track is malformed: %s", reason)
        self._reset(StreamResetCode.MALFORMED_TRACK)
        self.failed = True
        return False

    def _reset(self, code: int) -> None:
        if self.stream is not None and not self.finished:
            # the stream's header goes out first: a reset stream the subscriber never saw the
            # header of names no request, and its FETCH would wait forever (qh3 sends nothing
            # of a stream reset before its first transmit)
            self.connection.transmit()
            self.connection.session.reset_data_stream(self.stream, code)
            self.connection.transmit()
            self.finished = True

    def close(self) -> None:
        """Make sure the downstream stream does not stay open."""
        if not self.finished:
            self._reset(StreamResetCode.CANCELLED)
