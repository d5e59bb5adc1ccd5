"""The holder's HTTP face (spec §6.6 leases, §6.7 block retrieval and storage; DESIGN.md §3
resource table) and ``kvsp serve holder``.

Routes (relative to the holder's base URL):

* ``GET blocks/{compat}/{scope}/{key}`` (``?layers=a-b``, ``?codec=n``): the container as
  ``application/kvsp-block`` with ``Content-Length``, ``Repr-Digest`` (RFC 9530) and
  ``Cache-Control: private, immutable, max-age=<remaining record TTL in s>``, sent from the
  stored octets without a copy (:class:`~kvsp.web.responses.PartsResponse`); a disk-tier block
  is read and checked against its digest first, and a faulty one is a 404 (a miss).
* ``PUT blocks/{compat}/{scope}/{key}`` with ``If-None-Match: *`` (missing or another value:
  428): 201 with the Replica Record; an optional ``Repr-Digest``/``Content-Digest`` is verified.
  Scope, an existing copy (412) and the descriptor are checked before the body is read; an
  unknown compat_id's descriptor is fetched from the IS (``--index``) before answering 422.
* ``POST leases`` (201, ``Location: leases/{id}``), ``PUT leases/{id}``, ``DELETE leases/{id}``
  (204); ``PUT``/``GET descriptors/{compat}``; ``GET healthz`` and ``GET readyz`` (ready when
  its IS answers) need no token.

Every other answer is an RFC 9457 problem; path parameters that are not lowercase hex of the
right length are 400 naming the parameter (``compat``, ``scope``, ``key``). The roles each route
takes are :data:`kvsp.web.roles.RULES` (storing needs holder, instance or relay; never client or
metrics).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvsp.audience import origins
from kvsp.errors import (
    BadRequest,
    Incompatible,
    NotFound,
    PreconditionRequired,
    UnsupportedMediaType,
)
from kvsp.ids import parse_block_key, parse_compat_id, parse_scope_id
from kvsp.index import ReplicaIndex
from kvsp.leases import CLIENT_SHARE, LeaseQuota
from kvsp.records import LeaseRenewal, LeaseRequest
from kvsp.registries import Tier
from kvsp.services.descriptors import descriptor_routes
from kvsp.services.holder.service import (
    DEFAULT_LEASE_TTL_MS,
    DEFAULT_LEASES_PER_CLIENT,
    Holder,
    HolderConfig,
)
from kvsp.stores.blocks import BlockRef, DeviceBackend, cuda_backend
from kvsp.stores.descriptors import DescriptorRegistry
from kvsp.web.auth import Principals, principal_of
from kvsp.web.cliargs import (
    load_principals,
    parse_size,
    positive_int,
    positive_size,
    serve_config,
    trust_from_args,
)
from kvsp.web.clock import Clock, SystemClock
from kvsp.web.failover import add_url_list_argument
from kvsp.web.http import (
    install_operations,
    media_type,
    parse_codec_param,
    parse_layers_param,
    parse_repr_digest,
    read_body,
    read_json,
    repr_digest,
)
from kvsp.web.metrics import observe_bytes
from kvsp.web.problems import install_problem_handlers, kvsp_json
from kvsp.web.responses import PartsResponse
from kvsp.web.roles import install_roles
from kvsp.web.runner import ServeConfig, serve_async
from kvsp.web.sites import add_site_arguments, site_labels

BLOCK_MEDIA_TYPE = "application/kvsp-block"
PUT_MEDIA_TYPES = frozenset({BLOCK_MEDIA_TYPE, "application/octet-stream"})
JSON_LIMIT = 1 << 20
"""Largest lease body: a million octets holds thousands of block keys."""
_LEASE_ID = re.compile(r"[A-Za-z0-9._~-]{1,128}")


def _block_ref(request: Request) -> BlockRef:
    params = request.path_params
    return BlockRef(
        parse_compat_id(params["compat"], path="compat"),
        parse_scope_id(params["scope"], path="scope"),
        parse_block_key(params["key"], path="key"),
    )


def _lease_id(request: Request) -> str:
    lease_id: str = request.path_params["lease"]
    if _LEASE_ID.fullmatch(lease_id) is None:
        raise NotFound("no such lease")
    return lease_id


def _query(request: Request, name: str) -> str | None:
    values = request.query_params.getlist(name)
    if len(values) > 1:
        raise BadRequest(f"query parameter {name!r} given more than once", path=name)
    return values[0] if values else None


class _HolderEndpoints:
    def __init__(self, holder: Holder, body_limit: int) -> None:
        self.holder = holder
        self.body_limit = body_limit

    async def get_block(self, request: Request) -> Response:
        principal = principal_of(request)
        ref = _block_ref(request)
        layers_text = _query(request, "layers")
        codec_text = _query(request, "codec")
        layers = None if layers_text is None else parse_layers_param(layers_text)
        codec = None if codec_text is None else parse_codec_param(codec_text)
        plan = await self.holder.get_block(principal, *ref, layers, codec)
        headers = {
            "content-length": str(plan.length),
            "repr-digest": repr_digest(plan.repr_digest),
            "cache-control": f"private, immutable, max-age={plan.max_age_s}",
        }
        observe_bytes(request, "http", "sent", plan.length)  # metrics
        return PartsResponse(plan.parts, headers=headers, media_type=BLOCK_MEDIA_TYPE)

    async def put_block(self, request: Request) -> Response:
        principal = principal_of(request)
        ref = _block_ref(request)
        if request.headers.get("if-none-match", "").strip() != "*":
            raise PreconditionRequired("a block PUT needs If-None-Match: *", path="If-None-Match")
        content_type = request.headers.get("content-type")
        if content_type is not None and media_type(content_type) not in PUT_MEDIA_TYPES:
            raise UnsupportedMediaType(f"expected {BLOCK_MEDIA_TYPE}, got {content_type[:80]!r}")
        if request.headers.get("content-encoding", "identity").strip().lower() != "identity":
            raise UnsupportedMediaType("block bodies are sent without content coding")
        try:
            self.holder.check_put(principal, ref)  # 403, 412, 422 before reading the body
        except Incompatible:
            if not await self.holder.learn_descriptor(ref.compat):  # from the IS
                raise
            self.holder.check_put(principal, ref)
        expected = _expected_digest(request)
        data = await read_body(request, self.body_limit)
        block = await self.holder.put_block(principal, *ref, data, expected_digest=expected)
        observe_bytes(request, "http", "received", len(data))  # metrics
        headers = {"repr-digest": repr_digest(block.meta.repr_digest)}
        if self.holder.public_url is not None:
            headers["location"] = f"{self.holder.public_url}blocks/{ref}"
        record = self.holder.record_of(block) if self.holder.public_url is not None else None
        body = record.to_json() if record is not None else {"size": block.meta.size}
        return kvsp_json(body, status=201, headers=headers)

    async def post_lease(self, request: Request) -> Response:
        principal = principal_of(request)
        lease_request = LeaseRequest.from_json(await read_json(request, JSON_LIMIT))
        grant = self.holder.grant(principal, lease_request)
        base = self.holder.public_url or ""
        headers = {"location": f"{base}leases/{grant.lease}"}
        return kvsp_json(grant.to_json(), status=201, headers=headers)

    async def put_lease(self, request: Request) -> Response:
        principal = principal_of(request)
        lease_id = _lease_id(request)
        renewal = LeaseRenewal.from_json(await read_json(request, JSON_LIMIT))
        return kvsp_json(self.holder.renew(principal, lease_id, renewal).to_json())

    async def delete_lease(self, request: Request) -> Response:
        principal = principal_of(request)
        self.holder.release(principal, _lease_id(request))
        return Response(status_code=204)


def _expected_digest(request: Request) -> bytes | None:
    """The SHA-256 the client claims for the body: Repr-Digest, else Content-Digest (the same
    for a body without content coding)."""
    for name in ("repr-digest", "content-digest"):
        values = request.headers.getlist(name)
        if values:
            return parse_repr_digest(", ".join(values))
    return None


async def healthz(request: Request) -> Response:
    """Liveness: answers without a token and says nothing about the contents."""
    return kvsp_json({"status": "ok"})


def holder_routes(holder: Holder, body_limit: int) -> list[Route]:
    """The holder's block and lease routes, for this app and for instances and relays."""
    ep = _HolderEndpoints(holder, body_limit)
    block = "/blocks/{compat}/{scope}/{key}"
    return [
        Route(block, ep.get_block, methods=["GET"]),
        Route(block, ep.put_block, methods=["PUT"]),
        Route("/leases", ep.post_lease, methods=["POST"]),
        Route("/leases/{lease}", ep.put_lease, methods=["PUT"]),
        Route("/leases/{lease}", ep.delete_lease, methods=["DELETE"]),
    ]


