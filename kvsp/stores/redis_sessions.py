"""The PC's session state in Redis (spec §6.8 checkpoints and epochs; DESIGN.md §1 "the
scale-out path"): any number of PC processes share sessions through one Redis.

:class:`RedisSessionStore` answers exactly as
:class:`~kvsp.stores.sessions.MemorySessionStore`: the rules are the same functions of
:mod:`kvsp.sessions`, applied to the stored record, and the result is written by one Lua
script that is a compare-and-set on the record read (the stored JSON, octet for octet). When
another writer changed the record in between, the script writes nothing and the call reads
again and re-applies the rule, so every write is one atomic step taken on the record it was
decided on: a checkpoint of a lower epoch is never kept once the epoch moved on, the kept
checkpoint is the one with the highest ``output_offset`` for the current epoch, and of racing
epoch advances from the same expected epoch exactly one wins (the others re-read, see the new
epoch and get :class:`~kvsp.errors.StaleEpoch`). Reads are one round trip each.

Keys (``P`` the prefix). Every key carries the hash tag ``{sessions}``, so on a Redis Cluster
they share one slot and each script touches one slot only; a session is small and lives for
one generation, so one slot holds many more sessions than a PC serves:

==================================== ======== ============================================
``P:{sessions}:r``                   hash     session id (hex) → record JSON
``P:{sessions}:n``                   hash     session id → holder id (hex) of its instance
``P:{sessions}:i:<holder id hex>``   set      live (serving, resuming) sessions of instance
``P:{sessions}:ul``                  zset     session id → ``updated_ms``, not finished
``P:{sessions}:uf``                  zset     session id → ``updated_ms``, done or failed
==================================== ======== ============================================
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, Self

import redis
import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from kvsp.errors import Conflict, NotFound, StoreUnavailable
from kvsp.index import holder_id_of
from kvsp.records_session import SessionCheckpoint
from kvsp.sessions import (
    FINAL,
    SessionRecord,
    SessionState,
    accept_checkpoint,
    advance_epoch,
    settle,
)
from kvsp.stores.redis import DEFAULT_PREFIX, parse_store_url
from kvsp.stores.sessions import LIVE

__all__ = ["MAX_TRIES", "RedisScripts", "RedisSessionStore", "ScriptedStore", "octets"]

MAX_TRIES = 1_000
"""Compare-and-set attempts before a call gives up (only ever reached under a writer storm on
one session; each failed attempt means another writer succeeded)."""

# KEYS: r, n, ul, uf. ARGV: key base, session hex, old JSON ('' = must be absent), new JSON,
# updated_ms, holder hex, live ('1'/'0'), final ('1'/'0'). 1 when written, 0 when the stored
# record is not the one the caller read.
_CAS = """
local cur = redis.call('HGET', KEYS[1], ARGV[2])
if ARGV[3] == '' then
  if cur then return 0 end
elseif cur ~= ARGV[3] then
  return 0
end
local old_holder = redis.call('HGET', KEYS[2], ARGV[2])
if old_holder then redis.call('SREM', ARGV[1] .. 'i:' .. old_holder, ARGV[2]) end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[4])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[6])
if ARGV[7] == '1' then redis.call('SADD', ARGV[1] .. 'i:' .. ARGV[6], ARGV[2]) end
if ARGV[8] == '1' then
  redis.call('ZREM', KEYS[3], ARGV[2])
  redis.call('ZADD', KEYS[4], ARGV[5], ARGV[2])
else
  redis.call('ZREM', KEYS[4], ARGV[2])
  redis.call('ZADD', KEYS[3], ARGV[5], ARGV[2])
end
return 1
"""

# KEYS: r, n, ul, uf. ARGV: key base, highest updated_ms dropped if not finished, the same if
# finished. How many sessions were dropped.
_EXPIRE = """
local dropped = 0
for z, cutoff in pairs({[KEYS[3]] = ARGV[2], [KEYS[4]] = ARGV[3]}) do
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', z, '-inf', cutoff)) do
    local holder = redis.call('HGET', KEYS[2], id)
    if holder then redis.call('SREM', ARGV[1] .. 'i:' .. holder, id) end
    redis.call('HDEL', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id)
    redis.call('ZREM', z, id)
    dropped = dropped + 1
  end
