"""A service that leaves gracefully on its first signal (:func:`kvsp.web.runner.serve_async`
``on_signal``): it answers ``GET /ok`` throughout, and its leave writes ``leaving`` and, after
``--leave-s`` seconds, ``left`` to ``--marks``.

Run as ``python tests/support/leaving_app.py --ready-file F --marks M --leave-s S``."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvsp.web.runner import ServeConfig, serve_async


async def ok(request: Request) -> Response:
    return Response(b"ok")


def main(argv: list[str]) -> int:
    """Serve until the leave ends (or a second signal)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--ready-file", type=Path, required=True)
    parser.add_argument("--marks", type=Path, required=True)
    parser.add_argument("--leave-s", type=float, required=True)
    args = parser.parse_args(argv)

    async def leave() -> None:
        with args.marks.open("a") as marks:
            marks.write("leaving\n")
        await asyncio.sleep(args.leave_s)
        with args.marks.open("a") as marks:
            marks.write("left\n")

    app = Starlette(routes=[Route("/ok", ok)])
    config = ServeConfig(ready_file=args.ready_file, graceful_shutdown_s=1)
    asyncio.run(serve_async(app, config, on_signal=leave))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