@contextlib.asynccontextmanager
async def holder_lifespan(holder: Holder) -> AsyncIterator[None]:
    """Start the holder (disk tier, refreshing) with the app; withdraw its records at the end."""
    await holder.start()
    try:
        yield
    finally:
        await holder.close()


def create_holder_app(
    holder: Holder,
    principals: Principals,
    clock: Clock,
    config: HolderConfig,
    descriptors: DescriptorRegistry | None = None,
) -> Starlette:
    """The holder as a Starlette app; ``descriptors`` (default: the holder's own source, when it
    is a :class:`DescriptorRegistry`) gets the ``descriptors/{compat}`` routes."""
    registry = descriptors
    if registry is None and isinstance(holder.descriptors, DescriptorRegistry):
        registry = holder.descriptors
    routes = holder_routes(holder, config.body_limit)
    if registry is not None:
        routes += descriptor_routes(registry)
    routes.append(Route("/healthz", healthz, methods=["GET"]))
    app = Starlette(routes=routes, lifespan=lambda _app: holder_lifespan(holder))
    app.state.principals = principals
    app.state.clock = clock
    app.state.holder = holder
    app.state.audiences = lambda: origins([holder.public_url])
    install_roles(app, "holder")
    install_problem_handlers(app)
    install_operations(app, "holder", "KVSP holder", readiness=holder.readiness)
    return app


