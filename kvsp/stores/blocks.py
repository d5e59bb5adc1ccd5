"""A holder's block store in tiers (spec §6.1 withdraw before evicting, §6.6 never evict a leased
replica, §6.7 blocks stored whole; DESIGN.md §1 "Holder", §3 tiers).

Each block is kept whole as its KVB1 container octets (possibly a layer sub-range,
``first_layer > 0``), together with its :class:`BlockMeta`: layer digests, replica digest and the
full container's Repr-Digest, all computed once when it is stored. Tiers:

* ``device``: CUDA tensors through a :class:`DeviceBackend` (torch is imported only when the
  backend is made, and only if ``torch.cuda.is_available()``);
* ``host``: bytes in memory;
* ``disk``: ``ROOT/<compat>/<scope>/<key>.kvb`` written atomically, beside a JSON sidecar
  ``<key>.json`` with the :class:`BlockMeta`; re-read and re-verified by :meth:`BlockStore.open`.

Eviction is least-recently-used per tier, and the store never evicts by itself: the holder asks
:meth:`BlockStore.plan_admission` what must go, withdraws those Replica Records from the Index
Service *first* (§6.1), and only then calls :meth:`BlockStore.evict` and :meth:`BlockStore.admit`.
A victim goes down one tier (device → host → disk) instead when that tier has room; its record's
residency changes, so the holder re-publishes it. A block covered by a lease is never chosen,
and :meth:`BlockStore.evict` refuses it (§6.6 MUST). The store is synchronous; its index is
guarded by a lock so that readers on the event loop can run while a writer thread stores octets.

Storage faults: :meth:`BlockStore.read_checked` reads a disk-tier block into memory and checks
its length and Repr-Digest before anything is sent, because a response's ``Content-Length`` and
``Repr-Digest`` leave before its body: a fault found while streaming could only reset the
connection. A file that is missing, empty, truncated, of another length or another digest is
a :class:`BlockFault` (a miss, 404), reported to the store's ``on_fault`` (the holder withdraws
its record, then :meth:`BlockStore.drop` deletes it) or, without one, dropped at once.
Reading into memory rather than mapping the file also means a file truncated while it is sent
cannot fault the process.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import secrets
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np

from kvsp.container import (
    Container,
    Geometry,
    decode_container,
    layer_digest,
    replica_digest,
)
from kvsp.errors import (
    BlockLeased,
    Conflict,
    DigestMismatch,
    Incompatible,
    InsufficientStorage,
    KVSPError,
    NotFound,
    RecordError,
)
from kvsp.fields import Fields
from kvsp.ids import BlockKey, CompatId, ScopeId, format_digest, parse_hex16, parse_hex32
from kvsp.records_common import hex_list, read_hex32_list
from kvsp.registries import Tier

TIER_ORDER: tuple[Tier, ...] = (Tier.DEVICE, Tier.HOST, Tier.DISK)
"""Fastest first: new blocks go to the first configured tier that can take them, and victims
are demoted to the next one."""
DATA_SUFFIX = ".kvb"
SIDECAR_SUFFIX = ".json"
FAULT_KINDS = ("missing", "empty", "truncated", "corrupt", "unreadable")
"""What can be wrong with a stored block's file when it is read: gone, zero octets, fewer
octets than stored, other octets (another length or digest), or an I/O error."""


class BlockRef(NamedTuple):
    """Names one block resource: ``blocks/{compat}/{scope}/{key}`` (§6.7)."""

    compat: CompatId
    scope: ScopeId
    key: BlockKey

    @property
    def packed(self) -> bytes:
        """The 80 octets compat ‖ scope ‖ key: the block's identity in a lease table."""
        return self.compat + self.scope + self.key

    def __str__(self) -> str:
        return f"{self.compat.hex()}/{self.scope.hex()}/{self.key.hex()}"


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockMeta:
    """What a holder knows of a stored block besides its octets, computed once on storage.

    ``layer_digests`` covers the held layers only. ``digest`` is the SHA-256 of those digests:
    the replica digest (§4.3) when the block is :attr:`complete`.
    """

    ref: BlockRef
    codec: int
    first_layer: int
    layer_count: int
    token_count: int
    total_layers: int
    """The descriptor's ``layers``: tells whether the container holds every layer."""
    size: int
    layer_digests: tuple[bytes, ...]
    digest: bytes
    repr_digest: bytes
    """SHA-256 of the whole stored container: its Repr-Digest (§6.7, RFC 9530)."""

    @property
    def last_layer(self) -> int:
        """The last layer held (inclusive)."""
        return self.first_layer + self.layer_count - 1

    @property
    def complete(self) -> bool:
        """Whether the container holds every layer of the block."""
        return self.first_layer == 0 and self.layer_count == self.total_layers

    def to_json(self) -> dict[str, Any]:
        """The sidecar form."""
        return {
            "compat_id": self.ref.compat.hex(),
            "scope_id": self.ref.scope.hex(),
            "block_key": self.ref.key.hex(),
            "codec": self.codec,
            "first_layer": self.first_layer,
            "layer_count": self.layer_count,
            "token_count": self.token_count,
            "total_layers": self.total_layers,
            "size": self.size,
            "layer_digests": hex_list(self.layer_digests),
            "digest": format_digest(self.digest),
            "repr_digest": format_digest(self.repr_digest),
        }

    @classmethod
    def from_json(cls, obj: object, path: str = "$") -> BlockMeta:
        """Read a sidecar.

        Raises:
            RecordError: a member is missing or malformed, or the digests disagree.
        """
        f = Fields(obj, path)
        meta = cls(
            ref=BlockRef(
                CompatId(f.hex32("compat_id")),
                ScopeId(f.hex16("scope_id")),
                BlockKey(f.hex32("block_key")),
            ),
            codec=f.integer("codec", maximum=0xFFFF),
            first_layer=f.integer("first_layer"),
            layer_count=f.integer("layer_count", minimum=1),
            token_count=f.integer("token_count", minimum=1),
            total_layers=f.integer("total_layers", minimum=1),
            size=f.integer("size", minimum=1),
            layer_digests=read_hex32_list(f.raw("layer_digests"), f.at("layer_digests")),
            digest=f.digest("digest"),
            repr_digest=f.digest("repr_digest"),
        )
        if len(meta.layer_digests) != meta.layer_count:
            raise RecordError("one digest per held layer", path=f.at("layer_digests"))
        if replica_digest(meta.layer_digests) != meta.digest:
            raise RecordError("layer digests do not hash to the digest", path=f.at("digest"))
        return meta


