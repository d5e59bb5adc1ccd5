"""``MOQTConnection.send_objects`` and ``MOQTSession.send_objects``: runs of whole objects on one
stream, over QUIC (each installed backend, real UDP on 127.0.0.1) and QMux (TCP and a Unix
socket).

Objects arrive byte-exact, in order, with their extensions and the FIN; a run is one session
call (a 2 MiB block of 32 layers is two runs, so two transmits, and a few STREAM frames on
QMux); a refused object sends nothing; and a peer that stops reading holds the sender at the
high-water mark, never more than one object beyond it.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from moqt.asyncio import SEND_HIGH_WATER, MOQTConnection, StreamObject, connect, serve
from moqt.backend import get_backend
from moqt.certs import make_self_signed
from moqt.errors import PublishDoneCode
from moqt.messages import StandaloneFetch
from moqt.objects_wire import encode_extensions
from moqt.qmux_asyncio import QMuxEndpoint, connect_qmux, serve_qmux
from moqt.session_events import FetchReceived, SubscribeReceived
from moqt.wire import Location, encode_kvps, encode_varint
from tests.support.backends import NEEDS_QH3

NS = (b"kvsp", b"batch")
TRACK = b"block"
SUBGROUP = b"subgroup"
LAYER = 64 << 10
LAYERS = [hashlib.sha256(b"k%d" % i).digest() * (LAYER // 32) for i in range(32)]
SPLIT = [(memoryview(layer)[: LAYER // 2], memoryview(layer)[LAYER // 2 :]) for layer in LAYERS]
DIGEST_EXT = 0x0B  # IMMUTABLE_EXTENSIONS, odd: a bytes value


def extensions(index: int) -> tuple[tuple[int, bytes], ...]:
    return ((DIGEST_EXT, encode_kvps([(0x4B57, hashlib.sha256(LAYERS[index]).digest())])),)


def fetch_objects(first: int, last: int) -> list[StreamObject]:
    return [StreamObject(i, SPLIT[i], extensions(i), 0) for i in range(first, last + 1)]


Handler = Callable[[MOQTConnection], Awaitable[None]]
Client = Callable[[MOQTConnection], Awaitable[None]]
TRANSPORTS = ["aioquic", pytest.param("qh3", marks=NEEDS_QH3), "qmux-tcp", "qmux-unix"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_self_signed("localhost", tmp_path_factory.mktemp("batch-certs"))


class Counted:
    """Counts the publisher's transmits and session runs, and the most a stream held after a
    run was queued."""

    def __init__(self) -> None:
        self.transmits = 0
        self.runs: list[int] = []  # objects per session.send_objects call
        self.most_held = 0

    def attach(self, connection: MOQTConnection) -> None:
        transmit, session = connection.transmit, connection.session
        queue = session.send_objects

        def counted_transmit() -> None:
            self.transmits += 1
            transmit()

        def counted_queue(stream_id: int, objects: Any, *, end_stream: bool = False) -> int:
            self.runs.append(len(objects))
            sent = queue(stream_id, objects, end_stream=end_stream)
            self.most_held = max(self.most_held, session.send_buffered(stream_id))
            return sent

        connection.transmit = counted_transmit  # type: ignore[method-assign]
        session.send_objects = counted_queue  # type: ignore[method-assign]


def publisher(counted: Counted) -> Handler:
    """FETCH of TRACK: the asked layers in one send_objects call; SUBSCRIBE of SUBGROUP: layers
    0..7 as a subgroup stream in one call, then PUBLISH_DONE."""

    async def handler(connection: MOQTConnection) -> None:
        counted.attach(connection)
        async for event in connection.requests():
            if isinstance(event, FetchReceived):
                target = event.message.target
                assert isinstance(target, StandaloneFetch)
                first, last = target.start.object, target.end.object - 1
                connection.session.fetch_ok(event.request_id, end_location=Location(0, last))
                stream_id = await connection.open_fetch_stream(event.request_id)
                before = counted.transmits
                await connection.send_objects(
                    stream_id, fetch_objects(first, last), end_stream=True
                )
                counted.runs.append(-(counted.transmits - before))  # marks the call's end
            elif isinstance(event, SubscribeReceived):
                connection.session.subscribe_ok(event.request_id)
                stream_id = await connection.open_subgroup(event.request_id, 0, end_of_group=True)
                objects = [StreamObject(i, LAYERS[i], extensions(i)) for i in range(8)]
                await connection.send_objects(stream_id, objects, end_stream=True)
                connection.session.publish_done(event.request_id, PublishDoneCode.TRACK_ENDED)
                connection.transmit()

    return handler


def run(
    transport: str, certs: tuple[Path, Path], tmp_path: Path, handler: Handler, client: Client
) -> None:
    async def main() -> None:
        if transport.startswith("qmux"):
            if transport == "qmux-unix":
                endpoint = QMuxEndpoint("unix", path=str(tmp_path / "batch.sock"))
            else:
                endpoint = QMuxEndpoint("tcp", "127.0.0.1", 0)
            server = await serve_qmux(endpoint, handler=handler)
            address = server.address
            if isinstance(address, tuple):
                endpoint = QMuxEndpoint("tcp", address[0], address[1])
            try:
                async with connect_qmux(endpoint) as connection:
                    await asyncio.wait_for(client(connection), 30)
            finally:
                server.close()
                await server.wait_closed()
            return
        backend = get_backend(transport)
        cert, key = (str(path) for path in certs)
        quic_server = await serve(
            "127.0.0.1",
            0,
            configuration=backend.configuration(is_client=False, certificate=cert, private_key=key),
            handler=handler,
            backend=transport,
        )
        try:
            configuration = backend.configuration(
                is_client=True, cafile=cert, server_name="localhost"
            )
            host, port = quic_server.address
            async with connect(
                host, port, configuration=configuration, backend=transport
            ) as connection:
                await asyncio.wait_for(client(connection), 30)
        finally:
            quic_server.close()

    asyncio.run(main())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_fetch_run_arrives_byte_exact_in_order_in_two_runs(
    transport: str, certs: tuple[Path, Path], tmp_path: Path
) -> None:
    counted = Counted()

    async def client(connection: MOQTConnection) -> None:
        response = await connection.fetch(NS, TRACK, Location(0, 0), Location(0, 32))
        objects = [obj async for obj in response.track.objects()]
        assert [obj.object_id for obj in objects] == list(range(32))
        assert [bytes(obj.payload) for obj in objects] == LAYERS
        assert [obj.extensions for obj in objects] == [extensions(i) for i in range(32)]
        partial = await connection.fetch(NS, TRACK, Location(0, 5), Location(0, 8))
        got = [(obj.object_id, bytes(obj.payload)) async for obj in partial.track.objects()]
        assert got == [(i, LAYERS[i]) for i in (5, 6, 7)]

    run(transport, certs, tmp_path, publisher(counted), client)
    calls = " ".join(str(n) for n in counted.runs).split(" -")  # runs per call, then transmits
    block, small = [int(n) for n in calls[0].split()], [int(n) for n in calls[1].split()[1:]]
    # 2 MiB: a first run of at most 256 KiB sent at once, then the rest in one run (QUIC: in
    # as many as the congestion window lets the stream drain under the high-water mark)
    assert block[0] == 3 and sum(block) == 32, calls
    if transport.startswith("qmux"):
        assert block == [3, 29], calls
    else:
        assert len(block) <= 4, calls
    assert small == [3], calls  # the three layers of the second fetch: one run


@pytest.mark.parametrize("transport", ["qmux-tcp", "qmux-unix"])
def test_qmux_a_run_leaves_in_two_transmits_and_few_stream_frames(
    transport: str, certs: tuple[Path, Path], tmp_path: Path
) -> None:
    counted = Counted()

    async def client(connection: MOQTConnection) -> None:
        reader = connection._protocol.quic._reader
        frames: list[int] = []
        parse = reader._stream_header

        def counting(*args: object) -> None:
            frames.append(1)
            parse(*args)

        reader._stream_header = counting
        response = await connection.fetch(NS, TRACK, Location(0, 0), Location(0, 32))
        assert b"".join([bytes(o.payload) async for o in response.track.objects()]) == b"".join(
            LAYERS
        )
        # the FETCH_HEADER's frame, the first run's, the rest in records of 1 MiB at most
        assert len(frames) <= 6, frames

    run(transport, certs, tmp_path, publisher(counted), client)
    # two runs, two transmits while send_objects ran: the first run's at once, the second's
    # deferred to the yield that follows more than YIELD_BYTES written
    assert counted.runs[:2] == [3, 29]
    assert -counted.runs[2] == 2, counted.runs


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_subgroup_run_with_fin_then_publish_done(
    transport: str, certs: tuple[Path, Path], tmp_path: Path
) -> None:
    async def client(connection: MOQTConnection) -> None:
        subscription = await connection.subscribe(NS, SUBGROUP)
        objects = [obj async for obj in subscription.track.objects()]
        assert [(o.object_id, bytes(o.payload)) for o in objects] == [
            (i, LAYERS[i]) for i in range(8)
        ]
        assert [o.extensions for o in objects] == [extensions(i) for i in range(8)]

    run(transport, certs, tmp_path, publisher(Counted()), client)


def test_a_refused_object_sends_nothing_of_its_run(
    certs: tuple[Path, Path], tmp_path: Path
) -> None:
    """Object IDs that do not ascend on a subgroup stream: ValueError, nothing of the run is
    queued, and the writer goes on from the last object sent."""
    errors: list[str] = []

    async def handler(connection: MOQTConnection) -> None:
        async for event in connection.requests():
            if not isinstance(event, SubscribeReceived):
                continue
            session = connection.session
            session.subscribe_ok(event.request_id)
            stream_id = await connection.open_subgroup(event.request_id, 0)
            await connection.send_objects(stream_id, [StreamObject(0, b"zero")])
            held = session.send_buffered(stream_id)
            bad = [StreamObject(1, b"one"), StreamObject(1, b"again")]
            with pytest.raises(ValueError) as refused:
                session.send_objects(stream_id, bad)
            errors.append(str(refused.value))
            assert session.send_buffered(stream_id) == held
            await connection.send_objects(
                stream_id,
                [StreamObject(1, b"one"), StreamObject(4, [b"fo", b"ur"])],
                end_stream=True,
            )
            session.publish_done(event.request_id, PublishDoneCode.TRACK_ENDED)
            connection.transmit()

    async def client(connection: MOQTConnection) -> None:
        subscription = await connection.subscribe(NS, SUBGROUP)
        got = [(o.object_id, bytes(o.payload)) async for o in subscription.track.objects()]
        assert got == [(0, b"zero"), (1, b"one"), (4, b"four")]

    run("qmux-unix", certs, tmp_path, handler, client)
    assert errors and "ascend" in errors[0]


def test_a_peer_that_stops_reading_holds_the_run_at_the_high_water_mark(
    certs: tuple[Path, Path], tmp_path: Path
) -> None:
    """64 MiB in one call while the client reads nothing: the sender waits with at most the
    high-water mark plus one object queued; once the client reads, everything arrives."""
    counted = Counted()
    count = 1024  # 64 MiB: far beyond the socket buffers and the carrier's write buffer
    payload = LAYERS[0]

    async def handler(connection: MOQTConnection) -> None:
        counted.attach(connection)
        async for event in connection.requests():
            if isinstance(event, FetchReceived):
                connection.session.fetch_ok(event.request_id, end_location=Location(0, count - 1))
                stream_id = await connection.open_fetch_stream(event.request_id)
                objects = [StreamObject(i, payload, (), 0) for i in range(count)]
                await connection.send_objects(stream_id, objects, end_stream=True)

    async def client(connection: MOQTConnection) -> None:
        transport = connection._protocol._transport
        received = bytearray()

        def sink(header: Any, data: memoryview, offset: int) -> None:
            received.extend(data)

        response = await connection.fetch(
            NS, TRACK, Location(0, 0), Location(0, count), payload_sink=sink
        )
        transport.pause_reading()
        for _ in range(200):  # the sender fills every buffer, then waits
            await asyncio.sleep(0.01)
            if len(counted.runs) > 2 and counted.most_held >= SEND_HIGH_WATER:
                break
        held_while_paused = len(received)
        transport.resume_reading()
        await response.track.finished()
        assert held_while_paused < count * LAYER
        assert len(received) == count * LAYER
        assert bytes(received[:LAYER]) == payload and bytes(received[-LAYER:]) == payload

    run("qmux-unix", certs, tmp_path, handler, client)
    header = len(encode_varint(LAYER)) + 1
    assert counted.most_held <= SEND_HIGH_WATER + LAYER + header
    assert len(counted.runs) > 2  # it waited, then went on in runs


def test_the_single_extension_fast_path_encodes_as_the_general_writer() -> None:
    cases: list[list[tuple[int, int | bytes]]] = [
        [(0x0B, b"x" * 37)],
        [(0x0B, b"x" * 61)],
        [(0x0B, b"x" * 62)],
        [(0x4B57, b"y" * 32)],
        [(0x0B, b"")],
        [(0x3C, 1)],
        [(0x0B, b"a"), (0x3C, 7)],
    ]
    for pairs in cases:
        body = encode_kvps(pairs)
        assert encode_extensions(pairs) == encode_varint(len(body)) + body
