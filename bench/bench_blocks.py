"""Benchmark the bulk block path (spec §6.7; DESIGN.md §7): which HTTP client, and what full
verification costs, side by side in one run against one holder-like server.

Run: ``.venv/bin/python bench/bench_blocks.py [--reps N] [--blocks N] [--server S]
[--only REGEX] [--loop asyncio|uvloop|both]`` (``--only``: just the matching cases, with (a)
and (b) always; ``--loop``: the client's event loop for (c)-(f); by default ``both`` where
uvloop is installed, which runs the (f) cases once more on uvloop, the loop
:mod:`kvsp.web.runner` gives every KVSP service, so the instances that fetch blocks). The
server is ``kvsp serve holder`` (uvicorn with uvloop + httptools, in its own process; or, with
``--server test``, the test holder ``tests/support/bulk_server.py``) holding eight
2 MiB KVB1 containers (16 tokens × 32 layers × 8 kv_heads × 128 head_dim × bf16), served with
``Repr-Digest``. Cases, run round-robin, each figure the median over the repetitions:

(a) a plain TCP stream of the same octets (the transport floor),
(b) a bare blocking-socket HTTP/1.1 client of the server (the HTTP floor),
(c) httpx, (d) aiohttp, (e) :class:`~kvsp.transfer.bulk.BulkClient`, without verification,
(f) :meth:`~kvsp.transfer.block_client.BlockClient.get_block` with full §6.7 verification
    (Repr-Digest + layer digests + replica digest), 1 and 4 in flight, for each placement of
    the hashing passes (``slices`` hashes slices of the received buffer; ``paired``, the
    default where :mod:`kvsp.sha256x2` is built, does so with both SHA-256 streams interleaved
    in one pass); the bodies land in the client's pooled buffers
    (:class:`~kvsp.transfer.buffers.BufferPool`), and the default placement runs once more
    with a fresh buffer per body ("fresh buffers") to show what the reuse saves.

Each case also prints the client's CPU per block (this process, every thread, user + system),
so that what verification costs shows beside what it moves; the server's is not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.util
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import httpx

from kvsp import sha256x2
from kvsp.compat import CompatibilityDescriptor, compat_id
from kvsp.container import Geometry, decode_container, replica_digest
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.records import ReplicaRecord
from kvsp.transfer.block_client import BlockClient
from kvsp.transfer.buffers import BufferPool
from kvsp.transfer.bulk import BulkClient
from kvsp.transfer.http11 import BytesBody
from kvsp.transfer.verify import Hashing
from kvsp.web.auth import principal_entry, write_principals
from kvsp.web.testing import RunningService, start_process

ROOT = Path(__file__).resolve().parent.parent
SERVER = ROOT / "tests" / "support" / "bulk_server.py"
DESCRIPTOR = CompatibilityDescriptor(
    model="bench-blocks",
    model_digest=b"\x05" * 32,
    tokenizer_digest=b"\x06" * 32,
    layers=32,
    kv_heads=8,
    head_dim=128,
    kv_dtype="bf16",
    positional="rope",
    block_tokens=16,
)
GEOMETRY = Geometry.from_descriptor(DESCRIPTOR)
TOKENS = 16
KEYS = [hashlib.sha256(b"bench-%d" % i).digest() for i in range(8)]
COMPAT, SCOPE = CompatId(compat_id(DESCRIPTOR)), ScopeId(bytes(16))
TOKEN = "bench-token-0123456789abcdefghijklmnopq"

TCP_SERVER = r"""
import os, socket, sys, threading
threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()
n = int(sys.argv[1]); block = (bytes(range(256)) * (n // 256 + 1))[:n]
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
def serve(conn):
    with conn:
        while (want := conn.recv(16)):
            for _ in range(int(want)):
                conn.sendall(block)
while True:
    conn, _ = srv.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""


def block_size() -> int:
    sys.path.insert(0, str(SERVER.parent))
    import bulk_server as srv  # noqa: PLC0415 - the test holder's own block maker

    return len(srv.block_container(KEYS[0], geometry=GEOMETRY, tokens=TOKENS))


def records(base: str) -> list[ReplicaRecord]:
    sys.path.insert(0, str(SERVER.parent))
    import bulk_server as srv  # noqa: PLC0415

    out = []
    for key in KEYS:
        container = decode_container(srv.block_container(key, geometry=GEOMETRY, tokens=TOKENS))
        digests = tuple(container.layer_digests())
        out.append(
            ReplicaRecord(
                block_key=BlockKey(key),
                compat_id=COMPAT,
                scope_id=SCOPE,
                holder=base,
                codec=1,
                size=sum(layer.k.nbytes + layer.v.nbytes for layer in container.layers),
                digest=replica_digest(digests),
                layer_digests=digests,
                residency=None,
                ttl_ms=600_000,
            )
        )
    return out


def block_url(base: str, key: bytes) -> str:
    return f"{base}blocks/{COMPAT.hex()}/{SCOPE.hex()}/{key.hex()}"


# -- (a) and (b): blocking sockets -------------------------------------------------------------


def tcp_floor(port: int, size: int, blocks: int, buf: bytearray) -> int:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"%d" % blocks)
        mv, total = memoryview(buf), blocks * size
        got = 0
        while got < total:
            n = sock.recv_into(mv)
            if n == 0:
                raise ConnectionError("TCP floor server closed early")
            got += n
    return got


class RawHTTP:
    """Keep-alive HTTP/1.1 GETs on a blocking socket, body read with recv_into."""

    def __init__(self, base: str, token: str) -> None:
        host, port = re.match(r"http://([^:/]+):(\d+)/", base).groups()  # type: ignore[union-attr]
        self.address = (host, int(port))
        self.host = f"{host}:{port}"
        self.token = token
        self.buf = bytearray(4 << 20)
        self.sock = self.connect()

    def connect(self) -> socket.socket:
        sock = socket.create_connection(self.address)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def get(self, path: str) -> int:
        auth = f"Authorization: Bearer {self.token}"
        req = f"GET {path} HTTP/1.1\r\nHost: {self.host}\r\n{auth}\r\n\r\n".encode()
        self.sock.sendall(req)
        head = b""
        while b"\r\n\r\n" not in head:
            data = self.sock.recv(65536)
            if not data:  # the server closed the idle keep-alive connection: reconnect
                if head:
                    raise ConnectionError("closed mid-head")
                self.sock.close()
                self.sock = self.connect()
                self.sock.sendall(req)
            head += data
        fields, _, rest = head.partition(b"\r\n\r\n")
        length = int(re.search(rb"(?i)content-length: *(\d+)", fields).group(1))  # type: ignore[union-attr]
        mv = memoryview(self.buf)
        got = len(rest)
        mv[:got] = rest
        while got < length:
            n = self.sock.recv_into(mv[got:length])
            if n == 0:
                raise ConnectionError("closed mid-body")
            got += n
        return length


# -- the measurement loop ----------------------------------------------------------------------


def spread(blocks: int, inflight: int, one: Callable[[int], Awaitable[int]]) -> Awaitable[int]:
    async def worker(w: int) -> int:
        return sum([await one(i) for i in range(w, blocks, inflight)])

    async def run() -> int:
        return sum(await asyncio.gather(*(worker(w) for w in range(inflight))))

    return run()


def start_holder(folder: Path, kind: str) -> tuple[RunningService, str]:
    """The server under test and the base URL of its blocks."""
    if kind == "test":
        geometry = f"{GEOMETRY.layers},{GEOMETRY.kv_heads},{GEOMETRY.head_dim},2"
        argv = [sys.executable, str(SERVER), "--geometry", geometry]
        service = start_process(argv, workdir=folder)
        return service, service.base_url + "good/"
    principals = folder / "principals.toml"
    write_principals(principals, [principal_entry("bench", TOKEN, ["admin"], None)])
    descriptor = folder / "descriptor.json"
    descriptor.write_text(json.dumps(DESCRIPTOR.to_json()))
    argv = [sys.executable, "-m", "kvsp", "serve", "holder", "--listen", "127.0.0.1:0"]
    argv += ["--principals", str(principals), "--state", str(folder / "state")]
    argv += ["--descriptor", str(descriptor), "--tier", "host=64MiB"]
    service = start_process(argv, workdir=folder)
    return service, service.base_url


async def store_blocks(base: str, token: str) -> None:
    import bulk_server as srv  # noqa: PLC0415 - on sys.path after block_size()

    async with BlockClient(token) as client:
        for key in KEYS:
            data = srv.block_container(key, geometry=GEOMETRY, tokens=TOKENS)
            await client.put_block(base, COMPAT, SCOPE, BlockKey(key), data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=96, help="blocks per case and rep")
    parser.add_argument("--server", choices=["holder", "test"], default="holder")
    parser.add_argument("--only", default="", help="regex: run only the cases it matches")
    default_loop = "both" if importlib.util.find_spec("uvloop") else "asyncio"
    parser.add_argument("--loop", choices=["asyncio", "uvloop", "both"], default=default_loop)
    args = parser.parse_args()
    size = block_size()
    folder = Path(tempfile.mkdtemp(prefix="kvsp-bench-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so that the finally below runs
    server, base = start_holder(folder, args.server)
    tcp = subprocess.Popen(  # it exits when its stdin closes, i.e. when this process ends
        [sys.executable, "-c", TCP_SERVER, str(size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        token = TOKEN if args.server == "holder" else srv_token()
        if args.server == "holder":
            asyncio.run(store_blocks(base, token))
        tcp_port = int(tcp.stdout.readline())  # type: ignore[union-attr]
        label = "kvsp serve holder" if args.server == "holder" else "the test holder"
        run(base, token, label, tcp_port, size, args.reps, args.blocks, args.only, args.loop)
    finally:
        tcp.kill()
        tcp.wait()
        server.stop()


def hash_costs(size: int, reps: int = 30) -> None:
    """CPU per block of §6.7's two SHA-256 passes: hashlib twice against one paired pass."""
    data = memoryview(bytes(range(256)) * (size // 256))

    def best(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    twice = best(lambda: (hashlib.sha256(data).digest(), hashlib.sha256(data).digest()))
    line = f"hashing one block twice: hashlib {twice * 1e3:.2f} ms"
    if sha256x2.ACCELERATED:

        def paired() -> None:
            a, b = sha256x2.Sha256(), sha256x2.Sha256()
            sha256x2.update2(a, b, data)
            a.digest(), b.digest()

        one = best(paired)
        line += f", paired {one * 1e3:.2f} ms ({twice / one:.2f}x less CPU)"
    else:
        line += " (kvsp.sha256x2 not accelerated here)"
    print(line)


def srv_token() -> str:
    import bulk_server as srv  # noqa: PLC0415

    return str(srv.TOKEN)


def run(  # noqa: C901, PLR0913 - one flat list of cases reads best
    base: str,
    token: str,
    label: str,
    tcp_port: int,
    size: int,
    reps: int,
    blocks: int,
    only: str = "",
    loop_kind: str = "asyncio",
) -> None:
    recs = records(base)
    urls = [block_url(base, key) for key in KEYS]
    paths = ["/" + url.split("/", 3)[3] for url in urls]
    floor_buf = bytearray(4 << 20)
    kinds = ["asyncio", "uvloop"] if loop_kind == "both" else [loop_kind]
    runners = [asyncio.Runner(loop_factory=loop_factory(kind)) for kind in kinds]
    auth = {"authorization": f"Bearer {token}"}
    raw = RawHTTP(base, token)
    hx = httpx.AsyncClient(headers=auth, timeout=30)
    aio: list[aiohttp.ClientSession] = []
    bulk = BulkClient()
    placements: list[Hashing] = ["inline", "thread", "split", "slices"]
    if sha256x2.ACCELERATED:
        placements.append("paired")
    # one set of verifying clients per loop: a client's connections belong to its loop
    verifiers = [{h: BlockClient(token, hashing=h) for h in placements} for _ in kinds]
    # the default placement once more with a fresh buffer per body (no BufferPool reuse)
    fresh = BlockClient(token, hashing=placements[-1], buffers=BufferPool(0))

    async def start_aiohttp() -> None:
        aio.append(aiohttp.ClientSession(headers=auth))

    runners[0].run(start_aiohttp())

    async def get_httpx(i: int) -> int:
        return len((await hx.get(urls[i % 8])).content)

    async def get_aiohttp(i: int) -> int:
        async with aio[0].get(urls[i % 8]) as r:
            return len(await r.read())

    async def get_bulk(i: int) -> int:
        response = await bulk.request("GET", urls[i % 8], headers=auth)
        body = response.body
        return len(body.data) if isinstance(body, BytesBody) else 0

    def get_verified(client: BlockClient) -> Callable[[int], Awaitable[int]]:
        async def one(i: int) -> int:
            block = await client.get_block(base, recs[i % 8], geometry=GEOMETRY)
            return sum(layer.k.nbytes + layer.v.nbytes for layer in block.layers) and size

        return one

    def aio_case(
        one: Callable[[int], Awaitable[int]], inflight: int, on: asyncio.Runner | None = None
    ) -> Callable[[], int]:
        target = (on or runners[0]).get_loop()
        return lambda: target.run_until_complete(spread(blocks, inflight, one))

    cases: list[tuple[str, Callable[[], int]]] = [
        ("(a) TCP stream, blocking socket", lambda: tcp_floor(tcp_port, size, blocks, floor_buf)),
        ("(b) bare socket HTTP client", lambda: sum(raw.get(paths[i % 8]) for i in range(blocks))),
        ("(c) httpx", aio_case(get_httpx, 1)),
        ("(d) aiohttp", aio_case(get_aiohttp, 1)),
        ("(d) aiohttp, 4 in flight", aio_case(get_aiohttp, 4)),
        ("(e) BulkClient", aio_case(get_bulk, 1)),
        ("(e) BulkClient, 4 in flight", aio_case(get_bulk, 4)),
    ]
    for kind, runner, clients in zip(kinds, runners, verifiers, strict=True):
        tag = f" [{kind}]" if len(kinds) > 1 else ""
        for hashing in placements:
            for inflight in (1, 4):
                name = f"(f) verified, hashing={hashing}, {inflight} in flight{tag}"
                cases.append((name, aio_case(get_verified(clients[hashing]), inflight, runner)))
    name = f"(f) verified, hashing={placements[-1]}, 4 in flight, fresh buffers"
    cases.append(
        (name + (f" [{kinds[0]}]" if len(kinds) > 1 else ""), aio_case(get_verified(fresh), 4))
    )

    keep = re.compile(only)
    cases = [c for i, c in enumerate(cases) if i < 2 or keep.search(c[0])]  # (a), (b) always
    for _, fn in cases:
        fn()  # warm up: connections open, caches filled
    rates: list[list[float]] = [[] for _ in cases]
    cpu = [0.0] * len(cases)  # this process's CPU (every thread), seconds per block moved
    for _ in range(reps):
        for n, ((_, fn), out) in enumerate(zip(cases, rates, strict=True)):
            before = os.times()
            start = time.perf_counter()
            moved = fn()
            out.append(moved / (time.perf_counter() - start) / 1e6)
            after = os.times()
            used = after.user + after.system - before.user - before.system
            cpu[n] += used / (moved / size) / reps

    medians = {name: statistics.median(r) for (name, _), r in zip(cases, rates, strict=True)}
    print(f"block: {size} octets (2 MiB KVB1), {blocks} blocks per case, median of {reps} reps")
    hash_costs(size)
    print(f"server: {label} (uvicorn + uvloop + httptools), client loop: {kinds[0]}", end="")
    print(" (the (f) cases also on uvloop, marked)" if len(kinds) > 1 else "")
    width = max(len(name) for name, _ in cases)
    for (name, _), r, c in zip(cases, rates, cpu, strict=True):
        line = f"{medians[name]:8.0f} MB/s   (min {min(r):5.0f}, max {max(r):5.0f})"
        print(f"  {name:<{width}} {line}   client CPU {c * 1e3:.2f} ms/block")
    floor_a = medians[cases[0][0]]
    floor_b = medians[cases[1][0]]
    for name, value in medians.items():
        if name.startswith("(f)"):
            ratios = f"(f)/(b) {value / floor_b:.2f}   (f)/(a) {value / floor_a:.2f}"
            print(f"  {name:<{width}} {ratios}")

    async def close(clients: dict[Hashing, BlockClient], first: bool) -> None:
        if first:
            await hx.aclose()
            await aio[0].close()
            await bulk.aclose()
            await fresh.aclose()
        for client in clients.values():
            await client.aclose()

    for n, (runner, clients) in enumerate(zip(runners, verifiers, strict=True)):
        runner.run(close(clients, n == 0))
        runner.close()


def loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop factory for ``kind`` (None: asyncio's default)."""
    if kind != "uvloop":
        return None
    import uvloop  # noqa: PLC0415 - optional

    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


if __name__ == "__main__":
    main()
