"""Load: many clients against a real Index Service process, many subscribers on one real relay
(spec §6.1-6.2 over HTTP, DESIGN.md §4 live tracks over MOQT).

* **IS**: ``--clients`` concurrent clients (default 64), each its own principal with its own
  scope and holder, against ``kvsp serve index`` for ``--seconds``: each first publishes 16
  records, then loops over lookups of its own keys (every answer must match all of them),
  lookups in another client's scope (every answer must be a miss, §6.2) and record refreshes.
* **Relay**: ``--subscribers`` MOQT sessions (default 100) subscribe to one live track on
  ``kvsp serve relay``; one publisher sends its objects (group 0, one subgroup stream, as a
  block's layers travel) at ``--rate`` per second, each carrying its send time; every
  subscriber must receive every object, intact and in order.

Both report errors (any unexpected status, answer, payload or gap: the target is zero),
latency percentiles (request latency; delivery latency publisher → subscriber), and the
server's RSS sampled twice a second: at a third of the run (after warm-up) and at the end.
"Flat" means the end is within 10 % + 8 MiB of the third.

    .venv/bin/python bench/bench_load.py                 # both, 60 s each
    .venv/bin/python bench/bench_load.py --only is --seconds 20
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvsp.ids import uri_id
from kvsp.moqt_mapping import kv_namespace, live_track_name
from kvsp.transfer.bulk import BulkClient
from kvsp.web.auth import principal_entry, write_principals
from kvsp.web.testing import RunningService, start_process
from moqt.asyncio import MOQTConnection, connect
from moqt.backend import get_backend
from moqt.session_events import SubscribeReceived
from moqt.wire import TrackNamespace

COMPAT = hashlib.sha256(b"bench-load-compat").digest()
KEYS_PER_CLIENT = 16
MIB = 1 << 20


# --- measurements ------------------------------------------------------------------------------


@dataclass
class LoadResult:
    """What one load run measured."""

    name: str
    operations: int = 0
    errors: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)
    rss: list[tuple[float, int]] = field(default_factory=list)
    """(seconds since the start, resident set size in octets) of the server."""
    elapsed_s: float = 0.0

    def percentile(self, q: float) -> float:
        """The ``q`` quantile of the latencies, in seconds (0 when there are none)."""
        if not self.latencies_s:
            return 0.0
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def rss_at(self, fraction: float) -> int:
        """The RSS sample closest to ``fraction`` of the run."""
        if not self.rss:
            return 0
        when = fraction * self.elapsed_s
        return min(self.rss, key=lambda sample: abs(sample[0] - when))[1]

    def rss_flat(self, slack: float = 0.10, allowance: int = 8 * MIB) -> bool:
        """Whether the RSS at the end is within ``slack`` + ``allowance`` of a third in."""
        third, end = self.rss_at(1 / 3), self.rss_at(1.0)
        return end <= third * (1 + slack) + allowance

    def report(self) -> str:
        """One paragraph of figures."""
        rate = self.operations / self.elapsed_s if self.elapsed_s else 0.0
        third, end = self.rss_at(1 / 3), self.rss_at(1.0)
        return (
            f"{self.name}: {self.operations} operations in {self.elapsed_s:.1f} s "
            f"({rate:.0f}/s), {len(self.errors)} errors; latency p50 "
            f"{1000 * self.percentile(0.5):.2f} ms, p99 {1000 * self.percentile(0.99):.2f} ms, "
            f"max {1000 * max(self.latencies_s, default=0.0):.2f} ms; server RSS "
            f"{third / MIB:.1f} MiB at 1/3, {end / MIB:.1f} MiB at the end "
            f"({(end - third) / MIB:+.1f} MiB: {'flat' if self.rss_flat() else 'GROWING'})"
        )


def rss_of(pid: int) -> int:
    """Resident set size of process ``pid`` in octets (Linux ``/proc``)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


