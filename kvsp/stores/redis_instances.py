"""The PC's instance registry in Redis (spec §6.3; DESIGN.md §1 "the scale-out path"): any
number of PC processes share one table of instances through one Redis.

:class:`RedisInstanceStore` answers exactly as
:class:`~kvsp.stores.instances.MemoryInstanceStore`: the rules are the pure transitions of
:mod:`kvsp.lifecycle`, applied to the stored entry, and the result is written by one Lua
script that is a compare-and-set on the entry read (the stored JSON, octet for octet). When
another PC changed the entry in between, the script writes nothing and the update reads
again and re-decides, so every write is one atomic step taken on the entry it was decided on:
a record's epoch is always checked against the stored epoch, and of two sweeps that find one
instance expired exactly one marks it failed (the other re-reads a failed entry and finds
nothing due), so exactly one PC starts the §6.8 move of its sessions.

Keys (``P`` the prefix). The key carries the hash tag ``{instances}``, so on a Redis Cluster
the whole table is on one slot: a PC reads it for every placement, in one ``HGETALL``, and a
deployment has hundreds of instances, not millions:

==================================== ======== ============================================
``P:{instances}:e``                  hash     instance URI → entry JSON
                                              (:func:`~kvsp.stores.instances.entry_to_json`)
==================================== ======== ============================================
"""

from __future__ import annotations

from typing import ClassVar

from kvsp.errors import RecordError, StoreUnavailable
from kvsp.stores.instances import Decide, Entry, T, entry_from_json, entry_to_json
from kvsp.stores.redis import DEFAULT_PREFIX
from kvsp.stores.redis_sessions import MAX_TRIES, ScriptedStore, octets

__all__ = ["RedisInstanceStore"]

# KEYS: e. ARGV: instance URI, old JSON ('' = must be absent), new JSON ('' = remove). 1 when
# written, 0 when the stored entry is not the one the caller read.
_CAS = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if ARGV[2] == '' then
  if cur then return 0 end
elseif cur ~= ARGV[2] then
  return 0
end
if ARGV[3] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
end
return 1
"""


def _decode(raw: bytes | str) -> Entry:
    try:
        return entry_from_json(raw)
    except RecordError as exc:
        raise StoreUnavailable(f"Redis instance store: {exc}") from exc


class RedisInstanceStore(ScriptedStore):
    """An :class:`~kvsp.stores.instances.InstanceStore` in Redis, shared by any number of PC
    processes; see the module docstring for the key and how each write is atomic.

    Every method raises :class:`~kvsp.errors.StoreUnavailable` when Redis fails.
    """

    SCRIPTS: ClassVar[dict[str, str]] = {"cas": _CAS}

    def __init__(self, url: str, *, prefix: str = DEFAULT_PREFIX) -> None:
        super().__init__(url, prefix=prefix)
        self._key = f"{prefix}:{{instances}}:e"
        self.conflicts = 0
        """Compare-and-set attempts lost to another writer (for tests and metrics)."""
        self._decoded: dict[bytes, Entry] = {}  # the stored JSON of each entry last read

    async def _raw(self, instance: str) -> bytes | None:
        client = self._redis.client()
        with self._redis.mapped():
            raw = await client.hget(self._key, instance)
        return octets(raw)

    async def get(self, instance: str) -> Entry | None:
        """The entry of ``instance``, or ``None`` (one ``HGET``)."""
        raw = await self._raw(instance)
        return None if raw is None else _decode(raw)

    async def entries(self) -> list[Entry]:
        """Every entry, sorted by URI (one ``HGETALL``); entries whose stored JSON did not
        change since the last call are not decoded again (a PC reads the table per placement,
        and most instances change once per status period)."""
        client = self._redis.client()
        with self._redis.mapped():
            found = await client.hgetall(self._key)
        known, self._decoded = self._decoded, {}
        for raw in found.values():
            data = octets(raw) or b""
            entry = known.get(data)
            self._decoded[data] = entry if entry is not None else _decode(data)
        return sorted(self._decoded.values(), key=lambda e: e.instance)

    async def update(self, instance: str, decide: Decide[T]) -> T:
        """Apply ``decide`` to the stored entry by compare-and-set, re-reading and re-deciding
        when another writer changed it meanwhile.

        Raises:
            StoreUnavailable: Redis failed, or the entry changed under ``MAX_TRIES`` attempts.
        """
        for _ in range(MAX_TRIES):
            raw = await self._raw(instance)
            current = None if raw is None else _decode(raw)
            new, answer = decide(current)
            if new is current or (new is None and current is None):
                return answer
            text = "" if new is None else entry_to_json(new)
            if octets(text) == raw:
                return answer
            old = b"" if raw is None else raw
            if await self._redis.run("cas", [self._key], [instance, old, text]):
                return answer
            self.conflicts += 1
        raise StoreUnavailable(f"instance {instance}: {MAX_TRIES} conflicting writes in a row")
