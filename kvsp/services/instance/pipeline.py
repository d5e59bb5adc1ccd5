"""The per-block pipeline of prefetch directives at the instance (spec §6.5 directives, §6.6
leases, §6.1 publishing): the requests that a block-at-a-time load pays once per block, paid
once per batch of blocks.

* :class:`LeaseBatcher` takes the leases. A lease lists many block keys (§6.6: "POST leases on
  a holder, with a body listing block keys"), so the blocks that ask for a lease at one source
  while a request to it is being prepared or is in flight go in one request, and its lease is
  released (DELETE, in the background) once the last of them is transferred. A request the
  holder refuses as a whole (one listed block gone, §6.1 "the index is advisory", or a quota)
  is retried key by key, so that each block learns its own outcome. A request carries at most
  ``max_octets`` of blocks, well inside the §6.6 per-client quota.
* :class:`ReplicaBatcher` publishes the new replicas. The IS takes several records in one
  ``POST replicas``. The blocks being loaded are announced to it, so that records gather until
  a batch is full or no announced block is still to come (a lone block, or a directive's last,
  goes at once); a short linger bounds how long a record waits for a slow transfer.

The lease batcher waits on no timer: a batch is whatever has gathered when the previous
request returns, so a lone block goes at once, and a directive's window of blocks goes in one
request. The transfers themselves (GETs on the bulk client's connection pool, FETCHes on one
MOQT session) and placing each block run concurrently in :mod:`kvsp.services.instance.service`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvsp.errors import KVSPError
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.prefetch import LinkMeter
from kvsp.records import LeaseGrant, LeaseRequest
from kvsp.stores.blocks import BlockRef, StoredBlock

_log = logging.getLogger("kvsp.instance")

LEASE_BATCH_OCTETS = 64 << 20
"""The most block octets one lease request covers."""
LEASE_BATCH_KEYS = 1024
"""The most block keys one lease request lists."""
REPLICA_BATCH = 32
"""Records gathered before a publication goes while more blocks are still being loaded."""
REPLICA_LINGER_S = 0.05
"""The longest a stored block's record waits for others to gather."""

Spawn = Callable[[Coroutine[Any, Any, object], str], None]


class LeaseClient(Protocol):
    """The part of :class:`~kvsp.transfer.block_client.BlockClient` that takes leases."""

    async def acquire_lease(self, holder_base: str, request: LeaseRequest, /) -> LeaseGrant:
        """POST leases."""
        ...

    async def release_lease(self, holder_base: str, lease: str, /) -> None:
        """DELETE leases/{id}."""
        ...


class ReplicaPublisher(Protocol):
    """The part of :class:`~kvsp.services.holder.Holder` that publishes records in batches."""

    async def publish_blocks(self, blocks: Sequence[StoredBlock], /) -> int:
        """Publish the records of held blocks; how many were published."""
        ...


@dataclass(slots=True)
class _SharedLease:
    """One granted lease and the blocks still using it."""

    lease_at: str
    lease: str
    users: int
    batcher: LeaseBatcher

    def drop_user(self) -> None:
        self.users -= 1
        if self.users == 0:
            self.batcher.release_later(self.lease_at, self.lease)


class LeaseHold:
    """One block's share of a lease; :meth:`release` once the block is transferred."""

    __slots__ = ("_shared", "lease")

    def __init__(self, shared: _SharedLease) -> None:
        self._shared: _SharedLease | None = shared
        self.lease = shared.lease
        """The lease identifier (several blocks may share it)."""

    def release(self) -> None:
        """Give up this block's share (idempotent); the lease is released with the last."""
        shared, self._shared = self._shared, None
        if shared is not None:
            shared.drop_user()


@dataclass(frozen=True, slots=True)
class _QueueKey:
    lease_at: str
    source: str
    compat: CompatId
    scope: ScopeId
    ttl_ms: int


@dataclass(slots=True)
class _Wanted:
    key: BlockKey
    octets: int
    future: asyncio.Future[LeaseHold] = field(repr=False)


