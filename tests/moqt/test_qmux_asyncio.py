"""moqt.qmux_asyncio: MOQT over QMux on real sockets, for every carrier (TLS 1.3 over TCP on
127.0.0.1, plain TCP on 127.0.0.1, a Unix socket in tmp_path).

Setup, FETCH of 2 MiB objects byte-exact, SUBSCRIBE of a live track, the refusals (ALPN or
application protocol not agreed, plain TCP off loopback) and a peer vanishing mid-transfer,
which must end in a typed error, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import mmap
import os
import socket
import ssl
import stat
import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import get_args

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moqt import receive_buffers
from moqt.asyncio import MOQTConnection, SessionClosedError
from moqt.certs import make_self_signed
from moqt.errors import ListenError, PublishDoneCode, RequestErrorCode, SessionError
from moqt.messages import StandaloneFetch
from moqt.qmux import QMuxConfig
from moqt.qmux_asyncio import (
    TLS_WRITE_BATCH,
    QMuxEndpoint,
    QMuxServer,
    TLSEngine,
    client_ssl_context,
    connect_qmux,
    require_loopback,
    serve_qmux,
    server_ssl_context,
)
from moqt.qmux_frames import NO_APPLICATION_PROTOCOL
from moqt.receive_buffers import BufferPool, ReceiveBuffers, prefaulted
from moqt.session_events import FetchReceived, ObjectData, ObjectHeader, SubscribeReceived
from moqt.wire import Location
from tests.support.qmux_servers import listening, released

NS = (b"kvsp", b"qmux")
TRACK = b"block"
LIVE = b"live"
OBJECT = 2 << 20
OBJECTS = [hashlib.sha256(b"object%d" % i).digest() * (OBJECT // 32) for i in range(3)]
CARRIERS = ["tls", "tls-thread", "tls-inline", "tcp", "unix"]  # tls-*: moqt.qmux_tls engines
Client = Callable[[MOQTConnection], Awaitable[None]]
Handler = Callable[[MOQTConnection], Awaitable[None]]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_self_signed("localhost", tmp_path_factory.mktemp("qmux-certs"))


async def publisher(connection: MOQTConnection) -> None:
    """FETCH of OBJECTS on TRACK, SUBSCRIBE of LIVE (4 objects, then PUBLISH_DONE)."""
    async for event in connection.requests():
        if isinstance(event, FetchReceived):
            await serve_fetch(connection, event)
        elif isinstance(event, SubscribeReceived) and event.message.track_name == LIVE:
            connection.session.subscribe_ok(event.request_id)
            stream_id = await connection.open_subgroup(event.request_id, 0, end_of_group=True)
            for index in range(4):
                payload = b"live-%d" % index * 1000
                await connection.send_object(stream_id, index, payload, end_stream=index == 3)
            connection.session.publish_done(event.request_id, PublishDoneCode.TRACK_ENDED)
            connection.transmit()


async def serve_fetch(connection: MOQTConnection, event: FetchReceived) -> None:
    target = event.message.target
    if not isinstance(target, StandaloneFetch) or target.track_name != TRACK:
        connection.session.request_error(event.request_id, RequestErrorCode.DOES_NOT_EXIST)
        connection.transmit()
        return
    last = target.end.object - 1
    connection.session.fetch_ok(event.request_id, end_location=Location(0, last))
    stream_id = await connection.open_fetch_stream(event.request_id)
    for index in range(target.start.object, last + 1):
        await connection.send_fetch_object(
            stream_id,
            group_id=0,
            object_id=index,
            payload=memoryview(OBJECTS[index]),
            end_stream=index == last,
        )


class Carrier:
    """How to serve and reach one carrier in a test."""

    def __init__(self, kind: str, certs: tuple[Path, Path], tmp_path: Path) -> None:
        self.kind, _, engine = kind.partition("-")
        self.engine: TLSEngine | None = engine or None  # type: ignore[assignment]
        self.cert, self.key = (str(path) for path in certs)
        self.sock = str(tmp_path / "moqt.sock")

    def server_endpoint(self) -> QMuxEndpoint:
        if self.kind == "unix":
            return QMuxEndpoint("unix", path=self.sock)
        return QMuxEndpoint(self.kind, "127.0.0.1", 0)  # type: ignore[arg-type]

    def server_context(self) -> ssl.SSLContext | None:
        return server_ssl_context(self.cert, self.key) if self.kind == "tls" else None

    def client_endpoint(self, server: QMuxServer) -> QMuxEndpoint:
        if self.kind == "unix":
            return QMuxEndpoint("unix", path=self.sock)
        host, port = server.address  # type: ignore[misc]
        return QMuxEndpoint(self.kind, host, port)  # type: ignore[arg-type]

    def client_context(self) -> ssl.SSLContext | None:
        return client_ssl_context(cafile=self.cert) if self.kind == "tls" else None


def run(
    carrier: Carrier,
    client: Client,
    *,
    handler: Handler = publisher,
    server_qmux: QMuxConfig | None = None,
    client_qmux: QMuxConfig | None = None,
) -> None:
    async def main() -> None:
        server = await serve_qmux(
            carrier.server_endpoint(),
            handler=handler,
            ssl_context=carrier.server_context(),
            qmux=server_qmux,
            tls_engine=carrier.engine,
        )
        try:
            async with connect_qmux(
                carrier.client_endpoint(server),
                ssl_context=carrier.client_context(),
                server_hostname="localhost",
                path="/kvsp",
                qmux=client_qmux,
                tls_engine=carrier.engine,
            ) as connection:
                await asyncio.wait_for(client(connection), 30)
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(main())


@pytest.fixture(params=CARRIERS)
def carrier(request: pytest.FixtureRequest, certs: tuple[Path, Path], tmp_path: Path) -> Carrier:
    return Carrier(request.param, certs, tmp_path)


def test_setup_and_fetch_of_2_mib_objects_byte_exact(carrier: Carrier) -> None:
    async def client(connection: MOQTConnection) -> None:
        assert connection.session.setup_complete
        response = await connection.fetch(NS, TRACK, Location(0, 0), Location(0, 3))
        objects = [obj async for obj in response.track.objects()]
        assert [obj.object_id for obj in objects] == [0, 1, 2]
        for obj, expected in zip(objects, OBJECTS, strict=True):
            assert hashlib.sha256(obj.payload).digest() == hashlib.sha256(expected).digest()

    run(carrier, client)


def test_fetch_into_a_sink(carrier: Carrier) -> None:
    async def client(connection: MOQTConnection) -> None:
        buffer = bytearray(3 * OBJECT)

        def sink(header: ObjectHeader, data: memoryview, offset: int) -> None:
            at = header.object_id * OBJECT + offset
            buffer[at : at + len(data)] = data

        for _ in range(2):
            response = await connection.fetch(
                NS, TRACK, Location(0, 0), Location(0, 3), payload_sink=sink
            )
            await response.track.finished()
            assert buffer == b"".join(OBJECTS)

    run(carrier, client)


def test_received_pieces_stay_intact_after_later_reads(carrier: Carrier) -> None:
    """Payload pieces are read-only slices of the receive buffers, kept (not copied) across
    two fetches of 6 MiB: later reads go to fresh buffers and never overwrite them."""

    async def client(connection: MOQTConnection) -> None:
        kept: list[memoryview] = []
        for _ in range(2):
            response = await connection.fetch(NS, TRACK, Location(0, 0), Location(0, 3))
            pieces: list[memoryview] = []
            async for event in response.track.events():
                if isinstance(event, ObjectData):
                    pieces.append(event.data)
            kept.extend(pieces)
            assert b"".join(pieces) == b"".join(OBJECTS)
        assert all(piece.readonly for piece in kept)
        assert len({id(piece.obj) for piece in kept}) > 2  # several receive buffers
        assert b"".join(kept) == b"".join(OBJECTS) * 2

    run(carrier, client)


def test_object_writes_are_coalesced_into_few_stream_frames(carrier: Carrier) -> None:
    """32 objects written as K and V (64 payload pieces) leave as a few large STREAM frames,
    not one frame per piece."""
    layers = [(os.urandom(32 << 10), os.urandom(32 << 10)) for _ in range(32)]

    async def handler(connection: MOQTConnection) -> None:
        event = await connection.next_request()
        assert isinstance(event, FetchReceived)
        connection.session.fetch_ok(event.request_id, end_location=Location(0, 31))
        stream_id = await connection.open_fetch_stream(event.request_id)
        for index, (k, v) in enumerate(layers):
            connection.session.begin_fetch_object(
                stream_id, group_id=0, object_id=index, payload_length=len(k) + len(v)
            )
            await connection.write_payload(stream_id, k)
            await connection.write_payload(stream_id, v, end_stream=index == 31)
        await connection.wait_closed()

    async def client(connection: MOQTConnection) -> None:
        reader = connection._protocol.quic._reader
        frames: list[int] = []
        parse = reader._stream_header

        def counting(*args: object) -> None:
            frames.append(1)
            parse(*args)

        reader._stream_header = counting
        response = await connection.fetch(NS, TRACK, Location(0, 0), Location(0, 32))
        objects = [obj async for obj in response.track.objects()]
        assert [bytes(obj.payload) for obj in objects] == [k + v for k, v in layers]
        assert len(frames) <= 24  # 2 MiB in 256 KiB batches and a first piece; 65 per piece

    run(carrier, client, handler=handler)


def test_subscribe_to_a_live_track(carrier: Carrier) -> None:
    async def client(connection: MOQTConnection) -> None:
        subscription = await connection.subscribe(NS, LIVE)
        objects = [obj async for obj in subscription.track.objects()]
        assert [bytes(obj.payload) for obj in objects] == [b"live-%d" % i * 1000 for i in range(4)]

    run(carrier, client)


def test_handler_failure_closes_with_internal_error(carrier: Carrier) -> None:
    async def failing(connection: MOQTConnection) -> None:
        raise RuntimeError("boom")

    async def client(connection: MOQTConnection) -> None:
        closed = await connection.wait_closed()
        assert closed.error_code == SessionError.INTERNAL_ERROR

    run(carrier, client, handler=failing)


def test_peer_vanishing_mid_transfer_is_a_session_closed_error(carrier: Carrier) -> None:
    async def vanishing(connection: MOQTConnection) -> None:
        event = await connection.next_request()
        assert isinstance(event, FetchReceived)
        connection.session.fetch_ok(event.request_id, end_location=Location(0, 2))
        stream_id = await connection.open_fetch_stream(event.request_id)
        await connection.send_fetch_object(
            stream_id, group_id=0, object_id=0, payload=OBJECTS[0][: OBJECT // 2]
        )
        await asyncio.sleep(0.05)
        connection._protocol._transport.abort()  # the carrier goes, no CONNECTION_CLOSE

    async def client(connection: MOQTConnection) -> None:
        response = await connection.fetch(NS, TRACK, Location(0, 0), Location(0, 3))
        with pytest.raises(SessionClosedError):
            async for _ in response.track.objects():
                pass
        assert connection.session.closed is not None

    run(carrier, client, handler=vanishing)


# --- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", get_args(TLSEngine))
def test_tls_alpn_mismatch_is_refused_on_both_sides(
    certs: tuple[Path, Path], engine: TLSEngine
) -> None:
    cert, key = (str(path) for path in certs)
    reached: list[MOQTConnection] = []

    async def handler(connection: MOQTConnection) -> None:
        reached.append(connection)

    async def main() -> None:
        server = await serve_qmux(
            QMuxEndpoint("tls", "127.0.0.1", 0),
            handler=handler,
            ssl_context=server_ssl_context(cert, key),
            tls_engine=engine,
        )
        host, port = server.address  # type: ignore[misc]
        try:
            other = client_ssl_context(cafile=cert)
            other.set_alpn_protocols(["moqt-16"])  # the QUIC identifier, not QMux's
            with pytest.raises(SessionClosedError, match="ALPN"):
                async with connect_qmux(
                    QMuxEndpoint("tls", host, port),
                    ssl_context=other,
                    server_hostname="localhost",
                    tls_engine=engine,
                ):
                    pass
            wrong_server = server_ssl_context(cert, key)
            wrong_server.set_alpn_protocols(["h2"])
            second = await serve_qmux(
                QMuxEndpoint("tls", "127.0.0.1", 0),
                handler=handler,
                ssl_context=wrong_server,
                tls_engine=engine,
            )
            host2, port2 = second.address  # type: ignore[misc]
            with pytest.raises((SessionClosedError, ConnectionError)):
                async with connect_qmux(
                    QMuxEndpoint("tls", host2, port2),
                    ssl_context=client_ssl_context(cafile=cert),
                    server_hostname="localhost",
                    tls_engine=engine,
                ):
                    pass
            second.close()
            await second.wait_closed()
        finally:
            server.close()
            await server.wait_closed()
        assert reached == []

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["tcp", "unix"])
def test_no_common_application_protocol_is_refused(
    kind: str, certs: tuple[Path, Path], tmp_path: Path
) -> None:
    async def client(connection: MOQTConnection) -> None:
        raise AssertionError("the setup must not complete")

    with pytest.raises(SessionClosedError) as caught:
        run(
            Carrier(kind, certs, tmp_path),
            client,
            server_qmux=QMuxConfig(application_protocols=("moqt-99",)),
        )
    assert caught.value.closed.error_code == NO_APPLICATION_PROTOCOL


def test_plain_tcp_off_loopback_is_refused_without_trusted_network() -> None:
    async def main() -> None:
        with pytest.raises(ValueError, match="trusted_network"):
            await serve_qmux(QMuxEndpoint("tcp", "0.0.0.0", 0), handler=publisher)
        with pytest.raises(ValueError, match="trusted_network"):
            async with connect_qmux(QMuxEndpoint("tcp", "192.0.2.1", 443)):
                pass

    asyncio.run(main())
    for host in ("127.0.0.1", "::1", "localhost"):
        require_loopback(host, trusted_network=False)
    require_loopback("192.0.2.1", trusted_network=True)


def test_unix_socket_file_is_owner_only_by_default(
    certs: tuple[Path, Path], tmp_path: Path
) -> None:
    async def main() -> None:
        path = tmp_path / "a.sock"
        server = await serve_qmux(QMuxEndpoint("unix", path=str(path)), handler=publisher)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and server.address == str(path)
        with pytest.raises(ListenError) as caught:
            await serve_qmux(QMuxEndpoint("unix", path=str(path)), handler=publisher)
        assert caught.value.where == str(path)
        assert caught.value.reason == "a server is already listening there"
        server.close()
        await server.wait_closed()
        assert not path.exists()
        group = await serve_qmux(
            QMuxEndpoint("unix", path=str(path)), handler=publisher, unix_mode=0o660
        )
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
        group.close()
        await group.wait_closed()

    asyncio.run(main())


def test_a_listener_that_cannot_bind_says_which_and_where(
    certs: tuple[Path, Path], tmp_path: Path
) -> None:
    """A port in use, a socket path in a missing folder, one that another file holds (left as
    it was) or one too long for AF_UNIX: a ListenError naming the carrier and the address,
    which the command lines print as one line, not an OSError from deep in asyncio."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    missing = str(tmp_path / "missing" / "q.sock")
    long = str(tmp_path / ("q" * 110))
    unix = "MOQT over QMux (Unix socket)"
    at, in_use = f"127.0.0.1:{port}", "address already in use"
    not_socket = "a file that is not a socket is there"
    cases = [
        (QMuxEndpoint("tcp", "127.0.0.1", port), "MOQT over QMux (TCP)", at, in_use),
        (QMuxEndpoint("tls", "127.0.0.1", port), "MOQT over QMux (TLS)", at, in_use),
        (QMuxEndpoint("unix", path=missing), unix, missing, "no such file or directory"),
        (QMuxEndpoint("unix", path=str(notes)), unix, str(notes), not_socket),
        (QMuxEndpoint("unix", path=long), unix, long, "AF_UNIX path too long"),
    ]
    context = server_ssl_context(str(certs[0]), str(certs[1]))

    async def main() -> None:
        for endpoint, what, where, reason in cases:
            with pytest.raises(ListenError) as caught:
                await serve_qmux(endpoint, handler=publisher, ssl_context=context)
            assert (caught.value.what, caught.value.where, caught.value.reason) == (
                what,
                where,
                reason,
            )
            assert str(caught.value) == f"cannot listen for {what} on {where}: {reason}"

    try:
        asyncio.run(main())
    finally:
        busy.close()
    assert notes.read_text() == "keep me"
    assert not os.path.exists(long)


