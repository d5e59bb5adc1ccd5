"""moqt.asyncio: events reach the reader of their request; the awaitable request calls.

Real UDP on 127.0.0.1 (aioquic), one small publisher per test; plus in-process checks of
:class:`~moqt.transport.TrackReader` fed by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from moqt.asyncio import (
    MalformedTrackError,
    MOQTConnection,
    RequestRejected,
    TrackReader,
    connect,
    serve,
)
from moqt.backend import get_backend
from moqt.certs import make_self_signed
from moqt.errors import ObjectStatus, PublishDoneCode, RequestErrorCode
from moqt.messages import JoiningFetch, SubscribeOptions
from moqt.messages_params import ExtensionType
from moqt.objects import ObjectRun, ObjectStart
from moqt.session_events import (
    DatagramReceived,
    DataStreamFinished,
    EndOfRangeReceived,
    FetchReceived,
    FetchStreamOpened,
    MalformedTrackDetected,
    MOQTEvent,
    NamespaceReceived,
    ObjectData,
    ObjectEnd,
    ObjectHeader,
    PublishReceived,
    SubscribeNamespaceReceived,
    SubscribeReceived,
    UnsubscribeReceived,
)
from moqt.wire import Location, encode_kvps

NS = (b"kvsp", b"1", b"c0", b"s0", b"k0")


@pytest.fixture(scope="module")
def cert_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_self_signed("localhost", tmp_path_factory.mktemp("certs"))


@dataclass
class Seen:
    """What the publisher saw, for the client side to check."""

    unsubscribed: set[int] = field(default_factory=set)
    published: asyncio.Queue[tuple[bytes, bytes]] = field(default_factory=asyncio.Queue)
    joined: list[bytes] = field(default_factory=list)
    options: list[SubscribeOptions] = field(default_factory=list)


class Publisher:
    """Answers by track name: datagram tracks, a malformed one, fetch ranges, PUBLISH, ..."""

    def __init__(self, seen: Seen) -> None:
        self.seen = seen
        self.tasks: set[asyncio.Task[None]] = set()

    def spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def __call__(self, connection: MOQTConnection) -> None:
        async for event in connection.requests():
            if isinstance(event, SubscribeReceived):
                self.on_subscribe(connection, event)
            elif isinstance(event, FetchReceived):
                self.on_fetch(connection, event)
            elif isinstance(event, PublishReceived):
                self.on_publish(connection, event)
            elif isinstance(event, SubscribeNamespaceReceived):
                self.on_subscribe_namespace(connection, event)
            elif isinstance(event, UnsubscribeReceived):
                self.seen.unsubscribed.add(event.request_id)
            connection.transmit()

    def on_subscribe(self, connection: MOQTConnection, event: SubscribeReceived) -> None:
        name = event.message.track_name
        connection.session.subscribe_ok(event.request_id)
        if name.startswith(b"dgram"):
            self.spawn(self.datagrams(connection, event.request_id, name))
        elif name == b"bad":
            self.spawn(self.malformed(connection, event.request_id))

    async def datagrams(self, connection: MOQTConnection, request_id: int, name: bytes) -> None:
        group = 0
        while request_id in connection.session.requests:
            connection.session.send_datagram(request_id, group, 0, name + b":%d" % group)
            connection.transmit()
            group += 1
            await asyncio.sleep(0.002)

    async def malformed(self, connection: MOQTConnection, request_id: int) -> None:
        stream_id = await connection.open_subgroup(request_id, 0)
        immutable = (ExtensionType.IMMUTABLE_EXTENSIONS, encode_kvps([(0x4B57, b"x" * 32)]))
        await connection.send_object(stream_id, 0, b"abc", extensions=[immutable, immutable])

    def on_fetch(self, connection: MOQTConnection, event: FetchReceived) -> None:
        if isinstance(event.message.target, JoiningFetch) and event.joined is not None:
            self.seen.joined.append(event.joined.track_name)
        connection.session.fetch_ok(event.request_id, end_location=Location(0, 2))
        self.spawn(self.fetch_stream(connection, event.request_id))

    async def fetch_stream(self, connection: MOQTConnection, request_id: int) -> None:
        stream_id = await connection.open_fetch_stream(request_id)
        connection.session.send_end_of_range(stream_id, 0, 1)
        await connection.send_fetch_object(
            stream_id, group_id=0, object_id=2, payload=[b"K" * 3, b"V" * 3], end_stream=True
        )

    def on_publish(self, connection: MOQTConnection, event: PublishReceived) -> None:
        if event.message.track_name == b"refuse":
            connection.session.request_error(event.request_id, RequestErrorCode.UNAUTHORIZED)
            return
        connection.session.publish_ok(event.request_id)
        self.spawn(self.read_published(connection.track(event.request_id)))

    async def read_published(self, reader: TrackReader) -> None:
        async for obj in reader.objects():
            await self.seen.published.put((b"%d" % obj.object_id, bytes(obj.payload)))

    def on_subscribe_namespace(
        self, connection: MOQTConnection, event: SubscribeNamespaceReceived
    ) -> None:
        message = event.message
        self.seen.options.append(message.subscribe_options)
        connection.session.request_ok(event.request_id)
        connection.session.namespace(event.request_id, (b"x",))
        if message.subscribe_options != SubscribeOptions.NAMESPACE:
            connection.session.publish((*message.track_namespace_prefix, b"x"), b"offered")


def run_pair(
    certs: tuple[Path, Path], client: Callable[[MOQTConnection, Seen], Awaitable[None]]
) -> None:
    async def main() -> None:
        quic = get_backend("aioquic")
        cert, key = certs
        seen = Seen()
        publisher = Publisher(seen)
        server_config = quic.configuration(
            is_client=False, certificate=str(cert), private_key=str(key)
        )
        server = await serve("127.0.0.1", 0, configuration=server_config, handler=publisher)
        try:
            client_config = quic.configuration(
                is_client=True, cafile=str(cert), server_name="localhost"
            )
            host, port = server.address
            async with connect(host, port, configuration=client_config) as connection:
                await asyncio.wait_for(client(connection, seen), 20)
        finally:
            server.close()
            for task in list(publisher.tasks):
                task.cancel()

    asyncio.run(main())


async def no_request(connection: MOQTConnection) -> bool:
    """True when the request queue stays empty for a moment."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(connection.next_request(), 0.1)
        return False
    return True


