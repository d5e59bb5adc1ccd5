"""The QUIC shell reads datagrams in batches and transmits once per batch per connection:
aioquic on :mod:`moqt.udp_endpoint`'s endpoint (client and server). Real QUIC connections on
127.0.0.1."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from moqt.asyncio import MOQTConnection, MOQTServer, connect, serve
from moqt.backend import get_backend
from moqt.certs import make_self_signed
from moqt.messages import StandaloneFetch
from moqt.session_events import FetchReceived
from moqt.transport import SEND_BATCH, protocol_class, transport_socket
from moqt.udp_endpoint import (
    RECEIVE_BATCH,
    BatchedDatagramTransport,
    TransmitBatch,
    open_batched_endpoint,
)
from moqt.wire import Location
from tests.support.backends import BACKENDS, NEEDS_QH3
from tests.support.polling import until

NS = (b"batching",)
TRACK = b"blocks"
LAYER = 64 * 1024
LAYERS = [hashlib.sha256(b"layer%d" % i).digest() * (LAYER // 32) for i in range(32)]
BLOCK = b"".join(LAYERS)  # 2 MiB
PINGS = 40  # per client; two clients' pings are more than one batch holds


Held = list[tuple[bytes, Any]]
Reads = list[list[tuple[int, int]]]  # per read, per server connection: (received, transmits)


@pytest.fixture(scope="module")
def cert_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_self_signed("localhost", tmp_path_factory.mktemp("certs"))


class HeldSocket:
    """The server's socket for one test read: ``recvfrom`` hands out datagrams taken from the
    real socket earlier (real source addresses), then would block; sending goes to the real
    socket."""

    def __init__(self, real: socket.socket, held: Held) -> None:
        self.real = real
        self.held = list(held)

    def recvfrom(self, size: int) -> tuple[bytes, Any]:
        if not self.held:
            raise BlockingIOError
        return self.held.pop(0)

    def sendto(self, data: bytes, addr: Any) -> int:
        return self.real.sendto(data, addr)


class Counted:
    """One server-side connection's datagrams received and transmits since the last take."""

    def __init__(self, protocol: Any) -> None:
        self.received = self.transmits = 0
        received, transmit = protocol.datagram_received, protocol.transmit

        def counted_received(data: bytes, addr: Any) -> None:
            self.received += 1
            received(data, addr)

        def counted_transmit() -> None:
            self.transmits += 1
            transmit()

        protocol.datagram_received = counted_received
        protocol.transmit = counted_transmit

    def take(self) -> tuple[int, int]:
        counts = (self.received, self.transmits)
        self.received = self.transmits = 0
        return counts


async def hold_datagrams(sock: socket.socket, count: int) -> Held:
    """Take at least ``count`` datagrams from ``sock`` (its endpoint not reading) as they come."""
    held: Held = []

    def take() -> bool:
        while True:
            try:
                held.append(sock.recvfrom(65535))
            except BlockingIOError:
                return len(held) >= count

    await until(take, what=f"{count} datagrams at the server")
    return held


Deliver = Callable[[MOQTServer, Held, list[Counted]], Reads]


async def pings_from_two_clients(
    server_backend: str, certs: tuple[Path, Path], deliver: Deliver
) -> tuple[Held, Reads]:
    """Two aioquic clients send :data:`PINGS` PINGs each (a datagram each) to a server that is
    not reading; ``deliver`` hands the datagrams to the server and says what each read did.
    Every ping is acknowledged afterwards."""
    cert, key = certs
    server_config = get_backend(server_backend).configuration(
        is_client=False, certificate=str(cert), private_key=str(key)
    )
    sessions: list[MOQTConnection] = []

    async def handler(connection: MOQTConnection) -> None:
        sessions.append(connection)
        await connection.wait_closed()

    server = await serve(
        "127.0.0.1", 0, configuration=server_config, handler=handler, backend=server_backend
    )
    host, port = server.address
    client_config = get_backend("aioquic").configuration(
        is_client=True, cafile=str(cert), server_name="localhost"
    )
    try:
        async with (
            connect(host, port, configuration=client_config, backend="aioquic") as first,
            connect(host, port, configuration=client_config, backend="aioquic") as second,
        ):
            await until(lambda: len(sessions) == 2, what="both sessions set up")
            server._transport.pause_reading()
            counted = [Counted(session._protocol) for session in sessions]
            pings = []
            for client in (first, second):
                for _ in range(PINGS):
                    pings.append(asyncio.ensure_future(client._protocol.ping()))
                    await asyncio.sleep(0)  # the ping leaves, in a datagram of its own
            held = await hold_datagrams(transport_socket(server._transport), 2 * PINGS)
            for each in counted:
                each.take()
            reads = deliver(server, held, counted)
            server._transport.resume_reading()
            await asyncio.wait_for(asyncio.gather(*pings), 10)
            return held, reads
    finally:
        server.close()


