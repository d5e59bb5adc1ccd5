"""KVSP blocks on every transport, side by side in one run: MB/s of 2 MiB and 64 KiB blocks
verified end to end as a client uses them, and the ratios issue #20 sets targets for.

Run: ``.venv/bin/python bench/bench_moqt.py [--quick] [--seconds S] [--json FILE]
[--install-peers] [--paired]``.

Every row fetches whole blocks one after another on loopback, each verified as §6.7 asks
(every layer digest against the Replica Record, or the peer's own check), and counts the K and
V octets delivered (MB/s = 1e6 octets a second):

* plain TCP stream (blocking sockets): the transport ceiling, no verification;
* HTTP GET from ``kvsp serve holder`` with :class:`~kvsp.transfer.block_client.BlockClient`
  (layer digests and Repr-Digest);
* MOQT FETCH with :class:`~kvsp.transfer.moqt_client.MoqtBlockClient` from one publisher
  process (:class:`~kvsp.transfer.moqt_publisher.MoqtBlockPublisher` behind every listener):
  over QUIC with aioquic as it comes (1,200-byte datagrams, its windows, the system's socket
  buffers), aioquic at 1,452-byte datagrams, and the measured default backend
  (:func:`moqt.backend.default_backend`) at its default :class:`~moqt.backend.TransportConfig`
  (1,452 bytes) and at 9,000 bytes; over QMux (draft-ietf-quic-qmux-01, MOQT over QMux as
  draft-nandakumar-moq-qmux-moqt-00) on TLS 1.3, plain TCP and a Unix socket, the record listing
  the one carrier in ``moqt_carriers`` so that the client picks it as it would in service;
* through ``relay.app`` on the fastest carrier measured above: FETCH forwarded upstream to the
  publisher's session (a cache miss per block), beside the same FETCH from the first hop's
  publisher directly (the ``relay-miss/direct`` denominator), FETCH from the relay's cache,
  and a live track fanned out to 8 subscribers (MB/s per subscriber);
* the directive path (§6.5): 64 blocks of 64 KiB prefetched end to end by an instance from the
  relay over MOQT (and from the source over HTTP on a full run), from
  ``bench/bench_directive.py``: with the per-block pipeline ("now"), today's code with the old
  options ("before" there), and the code issue #20 measured (its ``filed`` variant, run from
  this clone's git history), which the directive ratio divides by;
* two peers where they run: Redis GET + SHA-256 (``redis-server`` started on an ephemeral
  port) and Mooncake Store ``get_into`` + SHA-256 over its TCP transport
  (``mooncake-transfer-engine`` in its own virtual environment, installed on a full run or
  with ``--install-peers``; ``bench/peer_mooncake.py``). A row that cannot run says why.

The rows of each ratio run side by side: the HTTP, QUIC and QMux rows of the first hop with
every client open at once, and the relay misses with the direct FETCH, take turns in
:data:`ROUNDS` rounds (:func:`in_turns`), each row's rate over all its turns; the directive
variants alternate and each is the median of :data:`DIRECTIVE_REPS` directives. The 2 cores
are shared and their speed drifts by ±15% within a minute: rows measured minutes apart gave
ratios that moved with it.

The table puts the targets of issue #20 beside the ratios; the last five lines are the ratios
alone, in a fixed form. ``--paired`` adds the older MOQT-against-raw-QUIC table (per backend and
datagram size, the same server process, blocks alternating).
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
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvsp.compat import CompatibilityDescriptor, compat_id  # noqa: E402
from kvsp.container import Geometry, encode_container, layer_digest, replica_digest  # noqa: E402
from kvsp.ids import BlockKey, CompatId, ScopeId  # noqa: E402
from kvsp.moqt_mapping import kv_namespace, layer_digest_extension  # noqa: E402
from kvsp.records import ReplicaRecord  # noqa: E402
from moqt.asyncio import MOQTConnection, connect, serve, tune_socket  # noqa: E402
from moqt.backend import (  # noqa: E402
    TransportConfig,
    available_backends,
    default_backend,
    get_backend,
)
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
    """The paired table's QUIC settings: the library's own, or a fixed datagram size (no
    path-MTU probing) with 64 MiB / 32 MiB windows."""
    if datagram == LIBRARY_DEFAULTS:
        return AIOQUIC_DEFAULTS  # nothing set: the library's defaults
    return TransportConfig(
        max_datagram_size=datagram,
        probe_path_mtu=False,
        max_data=64 << 20,
        max_stream_data=32 << 20,
    )


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


# --- blocks of two sizes -----------------------------------------------------------------------

SCOPE = ScopeId(b"\x5b" * 16)
TOKENS = 16  # tokens a block (B)
FANOUT = 8
TOKEN = "bench-token-0123456789abcdefghijklmnop"
LIVE_PRODUCER = "http://bench-instance.example/kvsp/"


@dataclass(frozen=True)
class Shape:
    """One block size: its geometry, descriptor, layers and container."""

    name: str
    geometry: Geometry
    descriptor: CompatibilityDescriptor
    layers: list[tuple[bytes, bytes]]
    container: bytes
    relay_blocks: int
    """Distinct blocks the relay's publisher holds (each forwarded FETCH misses the cache)."""

    @property
    def compat(self) -> CompatId:
        return CompatId(compat_id(self.descriptor))

    @property
    def payload(self) -> int:
        """K and V octets of the block: what every row counts."""
        return sum(len(k) + len(v) for k, v in self.layers)

    @property
    def min_blocks(self) -> int:
        return 4 if self.payload >= 1 << 20 else 32

    def digests(self) -> list[bytes]:
        return [layer_digest(k, v) for k, v in self.layers]


