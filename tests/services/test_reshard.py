"""Resharding of sequence-sharded caches (spec §6.9), in-process: the PC's shard-map face and
several instances' reshard faces in one event loop, each request routed to its app by host.

The acceptance sequence 3 → 2 → 4 → 3 instances on a 64k-token context checks, after every
committed version, that gathering the shards gives back the original cache bit for bit, that no
octet of a retained range moved (the fetch log per range, and the very same page arrays), and
that released ranges are let go. A member that never acknowledges aborts the change, version v
keeps serving, and what was fetched is discarded. Then the rules, one by one.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvsp.engine.shards import container_parts, gather_sets, seeded_kv, token_bytes
from kvsp.errors import BadRequest
from kvsp.records_shard import ReshardFetch, ReshardPlan, Shard, ShardMap
from kvsp.reshard import plan_reshard
from kvsp.services.instance.reshard import ShardHolder
from kvsp.services.pc.reshard import ReshardConfig
from kvsp.stores.shardmaps import BeginOutcome, MemoryShardMaps, ShardMapStore
from kvsp.web.auth import Principals
from kvsp.web.clock import ManualClock
from tests.support import reshard_peers as rt

GEOMETRY = rt.GEOMETRY
CONTEXT = rt.CONTEXT
TOKEN = token_bytes(GEOMETRY)
PROBLEM = "urn:ietf:params:kvsp:problem:"
MAP = "ctx"


# --- in-process world --------------------------------------------------------------------------


class Gate:
    """An ASGI wrapper that can hold requests to ``path`` (and method) until released."""

    def __init__(self, app: ASGIApp, path: str, method: str = "POST") -> None:
        self.app = app
        self.path = path
        self.method = method
        self.holding = False
        self.arrived = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.holding
            and scope["type"] == "http"
            and scope["method"] == self.method
            and scope["path"].startswith(self.path)
        ):
            self.arrived.set()
            await self.release.wait()
        await self.app(scope, receive, send)


class Corrupt:
    """An ASGI wrapper that flips the last octet of every response body."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        chunks: list[Message] = []

        async def keep(message: Message) -> None:
            chunks.append(message)

        await self.app(scope, receive, keep)
        body = b"".join(m.get("body", b"") for m in chunks if m["type"] == "http.response.body")
        body = body[:-1] + bytes([body[-1] ^ 1])
        await send(next(m for m in chunks if m["type"] == "http.response.start"))
        await send({"type": "http.response.body", "body": body})


class Router(httpx.AsyncBaseTransport):
    """Sends each request to the in-process app of its host."""

    def __init__(self) -> None:
        self.apps: dict[str, httpx.ASGITransport] = {}

    def add(self, name: str, app: ASGIApp) -> str:
        self.apps[f"{name}.test"] = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        return f"http://{name}.test/"

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        transport = self.apps.get(request.url.host)
        if transport is None:
            raise httpx.ConnectError(f"no app at {request.url.host}", request=request)
        return await transport.handle_async_request(request)


class Node:
    """One in-process instance: its base URL, shard holder and gates."""

    def __init__(self, base: str, holder: ShardHolder, plans: Gate, ranges: Gate) -> None:
        self.base = base
        self.holder = holder
        self.plans = plans
        self.ranges = ranges


class World:
    """A PC and instances in one event loop, reached through one routed client."""

    def __init__(self, config: ReshardConfig | None = None) -> None:
        self.router = Router()
        self.client = httpx.AsyncClient(transport=self.router, timeout=30)
        self.principals = Principals.from_entries(rt.principal_entries())
        self.clock = ManualClock(1_000_000)
        config = config or ReshardConfig(message_timeout_s=0.3)
        app = rt.create_pc_app(self.principals, self.clock, client=self.client, config=config)
        self.pc = self.router.add("pc", app)

    def instance(self, name: str, *, corrupt: bool = False, page_tokens: int = 256) -> Node:
        app = rt.create_instance_app(
            self.principals, self.clock, client=self.client, page_tokens=page_tokens
        )
        ranges = Gate(Corrupt(app) if corrupt else app, "/shards/", "GET")
        plans = Gate(ranges, "/reshard")
        url = self.router.add(name, plans)
        app.state.own_urls.append(url)  # it takes audience credentials for its URL
        return Node(url, app.state.shards, plans, ranges)

    async def call(
        self, method: str, url: str, role: str | None = "pc", **kwargs: Any
    ) -> httpx.Response:
        headers = {**(rt.auth(role) if role else {}), **kwargs.pop("headers", {})}
        return await self.client.request(method, url, headers=headers, **kwargs)

    async def pc_post(self, path: str, body: Any, role: str | None = "pc") -> httpx.Response:
        return await self.call("POST", self.pc + path, role, json=body)

    async def pc_get(self, path: str, role: str | None = "pc") -> httpx.Response:
        return await self.call("GET", self.pc + path, role)

    async def reshard(self, node: Node, body: Any, role: str | None = "pc") -> httpx.Response:
        return await self.call("POST", node.base + "reshard", role, json=body)


