"""Leases on held replicas with per-client quotas (spec §6.6).

Sans-I/O: the table never reads a clock or a random source; every call takes ``now_ms`` and
lease identifiers come from an injected ``new_id``. A lease is valid while
``now_ms < expires_ms``: it ends *exactly at* ``expires_ms`` (the end is exclusive), so a lease
granted at ``t`` with ``ttl_ms`` covers ``[t, t + ttl_ms)``.

Time in the table never runs backward: a ``now_ms`` earlier than one already seen is taken as
the latest seen, so a lease that once expired stays expired. Every call first removes the leases
that have expired (amortised O(log n) each, by a heap); :meth:`LeaseTable.expire` returns them
all, including those removed on the way by other calls, so the caller can act on each exactly
once. Per-key reference counts make :meth:`LeaseTable.is_leased` O(1); grant and release are
O(keys of the lease).

Besides the per-client quota (§6.6 MUST), a holder bounds the octets leased by all clients
together (:attr:`LeaseQuota.max_octets_total`), so that leases can never pin its whole capacity:
:func:`capacity_quota` derives both from the holder's capacity (a client may lease a quarter of
it, all clients together half of it), which leaves room for other principals' stores however
many clients lease.
"""

from __future__ import annotations

import heapq
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from kvsp.errors import BadRequest, NotFound
from kvsp.errors import LeaseQuota as LeaseQuotaExceeded