def test_endpoint_needs_its_address_parts() -> None:
    with pytest.raises(ValueError):
        QMuxEndpoint("unix")
    with pytest.raises(ValueError):
        QMuxEndpoint("tls", "127.0.0.1")
    with pytest.raises(ValueError):
        QMuxEndpoint("udp", "127.0.0.1", 1)  # type: ignore[arg-type]


BUFFER_KINDS = pytest.mark.parametrize("prefault", [False, True], ids=["bytearray", "prefaulted"])
"""Every buffer a bytearray, or those after the first whole one prefaulted mappings."""


@BUFFER_KINDS
def test_receive_buffers_hand_out_read_only_bytes_never_overwritten(prefault: bool) -> None:
    buffers = ReceiveBuffers(size=1000, min_read=300, prefault=prefault)
    tail = buffers.get_buffer(-1)
    assert len(tail) == 1000
    tail[:600] = b"a" * 600
    first = buffers.filled(600)
    assert first.readonly and first == b"a" * 600
    tail = buffers.get_buffer(-1)  # 400 free: still the same buffer
    assert len(tail) == 400
    tail[:200] = b"b" * 200
    second = buffers.filled(200)
    assert second.obj is first.obj
    tail = buffers.get_buffer(100)  # 200 free, under min_read, but the hint fits
    assert len(tail) == 200
    buffers.filled(0)
    tail = buffers.get_buffer(-1)  # under min_read: a fresh buffer
    assert len(tail) == 1000
    tail[:] = b"c" * 1000
    third = buffers.filled(1000)
    assert third.obj is not first.obj
    assert len(buffers.get_buffer(5000)) == 5000  # full: a fresh one, as large as the hint
    assert first == b"a" * 600 and second == b"b" * 200 and third == b"c" * 1000


