"""The Index Service over HTTP (spec §6.1, §6.2, §6.3 status for estimates; DESIGN.md §3
resource table, §7 compact answers). Started by ``kvsp serve index``.

Resources (relative to the service base; ``R`` = ``replicas/{compat}/{scope}/{key}/{holder_id}``
with ``holder_id = uri_id(holder)``):

======= =================================== ==================================================
PUT     ``R``                               publish/refresh → 200 ``{"ttl_ms": granted}``
DELETE  ``R``                               withdraw → 204 (404 when there is none)
DELETE  ``holders/{holder_id}/replicas`` withdraw every record of the holder (``?before=MS``:
                                            only those last published before MS) → 200
                                            ``{"withdrawn": N}`` (the holder itself, pc,
                                            admin; the PC calls it for an instance it declared
                                            failed or that ended its epoch, §6.3)
POST    ``replicas`` ``{"records": [...]}`` → 200 ``{"results": [{"ok": true, "ttl_ms": n} |
                                            {"ok": false, "problem": {RFC 9457}}, ...]}``
POST    ``lookup``                          → 200 the §6.2 answer (compact on request)
GET     ``replicas``                        → 200 ``{"holders": [{"holder", "replicas",
                                            "octets"}]}``: live records per holder (admin;
                                            only over a store that counts them)
PUT     ``instances/{instance_id}/status``  → 200 ``{"state": the reported state}``
PUT/GET ``descriptors/{compat}``            → 201/200 ``{"compat_id"}`` / the descriptor
GET     ``healthz``                         → 200 ``{"status": "ok"}`` (no token needed)
======= =================================== ==================================================

Who may call each resource is :data:`kvsp.web.roles.RULES`. Path segments are lowercase hex of
the right length, else 400 naming the segment. Bodies are
bounded (:class:`IndexConfig`), errors are rendered by the problem handlers only, and a
background task sweeps expired records in bounded chunks. Records are checked against their
descriptor and a holder's records are bounded (:mod:`kvsp.index`: 422, 400 or 507), and status
epochs against the clock (``--max-epoch-skew-ms``, :mod:`kvsp.lifecycle`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from kvsp.errors import BadRequest, NotFound, PayloadTooLarge
from kvsp.fields import Fields
from kvsp.ids import parse_block_key, parse_compat_id, parse_hex16, parse_scope_id
from kvsp.index import (
    DEFAULT_MAX_LOOKUP_KEYS,
    DEFAULT_MAX_RECORDS_PER_HOLDER,
    IndexService,
    ReplicaCensus,
    ReplicaPath,
    ReplicaStore,
    holder_id_of,
)
from kvsp.lifecycle import DEFAULT_MAX_EPOCH_SKEW_MS
from kvsp.records import InstanceStatusRecord, LookupRequest, ReplicaRecord
from kvsp.services.descriptors import descriptor_routes
from kvsp.stores.descriptors import DescriptorRegistry
from kvsp.stores.memory import MemoryStore
from kvsp.web import auth
from kvsp.web.auth import Principal, Principals, principal_of
from kvsp.web.background import raise_if_cancelling
from kvsp.web.cliargs import (
    add_epoch_skew_argument,
    load_principals,
    positive_int,
    serve_config,
)
from kvsp.web.clock import Clock, SystemClock
from kvsp.web.http import JsonLimits, install_operations, read_json, store_readiness
from kvsp.web.metrics import observe_lookup
from kvsp.web.problems import install_problem_handlers, kvsp_json
from kvsp.web.roles import install_roles
from kvsp.web.runner import serve

_log = logging.getLogger("kvsp.services.index")

MIB = 1 << 20
RECORD_BODY_LIMIT = 1 * MIB
"""Octets of one record or status body (a 1,000-layer record is ~70 KB)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class IndexConfig:
    """Settings of one IS process.

    ``body_limit`` bounds lookup and batch bodies: 32 MiB holds a full 10,000-record batch of
    32-layer records (~27 MB) or a lookup of ~490k keys, above ``max_lookup_keys`` (65,536 keys
    = 4.4 MB), which is the tighter bound on lookups.
    """

    max_ttl_ms: int = 600_000
    body_limit: int = 32 * MIB
    max_lookup_keys: int = DEFAULT_MAX_LOOKUP_KEYS
    max_batch: int = 10_000
    max_records_per_holder: int | None = DEFAULT_MAX_RECORDS_PER_HOLDER
    """Records one holder may keep here (``None``: no bound); beyond it a new record is
    refused with 507 ``kvsp-insufficient-storage``."""
    max_epoch_skew_ms: int = DEFAULT_MAX_EPOCH_SKEW_MS
    """How far a status epoch may be ahead of the IS's clock (:mod:`kvsp.lifecycle`)."""
    sweep_interval_s: float = 1.0
    sweep_chunk: int = 10_000
    gc_freeze_interval_s: float | None = 2.0
    """How often :func:`freeze_heap_forever` moves surviving objects out of the cyclic
    collector's reach (``None``: never)."""