# --- routing --------------------------------------------------------------------------------------


def test_datagrams_reach_the_reader_of_their_subscription(cert_pair: tuple[Path, Path]) -> None:
    async def client(connection: MOQTConnection, seen: Seen) -> None:
        a = await connection.subscribe(NS, b"dgram-a")
        b = await connection.subscribe(NS, b"dgram-b")

        async def three(reader: TrackReader) -> list[bytes]:
            got: list[bytes] = []
            async for event in reader.events():
                assert isinstance(event, DatagramReceived)
                assert event.request_id == reader.request_id
                got.append(bytes(event.datagram.payload))
                if len(got) == 3:
                    break
            return got

        got_a, got_b = await asyncio.gather(three(a.track), three(b.track))
        assert all(payload.startswith(b"dgram-a:") for payload in got_a)
        assert all(payload.startswith(b"dgram-b:") for payload in got_b)
        assert await no_request(connection)
        connection.unsubscribe(a.request_id)
        connection.unsubscribe(b.request_id)

    run_pair(cert_pair, client)


def test_a_malformed_track_ends_its_reader(cert_pair: tuple[Path, Path]) -> None:
    async def client(connection: MOQTConnection, seen: Seen) -> None:
        subscription = await connection.subscribe(NS, b"bad")
        events: list[MOQTEvent] = []
        with pytest.raises(MalformedTrackError) as info:
            async for event in subscription.track.events():
                events.append(event)
        assert info.value.request_id == subscription.request_id
        assert isinstance(events[-1], MalformedTrackDetected)
        assert subscription.track.ended
        other = await connection.subscribe(NS, b"bad")
        with pytest.raises(MalformedTrackError):
            async for _ in other.track.objects():
                pass
        assert await no_request(connection)
        assert {subscription.request_id, other.request_id} <= seen.unsubscribed

    run_pair(cert_pair, client)