def describe_block(
    ref: BlockRef, data: memoryview, geometry: Geometry, repr_digest: bytes | None = None
) -> BlockMeta:
    """Decode a container against the descriptor's geometry and compute its digests (§4.3).

    Hashes every octet twice (layer digests and Repr-Digest, unless ``repr_digest`` is given:
    a caller can compute it in parallel); hashlib releases the GIL, so a caller may run this in
    a worker thread.

    Raises:
        ContainerError: the octets are not a container of this geometry (§4.3).
        ContainerTooLarge: the container declares more than the decoder's limits.
    """
    container = decode_container(data, geometry)
    digests = tuple(container.layer_digests())
    return BlockMeta(
        ref=ref,
        codec=container.codec,
        first_layer=container.first_layer,
        layer_count=container.layer_count,
        token_count=container.token_count,
        total_layers=geometry.layers,
        size=data.nbytes,
        layer_digests=digests,
        digest=replica_digest(digests),
        repr_digest=hashlib.sha256(data).digest() if repr_digest is None else repr_digest,
    )


def describe_verified(
    ref: BlockRef,
    data: memoryview,
    geometry: Geometry,
    verified: Container,
    layer_digests: Sequence[bytes],
) -> BlockMeta:
    """:func:`describe_block` for a container whose layers were verified already (§6.7):
    ``verified``, whose layers hashed to ``layer_digests``, must encode to exactly ``data``.
    That is checked by comparing the octets, which costs a fraction of hashing them again;
    only the Repr-Digest is computed.

    Raises:
        ContainerError: the octets are not a container of this geometry (§4.3).
        DigestMismatch: ``data`` is not ``verified``'s encoding, or ``layer_digests`` does not
            have one digest per layer.
    """
    container = decode_container(data, geometry)
    if len(layer_digests) != container.layer_count:
        raise DigestMismatch("one layer digest per verified layer expected")
    expected = verified.encode()
    same = len(expected) == data.nbytes and np.array_equal(
        np.frombuffer(expected, np.uint8), np.frombuffer(data, np.uint8)
    )
    if not same:
        raise DigestMismatch("the stored octets are not the verified block's")
    return verified_meta(ref, data, container, geometry, layer_digests)


