"""The Shard Map store behind the PC (spec §6.9 "Version v remains authoritative until all
instances have acknowledged"; DESIGN.md §1: the PC's durable state lives in a store, in memory
or in Redis).

:class:`ShardMapStore` is deliberately narrow: each method is one rule answered in one call, so
that a Redis store can make each one a single atomic script. A map has one *current* version
(the authoritative one, what a GET returns) and at most one *pending* version, begun only from
the current one (compare-and-set on the version) and then either committed (it becomes current)
or aborted (it is dropped). A pending version carries an ``attempt`` identifier and an absolute
expiry: commit and abort must name the attempt, so a coordinator that lost its pending version
(it outlived its expiry and another change began) can neither commit nor abort the newer one,
and a PC that died mid-change does not block the map past the expiry. :class:`MemoryShardMaps`
is the in-memory implementation.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from kvsp.records_shard import ShardMap


class BeginOutcome(enum.Enum):
    """What :meth:`ShardMapStore.begin` did."""

    STARTED = "started"
    """The proposed version is now pending."""
    UNKNOWN = "unknown"
    """No such map."""
    STALE = "stale"
    """The proposed version is not the current version + 1."""
    BUSY = "busy"
    """Another version is pending and has not expired."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Pending:
    """A version being moved to (§6.9), begun by one coordinator attempt."""

    shard_map: ShardMap
    attempt: str
    expires_ms: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardMapState:
    """A map's current (authoritative) version and the live pending one, if any."""

    current: ShardMap
    pending: Pending | None


class ShardMapStore(Protocol):
    """Shard maps with a current version and at most one pending version (§6.9)."""

    async def create(self, shard_map: ShardMap) -> bool:
        """Store a new map as its current version; ``False`` (nothing stored) when the name is
        taken."""
        ...

    async def get(self, map_name: str, now_ms: int) -> ShardMapState | None:
        """The map's state (a pending version past its expiry is left out), or ``None``."""
        ...

    async def begin(
        self, proposed: ShardMap, attempt: str, expires_ms: int, now_ms: int
    ) -> BeginOutcome:
        """Make ``proposed`` pending, only if its version is the current version + 1 and no
        other pending version is live (an expired one is replaced)."""
        ...

    async def commit(self, map_name: str, version: int, attempt: str) -> bool:
        """Make the pending ``version`` of ``attempt`` current (expired or not, as long as no
        other attempt replaced it); ``False`` when there is no such pending version."""
        ...

    async def abort(self, map_name: str, version: int, attempt: str) -> bool:
        """Drop the pending ``version`` of ``attempt``; ``False`` when there is none."""
        ...


class MemoryShardMaps:
    """A :class:`ShardMapStore` in this process's memory (single event loop; every method runs
    to completion without awaiting, so each rule is atomic)."""

    def __init__(self) -> None:
        self._current: dict[str, ShardMap] = {}
        self._pending: dict[str, Pending] = {}

    async def create(self, shard_map: ShardMap) -> bool:
        """Store a new map; ``False`` when the name is taken."""
        if shard_map.map in self._current:
            return False
        self._current[shard_map.map] = shard_map
        return True

    async def get(self, map_name: str, now_ms: int) -> ShardMapState | None:
        """The map's state without an expired pending version, or ``None``."""
        current = self._current.get(map_name)
        if current is None:
            return None
        return ShardMapState(current=current, pending=self._live_pending(map_name, now_ms))

    def _live_pending(self, map_name: str, now_ms: int) -> Pending | None:
        pending = self._pending.get(map_name)
        return pending if pending is not None and now_ms < pending.expires_ms else None

    async def begin(
        self, proposed: ShardMap, attempt: str, expires_ms: int, now_ms: int
    ) -> BeginOutcome:
        """Compare-and-set: pending only from the current version, one live change at a time."""
        current = self._current.get(proposed.map)
        if current is None:
            return BeginOutcome.UNKNOWN
        if proposed.version != current.version + 1:
            return BeginOutcome.STALE
        if self._live_pending(proposed.map, now_ms) is not None:
            return BeginOutcome.BUSY
        self._pending[proposed.map] = Pending(
            shard_map=proposed, attempt=attempt, expires_ms=expires_ms
        )
        return BeginOutcome.STARTED

    async def commit(self, map_name: str, version: int, attempt: str) -> bool:
        """The pending version of ``attempt`` becomes current."""
        pending = self._pending.get(map_name)
        if pending is None or pending.attempt != attempt or pending.shard_map.version != version:
            return False
        del self._pending[map_name]
        self._current[map_name] = pending.shard_map
        return True

    async def abort(self, map_name: str, version: int, attempt: str) -> bool:
        """The pending version of ``attempt`` is dropped; the current one stays."""
        pending = self._pending.get(map_name)
        if pending is None or pending.attempt != attempt or pending.shard_map.version != version:
            return False
        del self._pending[map_name]
        return True
