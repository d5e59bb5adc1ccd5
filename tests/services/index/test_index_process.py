"""The Index Service as a real process (``kvsp serve index`` / ``kvsp serve control`` on
127.0.0.1), driven with IndexClient: publish → lookup → withdraw, scope isolation, forged
holders, expiry on the wall clock, the mismatch hint, estimates, batches, descriptors. Every
test runs twice: over the in-memory store and over Redis (``--store redis://…``)."""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import sys
import tempfile
import time
from collections.abc import Coroutine, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from kvsp import errors
from kvsp.compat import CompatibilityDescriptor, compat_id
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.placement import estimate_targets
from kvsp.records import (
    InstanceStatusRecord,
    Link,
    LookupRequest,
    ReplicaRecord,
    dumps,
)
from kvsp.registries import InstanceState
from kvsp.services.index.client import IndexClient
from kvsp.web.auth import principal_entry, write_principals
from kvsp.web.testing import RunningService, start_process
from tests.support.polling import until

T = TypeVar("T")
SCOPE_A = ScopeId(b"\x0a" * 16)
SCOPE_B = ScopeId(b"\x0b" * 16)
SCOPE_EMPTY = ScopeId(b"\x0e" * 16)  # no test stores here: a lookup in it is a plain miss
H1 = "https://h1.example/kvsp/"
II7 = "https://ii7.example/kvsp/"
DESCRIPTOR = CompatibilityDescriptor(
    model="m",
    model_digest=b"\xa1" * 32,
    tokenizer_digest=b"\xb2" * 32,
    layers=4,
    kv_heads=2,
    head_dim=8,
    kv_dtype="bf16",
    positional="rope",
    block_tokens=16,
)
COMPAT = compat_id(DESCRIPTOR)
DRIFTED_DESCRIPTOR = replace(DESCRIPTOR, kv_dtype="fp16")
DRIFTED = compat_id(DRIFTED_DESCRIPTOR)
PRINCIPALS = {
    # name: (roles, scopes, holders)
    "h1": (["holder"], [SCOPE_A, SCOPE_B], [H1]),
    "ca": (["client"], [SCOPE_A], []),
    "cb": (["client"], [SCOPE_B, SCOPE_EMPTY], []),
    "i7": (["instance"], [], [II7]),
}


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def token(name: str) -> str:
    return f"process-token-{name}-0123456789"


def key(i: int) -> BlockKey:
    return BlockKey(hashlib.sha256(b"process-key%d" % i).digest())


def record(
    i: int, *, holder: str = H1, compat: bytes = COMPAT, scope: bytes = SCOPE_A, ttl: int = 60_000
) -> ReplicaRecord:
    digests = tuple(hashlib.sha256(b"%d/%d" % (i, n)).digest() for n in range(4))
    return ReplicaRecord(
        block_key=key(i),
        compat_id=CompatId(compat),
        scope_id=ScopeId(scope),
        holder=holder,
        codec=1,
        size=4096,
        digest=hashlib.sha256(b"".join(digests)).digest(),
        layer_digests=digests,
        residency=None,
        ttl_ms=ttl,
    )


def request(*indices: int, scope: bytes = SCOPE_A, compat: bytes = COMPAT, **kw: Any) -> Any:
    return LookupRequest(
        scope_id=ScopeId(scope),
        compat_id=CompatId(compat),
        block_keys=tuple(key(i) for i in indices),
        **kw,
    )


def status(epoch: int) -> InstanceStatusRecord:
    return InstanceStatusRecord(
        instance=II7,
        epoch=epoch,
        state=InstanceState.ACTIVE,
        running=0,
        queued=0,
        batch_size=8,
        kv_utilization=0.1,
        prefill_tokens_per_s=4000.0,
        decode_tokens_per_s=300.0,
        links=(Link(holder=H1, mbit_per_s=8000.0, rtt_us=40.0),),
        requested_state=None,
        ttl_ms=60_000,
    )


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("index-state")
    entries = [
        principal_entry(name, token(name), roles, scopes, holders)
        for name, (roles, scopes, holders) in PRINCIPALS.items()
    ]
    write_principals(folder / "principals.toml", entries)
    (folder / "descriptor.json").write_bytes(dumps(DESCRIPTOR))
    return folder


