"""Three Index Service and two PC processes on one Redis (``kvsp serve index|pc --store
redis://…``): a publish through one IS is seen through the others; a
session placed and checkpointed through one PC is read through the other, whose answers follow
the shared epoch: a checkpoint of a lower epoch sent to it is ``kvsp-stale-epoch`` (§6.8 MUST)."""

from __future__ import annotations

import asyncio
import hashlib
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

redis = pytest.importorskip("redis")

from kvsp.compat import CompatibilityDescriptor, compat_id  # noqa: E402
from kvsp.ids import BlockKey, CompatId, ScopeId, uri_id  # noqa: E402
from kvsp.records import (  # noqa: E402
    InstanceStatusRecord,
    LookupRequest,
    ReplicaRecord,
    Sampler,
    SessionCheckpoint,
    dumps,
)
from kvsp.registries import InstanceState  # noqa: E402
from kvsp.services.index.client import IndexClient  # noqa: E402
from kvsp.stores.redis_sessions import RedisSessionStore  # noqa: E402
from kvsp.web.auth import principal_entry, write_principals  # noqa: E402
from kvsp.web.testing import RunningService, start_process  # noqa: E402

pytestmark = pytest.mark.slow  # PC and IS processes sharing one Redis
SCOPE = ScopeId(b"\x0f" * 16)
A = "https://pc-proc-a.example/kvsp/"
B = "https://pc-proc-b.example/kvsp/"
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
COMPAT = CompatId(compat_id(DESCRIPTOR))
TOKENS = {name: f"pc-process-{name}-token-0123456789" for name in ("admin", "pc", "ia", "client")}
PROBLEM = "urn:ietf:params:kvsp:problem:"


def key(i: int) -> BlockKey:
    return BlockKey(hashlib.sha256(b"redis-pc-process-key%d" % i).digest())


