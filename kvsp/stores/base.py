"""The store behind the Index Service (spec §6.1 replica TTLs, §6.2 prefix lookup, §6.3 status
epochs; DESIGN.md §1: stateless IS processes over an in-memory or Redis store).

:class:`ReplicaStore` is deliberately narrow, so that a Redis store can answer each call in one
round trip: a lookup is one call for the whole prompt, not one per key. Identifiers are raw
octets (``bytes``); a replica is stored under ``(compat_id, scope_id, block_key, holder_id)``
where ``holder_id`` is the 16 octets of ``uri_id(record.holder)`` (DESIGN §3), because a
withdrawal names the holder only by that id. Expiry is absolute milliseconds on the caller's
clock: a record is live while ``now_ms < expires_ms``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvsp.errors import KVSPError
from kvsp.ids import uri_id
from kvsp.records import InstanceStatusRecord, ReplicaRecord

StoredReplica = tuple[ReplicaRecord, int]
"""A stored record with its absolute expiry time in milliseconds."""


class StoreUnavailable(KVSPError):
    """A shared store (Redis) is unreachable or failed (503 ``kvsp-store-unavailable``): the
    service's trouble, never the client's."""

    problem = "kvsp-store-unavailable"
    status = 503
    title = "Store unavailable"


@functools.lru_cache(maxsize=65536)
def holder_id_of(uri: str) -> bytes:
    """The 16 octets that name a holder URI in paths and in the store (``uri_id``, DESIGN §3);
    cached, since a few holders publish most records."""
    return bytes.fromhex(uri_id(uri))


class ReplicaStore(Protocol):
    """Replica records with expiry, and the latest instance status records (§6.1–6.3)."""

    async def put(self, record: ReplicaRecord, expires_ms: int) -> None:
        """Store or refresh ``record`` (its holder's entry for its key) until ``expires_ms``."""
        ...

    async def put_many(self, items: Sequence[StoredReplica]) -> None:
        """Store or refresh several records at once (one round trip)."""
        ...

    async def delete(self, compat_id: bytes, scope_id: bytes, key: bytes, holder_id: bytes) -> bool:
        """Remove one holder's record for a key; whether there was one."""
        ...

    async def lookup(
        self, compat_id: bytes, scope_id: bytes, keys: Sequence[bytes], now_ms: int
    ) -> list[list[StoredReplica]]:
        """The live records of the leading ``keys``, one non-empty list per key, stopping at
        the first key without a live record (§6.2: keys are chained)."""
        ...

    async def compats_with_key(self, scope_id: bytes, key: bytes, now_ms: int) -> set[bytes]:
        """The Compatibility IDs under which ``key`` has a live record in ``scope_id``."""
        ...

    async def compats_in_scope(self, scope_id: bytes, now_ms: int) -> set[bytes]:
        """The Compatibility IDs with at least one live record in ``scope_id``."""
        ...

    async def sweep(self, now_ms: int, max_items: int) -> int:
        """Remove expired records, examining at most ``max_items`` expiry entries; returns how
        many records were removed. Bounded, so a caller can interleave it with requests."""
        ...

    async def count(self) -> int:
        """How many replica records are stored (expired ones not yet swept included)."""
        ...

    async def put_status(self, record: InstanceStatusRecord, expires_ms: int) -> bool:
        """Store an instance's status until ``expires_ms``; ``False`` (and nothing stored) when
        its epoch is lower than the highest seen for that instance (§6.3)."""
        ...

    async def statuses(self, instances: Sequence[str], now_ms: int) -> list[InstanceStatusRecord]:
        """The live status records of those of ``instances`` that have one, in that order."""
        ...


HolderCensus = tuple[str, int, int]
"""One holder's share of the live records: its URI, how many records, their total ``size``."""


@runtime_checkable
class ReplicaCensus(Protocol):
    """A store that can count its live records per holder, for operators (``GET replicas``
    at the IS, ``kvsp status``). Optional: the IS offers the route only over a store that
    has it."""

    async def holders(self, now_ms: int) -> list[HolderCensus]:
        """Every holder with a live record: ``(holder, records, octets)``, by holder URI."""
        ...
