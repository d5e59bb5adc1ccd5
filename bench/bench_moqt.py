"""MOQT goodput on loopback: 2 MiB blocks (32 objects × 64 KiB) by FETCH, beside raw QUIC.

Run: ``.venv/bin/python bench/bench_moqt.py [--seconds S] [--backends aioquic,qh3]
[--paths-only | --no-paths]``.

For every backend × max_datagram_size the server runs in its own process (so each side has a
core) with both a MOQT server and a raw QUIC server; the client holds one connection to each and
fetches whole blocks, alternating: one over MOQT (standalone FETCH {0,0}..{0,32}: FETCH_OK plus
one fetch stream, payload pieces and object ends counted by sinks in the QUIC event handler
as they arrive, :meth:`~moqt.transport.TrackReader.set_payload_sink` with ``object_end``, then
:meth:`~moqt.transport.TrackReader.finished`), one over raw QUIC (one bidi stream per block,
the server writing 2 MiB, bytes counted in the protocol's event handler), so both see the same
load on a shared machine. Both use the same QUIC settings: the given datagram
size, 64 MiB / 32 MiB flow-control windows and 4 MiB socket buffers, and both connections go
through :meth:`~moqt.backend.Backend.quiet` (qh3 without its logger-less packet logging).
Goodput counts payload bytes only. Object headers are read by the native ``moqt._objscan``
where it was built (the header line says which). The table gives MOQT/raw, each MOQT figure
against aioquic at its default 1200-byte datagrams, and the CPU each side spent per block
(client and server process, MOQT | raw).
For aioquic a first row, ``defaults``, sets nothing (1200-byte datagrams, aioquic's 1 MiB
windows, the system's socket buffers): what an application that takes aioquic as it comes
moves, the baseline of the "vs aioquic dflt" column.

A second table puts the same 2 MiB block on every path side by side: a plain TCP stream
(blocking sockets, the transport ceiling); HTTP GET from ``kvsp serve holder`` with
:class:`~kvsp.transfer.block_client.BlockClient` (the chosen bulk client, verifying
Repr-Digest and layer digests as §6.7 asks); MOQT FETCH with
:class:`~kvsp.transfer.moqt_client.MoqtBlockClient` (verifying every layer) straight from a
publisher; and, when ``relay.app`` exists, publisher → relay → subscriber: FETCH forwarded
upstream (a cache miss per block), FETCH served from the relay's cache, and a live track fanned
out by the relay to 8 subscribers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import importlib
import json
import multiprocessing
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvsp.container import Geometry, encode_container, layer_digest, replica_digest  # noqa: E402
from kvsp.ids import BlockKey, CompatId, ScopeId  # noqa: E402
from kvsp.moqt_mapping import kv_namespace, layer_digest_extension  # noqa: E402
from kvsp.records import ReplicaRecord  # noqa: E402
from moqt.asyncio import MOQTConnection, connect, serve, tune_socket  # noqa: E402
from moqt.backend import TransportConfig, available_backends, get_backend  # noqa: E402
from moqt.certs import make_self_signed  # noqa: E402
from moqt.messages import StandaloneFetch  # noqa: E402
from moqt.objects import NATIVE_HEADERS  # noqa: E402
from moqt.session_events import FetchReceived  # noqa: E402
from moqt.transport import open_datagram_endpoint  # noqa: E402
from moqt.wire import Location  # noqa: E402

NS = (b"kvsp", b"1", b"c0", b"s0", b"k0")
TRACK = b"d" * 64
LAYER = 64 * 1024
LAYERS = [hashlib.sha256(b"layer%d" % i).digest() * (LAYER // 32) for i in range(32)]
BLOCK = b"".join(LAYERS)
DIGESTS = [layer_digest_extension(hashlib.sha256(layer).digest()) for layer in LAYERS]
SIZES = (1200, 1452, 9000, 0)  # 0: the largest the backend takes on loopback
LARGEST = {"aioquic": 16384, "qh3": 65000}  # aioquic: 2-byte frame lengths; qh3: UDP on lo


LIBRARY_DEFAULTS = -1
"""A "datagram size" that stands for the backend's own defaults: 1200-byte datagrams, its
flow-control windows (aioquic: 1 MiB), the system's socket buffers."""


