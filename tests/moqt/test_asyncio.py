"""moqt.asyncio: MOQT over real UDP on 127.0.0.1, for each QUIC backend installed."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from kvsp.moqt_mapping import find_layer_digest, layer_digest_extension
from moqt.asyncio import (
    MOQTConnection,
    RequestRejected,
    SessionClosedError,
    connect,
    serve,
)
from moqt.backend import available_backends, get_backend, initial_padded_outside_packets
from moqt.certs import make_self_signed
from moqt.errors import ListenError, PublishDoneCode, RequestErrorCode, listening
from moqt.messages import StandaloneFetch
from moqt.session_events import (
    DataStreamFinished,
    FetchReceived,
    FetchStreamOpened,
    ObjectHeader,
    SessionClosed,
    SubscribeReceived,
)
from moqt.wire import Location
from tests.support.backends import BACKENDS, NEEDS_QH3
from tests.support.polling import until

NS = (b"kvsp", b"1", b"c0", b"s0", b"k0")
TRACK = b"d" * 64
LAYER = 64 * 1024
LAYERS = [hashlib.sha256(b"layer%d" % i).digest() * (LAYER // 32) for i in range(32)]
BLOCK = b"".join(LAYERS)  # 2 MiB
MANY = b"many-groups"  # one stream per group, more than the peer's stream limit
STREAMS = 300
ENDLESS = b"endless"  # a group every few milliseconds until the subscriber leaves


@pytest.fixture(scope="module")
def cert_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_self_signed("localhost", tmp_path_factory.mktemp("certs"))


async def publisher(connection: MOQTConnection) -> None:
    """Serve FETCH of LAYERS and SUBSCRIBE of 4 layers; refuse other tracks."""
    async for event in connection.requests():
        if isinstance(event, FetchReceived):
            await serve_fetch(connection, event)
        elif isinstance(event, SubscribeReceived):
            await serve_subscribe(connection, event)


async def serve_fetch(connection: MOQTConnection, event: FetchReceived) -> None:
    target = event.message.target
    if not isinstance(target, StandaloneFetch) or target.track_name != TRACK:
        connection.session.request_error(event.request_id, RequestErrorCode.DOES_NOT_EXIST)
        connection.transmit()
        return
    first, last = target.start.object, target.end.object - 1
    connection.session.fetch_ok(event.request_id, end_location=Location(0, last))
    stream_id = await connection.open_fetch_stream(event.request_id)
    for index in range(first, last + 1):
        extension = layer_digest_extension(hashlib.sha256(LAYERS[index]).digest())
        await connection.send_fetch_object(
            stream_id,
            group_id=0,
            object_id=index,
            payload=memoryview(LAYERS[index]),
            extensions=[extension],
            end_stream=index == last,
        )


async def serve_subscribe(connection: MOQTConnection, event: SubscribeReceived) -> None:
    if event.message.track_name == MANY:
        await serve_many_groups(connection, event.request_id)
        return
    if event.message.track_name == ENDLESS:
        await serve_until_unsubscribed(connection, event.request_id)
        return
    if event.message.track_name != TRACK:
        connection.session.request_error(event.request_id, RequestErrorCode.DOES_NOT_EXIST, "no")
        connection.transmit()
        return
    connection.session.subscribe_ok(event.request_id)
    stream_id = await connection.open_subgroup(event.request_id, 0, end_of_group=True)
    for index in range(4):
        await connection.send_object(stream_id, index, LAYERS[index], end_stream=index == 3)
    connection.session.publish_done(event.request_id, PublishDoneCode.TRACK_ENDED)
    connection.transmit()


async def serve_many_groups(connection: MOQTConnection, request_id: int) -> None:
    connection.session.subscribe_ok(request_id)
    for group in range(STREAMS):
        if request_id not in connection.session.requests:
            return  # the subscriber left
        stream_id = await connection.open_subgroup(request_id, group)
        await connection.send_object(stream_id, 0, b"g%d" % group, end_stream=True)
    connection.session.publish_done(request_id, PublishDoneCode.TRACK_ENDED)
    connection.transmit()


async def serve_until_unsubscribed(connection: MOQTConnection, request_id: int) -> None:
    connection.session.subscribe_ok(request_id)
    group = 0
    while request_id in connection.session.requests:
        stream_id = await connection.open_subgroup(request_id, group)
        await connection.send_object(stream_id, 0, b"g%d" % group, end_stream=True)
        group += 1
        await asyncio.sleep(0.005)


def run_client(
    backend: str,
    certs: tuple[Path, Path],
    client: Callable[[MOQTConnection], Awaitable[None]],
    *,
    client_backend: str | None = None,
    handler: Callable[[MOQTConnection], Awaitable[None]] = publisher,
) -> None:
    """Serve ``handler`` (:func:`publisher`) with ``backend`` and run ``client`` against it
    (connected with ``client_backend``, the same one by default)."""
    client_backend = client_backend or backend

    async def main() -> None:
        quic = get_backend(backend)
        cert, key = certs
        server_config = quic.configuration(
            is_client=False, certificate=str(cert), private_key=str(key)
        )
        server = await serve(
            "127.0.0.1", 0, configuration=server_config, handler=handler, backend=backend
        )
        try:
            client_config = get_backend(client_backend).configuration(
                is_client=True, cafile=str(cert), server_name="localhost"
            )
            host, port = server.address
            async with connect(
                host, port, configuration=client_config, backend=client_backend, path="/kvsp"
            ) as connection:
                await asyncio.wait_for(client(connection), 20)
        finally:
            server.close()

    asyncio.run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_quic_listener_on_a_port_in_use_says_where(
    backend: str, cert_pair: tuple[Path, Path]
) -> None:
    busy = socket.socket(type=socket.SOCK_DGRAM)
    busy.bind(("127.0.0.1", 0))
    port = busy.getsockname()[1]
    cert, key = cert_pair
    config = get_backend(backend).configuration(
        is_client=False, certificate=str(cert), private_key=str(key)
    )

    async def main() -> None:
        with pytest.raises(ListenError) as caught:
            await serve("127.0.0.1", port, configuration=config, handler=publisher, backend=backend)
        assert str(caught.value) == (
            f"cannot listen for MOQT over QUIC on 127.0.0.1:{port}: address already in use"
        )

    try:
        asyncio.run(main())
    finally:
        busy.close()


def test_a_listen_error_writes_v6_hosts_in_brackets_and_keeps_its_own_reason() -> None:
    with pytest.raises(ListenError) as caught, listening("HTTP", ("::1", 8080)):
        raise OSError(errno.EACCES, "Permission denied")
    assert str(caught.value) == "cannot listen for HTTP on [::1]:8080: permission denied"
    assert isinstance(caught.value, OSError)
    inner = ListenError("MOQT over QUIC", "127.0.0.1:1", "address already in use")
    with pytest.raises(ListenError) as again, listening("HTTP", "elsewhere"):
        raise inner
    assert again.value is inner


@pytest.mark.parametrize("backend", BACKENDS)
def test_fetch_a_2_mib_block_byte_exact(backend: str, cert_pair: tuple[Path, Path]) -> None:
    async def client(connection: MOQTConnection) -> None:
        response = await connection.fetch(NS, TRACK, Location(0, 0), Location(0, 32))
        assert response.ok.end_location == Location(0, 31)
        objects = [obj async for obj in response.track.objects()]
        assert [obj.object_id for obj in objects] == list(range(32))
        for obj in objects:
            assert find_layer_digest(obj.extensions) == hashlib.sha256(obj.payload).digest()
        assert b"".join(obj.payload for obj in objects) == BLOCK

    run_client(backend, cert_pair, client)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fetch_into_sinks_wakes_the_reader_only_for_stream_events(
    backend: str, cert_pair: tuple[Path, Path]
) -> None:
    async def client(connection: MOQTConnection) -> None:
        buffer = bytearray(len(BLOCK))
        starts = {i: i * LAYER for i in range(32)}
        ended: list[int] = []

        def sink(header: ObjectHeader, data: memoryview, offset: int) -> None:
            at = starts[header.object_id] + offset
            buffer[at : at + len(data)] = data

        def object_end(header: ObjectHeader) -> None:
            payload = buffer[starts[header.object_id] :][:LAYER]
            assert find_layer_digest(header.object.extensions) == hashlib.sha256(payload).digest()
            ended.append(header.object_id)

        response = await connection.fetch(
            NS, TRACK, Location(0, 0), Location(0, 32), payload_sink=sink, object_end=object_end
        )
        kinds = [type(event) async for event in response.track.events()]
        assert kinds == [FetchStreamOpened, DataStreamFinished]
        assert ended == list(range(32))
        assert buffer == BLOCK
        ended.clear()
        again = await connection.fetch(
            NS, TRACK, Location(0, 0), Location(0, 32), payload_sink=sink, object_end=object_end
        )
        await again.track.finished()  # the same, waited for without reading the track
        assert ended == list(range(32)) and buffer == BLOCK

    run_client(backend, cert_pair, client)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_large_object_on_an_idle_stream_is_sent_at_once(
    backend: str, cert_pair: tuple[Path, Path]
) -> None:
    """The first piece of a large payload written to a new stream is transmitted before the
    writer goes on (the first packets leave while the rest is queued); a write to a stream
    that still holds data, or a small one, waits for the end of the loop iteration."""
    calls = [0]  # transmit calls so far
    transmits: list[int] = []  # those made while each write ran

    async def handler(connection: MOQTConnection) -> None:
        original = connection.transmit

        def counted() -> None:
            calls[0] += 1
            original()

        connection.transmit = counted  # type: ignore[method-assign]
        served = [[LAYERS[0], LAYERS[1], b"small"], [b"x" * 100]]  # the second: idle but small
        async for event in connection.requests():
            if not isinstance(event, FetchReceived):
                continue
            payloads = served.pop(0)
            last = len(payloads) - 1
            connection.session.fetch_ok(event.request_id, end_location=Location(0, last))
            stream_id = await connection.open_fetch_stream(event.request_id)
            for index, payload in enumerate(payloads):
                before = calls[0]
                end = index == last
                await connection.send_fetch_object(
                    stream_id, group_id=0, object_id=index, payload=payload, end_stream=end
                )
                transmits.append(calls[0] - before)

    async def client(connection: MOQTConnection) -> None:
        for expected in ([LAYERS[0], LAYERS[1], b"small"], [b"x" * 100]):
            response = await connection.fetch(NS, TRACK, Location(0, 0), Location(0, 3))
            assert [bytes(obj.payload) async for obj in response.track.objects()] == expected

    run_client(backend, cert_pair, client, handler=handler)
    # the first 64 KiB go out at once; the initial congestion window leaves the stream busy
    assert transmits == [1, 0, 0, 0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_subscribe_until_publish_done(backend: str, cert_pair: tuple[Path, Path]) -> None:
    async def client(connection: MOQTConnection) -> None:
        subscription = await connection.subscribe(NS, TRACK)
        objects = [obj async for obj in subscription.track.objects()]
        assert [bytes(obj.payload) for obj in objects] == LAYERS[:4]

    run_client(backend, cert_pair, client)


@pytest.mark.parametrize("backend", BACKENDS)
def test_refused_requests_raise(backend: str, cert_pair: tuple[Path, Path]) -> None:
    async def client(connection: MOQTConnection) -> None:
        with pytest.raises(RequestRejected) as info:
            await connection.subscribe(NS, b"missing")
        assert info.value.error_code == RequestErrorCode.DOES_NOT_EXIST
        with pytest.raises(RequestRejected):
            await connection.fetch(NS, b"missing", Location(0, 0), Location(0, 1))
        connection.close()
        with pytest.raises(SessionClosedError):
            await connection.subscribe(NS, TRACK)

    run_client(backend, cert_pair, client)


@pytest.mark.parametrize("backend", BACKENDS)
def test_more_streams_than_the_peer_allows_at_once(
    backend: str, cert_pair: tuple[Path, Path]
) -> None:
    async def client(connection: MOQTConnection) -> None:
        subscription = await connection.subscribe(NS, MANY)
        groups = [obj.group_id async for obj in subscription.track.objects()]
        assert sorted(groups) == list(range(STREAMS))

    run_client(backend, cert_pair, client)


def test_unsubscribe_ends_the_reader(cert_pair: tuple[Path, Path]) -> None:
    async def client(connection: MOQTConnection) -> None:
        subscription = await connection.subscribe(NS, ENDLESS)
        connection.unsubscribe(subscription.request_id)
        async for _ in subscription.track.objects():
            pass  # whatever arrived before the UNSUBSCRIBE; then the reader ends
        assert subscription.track.ended

    run_client("aioquic", cert_pair, client)


@pytest.mark.parametrize(
    ("server", "client_backend"),
    [
        pytest.param("qh3", "aioquic", marks=NEEDS_QH3, id="qh3-server-aioquic-client"),
        pytest.param("aioquic", "qh3", marks=NEEDS_QH3, id="aioquic-server-qh3-client"),
    ],
)
def test_fetch_a_2_mib_block_across_backends(
    server: str, client_backend: str, cert_pair: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Byte-exact, and without the qh3 server's "packet builder capacity exhausted" (an
    aioquic Initial padded outside its packet starved qh3's anti-amplification budget)."""

    async def client(connection: MOQTConnection) -> None:
        for _ in range(2):
            response = await connection.fetch(NS, TRACK, Location(0, 0), Location(0, 32))
            payload = b"".join([bytes(obj.payload) async for obj in response.track.objects()])
            assert payload == BLOCK

    caplog.set_level(logging.ERROR)
    run_client(server, cert_pair, client, client_backend=client_backend)
    errors = [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]
    assert errors == []


