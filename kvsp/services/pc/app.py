"""The Placement Controller over HTTP (spec §6.3, §6.4, §6.5; DESIGN.md §1, §3 resource table).
Started alone by ``kvsp serve pc --index URL``; ``kvsp serve control`` mounts the same routes
beside the IS (:mod:`kvsp.services.control`).

Resources (relative to the service base):

======  ================================  ====================================================
PUT     ``instances/{instance_id}/status``  Instance Status Record → 200 ``{"state"}`` (§6.3);
                                          roles instance (for a URI in its ``holders``), admin
GET     ``instances``                     → 200 ``{"instances": [view, ...]}``; roles pc, admin
PUT     ``instances/{instance_id}/state`` ``{"state"}`` → 200 ``{"state"}``, forwarded to the
                                          instance first; roles pc, admin
DELETE  ``instances/{instance_id}?epoch=E`` end the epoch gracefully → 204; the entry leaves
                                          the registry, its replicas are withdrawn at the
                                          IS, its sessions move (§6.8); 409
                                          ``kvsp-stale-epoch`` for a lower epoch; roles
                                          instance (for itself), admin
POST    ``place``                         PlaceRequest → 200 PlaceResponse, or 503
                                          ``kvsp-not-active`` with ``Retry-After``; roles
                                          client, pc, admin, authorized for the scope; with
                                          ``session`` it creates the session (§6.8)
PUT     ``sessions/{session}/checkpoint`` Session Checkpoint → 200 ``{"session", "epoch",
                                          "output_offset", "state"}``; 409
                                          ``kvsp-stale-epoch``; role instance (§6.8)
GET     ``sessions/{session}``            → 200 ``{"session", "instance", "epoch", "state",
                                          "output_offset", ...}``; roles client, pc, instance
GET     ``healthz``                       → 200 ``{"status": "ok"}`` (no token needed)
======  ================================  ====================================================

The outbound side lives here too: :class:`HttpInstancePeers` (directives and state changes to
instances), :class:`RemoteIndex` (the IS when apart) and the two scale-up hook forms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shlex
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from kvsp.compat import CompatibilityDescriptor
from kvsp.errors import (
    BadRequest,
    Forbidden,
    NotFound,
    RecordError,
    RemoteError,
    ScaleUpFailed,
    StaleEpoch,
)
from kvsp.fields import UINT64_MAX, Fields
from kvsp.ids import parse_hex16
from kvsp.index import holder_id_of
from kvsp.lifecycle import InstanceRegistry, SleepPolicy
from kvsp.placement_plan import DirectiveOptions
from kvsp.records import (
    InstanceStatusRecord,
    LookupRequest,
    PlaceRequest,
    PrefetchDirective,
    ReplicaRecord,
    ResumeRequest,
    StateAnswer,
)
from kvsp.records_common import HTTP_SCHEMES, read_uri
from kvsp.registries import InstanceState
from kvsp.services.index.client import IndexClient
from kvsp.services.pc.reshard import coordinator_for, reshard_routes
from kvsp.services.pc.service import (
    IndexAccess,
    NoInstance,
    PCConfig,
    PlacementController,
    ScaleUpContext,
    ScaleUpHook,
)
from kvsp.services.pc.sessions import SessionSettings, session_routes
from kvsp.stores.descriptors import DescriptorRegistry
from kvsp.stores.instances import InstanceStore
from kvsp.stores.sessions import SessionStore
from kvsp.stores.shardmaps import ShardMapStore
from kvsp.web import auth
from kvsp.web.auth import Principals, principal_of
from kvsp.web.background import raise_if_cancelling
from kvsp.web.cliargs import add_epoch_skew_argument, load_principals, positive_int, serve_config
from kvsp.web.client import BaseClient
from kvsp.web.clock import Clock, SystemClock
from kvsp.web.failover import add_url_list_argument
from kvsp.web.http import JsonLimits, install_operations, read_json, store_readiness
from kvsp.web.metrics import observe_lookup
from kvsp.web.problems import install_problem_handlers, kvsp_json, problem_response
from kvsp.web.roles import install_roles
from kvsp.web.runner import serve

_log = logging.getLogger("kvsp.services.pc.service")

MIB = 1 << 20
STATUS_BODY_LIMIT = 1 * MIB
"""Octets of a status or state body (a record with 1,000 links is ~80 KB)."""
PLACE_BODY_LIMIT = 32 * MIB
"""Octets of a place body: ~480k keys, a 7.7M-token prompt at B=16."""
_PLACE_LIMITS = JsonLimits.for_array(PLACE_BODY_LIMIT // 64, 80, PLACE_BODY_LIMIT, strings=True)
"""A place body is one array of 64-hex block keys (what parsing it may build)."""
PEER_TIMEOUT_S = 10.0
HOOK_TIMEOUT_S = 120.0
Lifespan = Callable[[], AbstractAsyncContextManager[None]]


# --- routes ------------------------------------------------------------------------------------


class _PCEndpoints:
    """The request handlers, bound to one :class:`PlacementController`."""

    def __init__(self, pc: PlacementController) -> None:
        self.pc = pc

    async def put_status(self, request: Request) -> Response:
        principal = principal_of(request)
        instance_id = parse_hex16(request.path_params["instance_id"], path="instance_id")
        record = InstanceStatusRecord.from_json(await read_json(request, STATUS_BODY_LIMIT))
        actual = holder_id_of(record.instance)
        if actual != instance_id:
            raise BadRequest(
                f"uri_id(instance) is {actual.hex()} in the body but {instance_id.hex()} in "
                "the path ({instance_id})",
                path="$.instance",
            )
        if not auth.may_publish_for(principal, record.instance):
            raise Forbidden(f"principal {principal.name!r} may not report for this instance")
        answer = await self.pc.put_status(record)
        return kvsp_json(answer.to_json())

    async def list_instances(self, request: Request) -> Response:
        principal_of(request)
        await self.pc.refresh()
        return kvsp_json({"instances": [v.to_json() for v in self.pc.list_instances()]})

    async def put_state(self, request: Request) -> Response:
        principal_of(request)
        instance_id = parse_hex16(request.path_params["instance_id"], path="instance_id")
        body = StateAnswer.from_json(await read_json(request, STATUS_BODY_LIMIT))
        instance = await self.pc.instance_uri(instance_id)
        state = await self.pc.set_state(instance, body.state)
        return kvsp_json(StateAnswer(state=state).to_json())

    async def end_epoch(self, request: Request) -> Response:
        principal = principal_of(request)
        instance_id = parse_hex16(request.path_params["instance_id"], path="instance_id")
        epoch = _epoch_param(request)
        # Checked on the id, before the lookup: a 404 would tell others which instances exist.
        mine = any(holder_id_of(h) == instance_id for h in principal.holders)
        if not (mine or auth.has_role(principal, "admin")):
            raise Forbidden(f"principal {principal.name!r} may not end this instance's epoch")
        await self.pc.end_epoch(await self.pc.instance_uri(instance_id), epoch)
        return Response(status_code=204)

    async def place(self, request: Request) -> Response:
        principal = principal_of(request)
        body = await read_json(request, _PLACE_LIMITS)
        place = PlaceRequest.from_json(body)
        options = DirectiveOptions.from_json(body)
        auth.require_scope(principal, place.scope_id)
        try:
            answer = await self.pc.place(place, options)
        except NoInstance as exc:
            retry = {"Retry-After": str(exc.retry_after_s)}
            return problem_response(exc, instance=request.url.path, headers=retry)
        observe_lookup(request, "place", len(place.block_keys), answer.matched)  # metrics
        return kvsp_json(answer.to_json())


def _epoch_param(request: Request) -> int:
    """The ``epoch`` query parameter: a decimal uint64."""
    text = request.query_params.get("epoch")
    if text is None:
        raise BadRequest("name the epoch to end (?epoch=E)", path="epoch")
    if not (text.isascii() and text.isdigit()) or len(text) > 20 or int(text) > UINT64_MAX:
        raise BadRequest("epoch must be a decimal integer in 0..2^64-1", path="epoch")
    return int(text)


async def healthz(request: Request) -> Response:
    """Liveness: answers without a token and says nothing about the contents."""
    return kvsp_json({"status": "ok"})


def pc_routes(pc: PlacementController, *, with_healthz: bool = True) -> list[BaseRoute]:
    """The PC routes, for this app and for ``kvsp serve control`` (which has its own
    ``healthz``)."""
    ep = _PCEndpoints(pc)
    routes: list[BaseRoute] = [
        Route("/instances/{instance_id}/status", ep.put_status, methods=["PUT"]),
        Route("/instances", ep.list_instances, methods=["GET"]),
        Route("/instances/{instance_id}/state", ep.put_state, methods=["PUT"]),
        Route("/instances/{instance_id}", ep.end_epoch, methods=["DELETE"]),
        Route("/place", ep.place, methods=["POST"]),
        *session_routes(pc.sessions),
    ]
    if with_healthz:
        routes.append(Route("/healthz", healthz, methods=["GET"]))
    return routes


async def sweep_forever(pc: PlacementController) -> None:
    """Every ``status_sweep_ms``, mark instances whose status record expired as failed and
    start moving their sessions (§6.3, §6.8); drop sessions past their retention."""
    while True:
        await asyncio.sleep(pc.config.status_sweep_ms / 1000)
        raise_if_cancelling()
        try:
            await pc.sweep()
            await pc.sessions.recover()
            await pc.sessions.expire()
        except Exception:
            raise_if_cancelling()
            _log.exception("sweeping expired instance records failed")


@contextlib.asynccontextmanager
async def pc_lifespan(pc: PlacementController) -> AsyncIterator[None]:
    """Run :func:`sweep_forever` for as long as the app serves."""
    task = asyncio.create_task(sweep_forever(pc), name="kvsp-pc-sweeper")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await pc.sessions.aclose()


def create_pc_app(
    pc: PlacementController,
    *,
    principals: Principals,
    clock: Clock,
    extra_lifespans: Sequence[Lifespan] = (),
) -> Starlette:
    """The PC alone as a Starlette app (``app.state.pc`` holds the controller)."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(pc_lifespan(pc))
            for extra in extra_lifespans:
                await stack.enter_async_context(extra())
            yield

    app = Starlette(routes=pc_routes(pc), lifespan=lifespan)
    app.router.redirect_slashes = False
    app.state.principals = principals
    app.state.clock = clock
    app.state.pc = pc
    install_roles(app, "pc")
    install_problem_handlers(app)
    readiness = store_readiness(lambda: pc.sessions.store.get(uuid.UUID(int=0)))
    install_operations(app, "pc", "KVSP Placement Controller", readiness=readiness)
    return app


