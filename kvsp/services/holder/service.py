"""The holder: stores, serves and leases blocks, and keeps their Replica Records at the Index
Service (spec §6.1 publishing and withdrawing, §6.6 leases, §6.7 block retrieval and storage).

:class:`Holder` is the library behind ``kvsp serve holder`` and the holder face of instances
and relays; the HTTP shell is :mod:`kvsp.services.holder.app`. Choices the spec leaves open:

* Blocks are stored whole, as the container that was PUT; only codec raw (1) is stored or
  served, and ``?codec=`` naming any other codec is answered 406 (this holder does not transcode).
* A PUT for a compat_id the holder does not know fetches its descriptor from the IS
  (:meth:`Holder.learn_descriptor`) before it is refused with 422.
* A PUT container must match its descriptor's geometry (§4.3) and hold exactly
  ``block_tokens`` tokens (§4.2: only complete blocks have keys). It may hold a layer
  sub-range, which it serves (ranges it lacks answer ``kvsp-layers-unavailable``) but does not
  publish: a Replica Record's ``digest`` covers every layer (§4.3), which a holder of some
  layers cannot know, and a record with any other value would mislead clients.
* Every stored block's layer digests and Repr-Digest are computed by hashing its octets,
  except for a block its client verified against the producer's record (§6.7): an instance
  keeping a block it fetched hands it over as it was verified (:meth:`Holder.put_verified`,
  or :meth:`Holder.put_block` with ``verified``, which compares the octets with it), and the
  record's layer digests are taken; only the Repr-Digest is hashed.
* A PUT that could be stored only by evicting leased blocks fails with 507
  ``kvsp-insufficient-storage``; nothing is evicted.
* Records are refreshed once a third of their granted TTL has passed, and withdrawn on
  :meth:`Holder.close`. A failed withdrawal does not stop an eviction (§6.1 allows "immediately
  after"); it is retried with the next refresh.
* A disk-tier block is checked against its length and Repr-Digest before it is served over
  HTTP or MOQT (:meth:`BlockStore.read_checked`). A storage fault (missing, empty, truncated or
  corrupt file) is answered as a miss (404), counted in :attr:`Holder.faults`, and the block is
  retired at once (:mod:`kvsp.services.holder.faults`): no longer served or refreshed, its
  record withdrawn, then its files deleted (§6.6: withdraw before dropping leased data).
* Leases (§6.6) are bounded per client and for all clients together
  (:meth:`HolderConfig.lease_policy`), so that leases never pin the whole capacity.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, ParamSpec, Protocol, TypeVar, runtime_checkable

from kvsp.compat import CompatibilityDescriptor
from kvsp.container import Geometry, decode_container, header_size
from kvsp.errors import (
    BlockLeased,
    DigestMismatch,
    Incompatible,
    InsufficientStorage,
    KVSPError,
    NotAcceptable,
    NotFound,
    PreconditionFailed,
)
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.index import ReplicaIndex
from kvsp.leases import Lease, LeaseQuota, LeaseTable, capacity_quota, random_lease_id
from kvsp.records import LeaseGrant, LeaseRenewal, LeaseRequest, ReplicaRecord, Residency
from kvsp.registries import Codec, Tier
from kvsp.services.holder.faults import Retirement
from kvsp.stores.blocks import (
    BlockFault,
    BlockMeta,
    BlockRef,
    BlockStore,
    DeviceBackend,
    StoreConfig,
    StoredBlock,
    Victim,
    container_octets,
    describe_block,
    describe_verified,
    verified_meta,
)
from kvsp.web.auth import Principal, require_scope
from kvsp.web.background import raise_if_cancelling
from kvsp.web.clock import Clock

if TYPE_CHECKING:  # an annotation only: a holder alone does not load the client side
    from kvsp.transfer.verify import VerifiedBlock

_log = logging.getLogger("kvsp.holder")
P = ParamSpec("P")
T = TypeVar("T")

GiB = 1 << 30
OFFLOAD_BYTES = 1 << 20
"""Blocks at least this large are hashed in a worker thread (hashlib releases the GIL)."""
REFRESH_BATCH = 1000
"""Records per ``POST replicas`` when refreshing (the IS takes up to 10,000)."""
WITHDRAW_CONCURRENCY = 32
"""Withdrawals in flight at once when the holder shuts down."""
ADMISSION_ATTEMPTS = 3
"""How often a PUT re-plans when a lease lands on a victim while its record is withdrawn."""
DEFAULT_LEASE_TTL_MS = 60_000
DEFAULT_LEASES_PER_CLIENT = 1024


class DescriptorSource(Protocol):
    """Where the holder finds the Compatibility Descriptor of a compat_id (§4.1)."""

    def get(self, compat: CompatId, /) -> CompatibilityDescriptor | None:
        """The descriptor, or ``None`` when unknown."""


@runtime_checkable
class DescriptorSink(Protocol):
    """A :class:`DescriptorSource` that also keeps descriptors learnt from the IS."""

    def add(self, descriptor: CompatibilityDescriptor, /, *, persist: bool = True) -> bytes:
        """Keep ``descriptor``; its compat_id."""


@runtime_checkable
class DescriptorFetcher(Protocol):
    """An IS client that reads descriptors (``GET descriptors/{compat}``, §6.1)."""

    async def get_descriptor(self, cid: bytes) -> CompatibilityDescriptor:
        """The descriptor the IS knows for ``cid``.

        Raises:
            NotFound: the IS knows none.
        """
        ...


def _default_rates() -> dict[Tier, float]:
    return {Tier.HOST: 400_000.0, Tier.DISK: 16_000.0}


@dataclass(frozen=True, slots=True, kw_only=True)
class HolderConfig:
    """How a holder stores, publishes and leases blocks.

    ``public_url`` is the base (ending in ``/``) named as ``holder`` in its records; ``None``
    until :meth:`Holder.set_public_url` learns it from the server.
    """

    public_url: str | None = None
    tiers: Mapping[Tier, int] = field(default_factory=lambda: {Tier.HOST: GiB})
    state_dir: Path | None = None
    """The disk tier lives in ``state_dir/blocks``."""
    record_ttl_ms: int = 600_000
    read_mbit_per_s: Mapping[Tier, float] = field(default_factory=_default_rates)
    lease_quota: LeaseQuota | None = None
    """``None``: derived from the tiers' capacity (:meth:`lease_policy`)."""
    body_limit: int = 256 << 20
    digest_cache: int = 64
    """How many sub-range Repr-Digests to remember."""
    fsync: bool = True
    site: str | None = None
    """The ``site`` label its records carry (spec §4.4 extension member; ``--site``)."""
    zone: str | None = None
    """The ``zone`` label its records carry (``--zone``)."""

    @property
    def capacity(self) -> int:
        """Octets the tiers can hold together."""
        return sum(self.tiers.values())

    def lease_policy(self) -> LeaseQuota:
        """The lease quota applied (§6.6): ``lease_quota``, or by default a quarter of the
        capacity per client; either way all clients together lease at most half of it
        (:func:`~kvsp.leases.capacity_quota`), so leases never starve other principals' PUTs."""
        if self.lease_quota is not None:
            return self.lease_quota.bounded(self.capacity)
        return capacity_quota(
            self.capacity,
            max_ttl_ms=DEFAULT_LEASE_TTL_MS,
            max_leases_per_client=DEFAULT_LEASES_PER_CLIENT,
        )

    def store_config(self) -> StoreConfig:
        """The block store's configuration."""
        root = None if self.state_dir is None else self.state_dir / "blocks"
        return StoreConfig(budgets=dict(self.tiers), disk_root=root, fsync=self.fsync)