def fill(buffers: ReceiveBuffers, octet: int, count: int) -> memoryview:
    tail = buffers.get_buffer(-1)
    tail[:count] = bytes([octet]) * count
    return buffers.filled(count)


def test_receive_buffers_take_a_bytearray_again_once_no_slice_of_it_is_left() -> None:
    buffers = ReceiveBuffers(size=1000, min_read=300, prefault=False)
    first = fill(buffers, 1, 1000)
    owner = first.obj
    del first  # every slice of the first buffer is gone
    second = fill(buffers, 2, 1000)  # a second buffer: the first is the spare
    assert second.obj is not owner
    third = fill(buffers, 3, 1000)  # the spare again, written over
    assert third.obj is owner and third == b"\x03" * 1000 and len(owner) == 1000
    assert second == b"\x02" * 1000


@pytest.mark.skipif(not hasattr(mmap, "MAP_POPULATE"), reason="no MAP_POPULATE here")
def test_receive_buffers_take_a_pooled_buffer_again_once_no_slice_of_it_is_left() -> None:
    """A connection that carries bulk data takes its buffers from a pool, which takes each
    back once its last slice is gone: a consumer that copies what it reads, or a relay whose
    cache let go of it, gets the same pages again instead of fresh memory."""
    pool = BufferPool(1000, keep=4)
    buffers = ReceiveBuffers(size=1000, min_read=300, pool=pool)
    fill(buffers, 0, 1000)  # a bytearray: the connection has not carried bulk data yet
    first = fill(buffers, 1, 1000)
    assert (pool.taken, pool.reused, pool.free) == (1, 0, 0)
    del first
    second = fill(buffers, 2, 1000)
    assert (pool.taken, pool.reused) == (2, 1)  # the first one's mapping, written over
    kept = second[:10]
    del second
    third = fill(buffers, 3, 1000)  # a slice of the second is alive: fresh memory
    assert (pool.taken, pool.reused) == (3, 1)
    assert kept == b"\x02" * 10 and third == b"\x03" * 1000
    del kept, third
    fill(buffers, 4, 1000)
    assert (pool.taken, pool.reused, pool.free) == (4, 2, 1)


