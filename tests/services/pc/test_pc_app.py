"""The PC's HTTP face in ``kvsp serve control`` (IS + PC in one app), in-process: every
endpoint answers bad input with problem details and leaves the state as it was."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import httpx
import pytest

from kvsp.compat import CompatibilityDescriptor, compat_id
from kvsp.errors import Conflict, NotActive, StaleEpoch, TransportError
from kvsp.ids import BlockKey, CompatId, ScopeId, uri_id
from kvsp.records import (
    InstanceStatusRecord,
    Link,
    PlaceRequest,
    PrefetchDirective,
    ReplicaRecord,
)
from kvsp.registries import InstanceState
from kvsp.services.control import create_control_app
from kvsp.services.index.app import IndexConfig
from kvsp.services.pc.client import PCClient
from kvsp.services.pc.service import PCConfig
from kvsp.stores.descriptors import DescriptorRegistry
from kvsp.stores.memory import MemoryStore
from kvsp.web.auth import Principals, principal_entry
from kvsp.web.clock import ManualClock
from kvsp.web.testing import InProcessClient

SCOPE = ScopeId(b"\x0a" * 16)
OTHER = ScopeId(b"\x0b" * 16)
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
A, B = "https://ii-a.example/kvsp/", "https://ii-b.example/kvsp/"
PRINCIPALS = {
    # name: (roles, scopes (None = all), holders)
    "admin": (["admin"], None, []),
    "pc": (["pc"], None, []),
    "ia": (["instance"], [], [A]),
    "ib": (["instance"], [], [B]),
    "ca": (["client"], [SCOPE], []),
    "cb": (["client"], [OTHER], []),
    "h1": (["holder"], [SCOPE], [H1]),
}


def auth(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer token-of-{name}-0123456789"}


class Peers:
    def __init__(self) -> None:
        self.directives: list[tuple[str, PrefetchDirective]] = []
        self.states: list[tuple[str, InstanceState]] = []
        self.down: set[str] = set()

    async def prefetch(self, instance: str, directive: PrefetchDirective) -> None:
        if instance in self.down:
            raise TransportError("connection refused")
        self.directives.append((instance, directive))

    async def put_state(self, instance: str, state: InstanceState) -> None:
        if instance in self.down:
            raise TransportError("connection refused")
        if state is InstanceState.ACTIVE and instance == B:
            raise Conflict("B will not wake")
        self.states.append((instance, state))


class App:
    def __init__(self) -> None:
        self.clock = ManualClock(1_000_000)
        self.peers = Peers()
        descriptors = DescriptorRegistry()
        descriptors.add(DESCRIPTOR, persist=False)
        principals = Principals.from_entries(
            [
                principal_entry(name, auth(name)["authorization"][7:], roles, scopes, holders)
                for name, (roles, scopes, holders) in PRINCIPALS.items()
            ]
        )
        self.app = create_control_app(
            IndexConfig(gc_freeze_interval_s=None),  # no gc.collect() in the test process
            store=MemoryStore(),
            principals=principals,
            clock=self.clock,
            descriptors=descriptors,
            peers=self.peers,
            pc_config=PCConfig(retry_after_s=3),
        )
        self.http = InProcessClient(self.app)

    def put_status(self, body: Any, who: str = "ia", instance_id: str | None = None) -> Any:
        instance_id = instance_id or uri_id(body["instance"] if isinstance(body, dict) else A)
        return self.http.put(f"instances/{instance_id}/status", json=body, headers=auth(who))

    def put_state(self, body: Any, who: str = "pc", instance_id: str | None = None) -> Any:
        path = f"instances/{instance_id or uri_id(A)}/state"
        return self.http.put(path, json=body, headers=auth(who))

    def place(self, body: Any, who: str = "ca") -> Any:
        return self.http.post("place", json=body, headers=auth(who))

    def listing(self) -> list[dict[str, Any]]:
        answer = self.http.get("instances", headers=auth("pc"))
        assert answer.status_code == 200
        instances: list[dict[str, Any]] = answer.json()["instances"]
        return instances


def key(i: int) -> BlockKey:
    return BlockKey(hashlib.sha256(b"app-key%d" % i).digest())


def replica_json(i: int) -> dict[str, Any]:
    digests = tuple(hashlib.sha256(b"%d/%d" % (i, n)).digest() for n in range(4))
    return ReplicaRecord(
        block_key=key(i),
        compat_id=CompatId(COMPAT),
        scope_id=SCOPE,
        holder=H1,
        codec=1,
        size=1_000_000,
        digest=hashlib.sha256(b"".join(digests)).digest(),
        layer_digests=digests,
        residency=None,
        ttl_ms=600_000,
    ).to_json()


def status_json(
    instance: str = A, epoch: int = 3, links: Sequence[tuple[str, float]] = ((H1, 100_000),)
) -> dict[str, Any]:
    return InstanceStatusRecord(
        instance=instance,
        epoch=epoch,
        state=InstanceState.ACTIVE,
        running=1,
        queued=0,
        batch_size=8,
        kv_utilization=0.5,
        prefill_tokens_per_s=10_000.0,
        decode_tokens_per_s=1_000.0,
        links=tuple(Link(holder=h, mbit_per_s=float(r), rtt_us=10.0) for h, r in links),
        requested_state=None,
        ttl_ms=3_000,
    ).to_json()


def place_json(blocks: int = 4, tokens: int = 80, scope: bytes = SCOPE) -> dict[str, Any]:
    return {
        "scope_id": scope.hex(),
        "compat_id": COMPAT.hex(),
        "block_keys": [key(i).hex() for i in range(blocks)],
        "prompt_tokens": tokens,
        "request_ref": "front-1",
    }


def problem(answer: httpx.Response, status: int, name: str, path: str | None = None) -> None:
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    body = answer.json()
    assert body["type"] == f"urn:ietf:params:kvsp:problem:{name}"
    assert body["status"] == status
    if path is not None:
        assert body["path"] == path


@pytest.fixture
def app() -> App:
    return App()


def test_status_place_and_listing(app: App) -> None:
    for i in range(4):
        path = f"replicas/{COMPAT.hex()}/{SCOPE.hex()}/{key(i).hex()}/{uri_id(H1)}"
        assert app.http.put(path, json=replica_json(i), headers=auth("h1")).status_code == 200
    answer = app.put_status(status_json())
    assert answer.status_code == 200 and answer.json() == {"state": "active"}
    assert answer.headers["content-type"] == "application/kvsp+json"
    assert app.put_status(status_json(B, links=()), who="ib").json() == {"state": "active"}
    placed = app.place(place_json())
    assert placed.status_code == 200, placed.text
    body = placed.json()
    assert body["instance"] == A and body["matched"] == 4
    assert body["cost"] == pytest.approx(10 + 8 * 4_000_000 / 100_000 + 1e6 * 16 / 10_000)
    [(instance, directive)] = app.peers.directives
    assert instance == A and str(directive.directive) == body["directive"]
    assert directive.request_ref == "front-1"
    # The status went straight into the IS's table: a lookup with targets estimates A.
    lookup = {**place_json(), "targets": [A], "compact": True}
    estimates = app.http.post("lookup", json=lookup, headers=auth("ca")).json()["estimates"]
    assert set(estimates) == {A}
    [a, b] = app.listing()
    assert (a["instance"], a["state"], a["epoch"], a["load"], a["age_ms"]) == (A, "active", 3, 1, 0)
    assert b["instance"] == B


def test_status_bad_input_changes_nothing(app: App) -> None:
    assert app.put_status(status_json()).status_code == 200
    before = app.listing()
    path = f"instances/{uri_id(A)}/status"
    malformed = app.http.put(
        path, content=b'{"instance": ', headers={**auth("ia"), "content-type": "application/json"}
    )
    problem(malformed, 400, "kvsp-bad-request", "$")
    problem(app.put_status({**status_json(), "running": "1"}), 400, "kvsp-bad-request", "$.running")
    problem(app.put_status({**status_json(), "epoch": -1}), 400, "kvsp-bad-request", "$.epoch")
    problem(
        app.put_status(status_json(), instance_id="ABC"), 400, "kvsp-bad-request", "instance_id"
    )
    problem(app.put_status(status_json(), instance_id=uri_id(A).upper()), 400, "kvsp-bad-request")
    problem(
        app.put_status(status_json(), instance_id=uri_id(B)), 400, "kvsp-bad-request", "$.instance"
    )
    problem(app.put_status(status_json(epoch=2)), 409, "kvsp-stale-epoch")
    problem(app.put_status({**status_json(), "state": "failed"}), 400, "kvsp-bad-request")
    no_token = app.http.put(path, json=status_json())
    problem(no_token, 401, "kvsp-unauthorized")
    assert no_token.headers["www-authenticate"].startswith("Bearer")
    problem(app.put_status(status_json(), who="ib"), 403, "kvsp-forbidden")  # not its URI
    problem(app.put_status(status_json(), who="ca"), 403, "kvsp-forbidden")  # no instance role
    problem(app.put_status(status_json(), who="pc"), 403, "kvsp-forbidden")
    assert app.listing() == before
    assert app.put_status(status_json(), who="admin").status_code == 200


def test_state_changes_and_their_errors(app: App) -> None:
    assert app.put_status(status_json()).status_code == 200
    assert app.put_status(status_json(B, links=()), who="ib").status_code == 200
    problem(app.put_state({"state": "draining"}, who="ca"), 403, "kvsp-forbidden")
    problem(
        app.http.put(f"instances/{uri_id(A)}/state", json={"state": "draining"}),
        401,
        "kvsp-unauthorized",
    )
    problem(
        app.put_state({"state": "draining"}, instance_id="xyz"),
        400,
        "kvsp-bad-request",
        "instance_id",
    )
    problem(app.put_state({"state": "draining"}, instance_id="0" * 32), 404, "kvsp-not-found")
    problem(app.put_state({"state": "bogus"}), 400, "kvsp-bad-request", "$.state")
    problem(app.put_state({"state": 1}), 400, "kvsp-bad-request", "$.state")
    problem(app.put_state([]), 400, "kvsp-bad-request", "$")
    problem(app.put_state({"state": "sleeping"}), 409, "kvsp-conflict")
    app.peers.down.add(A)
    problem(app.put_state({"state": "draining"}), 502, "kvsp-unreachable")
    app.peers.down.clear()
    assert app.listing()[0]["state"] == "active" and app.peers.states == []
    drained = app.put_state({"state": "draining"}, who="admin")
    assert drained.status_code == 200 and drained.json() == {"state": "draining"}
    assert app.peers.states == [(A, InstanceState.DRAINING)]
    assert app.listing()[0]["state"] == "draining"
    assert app.put_state({"state": "draining"}, instance_id=uri_id(B)).status_code == 200
    refused = app.put_state({"state": "active"}, instance_id=uri_id(B))
    problem(refused, 502, "kvsp-upstream-error")
    assert app.listing()[1]["state"] == "draining"


def test_place_bad_input_and_no_instance(app: App) -> None:
    problem(app.place(place_json()), 503, "kvsp-not-active")
    assert app.put_status(status_json()).status_code == 200
    malformed = app.http.post(
        "place", content=b"[1,", headers={**auth("ca"), "content-type": "application/json"}
    )
    problem(malformed, 400, "kvsp-bad-request", "$")
    problem(
        app.place({**place_json(), "block_keys": ["AB" * 32]}),
        400,
        "kvsp-bad-request",
        "$.block_keys[0]",
    )
    problem(
        app.place({**place_json(), "scope_id": "0a" * 15}), 400, "kvsp-bad-request", "$.scope_id"
    )
    problem(
        app.place({**place_json(), "prompt_tokens": "80"}),
        400,
        "kvsp-bad-request",
        "$.prompt_tokens",
    )
    problem(app.place({**place_json(), "session": "nope"}), 400, "kvsp-bad-request", "$.session")
    problem(app.place({**place_json(), "lease_ms": 0}), 400, "kvsp-bad-request", "$.lease_ms")
    problem(app.place(place_json(tokens=40)), 400, "kvsp-bad-request", "$.prompt_tokens")
    problem(app.http.post("place", json=place_json()), 401, "kvsp-unauthorized")
    problem(app.place(place_json(), who="h1"), 403, "kvsp-forbidden")  # a holder places nothing
    problem(app.place(place_json(), who="cb"), 403, "kvsp-forbidden")  # not its scope
    problem(app.place(place_json(scope=OTHER), who="ca"), 403, "kvsp-forbidden")
    unsupported = app.http.post(
        "place", content=b"{}", headers={**auth("ca"), "content-type": "text/plain"}
    )
    assert unsupported.status_code == 415
    assert app.peers.directives == []
    ok = app.place({**place_json(), "deadline_ms": 30}, who="pc")
    assert ok.status_code == 200 and ok.json()["instance"] == A
    assert "directive" not in ok.json()  # nothing cached: recompute
    app.put_state({"state": "draining"})
    busy = app.place(place_json())
    problem(busy, 503, "kvsp-not-active")
    assert busy.headers["retry-after"] == "3"
    assert "starting" not in busy.json()


def test_listing_needs_the_pc_role(app: App) -> None:
    problem(app.http.get("instances", headers=auth("ca")), 403, "kvsp-forbidden")
    problem(app.http.get("instances"), 401, "kvsp-unauthorized")
    assert app.http.get("instances", headers=auth("admin")).json() == {"instances": []}


def test_control_keeps_the_index_routes(app: App) -> None:
    assert app.http.get("healthz").json() == {"status": "ok"}
    lookup = {"scope_id": SCOPE.hex(), "compat_id": COMPAT.hex(), "block_keys": []}
    assert app.http.post("lookup", json=lookup, headers=auth("ca")).json()["matched"] == 0
    descriptor = app.http.get(f"descriptors/{COMPAT.hex()}", headers=auth("ca"))
    assert descriptor.status_code == 200
    problem(app.http.post("place/", json={}, headers=auth("ca")), 404, "kvsp-not-found")


def test_pc_client_round_trips(app: App) -> None:
    async def scenario() -> None:
        transport = httpx.ASGITransport(app=app.app)
        async with httpx.AsyncClient(transport=transport) as shared:

            def client(who: str) -> PCClient:
                return PCClient("http://pc/", auth(who)["authorization"][7:], client=shared)

            with pytest.raises(NotActive):
                await client("ca").place(PlaceRequest.from_json(place_json()))
            record = InstanceStatusRecord.from_json(status_json())
            assert (await client("ia").put_status(record)).state is InstanceState.ACTIVE
            with pytest.raises(StaleEpoch):
                await client("ia").put_status(replace(record, epoch=1))
            placed = await client("ca").place(
                PlaceRequest.from_json(place_json()), deadline_ms=20, lease_ms=400
            )
            assert placed.instance == A and placed.directive is None
            with pytest.raises(Conflict):
                await client("pc").set_state(A, InstanceState.SLEEPING)
            assert await client("pc").set_state(A, InstanceState.DRAINING) is InstanceState.DRAINING
            [listed] = await client("pc").list_instances()
            assert (listed.instance, listed.state, listed.load) == (A, InstanceState.DRAINING, 1)
            assert listed.reported_state is InstanceState.ACTIVE and listed.epoch == 3

    asyncio.run(scenario())
