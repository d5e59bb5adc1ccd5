"""A small service used by the service-shell tests, in-process and as a real uvicorn process.

Run as ``python tests/support/apps.py --ready-file F [--principals P]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvsp.errors import NotFound
from kvsp.web.auth import Principals, principal_of, require_role, require_scope
from kvsp.web.clock import Clock, SystemClock
from kvsp.web.http import parse_codec_param, parse_layers_param, read_body, read_json
from kvsp.web.problems import install_problem_handlers, kvsp_json
from kvsp.web.runner import ServeConfig, serve

BODY_LIMIT = 1000
JSON_LIMIT = 4096
SECRET = "secret-marker-7f3a"


async def ok(request: Request) -> Response:
    return kvsp_json({"ok": True})


async def echo_json(request: Request) -> Response:
    return kvsp_json({"got": await read_json(request, JSON_LIMIT)})


async def count_body(request: Request) -> Response:
    return kvsp_json({"octets": len(await read_body(request, BODY_LIMIT))})


async def boom(request: Request) -> Response:
    raise RuntimeError(f"{SECRET}: this must not reach the client")


async def missing(request: Request) -> Response:
    raise NotFound("nothing here")


async def layers(request: Request) -> Response:
    first, last = parse_layers_param(request.query_params.get("layers", ""))
    codec = parse_codec_param(request.query_params.get("codec", "1"))
    return kvsp_json({"layers": [first, last], "codec": codec})


async def whoami(request: Request) -> Response:
    principal = principal_of(request)
    require_role(principal, "client")
    scope = request.query_params.get("scope")
    if scope is not None:
        require_scope(principal, bytes.fromhex(scope))
    return kvsp_json({"name": principal.name})


def create_app(principals: Principals, clock: Clock) -> Starlette:
    """The test service: each route exercises one piece of the service shell."""
    app = Starlette(
        routes=[
            Route("/ok", ok),
            Route("/json", echo_json, methods=["POST"]),
            Route("/body", count_body, methods=["POST"]),
            Route("/boom", boom),
            Route("/missing", missing),
            Route("/layers", layers),
            Route("/whoami", whoami),
        ]
    )
    install_problem_handlers(app)
    app.state.principals = principals
    app.state.clock = clock
    return app


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ready-file", type=Path, required=True)
    parser.add_argument("--principals", type=Path)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    principals = Principals.load(args.principals) if args.principals else Principals([])
    app = create_app(principals, SystemClock())
    return serve(app, ServeConfig(port=args.port, ready_file=args.ready_file))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