@BUFFER_KINDS
def test_receive_buffers_never_write_a_buffer_that_a_slice_still_views(prefault: bool) -> None:
    buffers = ReceiveBuffers(size=1000, min_read=300, prefault=prefault)
    kept = fill(buffers, 1, 1000)[10:20]  # a slice of a slice: it still views the buffer
    copy = memoryview(kept)  # and a view made from it
    del kept
    second = fill(buffers, 2, 1000)
    third = fill(buffers, 3, 1000)
    assert third.obj is not copy.obj and third.obj is not second.obj
    assert copy == b"\x01" * 10


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 1000), st.booleans()), min_size=1, max_size=40))
@BUFFER_KINDS
def test_receive_buffers_keep_every_held_slice_intact(
    prefault: bool, reads: list[tuple[int, bool]]
) -> None:
    buffers = ReceiveBuffers(size=1000, min_read=300, prefault=prefault)
    held: list[tuple[memoryview, bytes]] = []
    for index, (count, keep) in enumerate(reads):
        tail = buffers.get_buffer(-1)
        count = min(count, len(tail))
        tail[:count] = bytes([index % 251]) * count
        data = buffers.filled(count)
        if keep:
            held.append((data, bytes(data)))
        del data, tail
        assert all(view == expected for view, expected in held)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 1), st.integers(1, 1000), st.booleans(), st.integers(0, 5)),
        min_size=1,
        max_size=60,
    )
)
def test_two_connections_on_one_pool_never_write_a_slice_still_held(
    steps: list[tuple[int, int, bool, int]],
) -> None:
    """Two connections share the process's pool, keep some slices and let go of others (a
    relay's cache evicting): every slice still held keeps its octets, whatever buffer the
    pool handed out again."""
    pool = BufferPool(1000, keep=3)
    connections = [ReceiveBuffers(size=1000, min_read=300, pool=pool) for _ in range(2)]
    held: list[tuple[memoryview, bytes]] = []
    for index, (which, count, keep, drop) in enumerate(steps):
        if drop and held:
            del held[drop % len(held)]
        tail = connections[which].get_buffer(-1)
        count = min(count, len(tail))
        tail[:count] = bytes([index % 251]) * count
        data = connections[which].filled(count)
        if keep:
            held.append((data, bytes(data)))
        del data, tail
        assert all(view == expected for view, expected in held)
    assert pool.free <= 3