@dataclass(frozen=True, slots=True)
class BlockResponse:
    """What to send for a GET (§6.7): the parts in order (header octets and views of the
    stored block, never a second copy of it), their length, and the fields."""

    parts: tuple[bytes | memoryview, ...]
    length: int
    repr_digest: bytes
    """SHA-256 of exactly the returned container."""
    max_age_s: int
    """No longer than the replica's remaining TTL."""
    first_layer: int
    last_layer: int


@dataclass(slots=True)
class _Publication:
    published_ms: int
    ttl_ms: int

    def due(self, now_ms: int) -> bool:
        return now_ms - self.published_ms >= self.ttl_ms // 3


class Holder:
    """A block holder: storage in tiers, retrieval by layer range, leases, and its records."""

    def __init__(
        self,
        config: HolderConfig,
        *,
        index: ReplicaIndex | None,
        descriptors: DescriptorSource,
        clock: Clock,
        device: DeviceBackend | None = None,
    ) -> None:
        self.config = config
        self.index = index
        self.descriptors = descriptors
        self.clock = clock
        self.leases = LeaseTable(config.lease_policy(), random_lease_id)
        self.retirement = Retirement(self._withdraw)
        self.store = BlockStore(
            config.store_config(),
            is_leased=self.is_leased,
            device=device,
            on_fault=self.retirement.on_fault,
        )
        self.retirement.attach(self.store)
        self._public_url = config.public_url
        self._published: dict[BlockRef, _Publication] = {}
        self._unwithdrawn: set[BlockRef] = set()  # withdrawals that failed or wait for a URL
        self._digests: OrderedDict[tuple[BlockRef, bytes, int, int], bytes] = OrderedDict()
        self._admitting = asyncio.Lock()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def faults(self) -> dict[str, int]:
        """Storage faults found on reading, by kind (the ``kvsp_block_faults_total`` metric)."""
        return self.retirement.faults

    @property
    def public_url(self) -> str | None:
        """The base URL named in records, once known."""
        return self._public_url

    def set_public_url(self, url: str) -> None:
        """Learn the public base URL (the server's own when none was configured) and publish."""
        self._public_url = url if url.endswith("/") else url + "/"
        self._wake.set()

    async def start(self) -> None:
        """Re-read the disk tier (withdrawing dropped blocks), then keep the records fresh."""
        self.retirement.loop = asyncio.get_running_loop()
        for dropped in await asyncio.to_thread(self.store.open):
            _log.warning("dropped block %s: %s", dropped.ref, dropped.reason)
            self._unwithdrawn.add(dropped.ref)
        if self.index is not None and self._task is None:
            self._task = asyncio.create_task(self._refresh_loop(), name="kvsp-holder-refresh")

    async def stop_refreshing(self) -> None:
        """Stop keeping the records fresh (a holder about to leave withdraws them all at once
        next); :meth:`close` still withdraws those not forgotten."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def forget_published(self) -> int:
        """Forget every record as published, once the IS withdrew them all at once (``DELETE
        holders/{id}/replicas``): :meth:`close` has none left to withdraw; returns how many."""
        count = len(self._published)
        self._published.clear()
        self._unwithdrawn.clear()
        return count

    async def close(self) -> None:
        """Stop refreshing and withdraw every published record."""
        await self.stop_refreshing()
        await self.retirement.close()
        refs = list(self._published)
        for start in range(0, len(refs), WITHDRAW_CONCURRENCY):
            chunk = refs[start : start + WITHDRAW_CONCURRENCY]
            await asyncio.gather(*(self._withdraw(ref) for ref in chunk))

    async def _refresh_loop(self) -> None:
        while True:
            self._wake.clear()  # before the round: a wake-up during it starts the next at once
            try:
                await self.refresh_due()
            except Exception:  # a bad round must not end refreshing for good
                raise_if_cancelling()
                _log.exception("refreshing replica records failed")
            interval = min((p.ttl_ms for p in self._published.values()), default=None)
            seconds = (interval or self.config.record_ttl_ms) / 6000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=max(0.05, seconds))

    async def refresh_due(self) -> int:
        """Retry failed withdrawals, then publish every record not yet published or past a third
        of its granted TTL (§6.1); returns how many were published."""
        if self.index is None or self._public_url is None:
            return 0
        for ref in list(self._unwithdrawn):
            if ref in self.store:  # stored again since: publishing below replaces the record
                self._unwithdrawn.discard(ref)
            else:
                await self._withdraw(ref)
        now = self.clock.now_ms()
        due = []
        for block in self.store:
            if block.meta.ref in self.retirement:
                continue
            publication = self._published.get(block.meta.ref)
            if publication is None or publication.due(now):
                due.append(block)
        count = 0
        for start in range(0, len(due), REFRESH_BATCH):
            count += await self._publish_batch(due[start : start + REFRESH_BATCH])
        return count

    # -- records -------------------------------------------------------------------------------

    def record_of(self, block: StoredBlock) -> ReplicaRecord:
        """The Replica Record of a held block (§4.4).

        Raises:
            RuntimeError: the public URL is not known yet.
        """
        if self._public_url is None:
            raise RuntimeError("the holder's public URL is not known yet")
        meta = block.meta
        residency = Residency(
            tier=block.tier,
            first=meta.first_layer,
            last=meta.last_layer,
            read_mbit_per_s=self.config.read_mbit_per_s.get(block.tier),
        )
        return ReplicaRecord(
            block_key=meta.ref.key,
            compat_id=meta.ref.compat,
            scope_id=meta.ref.scope,
            holder=self._public_url,
            codec=meta.codec,
            size=meta.size,
            digest=meta.digest,
            layer_digests=meta.layer_digests,
            residency=(residency,),
            ttl_ms=self.config.record_ttl_ms,
            site=self.config.site,
            zone=self.config.zone,
        )

    async def _publish(self, block: StoredBlock) -> int:
        if self.index is None or self._public_url is None or not block.meta.complete:
            return 0
        now = self.clock.now_ms()
        try:
            granted = await self.index.publish(self.record_of(block))
        except KVSPError as exc:
            _log.warning("publishing %s failed: %s", block.meta.ref, exc)
            return 0
        self._published_at(block, now, granted)
        return 1

    async def _publish_batch(self, blocks: Sequence[StoredBlock]) -> int:
        blocks = [block for block in blocks if block.meta.complete]  # see the module docstring
        if not blocks:
            return 0
        if len(blocks) == 1 or self.index is None or self._public_url is None:
            return sum([await self._publish(block) for block in blocks])
        now = self.clock.now_ms()
        try:
            outcomes = await self.index.publish_batch([self.record_of(b) for b in blocks])
        except KVSPError as exc:
            _log.warning("publishing %d records failed: %s", len(blocks), exc)
            return 0
        count = 0
        for block, outcome in zip(blocks, outcomes, strict=True):
            if isinstance(outcome, KVSPError):
                _log.warning("publishing %s failed: %s", block.meta.ref, outcome)
                continue
            self._published_at(block, now, outcome)
            count += 1
        return count

    def _published_at(self, block: StoredBlock, now_ms: int, granted_ms: int) -> None:
        # Only while the block is still held as published: evicted or demoted meanwhile, its
        # record is gone or stale, and the next refresh round publishes it as it is now.
        if self.store.get(block.meta.ref, touch=False) is block:
            self._published[block.meta.ref] = _Publication(now_ms, max(1, granted_ms))

    async def _withdraw(self, ref: BlockRef) -> None:
        self._published.pop(ref, None)
        if self.index is None:
            return
        if self._public_url is None:
            self._unwithdrawn.add(ref)
            return
        try:
            await self.index.withdraw(ref.compat, ref.scope, ref.key, self._public_url)
        except KVSPError as exc:
            _log.warning("withdrawing %s failed (retried later): %s", ref, exc)
            self._unwithdrawn.add(ref)
        else:
            self._unwithdrawn.discard(ref)

    def remaining_ttl_ms(self, ref: BlockRef) -> int:
        """How long the replica's record has left at the IS (the configured TTL standalone)."""
        if self.index is None:
            return self.config.record_ttl_ms
        publication = self._published.get(ref)
        if publication is None:
            return 0
        return max(0, publication.published_ms + publication.ttl_ms - self.clock.now_ms())

    # -- storing (§6.7 PUT) --------------------------------------------------------------------

    async def readiness(self) -> str | None:
        """Why this holder is not ready to serve (``/readyz``), or ``None``: a holder with an
        IS is ready when the IS answers it (a descriptor read: its token is taken too)."""
        index: object = self.index
        if not isinstance(index, DescriptorFetcher):
            return None
        try:
            await index.get_descriptor(bytes(32))
        except NotFound:
            return None
        except KVSPError as exc:
            return f"the Index Service does not answer: {exc}"
        return None

    async def learn_descriptor(self, compat: CompatId) -> bool:
        """Fetch the descriptor of ``compat`` from the IS when this holder does not know it
        (§6.1 ``GET descriptors/{compat}``) and keep it; a holder without an IS, or an IS that
        does not know it either, leaves it unknown (the PUT is then refused with 422).

        Returns:
            Whether the descriptor is known now.
        """
        if self.descriptors.get(compat) is not None:
            return True
        index: object = self.index
        sink: object = self.descriptors
        if not isinstance(index, DescriptorFetcher) or not isinstance(sink, DescriptorSink):
            return False
        try:
            descriptor = await index.get_descriptor(compat)
        except NotFound:
            return False
        except KVSPError as exc:
            _log.warning("cannot fetch descriptor %s from the IS: %s", compat.hex(), exc)
            return False
        sink.add(descriptor)
        _log.info("learnt descriptor %s from the IS", compat.hex())
        return True

    def check_put(self, principal: Principal, ref: BlockRef) -> CompatibilityDescriptor:
        """What can be refused before the body is read, in this order.

        Raises:
            Forbidden: the principal may not use the scope (§6.7 MUST).
            PreconditionFailed: the key is already held (§6.7: keep the copy, 412).
            Incompatible: the compat_id has no descriptor here.
        """
        require_scope(principal, ref.scope)
        if ref in self.store:
            raise PreconditionFailed("this holder already has a replica for the key")
        descriptor = self.descriptors.get(ref.compat)
        if descriptor is None:
            raise Incompatible(
                "unknown compat_id here and at the IS; PUT its descriptor first", path="compat"
            )
        return descriptor

    async def put_block(
        self,
        principal: Principal,
        compat: CompatId,
        scope: ScopeId,
        key: BlockKey,
        data: bytes,
        *,
        expected_digest: bytes | None = None,
        publish: bool = True,
        verified: VerifiedBlock | None = None,
    ) -> StoredBlock:
        """Verify and store a container, then publish its record (§6.7, §6.1).

        ``expected_digest`` is the SHA-256 from the request's Repr-Digest or Content-Digest.
        With ``publish=False`` the caller publishes the record itself, with others in one
        request (:meth:`publish_blocks`); the refresh loop publishes it otherwise.
        ``verified`` is the block ``data`` encodes, as a client verified it against the
        producer's record: its layer digests are taken from that record, and ``data`` is
        compared with the block instead of hashed again (:func:`describe_verified`).

        Raises:
            Forbidden, PreconditionFailed, Incompatible: as :meth:`check_put`; Incompatible
                also for a token count other than the descriptor's ``block_tokens``.
            ContainerError: not a container of the descriptor's geometry (§4.3).
            DigestMismatch: ``expected_digest`` differs, or ``data`` is not ``verified``'s
                encoding (nothing is stored).
            InsufficientStorage: no room without evicting leased blocks (507).
        """
        ref = BlockRef(compat, scope, key)
        descriptor = self.check_put(principal, ref)
        geometry = Geometry.from_descriptor(descriptor)
        digests = None if verified is None else _verified_digests(ref, verified, geometry)
        if verified is not None and digests is not None:
            view = memoryview(data)
            meta = await _offload(
                view.nbytes, describe_verified, ref, view, geometry, verified, digests
            )
        else:
            meta = await _describe(ref, memoryview(data), geometry)
        if expected_digest is not None and expected_digest != meta.repr_digest:
            raise DigestMismatch("the body does not match its Repr-Digest", path="Repr-Digest")
        return await self._keep(descriptor, meta, data, publish)

    async def put_verified(
        self,
        principal: Principal,
        compat: CompatId,
        scope: ScopeId,
        key: BlockKey,
        block: VerifiedBlock,
        *,
        publish: bool = True,
    ) -> StoredBlock:
        """Store a block a client verified (§6.7) and publish its record (§6.1), as
        :meth:`put_block` with ``verified``: the octets are the block's encoding, taken here (the
        received buffer itself when the layers lie in it in order, :func:`container_octets`),
        so nothing is compared, and only the Repr-Digest is hashed when the block was checked
        against the producer's record (:func:`verified_meta`); otherwise it is hashed as any
        body. Not even the Repr-Digest is hashed when the octets are the HTTP body the client
        received and checked against one (``body_digest``, the layers still in it).

        Raises:
            as :meth:`put_block`.
        """
        ref = BlockRef(compat, scope, key)
        descriptor = self.check_put(principal, ref)
        geometry = Geometry.from_descriptor(descriptor)
        digests = _verified_digests(ref, block, geometry)
        data, in_place = container_octets(block)
        known = block.body_digest if in_place else None
        if digests is None:
            meta = await _describe(ref, memoryview(data), geometry, known)
        elif known is not None:
            meta = verified_meta(ref, data, block, geometry, digests, known)  # nothing to hash
        else:
            meta = await _offload(len(data), verified_meta, ref, data, block, geometry, digests)
        return await self._keep(descriptor, meta, data, publish)

    async def _keep(
        self,
        descriptor: CompatibilityDescriptor,
        meta: BlockMeta,
        data: bytes | memoryview,
        publish: bool,
    ) -> StoredBlock:
        if meta.token_count != descriptor.block_tokens:
            raise Incompatible(
                f"container holds {meta.token_count} tokens; a block holds "
                f"{descriptor.block_tokens} (block_tokens)"
            )
        async with self._admitting:
            if meta.ref in self.store:  # a concurrent PUT of the same key won
                raise PreconditionFailed("this holder already has a replica for the key")
            block = await self._admit(meta, memoryview(data))
        if publish:
            await self._publish(block)
        return block

    async def publish_blocks(self, blocks: Sequence[StoredBlock]) -> int:
        """Publish the records of held blocks in as few IS requests as the batch limit allows
        (``POST replicas``); returns how many were published. Failures are logged, and the
        refresh loop publishes those blocks later."""
        count = 0
        for start in range(0, len(blocks), REFRESH_BATCH):
            count += await self._publish_batch(blocks[start : start + REFRESH_BATCH])
        return count

    async def _admit(self, meta: BlockMeta, data: memoryview) -> StoredBlock:
        for _ in range(ADMISSION_ATTEMPTS):
            admission = self.store.plan(meta.size)
            try:
                await self._make_room(admission.victims)
            except BlockLeased:
                continue  # plan again, around the newly leased block
            if admission.tier is Tier.HOST:  # kept as it is, uncopied
                return self.store.admit(meta, data, admission.tier)
            return await asyncio.to_thread(self.store.admit, meta, data, admission.tier)
        raise InsufficientStorage("blocks kept being leased while room was being made")

    async def _make_room(self, victims: Sequence[Victim]) -> None:
        """Demote or evict each victim.

        Raises:
            BlockLeased: a lease arrived for a victim while its record was being withdrawn; the
                block stays and its record is published again.
        """
        for victim in victims:
            if victim.to is not None:
                moved = await asyncio.to_thread(self.store.demote, victim.ref, victim.to)
                await self._publish(moved)  # its residency changed
                continue
            await self._withdraw(victim.ref)  # §6.1: withdraw before evicting
            if victim.ref not in self.store:
                continue  # dropped meanwhile as faulty: its room is free already
            try:
                self.store.evict(victim.ref)
            except BlockLeased:
                block = self.store.get(victim.ref, touch=False)
                if block is not None:
                    await self._publish(block)  # still held: its record goes back
                raise

    # -- serving (§6.7 GET) --------------------------------------------------------------------

    async def get_block(
        self,
        principal: Principal,
        compat: CompatId,
        scope: ScopeId,
        key: BlockKey,
        layers: tuple[int, int] | None,
        codec: int | None,
    ) -> BlockResponse:
        """The container (or the layer range ``layers``) to send for a GET (§6.7).

        Raises:
            Forbidden: the principal may not use the scope (checked first).
            NotFound: the block is not held (``kvsp-not-found``).
            NotAcceptable: ``codec`` is not the stored codec (raw only; no transcoding).
            LayersUnavailable: the range is not held (``kvsp-layers-unavailable``).
        """
        require_scope(principal, scope)
        ref = BlockRef(compat, scope, key)
        block = self.store.get(ref)
        if block is None or ref in self.retirement:
            raise NotFound("this holder does not hold the block")
        if codec is not None and codec != block.meta.codec:
            raise NotAcceptable(
                f"codec {codec} requested; this holder serves codec {int(Codec.RAW)} (raw) only"
            )
        meta = block.meta
        max_age = self.remaining_ttl_ms(ref) // 1000
        data = await self._read(block)
        if layers is None or layers == (meta.first_layer, meta.last_layer):
            return BlockResponse(
                (data,), meta.size, meta.repr_digest, max_age, meta.first_layer, meta.last_layer
            )
        parts = _range_parts(data, *layers)
        length = sum(len(p) for p in parts)
        digest = await self._sub_range_digest(meta, layers, parts, length)
        return BlockResponse(parts, length, digest, max_age, layers[0], layers[1])

    async def _read(self, block: StoredBlock) -> memoryview:
        """The block's octets, checked before anything is sent (see the module docstring).

        Raises:
            NotFound: a storage fault; the block is retired before this returns.
        """
        self.retirement.loop = asyncio.get_running_loop()
        try:
            return await _offload(block.meta.size, self.store.read_checked, block)
        except BlockFault:
            await self.retirement.settle(block.meta.ref)
            raise NotFound("this holder does not hold the block") from None

    async def _sub_range_digest(
        self,
        meta: BlockMeta,
        layers: tuple[int, int],
        parts: Sequence[bytes | memoryview],
        length: int,
    ) -> bytes:
        cache_key = (meta.ref, meta.repr_digest, layers[0], layers[1])
        cached = self._digests.get(cache_key)
        if cached is not None:
            self._digests.move_to_end(cache_key)
            return cached
        digest = await _offload(length, _sha256_parts, parts)
        self._digests[cache_key] = digest
        while len(self._digests) > self.config.digest_cache:
            self._digests.popitem(last=False)
        return digest

    # -- leases (§6.6) -------------------------------------------------------------------------

    def is_leased(self, ref: BlockRef) -> bool:
        """Whether an unexpired lease covers the block (the store never evicts it)."""
        return self.leases.is_leased(ref.packed, self.clock.now_ms())

    def grant(self, principal: Principal, request: LeaseRequest) -> LeaseGrant:
        """Create a lease on held blocks for the principal (quota per principal name).

        Raises:
            Forbidden: the principal may not use the scope.
            NotFound: a listed block is not held (the message names it).
            LeaseQuota: over the principal's octets, lease count or TTL (429).
        """
        require_scope(principal, request.scope_id)
        sizes: dict[bytes, int] = {}
        for i, key in enumerate(request.block_keys):
            block = self.store.get(BlockRef(request.compat_id, request.scope_id, key), touch=False)
            if block is None:
                raise NotFound("this holder does not hold the block", path=f"$.block_keys[{i}]")
            sizes[block.meta.ref.packed] = block.meta.size
        lease = self.leases.grant(principal.name, sizes, request.ttl_ms, self.clock.now_ms())
        return _grant_of(lease, request.ttl_ms, request.block_keys)

    def renew(self, principal: Principal, lease_id: str, renewal: LeaseRenewal) -> LeaseGrant:
        """Renew one of the principal's leases to end ``ttl_ms`` from now.

        Raises:
            NotFound: no such unexpired lease of this principal.
            LeaseQuota: ``ttl_ms`` over the maximum.
        """
        now = self.clock.now_ms()
        lease = self.leases.renew(lease_id, principal.name, renewal.ttl_ms, now)
        keys = tuple(BlockKey(k[48:]) for k in sorted(lease.keys))
        return _grant_of(lease, renewal.ttl_ms, keys)

    def release(self, principal: Principal, lease_id: str) -> None:
        """Release one of the principal's leases.

        Raises:
            NotFound: no such unexpired lease of this principal.
        """
        self.leases.release(lease_id, principal.name, self.clock.now_ms())


