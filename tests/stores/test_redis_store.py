"""What is particular to the Redis replica store (kvsp.stores.redis; the behaviour it shares with
the in-memory store is tested on both in test_memory_store.py): the compact record form, one
round trip per lookup, hash tags per scope, script reloading, errors when Redis fails, one event
loop per store, stores sharing one Redis, sweeping in turns, §6.3 epochs under racing writers,
descriptors shared through Redis."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import socket
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("redis")

import redis  # noqa: E402

from kvsp.compat import CompatibilityDescriptor, compat_id  # noqa: E402
from kvsp.errors import BadRequest, StoreUnavailable  # noqa: E402
from kvsp.ids import BlockKey, CompatId, ScopeId  # noqa: E402
from kvsp.index import holder_id_of  # noqa: E402
from kvsp.records import (  # noqa: E402
    InstanceStatusRecord,
    LookupRequest,
    ReplicaRecord,
    Residency,
    dumps,
)
from kvsp.registries import InstanceState, Tier  # noqa: E402
from kvsp.services.index.app import IndexConfig, create_index_app  # noqa: E402
from kvsp.stores.descriptors import DescriptorRegistry  # noqa: E402
from kvsp.stores.redis import (  # noqa: E402
    RecordCache,
    RedisStore,
    SharedDescriptors,
    decode_record,
    encode_record,
    parse_store_url,
)
from kvsp.web.auth import Principals, principal_entry  # noqa: E402
from kvsp.web.clock import ManualClock  # noqa: E402
from tests.support.polling import until  # noqa: E402

Run = Callable[[Coroutine[Any, Any, Any]], Any]
COMPAT = CompatId(b"\x01" * 32)
SCOPE = ScopeId(b"\x0a" * 16)
OTHER_SCOPE = ScopeId(b"\x0b" * 16)
H1 = "https://h1.example/kvsp/"
DESCRIPTOR = CompatibilityDescriptor(
    model="m",
    model_digest=b"\xa1" * 32,
    tokenizer_digest=b"\xb2" * 32,
    layers=32,
    kv_heads=8,
    head_dim=128,
    kv_dtype="bf16",
    positional="rope",
    block_tokens=16,
)


def key(i: int) -> BlockKey:
    return BlockKey(hashlib.sha256(b"redis-key%d" % i).digest())


def record(i: int, scope: bytes = SCOPE, layers: int = 4) -> ReplicaRecord:
    digests = tuple(hashlib.sha256(b"%d/%d" % (i, n)).digest() for n in range(layers))
    return ReplicaRecord(
        block_key=key(i),
        compat_id=COMPAT,
        scope_id=ScopeId(scope),
        holder=H1,
        codec=1,
        size=4096,
        digest=hashlib.sha256(b"".join(digests)).digest(),
        layer_digests=digests,
        residency=(Residency(tier=Tier.HOST, first=0, last=layers - 1, read_mbit_per_s=8e3),),
        ttl_ms=60_000,
    )


def status(epoch: int) -> InstanceStatusRecord:
    return InstanceStatusRecord(
        instance="https://ii.example/kvsp/",
        epoch=epoch,
        state=InstanceState.ACTIVE,
        running=0,
        queued=0,
        batch_size=8,
        kv_utilization=0.1,
        prefill_tokens_per_s=1000.0,
        decode_tokens_per_s=100.0,
        links=(),
        requested_state=None,
        ttl_ms=60_000,
    )


@pytest.fixture
def runner() -> Iterator[asyncio.Runner]:
    """One event loop for the test."""
    with asyncio.Runner() as loop:
        yield loop


@pytest.fixture
def store(redis_url: str, runner: asyncio.Runner) -> Iterator[RedisStore]:
    """A store under a prefix of this test's own."""
    made = RedisStore.from_url(redis_url)
    yield made
    runner.run(made.aclose())


def raw_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(parse_store_url(url)[0])


# --- the compact record form -------------------------------------------------------------------


def test_compact_form_covers_every_member_of_a_record() -> None:
    # A member added to ReplicaRecord must be added to the compact form too: fail until it is.
    known = {"block_key", "compat_id", "scope_id", "holder", "codec", "size", "digest"}
    known |= {"layer_digests", "residency", "ttl_ms", "moqt_namespace", "lease_base"}
    known |= {"moqt_carriers", "site", "zone"}
    assert {f.name for f in dataclasses.fields(ReplicaRecord)} == known


