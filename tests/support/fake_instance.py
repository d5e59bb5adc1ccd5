"""A fake inference instance for the PC process tests, in two separate processes so that a test
can kill one without the other:

* ``serve --log FILE``: the instance's HTTP face. ``POST prefetch`` answers 202 with a
  ``Location`` (§6.5), ``PUT state`` answers ``{"state"}`` (§6.3) and ``POST
  sessions/{session}/resume`` answers 200 (§6.8); each request is appended
  to FILE as one JSON line ``{"kind", "body", "authorization"}``.
* ``report --pc URL --token-file F --instance URI [--link HOLDER=MBIT ...]``: PUTs an Instance
  Status Record to the PC every ``ttl_ms / 3`` (§6.3), and writes the ready file after the
  first one is accepted.

Both take ``--ready-file F`` (as :func:`kvsp.web.testing.start_process` passes it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvsp.ids import uri_id
from kvsp.records import InstanceStatusRecord, Link
from kvsp.registries import InstanceState
from kvsp.web.runner import ServeConfig, serve, write_ready_file


def _app(log: Path) -> Starlette:
    def record(kind: str, body: Any, request: Request) -> None:
        entry = {"kind": kind, "body": body, "authorization": request.headers.get("authorization")}
        with log.open("a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")

    async def prefetch(request: Request) -> Response:
        body = await request.json()
        record("prefetch", body, request)
        directive = body["directive"]
        status = {"directive": directive, "state": "pending", "loaded": []}
        return JSONResponse(status, 202, headers={"location": f"prefetch/{directive}"})

    async def state(request: Request) -> Response:
        body = await request.json()
        record("state", body, request)
        return JSONResponse({"state": body["state"]})

    async def resume(request: Request) -> Response:
        record("resume", await request.json(), request)
        return JSONResponse({"session": request.path_params["session"]})

    return Starlette(
        routes=[
            Route("/prefetch", prefetch, methods=["POST"]),
            Route("/state", state, methods=["PUT"]),
            Route("/sessions/{session}/resume", resume, methods=["POST"]),
        ]
    )


def _link(text: str) -> Link:
    holder, _, rate = text.rpartition("=")
    return Link(holder=holder, mbit_per_s=float(rate), rtt_us=10.0)


def _report(args: argparse.Namespace) -> int:
    token = args.token_file.read_text().strip()
    record = InstanceStatusRecord(
        instance=args.instance,
        epoch=args.epoch,
        state=InstanceState.ACTIVE,
        running=0,
        queued=0,
        batch_size=8,
        kv_utilization=0.1,
        prefill_tokens_per_s=args.prefill,
        decode_tokens_per_s=1000.0,
        links=tuple(_link(text) for text in args.link),
        requested_state=None,
        ttl_ms=args.ttl_ms,
    )
    url = f"{args.pc}instances/{uri_id(args.instance)}/status"
    ready = False
    with httpx.Client(headers={"authorization": f"Bearer {token}"}, timeout=5) as client:
        while True:
            answer = client.put(url, json=record.to_json())
            print(answer.status_code, answer.text, flush=True)
            if answer.status_code == 200 and not ready:
                write_ready_file(args.ready_file, args.instance)
                ready = True
            time.sleep(args.ttl_ms / 3000)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    serving = sub.add_parser("serve")
    serving.add_argument("--log", type=Path, required=True)
    serving.add_argument("--ready-file", type=Path, required=True)
    reporting = sub.add_parser("report")
    reporting.add_argument("--pc", required=True)
    reporting.add_argument("--token-file", type=Path, required=True)
    reporting.add_argument("--instance", required=True)
    reporting.add_argument("--link", action="append", default=[])
    reporting.add_argument("--epoch", type=int, default=int(time.time() * 1000))
    reporting.add_argument("--prefill", type=float, default=10_000.0)
    reporting.add_argument("--ttl-ms", type=int, default=900)
    reporting.add_argument("--ready-file", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.mode == "report":
        return _report(args)
    return serve(_app(args.log), ServeConfig(port=0, ready_file=args.ready_file))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
