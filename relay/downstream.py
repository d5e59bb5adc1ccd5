"""One downstream subscriber of a relayed track: its own queue and writer task (asyncio shell).

The upstream reader posts what happened (an object began, a piece of payload, a stream ended,
the track ended) to every attached :class:`Downstream` without waiting; each downstream writes
at its own pace, waiting for stream credit and for its send buffers to drain, so a slow
subscriber never holds up the others. A subgroup stream is opened towards the subscriber at the
first object it wants from that upstream stream, so a subscriber that attaches mid-stream starts
at the next object. A subscriber that falls more than ``queue_limit`` octets behind is ended
with PUBLISH_DONE TOO_FAR_BEHIND.

Groups reach the subscriber whole and in ascending order (d16 §7: absent other priorities,
groups are sent in the track's group order, ascending by default). The posts are kept per upstream
stream, and the writer always serves the lowest group that has something to write; it starts
writing a higher group only once the lower groups' upstream streams have ended and every stream
of the lower groups it wrote has been sent and acknowledged
(:meth:`~moqt.session.MOQTSession.send_buffered` is zero). Without that, the QUIC
library shares its packets round-robin among all streams holding data, so sixteen 2 MiB groups
written back to back complete at the subscriber nearly together and in any order, and a
subscriber that drops a group once a later one is complete (moq-rs's track consumer) loses
most of them (it also fails a group whose stream overlaps a later one's). A lower group
whose stream stays open holds the higher ones back only while they queue less than half of
``queue_limit`` and the track has not ended, so a stalled group cannot end the subscription.

PUBLISH_DONE goes out once the subscriber's streams have drained (everything written was sent
and acknowledged, or ``DRAIN_TIMEOUT_S`` passed): it travels on the control stream and would
otherwise overtake the tail of the last object, and some subscribers (moq-rs) close the track on
PUBLISH_DONE without waiting for the streams it counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

from moqt.asyncio import MOQTConnection, SessionClosedError
from moqt.errors import MOQTError, PublishDoneCode, StreamResetCode
from moqt.objects import ObjectDatagram, ObjectStart, SubgroupHeader
from moqt.session_state import LocalProtocolError
from moqt.wire import Location

from .routing import DeliveryFilter

log = logging.getLogger(__name__)
DEFAULT_QUEUE_LIMIT = 64 << 20
DRAIN_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class _Begin:
    stream: int
    header: SubgroupHeader
    start: ObjectStart


@dataclass(frozen=True, slots=True)
class _Chunk:
    stream: int
    data: memoryview


@dataclass(frozen=True, slots=True)
class _Finish:
    stream: int


@dataclass(frozen=True, slots=True)
class _Reset:
    stream: int
    code: int


@dataclass(frozen=True, slots=True)
class _Datagram:
    datagram: ObjectDatagram


@dataclass(frozen=True, slots=True)
class _Done:
    code: int
    reason: str


_StreamOp = _Begin | _Chunk | _Finish | _Reset
_Op = _StreamOp | _Datagram | _Done
NO_GROUP = -1  # an upstream stream whose first object has not been seen


class Downstream:
    """A SUBSCRIBE we accepted (``request_id`` on ``connection``) for a relayed track."""

    def __init__(
        self,
        connection: MOQTConnection,
        request_id: int,
        delivery: DeliveryFilter,
        *,
        joined_at: Location | None = None,
        queue_limit: int = DEFAULT_QUEUE_LIMIT,
    ) -> None:
        self.connection = connection
        self.joined_at = joined_at  # the Largest Location in our SUBSCRIBE_OK (joining FETCH)
        self.request_id = request_id
        self.delivery = delivery
        self.queue_limit = queue_limit
        self._ops: dict[int, deque[_StreamOp]] = {}  # upstream stream → posts not yet written
        self._groups: dict[int, int] = {}  # upstream stream → its group
        self._control: deque[_Datagram | _Done] = deque()
        self._wake = asyncio.Event()
        self._written: dict[int, int] = {}  # our stream → group, until sent and acknowledged
        self._queued_bytes = 0
        self._streams: dict[int, int] = {}  # upstream stream → our stream
        self._finished: list[int] = []  # our streams ended with a FIN (drained before DONE)
        self._skipping: set[int] = set()  # upstream streams whose current object is skipped
        self._task: asyncio.Task[None] | None = None
        self.closed = False

    @property
    def session_key(self) -> tuple[int, int]:
        """Identifies this subscription among all sessions."""
        return id(self.connection), self.request_id

    def start(self) -> None:
        """Start the writer task (after SUBSCRIBE_OK was sent)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        """Stop writing at once (the subscriber left, or the relay closes)."""
        self.closed = True
        if self._task is not None:
            self._task.cancel()

    async def wait(self) -> None:
        """Wait for the writer task to finish."""
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # --- posting (never waits) ---------------------------------------------------------------

    def _post(self, op: _Op) -> None:
        if self.closed:
            return
        self._wake.set()
        if isinstance(op, _Datagram | _Done):
            self._control.append(op)
            return
        if isinstance(op, _Chunk):
            self._queued_bytes += len(op.data)
            if self._queued_bytes > self.queue_limit:
                self._control.append(_Done(PublishDoneCode.TOO_FAR_BEHIND, "too far behind"))
                self.closed = True
                return
        if isinstance(op, _Begin) and op.stream not in self._groups:
            self._groups[op.stream] = op.start.group_id
        self._ops.setdefault(op.stream, deque()).append(op)

    def begin(self, stream: int, header: SubgroupHeader, start: ObjectStart) -> None:
        """An object began on the upstream ``stream``."""
        self._post(_Begin(stream, header, start))

    def chunk(self, stream: int, data: memoryview) -> None:
        """A piece of the current object's payload."""
        self._post(_Chunk(stream, data))

    def finish(self, stream: int) -> None:
        """The upstream stream ended with a FIN."""
        self._post(_Finish(stream))

    def reset(self, stream: int, code: int) -> None:
        """The upstream stream was reset (or the relay refuses to forward the rest)."""
        self._post(_Reset(stream, code))

    def datagram(self, datagram: ObjectDatagram) -> None:
        """A datagram object."""
        self._post(_Datagram(datagram))

    def done(self, code: int, reason: str = "") -> None:
        """The track ended: PUBLISH_DONE once the queued objects are written."""
        self._post(_Done(code, reason))
        self.closed = True

    # --- writing -----------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            try:
                op = await self._next()
            except SessionClosedError:
                return
            try:
                if isinstance(op, _Done):
                    await self._drain()
                    self._publish_done(op)
                    return
                await self._apply(op)
            except SessionClosedError:
                return
            except (LocalProtocolError, MOQTError, ValueError) as exc:
                if self.request_id not in self.connection.session.requests:
                    return  # the subscriber left or the session closed
                log.debug("downstream %s: %s", self.request_id, exc)
            finally:
                if isinstance(op, _Chunk):
                    self._queued_bytes -= len(op.data)

    async def _next(self) -> _Op:
        """The next post to write: a datagram at once; else the oldest post of the lowest
        group, once the lower groups written before it are acknowledged; PUBLISH_DONE last."""
        while True:
            control = self._control
            if control and isinstance(control[0], _Datagram):
                return control.popleft()
            stream = self._lowest()
            if stream is not None:
                if self._held(self._groups.get(stream, NO_GROUP)):
                    self.connection.transmit()
                    await self._moved()
                    continue
                ops = self._ops[stream]
                op = ops.popleft()
                if not ops:
                    del self._ops[stream]
                if isinstance(op, _Finish | _Reset):
                    self._groups.pop(stream, None)
                return op
            if control:
                return control.popleft()
            self._wake.clear()
            await self._wake.wait()

    async def _moved(self) -> None:
        """Wait until the connection moves (an ACK) or something is posted (the held-back
        lower group's next data), whichever comes first.

        Raises:
            SessionClosedError: the subscriber's session has ended.
        """
        connection = self.connection
        closed = connection.session.closed
        if closed is not None:
            raise SessionClosedError(closed)
        if connection._tick is None:  # the future MOQTConnection._progress awaits
            connection._tick = asyncio.get_running_loop().create_future()
        tick: asyncio.Future[Any] = connection._tick
        self._wake.clear()
        posted: asyncio.Future[Any] = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait({tick, posted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            posted.cancel()

    def _lowest(self) -> int | None:
        """The upstream stream with posts to write whose group is lowest (first come first)."""
        best: int | None = None
        best_group = 0
        for stream in self._ops:
            group = self._groups.get(stream, NO_GROUP)
            if best is None or group < best_group:
                best, best_group = stream, group
        return best

    def _held(self, group: int) -> bool:
        """Whether ``group`` must wait: a lower group's upstream stream is still open (unless
        the queue is half full or the track ended), or holds data we wrote that is unsent or
        not yet acknowledged (streams found empty and ended are forgotten)."""
        if group == NO_GROUP:
            return False
        ending = bool(self._control) and isinstance(self._control[-1], _Done)
        patient = not ending and self._queued_bytes <= self.queue_limit // 2
        if patient and any(NO_GROUP < other < group for other in self._groups.values()):
            return True
        busy = False
        for ours, written in list(self._written.items()):
            if written >= group:
                continue
            if self._buffered(ours):
                busy = True
            elif ours not in self._streams.values():
                del self._written[ours]  # ended and drained
        return busy

    async def _apply(self, op: _Op) -> None:
        session = self.connection.session
        if isinstance(op, _Begin):
            await self._begin(op)
        elif isinstance(op, _Chunk):
            ours = self._streams.get(op.stream)
            if ours is not None and op.stream not in self._skipping:
                await self.connection.write_payload(ours, op.data)
        elif isinstance(op, _Finish | _Reset):
            self._skipping.discard(op.stream)
            ours = self._streams.pop(op.stream, None)
            if ours is not None and isinstance(op, _Reset):
                session.reset_data_stream(ours, op.code)
            elif ours is not None:
                session.finish_stream(ours)
                self._finished.append(ours)
            self.connection.transmit()
        elif isinstance(op, _Datagram):
            self._send_datagram(op.datagram)

    async def _begin(self, op: _Begin) -> None:
        start = op.start
        if not self.delivery.wants(start.group_id, start.object_id):
            self._skipping.add(op.stream)  # not for this subscriber: skip its payload
            return
        self._skipping.discard(op.stream)
        ours = self._streams.get(op.stream)
        if ours is None:
            header = op.header
            ours = await self.connection.open_subgroup(
                self.request_id,
                start.group_id,
                subgroup_id=start.subgroup_id or 0,
                publisher_priority=header.publisher_priority,
                extensions=header.has_extensions or bool(start.extensions),
                end_of_group=header.end_of_group,
            )
            self._streams[op.stream] = ours
            self._written[ours] = start.group_id
        self.connection.session.begin_object(
            ours,
            start.object_id,
            start.payload_length,
            extensions=start.extensions,
            status=start.status,
        )
        self.connection.transmit()

    def _send_datagram(self, datagram: ObjectDatagram) -> None:
        if not self.delivery.wants(datagram.group_id, datagram.object_id):
            return
        self.connection.session.send_datagram(
            self.request_id,
            datagram.group_id,
            datagram.object_id,
            datagram.payload,
            publisher_priority=datagram.publisher_priority,
            extensions=datagram.extensions,
            end_of_group=datagram.end_of_group,
        )
        self.connection.transmit()

    async def _drain(self) -> None:
        """Wait (bounded) until our finished streams hold nothing unsent or unacknowledged."""
        deadline = asyncio.get_running_loop().time() + DRAIN_TIMEOUT_S
        while asyncio.get_running_loop().time() < deadline:
            self._finished = [s for s in self._finished if self._buffered(s)]
            if not self._finished:
                return
            self.connection.transmit()
            await asyncio.sleep(0.002)

    def _buffered(self, stream_id: int) -> bool:
        try:
            return self.connection.session.send_buffered(stream_id) > 0
        except Exception:  # noqa: BLE001 - a stream the QUIC library already dropped
            return False

    def _publish_done(self, op: _Done) -> None:
        session = self.connection.session
        for ours in self._streams.values():  # normally none: upstream streams ended first
            session.reset_data_stream(ours, StreamResetCode.CANCELLED)
        self._streams.clear()
        session.publish_done(self.request_id, op.code, reason=op.reason)
        self.connection.transmit()
