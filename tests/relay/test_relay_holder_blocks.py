"""The relay's holder role keeps one published record per block (spec §6.1): when the
published replica leaves the cache, another cached replica of the same block takes its place,
and finding it costs the same in a cache of one block or of thousands (a full cache withdraws a
record for every block it admits)."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.records import ReplicaRecord
from kvsp.web.clock import ManualClock
from relay import deadlines
from relay.cache import TrackKey
from relay.holder import HolderConfig, RelayHolder
from relay.kv import BlockTrack, KVReplica

COMPAT = CompatId(bytes(range(32)))
SCOPE = ScopeId(bytes(range(1, 33)))
DIGESTS = (hashlib.sha256(b"layer 0").digest(),)


class Index:
    """The IS as the holder sees it: what was published and withdrawn, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes, bytes]] = []

    async def publish(self, record: ReplicaRecord, /) -> int:
        self.calls.append(("publish", bytes(record.block_key), record.digest))
        return record.ttl_ms

    async def withdraw(self, compat_id: bytes, scope_id: bytes, key: bytes, holder: str, /) -> bool:
        self.calls.append(("withdraw", key, b""))
        return True


def replica(key: bytes, digest: bytes) -> KVReplica:
    block = BlockTrack(COMPAT, SCOPE, BlockKey(key), digest)
    namespace = (b"kvsp", b"1", COMPAT.hex().encode(), SCOPE.hex().encode(), key.hex().encode())
    track: TrackKey = (namespace, digest.hex().encode())
    return KVReplica(block, track, DIGESTS, 4096, None)


def block_key(n: int) -> bytes:
    return n.to_bytes(32, "big")


def holder_with(index: Index) -> RelayHolder:
    return RelayHolder(
        HolderConfig(record_ttl_ms=30_000),
        ManualClock(1_000_000),
        index,
        holder_url="moqt://relay.test:4443",
    )


def test_another_replica_of_the_block_is_published_when_the_published_one_goes() -> None:
    index = Index()
    holder = holder_with(index)
    first, second = replica(block_key(1), b"\x01" * 32), replica(block_key(1), b"\x02" * 32)
    other = replica(block_key(2), b"\x03" * 32)

    async def scenario() -> None:
        for each in (first, second, other):
            if holder.add(each):
                await holder.publish(each.key)
        assert holder.record_of(first.key) is not None
        assert holder.record_of(second.key) is None  # one record per block
        await holder.withdraw(first.key)
        assert holder.replica(first.key) is None
        record = holder.record_of(second.key)
        assert record is not None and record.digest == b"\x02" * 32
        await holder.withdraw(second.key)  # the last replica of the block: nothing to promote
        await holder.withdraw(second.key)  # already gone: nothing happens

    asyncio.run(scenario())
    assert index.calls == [
        ("publish", block_key(1), b"\x01" * 32),
        ("publish", block_key(2), b"\x03" * 32),
        ("withdraw", block_key(1), b""),
        ("publish", block_key(1), b"\x02" * 32),
        ("withdraw", block_key(1), b""),
    ]
    assert holder.record_of(other.key) is not None


def test_a_record_being_published_when_its_replica_goes_is_withdrawn_after_it() -> None:
    """The IS conversation is awaited: a replica evicted while its first publication is under
    way has that record withdrawn once it is in (not left at the IS, naming a block the relay
    no longer holds), and the other replica of its block is published next."""
    index = Index()
    holder = holder_with(index)
    first, second = replica(block_key(1), b"\x01" * 32), replica(block_key(1), b"\x02" * 32)
    release = asyncio.Event()
    publish = index.publish

    async def slow_publish(record: ReplicaRecord, /) -> int:
        await release.wait()
        return await publish(record)

    index.publish = slow_publish  # type: ignore[method-assign]

    async def scenario() -> None:
        assert holder.add(first)
        assert not holder.add(second)
        publishing = asyncio.create_task(holder.publish(first.key))
        await asyncio.sleep(0)  # the publication holds the IS conversation
        withdrawing = asyncio.create_task(holder.withdraw(first.key))
        await asyncio.sleep(0)
        release.set()
        await asyncio.gather(publishing, withdrawing)

    asyncio.run(scenario())
    assert index.calls == [
        ("publish", block_key(1), b"\x01" * 32),
        ("withdraw", block_key(1), b""),
        ("publish", block_key(1), b"\x02" * 32),
    ]
    assert holder.record_of(second.key) is not None


def test_an_unpublished_replica_that_goes_hands_its_block_to_another() -> None:
    """A replica whose publication failed (the refresh loop would retry it) leaves the cache:
    the block's other cached replica is published instead, not forgotten."""
    index = Index()
    holder = holder_with(index)
    first, second = replica(block_key(1), b"\x01" * 32), replica(block_key(1), b"\x02" * 32)

    async def scenario() -> None:
        assert holder.add(first)  # its publication is never attempted (or failed)
        assert not holder.add(second)
        await holder.withdraw(first.key)

    asyncio.run(scenario())
    assert index.calls == [("publish", block_key(1), b"\x02" * 32)]


def test_withdrawing_a_record_looks_at_the_block_alone_not_at_the_whole_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """How many replicas a withdrawal examines does not grow with the cache: it was a scan of
    every cached replica, so a full relay admitting a block (one eviction, one withdrawal)
    slowed down with the size of its cache."""
    looked = 0
    packed = BlockTrack.packed

    def counting(self: BlockTrack) -> bytes:
        nonlocal looked
        looked += 1
        return packed.fget(self)  # type: ignore[no-any-return, attr-defined]

    monkeypatch.setattr(BlockTrack, "packed", property(counting))

    def withdrawal_looks(cached: int) -> int:
        nonlocal looked
        holder = holder_with(Index())
        for n in range(cached):
            holder.add(replica(block_key(100 + n), b"\x05" * 32))
        gone, stays = replica(block_key(1), b"\x01" * 32), replica(block_key(1), b"\x02" * 32)
        holder.add(gone)
        holder.add(stays)
        asyncio.run(holder.publish(gone.key))
        looked = 0
        asyncio.run(holder.withdraw(gone.key))
        assert holder.record_of(stays.key) is not None
        return looked

    assert withdrawal_looks(3000) == withdrawal_looks(1)


