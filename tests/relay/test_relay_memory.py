"""A relay's memory is its cache budget (relay/cache.py; DESIGN.md §4): what it fetched upstream
and evicted is gone, not kept alive by the sessions it came over."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest

from moqt.certs import make_self_signed
from relay import cache as cache_module
from relay import ingest as ingest_module
from relay.cache import CachedObject
from tests.support.polling import until
from tests.support.relay_kit import (
    Certs,
    Track,
    client,
    fetch_all,
    make_block,
    publishing,
    relay_config,
    run,
    running_relay,
)

pytestmark = pytest.mark.timeout(60)
LAYERS, LAYER = 4, 64 << 10


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_self_signed("localhost", tmp_path_factory.mktemp("relay-memory"))


class Counted(CachedObject):
    """A cached object that can be counted while alive (the collector does not list those
    the cache untracks)."""

    __slots__ = ("__weakref__",)


@pytest.mark.parametrize("native", [True, False], ids=["frozen-slices", "memoryviews"])
def test_blocks_fetched_through_the_relay_and_evicted_are_freed(
    certs: Certs, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twenty blocks of 256 KiB through a relay whose cache holds three. The upstream session
    kept each ended FETCH's reader, and the reader its forwarder with every object it cached:
    the relay held all twenty blocks (1,024 per upstream session at most), whatever its cache
    budget. Now the objects alive are the cache's own, whether the cache keeps its payloads as
    untracked slices or as memoryviews."""
    if native and cache_module._frozen is None:
        pytest.skip("moqt._frozen was not built here")
    if not native:
        monkeypatch.setattr(cache_module, "_frozen", None)
    made: weakref.WeakSet[Counted] = weakref.WeakSet()

    def counted(**fields: Any) -> CachedObject:
        obj = Counted(**fields)
        made.add(obj)
        return obj

    monkeypatch.setattr(ingest_module, "CachedObject", counted)
    blocks = [make_block(n, layers=LAYERS, size=LAYER) for n in range(20)]
    tracks = {block.track: Track(block.objects()) for block in blocks}
    prefix = blocks[0].namespace[:4]  # the scope: one announcement routes every block

    def objects_alive() -> int:
        gc.collect()
        return len(made)

    async def main() -> tuple[int, int]:
        before = objects_alive()
        config = relay_config(certs, cache_bytes=3 * LAYERS * (LAYER + 64))
        async with (
            running_relay(config) as relay,
            publishing(relay.url, certs, tracks, [prefix]),
            client(relay.url, certs) as connection,
        ):
            for block in blocks:
                got = await fetch_all(connection, block.track, LAYERS)
                assert [bytes(obj.payload) for obj in got] == list(block.layers)
            await until(lambda: not relay.cache.over_budget)  # the last eviction ran
            names = relay.cache.keys()
            held = [relay.cache.track(name) for name in names]
            cached = sum(len(track.objects) for track in held if track is not None)
            return cached, objects_alive() - before

    cached, alive = run(main())
    assert 0 < cached <= 3 * LAYERS
    assert alive == cached
