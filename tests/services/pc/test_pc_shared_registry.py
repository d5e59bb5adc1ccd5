"""Two Placement Controller processes sharing one instance registry in Redis (``kvsp serve pc
--store redis://…`` twice, over one ``kvsp serve index`` on the same Redis; spec §6.3, §6.8):
a status sent to one PC is listed, placed on and state-changed through the other; a restart
seen by one is seen by the other; an expiry is declared once and withdraws the instance's
replicas at the IS; a session placed through one PC is moved by the other when its instance
dies; ``DELETE instances/{id}?epoch=E`` (:meth:`PCClient.end_epoch`) ends an epoch
gracefully. Instances are fake (``tests/support/fake_instance.py``) or status records sent by
the test."""

from __future__ import annotations

import asyncio
import hashlib
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("redis")

from kvsp.compat import CompatibilityDescriptor, compat_id  # noqa: E402
from kvsp.ids import BlockKey, CompatId, ScopeId, uri_id  # noqa: E402
from kvsp.records import (  # noqa: E402
    InstanceStatusRecord,
    ReplicaRecord,
    Sampler,
    SessionCheckpoint,
    dumps,
)
from kvsp.registries import InstanceState  # noqa: E402
from kvsp.services.pc.client import PCClient  # noqa: E402
from kvsp.web.auth import principal_entry, write_principals  # noqa: E402
from kvsp.web.testing import RunningService, start_process  # noqa: E402
from tests.support import SUPPORT  # noqa: E402
from tests.support.polling import eventually  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # IS, two PCs, fake instances
FAKE = SUPPORT / "fake_instance.py"
SCOPE = ScopeId(b"\x1c" * 16)
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
PROBLEM = "urn:ietf:params:kvsp:problem:"


def token(name: str) -> str:
    return f"shared-registry-{name}-token-0123456789"


def auth(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token(name)}"}


def key(i: int) -> BlockKey:
    return BlockKey(hashlib.sha256(b"shared-registry-key%d" % i).digest())


def replica(i: int, holder: str) -> ReplicaRecord:
    digests = tuple(hashlib.sha256(b"%d/%d" % (i, n)).digest() for n in range(4))
    return ReplicaRecord(
        block_key=key(i),
        compat_id=COMPAT,
        scope_id=SCOPE,
        holder=holder,
        codec=1,
        size=4096,
        digest=hashlib.sha256(b"".join(digests)).digest(),
        layer_digests=digests,
        residency=None,
        ttl_ms=120_000,
    )


def status(instance: str, *, epoch: int = 1, ttl_ms: int = 60_000) -> dict[str, Any]:
    return InstanceStatusRecord(
        instance=instance,
        epoch=epoch,
        state=InstanceState.ACTIVE,
        running=0,
        queued=0,
        batch_size=8,
        kv_utilization=0.1,
        prefill_tokens_per_s=10_000.0,
        decode_tokens_per_s=1_000.0,
        links=(),
        requested_state=None,
        ttl_ms=ttl_ms,
    ).to_json()


def checkpoint(session: uuid.UUID, instance: str) -> dict[str, Any]:
    return SessionCheckpoint(
        session=session,
        epoch=1,
        compat_id=COMPAT,
        scope_id=SCOPE,
        prompt_blocks=(key(0),),
        prompt_tail=(3, 4),
        generated=(100, 101, 102),
        output_offset=3,
        sampler=Sampler(method="greedy", params={}, seed=1, step=3, deterministic=True),
        instance=instance,
        max_tokens=None,
    ).to_json()


def problem(answer: httpx.Response) -> str:
    assert answer.headers["content-type"].startswith("application/problem+json"), answer.text
    kind: str = answer.json()["type"]
    return kind.removeprefix(PROBLEM)