async def sample_rss(pid: int, result: LoadResult, start: float, stop: asyncio.Event) -> None:
    """Sample ``pid``'s RSS every 0.5 s into ``result`` until ``stop``."""
    while not stop.is_set():
        result.rss.append((time.perf_counter() - start, rss_of(pid)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)
    result.rss.append((time.perf_counter() - start, rss_of(pid)))


# --- the Index Service -------------------------------------------------------------------------


def client_token(i: int) -> str:
    return f"load-client-{i:03d}-0123456789abcdefghij"


def client_scope(i: int) -> bytes:
    return hashlib.sha256(b"scope %d" % i).digest()[:16]


def client_holder(i: int) -> str:
    return f"http://holder-{i}.load.test/"


def write_index_principals(path: Path, clients: int) -> None:
    """One principal per client: role holder, its scope, its holder URI."""
    entries = [
        principal_entry(f"c{i}", client_token(i), ["holder"], [client_scope(i)], [client_holder(i)])
        for i in range(clients)
    ]
    write_principals(path, entries)


def _record(i: int, j: int) -> tuple[str, dict[str, Any]]:
    key = hashlib.sha256(b"key %d %d" % (i, j)).digest()
    digests = [hashlib.sha256(b"layer %d %d %d" % (i, j, n)).digest() for n in range(4)]
    record = {
        "block_key": key.hex(),
        "compat_id": COMPAT.hex(),
        "scope_id": client_scope(i).hex(),
        "holder": client_holder(i),
        "codec": 1,
        "size": 65536,
        "digest": "sha-256:" + hashlib.sha256(b"".join(digests)).hexdigest(),
        "layer_digests": [d.hex() for d in digests],
        "ttl_ms": 600_000,
    }
    url = f"replicas/{COMPAT.hex()}/{client_scope(i).hex()}/{key.hex()}/{uri_id(client_holder(i))}"
    return url, record


@dataclass
class Answer:
    """A status and a parsed JSON body (None when the body is not JSON)."""

    status: int
    body: Any
    text: str


class JsonClient:
    """JSON requests over :class:`~kvsp.transfer.bulk.BulkClient`, the project's HTTP/1.1
    client (httpx spends more CPU per request than the IS does: DESIGN.md §7), timed."""

    def __init__(self, bulk: BulkClient, base_url: str, token: str, result: LoadResult) -> None:
        self.bulk = bulk
        self.base_url = base_url
        self.headers = {
            "authorization": f"Bearer {token}",
            "content-type": "application/kvsp+json",
        }
        self.result = result

    async def send(self, method: str, path: str, body: Any) -> Answer:
        payload = json.dumps(body).encode()
        start = time.perf_counter()
        response = await self.bulk.request(
            method, self.base_url + path, headers=self.headers, body=payload
        )
        self.result.latencies_s.append(time.perf_counter() - start)
        self.result.operations += 1
        data = bytes(response.body.data)  # type: ignore[attr-defined]
        try:
            parsed = json.loads(data)
        except ValueError:
            parsed = None
        return Answer(response.status, parsed, data[:200].decode("utf-8", "replace"))


def _matched(answer: Answer) -> Any:
    return answer.body.get("matched") if isinstance(answer.body, dict) else None


async def index_client(
    client: JsonClient, i: int, clients: int, deadline: float, result: LoadResult
) -> None:
    """Publish this client's records, then look up and refresh until ``deadline``."""
    records = [_record(i, j) for j in range(KEYS_PER_CLIENT)]
    keys = [r["block_key"] for _, r in records]
    rng = random.Random(i)

    def fail(what: str, answer: Answer) -> None:
        result.errors.append(f"client {i} {what}: {answer.status} {answer.text}")

    for url, record in records:
        answer = await client.send("PUT", url, record)
        if answer.status != 200:
            fail("publish", answer)
    while time.perf_counter() < deadline:
        roll = rng.random()
        if roll < 0.6:
            n = rng.randint(1, KEYS_PER_CLIENT)
            body: dict[str, Any] = {"scope_id": client_scope(i).hex(), "compat_id": COMPAT.hex()}
            body["block_keys"] = keys[:n]
            answer = await client.send("POST", "lookup", body)
            if answer.status != 200 or _matched(answer) != n:
                fail(f"lookup of {n} own keys", answer)
        elif roll < 0.7:
            other = (i + 1 + rng.randrange(clients - 1)) % clients if clients > 1 else i
            body = {"scope_id": client_scope(other).hex(), "compat_id": COMPAT.hex()}
            body["block_keys"] = [_record(other, j)[1]["block_key"] for j in range(2)]
            answer = await client.send("POST", "lookup", body)
            if answer.status != 200 or _matched(answer) != (2 if other == i else 0):
                fail("lookup in another scope", answer)
        else:
            url, record = records[rng.randrange(KEYS_PER_CLIENT)]
            answer = await client.send("PUT", url, record)
            if answer.status != 200:
                fail("refresh", answer)


@asynccontextmanager
async def index_service(folder: Path, clients: int) -> AsyncIterator[RunningService]:
    """``kvsp serve index`` on an ephemeral port with one principal per client."""
    principals = folder / "principals.toml"
    write_index_principals(principals, clients)
    argv = [sys.executable, "-m", "kvsp", "serve", "index", "--listen", "127.0.0.1:0"]
    argv += ["--state", str(folder / "state"), "--principals", str(principals)]
    service = start_process(argv, workdir=folder)
    try:
        yield service
    finally:
        service.stop()


async def run_index_load(folder: Path, *, seconds: float, clients: int) -> LoadResult:
    """``clients`` concurrent clients against a fresh IS process for ``seconds``."""
    result = LoadResult(f"IS, {clients} clients")
    async with (
        index_service(folder, clients) as service,
        BulkClient(timeout=60.0, max_idle_per_origin=clients) as bulk,
    ):
        stop = asyncio.Event()
        start = time.perf_counter()
        sampler = asyncio.create_task(sample_rss(service.proc.pid, result, start, stop))
        deadline = start + seconds
        workers = [
            index_client(
                JsonClient(bulk, service.base_url, client_token(i), result),
                i,
                clients,
                deadline,
                result,
            )
            for i in range(clients)
        ]
        outcomes = await asyncio.gather(*workers, return_exceptions=True)
        result.elapsed_s = time.perf_counter() - start
        stop.set()
        await sampler
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                result.errors.append(f"client failed: {outcome!r}")
        if service.proc.poll() is not None:
            result.errors.append(f"the IS exited with {service.proc.returncode}")
    return result


# --- the relay ---------------------------------------------------------------------------------

PUBLISHER_TOKEN = "load-publisher-0123456789abcdefghij"
SUBSCRIBER_TOKEN = "load-subscriber-0123456789abcdefghi"
RELAY_SCOPE = hashlib.sha256(b"relay load scope").digest()[:16]
STAMP = struct.Struct("!dI")  # send time (perf_counter), object index


def live_track() -> tuple[TrackNamespace, bytes]:
    """A KV live track (DESIGN.md §4): the block's five namespace fields, ``live-<id>``."""
    key = hashlib.sha256(b"relay load block").digest()
    namespace = kv_namespace(COMPAT, RELAY_SCOPE, key)
    return namespace, live_track_name("http://producer.load.test/")


def payload_of(index: int, size: int, sent: float) -> bytes:
    """An object's payload: its stamp, then octets derived from its index."""
    body = hashlib.sha256(b"%d" % index).digest() * (size // 32 + 1)
    return STAMP.pack(sent, index) + body[: size - STAMP.size]


def check_payload(payload: bytes, index: int, size: int) -> float | None:
    """The send time in ``payload`` when it is intact and object ``index``'s; else None."""
    if len(payload) != size:
        return None
    sent, got = STAMP.unpack_from(payload)
    if got != index or payload[STAMP.size :] != payload_of(index, size, sent)[STAMP.size :]:
        return None
    return float(sent)


@asynccontextmanager
async def relay_service(folder: Path) -> AsyncIterator[tuple[RunningService, str, Path]]:
    """``kvsp serve relay`` with a publisher and a subscriber principal; yields the process,
    its MOQT URL and the certificate to pin."""
    principals = folder / "principals.toml"
    write_principals(
        principals,
        [
            principal_entry("pub", PUBLISHER_TOKEN, ["instance"], [RELAY_SCOPE]),
            principal_entry("sub", SUBSCRIBER_TOKEN, ["client"], [RELAY_SCOPE]),
        ],
    )
    state = folder / "relay-state"
    argv = [sys.executable, "-m", "kvsp", "serve", "relay", "--listen", "127.0.0.1:0"]
    argv += ["--state", str(state), "--principals", str(principals)]
    service = start_process(argv, workdir=folder, ready_timeout=60.0)
    try:
        ready = json.loads(service.base_url)
        yield service, ready["moqt"], state / "relay-tls" / "cert.pem"
    finally:
        service.stop()


@asynccontextmanager
async def moqt_session(url: str, cafile: Path, token: str) -> AsyncIterator[MOQTConnection]:
    """A MOQT session to the relay at ``url``, pinning ``cafile``."""
    host, port = url.removeprefix("moqt://").strip("/").rsplit(":", 1)
    configuration = get_backend().configuration(
        is_client=True, cafile=str(cafile), server_name="localhost"
    )
    async with connect(
        host, int(port), configuration=configuration, auth_token=token.encode()
    ) as connection:
        yield connection


class LivePublisher:
    """Answers the relay's SUBSCRIBE on the live track and sends its objects as they are made:
    group 0, one subgroup stream, object id = index (a block's layers, DESIGN.md §4)."""

    def __init__(self, connection: MOQTConnection, objects: int) -> None:
        self.connection = connection
        self.objects = objects
        self.streams: dict[int, int | None] = {}  # request id → its stream, once opened
        self.subscribed = asyncio.Event()

    async def serve(self) -> None:
        async for event in self.connection.requests():
            if isinstance(event, SubscribeReceived):
                self.connection.session.subscribe_ok(event.request_id)
                self.connection.transmit()
                self.streams[event.request_id] = None
                self.subscribed.set()

    async def send(self, index: int, size: int) -> None:
        payload = payload_of(index, size, time.perf_counter())
        last = index == self.objects - 1
        for request_id, stream in list(self.streams.items()):
            if stream is None:
                stream = await self.connection.open_subgroup(request_id, 0, end_of_group=True)
                self.streams[request_id] = stream
            await self.connection.send_object(stream, index, payload, end_stream=last)


async def subscriber(
    url: str,
    cafile: Path,
    track: tuple[TrackNamespace, bytes],
    objects: int,
    size: int,
    ready: asyncio.Event,
    result: LoadResult,
    timeout_s: float,
) -> None:
    """Subscribe, then check that objects 0..``objects``-1 arrive in order and intact; record
    each delivery latency."""
    async with moqt_session(url, cafile, SUBSCRIBER_TOKEN) as connection:
        subscription = await connection.subscribe(*track)
        ready.set()
        expected = 0
        received = subscription.track.objects()
        try:
            async with asyncio.timeout(timeout_s):
                while expected < objects:
                    obj = await anext(received)
                    sent = check_payload(bytes(obj.payload), obj.object_id, size)
                    if sent is None or obj.group_id != 0 or obj.object_id != expected:
                        result.errors.append(
                            f"object {obj.group_id}/{obj.object_id}: expected 0/{expected}, intact"
                        )
                        expected = obj.object_id + 1
                        continue
                    result.latencies_s.append(time.perf_counter() - sent)
                    result.operations += 1
                    expected += 1
        except TimeoutError:
            result.errors.append(f"{objects - expected} objects never arrived")
        except StopAsyncIteration:
            result.errors.append(f"the track ended {objects - expected} objects early")


async def run_relay_load(
    folder: Path, *, seconds: float, subscribers: int, rate: float = 5.0, size: int = 4096
) -> LoadResult:
    """``subscribers`` sessions on one relay process receive one published live track."""
    result = LoadResult(f"relay, {subscribers} subscribers")
    track = live_track()
    count = max(1, int(seconds * rate))
    async with (
        relay_service(folder) as (service, url, cafile),
        moqt_session(url, cafile, PUBLISHER_TOKEN) as pub_connection,
    ):
        publisher = LivePublisher(pub_connection, count)
        serving = asyncio.create_task(publisher.serve())
        await pub_connection.publish_namespace(track[0][:4])
        readies = [asyncio.Event() for _ in range(subscribers)]
        tasks = [
            asyncio.create_task(
                subscriber(url, cafile, track, count, size, readies[n], result, seconds + 20)
            )
            for n in range(subscribers)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in readies)), 60)
        await asyncio.wait_for(publisher.subscribed.wait(), 10)
        stop = asyncio.Event()
        start = time.perf_counter()
        sampler = asyncio.create_task(sample_rss(service.proc.pid, result, start, stop))
        for index in range(count):
            await publisher.send(index, size)
            await asyncio.sleep(max(0.0, start + (index + 1) / rate - time.perf_counter()))
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        result.elapsed_s = time.perf_counter() - start
        stop.set()
        await sampler
        serving.cancel()
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                result.errors.append(f"subscriber failed: {outcome!r}")
    return result