# --- outbound: instances, the IS, scale-up hooks -----------------------------------------------


class _InstanceClient(BaseClient):
    """One instance's base, over the pool of :class:`HttpInstancePeers`."""

    async def prefetch(self, directive: PrefetchDirective) -> None:
        response = await self._request("POST", "prefetch", directive.to_json())
        if response.status_code != 202:  # §6.5: the instance answers 202 (Accepted)
            raise RemoteError(
                f"prefetch answered {response.status_code}, not 202",
                remote_status=response.status_code,
                body=response.content,
            )

    async def put_state(self, state: InstanceState) -> None:
        await self._request("PUT", "state", StateAnswer(state=state).to_json())

    async def resume(self, request: ResumeRequest) -> None:
        path = f"sessions/{request.checkpoint.session}/resume"
        await self._request("POST", path, request.to_json())


class HttpInstancePeers:
    """:class:`~kvsp.services.pc.service.InstancePeers` over HTTP: one keep-alive pool, the PC's own
    bearer token (``--directive-token-file``)."""

    def __init__(self, token: str | None, *, timeout: float = PEER_TIMEOUT_S) -> None:
        self._token = token
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=min(timeout, 5)))

    def _peer(self, instance: str) -> _InstanceClient:
        return _InstanceClient(instance, self._token, client=self._client)

    async def prefetch(self, instance: str, directive: PrefetchDirective) -> None:
        """POST the directive to ``{instance}prefetch``; 202 expected."""
        await self._peer(instance).prefetch(directive)

    async def put_state(self, instance: str, state: InstanceState) -> None:
        """PUT ``{"state"}`` to ``{instance}state``."""
        await self._peer(instance).put_state(state)

    async def resume(self, instance: str, request: ResumeRequest) -> None:
        """POST the resume request to ``{instance}sessions/{session}/resume`` (§6.8)."""
        await self._peer(instance).resume(request)

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()