def test_fetch_stream_and_end_of_range_reach_the_fetch_reader(
    cert_pair: tuple[Path, Path],
) -> None:
    async def client(connection: MOQTConnection, seen: Seen) -> None:
        response = await connection.fetch(NS, b"ranges", Location(0, 0), Location(0, 3))
        kinds = [type(event) async for event in response.track.events()]
        assert kinds[:2] == [FetchStreamOpened, EndOfRangeReceived]
        assert kinds[-1] is DataStreamFinished
        again = await connection.fetch(NS, b"ranges", Location(0, 0), Location(0, 3))
        objects = [obj async for obj in again.track.objects()]
        assert [(o.object_id, bytes(o.payload)) for o in objects] == [(2, b"KKKVVV")]
        assert await no_request(connection)

    run_pair(cert_pair, client)


# --- the awaitable requests -----------------------------------------------------------------------


def test_publish_round_trip(cert_pair: tuple[Path, Path]) -> None:
    async def client(connection: MOQTConnection, seen: Seen) -> None:
        publication = await connection.publish(NS, b"pushed")
        assert publication.track_alias == 0  # the first alias this session allocates
        stream_id = await connection.open_subgroup(publication.request_id, 0)
        await connection.send_object(stream_id, 0, [b"key-", memoryview(b"value")])
        await connection.send_object(stream_id, 1, b"second", end_stream=True)
        assert await seen.published.get() == (b"0", b"key-value")
        assert await seen.published.get() == (b"1", b"second")
        connection.session.publish_done(publication.request_id, PublishDoneCode.TRACK_ENDED)
        connection.transmit()
        with pytest.raises(RequestRejected) as info:
            await connection.publish(NS, b"refuse")
        assert info.value.error_code == RequestErrorCode.UNAUTHORIZED

    run_pair(cert_pair, client)


def test_joining_fetch(cert_pair: tuple[Path, Path]) -> None:
    async def client(connection: MOQTConnection, seen: Seen) -> None:
        subscription = await connection.subscribe(NS, b"live")
        response = await connection.joining_fetch(subscription.request_id, 1)
        assert response.ok.end_location == Location(0, 2)
        objects = [obj async for obj in response.track.objects()]
        assert [bytes(o.payload) for o in objects] == [b"KKKVVV"]
        assert seen.joined == [b"live"]

    run_pair(cert_pair, client)


@pytest.mark.parametrize(
    "options", [SubscribeOptions.NAMESPACE, SubscribeOptions.PUBLISH, SubscribeOptions.BOTH]
)
def test_subscribe_namespace_options(
    options: SubscribeOptions, cert_pair: tuple[Path, Path]
) -> None:
    async def client(connection: MOQTConnection, seen: Seen) -> None:
        request_id, queue = await connection.subscribe_namespace(NS[:2], options=options)
        assert seen.options == [options]
        notice = await asyncio.wait_for(queue.get(), 5)
        assert isinstance(notice, NamespaceReceived) and notice.suffix == (b"x",)
        if options == SubscribeOptions.NAMESPACE:
            assert await no_request(connection)
        else:
            offer = await asyncio.wait_for(connection.next_request(), 5)
            assert isinstance(offer, PublishReceived)
            assert offer.message.track_namespace == (*NS[:2], b"x")
            connection.session.request_error(offer.request_id, RequestErrorCode.NOT_SUPPORTED)
        connection.unsubscribe_namespace(request_id)
        assert await queue.get() is None

    run_pair(cert_pair, client)


# --- TrackReader fed by hand ----------------------------------------------------------------------


def header(stream_id: int, object_id: int, length: int) -> ObjectHeader:
    start = ObjectStart(
        group_id=0,
        subgroup_id=0,
        object_id=object_id,
        publisher_priority=128,
        extensions=(),
        payload_length=length,
        status=ObjectStatus.NORMAL,
    )
    return ObjectHeader(stream_id, 7, None, start)


def test_a_payload_sink_gets_queued_pieces_then_new_ones_in_order() -> None:
    async def main() -> None:
        reader = TrackReader(7)
        reader.on_event(FetchStreamOpened(3, 7))
        reader.on_event(header(3, 0, 6))
        reader.on_payload(3, memoryview(b"abc"), 0)
        got: list[tuple[int, bytes, int]] = []
        reader.set_payload_sink(lambda h, data, offset: got.append((h.object_id, data, offset)))
        assert got == [(0, b"abc", 0)]
        reader.on_payload(3, memoryview(b"def"), 3)
        reader.on_event(ObjectEnd(3, 7, 0, 0))
        reader.on_event(header(3, 1, 2))
        reader.on_payload(3, memoryview(b"gh"), 0)
        reader.on_event(ObjectEnd(3, 7, 0, 1))
        reader.on_event(DataStreamFinished(3, 7))
        reader._fetch_done()
        assert [(o, bytes(d), off) for o, d, off in got] == [
            (0, b"abc", 0),
            (0, b"def", 3),
            (1, b"gh", 0),
        ]
        kinds = [type(event) async for event in reader.events()]
        assert ObjectData not in kinds
        assert kinds == [FetchStreamOpened, ObjectHeader, ObjectEnd, ObjectHeader, ObjectEnd,
                         DataStreamFinished]  # fmt: skip

    asyncio.run(main())


