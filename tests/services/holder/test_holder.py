"""The Holder library: storing, serving, leasing and publishing blocks (§6.1, §6.6, §6.7)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from kvsp.compat import CompatibilityDescriptor
from kvsp.container import Geometry, decode_container, encode_container
from kvsp.errors import (
    ContainerError,
    DigestMismatch,
    Forbidden,
    Incompatible,
    KVSPError,
    LayersUnavailable,
    LeaseQuota,
    NotAcceptable,
    NotFound,
    PreconditionFailed,
    TransportError,
)
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.leases import LeaseQuota as QuotaConfig
from kvsp.records import LeaseRenewal, LeaseRequest, ReplicaRecord
from kvsp.registries import Tier
from kvsp.services.holder.service import OFFLOAD_BYTES, Holder, HolderConfig
from kvsp.stores.blocks import BlockRef
from kvsp.stores.descriptors import DescriptorRegistry
from kvsp.web.auth import Principal
from kvsp.web.clock import ManualClock
from tests.support.tiny_holder import COMPAT, DESCRIPTOR, GEOMETRY, SCOPE, SIZE, container, key

T = TypeVar("T")
OTHER_SCOPE = ScopeId(b"\x0b" * 16)
URL = "http://holder.test/kvsp/"
TTL = 30_000
ALICE = Principal(name="alice", roles=frozenset({"client"}), scopes=frozenset({SCOPE}))
BOB = Principal(name="bob", roles=frozenset({"client"}), scopes=frozenset({SCOPE}))
MALLORY = Principal(name="mallory", roles=frozenset({"client"}), scopes=frozenset({OTHER_SCOPE}))


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def ref(n: int) -> BlockRef:
    return BlockRef(COMPAT, SCOPE, key(n))


class FakeIndex:
    """An Index Service that records every call, and whether the block was still held when
    its record was withdrawn (§6.1: withdraw before evicting)."""

    def __init__(self, cap_ms: int | None = None) -> None:
        self.cap_ms = cap_ms
        self.calls: list[tuple[str, BlockRef]] = []
        self.batches: list[int] = []
        self.records: dict[BlockRef, ReplicaRecord] = {}
        self.held_at_withdraw: dict[BlockRef, bool] = {}
        self.holder: Holder | None = None
        self.fail: Exception | None = None
        self.on_withdraw: Callable[[BlockRef], None] | None = None

    async def publish(self, record: ReplicaRecord, /) -> int:
        r = BlockRef(record.compat_id, record.scope_id, record.block_key)
        if self.fail is not None:
            raise self.fail
        self.calls.append(("publish", r))
        self.records[r] = record
        return record.ttl_ms if self.cap_ms is None else min(self.cap_ms, record.ttl_ms)

    async def publish_batch(self, records: Sequence[ReplicaRecord], /) -> list[int | KVSPError]:
        self.batches.append(len(records))
        if self.fail is not None:
            raise self.fail
        return [await self.publish(r) for r in records]

    async def withdraw(
        self, compat: CompatId, scope: ScopeId, key: BlockKey, holder: str, /
    ) -> bool:
        r = BlockRef(compat, scope, key)
        assert holder == URL
        if self.fail is not None:
            raise self.fail
        self.calls.append(("withdraw", r))
        if self.holder is not None:
            self.held_at_withdraw[r] = r in self.holder.store
        if self.on_withdraw is not None:
            self.on_withdraw(r)
        return self.records.pop(r, None) is not None


def make_holder(
    *,
    index: FakeIndex | None = None,
    clock: ManualClock | None = None,
    state: Path | None = None,
    quota: QuotaConfig | None = None,
    **tiers: int,
) -> Holder:
    registry = DescriptorRegistry()
    registry.add(DESCRIPTOR)
    config = HolderConfig(
        public_url=URL,
        tiers={Tier(t): size for t, size in tiers.items()} or {Tier.HOST: 16 * SIZE},
        state_dir=state,
        record_ttl_ms=TTL,
        lease_quota=quota
        or QuotaConfig(max_octets_per_client=4 * SIZE, max_ttl_ms=10_000, max_leases_per_client=4),
        fsync=False,
    )
    holder = Holder(config, index=index, descriptors=registry, clock=clock or ManualClock(0))
    if index is not None:
        index.holder = holder
    return holder


def put(holder: Holder, n: int, data: bytes | None = None, who: Principal = ALICE) -> Any:
    body = container(n) if data is None else data
    return run(holder.put_block(who, COMPAT, SCOPE, key(n), body))


def get(
    holder: Holder,
    n: int,
    layers: tuple[int, int] | None = None,
    codec: int | None = None,
    who: Principal = ALICE,
) -> bytes:
    plan = run(holder.get_block(who, COMPAT, SCOPE, key(n), layers, codec))
    body = b"".join(plan.parts)
    assert len(body) == plan.length
    assert hashlib.sha256(body).digest() == plan.repr_digest
    return body


def lease(holder: Holder, *ns: int, ttl: int = 5_000, who: Principal = ALICE) -> str:
    request = LeaseRequest(
        compat_id=COMPAT, scope_id=SCOPE, block_keys=tuple(map(key, ns)), ttl_ms=ttl
    )
    return holder.grant(who, request).lease


# -- storing and serving (§6.7) ----------------------------------------------------------------


def test_put_then_get_the_whole_block() -> None:
    holder = make_holder()
    put(holder, 1)
    assert get(holder, 1) == container(1)
    plan = run(holder.get_block(ALICE, COMPAT, SCOPE, key(1), None, 1))
    assert plan.max_age_s == TTL // 1000  # standalone: the configured record TTL
    assert len(plan.parts) == 1 and isinstance(plan.parts[0], memoryview)


def test_get_a_layer_range_sends_views_of_the_stored_block() -> None:
    holder = make_holder()
    put(holder, 1)
    body = get(holder, 1, (1, 2))
    assert body == decode_container(container(1)).select(1, 2).encode()
    plan = run(holder.get_block(ALICE, COMPAT, SCOPE, key(1), (1, 2), None))
    stored = holder.store.read(holder.store.get(ref(1)))  # type: ignore[arg-type]
    assert len(plan.parts) == 2  # a new header, then one view: the layers are contiguous
    assert plan.parts[1].obj is stored.obj  # type: ignore[union-attr]
    assert get(holder, 1, (0, 3)) == container(1)


def test_missing_blocks_layers_and_codecs() -> None:
    holder = make_holder()
    put(holder, 2, container(2, first=1, count=2))
    with pytest.raises(NotFound) as missing:
        get(holder, 9)
    assert missing.value.problem == "kvsp-not-found"
    with pytest.raises(LayersUnavailable):
        get(holder, 2, (0, 1))
    with pytest.raises(LayersUnavailable):
        get(holder, 2, (2, 3))
    assert get(holder, 2, (2, 2)) == decode_container(container(2, 1, 2)).select(2, 2).encode()
    with pytest.raises(NotAcceptable):
        get(holder, 2, codec=2)


def test_scope_is_checked_first() -> None:
    holder = make_holder()
    put(holder, 1)
    with pytest.raises(Forbidden):
        get(holder, 1, who=MALLORY)
    with pytest.raises(Forbidden):
        run(holder.get_block(MALLORY, COMPAT, SCOPE, key(9), None, 7))
    with pytest.raises(Forbidden):
        put(holder, 1, who=MALLORY)  # would be 412 for an authorized client
    with pytest.raises(Forbidden):
        lease(holder, 1, who=MALLORY)


def test_a_second_put_keeps_the_first_copy() -> None:
    holder = make_holder()
    put(holder, 1)
    with pytest.raises(PreconditionFailed) as exc:
        put(holder, 1, container(7))
    assert exc.value.status == 412
    assert get(holder, 1) == container(1)


def test_unknown_compat_and_wrong_token_count() -> None:
    holder = make_holder()
    with pytest.raises(Incompatible, match="PUT its descriptor first"):
        run(holder.put_block(ALICE, CompatId(b"\x00" * 32), SCOPE, key(1), container(1)))
    with pytest.raises(Incompatible, match="block_tokens"):
        put(holder, 1, container(1, tokens=3))
    with pytest.raises(ContainerError):
        put(holder, 1, container(1)[:-1])
    assert len(holder.store) == 0


def test_a_repr_digest_mismatch_stores_nothing() -> None:
    holder = make_holder()
    data = container(1)
    with pytest.raises(DigestMismatch):
        run(holder.put_block(ALICE, COMPAT, SCOPE, key(1), data, expected_digest=b"\0" * 32))
    assert len(holder.store) == 0
    good = hashlib.sha256(data).digest()
    run(holder.put_block(ALICE, COMPAT, SCOPE, key(1), data, expected_digest=good))
    assert ref(1) in holder.store


def test_large_blocks_are_hashed_in_worker_threads() -> None:
    descriptor = CompatibilityDescriptor.from_json(DESCRIPTOR.to_json() | {"head_dim": 32768})
    registry = DescriptorRegistry()
    cid = registry.add(descriptor)
    holder = Holder(
        HolderConfig(public_url=URL, tiers={Tier.HOST: 8 << 20}),
        index=None,
        descriptors=registry,
        clock=ManualClock(0),
    )
    geometry = Geometry.from_descriptor(descriptor)
    section = bytes(range(256)) * (geometry.section_length(2) // 256)
    data = encode_container(
        [(section, section)] * 4, first_layer=0, token_count=2, geometry=geometry
    )
    assert len(data) >= OFFLOAD_BYTES
    block = run(holder.put_block(ALICE, cid, SCOPE, key(1), data))
    assert block.meta.repr_digest == hashlib.sha256(data).digest()
    assert block.meta.layer_digests == tuple(decode_container(data).layer_digests())
    plan = run(holder.get_block(ALICE, cid, SCOPE, key(1), (1, 2), None))
    assert plan.repr_digest == hashlib.sha256(b"".join(plan.parts)).digest()
    with pytest.raises(ContainerError):
        run(holder.put_block(ALICE, cid, SCOPE, key(2), data[:-1]))


def test_sub_range_digests_are_cached() -> None:
    holder = make_holder()
    put(holder, 1)
    for first in range(4):
        get(holder, 1, (first, 3))
    assert len(holder._digests) == 3  # the whole block's digest is precomputed, not cached


# -- records (§4.4, §6.1) ----------------------------------------------------------------------


def test_the_published_record() -> None:
    index = FakeIndex()
    holder = make_holder(index=index)
    put(holder, 1)
    record = index.records[ref(1)]
    decoded = decode_container(container(1))
    assert record.holder == URL and record.codec == 1 and record.size == SIZE
    assert record.layer_digests == tuple(decoded.layer_digests())
    assert record.verify_layer_digests() and record.ttl_ms == TTL
    assert [r.to_json() for r in record.residency or ()] == [
        {"tier": "host", "layers": [0, 3], "read_mbit_per_s": 400000}
    ]
    assert ReplicaRecord.from_json(record.to_json()) == record


def test_a_sub_range_replica_is_served_but_not_published() -> None:
    # A record's digest covers every layer (§4.3); a holder of layers 1..3 cannot state it.
    index = FakeIndex()
    holder = make_holder(index=index)
    put(holder, 1, container(1, first=1, count=3))
    put(holder, 2)
    assert ref(1) not in index.records and ref(2) in index.records
    assert get(holder, 1, (2, 3)) == decode_container(container(1, 1, 3)).select(2, 3).encode()
    assert run(holder.refresh_due()) == 0 and ref(1) not in index.records  # 2 is not due yet


def test_records_are_refreshed_at_a_third_of_the_granted_ttl() -> None:
    clock = ManualClock(1_000)
    index = FakeIndex(cap_ms=9_000)
    holder = make_holder(index=index, clock=clock)
    put(holder, 1)
    assert index.calls == [("publish", ref(1))]
    clock.advance(2_999)
    assert run(holder.refresh_due()) == 0
    plan = run(holder.get_block(ALICE, COMPAT, SCOPE, key(1), None, None))
    assert plan.max_age_s == 6  # 9,000 granted − 2,999 elapsed, in whole seconds
    clock.advance(1)
    assert run(holder.refresh_due()) == 1
    assert holder.remaining_ttl_ms(ref(1)) == 9_000


def test_due_records_are_refreshed_in_one_batch() -> None:
    clock = ManualClock(0)
    index = FakeIndex()
    holder = make_holder(index=index, clock=clock)
    for n in (1, 2, 3):
        put(holder, n)
    clock.advance(TTL // 3)
    index.calls.clear()
    assert run(holder.refresh_due()) == 3
    assert index.batches == [3] and len(index.calls) == 3
    assert all(holder.remaining_ttl_ms(ref(n)) == TTL for n in (1, 2, 3))


def test_a_failed_publish_is_retried() -> None:
    clock = ManualClock(0)
    index = FakeIndex()
    holder = make_holder(index=index, clock=clock)
    index.fail = TransportError("IS down")
    put(holder, 1)  # stored all the same; the index is advisory
    assert holder.remaining_ttl_ms(ref(1)) == 0
    index.fail = None
    assert run(holder.refresh_due()) == 1 and ref(1) in index.records


def test_close_withdraws_every_record() -> None:
    index = FakeIndex()
    holder = make_holder(index=index)
    put(holder, 1)
    put(holder, 2)
    run(holder.close())
    assert index.records == {}
    assert sorted(c for c in index.calls if c[0] == "withdraw") == [
        ("withdraw", ref(1)),
        ("withdraw", ref(2)),
    ]


def test_no_url_no_publishing_until_it_is_known() -> None:
    index = FakeIndex()
    registry = DescriptorRegistry()
    registry.add(DESCRIPTOR)
    holder = Holder(HolderConfig(), index=index, descriptors=registry, clock=ManualClock(0))
    put(holder, 1)
    assert index.calls == []
    holder.set_public_url(URL.rstrip("/"))
    assert holder.public_url == URL
    assert run(holder.refresh_due()) == 1 and index.records[ref(1)].holder == URL


# -- eviction (§6.1, §6.6) ---------------------------------------------------------------------


def test_eviction_withdraws_before_evicting(monkeypatch: pytest.MonkeyPatch) -> None:
    index = FakeIndex()
    holder = make_holder(index=index, host=2 * SIZE)
    log: list[tuple[str, BlockRef]] = []
    evict = holder.store.evict
    index.on_withdraw = lambda r: log.append(("withdraw", r))

    def recording_evict(r: BlockRef) -> Any:
        log.append(("evict", r))
        return evict(r)

    monkeypatch.setattr(holder.store, "evict", recording_evict)
    put(holder, 1)
    put(holder, 2)
    get(holder, 1)  # 2 is now the least recently used
    put(holder, 3)
    assert log == [("withdraw", ref(2)), ("evict", ref(2))]
    assert index.held_at_withdraw == {ref(2): True}
    assert ref(2) not in holder.store and ref(2) not in index.records
    assert set(index.records) == {ref(1), ref(3)}


def test_leased_blocks_are_never_evicted() -> None:
    clock = ManualClock(0)
    index = FakeIndex()
    holder = make_holder(index=index, clock=clock, host=2 * SIZE)
    put(holder, 1)
    put(holder, 2)
    lease(holder, 1, ttl=1_000)
    put(holder, 3)  # evicts 2, the only unleased block
    assert ref(1) in holder.store and ref(2) not in holder.store
    with pytest.raises(LeaseQuota):  # all clients together: half the capacity
        lease(holder, 3, ttl=1_000, who=BOB)
    put(holder, 4)  # evicts 3: leases never pin the whole tier
    assert {ref(1), ref(4)} == {b.meta.ref for b in holder.store}
    assert set(index.records) == {ref(1), ref(4)}
    clock.advance(1_000)  # the lease ends; the block may go
    put(holder, 5)
    assert {ref(4), ref(5)} == {b.meta.ref for b in holder.store}


def test_a_lease_landing_during_the_withdrawal_stops_the_eviction() -> None:
    index = FakeIndex()
    holder = make_holder(index=index, host=2 * SIZE)
    put(holder, 1)
    put(holder, 2)
    index.on_withdraw = lambda r: (lease(holder, 1) if r == ref(1) else None, None)[1]
    put(holder, 3)  # 1 is leased while its record is withdrawn: 2 goes instead
    assert ref(1) in holder.store and ref(1) in index.records  # its record went back
    assert ref(2) not in holder.store and ref(2) not in index.records
    assert ref(3) in holder.store


def test_victims_are_demoted_to_disk_and_republished(tmp_path: Path) -> None:
    index = FakeIndex()
    holder = make_holder(index=index, state=tmp_path, host=SIZE, disk=4 * SIZE)
    put(holder, 1)
    put(holder, 2)
    assert holder.store.get(ref(1)).tier is Tier.DISK  # type: ignore[union-attr]
    residency = index.records[ref(1)].residency
    assert residency is not None and residency[0].tier is Tier.DISK
    assert residency[0].read_mbit_per_s == 16_000
    assert ("withdraw", ref(1)) not in index.calls
    assert get(holder, 1) == container(1)


def test_a_restart_withdraws_corrupt_disk_blocks(tmp_path: Path) -> None:
    index = FakeIndex()
    holder = make_holder(index=index, state=tmp_path, disk=4 * SIZE)
    put(holder, 1)
    put(holder, 2)
    path = tmp_path / "blocks" / COMPAT.hex() / SCOPE.hex() / f"{key(2).hex()}.kvb"
    path.write_bytes(path.read_bytes()[:-1] + b"\xff")
    index2 = FakeIndex()
    again = make_holder(index=index2, state=tmp_path, disk=4 * SIZE)

    async def restart() -> None:
        await again.start()
        await again.refresh_due()
        await again.close()

    run(restart())
    assert index2.calls[:2] == [("withdraw", ref(2)), ("publish", ref(1))]
    assert get(again, 1) == container(1)


# -- leases (§6.6) -----------------------------------------------------------------------------


def test_lease_grant_renew_release() -> None:
    clock = ManualClock(0)
    holder = make_holder(clock=clock)
    put(holder, 1)
    put(holder, 2)
    request = LeaseRequest(
        compat_id=COMPAT, scope_id=SCOPE, block_keys=(key(1), key(2)), ttl_ms=2_000
    )
    grant = holder.grant(ALICE, request)
    assert grant.ttl_ms == 2_000 and grant.block_keys == (key(1), key(2))
    assert holder.is_leased(ref(1)) and holder.is_leased(ref(2))
    renewed = holder.renew(ALICE, grant.lease, LeaseRenewal(ttl_ms=5_000))
    assert renewed.ttl_ms == 5_000 and set(renewed.block_keys or ()) == {key(1), key(2)}
    with pytest.raises(NotFound):
        holder.renew(BOB, grant.lease, LeaseRenewal(ttl_ms=5_000))  # not Bob's
    holder.release(ALICE, grant.lease)
    assert not holder.is_leased(ref(1))
    with pytest.raises(NotFound):
        holder.release(ALICE, grant.lease)


def test_leases_expire_on_the_clock() -> None:
    clock = ManualClock(0)
    holder = make_holder(clock=clock)
    put(holder, 1)
    lease_id = lease(holder, 1, ttl=1_000)
    clock.advance(999)
    assert holder.is_leased(ref(1))
    clock.advance(1)
    assert not holder.is_leased(ref(1))
    with pytest.raises(NotFound):
        holder.renew(ALICE, lease_id, LeaseRenewal(ttl_ms=1_000))


def test_lease_quota_is_per_client() -> None:
    quota = QuotaConfig(max_octets_per_client=2 * SIZE, max_ttl_ms=10_000, max_leases_per_client=8)
    holder = make_holder(quota=quota)
    for n in (1, 2, 3):
        put(holder, n)
    lease(holder, 1, 2)
    with pytest.raises(LeaseQuota) as exc:
        lease(holder, 3)
    assert exc.value.status == 429 and exc.value.problem == "kvsp-lease-quota"
    lease(holder, 3, who=BOB)  # Bob's quota is his own
    with pytest.raises(LeaseQuota):
        lease(holder, 3, ttl=10_001, who=BOB)


def test_leasing_a_block_not_held_is_not_found() -> None:
    holder = make_holder()
    put(holder, 1)
    with pytest.raises(NotFound) as exc:
        lease(holder, 1, 5)
    assert exc.value.path == "$.block_keys[1]"
    assert not holder.is_leased(ref(1))


# -- storing a block a client verified (put_block verified=, put_verified) ----------------------


def verified_of(
    decoded: Any,
    record: ReplicaRecord,
    *,
    layers: Sequence[Any] | None = None,
    producer: bool = True,
    body_digest: bytes | None = None,
) -> Any:
    """``decoded`` (with other ``layers``) as a client verified it against ``record``."""
    from kvsp.transfer.verify import VerifiedBlock

    return VerifiedBlock(
        version=decoded.version,
        flags=decoded.flags,
        codec=decoded.codec,
        first_layer=decoded.first_layer,
        layer_count=decoded.layer_count,
        token_count=decoded.token_count,
        layers=tuple(decoded.layers if layers is None else layers),
        record=record,
        source=URL,
        producer_verified=producer,
        body_digest=body_digest,
    )


def verified_block(n: int, *, producer: bool = True, seed: int | None = None) -> Any:
    """Block ``n`` as a client verified it against its producer's record (or, with ``seed``,
    a block of other octets claiming that record)."""
    record_source = make_holder()
    put(record_source, n)
    stored = record_source.store.get(ref(n))
    assert stored is not None
    record = record_source.record_of(stored)
    decoded = decode_container(container(n if seed is None else seed), GEOMETRY)
    return verified_of(decoded, record, producer=producer)


def test_a_verified_block_is_stored_with_the_digests_it_was_verified_against() -> None:
    holder = make_holder()
    verified = verified_block(1)
    stored = run(holder.put_verified(ALICE, COMPAT, SCOPE, key(1), verified, publish=False))
    again = run(holder.put_block(ALICE, COMPAT, SCOPE, key(2), container(1), verified=verified))
    hashed = make_holder()
    put(hashed, 1)
    reference = hashed.store.get(ref(1))
    assert reference is not None
    for meta in (stored.meta, again.meta):
        assert meta.layer_digests == reference.meta.layer_digests
        assert meta.digest == reference.meta.digest == verified.record.digest
        assert meta.repr_digest == hashlib.sha256(container(1)).digest()
    assert bytes(holder.store.read(stored)) == container(1)


def test_octets_that_are_not_the_verified_block_are_refused() -> None:
    holder = make_holder()
    verified = verified_block(1)
    with pytest.raises(DigestMismatch, match="not the verified block"):
        run(holder.put_block(ALICE, COMPAT, SCOPE, key(1), container(2), verified=verified))
    assert len(holder.store) == 0
    # the octets of the record's block, but not those of the block said to be verified
    forged = verified_block(1, seed=3)
    with pytest.raises(DigestMismatch):
        run(holder.put_block(ALICE, COMPAT, SCOPE, key(1), container(1), verified=forged))
    assert len(holder.store) == 0
    # another key's record lends no digests: the octets are hashed as any body
    stored = run(holder.put_block(ALICE, COMPAT, SCOPE, key(2), container(3), verified=verified))
    assert stored.meta.layer_digests == tuple(decode_container(container(3)).layer_digests())


def test_a_block_not_checked_against_its_producer_is_hashed() -> None:
    holder = make_holder()
    unchecked = verified_block(1, producer=False, seed=4)
    stored = run(holder.put_verified(ALICE, COMPAT, SCOPE, key(1), unchecked))
    assert stored.meta.layer_digests == tuple(decode_container(container(4)).layer_digests())


def test_a_received_container_is_kept_in_its_buffer_only_when_laid_out_as_encoded() -> None:
    from kvsp.engine.toy import toy_descriptor
    from kvsp.stores.blocks import IN_PLACE_FROM, container_octets

    descriptor = toy_descriptor(
        layers=8, kv_heads=8, head_dim=128, kv_dtype="fp16", block_tokens=16
    )
    geometry = Geometry.from_descriptor(descriptor)
    section = geometry.section_length(16)
    pairs = [(bytes([i]) * section, bytes([i, 1]) * (section // 2)) for i in range(8)]
    body = bytearray(encode_container(pairs, first_layer=0, token_count=16, geometry=geometry))
    assert len(body) >= IN_PLACE_FROM
    decoded = decode_container(memoryview(body), geometry)
    octets, in_place = container_octets(decoded)
    assert id(octets) == id(body) and in_place  # the received buffer itself, uncopied
    # the same octets, but the first two layers' views swapped: not the encoding's layout
    swapped = type(decoded)(
        version=decoded.version,
        flags=decoded.flags,
        codec=decoded.codec,
        first_layer=decoded.first_layer,
        layer_count=decoded.layer_count,
        token_count=decoded.token_count,
        layers=(
            replace(decoded.layers[0], k=decoded.layers[1].k, v=decoded.layers[1].v),
            replace(decoded.layers[1], k=decoded.layers[0].k, v=decoded.layers[0].v),
            *decoded.layers[2:],
        ),
    )
    octets, in_place = container_octets(swapped)
    assert id(octets) != id(body) and octets == swapped.encode() != bytes(body)
    assert not in_place


def big_body() -> tuple[CompatibilityDescriptor, np.ndarray]:
    """A container of at least IN_PLACE_FROM octets, received into a numpy buffer (as
    BlockClient's receive buffers are), and its descriptor."""
    from kvsp.engine.toy import toy_descriptor
    from kvsp.stores.blocks import IN_PLACE_FROM

    descriptor = toy_descriptor(
        layers=8, kv_heads=8, head_dim=128, kv_dtype="fp16", block_tokens=16
    )
    geometry = Geometry.from_descriptor(descriptor)
    section = geometry.section_length(16)
    pairs = [(bytes([i]) * section, bytes([i, 2]) * (section // 2)) for i in range(8)]
    encoded = encode_container(pairs, first_layer=0, token_count=16, geometry=geometry)
    assert len(encoded) >= IN_PLACE_FROM
    buffer = np.empty(len(encoded), dtype=np.uint8)
    buffer[:] = np.frombuffer(encoded, dtype=np.uint8)
    return descriptor, buffer


def big_holder(descriptor: CompatibilityDescriptor) -> Holder:
    registry = DescriptorRegistry()
    registry.add(descriptor)
    config = HolderConfig(
        public_url=URL,
        tiers={Tier.HOST: 16 << 20},
        record_ttl_ms=TTL,
        fsync=False,
    )
    return Holder(config, index=None, descriptors=registry, clock=ManualClock(0))


def test_a_container_received_into_a_numpy_buffer_is_taken_from_it_read_only() -> None:
    from kvsp.stores.blocks import container_octets

    descriptor, buffer = big_body()
    decoded = decode_container(buffer.data.cast("B"), Geometry.from_descriptor(descriptor))
    octets, in_place = container_octets(decoded)
    assert in_place and isinstance(octets, memoryview) and octets.readonly
    assert octets.obj is buffer and bytes(octets) == buffer.tobytes()  # no new encoding


def test_a_checked_http_body_kept_in_place_is_not_hashed_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """put_verified takes the Repr-Digest the client checked the body against when the octets
    it stores are that body; a block whose layers lie elsewhere is hashed as before."""
    import kvsp.stores.blocks as blocks
    from kvsp.compat import compat_id

    descriptor, buffer = big_body()
    compat = CompatId(compat_id(descriptor))
    decoded = decode_container(buffer.data.cast("B"), Geometry.from_descriptor(descriptor))
    body_digest = hashlib.sha256(buffer.tobytes()).digest()
    source = big_holder(descriptor)
    records = {
        n: source.record_of(run(source.put_block(ALICE, compat, SCOPE, key(n), buffer.tobytes())))
        for n in (1, 2)
    }
    hashed: list[int] = []  # octets given to SHA-256, call by call
    real = hashlib.sha256

    class Counting:
        def __init__(self, data: Any = b"") -> None:
            self._hash = real()
            self.update(data)

        def update(self, data: Any) -> None:
            hashed.append(memoryview(data).nbytes)
            self._hash.update(data)

        def digest(self) -> bytes:
            return self._hash.digest()

    monkeypatch.setattr(blocks.hashlib, "sha256", Counting)

    def verified(n: int, in_place: bool) -> Any:
        layers = decoded.layers
        if not in_place:
            layers = tuple(
                replace(layer, k=memoryview(bytes(layer.k)), v=memoryview(bytes(layer.v)))
                for layer in layers
            )
        return verified_of(decoded, records[n], layers=layers, body_digest=body_digest)

    holder = big_holder(descriptor)
    kept = run(holder.put_verified(ALICE, compat, SCOPE, key(1), verified(1, True)))
    assert kept.meta.repr_digest == body_digest
    assert sum(hashed) == 8 * 32  # the replica digest's input alone: the layer digests
    hashed.clear()
    copied = run(holder.put_verified(ALICE, compat, SCOPE, key(2), verified(2, False)))
    assert copied.meta.repr_digest == body_digest and buffer.nbytes in hashed
    assert bytes(holder.store.read(kept)) == bytes(holder.store.read(copied)) == buffer.tobytes()


def test_a_verified_block_in_place_in_a_bytearray_is_stored() -> None:
    """A received body in a bytearray (large, the layers in place) is stored from it, its
    Repr-Digest hashed (no body digest came with it)."""
    from kvsp.compat import compat_id

    descriptor, buffer = big_body()
    compat = CompatId(compat_id(descriptor))
    body = bytearray(buffer.tobytes())
    decoded = decode_container(memoryview(body), Geometry.from_descriptor(descriptor))
    source = big_holder(descriptor)
    record = source.record_of(run(source.put_block(ALICE, compat, SCOPE, key(1), bytes(body))))
    holder = big_holder(descriptor)
    kept = run(holder.put_verified(ALICE, compat, SCOPE, key(1), verified_of(decoded, record)))
    assert kept.meta.size == len(body)
    assert kept.meta.repr_digest == hashlib.sha256(body).digest()
    assert bytes(holder.store.read(kept)) == bytes(body)