class Looked(dict):  # type: ignore[type-arg]
    """A dict that counts the entries read from it, one by key or each one of a walk."""

    count = 0

    def get(self, key, default=None):  # type: ignore[no-untyped-def]
        Looked.count += 1
        return super().get(key, default)

    def values(self):  # type: ignore[no-untyped-def]
        for value in super().values():
            Looked.count += 1
            yield value

    def items(self):  # type: ignore[no-untyped-def]
        for item in super().items():
            Looked.count += 1
            yield item


def test_the_upkeep_looks_at_the_records_due_alone_not_at_the_whole_cache() -> None:
    """The relay asks twice a second which records are due for a refresh and which replicas
    have expired. Both were scans of every cached block: a relay holding a million blocks
    spent most of its time, and held its event loop, looking at the ones not due. Now a
    pass looks at the deadlines that have come, each once: here, past the first-publication
    retries that the publications made stale, only the one block due."""

    def looks(cached: int) -> tuple[int, int]:
        clock = ManualClock(1_000_000)
        holder = RelayHolder(HolderConfig(record_ttl_ms=30_000), clock, Index())
        for n in range(cached):
            held = replica(block_key(100 + n), b"\x05" * 32)
            held = KVReplica(held.block, held.key, DIGESTS, 4096, 10_000_000)
            holder.add(held)
            asyncio.run(holder.publish(held.key))  # refreshed at 1,010,000
        soon = replica(block_key(1), b"\x01" * 32)
        soon = KVReplica(soon.block, soon.key, DIGESTS, 4096, 1_005_000)
        holder.add(soon)
        asyncio.run(holder.publish(soon.key))  # TTL 5,000: refreshed at 1,001,666
        holder._blocks = Looked(holder._blocks)  # type: ignore[assignment]
        holder._replicas = Looked(holder._replicas)  # type: ignore[assignment]
        clock.set(1_001_500)
        assert holder.due() == []  # the stale retries (one a publication) go, each once
        Looked.count = 0
        clock.set(1_002_000)
        assert holder.due() == [soon.key]
        due_looks = Looked.count
        Looked.count = 0
        clock.set(1_005_000)
        assert holder.expired() == [soon.key]
        return due_looks, Looked.count

    assert looks(3000) == looks(1)


def test_a_due_record_and_an_expired_replica_are_named_until_acted_on() -> None:
    """Each upkeep pass names a record due for a refresh again until the refresh moves it on,
    and an expired replica until it is withdrawn (a pass that failed half-way loses
    nothing); a relay with no index queues no refreshes at all."""
    clock = ManualClock(1_000_000)
    index = Index()
    holder = RelayHolder(HolderConfig(record_ttl_ms=30_000), clock, index)
    held = replica(block_key(1), b"\x01" * 32)
    held = KVReplica(held.block, held.key, DIGESTS, 4096, 1_100_000)
    holder.add(held)
    assert holder.due() == []
    clock.set(1_001_000)  # the first publication was not made: retried after RETRY_MS
    assert holder.due() == [held.key] and holder.due() == [held.key]
    asyncio.run(holder.publish(held.key))  # granted 30,000: refreshed at a third
    assert holder.due() == []
    clock.set(1_010_999)
    assert holder.due() == []
    clock.set(1_011_000)
    assert holder.due() == [held.key]
    clock.set(1_100_000)
    assert holder.expired() == [held.key] and holder.expired() == [held.key]
    asyncio.run(holder.withdraw(held.key))
    assert holder.expired() == [] and holder.due() == []

    alone = RelayHolder(HolderConfig(record_ttl_ms=30_000), ManualClock(1_000_000))
    alone.add(replica(block_key(2), b"\x02" * 32))
    alone.clock.set(2_000_000)  # type: ignore[attr-defined]
    assert alone.due() == []  # without an index there is nothing to publish


def test_a_holder_that_turns_over_keeps_deadlines_only_for_what_it_holds() -> None:
    """A replica's expiry and its record's refresh are queued when it is added; a replica
    withdrawn (evicted) before then left both entries, and its names, in the heaps until
    their time: 6,000 replicas cycled through a holder of 20 kept 12,000 entries. The heaps
    now compact themselves, and the replicas held are still refreshed and expired on time."""
    clock = ManualClock(1_000_000)
    holder = RelayHolder(HolderConfig(record_ttl_ms=30_000), clock, Index())
    held: list[KVReplica] = []
    for n in range(6_000):
        base = replica(block_key(n), n.to_bytes(32, "big"))
        added = KVReplica(base.block, base.key, DIGESTS, 4096, 4_600_000)
        holder.add(added)
        asyncio.run(holder.publish(added.key))
        held.append(added)
        if len(held) > 20:
            asyncio.run(holder.withdraw(held.pop(0).key))
    assert len(holder._expiries) <= 2 * deadlines.COMPACT_FLOOR
    assert len(holder._refreshes) <= 2 * deadlines.COMPACT_FLOOR
    keys = sorted(replica.key for replica in held)
    clock.set(1_009_999)
    assert holder.due() == []
    clock.set(1_010_000)  # granted 30,000: refreshed at a third
    assert sorted(holder.due()) == keys
    clock.set(4_600_000)
    assert sorted(holder.expired()) == keys
