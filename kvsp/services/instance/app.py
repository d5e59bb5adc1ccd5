"""The inference instance over HTTP (spec §6.3 PUT state, §6.5 prefetch, §6.6–6.7 holder face;
DESIGN.md §3 resource table) and ``kvsp serve instance``.

Routes (relative to the instance's base URL):

======  ============================ ==========================================================
POST    ``prefetch``                  §6.5 directive → 202, ``Location: prefetch/{directive}``,
                                      body the directive's status (role ``pc``)
GET     ``prefetch/{directive}``      ``{"directive", "state", "loaded": [hex32...], "detail"?}``;
                                      ``?wait_ms=N`` (up to 60000) answers once the directive
                                      stopped or after N ms, whichever is first (a long poll)
PUT     ``state``                     ``{"state": "active"|"draining"|"sleeping"}`` from the PC
                                      → 200 ``{"state": now}``; 409 for a move §6.3 forbids
POST    ``generate``                  ``{"prompt": [uint32...], "max_tokens": n, "scope_key"?:
                                      hex, "scope_id"?: hex16, "session"?: uuid, "sampler"?:
                                      {"method", "params"?, "seed"?, "deterministic"?}}`` →
                                      200 ``application/x-ndjson``, one ``{"index", "epoch",
                                      "token"}`` per line (role ``client``)
GET     ``sessions/{s}/tokens?from=N``  the session's tokens from index N, NDJSON as above
                                      (role ``client``; §6.8 reattaching)
POST    ``sessions/{s}/resume``       ResumeRequest (§6.8) → 200 ``{"session", "epoch",
                                      "output_offset", "loaded_prompt_blocks",
                                      "loaded_generated_blocks", "recomputed_tokens"}``; 409
                                      ``kvsp-stale-epoch`` for an epoch not above its own
                                      (role ``pc``)
GET     ``sessions/{s}``              the instance's view of a session it serves
GET     ``status``                    the Instance Status Record it would send now (roles
                                      ``pc``, ``instance``)
GET/PUT ``blocks/…``, ``leases…``     the holder face (§6.6, §6.7) over what it computed/loaded
GET     ``healthz``                   liveness, no token
======  ============================ ==========================================================

**Scope key.** Block Keys need the scope key (§4.2). A request carries it as ``scope_key``
(hex, at least 32 octets) or names a scope configured with ``--scope-key-file`` by
``scope_id``; with neither, the single configured scope is used (the single-tenant default).
The principal must be authorized for the scope either way. Generation answers carry
``KVSP-Loaded-Blocks`` and ``KVSP-Computed-Blocks`` (how many prompt blocks were loaded and
computed). An error after the stream started ends it with one ``{"error": problem}`` line.

**Sessions** (§6.8). A generate request with ``session`` (placed by the PC with that id) runs
as a session of :mod:`kvsp.services.instance.sessions`: it checkpoints to the PC, survives the
reader (``GET sessions/{s}/tokens?from=N`` reattaches), and can be resumed elsewhere. It needs
the scope key configured with ``--scope-key-file`` (a resumed instance computes the keys of
generated blocks with it). Without ``session`` a generation is greedy unless a ``sampler``
says otherwise, and never checkpointed.

**Leaving** (SIGTERM or SIGINT, :func:`leave`): the instance reports draining at once (§6.3: no
new work), lets its in-flight sessions and directives finish for up to ``--drain-timeout``
seconds, withdraws all its replicas at the IS in one request (``DELETE holders/{holder_id}/
replicas``) and ends its epoch at the PC (``DELETE instances/{instance_id}?epoch=E``, which
moves any session left, §6.8), then exits 0. Each step is logged at info; a step that fails is
logged at warning and the next one is still tried. ``--pc`` and ``--index`` take several
URLs (:mod:`kvsp.web.failover`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import logging
import re
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from kvsp.audience import origins
from kvsp.compat import CompatibilityDescriptor
from kvsp.engine.api import GREEDY, InferenceEngine, Sampling
from kvsp.errors import BadRequest, KVSPError, NotFound
from kvsp.ids import ScopeId
from kvsp.keys import scope_id as scope_id_of
from kvsp.records import PrefetchDirective, ResumeRequest, StateAnswer
from kvsp.records_common import UINT32_MAX, read_uuid
from kvsp.registries import Tier
from kvsp.services.descriptors import descriptor_routes
from kvsp.services.holder import Holder, HolderConfig, holder_routes
from kvsp.services.instance.requests import GenerateRequest
from kvsp.services.instance.reshard import agent_reshard_routes
from kvsp.services.instance.service import InstanceAgent, InstanceConfig, Session
from kvsp.services.instance.sessions import InstanceSessions, LiveSession, SessionConfig
from kvsp.stores.descriptors import DescriptorRegistry, read_descriptor_file
from kvsp.transfer.relay_link import RelayAttachment, add_relay_arguments, check_relay_argument
from kvsp.web.auth import Principals, principal_of, require_scope
from kvsp.web.cliargs import (
    add_deprecated_aliases,
    load_principals,
    parse_size,
    positive_int,
    positive_size,
    require_option,
    serve_config,
    trust_from_args,
)
from kvsp.web.clock import Clock, SystemClock
from kvsp.web.failover import add_url_list_argument
from kvsp.web.http import JsonLimits, install_operations, read_json
from kvsp.web.metrics import arrival
from kvsp.web.problems import dumps_json, install_problem_handlers, kvsp_json
from kvsp.web.roles import install_roles
from kvsp.web.runner import ServeConfig, freeze_startup_heap, serve_async
from kvsp.web.sites import add_site_arguments, site_labels

_log = logging.getLogger("kvsp.instance")

NDJSON = "application/x-ndjson"
JSON_LIMIT = 1 << 20
DIRECTIVE_LIMIT = 64 << 20
"""A directive lists up to a million blocks with their sources."""
_DIRECTIVE_LIMITS = JsonLimits(
    max_octets=DIRECTIVE_LIMIT, max_items=DIRECTIVE_LIMIT // 8, max_containers=DIRECTIVE_LIMIT // 32
)
"""Each block is an object with a key and an array of sources (at least ~70 octets)."""
PROMPT_LIMIT = 64 << 20
"""A prompt of a million tokens as JSON numbers."""


def _resolve_scope(agent: InstanceAgent, body: GenerateRequest) -> tuple[ScopeId, bytes]:
    if body.scope_key is not None:
        return scope_id_of(body.scope_key), body.scope_key
    if body.scope_id is not None:
        return body.scope_id, agent.scope_key_for(body.scope_id)
    configured = list(agent.config.scope_keys.items())
    if len(configured) != 1:
        raise BadRequest("name the scope: scope_key or scope_id", path="$.scope_key")
    scope, key = configured[0]
    return ScopeId(scope), key


def _no_first() -> None:
    pass


async def _ndjson(
    session: Session, sampling: Sampling = GREEDY, first: Callable[[], None] = _no_first
) -> AsyncIterator[bytes]:
    try:
        async for index, token in session.tokens(sampling):
            if index == 0:
                first()  # metrics: time to first token
            line = {"index": index, "epoch": session.epoch, "token": token}
            yield dumps_json(line) + b"\n"
    except KVSPError as exc:
        yield dumps_json({"error": exc.to_problem()}) + b"\n"
    except Exception:
        _log.exception("generation failed")
        yield dumps_json({"error": {"status": 500, "title": "Internal error"}}) + b"\n"


async def _session_ndjson(
    live: LiveSession, start: int, first: Callable[[], None] = _no_first
) -> AsyncIterator[bytes]:
    try:
        async for index, token in live.stream(start):
            if index == 0:
                first()  # metrics: time to first token
            yield dumps_json({"index": index, "epoch": live.epoch, "token": token}) + b"\n"
    except KVSPError as exc:
        yield dumps_json({"error": exc.to_problem()}) + b"\n"


_DECIMAL = re.compile(r"0|[1-9][0-9]{0,9}")


def _read_from(request: Request) -> int:
    text = request.query_params.get("from", "0")
    if _DECIMAL.fullmatch(text) is None or int(text) > UINT32_MAX:
        raise BadRequest(f"from must be a decimal index, got {text[:40]!r}", path="from")
    return int(text)


def _stream(body: AsyncIterator[bytes], headers: dict[str, str]) -> StreamingResponse:
    return StreamingResponse(
        body, media_type=NDJSON, headers={**headers, "cache-control": "no-store"}
    )


class _InstanceEndpoints:
    def __init__(self, agent: InstanceAgent, sessions: InstanceSessions | None) -> None:
        self.agent = agent
        self.sessions = sessions

    def _sessions(self) -> InstanceSessions:
        if self.sessions is None:
            raise BadRequest("this instance keeps no sessions (it has no PC to checkpoint to)")
        return self.sessions

    async def post_prefetch(self, request: Request) -> Response:
        principal = principal_of(request)
        directive = PrefetchDirective.from_json(await read_json(request, _DIRECTIVE_LIMITS))
        require_scope(principal, directive.scope_id)
        progress = self.agent.accept_directive(directive)
        where = f"prefetch/{directive.directive}"
        if self.agent.public_url is not None:
            where = self.agent.public_url + where
        return kvsp_json(progress.status().to_json(), status=202, headers={"location": where})

    async def get_prefetch(self, request: Request) -> Response:
        principal = principal_of(request)
        directive = read_uuid(request.path_params["directive"], "directive")
        progress = self.agent.directives.get(directive)
        require_scope(principal, progress.directive.scope_id)
        wait = request.query_params.get("wait_ms")
        if wait is not None:
            await self.agent.wait_directive(progress, _wait_ms(wait) / 1000)
        return kvsp_json(progress.status().to_json())

    async def put_state(self, request: Request) -> Response:
        principal_of(request)  # role pc: kvsp.web.roles
        body = StateAnswer.from_json(await read_json(request, JSON_LIMIT))
        return kvsp_json({"state": str(self.agent.change_state(body.state))})

    async def post_generate(self, request: Request) -> Response:
        principal = principal_of(request)
        limits = JsonLimits.for_array(
            self.agent.config.max_prompt_tokens, 16, PROMPT_LIMIT, strings=False
        )  # one array of token ids
        body = GenerateRequest.from_json(await read_json(request, limits))
        scope, key = _resolve_scope(self.agent, body)
        require_scope(principal, scope)
        arrived = arrival(request)
        first = functools.partial(self.agent.meter.first_token, arrived)  # metrics
        if body.session is not None:
            return await self._open_session(body, scope, key, first)
        session = await self.agent.open_session(body.prompt, body.max_tokens, scope, key)
        headers = {
            "kvsp-loaded-blocks": str(session.loaded_blocks),
            "kvsp-computed-blocks": str(session.computed_blocks),
            "cache-control": "no-store",
        }
        return StreamingResponse(
            _ndjson(session, body.sampling, first),
            media_type=NDJSON,
            headers=headers,
            background=BackgroundTask(session.close),
        )

    async def _open_session(
        self, body: GenerateRequest, scope: ScopeId, key: bytes, first: Callable[[], None]
    ) -> Response:
        if body.session is None:
            raise BadRequest("no session", path="$.session")
        live, opened = await self._sessions().open(
            body.session,
            body.prompt,
            body.max_tokens,
            scope,
            key,
            body.sampling,
            body.deterministic,
        )
        headers = {
            "kvsp-loaded-blocks": str(opened.loaded_blocks),
            "kvsp-computed-blocks": str(opened.computed_blocks),
        }
        return _stream(_session_ndjson(live, 0, first), headers)

    async def get_tokens(self, request: Request) -> Response:
        principal = principal_of(request)
        live = self._sessions().get(read_uuid(request.path_params["session"], "session"))
        require_scope(principal, live.scope)
        return _stream(_session_ndjson(live, _read_from(request)), {})

    async def get_session(self, request: Request) -> Response:
        principal = principal_of(request)
        live = self._sessions().get(read_uuid(request.path_params["session"], "session"))
        require_scope(principal, live.scope)
        return kvsp_json(live.view())

    def _resume_limits(self) -> JsonLimits:
        """A checkpoint holds token ids (prompt tail, generated) and the prompt's block keys."""
        tokens = self.agent.config.max_prompt_tokens
        blocks = tokens // self.agent.descriptor.block_tokens + 1
        limits = JsonLimits.for_array(2 * tokens + blocks, 16, PROMPT_LIMIT, strings=False)
        return dataclasses.replace(limits, max_strings=blocks + 1024)

    async def post_resume(self, request: Request) -> Response:
        principal = principal_of(request)
        session = read_uuid(request.path_params["session"], "session")
        body = ResumeRequest.from_json(await read_json(request, self._resume_limits()))
        if body.checkpoint.session != session:
            raise BadRequest("the checkpoint is of another session", path="$.checkpoint.session")
        require_scope(principal, body.checkpoint.scope_id)
        outcome = await self._sessions().resume(body)
        return kvsp_json(outcome.to_json())

    async def get_status(self, request: Request) -> Response:
        principal_of(request)
        if self.agent.public_url is None:
            raise NotFound("the instance does not know its URL yet")
        return kvsp_json(self.agent.status_record().to_json())


