"""moqt.qmux_tls: TLS 1.3 with its records on a worker thread or inline on the loop, on real
sockets (127.0.0.1), and moqt._tlsrecords (records decrypted in bulk) on an in-memory pair.

A large transfer both ways under random chunking (with buffers the writer changes right after
handing them over), the endings (close_notify, TCP EOF without it, garbage after the handshake),
handshake failures raising what asyncio's TLS transport raises, back-pressure from a reader that
stops, the worker thread ending with its connection, and the same without the C reader; and
which side protects the records after the handshake (moqt._tlsrecords.Records inline, with
AES-128-GCM first among the suites a context enables; OpenSSL on the thread engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, get_args

import pytest

from moqt import qmux_tls
from moqt.asyncio import MOQTConnection
from moqt.certs import make_self_signed
from moqt.qmux_asyncio import (
    QMuxEndpoint,
    ReceiveBuffers,
    TLSEngine,
    client_ssl_context,
    connect_qmux,
    serve_qmux,
    server_ssl_context,
)
from moqt.qmux_tls import TLSWorkerTransport, open_tls_connection, serve_tls
from tests.support.qmux_servers import listening, released
from tests.support.tls_peer import Peer

MiB = 1 << 20


@pytest.fixture(params=[True, False], ids=["thread", "inline"])
def threaded(request: pytest.FixtureRequest) -> bool:
    """Whether the records run on a worker thread or inline on the event loop."""
    return bool(request.param)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    cert, key = make_self_signed("localhost", tmp_path_factory.mktemp("tls-certs"))
    return str(cert), str(key)


Body = Callable[[TLSWorkerTransport, Peer, list[Peer]], Awaitable[None]]


def run(
    certs: tuple[str, str], body: Body, threaded: bool = True, **server_peer: bool
) -> list[Peer]:
    """Serve Peer(**server_peer) with TLS (records on a worker thread or inline), connect a
    client Peer, run ``body``."""
    cert, key = certs
    served: list[Peer] = []

    async def main() -> None:
        def factory() -> tuple[asyncio.BaseProtocol, ReceiveBuffers]:
            peer = Peer(**server_peer)
            served.append(peer)
            return peer, ReceiveBuffers()

        server = await serve_tls(
            factory, "127.0.0.1", 0, context=server_ssl_context(cert, key), threaded=threaded
        )
        port = server.sockets[0].getsockname()[1]
        try:
            client = Peer()
            tls = await open_tls_connection(
                client,
                "127.0.0.1",
                port,
                context=client_ssl_context(cafile=cert),
                server_hostname="localhost",
                plain_buffers=ReceiveBuffers(),
                threaded=threaded,
            )
            await asyncio.wait_for(body(tls, client, served), 60)
            for peer in served:  # the server's side closes too (its socket flushed first)
                await asyncio.wait_for(peer.lost, 10)
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(main())
    return served


async def ended(thread_owner: TLSWorkerTransport) -> None:
    """Wait until the transport's worker thread has ended (inline: its records stopped)."""
    thread = thread_owner.worker_thread
    if thread is None:
        for _ in range(1000):
            if thread_owner._worker._stopped:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the inline records never stopped")
    await asyncio.get_running_loop().run_in_executor(None, thread.join, 10)
    assert not thread.is_alive()


