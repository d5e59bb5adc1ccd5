"""MOQT goodput on loopback: 2 MiB blocks (32 objects × 64 KiB) by FETCH, beside raw QUIC.

Run: ``.venv/bin/python bench/bench_moqt.py [--seconds S] [--backends aioquic,qh3]``.

For every backend × max_datagram_size the server runs in its own process (so each side has a
core) with both a MOQT server and a raw QUIC server; the client fetches whole blocks one after
another over MOQT (standalone FETCH {0,0}..{0,32}: FETCH_OK plus one fetch stream) and then
reads the same bytes over raw QUIC (one bidi stream per block, the server writing 2 MiB). Both
use the same QUIC settings: the given datagram size, 64 MiB / 32 MiB flow-control windows and
4 MiB socket buffers. Goodput counts payload bytes only. The table gives MOQT/raw and each MOQT
figure against aioquic at its default 1200-byte datagrams.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib
import multiprocessing
import socket
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moqt.asyncio import MOQTConnection, connect, serve, tune_socket  # noqa: E402
from moqt.backend import TransportConfig, available_backends, get_backend  # noqa: E402
from moqt.certs import make_self_signed  # noqa: E402
from moqt.messages import StandaloneFetch  # noqa: E402
from moqt.objects import layer_digest_extension  # noqa: E402
from moqt.session_events import FetchReceived, ObjectData  # noqa: E402
from moqt.wire import Location  # noqa: E402

NS = (b"kvsp", b"1", b"c0", b"s0", b"k0")
TRACK = b"d" * 64
LAYER = 64 * 1024
LAYERS = [hashlib.sha256(b"layer%d" % i).digest() * (LAYER // 32) for i in range(32)]
BLOCK = b"".join(LAYERS)
DIGESTS = [layer_digest_extension(hashlib.sha256(layer).digest()) for layer in LAYERS]
SIZES = (1200, 1452, 9000, 0)  # 0: the largest the backend takes on loopback
LARGEST = {"aioquic": 16384, "qh3": 65000}  # aioquic: 2-byte frame lengths; qh3: UDP on lo


def transport_for(datagram: int) -> TransportConfig:
    return TransportConfig(max_datagram_size=datagram, max_data=64 << 20, max_stream_data=32 << 20)


# --- server process ------------------------------------------------------------------------------


async def moqt_publisher(connection: MOQTConnection) -> None:
    async for event in connection.requests():
        if not isinstance(event, FetchReceived):
            continue
        target = event.message.target
        if not isinstance(target, StandaloneFetch):
            continue
        first, last = target.start.object, target.end.object - 1
        connection.session.fetch_ok(event.request_id, end_location=Location(0, last))
        stream_id = await connection.open_fetch_stream(event.request_id)
        for index in range(first, last + 1):
            await connection.send_fetch_object(
                stream_id,
                group_id=0,
                object_id=index,
                payload=LAYERS[index],
                extensions=[DIGESTS[index]],
                end_stream=index == last,
            )


def raw_protocol(backend: str, *, server: bool) -> type:
    """A plain QuicConnectionProtocol: the server writes ``n`` bytes, the client counts them."""
    base: Any = importlib.import_module(f"{backend}.asyncio.protocol").QuicConnectionProtocol
    events: Any = importlib.import_module(f"{backend}.quic.events")
    view = memoryview(BLOCK)

    def __init__(self: Any, quic: Any, stream_handler: Any = None) -> None:
        base.__init__(self, quic, stream_handler)
        waiters: dict[int, tuple[asyncio.Future[int], list[int]]] = {}
        self.waiters = waiters

    def connection_made(self: Any, transport: Any) -> None:
        base.connection_made(self, transport)
        tune_socket(
            transport.get_extra_info("socket") or getattr(transport, "_sock", None), 4 << 20
        )

    def quic_event_received(self: Any, event: Any) -> None:
        if not isinstance(event, events.StreamDataReceived):
            return
        if server and event.end_stream:
            left = int(event.data)
            while left > 0:
                piece = view[: min(left, len(view))]
                left -= len(piece)
                self._quic.send_stream_data(event.stream_id, piece, end_stream=left == 0)
        elif not server:
            future, count = self.waiters[event.stream_id]
            count[0] += len(event.data)
            if event.end_stream:
                future.set_result(count[0])

    async def fetch(self: Any, size: int) -> int:
        stream_id = self._quic.get_next_available_stream_id()
        future = asyncio.get_running_loop().create_future()
        self.waiters[stream_id] = (future, [0])
        self._quic.send_stream_data(stream_id, b"%d" % size, end_stream=True)
        self.transmit()
        return int(await future)

    namespace = {
        "__init__": __init__,
        "connection_made": connection_made,
        "quic_event_received": quic_event_received,
        "fetch": fetch,
    }
    return type("RawProtocol", (base,), namespace)


async def serve_raw(backend: str, configuration: Any) -> tuple[Any, int]:
    server_module: Any = importlib.import_module(f"{backend}.asyncio.server")
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tune_socket(sock, 4 << 20)
    sock.bind(("127.0.0.1", 0))
    cls = raw_protocol(backend, server=True)
    transport, server = await asyncio.get_running_loop().create_datagram_endpoint(
        lambda: server_module.QuicServer(configuration=configuration, create_protocol=cls),
        sock=sock,
    )
    return server, int(transport.get_extra_info("sockname")[1])


def server_main(backend: str, datagram: int, cert: str, key: str, pipe: Connection) -> None:
    async def main() -> None:
        quic = get_backend(backend)
        transport = transport_for(datagram)

        def config() -> Any:
            return quic.configuration(
                is_client=False, transport=transport, certificate=cert, private_key=key
            )

        moqt_server = await serve(
            "127.0.0.1",
            0,
            configuration=config(),
            handler=moqt_publisher,
            backend=backend,
            transport=transport,
        )
        raw_server, raw_port = await serve_raw(backend, config())
        pipe.send((moqt_server.address[1], raw_port))
        await asyncio.get_running_loop().run_in_executor(None, pipe.recv)
        moqt_server.close()
        raw_server.close()

    asyncio.run(main())


# --- client --------------------------------------------------------------------------------------


async def run_moqt(backend: str, datagram: int, port: int, cert: str, seconds: float) -> float:
    quic = get_backend(backend)
    transport = transport_for(datagram)
    configuration = quic.configuration(
        is_client=True, transport=transport, cafile=cert, server_name="localhost"
    )
    async with connect(
        "127.0.0.1", port, configuration=configuration, backend=backend, transport=transport
    ) as connection:

        async def block(check: bool = False) -> int:
            response = await connection.fetch(NS, TRACK, Location(0, 0), Location(0, 32))
            if check:
                payload = b"".join([bytes(o.payload) async for o in response.track.objects()])
                if payload != BLOCK:
                    raise AssertionError("MOQT block differs")
                return len(payload)
            received = 0
            async for event in response.track.events():
                if isinstance(event, ObjectData):
                    received += len(event.data)
            return received

        await block(check=True)
        return await timed(block, seconds)


async def run_raw(backend: str, datagram: int, port: int, cert: str, seconds: float) -> float:
    quic = get_backend(backend)
    configuration = quic.configuration(
        is_client=True, transport=transport_for(datagram), cafile=cert, server_name="localhost"
    )
    client_module: Any = importlib.import_module(f"{backend}.asyncio.client")
    cls = raw_protocol(backend, server=False)
    async with client_module.connect(
        "127.0.0.1", port, configuration=configuration, create_protocol=cls
    ) as protocol:

        async def block() -> int:
            return int(await protocol.fetch(len(BLOCK)))

        await block()
        return await timed(block, seconds)


async def timed(block: Any, seconds: float) -> float:
    """MB/s over whole blocks fetched one after another for about ``seconds``."""
    total, count, start = 0, 0, time.perf_counter()
    while count < 4 or (time.perf_counter() - start < seconds and count < 200):
        received = await block()
        if received != len(BLOCK):
            raise AssertionError(f"got {received} bytes, expected {len(BLOCK)}")
        total += received
        count += 1
    return total / (time.perf_counter() - start) / 1e6


def measure(
    backend: str, datagram: int, cert: str, key: str, seconds: float
) -> tuple[float, float]:
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=server_main, args=(backend, datagram, cert, key, child))
    process.start()
    try:
        moqt_port, raw_port = parent.recv()
        moqt = asyncio.run(
            asyncio.wait_for(run_moqt(backend, datagram, moqt_port, cert, seconds), 60)
        )
        raw = asyncio.run(asyncio.wait_for(run_raw(backend, datagram, raw_port, cert, seconds), 60))
    finally:
        parent.send("stop")
        process.join(10)
        if process.is_alive():
            process.kill()
    return moqt, raw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="time per measurement")
    parser.add_argument("--backends", default=",".join(available_backends()))
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    args = parser.parse_args()
    backends = args.backends.split(",")
    sizes = [int(size) for size in args.sizes.split(",")]
    folder = tempfile.mkdtemp(prefix="bench-moqt-")
    cert, key = (str(path) for path in make_self_signed("localhost", folder))
    versions = ", ".join(f"{name} {get_backend(name).version}" for name in backends)
    print(f"# MOQT d16 FETCH of 2 MiB blocks (32 x 64 KiB) vs raw QUIC, loopback; {versions}")
    print("# windows 64 MiB / 32 MiB, SO_RCVBUF/SO_SNDBUF 4 MiB, blocks one after another")
    rows: list[tuple[str, int, float, float]] = []
    for backend in backends:
        for size in sizes:
            datagram = size or LARGEST[backend]
            try:
                moqt, raw = measure(backend, datagram, cert, key, args.seconds)
            except Exception as exc:  # noqa: BLE001 - a size the backend refuses is a result
                print(f"{backend} {datagram}: failed: {type(exc).__name__}: {exc}")
                continue
            rows.append((backend, datagram, moqt, raw))
    baseline = next((r[2] for r in rows if r[0] == "aioquic" and r[1] == 1200), None)
    header = f"{'backend':8} {'datagram':>8} {'MOQT MB/s':>10} {'raw MB/s':>9} "
    header += f"{'MOQT/raw':>9} {'ms/block':>9} {'vs aioquic-1200':>16}"
    print(header)
    for backend, datagram, moqt, raw in rows:
        versus = f"{moqt / baseline:15.2f}x" if baseline else f"{'-':>16}"
        ms = len(BLOCK) / 1e6 / moqt * 1000
        print(
            f"{backend:8} {datagram:>8} {moqt:>10.1f} {raw:>9.1f} {moqt / raw:>9.2f} "
            f"{ms:>9.1f} {versus}"
        )
    if rows and baseline:
        best = max(rows, key=lambda r: r[2])
        ratio = best[2] / baseline
        print(f"best: {best[0]} {best[1]} B: {best[2]:.1f} MB/s = {ratio:.1f}x aioquic-1200")


if __name__ == "__main__":
    main()
