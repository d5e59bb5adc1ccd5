"""The layer digests of a relay's FETCH miss computed two at a time (relay/ingest.py
``ObjectIngest.store_each``, relay/fetch.py ``_FetchRelay.store_completed``), sans-I/O.

The objects a batch of received data completed are hashed in pairs on the two lanes of
:func:`kvsp.sha256x2.digest_pair` (hashlib one after the other where the native entry point is
absent); what must hold either way: every object is checked against its in-band layer digest
(DESIGN §4, spec §6.7) before it is cached and before the stream's FIN goes downstream; a
failure in either lane of a pair stops the batch there (the track is tombstoned, the stream
reset, never finished); an object without a partner (an odd count, or a stream reset or ended
with one pending) is hashed alone at once, never held for one that may not come.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest

from kvsp import sha256x2
from moqt.errors import StreamResetCode
from moqt.objects import ObjectStart
from moqt.session_events import DataStreamFinished, DataStreamReset, ObjectHeader
from moqt.wire import KeyValuePair, Location
from relay.cache import ObjectCache
from relay.fetch import _FetchRelay
from relay.ingest import CompleteObject, Ended, ObjectIngest
from relay.kv import KVReplica
from relay.track import TrackHooks
from tests.support.relay_kit import Block, make_block

STREAM = 5
UPSTREAM_RESET = 0x7


class Hashing:
    """Records which layers were hashed together and which alone (still hashing them)."""

    def __init__(self, block: Block, monkeypatch: pytest.MonkeyPatch) -> None:
        self.index = {layer: i for i, layer in enumerate(block.layers)}
        self.calls: list[tuple[int, ...]] = []
        pair, alone = sha256x2.digest_pair, sha256x2.digest_pieces

        def digest_pair(a: list[sha256x2.Buffer], b: list[sha256x2.Buffer]) -> tuple[bytes, bytes]:
            self.calls.append((self._which(a), self._which(b)))
            return pair(a, b)

        def digest_pieces(pieces: list[sha256x2.Buffer]) -> bytes:
            self.calls.append((self._which(pieces),))
            return alone(pieces)

        monkeypatch.setattr(sha256x2, "digest_pair", digest_pair)
        monkeypatch.setattr(sha256x2, "digest_pieces", digest_pieces)

    def _which(self, pieces: list[sha256x2.Buffer]) -> int:
        return self.index.get(b"".join(pieces), -1)


def forge(block: Block, index: int) -> list[tuple[bytes, tuple[KeyValuePair, ...]]]:
    """``block``'s objects with layer ``index`` one octet off (its digest extension kept)."""
    objects = block.objects()
    payload = bytearray(objects[index][0])
    payload[len(payload) // 2] ^= 0xFF
    objects[index] = (bytes(payload), objects[index][1])
    return objects


def start(index: int, payload: bytes, extensions: tuple[KeyValuePair, ...]) -> ObjectStart:
    return ObjectStart(
        group_id=0,
        subgroup_id=None,
        object_id=index,
        publisher_priority=None,
        extensions=extensions,
        payload_length=len(payload),
    )


def pieces(payload: bytes) -> Iterator[memoryview]:
    """``payload`` in uneven pieces, none a multiple of SHA-256's 64-octet block."""
    view = memoryview(payload)
    cuts = [0, 1, 100, len(payload) // 2 + 3, len(payload)]
    for begin, end in zip(cuts, cuts[1:], strict=False):
        if begin < end:
            yield view[begin:end]


def completes(
    ingest: ObjectIngest, objects: list[tuple[bytes, tuple[KeyValuePair, ...]]]
) -> list[CompleteObject]:
    taken = []
    for index, (payload, extensions) in enumerate(objects):
        assert ingest.begin(STREAM, start(index, payload, extensions), 0) is None
        for piece in pieces(payload):
            assert ingest.data(STREAM, piece, 0) is None
        complete = ingest.complete(STREAM)
        assert complete is not None
        taken.append(complete)
    return taken


def cached(cache: ObjectCache, block: Block) -> list[int]:
    """The object IDs of ``block`` cached, each checked byte for byte with its digest."""
    held = []
    for index, layer in enumerate(block.layers):
        obj = cache.get(block.track, Location(0, index), 0)
        if obj is not None:
            assert bytes(obj.payload_bytes()) == layer
            assert obj.digest == block.digests[index]
            held.append(index)
    return held


# --- ObjectIngest.store_each ----------------------------------------------------------------


@pytest.mark.parametrize("layers", [1, 4, 5])
def test_layers_are_hashed_in_pairs_and_one_left_over_alone(
    lanes: str, layers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    block = make_block(401 + layers, layers=layers, size=3000)
    hashing = Hashing(block, monkeypatch)
    cache = ObjectCache(1 << 20)
    ingest = ObjectIngest(cache, block.track)
    ended = list(ingest.store_each(completes(ingest, block.objects()), 0))
    assert [e.malformed for e in ended] == [None] * layers
    expected = [(i, i + 1) for i in range(0, layers - 1, 2)] + (
        [(layers - 1,)] if layers % 2 else []
    )
    assert hashing.calls == expected
    assert cached(cache, block) == list(range(layers))
    replica = ended[-1].replica  # the last layer completes the replica (its digests check out)
    assert replica is not None and replica.layer_digests == block.digests


@pytest.mark.parametrize("bad", [2, 3, 4], ids=["first-lane", "second-lane", "alone"])
def test_a_layer_failing_its_digest_in_either_lane_is_never_cached(
    lanes: str, bad: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    block = make_block(411, layers=5, size=3000)
    cache = ObjectCache(1 << 20)
    ingest = ObjectIngest(cache, block.track)
    seen: list[Ended] = []
    stored_before: list[list[int]] = []
    for ended in ingest.store_each(completes(ingest, forge(block, bad)), 0):
        seen.append(ended)
        stored_before.append(cached(cache, block))
        if ended.malformed is not None:
            break  # as the caller does: the rest would be refused
    assert [e.malformed is None for e in seen] == [True] * bad + [False]
    assert f"layer {bad}" in (seen[-1].malformed or "")
    assert stored_before[bad - 1] == list(range(bad))  # the good ones before it were cached
    assert cache.is_malformed(block.track, 0)
    assert cache.track(block.track) is None  # the forged layer never was, nor anything after


def test_a_track_without_layer_digests_is_cached_unhashed(monkeypatch: pytest.MonkeyPatch) -> None:
    block = make_block(421, layers=3, size=3000)
    hashing = Hashing(block, monkeypatch)
    cache = ObjectCache(1 << 20)
    key = ((b"plain", b"ns"), b"track")  # not a stored KV replica track
    ingest = ObjectIngest(cache, key)
    ended = list(ingest.store_each(completes(ingest, block.objects()), 0))
    assert [e.malformed for e in ended] == [None, None, None]
    assert hashing.calls == []
    stored = [cache.get(key, Location(0, i), 0) for i in range(3)]
    assert [obj.digest if obj else b"-" for obj in stored] == [None, None, None]


# --- _FetchRelay: the order of caching, forwarding and the stream's end ----------------------


class Downstream:
    """The downstream session and connection :class:`_FetchRelay` writes to, as a log."""

    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        self.log = log
        self.session = self

    def send_buffered(self, stream: int) -> int:
        return 0

    def begin_fetch_object(self, stream: int, **fields: Any) -> None:
        self.log.append(("header", fields["object_id"]))

    def write_payload(self, stream: int, data: sha256x2.Buffer) -> None:
        self.log.append(("data", len(data)))

    def finish_stream(self, stream: int) -> None:
        self.log.append(("fin",))

    def reset_data_stream(self, stream: int, code: int) -> None:
        self.log.append(("reset", code))

    def transmit(self) -> None:
        pass


def fetch_relay(block: Block, log: list[tuple[Any, ...]]) -> tuple[_FetchRelay, ObjectCache]:
    cache = ObjectCache(1 << 20)
    replicas: list[KVReplica] = []
    hooks = TrackHooks(
        cache=cache,
        now_ms=lambda: 0,
        on_replica=replicas.append,
        on_cached=lambda: log.append(("cached",)),
        on_ended=lambda track: None,
    )
    relay = _FetchRelay(cast(Any, Downstream(log)), ObjectIngest(cache, block.track), hooks)
    relay.stream = 1
    return relay, cache


def deliver(
    relay: _FetchRelay, objects: list[tuple[bytes, tuple[KeyValuePair, ...]]], *, part: int = 0
) -> None:
    """One batch of received data: every object of ``objects`` whole, then ``part`` octets of
    one more (its header is the last of ``objects``'s kind: a copy of the first)."""
    for index, (payload, extensions) in enumerate(objects):
        header = ObjectHeader(STREAM, 0, None, start(index, payload, extensions))
        for piece in pieces(payload):
            relay.piece(header, piece, 0)
        relay.object_end(header)
    if part:
        payload, extensions = objects[0]
        header = ObjectHeader(STREAM, 0, None, start(len(objects), payload, extensions))
        relay.piece(header, memoryview(payload)[:part], 0)


def after(log: list[tuple[Any, ...]], what: Callable[[tuple[Any, ...]], bool]) -> list[str]:
    return [entry[0] for entry in log[next(i for i, e in enumerate(log) if what(e)) :]]


def test_every_layer_is_checked_and_cached_before_the_fin_goes_out(
    lanes: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    block = make_block(431, layers=5, size=3000)
    hashing = Hashing(block, monkeypatch)

    async def scenario() -> None:
        log: list[tuple[Any, ...]] = []
        relay, cache = fetch_relay(block, log)
        deliver(relay, block.objects())
        assert cached(cache, block) == []  # hashed after the batch's transmit, not during it
        assert relay.on_event(DataStreamFinished(STREAM, 0)) is False  # in the same batch
        assert cached(cache, block) == [0, 1, 2, 3, 4]
        assert hashing.calls == [(0, 1), (2, 3), (4,)]
        assert after(log, lambda e: e[0] == "cached") == ["cached"] * 5 + ["fin"]
        await asyncio.sleep(0)  # the store the batch scheduled finds nothing left
        relay.close()
        assert log[-1] == ("fin",) and hashing.calls == [(0, 1), (2, 3), (4,)]

    asyncio.run(scenario())


@pytest.mark.parametrize("bad", [2, 3, 4], ids=["first-lane", "second-lane", "alone"])
def test_a_layer_failing_its_digest_resets_instead_of_the_fin(
    lanes: str, bad: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    block = make_block(441, layers=5, size=3000)

    async def scenario() -> None:
        log: list[tuple[Any, ...]] = []
        relay, cache = fetch_relay(block, log)
        deliver(relay, forge(block, bad))
        assert relay.on_event(DataStreamFinished(STREAM, 0)) is False
        relay.close()
        assert ("fin",) not in log
        assert [e for e in log if e[0] == "reset"] == [("reset", StreamResetCode.MALFORMED_TRACK)]
        assert [e[0] for e in log].count("cached") == bad
        assert cache.is_malformed(block.track, 0) and cache.track(block.track) is None

    asyncio.run(scenario())


@pytest.mark.parametrize("whole", [1, 3])
def test_a_reset_with_an_object_pending_caches_it_alone_and_passes_the_reset_on(
    lanes: str, whole: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The upstream stream is reset in the batch that completed an odd count of objects (one
    left without a partner) and began one more: the whole ones are hashed at once and cached,
    the part is not, and the reset goes downstream (no FIN)."""
    block = make_block(451, layers=4, size=3000)
    hashing = Hashing(block, monkeypatch)

    async def scenario() -> None:
        log: list[tuple[Any, ...]] = []
        relay, cache = fetch_relay(block, log)
        deliver(relay, block.objects()[:whole], part=700)
        assert relay.on_event(DataStreamReset(STREAM, 0, UPSTREAM_RESET)) is False
        relay.close()  # proxy_fetch's end: what arrived whole is cached
        assert cached(cache, block) == list(range(whole))
        assert hashing.calls == [(0, 1)] * (whole > 1) + [(whole - 1,)]
        assert ("fin",) not in log
        assert [e for e in log if e[0] == "reset"] == [("reset", UPSTREAM_RESET)]
        assert not cache.is_malformed(block.track, 0)

    asyncio.run(scenario())


def test_objects_completed_in_different_batches_are_not_held_for_a_partner(
    lanes: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch that completed one object caches it once the batch is through, though the next
    object is still arriving (a stalled upstream leaves nothing uncached that arrived whole)."""
    block = make_block(461, layers=3, size=3000)
    hashing = Hashing(block, monkeypatch)

    async def scenario() -> None:
        log: list[tuple[Any, ...]] = []
        relay, cache = fetch_relay(block, log)
        deliver(relay, block.objects()[:1], part=10)
        await asyncio.sleep(0)  # the batch's store runs after its transmit
        assert cached(cache, block) == [0]
        assert hashing.calls == [(0,)]
        relay.close()

    asyncio.run(scenario())
