"""A holder-like test server for the bulk path and the block client, as a real uvicorn process.

Run as ``python tests/support/bulk_server.py --ready-file F``. Each first path
segment is a "holder" with its own behaviour, so one process stands for several holders:

* ``good/``      serves blocks correctly (``Content-Length`` body, ``Repr-Digest``)
* ``chunked/``   serves them correctly as a chunked body in 48 KiB pieces
* ``badrepr/``   sends a ``Repr-Digest`` of other octets
* ``norepr/``    sends no ``Repr-Digest``
* ``garbled/``   sends a ``Repr-Digest`` that is not a valid structured field
* ``flip/``      flips one octet in layer 5 and sends the ``Repr-Digest`` of the flipped body
* ``truncate/``  breaks the connection halfway through the body
* ``missing/``   answers 404 ``kvsp-not-found`` to every GET
* ``transcode/`` answers with codec 2 in the header (and a matching ``Repr-Digest``)

Blocks are made from their key (:func:`block_layers`), so a test computes the same octets
and Replica Record without asking. Besides blocks: ``PUT`` stores (412 when present), leases
(``POST``/``PUT``/``DELETE``, 429 ``kvsp-lease-quota`` over 60 s), and for the HTTP tests
``bytes/{n}``, ``stream/{n}``, ``peer``, ``slow``, ``headers/{n}``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from kvsp.audience import audience_credential
from kvsp.container import Geometry, decode_container, encode_container
from kvsp.errors import (
    BadRequest,
    LayersUnavailable,
    LeaseQuota,
    NotFound,
    PreconditionFailed,
    Unauthorized,
)
from kvsp.records import LeaseGrant, LeaseRenewal, LeaseRequest
from kvsp.web.http import (
    parse_codec_param,
    parse_layers_param,
    parse_repr_digest,
    read_body,
    read_json,
    repr_digest,
)
from kvsp.web.problems import install_problem_handlers, kvsp_json
from kvsp.web.runner import ServeConfig, serve

TOKEN = "bulk-test-token-0123456789"
GEOMETRY = Geometry(layers=8, kv_heads=2, head_dim=64, element_size=2)
TOKENS = 16
"""8 layers × (K + V) × 16 tokens × 2 heads × 64 dims × 2 octets = 64 KiB of data per block."""
BLOCK_TYPE = "application/kvsp-block"
MAX_LEASE_MS = 60_000


def block_layers(key: bytes, geometry: Geometry = GEOMETRY, tokens: int = TOKENS) -> list[bytes]:
    """The K ‖ V octets of each layer of the block named ``key`` (deterministic)."""
    section = geometry.section_length(tokens)
    out = []
    for layer in range(geometry.layers):
        seed = hashlib.sha256(key + layer.to_bytes(4, "big")).digest()
        out.append((seed * (2 * section // 32 + 1))[: 2 * section])
    return out


def block_container(
    key: bytes,
    first: int = 0,
    last: int | None = None,
    codec: int = 1,
    geometry: Geometry = GEOMETRY,
    tokens: int = TOKENS,
) -> bytes:
    """The KVB1 container of layers ``first..last`` of the block named ``key``."""
    layers = block_layers(key, geometry, tokens)
    last = len(layers) - 1 if last is None else last
    half = len(layers[0]) // 2
    pairs = [(d[:half], d[half:]) for d in layers[first : last + 1]]
    return encode_container(pairs, first_layer=first, token_count=tokens, codec=codec)


@functools.lru_cache(maxsize=64)
def _served(
    key: bytes, first: int, last: int, codec: int, geometry: Geometry
) -> tuple[bytes, bytes]:
    body = block_container(key, first, last, codec, geometry)
    return body, hashlib.sha256(body).digest()


def _check_auth(request: Request) -> None:
    # Clients show a holder an audience credential for its origin (kvsp.audience).
    accepted = (f"Bearer {TOKEN}", f"Bearer {audience_credential(TOKEN, str(request.base_url))}")
    if request.headers.get("authorization") not in accepted:
        raise Unauthorized("bad or missing bearer token")


def _layers(request: Request, geometry: Geometry) -> tuple[int, int]:
    text = request.query_params.get("layers")
    first, last = parse_layers_param(text) if text else (0, geometry.layers - 1)
    if last >= geometry.layers:
        raise LayersUnavailable(f"layers {first}-{last} not held")
    return first, last


async def get_block(request: Request) -> Response:
    _check_auth(request)
    mode = request.path_params["mode"]
    key = bytes.fromhex(request.path_params["key"])
    stored: dict[bytes, bytes] = request.app.state.stored
    if mode == "missing" or (mode == "store" and key not in stored):
        raise NotFound("no such block")
    codec = parse_codec_param(request.query_params.get("codec", "1"))
    geometry: Geometry = request.app.state.geometry
    first, last = _layers(request, geometry)
    if mode == "store":
        body = decode_container(stored[key]).select(first, last).encode()
        digest = hashlib.sha256(body).digest()
    else:
        body, digest = _served(key, first, last, codec, geometry)
    if mode == "transcode":  # codec 2 is unregistered: only its number changes
        body = body[:6] + (2).to_bytes(2, "big") + body[8:]
        digest = hashlib.sha256(body).digest()
    if mode == "flip":
        flipped = bytearray(body)
        flipped[len(body) - 5 * len(body) // 16] ^= 0x01
        body = bytes(flipped)
        digest = hashlib.sha256(body).digest()
    headers = {"repr-digest": repr_digest(digest)}
    if mode == "badrepr":
        headers["repr-digest"] = repr_digest(hashlib.sha256(b"other").digest())
    if mode == "norepr":
        del headers["repr-digest"]
    if mode == "garbled":
        headers["repr-digest"] = "sha-256=:not base64:"
    if mode in ("chunked", "truncate"):
        return StreamingResponse(_pieces(body, mode == "truncate"), headers=headers)
    return Response(body, headers=headers, media_type=BLOCK_TYPE)


async def _pieces(body: bytes, truncate: bool) -> AsyncIterator[bytes]:
    step = 48 * 1024
    for offset in range(0, len(body), step):
        if truncate and offset >= len(body) // 2:
            raise ConnectionAbortedError("test server breaks the body off on purpose")
        yield body[offset : offset + step]
        await asyncio.sleep(0)


async def put_block(request: Request) -> Response:
    _check_auth(request)
    if request.headers.get("if-none-match") != "*":
        raise BadRequest("PUT needs If-None-Match: *")
    key = bytes.fromhex(request.path_params["key"])
    body = await read_body(request, 1 << 26)
    if parse_repr_digest(request.headers.get("repr-digest")) != hashlib.sha256(body).digest():
        raise BadRequest("Repr-Digest does not match the body")
    stored: dict[bytes, bytes] = request.app.state.stored
    if key in stored:
        raise PreconditionFailed("block already held")
    decode_container(body, request.app.state.geometry)
    stored[key] = body
    return Response(status_code=201)


async def post_lease(request: Request) -> Response:
    _check_auth(request)
    lease = LeaseRequest.from_json(await read_json(request, 1 << 20))
    if lease.ttl_ms > MAX_LEASE_MS:
        raise LeaseQuota(f"ttl_ms {lease.ttl_ms} over {MAX_LEASE_MS}")
    leases: dict[str, LeaseRequest] = request.app.state.leases
    name = f"l{len(leases) + 1}"
    leases[name] = lease
    grant = LeaseGrant(lease=name, ttl_ms=lease.ttl_ms, block_keys=lease.block_keys)
    return kvsp_json(grant.to_json(), status=201, headers={"location": f"leases/{name}"})


async def lease(request: Request) -> Response:
    _check_auth(request)
    leases: dict[str, LeaseRequest] = request.app.state.leases
    name = request.path_params["lease"]
    if name not in leases:
        raise NotFound(f"no lease {name}")
    if request.method == "DELETE":
        del leases[name]
        return Response(status_code=204)
    renewal = LeaseRenewal.from_json(await read_json(request, 1 << 16))
    if renewal.ttl_ms > MAX_LEASE_MS:
        raise LeaseQuota(f"ttl_ms {renewal.ttl_ms} over {MAX_LEASE_MS}")
    return kvsp_json(LeaseGrant(lease=name, ttl_ms=renewal.ttl_ms).to_json())


@functools.lru_cache(maxsize=8)
def pattern(n: int) -> bytes:
    """``n`` octets of a pattern the tests can recompute: octet i is i mod 251."""
    return (bytes(range(251)) * (n // 251 + 1))[:n]


async def some_bytes(request: Request) -> Response:
    n = int(request.path_params["n"])
    return Response(pattern(n), media_type="application/octet-stream")


async def stream_bytes(request: Request) -> Response:
    n = int(request.path_params["n"])
    data = pattern(n)

    async def gen() -> AsyncIterator[bytes]:
        for offset in range(0, n, 10_000):
            yield data[offset : offset + 10_000]

    return StreamingResponse(gen(), media_type="application/octet-stream")


async def peer(request: Request) -> Response:
    client = request.client
    return kvsp_json({"port": client.port if client else None})


async def slow(request: Request) -> Response:
    await asyncio.sleep(float(request.query_params.get("s", "5")))
    return kvsp_json({"slept": True})


async def big_headers(request: Request) -> Response:
    n = int(request.path_params["n"])
    return Response(b"ok", headers={f"x-filler-{i}": "v" * 1000 for i in range(n)})


def create_app(geometry: Geometry = GEOMETRY) -> Starlette:
    """The test holder, serving blocks of ``geometry`` (16 tokens each)."""
    block = "/{mode}/blocks/{compat}/{scope}/{key}"
    app = Starlette(
        routes=[
            Route(block, get_block, methods=["GET"]),
            Route(block, put_block, methods=["PUT"]),
            Route("/{mode}/leases", post_lease, methods=["POST"]),
            Route("/{mode}/leases/{lease}", lease, methods=["PUT", "DELETE"]),
            Route("/bytes/{n:int}", some_bytes),
            Route("/stream/{n:int}", stream_bytes),
            Route("/peer", peer),
            Route("/slow", slow),
            Route("/headers/{n:int}", big_headers),
        ]
    )
    install_problem_handlers(app)
    app.state.stored = {}
    app.state.leases = {}
    app.state.geometry = geometry
    return app


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ready-file", type=Path, required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument(
        "--geometry", default="8,2,64,2", help="layers,kv_heads,head_dim,element_size"
    )
    args = parser.parse_args(argv)
    layers, heads, dim, size = (int(x) for x in args.geometry.split(","))
    app = create_app(Geometry(layers, heads, dim, size))
    return serve(app, ServeConfig(port=args.port, ready_file=args.ready_file))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
