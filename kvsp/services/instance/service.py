"""The inference instance agent (spec §6.3 status and lifecycle, §6.5 prefetch directives,
§6.6–6.7 as a client and as a holder; DESIGN.md §1: "an agent around an engine. It reports
status, executes directives, serves as a holder of what it computed").

:class:`InstanceAgent` drives an :class:`~kvsp.engine.api.InferenceEngine` and a
:class:`~kvsp.services.holder.Holder` (its holder face); :mod:`kvsp.services.instance.app`
is the HTTP shell. Choices the spec leaves open:

* **Epoch** (§6.3): the start time in ms, or the last epoch used + 1 when the clock is not past
  it; the last epoch is kept in ``STATE/epoch`` (:func:`next_epoch`). A status PUT answered
  ``kvsp-stale-epoch`` (the PC saw the record expire) re-registers with a new epoch.
* **Status** is sent every ``ttl/3`` (never later: the period counts from the previous send)
  and at once after a state change. ``running``/``queued`` count admitted sessions holding or
  waiting for one of ``batch_size`` engine slots; ``links`` are measured per source holder
  (rate from the octets and seconds of recent verified GETs, RTT from the lease round trips).
* **Prefetch** (§6.5): the directive's records come from one IS lookup (they carry the digests
  to verify against). Blocks load in prefix order. Block after block (``pipeline=False``,
  ``prefetch_concurrency`` transfers at once) each takes a lease at a source, GETs and
  verifies the block (hashing in worker threads), releases the lease, then keeps it in the
  engine and in the holder's tiers (which publishes its replica). One load per key at a
  time: directives for overlapping keys share it, and it is cancelled only when no directive
  waits for it any more. As a pipeline (the default,
  ``InstanceConfig.pipeline``) a directive keeps up to ``pipeline_window`` blocks in flight,
  started by halves, with up to ``pipeline_transfers`` transfers (``pipeline_octets`` of
  blocks) at once; the blocks of a half take their leases at a source in one request and
  publish their replicas in batches (:mod:`kvsp.services.instance.pipeline`), and a block is
  placed while the next ones transfer; the holder keeps a verified block with the digests it
  was verified against (:meth:`~kvsp.services.holder.Holder.put_verified`, no second hash). A
  block counts as loaded once its record's batch was answered, and ``GET prefetch/{id}
  ?wait_ms=`` may wait for the directive to stop (:meth:`InstanceAgent.wait_directive`).
  ``pipeline=False`` is kept as an operator choice and as the baseline to measure against.
* **Generation**: the prompt's Block Keys use the request's scope key or a configured one;
  every leading block held by the engine or the holder (or that a running directive still has
  to load, even before its lookup is answered) is used, the rest recomputed, and the computed
  blocks are kept and published. Sessions that survive failures (§6.8: checkpoints, resume,
  the release gate) are built on these pieces in :mod:`kvsp.services.instance.sessions`; a
  status answered ``kvsp-stale-epoch`` tells them that the PC declared this instance failed
  (:meth:`InstanceAgent.on_declared_failed`).
* **Leaving** (SIGTERM, §6.3 draining): :meth:`InstanceAgent.begin_leaving` enters draining on
  the instance's own account and reports it at once, so no new work is placed here; the
  in-flight sessions and directives finish (:meth:`InstanceAgent.wait_idle`); then reporting
  stops (:meth:`InstanceAgent.stop_reporting`) and the shell withdraws the replicas and ends
  the epoch (:mod:`kvsp.services.instance.app`). While leaving, the instance never goes on to
  sleeping, never takes the PC's state, and never re-registers.
* **Directive outcomes** are logged at info once a directive stops: blocks loaded of total,
  octets, blocks and octets per source and per transport, elapsed ms and the final state; each
  failed fetch is logged at warning with its cause as it happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvsp.compat import compat_id
from kvsp.container import Container, Geometry, Layer, decode_container, header_size
from kvsp.engine.api import GREEDY, EngineSequence, InferenceEngine, Sampling
from kvsp.errors import (
    BadRequest,
    IllegalTransition,
    Incompatible,
    KVSPError,
    NotActive,
    PreconditionFailed,
    StaleEpoch,
    UnsupportedHolder,
    UnvouchedOrigin,
)
from kvsp.ids import BlockKey, ScopeId
from kvsp.keys import block_keys
from kvsp.lifecycle import check_transition
from kvsp.prefetch import DirectiveBook, DirectiveProgress, LinkMeter, through_relay
from kvsp.records import (
    DirectiveBlock,
    InstanceStatusRecord,
    LeaseRequest,
    LookupRequest,
    LookupResponse,
    PrefetchDirective,
    ReplicaRecord,
    StateAnswer,
)
from kvsp.registries import InstanceState, Tier
from kvsp.services.holder import Holder
from kvsp.services.instance.outcomes import DirectiveTally, Loaded
from kvsp.services.instance.pipeline import (
    LeaseBatcher,
    LeaseHold,
    ReplicaBatcher,
    TransferBudget,
)
from kvsp.stores.blocks import BlockRef, StoredBlock
from kvsp.transfer.block_client import BlockClient, lease_base, source_base
from kvsp.transfer.verify import VerifiedBlock
from kvsp.web.auth import Principal
from kvsp.web.background import raise_if_cancelling
from kvsp.web.clock import Clock
from kvsp.web.meters import GenerationMeter

_log = logging.getLogger("kvsp.instance")

EPOCH_FILE = "epoch"
LOOKUP_CHUNK = 4096
"""Keys per IS lookup when reading a directive's records."""


class StatusSink(Protocol):
    """Where status records go (§6.3): :class:`~kvsp.services.index.client.IndexClient` of the
    PC (or of ``kvsp serve control``)."""

    async def put_status(self, record: InstanceStatusRecord, /) -> StateAnswer:
        """PUT the record; the PC answers the state it wants."""
        ...


