"""The PC as a real process: ``kvsp serve control`` (IS + PC) and ``kvsp serve index`` +
``kvsp serve pc`` apart, with fake instances (``tests/support/fake_instance.py``) whose HTTP face
and status reporter are separate uvicorn/httpx processes, so a test can kill the reporter and
watch the instance fail while its HTTP face records that nothing more arrives."""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import sys
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kvsp.audience import audience_credential
from kvsp.compat import CompatibilityDescriptor, compat_id
from kvsp.errors import NotActive
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.records import LookupRequest, PlaceRequest, ReplicaRecord, dumps
from kvsp.registries import InstanceState
from kvsp.services.index.client import IndexClient
from kvsp.services.pc.client import PCClient
from kvsp.web.auth import principal_entry, write_principals
from kvsp.web.testing import RunningService, start_process
from tests.support import SUPPORT
from tests.support.polling import eventually

pytestmark = pytest.mark.slow  # the control plane and fake instances, each a process
T = TypeVar("T")
FAKE = SUPPORT / "fake_instance.py"
SCOPE = ScopeId(b"\x0c" * 16)
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
H1 = "https://h1.example/kvsp/"
TTL_MS = 900


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def token(name: str) -> str:
    return f"pc-process-token-{name}-0123456789"


def key(i: int) -> BlockKey:
    return BlockKey(hashlib.sha256(b"pc-process-key%d" % i).digest())


def replica(i: int) -> ReplicaRecord:
    digests = tuple(hashlib.sha256(b"%d/%d" % (i, n)).digest() for n in range(4))
    return ReplicaRecord(
        block_key=key(i),
        compat_id=CompatId(COMPAT),
        scope_id=SCOPE,
        holder=H1,
        codec=1,
        size=65_536,
        digest=hashlib.sha256(b"".join(digests)).digest(),
        layer_digests=digests,
        residency=None,
        ttl_ms=120_000,
    )


def place_request(ref: str) -> PlaceRequest:
    return PlaceRequest(
        scope_id=SCOPE,
        compat_id=CompatId(COMPAT),
        block_keys=tuple(key(i) for i in range(8)),
        prompt_tokens=130,
        request_ref=ref,
    )


def received(log: Path, kind: str) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    return [entry for entry in lines if entry["kind"] == kind]


