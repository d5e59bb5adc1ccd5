"""The Index Service over HTTP, in-process (kvsp.services.index.app, descriptors, client_base,
index_client; spec §6.1-6.3, DESIGN.md §3): every endpoint's answers, bad input on every
endpoint with the problem type checked and the stored state unchanged, the no-leak rule, the
mismatch hint, expiry on a manual clock, the sweeper, and the client's error mapping. The
tests that touch stored state run over both replica stores (in memory and Redis)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import uvicorn

from kvsp import errors
from kvsp.compat import CompatibilityDescriptor, compat_id
from kvsp.errors import RemoteError, TransportError, UnsupportedMediaType
from kvsp.ids import BlockKey, CompatId, ScopeId, uri_id
from kvsp.index import ReplicaStore
from kvsp.records import (
    InstanceStatusRecord,
    Link,
    LookupRequest,
    ReplicaRecord,
    Residency,
)
from kvsp.registries import InstanceState, Tier
from kvsp.services.index.app import IndexConfig, create_index_app, index_lifespan
from kvsp.services.index.client import IndexClient
from kvsp.stores.descriptors import DescriptorRegistry
from kvsp.stores.memory import MemoryStore
from kvsp.web.auth import Principals, principal_entry
from kvsp.web.client import error_from_problem, problem_error
from kvsp.web.clock import ManualClock
from kvsp.web.failover import NotSent, fails_over
from kvsp.web.problems import KVSP_JSON
from kvsp.web.testing import InProcessClient
from tests.support.polling import until

T = TypeVar("T")
PREFIX = "urn:ietf:params:kvsp:problem:"
NOW = 1_000_000
SCOPE_A = ScopeId(b"\x0a" * 16)
SCOPE_B = ScopeId(b"\x0b" * 16)
SCOPE_EMPTY = ScopeId(b"\x0c" * 16)
H1 = "https://h1.example/kvsp/"
H2 = "https://h2.example/kvsp/"
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
DRIFTED_DESCRIPTOR = replace(DESCRIPTOR, block_tokens=32)
DRIFTED = compat_id(DRIFTED_DESCRIPTOR)
TOKENS = {
    "h1": (["holder"], [SCOPE_A], [H1]),
    "h2": (["holder"], [SCOPE_A, SCOPE_B], [H2]),
    "ca": (["client"], [SCOPE_A], []),
    "cb": (["client"], [SCOPE_B, SCOPE_EMPTY], []),
    "i7": (["instance"], [], [II7]),
    "pc": (["pc"], None, []),
    "admin": (["admin"], None, []),
}
BODY_LIMIT = 256 * 1024


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def token(name: str) -> str:
    return f"token-{name}-0123456789abcdef"


def auth(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token(name)}"}


def key(i: int) -> BlockKey:
    return BlockKey(hashlib.sha256(b"key%d" % i).digest())


def record(
    i: int, holder: str = H1, *, compat: bytes = COMPAT, scope: bytes = SCOPE_A, ttl: int = 60_000
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
        residency=(Residency(tier=Tier.HOST, first=0, last=3, read_mbit_per_s=800.0),),
        ttl_ms=ttl,
    )


def url_of(r: ReplicaRecord, **override: str) -> str:
    parts = {
        "compat": r.compat_id.hex(),
        "scope": r.scope_id.hex(),
        "key": r.block_key.hex(),
        "holder_id": uri_id(r.holder),
    } | override
    return "/replicas/{compat}/{scope}/{key}/{holder_id}".format(**parts)


def status(epoch: int = 5, instance: str = II7, **changes: Any) -> InstanceStatusRecord:
    base = InstanceStatusRecord(
        instance=instance,
        epoch=epoch,
        state=InstanceState.ACTIVE,
        running=2,
        queued=1,
        batch_size=16,
        kv_utilization=0.5,
        prefill_tokens_per_s=8000.0,
        decode_tokens_per_s=500.0,
        links=(Link(holder=H1, mbit_per_s=10_000.0, rtt_us=20.0),),
        requested_state=None,
        ttl_ms=60_000,
    )
    return replace(base, **changes)


def lookup_body(*indices: int, scope: bytes = SCOPE_A, compat: bytes = COMPAT, **kw: Any) -> Any:
    request = LookupRequest(
        scope_id=ScopeId(scope),
        compat_id=CompatId(compat),
        block_keys=tuple(key(i) for i in indices),
        **kw,
    )
    return request.to_json()


class LoopClient(InProcessClient):
    """An in-process client whose requests all run on one event loop (``run``), as a real
    server's do: a Redis store's connections belong to the loop that opened them."""

    def __init__(self, app: Any, run: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
        super().__init__(app)
        self.run = run

    def request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        """Send one request on the client's loop."""
        response: httpx.Response = self.run(self._request(method, url, **kwargs))
        return response


