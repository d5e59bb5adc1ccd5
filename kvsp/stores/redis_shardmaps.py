"""Shard Map versions in Redis (spec §6.9 "Version v remains authoritative until all instances
have acknowledged"; DESIGN.md §1 "the scale-out path"): PC processes sharing one Redis share
every map's current and pending version.

:class:`RedisShardMaps` answers exactly as :class:`~kvsp.stores.shardmaps.MemoryShardMaps`;
each method is one Lua script, so ``begin`` (pending only from the current version, only when
no live pending version exists, the expiry judged on the caller's ``now_ms``), ``commit`` and
``abort`` (only by the attempt that began it) are each one atomic step across processes.

One hash per map, ``P:{m:<map name, UTF-8, hex>}:map``, its name in the hash tag so that a
Redis Cluster keeps each map's state on one slot: fields ``current`` (JSON), ``version`` (the
current version, decimal), and while a change is pending ``pending`` (JSON), ``pversion``,
``attempt`` and ``expires`` (ms).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from kvsp.records_shard import ShardMap
from kvsp.stores.redis_sessions import ScriptedStore, octets
from kvsp.stores.shardmaps import BeginOutcome, Pending, ShardMapState

__all__ = ["RedisShardMaps"]

# KEYS: map hash. ARGV: version, JSON. 1 when created, 0 when the name is taken.
_CREATE = """
if redis.call('HSETNX', KEYS[1], 'current', ARGV[2]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'version', ARGV[1])
return 1
"""

# KEYS: map hash. ARGV: proposed version, JSON, attempt, expires, now.
_BEGIN = """
local version = redis.call('HGET', KEYS[1], 'version')
if not version then return 'unknown' end
if tonumber(ARGV[1]) ~= tonumber(version) + 1 then return 'stale' end
local expires = redis.call('HGET', KEYS[1], 'expires')
if expires and tonumber(ARGV[5]) < tonumber(expires) then return 'busy' end
redis.call('HSET', KEYS[1], 'pending', ARGV[2], 'pversion', ARGV[1], 'attempt', ARGV[3],
  'expires', ARGV[4])
return 'started'
"""

# KEYS: map hash. ARGV: version, attempt, '1' to commit or '0' to abort. 1 when done.
_FINISH = """
local p = redis.call('HMGET', KEYS[1], 'pending', 'pversion', 'attempt')
if not p[1] or p[3] ~= ARGV[2] or tonumber(p[2]) ~= tonumber(ARGV[1]) then return 0 end
if ARGV[3] == '1' then redis.call('HSET', KEYS[1], 'current', p[1], 'version', p[2]) end
redis.call('HDEL', KEYS[1], 'pending', 'pversion', 'attempt', 'expires')
return 1
"""


def _encode(shard_map: ShardMap) -> str:
    return json.dumps(shard_map.to_json(), separators=(",", ":"))


def _decode(raw: Any) -> ShardMap:
    return ShardMap.from_json(json.loads(raw))


class RedisShardMaps(ScriptedStore):
    """A :class:`~kvsp.stores.shardmaps.ShardMapStore` in Redis, shared by PC processes; see the
    module docstring. Every method raises :class:`~kvsp.errors.StoreUnavailable` when Redis
    fails."""

    SCRIPTS: ClassVar[dict[str, str]] = {"create": _CREATE, "begin": _BEGIN, "finish": _FINISH}

    def _key(self, map_name: str) -> str:
        return f"{self._prefix}:{{m:{map_name.encode().hex()}}}:map"

    async def create(self, shard_map: ShardMap) -> bool:
        """Store a new map; ``False`` when the name is taken."""
        created = await self._redis.run(
            "create", [self._key(shard_map.map)], [shard_map.version, _encode(shard_map)]
        )
        return bool(created)

    async def get(self, map_name: str, now_ms: int) -> ShardMapState | None:
        """The map's state without an expired pending version, or ``None`` (one round trip)."""
        client = self._redis.client()
        with self._redis.mapped():
            fields = await client.hmget(
                self._key(map_name), ["current", "pending", "attempt", "expires"]
            )
        current, pending, attempt, expires = (octets(v) for v in fields)
        if current is None:
            return None
        live = None
        if (
            pending is not None
            and attempt is not None
            and expires is not None
            and now_ms < int(expires)
        ):
            live = Pending(
                shard_map=_decode(pending), attempt=attempt.decode(), expires_ms=int(expires)
            )
        return ShardMapState(current=_decode(current), pending=live)

    async def begin(
        self, proposed: ShardMap, attempt: str, expires_ms: int, now_ms: int
    ) -> BeginOutcome:
        """Compare-and-set: pending only from the current version, one live change at a time."""
        outcome = await self._redis.run(
            "begin",
            [self._key(proposed.map)],
            [proposed.version, _encode(proposed), attempt, expires_ms, now_ms],
        )
        return BeginOutcome(outcome.decode() if isinstance(outcome, bytes) else outcome)

    async def commit(self, map_name: str, version: int, attempt: str) -> bool:
        """The pending version of ``attempt`` becomes current."""
        done = await self._redis.run("finish", [self._key(map_name)], [version, attempt, "1"])
        return bool(done)

    async def abort(self, map_name: str, version: int, attempt: str) -> bool:
        """The pending version of ``attempt`` is dropped; the current one stays."""
        done = await self._redis.run("finish", [self._key(map_name)], [version, attempt, "0"])
        return bool(done)