def test_large_transfer_both_ways_under_random_chunking(
    certs: tuple[str, str], threaded: bool
) -> None:
    rng = random.Random(20)
    data = rng.randbytes(24 * MiB)

    async def body(tls: TLSWorkerTransport, client: Peer, served: list[Peer]) -> None:
        assert tls.get_extra_info("alpn_protocol") == "qmux-01.moqt-16"
        assert tls.get_extra_info("tls_version") == "TLSv1.3"
        staging = bytearray(2 * MiB)  # reused for every write, as a caller may
        at = 0
        while at < len(data):
            await client.writable.wait()
            pieces = []
            for _ in range(rng.randint(1, 6)):
                size = min(rng.choice((1, 7, 100, 16384, 16385, 70000, 300000)), len(data) - at)
                pieces.append(data[at : at + size])
                at += size
            joined = b"".join(pieces)
            staging[: len(joined)] = joined
            views = []
            offset = 0
            for piece in pieces:  # views of the staging buffer, overwritten right after
                views.append(memoryview(staging)[offset : offset + len(piece)])
                offset += len(piece)
            tls.writelines(views)
            staging[: len(joined)] = bytes(len(joined))
            del views
        while len(client.received) < len(data):
            await asyncio.sleep(0.01)
        tls.close()
        assert await client.lost is None
        await ended(tls)

    served = run(certs, body, threaded, echo=True)
    assert hashlib.sha256(served[0].received).digest() == hashlib.sha256(data).digest()


def test_close_notify_ends_both_sides_cleanly(certs: tuple[str, str], threaded: bool) -> None:
    async def body(tls: TLSWorkerTransport, client: Peer, served: list[Peer]) -> None:
        tls.write(b"last words")
        tls.close()
        assert await client.lost is None
        assert await served[0].lost is None
        assert served[0].events == ["made", "eof", "lost"]
        assert bytes(served[0].received) == b"last words"
        await ended(tls)

    run(certs, body, threaded)


def test_a_close_with_unread_data_queued_ends_cleanly(
    certs: tuple[str, str], threaded: bool
) -> None:
    """The closing side reads on after its close_notify and FIN: a socket closed with bytes
    still queued is reset, and the peer would see ECONNRESET instead of the close."""

    async def body(tls: TLSWorkerTransport, client: Peer, served: list[Peer]) -> None:
        tls.pause_reading()  # what the server sends stays queued at the client
        while not served or served[0].transport is None:
            await asyncio.sleep(0.01)
        served[0].transport.write(bytes(4 * MiB))
        await asyncio.sleep(0.3)
        assert len(client.received) < 4 * MiB
        tls.close()
        assert await served[0].lost is None
        assert served[0].events == ["made", "eof", "lost"]
        assert await client.lost is None
        await ended(tls)

    run(certs, body, threaded)


def test_abrupt_eof_without_close_notify_is_an_eof(certs: tuple[str, str], threaded: bool) -> None:
    async def body(tls: TLSWorkerTransport, client: Peer, served: list[Peer]) -> None:
        tls.write(b"x" * 100_000)
        while len(served) < 1 or len(served[0].received) < 100_000:
            await asyncio.sleep(0.01)
        sock = tls._sock
        assert sock is not None
        sock.close()  # TCP FIN, no close_notify
        assert await served[0].lost is None
        assert served[0].events == ["made", "eof", "lost"]
        await ended(tls)

    run(certs, body, threaded)


def test_garbage_after_the_handshake_fails_with_an_ssl_error(
    certs: tuple[str, str], threaded: bool
) -> None:
    async def body(tls: TLSWorkerTransport, client: Peer, served: list[Peer]) -> None:
        while not served or "made" not in served[0].events:
            await asyncio.sleep(0.01)
        sock = tls._sock
        assert sock is not None
        sock.write(b"\x17\x03\x03\x00\x40" + bytes(range(64)))  # a record nobody sealed
        error = await served[0].lost
        assert isinstance(error, ssl.SSLError)
        await client.lost  # the client sees its connection end too
        await ended(tls)

    run(certs, body, threaded)


