"""The control plane in one process: the Index Service and the Placement Controller over one
store, in memory or in Redis with ``--store`` (DESIGN.md §1: "IS and PC may run in one process
(``kvsp serve control``, the default)"). Started by ``kvsp serve control``.

The app serves the IS routes, the descriptor routes and the PC routes. ``PUT
instances/{instance_id}/status`` is the PC's here (the lifecycle authority, §6.3): the PC
accepts the record and writes it straight into the IS's status table (:class:`LocalIndex`), in
place of the forwarding it does when apart. Lookups for placement go to the in-process
:class:`~kvsp.index.IndexService`.
"""

from __future__ import annotations

import argparse
import contextlib
import operator
import uuid
from collections.abc import AsyncIterator, Sequence

from starlette.applications import Starlette
from starlette.routing import BaseRoute, Route

from kvsp.compat import CompatibilityDescriptor
from kvsp.index import Caller, DescriptorSource, IndexService, ReplicaStore, holder_id_of
from kvsp.lifecycle import InstanceRegistry, SleepPolicy
from kvsp.records import InstanceStatusRecord, LookupRequest, ReplicaRecord
from kvsp.services.descriptors import descriptor_routes
from kvsp.services.index.app import (
    IndexConfig,
    Lifespan,
    index_config,
    index_lifespan,
    index_routes,
    open_store,
)
from kvsp.services.index.app import configure_parser as configure_index_parser
from kvsp.services.pc.app import (
    HttpInstancePeers,
    add_pc_arguments,
    closing,
    directive_token,
    open_pc_stores,
    pc_config,
    pc_lifespan,
    pc_routes,
    scale_up_hook,
)
from kvsp.services.pc.reshard import coordinator_for, reshard_routes
from kvsp.services.pc.service import InstancePeers, PCConfig, PlacementController, ScaleUpHook
from kvsp.stores.descriptors import DescriptorRegistry
from kvsp.stores.instances import InstanceStore
from kvsp.stores.sessions import SessionStore
from kvsp.web.auth import Principals
from kvsp.web.cliargs import load_principals, serve_config
from kvsp.web.clock import Clock, SystemClock
from kvsp.web.http import install_operations, store_readiness
from kvsp.web.problems import install_problem_handlers
from kvsp.web.roles import install_roles
from kvsp.web.runner import serve

STATUS_PATH = "/instances/{instance_id}/status"
_record = operator.itemgetter(0)  # (record, expires_ms) -> record


class _ControllerCaller:
    """The PC as an IS caller: it has authorized the client for the scope before it looks up,
    and it publishes nothing."""

    name = "placement-controller"

    def may_use_scope(self, scope_id: bytes) -> bool:
        return True

    def may_publish_for(self, holder: str) -> bool:
        return False

    def may_publish_for_id(self, holder_id: bytes) -> bool:
        return False

    def may_report_for(self, instance: str) -> bool:
        return False

    def may_withdraw_any_holder(self) -> bool:
        return True  # it withdraws the replicas of instances it declared failed (§6.3)


class LocalIndex:
    """:class:`~kvsp.services.pc.service.IndexAccess` over an in-process
    :class:`~kvsp.index.IndexService`: status records go straight into its store."""

    __slots__ = ("_caller", "_descriptors", "_index")

    def __init__(self, index: IndexService, descriptors: DescriptorSource) -> None:
        self._index = index
        self._descriptors = descriptors
        self._caller: Caller = _ControllerCaller()

    async def find(self, request: LookupRequest, now_ms: int) -> Sequence[Sequence[ReplicaRecord]]:
        """The matched records, looked up as the PC."""
        result = await self._index.find(self._caller, request, now_ms)
        return [list(map(_record, found)) for found in result.matches]

    async def put_status(self, record: InstanceStatusRecord, now_ms: int) -> None:
        """Keep the record in the IS's status table until it expires (a lower epoch than the
        table has is dropped there too, unless that one is poisoned)."""
        await self._index.keep_status(record, now_ms)

    async def withdraw_holder(self, holder: str, *, published_before: int | None = None) -> int:
        """Withdraw the replica records of ``holder`` (those published before
        ``published_before`` only, when given) as the PC; how many went."""
        return await self._index.withdraw_holder(
            self._caller, holder_id_of(holder), published_before=published_before
        )

    async def descriptor(self, compat_id: bytes) -> CompatibilityDescriptor | None:
        """The descriptor from the shared registry."""
        return self._descriptors.get(compat_id)