def random_lease_id() -> str:
    """A lease identifier of 16 random octets, as 32 lowercase hex digits."""
    return secrets.token_hex(16)


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseQuota:
    """A holder's per-client lease limits (§6.6 "per-client quota on leased octets and lease
    TTL"); going past any of them is the problem ``kvsp-lease-quota``.

    Raises:
        ValueError: a limit that is not a positive integer.
    """

    max_octets_per_client: int
    max_ttl_ms: int
    max_leases_per_client: int
    max_octets_total: int | None = None
    """Octets leased by all clients together; ``None``: no holder-wide bound."""

    def __post_init__(self) -> None:
        for name in ("max_octets_per_client", "max_ttl_ms", "max_leases_per_client"):
            _check_positive(name, getattr(self, name))
        if self.max_octets_total is not None:
            _check_positive("max_octets_total", self.max_octets_total)

    def bounded(self, capacity: int) -> LeaseQuota:
        """This quota with its holder-wide bound at most :data:`TOTAL_SHARE` of ``capacity``
        octets (the sum of the holder's tier budgets), and no client allowed more than that."""
        cap = max(1, capacity // TOTAL_SHARE)
        total = cap if self.max_octets_total is None else min(self.max_octets_total, cap)
        return replace(
            self,
            max_octets_total=total,
            max_octets_per_client=min(self.max_octets_per_client, total),
        )


CLIENT_SHARE = 4
"""By default a client may lease a quarter of a holder's capacity."""
TOTAL_SHARE = 2
"""All clients together may lease at most half of a holder's capacity: whatever is leased, some
tier keeps at least half of its budget evictable, so a store of a block up to that size
always finds room."""


def capacity_quota(
    capacity: int,
    *,
    max_ttl_ms: int,
    max_leases_per_client: int,
    max_octets_per_client: int | None = None,
) -> LeaseQuota:
    """The lease quota of a holder with ``capacity`` octets in all its tiers: per client
    ``max_octets_per_client`` (default a :data:`CLIENT_SHARE` of the capacity), all clients
    together at most a :data:`TOTAL_SHARE` of it.

    Raises:
        ValueError: a limit that is not a positive integer.
    """
    per_client = max_octets_per_client
    if per_client is None:
        per_client = max(1, capacity // CLIENT_SHARE)
    quota = LeaseQuota(
        max_octets_per_client=per_client,
        max_ttl_ms=max_ttl_ms,
        max_leases_per_client=max_leases_per_client,
    )
    return quota.bounded(capacity)


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Lease:
    """One lease (§6.6): its client, the block keys it covers, their octets, and its end."""

    id: str
    client: str
    keys: frozenset[bytes]
    octets: int
    expires_ms: int

    def is_valid(self, now_ms: int) -> bool:
        """Whether the lease still holds at ``now_ms`` (it ends exactly at ``expires_ms``)."""
        return now_ms < self.expires_ms


class LeaseTable:
    """All leases of one holder, with per-client quotas and per-key reference counts (§6.6)."""

    def __init__(self, quota: LeaseQuota, new_id: Callable[[], str] = random_lease_id) -> None:
        self.quota = quota
        self._new_id = new_id
        self._now_ms: int | None = None
        self._leases: dict[str, Lease] = {}
        self._by_client: dict[str, dict[str, None]] = {}  # client → its lease ids, in order
        self._octets: dict[str, int] = {}  # client → leased octets
        self._total = 0  # octets of every unexpired lease
        self._refs: dict[bytes, int] = {}  # key → number of leases covering it
        self._deadlines: list[tuple[int, str]] = []  # (expires_ms, id); stale after renew
        self._expired: list[Lease] = []  # removed, not yet reported by expire()

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, client: str, sizes: Mapping[bytes, int], ttl_ms: int, now_ms: int) -> Lease:
        """Create a lease for ``client`` on the keys of ``sizes`` (key → octets held).

        Octets count per lease: two leases on one key count its octets twice.

        Raises:
            BadRequest: no keys, a negative size, or ``ttl_ms`` not positive.
            LeaseQuota: ``ttl_ms`` over the maximum, or the client's unexpired leases would
                pass its octet or lease-count quota (§6.6 MUST), or all clients' leases the
                holder-wide bound.
        """
        now = self._advance(now_ms)
        if not sizes:
            raise BadRequest("a lease covers at least one block key", path="$.block_keys")
        if any(not isinstance(n, int) or n < 0 for n in sizes.values()):
            raise BadRequest("block sizes are non-negative integers")
        self._check_ttl(ttl_ms)
        octets = sum(sizes.values())
        self._check_quota(client, octets)
        lease = Lease(
            id=self._fresh_id(),
            client=client,
            keys=frozenset(bytes(k) for k in sizes),
            octets=octets,
            expires_ms=now + ttl_ms,
        )
        self._add(lease)
        return lease

    def renew(self, lease_id: str, client: str, ttl_ms: int, now_ms: int) -> Lease:
        """Extend (or shorten) a lease to end ``ttl_ms`` from now.

        Raises:
            NotFound: no such unexpired lease of this client (another client's lease is not
                found either, so existence does not leak).
            BadRequest: ``ttl_ms`` not positive.
            LeaseQuota: ``ttl_ms`` over the maximum.
        """
        now = self._advance(now_ms)
        lease = self._owned(lease_id, client)
        self._check_ttl(ttl_ms)
        renewed = replace(lease, expires_ms=now + ttl_ms)
        self._leases[lease_id] = renewed
        heapq.heappush(self._deadlines, (renewed.expires_ms, lease_id))
        return renewed

    def release(self, lease_id: str, client: str, now_ms: int) -> Lease:
        """Release a lease before its end; returns it.

        Raises:
            NotFound: no such unexpired lease of this client.
        """
        self._advance(now_ms)
        lease = self._owned(lease_id, client)
        self._remove(lease)
        return lease

    def get(self, lease_id: str, client: str, now_ms: int) -> Lease:
        """The unexpired lease ``lease_id`` of ``client``.

        Raises:
            NotFound: no such unexpired lease of this client.
        """
        self._advance(now_ms)
        return self._owned(lease_id, client)

    def is_leased(self, key: bytes, now_ms: int) -> bool:
        """Whether an unexpired lease covers ``key`` (§6.6: the holder must not evict it)."""
        self._advance(now_ms)
        return key in self._refs

    def leased_keys(self, now_ms: int) -> set[bytes]:
        """Every key covered by an unexpired lease."""
        self._advance(now_ms)
        return set(self._refs)

    def total_octets(self, now_ms: int) -> int:
        """The octets leased by every client's unexpired leases."""
        self._advance(now_ms)
        return self._total

    def octets_of(self, client: str, now_ms: int) -> int:
        """The octets leased by ``client``'s unexpired leases."""
        self._advance(now_ms)
        return self._octets.get(client, 0)

    def leases_of(self, client: str, now_ms: int) -> list[Lease]:
        """``client``'s unexpired leases, oldest grant first."""
        self._advance(now_ms)
        return [self._leases[i] for i in self._by_client.get(client, ())]

    def expire(self, now_ms: int) -> list[Lease]:
        """Remove the leases expired at ``now_ms``; return every lease that expired since the
        previous call (each exactly once), in order of expiry."""
        self._advance(now_ms)
        expired, self._expired = self._expired, []
        return expired

    def _advance(self, now_ms: int) -> int:
        if self._now_ms is None or now_ms > self._now_ms:
            self._now_ms = now_ms
        now = self._now_ms
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            expires_ms, lease_id = heapq.heappop(deadlines)
            lease = self._leases.get(lease_id)
            if lease is not None and lease.expires_ms == expires_ms:  # else renewed or released
                self._remove(lease)
                self._expired.append(lease)
        return now

    def _check_ttl(self, ttl_ms: int) -> None:
        if not isinstance(ttl_ms, int) or isinstance(ttl_ms, bool) or ttl_ms <= 0:
            raise BadRequest("ttl_ms must be a positive integer", path="$.ttl_ms")
        if ttl_ms > self.quota.max_ttl_ms:
            raise LeaseQuotaExceeded(
                f"ttl_ms {ttl_ms} is over the maximum of {self.quota.max_ttl_ms}", path="$.ttl_ms"
            )

    def _check_quota(self, client: str, octets: int) -> None:
        held = self._octets.get(client, 0)
        if held + octets > self.quota.max_octets_per_client:
            raise LeaseQuotaExceeded(
                f"{held} octets leased + {octets} requested is over the quota of "
                f"{self.quota.max_octets_per_client}"
            )
        if len(self._by_client.get(client, ())) >= self.quota.max_leases_per_client:
            raise LeaseQuotaExceeded(
                f"already {self.quota.max_leases_per_client} leases, the most allowed"
            )
        total = self.quota.max_octets_total
        if total is not None and self._total + octets > total:
            # keeps room for other principals' stores, whoever holds the leases
            raise LeaseQuotaExceeded(
                f"{octets} octets requested would pass this holder's bound of {total} octets "
                "leased by all clients together"
            )

    def _fresh_id(self) -> str:
        lease_id = self._new_id()
        if lease_id in self._leases:
            raise RuntimeError("the lease id source repeated an id still in use")
        return lease_id

    def _owned(self, lease_id: str, client: str) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None or lease.client != client:
            raise NotFound("no such lease")
        return lease

    def _add(self, lease: Lease) -> None:
        self._leases[lease.id] = lease
        self._by_client.setdefault(lease.client, {})[lease.id] = None
        self._octets[lease.client] = self._octets.get(lease.client, 0) + lease.octets
        self._total += lease.octets
        for key in lease.keys:
            self._refs[key] = self._refs.get(key, 0) + 1
        heapq.heappush(self._deadlines, (lease.expires_ms, lease.id))

    def _remove(self, lease: Lease) -> None:
        del self._leases[lease.id]
        self._total -= lease.octets
        ids = self._by_client[lease.client]
        del ids[lease.id]
        if ids:
            self._octets[lease.client] -= lease.octets
        else:
            del self._by_client[lease.client]
            del self._octets[lease.client]
        for key in lease.keys:
            count = self._refs[key] - 1
            if count:
                self._refs[key] = count
            else:
                del self._refs[key]