@dataclass
class Env:
    """One in-process IS with seeded state, and the loop it runs on (``run``)."""

    client: InProcessClient
    clock: ManualClock
    store: ReplicaStore
    registry: DescriptorRegistry
    app: Any
    run: Callable[[Coroutine[Any, Any, Any]], Any]

    def put(self, r: ReplicaRecord, who: str = "h1") -> httpx.Response:
        return self.client.put(url_of(r), json=r.to_json(), headers=auth(who))

    def lookup(self, body: Any, who: str = "admin") -> httpx.Response:
        return self.client.post("/lookup", json=body, headers=auth(who))

    def snapshot(self) -> tuple[int, bytes, int]:
        """The stored state as seen from outside: count, a full lookup with targets, and the
        number of descriptors."""
        answer = self.lookup(lookup_body(0, 1, 2, targets=(II7,)))
        assert answer.status_code == 200
        return self.run(self.store.count()), answer.content, len(self.registry)


def make_env(
    tmp_path: Path,
    store: ReplicaStore | None = None,
    run_on: Callable[[Coroutine[Any, Any, Any]], Any] = asyncio.run,
    **config: Any,
) -> Env:
    entries = [
        principal_entry(name, token(name), roles, scopes, holders)
        for name, (roles, scopes, holders) in TOKENS.items()
    ]
    clock = ManualClock(NOW)
    store = MemoryStore() if store is None else store
    registry = DescriptorRegistry(tmp_path / "descriptors")
    registry.add(DESCRIPTOR)
    settings = {"body_limit": BODY_LIMIT, "max_batch": 50, "max_lookup_keys": 1000} | config
    app = create_index_app(
        IndexConfig(**settings),
        store=store,
        principals=Principals.from_entries(entries),
        clock=clock,
        descriptors=registry,
    )
    return Env(LoopClient(app, run_on), clock, store, registry, app, run_on)


@pytest.fixture(params=["memory", "redis"])
def bare_env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Env]:
    """An empty IS over each store, its requests on one event loop for the whole test."""
    with asyncio.Runner() as runner:
        if request.param == "memory":
            yield make_env(tmp_path, MemoryStore(), runner.run)
            return
        from kvsp.stores.redis import RedisStore

        store = RedisStore.from_url(request.getfixturevalue("redis_url"))
        try:
            yield make_env(tmp_path, store, runner.run)
        finally:
            runner.run(store.aclose())


@pytest.fixture
def env(bare_env: Env) -> Env:
    """An IS with key 0 at H1 and H2, key 1 at H1, and a status for II7 (epoch 5)."""
    e = bare_env
    for r, who in ((record(0), "h1"), (record(0, H2), "h2"), (record(1), "h1")):
        assert e.put(r, who).status_code == 200
    answer = e.client.put(
        f"/instances/{uri_id(II7)}/status", json=status().to_json(), headers=auth("i7")
    )
    assert answer.status_code == 200
    return e


# --- answers -----------------------------------------------------------------------------------


def test_publish_answers_the_granted_ttl(env: Env) -> None:
    r = record(2, ttl=10**9)
    answer = env.put(r)
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/kvsp+json"
    assert answer.json() == {"ttl_ms": 600_000}


def test_lookup_full_and_compact(env: Env) -> None:
    env.clock.advance(1000)
    full = env.lookup(lookup_body(0, 1, 2, targets=(II7,)), who="ca")
    assert full.status_code == 200
    body = full.json()
    assert body["matched"] == 2
    assert [[r["holder"] for r in rs] for rs in body["replicas"]] == [[H1, H2], [H1]]
    assert body["replicas"][0][0] == {**record(0).to_json(), "ttl_ms": 59_000}
    assert set(body["estimates"]) == {II7}
    assert set(body["estimates"][II7]) == {"fetch_us", "recompute_us"}
    assert "hint" not in body
    compact = env.lookup(lookup_body(0, 1, 2, targets=(II7,), compact=True), who="ca")
    assert compact.json() == {"matched": 2, "estimates": body["estimates"]}