def test_object_end_takes_the_object_bounds_out_of_the_iterators() -> None:
    async def main() -> None:
        reader = TrackReader(7)
        reader.on_event(FetchStreamOpened(3, 7))
        reader.on_event(header(3, 0, 2))
        reader.on_payload(3, memoryview(b"ab"), 0)
        reader.on_event(ObjectEnd(3, 7, 0, 0))  # queued before the sinks are set
        reader.on_event(header(3, 1, 4))
        reader.on_payload(3, memoryview(b"cd"), 0)
        pieces: list[tuple[int, bytes, int]] = []
        ends: list[tuple[int, int]] = []
        reader.set_payload_sink(
            lambda h, data, offset: pieces.append((h.object_id, bytes(data), offset)),
            object_end=lambda h: ends.append((h.object_id, h.object.payload_length)),
        )
        assert pieces == [(0, b"ab", 0), (1, b"cd", 0)] and ends == [(0, 2)]
        reader.on_payload(3, memoryview(b"ef"), 2)
        reader.on_event(ObjectEnd(3, 7, 0, 1))
        reader.on_event(header(3, 2, 0))  # a zero-length object ends too
        reader.on_event(ObjectEnd(3, 7, 0, 2))
        reader.on_event(DataStreamFinished(3, 7))
        reader._fetch_done()
        assert pieces[-1] == (1, b"ef", 2)
        assert ends == [(0, 2), (1, 4), (2, 0)]
        kinds = [type(event) async for event in reader.events()]
        assert kinds == [FetchStreamOpened, DataStreamFinished]

    asyncio.run(main())


