"""Storage faults found when a disk-tier block is read (§6.1, §6.6, §6.7): each kind is a
:class:`BlockFault` (a miss), reported to the store's listener, and the block is dropped."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvsp.container import Geometry, encode_container
from kvsp.errors import NotFound
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.registries import Tier
from kvsp.stores.blocks import (
    BlockFault,
    BlockRef,
    BlockStore,
    StoreConfig,
    StoredBlock,
    describe_block,
)

GEOMETRY = Geometry(layers=4, kv_heads=1, head_dim=4, element_size=2)
COMPAT = CompatId(bytes(range(32)))
SCOPE = ScopeId(bytes(range(16)))


def ref(n: int) -> BlockRef:
    return BlockRef(COMPAT, SCOPE, BlockKey(bytes([n]) * 32))


def container(seed: int) -> bytes:
    section = GEOMETRY.section_length(2)
    layers = [
        (bytes([seed, i]) * (section // 2), bytes([i, seed]) * (section // 2)) for i in range(4)
    ]
    return encode_container(layers, first_layer=0, token_count=2, geometry=GEOMETRY)


SIZE = len(container(0))


def make_store(
    tmp_path: Path, on_fault: Callable[[StoredBlock, str], None] | None = None
) -> BlockStore:
    config = StoreConfig(budgets={Tier.DISK: 8 * SIZE}, disk_root=tmp_path / "blocks", fsync=False)
    return BlockStore(config, is_leased=lambda _: True, on_fault=on_fault)


def put(store: BlockStore, n: int) -> StoredBlock:
    data = memoryview(container(n))
    return store.admit(describe_block(ref(n), data, GEOMETRY), data, Tier.DISK)


def data_path(tmp_path: Path, n: int, suffix: str = ".kvb") -> Path:
    return tmp_path / "blocks" / COMPAT.hex() / SCOPE.hex() / f"{bytes([n]).hex() * 32}{suffix}"


def longer(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b"\x00")


def flipped(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


DAMAGE: list[tuple[str, Callable[[Path], object]]] = [
    ("missing", Path.unlink),
    ("empty", lambda p: p.write_bytes(b"")),
    ("truncated", lambda p: p.write_bytes(p.read_bytes()[:-1])),
    ("corrupt", flipped),
    ("corrupt", longer),
    ("unreadable", lambda p: (p.unlink(), p.mkdir())),
]


@pytest.mark.parametrize(("kind", "damage"), DAMAGE)
def test_a_faulty_file_is_a_miss_and_is_dropped_leased_or_not(
    tmp_path: Path, kind: str, damage: Callable[[Path], object]
) -> None:
    store = make_store(tmp_path)  # no listener: dropped at once; every block is leased
    block = put(store, 1)
    damage(data_path(tmp_path, 1))
    with pytest.raises(BlockFault) as fault:
        store.read_checked(block)
    assert isinstance(fault.value, NotFound) and fault.value.kind == kind
    assert fault.value.ref == ref(1) and ref(1) not in store
    assert store.used(Tier.DISK) == 0
    assert not data_path(tmp_path, 1, ".json").exists()
    assert not data_path(tmp_path, 1).is_file()


def test_the_listener_decides_when_the_block_goes(tmp_path: Path) -> None:
    heard: list[tuple[StoredBlock, str]] = []
    store = make_store(tmp_path, lambda block, kind: heard.append((block, kind)))
    block = put(store, 1)
    data_path(tmp_path, 1).write_bytes(b"")
    with pytest.raises(BlockFault):
        store.container(block)  # the MOQT path's read
    assert heard == [(block, "empty")] and ref(1) in store  # still held until dropped
    assert store.drop(block) and ref(1) not in store
    assert not store.drop(block)  # once


def test_drop_leaves_a_block_stored_again_under_the_key(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    old = put(store, 1)
    assert store.drop(old)
    new = put(store, 1)
    assert not store.drop(old)
    assert store.get(ref(1)) is new and data_path(tmp_path, 1).exists()
    assert bytes(store.read_checked(new)) == container(1)