def test_unauthorized_scope_is_byte_identical_to_a_miss(env: Env) -> None:
    env.put(record(0, compat=DRIFTED))  # would give a hint to an authorized caller
    for kw in ({}, {"compact": True}, {"targets": (II7,)}):
        denied = env.lookup(lookup_body(0, 1, scope=SCOPE_A, **kw), who="cb")
        empty = env.lookup(lookup_body(0, 1, scope=SCOPE_EMPTY, **kw), who="cb")
        assert denied.status_code == empty.status_code == 200
        assert denied.content == empty.content
        # Each answer has its own X-Request-Id (kvsp.web.logs), unrelated to the scope.
        same = {k: v for k, v in denied.headers.items() if k != "x-request-id"}
        assert same == {k: v for k, v in empty.headers.items() if k != "x-request-id"}
        assert denied.json()["matched"] == 0


def test_hint_on_compat_drift_but_not_across_scopes(env: Env) -> None:
    assert env.put(record(7, H2, compat=DRIFTED), who="h2").status_code == 200
    assert env.put(record(8, H2, compat=DRIFTED, scope=SCOPE_B), who="h2").status_code == 200
    drift = env.lookup(lookup_body(7), who="ca").json()
    assert drift["matched"] == 0
    assert DRIFTED.hex() in drift["hint"]
    assert "descriptor" in drift["hint"]
    # Scope B holds only the drifted compat id; client-a may not see scope B: no hint at all.
    assert "hint" not in env.lookup(lookup_body(8, scope=SCOPE_B), who="ca").json()
    weaker = env.lookup(lookup_body(9, scope=SCOPE_B), who="cb").json()
    assert "only under compat_id " + DRIFTED.hex() in weaker["hint"]


def test_expiry_follows_the_clock(env: Env) -> None:
    env.put(record(2, ttl=500))
    assert env.lookup(lookup_body(2)).json()["matched"] == 1
    env.clock.advance(500)
    assert env.lookup(lookup_body(2)).json() == {"matched": 0, "replicas": []}


def test_withdraw(env: Env) -> None:
    r = record(1)
    assert env.client.delete(url_of(r), headers=auth("h1")).status_code == 204
    again = env.client.delete(url_of(r), headers=auth("h1"))
    assert again.status_code == 404
    assert again.json()["type"] == PREFIX + "kvsp-not-found"
    assert env.lookup(lookup_body(0, 1)).json()["matched"] == 1


def test_batch_publish_gives_per_record_results(env: Env) -> None:
    records = [
        record(3).to_json(),
        {**record(4).to_json(), "size": "big"},
        record(5, H2).to_json(),  # h1 may not publish for H2
        record(6, scope=SCOPE_B).to_json(),  # nor use scope B
    ]
    answer = env.client.post("/replicas", json={"records": records}, headers=auth("h1"))
    assert answer.status_code == 200
    results = answer.json()["results"]
    assert results[0] == {"ok": True, "ttl_ms": 60_000}
    assert [r["ok"] for r in results] == [True, False, False, False]
    assert results[1]["problem"]["path"] == "$.records[1].size"
    assert [r["problem"]["status"] for r in results[1:]] == [400, 403, 403]
    assert env.run(env.store.count()) == 4


def test_status_answers_and_permissions(env: Env) -> None:
    path = f"/instances/{uri_id(II7)}/status"
    answer = env.client.put(path, json=status(epoch=6).to_json(), headers=auth("i7"))
    assert answer.json() == {"state": "active"}
    forwarded = env.client.put(path, json=status(epoch=7).to_json(), headers=auth("pc"))
    assert forwarded.status_code == 200


def test_descriptors_put_get_and_persist(env: Env, tmp_path: Path) -> None:
    path = f"/descriptors/{DRIFTED.hex()}"
    body = DRIFTED_DESCRIPTOR.to_json()
    first = env.client.put(path, json=body, headers=auth("h1"))
    assert (first.status_code, first.json()) == (201, {"compat_id": DRIFTED.hex()})
    assert env.client.put(path, json=body, headers=auth("h1")).status_code == 200
    got = env.client.get(path, headers=auth("ca"))
    assert got.status_code == 200
    assert CompatibilityDescriptor.from_json(got.json()) == DRIFTED_DESCRIPTOR
    reloaded = DescriptorRegistry(tmp_path / "descriptors")
    assert reloaded.load_folder() == 2
    assert reloaded.get(DRIFTED) == DRIFTED_DESCRIPTOR


def test_healthz_needs_no_token(env: Env) -> None:
    answer = env.client.get("/healthz")
    assert (answer.status_code, answer.json()) == (200, {"status": "ok"})


# --- bad input on every endpoint ---------------------------------------------------------------