# --- command line ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Run the loads and print their figures; exit status 1 on any error."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--subscribers", type=int, default=100)
    parser.add_argument("--rate", type=float, default=5.0, help="relay: objects per second")
    parser.add_argument("--size", type=int, default=4096, help="relay: octets per object")
    parser.add_argument("--only", choices=["is", "relay"])
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="kvsp-load-") as tmp:
        folder = Path(tmp)
        if args.only in (None, "is"):
            (folder / "is").mkdir()
            results.append(
                asyncio.run(
                    run_index_load(folder / "is", seconds=args.seconds, clients=args.clients)
                )
            )
        if args.only in (None, "relay"):
            (folder / "relay").mkdir()
            results.append(
                asyncio.run(
                    run_relay_load(
                        folder / "relay",
                        seconds=args.seconds,
                        subscribers=args.subscribers,
                        rate=args.rate,
                        size=args.size,
                    )
                )
            )
    print(f"machine: {os.cpu_count()} CPUs; clients and servers share them")
    for result in results:
        print(result.report())
        for error in [e for e in result.errors if e][:5]:
            print("  error:", error)
        if result.latencies_s:
            mean = statistics.fmean(result.latencies_s)
            print(f"  mean latency {1000 * mean:.2f} ms over {len(result.latencies_s)} samples")
    return 1 if any(r.errors or not r.rss_flat() for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
