"""The holder's block store: tiers, budgets, LRU victims, leases, demotion, restart (§6.1, §6.6)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from kvsp.container import Geometry, decode_container, encode_container, replica_digest
from kvsp.errors import (
    BlockLeased,
    Conflict,
    ContainerError,
    InsufficientStorage,
    RecordError,
)
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.registries import Tier
from kvsp.stores.blocks import (
    BlockMeta,
    BlockRef,
    BlockStore,
    CudaBackend,
    StoreConfig,
    Victim,
    cuda_backend,
    describe_block,
)

GEOMETRY = Geometry(layers=4, kv_heads=1, head_dim=4, element_size=2)
TOKENS = 2
COMPAT = CompatId(bytes(range(32)))
SCOPE = ScopeId(bytes(range(16)))


def ref(n: int) -> BlockRef:
    return BlockRef(COMPAT, SCOPE, BlockKey(bytes([n]) * 32))


def container(seed: int, first: int = 0, count: int = 4) -> bytes:
    section = GEOMETRY.section_length(TOKENS)
    layers = [
        (
            bytes([seed, i, 0]) * (section // 3) + b"k" * (section % 3),
            bytes([seed, i, 1]) * 5 + b"v",
        )
        for i in range(first, first + count)
    ]
    return encode_container(layers, first_layer=first, token_count=TOKENS, geometry=GEOMETRY)


SIZE = len(container(0))


class Leases:
    """The leased set a test controls; stands in for the lease table's ``is_leased``."""

    def __init__(self) -> None:
        self.keys: set[BlockRef] = set()

    def __call__(self, r: BlockRef) -> bool:
        return r in self.keys


class HostCopies:
    """A device backend that keeps copies in host memory: exercises the device tier's path."""

    def __init__(self) -> None:
        self.uploads = 0

    def upload(self, data: memoryview) -> object:
        self.uploads += 1
        return bytearray(data)

    def download(self, handle: object) -> memoryview:
        assert isinstance(handle, bytearray)
        return memoryview(bytes(handle))


def make_store(
    tmp_path: Path | None = None, leases: Leases | None = None, **budgets: int
) -> BlockStore:
    tiers = {Tier(name): size for name, size in budgets.items()}
    root = None if tmp_path is None else tmp_path / "blocks"
    config = StoreConfig(budgets=tiers, disk_root=root, fsync=False)
    device = HostCopies() if Tier.DEVICE in tiers else None
    return BlockStore(config, is_leased=leases or Leases(), device=device)


def put(store: BlockStore, n: int, tier: Tier | None = None, data: bytes | None = None) -> None:
    data = container(n) if data is None else data
    meta = describe_block(ref(n), memoryview(data), GEOMETRY)
    store.admit(meta, memoryview(data), tier or store.tiers[0])


# -- metadata ----------------------------------------------------------------------------------


def test_describe_block_computes_the_digests_once() -> None:
    data = container(7)
    meta = describe_block(ref(7), memoryview(data), GEOMETRY)
    decoded = decode_container(data, GEOMETRY)
    assert meta.layer_digests == tuple(decoded.layer_digests())
    assert meta.digest == replica_digest(decoded.layer_digests())
    assert meta.repr_digest == hashlib.sha256(data).digest()
    assert meta.complete and meta.size == len(data) and meta.last_layer == 3


def test_a_layer_sub_range_is_not_complete() -> None:
    meta = describe_block(ref(1), memoryview(container(1, first=2, count=2)), GEOMETRY)
    assert (meta.first_layer, meta.last_layer, meta.complete) == (2, 3, False)
    assert len(meta.layer_digests) == 2


def test_describe_block_rejects_another_geometry() -> None:
    other = Geometry(layers=4, kv_heads=2, head_dim=4, element_size=2)
    with pytest.raises(ContainerError):
        describe_block(ref(1), memoryview(container(1)), other)


def test_sidecar_round_trip_and_inconsistent_digest() -> None:
    meta = describe_block(ref(3), memoryview(container(3)), GEOMETRY)
    assert BlockMeta.from_json(json.loads(json.dumps(meta.to_json()))) == meta
    bad = meta.to_json() | {"digest": "sha-256:" + "00" * 32}
    with pytest.raises(RecordError, match=r"\$\.digest"):
        BlockMeta.from_json(bad)


# -- budgets and LRU ---------------------------------------------------------------------------


def test_host_blocks_are_stored_uncopied() -> None:
    store = make_store(host=SIZE)
    data = container(1)
    meta = describe_block(ref(1), memoryview(data), GEOMETRY)
    block = store.admit(meta, memoryview(data), Tier.HOST)
    assert store.read(block).obj is data
    assert store.container(block).layer_count == 4