def one_transmit_per_connection_that_received(reads: Reads) -> bool:
    return all(
        transmits == (1 if received else 0) for read in reads for received, transmits in read
    )


def test_an_aioquic_server_transmits_once_per_batch_per_connection(
    cert_pair: tuple[Path, Path],
) -> None:
    def read_wake_ups(server: MOQTServer, held: Held, counted: list[Counted]) -> Reads:
        transport = server._transport
        assert isinstance(transport, BatchedDatagramTransport)
        real = transport._sock
        stand_in = HeldSocket(real, held)  # type: ignore[arg-type]
        transport._sock = stand_in  # type: ignore[assignment]
        reads = []
        try:
            while stand_in.held:
                transport._read_ready()  # one readable wake-up
                reads.append([each.take() for each in counted])
        finally:
            transport._sock = real
        return reads

    held, reads = asyncio.run(pings_from_two_clients("aioquic", cert_pair, read_wake_ups))
    assert len(held) > RECEIVE_BATCH  # both clients' pings, more than one batch
    assert [sum(r for r, _ in read) for read in reads][:-1] == [RECEIVE_BATCH] * (len(reads) - 1)
    assert sum(r for read in reads for r, _ in read) == len(held)
    assert one_transmit_per_connection_that_received(reads)
    # the first batch held the first client's pings whole: one transmit, one ACK, for all
    assert max(received for received, _ in reads[0]) >= PINGS