class Shared:
    """One IS and two PCs on one Redis, fake instances, and an HTTP client; all stopped at
    the end of the test."""

    def __init__(self, folder: Path, redis_url: str) -> None:
        self.folder = folder
        self.redis_url = redis_url
        self.started: list[RunningService] = []
        self.http = httpx.Client(timeout=20.0)
        self.urls: dict[str, str] = {}
        self.logs: dict[str, Path] = {}

    def start(self, name: str, argv: list[str]) -> RunningService:
        workdir = self.folder / name
        workdir.mkdir()
        service = start_process(argv, workdir=workdir, ready_timeout=60)
        self.started.append(service)
        return service

    def fake_instances(self, *names: str) -> None:
        for name in names:
            log = self.folder / f"{name}.jsonl"
            service = self.start(name, [sys.executable, str(FAKE), "serve", "--log", str(log)])
            self.urls[name], self.logs[name] = service.base_url, log

    def received(self, name: str, kind: str) -> list[Any]:
        import json

        log = self.logs[name]
        lines = log.read_text().splitlines() if log.exists() else []
        return [e["body"] for e in map(json.loads, lines) if e["kind"] == kind]

    def serve(self) -> tuple[str, str, str]:
        """Write the principals (instances as named by :meth:`fake_instances`), start the IS
        and the two PCs; their base URLs."""
        entries = [
            principal_entry("admin", token("admin"), ["admin"], None),
            principal_entry("pc", token("pc"), ["pc"], None),
            principal_entry("client", token("client"), ["client"], [SCOPE]),
        ]
        entries += [
            principal_entry(name, token(name), ["instance"], [SCOPE], [url])
            for name, url in self.urls.items()
        ]
        write_principals(self.folder / "principals.toml", entries)
        (self.folder / "descriptor.json").write_bytes(dumps(DESCRIPTOR))
        (self.folder / "pc.token").write_text(token("pc"))
        common = ["--listen", "127.0.0.1:0", "--store", self.redis_url]
        common += ["--principals", str(self.folder / "principals.toml")]
        common += ["--descriptor", str(self.folder / "descriptor.json")]
        kvsp = [sys.executable, "-m", "kvsp", "serve"]
        index = self.start("is", [*kvsp, "index", "--state", str(self.folder / "is"), *common])
        pcs = [
            self.start(
                f"pc{n}",
                [
                    *kvsp,
                    "pc",
                    "--state",
                    str(self.folder / f"pc{n}-state"),
                    *common,
                    "--index",
                    index.base_url,
                    "--index-token-file",
                    str(self.folder / "pc.token"),
                    "--status-sweep-ms",
                    "100",
                ],  # fmt: skip
            )
            for n in (1, 2)
        ]
        return index.base_url, pcs[0].base_url, pcs[1].base_url

    def pc_log(self, n: int) -> str:
        return (self.folder / f"pc{n}" / "output.log").read_text(errors="replace")

    def report(self, pc: str, name: str, **kw: Any) -> httpx.Response:
        url = self.urls[name]
        return self.http.put(
            f"{pc}instances/{uri_id(url)}/status", json=status(url, **kw), headers=auth(name)
        )

    def listed(self, pc: str) -> dict[str, dict[str, Any]]:
        answer = self.http.get(f"{pc}instances", headers=auth("admin"))
        assert answer.status_code == 200, answer.text
        return {row["instance"]: row for row in answer.json()["instances"]}

    def publish(self, index: str, name: str, count: int = 2) -> None:
        for i in range(count):
            r = replica(i, self.urls[name])
            path = f"{index}replicas/{COMPAT.hex()}/{SCOPE.hex()}/{key(i).hex()}/{uri_id(r.holder)}"
            answer = self.http.put(path, json=r.to_json(), headers=auth(name))
            assert answer.status_code == 200, answer.text

    def holders(self, index: str) -> list[str]:
        body = {"scope_id": SCOPE.hex(), "compat_id": COMPAT.hex(), "block_keys": [key(0).hex()]}
        answer = self.http.post(f"{index}lookup", json=body, headers=auth("admin"))
        assert answer.status_code == 200, answer.text
        found = answer.json()["replicas"]
        return sorted(r["holder"] for r in found[0]) if found else []

    def place(self, pc: str, session: uuid.UUID | None = None) -> httpx.Response:
        body: dict[str, Any] = {
            "scope_id": SCOPE.hex(),
            "compat_id": COMPAT.hex(),
            "block_keys": [],
            "prompt_tokens": 20,
        }
        if session is not None:
            body["session"] = str(session)
        return self.http.post(f"{pc}place", json=body, headers=auth("client"))

    def stop(self) -> None:
        for service in reversed(self.started):
            service.stop()
        self.http.close()


@pytest.fixture
def shared(tmp_path: Path, redis_url: str) -> Iterator[Shared]:
    world = Shared(tmp_path, redis_url)
    try:
        yield world
    finally:
        world.stop()


def test_status_taken_by_one_pc_is_listed_placed_and_changed_by_the_other(
    shared: Shared,
) -> None:
    shared.fake_instances("a")
    _, pc1, pc2 = shared.serve()
    a = shared.urls["a"]
    assert shared.report(pc1, "a", epoch=1).json() == {"state": "active"}
    row = shared.listed(pc2)[a]
    assert (row["state"], row["epoch"]) == ("active", 1)
    placed = shared.place(pc2)
    assert placed.status_code == 200 and placed.json()["instance"] == a, placed.text
    # an operator's drain through the second PC reaches the instance that reported to the first
    path = f"instances/{uri_id(a)}/state"
    drained = shared.http.put(f"{pc2}{path}", json={"state": "draining"}, headers=auth("admin"))
    assert drained.json() == {"state": "draining"}, drained.text
    assert shared.received("a", "state") == [{"state": "draining"}]
    assert shared.listed(pc1)[a]["state"] == "draining"
    assert shared.place(pc1).status_code == 503  # nobody active: the drain is shared too
    # a restart seen by the first PC is seen by the second, which refuses the old epoch
    assert shared.report(pc1, "a", epoch=2).json() == {"state": "active"}
    row = shared.listed(pc2)[a]
    assert (row["state"], row["epoch"]) == ("active", 2)
    assert problem(shared.report(pc2, "a", epoch=1)) == "kvsp-stale-epoch"