def _range_parts(data: memoryview, first: int, last: int) -> tuple[bytes, memoryview]:
    """Layers ``first..last`` of a stored container as a new header and one view of the
    stored octets: the sections of consecutive layers are contiguous (§4.3).

    Raises:
        LayersUnavailable: the range is not held.
    """
    stored = decode_container(data)
    selected = stored.select(first, last)
    start = header_size(stored.layer_count)
    for layer in stored.layers[: first - stored.first_layer]:
        start += layer.k.nbytes + layer.v.nbytes
    length = sum(layer.k.nbytes + layer.v.nbytes for layer in selected.layers)
    return selected.header_bytes, data[start : start + length]


def _verified_digests(
    ref: BlockRef, verified: VerifiedBlock, geometry: Geometry
) -> tuple[bytes, ...] | None:
    """The layer digests of ``verified``'s layers from the complete replica's record it was
    checked against, or None when it was not so checked (a transcoded block, another key, a
    record without layer digests)."""
    record = verified.record
    digests = record.layer_digests
    if (
        not verified.producer_verified
        or digests is None
        or len(digests) != geometry.layers
        or (record.compat_id, record.scope_id, record.block_key) != tuple(ref)
    ):
        return None
    first = verified.first_layer
    return digests[first : first + verified.layer_count]


