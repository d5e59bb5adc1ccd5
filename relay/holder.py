"""The relay as a KVSP holder (spec §4.4, §6.1, §6.6; DESIGN.md §1, §4).

For each complete, verified stored replica track in its cache the relay publishes a Replica
Record at the Index Service: holder = its ``moqt://`` URI, ``moqt_namespace`` = the five
namespace fields, ``digest`` = the track name, the layer digests of the objects, every layer in
host memory, the container size, codec raw, a TTL that is the track's remaining
MAX_CACHE_DURATION capped by configuration, ``lease_base`` = its HTTP face, and the ``site`` and
``zone`` labels it was given (extension members, for placement's locality). Records are
refreshed at a third of their granted TTL, withdrawn **before** their track is evicted, and
withdrawn when the track expires. A track whose block is leased is never chosen for eviction;
MAX_CACHE_DURATION still ends it (the publisher's cache directive), after its record is
withdrawn (§6.6: a holder that must drop leased data first withdraws the record). Given the
cache's ``capacity``, leases by all clients together are bounded to half of it
(:meth:`~kvsp.leases.LeaseQuota.bounded`), so leased tracks never fill the cache.

One record per block: a second complete replica of the same block key (other bytes) is cached
and served but not published while the first is held.

The relay's upkeep asks, twice a second, which records are due for a refresh and which
replicas have expired: both come from deadline heaps, so that a pass over a cache of a million
blocks looks only at the few that are due.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from kvsp.errors import KVSPError, NotFound
from kvsp.ids import BlockKey
from kvsp.leases import LeaseQuota, LeaseTable
from kvsp.records import LeaseGrant, LeaseRenewal, LeaseRequest, ReplicaRecord
from kvsp.web.auth import Principal, require_scope
from kvsp.web.clock import Clock

from .cache import TrackKey
from .deadlines import Deadlines
from .kv import KVReplica, replica_record

log = logging.getLogger(__name__)
_K = TypeVar("_K")
_V = TypeVar("_V")
DEFAULT_RECORD_TTL_MS = 60_000
RETRY_MS = 1000


class ReplicaIndex(Protocol):
    """The part of :class:`~kvsp.services.index.client.IndexClient` the holder uses."""

    async def publish(self, record: ReplicaRecord, /) -> int:
        """PUT a record; the granted TTL."""
        ...

    async def withdraw(self, compat_id: bytes, scope_id: bytes, key: bytes, holder: str, /) -> bool:
        """DELETE a record; False when the IS had none."""
        ...


def _come(
    deadlines: Deadlines[_K], now_ms: int, current: Callable[[_K], _V | None]
) -> dict[_K, _V]:
    """Pop the ``deadlines`` heap's entries up to ``now_ms``; what ``current`` still finds
    due for each key (None: the entry was stale), by key in deadline order. Those found are
    queued again, so that each call names them until the caller's action (a refresh, a
    withdrawal) ends them, as a scan of every entry would."""
    found: dict[_K, _V] = {}
    for _, key in deadlines.pop_due(now_ms):
        if key not in found and (value := current(key)) is not None:
            found[key] = value
    for key in found:
        deadlines.push(now_ms, key)
    return found


def _default_quota() -> LeaseQuota:
    return LeaseQuota(max_octets_per_client=1 << 30, max_ttl_ms=600_000, max_leases_per_client=1024)


@dataclass(frozen=True, slots=True, kw_only=True)
class HolderConfig:
    """The holder role's settings."""

    record_ttl_ms: int = DEFAULT_RECORD_TTL_MS
    lease_quota: LeaseQuota = field(default_factory=_default_quota)
    capacity: int | None = None
    """The cache budget in octets: leases stop at half of it (``None``: only ``lease_quota``)."""
    site: str | None = None
    """The ``site`` label its records carry (spec §4.4 extension member; ``--site``)."""
    zone: str | None = None
    """The ``zone`` label its records carry (``--zone``)."""

    def lease_policy(self) -> LeaseQuota:
        """The lease quota applied (§6.6), bounded by the capacity when it is known."""
        if self.capacity is None:
            return self.lease_quota
        return self.lease_quota.bounded(self.capacity)


@dataclass(slots=True)
class _Published:
    replica: KVReplica
    record: ReplicaRecord | None = None
    due_ms: int = 0  # next refresh