class World:
    """Processes started for one test, all stopped at its end."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.started: list[RunningService] = []

    def start(self, name: str, argv: list[str]) -> RunningService:
        workdir = self.folder / name
        workdir.mkdir()
        service = start_process(argv, workdir=workdir, ready_timeout=60)
        self.started.append(service)
        return service

    def fake_instance(self, name: str) -> tuple[str, Path]:
        log = self.folder / f"{name}.jsonl"
        service = self.start(name, [sys.executable, str(FAKE), "serve", "--log", str(log)])
        return service.base_url, log

    def reporter(self, name: str, pc: str, instance: str, rate: float) -> RunningService:
        argv = [sys.executable, str(FAKE), "report", "--pc", pc, "--instance", instance]
        argv += ["--token-file", str(self.token_file(name)), "--ttl-ms", str(TTL_MS)]
        argv += ["--link", f"{H1}={rate}"]
        return self.start(f"report-{name}", argv)

    def token_file(self, name: str) -> Path:
        path = self.folder / f"{name}.token"
        path.write_text(token(name) + "\n")
        return path

    def principals(self, **instances: str) -> Path:
        entries = [
            principal_entry("admin", token("admin"), ["admin"], None),
            principal_entry("pc", token("pc"), ["pc"], None),
            principal_entry("client", token("client"), ["client"], [SCOPE]),
            principal_entry("h1", token("h1"), ["holder"], [SCOPE], [H1]),
        ]
        entries += [
            principal_entry(name, token(name), ["instance"], [], [uri])
            for name, uri in instances.items()
        ]
        path = self.folder / "principals.toml"
        write_principals(path, entries)
        (self.folder / "descriptor.json").write_bytes(dumps(DESCRIPTOR))
        return path

    def serve_argv(self, service: str, *extra: str) -> list[str]:
        return [
            sys.executable,
            *("-m", "kvsp", "serve", service, "--listen", "127.0.0.1:0"),
            *("--state", str(self.folder / f"state-{service}")),
            *("--principals", str(self.folder / "principals.toml")),
            *("--descriptor", str(self.folder / "descriptor.json")),
            *extra,
        ]

    def stop(self) -> None:
        for service in reversed(self.started):
            service.stop()


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path)
    try:
        yield w
    finally:
        w.stop()


def publish(index_url: str) -> None:
    async def scenario() -> None:
        async with IndexClient(index_url, token("h1"), timeout=10) as h1:
            for i in range(8):
                await h1.publish(replica(i))

    run(scenario())


def test_control_places_directs_and_fails_an_instance_that_stops_reporting(
    world: World,
) -> None:
    a_url, a_log = world.fake_instance("a")
    b_url, b_log = world.fake_instance("b")
    world.principals(a=a_url, b=b_url)
    directive_token = str(world.token_file("admin"))
    control = world.start(
        "control",
        world.serve_argv(
            "control", "--directive-token-file", directive_token, "--status-sweep-ms", "100"
        ),
    )
    publish(control.base_url)
    reporter_a = world.reporter("a", control.base_url, a_url, 100_000)
    world.reporter("b", control.base_url, b_url, 1_000)

    async def place(ref: str) -> Any:
        async with PCClient(control.base_url, token("client"), timeout=10) as pc:
            return await pc.place(place_request(ref))

    async def operate(instance: str, state: InstanceState) -> InstanceState:
        async with PCClient(control.base_url, token("admin"), timeout=10) as pc:
            return await pc.set_state(instance, state)

    async def states() -> dict[str, InstanceState]:
        async with PCClient(control.base_url, token("pc"), timeout=10) as pc:
            return {v.instance: v.state for v in await pc.list_instances()}

    first = run(place("req-1"))
    assert (first.instance, first.matched) == (a_url, 8)
    [sent] = received(a_log, "prefetch")
    assert sent["body"]["directive"] == str(first.directive)
    assert sent["body"]["request_ref"] == "req-1"
    assert [b["block_key"] for b in sent["body"]["blocks"]] == [key(i).hex() for i in range(8)]
    assert all(b["sources"] == [H1] for b in sent["body"]["blocks"])
    # the PC's token, bound to the instance's origin: the instance cannot replay it elsewhere
    assert sent["authorization"] == f"Bearer {audience_credential(token('admin'), a_url)}"
    assert received(b_log, "prefetch") == []

    assert run(operate(b_url, InstanceState.DRAINING)) is InstanceState.DRAINING
    assert run(states())[b_url] is InstanceState.DRAINING
    assert run(operate(b_url, InstanceState.ACTIVE)) is InstanceState.ACTIVE
    assert [e["body"] for e in received(b_log, "state")] == [
        {"state": "draining"},
        {"state": "active"},
    ]

    reporter_a.proc.send_signal(signal.SIGKILL)
    reporter_a.proc.wait()
    eventually(lambda: run(states())[a_url] is InstanceState.FAILED, 10, "a failed at the PC")
    second = run(place("req-2"))
    assert second.instance == b_url and second.directive is not None
    assert len(received(a_log, "prefetch")) == 1  # a failed instance receives nothing
    [to_b] = received(b_log, "prefetch")
    assert to_b["body"]["directive"] == str(second.directive)

    assert run(operate(b_url, InstanceState.DRAINING)) is InstanceState.DRAINING
    with pytest.raises(NotActive):
        run(place("req-3"))
    assert len(received(a_log, "prefetch")) == 1 and len(received(b_log, "prefetch")) == 1


def test_pc_apart_forwards_status_to_the_index_and_places(world: World) -> None:
    a_url, a_log = world.fake_instance("a")
    world.principals(a=a_url)
    index = world.start("index", world.serve_argv("index"))
    pc = world.start(
        "pc",
        world.serve_argv(
            "pc",
            *("--index", index.base_url, "--index-token-file", str(world.token_file("pc"))),
            *("--directive-token-file", str(world.token_file("admin"))),
        ),
    )
    publish(index.base_url)
    world.reporter("a", pc.base_url, a_url, 100_000)

    async def scenario() -> None:
        async with PCClient(pc.base_url, token("client"), timeout=10) as client:
            answer = await client.place(place_request("apart-1"))
        assert answer.instance == a_url and answer.matched == 8
        lookup = LookupRequest(
            scope_id=SCOPE, compat_id=CompatId(COMPAT), block_keys=(key(0),), targets=(a_url,)
        )
        async with IndexClient(index.base_url, token("client"), timeout=10) as is_client:
            found = await is_client.lookup(lookup)
        assert found.estimates is not None  # the PC forwarded A's status to the IS
        assert [e.target for e in found.estimates] == [a_url]

    run(scenario())
    [sent] = received(a_log, "prefetch")
    assert sent["body"]["request_ref"] == "apart-1"