R0 = record(0)
GOOD = R0.to_json()
STATUS_URL = f"/instances/{uri_id(II7)}/status"
DESC_URL = f"/descriptors/{COMPAT.hex()}"
JSON_HEADERS = {"content-type": "application/kvsp+json"}
HUGE = "x" * (BODY_LIMIT + 1)


def _case(
    method: str,
    url: str,
    *,
    who: str | None = "admin",
    body: Any = None,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    h = dict(JSON_HEADERS) if (body is not None or raw is not None) else {}
    if who is not None:
        h |= {"authorization": f"Bearer {token(who)}"} if who != "forged" else {}
    if who == "forged":
        h["authorization"] = "Bearer not-a-known-token"
    h |= headers or {}
    kwargs: dict[str, Any] = {"headers": h}
    if raw is not None:
        kwargs["content"] = raw
    elif body is not None:
        kwargs["content"] = json.dumps(body).encode()
    return {"method": method, "url": url, **kwargs}


BAD_INPUT: dict[str, tuple[dict[str, Any], int, str, str | None]] = {
    # PUT replicas/...: (request, status, problem, path)
    "put-malformed-json": (_case("PUT", url_of(R0), raw=b'{"a":'), 400, "kvsp-bad-request", "$"),
    "put-not-an-object": (_case("PUT", url_of(R0), body=[GOOD]), 400, "kvsp-bad-request", "$"),
    "put-wrong-type": (
        _case("PUT", url_of(R0), body={**GOOD, "size": "big"}),
        400,
        "kvsp-bad-request",
        "$.size",
    ),
    "put-uppercase-path": (
        _case("PUT", url_of(R0, compat=COMPAT.hex().upper()), body=GOOD),
        400,
        "kvsp-bad-request",
        "compat",
    ),
    "put-short-scope-path": (
        _case("PUT", url_of(R0, scope=SCOPE_A.hex()[:-2]), body=GOOD),
        400,
        "kvsp-bad-request",
        "scope",
    ),
    "put-long-key-path": (
        _case("PUT", url_of(R0, key=R0.block_key.hex() + "00"), body=GOOD),
        400,
        "kvsp-bad-request",
        "key",
    ),
    "put-bad-holder-id-path": (
        _case("PUT", url_of(R0, holder_id="zz" * 16), body=GOOD),
        400,
        "kvsp-bad-request",
        "holder_id",
    ),
    "put-uppercase-body": (
        _case("PUT", url_of(R0), body={**GOOD, "block_key": R0.block_key.hex().upper()}),
        400,
        "kvsp-bad-request",
        "$.block_key",
    ),
    "put-short-body-digest": (
        _case("PUT", url_of(R0), body={**GOOD, "layer_digests": ["ab" * 31]}),
        400,
        "kvsp-bad-request",
        "$.layer_digests[0]",
    ),
    "put-path-body-key-mismatch": (
        _case("PUT", url_of(R0, key=key(9).hex()), body=GOOD),
        400,
        "kvsp-bad-request",
        "$.block_key",
    ),
    "put-path-body-holder-mismatch": (
        _case("PUT", url_of(R0, holder_id=uri_id(H2)), body=GOOD),
        400,
        "kvsp-bad-request",
        "$.holder",
    ),
    "put-oversized": (
        _case("PUT", url_of(R0), body={**GOOD, "pad": HUGE}),
        413,
        "kvsp-bad-request",
        None,
    ),
    "put-wrong-media-type": (
        _case("PUT", url_of(R0), body=GOOD, headers={"content-type": "text/plain"}),
        415,
        "kvsp-bad-request",
        None,
    ),
    "put-no-token": (_case("PUT", url_of(R0), who=None, body=GOOD), 401, "kvsp-unauthorized", None),
    "put-bad-token": (
        _case("PUT", url_of(R0), who="forged", body=GOOD),
        401,
        "kvsp-unauthorized",
        None,
    ),
    "put-no-scope": (
        _case(
            "PUT",
            url_of(record(0, scope=SCOPE_B)),
            who="h1",
            body=record(0, scope=SCOPE_B).to_json(),
        ),
        403,
        "kvsp-forbidden",
        None,
    ),
    "put-forged-holder": (
        _case("PUT", url_of(record(0, H2)), who="h1", body=record(0, H2).to_json()),
        403,
        "kvsp-forbidden",
        None,
    ),
    "put-zero-ttl": (
        _case("PUT", url_of(R0), body={**GOOD, "ttl_ms": 0}),
        400,
        "kvsp-bad-request",
        "$.ttl_ms",
    ),
    # DELETE replicas/...
    "delete-bad-path": (
        _case("DELETE", url_of(R0, key="k")),
        400,
        "kvsp-bad-request",
        "key",
    ),
    "delete-no-token": (_case("DELETE", url_of(R0), who=None), 401, "kvsp-unauthorized", None),
    "delete-no-scope": (_case("DELETE", url_of(R0), who="cb"), 403, "kvsp-forbidden", None),
    "delete-other-holder": (_case("DELETE", url_of(R0), who="h2"), 403, "kvsp-forbidden", None),
    "delete-missing": (
        _case("DELETE", url_of(record(0, compat=DRIFTED))),
        404,
        "kvsp-not-found",
        None,
    ),
    # POST replicas
    "batch-malformed-json": (_case("POST", "/replicas", raw=b"[1,"), 400, "kvsp-bad-request", "$"),
    "batch-no-records": (_case("POST", "/replicas", body={}), 400, "kvsp-bad-request", "$.records"),
    "batch-records-not-array": (
        _case("POST", "/replicas", body={"records": GOOD}),
        400,
        "kvsp-bad-request",
        "$.records",
    ),
    "batch-too-many": (
        _case("POST", "/replicas", body={"records": [GOOD] * 51}),
        413,
        "kvsp-bad-request",
        "$.records",
    ),
    "batch-oversized": (
        _case("POST", "/replicas", body={"records": [], "pad": HUGE}),
        413,
        "kvsp-bad-request",
        None,
    ),
    "batch-no-token": (
        _case("POST", "/replicas", who=None, body={"records": [GOOD]}),
        401,
        "kvsp-unauthorized",
        None,
    ),
    # POST lookup
    "lookup-malformed-json": (_case("POST", "/lookup", raw=b"{,}"), 400, "kvsp-bad-request", "$"),
    "lookup-nan": (
        _case("POST", "/lookup", raw=b'{"matched": NaN}'),
        400,
        "kvsp-bad-request",
        "$",
    ),
    "lookup-wrong-type": (
        _case("POST", "/lookup", body={**lookup_body(0), "block_keys": "k"}),
        400,
        "kvsp-bad-request",
        "$.block_keys",
    ),
    "lookup-uppercase-key": (
        _case("POST", "/lookup", body={**lookup_body(0), "block_keys": [key(0).hex().upper()]}),
        400,
        "kvsp-bad-request",
        "$.block_keys[0]",
    ),
    "lookup-short-scope": (
        _case("POST", "/lookup", body={**lookup_body(0), "scope_id": "0a" * 15}),
        400,
        "kvsp-bad-request",
        "$.scope_id",
    ),
    "lookup-compact-not-bool": (
        _case("POST", "/lookup", body={**lookup_body(0), "compact": 1}),
        400,
        "kvsp-bad-request",
        "$.compact",
    ),
    "lookup-too-many-keys": (
        _case("POST", "/lookup", body=lookup_body(*range(1001))),
        413,
        "kvsp-bad-request",
        "$.block_keys",
    ),
    "lookup-oversized": (
        _case("POST", "/lookup", body={**lookup_body(0), "pad": HUGE}),
        413,
        "kvsp-bad-request",
        None,
    ),
    "lookup-no-token": (
        _case("POST", "/lookup", who=None, body=lookup_body(0)),
        401,
        "kvsp-unauthorized",
        None,
    ),
    # PUT instances/{id}/status
    "status-malformed-json": (_case("PUT", STATUS_URL, raw=b"{"), 400, "kvsp-bad-request", "$"),
    "status-wrong-type": (
        _case("PUT", STATUS_URL, body={**status(6).to_json(), "epoch": -1}),
        400,
        "kvsp-bad-request",
        "$.epoch",
    ),
    "status-bad-id": (
        _case("PUT", "/instances/XYZ/status", body=status(6).to_json()),
        400,
        "kvsp-bad-request",
        "instance_id",
    ),
    "status-id-mismatch": (
        _case("PUT", f"/instances/{uri_id(H1)}/status", body=status(6).to_json()),
        400,
        "kvsp-bad-request",
        "$.instance",
    ),
    "status-client-role": (
        _case("PUT", STATUS_URL, who="ca", body=status(6).to_json()),
        403,
        "kvsp-forbidden",
        None,
    ),
    "status-other-instance": (
        _case(
            "PUT",
            f"/instances/{uri_id('https://ii9.example/')}/status",
            who="i7",
            body=status(6, instance="https://ii9.example/").to_json(),
        ),
        403,
        "kvsp-forbidden",
        None,
    ),
    "status-stale-epoch": (
        _case("PUT", STATUS_URL, who="i7", body=status(4).to_json()),
        409,
        "kvsp-stale-epoch",
        None,
    ),
    "status-no-token": (
        _case("PUT", STATUS_URL, who=None, body=status(6).to_json()),
        401,
        "kvsp-unauthorized",
        None,
    ),
    # PUT/GET descriptors/{compat}
    "descriptor-malformed-json": (_case("PUT", DESC_URL, raw=b"]"), 400, "kvsp-bad-request", "$"),
    "descriptor-invalid": (
        _case("PUT", DESC_URL, body={**DESCRIPTOR.to_json(), "layers": 0}),
        400,
        "kvsp-bad-request",
        "$.layers",
    ),
    "descriptor-path-differs": (
        _case("PUT", DESC_URL, body=DRIFTED_DESCRIPTOR.to_json()),
        400,
        "kvsp-bad-request",
        "compat",
    ),
    "descriptor-uppercase-path": (
        _case("PUT", DESC_URL.upper(), body=DESCRIPTOR.to_json()),
        404,  # /DESCRIPTORS/... is no route at all
        "kvsp-not-found",
        None,
    ),
    "descriptor-uppercase-id": (
        _case("PUT", f"/descriptors/{DRIFTED.hex().upper()}", body=DRIFTED_DESCRIPTOR.to_json()),
        400,
        "kvsp-bad-request",
        "compat",
    ),
    "descriptor-client-role": (
        _case("PUT", f"/descriptors/{DRIFTED.hex()}", who="ca", body=DRIFTED_DESCRIPTOR.to_json()),
        403,
        "kvsp-forbidden",
        None,
    ),
    "descriptor-no-token": (
        _case("PUT", f"/descriptors/{DRIFTED.hex()}", who=None, body=DRIFTED_DESCRIPTOR.to_json()),
        401,
        "kvsp-unauthorized",
        None,
    ),
    "descriptor-get-unknown": (
        _case("GET", f"/descriptors/{DRIFTED.hex()}"),
        404,
        "kvsp-not-found",
        None,
    ),
    "descriptor-get-bad-id": (_case("GET", "/descriptors/12"), 400, "kvsp-bad-request", "compat"),
    "descriptor-get-no-token": (_case("GET", DESC_URL, who=None), 401, "kvsp-unauthorized", None),
    # routes and methods
    "unknown-route": (_case("GET", "/replicas/x"), 404, "kvsp-not-found", None),
    "unknown-route-trailing-slash": (
        _case("POST", "/lookup/", body=lookup_body(0)),
        404,
        "kvsp-not-found",
        None,
    ),
    "wrong-method-lookup": (_case("GET", "/lookup"), 405, "about:blank", None),
    "wrong-method-replica": (_case("POST", url_of(R0), body=GOOD), 405, "about:blank", None),
    "wrong-method-healthz": (_case("POST", "/healthz", body={}), 405, "about:blank", None),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUT))