IN_PLACE_FROM = 256 * 1024
"""Containers at least this large are kept in the buffer their layers lie in when they can
be (:func:`container_octets`); smaller ones are encoded anew, which costs less than checking."""


def container_octets(container: Container) -> tuple[bytes | memoryview, bool]:
    """The container's encoding (§4.3), and whether it is the buffer the layers lie in: without
    a copy when the layers are views of one buffer holding exactly that encoding, each at its
    place (a received body): that buffer (a ``bytes`` or ``bytearray`` itself, any other
    exporter as a read-only view); else a new encoding.

    Whether each K and V view lies at its encoded offset is checked by address, so a buffer
    whose layers are arranged otherwise is never mistaken for the encoding.
    """
    layers = container.layers
    owner = layers[0].k.obj if layers else None
    if owner is None:
        return container.encode(), False
    try:
        body = memoryview(owner)  # any buffer exporter
    except TypeError:
        return container.encode(), False
    if body.nbytes < IN_PLACE_FROM or not body.c_contiguous:
        return container.encode(), False
    body = body.cast("B") if body.format != "B" or body.ndim != 1 else body
    header = container.header_bytes
    offset = len(header)
    size = offset + sum(layer.k.nbytes + layer.v.nbytes for layer in layers)
    if body.nbytes != size or body[:offset] != header:
        return container.encode(), False
    base = _address(body)
    for layer in layers:
        for view in (layer.k, layer.v):
            if view.obj is not owner or _address(view) != base + offset:
                return container.encode(), False
            offset += view.nbytes
    if isinstance(owner, bytes | bytearray):
        return owner, True  # type: ignore[return-value]  # a bytearray: accepted as bytes is
    return body.toreadonly(), True


def _address(view: memoryview) -> int:
    address: int = np.frombuffer(view, np.uint8).ctypes.data
    return address


def verified_meta(
    ref: BlockRef,
    data: bytes | memoryview,
    verified: Container,
    geometry: Geometry,
    layer_digests: Sequence[bytes],
    repr_digest: bytes | None = None,
) -> BlockMeta:
    """The :class:`BlockMeta` of ``data``, the caller's own encoding of ``verified`` (whose
    layers hashed to ``layer_digests``): nothing is decoded or hashed but the Repr-Digest, and
    not that when the caller knows it (``repr_digest``: ``data`` is a body checked against it).

    Raises:
        DigestMismatch: ``layer_digests`` does not have one digest per layer.
    """
    if len(layer_digests) != verified.layer_count:
        raise DigestMismatch("one layer digest per verified layer expected")
    digests = tuple(layer_digests)
    return BlockMeta(
        ref=ref,
        codec=verified.codec,
        first_layer=verified.first_layer,
        layer_count=verified.layer_count,
        token_count=verified.token_count,
        total_layers=geometry.layers,
        size=data.nbytes if isinstance(data, memoryview) else len(data),
        layer_digests=digests,
        digest=replica_digest(digests),
        repr_digest=hashlib.sha256(data).digest() if repr_digest is None else repr_digest,
    )


