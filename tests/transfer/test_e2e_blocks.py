"""End to end on loopback: ``kvsp serve index`` and two ``kvsp serve holder`` processes, driven
by :class:`~kvsp.transfer.block_client.BlockClient` (spec §6.1, §6.6, §6.7).

A block is stored at a holder, which publishes it to the IS; the client looks it up, takes a
lease, gets layers 3..7 verified and releases the lease. A proxy that flips one body octet
gets a DigestMismatch and no block; a replica that has gone (404, the index being advisory)
falls through to the next holder.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import pytest

from kvsp.audience import audience_credential
from kvsp.compat import CompatibilityDescriptor, compat_id
from kvsp.container import Geometry, decode_container, encode_container
from kvsp.errors import DigestMismatch
from kvsp.ids import BlockKey, ScopeId
from kvsp.records import LeaseRequest, LookupRequest, ReplicaRecord
from kvsp.services.index.client import IndexClient
from kvsp.transfer.block_client import BlockClient, block_base, lease_base
from kvsp.web.auth import principal_entry, write_principals
from kvsp.web.testing import RunningService, start_process

pytestmark = pytest.mark.slow

DESCRIPTOR = CompatibilityDescriptor(
    model="e2e-blocks",
    model_digest=b"\x03" * 32,
    tokenizer_digest=b"\x04" * 32,
    layers=10,
    kv_heads=2,
    head_dim=16,
    kv_dtype="fp16",
    positional="rope",
    block_tokens=4,
)
GEOMETRY = Geometry.from_descriptor(DESCRIPTOR)
COMPAT = compat_id(DESCRIPTOR)
SCOPE = ScopeId(b"\x0b" * 16)
SERVICE_TOKEN = "e2e-service-token-0123456789abcdefghij"
CLIENT_TOKEN = "e2e-client-token-0123456789abcdefghijk"
T = TypeVar("T")


def key(n: int) -> BlockKey:
    return BlockKey(bytes([n]) * 32)


def container(n: int) -> bytes:
    half = GEOMETRY.section_length(DESCRIPTOR.block_tokens) // 2
    layers = [(bytes([n, i]) * half, bytes([i, n]) * half) for i in range(DESCRIPTOR.layers)]
    return encode_container(layers, first_layer=0, token_count=4, geometry=GEOMETRY)


SIZE = len(container(0))


def run(coro: Awaitable[T]) -> T:
    async def main() -> T:
        return await coro

    return asyncio.run(main())


@dataclass
class Services:
    index: RunningService
    holders: list[RunningService]

    async def lookup(self, n: int) -> list[ReplicaRecord]:
        request = LookupRequest(scope_id=SCOPE, compat_id=COMPAT, block_keys=(key(n),))
        async with IndexClient(self.index.base_url, CLIENT_TOKEN) as client:
            found = await client.lookup(request)
        return sorted(found.replicas[0] if found.replicas else (), key=self.rank)

    def rank(self, record: ReplicaRecord) -> int:
        return [h.base_url for h in self.holders].index(record.holder)


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    tmp = tmp_path_factory.mktemp("e2e")
    principals = tmp / "principals.toml"
    write_principals(
        principals,
        [
            principal_entry("service", SERVICE_TOKEN, ["admin"], None),
            principal_entry("client", CLIENT_TOKEN, ["client", "instance"], [SCOPE]),
        ],
    )
    (tmp / "service.token").write_text(SERVICE_TOKEN + "\n")
    (tmp / "descriptor.json").write_text(json.dumps(DESCRIPTOR.to_json()))
    kvsp = [sys.executable, "-m", "kvsp", "serve"]
    common = ["--listen", "127.0.0.1:0", "--principals", str(principals)]
    common += ["--descriptor", str(tmp / "descriptor.json")]
    started: list[RunningService] = []
    try:
        (tmp / "index").mkdir()
        index = start_process(
            [*kvsp, "index", *common, "--state", str(tmp / "index" / "state")],
            workdir=tmp / "index",
        )
        started.append(index)
        for name in ("a", "b"):
            folder = tmp / name
            folder.mkdir()
            argv = [*kvsp, "holder", *common, "--state", str(folder / "state")]
            argv += ["--index", index.base_url, "--index-token-file", str(tmp / "service.token")]
            argv += ["--tier", f"host={4 * SIZE}"]  # four blocks: a client may lease one of them
            started.append(start_process(argv, workdir=folder))
        yield Services(index, started[1:])
    finally:
        for service in reversed(started):
            service.stop()


def test_store_lookup_lease_and_get_a_layer_range(services: Services) -> None:
    holder = services.holders[0].base_url

    async def main() -> None:
        async with BlockClient(CLIENT_TOKEN) as client:
            assert await client.put_block(holder, COMPAT, SCOPE, key(1), container(1))
            assert not await client.put_block(holder, COMPAT, SCOPE, key(1), container(1))
            (record,) = await services.lookup(1)
            assert record.holder == holder and record.layer_digests is not None
            request = LeaseRequest(
                compat_id=COMPAT, scope_id=SCOPE, block_keys=(key(1),), ttl_ms=10_000
            )
            grant = await client.acquire_lease(lease_base(record), request)
            block = await client.get_block(
                block_base(record), record, layers=(3, 7), geometry=GEOMETRY
            )
            await client.release_lease(lease_base(record), grant.lease)
        assert block.producer_verified and (block.first_layer, block.layer_count) == (3, 5)
        want = decode_container(container(1)).select(3, 7)
        assert [bytes(x.k) + bytes(x.v) for x in block.layers] == [
            bytes(x.k) + bytes(x.v) for x in want.layers
        ]

    run(main())


async def corrupting_proxy(upstream: str, flip_at: int) -> tuple[asyncio.Server, str]:
    """A TCP proxy to ``upstream`` that flips the octet ``flip_at`` of each response body.

    The client binds its credential to the proxy's origin (:mod:`kvsp.audience`), which the
    holder would refuse; the proxy swaps it for the one bound to the holder, as a test-only
    stand-in for a holder that also answers to the proxy's name."""
    host, port = upstream.removeprefix("http://").rstrip("/").split(":")
    swap: list[tuple[bytes, bytes]] = []

    async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, flip: bool) -> None:
        seen = bytearray()
        body_start: int | None = None
        try:
            while data := await src.read(65536):
                if not flip:
                    for old, new in swap:
                        data = data.replace(old, new)
                if flip:
                    start = len(seen)
                    seen += data
                    if body_start is None and (end := seen.find(b"\r\n\r\n")) >= 0:
                        body_start = end + 4
                    target = None if body_start is None else body_start + flip_at
                    if target is not None and start <= target < len(seen):
                        data = bytearray(data)
                        data[target - start] ^= 0x40
                        flip = False
                dst.write(bytes(data))
                await dst.drain()
        except ConnectionError:
            pass
        finally:
            dst.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        try:
            await asyncio.gather(pump(reader, up_writer, False), pump(up_reader, writer, True))
        except asyncio.CancelledError:
            pass  # the test is over: its loop is closing
        finally:
            writer.close()
            up_writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    proxy = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
    as_proxy, as_holder = (audience_credential(CLIENT_TOKEN, u) for u in (proxy, upstream))
    swap.append((as_proxy.encode(), as_holder.encode()))
    return server, proxy