class LeaseBatcher:
    """Leases for blocks being loaded, several blocks to a request (§6.6).

    ``links`` records each request's round trip under the source it is for (§6.3 ``links``).
    ``requests`` counts the lease requests sent (operations metrics and tests).
    """

    def __init__(
        self,
        client: LeaseClient,
        links: LinkMeter,
        *,
        max_octets: int = LEASE_BATCH_OCTETS,
        max_keys: int = LEASE_BATCH_KEYS,
    ) -> None:
        self.client = client
        self.links = links
        self.max_octets = max_octets
        self.max_keys = max_keys
        self.requests = 0
        self._pending: dict[_QueueKey, list[_Wanted]] = {}
        self._flushers: dict[_QueueKey, asyncio.Task[None]] = {}
        self._releases: set[asyncio.Task[None]] = set()

    async def acquire(
        self, lease_at: str, source: str, ref: BlockRef, octets: int, ttl_ms: int
    ) -> LeaseHold:
        """A lease of ``ttl_ms`` on ``ref`` at ``lease_at`` (for the replica at ``source``),
        shared with the other blocks asked for meanwhile.

        Raises:
            KVSPError: the holder refused a lease on this block (NotFound, LeaseQuota, ...);
                TransportError when unreachable.
        """
        queue = _QueueKey(lease_at, source, ref.compat, ref.scope, ttl_ms)
        future: asyncio.Future[LeaseHold] = asyncio.get_running_loop().create_future()
        self._pending.setdefault(queue, []).append(_Wanted(ref.key, octets, future))
        if queue not in self._flushers:
            task = asyncio.create_task(self._flush(queue), name="kvsp-leases")
            self._flushers[queue] = task
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().release()  # granted as this waiter was cancelled
            raise

    async def _flush(self, queue: _QueueKey) -> None:
        """Send what has gathered for ``queue``, one request at a time, until none is left."""
        batch: list[_Wanted] = []
        try:
            while True:
                waiting = self._pending.get(queue)
                if not waiting:
                    break
                batch = self._take(waiting)
                if not waiting:
                    del self._pending[queue]
                try:
                    await self._grant(queue, batch)
                except Exception as exc:  # not the holder's answer: every waiter learns it
                    _log.warning("lease request at %s failed: %r", queue.lease_at, exc)
                    for wanted in batch:
                        if not wanted.future.done():
                            wanted.future.set_exception(exc)
                batch = []
        finally:
            for wanted in batch:  # cancelled with a request in flight
                wanted.future.cancel()
            if self._flushers.get(queue) is asyncio.current_task():
                del self._flushers[queue]

    def _take(self, waiting: list[_Wanted]) -> list[_Wanted]:
        """The leading entries of ``waiting`` that fit one request (at least one), removed."""
        octets, count = 0, 0
        for wanted in waiting:
            if count and (count >= self.max_keys or octets + wanted.octets > self.max_octets):
                break
            octets += wanted.octets
            count += 1
        batch = waiting[:count]
        del waiting[:count]
        return batch

    async def _grant(self, queue: _QueueKey, batch: list[_Wanted]) -> None:
        live = [w for w in batch if not w.future.done()]  # a cancelled block needs no lease
        if not live:
            return
        request = LeaseRequest(
            compat_id=queue.compat,
            scope_id=queue.scope,
            block_keys=tuple(w.key for w in live),
            ttl_ms=queue.ttl_ms,
        )
        self.requests += 1
        began = time.perf_counter()
        try:
            grant = await self.client.acquire_lease(queue.lease_at, request)
        except KVSPError as exc:
            if len(live) == 1:
                live[0].future.set_exception(exc)
                return
            # refused as a whole: a listed block is gone, or the lot is over a quota; each
            # block on its own learns its own answer
            await asyncio.gather(*(self._grant(queue, [w]) for w in live))
            return
        self.links.record_rtt(queue.source, time.perf_counter() - began)
        shared = _SharedLease(queue.lease_at, grant.lease, len(live), self)
        for wanted in live:
            if wanted.future.done():  # cancelled during the request
                shared.drop_user()
            else:
                wanted.future.set_result(LeaseHold(shared))

    def release_later(self, lease_at: str, lease: str) -> None:
        """DELETE the lease in the background (it expires at the holder anyway)."""

        async def release() -> None:
            try:
                await self.client.release_lease(lease_at, lease)
            except KVSPError as exc:
                _log.debug("releasing lease %s at %s: %s", lease, lease_at, exc)

        task = asyncio.create_task(release(), name=f"kvsp-release-{lease[:8]}")
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def aclose(self, timeout: float = 5.0) -> None:
        """Stop sending lease requests (waiters are cancelled), then wait up to ``timeout``
        seconds for the releases under way, so that no lease outlives the instance's close
        longer than its TTL allows."""
        tasks = list(self._flushers.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for waiting in self._pending.values():
            for wanted in waiting:
                wanted.future.cancel()
        self._pending.clear()
        if self._releases:
            await asyncio.wait(set(self._releases), timeout=timeout)


class TransferBudget:
    """How many block transfers of the pipeline run at once: at most ``max_count``, and at most
    ``max_octets`` of blocks in flight (one block at least, however large). Small blocks are
    many in flight, so that each one's round trip hides behind the others'; large ones few,
    so that the memory they hold stays bounded."""

    def __init__(self, max_count: int, max_octets: int) -> None:
        self.max_count = max(1, max_count)
        self.max_octets = max_octets
        self.count = 0
        self.octets = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    def _fits(self, octets: int) -> bool:
        if self.count == 0:
            return True
        return self.count < self.max_count and self.octets + octets <= self.max_octets

    @contextlib.asynccontextmanager
    async def take(self, octets: int) -> AsyncIterator[None]:
        """Hold a place for a transfer of ``octets`` (first come, first served)."""
        if self._waiters or not self._fits(octets):
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            entry = (octets, waiter)
            self._waiters.append(entry)
            try:
                await waiter
            except BaseException:
                if entry in self._waiters:
                    self._waiters.remove(entry)
                    self._wake()  # the ones behind it may fit
                elif waiter.done() and not waiter.cancelled():
                    self._give(octets)  # granted as it was cancelled
                raise
        else:
            self.count += 1
            self.octets += octets
        try:
            yield
        finally:
            self._give(octets)

    def _give(self, octets: int) -> None:
        self.count -= 1
        self.octets -= octets
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            octets, waiter = self._waiters.popleft()
            if waiter.done():
                continue
            self.count += 1
            self.octets += octets
            waiter.set_result(None)


class ReplicaBatcher:
    """Publications of newly stored replicas (§6.1), several records to an IS request.

    The blocks being loaded are announced with :meth:`expect`; a batch goes when it holds
    ``max_batch`` records, when no announced block is still to come, or when its oldest record
    has waited ``linger_s`` (a slow transfer does not hold the others' records for long), and
    never while a request is in flight. ``requests`` counts the batches sent.
    """

    def __init__(
        self,
        holder: ReplicaPublisher,
        spawn: Spawn,
        *,
        max_batch: int = REPLICA_BATCH,
        linger_s: float = REPLICA_LINGER_S,
    ) -> None:
        self.holder = holder
        self.spawn = spawn
        self.max_batch = max(1, max_batch)
        self.linger_s = linger_s
        self.requests = 0
        self._waiting: list[tuple[StoredBlock, asyncio.Future[None]]] = []
        self._since = 0.0  # monotonic time the oldest waiting record came
        self._expected = 0
        self._busy = False
        self._timer: asyncio.TimerHandle | None = None

    def expect(self) -> None:
        """A block is being loaded: its record (:meth:`add` with ``expected``) or its
        :meth:`forget` follows."""
        self._expected += 1

    def forget(self) -> None:
        """An expected block will not be added (it failed or was cancelled)."""
        self._expected -= 1
        self._kick()

    def add(self, block: StoredBlock, *, expected: bool = False) -> asyncio.Future[None]:
        """Publish ``block``'s record with a batch; the future is done once the batch was
        answered. ``expected``: the block was announced with :meth:`expect`. A failed
        publication is logged and left to the holder's refresh loop, so the future never
        fails."""
        if expected:
            self._expected -= 1
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not self._waiting:
            self._since = time.monotonic()
        self._waiting.append((block, done))
        self._kick()
        return done

    def _ready(self) -> bool:
        return bool(self._waiting) and (
            len(self._waiting) >= self.max_batch
            or self._expected <= 0
            or time.monotonic() - self._since >= self.linger_s
        )

    def _kick(self) -> None:
        """Start a batch when one is due and none is in flight; else wake up at the linger."""
        if self._busy or not self._waiting:
            return
        if self._ready():
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._busy = True
            self.spawn(self._run(), "kvsp-publish-batch")
        elif self._timer is None:
            delay = max(0.0, self._since + self.linger_s - time.monotonic())
            self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._kick()

    async def _run(self) -> None:
        batch: list[tuple[StoredBlock, asyncio.Future[None]]] = []
        try:
            while self._ready():
                batch, self._waiting = self._waiting, []
                self._since = time.monotonic()
                self.requests += 1
                try:
                    await self.holder.publish_blocks([block for block, _ in batch])
                except Exception:  # the refresh loop publishes them later
                    _log.exception("publishing %d replicas failed", len(batch))
                _settle(batch)
                batch = []
        except BaseException:  # cancelled: the stored blocks wait for the refresh loop
            _settle(batch)
            _settle(self._waiting)
            self._waiting = []
            raise
        finally:
            self._busy = False
        self._kick()


def _settle(batch: Sequence[tuple[StoredBlock, asyncio.Future[None]]]) -> None:
    for _, done in batch:
        if not done.done():
            done.set_result(None)


__all__ = [
    "LEASE_BATCH_OCTETS",
    "REPLICA_BATCH",
    "REPLICA_LINGER_S",
    "LeaseBatcher",
    "LeaseHold",
    "ReplicaBatcher",
    "TransferBudget",
]