def test_a_stalled_reader_bounds_the_writer(certs: tuple[str, str], threaded: bool) -> None:
    chunk = bytes(MiB)
    total = 256 * MiB

    async def body(tls: TLSWorkerTransport, client: Peer, served: list[Peer]) -> None:
        high = 4 * MiB
        tls.set_write_buffer_limits(high=high)
        written = 0
        stalled = False
        while written < total:
            if not client.writable.is_set():
                try:  # paused: the reader's side resumes it only if it reads again
                    await asyncio.wait_for(client.writable.wait(), 1.0)
                except TimeoutError:
                    stalled = True
                    break
            tls.write(chunk)
            written += len(chunk)
            assert tls.get_write_buffer_size() <= high + 2 * len(chunk)  # TLS overhead
        assert stalled and written < total  # the writer had to stop; nothing unbounded queued
        peer = served[0]
        assert peer.transport is not None
        peer.transport.resume_reading()
        while written < 32 * MiB:
            await client.writable.wait()
            tls.write(chunk)
            written += len(chunk)
        while len(peer.received) < written:
            await asyncio.sleep(0.01)
        assert len(peer.received) == written
        tls.close()
        await client.lost

    run(certs, body, threaded, paused=True)


@pytest.mark.parametrize("engine", get_args(TLSEngine))
def test_handshake_with_an_untrusted_certificate_is_a_verification_error(
    certs: tuple[str, str], tmp_path: Path, engine: TLSEngine
) -> None:
    cert, key = certs
    other, _ = make_self_signed("localhost", tmp_path)  # a CA that did not sign the server's

    async def main() -> list[MOQTConnection]:
        async with listening(
            QMuxEndpoint("tls", "127.0.0.1", 0),
            ssl_context=server_ssl_context(cert, key),
            tls_engine=engine,
            setup_timeout=120,  # the server lets go of the connection long before this
        ) as (server, reached):
            address = server.address
            assert isinstance(address, tuple)
            host, port = address
            with pytest.raises(ssl.SSLCertVerificationError):
                async with connect_qmux(
                    QMuxEndpoint("tls", host, port),
                    ssl_context=client_ssl_context(cafile=str(other)),
                    server_hostname="localhost",
                    tls_engine=engine,
                ):
                    pass
            await asyncio.wait_for(released(server), 30)  # the server's side ends too, at once
            return reached

    assert asyncio.run(main()) == []


@pytest.mark.parametrize("engine", get_args(TLSEngine))
@pytest.mark.parametrize("says", [b"", b"\x16\x03\x01"], ids=["nothing", "half-a-hello"])
def test_a_client_that_never_finishes_the_handshake_is_dropped_at_the_setup_timeout(
    certs: tuple[str, str], engine: TLSEngine, says: bytes
) -> None:
    cert, key = certs

    async def main() -> list[MOQTConnection]:
        async with listening(
            QMuxEndpoint("tls", "127.0.0.1", 0),
            ssl_context=server_ssl_context(cert, key),
            tls_engine=engine,
            setup_timeout=0.3,
        ) as (server, reached):
            address = server.address
            assert isinstance(address, tuple)
            reader, writer = await asyncio.open_connection(*address)
            writer.write(says)
            await writer.drain()
            with contextlib.suppress(ConnectionResetError):  # the server closed the socket
                assert await asyncio.wait_for(reader.read(), 30) == b""
            writer.close()
            await released(server)
            return reached

    assert asyncio.run(main()) == []


def test_the_worker_thread_ends_with_a_qmux_connection(certs: tuple[str, str]) -> None:
    cert, key = certs
    transports: list[TLSWorkerTransport] = []

    async def handler(connection: MOQTConnection) -> None:
        transport = connection._protocol._transport
        assert isinstance(transport, TLSWorkerTransport)
        transports.append(transport)
        await connection.wait_closed()

    async def main() -> None:
        server = await serve_qmux(
            QMuxEndpoint("tls", "127.0.0.1", 0),
            handler=handler,
            ssl_context=server_ssl_context(cert, key),
            tls_engine="thread",
        )
        address = server.address
        assert isinstance(address, tuple)
        host, port = address
        try:
            async with connect_qmux(
                QMuxEndpoint("tls", host, port),
                ssl_context=client_ssl_context(cafile=cert),
                server_hostname="localhost",
                tls_engine="thread",
            ) as connection:
                client = connection._protocol._transport
                assert isinstance(client, TLSWorkerTransport)
                transports.append(client)
                thread = client.worker_thread
                assert thread is not None and thread.is_alive()
            for transport in transports:
                await ended(transport)
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(main())
    assert len(transports) == 2