def test_compact_form_round_trips_and_is_smaller_than_json() -> None:
    full = dataclasses.replace(
        record(0, layers=32),
        holder="moqt://relay.example:4443/",
        moqt_namespace=b"\x01a\x01b",
        lease_base="https://relay.example/",
        moqt_carriers=("moqt+tls://relay.example:4444/", "moqt+unix://localhost/run/r.sock"),
        residency=(
            Residency(tier=Tier.DEVICE, first=0, last=15),
            Residency(tier=Tier.DISK, first=16, last=31, read_mbit_per_s=0.5),
        ),
    )
    bare = dataclasses.replace(record(1), layer_digests=None, residency=None)
    for r in (full, bare):
        data = b"pad" + encode_record(r)
        assert decode_record(data, 3, r.block_key, r.compat_id, r.scope_id) == r
    assert len(encode_record(full)) < len(dumps(full)) / 2


@pytest.mark.parametrize("cut", [1, 20, 60, 200])
def test_truncated_or_foreign_compact_forms_raise_value_error(cut: int) -> None:
    data = encode_record(record(0))
    with pytest.raises(ValueError, match="compact record"):
        decode_record(data[:cut], 0, key(0), COMPAT, SCOPE)
    with pytest.raises(ValueError, match="version 9"):
        decode_record(b"\x09" + data[1:], 0, key(0), COMPAT, SCOPE)


# --- round trips, key layout, scripts ----------------------------------------------------------


def test_a_lookup_is_one_evalsha(store: RedisStore, runner: asyncio.Runner, redis_url: str) -> None:
    runner.run(store.put_many([(record(i), 10**9) for i in range(300)]))
    client = raw_client(redis_url)

    def evalsha_calls() -> int:
        stats = client.info("commandstats").get("cmdstat_evalsha", {"calls": 0})
        return int(stats["calls"])

    try:
        for asked, matched in ((range(300), 300), (range(10), 10), ([999, 0], 0)):
            trips, calls = store.round_trips, evalsha_calls()
            found = runner.run(store.lookup(COMPAT, SCOPE, [key(i) for i in asked], 0))
            assert len(found) == matched
            assert store.round_trips - trips == 1
            assert evalsha_calls() - calls == 1
    finally:
        client.close()


def test_keys_carry_one_hash_tag_per_scope(
    store: RedisStore, runner: asyncio.Runner, redis_url: str
) -> None:
    runner.run(store.put_many([(record(0), 10**9), (record(1, OTHER_SCOPE), 10**9)]))
    runner.run(store.put_status(status(1), 10**9))
    client = raw_client(redis_url)
    try:
        names = [k.decode("latin-1") for k in client.scan_iter(match=f"{store.prefix}:*")]
    finally:
        client.close()
    tags = {name.split("{", 1)[1].split("}", 1)[0] for name in names if "{" in name}
    untagged = {name for name in names if "{" not in name}
    assert untagged == {f"{store.prefix}:scopes"}
    assert {t for t in tags if not t.startswith(("i:", "h:"))} == {SCOPE.hex(), OTHER_SCOPE.hex()}
    for name in names:  # the tag is the first {...}: the prefix has no braces
        assert name.startswith(f"{store.prefix}:{{") or name in untagged


def test_scripts_are_loaded_again_after_a_flush(
    store: RedisStore, runner: asyncio.Runner, redis_url: str
) -> None:
    runner.run(store.put(record(0), 10**9))
    client = raw_client(redis_url)
    try:
        client.script_flush()
    finally:
        client.close()
    assert len(runner.run(store.lookup(COMPAT, SCOPE, [key(0)], 0))) == 1
    client = raw_client(redis_url)
    try:
        client.script_flush()
    finally:
        client.close()
    runner.run(store.put_many([(record(1), 10**9)]))  # a pipeline reloads them too
    assert len(runner.run(store.lookup(COMPAT, SCOPE, [key(0), key(1)], 0))) == 2


def test_a_corrupt_value_is_a_store_error_not_a_crash(
    store: RedisStore, runner: asyncio.Runner, redis_url: str
) -> None:
    runner.run(store.put(record(0), 10**9))
    client = raw_client(redis_url)
    try:
        group = f"{store.prefix}:{{{SCOPE.hex()}}}:r:{COMPAT.hex()}"
        client.hset(group, key(0), b"9" * 15 + b"x" * 16 + b"9" * 15 + b"0000000005abc")
    finally:
        client.close()
    with pytest.raises(StoreUnavailable) as caught:
        runner.run(store.lookup(COMPAT, SCOPE, [key(0)], 0))
    assert caught.value.status == 503


# --- failures, loops, URLs ---------------------------------------------------------------------


def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_unreachable_redis_is_a_clear_error(runner: asyncio.Runner) -> None:
    down = RedisStore.from_url(f"redis://127.0.0.1:{unused_port()}/0")
    with pytest.raises(StoreUnavailable, match="cannot reach Redis at redis://127.0.0.1:"):
        down.check_reachable(timeout_s=1.0)
    try:
        with pytest.raises(StoreUnavailable) as caught:
            runner.run(down.lookup(COMPAT, SCOPE, [key(0)], 0))
        assert caught.value.problem == "kvsp-store-unavailable"
    finally:
        runner.run(down.aclose())