def test_bad_input_is_a_problem_and_changes_nothing(env: Env, name: str) -> None:
    request, expected_status, problem, path = BAD_INPUT[name]
    before = env.snapshot()
    answer = env.client.request(**request)
    assert answer.status_code == expected_status, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    body = answer.json()
    expected_type = problem if problem == "about:blank" else PREFIX + problem
    assert body["type"] == expected_type
    assert body["status"] == expected_status
    if path is not None:
        assert body["path"] == path
    if expected_status == 401:
        assert answer.headers["www-authenticate"].startswith("Bearer")
    assert env.snapshot() == before


def test_every_route_is_covered_by_bad_input() -> None:
    covered = {name.split("-")[0] for name in BAD_INPUT}
    assert covered >= {"put", "delete", "batch", "lookup", "status", "descriptor", "wrong"}


# --- sweeper -----------------------------------------------------------------------------------


def test_sweeper_removes_expired_records_in_chunks(env: Env) -> None:
    for i in range(10, 35):
        env.put(record(i, ttl=100))
    env.clock.advance(100)
    index = env.app.state.index
    config = IndexConfig(sweep_interval_s=0.01, sweep_chunk=4, gc_freeze_interval_s=None)

    async def swept() -> bool:
        return await env.store.count() == 3

    async def sweep_a_while() -> int:
        async with index_lifespan(index, env.clock, config):
            await until(swept, 10, "the expired records swept")
        return await env.store.count()

    assert env.run(sweep_a_while()) == 3