def auth(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer {TOKENS[name]}"}


def replica(i: int) -> ReplicaRecord:
    digests = tuple(hashlib.sha256(b"%d/%d" % (i, n)).digest() for n in range(4))
    return ReplicaRecord(
        block_key=key(i),
        compat_id=COMPAT,
        scope_id=SCOPE,
        holder=A,
        codec=1,
        size=4096,
        digest=hashlib.sha256(b"".join(digests)).digest(),
        layer_digests=digests,
        residency=None,
        ttl_ms=60_000,
    )


def status(instance: str) -> InstanceStatusRecord:
    return InstanceStatusRecord(
        instance=instance,
        epoch=1,
        state=InstanceState.ACTIVE,
        running=0,
        queued=0,
        batch_size=8,
        kv_utilization=0.1,
        prefill_tokens_per_s=10_000.0,
        decode_tokens_per_s=1_000.0,
        links=(),
        requested_state=None,
        ttl_ms=60_000,  # no failover while the test runs
    )


def checkpoint(session: uuid.UUID, offset: int, epoch: int, instance: str) -> SessionCheckpoint:
    return SessionCheckpoint(
        session=session,
        epoch=epoch,
        compat_id=COMPAT,
        scope_id=SCOPE,
        prompt_blocks=(key(0),),
        prompt_tail=(3, 4),
        generated=tuple(range(100, 100 + offset)),
        output_offset=offset,
        sampler=Sampler(method="greedy", params={}, seed=1, step=offset, deterministic=True),
        instance=instance,
        max_tokens=None,
    )


def problem(answer: httpx.Response) -> str:
    assert answer.headers["content-type"].startswith("application/problem+json"), answer.text
    kind: str = answer.json()["type"]
    return kind.removeprefix(PROBLEM)


@pytest.fixture
def services(tmp_path: Path, redis_url: str) -> Iterator[tuple[list[RunningService], ...]]:
    """Three IS processes, then two PC processes (the first on the first IS, the second on the
    second), all with ``--store redis_url``; stopped at teardown."""
    principals = tmp_path / "principals.toml"
    write_principals(
        principals,
        [
            principal_entry("admin", TOKENS["admin"], ["admin"], None),
            principal_entry("pc", TOKENS["pc"], ["pc"], None),
            principal_entry("ia", TOKENS["ia"], ["instance"], [SCOPE], [A]),
            principal_entry("client", TOKENS["client"], ["client"], [SCOPE]),
        ],
    )
    (tmp_path / "descriptor.json").write_bytes(dumps(DESCRIPTOR))
    (tmp_path / "pc.token").write_text(TOKENS["pc"])
    common = ["--listen", "127.0.0.1:0", "--principals", str(principals), "--store", redis_url]
    common += ["--descriptor", str(tmp_path / "descriptor.json")]
    started: list[RunningService] = []
    try:
        for n in range(3):
            workdir = tmp_path / f"is-{n}"
            workdir.mkdir()
            argv = [sys.executable, "-m", "kvsp", "serve", "index", "--state", str(workdir / "s")]
            started.append(start_process([*argv, *common], workdir=workdir))
        for n in range(2):
            workdir = tmp_path / f"pc-{n}"
            workdir.mkdir()
            argv = [
                sys.executable, "-m", "kvsp", "serve", "pc", "--state", str(workdir / "s"),
                "--index", started[n].base_url, "--index-token-file", str(tmp_path / "pc.token"),
            ]  # fmt: skip
            started.append(start_process([*argv, *common], workdir=workdir))
        yield started[:3], started[3:]
    finally:
        for service in started:
            service.stop()


async def _lookup(url: str) -> int:
    request = LookupRequest(scope_id=SCOPE, compat_id=COMPAT, block_keys=(key(0), key(1)))
    async with IndexClient(url, TOKENS["admin"], timeout=10.0) as client:
        return (await client.lookup(request)).matched


async def _publish(url: str) -> None:
    async with IndexClient(url, TOKENS["admin"], timeout=10.0) as client:
        await client.publish(replica(0))


def test_two_pcs_and_three_iss_share_one_redis(
    services: tuple[list[RunningService], list[RunningService]], redis_url: str
) -> None:
    iss, (pc1, pc2) = services
    asyncio.run(_publish(iss[2].base_url))
    assert [asyncio.run(_lookup(s.base_url)) for s in iss] == [1, 1, 1]

    session = uuid.uuid4()
    with httpx.Client(timeout=10.0) as http:
        one, two = pc1.base_url, pc2.base_url
        reported = http.put(
            f"{one}instances/{uri_id(A)}/status", json=status(A).to_json(), headers=auth("admin")
        )
        assert reported.status_code == 200, reported.text
        body: dict[str, Any] = {
            "scope_id": SCOPE.hex(),
            "compat_id": COMPAT.hex(),
            "block_keys": [key(0).hex()],
            "prompt_tokens": 20,
            "session": str(session),
        }
        placed = http.post(f"{one}place", json=body, headers=auth("client"))
        assert placed.status_code == 200 and placed.json()["instance"] == A, placed.text
        # The session placed through the first PC is read through the second.
        seen = http.get(f"{two}sessions/{session}", headers=auth("client"))
        assert seen.status_code == 200, seen.text
        assert seen.json()["instance"] == A and seen.json()["epoch"] == 1
        # Placing the same session through the second PC is a conflict: it is shared.
        assert problem(http.post(f"{two}place", json=body, headers=auth("client"))) == (
            "kvsp-conflict"
        )

        path = f"sessions/{session}/checkpoint"
        cp = checkpoint(session, 5, 1, A).to_json()
        put = http.put(f"{one}{path}", json=cp, headers=auth("ia"))
        assert put.status_code == 200, put.text
        seen = http.get(f"{two}sessions/{session}", headers=auth("client"))
        assert seen.json()["output_offset"] == 5

        # A third PC process moves the session to epoch 2 (as a failover does)...
        async def advance() -> None:
            store = RedisSessionStore.from_url(redis_url)
            try:
                await store.advance_epoch(session, 1, B, 10**13)
            finally:
                await store.aclose()

        asyncio.run(advance())
        # ...and a checkpoint of epoch 1 sent to the second PC is stale, even though that PC
        # never changed the session itself; the first PC answers alike.
        later = checkpoint(session, 7, 1, A).to_json()
        assert problem(http.put(f"{two}{path}", json=later, headers=auth("ia"))) == (
            "kvsp-stale-epoch"
        )
        assert problem(http.put(f"{one}{path}", json=later, headers=auth("ia"))) == (
            "kvsp-stale-epoch"
        )
        for url in (one, two):
            view = http.get(f"{url}sessions/{session}", headers=auth("client")).json()
            assert (view["epoch"], view["instance"], view["output_offset"]) == (2, B, 5)


def test_two_control_planes_share_sessions(tmp_path: Path, redis_url: str) -> None:
    """``kvsp serve control --store redis://…`` twice: the PC halves share sessions too."""
    principals = tmp_path / "principals.toml"
    write_principals(
        principals,
        [
            principal_entry("admin", TOKENS["admin"], ["admin"], None),
            principal_entry("ia", TOKENS["ia"], ["instance"], [SCOPE], [A]),
            principal_entry("client", TOKENS["client"], ["client"], [SCOPE]),
        ],
    )
    (tmp_path / "descriptor.json").write_bytes(dumps(DESCRIPTOR))
    started: list[RunningService] = []
    try:
        for n in range(2):
            workdir = tmp_path / f"control-{n}"
            workdir.mkdir()
            argv = [
                sys.executable, "-m", "kvsp", "serve", "control", "--listen", "127.0.0.1:0",
                "--state", str(workdir / "s"), "--principals", str(principals),
                "--store", redis_url, "--descriptor", str(tmp_path / "descriptor.json"),
            ]  # fmt: skip
            started.append(start_process(argv, workdir=workdir))
        one, two = (s.base_url for s in started)
        session = uuid.uuid4()
        with httpx.Client(timeout=10.0) as http:
            reported = http.put(
                f"{one}instances/{uri_id(A)}/status",
                json=status(A).to_json(),
                headers=auth("admin"),
            )
            assert reported.status_code == 200, reported.text
            body = {
                "scope_id": SCOPE.hex(),
                "compat_id": COMPAT.hex(),
                "block_keys": [],
                "prompt_tokens": 20,
                "session": str(session),
            }
            placed = http.post(f"{one}place", json=body, headers=auth("client"))
            assert placed.status_code == 200, placed.text
            path = f"sessions/{session}/checkpoint"
            # Checkpointed through the second, which never placed it.
            cp = checkpoint(session, 4, 1, A).to_json()
            assert http.put(f"{two}{path}", json=cp, headers=auth("ia")).status_code == 200
            view = http.get(f"{one}sessions/{session}", headers=auth("client")).json()
            assert (view["epoch"], view["output_offset"]) == (1, 4)
            ahead = checkpoint(session, 6, 2, A).to_json()
            assert problem(http.put(f"{one}{path}", json=ahead, headers=auth("ia"))) == (
                "kvsp-conflict"
            )
    finally:
        for service in started:
            service.stop()
