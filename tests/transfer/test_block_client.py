"""BlockClient against the test holder (a real uvicorn process): §6.7 verification of every
returned block, fall-through over replicas (§6.1), storage with ``If-None-Match: *`` and
leases (§6.6)."""

from __future__ import annotations

import asyncio
import hashlib
import socket
import sys
from collections.abc import Awaitable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pytest

from kvsp import sha256x2
from kvsp.container import Container, Geometry, decode_container, header_size, replica_digest
from kvsp.errors import (
    ContainerError,
    DigestMismatch,
    Incompatible,
    LayersUnavailable,
    LeaseQuota,
    NotFound,
    TransportError,
    Unauthorized,
    UnsupportedHolder,
)
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.records import LeaseRequest, ReplicaRecord
from kvsp.transfer.block_client import (
    BlockClient,
    FetchStats,
    block_base,
    lease_base,
)
from kvsp.transfer.bulk import BulkClient, RequestTimeout
from kvsp.transfer.http11 import ConnectionClosed
from kvsp.transfer.verify import DEFAULT_HASHING, VerifiedBlock, plan_block
from kvsp.transfer.verify_slices import SliceBody
from kvsp.web.testing import RunningService, start_process
from tests.support import SUPPORT
from tests.support import bulk_server as srv

SERVER = SUPPORT / "bulk_server.py"
COMPAT, SCOPE = CompatId(bytes(range(32))), ScopeId(bytes(range(16)))
KEY = BlockKey(hashlib.sha256(b"block-client").digest())
T = TypeVar("T")


GEOMETRY = srv.GEOMETRY
EXPECTED = decode_container(srv.block_container(KEY))
DIGESTS = tuple(EXPECTED.layer_digests())


def run(coro: Awaitable[T]) -> T:
    async def main() -> T:
        return await coro

    return asyncio.run(main())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    folder = tmp_path_factory.mktemp("holder")
    with start_process([sys.executable, str(SERVER)], workdir=folder) as running:
        yield running


def record(holder: str, key: bytes = KEY, **changes: Any) -> ReplicaRecord:
    """The Replica Record of the test holder's block ``key`` at ``holder``."""
    digests = tuple(decode_container(srv.block_container(key)).layer_digests())
    fields: dict[str, Any] = {
        "block_key": BlockKey(key),
        "compat_id": COMPAT,
        "scope_id": SCOPE,
        "holder": holder,
        "codec": 1,
        "size": 65_536,
        "digest": replica_digest(digests),
        "layer_digests": digests,
        "residency": None,
        "ttl_ms": 60_000,
    }
    fields.update(changes)
    return ReplicaRecord(**fields)


def get(holder: str, rec: ReplicaRecord | None = None, **kw: Any) -> VerifiedBlock:
    async def main() -> VerifiedBlock:
        async with BlockClient(srv.TOKEN, hashing=kw.pop("hashing", "split")) as client:
            return await client.get_block(holder, rec or record(holder), geometry=GEOMETRY, **kw)

    return run(main())


def same_layers(block: Container, first: int, last: int) -> bool:
    want = EXPECTED.select(first, last)
    return [(bytes(a.k), bytes(a.v)) for a in block.layers] == [
        (bytes(b.k), bytes(b.v)) for b in want.layers
    ]


HASHING = ["inline", "thread", "split", "slices", "paired"]
# SliceBody with and without the native two-stream SHA-256 (kvsp.sha256x2)
PAIRED = [
    False,
    pytest.param(
        True,
        marks=pytest.mark.skipif(not sha256x2.ACCELERATED, reason="no native SHA-256 pairing"),
    ),
]


@pytest.mark.parametrize("hashing", HASHING)
@pytest.mark.parametrize("mode", ["good", "chunked"])
def test_whole_block_is_verified(server: RunningService, mode: str, hashing: str) -> None:
    holder = f"{server.base_url}{mode}/"
    block = get(holder, hashing=hashing)
    assert isinstance(block, VerifiedBlock) and isinstance(block, Container)
    assert (block.first_layer, block.layer_count, block.token_count) == (0, 8, srv.TOKENS)
    assert block.producer_verified and block.source == holder and same_layers(block, 0, 7)
    assert block.digest() == record(holder).digest
    # the body's checked Repr-Digest comes with it (a holder storing it need not hash again)
    assert block.body_digest == hashlib.sha256(srv.block_container(KEY)).digest()