class PrincipalCaller:
    """An authenticated :class:`~kvsp.web.auth.Principal` as the IS's
    :class:`~kvsp.index.Caller`, decided by the rules of :mod:`kvsp.web.auth`.

    Status reports: a ``pc`` (or admin) may forward any instance's status (DESIGN §1: the PC
    forwards accepted records to the IS); an ``instance`` only those of URIs in its ``holders``.
    """

    __slots__ = ("principal",)

    def __init__(self, principal: Principal) -> None:
        self.principal = principal

    @property
    def name(self) -> str:
        """The principal's name."""
        return self.principal.name

    def may_use_scope(self, scope_id: bytes) -> bool:
        """Whether the principal may use ``scope_id``."""
        return auth.may_use_scope(self.principal, scope_id)

    def may_publish_for(self, holder: str) -> bool:
        """Whether the principal may publish for ``holder``."""
        return auth.may_publish_for(self.principal, holder)

    def may_publish_for_id(self, holder_id: bytes) -> bool:
        """Whether the principal may publish for the holder named by ``holder_id``."""
        p = self.principal
        return auth.has_role(p, "admin") or any(holder_id_of(h) == holder_id for h in p.holders)

    def may_withdraw_any_holder(self) -> bool:
        """Whether the principal may withdraw all records of any holder (pc, admin)."""
        return auth.has_role(self.principal, "pc") or auth.has_role(self.principal, "admin")

    def may_report_for(self, instance: str) -> bool:
        """Whether the principal may report ``instance``'s status."""
        p = self.principal
        if auth.has_role(p, "pc"):
            return True
        return auth.has_role(p, "instance") and auth.may_publish_for(p, instance)


def _uint_param(text: str, name: str) -> int:
    """A decimal uint64 query parameter.

    Raises:
        BadRequest: anything else (``path`` names the parameter).
    """
    if not (text.isascii() and text.isdigit()) or len(text) > 20 or int(text) >= 1 << 64:
        raise BadRequest(f"{name} must be a decimal integer in 0..2^64-1", path=name)
    return int(text)


def _caller(request: Request) -> PrincipalCaller:
    return PrincipalCaller(principal_of(request))


def _replica_path(request: Request) -> ReplicaPath:
    params = request.path_params
    return ReplicaPath(
        compat_id=parse_compat_id(params["compat"], path="compat"),
        scope_id=parse_scope_id(params["scope"], path="scope"),
        block_key=parse_block_key(params["key"], path="key"),
        holder_id=parse_hex16(params["holder_id"], path="holder_id"),
    )