@pytest.mark.skipif(not hasattr(mmap, "MAP_POPULATE"), reason="no MAP_POPULATE here")
def test_receive_buffers_prefault_the_buffers_of_a_connection_that_filled_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first buffer is a bytearray (a connection may carry only control messages); once
    one was filled, fresh buffers are prefaulted mappings, from the pool, and a hint larger
    than the size gets one of its own."""
    made: list[int] = []

    def counted(size: int) -> mmap.mmap | bytearray:
        made.append(size)
        return prefaulted(size)

    monkeypatch.setattr(receive_buffers, "prefaulted", counted)
    buffers = ReceiveBuffers(size=1000, min_read=300)
    first = fill(buffers, 1, 700)
    assert type(first.obj) is bytearray
    second = fill(buffers, 2, 300)  # 300 free is not under min_read: the same buffer
    assert second.obj is first.obj and len(second) == 300
    third = fill(buffers, 3, 1000)  # the first was filled: a pooled, prefaulted mapping
    assert isinstance(third.obj, ctypes.Array) and made == [1000]
    assert len(buffers.get_buffer(5000)) == 5000
    fourth = buffers.filled(5000)
    assert type(fourth.obj) is mmap.mmap and len(fourth.obj) == 5000 and made == [1000, 5000]
    assert first == b"\x01" * 700 and second == b"\x02" * 300 and third == b"\x03" * 1000


@pytest.mark.skipif(not hasattr(mmap, "MAP_POPULATE"), reason="no MAP_POPULATE here")
def test_the_pool_keeps_so_many_free_buffers_and_unmaps_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A relay caches slices: each buffer lives while a slice of it does. Once the last is
    gone the pool takes it back, up to ``keep`` free buffers; the others are unmapped (a
    relay whose cache emptied returns the memory)."""
    mappings: list[weakref.ref[mmap.mmap]] = []

    def watched(size: int) -> mmap.mmap | bytearray:
        mapping = prefaulted(size)
        assert type(mapping) is mmap.mmap
        mappings.append(weakref.ref(mapping))
        return mapping

    monkeypatch.setattr(receive_buffers, "prefaulted", watched)
    pool = BufferPool(1000, keep=2)
    buffers = ReceiveBuffers(size=1000, min_read=300, pool=pool)
    fill(buffers, 0, 1000)
    kept = [fill(buffers, octet, 1000)[100:200] for octet in range(1, 6)]
    assert len(mappings) == 5 and pool.free == 0
    assert [view.tobytes() for view in kept] == [bytes([octet]) * 100 for octet in range(1, 6)]
    del kept
    buffers.get_buffer(5000)  # the connection lets go of its buffer: a larger one, unpooled
    assert pool.free == 2 and len(mappings) == 6
    alive = [ref() is not None for ref in mappings]
    assert sum(alive[:5]) == 2 and alive[5]  # three of the five were unmapped