def test_lru_victims_are_least_recently_used_first() -> None:
    store = make_store(host=3 * SIZE)
    for n in (1, 2, 3):
        put(store, n)
    assert store.get(ref(1)) is not None  # touch: 1 becomes the most recent
    assert store.lru_order(Tier.HOST) == [ref(2), ref(3), ref(1)]
    assert store.plan_admission(SIZE, Tier.HOST) == [Victim(ref(2), Tier.HOST, SIZE, None)]
    assert [v.ref for v in store.plan_admission(2 * SIZE, Tier.HOST)] == [ref(2), ref(3)]


def test_get_without_touch_keeps_the_order() -> None:
    store = make_store(host=2 * SIZE)
    put(store, 1)
    put(store, 2)
    store.get(ref(1), touch=False)
    assert store.lru_order(Tier.HOST) == [ref(1), ref(2)]


def test_planning_changes_nothing_and_admit_needs_room() -> None:
    store = make_store(host=2 * SIZE)
    put(store, 1)
    put(store, 2)
    store.plan_admission(SIZE, Tier.HOST)
    assert len(store) == 2 and store.used(Tier.HOST) == 2 * SIZE
    with pytest.raises(InsufficientStorage):
        put(store, 3)
    store.evict(ref(1))
    put(store, 3)
    assert store.used(Tier.HOST) == 2 * SIZE and ref(1) not in store


def test_a_block_larger_than_the_tier_is_refused() -> None:
    store = make_store(host=SIZE - 1)
    with pytest.raises(InsufficientStorage, match="exceed its budget"):
        store.plan_admission(SIZE, Tier.HOST)
    with pytest.raises(InsufficientStorage):
        store.plan(SIZE)


def test_admitting_a_held_block_again_is_a_conflict() -> None:
    store = make_store(host=4 * SIZE)
    put(store, 1)
    with pytest.raises(Conflict):
        put(store, 1)


# -- leases (§6.6) -----------------------------------------------------------------------------


def test_leased_blocks_are_never_chosen() -> None:
    leases = Leases()
    store = make_store(leases=leases, host=3 * SIZE)
    for n in (1, 2, 3):
        put(store, n)
    leases.keys = {ref(1), ref(2)}
    assert [v.ref for v in store.plan_admission(SIZE, Tier.HOST)] == [ref(3)]
    leases.keys.add(ref(3))
    with pytest.raises(InsufficientStorage, match="only leased blocks remain"):
        store.plan_admission(SIZE, Tier.HOST)


def test_evict_refuses_a_leased_block() -> None:
    leases = Leases()
    store = make_store(leases=leases, host=SIZE)
    put(store, 1)
    leases.keys = {ref(1)}
    with pytest.raises(BlockLeased):
        store.evict(ref(1))
    assert ref(1) in store


# -- demotion ----------------------------------------------------------------------------------


def test_victims_are_demoted_when_the_next_tier_has_room(tmp_path: Path) -> None:
    store = make_store(tmp_path, host=2 * SIZE, disk=SIZE)
    for n in (1, 2):
        put(store, n)
    admission = store.plan(2 * SIZE)
    assert admission.tier is Tier.HOST
    assert admission.victims == (
        Victim(ref(1), Tier.HOST, SIZE, Tier.DISK),  # the disk tier has room for one
        Victim(ref(2), Tier.HOST, SIZE, None),
    )
    moved = store.demote(ref(1), Tier.DISK)
    assert moved.tier is Tier.DISK and store.used(Tier.HOST) == SIZE
    assert bytes(store.read(moved)) == container(1)
    assert (tmp_path / "blocks" / COMPAT.hex() / SCOPE.hex() / f"{'01' * 32}.kvb").exists()
    with pytest.raises(InsufficientStorage):
        store.demote(ref(2), Tier.DISK)


def test_a_full_fast_tier_of_leased_blocks_sends_new_blocks_down(tmp_path: Path) -> None:
    leases = Leases()
    store = make_store(tmp_path, leases, host=SIZE, disk=SIZE)
    put(store, 1)
    leases.keys = {ref(1)}
    admission = store.plan(SIZE)
    assert (admission.tier, admission.victims) == (Tier.DISK, ())


