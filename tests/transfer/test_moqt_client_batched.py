"""A large block's layers verified off the event loop in batches (spec §6.7): the FETCH
consumer (:class:`~kvsp.transfer.moqt_client.MoqtBlockClient`) and its
:class:`~kvsp.transfer.moqt_transfer.LayerChecks` hand a layer out only once it matched the
record, in order, stop at the first that did not, and without ``layer_digests`` check the
replica digest before handing any out; on real sockets (QUIC on 127.0.0.1) and worker threads.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

import pytest

from kvsp.container import Geometry, Layer, encode_container, replica_digest
from kvsp.errors import DigestMismatch
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.moqt_mapping import LayerAssembler, encode_moqt_namespace, kv_namespace
from kvsp.records import ReplicaRecord
from kvsp.transfer import moqt_transfer
from kvsp.transfer.moqt_client import MoqtBlockClient
from kvsp.transfer.moqt_publisher import LiveTracks, MemoryBlocks, StoredBlock, serve_blocks
from kvsp.transfer.moqt_transfer import HASH_INLINE_BELOW, LayerChecks
from moqt.backend import get_backend
from moqt.certs import make_self_signed

GEOMETRY = Geometry(layers=32, kv_heads=4, head_dim=64, element_size=2)
TOKENS = 16
SECTION = GEOMETRY.section_length(TOKENS)  # 8 KiB: a 512 KiB block, hashed on worker threads
COMPAT = CompatId(b"\xc1" * 32)
SCOPE = ScopeId(b"\x5d" * 16)
KEY = BlockKey(b"\x4c" * 32)
BAD = 20  # the corrupted layer: in the middle, inside the second or third batch


def layer_bytes(index: int) -> tuple[bytes, bytes]:
    k = hashlib.sha256(b"K/%d" % index).digest() * (SECTION // 32)
    v = hashlib.sha256(b"V/%d" % index).digest() * (SECTION // 32)
    return k, v


LAYERS = [layer_bytes(i) for i in range(GEOMETRY.layers)]
CONTAINER = encode_container(LAYERS, first_layer=0, token_count=TOKENS, geometry=GEOMETRY)
DIGESTS = [hashlib.sha256(k + v).digest() for k, v in LAYERS]


def corrupted(index: int) -> bytes:
    data = bytearray(CONTAINER)
    data[-SECTION * 2 * (GEOMETRY.layers - index) + SECTION + 7] ^= 0x40  # inside its V
    return bytes(data)


def stored(data: bytes = CONTAINER) -> StoredBlock:
    return StoredBlock.of(
        COMPAT, SCOPE, KEY, data, geometry=GEOMETRY, layer_digests=DIGESTS, ttl_ms=60_000
    )


def record(holder: str, **changes: object) -> ReplicaRecord:
    body = {
        "block_key": KEY.hex(),
        "compat_id": COMPAT.hex(),
        "scope_id": SCOPE.hex(),
        "holder": holder,
        "codec": 1,
        "size": len(CONTAINER),
        "digest": "sha-256:" + replica_digest(DIGESTS).hex(),
        "layer_digests": [d.hex() for d in DIGESTS],
        "ttl_ms": 60_000,
        "moqt_namespace": encode_moqt_namespace(kv_namespace(COMPAT, SCOPE, KEY)),
    }
    body.update(changes)
    return ReplicaRecord.from_json(body)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    cert, key = make_self_signed("localhost", tmp_path_factory.mktemp("certs"))
    return str(cert), str(key)


@dataclass
class Holder:
    uri: str
    blocks: MemoryBlocks
    client: MoqtBlockClient


@asynccontextmanager
async def holder(certs: tuple[str, str]) -> AsyncIterator[Holder]:
    cert, key = certs
    configuration = get_backend("aioquic").configuration(
        is_client=False, certificate=cert, private_key=key
    )
    blocks = MemoryBlocks()
    server = await serve_blocks(
        "127.0.0.1", 0, configuration=configuration, blocks=blocks, live=LiveTracks()
    )
    try:
        async with MoqtBlockClient(cafile=cert, backend="aioquic", timeout=10) as client:
            yield Holder(f"moqt://127.0.0.1:{server.address[1]}", blocks, client)
    finally:
        server.close()


@pytest.fixture
def hashed_on() -> Iterator[list[str]]:
    """The threads the worker-thread jobs ran on (each job records its thread)."""
    threads: list[str] = []
    span, layers = moqt_transfer.digest_span, moqt_transfer.digest_layers

    def record_span(data: memoryview, size: int) -> list[bytes]:
        threads.append(threading.current_thread().name)
        return span(data, size)

    def record_layers(batch: list[Layer]) -> list[bytes]:
        threads.append(threading.current_thread().name)
        return layers(batch)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(moqt_transfer, "digest_span", record_span)
        patch.setattr(moqt_transfer, "digest_layers", record_layers)
        yield threads


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 60))


def test_the_block_is_large_enough_for_the_worker_threads() -> None:
    assert len(CONTAINER) >= HASH_INLINE_BELOW


def test_a_large_block_is_handed_out_in_order_verified_on_worker_threads(
    certs: tuple[str, str], hashed_on: list[str]
) -> None:
    async def test() -> None:
        async with holder(certs) as h:
            h.blocks.add(stored())
            h.client.hash_batch = 3 * 2 * SECTION + 1  # batches of 4 layers: 8 jobs
            stream = h.client.stream_block(record(h.uri), geometry=GEOMETRY, block_tokens=TOKENS)
            seen = [(layer.index, bytes(layer.k), bytes(layer.v)) async for layer in stream]
            block = await stream.block()
        assert seen == [(i, k, v) for i, (k, v) in enumerate(LAYERS)]
        assert block.encode() == CONTAINER
        workers = [name for name in hashed_on if name.startswith("kvsp-moqt-hash")]
        assert len(workers) >= 4  # most batches went to the workers (the tail may not)

    run(test)


def test_by_default_a_large_block_is_hashed_in_two_halves(
    certs: tuple[str, str], hashed_on: list[str]
) -> None:
    """Half the FETCH a job (the first while the second arrives), not a job every 512 KiB."""

    async def test() -> None:
        async with holder(certs) as h:
            h.blocks.add(stored())
            block = await h.client.get_block(record(h.uri), geometry=GEOMETRY)
        assert block.encode() == CONTAINER
        assert len(hashed_on) == 2  # the 512 KiB block: two jobs of 256 KiB
        assert hashed_on[0].startswith("kvsp-moqt-hash")

    run(test)


@pytest.mark.parametrize(
    ("octets", "most", "batch"),
    [
        (2 << 20, moqt_transfer.HASH_BATCH, 1 << 20),  # a 2 MiB block: two jobs
        (1 << 20, moqt_transfer.HASH_BATCH, 512 << 10),
        (8 << 20, moqt_transfer.HASH_BATCH, moqt_transfer.HASH_BATCH),  # never more a job
        (2 << 20, 100_000, 100_000),  # a client's own limit
        (1, moqt_transfer.HASH_BATCH, 1),
        (0, moqt_transfer.HASH_BATCH, 1),  # a record whose size says nothing
    ],
)
def test_the_hashing_batch_is_half_the_fetch_at_most_the_limit(
    octets: int, most: int, batch: int
) -> None:
    assert moqt_transfer.hash_batch(octets, most) == batch


def test_a_plan_counts_the_octets_of_the_layers_it_fetches() -> None:
    whole = moqt_transfer.plan_fetch(record("moqt://h/"), None, None, GEOMETRY, TOKENS, None)
    half = moqt_transfer.plan_fetch(record("moqt://h/"), None, (0, 15), GEOMETRY, TOKENS, None)
    assert whole.octets == len(CONTAINER)
    assert half.octets == len(CONTAINER) // 2


def test_a_dropped_block_lends_its_memory_to_the_next_and_a_kept_one_stays_intact(
    certs: tuple[str, str],
) -> None:
    async def test() -> None:
        async with holder(certs) as h:
            h.blocks.add(stored())
            pool = h.client.buffers
            asked = record(h.uri)
            kept = await h.client.get_block(asked, geometry=GEOMETRY, block_tokens=TOKENS)
            second = await h.client.get_block(asked, geometry=GEOMETRY, block_tokens=TOKENS)
            assert (pool.allocated, pool.reused) == (2, 0)  # the kept block's memory is its own
            del second
            gc.collect()
            third = await h.client.get_block(asked, geometry=GEOMETRY, block_tokens=TOKENS)
            assert (pool.allocated, pool.reused) == (2, 1)
            assert kept.encode() == third.encode() == CONTAINER

    run(test)


def test_a_corrupted_layer_in_a_large_block_stops_the_transfer_there(
    certs: tuple[str, str], hashed_on: list[str]
) -> None:
    async def test() -> None:
        async with holder(certs) as h:
            h.blocks.add(stored(corrupted(BAD)))
            for batch in (moqt_transfer.HASH_BATCH, 3 * 2 * SECTION):
                h.client.hash_batch = batch
                stream = h.client.stream_block(record(h.uri), geometry=GEOMETRY)
                handed: list[int] = []
                with pytest.raises(DigestMismatch, match=f"layer {BAD}:"):
                    async for layer in stream:
                        handed.append(layer.index)
                assert handed == list(range(BAD))  # every layer before it, none after
                with pytest.raises(DigestMismatch, match=f"layer {BAD}:"):
                    await stream.block()
            # the session survives: the layers after it still come, verified
            block = await h.client.get_block(record(h.uri), layers=(BAD + 1, 31), geometry=GEOMETRY)
            assert [layer.index for layer in block.layers] == list(range(BAD + 1, 32))
        assert any(name.startswith("kvsp-moqt-hash") for name in hashed_on)

    run(test)


def test_a_large_block_without_layer_digests_is_checked_against_the_replica_digest(
    certs: tuple[str, str], hashed_on: list[str]
) -> None:
    async def test() -> None:
        async with holder(certs) as h:
            plain = replace(record(h.uri), layer_digests=None)
            h.blocks.add(stored())
            block = await h.client.get_block(plain, geometry=GEOMETRY)
            assert block.encode() == CONTAINER
            h.blocks.add(stored(corrupted(BAD)))
            stream = h.client.stream_block(plain, geometry=GEOMETRY)
            handed: list[Layer] = []
            with pytest.raises(DigestMismatch, match="replica digest"):
                async for layer in stream:
                    handed.append(layer)
            assert handed == []  # nothing before the whole block was checked
        assert any(name.startswith("kvsp-moqt-hash") for name in hashed_on)

    run(test)


class Sink:
    """Caller memory: one K and one V buffer a layer."""

    def __init__(self) -> None:
        self.buffers: dict[int, tuple[bytearray, bytearray]] = {}

    def layer_buffer(self, index: int, k_len: int, v_len: int) -> tuple[memoryview, memoryview]:
        k, v = self.buffers[index] = (bytearray(k_len), bytearray(v_len))
        return memoryview(k), memoryview(v)


def test_a_large_block_lands_in_the_sink_verified(
    certs: tuple[str, str], hashed_on: list[str]
) -> None:
    async def test() -> None:
        async with holder(certs) as h:
            h.blocks.add(stored())
            sink = Sink()
            stream = h.client.stream_block(
                record(h.uri), layers=(2, 29), geometry=GEOMETRY, sink=sink
            )
            seen = [layer.index async for layer in stream]
            await stream.block()
            assert seen == list(range(2, 30))
            assert {i: (bytes(k), bytes(v)) for i, (k, v) in sink.buffers.items()} == {
                i: LAYERS[i] for i in range(2, 30)
            }
            bad = h.client.stream_block(record(h.uri), geometry=GEOMETRY, sink=Sink(), holder=h.uri)
            h.blocks.add(stored(corrupted(BAD)))
            with pytest.raises(DigestMismatch, match=f"layer {BAD}:"):
                await bad.block()
        assert any(name.startswith("kvsp-moqt-hash") for name in hashed_on)

    run(test)


class PacedSink(Sink):
    """A sink with one staging buffer (as kvsp.engine.sink's on a device): a layer's buffer
    may be asked for only once the layer before it was handed out."""

    def __init__(self) -> None:
        super().__init__()
        self.handed: list[int] = []

    def layer_buffer(self, index: int, k_len: int, v_len: int) -> tuple[memoryview, memoryview]:
        assert not self.buffers or max(self.buffers) in self.handed, (index, self.handed)
        return super().layer_buffer(index, k_len, v_len)


def test_a_sink_is_asked_for_each_layer_only_after_the_one_before_was_handed_out(
    certs: tuple[str, str],
) -> None:
    async def test() -> None:
        async with holder(certs) as h:
            h.blocks.add(stored())
            h.client.hash_inline_below = len(CONTAINER) + 1  # each layer checked as it ends
            sink = PacedSink()
            stream = h.client.stream_block(record(h.uri), geometry=GEOMETRY, sink=sink)
            async for layer in stream:
                sink.handed.append(layer.index)
            await stream.block()
            assert sink.handed == list(range(GEOMETRY.layers))

    run(test)


# -- LayerChecks alone, on a worker thread ------------------------------------------------------


def assembled(data: list[tuple[bytes, bytes]]) -> tuple[LayerAssembler, list[Layer]]:
    assembler = LayerAssembler(GEOMETRY, 0, GEOMETRY.layers - 1, hash_below=HASH_INLINE_BELOW)
    layers = []
    for index, (k, v) in enumerate(data):
        assembler.begin(0, index, 2 * SECTION)
        assembler.feed(memoryview(k + v))
        layer, digest = assembler.end()
        assert digest is None  # a large range: not hashed as it arrives
        layers.append(layer)
    return assembler, layers


def take(checks: LayerChecks, handed: list[int]) -> None:
    for layer in checks.ready():  # one by one: a mismatch comes after the layers before it
        handed.append(layer.index)


def test_layer_checks_hand_out_in_order_and_stop_at_the_first_mismatch() -> None:
    data = list(LAYERS)
    data[BAD] = (LAYERS[BAD][0], bytes(SECTION))
    assembler, layers = assembled(data)

    async def test() -> None:
        with ThreadPoolExecutor(2) as pool:
            checks = LayerChecks(
                DIGESTS,
                replica_digest(DIGESTS),
                batch=5 * 2 * SECTION,
                executor=pool,
                span=assembler.span,
            )
            handed: list[int] = []
            with pytest.raises(DigestMismatch, match=f"layer {BAD}:"):
                for layer in layers:
                    checks.add(layer, None)
                    take(checks, handed)
                while checks.pending:
                    await checks.wait()
                    take(checks, handed)
            assert handed == list(range(BAD))

    run(test)


def test_layer_checks_without_layer_digests_hold_every_layer_until_finish() -> None:
    assembler, layers = assembled(LAYERS)

    async def test() -> None:
        for replica, ok in ((replica_digest(DIGESTS), True), (bytes(32), False)):
            checks = LayerChecks(None, replica, batch=7 * 2 * SECTION, span=assembler.span)
            handed: list[int] = []
            for layer in layers:
                checks.add(layer, None)
                take(checks, handed)
            while checks.pending:
                await checks.wait()
                take(checks, handed)
            assert handed == []
            if ok:
                checks.finish()
                assert [x.index for x in checks.ready()] == list(range(GEOMETRY.layers))
            else:
                with pytest.raises(DigestMismatch, match="replica digest"):
                    checks.finish()
                assert list(checks.ready()) == []

    run(test)


def test_a_small_range_is_hashed_as_it_arrives() -> None:
    assembler = LayerAssembler(GEOMETRY, 0, 3, hash_below=HASH_INLINE_BELOW)  # 64 KiB
    k, v = LAYERS[0]
    assembler.begin(0, 0, 2 * SECTION)
    assembler.feed(memoryview(k + v))
    assert assembler.hashing
    assert assembler.end()[1] == DIGESTS[0]
