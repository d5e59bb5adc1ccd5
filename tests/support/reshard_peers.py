"""The PC's shard-map face and the instance's reshard face (spec §6.9) for the reshard tests,
in-process and as real uvicorn processes.

Run as ``python tests/support/reshard_peers.py pc|instance --principals P --token-file T
--ready-file F [--deadline-ms N] [--message-timeout-s S]``. The context is sharded with
:data:`GEOMETRY` (2 layers, 2 KV heads, head_dim 16, fp16: 256 octets per token, 16 MiB for
64k tokens); the test fills it with :func:`kvsp.engine.shards.seeded_kv`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.routing import BaseRoute

from kvsp.audience import origins
from kvsp.container import Geometry
from kvsp.services.instance.reshard import HttpRangeFetcher, ShardHolder
from kvsp.services.instance.reshard import reshard_routes as instance_routes
from kvsp.services.pc.reshard import HttpReshardPeers, ReshardConfig, ShardCoordinator
from kvsp.services.pc.reshard import reshard_routes as pc_routes
from kvsp.stores.shardmaps import MemoryShardMaps
from kvsp.web.auth import Principals, principal_entry
from kvsp.web.clock import Clock, SystemClock
from kvsp.web.problems import install_problem_handlers
from kvsp.web.roles import install_roles
from kvsp.web.runner import ServeConfig, serve_async

GEOMETRY = Geometry(layers=2, kv_heads=2, head_dim=16, element_size=2)
CONTEXT = 65_536
SEED = 2024
TOKENS = {
    "admin": "reshard-admin-token-0123456789abcdef",
    "pc": "reshard-pc-token-0123456789abcdef",
    "instance": "reshard-instance-token-0123456789abcdef",
    "client": "reshard-client-token-0123456789abcdef",
}


def principal_entries() -> list[dict[str, Any]]:
    """One principal per role in :data:`TOKENS` (the admin has every role)."""
    return [principal_entry(role, token, [role], None) for role, token in TOKENS.items()]


def auth(role: str) -> dict[str, str]:
    """The Authorization header of ``role``'s principal."""
    return {"authorization": f"Bearer {TOKENS[role]}"}


def _app(service: str, routes: list[BaseRoute], principals: Principals, clock: Clock) -> Starlette:
    app = Starlette(routes=routes)
    app.router.redirect_slashes = False
    app.state.principals = principals
    app.state.clock = clock
    # the URLs it is reached by: the audiences of the credentials it takes (kvsp.audience)
    app.state.own_urls = []
    app.state.audiences = lambda: origins(app.state.own_urls)
    install_roles(app, service)  # the service's role rules, as in the real app
    install_problem_handlers(app)
    return app


def create_instance_app(
    principals: Principals,
    clock: Clock,
    *,
    client: httpx.AsyncClient | None = None,
    page_tokens: int = 256,
) -> Starlette:
    """An instance's reshard face; its :class:`ShardHolder` is ``app.state.shards``."""
    holder = ShardHolder(GEOMETRY, page_tokens=page_tokens)
    fetcher = HttpRangeFetcher(TOKENS["instance"], GEOMETRY, client=client)
    app = _app("instance", instance_routes(holder, fetcher), principals, clock)
    app.state.shards = holder
    return app


def create_pc_app(
    principals: Principals,
    clock: Clock,
    *,
    client: httpx.AsyncClient | None = None,
    config: ReshardConfig | None = None,
) -> Starlette:
    """The PC's shard-map face over an in-memory store; the coordinator is
    ``app.state.coordinator``."""
    peers = HttpReshardPeers(TOKENS["pc"], client=client)
    coordinator = ShardCoordinator(MemoryShardMaps(), peers, clock, config)
    app = _app("pc", pc_routes(coordinator), principals, clock)
    app.state.coordinator = coordinator
    return app


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["pc", "instance"])
    parser.add_argument("--principals", type=Path, required=True)
    parser.add_argument("--ready-file", type=Path, required=True)
    parser.add_argument("--deadline-ms", type=int, default=10_000)
    parser.add_argument("--message-timeout-s", type=float, default=5.0)
    args = parser.parse_args(argv)
    principals = Principals.load(args.principals)
    clock = SystemClock()
    if args.role == "pc":
        config = ReshardConfig(
            deadline_ms=args.deadline_ms, message_timeout_s=args.message_timeout_s
        )
        app = create_pc_app(principals, clock, config=config)
    else:
        app = create_instance_app(principals, clock)
    serving = serve_async(app, ServeConfig(ready_file=args.ready_file), app.state.own_urls.append)
    with asyncio.Runner() as runner:
        runner.run(serving)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