def make_shape(name: str, layers: int, kv_heads: int, head_dim: int, relay_blocks: int) -> Shape:
    geometry = Geometry(layers=layers, kv_heads=kv_heads, head_dim=head_dim, element_size=2)
    descriptor = CompatibilityDescriptor(
        model=f"bench-{name.replace(' ', '')}",
        model_digest=b"\x01" * 32,
        tokenizer_digest=b"\x02" * 32,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        kv_dtype="fp16",
        positional="rope",
        block_tokens=TOKENS,
    )
    half = TOKENS * kv_heads * head_dim * 2
    seed = [hashlib.sha256(b"%s layer %d" % (name.encode(), i)).digest() for i in range(layers)]
    kv = [(s * (half // 32), s[::-1] * (half // 32)) for s in seed]
    container = encode_container(kv, first_layer=0, token_count=TOKENS, geometry=geometry)
    return Shape(name, geometry, descriptor, kv, container, relay_blocks)


SHAPES = (make_shape("2 MiB", 32, 8, 128, 48), make_shape("64 KiB", 16, 1, 64, 256))


def block_key(shape: Shape, n: int) -> BlockKey:
    return BlockKey(hashlib.sha256(b"bench-key-%s-%d" % (shape.name.encode(), n)).digest())


def block_record(
    shape: Shape, holder: str, key: BlockKey, carriers: tuple[str, ...] | None = None
) -> ReplicaRecord:
    namespace = kv_namespace(shape.compat, SCOPE, key)
    return ReplicaRecord(
        block_key=key,
        compat_id=shape.compat,
        scope_id=SCOPE,
        holder=holder,
        codec=1,
        size=len(shape.container),
        digest=replica_digest(shape.digests()),
        layer_digests=tuple(shape.digests()),
        residency=None,
        ttl_ms=600_000,
        moqt_namespace=b"".join(bytes([len(f)]) + f for f in namespace)
        if holder.startswith("moqt")
        else None,
        moqt_carriers=carriers,
    )


def stored_blocks(shapes: tuple[Shape, ...], count: int | None) -> Any:
    """A MemoryBlocks with block 0 of every shape (``count`` None) or its relay blocks."""
    from kvsp.transfer.moqt_publisher import MemoryBlocks, StoredBlock

    blocks = MemoryBlocks()
    for shape in shapes:
        for n in range(shape.relay_blocks if count is None else count):
            key = block_key(shape, n)
            blocks.add(
                StoredBlock.of(shape.compat, SCOPE, key, shape.container, geometry=shape.geometry)
            )
    return blocks


# --- rows, timing and processes ------------------------------------------------------------------


@dataclass
class Row:
    """One path: MB/s per block size (absent: not measured), and why not where it failed."""

    key: str
    label: str
    rates: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    per_second: dict[str, float] = field(default_factory=dict)
    """Blocks a second, for rows measured that way (the directive path)."""


class Table:
    """The rows in the order they were first named."""

    def __init__(self) -> None:
        self.rows: dict[str, Row] = {}

    def row(self, key: str, label: str) -> Row:
        return self.rows.setdefault(key, Row(key, label))

    def rate(self, key: str, shape: str = "2 MiB") -> float | None:
        row = self.rows.get(key)
        return None if row is None else row.rates.get(shape)

    def record(self, key: str, label: str, shape: Shape, run: Callable[[], float]) -> None:
        """Run one measurement; a failure is a result (the row's note)."""
        row = self.row(key, label)
        try:
            row.rates[shape.name] = run()
        except Exception as exc:  # noqa: BLE001 - a path that cannot run is a result
            row.notes.append(failure(shape.name, exc))

    async def arecord(
        self, key: str, label: str, shape: Shape, run: Callable[[], Awaitable[float]]
    ) -> None:
        row = self.row(key, label)
        CPU_NOTE.clear()
        try:
            row.rates[shape.name] = await run()
        except Exception as exc:  # noqa: BLE001
            row.notes.append(failure(shape.name, exc))
        if CPU_NOTE and shape is SHAPES[0]:
            row.notes.append(f"{shape.name} cpu ms/block {CPU_NOTE[0]}")


def failure(where: str, exc: BaseException) -> str:
    """One line: where, the exception's type, its message's last line (a traceback's)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [""]
    text = lines[0] if len(lines) == 1 else f"{lines[0][:60]} ... {lines[-1]}"
    return f"{where} failed: {type(exc).__name__}: {text}"[:200]


CPU_NOTE: list[str] = []
"""What the last :func:`timed` with ``servers`` measured: CPU ms a block, client | servers."""

ROUNDS = 4
"""Turns each row of a side-by-side group takes (:func:`in_turns`)."""


@dataclass
class Turns:
    """One row measured in turns that alternate with other rows' (:func:`in_turns`): what
    its turns moved so far, and the CPU each process spent on them."""

    key: str
    label: str
    block: Callable[[], Awaitable[int]]
    """Fetch one whole block; the K and V octets it delivered."""
    servers: tuple[int, ...] = ()
    limit: int = 1 << 30
    """The most blocks over all turns (a relay miss needs a block never fetched before)."""
    octets: int = 0
    blocks: int = 0
    seconds: float = 0.0
    cpu: list[float] = field(default_factory=list)

    async def turn(self, shape: Shape, seconds: float, min_blocks: int, limit: int) -> None:
        """Blocks one after another for about ``seconds`` (at least ``min_blocks``, at most
        ``limit``); each must deliver the block's K and V octets."""
        before = [time.process_time(), *(process_cpu(pid) for pid in self.servers)]
        count, start = 0, time.perf_counter()
        while count < limit and (count < min_blocks or time.perf_counter() - start < seconds):
            received = await self.block()
            if received != shape.payload:
                raise AssertionError(f"got {received} octets, expected {shape.payload}")
            count += 1
        self.seconds += time.perf_counter() - start
        after = [time.process_time(), *(process_cpu(pid) for pid in self.servers)]
        spent = [b - a for a, b in zip(before, after, strict=True)]
        self.cpu = [a + b for a, b in zip(self.cpu or [0.0] * len(spent), spent, strict=True)]
        self.blocks += count
        self.octets += count * shape.payload

    @property
    def rate(self) -> float:
        """MB/s over every turn."""
        return self.octets / self.seconds / 1e6

    def cpu_note(self) -> str:
        """CPU ms a block: the client | each server."""
        ms = [f"{1000 * spent / self.blocks:.1f}" for spent in self.cpu]
        return f"{ms[0]} | {' | '.join(ms[1:])}" if len(ms) > 1 else ms[0]


async def in_turns(
    table: Table, shape: Shape, rows: list[Turns], seconds: float, rounds: int = ROUNDS
) -> None:
    """Measure ``rows`` side by side: ``rounds`` rounds in which each row in turn fetches for
    ``seconds / rounds``, so that a change in the machine's speed while they run (these
    2 cores are shared) reaches every row alike; each row's rate is over all its turns. A
    row that fails is a result (its note) and sits out the rounds left."""
    failed: set[str] = set()
    for left in range(rounds, 0, -1):
        for row in rows:
            if row.key in failed:
                continue
            share = -(-(row.limit - row.blocks) // left)  # a limit spread over the turns left
            try:
                await row.turn(shape, seconds / rounds, -(-shape.min_blocks // rounds), share)
            except Exception as exc:  # noqa: BLE001 - a path that cannot run is a result
                failed.add(row.key)
                table.row(row.key, row.label).notes.append(failure(shape.name, exc))
    for row in rows:
        entry = table.row(row.key, row.label)
        if row.key in failed or not row.blocks:
            continue
        entry.rates[shape.name] = row.rate
        if row.servers and shape is SHAPES[0]:
            entry.notes.append(f"{shape.name} cpu ms/block {row.cpu_note()}")


async def timed(
    block: Callable[[], Awaitable[int]],
    shape: Shape,
    seconds: float,
    limit: int = 1 << 30,
    servers: tuple[int, ...] = (),
) -> float:
    """MB/s of whole blocks fetched one after another for about ``seconds`` (at least
    ``shape.min_blocks``, at most ``limit``); each must deliver the block's K and V octets.
    With ``servers`` (process ids), :data:`CPU_NOTE` gets the CPU each process spent a block."""
    CPU_NOTE.clear()
    row = Turns("", "", block, servers, limit)
    await row.turn(shape, seconds, shape.min_blocks, limit)
    if servers:
        CPU_NOTE.append(row.cpu_note())
    return row.rate


def kv_octets(block: Any) -> int:
    return sum(layer.k.nbytes + layer.v.nbytes for layer in block.layers)


def in_process(target: Any, *args: Any) -> tuple[Any, Connection, Any]:
    """Start ``target(*args, pipe)`` in a spawned process; its first message back."""
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=target, args=(*args, child), daemon=True)
    process.start()
    if not parent.poll(60):
        process.kill()
        raise TimeoutError(f"{target.__name__} did not start")
    return process, parent, parent.recv()


def stop(process: Any, pipe: Connection) -> None:
    with contextlib.suppress(OSError):
        pipe.send("stop")
    process.join(10)
    if process.is_alive():
        process.kill()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- plain TCP, the ceiling ----------------------------------------------------------------------


def tcp_server_main(pipe: Connection) -> None:
    """Answer each 8-octet size on a connection with that many octets."""
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    pipe.send(listener.getsockname()[1])
    view = memoryview(SHAPES[0].container)

    def serve_one(conn: socket.socket) -> None:
        with conn:
            while header := conn.recv(8):
                left = int.from_bytes(header, "big")
                while left > 0:
                    left -= conn.send(view[: min(left, len(view))])

    def accept() -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=serve_one, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    pipe.recv()


def measure_tcp(table: Table, seconds: float) -> None:
    process, pipe, port = in_process(tcp_server_main)
    try:
        with socket.create_connection(("127.0.0.1", port)) as conn:
            for shape in SHAPES:
                size = len(shape.container)
                buffer = memoryview(bytearray(size))

                async def block(
                    size: int = size, buffer: memoryview = buffer, payload: int = shape.payload
                ) -> int:
                    conn.sendall(size.to_bytes(8, "big"))
                    got = 0
                    while got < size:
                        got += conn.recv_into(buffer[got:])
                    return got - (size - payload)  # the K and V octets, as elsewhere

                table.record(
                    "tcp",
                    "plain TCP stream (blocking sockets, unverified)",
                    shape,
                    lambda b=block, s=shape: asyncio.run(timed(b, s, seconds)),
                )
    finally:
        stop(process, pipe)


# --- HTTP: kvsp serve holder + BlockClient -------------------------------------------------------


def start_holder(folder: Path) -> Any:
    """``kvsp serve holder`` with both descriptors and block 0 of each shape stored."""
    import httpx

    from kvsp.web.auth import principal_entry, write_principals
    from kvsp.web.testing import start_process

    principals = folder / "principals.toml"
    write_principals(principals, [principal_entry("bench", TOKEN, ["admin"], None)])
    argv = [sys.executable, "-m", "kvsp", "serve", "holder", "--listen", "127.0.0.1:0"]
    argv += ["--principals", str(principals), "--state", str(folder / "state")]
    argv += ["--tier", f"host={4 * sum(len(s.container) for s in SHAPES)}"]
    holder = start_process(argv, workdir=folder)
    auth = {"authorization": f"Bearer {TOKEN}"}
    try:
        with httpx.Client(timeout=30) as http:
            for shape in SHAPES:
                compat = shape.compat.hex()
                url = f"{holder.base_url}descriptors/{compat}"
                http.put(url, json=shape.descriptor.to_json(), headers=auth).raise_for_status()
                url = f"{holder.base_url}blocks/{compat}/{SCOPE.hex()}/{block_key(shape, 0).hex()}"
                headers = auth | {"if-none-match": "*", "content-type": "application/kvsp-block"}
                http.put(url, content=shape.container, headers=headers).raise_for_status()
    except BaseException:
        holder.stop()
        raise
    return holder


# --- MOQT: one publisher process behind every QUIC and QMux listener ------------------------------

AIOQUIC_DEFAULTS = TransportConfig(max_datagram_size=None, probe_path_mtu=False, socket_buffer=0)
"""aioquic as it comes: 1,200-byte datagrams, its 1 MiB windows, the system's socket buffers."""


def quic_rows() -> list[tuple[str, str, str, TransportConfig]]:
    """(key, label, backend, transport) of the MOQT-over-QUIC rows."""
    best = default_backend()
    rows = [
        ("quic-aioquic-defaults", "aioquic defaults (1200 B)", "aioquic", AIOQUIC_DEFAULTS),
        (
            "quic-aioquic-1452",
            "aioquic, 1452 B",
            "aioquic",
            TransportConfig(max_datagram_size=1452),
        ),
        ("quic-default-1452", f"{best} (the default), 1452 B", best, TransportConfig()),
        ("quic-default-9000", f"{best}, 9000 B", best, TransportConfig(max_datagram_size=9000)),
    ]
    return [(k, f"MOQT over QUIC, {label}", b, t) for k, label, b, t in rows]


QMUX_ROWS = (
    ("qmux-tls", "tls", "MOQT over QMux, TLS 1.3 over TCP"),
    ("qmux-tcp", "tcp", "MOQT over QMux, plain TCP (loopback)"),
    ("qmux-uds", "unix", "MOQT over QMux, Unix socket"),
)
CARRIER_NAMES = {
    "quic-default-1452": "QUIC",
    "qmux-tls": "QMux TLS",
    "qmux-tcp": "QMux TCP",
    "qmux-uds": "QMux UDS",
}
SCHEMES = {"moqt": "quic-default-1452", "moqt+tls": "qmux-tls", "moqt+tcp": "qmux-tcp"}
SCHEMES["moqt+unix"] = "qmux-uds"


def block_handler(blocks: Any) -> Callable[[MOQTConnection], Awaitable[None]]:
    """The publisher every listener runs: serve_blocks' handler (FETCH and SUBSCRIBE)."""
    from kvsp.transfer.moqt_publisher import LiveTracks, MoqtBlockPublisher

    live = LiveTracks()

    async def handler(connection: MOQTConnection) -> None:
        await MoqtBlockPublisher(connection, blocks, live=live).serve()

    return handler


def publisher_main(cert: str, key: str, folder: str, pipe: Connection) -> None:
    """Listen on every QUIC row's settings and on the three QMux carriers; send back
    ``{row key: URI or "failed: ..."}``; serve until told to stop."""

    async def main() -> None:
        handler = block_handler(stored_blocks(SHAPES, 1))
        servers: list[Any] = []
        uris: dict[str, str] = {}
        for row, _, backend, transport in quic_rows():
            try:
                configuration = get_backend(backend).configuration(
                    is_client=False, transport=transport, certificate=cert, private_key=key
                )
                server = await serve(
                    "127.0.0.1",
                    0,
                    configuration=configuration,
                    handler=handler,
                    backend=backend,
                    transport=transport,
                )
                servers.append(server)
                uris[row] = f"moqt://127.0.0.1:{server.address[1]}/"
            except Exception as exc:  # noqa: BLE001 - reported in the row
                uris[row] = failure("listen", exc)
        for row, carrier, _ in QMUX_ROWS:
            try:
                server, uri = await serve_carrier(carrier, handler, cert, key, Path(folder))
                servers.append(server)
                uris[row] = uri
            except Exception as exc:  # noqa: BLE001
                uris[row] = failure("listen", exc)
        pipe.send(uris)
        await asyncio.get_running_loop().run_in_executor(None, pipe.recv)
        for server in servers:
            server.close()

    asyncio.run(main())


async def serve_carrier(
    carrier: str, handler: Any, cert: str, key: str, folder: Path
) -> tuple[Any, str]:
    """A QMux listener on ``carrier`` (tls, tcp, unix) and its ``moqt+*`` URI."""
    from moqt.qmux_asyncio import QMuxEndpoint, serve_qmux, server_ssl_context

    if carrier == "unix":
        path = folder / "publisher.sock"
        endpoint = QMuxEndpoint(carrier="unix", host=None, port=None, path=str(path))
        server = await serve_qmux(endpoint, handler=handler)
        return server, f"moqt+unix://localhost{path.resolve()}"
    endpoint = QMuxEndpoint(carrier=carrier, host="127.0.0.1", port=0, path=None)
    context = server_ssl_context(cert, key) if carrier == "tls" else None
    server = await serve_qmux(endpoint, handler=handler, ssl_context=context)
    return server, f"moqt+{carrier}://127.0.0.1:{server.address[1]}/"


def carrier_used(client: Any) -> str:
    """The carriers of the client's open sessions (to show a record's carrier was taken)."""
    return ",".join(sorted({address.carrier for address in getattr(client, "_sessions", {})}))


def fetcher(
    client: Any, record: ReplicaRecord, shape: Shape, http_base: str | None = None
) -> Callable[[], Awaitable[int]]:
    """Fetch the record's block with ``client`` (a BlockClient GETting from ``http_base``, or
    a MoqtBlockClient); the K and V octets delivered."""

    async def block() -> int:
        if http_base is not None:
            return kv_octets(await client.get_block(http_base, record, geometry=shape.geometry))
        got = await client.get_block(record, geometry=shape.geometry, block_tokens=TOKENS)
        return kv_octets(got)

    return block


async def warm(block: Callable[[], Awaitable[int]], client: Any, expect: str) -> None:
    """Fetch once outside the clock (the session or connection), checking the carrier."""
    await block()
    used = carrier_used(client) if expect != "http" else "http"
    if used != expect:
        raise AssertionError(f"the client took {used or 'nothing'}, not {expect}")


async def measure_first_hop(
    table: Table,
    http: tuple[str, int],
    uris: dict[str, str],
    cert: str,
    seconds: float,
    pid: int,
) -> None:
    """Verified GETs from the holder (``http``: its base URL and process id) and FETCHes from
    the publisher (``pid``) on every QUIC setting and QMux carrier, side by side: one client
    each, all open at once, the rows taking turns (:func:`in_turns`)."""
    from kvsp.transfer.block_client import BlockClient
    from kvsp.transfer.moqt_client import MoqtBlockClient

    base, holder_pid = http
    async with contextlib.AsyncExitStack() as stack:
        # (key, label, client, holder URI, carriers, expected carrier)
        paths: list[tuple[str, str, Any, str, tuple[str, ...] | None, str]] = []
        web = await stack.enter_async_context(BlockClient(TOKEN))
        paths.append(("http", "HTTP GET, kvsp serve holder + BlockClient", web, base, None, "http"))
        for key, label, backend, transport in quic_rows():
            if not uris[key].startswith("moqt://"):
                table.row(key, label).notes.append(uris[key])
                continue
            client = MoqtBlockClient(
                cafile=cert,
                server_name="localhost",
                timeout=30,
                backend=backend,
                transport=transport,
            )
            client = await stack.enter_async_context(client)
            paths.append((key, label, client, uris[key], None, "quic"))
        holder = uris.get("quic-default-1452", "")
        for key, carrier, label in QMUX_ROWS:
            uri = uris[key]
            if not uri.startswith("moqt+") or not holder.startswith("moqt://"):
                table.row(key, label).notes.append(uri if not uri.startswith("moqt+") else holder)
                continue
            client = MoqtBlockClient(cafile=cert, server_name="localhost", timeout=30)
            client = await stack.enter_async_context(client)
            paths.append((key, label, client, holder, (uri,), carrier))
        for shape in SHAPES:
            rows = []
            for key, label, client, at, carriers, expect in paths:
                record = block_record(shape, at, block_key(shape, 0), carriers)
                block = fetcher(client, record, shape, base if expect == "http" else None)
                server = holder_pid if expect == "http" else pid
                try:
                    await warm(block, client, expect)
                except Exception as exc:  # noqa: BLE001 - a path that cannot run is a result
                    table.row(key, label).notes.append(failure(shape.name, exc))
                    continue
                rows.append(Turns(key, label, block, (server,)))
            await in_turns(table, shape, rows, seconds)


# --- the relay ----------------------------------------------------------------------------------


def relay_publisher_main(carrier: str, pipe: Connection) -> None:
    """An instance's session to the relay over ``carrier`` (a ``moqt`` URI): its scope
    announced for both shapes, their relay blocks stored, live tracks made on command
    ("open S N", then "go S N": shape S, track N)."""
    from kvsp.transfer.moqt_carriers import SessionOptions, open_session
    from kvsp.transfer.moqt_publisher import MoqtBlockPublisher
    from kvsp.transfer.moqt_transfer import parse_moqt_uri

    async def main() -> None:
        blocks = stored_blocks(SHAPES, None)
        async with contextlib.AsyncExitStack() as stack:
            options = SessionOptions(verify=False, timeout=30)
            connection = await open_session(stack, parse_moqt_uri(carrier), options)
            publisher = MoqtBlockPublisher(connection, blocks)
            serving = asyncio.ensure_future(publisher.serve())
            for shape in SHAPES:
                await publisher.announce(shape.compat, SCOPE)
            pipe.send("ready")
            writers: dict[tuple[int, int], Any] = {}
            loop = asyncio.get_running_loop()
            while (command := await loop.run_in_executor(None, pipe.recv)) != "stop":
                verb, which, number = command.split()
                shape, n = SHAPES[int(which)], int(number)
                if verb == "open":
                    writers[int(which), n] = publisher.publish_live(
                        LIVE_PRODUCER,
                        shape.compat,
                        SCOPE,
                        block_key(shape, 1000 + n),
                        token_count=TOKENS,
                    )
                else:
                    writer = writers.pop((int(which), n))
                    for index, (k, v) in enumerate(shape.layers):
                        writer.send_layer(index, k, v)
                        await asyncio.sleep(0)
                    writer.finish()
                pipe.send("done")
            serving.cancel()

    asyncio.run(main())


def start_relay(folder: Path) -> tuple[Any, str, dict[str, str]]:
    """``relay.app --open`` listening on QUIC and on QMux TLS, TCP and a Unix socket: the
    peer, its QUIC URI, and {row key: URI} of every carrier it announced."""
    from interop.peers import start_our_relay

    sock = folder / "relay.sock"
    try:
        relay = start_our_relay(
            folder, "--qmux-unix", str(sock), "--qmux-tcp-listen", "127.0.0.1:0"
        )
    except Exception:  # noqa: BLE001 - no QMux in this relay: QUIC only
        relay = start_our_relay(folder, "--qmux-listen", "off")
    info = json.loads((folder / "relay-ready.json").read_text())
    carriers = {"quic-default-1452": relay.url}
    for uri in info.get("carriers", []):
        scheme = uri.split(":", 1)[0]
        if scheme in SCHEMES:
            carriers[SCHEMES[scheme]] = uri
    return relay, relay.url, carriers


def fastest_carrier(table: Table, offered: dict[str, str]) -> str:
    """The row key of the fastest carrier (2 MiB, direct) that the relay offers."""
    measured = [(table.rate(key) or 0.0, key) for key in offered]
    return max(measured)[1]


@dataclass(frozen=True)
class Direct:
    """The publisher of the first hop, fetched from directly beside the relay's misses."""

    holder: str
    carriers: tuple[str, ...] | None
    cafile: str
    pid: int


async def measure_relay(
    table: Table,
    url: str,
    carrier_key: str,
    carrier: str,
    pipe: Connection,
    seconds: float,
    servers: tuple[int, ...],
    direct: Direct,
) -> None:
    """FETCH forwarded upstream (a miss per block) side by side with the same FETCH straight
    from the first hop's publisher on the same carrier, then FETCH from the cache, and
    fan-out."""
    from kvsp.transfer.moqt_client import MoqtBlockClient

    name = CARRIER_NAMES[carrier_key]
    expect = next((c for k, c, _ in QMUX_ROWS if k == carrier_key), "quic")
    carriers = None if carrier_key == "quic-default-1452" else (carrier,)
    straight = MoqtBlockClient(cafile=direct.cafile, server_name="localhost", timeout=30)
    async with MoqtBlockClient(verify=False, timeout=30) as client, straight:
        for shape in SHAPES:
            records = [
                block_record(shape, url, block_key(shape, n), carriers)
                for n in range(shape.relay_blocks)
            ]
            cursor = iter(records)
            fetched: list[ReplicaRecord] = []

            async def miss(
                cursor: Any = cursor, shape: Shape = shape, fetched: list[ReplicaRecord] = fetched
            ) -> int:
                record = next(cursor)
                fetched.append(record)
                got = await client.get_block(record, geometry=shape.geometry, block_tokens=TOKENS)
                return kv_octets(got)

            record = block_record(shape, direct.holder, block_key(shape, 0), direct.carriers)
            rows = [
                Turns(
                    "relay-miss",
                    f"relay, FETCH forwarded upstream (miss), {name}",
                    miss,
                    servers,
                    limit=len(records) - 1,
                ),
                Turns(
                    "relay-direct",
                    f"the same FETCH from the publisher directly, {name}",
                    fetcher(straight, record, shape),
                    (direct.pid,),
                ),
            ]
            try:  # the sessions and a forwarded FETCH, outside the clock
                await warm(miss, client, expect)
                await warm(rows[1].block, straight, expect)
            except Exception as exc:  # noqa: BLE001 - a path that cannot run is a result
                table.row(rows[0].key, rows[0].label).notes.append(failure(shape.name, exc))
                continue
            await in_turns(table, shape, rows, seconds)

            async def hit(shape: Shape = shape, fetched: list[ReplicaRecord] = fetched) -> float:
                turn = iter(range(1 << 30))

                async def block() -> int:
                    record = fetched[next(turn) % len(fetched)]
                    got = await client.get_block(
                        record, geometry=shape.geometry, block_tokens=TOKENS
                    )
                    return kv_octets(got)

                return await timed(block, shape, seconds, servers=servers)

            label = f"relay, FETCH from its cache (hit), {name}"
            await table.arecord("relay-hit", label, shape, hit)
    for index, shape in enumerate(SHAPES):
        label = f"relay, live track to {FANOUT} subscribers (MB/s each), {name}"
        await table.arecord(
            "relay-fanout", label, shape, lambda i=index: fanout(i, carrier, pipe, seconds)
        )


async def fanout(which: int, carrier: str, pipe: Connection, seconds: float) -> float:
    """FANOUT subscribers of live tracks through the relay, rounds of one block each; MB/s
    each subscriber received (the note gives the sum)."""
    from kvsp.transfer.moqt_client import MoqtBlockClient

    shape = SHAPES[which]
    loop = asyncio.get_running_loop()
    clients = [MoqtBlockClient(verify=False, timeout=30) for _ in range(FANOUT)]
    total, elapsed, rounds = 0, 0.0, 0
    try:
        while rounds < 2 or (elapsed < seconds and rounds < 16):
            pipe.send(f"open {which} {rounds}")
            await loop.run_in_executor(None, pipe.recv)
            streams = [
                client.subscribe_live(
                    carrier,
                    producer=LIVE_PRODUCER,
                    compat=shape.compat,
                    scope=SCOPE,
                    key=block_key(shape, 1000 + rounds),
                    geometry=shape.geometry,
                    block_tokens=TOKENS,
                )
                for client in clients
            ]
            tasks = [asyncio.ensure_future(_drain(stream)) for stream in streams]
            await asyncio.sleep(0.2)  # every SUBSCRIBE has reached the publisher
            started = time.perf_counter()
            pipe.send(f"go {which} {rounds}")
            sizes = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            elapsed += time.perf_counter() - started
            await loop.run_in_executor(None, pipe.recv)
            if any(size != shape.payload for size in sizes):
                raise AssertionError(f"subscribers got {sizes}, expected {shape.payload} each")
            total += sum(sizes)
            rounds += 1
    finally:
        for client in clients:
            await client.aclose()
    return total / FANOUT / elapsed / 1e6


async def _drain(stream: Any) -> int:
    return kv_octets(await stream.block())


# --- the directive path --------------------------------------------------------------------------

DIRECTIVE_BLOCKS = 64
DIRECTIVE_BYTES = 64 * 1024


DIRECTIVE_REPS = 5
"""Directives of each variant, alternating (one directive is about 0.1 s: one is noise)."""


DIRECTIVE_VARIANTS = (
    ("after", "", "now"),
    ("before", "-options", "today's code with the old options"),
    ("filed", "-before", "the code issue #20 measured, {commit}"),
)
"""(``bench_directive`` variant, row key suffix, label): the pipeline as it is now; the path
rebuilt from options on today's code; and the code of ``bench_directive.FILED_COMMIT``, the
directive path as issue #20 measured it, which the ratio divides by."""


async def measure_directive_rows(table: Table, transports: tuple[str, ...]) -> None:
    """Blocks a second of a ``kvsp demo``-sized directive, for each of
    :data:`DIRECTIVE_VARIANTS`: they alternate, :data:`DIRECTIVE_REPS` each, and each row is
    the median of its own. A variant that cannot run (the filed code needs this clone's git
    history) keeps its row, with the reason."""
    from bench.bench_directive import FILED_COMMIT, measure_directive

    shape = SHAPES[1]
    for transport in transports:
        rates: dict[str, list[float]] = {v: [] for v, _, _ in DIRECTIVE_VARIANTS}
        failed: dict[str, str] = {}
        for _ in range(DIRECTIVE_REPS):
            for variant, _, _ in DIRECTIVE_VARIANTS:
                if variant in failed:
                    continue
                try:
                    rate = await measure_directive(
                        DIRECTIVE_BYTES, DIRECTIVE_BLOCKS, transport=transport, variant=variant
                    )
                except Exception as exc:  # noqa: BLE001 - a path that cannot run is a result
                    failed[variant] = failure(shape.name, exc)
                else:
                    rates[variant].append(rate)
        for variant, suffix, when in DIRECTIVE_VARIANTS:
            key = f"directive-{transport}{suffix}"
            when = when.format(commit=FILED_COMMIT[:7])
            row = table.row(
                key, f"directive path, {transport.upper()}, {DIRECTIVE_BLOCKS} blocks ({when})"
            )
            if variant in failed:
                row.notes.append(failed[variant])
            if rates[variant]:
                rate = statistics.median(rates[variant])
                row.per_second[shape.name] = rate
                row.rates[shape.name] = rate * DIRECTIVE_BYTES / 1e6


# --- peers: Redis and Mooncake -------------------------------------------------------------------


def measure_redis(table: Table, seconds: float) -> None:
    """GET of a stored container + SHA-256 of it (LMCache's Redis backend, plus the hash)."""
    label = "peer: Redis GET + SHA-256"
    row = table.row("redis", label)
    exe = shutil.which("redis-server")
    if exe is None:
        row.notes.append("skipped: redis-server is not installed")
        return
    try:
        import redis
    except ModuleNotFoundError:
        row.notes.append("skipped: the redis Python package is not installed")
        return
    port = free_port()
    argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(host="127.0.0.1", port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        for shape in SHAPES:
            name = f"block-{shape.name}"
            client.set(name, shape.container)
            digest = hashlib.sha256(shape.container).digest()

            async def block(name: str = name, digest: bytes = digest, shape: Shape = shape) -> int:
                data = client.get(name)
                if not isinstance(data, bytes) or hashlib.sha256(data).digest() != digest:
                    raise AssertionError("Redis returned other octets")
                return len(data) - (len(shape.container) - shape.payload)

            table.record(
                "redis", label, shape, lambda b=block, s=shape: asyncio.run(timed(b, s, seconds))
            )
        client.close()
    except Exception as exc:  # noqa: BLE001
        row.notes.append(failure("redis", exc))
    finally:
        process.terminate()
        process.wait(10)


MOONCAKE_PACKAGES = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")
"""Tried in order: the CPU build first (the CUDA one needs libcuda to import)."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("KVSP_BENCH_CACHE", Path(base) / "kvsp-bench"))


def mooncake_python(install: bool) -> tuple[Path | None, str]:
    """A Python that imports ``mooncake.store`` (from a venv under :func:`cache_dir`), or
    None and why not."""
    reasons = []
    for package in MOONCAKE_PACKAGES:
        venv = cache_dir() / f"venv-{package}"
        python = venv / "bin" / "python"
        if not python.exists():
            if not install:
                reasons.append(f"{package} not installed (run with --install-peers)")
                continue
            print(f"# installing {package} into {venv} ...", flush=True)
            made = subprocess.run(
                [sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True
            )
            pip = [str(python), "-m", "pip", "install", "-q", package]
            done = made.returncode == 0 and (
                subprocess.run(pip, capture_output=True, text=True, timeout=900).returncode == 0
            )
            if not done:
                shutil.rmtree(venv, ignore_errors=True)
                reasons.append(f"pip install {package} failed")
                continue
        check = subprocess.run(
            [str(python), "-c", "import mooncake.store"], capture_output=True, text=True
        )
        if check.returncode == 0:
            return python, package
        last = (check.stderr.strip().splitlines() or ["?"])[-1]
        reasons.append(f"{package} does not import: {last}")
    return None, "; ".join(reasons)


def measure_mooncake(table: Table, seconds: float, install: bool) -> None:
    """``get_into`` of a block held by another process's segment, over Mooncake's TCP
    transport, + SHA-256 (bench/peer_mooncake.py)."""
    label = "peer: Mooncake Store get_into + SHA-256 (TCP)"
    row = table.row("mooncake", label)
    python, found = mooncake_python(install)
    if python is None:
        row.notes.append(f"skipped: {found}")
        return
    master_exe = python.parent / "mooncake_master"
    script = str(Path(__file__).with_name("peer_mooncake.py"))
    folder = Path(tempfile.mkdtemp(prefix="bench-mooncake-"))
    http, rpc, metrics = free_port(), free_port(), free_port()
    master = subprocess.Popen(
        [
            str(master_exe),
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={http}",
            "--rpc_address=127.0.0.1",
            f"--rpc_port={rpc}",
            f"--metrics_port={metrics}",
            "--enable_metric_reporting=false",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(folder / "master.log", "wb"),  # noqa: SIM115 - closed with the process
    )
    common = ["--master", f"127.0.0.1:{rpc}", "--metadata", f"http://127.0.0.1:{http}/metadata"]
    common += ["--sizes", ",".join(str(s.payload) for s in SHAPES)]
    holder = None
    try:
        wait_port(rpc, 20)
        holder = subprocess.Popen(
            [str(python), script, "holder", *common],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(folder / "holder.log", "wb"),  # noqa: SIM115
            text=True,
        )
        assert holder.stdout is not None
        digests = holder.stdout.readline().strip()
        if not digests:
            raise RuntimeError(f"the holder stopped: {(folder / 'holder.log').read_text()[-300:]}")
        client = subprocess.run(
            [str(python), script, "client", *common, "--seconds", str(seconds)]
            + ["--digests", digests],
            capture_output=True,
            text=True,
            timeout=60 + 4 * seconds,
        )
        if client.returncode != 0:
            raise RuntimeError(client.stderr.strip()[-300:] or f"exit {client.returncode}")
        rates = json.loads(client.stdout.strip().splitlines()[-1])
        for shape in SHAPES:
            table.row("mooncake", label).rates[shape.name] = float(rates[str(shape.payload)])
        row.notes.append(f"{found}")
    except Exception as exc:  # noqa: BLE001
        row.notes.append(failure("mooncake", exc))
    finally:
        if holder is not None:
            with contextlib.suppress(OSError):
                assert holder.stdin is not None
                holder.stdin.close()
            try:
                holder.wait(10)
            except subprocess.TimeoutExpired:
                holder.kill()
        master.terminate()
        try:
            master.wait(10)
        except subprocess.TimeoutExpired:
            master.kill()


def wait_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


# --- the run -------------------------------------------------------------------------------------

RATIOS = (
    ("qmux-tls/http-verified", "qmux-tls", "http", 0.8),
    ("qmux-uds/http-verified", "qmux-uds", "http", 1.0),
    ("quic-default-1452/aioquic-defaults", "quic-default-1452", "quic-aioquic-defaults", 10.0),
    ("relay-miss/direct", "relay-miss", "relay-direct", 0.6),
    ("directive-64k/directive-64k-before", "directive-moqt", "directive-moqt-before", 10.0),
)
"""(name, numerator row, denominator row, target): 2 MiB blocks but for the directive rows."""


FALLBACKS = {"directive-moqt-before": "directive-moqt-options"}
"""A denominator row that could not run, and the row measured in its place (said in the
table): the filed code needs this clone's git history."""


def ratios(table: Table) -> list[tuple[str, float | None, float]]:
    out = []
    for name, top, bottom, target in RATIOS:
        shape = "64 KiB" if top.startswith("directive") else "2 MiB"
        a, b = table.rate(top, shape), table.rate(bottom, shape)
        if not b and bottom in FALLBACKS:
            b = table.rate(FALLBACKS[bottom], shape)
            if b and bottom in table.rows:
                table.rows[bottom].notes.append(f"the ratio divides by {FALLBACKS[bottom]}")
        out.append((name, a / b if a and b else None, target))
    return out


def print_table(table: Table, found: list[tuple[str, float | None, float]]) -> None:
    names = [shape.name for shape in SHAPES]
    print("# cpu ms/block (2 MiB): CPU milliseconds a block of the client | the server process")
    print("# (relay rows: client | relay | publisher); 2 cores shared by all of them")
    head = f"{'path':72}" + "".join(f" {n + ' MB/s':>12} {'ms/block':>8}" for n in names)
    print(head + "  note")
    for row in table.rows.values():
        cells = ""
        for shape in SHAPES:
            rate = row.rates.get(shape.name)
            if rate:
                cells += f" {rate:12.1f} {shape.payload / 1e3 / rate:8.2f}"
            else:
                cells += f" {'-':>12} {'-':>8}"
        notes = list(row.notes)
        notes += [f"{n}: {r:.0f} blocks/s" for n, r in row.per_second.items()]
        print(f"{row.label[:72]:72}{cells}  {'; '.join(notes)}")
    print()
    print(f"{'ratio (2 MiB; directive: 64 KiB blocks/s)':44} {'value':>8} {'target':>8}  met")
    for name, value, target in found:
        shown = f"{value:8.2f}" if value is not None else f"{'-':>8}"
        met = "yes" if value is not None and value >= target else "NO"
        print(f"{name:44} {shown} {'>= ' + format(target, 'g'):>8}  {met}")
    now = table.rate("directive-moqt", "64 KiB")
    options = table.rate("directive-moqt-options", "64 KiB")
    if now and options:
        name = "directive-64k/directive-64k-options"
        print(f"{name:44} {now / options:8.2f} {'-':>8}  (today's code with the old options)")


def measure_relay_rows(
    table: Table, folder: Path, publisher: tuple[Any, Connection, Any], cert: str, seconds: float
) -> None:
    """The relay rows on the fastest carrier it offers (the first hop's ``publisher`` still
    serving, for the direct row beside the misses)."""
    relay_folder = folder / "relay"
    relay_folder.mkdir()
    try:
        relay, url, offered = start_relay(relay_folder)
    except Exception as exc:  # noqa: BLE001
        table.row("relay-miss", "relay").notes.append(failure("relay", exc))
        return
    try:
        relay_carrier = fastest_carrier(table, offered)
        carrier = offered[relay_carrier]
        uris = publisher[2]
        holder = uris.get("quic-default-1452", "")
        carriers = None if relay_carrier == "quic-default-1452" else (uris[relay_carrier],)
        direct = Direct(holder, carriers, cert, publisher[0].pid)
        process, pipe, _ = in_process(relay_publisher_main, carrier)
        try:
            servers = (relay.proc.pid, process.pid)
            asyncio.run(
                measure_relay(table, url, relay_carrier, carrier, pipe, seconds, servers, direct)
            )
        finally:
            stop(process, pipe)
    except Exception as exc:  # noqa: BLE001
        table.row("relay-miss", "relay").notes.append(failure("relay", exc))
    finally:
        relay.stop()


def run_all(args: argparse.Namespace, cert: str, key: str, folder: Path) -> dict[str, Any]:
    table = Table()
    seconds = args.seconds
    started = time.perf_counter()
    context = multiprocessing.get_context("spawn")
    print(f"# blocks: {', '.join(f'{s.name} ({len(s.layers)} layers)' for s in SHAPES)}; ", end="")
    print(f"QUIC default {default_backend()} {get_backend().version}; {seconds:g} s a row")
    holder_folder = folder / "holder"
    holder_folder.mkdir()
    publisher = in_process(publisher_main, cert, key, str(folder))
    try:
        holder = start_holder(holder_folder)
        try:
            measure_tcp(table, seconds)
            http = (holder.base_url, holder.proc.pid)
            run = measure_first_hop(table, http, publisher[2], cert, seconds, publisher[0].pid)
            asyncio.run(run)
        finally:
            holder.stop()
        measure_relay_rows(table, folder, publisher, cert, seconds)
    finally:
        stop(publisher[0], publisher[1])
    del context
    measure_redis(table, seconds)
    measure_mooncake(table, seconds, install=args.install_peers or not args.quick)
    transports = ("moqt",) if args.quick else ("moqt", "http")
    try:
        asyncio.run(measure_directive_rows(table, transports))
    finally:
        with contextlib.suppress(Exception):
            from bench.bench_directive import _stop_all

            _stop_all()
    found = ratios(table)
    print()
    print_table(table, found)
    print(f"# {time.perf_counter() - started:.0f} s")
    paths = [
        {"path": f"{row.label} ({shape})", "mb_s": rate, "note": "; ".join(row.notes)}
        | {"key": row.key, "block": shape}
        for row in table.rows.values()
        for shape, rate in row.rates.items()
    ]
    paths += [
        {"path": row.label, "mb_s": 0.0, "note": "; ".join(row.notes), "key": row.key}
        for row in table.rows.values()
        if not row.rates
    ]
    return {
        "paths": paths,
        "ratios": [{"ratio": n, "value": v, "target": t} for n, v, t in found],
        "found": found,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short rows (under 2 minutes)")
    parser.add_argument("--seconds", type=float, help="time per row (default 2; 0.8 quick)")
    parser.add_argument("--install-peers", action="store_true", help="pip install Mooncake")
    parser.add_argument("--paired", action="store_true", help="also the MOQT/raw QUIC table")
    parser.add_argument("--backends", default=",".join(available_backends()))
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    if args.seconds is None:
        args.seconds = 0.8 if args.quick else 2.0
    folder = Path(tempfile.mkdtemp(prefix="bench-moqt-"))
    cert, key = (str(path) for path in make_self_signed("localhost", folder))
    doc: dict[str, Any] = {"moqt": []}
    if args.paired:
        sizes = [int(size) for size in args.sizes.split(",")]
        rows = moqt_table(args.backends.split(","), sizes, cert, key, args.seconds)
        keys = ("backend", "datagram", "moqt_mb_s", "raw_mb_s")
        doc["moqt"] = [dict(zip(keys, row[:4], strict=True)) for row in rows]
        print()
    found = run_all(args, cert, key, folder)
    doc |= {k: v for k, v in found.items() if k != "found"}
    if args.json is not None:
        args.json.write_text(json.dumps(doc), encoding="utf-8")
    shutil.rmtree(folder, ignore_errors=True)
    print()
    for name, value, _ in found["found"]:
        print(f"ratio {name} = {value or 0.0:.2f}")


if __name__ == "__main__":
    main()