class RemoteIndex:
    """:class:`~kvsp.services.pc.service.IndexAccess` over an :class:`IndexClient` (PC apart).

    Lookups ask for full records (not compact): the PC plans sources per block. They carry no
    ``targets``: the PC computes the whole §6.4 cost itself, with waits and capacity the IS
    does not know, so IS estimates would only double the work. Descriptors come from the local
    registry, else from the IS (cached).
    """

    def __init__(self, client: IndexClient, descriptors: DescriptorRegistry) -> None:
        self._client = client
        self._descriptors = descriptors

    async def find(self, request: LookupRequest, now_ms: int) -> Sequence[Sequence[ReplicaRecord]]:
        """The matched records, from a full lookup."""
        answer = await self._client.lookup(request)
        return answer.replicas or ()

    async def put_status(self, record: InstanceStatusRecord, now_ms: int) -> None:
        """PUT the record to the IS (it discards a lower epoch with 409, which is fine)."""
        with contextlib.suppress(StaleEpoch):
            await self._client.put_status(record)

    async def withdraw_holder(self, holder: str, *, published_before: int | None = None) -> int:
        """DELETE the records of ``holder`` at the IS (as role pc; those published before
        ``published_before`` only, when given); how many went."""
        return await self._client.withdraw_holder(holder, published_before=published_before)

    async def descriptor(self, compat_id: bytes) -> CompatibilityDescriptor | None:
        """The local descriptor, else the IS's."""
        known = self._descriptors.get(compat_id)
        if known is not None:
            return known
        try:
            found = await self._client.get_descriptor(compat_id)
        except NotFound:
            return None
        self._descriptors.add(found, persist=False)
        return found