class RelayHolder:
    """Records and leases of the replicas the relay caches."""

    def __init__(
        self,
        config: HolderConfig,
        clock: Clock,
        index: ReplicaIndex | None = None,
        *,
        holder_url: str = "",
        lease_base: str | None = None,
        carriers: tuple[str, ...] = (),
    ) -> None:
        self.config = config
        self.clock = clock
        self.index = index
        self.holder_url = holder_url
        self.lease_base = lease_base
        self.carriers = carriers
        """The relay's MOQT-over-QMux URIs, fastest first: the records' ``moqt_carriers``."""
        self.leases = LeaseTable(config.lease_policy())
        self._replicas: dict[TrackKey, KVReplica] = {}  # complete replicas in the cache
        self._of_block: dict[bytes, dict[TrackKey, None]] = {}  # block (packed) → its tracks
        self._blocks: dict[bytes, _Published] = {}  # block (packed) → its published replica
        self._lock = asyncio.Lock()  # one IS conversation at a time, in order
        # deadlines, each checked against the current state when it comes (so a stale one,
        # of a replica gone or a refresh moved on, is dropped then)
        self._expiries: Deadlines[TrackKey] = Deadlines(self._expires_ms)
        self._refreshes: Deadlines[bytes] = Deadlines(self._due_ms)

    # --- replicas ----------------------------------------------------------------------------

    def replica(self, key: TrackKey) -> KVReplica | None:
        """The complete replica cached under ``key``."""
        return self._replicas.get(key)

    def record_of(self, key: TrackKey) -> ReplicaRecord | None:
        """The record last published for the track (None when not published)."""
        replica = self._replicas.get(key)
        if replica is None:
            return None
        published = self._blocks.get(replica.block.packed)
        if published is None or published.replica.key != key:
            return None
        return published.record

    def add(self, replica: KVReplica) -> bool:
        """A replica became complete; True when it is the one to publish for its block."""
        self._replicas[replica.key] = replica
        if replica.expires_ms is not None:
            self._expiries.push(replica.expires_ms, replica.key)
        packed = replica.block.packed
        self._of_block.setdefault(packed, {})[replica.key] = None
        if packed in self._blocks:
            return False
        # the caller publishes now; the refresh loop retries only if that fails
        published = self._blocks[packed] = _Published(replica)
        self._refresh_at(packed, published, self.clock.now_ms() + RETRY_MS)
        return True

    def _refresh_at(self, packed: bytes, published: _Published, due_ms: int) -> None:
        """Set when the block's record is next (re)published; without an index there is
        nothing to publish, and nothing is queued."""
        published.due_ms = due_ms
        if self.index is not None:
            self._refreshes.push(due_ms, packed)

    def _expires_ms(self, key: TrackKey) -> int | None:
        replica = self._replicas.get(key)
        return None if replica is None else replica.expires_ms

    def _due_ms(self, packed: bytes) -> int | None:
        published = self._blocks.get(packed)
        return None if published is None else published.due_ms

    def is_pinned(self, key: TrackKey) -> bool:
        """Whether the track's block is leased (spec §6.6: never evict it)."""
        replica = self._replicas.get(key)
        return replica is not None and self.leases.is_leased(
            replica.block.packed, self.clock.now_ms()
        )

    def _ttl_ms(self, replica: KVReplica, now_ms: int) -> int:
        ttl = self.config.record_ttl_ms
        if replica.expires_ms is not None:
            ttl = min(ttl, replica.expires_ms - now_ms)
        return ttl

    # --- the index ---------------------------------------------------------------------------

    async def publish(self, key: TrackKey) -> None:
        """Publish (or refresh) the record of the track's replica, if it is the block's one."""
        replica = self._replicas.get(key)
        if replica is None or self.index is None:
            return
        published = self._blocks.get(replica.block.packed)
        if published is None or published.replica.key != key:
            return
        async with self._lock:
            now = self.clock.now_ms()
            ttl = self._ttl_ms(replica, now)
            if ttl <= 0:
                return
            record = replica_record(
                replica,
                holder=self.holder_url,
                lease_base=self.lease_base,
                ttl_ms=ttl,
                carriers=self.carriers,
                site=self.config.site,
                zone=self.config.zone,
            )
            try:
                granted = await self.index.publish(record)
            except (KVSPError, OSError) as exc:
                log.warning("publishing a record failed (retried later): %s", exc)
                self._refresh_at(replica.block.packed, published, now + max(RETRY_MS, ttl // 10))
                return
            if self._blocks.get(replica.block.packed) is published:
                published.record = record
                # refresh at a third
                self._refresh_at(replica.block.packed, published, now + max(1, granted // 3))

    async def withdraw(self, key: TrackKey) -> None:
        """Forget the track's replica; withdraw its record first when it was published (a
        publication still under way finishes, then is withdrawn), and publish another cached
        replica of the block in its place, if there is one."""
        replica = self._replicas.pop(key, None)
        if replica is None:
            return
        packed = replica.block.packed
        tracks = self._of_block.get(packed)
        if tracks is not None:
            tracks.pop(key, None)
            if not tracks:
                del self._of_block[packed]
        published = self._blocks.get(packed)
        if published is None or published.replica.key != key:
            return
        if self.index is not None:
            block = replica.block
            async with self._lock:  # a publication of this replica under way ends first
                if self._blocks.get(packed) is published:
                    del self._blocks[packed]
                if published.record is not None:
                    try:
                        await self.index.withdraw(
                            block.compat_id, block.scope_id, block.block_key, self.holder_url
                        )
                    except (KVSPError, OSError) as exc:
                        log.warning("withdrawing a record failed (it expires at the IS): %s", exc)
        else:
            del self._blocks[packed]
        await self._promote(packed)

    async def _promote(self, packed: bytes) -> None:
        """Publish another cached replica of the same block, if any (found by the block, not
        by a scan of the cache: a full cache withdraws a record for every block it admits)."""
        tracks = self._of_block.get(packed)
        if not tracks or packed in self._blocks:
            return
        other = self._replicas[next(iter(tracks))]
        published = self._blocks[packed] = _Published(other)
        self._refresh_at(packed, published, self.clock.now_ms() + RETRY_MS)
        await self.publish(other.key)

    def due(self) -> list[TrackKey]:
        """Tracks whose records are due for a refresh (or a retried first publication). Each
        stays due, and is named again, until :meth:`publish` moves its refresh on or the
        block goes."""
        now = self.clock.now_ms()

        def current(packed: bytes) -> _Published | None:
            due = self._due_ms(packed)
            return self._blocks[packed] if due is not None and due <= now else None

        found = _come(self._refreshes, now, current)
        return [published.replica.key for published in found.values()]

    def expired(self) -> list[TrackKey]:
        """Tracks whose MAX_CACHE_DURATION has passed; each is named again until it is
        withdrawn."""
        now = self.clock.now_ms()

        def current(key: TrackKey) -> KVReplica | None:
            expires = self._expires_ms(key)
            return self._replicas[key] if expires is not None and expires <= now else None

        return list(_come(self._expiries, now, current))

    async def close(self) -> None:
        """Withdraw every published record (the relay is stopping)."""
        for key in list(self._replicas):
            with contextlib.suppress(Exception):
                await self.withdraw(key)

    # --- leases (spec §6.6) --------------------------------------------------------------------

    def _held(self, request: LeaseRequest) -> dict[bytes, KVReplica]:
        found: dict[bytes, KVReplica] = {}
        for i, key in enumerate(request.block_keys):
            packed = request.compat_id + request.scope_id + key
            published = self._blocks.get(packed)
            if published is None:
                raise NotFound("this relay does not hold the block", path=f"$.block_keys[{i}]")
            found[packed] = published.replica
        return found

    def grant(self, principal: Principal, request: LeaseRequest) -> LeaseGrant:
        """Lease held blocks for ``principal``; the granted TTL is at most what is left of the
        shortest MAX_CACHE_DURATION among them.

        Raises:
            Forbidden: the principal may not use the scope.
            NotFound: a listed block is not held.
            LeaseQuota: over the principal's quota.
        """
        require_scope(principal, request.scope_id)
        held = self._held(request)
        now = self.clock.now_ms()
        ttl = request.ttl_ms
        for replica in held.values():
            if replica.expires_ms is not None:
                ttl = min(ttl, max(1, replica.expires_ms - now))
        sizes = {packed: replica.size for packed, replica in held.items()}
        lease = self.leases.grant(principal.name, sizes, ttl, now)
        return LeaseGrant(lease=lease.id, ttl_ms=ttl, block_keys=request.block_keys)

    def renew(self, principal: Principal, lease_id: str, renewal: LeaseRenewal) -> LeaseGrant:
        """Renew one of the principal's leases.

        Raises:
            NotFound: no such unexpired lease of this principal.
            LeaseQuota: ``ttl_ms`` over the maximum.
        """
        lease = self.leases.renew(lease_id, principal.name, renewal.ttl_ms, self.clock.now_ms())
        keys = tuple(BlockKey(k[48:]) for k in sorted(lease.keys))
        return LeaseGrant(lease=lease.id, ttl_ms=renewal.ttl_ms, block_keys=keys)

    def release(self, principal: Principal, lease_id: str) -> None:
        """Release one of the principal's leases.

        Raises:
            NotFound: no such unexpired lease of this principal.
        """
        self.leases.release(lease_id, principal.name, self.clock.now_ms())