def test_a_store_serves_one_event_loop_until_closed(
    store: RedisStore, runner: asyncio.Runner
) -> None:
    assert runner.run(store.count()) == 0

    async def count_elsewhere() -> int:
        return await store.count()

    with pytest.raises(RuntimeError, match="another event loop"):
        asyncio.run(count_elsewhere())
    runner.run(store.aclose())

    async def count_and_close() -> int:
        try:
            return await store.count()
        finally:
            await store.aclose()

    assert asyncio.run(count_and_close()) == 0


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://h:1/2", ("redis://h:1/2", "kvsp")),
        ("redis://h:1/2?prefix=a.b-c_1", ("redis://h:1/2", "a.b-c_1")),
        (
            "rediss://u:p@h/0?prefix=x&ssl_cert_reqs=none",
            ("rediss://u:p@h/0?ssl_cert_reqs=none", "x"),
        ),
    ],
)
def test_store_urls(url: str, expected: tuple[str, str]) -> None:
    assert parse_store_url(url) == expected


@pytest.mark.parametrize(
    "url", ["memory://", "http://h/", "redis://h/0?prefix=", "redis://h?prefix=a:b"]
)
def test_bad_store_urls(url: str) -> None:
    with pytest.raises(BadRequest, match="--store"):
        parse_store_url(url)


# --- several stores on one Redis ---------------------------------------------------------------


def test_stores_on_one_redis_share_records_and_prefixes_keep_them_apart(
    redis_url: str, runner: asyncio.Runner
) -> None:
    a, b = RedisStore.from_url(redis_url), RedisStore.from_url(redis_url)
    apart = RedisStore(a.url, prefix=a.prefix + "-apart")
    try:
        runner.run(a.put_many([(record(i), 10**9) for i in range(5)]))
        assert len(runner.run(b.lookup(COMPAT, SCOPE, [key(i) for i in range(6)], 0))) == 5
        assert runner.run(apart.lookup(COMPAT, SCOPE, [key(0)], 0)) == []
        assert runner.run(b.delete(COMPAT, SCOPE, key(2), holder_id_of(H1)))
        assert len(runner.run(a.lookup(COMPAT, SCOPE, [key(i) for i in range(5)], 0))) == 2
        assert runner.run(apart.count()) == 0
        assert runner.run(b.drop_all()) > 0
        assert runner.run(a.count()) == 0
    finally:
        for s in (a, b, apart):
            runner.run(s.aclose())


def test_sweeping_takes_turns_between_scopes_and_forgets_emptied_ones(
    store: RedisStore, runner: asyncio.Runner, redis_url: str
) -> None:
    items = [(record(i, scope), 100) for scope in (SCOPE, OTHER_SCOPE) for i in range(4)]
    runner.run(store.put_many(items))
    first = runner.run(store.sweep(now_ms=100, max_items=3))
    second = runner.run(store.sweep(now_ms=100, max_items=3))
    assert (first, second) == (3, 3)
    assert runner.run(store.compats_in_scope(SCOPE, 0)) == {COMPAT}
    assert runner.run(store.compats_in_scope(OTHER_SCOPE, 0)) == {COMPAT}
    assert runner.run(store.sweep(now_ms=100, max_items=10)) == 2
    client = raw_client(redis_url)
    try:
        assert client.smembers(f"{store.prefix}:scopes") == set()
        runner.run(store.put(record(9), 200))  # a scope that fills again is swept again
        assert client.smembers(f"{store.prefix}:scopes") == {SCOPE.hex().encode()}
    finally:
        client.close()
    assert runner.run(store.sweep(now_ms=200, max_items=10)) == 1


def test_epochs_hold_under_racing_writers(redis_url: str, runner: asyncio.Runner) -> None:
    writers = [RedisStore.from_url(redis_url) for _ in range(3)]
    epochs = list(range(1, 61))

    async def race() -> list[bool]:
        calls = [writers[e % 3].put_status(status(e), 10**9) for e in reversed(epochs)]
        return list(await asyncio.gather(*calls))

    try:
        accepted = runner.run(race())
        [latest] = runner.run(writers[0].statuses([status(1).instance], 0))
        assert latest.epoch == 60  # whatever order they arrived in, the highest stays
        assert accepted[0]  # 60 is never below an epoch seen
        assert not runner.run(writers[1].put_status(status(59), 10**9))
        big = 2**64 - 1
        assert runner.run(writers[1].put_status(status(big), 10**9))
        assert not runner.run(writers[2].put_status(status(big - 1), 10**9))
    finally:
        for w in writers:
            runner.run(w.aclose())


# --- descriptors -------------------------------------------------------------------------------