class _IndexEndpoints:
    """The request handlers, bound to one :class:`IndexService`."""

    def __init__(self, index: IndexService, config: IndexConfig, clock: Clock) -> None:
        self.index = index
        self.config = config
        self.clock = clock
        self.record_limit = min(RECORD_BODY_LIMIT, config.body_limit)
        # a lookup is one array of 64-hex keys; a batch one record per ~48 octets per item
        self.lookup_limits = JsonLimits.for_array(
            index.max_lookup_keys, 80, config.body_limit, strings=True
        )
        self.batch_limits = JsonLimits(
            max_octets=config.body_limit,
            max_items=max(1024, config.body_limit // 48),
            max_containers=config.max_batch * 8 + 64,
        )

    async def put_replica(self, request: Request) -> Response:
        caller = _caller(request)
        path = _replica_path(request)
        record = ReplicaRecord.from_json(await read_json(request, self.record_limit))
        granted = await self.index.publish(caller, path, record, self.clock.now_ms())
        return kvsp_json({"ttl_ms": granted})

    async def delete_replica(self, request: Request) -> Response:
        caller = _caller(request)
        path = _replica_path(request)
        if not await self.index.withdraw(caller, path):
            raise NotFound("no such replica record")
        return Response(status_code=204)

    async def withdraw_holder(self, request: Request) -> Response:
        caller = _caller(request)
        holder_id = parse_hex16(request.path_params["holder_id"], path="holder_id")
        before = request.query_params.get("before")
        bound = None if before is None else _uint_param(before, "before")
        withdrawn = await self.index.withdraw_holder(caller, holder_id, published_before=bound)
        return kvsp_json({"withdrawn": withdrawn})

    async def publish_batch(self, request: Request) -> Response:
        caller = _caller(request)
        records = Fields(await read_json(request, self.batch_limits)).array("records")
        if len(records) > self.config.max_batch:
            raise PayloadTooLarge(
                f"at most {self.config.max_batch} records per batch, got {len(records)}",
                path="$.records",
            )
        outcomes = await self.index.publish_batch(caller, records, self.clock.now_ms())
        return kvsp_json({"results": [o.to_json() for o in outcomes]})

    async def lookup(self, request: Request) -> Response:
        caller = _caller(request)
        body = await read_json(request, self.lookup_limits)
        self._check_key_count(body)
        lookup = LookupRequest.from_json(body)
        now_ms = self.clock.now_ms()
        result = await self.index.find(caller, lookup, now_ms)
        observe_lookup(request, "lookup", len(lookup.block_keys), len(result.matches))  # metrics
        return kvsp_json(result.to_json(now_ms))

    def _check_key_count(self, body: Any) -> None:
        """Refuse an oversized lookup before decoding every key."""
        keys = body.get("block_keys") if isinstance(body, dict) else None
        if isinstance(keys, list) and len(keys) > self.index.max_lookup_keys:
            raise PayloadTooLarge(
                f"at most {self.index.max_lookup_keys} keys per lookup, got {len(keys)}",
                path="$.block_keys",
            )

    async def put_status(self, request: Request) -> Response:
        caller = _caller(request)
        instance_id = parse_hex16(request.path_params["instance_id"], path="instance_id")
        record = InstanceStatusRecord.from_json(await read_json(request, self.record_limit))
        answer = await self.index.put_status(caller, instance_id, record, self.clock.now_ms())
        return kvsp_json(answer.to_json())


async def healthz(request: Request) -> Response:
    """Liveness: answers without a token and says nothing about the contents."""
    return kvsp_json({"status": "ok"})


def index_routes(index: IndexService, config: IndexConfig, clock: Clock) -> list[BaseRoute]:
    """The IS routes (without descriptors), for this app and for ``kvsp serve control``."""
    ep = _IndexEndpoints(index, config, clock)
    replica = "/replicas/{compat}/{scope}/{key}/{holder_id}"
    return [
        Route(replica, ep.put_replica, methods=["PUT"]),
        Route(replica, ep.delete_replica, methods=["DELETE"]),
        Route("/replicas", ep.publish_batch, methods=["POST"]),
        Route("/holders/{holder_id}/replicas", ep.withdraw_holder, methods=["DELETE"]),
        Route("/lookup", ep.lookup, methods=["POST"]),
        Route("/instances/{instance_id}/status", ep.put_status, methods=["PUT"]),
        Route("/healthz", healthz, methods=["GET"]),
        *_census_routes(index.store, clock),
    ]


def _census_routes(store: ReplicaStore, clock: Clock) -> list[BaseRoute]:
    """``GET replicas`` (admin): live records and octets per holder, over a store that can
    count them (:class:`~kvsp.index.ReplicaCensus`); no route otherwise."""
    if not isinstance(store, ReplicaCensus):
        return []
    census: ReplicaCensus = store

    async def holders(request: Request) -> Response:
        principal_of(request)  # admin only: kvsp.web.roles
        rows = await census.holders(clock.now_ms())
        body = [{"holder": h, "replicas": n, "octets": octets} for h, n, octets in rows]
        return kvsp_json({"holders": body})

    return [Route("/replicas", holders, methods=["GET"])]


async def sweep_forever(index: IndexService, clock: Clock, config: IndexConfig) -> None:
    """Every ``sweep_interval_s``, remove expired records in chunks of ``sweep_chunk``,
    yielding to requests between chunks. A failing store is logged and retried."""
    while True:
        await asyncio.sleep(config.sweep_interval_s)
        raise_if_cancelling()  # a cancel a client library ate on the way still ends the loop
        try:
            while await index.sweep(clock.now_ms(), config.sweep_chunk) >= config.sweep_chunk:
                await asyncio.sleep(0)
                raise_if_cancelling()
        except Exception:
            raise_if_cancelling()
            _log.exception("sweeping expired replica records failed")


async def freeze_heap_forever(interval_s: float) -> None:
    """Every ``interval_s``, collect the objects made since the last call, then freeze the
    survivors (``gc.freeze``), so that full collections never walk the stored records again.

    Why: each record is several objects tracked by the cyclic collector, and CPython runs a full
    collection each time the long-lived objects grow by a quarter; with many records those
    pauses last seconds and take a large share of a bulk load. Frozen objects
    are still freed by reference counting when a record is replaced or removed; only an object
    that dies in a reference cycle after being frozen would stay. The store makes no cycles and
    the collections before each freeze find next to nothing in a running IS.
    """
    while True:
        await asyncio.sleep(interval_s)
        gc.collect()  # only the objects not frozen yet: those of the last interval
        gc.freeze()


@contextlib.asynccontextmanager
async def index_lifespan(
    index: IndexService, clock: Clock, config: IndexConfig
) -> AsyncIterator[None]:
    """Run :func:`sweep_forever` (and :func:`freeze_heap_forever`) while the app serves."""
    tasks = [asyncio.create_task(sweep_forever(index, clock, config), name="kvsp-index-sweeper")]
    if config.gc_freeze_interval_s is not None:
        keeper = freeze_heap_forever(config.gc_freeze_interval_s)
        tasks.append(asyncio.create_task(keeper, name="kvsp-index-heap"))
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


Lifespan = Callable[[], AbstractAsyncContextManager[None]]
"""A background task's context: entered at startup, left at shutdown."""


def create_index_app(
    config: IndexConfig,
    *,
    store: ReplicaStore,
    principals: Principals,
    clock: Clock,
    descriptors: DescriptorRegistry,
    extra_routes: Sequence[BaseRoute] = (),
    extra_lifespans: Sequence[Lifespan] = (),
) -> Starlette:
    """The IS as a Starlette app (``app.state.index`` holds its :class:`IndexService`).

    ``extra_routes`` follow the IS and descriptor routes, and ``extra_lifespans`` run beside
    the sweeper: that is how ``kvsp serve control`` adds the PC to the same process.
    """
    index = IndexService(
        store,
        max_ttl_ms=config.max_ttl_ms,
        descriptors=descriptors,
        max_lookup_keys=config.max_lookup_keys,
        max_records_per_holder=config.max_records_per_holder,
        max_epoch_skew_ms=config.max_epoch_skew_ms,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(index_lifespan(index, clock, config))
            for extra in extra_lifespans:
                await stack.enter_async_context(extra())
            yield

    routes = [*index_routes(index, config, clock), *descriptor_routes(descriptors)]
    app = Starlette(routes=[*routes, *extra_routes], lifespan=lifespan)
    app.router.redirect_slashes = False  # "lookup/" is no resource: a 404 problem, not a 307
    app.state.principals = principals
    app.state.clock = clock
    app.state.index = index
    install_roles(app, "index")
    install_problem_handlers(app)
    readiness = store_readiness(index.store.count)
    install_operations(app, "index", "KVSP Index Service", readiness=readiness)
    return app


# --- command line ------------------------------------------------------------------------------


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the IS options (``kvsp serve index`` and ``kvsp serve control``)."""
    defaults = IndexConfig()
    parser.add_argument(
        "--max-ttl-ms",
        type=positive_int,
        default=defaults.max_ttl_ms,
        metavar="MS",
        help=f"cap on granted replica TTLs (default {defaults.max_ttl_ms})",
    )
    parser.add_argument(
        "--descriptor",
        action="append",
        default=[],
        metavar="FILE",
        help="a Compatibility Descriptor (JSON) to know at start; repeatable",
    )
    parser.add_argument(
        "--body-limit",
        type=positive_int,
        default=defaults.body_limit,
        metavar="OCTETS",
        help=f"largest lookup or batch body (default {defaults.body_limit})",
    )
    parser.add_argument(
        "--max-lookup-keys",
        type=positive_int,
        default=defaults.max_lookup_keys,
        metavar="N",
        help=f"most block keys in one lookup (default {defaults.max_lookup_keys})",
    )
    parser.add_argument(
        "--max-records-per-holder",
        type=positive_int,
        default=defaults.max_records_per_holder,
        metavar="N",
        help="most replica records one holder may keep; beyond it a new record is refused "
        f"with 507 (default {defaults.max_records_per_holder})",
    )
    add_epoch_skew_argument(parser)
    parser.add_argument(
        "--store",
        default="memory",
        metavar="URL",
        help="where replica records (with kvsp serve control also the PC's instance registry, "
        "sessions and shard maps) live: memory (default: in this process) or "
        "redis://HOST:PORT/DB[?prefix=NAME], shared by every process using it",
    )


@dataclass(frozen=True, slots=True)
class OpenedStore:
    """The replica store and descriptor registry ``--store`` names, and the lifespans they
    need while the app serves (a Redis store's connections, descriptor sharing)."""

    store: ReplicaStore
    descriptors: DescriptorRegistry
    lifespans: tuple[Lifespan, ...]


def open_store(args: argparse.Namespace) -> OpenedStore:
    """The store of ``--store`` with the registry of ``STATE/descriptors`` and the
    ``--descriptor`` files; with Redis, descriptors are shared through it too.

    Raises:
        BadRequest: a bad ``--store`` URL, or the ``redis`` package is not installed.
        StoreUnavailable: Redis does not answer.
        DescriptorError: a descriptor file is unreadable or not a valid descriptor.
    """
    folder = args.state / "descriptors"
    if args.store == "memory":
        opened = OpenedStore(MemoryStore(), DescriptorRegistry(folder), ())
    else:
        try:
            from kvsp.stores.redis import RedisStore, SharedDescriptors
        except ModuleNotFoundError as exc:
            if exc.name != "redis":
                raise
            raise BadRequest("--store redis://… needs the redis package (kvsp[redis])") from None
        store = RedisStore.from_url(args.store)
        store.check_reachable()  # a clear error now rather than a failing first request
        shared = SharedDescriptors(folder, store)
        opened = OpenedStore(store, shared, (store.serving, shared.syncing))
    opened.descriptors.load_folder()
    opened.descriptors.load_files(args.descriptor)
    return opened


def index_config(args: argparse.Namespace) -> IndexConfig:
    """The :class:`IndexConfig` the IS options describe."""
    return IndexConfig(
        max_ttl_ms=args.max_ttl_ms,
        body_limit=args.body_limit,
        max_lookup_keys=args.max_lookup_keys,
        max_records_per_holder=args.max_records_per_holder,
        max_epoch_skew_ms=args.max_epoch_skew_ms,
    )


def run(args: argparse.Namespace) -> int:
    """Serve the IS until SIGTERM/SIGINT; returns the exit status.

    Raises:
        BadRequest: a bad option.
        StoreUnavailable: ``--store`` names a Redis that does not answer.
        DescriptorError: a ``--descriptor`` file is not a valid descriptor.
    """
    config = serve_config(args)
    principals = load_principals(args)
    opened = open_store(args)
    app = create_index_app(
        index_config(args),
        store=opened.store,
        principals=principals,
        clock=SystemClock(),
        descriptors=opened.descriptors,
        extra_lifespans=opened.lifespans,
    )
    return serve(app, config)