@pytest.mark.parametrize("hashing", HASHING)
@pytest.mark.parametrize("mode", ["good", "chunked"])
def test_layer_range(server: RunningService, mode: str, hashing: str) -> None:
    block = get(f"{server.base_url}{mode}/", layers=(3, 7), hashing=hashing)
    assert (block.first_layer, block.layer_count) == (3, 5) and same_layers(block, 3, 7)


def test_asking_for_the_replica_codec(server: RunningService) -> None:
    assert get(f"{server.base_url}good/", codec=1).producer_verified


@pytest.mark.parametrize("hashing", HASHING)
@pytest.mark.parametrize(
    ("mode", "error", "match"),
    [
        ("badrepr", DigestMismatch, "Repr-Digest"),
        ("norepr", DigestMismatch, "no Repr-Digest"),
        ("garbled", DigestMismatch, "malformed Repr-Digest"),
        ("flip", DigestMismatch, "layer 5"),
        ("truncate", ConnectionClosed, "closed"),
        ("missing", NotFound, "no such block"),
        ("transcode", Incompatible, "codec 2"),
    ],
)
def test_bad_answers_never_hand_out_a_block(
    server: RunningService, mode: str, error: type[Exception], match: str, hashing: str
) -> None:
    with pytest.raises(error, match=match):
        get(f"{server.base_url}{mode}/", hashing=hashing)


@pytest.mark.parametrize("hashing", HASHING)
def test_a_kept_block_is_never_overwritten_by_later_ones(
    server: RunningService, hashing: str
) -> None:
    """Bodies land in pooled buffers (BufferPool): a block the caller still holds keeps its
    memory while others are fetched, and a dropped block's memory serves the next one."""
    holder = f"{server.base_url}good/"
    other = BlockKey(hashlib.sha256(b"block-client-other").digest())

    async def main() -> None:
        async with BlockClient(srv.TOKEN, hashing=hashing) as client:
            kept = await client.get_block(holder, record(holder), geometry=GEOMETRY)
            k_view = kept.layers[3].k
            del kept
            for _ in range(3):
                block = await client.get_block(holder, record(holder, other), geometry=GEOMETRY)
                assert block.layers[3].k.tobytes() != EXPECTED.layers[3].k.tobytes()
                del block
            assert k_view.tobytes() == EXPECTED.layers[3].k.tobytes()
            assert client.buffers.reused >= 2  # the other block's buffer came back twice
            reused = client.buffers.reused
            del k_view
            again = await client.get_block(holder, record(holder), geometry=GEOMETRY)
            assert same_layers(again, 0, 7) and client.buffers.reused == reused + 1
        assert client.buffers.idle_bytes == 0  # closing the client let its idle buffers go
        assert same_layers(again, 0, 7)  # a block handed out outlives its client

    run(main())


def test_flipped_octet_in_a_range(server: RunningService) -> None:
    with pytest.raises(DigestMismatch, match="layer"):
        get(f"{server.base_url}flip/", layers=(4, 7))


def test_layers_the_holder_lacks(server: RunningService) -> None:
    holder = f"{server.base_url}good/"
    digests = DIGESTS + DIGESTS  # a record of 16 layers; the holder has 8
    rec = record(holder, layer_digests=digests, digest=replica_digest(digests))
    with pytest.raises(LayersUnavailable):
        get(holder, rec, layers=(9, 10))


def test_records_that_cannot_verify(server: RunningService) -> None:
    holder = f"{server.base_url}good/"
    with pytest.raises(DigestMismatch, match="record"):
        get(holder, record(holder, digest=bytes(32)))
    with pytest.raises(Incompatible, match="no layer_digests"):
        get(holder, record(holder, layer_digests=None), layers=(1, 2))
    with pytest.raises(Incompatible, match="layers 3-9"):
        get(holder, layers=(3, 9))
    with pytest.raises(UnsupportedHolder):
        get("moqt://relay.example/", record("moqt://relay.example/", moqt_namespace=b"x"))
    with pytest.raises(UnsupportedHolder):
        get("http:///no-host", record(holder))