async def healthz(request: Request) -> Response:
    """Liveness: answers without a token and says nothing about the contents."""
    return kvsp_json({"status": "ok"})


@contextlib.asynccontextmanager
async def instance_lifespan(
    agent: InstanceAgent, sessions: InstanceSessions | None = None
) -> AsyncIterator[None]:
    """Start the agent with the app; stop its sessions and it (withdrawing its records) at
    the end."""
    await agent.start()
    try:
        yield
    finally:
        if sessions is not None:
            await sessions.close()
        await agent.close()


def create_instance_app(
    agent: InstanceAgent,
    principals: Principals,
    clock: Clock,
    *,
    body_limit: int = 256 << 20,
    descriptors: DescriptorRegistry | None = None,
    sessions: InstanceSessions | None = None,
) -> Starlette:
    """The instance as a Starlette app: its own routes, the holder face, and (with
    ``descriptors``) the ``descriptors/{compat}`` routes. Without ``sessions`` it takes no
    §6.8 sessions (generate with ``session`` and the ``sessions/…`` routes answer 400)."""
    ep = _InstanceEndpoints(agent, sessions)
    routes = [
        Route("/prefetch", ep.post_prefetch, methods=["POST"]),
        Route("/prefetch/{directive}", ep.get_prefetch, methods=["GET"]),
        Route("/state", ep.put_state, methods=["PUT"]),
        Route("/generate", ep.post_generate, methods=["POST"]),
        Route("/sessions/{session}/tokens", ep.get_tokens, methods=["GET"]),
        Route("/sessions/{session}/resume", ep.post_resume, methods=["POST"]),
        Route("/sessions/{session}", ep.get_session, methods=["GET"]),
        Route("/status", ep.get_status, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        *holder_routes(agent.holder, body_limit),
    ]
    if descriptors is not None:
        routes += descriptor_routes(descriptors)
    app = Starlette(routes=routes, lifespan=lambda _app: instance_lifespan(agent, sessions))
    app.state.principals = principals
    app.state.clock = clock
    app.state.agent = agent
    app.state.audiences = lambda: origins([agent.public_url])
    install_roles(app, "instance")
    install_problem_handlers(app)
    install_operations(app, "instance", "KVSP inference instance", readiness=agent.readiness)
    return app


# --- command line ------------------------------------------------------------------------------


def _tier_size(text: str) -> tuple[Tier, int]:
    name, sep, value = text.partition("=")
    try:
        tier = Tier(name.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"unknown tier {name!r}") from None
    if not sep:
        raise argparse.ArgumentTypeError(f"expected TIER=SIZE, got {text!r}")
    return tier, parse_size(value)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the instance's options (``kvsp serve instance``)."""
    d = InstanceConfig()
    add = parser.add_argument
    # --pc is required; given as --control too, so argparse cannot check it: run() does
    pc = add_url_list_argument(
        parser, "--pc", dest="control", help="the PC (or kvsp serve control); required"
    )
    add_deprecated_aliases(parser, pc, "--control")
    add_url_list_argument(parser, "--index", help="the IS, when apart from the PC (default: --pc)")
    add(
        "--token-file",
        required=True,
        type=Path,
        metavar="FILE",
        help="its own bearer token (role instance), for the PC and the IS alike",
    )
    engines = ["toy", "reference", "transformers"]
    add("--engine", choices=engines, default="toy", help="the engine (default toy)")
    add("--descriptor", type=Path, metavar="D.json", help="Compatibility Descriptor to compute")
    add("--kv-capacity-blocks", type=positive_int, default=1024, metavar="N")
    add("--model", type=Path, metavar="DIR", help="checkpoint folder (reference, transformers)")
    add("--device", default="cpu", help="torch device (reference, transformers; default cpu)")
    add("--block-tokens", type=positive_int, default=16, metavar="B", help="(torch engines)")
    add("--kv-dtype", default="fp32", metavar="T", help="KV element type (reference; fp32)")
    add("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="compute (reference)")
    add("--public-url", metavar="URL", help="base URL it is known by (default: its own)")
    add_site_arguments(parser)
    add("--status-ttl-ms", type=positive_int, default=d.status_ttl_ms, metavar="MS")
    add("--batch-size", type=positive_int, default=d.batch_size, metavar="N")
    add("--prefetch-concurrency", type=positive_int, default=d.prefetch_concurrency)
    add("--prefetch-window", type=positive_int, default=d.prefetch_window, metavar="N")
    add(
        "--prefetch-pipeline",
        choices=["on", "off"],
        default="on" if d.pipeline else "off",
        help="on: batched leases and publications, transfers overlapped (default); off: one "
        "block after another, each with its own lease and publication",
    )
    add(
        "--pipeline-transfers",
        type=positive_int,
        default=d.pipeline_transfers,
        metavar="N",
        help=f"with the pipeline: block transfers at once (default {d.pipeline_transfers})",
    )
    add(
        "--pipeline-octets",
        type=positive_size,
        default=d.pipeline_octets,
        metavar="SIZE",
        help="with the pipeline: most octets of blocks in transfer at once (default 8MiB)",
    )
    add("--sleep-threshold", type=float, metavar="LOAD", help="ask to sleep below this load")
    add("--sleep-after-ms", type=positive_int, default=d.sleep_after_ms, metavar="MS")
    add("--record-ttl-ms", type=positive_int, default=600_000, metavar="MS")
    add(
        "--drain-timeout",
        type=_seconds,
        default=DRAIN_TIMEOUT_S,
        metavar="S",
        help="on SIGTERM, seconds in-flight sessions and directives may take before the "
        f"instance withdraws its replicas and leaves (default {DRAIN_TIMEOUT_S:g})",
    )
    add_relay_arguments(parser)
    add(
        "--scope-key-file",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="a scope key (hex, >= 32 octets) for requests without one; repeatable",
    )
    add(
        "--tier",
        type=_tier_size,
        action="append",
        default=[],
        metavar="TIER=SIZE",
        help="holder-face tier and budget, e.g. host=2GiB (default host=1GiB)",
    )
    add_session_arguments(parser)


DRAIN_TIMEOUT_S = 30.0
"""How long a stopping instance waits for its in-flight work by default."""
LEAVE_STEP_S = 10.0
"""The longest one request of leaving (the status report, the withdrawal, the epoch's end)
may take."""


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1e9:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return value


async def leave(
    agent: InstanceAgent, index: _Withdraws, pc: _EndsEpochs, drain_timeout_s: float
) -> None:
    """Leave gracefully (SIGTERM): report draining, let in-flight work finish for at most
    ``drain_timeout_s``, withdraw every replica of this instance at the IS, end the epoch at
    the PC. Each step is logged; a failed step does not stop the next."""
    url = agent.public_url
    try:
        async with asyncio.timeout(LEAVE_STEP_S):
            await agent.begin_leaving()
        _log.info("leaving: state %s reported to the PC; no new work", agent.state)
    except (KVSPError, TimeoutError) as exc:
        _log.warning("leaving: reporting draining to the PC failed: %s", exc or "timed out")
    if await agent.wait_idle(drain_timeout_s):
        _log.info("leaving: in-flight sessions and directives finished")
    else:
        sessions, directives = agent.busy()
        _log.warning(
            "leaving: %d sessions and %d directives still running after %g s; leaving anyway",
            sessions,
            directives,
            drain_timeout_s,
        )
    await agent.stop_reporting()
    if url is None:
        _log.warning("leaving: the instance never learned its URL; nothing to withdraw")
        return
    await _leave_step("withdrawing the replicas at the IS", _withdraw_all(agent, index, url))
    await _leave_step(f"ending epoch {agent.epoch} at the PC", _end_epoch(agent, pc, url))


async def _withdraw_all(agent: InstanceAgent, index: _Withdraws, url: str) -> str:
    withdrawn = await index.withdraw_holder(url)
    agent.holder.forget_published()
    return f"{withdrawn} withdrawn"


async def _end_epoch(agent: InstanceAgent, pc: _EndsEpochs, url: str) -> str:
    try:
        await pc.end_epoch(url, agent.epoch)
    except NotFound:
        return "the PC did not know it"
    return "done"


async def _leave_step(what: str, step: Coroutine[Any, Any, str]) -> None:
    try:
        async with asyncio.timeout(LEAVE_STEP_S):
            outcome = await step
    except (KVSPError, TimeoutError) as exc:
        _log.warning("leaving: %s failed: %s", what, exc or "timed out")
        return
    _log.info("leaving: %s: %s", what, outcome)


class _Withdraws(Protocol):
    async def withdraw_holder(self, holder: str, /) -> int: ...


class _EndsEpochs(Protocol):
    async def end_epoch(self, instance: str, epoch: int, /) -> None: ...


def _delay_ms(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number of ms >= 0, got {text!r}")
    return value


def add_session_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of §6.8 sessions (checkpoints, the release gate, replicas)."""
    d = SessionConfig()
    add = parser.add_argument
    add(
        "--checkpoint-every",
        type=positive_int,
        default=d.checkpoint_every,
        metavar="N",
        help=f"checkpoint at least every N output tokens (default {d.checkpoint_every})",
    )
    add(
        "--gate-batch",
        type=positive_int,
        default=d.gate_batch,
        metavar="N",
        help="non-deterministic samplers: new tokens a checkpoint waits for before tokens are "
        f"released (default {d.gate_batch})",
    )
    add(
        "--replica-holder",
        action="append",
        default=[],
        metavar="URL",
        help="a holder that keeps copies of session blocks, so they outlive this instance "
        "(repeatable)",
    )
    add("--session-log", type=Path, metavar="FILE", help="append token releases as JSON lines")
    add(
        "--toy-decode-ms",
        type=_delay_ms,
        default=0.0,
        metavar="MS",
        help="--engine toy: emulated device time of each decode round (default 0)",
    )


def session_config(args: argparse.Namespace) -> SessionConfig:
    """The :class:`SessionConfig` the options describe."""
    return SessionConfig(
        checkpoint_every=args.checkpoint_every,
        gate_batch=args.gate_batch,
        replica_holders=tuple(args.replica_holder),
        log=args.session_log,
    )


def _read_secret(path: Path, what: str) -> str:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise BadRequest(f"cannot read {what} {path}: {exc.strerror}") from None
    if not text:
        raise BadRequest(f"{what} {path} is empty")
    return text


def _scope_keys(paths: list[Path]) -> dict[bytes, bytes]:
    keys: dict[bytes, bytes] = {}
    for path in paths:
        text = _read_secret(path, "--scope-key-file")
        try:
            key = bytes.fromhex(text)
        except ValueError:
            raise BadRequest(f"--scope-key-file {path}: expected hex") from None
        keys[scope_id_of(key)] = key
    return keys


MAX_WAIT_MS = 60_000
"""The longest ``GET prefetch/{directive}?wait_ms=`` holds the request."""


def _wait_ms(text: str) -> int:
    """The ``wait_ms`` query parameter: 0 to :data:`MAX_WAIT_MS` in ASCII digits.

    Raises:
        BadRequest: anything else.
    """
    if not (text.isascii() and text.isdigit() and len(text) <= 6) or int(text) > MAX_WAIT_MS:
        raise BadRequest(f"wait_ms must be 0 to {MAX_WAIT_MS}, got {text[:20]!r}", path="wait_ms")
    return int(text)


def instance_config(args: argparse.Namespace) -> InstanceConfig:
    """The :class:`InstanceConfig` the options describe.

    Raises:
        BadRequest: unreadable scope key files, a public URL without a trailing ``/``, a
            ``--relay`` it may not dial, or ``--zone`` without ``--site``.
    """
    if args.public_url is not None and not args.public_url.endswith("/"):
        raise BadRequest("--public-url must end in '/'")
    check_relay_argument(args)
    labels = site_labels(args)
    return InstanceConfig(
        public_url=args.public_url,
        status_ttl_ms=args.status_ttl_ms,
        batch_size=args.batch_size,
        prefetch_concurrency=args.prefetch_concurrency,
        prefetch_window=args.prefetch_window,
        pipeline=args.prefetch_pipeline == "on",
        pipeline_transfers=args.pipeline_transfers,
        pipeline_octets=args.pipeline_octets,
        sleep_threshold=args.sleep_threshold,
        sleep_after_ms=args.sleep_after_ms,
        state_dir=args.state,
        scope_keys=_scope_keys(args.scope_key_file),
        site=labels.site,
        zone=labels.zone,
        relay=args.relay,
    )


def make_engine(args: argparse.Namespace) -> InferenceEngine:
    """The engine ``--engine`` names: the toy engine computing ``--descriptor`` (its default
    otherwise), the torch reference engine over the checkpoint in ``--model``, or the
    transformers engine over the Hugging Face checkpoint in ``--model``.

    Raises:
        DescriptorError: an invalid descriptor file.
        BadRequest: ``--engine reference|transformers`` without ``--model`` or without its
            extra, or with a ``--descriptor`` that is not the model's.
        CheckpointError: the model folder cannot be loaded, or holds a model the transformers
            engine refuses (the message names the feature).
    """
    descriptor = None if args.descriptor is None else read_descriptor_file(args.descriptor)
    if args.engine == "reference":
        return _reference_engine(args, descriptor)
    if args.engine == "transformers":
        return _transformers_engine(args, descriptor)
    from kvsp.engine.toy import ToyEngine

    return ToyEngine(
        descriptor,
        capacity_blocks=args.kv_capacity_blocks,
        decode_delay_s=args.toy_decode_ms / 1000,
    )


def _reference_engine(
    args: argparse.Namespace, descriptor: CompatibilityDescriptor | None
) -> InferenceEngine:
    if args.model is None:
        raise BadRequest("--engine reference needs --model DIR (see: kvsp model init DIR)")
    from kvsp.engine.reference import TorchEngine

    try:
        engine = TorchEngine(
            args.model,
            device=args.device,
            num_pages=args.kv_capacity_blocks,
            block_tokens=args.block_tokens,
            kv_dtype=args.kv_dtype,
            dtype=args.dtype,
        )
    except ModuleNotFoundError as exc:  # torch is an optional extra (kvsp[engine])
        raise _missing_extra(exc, "reference", "engine", {"torch", "safetensors"}) from None
    return _matching(engine, descriptor, args.model)


def _transformers_engine(
    args: argparse.Namespace, descriptor: CompatibilityDescriptor | None
) -> InferenceEngine:
    if args.model is None:
        raise BadRequest("--engine transformers needs --model DIR (a Hugging Face checkpoint)")
    try:
        from kvsp.engine.transformers_engine import HFEngine

        engine = HFEngine(
            args.model,
            device=args.device,
            num_pages=args.kv_capacity_blocks,
            block_tokens=args.block_tokens,
            kv_dtype=args.kv_dtype,
        )
    except ModuleNotFoundError as exc:  # an optional extra (kvsp[transformers])
        modules = {"torch", "safetensors", "transformers", "tokenizers"}
        raise _missing_extra(exc, "transformers", "transformers", modules) from None
    return _matching(engine, descriptor, args.model)


def _missing_extra(
    exc: ModuleNotFoundError, engine: str, extra: str, modules: set[str]
) -> Exception:
    """The error for an engine whose optional extra is not installed (``exc`` itself when
    the missing module is not one of the extra's)."""
    if exc.name not in modules:
        return exc
    return BadRequest(f"--engine {engine} needs {exc.name}: pip install 'kvsp[{extra}]'")


def _matching(
    engine: InferenceEngine, descriptor: CompatibilityDescriptor | None, model: object
) -> InferenceEngine:
    """``engine``, when ``--descriptor`` (if given) is the descriptor of its model."""
    if descriptor is not None and descriptor != engine.descriptor:
        raise BadRequest(f"--descriptor is not the descriptor of the model in {model}")
    return engine


def run(args: argparse.Namespace) -> int:
    """Serve an instance until SIGTERM/SIGINT; returns the exit status.

    Raises:
        BadRequest: inconsistent options or unreadable files.
    """
    require_option(args, "control", "--pc", "the PC this instance reports to")
    config = instance_config(args)
    token = _read_secret(args.token_file, "--token-file")
    tiers = dict(args.tier) or {Tier.HOST: 1 << 30}
    holder_config = HolderConfig(
        public_url=args.public_url,
        tiers=tiers,
        state_dir=args.state,
        record_ttl_ms=args.record_ttl_ms,
        site=config.site,
        zone=config.zone,
    )
    engine = make_engine(args)
    registry = DescriptorRegistry()
    registry.add(engine.descriptor, persist=False)
    principals = load_principals(args)
    serving = serve_config(args)
    main = _serve(args, config, holder_config, token, engine, registry, principals, serving)
    # The stdlib loop, not uvloop: the bulk block client needs asyncio's own transports.
    with asyncio.Runner() as runner:
        runner.run(main)
    return 0


async def _serve(
    args: argparse.Namespace,
    config: InstanceConfig,
    holder_config: HolderConfig,
    token: str,
    engine: InferenceEngine,
    registry: DescriptorRegistry,
    principals: Principals,
    serving: ServeConfig,
) -> None:
    from kvsp.services.index.client import IndexClient
    from kvsp.services.pc.client import PCClient
    from kvsp.transfer.block_client import BlockClient

    clock = SystemClock()
    trust = trust_from_args(args)  # one TLS trust for the IS, PC, holders, leases and MOQT
    _log.info("%s", trust.describe())
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(engine.aclose)
        control = await stack.enter_async_context(
            IndexClient(args.control, token, trust=trust, service="PC")  # status records
        )
        index = control
        if args.index is not None:
            index = await stack.enter_async_context(IndexClient(args.index, token, trust=trust))
        try:
            await index.put_descriptor(engine.descriptor)
        except KVSPError as exc:
            _log.warning("registering the descriptor at the IS failed: %s", exc)
        relay = RelayAttachment(args, token, trust)  # moqt:// replicas; --relay: blocks there
        blocks = await stack.enter_async_context(
            BlockClient(token, moqt=relay.moqt_client(), trust=trust)
        )
        holder = Holder(holder_config, index=relay.index(index), descriptors=registry, clock=clock)
        relay.start(holder.store, stack)
        agent = InstanceAgent(engine, holder, index, blocks, control, clock, config)
        pc = await stack.enter_async_context(PCClient(args.control, token, trust=trust))
        sessions = InstanceSessions(agent, pc, session_config(args))
        app = create_instance_app(
            agent,
            principals,
            clock,
            body_limit=holder_config.body_limit,
            descriptors=registry,
            sessions=sessions,
        )
        app.router.routes.extend(agent_reshard_routes(agent, token))  # §6.9 POST reshard, shards/

        def on_serving(url: str) -> None:
            if config.public_url is None:
                agent.set_public_url(url)

        async def on_signal() -> None:
            await leave(agent, index, pc, args.drain_timeout)

        async def freeze_once_registered() -> None:
            await agent.registered.wait()  # started, warmed up, serving, known to the PC
            freeze_startup_heap(collect=True)  # what warming up left, before any directive

        freezer = asyncio.create_task(freeze_once_registered(), name="kvsp-freeze-heap")
        stack.callback(freezer.cancel)

        await serve_async(app, serving, on_serving=on_serving, on_signal=on_signal)


__all__ = [
    "configure_parser",
    "create_instance_app",
    "instance_config",
    "leave",
    "make_engine",
    "run",
]
