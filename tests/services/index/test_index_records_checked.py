"""The Index Service checks what it keeps (kvsp.index.check_record, the per-holder record quota,
status epochs bounded by the IS's clock; spec §4.3, §4.4, §6.1, §6.3): records whose layer
digests do not fit the descriptor or do not hash to their digest, impossible sizes, a holder
beyond its quota, and a status epoch far ahead of the clock are refused with a problem and
change nothing; a poisoned epoch yields to the instance's next status. Over HTTP to an
in-process IS, over both replica stores (in memory and Redis)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsp.ids import CompatId, ScopeId, uri_id
from kvsp.index import DEFAULT_MAX_RECORDS_PER_HOLDER
from kvsp.lifecycle import DEFAULT_MAX_EPOCH_SKEW_MS
from kvsp.records import ReplicaRecord, Residency
from kvsp.registries import Tier
from kvsp.services.index.app import IndexConfig
from kvsp.stores.memory import MemoryStore
from tests.services.index.test_index_app import (
    COMPAT,
    H2,
    II7,
    NOW,
    PREFIX,
    SCOPE_A,
    SCOPE_B,
    Env,
    auth,
    make_env,
    record,
    status,
    url_of,
)

QUOTA = 5
UNKNOWN = CompatId(hashlib.sha256(b"a compat id no descriptor names").digest())


def _env(request: pytest.FixtureRequest, tmp_path: Path, **config: Any) -> Iterator[Env]:
    with asyncio.Runner() as runner:
        if request.param == "memory":
            yield make_env(tmp_path, MemoryStore(), runner.run, **config)
            return
        from kvsp.stores.redis import RedisStore

        store = RedisStore.from_url(request.getfixturevalue("redis_url"))
        try:
            yield make_env(tmp_path, store, runner.run, **config)
        finally:
            runner.run(store.aclose())


@pytest.fixture(params=["memory", "redis"])
def env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Env]:
    """An empty IS over each store, with room for large records and a quota of 5 records."""
    yield from _env(request, tmp_path, body_limit=8 << 20, max_records_per_holder=QUOTA)


def problem(answer: httpx.Response, status: int, name: str, path: str | None = None) -> Any:
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    body = answer.json()
    assert body["type"] == PREFIX + name
    assert body["status"] == status
    if path is not None:
        assert body["path"] == path
    return body


def with_digests(r: ReplicaRecord, count: int) -> ReplicaRecord:
    """``r`` listing ``count`` layer digests, with the replica digest they hash to."""
    digests = tuple(hashlib.sha256(b"layer %d" % n).digest() for n in range(count))
    return replace(
        r, layer_digests=digests, digest=hashlib.sha256(b"".join(digests)).digest(), residency=None
    )


def batch(env: Env, records: list[ReplicaRecord], who: str = "h1") -> list[dict[str, Any]]:
    body = {"records": [r.to_json() for r in records]}
    answer = env.client.post("/replicas", json=body, headers=auth(who))
    assert answer.status_code == 200, answer.text
    results: list[dict[str, Any]] = answer.json()["results"]
    return results


def count(env: Env) -> int:
    return int(env.run(env.store.count()))


# --- records against their descriptor ----------------------------------------------------------


def test_layer_digests_beyond_the_descriptor_are_refused(env: Env) -> None:
    wide = with_digests(record(0), 12_000)  # the descriptor has 4 layers
    problem(env.put(wide), 422, "kvsp-incompatible", "$.layer_digests")
    results = batch(env, [with_digests(record(i), 12_000) for i in range(3)])
    assert [r["ok"] for r in results] == [False] * 3
    assert results[2]["problem"]["path"] == "$.records[2].layer_digests"
    problem(env.put(with_digests(record(1), 3)), 422, "kvsp-incompatible", "$.layer_digests")
    # An unknown compat id is kept as before, but never with more layers than a container has.
    unknown = with_digests(record(2, compat=UNKNOWN), 5_000)
    problem(env.put(unknown), 413, "kvsp-bad-request", "$.layer_digests")
    assert count(env) == 0
    assert env.put(with_digests(record(3, compat=UNKNOWN), 12)).status_code == 200
    assert env.put(record(4)).status_code == 200
    assert count(env) == 2


def test_residency_beyond_the_descriptor_is_refused(env: Env) -> None:
    r = replace(
        record(0), layer_digests=None, residency=(Residency(tier=Tier.HOST, first=0, last=11),)
    )
    problem(env.put(r), 422, "kvsp-incompatible", "$.residency[0].layers")
    assert count(env) == 0


def test_a_digest_that_is_not_of_the_layer_digests_is_refused(env: Env) -> None:
    forged = replace(record(0), digest=hashlib.sha256(b"something else").digest())
    problem(env.put(forged), 422, "kvsp-digest-mismatch", "$.digest")
    other = replace(record(1, compat=UNKNOWN), digest=forged.digest)  # no descriptor needed
    problem(env.put(other), 422, "kvsp-digest-mismatch", "$.digest")
    [result] = batch(env, [forged])
    assert result["problem"]["path"] == "$.records[0].digest"
    assert result["problem"]["type"] == PREFIX + "kvsp-digest-mismatch"
    assert count(env) == 0


def test_impossible_sizes_are_refused(env: Env) -> None:
    problem(env.put(replace(record(0), size=2**40)), 400, "kvsp-bad-request", "$.size")
    problem(env.put(replace(record(0), size=10)), 400, "kvsp-bad-request", "$.size")
    assert count(env) == 0


# --- the per-holder record quota ---------------------------------------------------------------


def test_a_holder_keeps_at_most_its_quota_of_records(env: Env) -> None:
    for i in range(QUOTA):
        assert env.put(record(i)).status_code == 200
    body = problem(env.put(record(QUOTA)), 507, "kvsp-insufficient-storage")
    assert str(QUOTA) in body["detail"]
    assert env.put(record(0, ttl=1_000)).status_code == 200  # a refresh always passes
    results = batch(env, [record(1), record(10), record(11)])
    assert [r["ok"] for r in results] == [True, False, False]
    assert results[1]["problem"]["status"] == 507
    assert env.put(record(0, H2), who="h2").status_code == 200  # another holder's quota
    assert count(env) == QUOTA + 1
    # A withdrawal and an expiry (once swept) each make room again.
    assert env.client.delete(url_of(record(1)), headers=auth("h1")).status_code == 204
    assert env.put(record(20)).status_code == 200
    problem(env.put(record(21)), 507, "kvsp-insufficient-storage")
    env.clock.advance(1_000)  # record 0 expires
    assert env.run(env.app.state.index.sweep(env.clock.now_ms(), 100)) == 1
    assert env.put(record(21)).status_code == 200
    problem(env.put(record(22)), 507, "kvsp-insufficient-storage")


def test_the_quota_counts_every_scope_of_a_holder(env: Env) -> None:
    assert [r["ok"] for r in batch(env, [record(i, H2) for i in range(3)], "h2")] == [True] * 3
    in_b = [record(i, H2, scope=SCOPE_B) for i in range(10, 13)]
    assert [r["ok"] for r in batch(env, in_b, "h2")] == [True, True, False]
    problem(env.put(record(3, H2), who="h2"), 507, "kvsp-insufficient-storage")
    assert count(env) == QUOTA


def test_the_quota_default_is_stated() -> None:
    assert IndexConfig().max_records_per_holder == DEFAULT_MAX_RECORDS_PER_HOLDER == 500_000
    assert IndexConfig().max_epoch_skew_ms == DEFAULT_MAX_EPOCH_SKEW_MS == 60_000


# --- status epochs -----------------------------------------------------------------------------


def put_status(env: Env, epoch: int) -> httpx.Response:
    body = status(epoch).to_json()
    return env.client.put(f"/instances/{uri_id(II7)}/status", json=body, headers=auth("i7"))


def test_a_status_epoch_far_ahead_of_the_clock_is_refused(env: Env) -> None:
    assert put_status(env, NOW).status_code == 200
    body = problem(put_status(env, NOW + 10**9), 400, "kvsp-bad-request", "$.epoch")
    assert str(DEFAULT_MAX_EPOCH_SKEW_MS) in body["detail"]
    assert put_status(env, NOW).status_code == 200  # the real instance is not locked out
    assert put_status(env, NOW + DEFAULT_MAX_EPOCH_SKEW_MS).status_code == 200  # the bound


def test_a_poisoned_status_epoch_yields_to_the_next_status(env: Env) -> None:
    env.clock.set(NOW + 10**9)  # the IS's clock ran far ahead, then was stepped back
    assert put_status(env, NOW + 10**9).status_code == 200
    env.clock.set(NOW)
    assert put_status(env, 5).status_code == 200  # replaces the poisoned epoch
    problem(put_status(env, 4), 409, "kvsp-stale-epoch")  # and §6.3 holds from it on
    lookup = {
        "scope_id": ScopeId(SCOPE_A).hex(),
        "compat_id": COMPAT.hex(),
        "block_keys": [record(0).block_key.hex()],
        "targets": [II7],
    }
    assert env.put(record(0)).status_code == 200
    answer = env.client.post("/lookup", json=lookup, headers=auth("admin"))
    assert set(answer.json()["estimates"]) == {II7}  # the new record serves estimates
