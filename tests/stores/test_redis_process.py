"""Three Index Service processes on one Redis (``kvsp serve index --store redis://…``): a publish
through one is seen by lookups through the others at once, a SIGKILLed and restarted IS loses no
record, expiry holds across processes and the sweepers remove the records, descriptors registered
through one are learnt by the others, and a lookup through HTTP costs Redis exactly one command (an
``EVALSHA`` of the lookup script, counted in its slowlog)."""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import signal
import sys
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

redis = pytest.importorskip("redis")

from kvsp.compat import CompatibilityDescriptor, compat_id  # noqa: E402
from kvsp.ids import BlockKey, CompatId, ScopeId  # noqa: E402
from kvsp.records import LookupRequest, ReplicaRecord, dumps  # noqa: E402
from kvsp.services.index.client import IndexClient  # noqa: E402
from kvsp.stores.redis_lua import LOOKUP_SHA  # noqa: E402
from kvsp.web.auth import principal_entry, write_principals  # noqa: E402
from kvsp.web.testing import RunningService, start_process  # noqa: E402
from tests.support.polling import eventually  # noqa: E402

pytestmark = pytest.mark.slow  # several IS processes sharing one Redis
T = TypeVar("T")
TOKEN = "redis-process-admin-token-0123456789"
SCOPE = ScopeId(b"\x0a" * 16)
EXPIRY_SCOPE = ScopeId(b"\x0e" * 16)
H1 = "https://h1.example/kvsp/"
DESCRIPTOR = CompatibilityDescriptor(
    model="m",
    model_digest=b"\xa1" * 32,
    tokenizer_digest=b"\xb2" * 32,
    layers=4,
    kv_heads=2,
    head_dim=8,
    kv_dtype="bf16",
    positional="rope",
    block_tokens=16,
)
COMPAT = compat_id(DESCRIPTOR)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def key(i: int) -> BlockKey:
    return BlockKey(hashlib.sha256(b"redis-process-key%d" % i).digest())


def record(i: int, *, scope: bytes = SCOPE, ttl: int = 60_000) -> ReplicaRecord:
    digests = tuple(hashlib.sha256(b"%d/%d" % (i, n)).digest() for n in range(4))
    return ReplicaRecord(
        block_key=key(i),
        compat_id=CompatId(COMPAT),
        scope_id=ScopeId(scope),
        holder=H1,
        codec=1,
        size=4096,
        digest=hashlib.sha256(b"".join(digests)).digest(),
        layer_digests=digests,
        residency=None,
        ttl_ms=ttl,
    )


def lookup(indices: range | list[int], scope: bytes = SCOPE) -> LookupRequest:
    keys = tuple(key(i) for i in indices)
    return LookupRequest(scope_id=ScopeId(scope), compat_id=CompatId(COMPAT), block_keys=keys)


class Cluster:
    """IS processes on one Redis prefix; each started one is stopped at teardown."""

    def __init__(self, folder: Path, store: str) -> None:
        self.folder = folder
        self.store = store
        self.started: list[RunningService] = []
        write_principals(folder / "principals.toml", [principal_entry("a", TOKEN, ["admin"], None)])

    def start(self, *extra: str) -> RunningService:
        n = len(self.started)
        workdir = self.folder / f"is-{n}"
        workdir.mkdir()
        argv = [
            sys.executable, "-m", "kvsp", "serve", "index", "--listen", "127.0.0.1:0",
            "--state", str(workdir / "state"), "--principals", str(self.folder / "principals.toml"),
            "--store", self.store, *extra,
        ]  # fmt: skip
        service = start_process(argv, workdir=workdir)
        self.started.append(service)
        return service

    def client(self, service: RunningService) -> IndexClient:
        return IndexClient(service.base_url, TOKEN, timeout=10.0)


@pytest.fixture(scope="module")
def store(redis_server: str) -> Iterator[str]:
    """A ``--store`` URL with a key prefix of this module's own, deleted afterwards."""
    prefix = f"test-{secrets.token_hex(6)}"
    yield f"{redis_server}?prefix={prefix}"
    client = redis.Redis.from_url(redis_server)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.unlink(*keys)
    finally:
        client.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, store: str) -> Iterator[Cluster]:
    """Three IS processes; the first knows the descriptor from ``--descriptor``."""
    folder = tmp_path_factory.mktemp("redis-cluster")
    (folder / "descriptor.json").write_bytes(dumps(DESCRIPTOR))
    made = Cluster(folder, store)
    try:
        made.start("--descriptor", str(folder / "descriptor.json"))
        made.start()
        made.start()
        yield made
    finally:
        for service in made.started:
            service.stop()


async def count(cluster: Cluster, service: RunningService, request: LookupRequest) -> int:
    async with cluster.client(service) as client:
        return (await client.lookup(request)).matched


def matched(cluster: Cluster, service: RunningService, request: LookupRequest) -> int:
    return run(count(cluster, service, request))


