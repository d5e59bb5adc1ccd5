"""The replica stores (kvsp.stores.memory and kvsp.stores.redis, each test run on both): prefix
lookup stops at the first miss, expiry is exact on the caller's clock, sweeping is bounded,
refreshes move expiry, §6.3 epochs; then what is particular to the in-memory store."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import replace
from typing import Any, TypeVar

import pytest

from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.index import ReplicaStore, holder_id_of
from kvsp.records import InstanceStatusRecord, Link, ReplicaRecord, Residency
from kvsp.registries import InstanceState, Tier
from kvsp.stores.memory import HEAP_SLACK, MemoryStore

T = TypeVar("T")
COMPAT = CompatId(b"\x01" * 32)
OTHER_COMPAT = CompatId(b"\x02" * 32)
SCOPE = ScopeId(b"\x0a" * 16)
H1 = "https://h1.example/kvsp/"
H2 = "https://h2.example/kvsp/"


Run = Callable[[Coroutine[Any, Any, T]], T]
Stores = tuple[ReplicaStore, Run[Any]]


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@pytest.fixture(params=["memory", "redis"])
def stores(request: pytest.FixtureRequest) -> Iterator[Stores]:
    """A fresh store of each kind, and how to run its coroutines: on one event loop for the
    whole test, since a Redis store's connections belong to the loop that opened them."""
    with asyncio.Runner() as runner:
        if request.param == "memory":
            yield MemoryStore(), runner.run
            return
        from kvsp.stores.redis import RedisStore

        store = RedisStore.from_url(request.getfixturevalue("redis_url"))
        try:
            yield store, runner.run
        finally:
            runner.run(store.aclose())


def key(i: int) -> BlockKey:
    return BlockKey(hashlib.sha256(i.to_bytes(4, "big")).digest())


def record(i: int, holder: str = H1, compat: bytes = COMPAT, scope: bytes = SCOPE) -> ReplicaRecord:
    return ReplicaRecord(
        block_key=key(i),
        compat_id=CompatId(compat),
        scope_id=ScopeId(scope),
        holder=holder,
        codec=1,
        size=1024,
        digest=hashlib.sha256(b"d%d" % i).digest(),
        layer_digests=None,
        residency=None,
        ttl_ms=1000,
    )


def status(epoch: int, instance: str = "https://ii7.example/kvsp/") -> InstanceStatusRecord:
    return InstanceStatusRecord(
        instance=instance,
        epoch=epoch,
        state=InstanceState.ACTIVE,
        running=1,
        queued=0,
        batch_size=8,
        kv_utilization=0.5,
        prefill_tokens_per_s=1000.0,
        decode_tokens_per_s=100.0,
        links=(Link(holder=H1, mbit_per_s=1000.0, rtt_us=10.0),),
        requested_state=None,
        ttl_ms=3000,
    )


def keys(*indices: int) -> list[bytes]:
    return [key(i) for i in indices]


def test_memory_store_is_a_replica_store() -> None:
    store: ReplicaStore = MemoryStore()
    assert run(store.count()) == 0


def test_lookup_stops_at_first_key_without_a_replica(
    stores: Stores,
) -> None:
    store, run = stores
    run(store.put_many([(record(i), 100) for i in (0, 1, 3)]))
    found = run(store.lookup(COMPAT, SCOPE, keys(0, 1, 2, 3), now_ms=0))
    assert [[r.block_key for r, _ in f] for f in found] == [[key(0)], [key(1)]]
    assert run(store.lookup(COMPAT, SCOPE, keys(2, 0), now_ms=0)) == []
    assert run(store.lookup(OTHER_COMPAT, SCOPE, keys(0), now_ms=0)) == []


def test_lookup_returns_every_live_holder_and_skips_expired_ones(
    stores: Stores,
) -> None:
    store, run = stores
    run(store.put(record(0, H1), 100))
    run(store.put(record(0, H2), 200))
    run(store.put(record(1, H1), 100))
    both = run(store.lookup(COMPAT, SCOPE, keys(0, 1), now_ms=99))
    assert [sorted(r.holder for r, _ in f) for f in both] == [[H1, H2], [H1]]
    # At 100 the H1 records are expired: key 0 still has H2, key 1 has nothing, so stop there.
    later = run(store.lookup(COMPAT, SCOPE, keys(0, 1), now_ms=100))
    assert [[(r.holder, e) for r, e in f] for f in later] == [[(H2, 200)]]


def test_expired_records_are_never_returned_before_a_sweep(
    stores: Stores,
) -> None:
    store, run = stores
    run(store.put(record(0), 50))
    assert run(store.lookup(COMPAT, SCOPE, keys(0), now_ms=50)) == []
    assert run(store.compats_with_key(SCOPE, key(0), now_ms=50)) == set()
    assert run(store.compats_in_scope(SCOPE, now_ms=50)) == set()
    assert run(store.count()) == 1  # not swept yet, but invisible


