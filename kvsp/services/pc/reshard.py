"""Shard maps and resharding at the PC (spec §6.9; DESIGN.md §3 resource table: ``POST
shardmaps``, ``POST shardmaps/{map}/versions``).

:func:`~kvsp.reshard.plan_reshard` computes the per-instance plans from versions v and v+1;
:class:`ShardCoordinator` runs the two phases over a
:class:`~kvsp.stores.shardmaps.ShardMapStore` and :class:`ReshardPeers`;
:func:`reshard_routes` is its HTTP face (roles ``pc`` and ``admin``):

======  ==============================  ==================================================
POST    ``shardmaps``                   ``{"map"?, "version"?: 1, "shards"}`` → 201, the map,
                                        ``Location: shardmaps/{map}``; 409 when the name is
                                        taken
GET     ``shardmaps/{map}``             → 200 the current (authoritative) version, plus
                                        ``"pending": v+1`` while a change is in flight
POST    ``shardmaps/{map}/versions``    ``{"from": v, "shards", "deadline_ms"?}`` → 200 the
                                        committed version v+1, or a problem (below)
======  ==============================  ==================================================

Choices the spec leaves open:

* **Creating a map** registers version 1 as it is: the PC moves no data, the instances already
  hold their ranges (their engines computed them, or they were loaded with ``PUT shards/…``).
  The client may name the map (URL-unreserved, 1–128 characters); without ``map`` the PC names
  it (32 hex digits). ``version`` may be omitted; any value but 1 is refused. Instance bases
  must end in ``/``.
* **A new version** names the version it moves from (``from``, compare-and-set): a ``from``
  that is not current, or a change already in flight, answers 409 ``kvsp-conflict``; an
  unknown map 404. Version v+1 must cover exactly the tokens of version v (a reshard moves KV,
  it creates none), else 400. ``deadline_ms`` defaults to :attr:`ReshardConfig.deadline_ms`.
* **Plans.** A range on the same instance in both versions is in its ``retain``; a range
  newly assigned is in its ``fetch``, split at the shard boundaries of version v, each piece
  from its owner at v; a range no longer assigned is in its ``release``. Every instance of
  either version gets its plan, all concurrently.
* **Abort answer.** When a member does not acknowledge within ``deadline_ms``, or fails, the
  PC aborts (store first, then ``{"map", "abort"}`` to every member) and answers
  ``kvsp-reshard-aborted``: 504 when a member did not answer in time, else 502; the problem
  carries ``"version"`` (still v) and ``"failed": [{"instance", "detail", "status"?}]``.
  Version v stays authoritative throughout; a GET during the change returns v.
* **Commit delivery** is retried (:attr:`ReshardConfig.commit_attempts`); the committed map is
  answered either way, with ``"unconfirmed": [instance, ...]`` naming members that never
  confirmed the commit.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from kvsp.errors import (
    Conflict,
    KVSPError,
    NotFound,
    ReshardAborted,
    ReshardTimedOut,
    TransportError,
)
from kvsp.records_common import read_name
from kvsp.records_shard import (
    ReshardAbort,
    ReshardCommit,
    ReshardMessage,
    ReshardPlan,
    ShardMap,
)
from kvsp.reshard import MAX_DEADLINE_MS, VersionRequest, plan_reshard, read_new_map
from kvsp.stores.shardmaps import BeginOutcome, MemoryShardMaps, ShardMapStore
from kvsp.web.auth import principal_of
from kvsp.web.client import BaseClient
from kvsp.web.clock import Clock
from kvsp.web.http import read_json
from kvsp.web.problems import kvsp_json

BODY_LIMIT = 16 << 20
"""Octets of a shard map body (65,536 shards with long URIs fit)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReshardConfig:
    """How the PC runs a version change."""

    deadline_ms: int = 10_000
    """``deadline_ms`` of plans when the request names none."""
    message_timeout_s: float = 5.0
    """How long a commit or abort message may take to be answered."""
    commit_attempts: int = 3
    """Tries per member to deliver a commit."""
    pending_grace_ms: int = 30_000
    """How long past ``deadline_ms`` a pending version blocks other changes (a PC that died
    mid-change holds the map no longer)."""


# --- the coordinator ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class MemberFailure:
    """A member that did not acknowledge a plan: why, and the status it answered if any."""

    instance: str
    detail: str
    status: int | None = None

    def to_json(self) -> dict[str, Any]:
        """Render as JSON."""
        body: dict[str, Any] = {"instance": self.instance, "detail": self.detail}
        if self.status is not None:
            body["status"] = self.status
        return body


class ReshardPeers(Protocol):
    """How the PC sends POST reshard to an instance; anything but 200 raises."""

    async def reshard(self, instance: str, message: ReshardMessage) -> None:
        """POST ``message`` to ``{instance}reshard`` and wait for its 200.

        Raises:
            KVSPError: the instance answered an error or could not be reached.
        """
        ...


