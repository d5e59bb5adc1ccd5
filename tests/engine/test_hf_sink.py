"""Layer-by-layer loading into the transformers engine's cache (DESIGN.md §5; spec §4.3, §6.5,
§6.7).

Engine A computes a prompt's blocks; they are stored at a real holder (``kvsp serve holder``,
HTTP) and at a real MOQT publisher (real UDP). Engine B fetches them with
:class:`~kvsp.transfer.block_client.BlockClient` / :class:`~kvsp.transfer.moqt_client.
MoqtBlockClient` through the sinks of :meth:`HFCore.prefix_sinks`, so each layer's wire octets
land in the prefix's per-layer K/V tensors, and prefills only the rest. For two families the
cache then equals, byte for byte, what B computes itself, the logits are bit-identical and the
greedy tokens are the recompute's. A corrupted layer is refused: its block and the ones after
it are recomputed, never adopted.
"""

from __future__ import annotations

import asyncio
import sys
import warnings
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

torch = pytest.importorskip("torch", reason="the transformers engine needs the torch extra")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    transformers = pytest.importorskip(
        "transformers", reason="the transformers engine needs the transformers extra"
    )

from kvsp.compat import compat_id  # noqa: E402
from kvsp.container import Geometry, decode_container, replica_digest  # noqa: E402
from kvsp.engine.hf_sink import HFPrefixLoad  # noqa: E402
from kvsp.engine.transformers_engine import HFCore, HFEngine  # noqa: E402
from kvsp.errors import ContainerError, DigestMismatch, KVSPError  # noqa: E402
from kvsp.ids import BlockKey, CompatId, ScopeId  # noqa: E402
from kvsp.moqt_mapping import encode_moqt_namespace, kv_namespace  # noqa: E402
from kvsp.records import ReplicaRecord  # noqa: E402
from kvsp.transfer.block_client import BlockClient  # noqa: E402
from kvsp.transfer.moqt_client import MoqtBlockClient  # noqa: E402
from kvsp.transfer.moqt_publisher import (  # noqa: E402
    LiveTracks,
    MemoryBlocks,
    StoredBlock,
    serve_blocks,
)
from kvsp.web.auth import principal_entry, write_principals  # noqa: E402
from kvsp.web.testing import RunningService, start_process  # noqa: E402
from moqt.backend import get_backend  # noqa: E402
from moqt.certs import make_self_signed  # noqa: E402
from tests.support.hf_models import write_checkpoint  # noqa: E402

torch.set_num_threads(1)
T = TypeVar("T")
B = 8
PROMPT = [(37 * i + 11) % 250 for i in range(3 * B + 3)]  # 3 complete blocks and 3 tail tokens
LOADED = 3
COUNT = 10
FAMILIES = ["llama", "gemma"]  # gemma: head_dim 24, not hidden / heads
SCOPE = ScopeId(b"\x3b" * 16)
TOKEN = "hf-sink-client-token-0123456789abcdefgh"
AUTH = {"authorization": f"Bearer {TOKEN}"}
CORRUPT_BLOCK, CORRUPT_LAYER = 1, 1


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, 60))


@dataclass
class Prepared:
    """Engine B, A's blocks of PROMPT and B's own full recompute of PROMPT."""

    core: HFCore
    folder: Path
    compat: CompatId
    geometry: Geometry
    containers: list[bytes]
    digests: list[tuple[bytes, ...]]
    full_logits: Any
    full_blocks: list[bytes]
    greedy: list[int]

    def key(self, block: int, corrupt: bool = False) -> BlockKey:
        return BlockKey(bytes([block + (0x80 if corrupt else 0)]) * 32)

    def stored(self, block: int, corrupt: bool) -> bytes:
        """Block ``block``'s container; with ``corrupt`` one octet of one layer's K flipped."""
        data = bytearray(self.containers[block])
        if corrupt:
            section = self.geometry.section_length(B)
            start = len(data) - 2 * section * (self.geometry.layers - CORRUPT_LAYER)
            data[start + 5] ^= 0x01  # inside layer CORRUPT_LAYER's K
        return bytes(data)


def greedy(core: HFCore, seq: Any, logits: Any, count: int) -> list[int]:
    tokens = []
    for _ in range(count):
        token = int(torch.argmax(logits))
        tokens.append(token)
        logits = core.decode(seq, token)
    return tokens