@pytest.mark.parametrize(("backend", "padded"), [("aioquic", True), ("qh3", False)])
def test_initial_padded_outside_packets(
    backend: str, padded: bool, cert_pair: tuple[Path, Path]
) -> None:
    if backend not in available_backends():
        pytest.skip(f"{backend} not installed")
    quic = get_backend(backend)
    config = quic.configuration(is_client=True, cafile=str(cert_pair[0]), server_name="localhost")
    connection = quic.QuicConnection(configuration=config)
    connection.connect(("127.0.0.1", 4433), now=0.0)
    datagrams = [data for data, _ in connection.datagrams_to_send(now=0.0)]
    assert [initial_padded_outside_packets(data) for data in datagrams] == [padded] * len(datagrams)
    assert not initial_padded_outside_packets(b"")
    assert not initial_padded_outside_packets(bytes(1200))  # no long header: not an Initial


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_session_ends_once_its_peer_s_connection_close_is_read(
    backend: str, cert_pair: tuple[Path, Path]
) -> None:
    """The QUIC libraries report a peer's CONNECTION_CLOSE (``ConnectionTerminated``) only once
    the connection has drained, three PTOs later (RFC 9000 §10.2.2); the session must end when
    the close is read, so that a request made meanwhile fails with SessionClosedError (which a
    relay takes to route it elsewhere) instead of raising the library's "connection is closed"
    (qh3) or waiting for a reply that cannot come."""
    served: list[MOQTConnection] = []
    at_close: list[SessionClosed | None] = []  # the session's state once the close was read

    async def handler(connection: MOQTConnection) -> None:
        await connection.wait_setup()
        protocol = connection._protocol
        receive = protocol.datagram_received

        def watched(data: bytes, addr: object) -> None:
            receive(data, addr)
            # both libraries note the peer's CONNECTION_CLOSE as the connection's _close_event
            if not at_close and protocol._quic._close_event is not None:
                at_close.append(connection.session.closed)

        protocol.datagram_received = watched
        served.append(connection)
        await connection.wait_closed()

    async def client(connection: MOQTConnection) -> None:
        server_side = (await until(lambda: served, what="the server's session"))[0]
        connection.close()
        await until(lambda: at_close, what="the server to read the client's CONNECTION_CLOSE")
        closed = at_close[0]
        assert closed is not None, "the session still looked open after the peer's close"
        assert closed.by_peer and closed.error_code == 0
        with pytest.raises(SessionClosedError):
            await server_side.subscribe(NS, TRACK)

    run_client(backend, cert_pair, client, handler=handler)