def test_refresh_moves_expiry(stores: Stores) -> None:
    store, run = stores
    run(store.put(record(0), 100))
    run(store.put(record(0), 300))  # refresh: same key and holder
    assert run(store.count()) == 1
    assert run(store.sweep(now_ms=150, max_items=10)) == 0
    assert [[e for _, e in f] for f in run(store.lookup(COMPAT, SCOPE, keys(0), 150))] == [[300]]
    assert run(store.sweep(now_ms=300, max_items=10)) == 1
    assert run(store.count()) == 0
    assert run(store.lookup(COMPAT, SCOPE, keys(0), 0)) == []


def test_records_round_trip_with_every_member(stores: Stores) -> None:
    store, run = stores
    full = replace(
        record(0, holder="moqt://relay.example:4443/kvsp"),
        layer_digests=tuple(hashlib.sha256(b"%d" % n).digest() for n in range(3)),
        residency=(
            Residency(tier=Tier.DEVICE, first=0, last=0),
            Residency(tier=Tier.DISK, first=1, last=2, read_mbit_per_s=1234.5),
        ),
        moqt_namespace=b"\x04kvsp\x011",
        lease_base="https://relay.example/kvsp/",
        ttl_ms=2**40,
        size=2**63,
        codec=0xFFFF,
    )
    bare = record(1, holder=H2)
    run(store.put_many([(full, 10**12), (bare, 10**12 + 1)]))
    found = run(store.lookup(COMPAT, SCOPE, keys(0, 1), now_ms=0))
    assert found == [[(full, 10**12)], [(bare, 10**12 + 1)]]


def test_scopes_and_compat_ids_are_kept_apart(stores: Stores) -> None:
    store, run = stores
    other_scope = ScopeId(b"\x0b" * 16)
    run(store.put(record(0, scope=other_scope), 100))
    run(store.put(record(1, compat=OTHER_COMPAT), 100))
    assert run(store.lookup(COMPAT, SCOPE, keys(0), 0)) == []
    assert len(run(store.lookup(COMPAT, other_scope, keys(0), 0))) == 1
    assert run(store.lookup(COMPAT, SCOPE, keys(1), 0)) == []
    assert run(store.compats_in_scope(other_scope, 0)) == {COMPAT}
    assert not run(store.delete(COMPAT, SCOPE, key(0), holder_id_of(H1)))
    assert run(store.count()) == 2
    assert run(store.sweep(now_ms=100, max_items=10)) == 2
    assert run(store.count()) == 0


def test_lookup_of_no_keys_and_of_many(stores: Stores) -> None:
    store, run = stores
    run(store.put_many([(record(i), 100) for i in range(1500)]))
    assert run(store.lookup(COMPAT, SCOPE, [], now_ms=0)) == []
    found = run(store.lookup(COMPAT, SCOPE, keys(*range(1501)), now_ms=0))
    assert [f[0][0].block_key for f in found] == keys(*range(1500))
    assert run(store.count()) == 1500


def test_refresh_leaves_a_stale_heap_entry_behind() -> None:
    store = MemoryStore()
    run(store.put(record(0), 100))
    run(store.put(record(0), 300))  # refresh: same key and holder
    assert run(store.count()) == 1
    assert store.pending_expiries() == 2
    assert run(store.sweep(now_ms=150, max_items=10)) == 0  # the stale entry is skipped
    assert store.pending_expiries() == 1
    assert [[e for _, e in f] for f in run(store.lookup(COMPAT, SCOPE, keys(0), 150))] == [[300]]
    assert run(store.sweep(now_ms=300, max_items=10)) == 1
    assert run(store.count()) == 0
    assert store.pending_expiries() == 0


def test_frequent_refreshes_keep_the_expiry_heap_bounded_by_the_records() -> None:
    store = MemoryStore()
    run(store.put_many([(record(i), 10_000) for i in range(100)]))
    for step in range(50):  # 5,000 refreshes, far more than the records, none of them due
        run(store.put_many([(record(i), 10_000 + step) for i in range(100)]))
        assert store.pending_expiries() <= 2 * 100 + HEAP_SLACK
    assert run(store.count()) == 100
    # the rebuilt heap still expires each record at its latest expiry, and only then
    assert run(store.sweep(now_ms=10_048, max_items=10_000)) == 0
    assert len(run(store.lookup(COMPAT, SCOPE, keys(*range(100)), now_ms=10_048))) == 100
    assert run(store.sweep(now_ms=10_049, max_items=10_000)) == 100
    assert run(store.count()) == 0
    assert store.pending_expiries() == 0


def test_refresh_to_an_earlier_expiry_takes_effect(
    stores: Stores,
) -> None:
    store, run = stores
    run(store.put(record(0), 300))
    run(store.put(record(0), 100))
    assert run(store.lookup(COMPAT, SCOPE, keys(0), now_ms=100)) == []
    assert run(store.sweep(now_ms=100, max_items=10)) == 1
    assert run(store.sweep(now_ms=300, max_items=10)) == 0  # the older entry is stale


