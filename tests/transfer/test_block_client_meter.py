"""What BlockClient.get_block counts into its FetchMeter (kvsp.web.meters; spec §6.7), against
the test holder (a real uvicorn process): a verified HTTP block's octets are its answer's body,
header included, by source; a failed attempt counts by its error class, and nothing else."""

from __future__ import annotations

import asyncio
import hashlib
import socket
import sys
from collections.abc import Iterator

import pytest

from kvsp.container import decode_container, header_size, replica_digest
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.records import ReplicaRecord
from kvsp.transfer.block_client import BlockClient
from kvsp.web.meters import FetchMeter
from kvsp.web.testing import RunningService, start_process
from tests.support import SUPPORT
from tests.support import bulk_server as srv

SERVER = SUPPORT / "bulk_server.py"
COMPAT, SCOPE = CompatId(bytes(range(32))), ScopeId(bytes(range(16)))
KEY = BlockKey(hashlib.sha256(b"block-client-meter").digest())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    folder = tmp_path_factory.mktemp("holder")
    with start_process([sys.executable, str(SERVER)], workdir=folder) as running:
        yield running


def record(holder: str) -> ReplicaRecord:
    digests = tuple(decode_container(srv.block_container(KEY)).layer_digests())
    return ReplicaRecord(
        block_key=KEY,
        compat_id=COMPAT,
        scope_id=SCOPE,
        holder=holder,
        codec=1,
        size=65_536,
        digest=replica_digest(digests),
        layer_digests=digests,
        residency=None,
        ttl_ms=60_000,
    )


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_get_block_counts_octets_seconds_and_failures_by_source(server: RunningService) -> None:
    base = server.base_url
    dead = f"http://127.0.0.1:{closed_port()}/"
    meter = FetchMeter()

    async def main() -> None:
        async with BlockClient(srv.TOKEN, meter=meter) as client:
            replicas = [record(h) for h in (dead, f"{base}missing/", f"{base}flip/")]
            replicas.append(record(f"{base}good/"))
            whole = await client.fetch(replicas, geometry=srv.GEOMETRY)
            assert whole is not None and whole.source == f"{base}good/"
            # a layer range, and a holder base named without its final slash
            part = await client.get_block(
                f"{base}chunked", record(f"{base}chunked/"), layers=(2, 4), geometry=srv.GEOMETRY
            )
            assert part.layer_count == 3

    asyncio.run(main())
    section = srv.GEOMETRY.section_length(srv.TOKENS)
    assert meter.octets == {
        ("http", f"{base}good/"): header_size(8) + 8 * 2 * section,  # the whole answer body
        ("http", f"{base}chunked/"): header_size(3) + 3 * 2 * section,
    }
    assert meter.latency[("http", f"{base}good/")].count == 1
    assert meter.latency[("http", f"{base}chunked/")].count == 1
    assert meter.latency[("http", f"{base}good/")].sum > 0
    assert meter.failures == {
        ("http", dead, "TransportError"): 1,
        ("http", f"{base}missing/", "NotFound"): 1,
        ("http", f"{base}flip/", "DigestMismatch"): 1,
    }
    assert set(meter.latency) == set(meter.octets)  # failures time nothing
