"""The Redis replica store: many Index Service processes over one shared state (spec §6.1
replica TTLs, §6.2 prefix lookup, §6.3 status epochs; DESIGN.md §1 "the scale-out path").

Selected with ``--store redis://host:port/db`` (``?prefix=NAME`` puts every key under ``NAME:``
instead of ``kvsp:``). Every key of a scope carries the hash tag ``{<scope_id hex>}``, so a
Redis Cluster keeps a scope on one slot and each script (:mod:`kvsp.stores.redis_lua`) touches
one slot only. State added later keeps to the rule: a hash tag per scope, session or instance.

==================================== ======== ============================================
``P:{S}:r:<compat hex>``             hash     block key (32 octets) → *key value* (below)
``P:{S}:x:<compat hex>``             zset     block key ‖ holder id (48 octets) → expiry ms
``P:{S}:c``                          set      compat ids (hex) with records in scope S
``P:{S}:h``                          hash     holder id (16 octets) → its records in scope S
``P:scopes``                         set      scope ids (hex) with records, for the sweeper
``P:{h:<holder id hex>}:s``          set      scope ids (hex) where the holder has had records
``P:{i:<uri_id hex>}:status``        hash     ``epoch``, ``expires``, ``record`` (§6.3)
``P:descriptors``                    hash     compat id (hex) → descriptor JSON (§4.1)
==================================== ======== ============================================

A *key value* holds every holder's record of one block in the compact form of
:mod:`kvsp.stores.redis_records`, led by the largest expiry of its entries, so that the lookup
script decides "has a live record" from 15 octets; the entries are filtered by the caller, and
decoded records are kept in a bounded :class:`RecordCache`, so hot prefixes are decoded once.

A holder's record quota (``max_per_holder``) is exact within a scope, where the put script
checks and counts in one step, and holds across scopes up to what concurrent puts of one
holder in different scopes add at once: the put first reads the holder's counts in its other
scopes (two round trips more, only with a quota) and hands the script what is left.

Each operation is one round trip (one ``EVALSHA`` or one pipeline): a lookup walks the chained
keys in order inside Redis, fetching them in growing chunks with ``HMGET`` and stopping at the
first key without a live record (§6.2). Puts, withdrawals and sweeps are scripts too, so the
hash and the expiry zset never disagree; the zset makes sweeping a bounded range scan.

A :class:`RedisStore` serves the event loop that first used it (asyncio connections belong to a
loop); :meth:`RedisStore.aclose` releases it. :class:`SharedDescriptors` shares the
Compatibility Descriptors the IS processes learn (§4.1) through the same Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis

from kvsp.compat import CompatibilityDescriptor, compat_id
from kvsp.errors import BadRequest, RecordError, StoreUnavailable
from kvsp.fields import UINT64_MAX
from kvsp.ids import CompatId
from kvsp.index import HolderCensus, StoredReplica, holder_id_of
from kvsp.records import InstanceStatusRecord, ReplicaRecord, dumps, loads
from kvsp.stores.descriptors import DescriptorRegistry
from kvsp.stores.redis_lua import SCRIPTS
from kvsp.stores.redis_records import (
    EXPIRY_DIGITS,
    RecordCache,
    decode_record,
    encode_record,
    live_entries,
)

__all__ = [
    "DEFAULT_PREFIX",
    "RecordCache",
    "RedisStore",
    "SharedDescriptors",
    "decode_record",
    "encode_record",
    "parse_store_url",
]

_log = logging.getLogger("kvsp.stores.redis")
DEFAULT_PREFIX = "kvsp"
_PREFIX = re.compile(r"[A-Za-z0-9_.-]{1,64}")
PUT_CHUNK = 500
"""Records per put script call: keeps each call (and Redis's pause for it) to a few ms."""
SWEEP_CHUNK = 1000
"""Expiry entries per sweep script call, for the same reason."""
DEFAULT_CACHE = 16_384
"""Decoded records an IS keeps (~3 KB each at 32 layers: ~50 MB): eight 1,000-block prompts
of two replicas each, enough for the prefixes most requests share."""

# --- the store ---------------------------------------------------------------------------------


def parse_store_url(url: str) -> tuple[str, str]:
    """Split ``redis://host:port/db?prefix=NAME`` (also ``rediss://``, ``unix://``) into the
    URL for redis-py and the key prefix.

    Raises:
        BadRequest: another scheme, or a prefix other than 1-64 of ``A-Za-z0-9_.-``.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise BadRequest(f"--store: expected memory or redis://host:port/db, got {url!r}")
    query = parse_qsl(parts.query, keep_blank_values=True)
    prefixes = [v for k, v in query if k == "prefix"]
    prefix = prefixes[-1] if prefixes else DEFAULT_PREFIX
    if _PREFIX.fullmatch(prefix) is None:
        raise BadRequest(f"--store: prefix must be 1-64 of A-Za-z0-9_.-, got {prefix!r}")
    rest = urlencode([(k, v) for k, v in query if k != "prefix"])
    return urlunsplit(parts._replace(query=rest)), prefix


class RedisStore:
    """A :class:`~kvsp.index.ReplicaStore` in Redis, shared by any number of IS
    processes; see the module docstring for the key layout.

    ``url`` is a redis-py URL (``redis://host:port/db``); keys live under ``prefix:``;
    ``cache_records`` bounds the :class:`RecordCache` of decoded records (0: none).
    Every method raises :class:`~kvsp.errors.StoreUnavailable` when Redis fails.
    """

    def __init__(
        self, url: str, *, prefix: str = DEFAULT_PREFIX, cache_records: int = DEFAULT_CACHE
    ) -> None:
        if _PREFIX.fullmatch(prefix) is None:
            raise ValueError(f"prefix must be 1-64 of A-Za-z0-9_.-, got {prefix!r}")
        self.url = url
        self.prefix = prefix
        self.cache = RecordCache(cache_records)
        self.round_trips = 0
        """Requests sent to Redis (a script call or a pipeline each); for tests and metrics."""
        self._redis: aioredis.Redis | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scopes_key = f"{prefix}:scopes"
        self._sweep_turn = 0

    @classmethod
    def from_url(cls, url: str) -> RedisStore:
        """A store for ``redis://host:port/db[?prefix=NAME]``.

        Raises:
            BadRequest: not such a URL (see :func:`parse_store_url`).
        """
        redis_url, prefix = parse_store_url(url)
        return cls(redis_url, prefix=prefix)

    @property
    def location(self) -> str:
        """Where the store is, for messages (no password)."""
        parts = urlsplit(self.url)
        host = parts.hostname or parts.path
        port = f":{parts.port}" if parts.port else ""
        return f"{parts.scheme}://{host}{port}{'' if parts.scheme == 'unix' else parts.path}"

    def check_reachable(self, timeout_s: float = 5.0) -> None:
        """Ping Redis synchronously (for startup, before any event loop runs).

        Raises:
            StoreUnavailable: Redis does not answer, refuses the credentials, or is no Redis.
        """
        client = redis.Redis.from_url(
            self.url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s
        )
        try:
            client.ping()
        except redis.RedisError as exc:
            raise StoreUnavailable(f"cannot reach Redis at {self.location}: {exc}") from exc
        finally:
            client.close()

    @contextlib.contextmanager
    def _mapped(self) -> Iterator[None]:
        """Turn redis-py's errors into :class:`StoreUnavailable` (one boundary, STYLE.md)."""
        try:
            yield
        except redis.RedisError as exc:
            kind = type(exc).__name__
            raise StoreUnavailable(f"Redis store at {self.location}: {kind}: {exc}") from exc

    def _client(self) -> aioredis.Redis:
        loop = asyncio.get_running_loop()
        if self._redis is None:
            # A request never waits on a hung Redis for ever: it fails as StoreUnavailable.
            self._redis = aioredis.Redis.from_url(
                self.url, socket_connect_timeout=5.0, socket_timeout=30.0
            )
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("this RedisStore serves another event loop; aclose() it first")
        return self._redis

    async def aclose(self) -> None:
        """Close the connections; the store may then be used from another event loop."""
        if self._redis is not None:
            client, self._redis, self._loop = self._redis, None, None
            await client.aclose()

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        """A lifespan for an app over this store: closes the connections when it stops."""
        try:
            yield
        finally:
            await self.aclose()

    async def _load_scripts(self, client: aioredis.Redis) -> None:
        pipe = client.pipeline(transaction=False)
        for script in SCRIPTS.values():
            pipe.script_load(script.source)
        await pipe.execute()

    async def _eval(self, name: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """``EVALSHA`` one script; loads the scripts once if Redis lacks them (a restart)."""
        client = self._client()
        sha = SCRIPTS[name].sha
        with self._mapped():
            self.round_trips += 1
            try:
                return await client.evalsha(sha, len(keys), *keys, *args)
            except redis.exceptions.NoScriptError:
                self.round_trips += 2
                await self._load_scripts(client)
                return await client.evalsha(sha, len(keys), *keys, *args)

    async def _pipeline(
        self,
        calls: Sequence[tuple[str, Sequence[Any], Sequence[Any]]],
        sets: Sequence[tuple[str, Sequence[str]]] = (),
    ) -> list[Any]:
        """Run idempotent script calls (then ``SADD`` of members to ``sets``: the sweeper's
        scopes, a holder's scopes) in one pipeline, one round trip; again after loading the
        scripts if Redis lacked one."""
        client = self._client()
        with self._mapped():
            results = await self._execute(client, calls, sets)
            if any(isinstance(r, redis.exceptions.NoScriptError) for r in results):
                self.round_trips += 1
                await self._load_scripts(client)
                results = await self._execute(client, calls, sets)
            for result in results:
                if isinstance(result, Exception):
                    raise result
        return results[: len(calls)]

    async def _execute(
        self,
        client: aioredis.Redis,
        calls: Sequence[tuple[str, Sequence[Any], Sequence[Any]]],
        sets: Sequence[tuple[str, Sequence[str]]],
    ) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        for name, keys, args in calls:
            pipe.evalsha(SCRIPTS[name].sha, len(keys), *keys, *args)
        for key, members in sets:
            if members:
                pipe.sadd(key, *members)
        self.round_trips += 1
        results: list[Any] = await pipe.execute(raise_on_error=False)
        return results

    # --- key names ------------------------------------------------------------------------------

    def _base(self, scope: bytes) -> str:
        return f"{self.prefix}:{{{scope.hex()}}}:"

    def _group_keys(self, compat: bytes, scope: bytes) -> tuple[str, str, str, str]:
        base = self._base(scope)
        return f"{base}r:{compat.hex()}", f"{base}x:{compat.hex()}", f"{base}c", f"{base}h"

    def _holder_scopes_key(self, holder_id: bytes) -> str:
        return f"{self.prefix}:{{h:{holder_id.hex()}}}:s"

    def _status_key(self, instance: str) -> str:
        return f"{self.prefix}:{{i:{holder_id_of(instance).hex()}}}:status"

    # --- replicas (§6.1, §6.2) ------------------------------------------------------------------

    async def put(self, record: ReplicaRecord, expires_ms: int) -> None:
        """Store or refresh ``record`` until ``expires_ms``."""
        await self.put_many([(record, expires_ms)])

    async def put_many(
        self, items: Sequence[StoredReplica], *, max_per_holder: int | None = None
    ) -> list[bool]:
        """Store or refresh several records: one script call per 500 records of a
        (compat, scope) group, all in one pipeline; per item, whether it was stored (a new
        record beyond ``max_per_holder`` of its holder's is not, see the module text)."""
        if not items:
            return []
        groups: dict[tuple[bytes, bytes], list[bytes]] = {}
        positions: dict[tuple[bytes, bytes], list[int]] = {}
        for n, (record, expires_ms) in enumerate(items):
            if not 0 <= expires_ms < 10**EXPIRY_DIGITS:
                raise ValueError(f"expiry {expires_ms} ms is out of range")
            group = (record.compat_id, record.scope_id)
            args = groups.setdefault(group, [])
            expiry = b"%015d" % expires_ms
            args += (record.block_key, holder_id_of(record.holder), expiry, encode_record(record))
            positions.setdefault(group, []).append(n)
        allowances = await self._allowances(groups, max_per_holder)
        calls: list[tuple[str, Sequence[Any], Sequence[Any]]] = []
        offsets: list[list[int]] = []
        for (compat, scope), args in groups.items():
            keys = self._group_keys(compat, scope)
            allow = allowances.get(scope, b"")
            for i in range(0, len(args), 4 * PUT_CHUNK):
                calls.append(("put", keys, [compat.hex(), allow, *args[i : i + 4 * PUT_CHUNK]]))
                offsets.append(positions[(compat, scope)][i // 4 : i // 4 + PUT_CHUNK])
        # The scopes go in after the records: a sweeper that drops an emptied scope re-adds
        # it when it then sees records (_forget_scope), so no scope with records stays out.
        holder_scopes: dict[bytes, set[str]] = {}
        for _, scope in groups:
            for holder in _holders_of(groups, scope):
                holder_scopes.setdefault(holder, set()).add(scope.hex())
        sets = [(self._scopes_key, sorted({scope.hex() for _, scope in groups}))]
        sets += [(self._holder_scopes_key(h), sorted(s)) for h, s in holder_scopes.items()]
        refused = await self._pipeline(calls, sets)
        stored = [True] * len(items)
        for where, gone in zip(offsets, refused, strict=True):
            for k in gone:
                stored[where[int(k)]] = False
        return stored

    async def _allowances(
        self, groups: dict[tuple[bytes, bytes], list[bytes]], quota: int | None
    ) -> dict[bytes, bytes]:
        """Per scope of ``groups``, the put script's allowance table: for each holder putting
        there, ``quota`` less its records in its other scopes (two pipelines)."""
        if quota is None:
            return {}
        scopes = {scope for _, scope in groups}
        holders = sorted({h for scope in scopes for h in _holders_of(groups, scope)})
        client = self._client()
        with self._mapped():
            pipe = client.pipeline(transaction=False)
            for holder in holders:
                pipe.smembers(self._holder_scopes_key(holder))
            self.round_trips += 1
            known: list[set[Any]] = await pipe.execute()
            pairs = [
                (holder, scope)
                for holder, found in zip(holders, known, strict=True)
                for scope in {_text(m) for m in found} | {s.hex() for s in scopes}
            ]
            pipe = client.pipeline(transaction=False)
            for holder, scope_hex in pairs:
                pipe.hget(f"{self._base(bytes.fromhex(scope_hex))}h", holder)
            self.round_trips += 1
            counts = [int(c or 0) for c in await pipe.execute()]
        total: dict[bytes, int] = {}
        here: dict[tuple[bytes, str], int] = {}
        for (holder, scope_hex), count in zip(pairs, counts, strict=True):
            total[holder] = total.get(holder, 0) + count
            here[(holder, scope_hex)] = count
        tables: dict[bytes, bytes] = {}
        for scope in scopes:
            parts = []
            for holder in _holders_of(groups, scope):
                elsewhere = total[holder] - here[(holder, scope.hex())]
                parts.append(holder + b"%015d" % max(0, quota - elsewhere))
            tables[scope] = b"".join(parts)
        return tables

    async def delete(self, compat_id: bytes, scope_id: bytes, key: bytes, holder_id: bytes) -> bool:
        """Remove one holder's record for a key; whether there was one."""
        keys = self._group_keys(compat_id, scope_id)
        return bool(await self._eval("delete", keys, [compat_id.hex(), key, holder_id]))

    async def delete_holder(self, holder_id: bytes, *, published_before: int | None = None) -> int:
        """Remove every record of the holder ``holder_id`` (an instance that failed or
        ended, spec §6.3), or only those last published (``expires_ms - ttl_ms``) before
        ``published_before``; returns how many went.

        Only the scopes in the holder's scope set (``P:{h:…}:s``) where it still counts
        entries are visited; in each, the expiry zsets are scanned (``ZSCAN`` matching the
        holder id, so Redis never blocks on a long scan) and the holder's entries removed by
        the delete script, 1,000 to a pipeline. With a bound, the candidates' key values are
        read first (one pipeline per 1,000) to learn when each was published."""
        client = self._client()
        with self._mapped():
            self.round_trips += 1
            scopes = sorted(
                _text(s) for s in await client.smembers(self._holder_scopes_key(holder_id))
            )
        pattern = b"*" + _glob_escape(holder_id)
        removed = 0
        for scope_hex in scopes:
            scope = bytes.fromhex(scope_hex)
            base = self._base(scope)
            with self._mapped():
                self.round_trips += 2
                if not await client.hget(f"{base}h", holder_id):
                    continue
                compats = sorted(_text(c) for c in await client.smembers(f"{base}c"))
            for compat_hex in compats:
                keys = self._group_keys(bytes.fromhex(compat_hex), scope)
                with self._mapped():
                    members = [
                        bytes(m)
                        async for m, _ in client.zscan_iter(keys[1], match=pattern, count=1000)
                    ]
                mine = [m[:32] for m in members if len(m) == 48 and m[32:] == holder_id]
                if published_before is not None:
                    mine = await self._published_before(
                        keys[0], mine, holder_id, published_before, bytes.fromhex(compat_hex), scope
                    )
                for i in range(0, len(mine), SWEEP_CHUNK):
                    calls: list[tuple[str, Sequence[Any], Sequence[Any]]] = [
                        ("delete", keys, [compat_hex, key, holder_id])
                        for key in mine[i : i + SWEEP_CHUNK]
                    ]
                    removed += sum(int(found) for found in await self._pipeline(calls))
        return removed

    async def _published_before(
        self,
        group: str,
        keys: list[bytes],
        holder_id: bytes,
        bound: int,
        compat: bytes,
        scope: bytes,
    ) -> list[bytes]:
        """Those of ``keys`` whose entry of the holder was last published before ``bound``."""
        client = self._client()
        uncached = RecordCache(0)
        out = []
        for i in range(0, len(keys), SWEEP_CHUNK):
            chunk = keys[i : i + SWEEP_CHUNK]
            with self._mapped():
                pipe = client.pipeline(transaction=False)
                for key in chunk:
                    pipe.hget(group, key)
                self.round_trips += 1
                values = await pipe.execute()
            for key, value in zip(chunk, values, strict=True):
                if value is None:
                    continue
                try:
                    entries = live_entries(value, -1, key, compat, scope, uncached)
                except ValueError as exc:
                    raise StoreUnavailable(f"Redis store at {self.location}: {exc}") from exc
                if any(
                    holder_id_of(r.holder) == holder_id and expires - r.ttl_ms < bound
                    for r, expires in entries
                ):
                    out.append(key)
        return out

    async def lookup(
        self, compat_id: bytes, scope_id: bytes, keys: Sequence[bytes], now_ms: int
    ) -> list[list[StoredReplica]]:
        """The live records of the leading ``keys``, stopping at the first key without one;
        one ``EVALSHA``.

        Raises:
            ValueError: a key that is not 32 octets.
        """
        blob = b"".join(keys)
        if len(blob) != 32 * len(keys) or any(len(k) != 32 for k in keys):
            raise ValueError("block keys are 32 octets each")
        if not keys:
            return []
        group = self._group_keys(compat_id, scope_id)[0]
        values = await self._eval("lookup", [group], [now_ms, blob])
        try:
            return [
                live_entries(value, now_ms, key, compat_id, scope_id, self.cache)
                for value, key in zip(values, keys, strict=False)
            ]
        except ValueError as exc:
            raise StoreUnavailable(f"Redis store at {self.location}: {exc}") from exc

    async def compats_with_key(self, scope_id: bytes, key: bytes, now_ms: int) -> set[bytes]:
        """The compat ids under which ``key`` has a live record in ``scope_id``."""
        base = self._base(scope_id)
        found = await self._eval("compats_with_key", [f"{base}c"], [base, key, now_ms])
        return {bytes.fromhex(c.decode()) for c in found}

    async def compats_in_scope(self, scope_id: bytes, now_ms: int) -> set[bytes]:
        """The compat ids with a live record in ``scope_id``."""
        base = self._base(scope_id)
        found = await self._eval("compats_in_scope", [f"{base}c"], [base, now_ms])
        return {bytes.fromhex(c.decode()) for c in found}

    async def _scopes(self) -> list[str]:
        with self._mapped():
            self.round_trips += 1
            members = await self._client().smembers(self._scopes_key)
        return sorted(m.decode() if isinstance(m, bytes) else m for m in members)

    async def sweep(self, now_ms: int, max_items: int) -> int:
        """Remove due records, at most ``max_items`` and 1,000 per script call (so Redis
        pauses for a few ms at a time); returns how many went. Scopes take turns going first."""
        scopes = await self._scopes()
        if not scopes:
            return 0
        self._sweep_turn = (self._sweep_turn + 1) % len(scopes)
        removed = 0
        for scope_hex in scopes[self._sweep_turn :] + scopes[: self._sweep_turn]:
            base = self._base(bytes.fromhex(scope_hex))
            while removed < max_items:
                budget = min(SWEEP_CHUNK, max_items - removed)
                gone, compats = await self._eval("sweep", [f"{base}c"], [base, now_ms, budget])
                removed += gone
                if not compats:
                    await self._forget_scope(scope_hex, base)
                if gone < budget:
                    break
            if removed >= max_items:
                break
        return removed

    async def _forget_scope(self, scope_hex: str, base: str) -> None:
        """Drop an emptied scope from the sweeper's set; re-add it if a put raced in."""
        client = self._client()
        with self._mapped():
            self.round_trips += 2
            await client.srem(self._scopes_key, scope_hex)
            if await client.scard(f"{base}c"):
                await client.sadd(self._scopes_key, scope_hex)

    async def count(self) -> int:
        """How many replica records are stored (expired ones not yet swept included)."""
        bases = [self._base(bytes.fromhex(s)) for s in await self._scopes()]
        if not bases:
            return 0
        counts = await self._pipeline([("count", [f"{b}c"], [b]) for b in bases])
        return sum(int(c) for c in counts)

    async def holders(self, now_ms: int) -> list[HolderCensus]:
        """Live records and octets per holder (:class:`~kvsp.index.ReplicaCensus`, ``GET
        replicas`` at the IS): one ``HSCAN`` pass over every scope's key values, for an
        operator's call, not for each request. Records are decoded without the cache, so a
        census does not push the hot prefixes out of it."""
        client = self._client()
        uncached = RecordCache(0)
        tally: dict[str, tuple[int, int]] = {}
        for scope_hex in await self._scopes():
            scope = bytes.fromhex(scope_hex)
            base = self._base(scope)
            with self._mapped():
                self.round_trips += 1
                compats = [_text(c) for c in await client.smembers(f"{base}c")]
            for compat_hex in compats:
                compat = bytes.fromhex(compat_hex)
                with self._mapped():
                    async for key, value in client.hscan_iter(f"{base}r:{compat_hex}"):
                        try:
                            live = live_entries(value, now_ms, key, compat, scope, uncached)
                        except ValueError as exc:
                            raise StoreUnavailable(f"Redis store: {exc}") from exc
                        for record, _ in live:
                            count, octets = tally.get(record.holder, (0, 0))
                            tally[record.holder] = (count + 1, octets + record.size)
        # sizes are client-declared uint64 values: a saturated sum stays a JSON integer
        return [(h, n, min(octets, UINT64_MAX)) for h, (n, octets) in sorted(tally.items())]

    async def drop_all(self) -> int:
        """Delete every key under this store's prefix (tests, or retiring a deployment);
        returns how many keys went."""
        client = self._client()
        deleted = 0
        with self._mapped():
            async for batch in _batches(client.scan_iter(match=f"{self.prefix}:*", count=1000)):
                deleted += await client.unlink(*batch)
        return deleted

    # --- instance status (§6.3) -----------------------------------------------------------------

    async def put_status(
        self, record: InstanceStatusRecord, expires_ms: int, *, poisoned_above: int | None = None
    ) -> bool:
        """Store an instance's status; ``False`` when its epoch is below the highest seen and
        that one is not above ``poisoned_above``. The epoch check and the write are one
        script, so racing writers cannot undo it."""
        key = self._status_key(record.instance)
        bound = "" if poisoned_above is None else poisoned_above
        args = [record.epoch, expires_ms, dumps(record), bound]
        return bool(await self._eval("put_status", [key], args))

    async def statuses(self, instances: Sequence[str], now_ms: int) -> list[InstanceStatusRecord]:
        """The live status records of ``instances`` that have one, in that order (one
        pipeline)."""
        if not instances:
            return []
        client = self._client()
        with self._mapped():
            pipe = client.pipeline(transaction=False)
            for name in instances:
                pipe.hmget(self._status_key(name), ["expires", "record"])
            self.round_trips += 1
            found = await pipe.execute()
        return [
            _status_from(record)
            for expires, record in found
            if record is not None and int(expires) > now_ms
        ]

    # --- descriptors (§4.1), shared by every IS process -----------------------------------------

    async def put_descriptor(self, descriptor: CompatibilityDescriptor) -> bool:
        """Keep ``descriptor`` under its computed compat id; whether it was new."""
        client = self._client()
        with self._mapped():
            self.round_trips += 1
            key = compat_id(descriptor).hex()
            return bool(await client.hsetnx(f"{self.prefix}:descriptors", key, dumps(descriptor)))

    async def descriptors(self) -> list[CompatibilityDescriptor]:
        """Every descriptor kept, except any whose computed compat id is not the one it is
        kept under (§4.1: an id is computed, never taken on trust)."""
        client = self._client()
        with self._mapped():
            self.round_trips += 1
            kept = await client.hgetall(f"{self.prefix}:descriptors")
        out = []
        for key, raw in kept.items():
            try:
                descriptor = CompatibilityDescriptor.from_json(loads(raw))
            except RecordError:
                _log.warning("ignoring a malformed descriptor in Redis under %r", key)
                continue
            name = key.decode(errors="replace") if isinstance(key, bytes) else key
            if compat_id(descriptor).hex() == name:
                out.append(descriptor)
        return out


class SharedDescriptors(DescriptorRegistry):
    """The descriptors of every IS process on one Redis: those added here (``--descriptor``,
    ``STATE/descriptors``, ``PUT descriptors/{compat}``) are written to Redis, and those added
    through other processes are read back, within ``interval_s`` while :meth:`syncing` runs."""

    def __init__(
        self, folder: str | os.PathLike[str] | None, store: RedisStore, interval_s: float = 1.0
    ) -> None:
        super().__init__(folder)
        self.store = store
        self.interval_s = interval_s
        self._pending: dict[bytes, CompatibilityDescriptor] = {}
        self._wake = asyncio.Event()

    def add(self, descriptor: CompatibilityDescriptor, *, persist: bool = True) -> CompatId:
        """Register ``descriptor`` here (see :class:`DescriptorRegistry`) and queue it for
        Redis, if it is new."""
        known = len(self)
        cid = super().add(descriptor, persist=persist)
        if len(self) > known:
            self._pending[cid] = descriptor
            self._wake.set()
        return cid

    async def sync(self) -> int:
        """Write the queued descriptors to Redis and learn the others' ones; returns how many
        were learnt."""
        pending, self._pending = self._pending, {}
        try:
            for descriptor in pending.values():
                await self.store.put_descriptor(descriptor)
            learnt = 0
            for descriptor in await self.store.descriptors():
                if self.get(compat_id(descriptor)) is None:
                    super().add(descriptor, persist=False)
                    learnt += 1
        except BaseException:
            self._pending = pending | self._pending  # written again on the next round
            raise
        return learnt

    async def _sync_forever(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            self._wake.clear()
            try:
                await self.sync()
            except StoreUnavailable:
                _log.exception("sharing descriptors through Redis failed")
            if stop.is_set():
                return
            # The interval sets the event rather than timing the wait out: on 3.11 both
            # wait_for and asyncio.timeout can lose a cancel that lands as their own timeout
            # fires (and a cancel landing inside a Redis call may be lost as well), so the
            # loop also ends on ``stop``, not on the cancel alone
            timer = loop.call_later(self.interval_s, self._wake.set)
            try:
                await self._wake.wait()
            finally:
                timer.cancel()

    @contextlib.asynccontextmanager
    async def syncing(self) -> AsyncIterator[None]:
        """Keep syncing with Redis in the background while the app serves."""
        self._wake = asyncio.Event()  # bound to the serving loop
        stop = asyncio.Event()
        task = asyncio.create_task(self._sync_forever(stop), name="kvsp-descriptor-sync")
        try:
            yield
        finally:
            stop.set()
            self._wake.set()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _holders_of(groups: dict[tuple[bytes, bytes], list[bytes]], scope: bytes) -> list[bytes]:
    """The holder ids putting records in ``scope`` (the second of each group's 4-tuples)."""
    found: dict[bytes, None] = {}
    for (_, s), args in groups.items():
        if s == scope:
            found.update(dict.fromkeys(args[1::4]))
    return list(found)


def _glob_escape(octets: bytes) -> bytes:
    """``octets`` as a Redis glob pattern matching them literally."""
    return b"".join(b"\\" + bytes([c]) if c in b"*?[]\\^-" else bytes([c]) for c in octets)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _status_from(raw: bytes) -> InstanceStatusRecord:
    return InstanceStatusRecord.from_json(loads(raw))


async def _batches(items: AsyncIterator[Any], size: int = 1000) -> AsyncIterator[list[Any]]:
    batch: list[Any] = []
    async for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
