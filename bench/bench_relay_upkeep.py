"""Benchmark the relay's upkeep pass (MOQT draft-16 MAX_CACHE_DURATION; spec §4.4 record
refresh, §6.1 withdrawal; DESIGN.md §1): what one pass costs with a large cache when nothing,
or a few blocks, are due.

Run: ``.venv/bin/python bench/bench_relay_upkeep.py [--blocks 10000,100000] [--due 10]
[--passes 20]``.

Twice a second the relay asks its holder which replicas have expired and which records are due
for a refresh, and sweeps its cache for expired objects (``Relay._upkeep``). Each answer was a
scan of every cached block, in the event loop; now each comes from a deadline heap
(:meth:`relay.cache.ObjectCache.expire`, :meth:`relay.holder.RelayHolder.due` and
:meth:`~relay.holder.RelayHolder.expired`). For each cache size, one cache and holder hold that
many complete blocks (a 16-layer track each, MAX_CACHE_DURATION ten minutes, the record
published with a 60 s TTL), of which ``--due`` have a record due; the passes alternate between
the heaps and the scans the relay ran before (kept here as that variant, over the same
structures), and each prints its median milliseconds a pass. Last, one line a size:
``ratio upkeep-scan/upkeep-heap <N> blocks = X``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvsp.ids import BlockKey, CompatId, ScopeId  # noqa: E402
from kvsp.records import ReplicaRecord  # noqa: E402
from kvsp.web.clock import ManualClock  # noqa: E402
from moqt.errors import ObjectStatus  # noqa: E402
from moqt.messages_params import ExtensionType  # noqa: E402
from relay.cache import CachedObject, ObjectCache, TrackKey  # noqa: E402
from relay.holder import HolderConfig, RelayHolder  # noqa: E402
from relay.kv import BlockTrack, KVReplica  # noqa: E402

COMPAT = CompatId(bytes(range(32)))
SCOPE = ScopeId(bytes(range(1, 33)))
LAYERS = 16
DURATION_MS = 600_000
START_MS = 1_000_000


class Index:
    """An IS that grants every record its TTL."""

    async def publish(self, record: ReplicaRecord, /) -> int:
        return record.ttl_ms

    async def withdraw(self, compat_id: bytes, scope_id: bytes, key: bytes, holder: str, /) -> bool:
        return True


def build(blocks: int, due: int) -> tuple[ManualClock, ObjectCache, RelayHolder]:
    """A cache and holder with ``blocks`` complete blocks; ``due`` of them published early,
    so that their refresh is due when the passes run."""
    clock = ManualClock(START_MS)
    cache = ObjectCache(1 << 40)
    holder = RelayHolder(HolderConfig(record_ttl_ms=60_000), clock, Index())
    digests = tuple(hashlib.sha256(b"%d" % n).digest() for n in range(LAYERS))
    extensions = ((ExtensionType.MAX_CACHE_DURATION, DURATION_MS),)

    async def fill() -> None:
        for n in range(blocks):
            clock.set(START_MS - 30_000 if n < due else START_MS)
            key = n.to_bytes(32, "big")
            digest = hashlib.sha256(key).digest()
            namespace = (
                b"kvsp",
                b"1",
                COMPAT.hex().encode(),
                SCOPE.hex().encode(),
                key.hex().encode(),
            )
            track: TrackKey = (namespace, digest.hex().encode())
            cache.open_track(track, extensions)
            for layer in range(LAYERS):
                cache.put(track, layer_object(layer, clock.now_ms()))
            block = BlockTrack(COMPAT, SCOPE, BlockKey(key), digest)
            replica = KVReplica(block, track, digests, LAYERS * 4096, clock.now_ms() + DURATION_MS)
            if holder.add(replica):
                await holder.publish(track)

    asyncio.run(fill())
    clock.set(START_MS)
    return clock, cache, holder


def layer_object(layer: int, now_ms: int) -> CachedObject:
    """One layer's object as the cache keeps it (the payload does not matter here)."""
    return CachedObject(
        group_id=0,
        object_id=layer,
        subgroup_id=0,
        publisher_priority=128,
        extensions=(),
        status=ObjectStatus.NORMAL,
        payload=b"",
        arrived_ms=now_ms,
    )


def heap_pass(clock: ManualClock, cache: ObjectCache, holder: RelayHolder) -> int:
    """What ``Relay._upkeep`` asks now: the number of tracks named."""
    return len(holder.expired()) + len(cache.expire(clock.now_ms())) + len(holder.due())


def scan_pass(clock: ManualClock, cache: ObjectCache, holder: RelayHolder) -> int:
    """What it asked before: a scan of every replica, track and published block."""
    now = clock.now_ms()
    expired = [
        key
        for key, r in holder._replicas.items()
        if r.expires_ms is not None and now >= r.expires_ms
    ]
    tracks = list(cache._tracks.items())
    swept = [key for key, entry in tracks if cache._drop_expired(entry, now)]
    due = [p.replica.key for p in holder._blocks.values() if now >= p.due_ms]
    return len(expired) + len(swept) + len(due)


def main(argv: list[str] | None = None) -> int:
    """Print each size's milliseconds a pass for both variants, then the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", default="10000,100000", help="cache sizes, in blocks")
    parser.add_argument("--due", type=int, default=10, help="records due in each pass")
    parser.add_argument("--passes", type=int, default=20, help="passes of each variant")
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.blocks.split(",")]
    print(f"# {LAYERS}-layer blocks, MAX_CACHE_DURATION {DURATION_MS} ms; {args.due} records due")
    print(f"{'blocks':>8} {'variant':>8} {'ms a pass':>10} {'named':>6}")
    ratios: list[tuple[int, float]] = []
    for size in sizes:
        clock, cache, holder = build(size, args.due)
        times: dict[str, list[float]] = {"heap": [], "scan": []}
        named: dict[str, int] = {}
        for n in range(args.passes):
            order = ("heap", "scan") if n % 2 == 0 else ("scan", "heap")
            for variant in order:
                run = heap_pass if variant == "heap" else scan_pass
                started = time.perf_counter()
                named[variant] = run(clock, cache, holder)
                times[variant].append(time.perf_counter() - started)
        medians = {v: statistics.median(t) * 1e3 for v, t in times.items()}
        for variant in ("scan", "heap"):
            print(f"{size:8} {variant:>8} {medians[variant]:10.3f} {named[variant]:6}")
        ratios.append((size, medians["scan"] / medians["heap"]))
    print()
    for size, ratio in ratios:
        print(f"ratio upkeep-scan/upkeep-heap {size} blocks = {ratio:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
