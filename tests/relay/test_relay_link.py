"""An instance's link to its relay, in process over real UDP (DESIGN.md §4;
:mod:`kvsp.transfer.relay_link`).

Pushed blocks are PUBLISHed into the relay, cached there and recognised as complete replicas;
a block the relay already holds is not sent again; the announced scope prefix routes the
relay's FETCH for another block of the scope back over the link; the link reconnects and
announces again after the relay restarts; :class:`MirroringIndex` pushes each replica it
publishes once.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence

import pytest

from kvsp.container import Geometry, encode_container, replica_digest
from kvsp.errors import KVSPError
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.records import ReplicaRecord
from kvsp.transfer.moqt_publisher import MemoryBlocks, StoredBlock
from kvsp.transfer.relay_link import MirroringIndex, RelayLink, RelayLinkConfig
from moqt.certs import make_self_signed
from tests.support.polling import until
from tests.support.relay_kit import (
    Certs,
    client,
    fetch_all,
    port_of,
    relay_config,
    run,
    running_relay,
)

pytestmark = pytest.mark.timeout(60)
GEOMETRY = Geometry(layers=6, kv_heads=2, head_dim=16, element_size=2)
TOKENS = 8
COMPAT = CompatId(hashlib.sha256(b"relay-link-compat").digest())
SCOPE = ScopeId(b"\x1c" * 16)


def block(seed: int) -> StoredBlock:
    section = GEOMETRY.section_length(TOKENS)
    pairs = [
        ((bytes([seed, i, 1]) * section)[:section], (bytes([seed, i, 2]) * section)[:section])
        for i in range(GEOMETRY.layers)
    ]
    data = encode_container(pairs, first_layer=0, token_count=TOKENS, geometry=GEOMETRY)
    key = BlockKey(hashlib.sha256(b"link-key-%d" % seed).digest())
    return StoredBlock.of(COMPAT, SCOPE, key, data, geometry=GEOMETRY)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_self_signed("localhost", tmp_path_factory.mktemp("relay-certs"))


def link_to(url: str, certs: Certs, blocks: MemoryBlocks) -> RelayLink:
    config = RelayLinkConfig(url=url, cafile=str(certs[0]), retry_s=0.05, timeout_s=5)
    return RelayLink(config, blocks)


def payloads(b: StoredBlock) -> list[bytes]:
    return [bytes(layer.k) + bytes(layer.v) for layer in b.container.layers]


def test_pushed_blocks_are_cached_and_announced_scopes_route_back(certs: Certs) -> None:
    first, second = block(1), block(2)
    blocks = MemoryBlocks()
    blocks.add(first)
    blocks.add(second)

    async def scenario() -> None:
        async with running_relay(relay_config(certs)) as relay:
            link = link_to(relay.url, certs, blocks)
            link.start()
            try:
                link.push(COMPAT, SCOPE, first.key)
                await asyncio.wait_for(link.idle(), 10)
                assert (link.pushed, link.skipped) == (1, 0)
                track = (first.namespace, first.track_name)
                await until(lambda: relay.holder.replica(track) is not None)  # sent, arriving
                replica = relay.holder.replica(track)  # a complete replica: the relay holds it
                assert replica is not None and replica.layer_digests == first.layer_digests
                link.push(COMPAT, SCOPE, first.key)  # the relay holds all of it: not resent
                await asyncio.wait_for(link.idle(), 10)
                assert (link.pushed, link.skipped) == (1, 1)
                async with client(relay.url, certs) as reader:
                    cached = await fetch_all(reader, track, GEOMETRY.layers)
                    assert [bytes(o.payload) for o in cached] == payloads(first)
                    # never pushed: the relay routes the miss to the announced scope prefix
                    other = (second.namespace, second.track_name)
                    fetched = await fetch_all(reader, other, GEOMETRY.layers)
                    assert [bytes(o.payload) for o in fetched] == payloads(second)
            finally:
                await link.close()
            assert other in relay.cache

    run(scenario())


def test_the_link_reconnects_and_announces_again(certs: Certs) -> None:
    third = block(3)
    blocks = MemoryBlocks()
    blocks.add(third)

    async def scenario() -> None:
        async with running_relay(relay_config(certs)) as relay:
            port = port_of(relay.url)
            link = link_to(relay.url, certs, blocks)
            link.start()
            try:
                link.announce(COMPAT, SCOPE)
                await asyncio.wait_for(link.idle(), 10)
                await relay.close()
                async with running_relay(relay_config(certs, port=port)) as again:
                    track = (third.namespace, third.track_name)
                    async with client(again.url, certs) as reader:

                        async def routed() -> bool:
                            try:
                                await fetch_all(reader, track, GEOMETRY.layers)
                            except Exception:  # noqa: BLE001 - not announced yet
                                return False
                            return True

                        await until(routed, 15, "the link's announcement routed", interval=0.1)
                    await until(lambda: track in again.cache)
            finally:
                await link.close()

    run(scenario())


class RecordingIndex:
    """An IS stand-in that accepts every record and notes what it got."""

    def __init__(self) -> None:
        self.published: list[ReplicaRecord] = []

    async def publish(self, record: ReplicaRecord, /) -> int:
        self.published.append(record)
        return record.ttl_ms

    async def publish_batch(self, records: Sequence[ReplicaRecord], /) -> list[int | KVSPError]:
        self.published += records
        return [r.ttl_ms for r in records]

    async def withdraw(self, compat: CompatId, scope: ScopeId, key: BlockKey, h: str, /) -> bool:
        return True


def record_of(b: StoredBlock, codec: int = 1) -> ReplicaRecord:
    return ReplicaRecord(
        block_key=b.key,
        compat_id=b.compat,
        scope_id=b.scope,
        holder="http://127.0.0.1:1/",
        codec=codec,
        size=len(b.container.encode()),
        digest=replica_digest(b.layer_digests),
        layer_digests=b.layer_digests,
        residency=None,
        ttl_ms=30_000,
    )


def test_the_mirroring_index_pushes_each_replica_once(certs: Certs) -> None:
    fourth, fifth = block(4), block(5)
    blocks = MemoryBlocks()
    blocks.add(fourth)
    blocks.add(fifth)

    async def scenario() -> None:
        async with running_relay(relay_config(certs)) as relay:
            link = link_to(relay.url, certs, blocks)
            inner = RecordingIndex()
            index = MirroringIndex(inner, link)
            link.start()
            try:
                assert await index.publish(record_of(fourth)) == 30_000
                await index.publish(record_of(fourth))  # a refresh: not pushed again
                await index.publish_batch([record_of(fourth), record_of(fifth)])
                await index.publish(record_of(block(6), codec=2))  # not raw: not over MOQT
                await asyncio.wait_for(link.idle(), 10)
                assert len(inner.published) == 5
                assert (link.pushed, link.skipped) == (2, 0)
                for b in (fourth, fifth):
                    await until(lambda b=b: relay.holder.replica((b.namespace, b.track_name)))
                assert await index.withdraw(COMPAT, SCOPE, fourth.key, "http://127.0.0.1:1/")
            finally:
                await link.close()

    run(scenario())