class Recorder(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.lost: list[Exception | None] = []

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.append(exc)


class FullThenDraining:
    """A socket whose send buffer is full (``BlockingIOError``) until ``full`` is cleared."""

    def __init__(self, real: socket.socket) -> None:
        self.real = real
        self.full = True

    def sendto(self, data: bytes, addr: Any) -> int:
        if self.full:
            raise BlockingIOError
        return self.real.sendto(data, addr)

    def close(self) -> None:
        self.real.close()


def test_datagrams_the_kernel_refuses_are_queued_and_sent_in_order_then_closed() -> None:
    async def scenario() -> None:
        receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        receiver.bind(("127.0.0.1", 0))
        receiver.setblocking(False)
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", 0))
        protocol = Recorder()
        transport, _ = await open_batched_endpoint(lambda: protocol, sock)
        stand_in = FullThenDraining(sock)
        transport._sock = stand_in  # type: ignore[assignment]
        to = receiver.getsockname()
        transport.sendto(b"first", to)
        transport.sendto(b"second", to)
        assert transport.get_write_buffer_size() == len(b"firstsecond")
        transport.close()  # waits for the queue
        assert protocol.lost == []
        stand_in.full = False
        await until(lambda: protocol.lost == [None], what="the queue sent, then closed")
        assert [receiver.recvfrom(100)[0] for _ in range(2)] == [b"first", b"second"]
        assert transport.get_write_buffer_size() == 0
        assert sock.fileno() == -1
        receiver.close()

    asyncio.run(scenario())


async def serve_blocks(connection: MOQTConnection) -> None:
    async for event in connection.requests():
        if not isinstance(event, FetchReceived):
            continue
        assert isinstance(event.message.target, StandaloneFetch)
        connection.session.fetch_ok(event.request_id, end_location=Location(0, 31))
        stream_id = await connection.open_fetch_stream(event.request_id)
        for index, layer in enumerate(LAYERS):
            await connection.send_fetch_object(
                stream_id, group_id=0, object_id=index, payload=layer, end_stream=index == 31
            )


@pytest.mark.parametrize("backend", BACKENDS)
def test_fetch_2_mib_blocks_byte_exact_over_batched_endpoints(
    backend: str, cert_pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    batches: list[int] = []  # per batch: connections that transmitted
    deferred = [0]  # datagrams whose transmit waited for their batch's end
    defer, end = TransmitBatch.defer, TransmitBatch.end

    def counted_defer(self: TransmitBatch, protocol: Any) -> None:
        deferred[0] += 1
        defer(self, protocol)

    def counted_end(self: TransmitBatch) -> None:
        batches.append(len(self._pending))
        end(self)

    monkeypatch.setattr(TransmitBatch, "defer", counted_defer)
    monkeypatch.setattr(TransmitBatch, "end", counted_end)
    cert, key = cert_pair
    quic = get_backend(backend)
    endpoints: list[Any] = []

    async def main() -> None:
        server = await serve(
            "127.0.0.1",
            0,
            configuration=quic.configuration(
                is_client=False, certificate=str(cert), private_key=str(key)
            ),
            handler=serve_blocks,
            backend=backend,
        )
        endpoints.append(server._transport)
        host, port = server.address
        config = quic.configuration(is_client=True, cafile=str(cert), server_name="localhost")
        try:
            async with connect(host, port, configuration=config, backend=backend) as client:
                endpoints.append(client._protocol._transport)
                for _ in range(3):
                    response = await client.fetch(NS, TRACK, Location(0, 0), Location(0, 32))
                    objects = [obj async for obj in response.track.objects()]
                    assert b"".join(obj.payload for obj in objects) == BLOCK
        finally:
            server.close()

    asyncio.run(asyncio.wait_for(main(), 60))
    if backend == "aioquic":  # qh3 keeps its own datagram dispatch: byte-exact is the check
        assert batches and max(batches) == 1  # one connection each side: one transmit a batch
        assert all(isinstance(endpoint, BatchedDatagramTransport) for endpoint in endpoints)
        # bursts of the sender's packets were read together and acknowledged once
        assert deferred[0] > len(batches)


@NEEDS_QH3
def test_a_qh3_transmit_sends_its_datagrams_in_batches_as_they_are_built(
    cert_pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 2 MiB FETCH leaves the publisher in sends of at most :data:`SEND_BATCH` datagrams,
    several per transmit (qh3's own transmit makes one send of all it built), byte-exact."""
    module: Any = importlib.import_module("qh3.asyncio._transport")
    sends: list[int] = []  # datagrams per send, the server's
    sent = [0]  # bytes in them
    transmits: list[int] = []  # sends per transmit, the server's
    timers: list[bool] = []  # after each: its timer armed for the connection's next deadline
    server_transports: list[Any] = []
    sendto_many = module.OptimizedDatagramTransport.sendto_many

    def counted_sendto_many(self: Any, datagrams: list[bytes], addr: Any = None) -> None:
        if self in server_transports:
            sends.append(len(datagrams))
            sent[0] += sum(map(len, datagrams))
        sendto_many(self, datagrams, addr)

    monkeypatch.setattr(module.OptimizedDatagramTransport, "sendto_many", counted_sendto_many)
    cert, key = cert_pair
    quic = get_backend("qh3")

    async def main() -> None:
        server = await serve(
            "127.0.0.1",
            0,
            configuration=quic.configuration(
                is_client=False, certificate=str(cert), private_key=str(key)
            ),
            handler=serve_blocks,
            backend="qh3",
        )
        server_transports.append(server._transport)
        host, port = server.address
        config = quic.configuration(is_client=True, cafile=str(cert), server_name="localhost")
        try:
            async with connect(host, port, configuration=config, backend="qh3") as client:
                for _ in range(2):
                    response = await client.fetch(NS, TRACK, Location(0, 0), Location(0, 32))
                    objects = [obj async for obj in response.track.objects()]
                    assert b"".join(obj.payload for obj in objects) == BLOCK
        finally:
            server.close()

    protocol = protocol_class(quic)
    transmit = protocol.transmit

    def counted_transmit(self: Any) -> None:
        before = len(sends)
        transmit(self)
        if self._transport in server_transports:
            transmits.append(len(sends) - before)
            timers.append(self._timer_at == self._quic.get_timer())

    monkeypatch.setattr(protocol, "transmit", counted_transmit)
    asyncio.run(asyncio.wait_for(main(), 60))
    assert sent[0] > 2 * len(BLOCK)  # the blocks left through the counted sends
    assert max(sends) <= SEND_BATCH
    assert max(transmits) > 1  # a transmit sent its first batches before building the rest
    assert timers and all(timers)