HEAP_KEEPER_SCRIPT = """
import asyncio, gc
from kvsp.services.index.app import freeze_heap_forever

async def main():
    keeper = asyncio.create_task(freeze_heap_forever(0.01))
    while gc.get_freeze_count() == 0:
        await asyncio.sleep(0.01)
    keeper.cancel()
    print(gc.get_freeze_count())

asyncio.run(main())
"""


def test_heap_keeper_freezes_survivors() -> None:
    """In a process of its own, like a running IS: a collection in this one would run the
    finalizers of every earlier test's garbage inside the keeper's task."""
    done = subprocess.run(
        [sys.executable, "-c", HEAP_KEEPER_SCRIPT],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert int(done.stdout) > 0


# --- the client --------------------------------------------------------------------------------


def asgi_client(env: Env, who: str) -> IndexClient:
    transport = httpx.ASGITransport(app=env.app)
    return IndexClient(
        "http://testserver", token(who), client=httpx.AsyncClient(transport=transport)
    )


def test_index_client_round_trip(env: Env) -> None:
    async def scenario() -> None:
        async with asgi_client(env, "h1") as h1, asgi_client(env, "ca") as ca:
            assert await h1.publish(record(2, ttl=10**9)) == 600_000
            results = await h1.publish_batch([record(3), record(4, H2)])
            assert results[0] == 60_000
            assert isinstance(results[1], errors.Forbidden)
            answer = await ca.lookup(LookupRequest.from_json(lookup_body(0, 1, 2, 3, 4)))
            assert answer.matched == 4
            assert await h1.withdraw(COMPAT, SCOPE_A, key(3), H1)
            assert not await h1.withdraw(COMPAT, SCOPE_A, key(3), H1)
            with pytest.raises(errors.Forbidden):
                await h1.publish(record(5, H2))
            with pytest.raises(errors.BadRequest) as caught:
                await h1.publish(record(5, ttl=0))
            assert caught.value.path == "$.ttl_ms"
            assert str(caught.value) == "$.ttl_ms: must be at least 1"
            assert await h1.put_descriptor(DRIFTED_DESCRIPTOR) == DRIFTED
            assert await ca.get_descriptor(DRIFTED) == DRIFTED_DESCRIPTOR
            with pytest.raises(errors.NotFound):
                await ca.get_descriptor(b"\x00" * 32)

        async with asgi_client(env, "i7") as i7:
            assert (await i7.put_status(status(epoch=9))).state is InstanceState.ACTIVE
            with pytest.raises(errors.StaleEpoch):
                await i7.put_status(status(epoch=8))

    env.run(scenario())


def test_transport_failures_become_transport_errors() -> None:
    """Over the bulk transport (the default) a refused connection is NotSent, which a
    failover may move on from even for a POST that is not resent; over an httpx client, the
    httpx error stays the cause."""

    async def scenario(client: httpx.AsyncClient | None) -> None:
        async with IndexClient("http://127.0.0.1:9/", "t", timeout=2.0, client=client) as index:
            await index.lookup(LookupRequest.from_json(lookup_body(0)))

    with pytest.raises(NotSent) as refused:
        run(scenario(None))
    assert isinstance(refused.value.__cause__, OSError)
    assert refused.value.status == 502
    assert fails_over(refused.value, resend=False)

    async def with_httpx() -> None:
        async with httpx.AsyncClient(timeout=2.0) as http:
            await scenario(http)

    with pytest.raises(TransportError) as caught:
        run(with_httpx())
    assert isinstance(caught.value.__cause__, httpx.TransportError)
    assert caught.value.status == 502
    assert fails_over(caught.value, resend=False)


def test_the_bulk_transport_sends_what_httpx_sends() -> None:
    """The default (bulk) transport and an httpx client put the same method, path, headers
    and body on the wire, and read answers and problems alike."""
    seen: list[tuple[str, str, dict[str, str], bytes]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        seen.append((scope["method"], scope["path"], headers, body))
        if scope["path"].endswith("/lookup"):
            status, payload, kind = 200, {"matched": 0, "replicas": []}, KVSP_JSON
        else:
            problem = {
                "type": errors.PROBLEM_PREFIX + "kvsp-forbidden",
                "status": 403,
                "detail": "no",
            }
            status, payload, kind = 403, problem, "application/problem+json"
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", kind.encode())],
            }
        )
        await send({"type": "http.response.body", "body": json.dumps(payload).encode()})

    async def scenario() -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", lifespan="off")
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        base = f"http://127.0.0.1:{port}/is/"
        request = LookupRequest.from_json(lookup_body(0))
        try:
            async with httpx.AsyncClient() as http:
                for client in (None, http):
                    async with IndexClient(base, "tok", client=client) as index:
                        answer = await index.lookup(request)
                        assert answer.matched == 0
                        with pytest.raises(errors.Forbidden, match="no"):
                            await index.withdraw_holder("http://h/")
        finally:
            server.should_exit = True
            await task

    run(scenario())
    assert len(seen) == 4
    for bulk, other in ((seen[0], seen[2]), (seen[1], seen[3])):
        assert bulk[:2] == other[:2] and bulk[3] == other[3]
        for name in ("authorization", "accept", "content-type", "host"):
            assert bulk[2].get(name) == other[2].get(name), name