@dataclass(frozen=True, slots=True)
class Victim:
    """A block that must leave its tier to make room: demoted to ``to``, or evicted (``None``).

    The holder withdraws an evicted victim's Replica Record before calling
    :meth:`BlockStore.evict` (§6.1), and re-publishes a demoted one with its new residency.
    """

    ref: BlockRef
    tier: Tier
    size: int
    to: Tier | None


@dataclass(frozen=True, slots=True)
class Admission:
    """Where a new block goes and what must leave first."""

    tier: Tier
    victims: tuple[Victim, ...]


@dataclass(frozen=True, slots=True)
class Dropped:
    """A block found unusable when the disk tier was re-read; its record must be withdrawn."""

    ref: BlockRef
    reason: str


class BlockFault(NotFound):
    """A stored block whose octets could not be read back as stored (one of
    :data:`FAULT_KINDS`): to a client, a miss (404 ``kvsp-not-found``, §6.1)."""

    def __init__(self, ref: BlockRef, kind: str) -> None:
        super().__init__("this holder does not hold the block")
        self.ref = ref
        self.kind = kind


@dataclass(slots=True, eq=False)
class StoredBlock:
    """A block in the store: its metadata, its tier, and the tier's handle on its octets."""

    meta: BlockMeta
    tier: Tier
    payload: object


class DeviceBackend(Protocol):
    """Moves container octets to accelerator memory and back (the ``device`` tier)."""

    def upload(self, data: memoryview) -> object:
        """Copy ``data`` to the device; returns a handle."""

    def download(self, handle: object) -> memoryview:
        """Copy a stored block back to host memory."""


class CudaBackend:
    """The ``device`` tier on a CUDA device, as ``torch.uint8`` tensors."""

    def __init__(self, device: str = "cuda") -> None:
        import torch  # deferred: torch is an optional extra and slow to import

        self._torch = torch
        self.device = torch.device(device)

    def upload(self, data: memoryview) -> object:
        """Copy ``data`` into a new device tensor."""
        with warnings.catch_warnings():
            # torch warns that the buffer is read-only; the view is only read, by the copy.
            warnings.simplefilter("ignore", UserWarning)
            host = self._torch.frombuffer(data, dtype=self._torch.uint8)
        return host.to(self.device, copy=True)

    def download(self, handle: object) -> memoryview:
        """Copy a device tensor back into host memory."""
        if not isinstance(handle, self._torch.Tensor):
            raise TypeError("not a device block handle")
        return handle.cpu().numpy().data.cast("B")


def cuda_backend() -> DeviceBackend | None:
    """A :class:`CudaBackend` when torch imports and CUDA is available, else ``None``."""
    try:
        import torch
    except ImportError:
        return None
    return CudaBackend() if torch.cuda.is_available() else None


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreConfig:
    """Byte budgets per tier (absent = not used) and the disk tier's folder.

    Raises:
        ValueError: a negative budget, a disk tier without ``disk_root``.
    """

    budgets: Mapping[Tier, int]
    disk_root: Path | None = None
    fsync: bool = True

    def __post_init__(self) -> None:
        for tier, budget in self.budgets.items():
            if not isinstance(budget, int) or budget < 0:
                raise ValueError(f"tier {tier}: budget must be a non-negative integer")
        if Tier.DISK in self.budgets and self.disk_root is None:
            raise ValueError("the disk tier needs a folder")


class _TierState:
    __slots__ = ("budget", "lru", "name", "used")

    def __init__(self, name: Tier, budget: int) -> None:
        self.name = name
        self.budget = budget
        self.used = 0
        self.lru: OrderedDict[BlockRef, StoredBlock] = OrderedDict()  # oldest first

    @property
    def free(self) -> int:
        return self.budget - self.used