def _instance_uri(text: str, source: str) -> str:
    try:
        uri = read_uri(text, source, HTTP_SCHEMES)
    except RecordError as exc:
        raise ScaleUpFailed(f"{source} gave no instance URI: {text[:200]!r}") from exc
    return uri if uri.endswith("/") else uri + "/"


def _hook_env(context: ScaleUpContext) -> dict[str, str]:
    return {
        "KVSP_SCOPE_ID": context.scope_id.hex(),
        "KVSP_COMPAT_ID": context.compat_id.hex(),
        "KVSP_PROMPT_TOKENS": str(context.prompt_tokens),
        "KVSP_MATCHED": str(context.matched),
        "KVSP_REQUEST_REF": context.request_ref or "",
        "KVSP_ACTIVE": str(context.active),
    }


class CommandHook:
    """A scale-up hook that runs a command (no shell): the context as JSON on stdin and as
    ``KVSP_*`` environment variables; the first line on stdout is the new instance's URI.

    The command should print once the instance's HTTP face accepts requests, so that the
    directive the PC sends next reaches it while its engine is still loading.
    """

    def __init__(self, argv: Sequence[str], *, timeout: float = HOOK_TIMEOUT_S) -> None:
        if not argv:
            raise BadRequest("--scale-up-hook: empty command")
        self.argv = list(argv)
        self.timeout = timeout

    async def __call__(self, context: ScaleUpContext) -> str:
        """Run the command and return the URI it printed.

        Raises:
            ScaleUpFailed: it could not start, failed, timed out or printed no URI.
        """
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                env={**os.environ, **_hook_env(context)},
            )
        except OSError as exc:
            raise ScaleUpFailed(f"cannot run {self.argv[0]!r}: {exc.strerror}") from exc
        data = json.dumps(context.to_json()).encode()
        try:
            out, _ = await asyncio.wait_for(proc.communicate(data), self.timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise ScaleUpFailed(f"{self.argv[0]!r} ran past {self.timeout} s") from None
        if proc.returncode != 0:
            raise ScaleUpFailed(f"{self.argv[0]!r} exited with status {proc.returncode}")
        first = out.decode("utf-8", "replace").strip().splitlines()[:1]
        return _instance_uri(first[0] if first else "", "the scale-up command")


class UrlHook:
    """A scale-up hook that POSTs the context as JSON to a URL and reads ``{"instance": uri}``."""

    def __init__(self, url: str, *, timeout: float = HOOK_TIMEOUT_S) -> None:
        self.url = url
        self.timeout = timeout

    async def __call__(self, context: ScaleUpContext) -> str:
        """POST the context and return the URI answered.

        Raises:
            ScaleUpFailed: unreachable, a non-2xx answer, or no ``instance`` URI in it.
        """
        try:
            async with httpx.AsyncClient(timeout=self.timeout) as client:
                response = await client.post(self.url, json=context.to_json())
        except httpx.HTTPError as exc:
            raise ScaleUpFailed(f"scale-up URL: {type(exc).__name__}: {exc}") from exc
        if not response.is_success:
            raise ScaleUpFailed(f"scale-up URL answered {response.status_code}")
        try:
            value = Fields(response.json()).string("instance")
        except (ValueError, RecordError) as exc:
            raise ScaleUpFailed(f"scale-up URL answered no instance: {exc}") from exc
        return _instance_uri(value, "the scale-up URL")


def scale_up_hook(spec: str, *, timeout: float = HOOK_TIMEOUT_S) -> ScaleUpHook:
    """The hook ``--scale-up-hook`` names: a URL (``http://``/``https://``) or a command.

    Raises:
        BadRequest: an empty or unparsable command.
    """
    if spec.startswith(("http://", "https://")):
        return UrlHook(spec, timeout=timeout)
    try:
        return CommandHook(shlex.split(spec), timeout=timeout)
    except ValueError as exc:
        raise BadRequest(f"--scale-up-hook: {exc}") from None


# --- command line ------------------------------------------------------------------------------


def _nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def add_pc_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the PC's own options (``kvsp serve pc`` and ``kvsp serve control``)."""
    d = PCConfig()
    add = parser.add_argument
    add(
        "--sleep-threshold",
        type=_nonnegative_float,
        default=d.sleep_threshold,
        metavar="LOAD",
        help="load (running+queued) below which an instance may ask to sleep "
        f"(default {d.sleep_threshold})",
    )
    add(
        "--sleep-after-ms",
        type=positive_int,
        default=d.sleep_after_ms,
        metavar="MS",
        help=f"how long the load must stay below it (default {d.sleep_after_ms})",
    )
    add(
        "--status-sweep-ms",
        type=positive_int,
        default=d.status_sweep_ms,
        metavar="MS",
        help=f"how often expired instances are marked failed (default {d.status_sweep_ms})",
    )
    add(
        "--deadline-ms",
        type=positive_int,
        default=d.deadline_ms,
        metavar="MS",
        help=f"deadline_ms of prefetch directives (default {d.deadline_ms})",
    )
    add(
        "--lease-ms",
        type=positive_int,
        default=d.lease_ms,
        metavar="MS",
        help=f"lease_ms of prefetch directives (default {d.lease_ms})",
    )
    add(
        "--assumed-link-mbit",
        type=_nonnegative_float,
        default=d.assumed_link_mbit_per_s,
        metavar="MBIT",
        help="link rate assumed to a holder an instance has not measured yet, so a fresh "
        f"instance can be sent directives; 0 = never assume (default {d.assumed_link_mbit_per_s})",
    )
    add(
        "--assumed-link-rtt-us",
        type=_nonnegative_float,
        default=d.assumed_link_rtt_us,
        metavar="US",
        help=f"RTT assumed with it (default {d.assumed_link_rtt_us})",
    )
    add(
        "--max-cost-us",
        type=_nonnegative_float,
        default=d.max_cost_us,
        metavar="US",
        help="highest acceptable §6.4 cost; above it an instance is started (default none)",
    )
    add(
        "--queue-limit",
        type=positive_int,
        default=None,
        metavar="N",
        help="capacity: running+queued below batch_size+N (default unlimited)",
    )
    add(
        "--service-prior-us",
        type=_nonnegative_float,
        default=d.service_prior_us,
        metavar="US",
        help="service time assumed before any instance is measured (default 0)",
    )
    add(
        "--scale-up-hook",
        metavar="CMD|URL",
        help="start an instance when none fits: a command printing its URI, or a URL "
        'answering {"instance": uri}',
    )
    add(
        "--scale-up-timeout-ms",
        type=positive_int,
        default=d.scale_up_timeout_ms,
        metavar="MS",
        help=f"how long a started instance has to register (default {d.scale_up_timeout_ms})",
    )
    add(
        "--directive-token-file",
        type=Path,
        metavar="FILE",
        help="the PC's bearer token for calling instances (default STATE/admin.token if any)",
    )
    sd = d.sessions
    add(
        "--failover-deadline-ms",
        type=positive_int,
        default=sd.deadline_ms,
        metavar="MS",
        help="how long the PC keeps trying to move a failed instance's session before it "
        f"marks it failed (default {sd.deadline_ms})",
    )
    add(
        "--session-retain-ms",
        type=positive_int,
        default=sd.retain_ms,
        metavar="MS",
        help=f"how long done and failed sessions stay readable (default {sd.retain_ms})",
    )
    add(
        "--session-log",
        type=Path,
        metavar="FILE",
        help="append checkpoint acks, rejections and session moves to FILE as JSON lines",
    )


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``kvsp serve pc`` (the PC apart from the IS)."""
    add_url_list_argument(parser, "--index", required=True, help="the Index Service")
    parser.add_argument(
        "--index-token-file",
        type=Path,
        required=True,
        metavar="FILE",
        help="the PC's bearer token for the IS (role pc)",
    )
    parser.add_argument(
        "--descriptor",
        action="append",
        default=[],
        metavar="FILE",
        help="a Compatibility Descriptor (JSON) to know at start; repeatable",
    )
    parser.add_argument(
        "--store",
        default="memory",
        metavar="URL",
        help="where the instance registry, sessions and shard maps live: memory (default: in "
        "this process) or redis://HOST:PORT/DB[?prefix=NAME], shared by every PC process using it",
    )
    add_epoch_skew_argument(parser)  # kvsp serve control has it from the IS's options
    add_pc_arguments(parser)


def pc_config(args: argparse.Namespace) -> PCConfig:
    """The :class:`PCConfig` the options describe."""
    return PCConfig(
        sleep_threshold=args.sleep_threshold,
        sleep_after_ms=args.sleep_after_ms,
        status_sweep_ms=args.status_sweep_ms,
        deadline_ms=args.deadline_ms,
        lease_ms=args.lease_ms,
        max_cost_us=args.max_cost_us,
        queue_limit=args.queue_limit,
        service_prior_us=args.service_prior_us,
        scale_up_timeout_ms=args.scale_up_timeout_ms,
        assumed_link_mbit_per_s=args.assumed_link_mbit,
        assumed_link_rtt_us=args.assumed_link_rtt_us,
        max_epoch_skew_ms=args.max_epoch_skew_ms,
        sessions=SessionSettings(
            deadline_ms=args.failover_deadline_ms,
            retain_ms=args.session_retain_ms,
            log=args.session_log,
        ),
    )


def read_token(path: Path, option: str) -> str:
    """The token in ``path`` (stripped).

    Raises:
        BadRequest: unreadable or empty.
    """
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise BadRequest(f"cannot read {option} {path}: {exc.strerror}") from None
    if not token:
        raise BadRequest(f"{option} {path} is empty")
    return token


def directive_token(args: argparse.Namespace) -> str | None:
    """``--directive-token-file``, else the embedded default's admin token, else none."""
    if args.directive_token_file is not None:
        return read_token(args.directive_token_file, "--directive-token-file")
    default = args.state / auth.ADMIN_TOKEN_FILE
    return read_token(default, "admin token") if default.is_file() else None


def build_controller(
    args: argparse.Namespace,
    index: IndexAccess,
    peers: HttpInstancePeers,
    clock: Clock,
    sessions: SessionStore | None = None,
    instances: InstanceStore | None = None,
) -> PlacementController:
    """The controller the options describe, over ``index`` (and ``sessions`` and
    ``instances``: in memory when ``None``).

    Raises:
        BadRequest: an unparsable ``--scale-up-hook`` command.
    """
    config = pc_config(args)
    policy = SleepPolicy(threshold_load=config.sleep_threshold, min_low_ms=config.sleep_after_ms)
    hook = None if args.scale_up_hook is None else scale_up_hook(args.scale_up_hook)
    return PlacementController(
        InstanceRegistry(policy),
        index,
        peers,
        clock,
        config,
        scale_up=hook,
        sessions=sessions,
        instances=instances,
    )


@dataclass(frozen=True, slots=True)
class PCStores:
    """The PC's session, shard map and instance stores ``--store`` names (``None``: in this
    process's memory) and the lifespans that close them."""

    sessions: SessionStore | None
    shard_maps: ShardMapStore | None
    lifespans: tuple[Lifespan, ...]
    instances: InstanceStore | None = None


def open_pc_stores(url: str) -> PCStores:
    """The PC stores of ``--store``: in memory for ``memory``; for ``redis://…`` the Redis ones
    (:mod:`kvsp.stores.redis_sessions`, :mod:`kvsp.stores.redis_shardmaps`,
    :mod:`kvsp.stores.redis_instances`), so that every PC process on that Redis shares
    sessions, shard maps and the instance registry.

    Raises:
        BadRequest: a bad URL, or the ``redis`` package is not installed.
        StoreUnavailable: Redis does not answer.
    """
    if url == "memory":
        return PCStores(None, None, ())
    try:
        from kvsp.stores.redis import RedisStore
        from kvsp.stores.redis_instances import RedisInstanceStore
        from kvsp.stores.redis_sessions import RedisSessionStore
        from kvsp.stores.redis_shardmaps import RedisShardMaps
    except ModuleNotFoundError as exc:
        if exc.name != "redis":
            raise
        raise BadRequest("--store redis://… needs the redis package (kvsp[redis])") from None
    RedisStore.from_url(url).check_reachable()  # a clear error now rather than a failing request
    sessions, maps = RedisSessionStore.from_url(url), RedisShardMaps.from_url(url)
    instances = RedisInstanceStore.from_url(url)

    @contextlib.asynccontextmanager
    async def close() -> AsyncIterator[None]:
        try:
            yield
        finally:
            await sessions.aclose()
            await maps.aclose()
            await instances.aclose()

    return PCStores(sessions, maps, (close,), instances)


def closing(*clients: HttpInstancePeers | BaseClient) -> Lifespan:
    """A lifespan that closes ``clients`` at shutdown."""

    @contextlib.asynccontextmanager
    async def close() -> AsyncIterator[None]:
        try:
            yield
        finally:
            for client in clients:
                await client.aclose()

    return close


def run(args: argparse.Namespace) -> int:
    """Serve the PC apart from the IS until SIGTERM/SIGINT; returns the exit status.

    Raises:
        BadRequest: unreadable token files or a bad option.
        StoreUnavailable: ``--store`` names a Redis that does not answer.
        DescriptorError: a ``--descriptor`` file is not a valid descriptor.
    """
    serving = serve_config(args)
    principals = load_principals(args)
    index_token = read_token(args.index_token_file, "--index-token-file")
    registry = DescriptorRegistry(args.state / "descriptors")
    registry.load_folder()
    registry.load_files(args.descriptor)
    clock = SystemClock()
    peers = HttpInstancePeers(directive_token(args))
    client = IndexClient(args.index, index_token)
    stores = open_pc_stores(args.store)
    pc = build_controller(
        args, RemoteIndex(client, registry), peers, clock, stores.sessions, stores.instances
    )
    lifespans = [closing(peers, client), *stores.lifespans]
    app = create_pc_app(pc, principals=principals, clock=clock, extra_lifespans=lifespans)
    coordinator = coordinator_for(directive_token(args), clock, store=stores.shard_maps)
    app.router.routes.extend(reshard_routes(coordinator))
    return serve(app, serving)