def test_device_tier_through_a_backend() -> None:
    store = make_store(device=SIZE, host=SIZE)
    put(store, 1)
    block = store.get(ref(1))
    assert block is not None and block.tier is Tier.DEVICE
    assert bytes(store.read(block)) == container(1)
    victims = store.plan_admission(SIZE, Tier.DEVICE)
    assert victims == [Victim(ref(1), Tier.DEVICE, SIZE, Tier.HOST)]
    assert store.demote(ref(1), Tier.HOST).tier is Tier.HOST


def test_the_device_tier_needs_a_backend() -> None:
    with pytest.raises(ValueError, match="device backend"):
        BlockStore(StoreConfig(budgets={Tier.DEVICE: 1}), is_leased=Leases())


def test_cuda_backend_only_with_cuda() -> None:
    torch = pytest.importorskip("torch")
    backend = cuda_backend()
    assert (backend is not None) == torch.cuda.is_available()
    # The same code on the CPU device: a copy in, a copy out.
    cpu = CudaBackend("cpu")
    data = container(1)
    handle = cpu.upload(memoryview(data))
    assert isinstance(handle, torch.Tensor) and handle.dtype == torch.uint8
    assert bytes(cpu.download(handle)) == data
    with pytest.raises(TypeError):
        cpu.download(b"not a tensor")


# -- restart (disk tier) -----------------------------------------------------------------------


def test_disk_blocks_survive_a_restart(tmp_path: Path) -> None:
    store = make_store(tmp_path, disk=4 * SIZE)
    put(store, 1)
    put(store, 2, data=container(2, first=1, count=3))
    before = {b.meta.ref: b.meta for b in store}
    again = make_store(tmp_path, disk=4 * SIZE)
    assert again.open() == []
    assert {b.meta.ref: b.meta for b in again} == before
    assert again.used(Tier.DISK) == store.used(Tier.DISK)
    block = again.get(ref(2))
    assert block is not None and bytes(again.read(block)) == container(2, first=1, count=3)


def _data_path(tmp_path: Path, n: int) -> Path:
    return tmp_path / "blocks" / COMPAT.hex() / SCOPE.hex() / f"{bytes([n]).hex() * 32}.kvb"


def test_a_corrupt_disk_block_is_dropped_and_reported(tmp_path: Path) -> None:
    store = make_store(tmp_path, disk=4 * SIZE)
    for n in (1, 2, 3):
        put(store, n)
    corrupt = bytearray(_data_path(tmp_path, 2).read_bytes())
    corrupt[-1] ^= 0xFF  # last V octet of the last layer
    _data_path(tmp_path, 2).write_bytes(bytes(corrupt))
    _data_path(tmp_path, 3).with_suffix(".json").unlink()  # an interrupted write
    again = make_store(tmp_path, disk=4 * SIZE)
    dropped = {d.ref: d.reason for d in again.open()}
    assert set(dropped) == {ref(2), ref(3)}
    assert "layer 3" in dropped[ref(2)] and "sidecar" in dropped[ref(3)]
    assert [b.meta.ref for b in again] == [ref(1)]
    assert not _data_path(tmp_path, 2).exists() and not _data_path(tmp_path, 3).exists()
    assert not _data_path(tmp_path, 2).with_suffix(".json").exists()


def test_restart_drops_leftovers_and_what_no_longer_fits(tmp_path: Path) -> None:
    store = make_store(tmp_path, disk=4 * SIZE)
    put(store, 1)
    put(store, 2)
    folder = _data_path(tmp_path, 1).parent
    (folder / ".x.kvb.1234.tmp").write_bytes(b"partial")
    (folder / "not-a-key.kvb").write_bytes(b"stranger")
    sidecar = _data_path(tmp_path, 2).with_suffix(".json")
    sidecar.write_text(sidecar.read_text().replace('"codec":1', '"codec":"raw"'))
    again = make_store(tmp_path, disk=SIZE)
    dropped = again.open()
    assert [d.ref for d in dropped] == [ref(2)] and "codec" in dropped[0].reason
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [_data_path(tmp_path, 1).name, _data_path(tmp_path, 1).with_suffix(".json").name]
    )


def test_restart_over_a_smaller_budget_keeps_the_newest_fitting(tmp_path: Path) -> None:
    store = make_store(tmp_path, disk=4 * SIZE)
    put(store, 1)
    put(store, 2)
    again = make_store(tmp_path, disk=SIZE)
    dropped = again.open()
    assert len(dropped) == 1 and dropped[0].reason == "over the disk budget"
    assert len(again) == 1


def test_open_after_admitting_counts_nothing_twice(tmp_path: Path) -> None:
    store = make_store(tmp_path, disk=4 * SIZE)
    put(store, 1)
    assert store.open() == []
    assert len(store) == 1 and store.used(Tier.DISK) == SIZE
