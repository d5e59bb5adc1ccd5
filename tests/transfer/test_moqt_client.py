"""KV blocks over MOQT on real UDP (127.0.0.1): a publisher serving stored and live block
tracks, the verifying consumer, and BlockClient's walk over HTTP and MOQT replicas (DESIGN.md
§4; spec §4.4, §6.1, §6.7)."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from kvsp.container import Geometry, Layer, encode_container, replica_digest
from kvsp.errors import (
    DigestMismatch,
    Incompatible,
    LayersUnavailable,
    NotFound,
    RecordError,
    TransportError,
)
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.moqt_mapping import encode_moqt_namespace, kv_namespace
from kvsp.records import ReplicaRecord
from kvsp.transfer.block_client import BlockClient
from kvsp.transfer.moqt_client import MoqtBlockClient
from kvsp.transfer.moqt_publisher import LiveTracks, MemoryBlocks, StoredBlock, serve_blocks
from kvsp.transfer.moqt_transfer import parse_moqt_uri
from moqt.backend import get_backend
from moqt.certs import make_self_signed

GEOMETRY = Geometry(layers=32, kv_heads=2, head_dim=32, element_size=2)
TOKENS = 16
SECTION = GEOMETRY.section_length(TOKENS)  # 2 KiB: a 128 KiB block
COMPAT = CompatId(b"\xc0" * 32)
SCOPE = ScopeId(b"\x5c" * 16)
KEY = BlockKey(b"\x4b" * 32)
PRODUCER = "http://instance-a.example/kvsp/"

BACKENDS = [
    "aioquic",
    pytest.param(
        "qh3",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("qh3") is None, reason="qh3 (extra quic-fast) not installed"
        ),
    ),
]


def layer_bytes(index: int, seed: int = 0) -> tuple[bytes, bytes]:
    k = hashlib.sha256(b"K%d/%d" % (seed, index)).digest() * (SECTION // 32)
    v = hashlib.sha256(b"V%d/%d" % (seed, index)).digest() * (SECTION // 32)
    return k, v


LAYERS = [layer_bytes(i) for i in range(GEOMETRY.layers)]
CONTAINER = encode_container(LAYERS, first_layer=0, token_count=TOKENS, geometry=GEOMETRY)
DIGESTS = [hashlib.sha256(k + v).digest() for k, v in LAYERS]


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
    live: LiveTracks
    client: MoqtBlockClient


@asynccontextmanager
async def holder(
    backend: str, certs: tuple[str, str], *, in_band_digests: bool = True
) -> AsyncIterator[Holder]:
    cert, key = certs
    quic = get_backend(backend)
    configuration = quic.configuration(is_client=False, certificate=cert, private_key=key)
    blocks, live = MemoryBlocks(), LiveTracks()
    server = await serve_blocks(
        "127.0.0.1",
        0,
        configuration=configuration,
        blocks=blocks,
        live=live,
        backend=backend,
        in_band_digests=in_band_digests,
    )
    try:
        async with MoqtBlockClient(cafile=cert, backend=backend, timeout=10) as client:
            yield Holder(f"moqt://127.0.0.1:{server.address[1]}", blocks, live, client)
    finally:
        server.close()


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 30))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fetch_layers_3_to_7_verified(backend: str, certs: tuple[str, str]) -> None:
    async def test() -> None:
        async with holder(backend, certs) as h:
            h.blocks.add(stored())
            stream = h.client.stream_block(
                record(h.uri), layers=(3, 7), geometry=GEOMETRY, block_tokens=TOKENS
            )
            seen = [layer.index async for layer in stream]
            block = await stream.block()
        assert seen == [3, 4, 5, 6, 7]
        assert (block.first_layer, block.layer_count, block.token_count) == (3, 5, TOKENS)
        assert block.producer_verified and block.codec == 1
        assert [(bytes(x.k), bytes(x.v)) for x in block.layers] == LAYERS[3:8]
        full = encode_container(LAYERS[3:8], first_layer=3, token_count=TOKENS)
        assert block.encode() == full  # the header rebuilt from the record and the geometry

    run(test)


def test_whole_block_without_layer_digests_checks_the_replica_digest(
    certs: tuple[str, str],
) -> None:
    async def test() -> None:
        async with holder("aioquic", certs) as h:
            h.blocks.add(stored())
            plain = replace(record(h.uri), layer_digests=None)
            block = await h.client.get_block(plain, geometry=GEOMETRY)  # tokens from the length
        assert block.token_count == TOKENS and block.encode() == CONTAINER

    run(test)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_corrupted_object_is_never_handed_out(backend: str, certs: tuple[str, str]) -> None:
    corrupt = bytearray(CONTAINER)
    corrupt[-SECTION * 2 * (GEOMETRY.layers - 5) + 100] ^= 0x01  # inside layer 5's K

    async def test() -> None:
        async with holder(backend, certs) as h:
            h.blocks.add(stored(bytes(corrupt)))
            stream = h.client.stream_block(record(h.uri), layers=(3, 7), geometry=GEOMETRY)
            handed: list[Layer] = []
            with pytest.raises(DigestMismatch, match="layer 5"):
                async for layer in stream:
                    handed.append(layer)
            assert [layer.index for layer in handed] == [3, 4]
            with pytest.raises(DigestMismatch):
                await h.client.get_block(record(h.uri), geometry=GEOMETRY)
            # the session survives: the untouched layers still come
            block = await h.client.get_block(record(h.uri), layers=(6, 9), geometry=GEOMETRY)
            assert block.layer_count == 4

    run(test)


def test_a_namespace_naming_another_block_is_rejected(certs: tuple[str, str]) -> None:
    other = encode_moqt_namespace(kv_namespace(COMPAT, SCOPE, BlockKey(b"\x00" * 32)))
    foreign = encode_moqt_namespace((b"kvsp", b"2", b"c", b"s", b"k"))

    async def test() -> None:
        async with MoqtBlockClient() as client:
            for namespace in (other, foreign):
                bad = record("moqt://127.0.0.1:9", moqt_namespace=namespace)
                with pytest.raises(RecordError, match="moqt_namespace"):
                    await client.get_block(bad, geometry=GEOMETRY)

    run(test)


def test_missing_blocks_and_layers_map_to_kvsp_errors(certs: tuple[str, str]) -> None:
    async def test() -> None:
        async with holder("aioquic", certs) as h:
            with pytest.raises(NotFound):
                await h.client.get_block(record(h.uri), geometry=GEOMETRY)
            half = encode_container(LAYERS[:8], first_layer=0, token_count=TOKENS)
            h.blocks.add(stored(half))
            with pytest.raises(LayersUnavailable):
                await h.client.get_block(record(h.uri), layers=(6, 9), geometry=GEOMETRY)
            block = await h.client.get_block(record(h.uri), layers=(2, 7), geometry=GEOMETRY)
            assert block.layer_count == 6

    run(test)


async def produce(h: Holder, started: asyncio.Event, *, finish: bool = True) -> StoredBlock:
    writer = h.live.publish(PRODUCER, COMPAT, SCOPE, KEY, token_count=TOKENS, blocks=h.blocks)
    for index, (k, v) in enumerate(LAYERS):
        writer.send_layer(index, k, v)
        await started.wait()  # held after layer 0 until the consumer has seen it
        await asyncio.sleep(0.002)  # one layer per forward-pass step
    return writer.finish(ttl_ms=60_000)


@pytest.mark.parametrize("backend", BACKENDS)
def test_subscribe_to_a_live_track_while_layers_are_produced(
    backend: str, certs: tuple[str, str]
) -> None:
    async def test() -> None:
        async with holder(backend, certs) as h:
            started = asyncio.Event()
            producer = asyncio.create_task(produce(h, started))
            await asyncio.sleep(0)
            stream = h.client.subscribe_live(
                h.uri,
                producer=PRODUCER,
                compat=COMPAT,
                scope=SCOPE,
                key=KEY,
                geometry=GEOMETRY,
                block_tokens=TOKENS,
            )
            seen = []
            async for layer in stream:
                seen.append(layer.index)
                if len(seen) == 1:
                    assert not producer.done()  # layers arrive while the block is computed
                started.set()
            block = await stream.block()
            finished = await producer
            assert seen == list(range(GEOMETRY.layers))
            assert block.in_band_verified and block.block_digest == finished.digest
            assert block.encode() == CONTAINER
            # once finished, the same block is served as the stored track named by its digest
            again = await h.client.get_block(record(h.uri), geometry=GEOMETRY)
            assert again.encode() == CONTAINER

    run(test)


def test_a_live_track_without_in_band_digests_is_checked_against_the_record(
    certs: tuple[str, str],
) -> None:
    async def test() -> None:
        async with holder("aioquic", certs, in_band_digests=False) as h:
            started = asyncio.Event()
            started.set()
            producer = asyncio.create_task(produce(h, started))
            await asyncio.sleep(0)
            arguments = dict(
                producer=PRODUCER, compat=COMPAT, scope=SCOPE, key=KEY, geometry=GEOMETRY
            )
            published = record(h.uri)
            block = await h.client.subscribe_live(h.uri, record=published, **arguments).block()
            assert not block.in_band_verified and block.record is published
            assert block.encode() == CONTAINER
            await producer
            started = asyncio.Event()
            started.set()
            producer = asyncio.create_task(produce(h, started))
            await asyncio.sleep(0)
            wrong = replace(published, layer_digests=tuple(reversed(DIGESTS)))
            stream = h.client.subscribe_live(h.uri, record=wrong, **arguments)
            with pytest.raises(DigestMismatch):
                async for _ in stream:
                    raise AssertionError("an unverified layer was handed out")
            await producer

    run(test)


def test_block_client_walks_http_and_moqt_replicas_in_order(certs: tuple[str, str]) -> None:
    async def test() -> None:
        async with holder("aioquic", certs) as h:
            h.blocks.add(stored())
            async with BlockClient(None, hashing="inline", moqt=h.client) as client:
                replicas = [
                    record("http://127.0.0.1:9/kvsp/"),  # nothing listens there
                    replace(record(h.uri), layer_digests=None),
                    record(h.uri),
                ]
                block = await client.fetch(
                    replicas, layers=(0, 1), geometry=GEOMETRY, block_tokens=TOKENS
                )
                assert block is not None and block.source == h.uri
                assert block.token_count == TOKENS  # the descriptor's count reached MOQT
                outcomes = [(o.holder, o.ok, o.error) for o in client.stats.recent]
        base = h.uri + "/"  # attempts are counted under the replica's base
        assert outcomes[0][1:] == (False, "TransportError")
        assert outcomes[1] == (base, False, "Incompatible")  # a range needs layer_digests
        assert outcomes[2] == (base, True, None)

    run(test)


def test_moqt_uris() -> None:
    address = parse_moqt_uri("moqt://relay.example/kvsp?x=1")
    assert (address.host, address.port, address.path) == ("relay.example", 443, "/kvsp?x=1")
    assert parse_moqt_uri("moqt://[::1]:4443").port == 4443


def test_verifying_against_the_ip_address_san(certs: tuple[str, str]) -> None:
    async def test() -> None:
        async with holder("aioquic", certs) as h:
            h.blocks.add(stored())
            async with MoqtBlockClient(cafile=certs[0], timeout=10) as client:
                block = await client.get_block(record(h.uri), layers=(0, 0), geometry=GEOMETRY)
            assert block.layer_count == 1

    run(test)


def test_certificate_pinning_refuses_another_certificate(
    certs: tuple[str, str], tmp_path: Path
) -> None:
    other, _ = make_self_signed("localhost", tmp_path)

    async def test() -> None:
        async with holder("aioquic", certs) as h:
            h.blocks.add(stored())
            async with MoqtBlockClient(cafile=str(other), timeout=3) as client:
                with pytest.raises(Exception, match="MOQT session|TransportError|no MOQT"):
                    await client.get_block(record(h.uri), geometry=GEOMETRY)

    run(test)


def test_live_writer_rules() -> None:
    async def test() -> None:
        live = LiveTracks()
        writer = live.publish(PRODUCER, COMPAT, SCOPE, KEY, token_count=TOKENS)
        with pytest.raises(ValueError, match="already"):
            live.publish(PRODUCER, COMPAT, SCOPE, KEY, token_count=TOKENS)
        with pytest.raises(ValueError, match="layer 0 expected"):
            writer.send_layer(1, *LAYERS[1])
        assert writer.send_layer(0, *LAYERS[0]) == DIGESTS[0]
        writer.abort()
        with pytest.raises(ValueError, match="ended"):
            writer.send_layer(1, *LAYERS[1])
        assert live.get(writer.track.namespace, writer.track.name) is None

    run(test)


def test_a_partial_block_needs_the_replica_digests() -> None:
    half = encode_container(LAYERS[4:8], first_layer=4, token_count=TOKENS)
    with pytest.raises(Incompatible):
        StoredBlock.of(COMPAT, SCOPE, KEY, half)
    block = StoredBlock.of(COMPAT, SCOPE, KEY, half, layer_digests=DIGESTS)
    assert block.digest == replica_digest(DIGESTS) and block.held(4, 7) is not None
    assert block.held(3, 7) is None and block.held(4, 8) is None


def test_an_aborted_live_track_hands_out_nothing_more(certs: tuple[str, str]) -> None:
    async def test() -> None:
        async with holder("aioquic", certs) as h:
            writer = h.live.publish(PRODUCER, COMPAT, SCOPE, KEY, token_count=TOKENS)
            writer.send_layer(0, *LAYERS[0])
            stream = h.client.subscribe_live(
                h.uri, producer=PRODUCER, compat=COMPAT, scope=SCOPE, key=KEY, geometry=GEOMETRY
            )
            assert (await stream.__anext__()).index == 0
            writer.abort("engine failed")
            with pytest.raises(TransportError):
                await stream.block()
            with pytest.raises(NotFound):  # gone for new subscribers
                await h.client.subscribe_live(
                    h.uri,
                    producer=PRODUCER,
                    compat=COMPAT,
                    scope=SCOPE,
                    key=KEY,
                    geometry=GEOMETRY,
                ).block()

    run(test)


def test_a_fetch_never_answered_times_out_cancelled_and_its_session_forgotten(
    certs: tuple[str, str],
) -> None:
    from moqt.asyncio import MOQTConnection, serve
    from moqt.session_events import FetchCancelReceived

    cancelled: list[int] = []

    async def silent(connection: MOQTConnection) -> None:  # takes the FETCH, never answers it
        async for event in connection.requests():
            if isinstance(event, FetchCancelReceived):
                cancelled.append(event.request_id)

    async def test() -> None:
        cert, key = certs
        quic = get_backend("aioquic")
        configuration = quic.configuration(is_client=False, certificate=cert, private_key=key)
        server = await serve(
            "127.0.0.1", 0, configuration=configuration, handler=silent, backend="aioquic"
        )
        try:
            async with MoqtBlockClient(cafile=cert, backend="aioquic", timeout=0.5) as client:
                uri = f"moqt://127.0.0.1:{server.address[1]}"
                started = asyncio.get_running_loop().time()
                with pytest.raises(TransportError, match="FETCH of .* failed: TimeoutError"):
                    await client.get_block(record(uri), geometry=GEOMETRY, block_tokens=TOKENS)
                assert asyncio.get_running_loop().time() - started < 5
                assert client.sessions() == []  # the next request connects anew
                for _ in range(50):
                    if cancelled:
                        break
                    await asyncio.sleep(0.02)
                assert len(cancelled) == 1  # FETCH_CANCEL: the holder stops serving it
        finally:
            server.close()

    run(test)