def test_record_without_layer_digests_checks_the_replica_digest(server: RunningService) -> None:
    holder = f"{server.base_url}good/"
    assert same_layers(get(holder, record(holder, layer_digests=None)), 0, 7)
    with pytest.raises(DigestMismatch, match="replica digest"):
        get(holder, record(holder, layer_digests=None, digest=bytes(32)))


def test_layers_land_in_a_caller_sink(server: RunningService) -> None:
    section = GEOMETRY.section_length(srv.TOKENS)
    pages = {i: (bytearray(section), bytearray(section)) for i in range(8)}

    class Sink:
        def layer_buffer(self, index: int, k: int, v: int) -> tuple[memoryview, memoryview]:
            return memoryview(pages[index][0]), memoryview(pages[index][1])

    block = get(f"{server.base_url}chunked/", layers=(2, 4), sink=Sink())
    assert same_layers(block, 2, 4)
    assert bytes(pages[3][1]) == bytes(EXPECTED.layers[3].v)


def test_wrong_token(server: RunningService) -> None:
    async def main() -> None:
        async with BlockClient("wrong") as client:
            holder = f"{server.base_url}good/"
            await client.get_block(holder, record(holder), geometry=GEOMETRY)

    with pytest.raises(Unauthorized):
        run(main())


# -- fetch ---------------------------------------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_fetch_falls_through_to_the_first_good_replica(server: RunningService) -> None:
    base = server.base_url
    dead = f"http://127.0.0.1:{closed_port()}/"
    holders = [f"{base}{m}/" for m in ("missing", "flip", "truncate", "badrepr", "norepr")]
    replicas = [record(h) for h in [dead, *holders]]
    replicas.insert(2, record("moqt://relay.example/", moqt_namespace=b"x"))
    replicas += [record(f"{base}chunked/"), record(f"{base}good/")]

    async def main() -> tuple[VerifiedBlock | None, FetchStats]:
        async with BlockClient(srv.TOKEN) as client:
            return await client.fetch(replicas, layers=(1, 6), geometry=GEOMETRY), client.stats

    block, stats = run(main())
    assert block is not None and block.source == f"{base}chunked/" and same_layers(block, 1, 6)
    errors = {holder: s.errors for holder, s in stats.sources.items()}
    assert errors == {
        dead: {"TransportError": 1},
        f"{base}missing/": {"NotFound": 1},
        f"{base}flip/": {"DigestMismatch": 1},
        f"{base}truncate/": {"ConnectionClosed": 1},
        f"{base}badrepr/": {"DigestMismatch": 1},
        f"{base}norepr/": {"DigestMismatch": 1},
        f"{base}chunked/": {},
    }
    good = stats.sources[f"{base}chunked/"]
    assert good.successes == 1 and good.octets == 6 * 2 * GEOMETRY.section_length(srv.TOKENS)
    assert good.seconds > 0 and (stats.mbit_per_s(f"{base}chunked/") or 0) > 0
    assert stats.mbit_per_s(f"{base}flip/") is None and len(stats.recent) == 7


def test_fetch_returns_none_when_every_replica_fails(server: RunningService) -> None:
    replicas = [record(f"{server.base_url}{m}/") for m in ("missing", "flip")]

    async def main() -> VerifiedBlock | None:
        async with BlockClient(srv.TOKEN) as client:
            return await client.fetch(replicas, geometry=GEOMETRY)

    assert run(main()) is None


def test_fetch_moves_on_from_a_silent_holder(server: RunningService) -> None:
    async def main() -> tuple[VerifiedBlock | None, FetchStats]:
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await asyncio.sleep(10)
            finally:
                writer.close()

        hang = await asyncio.start_server(silent, "127.0.0.1", 0)
        slow = f"http://127.0.0.1:{hang.sockets[0].getsockname()[1]}/"
        async with hang, BlockClient(srv.TOKEN, timeout=0.3) as client:
            replicas = [record(slow), record(f"{server.base_url}good/")]
            return await client.fetch(replicas, geometry=GEOMETRY), client.stats

    block, stats = run(main())
    assert block is not None and block.source == f"{server.base_url}good/"
    assert any(s.errors == {"RequestTimeout": 1} for s in stats.sources.values())
    assert RequestTimeout.__mro__[1] is TransportError