end
return dropped
"""

# KEYS: r, n, ul, uf. ARGV: limit. The records of the most recently changed sessions: up to
# limit of the unfinished and up to limit of the finished ones (the caller merges them).
_RECENT = """
local ids = redis.call('ZREVRANGE', KEYS[3], 0, ARGV[1] - 1)
for _, id in ipairs(redis.call('ZREVRANGE', KEYS[4], 0, ARGV[1] - 1)) do ids[#ids + 1] = id end
if #ids == 0 then return {} end
return redis.call('HMGET', KEYS[1], unpack(ids))
"""

# KEYS: r. ARGV: key base, holder hex. The records of the instance's live sessions.
_LIVE = """
local ids = redis.call('SMEMBERS', ARGV[1] .. 'i:' .. ARGV[2])
if #ids == 0 then return {} end
return redis.call('HMGET', KEYS[1], unpack(ids))
"""


class RedisScripts:
    """A loop-bound asyncio Redis client and the Lua scripts a store runs on it, with redis-py's
    errors turned into :class:`~kvsp.errors.StoreUnavailable` (shared by the PC stores)."""

    def __init__(self, url: str, scripts: dict[str, str]) -> None:
        self.url = url
        self._sources = scripts
        self._redis: aioredis.Redis | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scripts: dict[str, AsyncScript] = {}

    def client(self) -> aioredis.Redis:
        """The client of the running event loop (made on first use).

        Raises:
            RuntimeError: the client serves another event loop (``aclose`` it first).
        """
        loop = asyncio.get_running_loop()
        if self._redis is None:
            self._redis = aioredis.Redis.from_url(
                self.url, socket_connect_timeout=5.0, socket_timeout=30.0
            )
            self._loop = loop
            self._scripts = {
                name: self._redis.register_script(source) for name, source in self._sources.items()
            }
        elif self._loop is not loop:
            raise RuntimeError("this Redis store serves another event loop; aclose() it first")
        return self._redis

    @contextlib.contextmanager
    def mapped(self) -> Iterator[None]:
        """Turn redis-py's errors into :class:`StoreUnavailable`."""
        try:
            yield
        except redis.RedisError as exc:
            raise StoreUnavailable(f"Redis store: {type(exc).__name__}: {exc}") from exc

    async def run(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run script ``name`` (``EVALSHA``, loading it when Redis lacks it).

        Raises:
            StoreUnavailable: Redis failed.
        """
        client = self.client()
        with self.mapped():
            return await self._scripts[name](keys=list(keys), args=list(args), client=client)

    async def aclose(self) -> None:
        """Close the connections; the store may then be used from another event loop."""
        if self._redis is not None:
            client, self._redis, self._loop = self._redis, None, None
            await client.aclose()


def octets(value: bytes | str | None) -> bytes | None:
    """A reply from redis-py as octets (it answers bytes unless told to decode)."""
    return value.encode() if isinstance(value, str) else value


def _encode(record: SessionRecord) -> str:
    return json.dumps(record.to_json(), separators=(",", ":"), sort_keys=True)


def _decode(raw: bytes) -> SessionRecord:
    return SessionRecord.from_json(json.loads(raw))


class ScriptedStore:
    """What the stores built on :class:`RedisScripts` share: their Lua scripts
    (:attr:`SCRIPTS`, named), the key prefix, being made from the ``--store`` URL and closed
    the same way."""

    SCRIPTS: ClassVar[dict[str, str]] = {}
    """The store's Lua scripts by name (for :meth:`RedisScripts.run`)."""

    def __init__(self, url: str, *, prefix: str = DEFAULT_PREFIX) -> None:
        self._redis = RedisScripts(url, self.SCRIPTS)
        self._prefix = prefix

    @classmethod
    def from_url(cls, url: str) -> Self:
        """A store for ``redis://host:port/db[?prefix=NAME]`` (as ``--store`` takes it).

        Raises:
            BadRequest: not such a URL.
        """
        redis_url, prefix = parse_store_url(url)
        return cls(redis_url, prefix=prefix)

    async def aclose(self) -> None:
        """Close the connections."""
        await self._redis.aclose()


class RedisSessionStore(ScriptedStore):
    """A :class:`~kvsp.stores.sessions.SessionStore` in Redis, shared by any number of PC
    processes; see the module docstring for the keys and how each write is atomic.

    Every method raises :class:`~kvsp.errors.StoreUnavailable` when Redis fails.
    """

    SCRIPTS: ClassVar[dict[str, str]] = {
        "cas": _CAS,
        "expire": _EXPIRE,
        "live": _LIVE,
        "recent": _RECENT,
    }

    def __init__(self, url: str, *, prefix: str = DEFAULT_PREFIX) -> None:
        super().__init__(url, prefix=prefix)
        self._base = f"{prefix}:{{sessions}}:"
        self._keys = [f"{self._base}{k}" for k in ("r", "n", "ul", "uf")]
        self.conflicts = 0
        """Compare-and-set attempts lost to another writer (for tests and metrics)."""

    async def _raw(self, session: uuid.UUID) -> bytes | None:
        client = self._redis.client()
        with self._redis.mapped():
            raw = await client.hget(self._keys[0], session.hex)
        return octets(raw)

    async def _cas(self, old: bytes | None, record: SessionRecord) -> bool:
        """Write ``record`` if the stored one is still ``old`` (absent when ``None``)."""
        written = await self._redis.run(
            "cas",
            self._keys,
            [
                self._base,
                record.session.hex,
                b"" if old is None else old,
                _encode(record),
                record.updated_ms,
                holder_id_of(record.instance).hex(),
                "1" if record.state in LIVE else "0",
                "1" if record.state in FINAL else "0",
            ],
        )
        return bool(written)

    async def _update(self, session: uuid.UUID, rule: Any) -> SessionRecord:
        """Read, apply ``rule`` (record → record, or raise), write if the record is unchanged;
        again from the read when another writer came first."""
        for _ in range(MAX_TRIES):
            raw = await self._raw(session)
            if raw is None:
                raise NotFound(f"no session {session}")
            record = _decode(raw)
            after: SessionRecord = rule(record)
            if after is record or await self._cas(raw, after):
                return after
            self.conflicts += 1
        raise StoreUnavailable(f"session {session}: too many concurrent writers")

    async def create(self, record: SessionRecord) -> None:
        """Add a new session.

        Raises:
            Conflict: a session with that id exists.
        """
        if not await self._cas(None, record):
            raise Conflict(f"session {record.session} exists", path="$.session")

    async def get(self, session: uuid.UUID) -> SessionRecord | None:
        """The session's record, or ``None``."""
        raw = await self._raw(session)
        return None if raw is None else _decode(raw)

    async def put_checkpoint(self, checkpoint: SessionCheckpoint, now_ms: int) -> SessionRecord:
        """Apply :func:`~kvsp.sessions.accept_checkpoint` atomically.

        Raises:
            NotFound: no such session. StaleEpoch, Conflict, Forbidden: as the rule.
        """
        return await self._update(
            checkpoint.session, lambda r: accept_checkpoint(r, checkpoint, now_ms)
        )

    async def advance_epoch(
        self, session: uuid.UUID, expected_epoch: int, instance: str, now_ms: int
    ) -> SessionRecord:
        """Compare-and-set the epoch to the next one at ``instance``.

        Raises:
            NotFound: no such session. StaleEpoch, IllegalTransition: as the rule.
        """
        return await self._update(
            session, lambda r: advance_epoch(r, expected_epoch, instance, now_ms)
        )

    async def settle(
        self,
        session: uuid.UUID,
        epoch: int,
        state: SessionState,
        now_ms: int,
        detail: str | None = None,
    ) -> SessionRecord:
        """Set the state if still at ``epoch``.

        Raises:
            NotFound: no such session. StaleEpoch, IllegalTransition: as the rule.
        """
        return await self._update(session, lambda r: settle(r, epoch, state, now_ms, detail))

    async def live_at(self, instance: str) -> list[SessionRecord]:
        """The serving or resuming sessions of ``instance``, oldest first (one script)."""
        raws = await self._redis.run(
            "live", self._keys[:1], [self._base, holder_id_of(instance).hex()]
        )
        records = [_decode(raw) for raw in raws if raw is not None]
        live = [r for r in records if r.instance == instance and r.state in LIVE]
        return sorted(live, key=lambda r: r.created_ms)

    async def recent(self, limit: int) -> list[SessionRecord]:
        """At most ``limit`` sessions, the most recently changed first
        (:class:`~kvsp.stores.sessions.SessionCensus`); one script."""
        if limit <= 0:
            return []
        raws = await self._redis.run("recent", self._keys, [limit])
        records = [_decode(raw) for raw in raws if raw is not None]
        return sorted(records, key=lambda r: r.updated_ms, reverse=True)[:limit]

    async def expire(self, now_ms: int, *, idle_ms: int, retain_ms: int) -> int:
        """Drop finished sessions older than ``retain_ms`` and any older than ``idle_ms``."""
        dropped = await self._redis.run(
            "expire", self._keys, [self._base, now_ms - idle_ms, now_ms - retain_ms]
        )
        return int(dropped)