class _Forwarder:
    """A sink's owner, as a relay's forwarder is: it holds what it forwarded."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []

    def piece(self, header: ObjectHeader, data: memoryview, offset: int) -> None:
        self.pieces.append(bytes(data))

    def end(self, header: ObjectHeader) -> None:
        pass


def test_an_ended_reader_lets_go_of_its_sinks() -> None:
    """A connection keeps its last ENDED_READERS_KEPT ended readers (to swallow what the peer
    still had in flight). Each kept its sinks, and through them whatever their owner held: a
    relay kept the forwarder of each of its last 1,024 upstream FETCHes, and with it every
    object of those blocks, far past its cache budget. An ended reader calls no sink, so it
    now keeps none, also when the sink is set after the end (a FETCH done before its
    FETCH_OK was handled)."""

    async def main() -> None:
        for set_before_end in (True, False):
            reader = TrackReader(7)
            owner = _Forwarder()
            gone = weakref.ref(owner)
            reader.on_event(FetchStreamOpened(3, 7))
            if set_before_end:
                reader.set_payload_sink(owner.piece, object_end=owner.end)
            reader.on_event(header(3, 0, 2))
            reader.on_payload(3, memoryview(b"ab"), 0)
            reader.on_event(ObjectEnd(3, 7, 0, 0))
            reader.on_event(DataStreamFinished(3, 7))
            reader._fetch_done()
            if not set_before_end:
                reader.set_payload_sink(owner.piece, object_end=owner.end)
            assert owner.pieces == [b"ab"]
            del owner
            assert gone() is None, "the ended reader still holds its sink's owner"
            kinds = [type(event) async for event in reader.events()]
            assert kinds == [FetchStreamOpened, DataStreamFinished]

    asyncio.run(main())


def test_finished_waits_for_the_end_without_reading_and_leaves_the_events() -> None:
    async def main() -> None:
        reader = TrackReader(7)
        ends: list[int] = []
        reader.set_payload_sink(lambda h, data, offset: None, object_end=lambda h: ends.append(1))
        waiting = asyncio.ensure_future(reader.finished())
        also = asyncio.ensure_future(reader.finished())  # two waiters: both released
        reader.on_event(FetchStreamOpened(3, 7))
        reader.on_event(header(3, 0, 2))
        reader.on_payload(3, memoryview(b"ab"), 0)
        reader.on_event(ObjectEnd(3, 7, 0, 0))
        await asyncio.sleep(0)
        assert not waiting.done()  # stream events do not end the wait
        reader.on_event(DataStreamFinished(3, 7))
        await asyncio.sleep(0)
        assert not waiting.done()  # the fetch has not said it is complete yet
        reader._fetch_done()
        await asyncio.wait_for(asyncio.gather(waiting, also), 1)
        assert ends == [1] and reader._finish_waiters == []
        await reader.finished()  # an ended reader returns at once
        kinds = [type(event) async for event in reader.events()]
        assert kinds == [FetchStreamOpened, DataStreamFinished]

    asyncio.run(main())


def test_finished_raises_how_the_track_ended_and_forgets_a_cancelled_wait() -> None:
    async def main() -> None:
        reader = TrackReader(7)
        cancelled = asyncio.ensure_future(reader.finished())
        await asyncio.sleep(0)
        cancelled.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await cancelled
        assert reader._finish_waiters == []
        waiting = asyncio.ensure_future(reader.finished())
        await asyncio.sleep(0)
        reader.on_event(MalformedTrackDetected(7, 3, "two IMMUTABLE_EXTENSIONS"))
        with pytest.raises(MalformedTrackError):
            await asyncio.wait_for(waiting, 1)
        with pytest.raises(MalformedTrackError):
            await reader.finished()

    asyncio.run(main())


def test_without_a_payload_sink_object_end_is_not_used() -> None:
    async def main() -> None:
        reader = TrackReader(7)
        ends: list[ObjectHeader] = []
        reader.set_payload_sink(None, object_end=ends.append)
        reader.on_event(header(3, 0, 2))
        reader.on_payload(3, memoryview(b"ab"), 0)
        reader.on_event(ObjectEnd(3, 7, 0, 0))
        reader.on_event(DataStreamFinished(3, 7))
        reader._fetch_done()
        objects = [obj async for obj in reader.objects()]
        assert [bytes(obj.payload) for obj in objects] == [b"ab"] and ends == []

    asyncio.run(main())


def test_objects_are_joined_from_pieces_and_the_reader_stops_after_it_ends() -> None:
    async def main() -> None:
        reader = TrackReader(7)
        reader.on_event(header(3, 0, 4))
        reader.on_payload(3, memoryview(b"ab"), 0)
        reader.on_payload(3, memoryview(b"cd"), 2)
        reader.on_event(ObjectEnd(3, 7, 0, 0))
        reader.on_event(DataStreamFinished(3, 7))
        reader._fetch_done()
        reader.on_payload(3, memoryview(b"late"), 4)  # ignored once ended
        objects = [obj async for obj in reader.objects()]
        assert [bytes(obj.payload) for obj in objects] == [b"abcd"]
        assert reader.current_object(3) is None

    asyncio.run(main())


def test_runs_go_to_the_run_sink_only_with_the_payload_and_object_end_sinks() -> None:
    async def main() -> None:
        run = ObjectRun(memoryview(b"xab"), [(0, 0, 0, 128, (), 1, 2)], 2)
        reader = TrackReader(7)
        assert not reader.on_run(3, run)  # no sinks: the session delivers the events
        runs: list[ObjectRun] = []
        reader.set_payload_sink(lambda h, data, offset: None, runs=runs.append)
        assert not reader.on_run(3, run) and runs == []  # the bounds go to the iterators
        reader.set_payload_sink(lambda h, data, offset: None, object_end=print, runs=runs.append)
        reader.on_event(header(3, 0, 1))
        assert reader.current_object(3) is not None
        assert reader.on_run(3, run) and runs == [run]
        assert reader.current_object(3) is None  # the run's objects are complete
        reader.set_payload_sink(None)
        assert not reader.on_run(3, run) and runs == [run]
        reader.on_event(DataStreamFinished(3, 7))
        reader._fetch_done()
        assert reader.on_run(3, run) and runs == [run]  # ended: dropped, as pieces are

    asyncio.run(main())
