"""Standalone FETCH at the relay: answered from the cache, or passed upstream and cached on the
way (d16 relay rules; DESIGN.md §4 "stored block fetched by standalone FETCH"; asyncio shell).

From the cache: FETCH_OK with the last cached Location of the range and the track's
extensions, then one fetch stream with every object, its properties as cached, written as a
publisher writes a block (:meth:`~moqt.transport.ObjectSender.send_objects`: runs of whole
objects, headers encoded together, the cached pieces passed on uncopied). Upstream:
the same FETCH to the route's source; FETCH_OK is withheld until the source's arrives (its
End Location is then known), its objects are forwarded as they arrive, compared with cached
copies (a differing copy resets the stream with MALFORMED_TRACK and tombstones the track) and
cached. A track the session finds malformed while parsing (it has stopped the upstream stream
and sent FETCH_CANCEL) is tombstoned the same way and the downstream stream reset with
MALFORMED_TRACK. A REQUEST_ERROR upstream is passed on with its code.

The upstream objects are handled where they arrive: the upstream reader's payload and
object-end sinks (:meth:`~moqt.asyncio.TrackReader.set_payload_sink`) write each piece to the
downstream stream at once, as the slice of received data it is (no copy, no event object, no
task switch), with one transmit per batch of received data; the objects completed in that
batch are cached (their layer digests computed, two objects at a time) just after that
transmit, so the subscriber works on the bytes meanwhile, and before the stream's FIN is
forwarded. Only the stream's end goes through the reader's iterator. While the downstream
stream holds more than :data:`~moqt.transport.SEND_HIGH_WATER` octets, pieces wait in order in
a backlog that a task writes as the stream drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque

from moqt.asyncio import MalformedTrackError, MOQTConnection, RequestRejected, SessionClosedError
from moqt.errors import RequestErrorCode, StreamResetCode
from moqt.messages import StandaloneFetch
from moqt.objects import ObjectStart
from moqt.session_data import StreamObject
from moqt.session_events import (
    DataStreamFinished,
    DataStreamReset,
    MalformedTrackDetected,
    MOQTEvent,
    ObjectHeader,
)
from moqt.session_state import LocalProtocolError
from moqt.transport import SEND_HIGH_WATER
from moqt.wire import Bytes

from .cache import FetchPlan
from .ingest import CompleteObject, ObjectIngest
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
        objects = [  # a joining FETCH with no history here has none: an empty stream
            StreamObject(
                object_id=obj.object_id,
                payload=obj.sendable(),
                extensions=obj.extensions,
                group_id=obj.group_id,
                subgroup_id=obj.subgroup_id,
                publisher_priority=DEFAULT_PRIORITY
                if obj.publisher_priority is None
                else obj.publisher_priority,
            )
            for obj in plan.objects
        ]
        await connection.send_objects(stream, objects, end_stream=True)
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
    relay = _FetchRelay(connection, ObjectIngest(hooks.cache, key), hooks)
    relay.upstream = (source, response.request_id)
    try:
        session.fetch_ok(
            request_id,
            end_location=ok.end_location,
            end_of_track=ok.end_of_track,
            track_extensions=ok.track_extensions,
        )
        relay.stream = await connection.open_fetch_stream(request_id)
        # what arrived meanwhile goes to the sinks now, in order; the rest as it arrives
        response.track.set_payload_sink(relay.piece, object_end=relay.object_end)
        async for event in response.track.events():
            if not relay.on_event(event):
                break
        await relay.drained()
    except (LocalProtocolError, SessionClosedError):
        relay.failed = True  # FETCH_CANCEL downstream, or a session closed
    except MalformedTrackError as exc:  # normally seen first as MalformedTrackDetected
        relay.malformed(exc.reason)
    finally:
        relay.close()
    return True


def _refuse(connection: MOQTConnection, request_id: int, code: int, reason: str) -> None:
    with contextlib.suppress(LocalProtocolError):
        connection.session.request_error(request_id, code, reason)
        connection.transmit()


_FIN = None  # the backlog's entry for the end of the stream


class _FetchRelay:
    """Forwards one upstream fetch stream downstream, through the cache.

    :meth:`piece` and :meth:`object_end` are the upstream reader's sinks (called where the
    upstream data is received); :meth:`on_event` takes the reader's stream events. Writes go
    out in order: straight to the session while the stream holds at most
    :data:`SEND_HIGH_WATER` octets and nothing waits, else through the backlog.
    """

    def __init__(self, connection: MOQTConnection, ingest: ObjectIngest, hooks: TrackHooks) -> None:
        self.connection = connection
        self.ingest = ingest
        self.hooks = hooks
        self.stream: int | None = None
        self.upstream: tuple[MOQTConnection, int] | None = None  # (source, its request id)
        self.finished = False  # our stream is closed (FIN or reset)
        self.completed = False  # the upstream stream ended with a FIN
        self.failed = False
        self._begun: dict[int, ObjectHeader] = {}  # upstream stream → the object forwarded
        self._backlog: deque[ObjectStart | Bytes | None] = deque()
        self._writer: asyncio.Task[None] | None = None
        self._transmit_pending = False
        self._completed: list[CompleteObject] = []  # to store after the transmit

    # --- the upstream reader's sinks (in the upstream connection's event handler) -------------

    def piece(self, header: ObjectHeader, data: memoryview, offset: int) -> None:
        """A payload piece of the object ``header`` describes: cache it, forward it."""
        if self.failed:
            return
        if self._begun.get(header.stream_id) is not header and not self._begin(header):
            return
        if (reason := self.ingest.data(header.stream_id, data, self.hooks.now_ms())) is not None:
            self._malformed(reason)
            return
        self._send(data)

    def object_end(self, header: ObjectHeader) -> None:
        """The object ``header`` describes is complete: cache it once this batch of received
        data has been transmitted (:meth:`store_completed`)."""
        if self.failed:
            return
        if self._begun.get(header.stream_id) is not header and not self._begin(header):
            return  # a zero-length object: its header was not forwarded yet
        complete = self.ingest.complete(header.stream_id)
        if complete is None:
            return
        self._completed.append(complete)
        if len(self._completed) == 1:  # after the transmit _send asked for
            asyncio.get_running_loop().call_soon(self.store_completed)

    def store_completed(self) -> bool:
        """Cache the completed objects, in order: their layer digests are computed here, two
        at a time (:meth:`~relay.ingest.ObjectIngest.store_each`; one left over is hashed alone,
        never held for the next batch), after their bytes went on downstream, so that the
        subscriber works on them meanwhile. Runs before the stream's FIN is forwarded (a layer
        that fails its digest resets the stream instead), and at a reset or the fetch's end for
        what arrived whole. False when the fetch has failed."""
        completed, self._completed = self._completed, []
        if not completed:
            return not self.failed
        for ended in self.ingest.store_each(completed, self.hooks.now_ms()):
            if ended.malformed is not None:
                self._malformed(ended.malformed)
                return False  # the rest would be refused: the track is tombstoned
            if ended.replica is not None:
                self.hooks.on_replica(ended.replica)
            self.hooks.on_cached()
        return not self.failed

    def _begin(self, header: ObjectHeader) -> bool:
        self._begun[header.stream_id] = header
        reason = self.ingest.begin(header.stream_id, header.object, self.hooks.now_ms())
        if reason is not None:
            self._malformed(reason)
            return False
        self._send(header.object)
        return True

    # --- the reader's stream events ---------------------------------------------------------

    def on_event(self, event: MOQTEvent) -> bool:
        """One upstream stream event; False when the fetch must stop."""
        if self.failed:
            return False
        if isinstance(event, DataStreamFinished):
            if not self.store_completed():
                return False  # a layer failed its digest: the stream was reset
            self.ingest.stream_finished(event.stream_id, False)
            self.completed = True
            self._send(_FIN)
            return False
        if isinstance(event, DataStreamReset):
            self.ingest.stream_reset(event.stream_id)
            self._reset(event.error_code)
            return False
        if isinstance(event, MalformedTrackDetected):
            return self.malformed(event.reason)
        return True

    # --- writing downstream -----------------------------------------------------------------

    def _send(self, item: ObjectStart | Bytes | None) -> None:
        """Write ``item`` (an object's fields, a payload piece, or the FIN) now, or queue it."""
        stream = self.stream
        if self.finished or stream is None:
            return
        session = self.connection.session
        if self._writer is not None or session.send_buffered(stream) > SEND_HIGH_WATER:
            self._backlog.append(item)
            if self._writer is None:
                self._writer = asyncio.get_running_loop().create_task(self._write_backlog())
            return
        try:
            self._write_now(stream, item)
        except LocalProtocolError:  # FETCH_CANCEL downstream, or its session closed
            self._fail()
            return
        self._transmit_soon()

    def _write_now(self, stream: int, item: ObjectStart | Bytes | None) -> None:
        session = self.connection.session
        if item is _FIN:
            session.finish_stream(stream)
            self.finished = True
        elif isinstance(item, ObjectStart):
            session.begin_fetch_object(
                stream,
                group_id=item.group_id,
                object_id=item.object_id,
                payload_length=item.payload_length,
                subgroup_id=item.subgroup_id,
                publisher_priority=DEFAULT_PRIORITY
                if item.publisher_priority is None
                else item.publisher_priority,
                extensions=item.extensions,
            )
        else:
            session.write_payload(stream, item)

    async def _write_backlog(self) -> None:
        """Write the backlog in order, waiting while the stream holds a lot."""
        backlog, stream = self._backlog, self.stream
        try:
            while backlog and stream is not None and not self.finished:
                item = backlog.popleft()
                if item is _FIN or isinstance(item, ObjectStart):
                    self._write_now(stream, item)
                else:
                    await self.connection.write_payload(stream, item)
            self.connection.transmit()
        except (LocalProtocolError, SessionClosedError):
            self._fail()
        finally:
            self._writer = None

    async def drained(self) -> None:
        """Wait until the backlog is written."""
        while (writer := self._writer) is not None:
            await asyncio.wait((writer,))  # not raising when a reset cancelled it

    def _transmit_soon(self) -> None:
        """One transmit for what this batch of received data wrote."""
        if not self._transmit_pending:
            self._transmit_pending = True
            asyncio.get_running_loop().call_soon(self._transmit)

    def _transmit(self) -> None:
        if self._transmit_pending:
            self._transmit_pending = False
            with contextlib.suppress(LocalProtocolError):
                self.connection.transmit()

    # --- ending -----------------------------------------------------------------------------

    def malformed(self, reason: str) -> bool:
        """The session found the upstream track malformed: tombstone it, reset downstream."""
        self.hooks.cache.mark_malformed(self.ingest.key, self.hooks.now_ms(), reason)
        return self._malformed(reason)

    def _malformed(self, reason: str) -> bool:
        log.warning("fetched track is malformed: %s", reason)
        self._reset(StreamResetCode.MALFORMED_TRACK)
        self._fail()
        return False

    def _fail(self) -> None:
        """Stop forwarding; the upstream fetch is cancelled soon after (which ends its reader,
        so :func:`proxy_fetch` returns)."""
        if not self.failed:
            self.failed = True
            asyncio.get_running_loop().call_soon(self._cancel_upstream)

    def _cancel_upstream(self) -> None:
        upstream, self.upstream = self.upstream, None
        if upstream is not None:
            with contextlib.suppress(LocalProtocolError, SessionClosedError):
                upstream[0].fetch_cancel(upstream[1])

    def _reset(self, code: int) -> None:
        self._backlog.clear()
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.cancel()
        if self.stream is not None and not self.finished:
            # the stream's header goes out first: a reset stream the subscriber never saw the
            # header of names no request, and its FETCH would wait forever (qh3 sends nothing
            # of a stream reset before its first transmit)
            self.finished = True
            with contextlib.suppress(LocalProtocolError):
                self.connection.transmit()
                self.connection.session.reset_data_stream(self.stream, code)
                self.connection.transmit()

    def close(self) -> None:
        """Cache what arrived whole; make sure the downstream stream does not stay open and,
        unless the upstream stream ended with its FIN, that the upstream fetch is cancelled."""
        self.store_completed()
        if not self.finished:
            self._reset(StreamResetCode.CANCELLED)
        if not self.completed:  # failed, or cancelled (the subscriber left)
            self._cancel_upstream()