def test_a_publish_through_one_is_seen_through_the_others_at_once(cluster: Cluster) -> None:
    one, two, three = cluster.started[:3]

    async def scenario() -> None:
        async with cluster.client(one) as a, cluster.client(three) as c:
            assert all(
                ttl == 60_000 for ttl in await a.publish_batch([record(i) for i in range(40)])
            )
            # No wait: the records are in Redis before the publish is answered.
            assert await count(cluster, two, lookup(range(41))) == 40
            assert await count(cluster, three, lookup(range(41))) == 40
            assert await c.withdraw(COMPAT, SCOPE, key(20), H1)
            assert await count(cluster, one, lookup(range(41))) == 20
            assert await a.publish(record(20)) == 60_000
            assert await count(cluster, two, lookup(range(41))) == 40

    run(scenario())


def test_descriptors_registered_through_one_are_learnt_by_the_others(cluster: Cluster) -> None:
    async def scenario() -> None:
        async with cluster.client(cluster.started[1]) as b:
            for _ in range(100):  # the sync runs every second
                if await b.get_descriptor(COMPAT) == DESCRIPTOR:
                    return
                await asyncio.sleep(0.1)
            pytest.fail("IS 1 never learnt the descriptor IS 0 was started with")

    run(scenario())


def test_a_killed_and_restarted_is_loses_no_record(cluster: Cluster) -> None:
    victim = cluster.start()  # one of its own: the other tests use the first three

    async def publish() -> None:
        async with cluster.client(victim) as b:
            await b.publish_batch([record(i) for i in range(100, 160)])

    run(publish())
    victim.proc.send_signal(signal.SIGKILL)
    assert victim.proc.wait(timeout=10) == -signal.SIGKILL
    assert matched(cluster, cluster.started[0], lookup(range(100, 161))) == 60
    reborn = cluster.start()
    assert matched(cluster, reborn, lookup(range(100, 161))) == 60


def test_expiry_holds_across_processes_and_the_sweepers_remove_records(
    cluster: Cluster, store: str
) -> None:
    alive = [service for service in cluster.started if service.proc.poll() is None]
    one, two, three = alive[0], alive[2], alive[-1]  # the last may be one started later

    ttl_ms = 2000  # long enough to be seen before it runs out, even on a busy machine

    async def publish() -> float:
        async with cluster.client(one) as a:
            await a.publish_batch([record(i, scope=EXPIRY_SCOPE, ttl=ttl_ms) for i in range(5)])
        return time.monotonic()

    published = run(publish())
    assert matched(cluster, two, lookup(range(5), EXPIRY_SCOPE)) == 5
    time.sleep(max(0.0, published + ttl_ms / 1000 + 0.1 - time.monotonic()))
    assert matched(cluster, three, lookup(range(5), EXPIRY_SCOPE)) == 0
    server, prefix = store.split("?prefix=")
    zset = f"{prefix}:{{{EXPIRY_SCOPE.hex()}}}:x:{COMPAT.hex()}"
    client = redis.Redis.from_url(server)
    try:
        # swept by the IS processes (every second)
        eventually(lambda: not client.exists(zset), 10, "the expired scope's set swept")
        assert not client.sismember(f"{prefix}:scopes", EXPIRY_SCOPE.hex())
    finally:
        client.close()


def test_a_lookup_over_http_is_one_redis_command(cluster: Cluster, store: str) -> None:
    server = store.split("?")[0]
    service = cluster.started[0]

    async def publish() -> None:
        async with cluster.client(service) as a:
            await a.publish_batch([record(i) for i in range(300, 500)])

    run(publish())
    client = redis.Redis.from_url(server)
    saved = client.config_get("slowlog-*")
    lookups = 25
    try:
        client.config_set("slowlog-log-slower-than", 0)  # log every command, with its arguments
        client.config_set("slowlog-max-len", 100_000)
        client.slowlog_reset()

        async def ask() -> list[int]:
            async with cluster.client(service) as a:
                return [(await a.lookup(lookup(range(300, 500)))).matched for _ in range(lookups)]

        assert run(ask()) == [200] * lookups
        entries = client.slowlog_get(100_000)
    finally:
        for name, value in saved.items():
            client.config_set(name, value)
        client.close()
    # Commands that scripts run are logged too, with no client address: leave them out.
    sent = [entry for entry in entries if entry["client_address"] not in (b"?:0", "?:0")]
    commands = [_words(entry["command"]) for entry in sent]
    ours = [c for c in commands if c[:2] == ["EVALSHA", LOOKUP_SHA]]
    assert len(ours) == lookups
    # Besides them: only the background work of the three IS processes and this test's own,
    # and the handshake of a connection a pool opens meanwhile (HELLO, CLIENT SETINFO).
    background = {"SMEMBERS", "SREM", "SCARD", "HGETALL", "HSETNX", "SLOWLOG", "CONFIG"}
    background |= {"HELLO", "CLIENT"}
    others = [c for c in commands if c[:2] != ["EVALSHA", LOOKUP_SHA]]
    assert all(c[0] in background or c[0] == "EVALSHA" for c in others), others
    assert len([c for c in others if c[0] == "EVALSHA"]) < lookups  # sweeps, once a second


def _words(command: Any) -> list[str]:
    text = command.decode("latin-1") if isinstance(command, bytes) else str(command)
    words = text.split(" ")
    return [words[0].upper(), *words[1:]]