def transport_for(datagram: int) -> TransportConfig:
    if datagram == LIBRARY_DEFAULTS:
        return TransportConfig(socket_buffer=0)  # nothing set: the library's defaults
    return TransportConfig(max_datagram_size=datagram, max_data=64 << 20, max_stream_data=32 << 20)


def datagram_label(datagram: int) -> str:
    return "defaults" if datagram == LIBRARY_DEFAULTS else str(datagram)


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


def raw_protocol(backend: str, *, server: bool, buffer: int = 4 << 20) -> type:
    """A plain QuicConnectionProtocol: the server writes ``n`` bytes, the client counts them."""
    base: Any = importlib.import_module(f"{backend}.asyncio.protocol").QuicConnectionProtocol
    events: Any = importlib.import_module(f"{backend}.quic.events")
    view = memoryview(BLOCK)

    def __init__(self: Any, quic: Any, stream_handler: Any = None) -> None:
        base.__init__(self, quic, stream_handler)
        get_backend(backend).quiet(quic)  # as the MOQT protocol does: the same floor
        waiters: dict[int, tuple[asyncio.Future[int], list[int]]] = {}
        self.waiters = waiters

    def connection_made(self: Any, transport: Any) -> None:
        base.connection_made(self, transport)
        tune_socket(transport.get_extra_info("socket") or getattr(transport, "_sock", None), buffer)

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


