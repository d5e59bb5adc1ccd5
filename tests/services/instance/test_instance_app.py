"""The instance's HTTP face in-process (§6.3 PUT state, §6.5 POST/GET prefetch, generate, the
holder face): every endpoint, with bad input answered by the right problem type and nothing
changed. The control plane is a small in-memory fake; no sockets."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsp.compat import compat_id
from kvsp.engine.toy import ToyEngine, toy_descriptor
from kvsp.errors import PROBLEM_PREFIX
from kvsp.keys import block_keys, scope_id
from kvsp.records import (
    InstanceStatusRecord,
    LookupRequest,
    LookupResponse,
    ReplicaRecord,
    StateAnswer,
)
from kvsp.registries import InstanceState
from kvsp.services.holder.service import Holder, HolderConfig
from kvsp.services.instance.app import create_instance_app
from kvsp.services.instance.requests import GenerateRequest
from kvsp.services.instance.service import InstanceAgent, InstanceConfig
from kvsp.stores.descriptors import DescriptorRegistry
from kvsp.transfer.block_client import BlockClient
from kvsp.web.auth import Principals, principal_entry
from kvsp.web.clock import ManualClock
from tests.support.polling import until

DESCRIPTOR = toy_descriptor(layers=2, kv_heads=2, head_dim=8, kv_dtype="fp16", block_tokens=4)
COMPAT = compat_id(DESCRIPTOR)
SCOPE_KEY = bytes(range(1, 33))
SCOPE = scope_id(SCOPE_KEY)
OTHER_KEY = bytes(range(50, 82))
URL = "http://ii.test/"
PC_TOKEN = "pc-token-0123456789abcdefghijklmnopqrstu"
CLIENT_TOKEN = "client-token-0123456789abcdefghijklmnopq"
STRANGER_TOKEN = "stranger-token-0123456789abcdefghijklmn"
PC = {"authorization": f"Bearer {PC_TOKEN}"}
CLIENT = {"authorization": f"Bearer {CLIENT_TOKEN}"}
STRANGER = {"authorization": f"Bearer {STRANGER_TOKEN}"}


def problem(name: str) -> str:
    return PROBLEM_PREFIX + name


class FakeControl:
    """PC and IS in memory: answers status with the reported state; knows no replicas."""

    def __init__(self) -> None:
        self.statuses: list[InstanceStatusRecord] = []
        self.published: list[ReplicaRecord] = []

    async def put_status(self, record: InstanceStatusRecord, /) -> StateAnswer:
        self.statuses.append(record)
        return StateAnswer(state=record.state)

    async def lookup(self, request: LookupRequest, /) -> LookupResponse:
        return LookupResponse(matched=0, replicas=())

    async def publish(self, record: ReplicaRecord, /) -> int:
        self.published.append(record)
        return record.ttl_ms

    async def publish_batch(self, records: Sequence[ReplicaRecord], /) -> list[Any]:
        return [await self.publish(r) for r in records]

    async def withdraw(self, compat: bytes, scope: bytes, key: bytes, holder: str, /) -> bool:
        return True


@dataclass
class Env:
    http: httpx.AsyncClient
    agent: InstanceAgent
    control: FakeControl


def principals() -> Principals:
    return Principals.from_entries(
        [
            principal_entry("pc", PC_TOKEN, ["pc"], None),
            principal_entry("client", CLIENT_TOKEN, ["client"], [SCOPE]),
            principal_entry("stranger", STRANGER_TOKEN, ["client"], [scope_id(OTHER_KEY)]),
        ]
    )


@asynccontextmanager
async def environment(tmp_path: Path) -> AsyncIterator[Env]:
    clock = ManualClock(1_000_000)
    control = FakeControl()
    engine = ToyEngine(DESCRIPTOR)
    registry = DescriptorRegistry()
    registry.add(DESCRIPTOR, persist=False)
    holder = Holder(HolderConfig(), index=control, descriptors=registry, clock=clock)
    blocks = BlockClient(PC_TOKEN)
    config = InstanceConfig(
        public_url=URL,
        status_loop=False,
        state_dir=tmp_path / "state",
        scope_keys={SCOPE: SCOPE_KEY},
        warmup_tokens=8,
        max_tokens=100,
    )
    agent = InstanceAgent(engine, holder, control, blocks, control, clock, config)
    app = create_instance_app(agent, principals(), clock, descriptors=registry)
    await agent.start()  # the ASGI transport runs no lifespan
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    try:
        async with httpx.AsyncClient(transport=transport, base_url=URL) as http:
            yield Env(http, agent, control)
    finally:
        await agent.close()
        await blocks.aclose()
        await engine.aclose()


def scenario(tmp_path: Path, body: Callable[[Env], Awaitable[None]]) -> None:
    async def main() -> None:
        async with environment(tmp_path) as env:
            await body(env)

    asyncio.run(main())


def assert_problem(answer: httpx.Response, status: int, name: str, path: str | None = None) -> None:
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"].startswith("application/problem+json")
    body = answer.json()
    assert body["type"] == problem(name)
    if path is not None:
        assert body.get("path") == path, body


def directive_json(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "directive": "a2b7c9e0-1f3d-4c1a-8f5b-6d2e9a7c3b10",
        "request_ref": "ref-1",
        "scope_id": SCOPE.hex(),
        "compat_id": COMPAT.hex(),
        "blocks": [{"block_key": "ab" * 32, "sources": ["http://127.0.0.1:9/"]}],
        "layer_order": "ascending",
        "deadline_ms": 5000,
        "lease_ms": 2000,
    }
    body.update(changes)
    return body


async def reference(prompt: Sequence[int], count: int) -> list[int]:
    engine = ToyEngine(DESCRIPTOR)
    seq = await engine.prefill(prompt, [])
    tokens = [t async for t in seq.tokens(count)]
    await seq.release()
    await engine.aclose()
    return tokens


def ndjson(answer: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line) for line in answer.text.splitlines()]


# -- prefetch (§6.5) ------------------------------------------------------------------------------


def test_prefetch_accepts_reports_and_is_idempotent(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        answer = await env.http.post("prefetch", json=directive_json(), headers=PC)
        assert answer.status_code == 202, answer.text
        location = answer.headers["location"]
        assert location == f"{URL}prefetch/a2b7c9e0-1f3d-4c1a-8f5b-6d2e9a7c3b10"
        assert answer.json()["state"] in ("pending", "failed")
        again = await env.http.post("prefetch", json=directive_json(), headers=PC)
        assert again.status_code == 202 and again.headers["location"] == location
        progress = env.agent.directives.get(uuid.UUID(directive_json()["directive"]))
        await env.agent.wait_directive(progress)
        status = await env.http.get(location, headers=PC)
        assert status.status_code == 200
        got = status.json()
        assert got["directive"] == directive_json()["directive"]
        assert got["state"] == "failed" and got["loaded"] == []  # no replica record anywhere
        assert "no replica record" in got["detail"]
        changed = await env.http.post("prefetch", json=directive_json(lease_ms=9), headers=PC)
        assert_problem(changed, 409, "kvsp-conflict")

    scenario(tmp_path, body)


@pytest.mark.parametrize(
    ("changes", "path"),
    [
        ({"deadline_ms": "50"}, "$.deadline_ms"),
        ({"scope_id": SCOPE.hex().upper()}, "$.scope_id"),
        ({"compat_id": "00" * 31}, "$.compat_id"),
        ({"directive": "not-a-uuid"}, "$.directive"),
        ({"blocks": []}, "$.blocks"),
        ({"blocks": [{"block_key": "zz" * 32, "sources": ["http://h/"]}]}, "$.blocks[0].block_key"),
        ({"layer_order": "descending"}, "$.layer_order"),
        ({"lease_ms": 0}, "$.lease_ms"),
    ],
)
def test_prefetch_bad_input_is_400_and_starts_nothing(
    tmp_path: Path, changes: dict[str, Any], path: str
) -> None:
    async def body(env: Env) -> None:
        answer = await env.http.post("prefetch", json=directive_json(**changes), headers=PC)
        assert_problem(answer, 400, "kvsp-bad-request", path)
        assert len(env.agent.directives) == 0

    scenario(tmp_path, body)


def test_prefetch_refusals(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        headers = PC | {"content-type": "application/kvsp+json"}
        malformed = await env.http.post("prefetch", content=b'{"directive": ', headers=headers)
        assert_problem(malformed, 400, "kvsp-bad-request", "$")
        no_token = await env.http.post("prefetch", json=directive_json())
        assert_problem(no_token, 401, "kvsp-unauthorized")
        client = await env.http.post("prefetch", json=directive_json(), headers=CLIENT)
        assert_problem(client, 403, "kvsp-forbidden")
        other = await env.http.post(
            "prefetch", json=directive_json(compat_id="11" * 32), headers=PC
        )
        assert_problem(other, 422, "kvsp-incompatible")
        unknown = await env.http.get(f"prefetch/{uuid.uuid4()}", headers=PC)
        assert_problem(unknown, 404, "kvsp-not-found")
        bad_id = await env.http.get("prefetch/nope", headers=PC)
        assert_problem(bad_id, 400, "kvsp-bad-request", "directive")
        assert len(env.agent.directives) == 0
        env.agent.change_state(InstanceState.DRAINING)
        inactive = await env.http.post("prefetch", json=directive_json(), headers=PC)
        assert_problem(inactive, 503, "kvsp-not-active")
        assert len(env.agent.directives) == 0

    scenario(tmp_path, body)


# -- state (§6.3) ---------------------------------------------------------------------------------


def test_put_state_follows_the_lifecycle_table(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        illegal = await env.http.put("state", json={"state": "sleeping"}, headers=PC)
        assert_problem(illegal, 409, "kvsp-conflict")
        assert env.agent.state is InstanceState.ACTIVE
        drained = await env.http.put("state", json={"state": "draining"}, headers=PC)
        assert drained.status_code == 200
        assert drained.json() == {"state": "sleeping"}  # idle: straight on to sleeping
        again = await env.http.put("state", json={"state": "draining"}, headers=PC)
        assert_problem(again, 409, "kvsp-conflict")
        failed = await env.http.put("state", json={"state": "failed"}, headers=PC)
        assert_problem(failed, 409, "kvsp-conflict")
        for bad, path in (({"state": "bogus"}, "$.state"), ({"state": 3}, "$.state"), ([], "$")):
            answer = await env.http.put("state", json=bad, headers=PC)
            assert_problem(answer, 400, "kvsp-bad-request", path)
        text = await env.http.put(
            "state", content=b"draining", headers=PC | {"content-type": "text/plain"}
        )
        assert text.status_code == 415
        client = await env.http.put("state", json={"state": "active"}, headers=CLIENT)
        assert_problem(client, 403, "kvsp-forbidden")
        assert env.agent.state is InstanceState.SLEEPING
        await env.agent.report_status()
        assert env.control.statuses[-1].state is InstanceState.SLEEPING
        woken = await env.http.put("state", json={"state": "active"}, headers=PC)
        assert woken.json() == {"state": "active"}

    scenario(tmp_path, body)


# -- generate -------------------------------------------------------------------------------------


def test_generate_streams_ndjson_and_serves_its_blocks(tmp_path: Path) -> None:
    prompt = list(range(40, 50))  # two blocks of 4 and a tail

    async def body(env: Env) -> None:
        request = {"prompt": prompt, "max_tokens": 6}
        answer = await env.http.post("generate", json=request, headers=CLIENT)
        assert answer.status_code == 200, answer.text
        assert answer.headers["content-type"].startswith("application/x-ndjson")
        assert answer.headers["kvsp-loaded-blocks"] == "0"
        assert answer.headers["kvsp-computed-blocks"] == "2"
        lines = ndjson(answer)
        assert [line["index"] for line in lines] == list(range(6))
        assert {line["epoch"] for line in lines} == {1}
        assert [line["token"] for line in lines] == await reference(prompt, 6)

        keys = block_keys(SCOPE_KEY, COMPAT, prompt, 4)
        await until(lambda: len(env.agent.holder.store) >= 2)
        url = f"blocks/{COMPAT.hex()}/{SCOPE.hex()}/{keys[1].hex()}"
        block = await env.http.get(url, headers=CLIENT)
        assert block.status_code == 200
        digest = base64.b64encode(hashlib.sha256(block.content).digest()).decode()
        assert block.headers["repr-digest"] == f"sha-256=:{digest}:"
        assert {r.block_key for r in env.control.published} == set(keys)
        assert all(r.holder == URL for r in env.control.published)
        stranger = await env.http.get(url, headers=STRANGER)
        assert_problem(stranger, 403, "kvsp-forbidden")

        with_key = {"prompt": prompt, "max_tokens": 6, "scope_key": SCOPE_KEY.hex()}
        again = await env.http.post("generate", json=with_key, headers=CLIENT)
        assert again.headers["kvsp-loaded-blocks"] == "2"
        assert ndjson(again) == lines
        by_id = {"prompt": prompt, "max_tokens": 2, "scope_id": SCOPE.hex()}
        named = await env.http.post("generate", json=by_id, headers=CLIENT)
        assert ndjson(named) == lines[:2]

    scenario(tmp_path, body)


@pytest.mark.parametrize(
    ("request_body", "path"),
    [
        ({"prompt": [], "max_tokens": 1}, "$.prompt"),
        ({"prompt": [1, -1], "max_tokens": 1}, "$.prompt[1]"),
        ({"prompt": [1, 2**32], "max_tokens": 1}, "$.prompt[1]"),
        ({"prompt": "1 2", "max_tokens": 1}, "$.prompt"),
        ({"prompt": [1], "max_tokens": "3"}, "$.max_tokens"),
        ({"prompt": [1]}, "$.max_tokens"),
        ({"prompt": [1], "max_tokens": 101}, "$.max_tokens"),
        ({"prompt": [1], "max_tokens": 1, "scope_key": "AB" * 32}, "$.scope_key"),
        ({"prompt": [1], "max_tokens": 1, "scope_key": "ab" * 8}, "$.scope_key"),
        ({"prompt": [1], "max_tokens": 1, "scope_id": "xyz"}, "$.scope_id"),
        ({"prompt": [1], "max_tokens": 1, "scope_id": "00" * 16}, "$.scope_id"),
        (
            {"prompt": [1], "max_tokens": 1, "scope_key": SCOPE_KEY.hex(), "scope_id": "00" * 16},
            "$.scope_id",
        ),
        ({"prompt": [1], "max_tokens": 1, "session": "nope"}, "$.session"),
    ],
)
def test_generate_bad_input_is_400(tmp_path: Path, request_body: dict[str, Any], path: str) -> None:
    async def body(env: Env) -> None:
        answer = await env.http.post("generate", json=request_body, headers=CLIENT)
        assert_problem(answer, 400, "kvsp-bad-request", path)
        record = env.agent.status_record()
        assert (record.running, record.queued) == (0, 0)

    scenario(tmp_path, body)


def test_generate_refusals(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        request = {"prompt": [1, 2, 3], "max_tokens": 2}
        malformed = await env.http.post(
            "generate", content=b"[1,", headers=CLIENT | {"content-type": "application/json"}
        )
        assert_problem(malformed, 400, "kvsp-bad-request", "$")
        pc = await env.http.post("generate", json=request, headers=PC)
        assert_problem(pc, 403, "kvsp-forbidden")
        foreign = {"prompt": [1], "max_tokens": 1, "scope_key": OTHER_KEY.hex()}
        forbidden = await env.http.post("generate", json=foreign, headers=CLIENT)
        assert_problem(forbidden, 403, "kvsp-forbidden")
        env.agent.change_state(InstanceState.DRAINING)
        inactive = await env.http.post("generate", json=request, headers=CLIENT)
        assert_problem(inactive, 503, "kvsp-not-active")
        assert env.agent.state is InstanceState.SLEEPING
        assert len(env.agent.holder.store) == 0

    scenario(tmp_path, body)


def test_generate_request_record_reads_its_members() -> None:
    parsed = GenerateRequest.from_json(
        {
            "prompt": [5, 6],
            "max_tokens": 3,
            "scope_key": SCOPE_KEY.hex(),
            "scope_id": SCOPE.hex(),
            "session": "6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11",
            "unknown": True,
        }
    )
    assert parsed.prompt == (5, 6) and parsed.max_tokens == 3
    assert parsed.scope_key == SCOPE_KEY and parsed.scope_id == SCOPE
    assert parsed.session == uuid.UUID("6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11")


# -- status, health ------------------------------------------------------------------------------


def test_status_and_healthz(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        status = await env.http.get("status", headers=PC)  # status is for pc/instance/admin
        assert status.status_code == 200
        record = InstanceStatusRecord.from_json(status.json())
        assert record.instance == URL and record.state is InstanceState.ACTIVE
        assert record.prefill_tokens_per_s > 0
        assert_problem(await env.http.get("status"), 401, "kvsp-unauthorized")
        health = await env.http.get("healthz")
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        descriptor = await env.http.get(f"descriptors/{COMPAT.hex()}", headers=CLIENT)
        assert descriptor.json() == DESCRIPTOR.to_json()

    scenario(tmp_path, body)
