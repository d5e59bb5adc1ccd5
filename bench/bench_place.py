"""Benchmark placement (§6.4–6.5) through the Placement Controller with an in-process index,
as ``kvsp serve control`` runs it: decisions per second with p50/p99, and where the time goes.

Run by hand: ``.venv/bin/python bench/bench_place.py`` (about a minute on 2 cores).

The data: ``--instances`` instances (1,000) each reporting ``--links`` links (20) to holders
drawn from 40 stores and 60 peer instances; ``--prompts`` prompts (4) of ``--prompt-keys``
keys (10,000) at 16 tokens a block. Each prompt is cut into 5 segments, as if 5 earlier
requests had computed successive parts of it: a segment is held by the instance that computed
it and 1–3 stores (disk tier with a read rate on half of them), so every block has 2–4
replicas of 2 MiB with 32 layers. Prompts are placed in turn; every decision fetches (the
holders are reachable) and sends a directive for up to 10,000 blocks, encoded to JSON by the
sender as the HTTP sender would.

Reported: whole decisions (``PlacementController.place``: expiry sweep, lookup, §6.4 over
every active instance, directive built and encoded), then the parts alone: the index lookup
(``LocalIndex.find``), ``choose_instance``, and directive build + JSON encoding; last, whole
decisions again with the world's objects frozen out of the garbage collector's sweeps.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import random
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from kvsp.compat import CompatibilityDescriptor, compat_id
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.index import IndexService
from kvsp.lifecycle import InstanceRegistry, SleepPolicy
from kvsp.placement import choose_instance
from kvsp.placement_plan import build_directive
from kvsp.records import (
    InstanceStatusRecord,
    Link,
    LookupRequest,
    PlaceRequest,
    PrefetchDirective,
    ReplicaRecord,
    Residency,
)
from kvsp.registries import InstanceState, Tier
from kvsp.services.control import LocalIndex
from kvsp.services.pc.service import PCConfig, PlacementController
from kvsp.stores.descriptors import DescriptorRegistry
from kvsp.stores.memory import MemoryStore
from kvsp.web.clock import ManualClock

SCOPE = ScopeId(bytes(range(16)))
LAYERS = 32
BLOCK_OCTETS = 2 * 1024 * 1024
STORES = tuple(f"https://store{i}.bench.example/kvsp/" for i in range(40))
SEGMENTS = 5
TTL_MS = 3_600_000
DESCRIPTOR = CompatibilityDescriptor(
    model="bench-llama-8b",
    model_digest=hashlib.sha256(b"weights").digest(),
    tokenizer_digest=hashlib.sha256(b"tokenizer").digest(),
    layers=LAYERS,
    kv_heads=8,
    head_dim=128,
    kv_dtype="bf16",
    positional="rope;theta=500000",
    block_tokens=16,
)
COMPAT = CompatId(compat_id(DESCRIPTOR))
DIGESTS = tuple(hashlib.sha256(b"layer%d" % n).digest() for n in range(LAYERS))


def instance_uri(n: int) -> str:
    return f"https://ii{n}.bench.example/kvsp/"


class EncodingPeers:
    """Instances that take directives: each is encoded to JSON, as the HTTP sender does."""

    def __init__(self) -> None:
        self.sent = 0
        self.octets = 0

    async def prefetch(self, instance: str, directive: PrefetchDirective) -> None:
        self.sent += 1
        self.octets += len(orjson.dumps(directive.to_json()))

    async def put_state(self, instance: str, state: InstanceState) -> None:
        pass


def replica(key: BlockKey, holder: str, rng: random.Random) -> ReplicaRecord:
    tiers: tuple[Residency, ...] | None = None
    if holder in STORES and rng.random() < 0.5:
        tiers = (Residency(tier=Tier.DISK, first=0, last=LAYERS - 1, read_mbit_per_s=16_000.0),)
    return ReplicaRecord(
        block_key=key,
        compat_id=COMPAT,
        scope_id=SCOPE,
        holder=holder,
        codec=1,
        size=BLOCK_OCTETS,
        digest=hashlib.sha256(b"".join(DIGESTS)).digest(),
        layer_digests=DIGESTS,
        residency=tiers,
        ttl_ms=TTL_MS,
    )


def prompt_keys(p: int, count: int) -> tuple[BlockKey, ...]:
    return tuple(BlockKey(hashlib.sha256(b"p%d/k%d" % (p, i)).digest()) for i in range(count))


def build_world(
    args: argparse.Namespace, rng: random.Random
) -> tuple[MemoryStore, list[tuple[BlockKey, ...]], list[InstanceStatusRecord]]:
    """Replica records of every prompt, and one status record per instance."""
    store = MemoryStore()
    peers = [instance_uri(n) for n in range(min(60, args.instances))]
    prompts = []
    items = []
    for p in range(args.prompts):
        keys = prompt_keys(p, args.prompt_keys)
        prompts.append(keys)
        step = -(-len(keys) // SEGMENTS)
        for start in range(0, len(keys), step):
            holders = [rng.choice(peers), *rng.sample(STORES, rng.randint(1, 3))]
            for key in keys[start : start + step]:
                items.extend((replica(key, h, rng), TTL_MS) for h in holders)
    asyncio.run(store.put_many(items))
    holders = [*STORES, *peers]
    statuses = [
        InstanceStatusRecord(
            instance=instance_uri(n),
            epoch=1,
            state=InstanceState.ACTIVE,
            running=rng.randint(0, 16),
            queued=rng.randint(0, 4),
            batch_size=32,
            kv_utilization=rng.random(),
            prefill_tokens_per_s=rng.uniform(20_000, 60_000),
            decode_tokens_per_s=3_000.0,
            links=tuple(
                Link(holder=h, mbit_per_s=rng.choice((25_000.0, 100_000.0, 400_000.0)), rtt_us=20.0)
                for h in rng.sample(holders, args.links)
            ),
            requested_state=None,
            ttl_ms=TTL_MS,
        )
        for n in range(args.instances)
    ]
    return store, prompts, statuses


def timed(samples: int, step: Callable[[int], Any]) -> list[float]:
    out = []
    for i in range(samples):
        start = time.perf_counter()
        step(i)
        out.append((time.perf_counter() - start) * 1000)
    return out


def report(name: str, ms: Sequence[float]) -> None:
    ordered = sorted(ms)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    print(
        f"{name:<44} {1000 / statistics.mean(ms):8.1f}/s   p50 {statistics.median(ms):7.2f} ms"
        f"   p99 {p99:7.2f} ms   (n={len(ms)})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=1000)
    parser.add_argument("--links", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-keys", type=int, default=10_000)
    parser.add_argument("--samples", type=int, default=40)
    args = parser.parse_args()
    rng = random.Random(7)

    started = time.perf_counter()
    store, prompts, statuses = build_world(args, rng)
    records = sum(len(p) for p in prompts)
    print(
        f"world: {args.instances} instances x {args.links} links, {args.prompts} prompts x "
        f"{args.prompt_keys} keys, {records} keys held by 2-4 holders "
        f"({time.perf_counter() - started:.1f} s to build)"
    )

    clock = ManualClock(1_000_000)
    descriptors = DescriptorRegistry()
    descriptors.add(DESCRIPTOR, persist=False)
    index = IndexService(store, max_ttl_ms=TTL_MS, descriptors=descriptors, max_lookup_keys=10**6)
    local = LocalIndex(index, descriptors)
    peers = EncodingPeers()
    policy = SleepPolicy(threshold_load=1, min_low_ms=60_000)
    pc = PlacementController(
        InstanceRegistry(policy), local, peers, clock, PCConfig(service_prior_us=20_000)
    )

    async def put_all() -> None:
        for record in statuses:
            await pc.put_status(record)

    start = time.perf_counter()
    asyncio.run(put_all())
    took = time.perf_counter() - start
    print(f"status records accepted (+ forwarded to the IS): {len(statuses) / took:,.0f}/s")

    requests = [
        PlaceRequest(
            scope_id=SCOPE,
            compat_id=COMPAT,
            block_keys=keys,
            prompt_tokens=len(keys) * 16 + 7,
            request_ref=f"bench-{p}",
        )
        for p, keys in enumerate(prompts)
    ]
    loop = asyncio.new_event_loop()
    answers: list[Any] = []

    def place(i: int) -> None:
        answers.append(loop.run_until_complete(pc.place(requests[i % len(requests)])))

    place(0)  # warm up
    print()
    report("place (whole decision, directive sent)", timed(args.samples, place))
    directed = sum(a.directive is not None for a in answers)
    print(
        f"    {directed}/{len(answers)} decisions sent a directive, "
        f"{peers.octets / max(peers.sent, 1) / 1e6:.2f} MB of JSON each; "
        f"{len({a.instance for a in answers})} distinct instances chosen"
    )

    lookups = [
        LookupRequest(scope_id=SCOPE, compat_id=COMPAT, block_keys=r.block_keys) for r in requests
    ]
    found = [loop.run_until_complete(local.find(q, clock.now_ms())) for q in lookups]
    candidates = pc.registry.active_instances(clock.now_ms())

    def lookup(i: int) -> None:
        loop.run_until_complete(local.find(lookups[i % len(lookups)], clock.now_ms()))

    def choose(i: int) -> None:
        r = requests[i % len(requests)]
        choose_instance(
            candidates,
            found[i % len(found)],
            block_tokens=16,
            prompt_tokens=r.prompt_tokens,
            service_times=pc.service_times,
            layers=LAYERS,
        )

    decisions = [
        choose_instance(
            candidates,
            found[i],
            block_tokens=16,
            prompt_tokens=r.prompt_tokens,
            service_times=pc.service_times,
            layers=LAYERS,
        )
        for i, r in enumerate(requests)
    ]

    def directive(i: int) -> None:
        n = i % len(requests)
        decision = decisions[n]
        if decision is None or decision.estimate.sources is None:
            return
        entry = pc.registry.get(decision.instance)
        if entry is None:
            return
        built = build_directive(
            directive_id=uuid.uuid4(),
            request=requests[n],
            replicas=found[n],
            sources=decision.estimate.sources,
            status=entry.record,
            deadline_ms=1000,
            lease_ms=5000,
        )
        if built is not None:
            orjson.dumps(built.to_json())

    def sweep(i: int) -> None:
        pc.sweep()

    print("  parts:")
    report("  index lookup (LocalIndex.find, 10k keys)", timed(args.samples, lookup))
    report(f"  choose_instance ({len(candidates)} active)", timed(args.samples, choose))
    report("  directive build + JSON encode", timed(args.samples, directive))
    report("  expiry sweep", timed(args.samples, sweep))
    # The world is ~10^5 long-lived records; every full collection walks them all. Frozen,
    # the collector skips them: what a server gains by gc.freeze() after loading its state.
    gc.collect()
    gc.freeze()
    report("place, long-lived objects gc.freeze()'d", timed(args.samples, place))
    report("  choose_instance, frozen", timed(args.samples, choose))
    gc.unfreeze()
    loop.close()
    print(f"\ntotal {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