def test_a_flipped_octet_is_caught_and_nothing_is_handed_out(services: Services) -> None:
    holder = services.holders[0].base_url

    async def main() -> None:
        async with BlockClient(CLIENT_TOKEN) as client:
            await client.put_block(holder, COMPAT, SCOPE, key(2), container(2))
            (record,) = await services.lookup(2)
            server, proxy = await corrupting_proxy(holder, SIZE - 100)  # in the last layer
            range_server, range_proxy = await corrupting_proxy(holder, 100)  # in layer 8
            # The proxy flips the first response of each connection only, and the client may
            # reuse a connection, so each step gets a proxy (an origin) of its own.
            fetch_server, fetch_proxy = await corrupting_proxy(holder, SIZE - 100)
            async with server, range_server, fetch_server:
                with pytest.raises(DigestMismatch, match="layer 9"):
                    await client.get_block(proxy, record, geometry=GEOMETRY)
                with pytest.raises(DigestMismatch, match="layer 8"):
                    await client.get_block(range_proxy, record, layers=(8, 9), geometry=GEOMETRY)
                # the same replica through a proxy, then straight: fetch moves on
                relayed = [dataclasses.replace(record, holder=fetch_proxy), record]
                block = await client.fetch(relayed, geometry=GEOMETRY)
        assert block is not None and block.source == holder
        assert client.stats.sources[fetch_proxy].errors == {"DigestMismatch": 1}

    run(main())


def test_a_404_at_the_first_replica_falls_through_to_the_second(services: Services) -> None:
    first, second = (h.base_url for h in services.holders)

    async def main() -> None:
        async with BlockClient(CLIENT_TOKEN) as client:
            for holder in (first, second):
                await client.put_block(holder, COMPAT, SCOPE, key(3), container(3))
            stale = await services.lookup(3)
            assert [r.holder for r in stale] == [first, second]
            # the first holder has room for four blocks: storing four more evicts key 3 there
            for k in (4, 5, 6, 7):
                assert await client.put_block(first, COMPAT, SCOPE, key(k), container(k))
            block = await client.fetch(stale, layers=(0, 9), geometry=GEOMETRY)
            assert block is not None and block.source == second
            assert client.stats.sources[first].errors == {"NotFound": 1}
            assert [r.holder for r in await services.lookup(3)] == [second]

    run(main())