# --- command line ------------------------------------------------------------------------------


def _tier_value(text: str) -> tuple[Tier, str]:
    name, sep, value = text.partition("=")
    try:
        tier = Tier(name.strip())
    except ValueError:
        known = ", ".join(Tier)
        raise argparse.ArgumentTypeError(f"unknown tier {name!r} ({known})") from None
    if not sep:
        raise argparse.ArgumentTypeError(f"expected TIER=VALUE, got {text!r}")
    return tier, value


def _tier_size(text: str) -> tuple[Tier, int]:
    tier, value = _tier_value(text)
    return tier, parse_size(value)


def _tier_rate(text: str) -> tuple[Tier, float]:
    tier, value = _tier_value(text)
    try:
        rate = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
    if not 0 < rate < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive rate, got {value!r}")
    return tier, rate


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the holder's options (``kvsp serve holder``)."""
    d = HolderConfig()
    add = parser.add_argument
    add_url_list_argument(
        parser, "--index", help="the Index Service to publish at (default: standalone)"
    )
    add("--index-token-file", type=Path, metavar="FILE", help="bearer token for the IS")
    add("--public-url", metavar="URL", help="base URL named in records (default: its own)")
    add_site_arguments(parser)
    add(
        "--tier",
        type=_tier_size,
        action="append",
        default=[],
        metavar="TIER=SIZE",
        help="a storage tier and its budget, e.g. host=2GiB, disk=100GiB, device=8GiB "
        "(repeatable; default host=1GiB); the disk tier lives in STATE/blocks",
    )
    add(
        "--read-mbit-per-s",
        type=_tier_rate,
        action="append",
        default=[],
        metavar="TIER=RATE",
        help="read rate a tier reports in residency (default host=400000, disk=16000)",
    )
    add(
        "--record-ttl-ms",
        type=positive_int,
        default=d.record_ttl_ms,
        metavar="MS",
        help=f"TTL asked for each Replica Record; refreshed at a third (default {d.record_ttl_ms})",
    )
    add(
        "--lease-max-octets",
        type=positive_size,
        default=None,
        metavar="SIZE",
        help="per-client quota of leased octets (default a quarter of the tiers' capacity); "
        "all clients together never lease more than half of it",
    )
    add(
        "--lease-max-ttl-ms",
        type=positive_int,
        default=DEFAULT_LEASE_TTL_MS,
        metavar="MS",
        help=f"longest lease TTL (default {DEFAULT_LEASE_TTL_MS})",
    )
    add(
        "--lease-max-count",
        type=positive_int,
        default=DEFAULT_LEASES_PER_CLIENT,
        metavar="N",
        help=f"most leases per client (default {DEFAULT_LEASES_PER_CLIENT})",
    )
    add(
        "--descriptor",
        action="append",
        default=[],
        metavar="FILE",
        help="a Compatibility Descriptor (JSON) to know at start; repeatable (others: PUT "
        "descriptors/{compat}, kept in STATE/descriptors)",
    )
    add(
        "--body-limit",
        type=positive_size,
        default=d.body_limit,
        metavar="SIZE",
        help="largest block PUT body (default 256MiB)",
    )