def test_bases_of_a_record() -> None:
    rec = record("https://h1.example/kvsp")
    assert block_base(rec) == lease_base(rec) == "https://h1.example/kvsp/"
    relay = record("moqt://relay.example/", moqt_namespace=b"x", lease_base="http://relay.example/")
    assert lease_base(relay) == "http://relay.example/"
    with pytest.raises(UnsupportedHolder):
        block_base(relay)


# -- storage and leases --------------------------------------------------------------------------


def test_put_then_get(server: RunningService) -> None:
    key = BlockKey(hashlib.sha256(b"stored").digest())
    data = srv.block_container(key)
    holder = f"{server.base_url}store/"

    async def main() -> tuple[bool, bool, VerifiedBlock]:
        async with BlockClient(srv.TOKEN) as client:
            first = await client.put_block(holder, COMPAT, SCOPE, key, data)
            parts = decode_container(data).encode_parts()
            again = await client.put_block(holder, COMPAT, SCOPE, key, parts)
            block = await client.get_block(holder, record(holder, key), geometry=GEOMETRY)
            return first, again, block

    stored, again, block = run(main())
    assert (
        stored
        and not again
        and bytes(block.layers[7].v) == bytes(decode_container(data).layers[7].v)
    )


def test_put_refused(server: RunningService) -> None:
    async def main() -> None:
        async with BlockClient("wrong") as client:
            await client.put_block(f"{server.base_url}store/", COMPAT, SCOPE, KEY, b"KVB1")

    with pytest.raises(Unauthorized):
        run(main())


def test_lease_round_trip(server: RunningService) -> None:
    holder = f"{server.base_url}good/"
    request = LeaseRequest(compat_id=COMPAT, scope_id=SCOPE, block_keys=(KEY,), ttl_ms=2000)

    async def main() -> None:
        async with BulkClient() as bulk, BlockClient(srv.TOKEN, bulk=bulk) as client:
            grant = await client.acquire_lease(holder, request)
            assert grant.ttl_ms == 2000 and grant.block_keys == (KEY,)
            renewed = await client.renew_lease(holder, grant.lease, 5000)
            assert (renewed.lease, renewed.ttl_ms) == (grant.lease, 5000)
            with pytest.raises(LeaseQuota):
                await client.renew_lease(holder, grant.lease, 10**9)
            await client.release_lease(holder, grant.lease)
            with pytest.raises(NotFound):
                await client.release_lease(holder, grant.lease)
            with pytest.raises(LeaseQuota):
                big = LeaseRequest(
                    compat_id=COMPAT, scope_id=SCOPE, block_keys=(KEY,), ttl_ms=10**9
                )
                await client.acquire_lease(holder, big)
            with pytest.raises(ValueError):
                await client.release_lease(holder, "../blocks")

    run(main())


def test_malformed_container_is_a_container_error(server: RunningService) -> None:
    key = BlockKey(hashlib.sha256(b"short").digest())
    holder = f"{server.base_url}good/"
    # the client expects another geometry: the container's lengths do not fit it

    async def main() -> None:
        async with BlockClient(srv.TOKEN) as client:
            other = Geometry(8, 4, 64, 2)
            await client.get_block(holder, record(holder, key), geometry=other)

    with pytest.raises(ContainerError):
        run(main())


# -- SliceBody: the contiguous body hashed in slices -------------------------------------------


def test_default_placement_follows_the_native_hashing() -> None:
    want = "paired" if sha256x2.ACCELERATED else "slices"
    assert BlockClient(srv.TOKEN).hashing == DEFAULT_HASHING == want


@pytest.mark.parametrize("hashing", ["slices", "paired"])
def test_sliced_placements_hold_the_other_checks(server: RunningService, hashing: str) -> None:
    holder = f"{server.base_url}good/"
    assert same_layers(get(holder, record(holder, layer_digests=None), hashing=hashing), 0, 7)
    with pytest.raises(DigestMismatch, match="replica digest"):
        get(holder, record(holder, layer_digests=None, digest=bytes(32)), hashing=hashing)
    with pytest.raises(DigestMismatch, match="layer"):
        get(f"{server.base_url}flip/", layers=(4, 7), hashing=hashing)