def run_world(
    test: Callable[[World], Awaitable[None]], config: ReshardConfig | None = None
) -> None:
    async def main() -> None:
        world = World(config)
        try:
            await test(world)
        finally:
            await world.client.aclose()

    asyncio.run(main())


def shards(*parts: tuple[Node, int, int]) -> list[dict[str, Any]]:
    return [{"tokens": [a, b], "instance": node.base} for node, a, b in parts]


def thirds(nodes: Sequence[Node], original: np.ndarray) -> list[tuple[Node, int, int]]:
    cuts = [0, 21_846, 43_691, CONTEXT]
    parts = list(zip(nodes, cuts, cuts[1:], strict=False))
    for node, a, b in parts:
        node.holder.load(MAP, 1, a, original[:, :, a:b])
    return parts


def owners(parts: Sequence[tuple[Node, int, int]], nodes: Sequence[Node]) -> np.ndarray:
    """Which node (index into ``nodes``) holds each token; -1 for none."""
    owner = np.full(CONTEXT, -1)
    for node, a, b in parts:
        owner[a:b] = nodes.index(node)
    return owner


def runs(mask: np.ndarray) -> Iterator[tuple[int, int]]:
    """The maximal ``[a, b)`` runs where ``mask`` is true."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    yield from zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True)


def problem(response: httpx.Response, status: int, name: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = response.json()
    assert body["type"] == PROBLEM + name, body
    return body


# --- acceptance: 3 → 2 → 4 → 3 -----------------------------------------------------------------

STEPS = [
    ("ab", [(0, 0, 32_768), (1, 32_768, CONTEXT)]),
    ("abcd", [(0, 0, 16_384), (3, 16_384, 32_768), (1, 32_768, 49_152), (2, 49_152, CONTEXT)]),
    ("acd", [(0, 0, 20_000), (3, 20_000, 45_000), (2, 45_000, CONTEXT)]),
]


def test_three_two_four_three_instances_on_a_64k_context() -> None:
    run_world(_three_two_four_three)


async def _three_two_four_three(w: World) -> None:
    nodes = [w.instance(name) for name in "abcd"]
    original = seeded_kv(GEOMETRY, 0, CONTEXT, rt.SEED)
    parts = thirds(nodes[:3], original)
    created = await w.pc_post("shardmaps", {"map": MAP, "shards": shards(*parts)})
    assert created.status_code == 201, created.text
    assert created.headers["location"] == f"shardmaps/{MAP}"
    for version, (_, layout) in enumerate(STEPS, start=1):
        new_parts = [(nodes[i], a, b) for i, a, b in layout]
        old_owner, new_owner = owners(parts, nodes), owners(new_parts, nodes)
        kept = _retained_pages(nodes, old_owner, new_owner)
        logged = [len(n.holder.fetched) for n in nodes]
        answer = await w.pc_post(
            f"shardmaps/{MAP}/versions", {"from": version, "shards": shards(*new_parts)}
        )
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"map": MAP, "version": version + 1, "shards": shards(*new_parts)}
        assert (await w.pc_get(f"shardmaps/{MAP}")).json()["version"] == version + 1
        members = [n for n in nodes if any(p[0] is n for p in new_parts)]
        start, whole = gather_sets(n.holder.shard_set(MAP) for n in members)
        assert start == 0 and np.array_equal(whole, original)  # bit-exact
        for index, node in enumerate(nodes):
            fetched = list(node.holder.fetched)[logged[index] :]
            _check_node(node, index, version + 1, fetched, old_owner, new_owner, kept)
        parts = new_parts


def _retained_pages(
    nodes: Sequence[Node], old: np.ndarray, new: np.ndarray
) -> dict[tuple[int, int, int], list[np.ndarray]]:
    """The page arrays behind every range each node keeps, before the change."""
    kept = {}
    for i, node in enumerate(nodes):
        for a, b in runs((old == i) & (new == i)):
            pieces = node.holder.shard_set(MAP).slice(a, b)
            kept[(i, a, b)] = [page for piece in pieces for page in piece.pages]
    return kept


def _check_node(
    node: Node,
    index: int,
    version: int,
    fetched: Sequence[Any],
    old: np.ndarray,
    new: np.ndarray,
    kept: dict[tuple[int, int, int], list[np.ndarray]],
) -> None:
    retained = (old == index) & (new == index)
    incoming = (new == index) & (old != index)
    for entry in fetched:  # counted per range: nothing fetched overlaps a retained range
        a, b = entry.tokens
        assert entry.version == version
        assert not retained[a:b].any(), (node.base, entry)
        assert entry.bytes == (b - a) * TOKEN
        assert set(old[a:b].tolist()) == {-1} or len(set(old[a:b].tolist())) == 1
    assert sum(e.bytes for e in fetched) == int(incoming.sum()) * TOKEN
    for (i, a, b), pages in kept.items():
        if i == index:  # the very same page arrays: retained memory stayed in place
            now = [p for piece in node.holder.shard_set(MAP).slice(a, b) for p in piece.pages]
            assert len(now) == len(pages) and all(x is y for x, y in zip(now, pages, strict=True))
    mine = list(runs(new == index))
    held = node.holder.shard_set(MAP)
    assert all(held.covers(a, b) for a, b in mine)
    assert sum(b - a for a, b in held.ranges()) == int((new == index).sum())
    page_bytes = 256 * TOKEN
    # Released ranges are let go: at most one partly used page at each end of a piece.
    assert node.holder.held_bytes <= int((new == index).sum()) * TOKEN + 2 * len(held) * page_bytes
    if not mine:
        assert node.holder.held_bytes == 0 and node.holder.version(MAP) is None
    else:
        assert node.holder.version(MAP) == version


# --- acceptance: a member that never acknowledges ----------------------------------------------


def test_a_silent_member_aborts_and_version_v_keeps_serving() -> None:
    run_world(_silent_member, ReshardConfig(message_timeout_s=0.2))


async def _silent_member(w: World) -> None:
    a, b, c = (w.instance(name) for name in "abc")
    original = seeded_kv(GEOMETRY, 0, CONTEXT, rt.SEED)
    parts = thirds([a, b, c], original)
    assert (await w.pc_post("shardmaps", {"map": MAP, "shards": shards(*parts)})).status_code == 201
    before = [n.holder.held_bytes for n in (a, b, c)]
    c.plans.holding = True  # c receives its plan and never answers
    proposal = shards((a, 0, 30_000), (b, 30_000, 43_691), (c, 43_691, CONTEXT))
    change = asyncio.create_task(
        w.pc_post(f"shardmaps/{MAP}/versions", {"from": 1, "shards": proposal, "deadline_ms": 2500})
    )
    await c.plans.arrived.wait()
    during = (await w.pc_get(f"shardmaps/{MAP}")).json()
    assert during["version"] == 1 and during["pending"] == 2  # v stays authoritative
    assert during["shards"] == shards(*parts)
    body = problem(await change, 504, "kvsp-reshard-aborted")
    assert body["version"] == 1
    assert [f["instance"] for f in body["failed"]] == [c.base]
    after = (await w.pc_get(f"shardmaps/{MAP}")).json()
    assert after == {"map": MAP, "version": 1, "shards": shards(*parts)}
    assert [entry.tokens for entry in a.holder.fetched] == [(21_846, 30_000)]  # it did fetch
    assert a.holder.fetched[0].bytes == 8_154 * TOKEN
    assert [n.holder.held_bytes for n in (a, b, c)] == before  # ... and discarded it
    assert a.holder.status()["maps"][0]["pending"] is None and a.holder.aborted == 1
    start, whole = gather_sets(n.holder.shard_set(MAP) for n in (a, b, c))
    assert start == 0 and np.array_equal(whole, original)
    served = await w.call("GET", f"{b.base}shards/{MAP}/21846-30000?version=1", "instance")
    assert served.status_code == 200  # version 1 still served
    c.plans.holding = False  # the same change succeeds once every member answers
    retry = await w.pc_post(f"shardmaps/{MAP}/versions", {"from": 1, "shards": proposal})
    assert retry.status_code == 200, retry.text
    assert [entry.tokens for entry in a.holder.fetched] == [(21_846, 30_000)] * 2
    start, whole = gather_sets(n.holder.shard_set(MAP) for n in (a, b, c))
    assert np.array_equal(whole, original)


def test_a_source_without_the_range_fails_the_ack_and_aborts() -> None:
    run_world(_source_lacks_range, ReshardConfig(message_timeout_s=0.2))


async def _source_lacks_range(w: World) -> None:
    a, b = w.instance("a"), w.instance("b")
    kv = seeded_kv(GEOMETRY, 0, 2000, 5)
    a.holder.load(MAP, 1, 0, kv[:, :, :1000])
    b.holder.load(MAP, 1, 1000, kv[:, :, 1000:1500])  # the map says b holds [1000, 2000)
    created = await w.pc_post(
        "shardmaps", {"map": MAP, "shards": shards((a, 0, 1000), (b, 1000, 2000))}
    )
    assert created.status_code == 201
    before = a.holder.held_bytes
    b.plans.holding = True  # b's own plan check comes too late to matter: a fails first
    answer = await w.pc_post(
        f"shardmaps/{MAP}/versions", {"from": 1, "shards": shards((a, 0, 2000))}
    )
    body = problem(answer, 502, "kvsp-reshard-aborted")
    assert [f["instance"] for f in body["failed"]] == [a.base]
    assert body["failed"][0]["status"] == 502
    assert "[1000, 2000)" in body["failed"][0]["detail"]
    assert "not all held" in body["failed"][0]["detail"]
    assert (await w.pc_get(f"shardmaps/{MAP}")).json()["version"] == 1
    assert a.holder.held_bytes == before and a.holder.aborted == 1


# --- the PC's rules ----------------------------------------------------------------------------


def test_map_creation_rules() -> None:
    run_world(_map_creation)


async def _map_creation(w: World) -> None:
    a, b = w.instance("a"), w.instance("b")
    overlap = [{"tokens": [0, 10], "instance": a.base}, {"tokens": [5, 20], "instance": b.base}]
    body = problem(
        await w.pc_post("shardmaps", {"map": "m", "shards": overlap}), 400, "kvsp-bad-request"
    )
    assert body["path"] == "$.shards[1].tokens" and "overlaps" in body["detail"]
    gap = [{"tokens": [0, 10], "instance": a.base}, {"tokens": [11, 20], "instance": b.base}]
    body = problem(
        await w.pc_post("shardmaps", {"map": "m", "shards": gap}), 400, "kvsp-bad-request"
    )
    assert "gap" in body["detail"]
    good = shards((a, 0, 10), (b, 10, 20))
    for bad in (
        {"map": "m", "version": 2, "shards": good},
        {"map": "m/x", "shards": good},
        {"map": "m", "shards": []},
        {"map": "m", "shards": [{"tokens": [0, 10], "instance": "http://a.test"}]},
        {"map": "m", "shards": [{"tokens": [10, 10], "instance": a.base}]},
        [1, 2],
    ):
        problem(await w.pc_post("shardmaps", bad), 400, "kvsp-bad-request")
    created = await w.pc_post("shardmaps", {"shards": good})
    assert created.status_code == 201
    name = created.json()["map"]
    assert re.fullmatch("[0-9a-f]{32}", name) and created.json()["version"] == 1
    assert (await w.pc_get(f"shardmaps/{name}")).json() == created.json()
    assert (
        await w.pc_post("shardmaps", {"map": "m", "version": 1, "shards": good})
    ).status_code == 201
    problem(await w.pc_post("shardmaps", {"map": "m", "shards": good}), 409, "kvsp-conflict")
    problem(await w.pc_get("shardmaps/nope"), 404, "kvsp-not-found")
    versions = {"from": 1, "shards": good}
    problem(await w.pc_post("shardmaps/nope/versions", versions), 404, "kvsp-not-found")


def test_version_change_rules() -> None:
    run_world(_version_rules)


async def _version_rules(w: World) -> None:
    a, b = w.instance("a"), w.instance("b")
    kv = seeded_kv(GEOMETRY, 0, 20, 1)
    a.holder.load(MAP, 1, 0, kv[:, :, :10])
    b.holder.load(MAP, 1, 10, kv[:, :, 10:])
    await w.pc_post("shardmaps", {"map": MAP, "shards": shards((a, 0, 10), (b, 10, 20))})
    url = f"shardmaps/{MAP}/versions"
    body = problem(
        await w.pc_post(url, {"from": 5, "shards": shards((a, 0, 20))}), 409, "kvsp-conflict"
    )
    assert body["path"] == "$.from" and "version 1" in body["detail"]
    overlap = [{"tokens": [0, 12], "instance": a.base}, {"tokens": [10, 20], "instance": b.base}]
    problem(await w.pc_post(url, {"from": 1, "shards": overlap}), 400, "kvsp-bad-request")
    body = problem(
        await w.pc_post(url, {"from": 1, "shards": shards((a, 0, 25))}), 400, "kvsp-bad-request"
    )
    assert "[0, 20)" in body["detail"]
    for bad in (
        {"shards": shards((a, 0, 20))},
        {"from": 1},
        {"from": 1, "shards": shards((a, 0, 20)), "deadline_ms": 0},
    ):
        problem(await w.pc_post(url, bad), 400, "kvsp-bad-request")
    problem(
        await w.call(
            "POST",
            w.pc + url,
            content=b"{",
            headers={"content-type": "application/json"},
        ),
        400,
        "kvsp-bad-request",
    )
    b.plans.holding = True  # a change in flight: a second one is refused
    first = asyncio.create_task(
        w.pc_post(url, {"from": 1, "shards": shards((a, 0, 20)), "deadline_ms": 400})
    )
    await b.plans.arrived.wait()
    problem(await w.pc_post(url, {"from": 1, "shards": shards((b, 0, 20))}), 409, "kvsp-conflict")
    problem(await first, 504, "kvsp-reshard-aborted")
    b.plans.holding = False
    done = await w.pc_post(url, {"from": 1, "shards": shards((b, 0, 20))})
    assert done.status_code == 200 and done.json()["version"] == 2
    problem(await w.pc_post(url, {"from": 1, "shards": shards((a, 0, 20))}), 409, "kvsp-conflict")


def test_roles_on_the_pc() -> None:
    run_world(_pc_roles)


async def _pc_roles(w: World) -> None:
    a = w.instance("a")
    body = {"map": MAP, "shards": shards((a, 0, 10))}
    for role in ("client", "instance"):
        problem(await w.pc_post("shardmaps", body, role), 403, "kvsp-forbidden")
    problem(await w.pc_post("shardmaps", body, None), 401, "kvsp-unauthorized")
    assert (await w.pc_post("shardmaps", body, "admin")).status_code == 201
    problem(await w.pc_get(f"shardmaps/{MAP}", "client"), 403, "kvsp-forbidden")
    versions = {"from": 1, "shards": shards((a, 0, 10))}
    problem(
        await w.pc_post(f"shardmaps/{MAP}/versions", versions, "instance"), 403, "kvsp-forbidden"
    )


# --- the instance's rules ----------------------------------------------------------------------


def _plan(
    frm: int,
    retain: Sequence[tuple[int, int]] = (),
    fetch: Sequence[tuple[int, int, str]] = (),
    release: Sequence[tuple[int, int]] = (),
    deadline_ms: int = 5000,
) -> dict[str, Any]:
    return {
        "map": MAP,
        "from": frm,
        "to": frm + 1,
        "deadline_ms": deadline_ms,
        "retain": [list(r) for r in retain],
        "fetch": [{"tokens": [a, b], "from": src} for a, b, src in fetch],
        "release": [list(r) for r in release],
    }


def test_instance_checks_plans_against_what_it_holds() -> None:
    run_world(_instance_plan_checks)


async def _instance_plan_checks(w: World) -> None:
    a, b = w.instance("a"), w.instance("b")
    a.holder.load(MAP, 3, 0, seeded_kv(GEOMETRY, 0, 100, 1))
    cases = [
        (_plan(2, retain=[(0, 100)]), "holds version 3"),
        (_plan(3, retain=[(0, 120)]), "does not hold [0, 120)"),
        (_plan(3, retain=[(0, 50)]), "neither retained nor released"),
        (_plan(3, release=[(0, 50)], retain=[(60, 100)]), "neither retained nor released"),
    ]
    for plan, detail in cases:
        body = problem(await w.reshard(a, plan), 409, "kvsp-conflict")
        assert detail in body["detail"], body
    body = problem(await w.reshard(b, _plan(3, retain=[(0, 10)])), 409, "kvsp-conflict")
    assert "holds no range" in body["detail"]
    assert b.holder.status()["maps"] == []  # a refused plan leaves nothing behind
    problem(await w.reshard(a, _plan(3, retain=[(0, 100)]), "instance"), 403, "kvsp-forbidden")
    problem(await w.reshard(a, {**_plan(3), "commit": 4}), 400, "kvsp-bad-request")
    problem(await w.reshard(a, {**_plan(3), "to": 9}), 400, "kvsp-bad-request")
    overlapping = _plan(3, retain=[(0, 100)], release=[(50, 60)])
    problem(await w.reshard(a, overlapping), 400, "kvsp-bad-request")
    assert a.holder.status()["maps"][0]["pending"] is None


def test_commit_and_abort_on_the_instance() -> None:
    run_world(_instance_commit_abort)


async def _instance_commit_abort(w: World) -> None:
    a, b = w.instance("a"), w.instance("b")
    kv = seeded_kv(GEOMETRY, 0, 600, 2)
    a.holder.load(MAP, 1, 0, kv[:, :, :300])
    b.holder.load(MAP, 1, 300, kv[:, :, 300:])
    problem(await w.reshard(a, {"map": MAP, "commit": 2}), 409, "kvsp-conflict")
    aborted = await w.reshard(a, {"map": MAP, "abort": 2})  # nothing pending: nothing to do
    assert aborted.json() == {"map": MAP, "aborted": 2, "discarded_bytes": 0}
    plan = _plan(1, retain=[(0, 300)], fetch=[(300, 600, b.base)])
    ack = await w.reshard(a, plan)
    assert ack.status_code == 200 and ack.json()["ready"] == 2
    again = await w.reshard(a, plan)  # idempotent: no second fetch
    assert again.status_code == 200 and len(a.holder.fetched) == 1
    release = await w.reshard(b, _plan(1, release=[(300, 600)]))
    assert release.status_code == 200
    for node, ranges in ((a, [[0, 300], [300, 600]]), (b, [])):
        committed = await w.reshard(node, {"map": MAP, "commit": 2})
        assert committed.json() == {"map": MAP, "version": 2, "ranges": ranges}
        repeat = await w.reshard(node, {"map": MAP, "commit": 2})
        assert repeat.json() == committed.json()
    assert np.array_equal(a.holder.shard_set(MAP).read(0, 600), kv)
    assert b.holder.held_bytes == 0 and b.holder.committed == 1
    problem(await w.reshard(a, {"map": MAP, "abort": 2}), 409, "kvsp-conflict")
    problem(await w.reshard(a, {"map": MAP, "commit": 3}), 409, "kvsp-conflict")


def test_abort_while_loading_discards_and_answers_the_plan() -> None:
    run_world(_abort_while_loading)


async def _abort_while_loading(w: World) -> None:
    a, b = w.instance("a"), w.instance("b")
    kv = seeded_kv(GEOMETRY, 0, 600, 3)
    a.holder.load(MAP, 1, 0, kv[:, :, :300])
    b.holder.load(MAP, 1, 300, kv[:, :, 300:])
    before = a.holder.held_bytes
    b.ranges.holding = True
    plan = asyncio.create_task(
        w.reshard(a, _plan(1, retain=[(0, 300)], fetch=[(300, 600, b.base)]))
    )
    await b.ranges.arrived.wait()
    assert a.holder.status()["maps"][0]["pending"]["state"] == "fetching"
    aborted = await w.reshard(a, {"map": MAP, "abort": 2})
    assert aborted.status_code == 200
    body = problem(await plan, 409, "kvsp-conflict")
    assert "aborted or replaced" in body["detail"]
    assert a.holder.held_bytes == before and a.holder.status()["maps"][0]["pending"] is None


def test_instance_deadline_and_digest_checks() -> None:
    run_world(_instance_fetch_failures)


async def _instance_fetch_failures(w: World) -> None:
    a, b, c = w.instance("a"), w.instance("b"), w.instance("c", corrupt=True)
    kv = seeded_kv(GEOMETRY, 0, 900, 4)
    a.holder.load(MAP, 1, 0, kv[:, :, :300])
    b.holder.load(MAP, 1, 300, kv[:, :, 300:600])
    c.holder.load(MAP, 1, 600, kv[:, :, 600:])
    b.ranges.holding = True
    slow = _plan(1, retain=[(0, 300)], fetch=[(300, 600, b.base)], deadline_ms=200)
    body = problem(await w.reshard(a, slow), 504, "kvsp-upstream-error")
    assert "within 200 ms" in body["detail"]
    assert a.holder.status()["maps"][0]["pending"]["state"] == "failed"
    b.ranges.holding = False
    retried = await w.reshard(a, slow)  # the same plan again: loads what is missing
    assert retried.status_code == 200
    assert a.holder.status()["maps"][0]["pending"]["state"] == "ready"
    bad = _plan(1, retain=[(0, 300)], fetch=[(300, 600, b.base), (600, 900, c.base)])
    body = problem(await w.reshard(a, bad), 502, "kvsp-upstream-error")
    assert "Repr-Digest" in body["detail"] and "[600, 900)" in body["detail"]
    pending = a.holder.status()["maps"][0]["pending"]
    assert pending["to"] == 2 and pending["fetched"] == [[300, 600]]  # kept across plans
    assert len(a.holder.fetched) == 1
    gone = _plan(1, retain=[(0, 300)], fetch=[(300, 600, "http://nowhere.test/")])
    a.holder.abort(_abort(2))
    body = problem(await w.reshard(a, gone), 502, "kvsp-upstream-error")
    assert "nowhere.test" in body["detail"]


def _abort(version: int) -> Any:
    from kvsp.records_shard import ReshardAbort

    return ReshardAbort(map=MAP, abort=version)


def test_range_resource() -> None:
    run_world(_range_resource)


async def _range_resource(w: World) -> None:
    a = w.instance("a", page_tokens=64)
    kv = seeded_kv(GEOMETRY, 100, 1100, 6)
    body = b"".join(bytes(p) for p in container_parts(kv, GEOMETRY))
    put = await w.call("PUT", f"{a.base}shards/{MAP}/100-1100?version=4", "pc", content=body)
    assert put.status_code == 204, put.text
    got = await w.call("GET", f"{a.base}shards/{MAP}/150-1000?version=4", "instance")
    assert got.status_code == 200 and got.headers["content-type"] == "application/kvsp-block"
    expected = b"".join(bytes(p) for p in container_parts(kv[:, :, 50:900], GEOMETRY))
    assert got.content == expected
    assert got.headers["repr-digest"].startswith("sha-256=:")
    assert a.holder.served[-1].tokens == (150, 1000) and a.holder.served_bytes == 850 * TOKEN
    url = f"{a.base}shards/{MAP}/"
    problem(await w.call("GET", url + "150-1000?version=3", "instance"), 409, "kvsp-conflict")
    problem(await w.call("GET", url + "50-200?version=4", "instance"), 404, "kvsp-not-found")
    problem(
        await w.call("GET", f"{a.base}shards/other/0-1?version=4", "instance"),
        404,
        "kvsp-not-found",
    )
    for bad in ("5-3?version=4", "x-9?version=4", "05-9?version=4", "1-2", "1-2?version=-1"):
        problem(await w.call("GET", url + bad, "instance"), 400, "kvsp-bad-request")
    problem(await w.call("GET", url + "150-1000?version=4", "client"), 403, "kvsp-forbidden")
    problem(
        await w.call("PUT", url + "1100-1200?version=4", "pc", content=body),
        400,
        "kvsp-bad-request",
    )
    problem(
        await w.call("PUT", url + "500-1500?version=4", "pc", content=body), 409, "kvsp-conflict"
    )
    problem(
        await w.call("PUT", url + "2000-3000?version=5", "pc", content=body), 409, "kvsp-conflict"
    )
    problem(
        await w.call("PUT", url + "2000-3000?version=4", "pc", content=body[:-5]),
        400,
        "kvsp-bad-request",
    )
    lie = {"repr-digest": "sha-256=:" + "A" * 43 + "=:"}
    problem(
        await w.call("PUT", url + "2000-3000?version=4", "pc", content=body, headers=lie),
        422,
        "kvsp-digest-mismatch",
    )
    status = await w.call("GET", f"{a.base}shards", "pc")
    assert status.json()["maps"][0]["ranges"] == [[100, 1100]]
    assert json.loads(status.content)["served_bytes"] == 850 * TOKEN


# --- plans (pure) and the store ----------------------------------------------------------------


def _map(version: int, *parts: tuple[str, int, int]) -> ShardMap:
    return ShardMap(
        map=MAP,
        version=version,
        shards=tuple(Shard(tokens=(a, b), instance=i) for i, a, b in parts),
    )


A, B, C = "http://a.test/", "http://b.test/", "http://c.test/"


def test_plan_retains_fetches_at_boundaries_and_releases() -> None:
    current = _map(4, (A, 0, 100), (B, 100, 200), (C, 200, 300))
    proposed = _map(5, (A, 0, 250), (C, 250, 300))
    plans = plan_reshard(current, proposed, 200)
    assert list(plans) == [A, B, C]
    assert plans[A] == ReshardPlan(
        map=MAP,
        from_version=4,
        to_version=5,
        deadline_ms=200,
        retain=((0, 100),),
        fetch=(
            ReshardFetch(tokens=(100, 200), source=B),
            ReshardFetch(tokens=(200, 250), source=C),
        ),
        release=(),
    )
    assert plans[B].retain == () and plans[B].fetch == () and plans[B].release == ((100, 200),)
    assert plans[C].retain == ((250, 300),) and plans[C].release == ((200, 250),)
    with pytest.raises(BadRequest):
        plan_reshard(current, _map(5, (A, 0, 299)), 200)
    with pytest.raises(BadRequest):
        plan_reshard(current, _map(6, (A, 0, 300)), 200)


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[ShardMap, ShardMap]:
    names = [A, B, C, "http://d.test/"]

    def layout(version: int) -> ShardMap:
        cuts = sorted(set(draw(st.lists(st.integers(1, 499), max_size=6))))
        edges = [0, *cuts, 500]
        owners = draw(
            st.lists(st.sampled_from(names), min_size=len(edges) - 1, max_size=len(edges) - 1)
        )
        return _map(
            version, *((o, a, b) for o, a, b in zip(owners, edges, edges[1:], strict=False))
        )

    return layout(1), layout(2)


@settings(max_examples=150, deadline=None)
@given(_layouts())
def test_plans_move_exactly_what_changes_owner(layouts: tuple[ShardMap, ShardMap]) -> None:
    current, proposed = layouts
    old = {t: s.instance for s in current.shards for t in range(*s.tokens)}
    new = {t: s.instance for s in proposed.shards for t in range(*s.tokens)}
    plans = plan_reshard(current, proposed, 100)
    assert set(plans) == set(old.values()) | set(new.values())
    for instance, plan in plans.items():
        retained = {t for a, b in plan.retain for t in range(a, b)}
        released = {t for a, b in plan.release for t in range(a, b)}
        fetched = {t for f in plan.fetch for t in range(*f.tokens)}
        assert retained == {t for t in new if new[t] == instance == old[t]}
        assert released == {t for t in old if old[t] == instance != new[t]}
        assert fetched == {t for t in new if new[t] == instance != old[t]}
        for f in plan.fetch:  # from the owner at v, never across one of its shard boundaries
            assert {old[t] for t in range(*f.tokens)} == {f.source}
            assert any(
                s.tokens[0] <= f.tokens[0] and f.tokens[1] <= s.tokens[1] for s in current.shards
            )
        ReshardPlan.from_json(plan.to_json())  # valid on the wire: disjoint ranges


@pytest.fixture(params=["memory", "redis"])
def shard_maps(request: pytest.FixtureRequest) -> Iterator[tuple[ShardMapStore, Any]]:
    """A fresh shard map store of each kind and how to run its coroutines (one event loop for
    the test: a Redis store's connections belong to the loop that opened them)."""
    with asyncio.Runner() as runner:
        if request.param == "memory":
            yield MemoryShardMaps(), runner.run
            return
        from kvsp.stores.redis_shardmaps import RedisShardMaps

        store = RedisShardMaps.from_url(request.getfixturevalue("redis_url"))
        try:
            yield store, runner.run
        finally:
            runner.run(store.aclose())


def test_store_compare_and_set(shard_maps: tuple[ShardMapStore, Any]) -> None:
    store, run_here = shard_maps
    run_here(_store(store))


async def _store(store: ShardMapStore) -> None:
    v1 = _map(1, (A, 0, 10))
    assert await store.create(v1) and not await store.create(v1)
    assert await store.get("nope", 0) is None
    assert await store.begin(_map(3, (B, 0, 10)), "x", 100, 0) is BeginOutcome.STALE
    assert (
        await store.begin(
            _map(2, (B, 0, 10)).__class__(map="nope", version=2, shards=v1.shards), "x", 100, 0
        )
        is BeginOutcome.UNKNOWN
    )
    assert await store.begin(_map(2, (B, 0, 10)), "x", 100, 0) is BeginOutcome.STARTED
    assert await store.begin(_map(2, (C, 0, 10)), "y", 200, 50) is BeginOutcome.BUSY
    state = await store.get(MAP, 50)
    assert state is not None and state.current == v1 and state.pending is not None
    assert not await store.commit(MAP, 2, "y") and not await store.abort(MAP, 3, "x")
    # Past its expiry the pending version no longer blocks; the old attempt cannot commit.
    assert await store.begin(_map(2, (C, 0, 10)), "y", 300, 100) is BeginOutcome.STARTED
    assert not await store.commit(MAP, 2, "x")
    assert await store.abort(MAP, 2, "y")
    assert (await store.get(MAP, 100)) == type(state)(current=v1, pending=None)
    assert await store.begin(_map(2, (B, 0, 10)), "z", 400, 100) is BeginOutcome.STARTED
    assert await store.commit(MAP, 2, "z")
    now = await store.get(MAP, 100)
    assert now is not None and now.current.version == 2 and now.pending is None
