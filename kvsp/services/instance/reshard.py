"""The instance's side of resharding (spec §6.9): its shards of sequence-sharded contexts, ``POST
reshard`` (plan, commit, abort), and the range resource peers fetch from.

:class:`ShardHolder` keeps, per map, the version the instance holds and its ranges
(:class:`~kvsp.engine.shards.ShardSet`), plus at most one *pending* plan whose fetched ranges
live apart until commit. Routes (relative to the instance's base URL):

======  ================================  ==================================================
POST    ``reshard``                       §6.9 plan → 200 once every ``fetch`` range is loaded;
                                          ``{"map", "commit"|"abort"}`` → 200 (role ``pc``)
GET     ``shards/{map}/{start}-{end}``    ``?version=v`` → 200 ``application/kvsp-block``, the
                                          KV of ``[start, end)`` (roles instance, pc)
PUT     ``shards/{map}/{start}-{end}``    ``?version=v``, the same container: load a range of
                                          version v → 204 (roles instance, pc)
GET     ``shards``                        held ranges and counters (roles instance, pc)
======  ================================  ==================================================

Choices the spec leaves open:

* **Range resource.** A range travels as one KVB1 container (§4.3, codec raw, layers ``0..L-1``,
  ``Token Count`` = the range's length, layout ``kvsp-layout-1``) with ``Repr-Digest``; the
  fetching instance MUST find the digest equal to the SHA-256 of the body and the container of
  its own geometry, or the fetch fails. ``version`` is required: a source serves only ranges of
  the version it holds as current (409 for another version, 404 for tokens it does not hold), so
  a fetch for v+1 always reads version v. Long ranges are fetched in chunks of at most
  ``chunk_bytes`` each (any sub-range of a held range is a valid resource).
* **Plans** are checked before anything moves (:func:`~kvsp.reshard.check_plan`): an instance
  that holds ranges of the map must hold version ``from`` (else 409), every ``retain`` and
  ``release`` range must be held, and together they must account for all it holds (else 409: the
  PC's view differs). An instance holding nothing of the map joins with empty
  ``retain``/``release``. Fetches are idempotent: the same plan again waits for the same loads,
  and a new plan for the map (a retry after a lost abort) keeps the ranges already fetched that
  it lists again and drops the others. The instance stops loading at ``deadline_ms`` and answers
  504; a failed fetch answers 502 (``kvsp-upstream-error``, naming the source and range).
* **Commit** makes ``retain`` (the same pages, sliced, never copied) plus the fetched ranges the
  current ranges, and drops everything else (``release``). Committing the version already held
  answers 200 again. **Abort** cancels loads and discards what was fetched for that version;
  aborting a version with nothing pending answers 200 (the PC aborts every member, including
  those its plan never reached), aborting a committed version 409.
* **Version 1** of a map reaches the instance from its engine (a prefill split by ranges,
  :func:`~kvsp.engine.shards.pages_from_paged_cache`) through :meth:`ShardHolder.load`, or over
  ``PUT shards/...``.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from kvsp.audience import AudienceSigner
from kvsp.container import ContainerLimits, Geometry, decode_container, header_size
from kvsp.engine.shards import (
    DEFAULT_PAGE_TOKENS,
    KVArray,
    ShardLayoutError,
    ShardSet,
    TokenPages,
    container_parts,
    distinct_page_bytes,
    parse_token_range,
    range_path,
    token_bytes,
)
from kvsp.errors import (
    BadRequest,
    Conflict,
    DigestMismatch,
    Incompatible,
    KVSPError,
    NotFound,
    RangeFetchFailed,
    RangeFetchTimedOut,
    TransportError,
)
from kvsp.records_common import TokenRange, read_name
from kvsp.records_shard import ReshardAbort, ReshardCommit, ReshardPlan, parse_reshard_message
from kvsp.reshard import PendingState, check_plan, move_pending
from kvsp.transfer.bulk import BulkClient
from kvsp.transfer.http11 import Buffer, BytesBody
from kvsp.web.auth import principal_of
from kvsp.web.client import problem_error
from kvsp.web.http import parse_repr_digest, read_body, read_json, repr_digest
from kvsp.web.problems import PROBLEM_JSON, kvsp_json
from kvsp.web.responses import PartsResponse

BLOCK_MEDIA_TYPE = "application/kvsp-block"
PLAN_LIMIT = 16 << 20
"""Octets of a POST reshard body."""
DEFAULT_BODY_LIMIT = 1 << 30
"""Octets of a PUT range body."""
DEFAULT_CHUNK_BYTES = 64 << 20
"""Most octets one range GET asks for; longer ranges are fetched in several."""
FETCH_TIMEOUT_S = 60.0
LOG_ENTRIES = 4096


@dataclass(slots=True, eq=False)
class _Pending:
    plan: ReshardPlan
    fetched: dict[TokenRange, TokenPages] = field(default_factory=dict)
    state: PendingState = PendingState.FETCHING
    task: asyncio.Task[None] | None = None

    def move(self, to: PendingState) -> None:
        self.state = move_pending(self.state, to)

    def stop(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()


@dataclass(slots=True, eq=False)
class _MapState:
    version: int | None = None
    shards: ShardSet = field(default_factory=ShardSet)
    pending: _Pending | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RangeTransfer:
    """One range moved: ``bytes`` of tokens ``tokens`` of ``map``, for ``version`` (the
    version being moved to when fetched, the version read when served), and its peer."""

    map: str
    version: int
    tokens: TokenRange
    peer: str | None
    bytes: int

    def to_json(self) -> dict[str, Any]:
        """Render as JSON."""
        body: dict[str, Any] = {
            "map": self.map,
            "version": self.version,
            "tokens": list(self.tokens),
            "bytes": self.bytes,
        }
        if self.peer is not None:
            body["from"] = self.peer
        return body


class RangeFetcher(Protocol):
    """How an instance loads a range of version ``version`` from a peer."""

    async def fetch(
        self, source: str, map_name: str, version: int, tokens: TokenRange, into: TokenPages
    ) -> int:
        """Load tokens ``tokens`` into ``into`` (verified); returns the KV octets received.

        Raises:
            KVSPError: the source refused, could not be reached, or sent bad data.
        """
        ...


class ShardHolder:
    """The shards one instance holds, per map, and its part of §6.9's two phases."""

    def __init__(
        self,
        geometry: Geometry,
        *,
        page_tokens: int = DEFAULT_PAGE_TOKENS,
        fetch_concurrency: int = 4,
    ) -> None:
        self.geometry = geometry
        self.page_tokens = page_tokens
        self.fetch_concurrency = fetch_concurrency
        self._maps: dict[str, _MapState] = {}
        self.fetched: deque[RangeTransfer] = deque(maxlen=LOG_ENTRIES)
        self.served: deque[RangeTransfer] = deque(maxlen=LOG_ENTRIES)
        self.fetched_bytes = 0
        self.served_bytes = 0
        self.committed = 0
        self.aborted = 0

    # -- holding --------------------------------------------------------------------------------

    def load(self, map_name: str, version: int, start: int, kv: KVArray | TokenPages) -> None:
        """Hold tokens ``[start, …)`` of version ``version`` of ``map_name`` (a range array is
        copied into pages; pages are taken as they are).

        Raises:
            Conflict: the instance holds another version, a plan is pending, or the range
                overlaps one held.
            ShardLayoutError: an array not of this geometry.
        """
        state = self._maps.get(map_name) or _MapState()
        if len(state.shards) and state.version != version:
            raise Conflict(f"holds version {state.version} of map {map_name!r}, not {version}")
        if state.pending is not None:
            raise Conflict(f"a reshard of map {map_name!r} is in progress")
        if isinstance(kv, TokenPages):
            pages = kv
        else:
            pages = TokenPages.from_array(start, kv, self.geometry, self.page_tokens)
        try:
            state.shards.add(pages)
        except ShardLayoutError as exc:
            raise Conflict(str(exc)) from None
        state.version = version
        self._maps[map_name] = state

    def version(self, map_name: str) -> int | None:
        """The version of ``map_name`` held (``None`` when it holds no range of it)."""
        state = self._maps.get(map_name)
        return state.version if state is not None and len(state.shards) else None

    def shard_set(self, map_name: str) -> ShardSet:
        """The ranges held of ``map_name`` at its current version (empty when none)."""
        state = self._maps.get(map_name)
        return state.shards if state is not None else ShardSet()

    def read(self, map_name: str, version: int, a: int, b: int) -> KVArray:
        """The KV of tokens ``[a, b)`` of the current ``version`` (a new array).

        Raises:
            NotFound: no range of the map is held, or not all of ``[a, b)``.
            Conflict: the instance holds another version.
        """
        state = self._maps.get(map_name)
        if state is None or not len(state.shards):
            raise NotFound(f"holds no range of map {map_name!r}")
        if state.version != version:
            raise Conflict(f"holds version {state.version} of map {map_name!r}, not {version}")
        kv = state.shards.read(a, b)
        self._log_served(
            RangeTransfer(map=map_name, version=version, tokens=(a, b), peer=None, bytes=kv.nbytes)
        )
        return kv

    def _log_served(self, transfer: RangeTransfer) -> None:
        self.served.append(transfer)
        self.served_bytes += transfer.bytes

    @property
    def held_bytes(self) -> int:
        """Octets of the pages held: current ranges and pending fetched ones."""
        pieces: list[TokenPages] = []
        for state in self._maps.values():
            pieces += state.shards.pieces
            if state.pending is not None:
                pieces += state.pending.fetched.values()
        return distinct_page_bytes(pieces)

    # -- §6.9 plan ------------------------------------------------------------------------------

    async def apply_plan(self, plan: ReshardPlan, fetcher: RangeFetcher) -> dict[str, Any]:
        """Check ``plan``, load its ``fetch`` ranges and answer the acknowledgement body.

        Raises:
            Conflict: the plan does not match what the instance holds, or it was aborted or
                replaced while loading.
            RangeFetchFailed: a range could not be loaded (RangeFetchTimedOut: not in time).
        """
        state = self._maps.get(plan.map) or _MapState()
        check_plan(plan, state.version, state.shards.ranges())
        self._maps[plan.map] = state
        pending = self._pending_for(state, plan)
        if pending.task is None or pending.state is PendingState.FAILED:
            if pending.state is PendingState.FAILED:
                pending.move(PendingState.FETCHING)
            pending.task = asyncio.create_task(self._load(pending, fetcher))
            # Read the outcome even when no request awaits it any more (the PC went away).
            pending.task.add_done_callback(_retrieve)
        task = pending.task
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and (current is None or not current.cancelling()):
                raise Conflict(f"plan to version {plan.to_version} aborted or replaced") from None
            raise
        moved = sum(p.nbytes for p in pending.fetched.values())
        return {"map": plan.map, "ready": plan.to_version, "fetched_bytes": moved}

    def _pending_for(self, state: _MapState, plan: ReshardPlan) -> _Pending:
        old = state.pending
        if old is not None and old.plan == plan:
            return old
        fresh = _Pending(plan=plan)
        if old is not None:
            old.stop()
            wanted = {entry.tokens for entry in plan.fetch}
            fresh.fetched = {r: p for r, p in old.fetched.items() if r in wanted}
        state.pending = fresh
        return fresh

    async def _load(self, pending: _Pending, fetcher: RangeFetcher) -> None:
        plan = pending.plan
        try:
            async with asyncio.timeout(plan.deadline_ms / 1000):
                await self._load_all(pending, fetcher)
        except TimeoutError:
            pending.move(PendingState.FAILED)
            missing = [list(e.tokens) for e in plan.fetch if e.tokens not in pending.fetched]
            raise RangeFetchTimedOut(
                f"ranges {missing} of map {plan.map!r} not loaded within {plan.deadline_ms} ms"
            ) from None
        except KVSPError:
            pending.move(PendingState.FAILED)
            raise
        pending.move(PendingState.READY)

    async def _load_all(self, pending: _Pending, fetcher: RangeFetcher) -> None:
        slots = asyncio.Semaphore(self.fetch_concurrency)
        try:
            async with asyncio.TaskGroup() as group:
                for entry in pending.plan.fetch:
                    if entry.tokens not in pending.fetched:
                        group.create_task(
                            self._load_one(pending, entry.source, entry.tokens, fetcher, slots)
                        )
        except BaseExceptionGroup as failures:  # the children raise plain exceptions
            errors: list[BaseException] = list(failures.exceptions)
            found = [e for e in errors if isinstance(e, KVSPError)]
            raise (found[0] if found else errors[0]) from None

    async def _load_one(
        self,
        pending: _Pending,
        source: str,
        tokens: TokenRange,
        fetcher: RangeFetcher,
        slots: asyncio.Semaphore,
    ) -> None:
        plan = pending.plan
        async with slots:
            pages = TokenPages.allocate(*tokens, self.geometry, self.page_tokens)
            try:
                received = await fetcher.fetch(source, plan.map, plan.from_version, tokens, pages)
            except KVSPError as exc:
                raise RangeFetchFailed(
                    f"fetching [{tokens[0]}, {tokens[1]}) of map {plan.map!r} from {source}: {exc}"
                ) from exc
        pending.fetched[tokens] = pages
        self.fetched.append(
            RangeTransfer(
                map=plan.map, version=plan.to_version, tokens=tokens, peer=source, bytes=received
            )
        )
        self.fetched_bytes += received

    # -- §6.9 commit and abort -----------------------------------------------------------------

    def commit(self, message: ReshardCommit) -> dict[str, Any]:
        """Make the pending version current: retained pages plus fetched ones; the rest is
        released.

        Raises:
            Conflict: no loaded plan to that version.
        """
        state = self._maps.get(message.map)
        pending = state.pending if state is not None else None
        if pending is None or pending.plan.to_version != message.commit:
            if state is not None and state.version == message.commit:
                return self._commit_answer(message.map, state)  # already committed
            raise Conflict(f"no plan to version {message.commit} of map {message.map!r}")
        if state is None or pending.state is not PendingState.READY:
            raise Conflict(f"plan to version {message.commit} is {pending.state.value}, not loaded")
        kept = [piece for a, b in pending.plan.retain for piece in state.shards.slice(a, b)]
        state.shards = ShardSet([*kept, *pending.fetched.values()])
        state.version = message.commit
        state.pending = None
        self.committed += 1
        return self._commit_answer(message.map, state)

    @staticmethod
    def _commit_answer(map_name: str, state: _MapState) -> dict[str, Any]:
        ranges = [list(r) for r in state.shards.ranges()]
        return {"map": map_name, "version": state.version, "ranges": ranges}

    def abort(self, message: ReshardAbort) -> dict[str, Any]:
        """Discard what was fetched for the aborted version; the current one stays.

        Raises:
            Conflict: that version was already committed here.
        """
        state = self._maps.get(message.map)
        if state is not None and state.version is not None and state.version >= message.abort:
            raise Conflict(f"version {message.abort} of map {message.map!r} is already committed")
        pending = state.pending if state is not None else None
        discarded = 0
        if state is not None and pending is not None and pending.plan.to_version == message.abort:
            before = self.held_bytes
            pending.stop()
            state.pending = None
            discarded = before - self.held_bytes
            self.aborted += 1
            if not len(state.shards):
                del self._maps[message.map]
        return {"map": message.map, "aborted": message.abort, "discarded_bytes": discarded}

    # -- counters -------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The held ranges per map, the pending plans, and the transfer counters."""
        return {
            "maps": [_map_status(name, state) for name, state in sorted(self._maps.items())],
            "held_bytes": self.held_bytes,
            "fetched_bytes": self.fetched_bytes,
            "served_bytes": self.served_bytes,
            "committed": self.committed,
            "aborted": self.aborted,
            "fetched": [t.to_json() for t in self.fetched],
            "served": [t.to_json() for t in self.served],
        }