class ReplicaLookup(Protocol):
    """The IS lookup (§6.2) the agent reads a directive's Replica Records with."""

    async def lookup(self, request: LookupRequest, /) -> LookupResponse:
        """POST lookup."""
        ...


def next_epoch(now_ms: int, last: int | None) -> int:
    """The epoch for a start at ``now_ms`` (§6.3 MUST increase on every restart): the start
    time, unless the clock is not past the last epoch used; then that epoch + 1."""
    return now_ms if last is None or now_ms > last else last + 1


class EpochStore:
    """The last epoch used, kept in ``folder/epoch`` (in memory only without a folder)."""

    def __init__(self, folder: Path | None) -> None:
        self.path = None if folder is None else folder / EPOCH_FILE
        self._last: int | None = None

    def last(self) -> int | None:
        """The last epoch used, or ``None`` on a first start."""
        if self.path is None or not self.path.exists():
            return self._last
        text = self.path.read_text(encoding="ascii").strip()
        return int(text) if text.isdigit() else self._last

    def advance(self, now_ms: int) -> int:
        """Choose, persist (atomically) and return the next epoch."""
        epoch = next_epoch(now_ms, self.last())
        self._last = epoch
        if self.path is not None:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{EPOCH_FILE}.{os.getpid()}.tmp")
            tmp.write_text(f"{epoch}\n", encoding="ascii")
            os.replace(tmp, self.path)
        return epoch


@dataclass(frozen=True, slots=True, kw_only=True)
class InstanceConfig:
    """How an instance reports, admits, prefetches and sleeps."""

    public_url: str | None = None
    """Base URL (ending in ``/``) it is known by; its own server's URL when ``None``."""
    status_ttl_ms: int = 3000
    batch_size: int = 8
    """Sessions the engine runs at once; more are queued."""
    max_tokens: int = 4096
    max_prompt_tokens: int = 1 << 20
    prefetch_concurrency: int = 4
    """Without the pipeline: block transfers in flight at once, over all directives."""
    prefetch_window: int = 8
    """Blocks of one directive started ahead of the prefix being completed."""
    pipeline: bool = True
    """Run directives as a pipeline (leases and publications batched, transfers overlapped
    with placing); ``False`` keeps the block-at-a-time path (one lease, GET, release and
    publication per block), for comparison."""
    pipeline_window: int = 64
    """Pipeline: blocks of one directive in flight (leased, transferring or being placed);
    refilled once half of them are done, so that a lease request lists about half."""
    pipeline_transfers: int = 32
    """Pipeline: block transfers at once, over all directives (small blocks: many FETCHes
    in flight on one MOQT session, or GETs on the bulk client's connections)..."""
    pipeline_octets: int = 8 << 20
    """... and at most these octets of blocks in flight (large blocks: a few at once)."""
    sleep_threshold: float | None = None
    """Ask to sleep when ``running + queued`` stayed below this (``None``: never ask)."""
    sleep_after_ms: int = 300_000
    state_dir: Path | None = None
    scope_keys: Mapping[bytes, bytes] = field(default_factory=dict)
    """Scope ID → scope key, for requests that name a scope instead of carrying its key."""
    warmup_tokens: int = 64
    status_loop: bool = True
    site: str | None = None
    """The ``site`` label of its status record (spec §4.4 extension member; ``--site``)."""
    zone: str | None = None
    """The ``zone`` label of its status record (``--zone``)."""
    relay: str | None = None
    """Its edge relay's URI (``--relay``), carried as ``relay`` in its status record so that
    the PC can name the relay as the source of blocks the instance cannot reach elsewhere."""


@dataclass(slots=True)
class _KeyLoad:
    task: asyncio.Task[Loaded]
    waiters: int = 0


def _log_failed_fetch(ref: BlockRef, source: str, stage: str, exc: KVSPError) -> None:
    """One warning per failed attempt at a source, with its cause: the problem type and the
    message (which names the peer and the transport's reason, never a token)."""
    _log.warning(
        "block %s: %s at %s failed: %s: %s", ref.key.hex()[:16], stage, source, exc.problem, exc
    )


def _log_no_record(ref: BlockRef, source: str) -> None:
    """A directive's source without a Replica Record at the IS (withdrawn or expired since the
    PC planned, §6.1): the next source is tried."""
    _log.warning("block %s: %s has no replica record at the IS", ref.key.hex()[:16], source)


def _base(uri: str) -> str:
    return uri if uri.endswith("/") else uri + "/"


