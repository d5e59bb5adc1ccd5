"""KV blocks through a relay: aiomoqt 0.13.3's (an independent stack: picoquic, Python 3.12)
and ours (``relay.app --open``).

A block published by our :class:`MoqtBlockPublisher` (an instance's session to its relay,
PUBLISH_NAMESPACE of the scope prefix) is FETCHed back through the relay by our verifying
client (2 MiB, 32 layers of 64 KiB) and by aiomoqt's own fetcher (an independent check of our
objects on the wire); a live track is followed through the relay while layers are produced.

Each relay skips with its reason when it cannot be installed or started.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from interop import peers
from kvsp.container import Geometry, encode_container, replica_digest
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.moqt_mapping import encode_moqt_namespace, kv_namespace, stored_track_name
from kvsp.records import ReplicaRecord
from kvsp.transfer.moqt_client import MoqtBlockClient
from kvsp.transfer.moqt_publisher import LiveTracks, MemoryBlocks, MoqtBlockPublisher, StoredBlock
from kvsp.transfer.moqt_transfer import parse_moqt_uri
from moqt.asyncio import connect
from moqt.backend import get_backend

pytestmark = pytest.mark.slow  # peer processes: about a minute in all
GEOMETRY = Geometry(layers=32, kv_heads=8, head_dim=128, element_size=2)
TOKENS = 16  # 32 KiB sections: a 2 MiB block, 64 KiB objects
SECTION = GEOMETRY.section_length(TOKENS)
COMPAT, SCOPE, KEY = CompatId(b"\xc1" * 32), ScopeId(b"\x5d" * 16), BlockKey(b"\x4c" * 32)
LAYERS = [
    (hashlib.sha256(b"K%d" % i).digest() * (SECTION // 32), bytes([i]) * SECTION)
    for i in range(GEOMETRY.layers)
]
CONTAINER = encode_container(LAYERS, first_layer=0, token_count=TOKENS, geometry=GEOMETRY)
DIGESTS = [hashlib.sha256(k + v).digest() for k, v in LAYERS]


@pytest.fixture(scope="module", params=["aiomoqt-relay", "kvsp-relay"])
def relay(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[peers.PeerProcess]:
    workdir = tmp_path_factory.mktemp(request.param)
    start = peers.start_aiomoqt_relay if request.param == "aiomoqt-relay" else peers.start_our_relay
    try:
        peer = start(workdir)
    except peers.PeerUnavailable as exc:
        pytest.skip(f"{request.param} unavailable: {exc}")
    with peer:
        yield peer


def record(holder: str) -> ReplicaRecord:
    return ReplicaRecord.from_json(
        {
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
    )


@asynccontextmanager
async def publishing(url: str, live: LiveTracks) -> AsyncIterator[MoqtBlockPublisher]:
    """Our publisher on a session to the relay, its scope announced."""
    address = parse_moqt_uri(url)
    blocks = MemoryBlocks()
    blocks.add(StoredBlock.of(COMPAT, SCOPE, KEY, CONTAINER, geometry=GEOMETRY))
    configuration = get_backend().configuration(is_client=True, verify=False)
    async with connect(address.host, address.port, configuration=configuration) as connection:
        publisher = MoqtBlockPublisher(connection, blocks, live=live)
        serving = asyncio.ensure_future(publisher.serve())
        try:
            await publisher.announce(COMPAT, SCOPE)
            yield publisher
        finally:
            serving.cancel()


def test_kv_block_fetched_back_through_the_relay(relay: peers.PeerProcess) -> None:
    async def test() -> None:
        async with publishing(relay.url, LiveTracks()), MoqtBlockClient(verify=False) as client:
            part = await client.get_block(record(relay.url), layers=(3, 7), geometry=GEOMETRY)
            assert [layer.index for layer in part.layers] == [3, 4, 5, 6, 7]
            whole = await client.get_block(record(relay.url), geometry=GEOMETRY)
            assert whole.token_count == TOKENS and whole.encode() == CONTAINER

    asyncio.run(asyncio.wait_for(test(), 60))


def test_aiomoqt_fetches_our_objects_byte_exact(relay: peers.PeerProcess, tmp_path: Path) -> None:
    python = peers.aiomoqt_python()
    host, port = "127.0.0.1", str(peers.url_port(relay.url))
    namespace = "/".join(f.decode() for f in kv_namespace(COMPAT, SCOPE, KEY))
    track = stored_track_name(replica_digest(DIGESTS)).decode()

    async def test() -> str:
        async with publishing(relay.url, LiveTracks()):
            args = [host, port, namespace, track, "0", str(GEOMETRY.layers - 1)]
            fetcher = peers.run_script(
                "aiomoqt-fetch", python, peers.AIOMOQT_KV_FETCH, args, tmp_path
            )
            while fetcher.proc.poll() is None:
                await asyncio.sleep(0.1)
            return fetcher.output()

    output = asyncio.run(asyncio.wait_for(test(), 60))
    got = peers.object_lines(output, "FETCH")
    expected = {
        i: (2 * SECTION, hashlib.sha256(k + v).hexdigest()) for i, (k, v) in enumerate(LAYERS)
    }
    assert got == expected, output[-2000:]


def test_live_track_followed_through_the_relay(relay: peers.PeerProcess) -> None:
    producer = "http://instance-b.example/kvsp/"

    async def test() -> None:
        live = LiveTracks()
        async with (
            publishing(relay.url, live) as publisher,
            MoqtBlockClient(verify=False) as client,
        ):
            writer = publisher.publish_live(producer, COMPAT, SCOPE, KEY, token_count=TOKENS)
            writer.send_layer(0, *LAYERS[0])
            stream = client.subscribe_live(
                relay.url,
                producer=producer,
                compat=COMPAT,
                scope=SCOPE,
                key=KEY,
                geometry=GEOMETRY,
                record=record(relay.url),
            )
            seen = []
            async for layer in stream:
                seen.append(layer.index)
                if len(seen) == 1:
                    for index in range(1, GEOMETRY.layers):
                        writer.send_layer(index, *LAYERS[index])
            writer.finish()
            block = await stream.block()
        assert seen == list(range(GEOMETRY.layers))
        assert block.encode() == CONTAINER
        assert block.in_band_verified  # aiomoqt forwards our immutable extension untouched

    asyncio.run(asyncio.wait_for(test(), 60))