def create_control_app(
    config: IndexConfig,
    *,
    store: ReplicaStore,
    principals: Principals,
    clock: Clock,
    descriptors: DescriptorRegistry,
    peers: InstancePeers,
    pc_config: PCConfig | None = None,
    scale_up: ScaleUpHook | None = None,
    extra_routes: Sequence[BaseRoute] = (),
    extra_lifespans: Sequence[Lifespan] = (),
    sessions: SessionStore | None = None,
    instances: InstanceStore | None = None,
) -> Starlette:
    """The control-plane app: IS and PC over ``store`` (``app.state.index`` and
    ``app.state.pc`` hold them), the PC's sessions in ``sessions`` and its instance registry
    in ``instances`` (in memory when ``None``);
    ``extra_routes`` and ``extra_lifespans`` join them."""
    pc_settings = pc_config or PCConfig()
    index = IndexService(
        store,
        max_ttl_ms=config.max_ttl_ms,
        descriptors=descriptors,
        max_lookup_keys=config.max_lookup_keys,
        max_records_per_holder=config.max_records_per_holder,
        max_epoch_skew_ms=config.max_epoch_skew_ms,
    )
    policy = SleepPolicy(
        threshold_load=pc_settings.sleep_threshold, min_low_ms=pc_settings.sleep_after_ms
    )
    pc = PlacementController(
        InstanceRegistry(policy),
        LocalIndex(index, descriptors),
        peers,
        clock,
        pc_settings,
        scale_up=scale_up,
        sessions=sessions,
        instances=instances,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(index_lifespan(index, clock, config))
            await stack.enter_async_context(pc_lifespan(pc))
            for extra in extra_lifespans:
                await stack.enter_async_context(extra())
            yield

    # The PC answers status PUTs (it is the lifecycle authority); the IS's own handler, which
    # answers with the reported state, is left out.
    is_routes = [
        r
        for r in index_routes(index, config, clock)
        if not (isinstance(r, Route) and r.path == STATUS_PATH)
    ]
    routes = [
        *is_routes,
        *descriptor_routes(descriptors),
        *pc_routes(pc, with_healthz=False),
        *extra_routes,
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.router.redirect_slashes = False  # "lookup/" is no resource: a 404 problem, not a 307
    app.state.principals = principals
    app.state.clock = clock
    app.state.index = index
    app.state.pc = pc
    install_roles(app, "control")
    install_problem_handlers(app)
    readiness = store_readiness(index.store.count, lambda: pc.sessions.store.get(uuid.UUID(int=0)))
    install_operations(
        app, "control", "KVSP control plane (Index Service and PC)", readiness=readiness
    )
    return app


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the control-plane options: those of the IS and those of the PC."""
    configure_index_parser(parser)
    add_pc_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Serve the control plane until SIGTERM/SIGINT; returns the exit status.

    Raises:
        BadRequest: a bad option or unreadable token file.
        StoreUnavailable: ``--store`` names a Redis that does not answer.
        DescriptorError: a ``--descriptor`` file is not a valid descriptor.
    """
    config = serve_config(args)
    principals = load_principals(args)  # first: it makes STATE/admin.token on a first start
    opened = open_store(args)
    stores = open_pc_stores(args.store)
    peers = HttpInstancePeers(directive_token(args))
    hook = None if args.scale_up_hook is None else scale_up_hook(args.scale_up_hook)
    app = create_control_app(
        index_config(args),
        store=opened.store,
        principals=principals,
        clock=SystemClock(),
        descriptors=opened.descriptors,
        peers=peers,
        pc_config=pc_config(args),
        scale_up=hook,
        extra_lifespans=[*opened.lifespans, *stores.lifespans, closing(peers)],
        sessions=stores.sessions,
        instances=stores.instances,
    )
    coordinator = coordinator_for(directive_token(args), SystemClock(), store=stores.shard_maps)
    app.router.routes.extend(reshard_routes(coordinator))
    return serve(app, config)