def _map_status(name: str, state: _MapState) -> dict[str, Any]:
    pending = state.pending
    return {
        "map": name,
        "version": state.version if len(state.shards) else None,
        "ranges": [list(r) for r in state.shards.ranges()],
        "bytes": state.shards.nbytes,
        "pending": None
        if pending is None
        else {
            "to": pending.plan.to_version,
            "state": pending.state.value,
            "fetched": [list(r) for r in sorted(pending.fetched)],
            "bytes": distinct_page_bytes(pending.fetched.values()),
        },
    }


def _retrieve(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()


# --- the range resource over HTTP --------------------------------------------------------------


def _version_param(request: Request) -> int:
    text = request.query_params.get("version")
    if text is None or not text.isascii() or not text.isdigit() or len(text) > 19:
        raise BadRequest("query parameter 'version' needs a decimal integer", path="version")
    return int(text)


class HttpRangeFetcher:
    """:class:`RangeFetcher` over HTTP with the instance's audience credentials: ``GET
    {source}shards/{map}/{a}-{b}?version=v``, Repr-Digest and geometry verified, in chunks of
    at most ``chunk_bytes``.

    Bodies come over the bulk client (:class:`~kvsp.transfer.bulk.BulkClient`, DESIGN §7: the
    client is the bottleneck, so it is chosen by measurement), a shared one or one per range;
    ``client`` sends through an httpx client instead (in-process tests route it to ASGI apps).
    """

    def __init__(
        self,
        token: str | None,
        geometry: Geometry,
        *,
        client: httpx.AsyncClient | None = None,
        bulk: BulkClient | None = None,
        timeout: float = FETCH_TIMEOUT_S,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        self._accept = {"accept": f"{BLOCK_MEDIA_TYPE}, {PROBLEM_JSON}"}
        self._signer = AudienceSigner(token)  # peers get credentials, never the token
        self.geometry = geometry
        self._client = client
        self._bulk = bulk
        self.timeout = timeout
        self.chunk_tokens = max(1, chunk_bytes // token_bytes(geometry))
        self._limit = self.chunk_tokens * token_bytes(geometry) + header_size(geometry.layers)

    async def fetch(
        self, source: str, map_name: str, version: int, tokens: TokenRange, into: TokenPages
    ) -> int:
        """Load ``tokens`` of ``version`` from ``source`` into ``into``; returns the KV octets
        received (container headers not counted).

        Raises:
            TransportError: the source could not be reached.
            DigestMismatch: no Repr-Digest, or the body does not match it.
            ContainerError, Incompatible: not a container of this geometry and range.
            KVSPError: the problem the source answered (NotFound, Conflict, ...).
        """
        if self._client is not None or self._bulk is not None:
            return await self._fetch(source, map_name, version, tokens, into, self._bulk)
        async with BulkClient(timeout=self.timeout) as bulk:
            return await self._fetch(source, map_name, version, tokens, into, bulk)

    async def _fetch(
        self,
        source: str,
        map_name: str,
        version: int,
        tokens: TokenRange,
        into: TokenPages,
        bulk: BulkClient | None,
    ) -> int:
        base = source if source.endswith("/") else source + "/"
        received = 0
        for a in range(tokens[0], tokens[1], self.chunk_tokens):
            b = min(tokens[1], a + self.chunk_tokens)
            url = base + range_path(map_name, (a, b), version)
            digest, body = await (self._get_bulk(bulk, url) if bulk else self._get_httpx(url))
            await self._verify_into(digest, body, (a, b), into)
            received += (b - a) * token_bytes(self.geometry)
        return received

    def _headers(self, url: str) -> dict[str, str]:
        authorization = self._signer.authorization(url)
        if authorization is None:
            return self._accept
        return {**self._accept, "authorization": authorization}

    async def _get_bulk(self, bulk: BulkClient, url: str) -> tuple[str | None, Buffer]:
        consumer = BytesBody.factory(self._limit)
        sent = self._headers(url)
        response = await bulk.request("GET", url, headers=sent, consumer=consumer)
        data = response.body.data if isinstance(response.body, BytesBody) else b""
        if response.status != 200:
            headers = list(response.head.headers)
            raise problem_error(
                httpx.Response(response.status, headers=headers, content=bytes(data))
            )
        return response.head.get("repr-digest"), data

    async def _get_httpx(self, url: str) -> tuple[str | None, Buffer]:
        if self._client is None:
            raise TransportError(f"GET {url}: no client")
        try:
            response = await self._client.get(url, headers=self._headers(url))
        except httpx.HTTPError as exc:
            raise TransportError(f"GET {url}: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise problem_error(response)
        return response.headers.get("repr-digest"), response.content

    async def _verify_into(
        self, digest: str | None, body: Buffer, tokens: TokenRange, into: TokenPages
    ) -> None:
        try:
            expected = parse_repr_digest(digest)
        except BadRequest as exc:
            raise DigestMismatch(f"malformed Repr-Digest: {exc}") from exc
        if expected is None:
            raise DigestMismatch("the source sent no Repr-Digest (sha-256)")
        got = await asyncio.to_thread(lambda: hashlib.sha256(body).digest())
        if got != expected:  # MUST: a range is taken only as the source digested it
            raise DigestMismatch("the range's octets do not match its Repr-Digest")
        limits = ContainerLimits(max_total_bytes=len(body))
        container = decode_container(body, self.geometry, limits=limits)
        if container.token_count != tokens[1] - tokens[0]:
            raise Incompatible(
                f"{container.token_count} tokens sent for [{tokens[0]}, {tokens[1]})"
            )
        into.write_container(tokens[0], container)


class _ReshardEndpoints:
    def __init__(self, holder: ShardHolder, fetcher: RangeFetcher, body_limit: int) -> None:
        self.holder = holder
        self.fetcher = fetcher
        self.body_limit = body_limit

    async def post_reshard(self, request: Request) -> Response:
        principal_of(request)  # role pc: kvsp.web.roles
        message = parse_reshard_message(await read_json(request, PLAN_LIMIT))
        if isinstance(message, ReshardPlan):
            return kvsp_json(await self.holder.apply_plan(message, self.fetcher))
        if isinstance(message, ReshardCommit):
            return kvsp_json(self.holder.commit(message))
        return kvsp_json(self.holder.abort(message))

    def _target(self, request: Request) -> tuple[str, TokenRange, int]:
        principal_of(request)  # roles instance, pc: kvsp.web.roles
        name = read_name(request.path_params["map"], "map")
        return name, parse_token_range(request.path_params["tokens"]), _version_param(request)

    async def get_range(self, request: Request) -> Response:
        name, (a, b), version = self._target(request)
        parts = container_parts(self.holder.read(name, version, a, b), self.holder.geometry)
        digest = hashlib.sha256()
        for part in parts:
            digest.update(part)
        headers = {
            "content-length": str(sum(len(memoryview(p)) for p in parts)),
            "repr-digest": repr_digest(digest.digest()),
            "cache-control": "no-store",
        }
        return PartsResponse(parts, headers=headers, media_type=BLOCK_MEDIA_TYPE)

    async def put_range(self, request: Request) -> Response:
        name, (a, b), version = self._target(request)
        body = await read_body(request, self.body_limit)
        expected = parse_repr_digest(request.headers.get("repr-digest"))
        if expected is not None and hashlib.sha256(body).digest() != expected:
            raise DigestMismatch("the body does not match its Repr-Digest")
        limits = ContainerLimits(max_total_bytes=self.body_limit)
        container = decode_container(body, self.holder.geometry, limits=limits)
        if container.token_count != b - a:
            raise BadRequest(
                f"{container.token_count} tokens in the body for [{a}, {b})", path="tokens"
            )
        pages = TokenPages.allocate(a, b, self.holder.geometry, self.holder.page_tokens)
        pages.write_container(a, container)
        self.holder.load(name, version, a, pages)
        return Response(status_code=204)

    async def get_status(self, request: Request) -> Response:
        principal_of(request)  # roles instance, pc: kvsp.web.roles
        return kvsp_json(self.holder.status())


def reshard_routes(
    holder: ShardHolder, fetcher: RangeFetcher, *, body_limit: int = DEFAULT_BODY_LIMIT
) -> list[BaseRoute]:
    """The instance's §6.9 routes over ``holder``, loading ranges with ``fetcher``."""
    ep = _ReshardEndpoints(holder, fetcher, body_limit)
    return [
        Route("/reshard", ep.post_reshard, methods=["POST"]),
        Route("/shards", ep.get_status, methods=["GET"]),
        Route("/shards/{map}/{tokens}", ep.get_range, methods=["GET"]),
        Route("/shards/{map}/{tokens}", ep.put_range, methods=["PUT"]),
    ]


class HasGeometry(Protocol):
    """An instance agent, as far as resharding needs it: the geometry of its engine's cache."""

    @property
    def geometry(self) -> Geometry:
        """The cache geometry (§4.1 layers, kv_heads, head_dim, element size)."""
        ...


def agent_reshard_routes(agent: HasGeometry, token: str | None) -> list[BaseRoute]:
    """The §6.9 routes of a running instance: a new :class:`ShardHolder` of its engine's
    geometry, fetching from peers with the instance's own bearer token."""
    holder = ShardHolder(agent.geometry)
    return reshard_routes(holder, HttpRangeFetcher(token, agent.geometry))
