"""The cyclic garbage collector's pauses in a relay with a large cache (MOQT draft-16 relay
caching; relay/cache.py): cached payloads as untracked ``FrozenSlice``s against memoryviews.

Run: ``.venv/bin/python bench/bench_relay_gc.py [--objects N] [--size OCTETS] [--rounds R]``.

Each round fills one :class:`relay.cache.ObjectCache` through :class:`relay.ingest.ObjectIngest`
per variant, as a relay fills it from received data: objects of ``--size`` octets (4 KiB by
default: the layers of small blocks), 16 a track, each received as a read-only slice of a 1 MiB
receive buffer (which the cache copies under 16 KiB and keeps as a slice from there), carrying
one 32-octet extension as KV objects carry their layer digest.
The ``frozen`` variant is the cache as it is (``moqt._frozen`` built); ``tracked`` keeps its
payloads as memoryviews and every cached object tracked, as before. While it fills, the
collector runs when it decides to; the bench records the longest of those pauses. Then it
times full collections (``gc.collect()``, the median of five). The variants' order flips each
round. Prints, per variant and round, the objects the collector tracks, the longest pause while
filling and the full collection, then, of the medians::

    ratio gc-full-tracked/gc-full-frozen = X
    ratio gc-longest-pause-tracked/gc-longest-pause-frozen = X
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moqt.objects import ObjectStart  # noqa: E402
from moqt.receive_buffers import RECEIVE_BUFFER, prefaulted  # noqa: E402
from relay import cache as cache_module  # noqa: E402
from relay.cache import ObjectCache  # noqa: E402
from relay.ingest import ObjectIngest  # noqa: E402

LAYERS = 16
EXTENSION = 0x4001
DIGEST = b"\x5a" * 32
"""An extension's type and value, as the in-band layer digest's (names, not constants, so
that each object's tuple of pairs is its own, as when parsed)."""


class Pauses:
    """The collector's pauses while installed: each collection's duration."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.longest = max(self.longest, time.perf_counter() - self._started)


def fill(objects: int, size: int) -> tuple[ObjectCache, list[Any], float]:
    """A cache holding ``objects`` objects of ``size`` octets; the buffers they were received
    into; the longest collector pause while it filled (seconds)."""
    cache = ObjectCache(1 << 50)
    buffers: list[Any] = []
    view, at = memoryview(b""), 0
    pauses = Pauses()
    gc.callbacks.append(pauses)
    try:
        for track in range(-(-objects // LAYERS)):
            ingest = ObjectIngest(cache, ((b"bench", b"gc", b"%d" % track), b"layers"))
            for layer in range(min(LAYERS, objects - track * LAYERS)):
                if at + size > len(view):
                    buffers.append(prefaulted(RECEIVE_BUFFER))
                    view, at = memoryview(buffers[-1]).toreadonly(), 0
                start = ObjectStart(
                    group_id=0,
                    subgroup_id=0,
                    object_id=layer,
                    publisher_priority=None,
                    extensions=((EXTENSION, DIGEST),),
                    payload_length=size,
                )
                ingest.begin(0, start, 0)
                ingest.data(0, view[at : at + size], 0)
                ingest.end(0, 0)
                at += size
    finally:
        gc.callbacks.remove(pauses)
    return cache, buffers, pauses.longest


def measure(frozen: bool, objects: int, size: int) -> dict[str, float]:
    """Fill a cache with the variant; what the collector tracks and its pauses (ms)."""
    native = cache_module._frozen
    if not frozen:
        cache_module._frozen = None
    try:
        gc.collect()
        base = len(gc.get_objects())
        cache, buffers, longest = fill(objects, size)
        gc.collect()
        tracked = len(gc.get_objects()) - base
        full = []
        for _ in range(5):
            started = time.perf_counter()
            gc.collect()
            full.append(time.perf_counter() - started)
        del cache, buffers
        gc.collect()
    finally:
        cache_module._frozen = native
    return {"tracked": tracked, "longest": 1000 * longest, "full": 1000 * statistics.median(full)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, default=200_000, help="objects cached")
    parser.add_argument("--size", type=int, default=4096, help="octets an object")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if cache_module._frozen is None:
        sys.exit("moqt._frozen was not built here: nothing to compare")
    if args.objects < 1 or not 1 <= args.size <= RECEIVE_BUFFER:
        parser.error(f"--objects at least 1; --size from 1 to {RECEIVE_BUFFER}")
    results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    print(f"{args.objects} cached objects of {args.size} octets, {LAYERS} a track")
    print("variant   round   tracked objects   longest pause filling ms   gc.collect() ms")
    for round_ in range(args.rounds):
        for frozen in (True, False) if round_ % 2 == 0 else (False, True):
            got = measure(frozen, args.objects, args.size)
            results[frozen].append(got)
            print(
                f"{'frozen' if frozen else 'tracked':8}  {round_:5}   {got['tracked']:15.0f}"
                f"   {got['longest']:24.1f}   {got['full']:15.1f}",
                flush=True,
            )

    def median(frozen: bool, key: str) -> float:
        return statistics.median(run[key] for run in results[frozen])

    print()
    print(
        f"ratio gc-full-tracked/gc-full-frozen = {median(False, 'full') / median(True, 'full'):.2f}"
    )
    longest = median(False, "longest") / median(True, "longest")
    print(f"ratio gc-longest-pause-tracked/gc-longest-pause-frozen = {longest:.2f}")


if __name__ == "__main__":
    main()