def holder_config(args: argparse.Namespace) -> HolderConfig:
    """The :class:`HolderConfig` the options describe.

    Raises:
        BadRequest: a tier given twice, a public URL without a trailing ``/``, or ``--zone``
            without ``--site``.
    """
    tiers: dict[Tier, int] = {}
    for tier, size in args.tier:
        if tier in tiers:
            raise BadRequest(f"--tier {tier} given twice")
        tiers[tier] = size
    defaults = HolderConfig()
    rates = dict(defaults.read_mbit_per_s) | dict(args.read_mbit_per_s)
    if args.public_url is not None and not args.public_url.endswith("/"):
        raise BadRequest("--public-url must end in '/'")
    tiers = tiers or dict(defaults.tiers)
    per_client = args.lease_max_octets
    if per_client is None:
        per_client = max(1, sum(tiers.values()) // CLIENT_SHARE)
    labels = site_labels(args)
    return HolderConfig(
        public_url=args.public_url,
        tiers=tiers,
        state_dir=args.state,
        record_ttl_ms=args.record_ttl_ms,
        read_mbit_per_s=rates,
        lease_quota=LeaseQuota(
            max_octets_per_client=per_client,
            max_ttl_ms=args.lease_max_ttl_ms,
            max_leases_per_client=args.lease_max_count,
        ),
        body_limit=args.body_limit,
        site=labels.site,
        zone=labels.zone,
    )


def _read_token(path: Path) -> str:
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise BadRequest(f"cannot read --index-token-file {path}: {exc.strerror}") from None
    if not token:
        raise BadRequest(f"--index-token-file {path} is empty")
    return token


def run(args: argparse.Namespace) -> int:
    """Serve a holder until SIGTERM/SIGINT; returns the exit status.

    Raises:
        BadRequest: inconsistent options (a device tier without CUDA, a token file without an
            index, …).
        DescriptorError: a ``--descriptor`` file is not a valid descriptor.
    """
    config = holder_config(args)
    if args.index_token_file is not None and args.index is None:
        raise BadRequest("--index-token-file needs --index")
    token = None if args.index_token_file is None else _read_token(args.index_token_file)
    device = cuda_backend() if Tier.DEVICE in config.tiers else None
    if Tier.DEVICE in config.tiers and device is None:
        raise BadRequest("--tier device=… needs torch with CUDA")
    registry = DescriptorRegistry(args.state / "descriptors")
    registry.load_folder()
    registry.load_files(args.descriptor)
    serving = serve_config(args)
    principals = load_principals(args)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(_serve(args, config, token, registry, principals, device, serving))
    return 0


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when importable (as :mod:`kvsp.web.runner` picks it), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


async def _serve(
    args: argparse.Namespace,
    config: HolderConfig,
    token: str | None,
    registry: DescriptorRegistry,
    principals: Principals,
    device: DeviceBackend | None,
    serving: ServeConfig,
) -> None:
    from kvsp.services.index.client import IndexClient

    clock = SystemClock()
    async with contextlib.AsyncExitStack() as stack:
        index: ReplicaIndex | None = None
        if args.index is not None:
            trust = trust_from_args(args)  # --cafile/--insecure: the IS over HTTPS
            index = await stack.enter_async_context(IndexClient(args.index, token, trust=trust))
        holder = Holder(
            config,
            index=index,
            descriptors=registry,
            clock=clock,
            device=device,
        )
        app = create_holder_app(holder, principals, clock, config)

        def on_serving(url: str) -> None:
            if config.public_url is None:
                holder.set_public_url(url)

        await serve_async(app, serving, on_serving=on_serving)