def test_slices_on_uvloop(server: RunningService) -> None:
    uvloop = pytest.importorskip("uvloop")
    holder = f"{server.base_url}good/"

    async def main() -> list[VerifiedBlock]:
        async with BlockClient(srv.TOKEN, hashing="slices", slice_step=4096) as client:
            return list(
                await asyncio.gather(
                    *(client.get_block(holder, record(holder), geometry=GEOMETRY) for _ in range(4))
                )
            )

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        blocks = runner.run(main())
    assert all(same_layers(block, 0, 7) for block in blocks)


def feed_slices(
    body: bytes,
    *,
    expected: bytes | None = None,
    layers: tuple[int, int] | None = None,
    length: int | None = None,
    piece: int = 1000,
    rec: ReplicaRecord | None = None,
    workers: int | None = 2,
    paired: bool = False,
) -> tuple[Container, bool]:
    """Feed ``body`` through a SliceBody in ``piece``-octet writes, as the bulk path does."""
    rec = rec or record("http://h.example/")

    async def main() -> tuple[Container, bool]:
        pool = ThreadPoolExecutor(workers) if workers else None
        try:
            plan = plan_block(rec, layers, GEOMETRY, None)
            digest = hashlib.sha256(body).digest() if expected is None else expected
            size = len(body) if length is None else length
            consumer = SliceBody(plan, digest, size, executor=pool, step=3000, paired=paired)
            fed = 0
            try:
                while fed < min(len(body), size):
                    dst = consumer.buffer(piece)
                    n = len(dst)
                    dst[:] = body[fed : fed + n]
                    fed += n
                    consumer.written(n)
                    await asyncio.sleep(0)
                consumer.finish()
            except BaseException as exc:
                consumer.fail(exc)
                raise
            return await consumer.result()
        finally:
            if pool is not None:
                pool.shutdown()

    return run(main())


@pytest.mark.parametrize("paired", PAIRED)
@pytest.mark.parametrize("workers", [None, 1, 2])
@pytest.mark.parametrize("piece", [1, 7, 1000, 1 << 20])
def test_slice_body_hands_out_views_of_verified_layers(
    workers: int | None, piece: int, paired: bool
) -> None:
    body = srv.block_container(KEY)  # piece 1: every boundary is crossed mid-write
    container, producer = feed_slices(body, piece=piece, workers=workers, paired=paired)
    assert producer and same_layers(container, 0, 7)
    # without layer_digests the layers' own digests must give the replica digest
    rec = record("http://h.example/", layer_digests=None)
    container, producer = feed_slices(body, piece=piece, workers=workers, rec=rec, paired=paired)
    assert producer and same_layers(container, 0, 7)


@pytest.mark.parametrize("paired", PAIRED)
def test_slice_body_refuses_what_verification_refuses(paired: bool) -> None:
    body = srv.block_container(KEY)

    def feed(data: bytes, **kwargs: Any) -> tuple[Container, bool]:
        return feed_slices(data, paired=paired, **kwargs)

    with pytest.raises(DigestMismatch, match="Repr-Digest"):
        feed(body, expected=bytes(32))
    flipped = bytearray(body)
    flipped[-1] ^= 1  # the last layer's V section; Repr-Digest is of the flipped octets
    with pytest.raises(DigestMismatch, match="layer 7"):
        feed(bytes(flipped))
    flipped = bytearray(body)
    layer_span = (len(body) - header_size(8)) // 8  # eight layers of one size, no trailer
    flipped[header_size(8) + 3 * layer_span] ^= (
        1  # the first octet of layer 3: caught when layer 3 completes
    )
    with pytest.raises(DigestMismatch, match="layer 3"):
        feed(bytes(flipped))
    with pytest.raises(ContainerError, match="container of"):
        feed(body + b"x")  # Content-Length one beyond the container
    with pytest.raises(ContainerError, match="container of"):
        feed(body[:-1])
    with pytest.raises(ContainerError, match="not a KVB1"):
        feed(body[:5])
    with pytest.raises(ContainerError):
        feed(b"NOPE" + body[4:])
    with pytest.raises(Incompatible, match="asked for layers 3-7"):
        feed(body, layers=(3, 7))  # the whole container where a range was asked
    with pytest.raises(DigestMismatch, match="replica digest"):
        feed(body, rec=record("http://h.example/", layer_digests=None, digest=bytes(32)))