def test_descriptors_are_shared_and_their_ids_checked(
    store: RedisStore, runner: asyncio.Runner, redis_url: str
) -> None:
    here, there = SharedDescriptors(None, store), SharedDescriptors(None, store)
    cid = here.add(DESCRIPTOR)
    assert there.get(cid) is None
    assert runner.run(here.sync()) == 0
    assert runner.run(there.sync()) == 1
    assert there.get(cid) == DESCRIPTOR
    drifted = dataclasses.replace(DESCRIPTOR, kv_dtype="fp16")
    client = raw_client(redis_url)
    try:  # stored under an id it does not have: never learnt
        client.hset(f"{store.prefix}:descriptors", compat_id(drifted).hex(), dumps(DESCRIPTOR))
        client.hset(f"{store.prefix}:descriptors", "ab" * 32, b"{not json")
    finally:
        client.close()
    assert runner.run(there.sync()) == 0
    assert there.get(compat_id(drifted)) is None


def test_descriptor_sync_keeps_running_in_the_background(
    store: RedisStore, runner: asyncio.Runner
) -> None:
    here = SharedDescriptors(None, store, interval_s=0.01)
    there = SharedDescriptors(None, store, interval_s=0.01)

    async def scenario() -> None:
        async with here.syncing(), there.syncing():
            here.add(DESCRIPTOR)
            await until(lambda: there.get(compat_id(DESCRIPTOR)), 2, "the descriptor over there")

    runner.run(scenario())


class _CancelLosingStore:
    """A store whose calls lose a cancel that lands in them (as a Redis client may)."""

    def __init__(self) -> None:
        self.calls = 0

    async def put_descriptor(self, descriptor: CompatibilityDescriptor) -> bool:
        return True

    async def descriptors(self) -> list[CompatibilityDescriptor]:
        self.calls += 1
        with contextlib.suppress(asyncio.CancelledError):  # lost
            await asyncio.sleep(0.02)
        return []


def test_descriptor_sync_stops_even_when_a_cancel_is_lost() -> None:
    """Leaving ``syncing()`` ends the background loop even when its cancel is swallowed inside
    a store call (before, the loop went on and ``syncing()`` waited for it forever)."""
    store = _CancelLosingStore()
    shared = SharedDescriptors(None, store, interval_s=0.001)  # type: ignore[arg-type]

    async def scenario() -> None:
        async with shared.syncing():
            await until(lambda: store.calls >= 3)

    loop = asyncio.new_event_loop()
    try:
        task = loop.create_task(scenario())
        # waited on, not cancelled: a cancel of the scenario would be lost the same way
        loop.run_until_complete(asyncio.wait({task}, timeout=5))
        assert task.done(), "syncing() still waits for its background loop"
        task.result()
    finally:
        loop.close()


def test_the_record_cache_is_bounded_and_keyed_by_block_as_well_as_octets() -> None:
    cache = RecordCache(2)
    data = encode_record(record(0))
    first = cache.decode(data, 0, len(data), key(0), COMPAT, SCOPE)
    assert cache.decode(data, 0, len(data), key(0), COMPAT, SCOPE) is first
    # The same octets for another block (identical replicas) decode with that block's key.
    other = cache.decode(data, 0, len(data), key(1), COMPAT, SCOPE)
    assert other.block_key == key(1) and other == dataclasses.replace(first, block_key=key(1))
    cache.decode(data, 0, len(data), key(2), COMPAT, SCOPE)
    assert len(cache) == 2  # key(0), least recently used, went
    assert cache.decode(data, 0, len(data), key(0), COMPAT, SCOPE) is not first
    assert len(RecordCache(0)) == 0
    uncached = RecordCache(0)
    assert uncached.decode(data, 0, len(data), key(0), COMPAT, SCOPE) == first
    assert len(uncached) == 0


def test_an_is_whose_redis_is_down_answers_503_problems(
    runner: asyncio.Runner, tmp_path: Path
) -> None:
    down = RedisStore.from_url(f"redis://127.0.0.1:{unused_port()}/0")
    entry = principal_entry("admin", "admin-token-0123456789abcdef", ["admin"], None)
    app = create_index_app(
        IndexConfig(gc_freeze_interval_s=None),
        store=down,
        principals=Principals.from_entries([entry]),
        clock=ManualClock(1000),
        descriptors=DescriptorRegistry(tmp_path / "descriptors"),
    )
    body = LookupRequest(scope_id=SCOPE, compat_id=COMPAT, block_keys=(key(0),)).to_json()

    async def ask() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        headers = {"authorization": "Bearer admin-token-0123456789abcdef"}
        async with httpx.AsyncClient(transport=transport, base_url="http://is") as client:
            return await client.post("/lookup", json=body, headers=headers)

    try:
        answer = runner.run(ask())
    finally:
        runner.run(down.aclose())
    assert answer.status_code == 503
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.json()["type"] == "urn:ietf:params:kvsp:problem:kvsp-store-unavailable"
