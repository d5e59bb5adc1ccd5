"""The in-memory replica store, the embedded default behind the Index Service (spec §6.1 TTLs,
§6.2 prefix lookup, §6.3 epochs; DESIGN.md §1).

Layout, chosen so that no call scans the store:

* ``(compat_id, scope_id)`` → ``block_key`` → ``holder_id`` → ``(record, expires_ms)``: a lookup
  is one dict probe for the group and one per key;
* ``scope_id`` → the compat ids with a group in that scope, for the mismatch hint (a scope holds
  a handful of compat ids, so the hint probes each group for the key);
* a heap of ``(expires_ms, compat_id, scope_id, key, holder_id)``. A refresh pushes a new entry
  and leaves the old one behind; :meth:`MemoryStore.sweep` pops at most ``max_items`` entries
  per call and skips those whose expiry no longer matches the stored record. When stale entries
  outnumber the records (the heap holds more than twice as many entries as records, plus
  :data:`HEAP_SLACK`), the heap is rebuilt from the records: frequent refreshes would otherwise
  keep one entry per refresh for up to the IS's maximum TTL, and memory would grow with the
  refresh rate. A rebuild is linear in the records and comes after at least as many refreshes,
  so a refresh costs amortised O(log n).

Each holder's records are counted (``holder_id`` → records), so that a put can refuse a
holder's record beyond its quota in O(1); the count includes expired records not yet swept.
Each holder's keys are indexed too (``holder_id`` → group → keys), so that withdrawing all
records of a holder (an instance that failed or ended, spec §6.3) touches only its records.

Identifier octets that repeat across records (compat and scope ids, holder ids) are interned, so
a million records cost their records and a few small containers each, not copies of the ids.
Expired records are never returned, swept or not.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from kvsp.fields import UINT64_MAX as _UINT64_MAX
from kvsp.index import HolderCensus, StoredReplica, holder_id_of
from kvsp.records import InstanceStatusRecord, ReplicaRecord

_Holders = dict[bytes, StoredReplica]
_Group = dict[bytes, _Holders]
_HeapEntry = tuple[int, bytes, bytes, bytes, bytes]

HEAP_SLACK = 1024
"""Stale expiry entries tolerated beyond one per record before the heap is rebuilt."""


def _any_live(holders: Iterable[StoredReplica], now_ms: int) -> bool:
    return any(expires > now_ms for _, expires in holders)


class MemoryStore:
    """A :class:`~kvsp.index.ReplicaStore` in this process's memory (single event loop;
    every method runs to completion without awaiting)."""

    def __init__(self) -> None:
        self._groups: dict[tuple[bytes, bytes], _Group] = {}
        self._scope_compats: dict[bytes, set[bytes]] = {}
        self._heap: list[_HeapEntry] = []
        self._count = 0
        self._per_holder: dict[bytes, int] = {}
        self._holder_keys: dict[bytes, dict[tuple[bytes, bytes], set[bytes]]] = {}
        self._interned: dict[bytes, bytes] = {}
        self._statuses: dict[str, tuple[InstanceStatusRecord, int]] = {}
        self._epochs: dict[str, int] = {}

    def _intern(self, value: bytes) -> bytes:
        return self._interned.setdefault(value, value)

    def _put(self, record: ReplicaRecord, expires_ms: int, quota: int | None = None) -> bool:
        compat = self._intern(record.compat_id)
        scope = self._intern(record.scope_id)
        holder = self._intern(holder_id_of(record.holder))
        group = self._groups.get((compat, scope))
        if quota is not None and self._per_holder.get(holder, 0) >= quota:
            known = group is not None and holder in group.get(record.block_key, ())
            if not known:
                return False  # a new record beyond the holder's quota; a refresh passes
        if group is None:
            group = self._groups[(compat, scope)] = {}
            self._scope_compats.setdefault(scope, set()).add(compat)
        key = record.block_key
        holders = group.get(key)
        if holders is None:
            holders = group[key] = {}
        if holder not in holders:
            self._count += 1
            self._per_holder[holder] = self._per_holder.get(holder, 0) + 1
            self._holder_keys.setdefault(holder, {}).setdefault((compat, scope), set()).add(key)
        holders[holder] = (record, expires_ms)
        heapq.heappush(self._heap, (expires_ms, compat, scope, key, holder))
        if len(self._heap) > 2 * self._count + HEAP_SLACK:
            self._rebuild_heap()
        return True

    def _rebuild_heap(self) -> None:
        """One entry per stored record, at its current expiry; the stale entries go."""
        heap: list[_HeapEntry] = [
            (expires, compat, scope, key, holder)
            for (compat, scope), group in self._groups.items()
            for key, holders in group.items()
            for holder, (_, expires) in holders.items()
        ]
        heapq.heapify(heap)
        self._heap = heap

    async def put(self, record: ReplicaRecord, expires_ms: int) -> None:
        """Store or refresh ``record`` until ``expires_ms``."""
        self._put(record, expires_ms)

    async def put_many(
        self, items: Sequence[StoredReplica], *, max_per_holder: int | None = None
    ) -> list[bool]:
        """Store or refresh several records; per item, whether it was stored (a new record
        beyond ``max_per_holder`` of its holder's is not)."""
        return [self._put(record, expires_ms, max_per_holder) for record, expires_ms in items]

    def _remove(
        self, compat: bytes, scope: bytes, key: bytes, holder: bytes, expires: int | None
    ) -> bool:
        """Remove one entry (only if its expiry is ``expires``, when given); prune empty maps."""
        group = self._groups.get((compat, scope))
        if group is None:
            return False
        holders = group.get(key)
        if holders is None:
            return False
        entry = holders.get(holder)
        if entry is None or (expires is not None and entry[1] != expires):
            return False
        del holders[holder]
        self._count -= 1
        left = self._per_holder[holder] - 1
        if left:
            self._per_holder[holder] = left
            groups = self._holder_keys[holder]
            keys = groups[(compat, scope)]
            keys.discard(key)
            if not keys:
                del groups[(compat, scope)]
        else:
            del self._per_holder[holder]
            del self._holder_keys[holder]
        if not holders:
            del group[key]
            if not group:
                del self._groups[(compat, scope)]
                compats = self._scope_compats[scope]
                compats.discard(compat)
                if not compats:
                    del self._scope_compats[scope]
        return True

    async def delete(self, compat_id: bytes, scope_id: bytes, key: bytes, holder_id: bytes) -> bool:
        """Remove one holder's record for a key; whether there was one."""
        return self._remove(compat_id, scope_id, key, holder_id, None)

    async def delete_holder(self, holder_id: bytes, *, published_before: int | None = None) -> int:
        """Remove every record of the holder ``holder_id`` (expired ones not yet swept
        included), or only those last published (``expires_ms - ttl_ms``) before
        ``published_before``; returns how many went. Linear in that holder's records only."""
        groups = self._holder_keys.get(holder_id, {})
        doomed = []
        for (compat, scope), keys in groups.items():
            group = self._groups[(compat, scope)]
            for key in keys:
                record, expires = group[key][holder_id]
                if published_before is None or expires - record.ttl_ms < published_before:
                    doomed.append((compat, scope, key))
        for compat, scope, key in doomed:
            self._remove(compat, scope, key, holder_id, None)
        return len(doomed)

    async def lookup(
        self, compat_id: bytes, scope_id: bytes, keys: Sequence[bytes], now_ms: int
    ) -> list[list[StoredReplica]]:
        """The live records of the leading ``keys``, stopping at the first key without one."""
        group = self._groups.get((compat_id, scope_id))
        found: list[list[StoredReplica]] = []
        if group is None:
            return found
        for key in keys:
            holders = group.get(key)
            if holders is None:
                break
            live = [entry for entry in holders.values() if entry[1] > now_ms]
            if not live:
                break
            found.append(live)
        return found

    async def compats_with_key(self, scope_id: bytes, key: bytes, now_ms: int) -> set[bytes]:
        """The compat ids under which ``key`` has a live record in ``scope_id``."""
        out = set()
        for compat in self._scope_compats.get(scope_id, ()):
            holders = self._groups[(compat, scope_id)].get(key)
            if holders and _any_live(holders.values(), now_ms):
                out.add(compat)
        return out

    async def compats_in_scope(self, scope_id: bytes, now_ms: int) -> set[bytes]:
        """The compat ids with a live record in ``scope_id`` (stops at the first live record of
        each group, so it is quick unless a group is all expired and not yet swept)."""
        out = set()
        for compat in self._scope_compats.get(scope_id, ()):
            group = self._groups[(compat, scope_id)]
            if any(_any_live(holders.values(), now_ms) for holders in group.values()):
                out.add(compat)
        return out

    async def sweep(self, now_ms: int, max_items: int) -> int:
        """Pop at most ``max_items`` due expiry entries; returns how many records went."""
        heap = self._heap
        removed = 0
        for _ in range(max_items):
            if not heap or heap[0][0] > now_ms:
                break
            expires, compat, scope, key, holder = heapq.heappop(heap)
            removed += self._remove(compat, scope, key, holder, expires)
        return removed

    async def count(self) -> int:
        """How many replica records are stored."""
        return self._count

    async def holders(self, now_ms: int) -> list[HolderCensus]:
        """Live records and octets per holder (:class:`~kvsp.index.ReplicaCensus`): one
        pass over every record, so an operator's call, not one for each request."""
        tally: dict[str, tuple[int, int]] = {}
        for group in self._groups.values():
            for holders in group.values():
                for record, expires in holders.values():
                    if expires > now_ms:
                        count, octets = tally.get(record.holder, (0, 0))
                        tally[record.holder] = (count + 1, octets + record.size)
        # record sizes are client-declared uint64 values: their sum saturates at the uint64
        # maximum so the answer stays a JSON integer every reader can take
        return [(h, n, min(octets, _UINT64_MAX)) for h, (n, octets) in sorted(tally.items())]

    def pending_expiries(self) -> int:
        """How many expiry entries (live and stale) wait in the heap; for tests and metrics."""
        return len(self._heap)

    async def put_status(
        self, record: InstanceStatusRecord, expires_ms: int, *, poisoned_above: int | None = None
    ) -> bool:
        """Store an instance's status; ``False`` when its epoch is below the highest seen and
        that one is not above ``poisoned_above``."""
        highest = self._epochs.get(record.instance)
        poisoned = highest is not None and poisoned_above is not None and highest > poisoned_above
        if highest is not None and record.epoch < highest and not poisoned:
            return False  # §6.3: discard records with an epoch lower than the highest seen
        self._epochs[record.instance] = record.epoch
        self._statuses[record.instance] = (record, expires_ms)
        return True

    async def statuses(self, instances: Sequence[str], now_ms: int) -> list[InstanceStatusRecord]:
        """The live status records of ``instances`` that have one, in that order."""
        out = []
        for name in instances:
            entry = self._statuses.get(name)
            if entry is not None and entry[1] > now_ms:
                out.append(entry[0])
        return out
