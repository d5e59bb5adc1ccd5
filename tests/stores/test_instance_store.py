"""The PC's instance store (spec §6.3), memory and Redis: the same semantics over both (an
update applies a pure transition of :mod:`kvsp.lifecycle` to the stored entry atomically, a
decision that raises writes nothing, removal, the stored form keeps every member), and, over
Redis, what several PCs need of it: writers on separate connections never lose an update,
a record's epoch is checked against the epoch another PC stored, and of racing sweeps exactly
one marks an expired instance failed."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from kvsp.errors import IllegalTransition, StaleEpoch
from kvsp.lifecycle import (
    InstanceEntry,
    InstanceRegistry,
    SleepPolicy,
    accept_status,
    end_epoch,
    expire_entry,
    order_state,
)
from kvsp.records import InstanceStatusRecord
from kvsp.registries import InstanceState
from kvsp.stores.instances import (
    InstanceStore,
    MemoryInstanceStore,
    entry_from_json,
    entry_to_json,
)

A = "https://store-a.example/kvsp/"
B = "https://store-b.example/kvsp/"
POLICY = SleepPolicy(threshold_load=1.0, min_low_ms=1_000)
Entry = InstanceEntry[InstanceStatusRecord]


def status(instance: str = A, *, epoch: int = 1, state: str = "active", ttl_ms: int = 3_000) -> Any:
    return InstanceStatusRecord(
        instance=instance,
        epoch=epoch,
        state=InstanceState(state),
        running=0,
        queued=0,
        batch_size=8,
        kv_utilization=0.0,
        prefill_tokens_per_s=1000.0,
        decode_tokens_per_s=100.0,
        links=(),
        requested_state=None,
        ttl_ms=ttl_ms,
    )


def accept(record: Any, now: int) -> Callable[[Entry | None], tuple[Entry, Any]]:
    return lambda entry: accept_status(entry, record, now, POLICY)


def expire(now: int) -> Callable[[Entry | None], tuple[Entry | None, bool]]:
    def decide(entry: Entry | None) -> tuple[Entry | None, bool]:
        new = None if entry is None else expire_entry(entry, now)
        return (entry, False) if new is None else (new, True)

    return decide


def _memory() -> MemoryInstanceStore:
    return MemoryInstanceStore(InstanceRegistry(POLICY))


Pair = tuple[InstanceStore, InstanceStore]
Scenario = Callable[[Pair], Awaitable[None]]


@pytest.fixture(params=["memory", "redis"])
def on_stores(request: pytest.FixtureRequest) -> Callable[[Scenario], None]:
    """Runs a scenario on two handles of one store: the same object in memory, two
    connections over Redis (closed afterwards)."""
    if request.param == "memory":

        def run_memory(scenario: Scenario) -> None:
            one = _memory()
            asyncio.run(scenario((one, one)))

        return run_memory
    pytest.importorskip("redis")
    from kvsp.stores.redis_instances import RedisInstanceStore

    url = request.getfixturevalue("redis_url")

    def run_redis(scenario: Scenario) -> None:
        async def main() -> None:
            pair = (RedisInstanceStore.from_url(url), RedisInstanceStore.from_url(url))
            try:
                await scenario(pair)
            finally:
                for store in pair:
                    await store.aclose()

        asyncio.run(main())

    return run_redis


def test_update_applies_a_transition_and_every_handle_reads_it(
    on_stores: Callable[[Scenario], None],
) -> None:
    async def scenario(stores: Pair) -> None:
        one, two = stores
        assert await one.get(A) is None and await one.entries() == []
        accepted = await one.update(A, accept(status(A), 100))
        assert accepted.registered and accepted.state is InstanceState.ACTIVE
        await two.update(B, accept(status(B, epoch=5), 100))
        entry = await two.get(A)
        assert entry is not None and (entry.epoch, entry.state, entry.received_ms) == (
            1,
            InstanceState.ACTIVE,
            100,
        )
        assert [e.instance for e in await one.entries()] == [A, B]  # sorted by URI
        # a lower epoch than the one stored through the other handle is refused and changes nothing
        with pytest.raises(StaleEpoch):
            await one.update(B, accept(status(B, epoch=4), 200))
        after = await two.get(B)
        assert after is not None and (after.epoch, after.received_ms) == (5, 100)

    on_stores(scenario)


def test_a_refused_decision_writes_nothing_and_none_removes(
    on_stores: Callable[[Scenario], None],
) -> None:
    async def scenario(stores: Pair) -> None:
        one, two = stores
        await one.update(A, accept(status(A), 100))
        before = await two.get(A)
        with pytest.raises(IllegalTransition):  # active -> sleeping is not the PC's move
            await two.update(A, lambda e: (order_state(e, A, InstanceState.SLEEPING, 100), None))
        assert await one.get(A) == before
        assert await two.update(A, lambda e: (None, "gone")) == "gone"
        assert await one.get(A) is None and await one.entries() == []

    on_stores(scenario)


def test_expiry_is_declared_once(on_stores: Callable[[Scenario], None]) -> None:
    async def scenario(stores: Pair) -> None:
        one, two = stores
        await one.update(A, accept(status(A, ttl_ms=1_000), 100))
        wins = await asyncio.gather(*(s.update(A, expire(5_000)) for s in (one, two, one, two)))
        assert sorted(wins) == [False, False, False, True]
        entry = await one.get(A)
        assert entry is not None and entry.state is InstanceState.FAILED

    on_stores(scenario)


def test_ended_epoch_is_kept_and_refuses_its_late_records(
    on_stores: Callable[[Scenario], None],
) -> None:
    async def scenario(stores: Pair) -> None:
        one, two = stores
        await one.update(A, accept(status(A, epoch=3), 100))
        await two.update(A, lambda e: (end_epoch(e, A, 3), None))
        entry = await one.get(A)
        assert entry is not None and entry.ended
        with pytest.raises(StaleEpoch):
            await one.update(A, accept(status(A, epoch=3), 200))
        again = await one.update(A, accept(status(A, epoch=4), 300))
        assert again.registered and again.ended_epoch is None  # ended, never failed
        entry = await two.get(A)
        assert entry is not None and not entry.ended and entry.epoch == 4

    on_stores(scenario)


def test_the_stored_form_keeps_every_member() -> None:
    entry = accept_status(None, status(A, epoch=7), 100, POLICY)[0]
    entry = dataclasses.replace(
        entry,
        state=InstanceState.DRAINING,
        low_since_ms=50,
        unapplied_from=frozenset({InstanceState.ACTIVE}),
        ordered=frozenset({InstanceState.ACTIVE, InstanceState.DRAINING}),
        ended=True,
    )
    text = entry_to_json(entry)
    assert entry_from_json(text) == entry
    assert entry_to_json(entry_from_json(text)) == text  # equal entries, equal strings


def test_redis_writers_on_separate_connections_lose_no_update(redis_url: str) -> None:
    pytest.importorskip("redis")
    from kvsp.stores.redis_instances import RedisInstanceStore

    async def scenario() -> None:
        stores = [RedisInstanceStore.from_url(redis_url) for _ in range(4)]
        try:
            await stores[0].update(A, accept(status(A), 0))

            def bump(entry: Entry | None) -> tuple[Entry, None]:
                assert entry is not None
                return dataclasses.replace(entry, received_ms=entry.received_ms + 1), None

            await asyncio.gather(*(stores[i % 4].update(A, bump) for i in range(40)))
            entry = await stores[1].get(A)
            assert entry is not None and entry.received_ms == 40
        finally:
            for store in stores:
                await store.aclose()

    asyncio.run(scenario())
