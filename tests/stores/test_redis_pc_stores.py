"""The PC's Redis stores under concurrent writers (the epoch and
checkpoint rules hold under concurrent writers): writers on separate
connections, then in separate OS processes, put checkpoints of mixed epochs and offsets and race
``advance_epoch``; exactly one advance wins per epoch, no checkpoint of a lower epoch is taken
once the epoch moved on, and the kept offset is the highest accepted. Racing ``begin`` on a shard
map lets exactly one attempt start. Plus what is particular to the Redis stores: the keys carry
their hash tags, two stores on one Redis see each other's state, and an unreachable Redis is
:class:`~kvsp.errors.StoreUnavailable`."""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
import sys
import uuid
from typing import Any

import pytest

redis = pytest.importorskip("redis")

from kvsp.errors import StoreUnavailable  # noqa: E402
from kvsp.stores.redis import parse_store_url  # noqa: E402
from kvsp.stores.redis_sessions import RedisSessionStore  # noqa: E402
from kvsp.stores.redis_shardmaps import RedisShardMaps  # noqa: E402
from kvsp.stores.shardmaps import BeginOutcome  # noqa: E402
from tests.support import SUPPORT  # noqa: E402
from tests.support import pc_race as race  # noqa: E402

HELPER = SUPPORT / "pc_race.py"
WRITERS = 6
PROCESSES = 4


def check_round(events: list[list[list[Any]]], epoch: int) -> list[int]:
    """Exactly one advance from ``epoch`` won; every put after a writer saw the advance was
    stale. Returns the offsets accepted."""
    advances = [e[1] for writer in events for e in writer if e[0] == "advance"]
    assert sorted(advances) == ["lost"] * (len(events) - 1) + ["won"], advances
    accepted = []
    for writer in events:
        for e in writer:
            if e[0] == "put":
                _, put_epoch, offset, outcome, after_advance = e
                assert put_epoch == epoch
                if after_advance:
                    assert outcome == "stale", f"epoch {epoch} checkpoint taken after the advance"
                elif outcome == "ok":
                    accepted.append(offset)
    return accepted


def test_racing_writers_on_separate_connections(redis_url: str) -> None:
    async def scenario() -> None:
        stores = [RedisSessionStore.from_url(redis_url) for _ in range(WRITERS)]
        session = uuid.uuid4()
        try:
            await stores[0].create(race.new_race_session(session))
            accepted: list[int] = []
            for epoch in (1, 2, 3):
                events = await asyncio.gather(
                    *(
                        race.session_writer(store, session, epoch, seed=epoch * 100 + i)
                        for i, store in enumerate(stores)
                    )
                )
                accepted += check_round(list(events), epoch)
                for store in stores:  # every connection reads the same record
                    record = await store.get(session)
                    assert record is not None and record.epoch == epoch + 1
                    assert record.instance == race.instance(epoch + 1)
                    assert record.output_offset == max(accepted)
            # The writers did lose compare-and-set rounds to each other: the race was real.
            assert sum(store.conflicts for store in stores) > 0
        finally:
            for store in stores:
                await store.aclose()

    asyncio.run(scenario())