def _answer(status_code: int, body: Any, content_type: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.Response(status_code, content=content, headers={"content-type": content_type})


@pytest.mark.parametrize(
    ("problem", "status_code", "cls"),
    [
        ("kvsp-bad-request", 400, errors.BadRequest),
        ("kvsp-bad-request", 413, errors.PayloadTooLarge),
        ("kvsp-bad-request", 415, UnsupportedMediaType),
        ("kvsp-incompatible", 406, errors.NotAcceptable),
        ("kvsp-unauthorized", 401, errors.Unauthorized),
        ("kvsp-forbidden", 403, errors.Forbidden),
        ("kvsp-not-found", 404, errors.NotFound),
        ("kvsp-layers-unavailable", 404, errors.LayersUnavailable),
        ("kvsp-conflict", 409, errors.Conflict),
        ("kvsp-conflict", 412, errors.PreconditionFailed),
        ("kvsp-stale-epoch", 409, errors.StaleEpoch),
        ("kvsp-lease-quota", 429, errors.LeaseQuota),
        ("kvsp-digest-mismatch", 422, errors.DigestMismatch),
        ("kvsp-incompatible", 422, errors.Incompatible),
        ("kvsp-not-active", 503, errors.NotActive),
        ("kvsp-unreachable", 502, TransportError),
    ],
)
def test_problem_answers_map_back_to_their_error_class(
    problem: str, status_code: int, cls: type[errors.KVSPError]
) -> None:
    original = cls("what went wrong", path="$.x")
    body = original.to_problem(instance="/lookup")
    assert body["type"] == PREFIX + problem
    err = problem_error(_answer(status_code, body, "application/problem+json"))
    assert type(err) is cls
    assert (err.detail, err.path, str(err)) == ("what went wrong", "$.x", "$.x: what went wrong")
    assert type(error_from_problem(body)) is cls


@pytest.mark.parametrize(
    ("status_code", "body", "content_type"),
    [
        (
            405,
            {"type": "about:blank", "title": "Method Not Allowed", "status": 405},
            "application/problem+json",
        ),
        (418, {"type": PREFIX + "kvsp-teapot", "status": 418}, "application/problem+json"),
        (500, b"<html>oops</html>", "text/html"),
        (503, b"not json", "application/problem+json"),
        (400, [1, 2], "application/problem+json"),
    ],
)
def test_unknown_answers_become_remote_errors(
    status_code: int, body: Any, content_type: str
) -> None:
    err = problem_error(_answer(status_code, body, content_type))
    assert isinstance(err, RemoteError)
    assert err.remote_status == status_code
    assert err.status == 502
    assert err.body


def test_a_malformed_success_answer_blames_the_peer() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return _answer(200, {"matched": "two"}, "application/kvsp+json")

    async def scenario() -> None:
        transport = httpx.MockTransport(handler)
        async with IndexClient(
            "http://peer/", "t", client=httpx.AsyncClient(transport=transport)
        ) as client:
            await client.lookup(LookupRequest.from_json(lookup_body(0)))

    with pytest.raises(RemoteError) as caught:
        run(scenario())
    assert "$.matched" in str(caught.value)


def test_answers_for_other_keys_are_refused() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        other = {**record(1).to_json()}
        return _answer(200, {"matched": 1, "replicas": [[other]]}, "application/kvsp+json")

    async def scenario() -> None:
        transport = httpx.MockTransport(handler)
        async with IndexClient(
            "http://peer", None, client=httpx.AsyncClient(transport=transport)
        ) as client:
            await client.lookup(LookupRequest.from_json(lookup_body(0)))

    with pytest.raises(RemoteError, match="not for the key asked"):
        run(scenario())