class _ReshardClient(BaseClient):
    async def send(self, message: ReshardMessage) -> None:
        await self._request("POST", "reshard", message.to_json())


class HttpReshardPeers:
    """:class:`ReshardPeers` over HTTP with the PC's bearer token. Without a shared ``client``,
    each message opens its own connection (version changes are rare)."""

    def __init__(
        self,
        token: str | None,
        *,
        client: httpx.AsyncClient | None = None,
        timeout: float = MAX_DEADLINE_MS / 1000,
    ) -> None:
        self._token = token
        self._client = client
        self.timeout = timeout

    async def reshard(self, instance: str, message: ReshardMessage) -> None:
        """POST ``message`` to ``{instance}reshard``.

        Raises:
            KVSPError: the answer's problem, or TransportError.
        """
        if self._client is not None:
            await _ReshardClient(instance, self._token, client=self._client).send(message)
            return
        async with _ReshardClient(instance, self._token, timeout=self.timeout) as peer:
            await peer.send(message)


def _failure(instance: str, exc: BaseException) -> MemberFailure:
    if isinstance(exc, KVSPError):
        status = (
            None if isinstance(exc, TransportError) else getattr(exc, "remote_status", exc.status)
        )
        return MemberFailure(instance=instance, detail=str(exc), status=status)
    return MemberFailure(instance=instance, detail=f"{type(exc).__name__}: {exc}")


class ShardCoordinator:
    """Creates shard maps and moves them between versions (§6.9)."""

    def __init__(
        self,
        store: ShardMapStore,
        peers: ReshardPeers,
        clock: Clock,
        config: ReshardConfig | None = None,
    ) -> None:
        self.store = store
        self.peers = peers
        self.clock = clock
        self.config = config or ReshardConfig()

    async def create(self, shard_map: ShardMap) -> ShardMap:
        """Register version 1 of a new map.

        Raises:
            Conflict: the name is taken.
        """
        if not await self.store.create(shard_map):
            raise Conflict(f"shard map {shard_map.map!r} exists")
        return shard_map

    async def get(self, map_name: str) -> tuple[ShardMap, int | None]:
        """The current version and the pending version number, if any.

        Raises:
            NotFound: no such map.
        """
        state = await self.store.get(map_name, self.clock.now_ms())
        if state is None:
            raise NotFound(f"no shard map {map_name!r}")
        pending = None if state.pending is None else state.pending.shard_map.version
        return state.current, pending

    async def change(self, map_name: str, request: VersionRequest) -> tuple[ShardMap, list[str]]:
        """Move ``map_name`` from ``request.from_version`` to the next version (§6.9): the
        committed map and the members that did not confirm the commit.

        Raises:
            NotFound: no such map.
            Conflict: ``from`` is not the current version, or another change is in flight.
            BadRequest: the new version covers other tokens.
            ReshardAborted: a member failed (ReshardTimedOut: did not answer in time).
        """
        now = self.clock.now_ms()
        state = await self.store.get(map_name, now)
        if state is None:
            raise NotFound(f"no shard map {map_name!r}")
        current = state.current
        if current.version != request.from_version:
            raise Conflict(
                f"map {map_name!r} is at version {current.version}, not {request.from_version}",
                path="$.from",
            )
        proposed = ShardMap(map=map_name, version=current.version + 1, shards=request.shards)
        deadline = request.deadline_ms or self.config.deadline_ms
        # Off the event loop: a map of 65,536 shards takes a while to plan.
        plans = await asyncio.to_thread(plan_reshard, current, proposed, deadline)
        attempt = uuid.uuid4().hex
        expires = now + deadline + self.config.pending_grace_ms
        await self._begin(proposed, attempt, expires, now)
        failures, late = await self._collect_acks(plans, deadline)
        if failures:
            await self._abort(proposed, attempt, list(plans))
            cls = ReshardTimedOut if late else ReshardAborted
            names = ", ".join(f.instance for f in failures)
            raise cls(
                f"version {proposed.version} aborted, not acknowledged by {names}",
                version=current.version,
                failed=failures,
            )
        if not await self.store.commit(map_name, proposed.version, attempt):
            raise Conflict(
                f"version {proposed.version} of map {map_name!r} was taken over by another change"
            )
        return proposed, await self._deliver_commit(proposed, list(plans))

    async def _begin(self, proposed: ShardMap, attempt: str, expires: int, now: int) -> None:
        outcome = await self.store.begin(proposed, attempt, expires, now)
        if outcome is BeginOutcome.UNKNOWN:
            raise NotFound(f"no shard map {proposed.map!r}")
        if outcome is BeginOutcome.STALE:
            raise Conflict(
                f"map {proposed.map!r} moved past version {proposed.version - 1}", path="$.from"
            )
        if outcome is BeginOutcome.BUSY:
            raise Conflict(f"a change of map {proposed.map!r} is already in flight")

    async def _collect_acks(
        self, plans: dict[str, ReshardPlan], deadline_ms: int
    ) -> tuple[list[MemberFailure], bool]:
        """Send every plan at once and wait for the 200s: the members that failed (a failed
        answer ends the wait at once) and whether the failure is silence at the deadline."""
        tasks = {asyncio.create_task(self.peers.reshard(i, p)): i for i, p in plans.items()}
        done, silent = await asyncio.wait(
            tasks, timeout=deadline_ms / 1000, return_when=asyncio.FIRST_EXCEPTION
        )
        for task in silent:
            task.cancel()
        await asyncio.gather(*silent, return_exceptions=True)
        failures = []
        for task in done:
            exc = task.exception()
            if exc is not None:
                failures.append(_failure(tasks[task], exc))
        if failures:
            return sorted(failures, key=lambda f: f.instance), False
        # §6.9: "If any instance fails to acknowledge within deadline_ms" the PC aborts.
        note = f"no acknowledgement within deadline_ms ({deadline_ms} ms)"
        late = [MemberFailure(instance=tasks[t], detail=note) for t in silent]
        return sorted(late, key=lambda f: f.instance), bool(late)

    async def _send_all(self, instances: Sequence[str], message: ReshardMessage) -> list[str]:
        async def one(instance: str) -> bool:
            try:
                async with asyncio.timeout(self.config.message_timeout_s):
                    await self.peers.reshard(instance, message)
            except (KVSPError, TimeoutError):
                return False
            return True

        results = await asyncio.gather(*(one(i) for i in instances))
        return [i for i, ok in zip(instances, results, strict=True) if not ok]

    async def _abort(self, proposed: ShardMap, attempt: str, instances: Sequence[str]) -> None:
        # The store first: from here on no commit of this attempt can happen.
        if await self.store.abort(proposed.map, proposed.version, attempt):
            await self._send_all(instances, ReshardAbort(map=proposed.map, abort=proposed.version))

    async def _deliver_commit(self, proposed: ShardMap, instances: Sequence[str]) -> list[str]:
        message = ReshardCommit(map=proposed.map, commit=proposed.version)
        left = list(instances)
        for _ in range(self.config.commit_attempts):
            left = await self._send_all(left, message)
            if not left:
                break
        return left