@pytest.mark.skipif(not hasattr(mmap, "MAP_POPULATE"), reason="no MAP_POPULATE here")
def test_receive_buffers_fall_back_to_bytearrays_when_no_mapping_is_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process that holds vm.max_map_count mappings (a relay with a cache of 64 GiB of
    1 MiB buffers) gets ENOMEM from mmap: the connection goes on with bytearrays."""
    buffers = ReceiveBuffers(size=1000, min_read=300)
    first = fill(buffers, 1, 1000)

    def no_more(*args: object, **kwargs: object) -> mmap.mmap:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", no_more)
    second = fill(buffers, 2, 1000)
    assert type(second.obj) is bytearray
    assert first == b"\x01" * 1000 and second == b"\x02" * 1000


def test_tls_hands_its_transport_batches_so_the_peer_decrypts_while_more_is_encrypted(
    certs: tuple[Path, Path], tmp_path: Path
) -> None:
    """asyncio's TLS transport encrypts all of a write before it sends any of it: 6 MiB of
    objects reach it in many batches of about TLS_WRITE_BATCH, not in one."""
    written: list[int] = []

    async def handler(connection: MOQTConnection) -> None:
        transport = connection._protocol._transport  # type: ignore[attr-defined]
        writelines = transport.writelines

        def counting(buffers: list[bytes]) -> None:
            written.append(sum(len(buffer) for buffer in buffers))
            writelines(buffers)

        transport.writelines = counting
        await publisher(connection)

    async def client(connection: MOQTConnection) -> None:
        response = await connection.fetch(NS, TRACK, Location(0, 0), Location(0, 3))
        objects = [obj async for obj in response.track.objects()]
        assert [bytes(obj.payload) for obj in objects] == OBJECTS

    run(Carrier("tls", certs, tmp_path), client, handler=handler)
    assert sum(written) > 3 * OBJECT
    assert max(written) <= 2 * TLS_WRITE_BATCH, written
    assert len([size for size in written if size >= TLS_WRITE_BATCH // 2]) >= 12


@pytest.mark.parametrize("carrier", ["tcp", "unix"])
def test_a_client_that_never_sets_up_is_dropped_at_the_setup_timeout(
    carrier: str, tmp_path: Path
) -> None:
    if carrier == "unix":
        endpoint = QMuxEndpoint("unix", None, None, str(tmp_path / "q.sock"))
    else:
        endpoint = QMuxEndpoint("tcp", "127.0.0.1", 0)

    async def main() -> list[MOQTConnection]:
        async with listening(endpoint, setup_timeout=0.3) as (server, reached):
            address = server.address
            if isinstance(address, str):
                reader, writer = await asyncio.open_unix_connection(address)
            else:
                reader, writer = await asyncio.open_connection(*address)
            # the server's transport parameters arrive, then nothing but the end: no SETUP
            # was sent, so the server aborts the carrier
            with contextlib.suppress(ConnectionResetError):
                while await asyncio.wait_for(reader.read(65536), 30):
                    pass
            writer.close()
            await released(server)
            return reached

    assert asyncio.run(main()) == []