class BlockStore:
    """Blocks in tiers with per-tier byte budgets and LRU victims that skip leased blocks.

    ``is_leased(ref)`` answers whether an unexpired lease covers a block (§6.6).
    ``on_fault(block, kind)`` hears of each storage fault :meth:`read_checked` finds, from the
    reading thread; the block stays until the listener calls :meth:`drop` (without a listener
    it is dropped at once).
    """

    def __init__(
        self,
        config: StoreConfig,
        *,
        is_leased: Callable[[BlockRef], bool],
        device: DeviceBackend | None = None,
        on_fault: Callable[[StoredBlock, str], None] | None = None,
    ) -> None:
        if Tier.DEVICE in config.budgets and device is None:
            raise ValueError("the device tier needs a device backend (CUDA)")
        self.config = config
        self.on_fault = on_fault
        self._is_leased = is_leased
        self._device = device
        self._tiers = {
            t: _TierState(t, config.budgets[t]) for t in TIER_ORDER if t in config.budgets
        }
        self._blocks: dict[BlockRef, StoredBlock] = {}
        self._lock = threading.Lock()

    # -- reading -------------------------------------------------------------------------------

    def __contains__(self, ref: object) -> bool:
        return ref in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self) -> Iterator[StoredBlock]:
        with self._lock:
            return iter(list(self._blocks.values()))

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The configured tiers, fastest first."""
        return tuple(self._tiers)

    def used(self, tier: Tier) -> int:
        """Octets stored in ``tier``."""
        return self._tiers[tier].used

    def budget(self, tier: Tier) -> int:
        """The byte budget of ``tier``."""
        return self._tiers[tier].budget

    def lru_order(self, tier: Tier) -> list[BlockRef]:
        """The blocks of ``tier``, least recently used first."""
        with self._lock:
            return list(self._tiers[tier].lru)

    def get(self, ref: BlockRef, *, touch: bool = True) -> StoredBlock | None:
        """The stored block, marked most recently used unless ``touch`` is false."""
        with self._lock:
            block = self._blocks.get(ref)
            if block is not None and touch:
                self._tiers[block.tier].lru.move_to_end(ref)
            return block

    def read(self, block: StoredBlock) -> memoryview:
        """The container octets of ``block``: a view of host memory or of the mapped file, or a
        host copy of a device tensor."""
        return self._read_payload(block.tier, block.payload)

    def read_checked(self, block: StoredBlock) -> memoryview:
        """:meth:`read`, with a disk-tier block read into memory and checked against its
        stored length and Repr-Digest (one SHA-256 pass: a caller may run this in a worker
        thread). Memory tiers are returned as they are.

        Raises:
            BlockFault: the file is missing, empty, truncated or differs (reported to
                ``on_fault`` first).
        """
        if block.tier is not Tier.DISK or not isinstance(block.payload, Path):
            return self.read(block)
        data, kind = _load_file(block.payload, block.meta)
        if kind is None:
            return memoryview(data)
        if self.on_fault is not None:
            self.on_fault(block, kind)
        else:
            self.drop(block)
        raise BlockFault(block.meta.ref, kind)

    def container(self, block: StoredBlock) -> Container:
        """The stored container, decoded over :meth:`read_checked`'s octets without copying.

        Raises:
            BlockFault: as :meth:`read_checked`.
        """
        return decode_container(self.read_checked(block))

    # -- making room ---------------------------------------------------------------------------

    def plan(self, size: int) -> Admission:
        """Where a block of ``size`` octets goes: the fastest tier that can take it.

        Raises:
            InsufficientStorage: no tier can, because it is too small or only leased blocks
                could make room.
        """
        reasons = []
        for tier in self._tiers:
            try:
                return Admission(tier, tuple(self.plan_admission(size, tier)))
            except InsufficientStorage as exc:
                reasons.append(exc.detail)
        if not reasons:
            raise InsufficientStorage("this holder has no storage tier")
        raise InsufficientStorage("; ".join(reasons))

    def plan_admission(self, size: int, tier: Tier) -> list[Victim]:
        """The least recently used unleased blocks of ``tier`` that must leave so that ``size``
        octets fit, each demoted to the next tier when that has room, else evicted.

        Nothing is changed: the caller withdraws the records of evicted victims (§6.1), then
        calls :meth:`evict`/:meth:`demote` for each and :meth:`admit` for the new block.

        Raises:
            InsufficientStorage: the tier is smaller than ``size``, or unleased blocks do not
                free enough (§6.6: leased blocks are never chosen).
        """
        with self._lock:
            state = self._tiers.get(tier)
            if state is None:
                raise InsufficientStorage(f"no {tier} tier")
            if size > state.budget:
                raise InsufficientStorage(f"{tier}: {size} octets exceed its budget")
            return self._choose_victims(state, state.used + size - state.budget)

    def _choose_victims(self, state: _TierState, need: int) -> list[Victim]:
        lower = self._lower(state.name)
        room = lower.free if lower is not None else 0
        victims: list[Victim] = []
        for ref, block in state.lru.items():
            if need <= 0:
                break
            if self._is_leased(ref):  # §6.6: MUST NOT evict a leased replica
                continue
            size = block.meta.size
            to = None
            if lower is not None and size <= room:
                to, room = lower.name, room - size
            victims.append(Victim(ref, state.name, size, to))
            need -= size
        if need > 0:
            raise InsufficientStorage(
                f"{state.name}: {need} more octets are needed and only leased blocks remain"
            )
        return victims

    def _lower(self, tier: Tier) -> _TierState | None:
        names = list(self._tiers)
        i = names.index(tier)
        return self._tiers[names[i + 1]] if i + 1 < len(names) else None

    def evict(self, ref: BlockRef) -> StoredBlock:
        """Remove a block. Withdraw its Replica Record first (§6.1).

        Raises:
            KeyError: the block is not held.
            BlockLeased: a lease covers it (§6.6).
        """
        if self._is_leased(ref):
            raise BlockLeased(f"block {ref} is leased and cannot be evicted")
        with self._lock:
            block = self._blocks[ref]
            self._unlink(block)
        self._release(block)
        return block

    def drop(self, block: StoredBlock) -> bool:
        """Remove a faulty block and delete its files, leased or not (its octets are lost);
        withdraw its Replica Record first (§6.6). False when ``block`` is no longer the one
        held under its key (dropped or replaced meanwhile), which is left alone."""
        with self._lock:
            if self._blocks.get(block.meta.ref) is not block:
                return False
            self._unlink(block)
        if isinstance(block.payload, Path):
            for path in (block.payload, block.payload.with_suffix(SIDECAR_SUFFIX)):
                with contextlib.suppress(OSError):  # one that cannot be deleted stays unused
                    path.unlink(missing_ok=True)
        return True

    def demote(self, ref: BlockRef, to: Tier) -> StoredBlock:
        """Move a block to the slower tier ``to``; the caller re-publishes its record.

        Raises:
            KeyError: the block is not held.
            InsufficientStorage: ``to`` has no room for it.
        """
        old = self._blocks[ref]
        target = self._tiers[to]
        if old.meta.size > target.free:
            raise InsufficientStorage(f"{to}: no room to demote {ref}")
        payload = self._write_payload(to, old.meta, self.read(old))
        moved = StoredBlock(old.meta, to, payload)
        with self._lock:
            self._unlink(old)
            self._link(moved)
        self._release(old)
        return moved

    def admit(self, meta: BlockMeta, data: memoryview, tier: Tier) -> StoredBlock:
        """Store a new block in ``tier`` (after the planned victims have gone).

        Raises:
            Incompatible: ``data`` differs in size from ``meta``.
            Conflict: the block is already held.
            InsufficientStorage: ``tier`` has no room (the victims were not removed).
        """
        if data.nbytes != meta.size:
            raise Incompatible(f"{data.nbytes} octets for a block of {meta.size}")
        if meta.ref in self._blocks:
            raise Conflict(f"block {meta.ref} is already held")
        if meta.size > self._tiers[tier].free:
            raise InsufficientStorage(f"{tier}: no room for {meta.size} octets")
        block = StoredBlock(meta, tier, self._write_payload(tier, meta, data))
        with self._lock:
            self._link(block)
        return block

    def _link(self, block: StoredBlock) -> None:
        self._blocks[block.meta.ref] = block
        state = self._tiers[block.tier]
        state.lru[block.meta.ref] = block
        state.used += block.meta.size

    def _unlink(self, block: StoredBlock) -> None:
        del self._blocks[block.meta.ref]
        state = self._tiers[block.tier]
        del state.lru[block.meta.ref]
        state.used -= block.meta.size

    # -- tiers ---------------------------------------------------------------------------------

    def _write_payload(self, tier: Tier, meta: BlockMeta, data: memoryview) -> object:
        if tier is Tier.HOST:
            obj = data.obj
            # Keep an immutable exporter as it is: the request body's bytes, stored uncopied.
            if isinstance(obj, bytes) and data.nbytes == len(obj) and data.c_contiguous:
                return obj
            return data.tobytes()
        if tier is Tier.DISK:
            return self._write_files(meta, data)
        if self._device is None:
            raise InsufficientStorage("no device backend")
        return self._device.upload(data)

    def _read_payload(self, tier: Tier, payload: object) -> memoryview:
        if tier is Tier.HOST and isinstance(payload, bytes):
            return memoryview(payload)
        if tier is Tier.DISK and isinstance(payload, Path):
            return _map_file(payload)
        if tier is Tier.DEVICE and self._device is not None:
            return self._device.download(payload)
        raise TypeError(f"bad payload for tier {tier}")

    def _release(self, block: StoredBlock) -> None:
        # A view already handed to a reader stays valid: host bytes are reference counted,
        # and a mapped file outlives its unlinking.
        if block.tier is Tier.DISK and isinstance(block.payload, Path):
            block.payload.unlink(missing_ok=True)
            block.payload.with_suffix(SIDECAR_SUFFIX).unlink(missing_ok=True)

    def _block_path(self, ref: BlockRef) -> Path:
        if self.config.disk_root is None:
            raise InsufficientStorage("no disk tier")
        return self.config.disk_root / ref.compat.hex() / ref.scope.hex() / f"{ref.key.hex()}"

    def _write_files(self, meta: BlockMeta, data: memoryview) -> Path:
        base = self._block_path(meta.ref)
        base.parent.mkdir(parents=True, exist_ok=True)
        path = base.with_suffix(DATA_SUFFIX)
        # The octets land before the sidecar: a crash in between leaves a file without a
        # sidecar, which open() drops, never a sidecar describing missing octets.
        _write_atomic(path, data, self.config.fsync)
        sidecar = json.dumps(meta.to_json(), separators=(",", ":")).encode()
        _write_atomic(base.with_suffix(SIDECAR_SUFFIX), memoryview(sidecar), self.config.fsync)
        return path

    # -- restart -------------------------------------------------------------------------------

    def open(self) -> list[Dropped]:
        """Re-read the disk tier: verify each block against its sidecar and keep the good ones,
        least recently modified first in LRU order.

        Returns:
            The blocks dropped (their files deleted): corrupt, without a sidecar, or beyond the
            budget. The holder withdraws their records, which may predate the restart.
        """
        root = self.config.disk_root
        if Tier.DISK not in self._tiers or root is None or not root.is_dir():
            return []
        dropped: list[Dropped] = []
        found: list[tuple[float, Path, BlockMeta]] = []
        for path, ref in _scan(root, dropped):
            try:
                meta = _verify_file(path, ref)
                found.append((path.stat().st_mtime, path, meta))
            except (KVSPError, OSError, ValueError) as exc:
                dropped.append(Dropped(ref, f"corrupt: {exc}"))
                _remove_pair(path)
        kept: list[StoredBlock] = []
        room = self._tiers[Tier.DISK].free
        for _, path, meta in sorted(found, key=lambda item: item[0], reverse=True):
            if meta.ref in self._blocks:
                continue  # admitted before this call: already counted
            if meta.size > room:  # keep the most recently written blocks that fit
                dropped.append(Dropped(meta.ref, "over the disk budget"))
                _remove_pair(path)
                continue
            room -= meta.size
            kept.append(StoredBlock(meta, Tier.DISK, path))
        with self._lock:
            for block in reversed(kept):
                self._link(block)
        return dropped


def _write_atomic(path: Path, data: memoryview, fsync: bool) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _load_file(path: Path, meta: BlockMeta) -> tuple[bytes, str | None]:
    """The file's octets, and the fault kind when they are not the block ``meta`` describes."""
    try:
        with open(path, "rb") as f:
            data = f.read(meta.size + 1)  # one more octet tells a longer file
    except FileNotFoundError:
        return b"", "missing"
    except OSError:
        return b"", "unreadable"
    if not data:
        return data, "empty"
    if len(data) < meta.size:
        return data, "truncated"
    if len(data) > meta.size or hashlib.sha256(data).digest() != meta.repr_digest:
        return data, "corrupt"
    return data, None