def prepare(folder: Path) -> Prepared:
    a = HFCore(folder, num_pages=16, block_tokens=B)
    seq = a.new_sequence()
    a.prefill(seq, PROMPT)
    containers = [a.block_container(seq, i) for i in range(LOADED)]
    digests = [tuple(decode_container(c).layer_digests()) for c in containers]
    b = HFCore(folder, num_pages=32, block_tokens=B)
    full = b.new_sequence()
    logits = b.prefill(full, PROMPT)
    full_blocks = [b.block_container(full, i) for i in range(LOADED)]
    tokens = greedy(b, full, logits, COUNT)
    b.free(full)
    assert full_blocks == containers  # both engines compute the same octets
    return Prepared(
        b,
        folder,
        compat_id(b.descriptor),
        b.geometry,
        containers,
        digests,
        logits,
        full_blocks,
        tokens,
    )


@pytest.fixture(scope="module", params=FAMILIES)
def prepared(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Prepared:
    family: str = request.param
    folder = write_checkpoint(family, tmp_path_factory.mktemp(family) / "model")
    return prepare(folder)


def record(p: Prepared, block: int, holder: str, corrupt: bool = False) -> ReplicaRecord:
    """The Replica Record of block ``block`` at ``holder``: always the true layer digests."""
    key = p.key(block, corrupt)
    return ReplicaRecord.from_json(
        {
            "block_key": key.hex(),
            "compat_id": p.compat.hex(),
            "scope_id": SCOPE.hex(),
            "holder": holder,
            "codec": 1,
            "size": len(p.containers[block]),
            "digest": "sha-256:" + replica_digest(p.digests[block]).hex(),
            "layer_digests": [d.hex() for d in p.digests[block]],
            "ttl_ms": 60_000,
            "moqt_namespace": encode_moqt_namespace(kv_namespace(p.compat, SCOPE, key)),
        }
    )


def check_adopted(p: Prepared, load: HFPrefixLoad, adopted: int) -> None:
    """Prefill B from ``load``: ``adopted`` blocks taken, the cache, logits and greedy tokens
    those of B's full recompute."""
    core = p.core
    before = core.cache.used_pages - len(load.pages)
    seq = core.new_sequence()
    try:
        logits = core.prefill(seq, PROMPT, loaded_prefix_pages=load.pages)
        assert seq.adopted == adopted
        assert seq.pages[:adopted] == load.pages[:adopted]
        assert torch.equal(logits, p.full_logits)  # bit-exact: tolerance 0
        assert [core.block_container(seq, i) for i in range(LOADED)] == p.full_blocks
        assert greedy(core, seq, logits, COUNT) == p.greedy
    finally:
        core.free(seq)
    assert core.cache.used_pages == before  # the pages of refused blocks went back too


def zero_copy(load: HFPrefixLoad, block: int, layers: Any) -> bool:
    """Whether the verified layers are views of the load's own tensors (no copy)."""
    for layer in layers:
        k, v = load.rows(layer.index, block)
        k_at = torch.frombuffer(layer.k, dtype=torch.uint8).data_ptr()
        v_at = torch.frombuffer(layer.v, dtype=torch.uint8).data_ptr()
        if (k_at, v_at) != (k.data_ptr(), v.data_ptr()):
            return False
    return True


# -- HTTP: a real holder process ----------------------------------------------------------------


@pytest.fixture(scope="module")
def holder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    folder = tmp_path_factory.mktemp("holder")
    principals = folder / "principals.toml"
    write_principals(principals, [principal_entry("client", TOKEN, ["client", "instance"], None)])
    argv = [sys.executable, "-m", "kvsp", "serve", "holder", "--listen", "127.0.0.1:0"]
    argv += ["--principals", str(principals), "--state", str(folder / "state")]
    with start_process(argv, workdir=folder) as running:
        yield running


def store_http(p: Prepared, holder: RunningService) -> None:
    """Store the blocks (and a corrupted copy of one) at the holder."""
    with httpx.Client(timeout=30, headers=AUTH) as http:
        url = f"{holder.base_url}descriptors/{p.compat.hex()}"
        answer = http.put(url, json=p.core.descriptor.to_json())
        assert answer.status_code in (200, 201, 204), answer.text
        for block in range(LOADED):
            for corrupt in (False, True):
                key = p.key(block, corrupt)
                url = f"{holder.base_url}blocks/{p.compat.hex()}/{SCOPE.hex()}/{key.hex()}"
                headers = {"if-none-match": "*", "content-type": "application/kvsp-block"}
                answer = http.put(url, content=p.stored(block, corrupt), headers=headers)
                assert answer.status_code in (201, 412), answer.text


async def fetch_http(
    p: Prepared, holder: RunningService, load: HFPrefixLoad, corrupt: int | None
) -> list[bool]:
    """GET each block into its sink; whether the verified layers landed in place."""
    in_place = []
    async with BlockClient(TOKEN) as client:
        for j in range(len(load)):
            sink = load.sink(j)
            rec = record(p, j, holder.base_url, corrupt=j == corrupt)
            try:
                block = await client.get_block(holder.base_url, rec, geometry=p.geometry, sink=sink)
            except KVSPError as exc:
                sink.abort(str(exc))
                assert isinstance(exc, DigestMismatch) and j == corrupt
                continue
            in_place.append(zero_copy(load, j, block.layers))
            sink.accept(block)
    return in_place


def test_http_blocks_land_in_the_cache_exactly(prepared: Prepared, holder: RunningService) -> None:
    p = prepared
    store_http(p, holder)
    load = p.core.prefix_sinks(LOADED)
    in_place = run(fetch_http(p, holder, load, None))
    assert in_place == [True] * LOADED  # the wire octets went straight into the tensors
    assert load.verified_blocks == LOADED
    check_adopted(p, load, LOADED)
    with pytest.raises(ContainerError):  # adopted: the load takes no more octets
        load.sink(0).layer_buffer(0, load.section_length, load.section_length)


def test_http_corrupted_layer_is_refused_and_recomputed(
    prepared: Prepared, holder: RunningService
) -> None:
    p = prepared
    store_http(p, holder)
    load = p.core.prefix_sinks(LOADED)
    run(fetch_http(p, holder, load, CORRUPT_BLOCK))
    sink = load.sink(CORRUPT_BLOCK)
    assert sink.error is not None and not sink.complete
    assert CORRUPT_LAYER in sink.missing()
    assert load.verified_blocks == CORRUPT_BLOCK
    check_adopted(p, load, CORRUPT_BLOCK)


def test_http_fall_through_rewrites_the_rows(prepared: Prepared, holder: RunningService) -> None:
    """BlockClient.fetch tries a corrupted replica, then a good one, with the same sink: the
    good one's verified octets are what the block holds."""
    p = prepared
    store_http(p, holder)
    load = p.core.prefix_sinks(LOADED)

    async def scenario() -> None:
        async with BlockClient(TOKEN) as client:
            for j in range(LOADED):
                replicas = [record(p, j, holder.base_url, corrupt=True)]
                replicas.append(record(p, j, holder.base_url))
                block = await client.fetch(replicas, geometry=p.geometry, sink=load.sink(j))
                assert block is not None and zero_copy(load, j, block.layers)
                load.sink(j).accept(block)
            stats = client.stats.sources[holder.base_url]
            assert stats.errors == {"DigestMismatch": LOADED}

    run(scenario())
    check_adopted(p, load, LOADED)


def test_engine_api_over_http(prepared: Prepared, holder: RunningService) -> None:
    """HFEngine.prefix_sinks and prefill_loaded on the engine thread: the same tokens."""
    p = prepared
    store_http(p, holder)

    async def scenario() -> tuple[int, list[int], list[int]]:
        engine = HFEngine(p.folder, num_pages=32, block_tokens=B)
        try:
            load = await engine.prefix_sinks(LOADED)
            await fetch_http(p, holder, load, CORRUPT_BLOCK)
            seq = await engine.prefill_loaded(PROMPT, load)
            tokens = [t async for t in seq.tokens(COUNT)]
            computed = [block.index for block in seq.computed]
            await seq.release()
            return seq.loaded_blocks, computed, tokens
        finally:
            await engine.aclose()

    loaded, computed, tokens = run(scenario())
    assert loaded == CORRUPT_BLOCK
    assert computed == list(range(CORRUPT_BLOCK, LOADED))
    assert tokens == p.greedy


# -- MOQT: a real publisher on UDP ---------------------------------------------------------------


async def fetch_moqt(
    p: Prepared, certs: tuple[Path, Path], load: HFPrefixLoad, corrupt: int | None
) -> list[list[int]]:
    """FETCH each block into its sink, committing each layer as the stream yields it
    (verified); the layers committed per block."""
    cert, key = certs
    quic = get_backend("aioquic")
    configuration = quic.configuration(is_client=False, certificate=str(cert), private_key=str(key))
    blocks = MemoryBlocks()
    for j in range(LOADED):
        bad = j == corrupt
        blocks.add(
            StoredBlock.of(
                p.compat,
                SCOPE,
                p.key(j, bad),
                p.stored(j, bad),
                geometry=p.geometry,
                layer_digests=p.digests[j],
                ttl_ms=60_000,
            )
        )
    server = await serve_blocks(
        "127.0.0.1", 0, configuration=configuration, blocks=blocks, live=LiveTracks()
    )
    committed: list[list[int]] = []
    try:
        uri = f"moqt://127.0.0.1:{server.address[1]}"
        async with MoqtBlockClient(cafile=str(cert), timeout=20) as client:
            for j in range(len(load)):
                sink, done = load.sink(j), []
                rec = record(p, j, uri, corrupt=j == corrupt)
                stream = client.stream_block(rec, geometry=p.geometry, block_tokens=B, sink=sink)
                try:
                    async for layer in stream:
                        sink.commit(layer.index)
                        done.append(layer.index)
                    block = await stream.block()
                    assert zero_copy(load, j, block.layers)
                except KVSPError as exc:
                    sink.abort(str(exc))
                    assert isinstance(exc, DigestMismatch) and j == corrupt
                committed.append(done)
    finally:
        server.close()
    return committed


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_self_signed("localhost", tmp_path_factory.mktemp("certs"))


def test_moqt_blocks_land_in_the_cache_exactly(
    prepared: Prepared, certs: tuple[Path, Path]
) -> None:
    p = prepared
    load = p.core.prefix_sinks(LOADED)
    committed = run(fetch_moqt(p, certs, load, None))
    assert committed == [list(range(p.geometry.layers))] * LOADED
    assert load.verified_blocks == LOADED
    check_adopted(p, load, LOADED)


def test_moqt_corrupted_layer_is_refused_and_recomputed(
    prepared: Prepared, certs: tuple[Path, Path]
) -> None:
    p = prepared
    load = p.core.prefix_sinks(LOADED)
    committed = run(fetch_moqt(p, certs, load, CORRUPT_BLOCK))
    assert committed[CORRUPT_BLOCK] == list(range(CORRUPT_LAYER))  # the layers before it
    assert load.verified_blocks == CORRUPT_BLOCK
    check_adopted(p, load, CORRUPT_BLOCK)


# -- the sink's contract -------------------------------------------------------------------------


def test_only_committed_layers_count(prepared: Prepared) -> None:
    """Octets written but never committed (verification not finished) are never adopted."""
    p = prepared
    load = p.core.prefix_sinks(LOADED)
    container = decode_container(p.containers[0])
    sink = load.sink(0)
    for layer in container.layers:
        k, v = sink.layer_buffer(layer.index, layer.k.nbytes, layer.v.nbytes)
        k[:], v[:] = layer.k.cast("B"), layer.v.cast("B")
    assert not sink.complete and load.verified_blocks == 0
    for layer in container.layers[:-1]:
        sink.commit(layer.index)
    assert sink.missing() == [p.geometry.layers - 1] and load.verified_blocks == 0
    with pytest.raises(ContainerError):
        sink.commit(99)  # a layer whose buffer was never handed out
    check_adopted(p, load, 0)  # nothing verified: the whole prompt is computed


def test_accept_refuses_a_block_not_verified_per_layer(prepared: Prepared) -> None:
    p = prepared
    load = p.core.prefix_sinks(1)
    try:
        with pytest.raises(KVSPError):
            load.sink(0).accept(decode_container(p.containers[0]))  # a plain container
        assert load.verified_blocks == 0
    finally:
        p.core.cache.free(load.pages)