def test_sweep_is_bounded_per_call(stores: Stores) -> None:
    store, run = stores
    run(store.put_many([(record(i), 10 + i) for i in range(100)]))
    assert run(store.sweep(now_ms=1000, max_items=30)) == 30
    assert run(store.count()) == 70
    assert run(store.sweep(now_ms=1000, max_items=30)) == 30
    # Only due entries go, earliest first.
    assert run(store.sweep(now_ms=79, max_items=1000)) == 10
    assert run(store.count()) == 30
    assert run(store.lookup(COMPAT, SCOPE, keys(70), now_ms=0))[0][0][1] == 80


def test_delete_removes_one_holder_and_prunes_empty_groups(
    stores: Stores,
) -> None:
    store, run = stores
    run(store.put(record(0, H1), 100))
    run(store.put(record(0, H2), 100))
    assert run(store.delete(COMPAT, SCOPE, key(0), holder_id_of(H1)))
    assert not run(store.delete(COMPAT, SCOPE, key(0), holder_id_of(H1)))
    assert [[r.holder for r, _ in f] for f in run(store.lookup(COMPAT, SCOPE, keys(0), 0))] == [
        [H2]
    ]
    assert run(store.delete(COMPAT, SCOPE, key(0), holder_id_of(H2)))
    assert run(store.count()) == 0
    assert run(store.compats_in_scope(SCOPE, now_ms=0)) == set()
    assert run(store.sweep(now_ms=100, max_items=10)) == 0  # nothing left to expire


def test_compat_ids_by_key_and_by_scope(stores: Stores) -> None:
    store, run = stores
    run(store.put(record(0, compat=COMPAT), 100))
    run(store.put(record(0, compat=OTHER_COMPAT), 200))
    run(store.put(record(1, compat=OTHER_COMPAT), 100))
    assert run(store.compats_with_key(SCOPE, key(0), 50)) == {COMPAT, OTHER_COMPAT}
    assert run(store.compats_with_key(SCOPE, key(0), 150)) == {OTHER_COMPAT}
    assert run(store.compats_with_key(SCOPE, key(1), 50)) == {OTHER_COMPAT}
    assert run(store.compats_with_key(SCOPE, key(2), 50)) == set()
    assert run(store.compats_in_scope(SCOPE, 150)) == {OTHER_COMPAT}
    assert run(store.compats_in_scope(ScopeId(b"\x0b" * 16), 0)) == set()


def test_status_epochs_never_go_back(stores: Stores) -> None:
    store, run = stores
    assert run(store.put_status(status(5), 1000))
    assert run(store.put_status(status(5), 2000))  # same epoch: a refresh
    assert not run(store.put_status(status(4), 9000))  # §6.3: lower epoch discarded
    assert run(store.put_status(status(6), 1500))
    [latest] = run(store.statuses(["https://ii7.example/kvsp/"], now_ms=0))
    assert latest.epoch == 6
    # Expiry hides the record but the epoch is remembered.
    assert run(store.statuses(["https://ii7.example/kvsp/"], now_ms=1500)) == []
    assert not run(store.put_status(status(5), 9000))


def test_statuses_keep_the_order_asked_and_skip_unknown_instances(
    stores: Stores,
) -> None:
    store, run = stores
    a, b = "https://a.example/", "https://b.example/"
    run(store.put_status(status(1, a), 100))
    run(store.put_status(status(1, b), 100))
    got = run(store.statuses([b, "https://c.example/", a], now_ms=0))
    assert [s.instance for s in got] == [b, a]


def test_identifiers_are_interned_across_records() -> None:
    store = MemoryStore()
    a = record(0, compat=bytes(bytearray(COMPAT)))
    b = record(1, compat=bytes(bytearray(COMPAT)))
    assert a.compat_id is not b.compat_id
    run(store.put_many([(a, 100), (b, 100)]))
    # Heap entries are (expires, compat, scope, key, holder id): one object per distinct id.
    assert len({id(entry[1]) for entry in store._heap}) == 1
    assert len({id(entry[4]) for entry in store._heap}) == 1


def test_census_octets_saturate_at_uint64_so_the_answer_stays_serializable() -> None:
    # found by schemathesis: two records declaring near-2^64 sizes overflowed the JSON writer
    store = MemoryStore()
    big = 2**64 - 1
    run(store.put(replace(record(1), size=big), expires_ms=10_000))
    run(store.put(replace(record(2), size=big), expires_ms=10_000))
    run(store.put(replace(record(3, holder=H2), size=5), expires_ms=10_000))
    assert run(store.holders(0)) == [(H1, 2, big), (H2, 1, 5)]  # sorted by holder