class Session:
    """An admitted generation: its prefix is in the engine; :meth:`tokens` streams the rest."""

    def __init__(
        self, agent: InstanceAgent, seq: EngineSequence, max_tokens: int, epoch: int = 1
    ) -> None:
        self._agent = agent
        self._seq = seq
        self.max_tokens = max_tokens
        self.epoch = epoch
        self.loaded_blocks = seq.loaded_blocks
        self.computed_blocks = len(seq.computed)
        self.keys: Sequence[BlockKey] = ()
        """The Block Keys of the prompt's complete blocks (empty for a resumed session)."""
        self._closed = False

    @property
    def sequence(self) -> EngineSequence:
        """The engine's sequence (for sessions that sample, checkpoint and export blocks)."""
        return self._seq

    async def tokens(self, sampling: Sampling = GREEDY) -> AsyncIterator[tuple[int, int]]:
        """``(index, token)`` pairs chosen by ``sampling``; the session is closed when the
        iteration ends."""
        try:
            index = 0
            async for token in self._seq.tokens(self.max_tokens, sampling):
                yield index, token
                index += 1
        finally:
            await self.close()

    async def close(self) -> None:
        """Free the engine's memory and the slot (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._seq.release()
        finally:
            self._agent._session_done(running=True)


class InstanceAgent:
    """An inference instance: status, lifecycle, prefetch, generation, and its holder face.

    ``index`` serves the lookups of directives (the IS); ``control`` takes status records
    (the PC); the holder publishes its replicas through its own index client.
    """

    def __init__(
        self,
        engine: InferenceEngine,
        holder: Holder,
        index: ReplicaLookup,
        block_client: BlockClient,
        control: StatusSink,
        clock: Clock,
        config: InstanceConfig,
    ) -> None:
        self.engine = engine
        self.holder = holder
        self.index = index
        self.block_client = block_client
        self.control = control
        self.clock = clock
        self.config = config
        self.descriptor = engine.descriptor
        self.compat = compat_id(self.descriptor)
        self.geometry = Geometry.from_descriptor(self.descriptor)
        self.links = LinkMeter()
        self.meter = GenerationMeter()
        """Prefix cache queries and hits in tokens, and times to first token (metrics)."""
        self.directives = DirectiveBook()
        self.loads_started = 0
        self._epochs = EpochStore(config.state_dir)
        self._epoch = 0
        self._state = InstanceState.ACTIVE
        self._admitted = 0
        self._running = 0
        self._low_since_ms: int | None = None
        self._slots = asyncio.Semaphore(config.batch_size)
        self._transfers = asyncio.Semaphore(config.prefetch_concurrency)
        self._pipe_transfers = TransferBudget(config.pipeline_transfers, config.pipeline_octets)
        self._loads: dict[BlockRef, _KeyLoad] = {}
        self._loading: dict[uuid.UUID, tuple[DirectiveProgress, asyncio.Event]] = {}
        """The directives loading now, by id: each one's progress and an event set as it stops."""
        self._loads_moved = asyncio.Event()  # replaced each time it is set (:meth:`_moved`)
        self._tallies: dict[uuid.UUID, DirectiveTally] = {}  # directive id → what it loaded
        self._tasks: set[asyncio.Task[object]] = set()
        self._status_task: asyncio.Task[None] | None = None
        self._status_wake = asyncio.Event()
        self._url_known = asyncio.Event()
        self._public_url: str | None = None
        self._principal = Principal(name="instance", roles=frozenset({"instance"}), scopes=None)
        self._failure_listeners: list[Callable[[], None]] = []
        self._leaving = False
        self._quieter = asyncio.Event()  # set when a session or a directive ends
        self._registered_ms: int | None = None  # the PC last took a status record
        self.registered = asyncio.Event()
        """Set once the PC has taken a status record of this run (§6.3)."""
        self._relay_base = None if config.relay is None else _base(config.relay)
        """Its relay as a directive source (blocks it does not hold yet: :func:`through_relay`)."""
        self.leases = LeaseBatcher(block_client, self.links)
        self.unvouched_records = 0
        """Records refused because their ``lease_base`` was not on their holder's origin."""
        self.replicas = ReplicaBatcher(
            holder, self._spawn, max_batch=max(1, config.pipeline_window // 2)
        )
        if config.public_url is not None:
            self.set_public_url(config.public_url)

    # -- lifecycle of the process --------------------------------------------------------------

    @property
    def public_url(self) -> str | None:
        """The base URL named in status records and replica records, once known."""
        return self._public_url

    def set_public_url(self, url: str) -> None:
        """Learn the base URL (the server's own when none was configured)."""
        self._public_url = _base(url)
        self.holder.set_public_url(self._public_url)
        self._url_known.set()

    @property
    def state(self) -> InstanceState:
        """The lifecycle state (§6.3)."""
        return self._state

    @property
    def epoch(self) -> int:
        """The epoch of this run (§6.3)."""
        return self._epoch

    async def start(self) -> None:
        """Choose the epoch, start the holder face, measure the engine, start reporting.

        Raises:
            Incompatible: the holder does not know the engine's descriptor.
        """
        if self.holder.descriptors.get(self.compat) is None:
            raise Incompatible("the holder face must know the engine's descriptor")
        self._epoch = self._epochs.advance(self.clock.now_ms())
        await self.holder.start()
        await self._warm_up()
        if self.config.status_loop and self._status_task is None:
            self._status_task = asyncio.create_task(self._status_loop(), name="kvsp-status")

    async def _warm_up(self) -> None:
        """Run a short prompt so the first status record carries measured rates."""
        count = max(self.descriptor.block_tokens, self.config.warmup_tokens)
        # Ids below 256 exist in every vocabulary, the byte-level one of the seeded model too.
        seq = await self.engine.prefill([(i * 7919) % 251 for i in range(count)], [])
        try:
            async for _ in seq.tokens(8):
                pass
        finally:
            await seq.release()

    async def close(self) -> None:
        """Stop reporting and prefetching, then withdraw the holder face's records."""
        tasks = list(self._tasks)
        if self._status_task is not None:
            tasks.append(self._status_task)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        loads = [load.task for load in self._loads.values()]
        for load_task in loads:  # their lease shares go back as they stop
            load_task.cancel()
        for load_task in loads:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await load_task
        await self.leases.aclose()
        for progress in self.directives.pending():
            progress.abort("the instance is shutting down")
        for _, stopped in self._loading.values():  # runs cancelled before they started
            stopped.set()
        self._loading.clear()
        self._moved()
        await self.holder.close()

    def _spawn(self, coro: Coroutine[Any, Any, object], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- status (§6.3) -------------------------------------------------------------------------

    def _requested_state(self, now_ms: int) -> InstanceState | None:
        threshold = self.config.sleep_threshold
        if (
            threshold is None
            or self._state is not InstanceState.ACTIVE
            or self._admitted >= threshold
        ):
            self._low_since_ms = None
            return None
        if self._low_since_ms is None:
            self._low_since_ms = now_ms
        if now_ms - self._low_since_ms >= self.config.sleep_after_ms:
            return InstanceState.SLEEPING
        return None

    def status_record(self) -> InstanceStatusRecord:
        """The Instance Status Record as of now (§4.4).

        Raises:
            RuntimeError: the public URL is not known yet.
        """
        if self._public_url is None:
            raise RuntimeError("the instance's public URL is not known yet")
        stats = self.engine.stats()
        return InstanceStatusRecord(
            instance=self._public_url,
            epoch=self._epoch,
            state=self._state,
            running=self._running,
            queued=self._admitted - self._running,
            batch_size=self.config.batch_size,
            kv_utilization=stats.kv_utilization,
            prefill_tokens_per_s=stats.prefill_tokens_per_s,
            decode_tokens_per_s=stats.decode_tokens_per_s,
            links=self.links.links(),
            requested_state=self._requested_state(self.clock.now_ms()),
            ttl_ms=self.config.status_ttl_ms,
            site=self.config.site,
            zone=self.config.zone,
            relay=self.config.relay,
        )

    async def report_status(self) -> StateAnswer:
        """Send one status record and apply the PC's answer.

        A ``kvsp-stale-epoch`` answer (the PC saw this epoch fail) re-registers once with a
        new epoch, as active.

        Raises:
            KVSPError: the PC refused the record or could not be reached.
        """
        try:
            answer = await self.control.put_status(self.status_record())
        except StaleEpoch:
            if self._leaving:
                raise  # a leaving instance does not register again
            self._epoch = self._epochs.advance(self.clock.now_ms())
            self._state = InstanceState.ACTIVE
            _log.warning("status expired at the PC; re-registering with epoch %d", self._epoch)
            for listener in list(self._failure_listeners):
                listener()
            answer = await self.control.put_status(self.status_record())
        self._apply_answer(answer)
        self._registered_ms = self.clock.now_ms()
        self.registered.set()
        return answer

    async def readiness(self) -> str | None:
        """Why this instance is not ready to serve (``/readyz``), or ``None``: ready while the
        PC took a status record within its TTL and its holder face's IS answers."""
        at = self._registered_ms
        if at is None:
            return "not registered at the PC yet"
        if self.clock.now_ms() - at >= self.config.status_ttl_ms:
            return "no status record reached the PC within its TTL"
        return await self.holder.readiness()

    def on_declared_failed(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` whenever the PC answers a status with ``kvsp-stale-epoch``: it
        declared this instance failed, so its sessions may live elsewhere now (§6.8)."""
        self._failure_listeners.append(listener)

    def _apply_answer(self, answer: StateAnswer) -> None:
        if answer.state is self._state or self._leaving:
            return
        try:
            check_transition(self._state, answer.state, by="pc")
        except KVSPError:
            # The PC has not seen a move this instance made on its own yet (§6.3 lag).
            _log.debug("ignoring PC state %s while %s", answer.state, self._state)
            return
        self._enter(answer.state)

    async def _status_loop(self) -> None:
        await self._url_known.wait()
        period = self.config.status_ttl_ms / 3000  # §6.3: no longer than ttl/3
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            self._status_wake.clear()
            try:
                async with asyncio.timeout(period):
                    await self.report_status()
            except (KVSPError, TimeoutError) as exc:
                raise_if_cancelling()
                _log.warning("status report failed: %s", exc)
            except Exception:
                raise_if_cancelling()
                _log.exception("status report failed")
            delay = max(0.0, began + period - loop.time())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._status_wake.wait(), delay)

    # -- lifecycle (§6.3) ----------------------------------------------------------------------

    def change_state(self, dst: InstanceState) -> InstanceState:
        """Apply a state change from the PC (PUT state); returns the state now.

        A draining instance with nothing in flight goes on to sleeping at once.

        Raises:
            IllegalTransition: the lifecycle table has no such move for the PC (409).
        """
        if dst is not self._state:
            check_transition(self._state, dst, by="pc")
            if self._leaving:
                raise IllegalTransition(f"the instance is shutting down; not {dst}")
            self._enter(dst)
        return self._state

    def _enter(self, dst: InstanceState) -> None:
        self._state = dst
        self._low_since_ms = None
        self._settle()
        self._status_wake.set()

    def _settle(self) -> None:
        if self._state is InstanceState.DRAINING and self._admitted == 0 and not self._leaving:
            check_transition(InstanceState.DRAINING, InstanceState.SLEEPING, by="instance")
            self._state = InstanceState.SLEEPING
            self._status_wake.set()  # §6.3: "enters sleeping and reports it"

    def _session_done(self, *, running: bool) -> None:
        if running:
            self._running -= 1
            self._slots.release()
        self._admitted -= 1
        self._quieter.set()
        self._settle()

    # -- leaving (SIGTERM) ---------------------------------------------------------------------

    @property
    def leaving(self) -> bool:
        """Whether the instance is on its way out (:meth:`begin_leaving`)."""
        return self._leaving

    async def begin_leaving(self) -> None:
        """Stop taking new work: an active instance enters draining on its own account (§6.3:
        no new sessions; the PC places nothing here) and reports it at once.

        Raises:
            KVSPError: the PC refused the record or could not be reached (the instance is
                draining all the same).
        """
        self._leaving = True
        if self._state is InstanceState.ACTIVE:
            check_transition(self._state, InstanceState.DRAINING, by="shutdown")
            self._state = InstanceState.DRAINING
        if self._public_url is not None:
            await self.report_status()

    def busy(self) -> tuple[int, int]:
        """The sessions admitted and the directives still loading."""
        return self._admitted, len(self._loading)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no session is admitted and no directive is loading, at most
        ``timeout_s`` seconds; whether it got there."""
        try:
            async with asyncio.timeout(timeout_s):
                while any(self.busy()):
                    self._quieter.clear()
                    await self._quieter.wait()
        except TimeoutError:
            return False
        return True

    async def stop_reporting(self, settle_s: float = 5.0) -> None:
        """Stop the status loop and the holder face's refreshes, letting the background
        publications of computed blocks end first (at most ``settle_s`` seconds)."""
        if self._status_task is not None:
            self._status_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._status_task
            self._status_task = None
        pending = [t for t in self._tasks if t.get_name().startswith("kvsp-publish")]
        if pending:
            await asyncio.wait(pending, timeout=settle_s)
        await self.holder.stop_refreshing()

    # -- generation ----------------------------------------------------------------------------

    def scope_key_for(self, scope: ScopeId) -> bytes:
        """The configured scope key of ``scope``.

        Raises:
            BadRequest: no key is configured for it.
        """
        key = self.config.scope_keys.get(bytes(scope))
        if key is None:
            raise BadRequest("no scope key is configured for this scope_id", path="$.scope_id")
        return key

    async def open_session(
        self, prompt: Sequence[int], max_tokens: int, scope: ScopeId, scope_key: bytes
    ) -> Session:
        """Admit a generation: compute its Block Keys, load what is held, compute the rest
        and publish it. The caller streams :meth:`Session.tokens`.

        Raises:
            NotActive: the instance is draining or sleeping (§6.3 MUST NOT accept new ones).
            BadRequest: a bad prompt or too many tokens asked for.
            KVSPError: the engine refused the prompt.
        """
        if self._state is not InstanceState.ACTIVE:
            raise NotActive(f"the instance is {self._state}")
        if not 0 < len(prompt) <= self.config.max_prompt_tokens:
            raise BadRequest("prompt length out of range", path="$.prompt")
        if not 0 <= max_tokens <= self.config.max_tokens:
            raise BadRequest(f"at most {self.config.max_tokens} tokens", path="$.max_tokens")
        keys = block_keys(scope_key, self.compat, prompt, self.descriptor.block_tokens)

        async def prefill() -> EngineSequence:
            return await self.engine.prefill(prompt, await self.held_prefix(scope, keys))

        seq = await self._admit(prefill)
        found = seq.loaded_blocks * self.descriptor.block_tokens
        self.meter.count_prefix("generate", len(prompt), found)  # metrics
        self._keep_computed(scope, keys, seq)
        session = Session(self, seq, max_tokens)
        session.keys = keys
        return session

    async def resume_session(
        self,
        loaded: Sequence[Container],
        prefill: Sequence[int],
        replay: Sequence[int],
        max_tokens: int,
        epoch: int,
    ) -> Session:
        """Admit a session moved here (§6.8): rebuild its context in the engine from loaded
        blocks, a prefill and replayed output tokens, in one of the slots new sessions use.

        Raises:
            NotActive: the instance is not active (a resume is a new session here, §6.3).
            KVSPError: the engine refused the context.
        """
        if self._state is not InstanceState.ACTIVE:
            raise NotActive(f"the instance is {self._state}")

        async def rebuild() -> EngineSequence:
            return await self.engine.resume(loaded, prefill, replay)

        return Session(self, await self._admit(rebuild), max_tokens, epoch)

    async def _admit(self, start: Callable[[], Awaitable[EngineSequence]]) -> EngineSequence:
        """Count a session in, wait for a slot and start its sequence; counted out again if
        that fails."""
        self._admitted += 1
        running = False
        try:
            await self._slots.acquire()
            self._running += 1
            running = True
            return await start()
        except BaseException:
            self._session_done(running=running)
            raise

    async def held_prefix(self, scope: ScopeId, keys: Sequence[BlockKey]) -> list[Container]:
        """The leading blocks of ``keys`` held by the engine or the holder face (waiting for
        those a directive is loading), up to the first one not held."""
        found = self.engine.lookup(keys)
        for key in keys[len(found) :]:
            ref = BlockRef(self.compat, scope, key)
            load = await self._load_of(ref)
            if load is not None:  # a directive is loading it: worth the wait (§6.5 partial)
                await asyncio.wait({load.task})
            stored = self.holder.store.get(ref)
            if stored is None or not stored.meta.complete:
                break
            found.append(decode_container(self.holder.store.read(stored), self.geometry))
        return found

    async def _load_of(self, ref: BlockRef) -> _KeyLoad | None:
        """The load of ``ref`` under way, or the one a running directive is still to start
        (while the IS answers its lookup, say); None once the block is held or no running
        directive has it still to load."""
        while (load := self._loads.get(ref)) is None and not self.holds(ref):
            if not any(
                (p.directive.compat_id, p.directive.scope_id) == (ref.compat, ref.scope)
                and p.still_to_load(ref.key)
                for p, _ in self._loading.values()
            ):
                return None
            await self._loads_moved.wait()
        return load

    def _moved(self) -> None:
        """Wake what waits for a load to start or a directive to move on (:meth:`_load_of`)."""
        self._loads_moved.set()
        self._loads_moved = asyncio.Event()

    def _keep_computed(self, scope: ScopeId, keys: Sequence[BlockKey], seq: EngineSequence) -> None:
        for block in seq.computed:
            self.keep_block(scope, keys[block.index], block.container)

    def keep_block(self, scope: ScopeId, key: BlockKey, data: bytes) -> None:
        """Keep a block this instance computed in the engine and, in the background, in the
        holder face's tiers, which publishes its replica (§6.1)."""
        self.engine.hold(key, decode_container(data, self.geometry))
        ref = BlockRef(self.compat, scope, key)
        self._spawn(self._store(ref, data), f"kvsp-publish-{key.hex()[:8]}")

    async def _store(self, ref: BlockRef, data: bytes) -> bool:
        """Put a block in the holder's tiers, which publishes its replica (§6.1)."""
        try:
            await self.holder.put_block(self._principal, *ref, data)
        except PreconditionFailed:
            return True  # held already
        except KVSPError as exc:
            _log.warning("keeping block %s failed: %s", ref, exc)
            return False
        return True

    def holds(self, ref: BlockRef) -> bool:
        """Whether the engine or the holder face has the block."""
        return ref in self.holder.store or bool(self.engine.lookup([ref.key]))

    # -- prefetch (§6.5) -----------------------------------------------------------------------

    def accept_directive(self, directive: PrefetchDirective) -> DirectiveProgress:
        """Take a directive and load it in the background; the same directive again is the
        same directive (idempotent).

        Raises:
            NotActive: the instance is not active (§6.3: the PC sends none then).
            Incompatible: the directive's compat_id is not the engine's.
            Conflict: a known directive id with another body.
        """
        if self._state is not InstanceState.ACTIVE:
            raise NotActive(f"the instance is {self._state}")
        if directive.compat_id != self.compat:
            raise Incompatible("the directive's compat_id is not this instance's", path="$")
        progress, new = self.directives.add(directive, self.clock.now_ms())
        if new:
            self._loading[directive.directive] = (progress, asyncio.Event())
            self._spawn(self._run_directive(progress), f"kvsp-directive-{directive.directive}")
        return progress

    async def wait_directive(
        self, progress: DirectiveProgress, timeout: float | None = None
    ) -> None:
        """Wait until the directive has stopped, or ``timeout`` seconds (None: no limit)."""
        running = self._loading.get(progress.directive.directive)
        if progress.final or running is None:  # None: its run has ended
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(running[1].wait(), timeout)

    async def _run_directive(self, progress: DirectiveProgress) -> None:
        tally = self._tallies[progress.directive.directive] = DirectiveTally()
        try:
            await self._directive(progress)
        finally:
            tokens = self.descriptor.block_tokens  # metrics: blocks asked for, blocks loaded
            asked, loaded = len(progress.keys) * tokens, len(progress.loaded) * tokens
            self.meter.count_prefix("prefetch", asked, loaded)
            self._tallies.pop(progress.directive.directive, None)
            if progress.final:
                tally.log(progress)
            else:
                _log.info("directive %s stopped unfinished", progress.directive.directive)
            running = self._loading.pop(progress.directive.directive, None)
            if running is not None:
                running[1].set()
            self._quieter.set()
            self._moved()

    async def _directive(self, progress: DirectiveProgress) -> None:
        d = progress.directive
        while not progress.final:  # blocks already held count at once
            key = progress.keys[progress.next_index]
            if not self.holds(BlockRef(d.compat_id, d.scope_id, key)):
                break
            progress.block_loaded(key)
            self._count(progress, Loaded(True))
        if progress.final or progress.expire(self.clock.now_ms()):
            return
        try:
            async with asyncio.timeout(progress.remaining_ms(self.clock.now_ms()) / 1000):
                if self.config.pipeline:
                    await self._pipeline_directive(progress)
                else:
                    await self._load_directive(progress)
        except TimeoutError:
            progress.expire(max(self.clock.now_ms(), progress.deadline_at_ms))
        except Exception:
            _log.exception("directive %s failed", d.directive)
            progress.abort("internal error")

    async def _load_directive(self, progress: DirectiveProgress) -> None:
        d = progress.directive
        records = await self._records(d, progress.next_index)
        window: deque[tuple[BlockKey, _KeyLoad | None]] = deque()
        upcoming = progress.next_index
        try:
            while not progress.final:
                while upcoming < len(d.blocks) and len(window) < self.config.prefetch_window:
                    block = d.blocks[upcoming]
                    upcoming += 1
                    ref = BlockRef(d.compat_id, d.scope_id, block.block_key)
                    load = None if self.holds(ref) else self._ticket(ref, block, records, d)
                    window.append((block.block_key, load))
                await self._settle_head(window, progress)
        finally:
            for _, load in window:
                self._drop(load)

    async def _settle_head(
        self, window: deque[tuple[BlockKey, _KeyLoad | None]], progress: DirectiveProgress
    ) -> None:
        """Wait for the oldest block of the window and report it (blocks complete in prefix
        order: a block is useless without every block before it)."""
        key, load = window[0]
        loaded = Loaded(True) if load is None else await self._outcome(load)
        self._drop(window.popleft()[1])
        if loaded.ok:
            progress.block_loaded(key)
            self._count(progress, loaded)
        else:
            progress.block_failed(key, loaded.why)
        progress.expire(self.clock.now_ms())
        self._moved()

    def _count(self, progress: DirectiveProgress, loaded: Loaded) -> None:
        tally = self._tallies.get(progress.directive.directive)
        if tally is not None:
            tally.add(loaded)

    async def _pipeline_directive(self, progress: DirectiveProgress) -> None:
        """Load the directive's blocks with up to ``pipeline_window`` in flight, started by
        halves (so that each half's leases go in one request per source), and report them in
        prefix order as they complete. The blocks whose records come in the second lookup
        start as it is answered, while the first block may still be loading."""
        d = progress.directive
        size = max(1, self.config.pipeline_window)
        upcoming = progress.next_index
        # The first blocks' records come in a small lookup, so that their transfers start
        # while the IS answers (and the instance decodes) the lookup of the rest.
        limit = min(len(d.blocks), upcoming + max(1, size // 4))
        rest = asyncio.ensure_future(self._records(d, limit))
        window: deque[tuple[BlockKey, _KeyLoad | None]] = deque()
        try:
            records = await self._records(d, upcoming, limit)
            while not progress.final:
                if limit < len(d.blocks) and rest.done():
                    records.update(rest.result())
                    limit = len(d.blocks)
                if len(window) <= size // 2:
                    while upcoming < limit and len(window) < size:
                        block = d.blocks[upcoming]
                        upcoming += 1
                        ref = BlockRef(d.compat_id, d.scope_id, block.block_key)
                        held = self.holds(ref)
                        load = None if held else self._ticket(ref, block, records, d, pipe=True)
                        window.append((block.block_key, load))
                if not window:  # every block with records so far is done: wait for the rest
                    if limit >= len(d.blocks):
                        break
                    records.update(await rest)
                    limit = len(d.blocks)
                    continue
                head = window[0][1]
                if head is not None and limit < len(d.blocks) and len(window) < size:
                    # the rest's records may come before the head block is done: start their
                    # transfers then, not once the head (and its publication) has settled
                    await asyncio.wait((head.task, rest), return_when=asyncio.FIRST_COMPLETED)
                    if not head.task.done():
                        continue
                await self._settle_head(window, progress)
        finally:
            rest.cancel()
            for _, load in window:
                self._drop(load)

    async def _records(
        self, d: PrefetchDirective, start: int, stop: int | None = None
    ) -> dict[tuple[BlockKey, str], ReplicaRecord]:
        """The Replica Records of the directive's blocks ``start..stop`` by (key, holder
        base), from the IS."""
        keys = tuple(b.block_key for b in d.blocks[start:stop])
        out: dict[tuple[BlockKey, str], ReplicaRecord] = {}
        for first in range(0, len(keys), LOOKUP_CHUNK):
            chunk = keys[first : first + LOOKUP_CHUNK]
            request = LookupRequest(scope_id=d.scope_id, compat_id=d.compat_id, block_keys=chunk)
            try:
                answer = await self.index.lookup(request)
            except KVSPError as exc:
                _log.warning("lookup for directive %s failed: %s", d.directive, exc)
                break
            for key, records in zip(chunk, answer.replicas or (), strict=False):
                for record in records:
                    with contextlib.suppress(UnsupportedHolder):
                        out[(key, source_base(record))] = record
                self._add_relay_record(out, key, records)
            if answer.matched < len(chunk):
                break  # chained keys: nothing after a miss is findable
        return out

    def _add_relay_record(
        self,
        out: dict[tuple[BlockKey, str], ReplicaRecord],
        key: BlockKey,
        records: Sequence[ReplicaRecord],
    ) -> None:
        """With a relay and no record of its copy of ``key``, the record it would serve the
        block by (:func:`~kvsp.prefetch.through_relay`), from the first record that allows one."""
        relay = self._relay_base
        if relay is None or (key, relay) in out:
            return
        for record in records:
            derived = through_relay(record, relay)
            if derived is not None:
                out[(key, relay)] = derived
                return

    def _unleased(self, base: str, record: ReplicaRecord) -> bool:
        """Whether ``record`` is its relay's copy of a block it does not hold yet: nothing to
        lease there, the FETCH passes through to the block's publisher (§6.1: a miss is a miss)."""
        return base == self._relay_base and record.lease_base is None

    def _ticket(
        self,
        ref: BlockRef,
        block: DirectiveBlock,
        records: Mapping[tuple[BlockKey, str], ReplicaRecord],
        d: PrefetchDirective,
        *,
        pipe: bool = False,
    ) -> _KeyLoad:
        load = self._loads.get(ref)
        if load is None:
            run = self._pipe_block if pipe else self._load_block
            task = asyncio.create_task(run(ref, block.sources, records, d.lease_ms))
            load = _KeyLoad(task)
            self._loads[ref] = load
            self.loads_started += 1
            self._moved()

            def forget(_: object, ref: BlockRef = ref, load: _KeyLoad = load) -> None:
                if self._loads.get(ref) is load:
                    del self._loads[ref]
                self._moved()

            task.add_done_callback(forget)
        load.waiters += 1
        return load

    def _drop(self, load: _KeyLoad | None) -> None:
        if load is None:
            return
        load.waiters -= 1
        if load.waiters <= 0 and not load.task.done():
            load.task.cancel()  # no directive waits for it: stop loading (§6.5 deadline)

    @staticmethod
    async def _outcome(load: _KeyLoad) -> Loaded:
        try:
            return await asyncio.shield(load.task)
        except asyncio.CancelledError:
            if load.task.cancelled():
                return Loaded(False, "cancelled")
            raise

    async def _load_block(
        self,
        ref: BlockRef,
        sources: Sequence[str],
        records: Mapping[tuple[BlockKey, str], ReplicaRecord],
        lease_ms: int,
    ) -> Loaded:
        """Load one block from the first source that delivers it verified."""
        reasons = []
        async with self._transfers:
            for source in sources:
                base = _base(source)
                record = records.get((ref.key, base))
                if record is None:
                    _log_no_record(ref, base)
                    reasons.append(f"{base}: no replica record")
                    continue
                try:
                    if self._unleased(base, record):
                        block = await self._get(base, record)
                    else:
                        block = await self._fetch(ref, base, record, lease_ms)
                except KVSPError as exc:
                    _log_failed_fetch(ref, base, "lease and GET", exc)
                    reasons.append(f"{base}: {exc.problem}")
                    continue
                if await self._place(ref, block):
                    return Loaded(True, source=base, octets=_payload(block))
                reasons.append("no room to keep it")
                break
        return Loaded(False, "; ".join(reasons) or "no sources")

    async def _pipe_block(
        self,
        ref: BlockRef,
        sources: Sequence[str],
        records: Mapping[tuple[BlockKey, str], ReplicaRecord],
        lease_ms: int,
    ) -> Loaded:
        """Load one block from the first source that delivers it verified, as a stage of the
        pipeline: a share of a batched lease, the transfer (within ``pipeline_transfers`` and
        ``pipeline_octets``),
        then placing it, while other blocks transfer; its record is published in a batch."""
        self.replicas.expect()
        expected = True  # until the record is handed to the batcher (or the block given up)
        try:
            reasons = []
            for source in sources:
                base = _base(source)
                record = records.get((ref.key, base))
                if record is None:
                    _log_no_record(ref, base)
                    reasons.append(f"{base}: no replica record")
                    continue
                hold: LeaseHold | None = None
                if not self._unleased(base, record):
                    try:
                        lease_at = self._lease_at(record)
                        hold = await self.leases.acquire(lease_at, base, ref, record.size, lease_ms)
                    except KVSPError as exc:
                        _log_failed_fetch(ref, base, "lease", exc)
                        reasons.append(f"{base}: {exc.problem}")
                        continue
                try:
                    async with self._pipe_transfers.take(record.size):
                        block = await self._get(base, record)
                        octets = _payload(block)
                except KVSPError as exc:
                    _log_failed_fetch(ref, base, "GET", exc)
                    reasons.append(f"{base}: {exc.problem}")
                    continue
                finally:
                    if hold is not None:
                        hold.release()
                stored = await self._keep(ref, block)
                held = self.engine.hold(ref.key, self._engine_copy(stored, block))
                if stored is None:
                    if held:
                        return Loaded(True, source=base, octets=octets)
                    reasons.append("no room to keep it")
                    break
                expected = False
                if isinstance(stored, StoredBlock):  # published with the blocks stored meanwhile
                    await self.replicas.add(stored, expected=True)
                else:
                    self.replicas.forget()  # held already
                return Loaded(True, source=base, octets=octets)
            return Loaded(False, "; ".join(reasons) or "no sources")
        finally:
            if expected:
                self.replicas.forget()

    def _engine_copy(self, stored: StoredBlock | bool | None, block: Container) -> Container:
        """The block for the engine to hold: views of the holder's host copy when the holder
        has just stored it there (so that the engine and the holder share one copy, and the
        received buffer goes back to the client's pool for the next transfer), else
        ``block`` itself."""
        if not isinstance(stored, StoredBlock) or stored.tier is not Tier.HOST:
            return block
        return _views_of(self.holder.store.read(stored), block)

    async def _keep(self, ref: BlockRef, block: VerifiedBlock) -> StoredBlock | bool | None:
        """Store a verified block in the holder's tiers without publishing it: the stored
        block, True when the holder has it already, None when it could not keep it."""
        try:
            return await self.holder.put_verified(self._principal, *ref, block, publish=False)
        except PreconditionFailed:
            return True
        except KVSPError as exc:
            _log.warning("keeping block %s failed: %s", ref, exc)
            return None

    def _lease_at(self, record: ReplicaRecord) -> str:
        """Where to lease the record's replica: never an origin its holder URI does not name.

        Raises:
            UnvouchedOrigin: a ``lease_base`` elsewhere (counted in ``unvouched_records``).
            UnsupportedHolder: no HTTP base to lease at.
        """
        try:
            return lease_base(record)
        except UnvouchedOrigin:
            self.unvouched_records += 1
            raise

    async def _fetch(
        self, ref: BlockRef, base: str, record: ReplicaRecord, lease_ms: int
    ) -> VerifiedBlock:
        """Lease, GET and verify one block at one source (§6.6, §6.7); the lease is released
        whatever happens (and expires at the source anyway)."""
        lease_at = self._lease_at(record)
        request = LeaseRequest(
            compat_id=ref.compat, scope_id=ref.scope, block_keys=(ref.key,), ttl_ms=lease_ms
        )
        began = time.perf_counter()
        grant = await self.block_client.acquire_lease(lease_at, request)
        self.links.record_rtt(base, time.perf_counter() - began)
        try:
            return await self._get(base, record)
        finally:
            try:
                await self.block_client.release_lease(lease_at, grant.lease)
            except KVSPError as exc:
                _log.debug("releasing lease %s at %s: %s", grant.lease, lease_at, exc)

    async def _get(self, base: str, record: ReplicaRecord) -> VerifiedBlock:
        """GET (or FETCH) and verify the record's block at ``base``, timing it for ``links``.

        A copy fetched through the relay unleased has no lease request to time the round trip
        by; the whole FETCH bounds it from above and stands in for it."""
        began = time.perf_counter()
        block = await self.block_client.get_block(base, record, geometry=self.geometry)
        seconds = time.perf_counter() - began
        octets = _payload(block)
        if self._unleased(base, record):
            self.links.record_rtt(base, seconds)
        self.links.record_transfer(base, octets, seconds)
        return block

    async def _place(self, ref: BlockRef, block: VerifiedBlock) -> bool:
        """Keep a verified block in the engine and in the holder's tiers, publishing it."""
        held = self.engine.hold(ref.key, block)
        return await self._store(ref, _octets(block)) or held


def _payload(block: Container) -> int:
    """The octets of a block's K and V sections (what a transfer moved, header aside)."""
    return sum(layer.k.nbytes + layer.v.nbytes for layer in block.layers)


def _views_of(data: memoryview, block: Container) -> Container:
    """``block`` over ``data``, which holds ``block``'s encoding (§4.3): the same header
    fields, each layer's K and V a view of ``data`` at its place. ``block`` itself when
    ``data`` is not of that encoding's size."""
    offset = header_size(block.layer_count)
    if data.nbytes != offset + _payload(block):
        return block
    data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    layers = []
    for layer in block.layers:
        k_end = offset + layer.k.nbytes
        end = k_end + layer.v.nbytes
        layers.append(Layer(layer.index, data[offset:k_end], data[k_end:end]))
        offset = end
    return Container(
        version=block.version,
        flags=block.flags,
        codec=block.codec,
        first_layer=block.first_layer,
        layer_count=block.layer_count,
        token_count=block.token_count,
        layers=tuple(layers),
    )


def _octets(block: Container) -> bytes:
    """The container's octets: the received body itself when the layers are views of one
    buffer holding exactly the container (no copy of a large block), else a new encoding."""
    body = block.layers[0].k.obj if block.layers else None
    header = block.header_bytes
    size = len(header) + sum(layer.k.nbytes + layer.v.nbytes for layer in block.layers)
    if isinstance(body, bytearray) and len(body) == size and body.startswith(header):
        return body  # type: ignore[return-value]  # bytearray: accepted wherever bytes is
    return block.encode()