@pytest.fixture(scope="module", params=["memory", "redis"])
def store(request: pytest.FixtureRequest) -> Iterator[str]:
    """``--store`` for the module's servers: ``memory``, or a Redis URL with a key prefix of
    the module's own (its keys deleted afterwards)."""
    if request.param == "memory":
        yield "memory"
        return
    redis = pytest.importorskip("redis")
    server: str = request.getfixturevalue("redis_server")
    prefix = f"test-{secrets.token_hex(6)}"
    yield f"{server}?prefix={prefix}"
    client = redis.Redis.from_url(server)
    try:
        for pattern in (f"{prefix}:*", f"{prefix}-control:*"):
            keys = list(client.scan_iter(match=pattern, count=1000))
            if keys:
                client.unlink(*keys)
    finally:
        client.close()


def serve_argv(service: str, state: Path, store: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvsp",
        "serve",
        service,
        "--listen",
        "127.0.0.1:0",
        "--state",
        str(state / "state"),
        "--principals",
        str(state / "principals.toml"),
        "--descriptor",
        str(state / "descriptor.json"),
        "--max-ttl-ms",
        "120000",
        "--body-limit",
        str(1 << 20),
        "--store",
        store,
    ]


@pytest.fixture(scope="module")
def server(state_dir: Path, store: str) -> Iterator[RunningService]:
    workdir = Path(tempfile.mkdtemp(prefix="index-run-", dir=state_dir))
    with start_process(serve_argv("index", state_dir, store), workdir=workdir) as running:
        yield running


def client(server: RunningService, who: str) -> IndexClient:
    return IndexClient(server.base_url, token(who), timeout=10.0)


def test_publish_lookup_withdraw(server: RunningService) -> None:
    async def scenario() -> None:
        async with client(server, "h1") as h1, client(server, "ca") as ca:
            assert await h1.publish(record(0, ttl=10**9)) == 120_000  # capped
            assert await h1.publish(record(1)) == 60_000
            answer = await ca.lookup(request(0, 1, 2))
            assert answer.matched == 2
            assert answer.replicas is not None
            assert answer.replicas[0][0] == replace(record(0), ttl_ms=answer.replicas[0][0].ttl_ms)
            assert 0 < answer.replicas[1][0].ttl_ms <= 60_000
            compact = await ca.lookup(request(0, 1, 2, compact=True))
            assert (compact.matched, compact.replicas) == (2, None)
            assert await h1.withdraw(COMPAT, SCOPE_A, key(1), H1)
            assert not await h1.withdraw(COMPAT, SCOPE_A, key(1), H1)
            assert (await ca.lookup(request(0, 1))).matched == 1

    run(scenario())


def test_scope_isolation_answers_exactly_like_a_miss(server: RunningService) -> None:
    async def scenario() -> None:
        async with client(server, "h1") as h1:
            await h1.publish(record(10, scope=SCOPE_A))
            await h1.publish(record(10, scope=SCOPE_A, compat=DRIFTED))
        body = request(10, 11, compact=False).to_json()
        empty = {**body, "scope_id": SCOPE_EMPTY.hex()}
        headers = {"authorization": f"Bearer {token('cb')}"}
        async with httpx.AsyncClient(base_url=server.base_url, headers=headers) as raw:
            denied = await raw.post("lookup", json=body)
            miss = await raw.post("lookup", json=empty)
        assert denied.status_code == miss.status_code == 200
        assert denied.content == miss.content == b'{"matched":0,"replicas":[]}'
        assert denied.headers["content-type"] == miss.headers["content-type"]

    run(scenario())


def test_forged_holder_and_foreign_scope_are_forbidden(server: RunningService) -> None:
    async def scenario() -> None:
        async with client(server, "h1") as h1, client(server, "ca") as ca:
            with pytest.raises(errors.Forbidden):
                await h1.publish(record(20, holder="https://evil.example/kvsp/"))
            with pytest.raises(errors.Forbidden):
                await ca.publish(record(20))  # a client is no holder
            assert (await ca.lookup(request(20))).matched == 0

    run(scenario())


def test_expired_records_are_gone(server: RunningService) -> None:
    async def scenario() -> None:
        async with client(server, "h1") as h1, client(server, "ca") as ca:

            async def gone() -> bool:
                return (await ca.lookup(request(30))).matched == 0

            loop = asyncio.get_running_loop()
            published = loop.time()
            assert await h1.publish(record(30, ttl=300)) == 300
            assert (await ca.lookup(request(30))).matched == 1
            await until(gone, 5, "the record expired", interval=0.05)
            assert loop.time() - published >= 0.29  # not before its 300 ms ttl (ms rounding)

    run(scenario())