def coordinator_for(
    token: str | None,
    clock: Clock,
    *,
    store: ShardMapStore | None = None,
    config: ReshardConfig | None = None,
) -> ShardCoordinator:
    """A coordinator of a PC that calls instances with ``token`` (its
    ``--directive-token-file``), over ``store`` (in memory by default)."""
    return ShardCoordinator(store or MemoryShardMaps(), HttpReshardPeers(token), clock, config)


# --- HTTP --------------------------------------------------------------------------------------


def _map_json(shard_map: ShardMap, pending: int | None = None) -> dict[str, Any]:
    body = shard_map.to_json()
    if pending is not None:
        body["pending"] = pending
    return body


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


class _Endpoints:
    def __init__(self, coordinator: ShardCoordinator) -> None:
        self.coordinator = coordinator

    async def post_map(self, request: Request) -> Response:
        principal_of(request)  # role pc: kvsp.web.roles
        shard_map = await self.coordinator.create(
            read_new_map(await read_json(request, BODY_LIMIT), default_name=uuid.uuid4().hex)
        )
        headers = {"location": f"shardmaps/{shard_map.map}"}
        return kvsp_json(_map_json(shard_map), status=201, headers=headers)

    async def get_map(self, request: Request) -> Response:
        principal_of(request)  # role pc: kvsp.web.roles
        name = read_name(request.path_params["map"], "map")
        current, pending = await self.coordinator.get(name)
        return kvsp_json(_map_json(current, pending))

    async def post_version(self, request: Request) -> Response:
        principal_of(request)  # role pc: kvsp.web.roles
        name = read_name(request.path_params["map"], "map")
        body = VersionRequest.from_json(await read_json(request, BODY_LIMIT), name)
        # Both phases run to their end even if the caller goes away meanwhile.
        change = asyncio.create_task(self.coordinator.change(name, body))
        change.add_done_callback(_retrieve)
        committed, unconfirmed = await asyncio.shield(change)
        answer = _map_json(committed)
        if unconfirmed:
            answer["unconfirmed"] = unconfirmed
        return kvsp_json(answer)


def reshard_routes(coordinator: ShardCoordinator) -> list[BaseRoute]:
    """The PC's shard map routes over ``coordinator``."""
    ep = _Endpoints(coordinator)
    return [
        Route("/shardmaps", ep.post_map, methods=["POST"]),
        Route("/shardmaps/{map}", ep.get_map, methods=["GET"]),
        Route("/shardmaps/{map}/versions", ep.post_version, methods=["POST"]),
    ]


__all__ = [
    "HttpReshardPeers",
    "MemberFailure",
    "ReshardConfig",
    "ReshardPeers",
    "ShardCoordinator",
    "coordinator_for",
    "reshard_routes",
]
