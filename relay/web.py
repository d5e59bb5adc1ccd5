"""The relay's holder face, HTTPS with the relay's certificate (plain HTTP without one): leases
on relay-held replicas (spec §6.6; DESIGN.md §3, §4).

Records published by the relay name this face in their ``lease_base`` member. Routes, with the
same JSON as the HTTP holder (:mod:`kvsp.services.holder.app`):

* ``POST leases`` ``{compat_id, scope_id, block_keys, ttl_ms}`` → 201 LeaseGrant,
  ``Location: leases/{id}``;
* ``PUT leases/{id}`` ``{ttl_ms}`` → 200 LeaseGrant; ``DELETE leases/{id}`` → 204;
* ``GET healthz`` (no token) → ``{"status": "ok"}``;
* ``GET metrics`` (role ``metrics``; :mod:`kvsp.web.metrics`: leases, and the MOQT octets
  of the relay named by ``app.state.relay``, those it sent as ``kvsp_block_served_bytes``),
  ``GET openapi.json`` (no token).

Errors are RFC 9457 problems. Every request but healthz needs ``Authorization: Bearer``; in
open mode (no principals) every request acts as an anonymous admin.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
from collections.abc import Generator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvsp.audience import origins
from kvsp.errors import NotFound
from kvsp.records import LeaseRenewal, LeaseRequest
from kvsp.web.auth import Principal, Principals, principal_of
from kvsp.web.clock import Clock
from kvsp.web.http import install_operations, read_json
from kvsp.web.problems import install_problem_handlers, kvsp_json
from kvsp.web.roles import install_roles
from kvsp.web.runner import (
    ReadTimeouts,
    base_url,
    bind_socket,
    bounded_protocol,
    http_protocol_class,
)

from .access import ANONYMOUS
from .holder import RelayHolder

JSON_LIMIT = 1 << 20
_LEASE_ID = re.compile(r"[A-Za-z0-9._~-]{1,128}")


def _principal(request: Request) -> Principal:
    if request.app.state.principals is None:
        return ANONYMOUS
    return principal_of(request)


def _lease_id(request: Request) -> str:
    lease_id: str = request.path_params["lease"]
    if _LEASE_ID.fullmatch(lease_id) is None:
        raise NotFound("no such lease")
    return lease_id


def create_app(holder: RelayHolder, principals: Principals | None, clock: Clock) -> Starlette:
    """The HTTP face as a Starlette app."""

    async def post_lease(request: Request) -> Response:
        principal = _principal(request)
        lease_request = LeaseRequest.from_json(await read_json(request, JSON_LIMIT))
        grant = holder.grant(principal, lease_request)
        headers = {"location": f"{holder.lease_base or ''}leases/{grant.lease}"}
        return kvsp_json(grant.to_json(), status=201, headers=headers)

    async def put_lease(request: Request) -> Response:
        principal = _principal(request)
        lease_id = _lease_id(request)
        renewal = LeaseRenewal.from_json(await read_json(request, JSON_LIMIT))
        return kvsp_json(holder.renew(principal, lease_id, renewal).to_json())

    async def delete_lease(request: Request) -> Response:
        principal = _principal(request)
        holder.release(principal, _lease_id(request))
        return Response(status_code=204)

    async def healthz(request: Request) -> Response:
        return kvsp_json({"status": "ok"})

    app = Starlette(
        routes=[
            Route("/leases", post_lease, methods=["POST"]),
            Route("/leases/{lease}", put_lease, methods=["PUT"]),
            Route("/leases/{lease}", delete_lease, methods=["DELETE"]),
            Route("/healthz", healthz, methods=["GET"]),
        ]
    )
    app.state.principals = principals
    app.state.clock = clock
    app.state.holder = holder
    # audience credentials for any URI of the relay (kvsp.audience), as over MOQT
    app.state.audiences = lambda: origins([holder.holder_url, holder.lease_base, *holder.carriers])
    install_roles(app, "relay-http", anonymous=ANONYMOUS)
    install_problem_handlers(app)
    install_operations(app, "relay", "KVSP relay (holder face)")
    return app


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the relay owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class HttpFace:
    """The HTTP face served by uvicorn inside the relay's event loop, with the read bounds of
    ``timeouts`` (:class:`~kvsp.web.runner.ReadTimeouts`)."""

    def __init__(
        self,
        app: Starlette,
        host: str,
        port: int,
        *,
        certfile: str | None = None,
        keyfile: str | None = None,
        log_level: str = "warning",
        timeouts: ReadTimeouts | None = None,
    ) -> None:
        self.app = app
        self._socket: socket.socket = bind_socket(host, port)
        self.url = base_url(host, self._socket.getsockname()[1], tls=certfile is not None)
        bounds = timeouts or ReadTimeouts()
        config = uvicorn.Config(
            app,
            lifespan="off",
            access_log=False,
            log_config=None,  # records go to the root logger: JSON under kvsp serve
            log_level=log_level,
            ssl_certfile=certfile,
            ssl_keyfile=keyfile,
            server_header=False,
            http=bounded_protocol(http_protocol_class(), bounds),  # head/body read bounds
            timeout_keep_alive=bounds.keep_alive_s,
        )
        self._server = _Server(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start serving; returns once the socket accepts connections."""
        self._task = asyncio.get_running_loop().create_task(
            self._server.serve(sockets=[self._socket])
        )
        while not self._server.started:
            if self._task.done():
                await self._task  # raises what stopped it
                raise RuntimeError("the holder face stopped during startup")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Stop serving and close the socket."""
        self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._socket.close()