async def serve_raw(backend: str, configuration: Any, buffer: int) -> tuple[Any, int]:
    server_module: Any = importlib.import_module(f"{backend}.asyncio.server")
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tune_socket(sock, buffer)
    sock.bind(("127.0.0.1", 0))
    cls = raw_protocol(backend, server=True, buffer=buffer)
    transport, server = await open_datagram_endpoint(  # the MOQT server's endpoint: a fair race
        get_backend(backend),
        lambda: server_module.QuicServer(configuration=configuration, create_protocol=cls),
        sock,
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
        raw_server, raw_port = await serve_raw(backend, config(), transport.socket_buffer)
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
            received = [0]

            def count(header: Any, data: memoryview, offset: int) -> None:
                received[0] += len(data)

            # the bulk path (sinks in the QUIC event handler, as the raw client counts there)
            sink = None if check else count
            response = await connection.fetch(
                NS,
                TRACK,
                Location(0, 0),
                Location(0, 32),
                payload_sink=sink,
                object_end=None if check else (lambda header: None),
            )
            if check:
                payload = b"".join([bytes(o.payload) async for o in response.track.objects()])
                if payload != BLOCK:
                    raise AssertionError("MOQT block differs")
                return len(payload)
            await response.track.finished()  # payload and object ends went to the sinks
            return received[0]

        await block(check=True)
        return await timed(block, seconds)


async def run_raw(backend: str, datagram: int, port: int, cert: str, seconds: float) -> float:
    quic = get_backend(backend)
    configuration = quic.configuration(
        is_client=True, transport=transport_for(datagram), cafile=cert, server_name="localhost"
    )
    client_module: Any = importlib.import_module(f"{backend}.asyncio.client")
    cls = raw_protocol(backend, server=False, buffer=transport_for(datagram).socket_buffer)
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
    """MOQT and raw QUIC goodput (MB/s), measured side by side (:func:`measure_paired`)."""
    paired = measure_paired(backend, datagram, cert, key, seconds)
    return paired.moqt.goodput(), paired.raw.goodput()


@dataclass
class Tally:
    """Blocks fetched one way: wall seconds and CPU seconds of each process."""

    blocks: int = 0
    wall: float = 0.0
    client_cpu: float = 0.0
    server_cpu: float = 0.0

    def goodput(self) -> float:
        """MB/s."""
        return self.blocks * len(BLOCK) / self.wall / 1e6 if self.wall else 0.0

    def cpu_ms(self) -> tuple[float, float]:
        """CPU milliseconds per block: (client, server)."""
        n = max(self.blocks, 1)
        return 1000 * self.client_cpu / n, 1000 * self.server_cpu / n


@dataclass
class Paired:
    """One backend and datagram size, MOQT beside raw QUIC."""

    moqt: Tally
    raw: Tally


def process_cpu(pid: int) -> float:
    """CPU seconds a process has used (Linux /proc; 0.0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_paired(backend: str, datagram: int, cert: str, key: str, seconds: float) -> Paired:
    """Alternate MOQT and raw blocks against one server process for about ``seconds`` each."""
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=server_main, args=(backend, datagram, cert, key, child))
    process.start()
    try:
        moqt_port, raw_port = parent.recv()
        ports = (moqt_port, raw_port)
        run = run_paired(backend, datagram, ports, cert, seconds, process.pid or 0)
        return asyncio.run(asyncio.wait_for(run, 120))
    finally:
        parent.send("stop")
        process.join(10)
        if process.is_alive():
            process.kill()


async def run_paired(
    backend: str,
    datagram: int,
    ports: tuple[int, int],
    cert: str,
    seconds: float,
    server_pid: int,
) -> Paired:
    quic = get_backend(backend)
    transport = transport_for(datagram)

    def configuration() -> Any:
        return quic.configuration(
            is_client=True, transport=transport, cafile=cert, server_name="localhost"
        )

    client_module: Any = importlib.import_module(f"{backend}.asyncio.client")
    raw_connect = client_module.connect(
        "127.0.0.1",
        ports[1],
        configuration=configuration(),
        create_protocol=raw_protocol(backend, server=False, buffer=transport.socket_buffer),
    )
    moqt_connect = connect(
        "127.0.0.1", ports[0], configuration=configuration(), backend=backend, transport=transport
    )
    async with moqt_connect as connection, raw_connect as protocol:
        await check_moqt_block(connection)

        async def moqt_block() -> int:
            counted = [0]

            def sink(header: Any, data: memoryview, offset: int) -> None:
                counted[0] += len(data)

            def object_end(header: Any) -> None:
                objects[0] += 1

            objects = [0]
            response = await connection.fetch(
                NS, TRACK, Location(0, 0), Location(0, 32), payload_sink=sink, object_end=object_end
            )
            await response.track.finished()  # payload and object ends went to the sinks
            if objects[0] != 32:
                raise AssertionError(f"{objects[0]} objects, expected 32")
            return counted[0]

        async def raw_block() -> int:
            return int(await protocol.fetch(len(BLOCK)))

        return await alternate(moqt_block, raw_block, seconds, server_pid)


async def check_moqt_block(connection: MOQTConnection) -> None:
    """One block through ``objects()``, compared byte for byte."""
    response = await connection.fetch(NS, TRACK, Location(0, 0), Location(0, 32))
    payload = b"".join([bytes(o.payload) async for o in response.track.objects()])
    if payload != BLOCK:
        raise AssertionError("MOQT block differs")


async def alternate(moqt_block: Any, raw_block: Any, seconds: float, server_pid: int) -> Paired:
    """Blocks one way then the other (order flipped each round) until each had ``seconds``."""
    paired = Paired(Tally(), Tally())
    await moqt_block(), await raw_block()  # warm-up
    rounds = 0
    while rounds < 4 or (min(paired.moqt.wall, paired.raw.wall) < seconds and rounds < 200):
        ways = [(paired.moqt, moqt_block), (paired.raw, raw_block)]
        for tally, block in ways if rounds % 2 == 0 else ways[::-1]:
            server, client, start = (
                process_cpu(server_pid),
                time.process_time(),
                time.perf_counter(),
            )
            received = await block()
            tally.wall += time.perf_counter() - start
            tally.client_cpu += time.process_time() - client
            tally.server_cpu += process_cpu(server_pid) - server
            if received != len(BLOCK):
                raise AssertionError(f"got {received} bytes, expected {len(BLOCK)}")
            tally.blocks += 1
        rounds += 1
    return paired


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="time per measurement")
    parser.add_argument("--backends", default=",".join(available_backends()))
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--paths-only", action="store_true", help="only the paths table")
    parser.add_argument("--no-paths", action="store_true", help="only the MOQT/raw table")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    backends = args.backends.split(",")
    sizes = [int(size) for size in args.sizes.split(",")]
    folder = tempfile.mkdtemp(prefix="bench-moqt-")
    cert, key = (str(path) for path in make_self_signed("localhost", folder))
    doc: dict[str, list[dict[str, Any]]] = {"moqt": [], "paths": []}  # --json, bench/report.py
    if not args.paths_only:
        rows = moqt_table(backends, sizes, cert, key, args.seconds)
        keys = ("backend", "datagram", "moqt_mb_s", "raw_mb_s")
        doc["moqt"] = [dict(zip(keys, row[:4], strict=True)) for row in rows]
    if not args.no_paths:
        paths = paths_table(backends, cert, key, args.seconds)
        doc["paths"] = [{"path": p, "mb_s": rate, "note": note} for p, rate, note in paths]
    if args.json is not None:
        args.json.write_text(json.dumps(doc), encoding="utf-8")


def moqt_table(
    backends: list[str], sizes: list[int], cert: str, key: str, seconds: float
) -> list[tuple[str, int, float, float, Paired]]:
    versions = ", ".join(f"{name} {get_backend(name).version}" for name in backends)
    print(f"# MOQT d16 FETCH of 2 MiB blocks (32 x 64 KiB) vs raw QUIC, loopback; {versions}")
    print("# windows 64 MiB / 32 MiB, SO_RCVBUF/SO_SNDBUF 4 MiB, blocks one after another")
    reader = "native (moqt._objscan)" if NATIVE_HEADERS else "Python (moqt._objscan not built)"
    print(f"# object headers read by: {reader}")
    rows: list[tuple[str, int, float, float, Paired]] = []
    for backend in backends:
        defaults = [LIBRARY_DEFAULTS] if backend == "aioquic" else []
        for datagram in [*defaults, *(size or LARGEST[backend] for size in sizes)]:
            try:
                paired = measure_paired(backend, datagram, cert, key, seconds)
            except Exception as exc:  # noqa: BLE001 - a size the backend refuses is a result
                label = datagram_label(datagram)
                print(f"{backend} {label}: failed: {type(exc).__name__}: {exc}")
                continue
            rows.append((backend, datagram, paired.moqt.goodput(), paired.raw.goodput(), paired))
    baseline = next((r[2] for r in rows if r[0] == "aioquic" and r[1] == LIBRARY_DEFAULTS), None)
    tuned = next((r[2] for r in rows if r[0] == "aioquic" and r[1] == 1200), None)
    header = f"{'backend':8} {'datagram':>8} {'MOQT MB/s':>10} {'raw MB/s':>9} "
    header += f"{'MOQT/raw':>9} {'ms/block':>9} {'vs aioquic dflt':>16}"
    header += f" {'client cpu ms':>15} {'server cpu ms':>15}"
    print(header)
    for backend, datagram, moqt, raw, paired in rows:
        versus = f"{moqt / baseline:15.2f}x" if baseline else f"{'-':>16}"
        ms = len(BLOCK) / 1e6 / moqt * 1000
        (mc, ms_), (rc, rs) = paired.moqt.cpu_ms(), paired.raw.cpu_ms()
        label = datagram_label(datagram)
        print(
            f"{backend:8} {label:>8} {moqt:>10.1f} {raw:>9.1f} {moqt / raw:>9.2f} "
            f"{ms:>9.1f} {versus} {mc:>7.1f} | {rc:<5.1f} {ms_:>7.1f} | {rs:<5.1f}"
        )
    if rows and baseline:
        best = max(rows, key=lambda r: r[2])
        line = f"best: {best[0]} {datagram_label(best[1])} B: {best[2]:.1f} MB/s"
        line += f" = {best[2] / baseline:.1f}x aioquic's defaults"
        if tuned:
            line += f", {best[2] / tuned:.1f}x aioquic at 1200 B with the windows above"
        print(line)
    return rows


# --- the same block on every path -----------------------------------------------------------------

GEOMETRY = Geometry(layers=32, kv_heads=8, head_dim=128, element_size=2)
TOKENS = 16  # 16 tokens x 8 heads x 128 x fp16 = 32 KiB per K or V: the 64 KiB objects above
COMPAT = CompatId(b"\xbe" * 32)
SCOPE = ScopeId(b"\x5b" * 16)
KV_LAYERS = [(layer[: len(layer) // 2], layer[len(layer) // 2 :]) for layer in LAYERS]
CONTAINER = encode_container(KV_LAYERS, first_layer=0, token_count=TOKENS, geometry=GEOMETRY)
KV_DIGESTS = [layer_digest(k, v) for k, v in KV_LAYERS]
FANOUT = 8


def block_key(n: int) -> BlockKey:
    return BlockKey(hashlib.sha256(b"bench-key-%d" % n).digest())


def block_record(holder: str, key: BlockKey) -> ReplicaRecord:
    return ReplicaRecord(
        block_key=key,
        compat_id=COMPAT,
        scope_id=SCOPE,
        holder=holder,
        codec=1,
        size=len(CONTAINER),
        digest=replica_digest(KV_DIGESTS),
        layer_digests=tuple(KV_DIGESTS),
        residency=None,
        ttl_ms=600_000,
        moqt_namespace=b"".join(bytes([len(f)]) + f for f in kv_namespace(COMPAT, SCOPE, key)),
    )


def tcp_server_main(pipe: Connection) -> None:
    """Answer each 8-octet size on a connection with that many octets of the block."""
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    pipe.send(listener.getsockname()[1])
    view = memoryview(CONTAINER)

    def serve(conn: socket.socket) -> None:
        with conn:
            while header := conn.recv(8):
                left = int.from_bytes(header, "big")
                while left > 0:
                    left -= conn.send(view[: min(left, len(view))])

    def accept() -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    pipe.recv()


def run_tcp(port: int, seconds: float) -> float:
    buffer = memoryview(bytearray(len(CONTAINER)))
    with socket.create_connection(("127.0.0.1", port)) as conn:

        async def block() -> int:
            conn.sendall(len(CONTAINER).to_bytes(8, "big"))
            got = 0
            while got < len(CONTAINER):
                got += conn.recv_into(buffer[got:])
            return got - (len(CONTAINER) - len(BLOCK))  # count the layers' octets, as above

        return asyncio.run(timed(block, seconds))


def in_process(target: Any, *args: Any) -> tuple[Any, Connection, Any]:
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=target, args=(*args, child))
    process.start()
    return process, parent, parent.recv()


def stop(process: Any, pipe: Connection) -> None:
    with contextlib.suppress(OSError):
        pipe.send("stop")
    process.join(10)
    if process.is_alive():
        process.kill()


def measure_tcp(seconds: float) -> float:
    process, pipe, port = in_process(tcp_server_main)
    try:
        return run_tcp(port, seconds)
    finally:
        stop(process, pipe)


def measure_http(seconds: float) -> float:
    """kvsp serve holder, one block PUT, then verified GETs with BlockClient."""
    import httpx

    from kvsp.compat import CompatibilityDescriptor, compat_id
    from kvsp.transfer.block_client import BlockClient
    from kvsp.web.auth import principal_entry, write_principals
    from kvsp.web.testing import start_process

    descriptor = CompatibilityDescriptor(
        model="bench",
        model_digest=b"\x01" * 32,
        tokenizer_digest=b"\x02" * 32,
        layers=GEOMETRY.layers,
        kv_heads=GEOMETRY.kv_heads,
        head_dim=GEOMETRY.head_dim,
        kv_dtype="fp16",
        positional="rope",
        block_tokens=TOKENS,
    )
    compat = CompatId(compat_id(descriptor))
    token = "bench-token-0123456789abcdefghijklmnop"
    folder = Path(tempfile.mkdtemp(prefix="bench-holder-"))
    principals = folder / "principals.toml"
    write_principals(principals, [principal_entry("bench", token, ["admin"], None)])
    argv = [sys.executable, "-m", "kvsp", "serve", "holder", "--listen", "127.0.0.1:0"]
    argv += ["--principals", str(principals), "--state", str(folder / "state")]
    argv += ["--tier", f"host={4 * len(CONTAINER)}"]
    auth = {"authorization": f"Bearer {token}"}
    key = block_key(0)
    with start_process(argv, workdir=folder) as holder, httpx.Client(timeout=30) as http:
        base = holder.base_url
        http.put(f"{base}descriptors/{compat.hex()}", json=descriptor.to_json(), headers=auth)
        url = f"{base}blocks/{compat.hex()}/{SCOPE.hex()}/{key.hex()}"
        headers = auth | {"if-none-match": "*", "content-type": "application/kvsp-block"}
        http.put(url, content=CONTAINER, headers=headers).raise_for_status()
        record = replace(block_record(base, key), compat_id=compat, moqt_namespace=None)

        async def run() -> float:
            async with BlockClient(token) as client:

                async def block() -> int:
                    got = await client.get_block(base, record, geometry=GEOMETRY)
                    return sum(layer.k.nbytes + layer.v.nbytes for layer in got.layers)

                return await timed(block, seconds)

        return asyncio.run(run())


def publisher_main(backend: str, cert: str, key: str, pipe: Connection) -> None:
    """A MOQT server publishing the block (serve_blocks) for direct FETCH."""
    from kvsp.transfer.moqt_publisher import MemoryBlocks, StoredBlock, serve_blocks

    async def main() -> None:
        blocks = MemoryBlocks()
        blocks.add(StoredBlock.of(COMPAT, SCOPE, block_key(0), CONTAINER, geometry=GEOMETRY))
        quic = get_backend(backend)
        transport = transport_for(LARGEST[backend])
        configuration = quic.configuration(
            is_client=False, transport=transport, certificate=cert, private_key=key
        )
        server = await serve_blocks(
            "127.0.0.1",
            0,
            configuration=configuration,
            blocks=blocks,
            backend=backend,
            transport=transport,
        )
        pipe.send(server.address[1])
        await asyncio.get_running_loop().run_in_executor(None, pipe.recv)
        server.close()

    asyncio.run(main())


def moqt_client(backend: str, **options: Any) -> Any:
    from kvsp.transfer.moqt_client import MoqtBlockClient

    transport = transport_for(LARGEST[backend])
    return MoqtBlockClient(backend=backend, transport=transport, timeout=30, **options)


async def verified_blocks(client: Any, records: list[ReplicaRecord], seconds: float) -> float:
    cursor = iter(range(1 << 30))

    async def block() -> int:
        record = records[next(cursor) % len(records)]
        got = await client.get_block(record, geometry=GEOMETRY, block_tokens=TOKENS)
        return sum(layer.k.nbytes + layer.v.nbytes for layer in got.layers)

    return await timed(block, seconds)


def measure_moqt_client(backend: str, cert: str, key: str, seconds: float) -> float:
    process, pipe, port = in_process(publisher_main, backend, cert, key)
    try:

        async def run() -> float:
            async with moqt_client(backend, cafile=cert, server_name="localhost") as client:
                record = block_record(f"moqt://127.0.0.1:{port}", block_key(0))
                return await verified_blocks(client, [record], seconds)

        return asyncio.run(run())
    finally:
        stop(process, pipe)


RELAY_BLOCKS = 64  # distinct blocks, so that each forwarded FETCH misses the relay's cache


def relay_publisher_main(backend: str, relay_url: str, pipe: Connection) -> None:
    """An instance's session to the relay: its scope announced, RELAY_BLOCKS stored blocks,
    and live tracks produced on command ("open N" then "go N")."""
    from kvsp.transfer.moqt_publisher import MemoryBlocks, MoqtBlockPublisher, StoredBlock
    from kvsp.transfer.moqt_transfer import parse_moqt_uri

    async def main() -> None:
        blocks = MemoryBlocks()
        for n in range(RELAY_BLOCKS):
            blocks.add(StoredBlock.of(COMPAT, SCOPE, block_key(n), CONTAINER, geometry=GEOMETRY))
        address = parse_moqt_uri(relay_url)
        transport = transport_for(LARGEST[backend])
        configuration = get_backend(backend).configuration(
            is_client=True, transport=transport, verify=False
        )
        async with connect(
            address.host,
            address.port,
            configuration=configuration,
            backend=backend,
            transport=transport,
        ) as connection:
            publisher = MoqtBlockPublisher(connection, blocks)
            serving = asyncio.ensure_future(publisher.serve())
            await publisher.announce(COMPAT, SCOPE)
            pipe.send("ready")
            writers: dict[int, Any] = {}
            loop = asyncio.get_running_loop()
            while (command := await loop.run_in_executor(None, pipe.recv)) != "stop":
                verb, number = command.split()
                n = int(number)
                if verb == "open":
                    writers[n] = publisher.publish_live(
                        LIVE_PRODUCER, COMPAT, SCOPE, block_key(1000 + n), token_count=TOKENS
                    )
                else:
                    for index, (k, v) in enumerate(KV_LAYERS):
                        writers[n].send_layer(index, k, v)
                        await asyncio.sleep(0)
                    writers.pop(n).finish()
                pipe.send("done")
            serving.cancel()

    asyncio.run(main())


LIVE_PRODUCER = "http://bench-instance.example/kvsp/"


def relay_available() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("relay.app") is not None
    except ModuleNotFoundError:
        return False


def measure_relay(backend: str, seconds: float) -> list[tuple[str, float, str]]:
    """Forwarded FETCH, cached FETCH and live fan-out through relay.app --open."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from interop.peers import start_our_relay

    folder = Path(tempfile.mkdtemp(prefix="bench-relay-"))
    relay = start_our_relay(folder, "--backend", backend)
    try:
        process, pipe, _ = in_process(relay_publisher_main, backend, relay.url)
        try:
            return asyncio.run(_relay_rows(backend, relay.url, pipe, seconds))
        finally:
            stop(process, pipe)
    finally:
        relay.stop()


async def _relay_rows(
    backend: str, url: str, pipe: Connection, seconds: float
) -> list[tuple[str, float, str]]:
    records = [block_record(url, block_key(n)) for n in range(RELAY_BLOCKS)]
    rows = []
    async with moqt_client(backend, verify=False) as client:
        started, count = time.perf_counter(), 0
        for record in records:  # every block once: each FETCH goes upstream
            await client.get_block(record, geometry=GEOMETRY, block_tokens=TOKENS)
            count += 1
            if count >= 4 and time.perf_counter() - started > seconds:
                break
        forwarded = count * len(BLOCK) / (time.perf_counter() - started) / 1e6
        rows.append(("publisher -> relay -> subscriber, FETCH forwarded", forwarded, "cache miss"))
        cached = await verified_blocks(client, records[:count], seconds)
        rows.append(("publisher -> relay -> subscriber, FETCH cached", cached, "cache hit"))
    rows.append(await _fanout(backend, url, pipe))
    return rows


async def _fanout(backend: str, url: str, pipe: Connection) -> tuple[str, float, str]:
    """FANOUT subscribers of one live track through the relay, rounds of one block each."""
    from kvsp.transfer.moqt_client import MoqtBlockClient

    loop = asyncio.get_running_loop()
    clients = [moqt_client(backend, verify=False) for _ in range(FANOUT)]
    total, elapsed = 0, 0.0
    try:
        for n in range(4):
            pipe.send(f"open {n}")
            await loop.run_in_executor(None, pipe.recv)
            streams = [_live(client, url, n) for client in clients]
            tasks = [asyncio.ensure_future(_drain(stream)) for stream in streams]
            await asyncio.sleep(0.3)  # every SUBSCRIBE has reached the publisher
            started = time.perf_counter()
            pipe.send(f"go {n}")
            sizes = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            elapsed += time.perf_counter() - started
            await loop.run_in_executor(None, pipe.recv)
            total += sum(sizes)
    finally:
        for client in clients:
            await MoqtBlockClient.aclose(client)
    each = total / FANOUT / elapsed / 1e6
    return (
        f"live track, relay fan-out to {FANOUT} subscribers",
        each,
        f"{each * FANOUT:.1f} MB/s in all",
    )


def _live(client: Any, url: str, n: int) -> Any:
    return client.subscribe_live(
        url,
        producer=LIVE_PRODUCER,
        compat=COMPAT,
        scope=SCOPE,
        key=block_key(1000 + n),
        geometry=GEOMETRY,
        block_tokens=TOKENS,
    )


async def _drain(stream: Any) -> int:
    block = await stream.block()
    return sum(layer.k.nbytes + layer.v.nbytes for layer in block.layers)


def paths_table(
    backends: list[str], cert: str, key: str, seconds: float
) -> list[tuple[str, float, str]]:
    """The same 2 MiB block over every path, one after another, in one table."""
    best = "qh3" if "qh3" in backends else backends[0]
    print()
    print("# one 2 MiB block (32 layers x 64 KiB), blocks one after another, loopback, verified")
    print("# where the client verifies; MOQT at each backend's largest datagram")
    rows: list[tuple[str, float, str]] = []
    attempts: list[tuple[str, Any]] = [
        ("plain TCP stream (blocking sockets)", lambda: measure_tcp(seconds)),
        ("HTTP GET, kvsp serve holder + BlockClient", lambda: measure_http(seconds)),
    ]
    for backend in backends:
        attempts.append(
            (
                f"MOQT FETCH direct, MoqtBlockClient ({backend})",
                lambda b=backend: measure_moqt_client(b, cert, key, seconds),
            )
        )
    for label, run in attempts:
        try:
            rows.append((label, run(), ""))
        except Exception as exc:  # noqa: BLE001 - a path that cannot run is a result
            rows.append((label, 0.0, f"failed: {type(exc).__name__}: {exc}"[:90]))
    if relay_available():
        try:
            rows += [
                (f"{label} ({best})", rate, note)
                for label, rate, note in measure_relay(best, seconds)
            ]
        except Exception as exc:  # noqa: BLE001
            rows.append((f"relay ({best})", 0.0, f"failed: {type(exc).__name__}: {exc}"[:90]))
    else:
        rows.append(("relay", 0.0, "relay.app does not exist yet"))
    tcp = rows[0][1] or None
    print(f"{'path':58} {'MB/s':>8} {'ms/block':>9} {'vs TCP':>7}  note")
    for label, rate, note in rows:
        ms = f"{len(BLOCK) / 1e6 / rate * 1000:9.1f}" if rate else f"{'-':>9}"
        versus = f"{rate / tcp:7.3f}" if rate and tcp else f"{'-':>7}"
        print(f"{label:58} {rate:8.1f} {ms} {versus}  {note}")
    return rows


if __name__ == "__main__":
    main()