def test_hint_on_compat_drift_only_where_the_caller_may_look(server: RunningService) -> None:
    async def scenario() -> None:
        async with client(server, "h1") as h1, client(server, "ca") as ca:
            await h1.publish(record(40, compat=DRIFTED))
            await h1.publish(record(41, compat=DRIFTED, scope=SCOPE_B))
            drift = await ca.lookup(request(40))
            assert drift.matched == 0
            assert drift.hint is not None and DRIFTED.hex() in drift.hint
            hidden = await ca.lookup(request(41, scope=SCOPE_B))
            assert hidden.hint is None

    run(scenario())


def test_estimates_match_placement(server: RunningService) -> None:
    async def scenario() -> None:
        async with client(server, "h1") as h1, client(server, "i7") as i7:
            await h1.publish(record(50))
            await h1.publish(record(51))
            assert (await i7.put_status(status(epoch=3))).state is InstanceState.ACTIVE
            with pytest.raises(errors.StaleEpoch):
                await i7.put_status(status(epoch=2))
            answer = await h1.lookup(request(50, 51, targets=(II7, "https://nobody.example/")))
            assert answer.replicas is not None
            expected = estimate_targets(answer.replicas, [status(3)], block_tokens=16, layers=4)
            assert answer.estimates is not None
            [estimate] = answer.estimates
            assert estimate.target == II7
            assert estimate.fetch_us == pytest.approx(expected[II7].fetch_us)
            assert estimate.recompute_us == pytest.approx(expected[II7].recompute_us)

    run(scenario())


def test_batch_publish_results(server: RunningService) -> None:
    async def scenario() -> None:
        async with client(server, "h1") as h1:
            results = await h1.publish_batch(
                [record(60), record(61, holder="https://evil.example/"), record(62, ttl=0)]
            )
            assert results[0] == 60_000
            assert isinstance(results[1], errors.Forbidden)
            assert isinstance(results[2], errors.BadRequest)
            assert (await h1.lookup(request(60, 61))).matched == 1

    run(scenario())


def test_bad_input_over_the_wire(server: RunningService) -> None:
    async def scenario() -> None:
        headers = {"authorization": f"Bearer {token('h1')}"}
        async with httpx.AsyncClient(base_url=server.base_url, headers=headers) as raw:
            malformed = await raw.post(
                "lookup", content=b"{", headers={"content-type": "application/kvsp+json"}
            )
            huge = await raw.post(
                "replicas",
                content=b" " * (2 << 20),
                headers={"content-type": "application/kvsp+json"},
            )
            unknown = await raw.get("nowhere")
            anonymous = await raw.post("lookup", json={}, headers={"authorization": ""})
        assert (malformed.status_code, huge.status_code, unknown.status_code) == (400, 413, 404)
        assert anonymous.status_code == 401
        for answer in (malformed, huge, unknown, anonymous):
            assert answer.headers["content-type"] == "application/problem+json"

    run(scenario())


def test_control_serves_the_same_index_and_persisted_descriptors(
    server: RunningService, state_dir: Path, store: str
) -> None:
    async def register() -> None:
        async with client(server, "h1") as h1:
            assert await h1.put_descriptor(DRIFTED_DESCRIPTOR) == DRIFTED

    run(register())
    workdir = Path(tempfile.mkdtemp(prefix="control-run-", dir=state_dir))
    started = time.monotonic()
    fresh = store if store == "memory" else store + "-control"  # another key prefix
    with start_process(serve_argv("control", state_dir, fresh), workdir=workdir) as control:

        async def scenario() -> None:
            async with client(control, "ca") as ca:
                assert await ca.get_descriptor(DRIFTED) == DRIFTED_DESCRIPTOR
                assert await ca.get_descriptor(COMPAT) == DESCRIPTOR  # from --descriptor
                assert (await ca.lookup(request(0))).matched == 0  # a fresh, empty store
            async with httpx.AsyncClient(base_url=control.base_url) as raw:
                assert (await raw.get("healthz")).json() == {"status": "ok"}

        run(scenario())
        assert control.stop() == 0
    assert time.monotonic() - started < 30