def test_the_inline_records_work_without_the_c_reader(
    certs: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where moqt._tlsrecords is not built, SSLObject.read does the records, one a call."""
    monkeypatch.setattr(qmux_tls, "_tlsrecords", None)
    data = random.Random(7).randbytes(3 * MiB + 5)

    async def body(tls: TLSWorkerTransport, client: Peer, served: list[Peer]) -> None:
        assert tls._worker._records is None
        tls.write(data)
        while len(client.received) < len(data):
            await asyncio.sleep(0.01)
        tls.close()
        await client.lost

    run(certs, body, False, echo=True)


# --- moqt._tlsrecords on an in-memory pair ----------------------------------------------------


class Pair:
    """A TLS 1.3 client and server over memory BIOs, handshake done."""

    def __init__(self, certs: tuple[str, str]) -> None:
        cert, key = certs
        self.server_in, self.server_out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.client_in, self.client_out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.server = server_ssl_context(cert, key).wrap_bio(
            self.server_in, self.server_out, server_side=True
        )
        self.client = client_ssl_context(cafile=cert).wrap_bio(
            self.client_in, self.client_out, server_hostname="localhost"
        )
        for _ in range(4):
            for side in (self.client, self.server):
                with contextlib.suppress(ssl.SSLWantReadError):
                    side.do_handshake()
            self.server_in.write(self.client_out.read())
            self.client_in.write(self.server_out.read())
        assert self.client.version() == "TLSv1.3"

    def sealed(self, data: bytes) -> bytes:
        """``data`` as the server's records, with any tickets it had queued before."""
        self.server.write(data)
        return self.server_out.read()


@pytest.fixture
def records() -> Any:
    return pytest.importorskip("moqt._tlsrecords", reason="moqt._tlsrecords is not built")


def test_bind_accepts_the_object_and_refuses_another_bio(
    certs: tuple[str, str], records: Any
) -> None:
    pair = Pair(certs)
    raw = pair.client._sslobj  # type: ignore[attr-defined]
    assert records.bind(raw, pair.client_in, pair.client.version())
    assert not records.bind(raw, pair.server_in, pair.client.version())  # not its BIO
    assert not records.bind(raw, pair.client_in, "TLSv1.2")  # not what _ssl reports
    with pytest.raises(TypeError):
        records.bind(pair.client, pair.client_in, "TLSv1.3")  # the Python wrapper
    with pytest.raises(TypeError):
        records.bind(raw, b"not a bio", "TLSv1.3")


def test_bulk_reads_match_the_stream_under_any_chunking(
    certs: tuple[str, str], records: Any
) -> None:
    pair = Pair(certs)
    raw = pair.client._sslobj  # type: ignore[attr-defined]
    assert records.bind(raw, pair.client_in, "TLSv1.3")
    rng = random.Random(3)
    data = rng.randbytes(MiB + 12345)
    wire = pair.sealed(data)
    out = bytearray(len(data) + 10)
    view = memoryview(out)
    got, at = 0, 0
    statuses = set()
    while at < len(wire):
        size = rng.choice((1, 5, 100, 16389, 70000))
        piece = wire[at : at + size]
        at += len(piece)
        room = rng.choice((0, 1, 3000, 1 << 20))
        count, status = records.read(raw, pair.client_in, piece, view[got : got + room])
        got += count
        statuses.add(status)
        while status == records.MORE and room:  # the room was filled: read on
            count, status = records.read(raw, pair.client_in, b"", view[got : got + room])
            got += count
    count, status = records.read(raw, pair.client_in, b"", view[got:])
    got += count
    assert status == records.NEED
    assert bytes(out[:got]) == data
    assert {records.MORE, records.NEED} <= statuses


def test_bulk_read_reports_close_notify(certs: tuple[str, str], records: Any) -> None:
    pair = Pair(certs)
    raw = pair.client._sslobj  # type: ignore[attr-defined]
    assert records.bind(raw, pair.client_in, "TLSv1.3")
    wire = pair.sealed(b"bye")
    with contextlib.suppress(ssl.SSLWantReadError):
        pair.server.unwrap()
    wire += pair.server_out.read()
    out = bytearray(64)
    assert records.read(raw, pair.client_in, wire, out) == (3, records.CLOSED)
    assert bytes(out[:3]) == b"bye"


def test_bulk_read_of_a_tampered_record_is_an_ssl_error(
    certs: tuple[str, str], records: Any
) -> None:
    pair = Pair(certs)
    raw = pair.client._sslobj  # type: ignore[attr-defined]
    assert records.bind(raw, pair.client_in, "TLSv1.3")
    wire = bytearray(pair.sealed(b"x" * 40000))
    wire[-20] ^= 1  # inside the last record's ciphertext or tag
    out = bytearray(65536)
    with pytest.raises(ssl.SSLError) as caught:
        records.read(raw, pair.client_in, bytes(wire), out)
    assert "decrypt" in str(caught.value).lower() or "mac" in str(caught.value).lower()
    with pytest.raises(TypeError):
        records.read(raw, pair.client_in, b"", b"read-only out")


# --- who protects the records after the handshake, with which suite ---------------------------


class Context:
    """What _preferred_suites reads of an ssl.SSLContext."""

    def __init__(self, *names: str) -> None:
        self.ciphers = [{"name": n, "protocol": "TLSv1.3"} for n in names]
        self.ciphers.append({"name": "ECDHE-RSA-AES128-GCM-SHA256", "protocol": "TLSv1.2"})

    def get_ciphers(self) -> list[dict[str, Any]]:
        return self.ciphers


@pytest.mark.parametrize(
    ("enabled", "expected"),
    [
        (
            ("TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256", "TLS_AES_128_GCM_SHA256"),
            "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256",
        ),
        (  # a policy without AES-128-GCM keeps it out
            ("TLS_CHACHA20_POLY1305_SHA256", "TLS_AES_256_GCM_SHA384"),
            "TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256",
        ),
        (  # one we do not rank stays enabled, after ours
            ("TLS_AES_128_CCM_SHA256", "TLS_AES_128_GCM_SHA256"),
            "TLS_AES_128_GCM_SHA256:TLS_AES_128_CCM_SHA256",
        ),
    ],
)
def test_the_preference_reorders_what_the_context_enables_and_adds_nothing(
    enabled: tuple[str, ...], expected: str
) -> None:
    context = Context(*enabled)
    assert qmux_tls._preferred_suites(context) == expected  # type: ignore[arg-type]
    context.ciphers.clear()  # kept per context: asked once
    assert qmux_tls._preferred_suites(context) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("threaded", [False, True], ids=["inline", "thread"])
def test_who_protects_the_records_after_the_handshake(
    certs: tuple[str, str], threaded: bool
) -> None:
    if not threaded:
        pytest.importorskip("moqt._tlsrecords", reason="moqt._tlsrecords is not built")
    data = bytes(range(256)) * 4096  # 1 MiB, echoed

    async def body(tls: TLSWorkerTransport, client: Peer, served: list[Peer]) -> None:
        tls.write(data)
        while len(client.received) < len(data):
            await asyncio.sleep(0.01)
        server = served[0].transport
        assert server is not None
        for side in (tls, server):
            assert (side._worker._sealed is not None) is not threaded
            if not threaded:
                assert side.get_extra_info("cipher")[0] == "TLS_AES_128_GCM_SHA256"
        tls.close()
        assert await client.lost is None

    run(certs, body, threaded, echo=True)
