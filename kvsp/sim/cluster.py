"""The simulated cluster: holders with LRU block caches that publish to and withdraw from the
real Index Service (spec §6.1), instances with FIFO prefill queues, NICs with bandwidth and RTT.

Sans-I/O like the core: nothing here reads a clock; every call takes the simulated time.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvsp.ids import BlockKey
from kvsp.records import InstanceStatusRecord, Link, Residency
from kvsp.registries import InstanceState, Tier
from kvsp.sim.config import ClusterConfig
from kvsp.sim.replicas import ClusterIndex
from kvsp.sim.trace import SimRequest


class Holder:
    """A holder of blocks: an LRU cache of ``capacity`` blocks, each with the time it is (or
    will be) resident; pins (leases, in-use blocks) that eviction skips; one NIC.

    Every replica it holds and has finished loading is published; it withdraws the record
    before it evicts the block (§6.1 MUST). A request's blocks are inserted and touched tail
    first, so that LRU evicts a prefix from its end: a chain is useless past its first gap.
    """

    def __init__(
        self,
        uri: str,
        *,
        capacity: int,
        nic_mbit_per_s: float,
        index: ClusterIndex,
        residency: tuple[Residency, ...] | None = None,
        read_mbit_per_s: float = math.inf,
    ) -> None:
        self.uri = uri
        self.capacity = capacity
        self.nic_mbit_per_s = nic_mbit_per_s
        self.read_mbit_per_s = read_mbit_per_s
        self.residency = residency
        self.cache: OrderedDict[BlockKey, float] = OrderedDict()
        self.published: set[BlockKey] = set()
        self.pins: dict[BlockKey, int] = {}
        self.egress_free_us = 0.0
        self.ingress_free_us = 0.0
        self.evictions = 0
        self._index = index

    def leading(self, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` are in the cache (resident or arriving)."""
        cache = self.cache
        n = 0
        for key in keys:
            if key not in cache:
                break
            n += 1
        return n

    def pin(self, keys: Iterable[BlockKey]) -> None:
        """Protect ``keys`` from eviction (counted: pins nest)."""
        pins = self.pins
        for key in keys:
            pins[key] = pins.get(key, 0) + 1

    def unpin(self, keys: Iterable[BlockKey]) -> None:
        """Release one pin of each of ``keys``."""
        pins = self.pins
        for key in keys:
            left = pins[key] - 1
            if left:
                pins[key] = left
            else:
                del pins[key]

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Mark ``keys`` (those present) most recently used, tail first."""
        cache = self.cache
        for key in reversed(keys):
            if key in cache:
                cache.move_to_end(key)

    def insert(
        self, items: Sequence[tuple[BlockKey, float]], now_ms: int, *, publish: bool
    ) -> None:
        """Add blocks with their ready times (tail first), evict down to capacity, and publish
        the new ones when ``publish`` (they are resident now)."""
        cache = self.cache
        for key, ready in reversed(items):
            old = cache.get(key)
            cache[key] = ready if old is None else min(old, ready)
            cache.move_to_end(key)
        self._evict()
        if publish:
            self.publish([key for key, _ in items], now_ms)

    def publish(self, keys: Iterable[BlockKey], now_ms: int) -> None:
        """Publish the replicas of those ``keys`` still held and not yet published."""
        fresh = [k for k in keys if k in self.cache and k not in self.published]
        if fresh:
            self.published.update(fresh)
            self._index.publish(self.uri, fresh, now_ms, self.residency)

    def _evict(self) -> None:
        cache, pins, published = self.cache, self.pins, self.published
        scanned, limit = 0, len(cache)
        while len(cache) > self.capacity and scanned < limit:
            key = next(iter(cache))
            scanned += 1
            if key in pins:
                cache.move_to_end(key)  # in use or leased (§6.6): never evicted
                continue
            if key in published:
                # §6.1: a holder MUST withdraw the record before evicting the replica.
                self._index.withdraw(self.uri, key)
                published.discard(key)
            del cache[key]
            self.evictions += 1


@dataclass(slots=True, kw_only=True)
class Job:
    """One request at its instance: what it pinned, what it fetched, when it ran."""

    request: SimRequest
    instance: Instance
    placed_us: float
    pins: list[BlockKey] = field(default_factory=list)
    fetched_blocks: int = 0
    predicted_us: float = 0.0
    start_us: float = math.nan
    finish_us: float = math.nan
    reused_blocks: int = 0


@dataclass(slots=True, kw_only=True)
class Transfer:
    """Blocks moving from ``source`` to ``target``; all have arrived at ``end_us``."""

    source: Holder
    target: Holder
    keys: list[BlockKey]
    end_us: float


class Instance(Holder):
    """An inference instance: a holder whose blocks it computed or loaded, plus a FIFO queue
    that prefills one request at a time."""

    def __init__(
        self, number: int, uri: str, *, config: ClusterConfig, index: ClusterIndex
    ) -> None:
        super().__init__(
            uri, capacity=config.cache_blocks, nic_mbit_per_s=config.nic_mbit_per_s, index=index
        )
        self.number = number
        self.queue: deque[Job] = deque()
        self.running: Job | None = None
        self.queued_pred_us = 0.0
        self.links: tuple[Link, ...] = ()

    def outstanding_us(self, now_us: float) -> float:
        """Predicted work left: what is left of the running request's prediction plus the
        predictions of the queued ones (predictions are made at placement, with the prefix the
        instance then holds or is receiving; the true end of the running one is not used)."""
        running = self.running
        rest = (
            0.0 if running is None else max(0.0, running.start_us + running.predicted_us - now_us)
        )
        return rest + self.queued_pred_us


def instance_uri(number: int) -> str:
    """The URI of simulated instance ``number``."""
    return f"https://ii{number}.sim.example/kvsp/"


STORE_URI = "https://store.sim.example/kvsp/"


class Cluster:
    """Instances, the optional store, their links, and the index they publish to."""

    def __init__(self, config: ClusterConfig, index: ClusterIndex) -> None:
        self.config = config
        self.index = index
        self.instances = [
            Instance(n, instance_uri(n), config=config, index=index)
            for n in range(config.instances)
        ]
        self.store: Holder | None = None
        holders: list[Holder] = list(self.instances)
        if config.store_blocks:
            read = config.store_read_mbit_per_s
            self.store = Holder(
                STORE_URI,
                capacity=config.store_blocks,
                nic_mbit_per_s=config.store_nic_mbit_per_s,
                index=index,
                residency=(
                    Residency(
                        tier=Tier.HOST, first=0, last=config.layers - 1, read_mbit_per_s=read
                    ),
                ),
                read_mbit_per_s=math.inf if read is None else read,
            )
            holders.append(self.store)
        self.holders = {h.uri: h for h in holders}
        for inst in self.instances:
            inst.links = tuple(
                Link(holder=h.uri, mbit_per_s=self.rate(inst, h), rtt_us=self.rtt(inst, h))
                for h in holders
                if h is not inst
            )
        self._rate_per_s = config.prefill_tokens_per_s

    def rate(self, a: Holder, b: Holder) -> float:
        """Link rate between two holders: the slower NIC."""
        return min(a.nic_mbit_per_s, b.nic_mbit_per_s)

    def rtt(self, a: Holder, b: Holder) -> float:
        """Round-trip time between two holders."""
        store = self.store is not None and self.store in (a, b)
        return self.config.store_rtt_us if store else self.config.rtt_us

    def status(self, inst: Instance) -> InstanceStatusRecord:
        """The Instance Status Record ``inst`` reports now (§4.4, §6.3)."""
        return InstanceStatusRecord(
            instance=inst.uri,
            epoch=1,
            state=InstanceState.ACTIVE,
            running=0 if inst.running is None else 1,
            queued=len(inst.queue),
            batch_size=1,
            kv_utilization=min(1.0, len(inst.cache) / inst.capacity),
            prefill_tokens_per_s=self._rate_per_s,
            decode_tokens_per_s=0.0,
            links=inst.links,
            requested_state=None,
            ttl_ms=3000,
        )

    def fetch(self, job: Job, sources: Sequence[str | None], now_us: float) -> list[Transfer]:
        """Start loading the blocks ``sources`` names (one holder per usable block, ``None``
        when resident) into the job's instance; blocks it already has or is receiving are
        skipped. Each source sends its blocks in prefix order as one transfer over a FIFO
        egress (source) and ingress (target) NIC; the source pins them until the end (§6.6)."""
        target = job.instance
        by_source: dict[str, list[BlockKey]] = {}
        for key, uri in zip(job.request.keys, sources, strict=False):
            if uri is not None and key not in target.cache and key in self.holders[uri].cache:
                by_source.setdefault(uri, []).append(key)
        transfers = []
        block_octets = self.config.block_bytes
        for uri, keys in by_source.items():
            source = self.holders[uri]
            rate = min(self.rate(source, target), source.read_mbit_per_s)
            block_us = 8.0 * block_octets / rate
            begin = max(
                now_us + self.rtt(source, target), source.egress_free_us, target.ingress_free_us
            )
            end = begin + len(keys) * block_us
            source.egress_free_us = target.ingress_free_us = end
            source.touch(keys)
            source.pin(keys)
            target.pin(keys)
            job.pins.extend(keys)
            target.insert(
                [(key, begin + (j + 1) * block_us) for j, key in enumerate(keys)],
                int(now_us // 1000),
                publish=False,
            )
            job.fetched_blocks += len(keys)
            transfers.append(Transfer(source=source, target=target, keys=keys, end_us=end))
        return transfers

    def arrived(self, transfer: Transfer, now_us: float) -> None:
        """A transfer ended: release the source's pins, publish the new replicas."""
        transfer.source.unpin(transfer.keys)
        transfer.target.publish(transfer.keys, int(now_us // 1000))