def _grant_of(lease: Lease, ttl_ms: int, keys: Sequence[BlockKey]) -> LeaseGrant:
    return LeaseGrant(lease=lease.id, ttl_ms=ttl_ms, block_keys=tuple(keys))


async def _describe(
    ref: BlockRef, data: memoryview, geometry: Geometry, repr_digest: bytes | None = None
) -> BlockMeta:
    """:func:`describe_block`, with the two passes over a large block in two threads (the
    layer digests alone, in one, when the Repr-Digest is known)."""
    if data.nbytes < OFFLOAD_BYTES:
        return describe_block(ref, data, geometry, repr_digest)
    if repr_digest is not None:
        return await asyncio.to_thread(describe_block, ref, data, geometry, repr_digest)
    whole = asyncio.ensure_future(asyncio.to_thread(_sha256_parts, (data,)))
    try:
        meta = await asyncio.to_thread(describe_block, ref, data, geometry, bytes(32))
    finally:
        digest = await whole
    return replace(meta, repr_digest=digest)  # in place of the placeholder


def _sha256_parts(parts: Sequence[bytes | memoryview]) -> bytes:
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.digest()


async def _offload(size: int, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run ``fn`` in a worker thread when ``size`` octets make it slow, else inline."""
    if size >= OFFLOAD_BYTES:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)