def test_an_expiry_is_declared_once_and_withdraws_the_replicas(shared: Shared) -> None:
    shared.fake_instances("a")
    index, pc1, pc2 = shared.serve()
    a = shared.urls["a"]
    shared.publish(index, "a")
    assert shared.holders(index) == [a]
    assert shared.report(pc1, "a", ttl_ms=1_000).status_code == 200
    eventually(lambda: shared.listed(pc2)[a]["state"] == "failed" or None, what="a failed")
    eventually(lambda: shared.holders(index) == [] or None, what="a's replicas withdrawn")
    assert shared.listed(pc1)[a]["state"] == "failed"
    time.sleep(0.5)  # both PCs swept several times since
    declared = [shared.pc_log(n).count("failed: its status record expired") for n in (1, 2)]
    assert sorted(declared) == [0, 1], declared


def test_a_session_placed_through_one_pc_is_moved_by_the_other(shared: Shared) -> None:
    shared.fake_instances("a", "b")
    _, pc1, pc2 = shared.serve()
    a, b = shared.urls["a"], shared.urls["b"]
    assert shared.report(pc1, "a", ttl_ms=1_500).status_code == 200
    session = uuid.uuid4()
    placed = shared.place(pc1, session)
    assert placed.status_code == 200 and placed.json()["instance"] == a, placed.text
    put = shared.http.put(
        f"{pc1}sessions/{session}/checkpoint", json=checkpoint(session, a), headers=auth("a")
    )
    assert put.status_code == 200, put.text
    assert shared.report(pc2, "b").status_code == 200  # b is known to the second PC only
    shared.started[-2].stop()  # the first PC is gone: only the second can move the session

    def moved() -> dict[str, Any] | None:
        view = shared.http.get(f"{pc2}sessions/{session}", headers=auth("client")).json()
        return view if view["instance"] == b and view["state"] == "serving" else None

    view = eventually(moved, timeout=30, what="the session moved to b")
    assert view["epoch"] == 2
    [resume] = shared.received("b", "resume")
    assert resume["epoch"] == 2 and resume["checkpoint"]["output_offset"] == 3


def test_deleting_an_instance_ends_its_epoch_everywhere(shared: Shared) -> None:
    shared.fake_instances("a", "b")
    index, pc1, pc2 = shared.serve()
    a = shared.urls["a"]
    shared.publish(index, "a")
    assert shared.report(pc1, "a", epoch=7).status_code == 200
    path = f"instances/{uri_id(a)}"
    delete = shared.http.delete
    assert problem(delete(f"{pc2}{path}?epoch=6", headers=auth("a"))) == "kvsp-stale-epoch"
    assert problem(delete(f"{pc2}{path}?epoch=x", headers=auth("a"))) == "kvsp-bad-request"
    assert problem(delete(f"{pc2}{path}", headers=auth("a"))) == "kvsp-bad-request"
    assert problem(delete(f"{pc2}{path}?epoch=7", headers=auth("b"))) == "kvsp-forbidden"
    unknown = f"{pc2}instances/{'0' * 32}?epoch=7"
    assert problem(delete(unknown, headers=auth("admin"))) == "kvsp-not-found"
    assert problem(delete(unknown, headers=auth("a"))) == "kvsp-forbidden"  # no existence leak

    async def end() -> None:  # as the instance does when it shuts down
        async with PCClient(pc2, token("a"), timeout=10.0) as client:
            await client.end_epoch(a, 7)

    asyncio.run(end())
    assert a not in shared.listed(pc1) and a not in shared.listed(pc2)
    assert shared.holders(index) == []
    assert shared.place(pc1).status_code == 503
    assert problem(delete(f"{pc1}{path}?epoch=7", headers=auth("a"))) == "kvsp-not-found"
    assert problem(shared.report(pc1, "a", epoch=7)) == "kvsp-stale-epoch"  # a late record
    time.sleep(0.3)  # sweeps ran: an ended epoch is never reported failed
    assert "failed: its status record expired" not in shared.pc_log(1) + shared.pc_log(2)
    assert shared.report(pc2, "a", epoch=8).json() == {"state": "active"}  # a new epoch
    assert shared.listed(pc1)[a]["epoch"] == 8
