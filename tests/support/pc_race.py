"""Racing writers of the PC's Redis stores (the epoch and checkpoint rules of §6.8 and §6.9 hold
under concurrent writers), used by the Redis PC store tests both in-process (one connection per
writer) and as separate OS processes::

    python tests/support/pc_race.py URL SESSION_HEX EPOCH SEED MAP ATTEMPT GO_KEY

A process waits for an item on the Redis list ``GO_KEY`` (so that all start together), then
runs :func:`session_writer` for ``EPOCH`` and, at once, a ``begin`` of version 2 of ``MAP``
with ``ATTEMPT``, and prints ``{"session": [...], "begin": "started"|"busy"|...}``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import sys
import uuid
from typing import Any

from kvsp.errors import StaleEpoch
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.records import Sampler, SessionCheckpoint
from kvsp.records_shard import Shard, ShardMap
from kvsp.sessions import new_session
from kvsp.stores.sessions import SessionStore
from kvsp.stores.shardmaps import ShardMapStore

SCOPE = ScopeId(b"\x0c" * 16)
COMPAT = CompatId(b"\x0d" * 32)
TOKENS = tuple(range(1000, 1256))


def instance(epoch: int) -> str:
    """The instance serving the session at ``epoch``."""
    return f"https://race-{epoch}.example/kvsp/"


def new_race_session(session: uuid.UUID) -> Any:
    """The session record the race starts from: epoch 1 at ``instance(1)``."""
    return new_session(session, SCOPE, COMPAT, instance(1), 1_000)


def checkpoint(session: uuid.UUID, epoch: int, offset: int) -> SessionCheckpoint:
    """A checkpoint of ``instance(epoch)`` covering ``offset`` tokens of :data:`TOKENS`."""
    return SessionCheckpoint(
        session=session,
        epoch=epoch,
        compat_id=COMPAT,
        scope_id=SCOPE,
        prompt_blocks=(BlockKey(hashlib.sha256(b"race").digest()),),
        prompt_tail=(5, 6),
        generated=TOKENS[:offset],
        output_offset=offset,
        sampler=Sampler(method="greedy", params={}, seed=1, step=offset, deterministic=True),
        instance=instance(epoch),
        max_tokens=None,
    )


async def session_writer(
    store: SessionStore, session: uuid.UUID, epoch: int, seed: int, puts: int = 6
) -> list[list[Any]]:
    """Put checkpoints of ``epoch`` at random offsets, race to advance from ``epoch``, then put
    more of ``epoch`` (all of which must be stale). Returns the events in order:
    ``["put", epoch, offset, "ok"|"stale", after_advance]`` and ``["advance", "won"|"lost"]``."""
    rng = random.Random(seed)
    events: list[list[Any]] = []
    advanced = False
    for i in range(2 * puts + 1):
        if i == puts:
            try:
                await store.advance_epoch(session, epoch, instance(epoch + 1), 2_000 + epoch)
                events.append(["advance", "won"])
            except StaleEpoch:
                events.append(["advance", "lost"])
            advanced = True
            continue
        offset = rng.randint(1, len(TOKENS))
        try:
            after = await store.put_checkpoint(checkpoint(session, epoch, offset), 2_000 + epoch)
            assert after.epoch == epoch, "a checkpoint was kept against another epoch"
            events.append(["put", epoch, offset, "ok", advanced])
        except StaleEpoch:
            events.append(["put", epoch, offset, "stale", advanced])
        await asyncio.sleep(0)
    return events


def shard_map(name: str, version: int, owner: str) -> ShardMap:
    """A one-shard map ``name`` at ``version`` owned by ``owner``."""
    return ShardMap(map=name, version=version, shards=(Shard(tokens=(0, 64), instance=owner),))


async def begin_v2(store: ShardMapStore, name: str, attempt: str) -> str:
    """Race to make version 2 of ``name`` pending; the outcome's value."""
    outcome = await store.begin(shard_map(name, 2, instance(9)), attempt, 10_000, 5_000)
    return outcome.value


async def _main(argv: list[str]) -> dict[str, Any]:
    import redis.asyncio as aioredis

    from kvsp.stores.redis import parse_store_url
    from kvsp.stores.redis_sessions import RedisSessionStore
    from kvsp.stores.redis_shardmaps import RedisShardMaps

    url, session_hex, epoch, seed, name, attempt, go_key = argv
    sessions = RedisSessionStore.from_url(url)
    maps = RedisShardMaps.from_url(url)
    waiter = aioredis.Redis.from_url(parse_store_url(url)[0])
    try:
        if await waiter.blpop([go_key], timeout=60) is None:
            raise SystemExit("no start signal")
        events, outcome = await asyncio.gather(
            session_writer(sessions, uuid.UUID(session_hex), int(epoch), int(seed)),
            begin_v2(maps, name, attempt),
        )
        return {"session": events, "begin": outcome}
    finally:
        await waiter.aclose()
        await sessions.aclose()
        await maps.aclose()


if __name__ == "__main__":
    print(json.dumps(asyncio.run(_main(sys.argv[1:]))))
