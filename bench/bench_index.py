"""Benchmark the Index Service (§6.1-6.2): 1,000,000 replica records, lookups of 1,000-key
prompts, in-process and over HTTP, full and compact answers, printed side by side.

Run by hand: ``.venv/bin/python bench/bench_index.py --records 1000000 --prompt-keys 1000``.

The data: prompts of ``--prompt-keys`` blocks that share prefixes (20 shared prefixes of a
quarter prompt each, then a continuation of its own per prompt), each block held by 1-3 of 8
holders, records with ``--layers`` layer digests and a residency (instances: device/host split;
stores: one disk tier with a read rate), as a 32-layer model's replicas look. Two instances
report status, so every lookup carries ``targets`` and the IS computes §6.4 estimates.

(a) in-process: :class:`~kvsp.index.IndexService` over :class:`~kvsp.stores.memory.MemoryStore`,
records published with ``publish_batch``; a full lookup builds the records with their remaining
TTL (``lookup``) or renders the answer's JSON as the server does (``find`` + JSON).
(b) HTTP on loopback against a real ``kvsp serve index`` process, loaded honestly through
``POST replicas`` in batches of ``--batch`` records; lookups through
:class:`~kvsp.services.index.client.IndexClient` (the answer decoded and checked as records) and
as raw bytes (server + transfer only). The load runs in two threads while (a) builds, since the
server's decoding on the other core is the long pole.
(c) Redis, once (a) and (b) are done: a ``redis-server`` of its own (or
``--redis-url``) loaded with the same records through ``publish_batch`` over
:class:`~kvsp.stores.redis.RedisStore` (pipelined script calls, 2 batches in flight; the load
time is printed), then the same lookups in-process and over HTTP against a ``kvsp serve index
--store redis://…`` process that starts on the loaded Redis. Before that, the record forms the
Redis store could keep are measured side by side: canonical JSON and the compact form it uses.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import hashlib
import itertools
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import orjson
import redis

from kvsp.compat import CompatibilityDescriptor, compat_id
from kvsp.index import IndexService, holder_id_of
from kvsp.records import InstanceStatusRecord, Link, LookupRequest, ReplicaRecord, Residency, dumps
from kvsp.registries import InstanceState, Tier
from kvsp.services.index.app import PrincipalCaller
from kvsp.services.index.client import IndexClient
from kvsp.stores.memory import MemoryStore
from kvsp.web.auth import Principal, principal_entry, write_principals
from kvsp.web.testing import start_process

if TYPE_CHECKING:
    from kvsp.stores.redis import RedisStore

TOKEN = "bench-admin-token-0123456789abcdef"
SCOPE = bytes(range(16))
INSTANCES = ("https://ii1.bench.example/kvsp/", "https://ii2.bench.example/kvsp/")
STORES = tuple(f"https://store{i}.bench.example/kvsp/" for i in range(6))
HOLDERS = INSTANCES + STORES
PREFIX_GROUPS = 20
TTL_MS = 3_600_000


def descriptor(layers: int) -> CompatibilityDescriptor:
    """A Llama-3-8B-like geometry: 2 MiB blocks of 16 tokens at 32 layers."""
    return CompatibilityDescriptor(
        model="bench-llama-8b",
        model_digest=hashlib.sha256(b"weights").digest(),
        tokenizer_digest=hashlib.sha256(b"tokenizer").digest(),
        layers=layers,
        kv_heads=8,
        head_dim=128,
        kv_dtype="bf16",
        positional="rope;theta=500000",
        block_tokens=16,
    )


def residency(holder: str, layers: int) -> tuple[Residency, ...]:
    if holder in INSTANCES:  # half on device, half in host memory
        half = layers // 2
        return (
            Residency(tier=Tier.DEVICE, first=0, last=half - 1),
            Residency(tier=Tier.HOST, first=half, last=layers - 1, read_mbit_per_s=400_000.0),
        )
    return (Residency(tier=Tier.DISK, first=0, last=layers - 1, read_mbit_per_s=16_000.0),)


@dataclass
class Dataset:
    compat: bytes
    layers: int
    prompts: list[list[bytes]]
    blocks: list[tuple[bytes, tuple[bytes, ...], bytes, tuple[str, ...]]]
    """(key, layer digests, replica digest, holders) per distinct block."""

    @property
    def records(self) -> int:
        return sum(len(b[3]) for b in self.blocks)


def build_dataset(records: int, prompt_keys: int, layers: int, seed: int) -> Dataset:
    """Prompts sharing prefixes until about ``records`` replica records exist."""
    rng = random.Random(seed)
    compat = compat_id(descriptor(layers))
    blocks: list[tuple[bytes, tuple[bytes, ...], bytes, tuple[str, ...]]] = []
    total = 0

    def new_key(previous: bytes) -> bytes:
        nonlocal total
        key = hashlib.sha256(previous + rng.randbytes(8)).digest()
        raw = rng.randbytes(32 * layers)
        digests = tuple(raw[i : i + 32] for i in range(0, len(raw), 32))
        holders = tuple(rng.sample(HOLDERS, rng.randint(1, 3)))
        blocks.append((key, digests, hashlib.sha256(raw).digest(), holders))
        total += len(holders)
        return key

    shared = max(1, prompt_keys // 4)
    prefixes = []
    for _ in range(PREFIX_GROUPS):
        chain = [new_key(bytes(32))]
        while len(chain) < shared:
            chain.append(new_key(chain[-1]))
        prefixes.append(chain)
    prompts = []
    while total < records:
        chain = list(rng.choice(prefixes))
        while len(chain) < prompt_keys and total < records:
            chain.append(new_key(chain[-1]))
        if len(chain) == prompt_keys:
            prompts.append(chain)
    return Dataset(compat=compat, layers=layers, prompts=prompts, blocks=blocks)


def replica_records(data: Dataset) -> Iterator[ReplicaRecord]:
    residencies = {h: residency(h, data.layers) for h in HOLDERS}
    for key, digests, digest, holders in data.blocks:
        for holder in holders:
            yield ReplicaRecord(
                block_key=key,  # type: ignore[arg-type]
                compat_id=data.compat,  # type: ignore[arg-type]
                scope_id=SCOPE,  # type: ignore[arg-type]
                holder=holder,
                codec=1,
                size=2 * 2 * 16 * 8 * 128 * data.layers,
                digest=digest,
                layer_digests=digests,
                residency=residencies[holder],
                ttl_ms=TTL_MS,
            )


def record_json_batches(data: Dataset, batch: int) -> Iterator[bytes]:
    """The load as ``POST replicas`` bodies, built without ReplicaRecord objects (the per-key
    hex is shared between a key's holders)."""
    residencies = {h: [r.to_json() for r in residency(h, data.layers)] for h in HOLDERS}
    common = {"compat_id": data.compat.hex(), "scope_id": SCOPE.hex(), "codec": 1}
    size = 2 * 2 * 16 * 8 * 128 * data.layers
    pending: list[dict[str, Any]] = []
    for key, digests, digest, holders in data.blocks:
        shared = {
            "block_key": key.hex(),
            "digest": "sha-256:" + digest.hex(),
            "layer_digests": [d.hex() for d in digests],
        }
        for holder in holders:
            pending.append(
                common
                | shared
                | {
                    "holder": holder,
                    "size": size,
                    "residency": residencies[holder],
                    "ttl_ms": TTL_MS,
                }
            )
            if len(pending) == batch:
                yield orjson.dumps({"records": pending})
                pending = []
    if pending:
        yield orjson.dumps({"records": pending})


def status(instance: str) -> InstanceStatusRecord:
    links = tuple(
        Link(holder=h, mbit_per_s=100_000.0 if h in STORES else 200_000.0, rtt_us=15.0)
        for h in HOLDERS
        if h != instance
    )
    return InstanceStatusRecord(
        instance=instance,
        epoch=1,
        state=InstanceState.ACTIVE,
        running=4,
        queued=1,
        batch_size=32,
        kv_utilization=0.6,
        prefill_tokens_per_s=40_000.0,
        decode_tokens_per_s=3_000.0,
        links=links,
        requested_state=None,
        ttl_ms=TTL_MS,
    )


def lookup_requests(
    data: Dataset, count: int, compact: bool, seed: int, targets: bool = True
) -> list[LookupRequest]:
    rng = random.Random(seed)
    return [
        LookupRequest(
            scope_id=SCOPE,  # type: ignore[arg-type]
            compat_id=data.compat,  # type: ignore[arg-type]
            block_keys=tuple(rng.choice(data.prompts)),  # type: ignore[arg-type]
            targets=INSTANCES if targets else None,
            compact=compact,
        )
        for _ in range(count)
    ]


# --- measurement -------------------------------------------------------------------------------


@dataclass
class Result:
    name: str
    seconds: list[float]
    answer_bytes: int
    matched: float

    def row(self) -> str:
        s = sorted(self.seconds)
        p50 = statistics.median(s) * 1e3
        p99 = s[min(len(s) - 1, round(0.99 * (len(s) - 1)))] * 1e3
        rate = len(s) / sum(s)
        size = f"{self.answer_bytes / 1e6:8.2f}" if self.answer_bytes else "       -"
        return (
            f"{self.name:<58} {len(s):>5} {rate:>10.1f} {p50:>9.2f} {p99:>9.2f} {size} "
            f"{self.matched:>8.0f}"
        )


async def timed(
    name: str, requests: Sequence[LookupRequest], call: Callable[[LookupRequest], Awaitable[Any]]
) -> Result:
    seconds = []
    size = 0
    matched = []
    for request in requests:
        start = time.perf_counter()
        answer = await call(request)
        seconds.append(time.perf_counter() - start)
        if isinstance(answer, bytes):
            size = len(answer)
            matched.append(orjson.loads(answer)["matched"])
        else:
            matched.append(answer.matched)
    return Result(name, seconds, size, statistics.mean(matched))


@dataclass
class InProcess:
    index: IndexService
    caller: PrincipalCaller
    now_ms: int
    build_s: float
    count: int


async def build_in_process(data: Dataset) -> InProcess:
    """Publish every record through ``publish_batch`` (10,000 at a time) and two statuses."""
    store = MemoryStore()
    index = IndexService(
        store, max_ttl_ms=TTL_MS, descriptors={data.compat: descriptor(data.layers)}
    )
    caller = PrincipalCaller(Principal(name="bench", roles=frozenset({"admin"}), scopes=None))
    start = time.perf_counter()
    chunk: list[ReplicaRecord] = []
    now = int(time.time() * 1000)
    for record in replica_records(data):
        chunk.append(record)
        if len(chunk) == 10_000:
            await index.publish_batch(caller, chunk, now)
            chunk = []
    await index.publish_batch(caller, chunk, now)
    for instance in INSTANCES:
        await index.put_status(caller, holder_id_of(instance), status(instance), now)
    return InProcess(index, caller, now, time.perf_counter() - start, await store.count())


async def in_process(
    built: InProcess,
    full: list[LookupRequest],
    compact: list[LookupRequest],
    bare: list[LookupRequest],
    label: str = "in-process",
) -> list[Result]:
    index, caller, now = built.index, built.caller, built.now_ms

    async def render(request: LookupRequest) -> bytes:
        result = await index.find(caller, request, now)
        return orjson.dumps(result.to_json(now))

    return [
        await timed(f"{label} full (records)", full, lambda r: index.lookup(caller, r, now)),
        await timed(f"{label} full (JSON rendered)", full, render),
        await timed(f"{label} compact (JSON rendered)", compact, render),
        await timed(f"{label} compact, no targets", bare, render),
    ]


async def over_http(
    base_url: str,
    full: list[LookupRequest],
    compact: list[LookupRequest],
    bare: list[LookupRequest],
    label: str = "HTTP",
) -> list[Result]:
    headers = {"authorization": f"Bearer {TOKEN}", "content-type": "application/kvsp+json"}
    async with (
        IndexClient(base_url, TOKEN) as client,
        httpx.AsyncClient(base_url=base_url, headers=headers, timeout=60) as raw,
    ):

        async def raw_lookup(request: LookupRequest) -> bytes:
            response = await raw.post("lookup", content=orjson.dumps(request.to_json()))
            response.raise_for_status()
            return response.content

        return [
            await timed(f"{label} full (IndexClient, decoded)", full, client.lookup),
            await timed(f"{label} full (raw bytes)", full, raw_lookup),
            await timed(f"{label} compact (IndexClient)", compact, client.lookup),
            await timed(f"{label} compact (raw bytes)", compact, raw_lookup),
            await timed(f"{label} compact, no targets (raw bytes)", bare, raw_lookup),
        ]


# --- (c) Redis ---------------------------------------------------------------------------------


def record_forms(data: Dataset, count: int = 2000) -> None:
    """Print the size and encode/decode rates of the record forms the Redis store could keep."""
    from kvsp.records import loads
    from kvsp.stores.redis import decode_record, encode_record

    records = list(itertools.islice(replica_records(data), count))
    rows = []
    forms: list[tuple[str, Callable[[ReplicaRecord], bytes], Callable[[bytes, Any], Any]]] = [
        ("canonical JSON", dumps, lambda b, r: ReplicaRecord.from_json(loads(b))),
        ("compact (stored)", encode_record, lambda b, r: decode_record(b, 0, *_ids(r))),
    ]
    for name, encode, decode in forms:
        start = time.perf_counter()
        blobs = [encode(r) for r in records]
        encode_s = time.perf_counter() - start
        start = time.perf_counter()
        decoded = [decode(b, r) for b, r in zip(blobs, records, strict=True)]
        decode_s = time.perf_counter() - start
        if decoded != records:
            raise SystemExit(f"{name} does not round-trip")
        size = statistics.mean(map(len, blobs))
        rows.append((name, size, count / encode_s, count / decode_s))
    print(f"record forms ({data.layers} layers): " + "; ".join(
        f"{n} {size:,.0f} B, encode {enc / 1e3:,.0f} k/s, decode {dec / 1e3:,.0f} k/s"
        for n, size, enc, dec in rows
    ), flush=True)  # fmt: skip


def _ids(record: ReplicaRecord) -> tuple[bytes, bytes, bytes]:
    return record.block_key, record.compat_id, record.scope_id


def start_redis(folder: Path) -> tuple[subprocess.Popen[bytes], str] | None:
    """A ``redis-server`` on a free loopback port, without persistence (``None``: there is
    no ``redis-server`` to start)."""
    exe = shutil.which("redis-server")
    if exe is None:
        return None
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen([*argv, "--dir", str(folder)], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    return proc, f"redis://127.0.0.1:{port}/0?prefix=bench"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("redis-server did not answer within 15 s")


async def build_redis(data: Dataset, store: RedisStore) -> InProcess:
    """Publish every record through ``publish_batch`` over a :class:`RedisStore`, 10,000 at a
    time with two batches in flight, and two statuses."""
    await store.drop_all()
    index = IndexService(
        store, max_ttl_ms=TTL_MS, descriptors={data.compat: descriptor(data.layers)}
    )
    caller = PrincipalCaller(Principal(name="bench", roles=frozenset({"admin"}), scopes=None))
    now = int(time.time() * 1000)
    records = replica_records(data)
    start = time.perf_counter()

    async def loader() -> None:
        while chunk := list(itertools.islice(records, 10_000)):
            await index.publish_batch(caller, chunk, now)

    await asyncio.gather(loader(), loader())
    for instance in INSTANCES:
        await index.put_status(caller, holder_id_of(instance), status(instance), now)
    return InProcess(index, caller, now, time.perf_counter() - start, await store.count())


async def redis_in_process(
    data: Dataset,
    url: str,
    full: list[LookupRequest],
    compact: list[LookupRequest],
    bare: list[LookupRequest],
) -> tuple[InProcess, list[Result]]:
    from kvsp.stores.redis import RedisStore, parse_store_url

    store = RedisStore.from_url(url)
    built = await build_redis(data, store)
    with redis.Redis.from_url(parse_store_url(url)[0]) as client:
        memory = client.info("memory")
    print(
        f"(c) Redis load: {built.count:,} records in {built.build_s:.1f} s "
        f"({built.count / built.build_s:,.0f}/s, publish_batch of 10,000, 2 in flight, "
        f"pipelined); Redis used_memory {memory['used_memory'] / 2**20:,.0f} MiB",
        flush=True,
    )
    cold = RedisStore(store.url, prefix=store.prefix, cache_records=0)
    uncached = dataclasses.replace(
        built,
        index=IndexService(cold, max_ttl_ms=TTL_MS, descriptors=built.index.descriptors),
    )
    try:
        results = await in_process(built, full, compact, bare, label="Redis in-process")
        label = "Redis in-process, no record cache"
        results += await in_process(uncached, full[:10], compact[:20], bare[:20], label)
        return built, results
    finally:
        await store.aclose()
        await cold.aclose()


def load_over_http(base_url: str, bodies: Iterator[bytes], threads: int) -> tuple[float, int]:
    """POST every batch body; returns (seconds, records refused)."""
    lock = threading.Lock()
    refused = [0]
    errors: list[BaseException] = []

    def worker() -> None:
        headers = {"authorization": f"Bearer {TOKEN}", "content-type": "application/kvsp+json"}
        try:
            with httpx.Client(base_url=base_url, headers=headers, timeout=600) as client:
                while True:
                    with lock:
                        body = next(bodies, None)
                    if body is None:
                        return
                    response = client.post("replicas", content=body)
                    response.raise_for_status()
                    bad = sum(1 for r in orjson.loads(response.content)["results"] if not r["ok"])
                    with lock:
                        refused[0] += bad
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    start = time.perf_counter()
    workers = [threading.Thread(target=worker) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start, refused[0]


def put_statuses(base_url: str) -> None:
    headers = {"authorization": f"Bearer {TOKEN}", "content-type": "application/kvsp+json"}
    with httpx.Client(base_url=base_url, headers=headers) as client:
        for instance in INSTANCES:
            path = f"instances/{holder_id_of(instance).hex()}/status"
            client.put(path, content=dumps(status(instance))).raise_for_status()


def rss_mib(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def redis_half(
    args: argparse.Namespace,
    data: Dataset,
    folder: Path,
    full: list[LookupRequest],
    compact: list[LookupRequest],
    bare: list[LookupRequest],
) -> list[Result]:
    """(c): the record forms, the Redis load, and the lookups in-process and over HTTP."""
    record_forms(data)
    redis_proc = None
    url = args.redis_url
    if url is None:
        started = start_redis(folder)
        if started is None:
            print("(c) Redis column skipped: no redis-server on PATH (or pass --redis-url)")
            return []
        redis_proc, url = started
    try:
        _, results = asyncio.run(redis_in_process(data, url, full, compact, bare))
        if not args.no_http:
            argv = [
                sys.executable, "-m", "kvsp", "serve", "index", "--listen", "127.0.0.1:0",
                "--state", str(folder / "state-redis"), "--principals",
                str(folder / "principals.toml"), "--descriptor", str(folder / "descriptor.json"),
                "--max-ttl-ms", str(TTL_MS), "--store", url,
            ]  # fmt: skip
            (folder / "redis-is").mkdir()
            with start_process(argv, workdir=folder / "redis-is") as server:
                label = "Redis HTTP"
                results += asyncio.run(over_http(server.base_url, full, compact, bare, label))
        return results
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--prompt-keys", type=int, default=1000)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--lookups", type=int, default=40, help="full lookups per variant")
    parser.add_argument("--compact-lookups", type=int, default=200)
    parser.add_argument("--batch", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--no-http", action="store_true", help="skip the HTTP half")
    parser.add_argument("--no-redis", action="store_true", help="skip the Redis column")
    parser.add_argument("--redis-url", metavar="URL", help="use this Redis (keys under bench:)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()

    t0 = time.perf_counter()
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    data = build_dataset(args.records, args.prompt_keys, args.layers, args.seed)
    print(
        f"dataset: {data.records:,} records, {len(data.blocks):,} blocks, {len(data.prompts)} "
        f"prompts of {args.prompt_keys} keys, {args.layers} layers "
        f"({time.perf_counter() - t0:.1f} s)",
        flush=True,
    )
    full = lookup_requests(data, args.lookups, False, args.seed + 1)
    compact = lookup_requests(data, args.compact_lookups, True, args.seed + 2)
    bare = lookup_requests(data, args.compact_lookups, True, args.seed + 3, targets=False)
    gc.freeze()  # the bench's own data must not tax its measurements with full collections

    with tempfile.TemporaryDirectory(prefix="kvsp-bench-") as tmp:
        folder = Path(tmp)
        server = None
        loader: threading.Thread | None = None
        load: dict[str, Any] = {}
        if not args.no_http:
            write_principals(
                folder / "principals.toml", [principal_entry("bench", TOKEN, ["admin"], None)]
            )
            (folder / "descriptor.json").write_bytes(dumps(descriptor(args.layers)))
            argv = [
                sys.executable, "-m", "kvsp", "serve", "index", "--listen", "127.0.0.1:0",
                "--state", str(folder / "state"), "--principals", str(folder / "principals.toml"),
                "--descriptor", str(folder / "descriptor.json"), "--max-ttl-ms", str(TTL_MS),
            ]  # fmt: skip
            server = start_process(argv, workdir=folder)
            bodies = record_json_batches(data, args.batch)

            def run_load() -> None:
                load["result"] = load_over_http(server.base_url, bodies, threads=2)

            loader = threading.Thread(target=run_load)
            loader.start()
        try:
            built = asyncio.run(build_in_process(data))
            gc.collect()
            gc.freeze()  # as the IS's heap keeper does (IndexConfig.gc_freeze_interval_s)
            print(
                f"(a) in-process: {built.count:,} records published in {built.build_s:.1f} s "
                f"({built.count / built.build_s:,.0f}/s, beside the HTTP load); "
                f"bench RSS {rss_mib():,.0f} MiB",
                flush=True,
            )
            if server is not None and loader is not None:
                loader.join()
                seconds, refused = load["result"]
                put_statuses(server.base_url)
                print(
                    f"(b) HTTP load: {data.records:,} records in {seconds:.1f} s "
                    f"({data.records / seconds:,.0f}/s, batches of {args.batch}, 2 threads), "
                    f"{refused} refused; server RSS {rss_mib(server.proc.pid):,.0f} MiB",
                    flush=True,
                )
            # Measured only now: nothing else runs in this process or the server.
            results = asyncio.run(in_process(built, full, compact, bare))
            if server is not None:
                results += asyncio.run(over_http(server.base_url, full, compact, bare))
        finally:
            if server is not None:
                server.stop()
        if not args.no_redis:
            del built  # the in-memory store's records: out of the Redis half's way
            gc.collect()
            results += redis_half(args, data, folder, full, compact, bare)
    print()
    print(
        f"lookups of {args.prompt_keys}-key prompts (all keys match), 2 targets with status "
        "unless said, 1 in flight"
    )
    print(f"{'variant':<58} {'n':>5} {'lookups/s':>10} {'p50 ms':>9} {'p99 ms':>9} {'MB':>8} "
          f"{'matched':>8}")  # fmt: skip
    for result in results:
        print(result.row())
    if args.json is not None:  # every lookup's seconds, for bench/report.py's latency CDF
        rows = [vars(r) for r in results]
        doc = {"records": data.records, "prompt_keys": args.prompt_keys, "results": rows}
        args.json.write_text(json.dumps(doc), encoding="utf-8")
    load_avg = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"total {time.perf_counter() - t0:.0f} s; load average at end: {load_avg}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