def test_parts_response_sends_each_part_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvsp.web import responses  # noqa: PLC0415 - the server side
    from kvsp.web.responses import PartsResponse  # noqa: PLC0415

    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def receive() -> Any:
        raise AssertionError("a GET answer reads nothing")

    headers = {"content-length": "5", "repr-digest": "sha-256=:x:"}
    part = memoryview(b"abc")
    response = PartsResponse([part, b"de"], headers=headers, media_type="application/kvsp-block")
    run(response({"type": "http"}, receive, send))
    start, first, second = sent
    assert start["status"] == 200
    assert dict(start["headers"]) == {
        b"content-length": b"5",
        b"repr-digest": b"sha-256=:x:",
        b"content-type": b"application/kvsp-block",
    }
    assert first == {"type": "http.response.body", "body": part, "more_body": True}
    assert first["body"] is part  # the stored memory itself, not a copy
    assert second == {"type": "http.response.body", "body": b"de", "more_body": False}
    sent.clear()
    run(PartsResponse([], headers={"content-length": "0"}, media_type="x/y")({}, receive, send))
    assert sent[1] == {"type": "http.response.body", "body": b""}
    sent.clear()
    monkeypatch.setattr(responses, "SEND_SLICE", 2)  # a part beyond it goes in slices
    run(PartsResponse([b"abcde"], headers={}, media_type="x/y")({}, receive, send))
    assert [bytes(m["body"]) for m in sent[1:]] == [b"ab", b"cd", b"e"]
    assert [m["more_body"] for m in sent[1:]] == [True, True, False]


@pytest.mark.skipif(not sha256x2.ACCELERATED, reason="no native SHA-256 pairing")
def test_paired_slice_body_hashes_both_streams_in_one_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvsp.transfer import verify_slices  # noqa: PLC0415 - the module under test

    calls: list[tuple[int, int]] = []
    native = sha256x2.feed_layers

    def counting(
        a: sha256x2.Sha256, b: sha256x2.Sha256, data: memoryview, ends: list[int]
    ) -> list[bytes]:
        calls.append((len(data), len(ends)))
        return native(a, b, data, ends)

    monkeypatch.setattr(verify_slices.sha256x2, "feed_layers", counting)
    body = srv.block_container(KEY)
    container, producer = feed_slices(body, piece=1 << 20, paired=True)
    assert producer and same_layers(container, 0, 7)
    # every layer octet once, in pairs, each layer finished once, a few calls per block
    assert sum(n for n, _ in calls) == len(body) - header_size(8)
    assert sum(k for _, k in calls) == 8 and len(calls) <= len(body) // 3000 + 2
    calls.clear()
    feed_slices(body, piece=1 << 20, paired=False)
    assert calls == []


def test_paired_verification_leaves_a_core_to_the_receiving_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvsp.transfer import block_client  # noqa: PLC0415 - the module under test

    monkeypatch.setattr(block_client.sha256x2, "ACCELERATED", True)
    for cores, want in ((1, 1), (2, 1), (3, 2), (16, 4)):
        monkeypatch.setattr(block_client.os, "sched_getaffinity", lambda _, n=cores: set(range(n)))
        assert block_client.default_workers("paired") == want
        assert block_client.default_workers("slices") == 2  # its two passes of one block at once
    monkeypatch.setattr(block_client.sha256x2, "ACCELERATED", False)
    assert block_client.default_workers("paired") == 2  # hashing as "slices"


def test_paired_falls_back_to_hashlib_where_the_native_pairing_cannot_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvsp.transfer import verify_slices  # noqa: PLC0415 - the module under test

    def refuse(*_: object) -> list[bytes]:
        raise AssertionError("the native pairing ran")

    monkeypatch.setattr(verify_slices.sha256x2, "ACCELERATED", False)
    monkeypatch.setattr(verify_slices.sha256x2, "feed_layers", refuse)
    body = srv.block_container(KEY)
    container, producer = feed_slices(body, paired=True)
    assert producer and same_layers(container, 0, 7)
    flipped = bytearray(body)
    flipped[-1] ^= 1
    with pytest.raises(DigestMismatch, match="layer 7"):
        feed_slices(bytes(flipped), paired=True)