def test_racing_writers_in_separate_processes(redis_url: str) -> None:
    redis_plain, prefix = parse_store_url(redis_url)
    session = uuid.uuid4()
    name = f"race-{secrets.token_hex(4)}"
    go_key = f"{prefix}:go"

    async def setup() -> None:
        sessions, maps = RedisSessionStore.from_url(redis_url), RedisShardMaps.from_url(redis_url)
        try:
            await sessions.create(race.new_race_session(session))
            assert await maps.create(race.shard_map(name, 1, race.instance(1)))
        finally:
            await sessions.aclose()
            await maps.aclose()

    asyncio.run(setup())
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HELPER),
                redis_url,
                session.hex,
                "1",
                str(i),
                name,
                f"a{i}",
                go_key,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for i in range(PROCESSES)
    ]
    client = redis.Redis.from_url(redis_plain)
    try:
        client.rpush(go_key, *range(PROCESSES))
    finally:
        client.close()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()
        results.append(json.loads(out))
    accepted = check_round([r["session"] for r in results], 1)
    assert sorted(r["begin"] for r in results) == ["busy"] * (PROCESSES - 1) + ["started"]

    async def final() -> None:
        sessions, maps = RedisSessionStore.from_url(redis_url), RedisShardMaps.from_url(redis_url)
        try:
            record = await sessions.get(session)
            assert record is not None and (record.epoch, record.instance) == (2, race.instance(2))
            assert record.output_offset == max(accepted)
            state = await maps.get(name, 5_000)
            winner = next(f"a{i}" for i, r in enumerate(results) if r["begin"] == "started")
            assert state is not None and state.pending is not None
            assert state.pending.attempt == winner and state.current.version == 1
        finally:
            await sessions.aclose()
            await maps.aclose()

    asyncio.run(final())


def test_racing_begins_on_separate_connections(redis_url: str) -> None:
    async def scenario() -> None:
        stores = [RedisShardMaps.from_url(redis_url) for _ in range(WRITERS)]
        try:
            assert await stores[0].create(race.shard_map("m", 1, race.instance(1)))
            for version in (2, 3):
                outcomes = await asyncio.gather(
                    *(
                        s.begin(race.shard_map("m", version, race.instance(i)), f"x{i}", 9_000, 0)
                        for i, s in enumerate(stores)
                    )
                )
                assert sorted(o.value for o in outcomes) == ["busy"] * (WRITERS - 1) + ["started"]
                started = [i for i, o in enumerate(outcomes) if o is BeginOutcome.STARTED]
                # Only the winner's attempt commits; the others' commits are refused.
                for i, store in enumerate(stores):
                    if i != started[0]:
                        assert not await store.commit("m", version, f"x{i}")
                assert await stores[-1].commit("m", version, f"x{started[0]}")
                state = await stores[0].get("m", 0)
                assert state is not None and state.pending is None
                assert state.current.shards[0].instance == race.instance(started[0])
        finally:
            for store in stores:
                await store.aclose()

    asyncio.run(scenario())


def test_keys_carry_hash_tags(redis_url: str) -> None:
    redis_plain, prefix = parse_store_url(redis_url)

    async def scenario() -> None:
        sessions, maps = RedisSessionStore.from_url(redis_url), RedisShardMaps.from_url(redis_url)
        try:
            await sessions.create(race.new_race_session(uuid.uuid4()))
            assert await maps.create(race.shard_map("tagged", 1, race.instance(1)))
        finally:
            await sessions.aclose()
            await maps.aclose()

    asyncio.run(scenario())
    client = redis.Redis.from_url(redis_plain)
    try:
        keys = sorted(k.decode() for k in client.scan_iter(match=f"{prefix}:*"))
    finally:
        client.close()
    tagged = f"{prefix}:{{m:{b'tagged'.hex()}}}:map"
    assert tagged in keys
    others = [k for k in keys if k != tagged]
    assert others and all(k.startswith(f"{prefix}:{{sessions}}:") for k in others), keys


def test_an_unreachable_redis_is_store_unavailable() -> None:
    async def scenario() -> None:
        # Port 1 on loopback: nothing listens there.
        sessions = RedisSessionStore.from_url("redis://127.0.0.1:1/0")
        maps = RedisShardMaps.from_url("redis://127.0.0.1:1/0")
        try:
            with pytest.raises(StoreUnavailable):
                await sessions.get(uuid.uuid4())
            with pytest.raises(StoreUnavailable):
                await maps.begin(race.shard_map("m", 2, race.instance(1)), "a", 1, 0)
        finally:
            await sessions.aclose()
            await maps.aclose()

    asyncio.run(scenario())