def _map_file(path: Path) -> memoryview:
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    # The view keeps the mapping alive; it is unmapped when the last view is released.
    return memoryview(mapped)


def _remove_pair(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.with_suffix(SIDECAR_SUFFIX).unlink(missing_ok=True)


def _scan(root: Path, dropped: list[Dropped]) -> Iterator[tuple[Path, BlockRef]]:
    """Yield each ``<compat>/<scope>/<key>.kvb`` under ``root``; delete leftovers of
    interrupted writes and sidecars without octets (noting both blocks as dropped)."""
    for compat_dir in sorted(root.iterdir()):
        for scope_dir in sorted(compat_dir.iterdir()) if compat_dir.is_dir() else ():
            for path in sorted(scope_dir.iterdir()) if scope_dir.is_dir() else ():
                ref = _ref_of(compat_dir.name, scope_dir.name, path.stem)
                if path.name.startswith(".") or ref is None:
                    path.unlink(missing_ok=True)  # a temporary file or a stranger
                elif path.suffix == SIDECAR_SUFFIX:
                    if not path.with_suffix(DATA_SUFFIX).exists():
                        # its octets are gone: a record published before may still name it
                        dropped.append(Dropped(ref, "no data file"))
                        path.unlink(missing_ok=True)
                elif path.suffix != DATA_SUFFIX:
                    path.unlink(missing_ok=True)
                elif not path.with_suffix(SIDECAR_SUFFIX).exists():
                    dropped.append(Dropped(ref, "no sidecar (interrupted write)"))
                    path.unlink(missing_ok=True)
                else:
                    yield path, ref


def _ref_of(compat: str, scope: str, key: str) -> BlockRef | None:
    try:
        return BlockRef(
            CompatId(parse_hex32(compat)), ScopeId(parse_hex16(scope)), BlockKey(parse_hex32(key))
        )
    except KVSPError:
        return None


def _verify_file(path: Path, ref: BlockRef) -> BlockMeta:
    """The sidecar's metadata, after checking the octets against it.

    Raises:
        KVSPError: the sidecar is malformed or names another block, or the octets differ.
        OSError, ValueError: a file cannot be read or parsed.
    """
    meta = BlockMeta.from_json(json.loads(path.with_suffix(SIDECAR_SUFFIX).read_bytes()))
    if meta.ref != ref:
        raise Incompatible("the sidecar names another block")
    data = _map_file(path)
    if data.nbytes != meta.size:
        raise Incompatible(f"{data.nbytes} octets, the sidecar says {meta.size}")
    container = decode_container(data)
    got = (container.codec, container.first_layer, container.layer_count, container.token_count)
    if got != (meta.codec, meta.first_layer, meta.layer_count, meta.token_count):
        raise Incompatible("the container header differs from the sidecar")
    _check_layers(container, meta.layer_digests)
    return meta


def _check_layers(container: Container, digests: Sequence[bytes]) -> None:
    for layer, expected in zip(container.layers, digests, strict=True):
        if layer_digest(layer.k, layer.v) != expected:
            raise Incompatible(f"layer {layer.index} differs from its digest")
