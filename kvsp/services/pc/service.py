"""The Placement Controller (spec §6.3 status and lifecycle at the PC, §6.4 placement, §6.5
issuing prefetch directives; DESIGN.md §1 and §3 ``place``).

:class:`PlacementController` keeps the instance table in an instance store
(:mod:`kvsp.stores.instances`: in this process, or in Redis shared by every PC on it) and
decides; each status record, state order, expiry and ended epoch is one atomic step on the
stored entry, so PCs sharing a store agree on every instance and an expiry is declared (and
its sessions moved, its replicas withdrawn) by exactly one of them. Its :attr:`registry` is
this process's copy of the table, read in one round trip before each placement or listing.
Everything it does to the outside world goes through small injected objects, so tests drive
it with in-process fakes and a manual clock:

* :class:`IndexAccess` finds replica records and takes status records: the in-process IS in
  ``kvsp serve control`` (:class:`kvsp.services.control.LocalIndex`), an IS client when the PC
  runs apart (:class:`kvsp.services.pc.app.RemoteIndex`);
* :class:`InstancePeers` sends prefetch directives and state changes to instances;
* a :data:`ScaleUpHook` starts an instance when none can take a request.

Decisions that can be pure are, in :mod:`kvsp.placement_plan`: directive contents and the
measured service times take values and return values.

Choices the spec leaves open, made here:

* **Stale epochs** are answered ``409 kvsp-stale-epoch`` and change nothing (§6.3 MUST
  discard): the sender is a dead incarnation or one the PC declared failed, and only a new epoch
  can bring it back (§6.8), which it learns from that answer. A 200 would tell a failed
  instance that it still serves. Epochs too far ahead of the PC's clock are refused, and a
  stored one beyond that bound yields to the next record (:mod:`kvsp.lifecycle`).
* **Service time** (§6.4 ``wait_us = queued * mean service time``) is measured, not configured:
  see :class:`~kvsp.placement_plan.ObservedServiceTimes`.
* **Scale-up** answers ``503 kvsp-not-active`` with ``Retry-After`` after starting the instance
  and sending it the directive; the PC does not hold the request open for an instance start,
  which can take minutes. The retry finds the instance registered with its blocks loading or
  loaded. One start runs at a time; requests meanwhile get the same 503 naming it.
* **Replicas of a lost instance** (§6.1, §6.3): an instance declared failed (expiry, or a
  restart ending its epoch) or that ended its epoch has every replica record it published as
  a holder withdrawn at the IS at once (:meth:`IndexAccess.withdraw_holder`), rather than left
  to expire, so no placement plans a fetch from it meanwhile.
* **Sessions** (§6.8) live in :attr:`PlacementController.sessions`
  (:mod:`kvsp.services.pc.sessions`): ``place`` with ``session`` creates the record at the
  chosen instance, and every instance found failed (:meth:`PlacementController.sweep`, or a
  restart seen in a status record) has its sessions moved by the same §6.4 choice
  (:meth:`PlacementController.choose_for_resume`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvsp.compat import CompatibilityDescriptor
from kvsp.errors import (
    BadRequest,
    Conflict,
    Incompatible,
    KVSPError,
    NotActive,
    NotFound,
    UpstreamError,
)
from kvsp.index import holder_id_of
from kvsp.lifecycle import (
    DEFAULT_MAX_EPOCH_SKEW_MS,
    Accepted,
    InstanceEntry,
    InstanceRegistry,
    accept_status,
    apply_order,
    cancel_order,
    end_epoch,
    expire_entry,
    order_state,
)
from kvsp.placement import AssumedLink, PlacementDecision, choose_instance
from kvsp.placement_plan import (
    DirectiveOptions,
    ObservedServiceTimes,
    build_directive,
    startup_directive,
)
from kvsp.records import (
    InstanceStatusRecord,
    LookupRequest,
    PlaceRequest,
    PlaceResponse,
    PrefetchDirective,
    ReplicaRecord,
    StateAnswer,
)
from kvsp.records_session import ResumeRequest, SessionCheckpoint
from kvsp.registries import InstanceState
from kvsp.services.pc.sessions import SessionService, SessionSettings
from kvsp.stores.instances import InstanceStore, MemoryInstanceStore
from kvsp.stores.sessions import MemorySessionStore, SessionStore
from kvsp.web.clock import Clock

_log = logging.getLogger("kvsp.services.pc.service")

DIRECTIVE_TRIES = 3
"""Instances tried for one request when sending the directive fails (it is then excluded)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PCConfig:
    """Settings of one PC.

    ``sleep_threshold``/``sleep_after_ms`` are the :class:`~kvsp.lifecycle.SleepPolicy`;
    ``deadline_ms``/``lease_ms`` go into directives unless the request asks otherwise;
    ``max_cost_us`` and ``queue_limit`` bound acceptable placements (§6.4); ``service_prior_us``
    is the mean service time assumed before any instance has been measured;
    ``scale_up_timeout_ms`` is how long a started instance has to send its first status before
    another may be started; ``retry_after_s`` goes into the 503's ``Retry-After``;
    ``max_epoch_skew_ms`` is how far a status epoch may be ahead of the PC's clock
    (:mod:`kvsp.lifecycle`).
    """

    sleep_threshold: float = 1.0
    sleep_after_ms: int = 60_000
    status_sweep_ms: int = 500
    deadline_ms: int = 1_000
    lease_ms: int = 5_000
    max_cost_us: float = math.inf
    queue_limit: int | None = None
    service_prior_us: float = 0.0
    service_alpha: float = 0.2
    scale_up_timeout_ms: int = 60_000
    retry_after_s: int = 1
    max_epoch_skew_ms: int = DEFAULT_MAX_EPOCH_SKEW_MS
    assumed_link_mbit_per_s: float = 10_000.0
    """Link rate assumed from an instance to a holder in its own site, or to its relay, to which
    it has not reported a link (0: none; :class:`~kvsp.placement.AssumedLink`).

    Instances report only links they measured, and they measure a link by fetching over it, so
    without an assumption no directive would ever reach a fresh instance. The instance's own
    measurement replaces the assumption as soon as it reports one."""
    assumed_link_rtt_us: float = 200.0
    sessions: SessionSettings = dataclasses.field(default_factory=SessionSettings)
    """How sessions are kept and moved on failure (§6.8)."""


# --- injected I/O ------------------------------------------------------------------------------


class IndexAccess(Protocol):
    """How the PC reaches the IS (in-process or over HTTP)."""

    async def find(self, request: LookupRequest, now_ms: int) -> Sequence[Sequence[ReplicaRecord]]:
        """The replica records of the matched leading keys, one non-empty list per key (§6.2)."""
        ...

    async def put_status(self, record: InstanceStatusRecord, now_ms: int) -> None:
        """Give the IS an accepted status record, for lookups with targets (DESIGN §1)."""
        ...

    async def descriptor(self, compat_id: bytes) -> CompatibilityDescriptor | None:
        """The descriptor of ``compat_id`` (for ``block_tokens`` and ``layers``), if known."""
        ...

    async def withdraw_holder(self, holder: str, *, published_before: int | None = None) -> int:
        """Withdraw every replica record of ``holder`` (an instance the PC declared failed or
        that ended its epoch, §6.3), or only those last published before ``published_before``
        (ms); how many went."""
        ...


class InstancePeers(Protocol):
    """How the PC reaches instances; failures raise :class:`~kvsp.errors.KVSPError`."""

    async def prefetch(self, instance: str, directive: PrefetchDirective) -> None:
        """POST ``{instance}prefetch`` (§6.5); returns once the instance answered 202."""
        ...

    async def put_state(self, instance: str, state: InstanceState) -> None:
        """PUT ``{instance}state`` with ``{"state": state}`` (§6.3)."""
        ...

    async def resume(self, instance: str, request: ResumeRequest) -> None:
        """POST ``{instance}sessions/{session}/resume`` (§6.8); returns once it took it."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class ScaleUpContext:
    """What a scale-up hook learns about the request that found no instance."""

    scope_id: bytes
    compat_id: bytes
    prompt_tokens: int
    matched: int
    request_ref: str | None
    active: int
    reason: str

    def to_json(self) -> dict[str, Any]:
        """Render as JSON (the hook's stdin or POST body)."""
        return {
            "scope_id": self.scope_id.hex(),
            "compat_id": self.compat_id.hex(),
            "prompt_tokens": self.prompt_tokens,
            "matched": self.matched,
            "request_ref": self.request_ref,
            "active": self.active,
            "reason": self.reason,
        }


ScaleUpHook = Callable[[ScaleUpContext], Awaitable[str]]
"""Starts an instance and returns its base URI; raises :class:`~kvsp.errors.KVSPError`."""


# --- errors ------------------------------------------------------------------------------------


class NoInstance(NotActive):
    """No active instance can take the request (503 ``kvsp-not-active``, §6.3, §6.4).

    ``retry_after_s`` is for ``Retry-After``. When an instance is being started for it, the
    problem names it in the extension member ``starting`` and the directive sent to it in
    ``directive``.
    """

    def __init__(
        self,
        detail: str,
        *,
        retry_after_s: int,
        starting: str | None = None,
        directive: uuid.UUID | None = None,
    ) -> None:
        super().__init__(detail)
        self.retry_after_s = retry_after_s
        self.starting = starting
        self.directive = directive

    def to_problem(self, instance: str | None = None) -> dict[str, Any]:
        """The problem object with ``starting`` and ``directive`` when set."""
        body = super().to_problem(instance)
        if self.starting is not None:
            body["starting"] = self.starting
        if self.directive is not None:
            body["directive"] = str(self.directive)
        return body


# --- the controller ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class InstanceView:
    """One row of ``GET instances``: the PC's state and the latest record's load."""

    instance: str
    state: InstanceState
    epoch: int
    reported_state: InstanceState
    requested_state: InstanceState | None
    running: int
    queued: int
    batch_size: int
    kv_utilization: float
    age_ms: int
    ttl_ms: int
    mean_service_us: float | None
    site: str | None = None
    zone: str | None = None

    def to_json(self) -> dict[str, Any]:
        """Render as JSON (``instance_id`` is the path segment naming the instance; ``site``
        and ``zone`` as the instance reports them, ``null`` when it has none)."""
        return {
            "instance": self.instance,
            "instance_id": holder_id_of(self.instance).hex(),
            "state": str(self.state),
            "epoch": self.epoch,
            "reported_state": str(self.reported_state),
            "requested_state": None if self.requested_state is None else str(self.requested_state),
            "load": self.running + self.queued,
            "running": self.running,
            "queued": self.queued,
            "batch_size": self.batch_size,
            "kv_utilization": self.kv_utilization,
            "age_ms": self.age_ms,
            "ttl_ms": self.ttl_ms,
            "mean_service_us": self.mean_service_us,
            "site": self.site,
            "zone": self.zone,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class _Geometry:
    block_tokens: int
    layers: int | None


class PlacementController:
    """Instance status and lifecycle (§6.3), placement (§6.4) and directives (§6.5)."""

    def __init__(
        self,
        registry: InstanceRegistry[InstanceStatusRecord],
        index: IndexAccess,
        peers: InstancePeers,
        clock: Clock,
        config: PCConfig,
        *,
        scale_up: ScaleUpHook | None = None,
        new_id: Callable[[], uuid.UUID] = uuid.uuid4,
        sessions: SessionStore | None = None,
        instances: InstanceStore | None = None,
    ) -> None:
        self.registry = registry
        """This process's copy of the instance table: the table itself over the memory store,
        else refreshed from the shared store before each read (one round trip)."""
        self.instances: InstanceStore = (
            instances if instances is not None else MemoryInstanceStore(registry)
        )
        self.config = config
        self.service_times = ObservedServiceTimes(
            prior_us=config.service_prior_us, alpha=config.service_alpha
        )
        self._index = index
        self._peers = peers
        self._clock = clock
        self._scale_up = scale_up
        self._new_id = new_id
        self._ids: dict[bytes, str] = {}
        self._starting: dict[str, int] = {}  # instance being started -> give up at (ms)
        self._hook_running = False
        self.sessions = SessionService(
            sessions if sessions is not None else MemorySessionStore(),
            self,
            peers,
            clock,
            config.sessions,
        )
        self.directives_sent = 0  # accepted (202) by their instance; for metrics
        self.directives_failed = 0  # refused or unreachable; for metrics
        self.replicas_withdrawn = 0  # records of failed or ended instances withdrawn; for tests

    # --- §6.3 status and lifecycle -------------------------------------------------------------

    async def refresh(self) -> None:
        """Bring :attr:`registry` up to date with a shared instance store (one round trip);
        nothing to do over the memory store, whose table it is."""
        store = self.instances
        if isinstance(store, MemoryInstanceStore) and store.registry is self.registry:
            return
        self.registry.load(await store.entries())

    async def put_status(self, record: InstanceStatusRecord) -> StateAnswer:
        """Take an instance's status record and answer with the PC's state for it (§6.3).

        The decision (:func:`kvsp.lifecycle.accept_status`) is taken on the stored entry in one
        atomic step, so PCs sharing a store never lose an update. Accepted records are
        forwarded to the IS; a failure to forward is logged, since the IS only uses them for
        estimates and the next record will try again.

        Raises:
            StaleEpoch: a lower epoch than seen, or the epoch of an instance declared failed.
            IllegalTransition: a reported state the instance may not move to.
            BadRequest: a reported state of failed, or an epoch further ahead of the PC's clock
                than ``max_epoch_skew_ms``.
        """
        now = self._clock.now_ms()
        policy, skew = self.registry.policy, self.config.max_epoch_skew_ms

        def decide(
            entry: InstanceEntry[InstanceStatusRecord] | None,
        ) -> tuple[InstanceEntry[InstanceStatusRecord], Accepted]:
            return accept_status(entry, record, now, policy, max_epoch_skew_ms=skew)

        accepted = await self.instances.update(record.instance, decide)
        self._ids[holder_id_of(record.instance)] = record.instance
        if accepted.poisoned_epoch is not None:
            _log.warning(
                "%s: epoch %d was beyond the skew bound; replaced by epoch %d",
                record.instance,
                accepted.poisoned_epoch,
                record.epoch,
            )
        if accepted.registered:
            self.service_times.forget(record.instance)  # a new epoch may be a new machine
            self._starting.pop(record.instance, None)
        if accepted.ended_epoch is not None:
            _log.warning("%s restarted; epoch %d ended", record.instance, accepted.ended_epoch)
            self.sessions.instance_failed(record.instance)  # its sessions died with it
            # Only the old incarnation's records: the new one may have published before its
            # first status. Its epoch is its start time when epochs are clock times (as this
            # implementation's are); else the last record of the old epoch bounds them.
            heard = accepted.ended_heard_ms if accepted.ended_heard_ms is not None else now
            await self._withdraw(
                record.instance, published_before=min(now, max(heard, record.epoch))
            )
        self.service_times.on_status(record, now)
        try:
            await self._index.put_status(record, now)
        except KVSPError as exc:
            _log.warning("forwarding the status of %s to the IS failed: %s", record.instance, exc)
        return StateAnswer(state=accepted.state)

    async def sweep(self) -> tuple[str, ...]:
        """Mark instances whose record expired as failed (§6.3), withdraw their replicas at
        the IS and start moving their sessions (§6.8); returns them.

        Each mark is a compare-and-set on the stored entry: of PCs sweeping one store at once,
        exactly one marks a given instance failed and acts on it.
        """
        now = self._clock.now_ms()
        await self.refresh()
        due = [e.instance for e in self.registry.all_entries() if expire_entry(e, now)]
        failed = []
        for name in due:

            def decide(
                entry: InstanceEntry[InstanceStatusRecord] | None,
            ) -> tuple[InstanceEntry[InstanceStatusRecord] | None, bool]:
                new = None if entry is None else expire_entry(entry, now)
                return (entry, False) if new is None else (new, True)

            if await self.instances.update(name, decide):
                failed.append(name)
        for name in failed:
            self.service_times.forget(name)
            self.sessions.instance_failed(name)  # §6.8: its sessions move elsewhere
            _log.warning("%s failed: its status record expired", name)
            await self._withdraw(name)
        if failed:
            await self.refresh()
        return tuple(failed)

    async def _withdraw(self, instance: str, *, published_before: int | None = None) -> None:
        """Withdraw the replicas the instance published as a holder (§6.1; before
        ``published_before`` only, when given): its blocks died with it, or went with its
        epoch; a failure is logged (their TTLs end them anyway)."""
        try:
            gone = await self._index.withdraw_holder(instance, published_before=published_before)
        except KVSPError as exc:
            _log.warning("withdrawing the replicas of %s failed: %s", instance, exc)
            return
        self.replicas_withdrawn += gone
        if gone:
            _log.info("withdrew %d replica records of %s", gone, instance)

    async def end_epoch(self, instance: str, epoch: int) -> None:
        """End ``instance``'s ``epoch`` gracefully (its shutdown, or an operator's): it leaves
        the table (not listed, not placed on, never reported failed), its replicas are
        withdrawn at the IS and its sessions, if any remain, move as after a failure (§6.8).
        A record with a higher epoch registers it again.

        Raises:
            NotFound: no such instance (or its epoch ended already).
            StaleEpoch: ``epoch`` is lower than the PC's epoch of it.
        """

        def decide(
            entry: InstanceEntry[InstanceStatusRecord] | None,
        ) -> tuple[InstanceEntry[InstanceStatusRecord], InstanceEntry[InstanceStatusRecord]]:
            ended = end_epoch(entry, instance, epoch)
            return ended, entry if entry is not None else ended

        before = await self.instances.update(instance, decide)
        self.service_times.forget(instance)
        if before.state is not InstanceState.FAILED:
            self.sessions.instance_failed(instance)  # §6.8: any left move elsewhere
        _log.info("%s ended epoch %d", instance, epoch)
        await self._withdraw(instance)
        await self.refresh()

    async def instance_uri(self, instance_id: bytes) -> str:
        """The URI of the instance named by ``uri_id`` octets in a path (one that reported to
        this PC, or to any PC sharing its store).

        Raises:
            NotFound: no instance with that id ever reported.
        """
        uri = self._ids.get(bytes(instance_id))
        if uri is None:
            await self.refresh()
            for entry in self.registry.all_entries():
                self._ids[holder_id_of(entry.instance)] = entry.instance
            uri = self._ids.get(bytes(instance_id))
        if uri is None:
            raise NotFound(f"no instance {bytes(instance_id).hex()}")
        return uri

    async def set_state(self, instance: str, state: InstanceState) -> InstanceState:
        """Change an instance's state on an operator's order: check the transition table and
        note the order, forward ``PUT state`` to the instance, then record the move (§6.3).

        The order is noted before it is sent, so that a status record the instance sends
        after taking it (which may reach the PC before the answer does) is read as the
        order's outcome, not refused as a move the instance may not make; an instance that
        went on from the ordered state by itself (draining → sleeping) keeps its state.

        Raises:
            NotFound: the instance never reported.
            IllegalTransition: no such move by the PC (409), checked before contacting it.
            TransportError: the instance could not be reached (502); nothing changes.
            UpstreamError: the instance answered with an error (502); nothing changes.
        """
        now = self._clock.now_ms()

        def order(
            entry: InstanceEntry[InstanceStatusRecord] | None,
        ) -> tuple[InstanceEntry[InstanceStatusRecord], None]:
            return order_state(entry, instance, state, now), None

        def cancel(
            entry: InstanceEntry[InstanceStatusRecord] | None,
        ) -> tuple[InstanceEntry[InstanceStatusRecord] | None, None]:
            return cancel_order(entry, state) or entry, None

        await self.instances.update(instance, order)
        try:
            await self._peers.put_state(instance, state)
        except KVSPError as exc:
            await self.instances.update(instance, cancel)
            if exc.status == 502:
                raise
            raise UpstreamError(f"{instance} refused state {state}: {exc}") from exc
        done = self._clock.now_ms()

        def apply(
            entry: InstanceEntry[InstanceStatusRecord] | None,
        ) -> tuple[InstanceEntry[InstanceStatusRecord], InstanceState]:
            # Re-checked: the instance may have failed while we waited.
            new = apply_order(entry, instance, state, done)
            return new, new.state

        return await self.instances.update(instance, apply)

    def list_instances(self) -> list[InstanceView]:
        """Every known instance, by URI, with the state as of now (expired = failed), from this
        process's copy of the table (:meth:`refresh` it first for the shared store's)."""
        now = self._clock.now_ms()
        views = []
        for entry in self.registry.entries():
            record = entry.record
            state = entry.state_at(now)
            measured = self.service_times.measured(entry.instance)
            views.append(
                InstanceView(
                    instance=entry.instance,
                    state=state,
                    epoch=entry.epoch,
                    reported_state=record.state,
                    requested_state=record.requested_state,
                    running=record.running,
                    queued=record.queued,
                    batch_size=record.batch_size,
                    kv_utilization=record.kv_utilization,
                    age_ms=now - entry.received_ms,
                    ttl_ms=record.ttl_ms,
                    mean_service_us=(
                        self.service_times.mean_us(entry.instance) if measured else None
                    ),
                    site=record.site,
                    zone=record.zone,
                )
            )
        return views

    # --- §6.4 placement, §6.5 directives -------------------------------------------------------

    async def place(
        self, request: PlaceRequest, options: DirectiveOptions | None = None
    ) -> PlaceResponse:
        """Choose the active instance with the lowest §6.4 cost and, when loading cached
        blocks is cheaper than recomputing them, send it the prefetch directive before
        answering (§6.5).

        With ``session`` the PC records the session at the chosen instance (§6.8), so that
        it can be moved when that instance fails.

        Raises:
            NoInstance: no active instance has acceptable cost and capacity (503, after
                starting one when a scale-up hook is configured).
            Incompatible: blocks matched but the PC knows no descriptor for the compat id.
            BadRequest: ``prompt_tokens`` shorter than the keyed blocks.
            Conflict: the session exists.
            KVSPError: the IS could not be asked (502 when unreachable).
        """
        options = options or DirectiveOptions()
        if request.session is not None and await self.sessions.exists(request.session):
            raise Conflict(f"session {request.session} exists", path="$.session")
        await self.sweep()  # reads the instance table once (and refreshes after a failure)
        replicas: Sequence[Sequence[ReplicaRecord]] = ()
        if request.block_keys:
            lookup = LookupRequest(
                scope_id=request.scope_id,
                compat_id=request.compat_id,
                block_keys=request.block_keys,
            )
            replicas = await self._index.find(lookup, self._clock.now_ms())
        geometry = await self._geometry(request, len(replicas))
        excluded: set[str] = set()
        for _ in range(DIRECTIVE_TRIES):
            decision = self._choose(request, replicas, geometry, excluded)
            if decision is None:
                break
            try:
                directive = await self._direct(decision, request, replicas, options)
            except KVSPError as exc:
                _log.warning("directive to %s failed: %s", decision.instance, exc)
                self.directives_failed += 1  # metrics
                excluded.add(decision.instance)
                continue
            self.service_times.placed(decision.instance)
            if request.session is not None:
                await self.sessions.create(
                    request.session, request.scope_id, request.compat_id, decision.instance
                )
            return PlaceResponse(
                instance=decision.instance,
                matched=len(replicas),
                cost_us=decision.estimate.cost_us,
                directive=None if directive is None else directive.directive,
            )
        raise await self._no_instance(request, replicas, options, tried=len(excluded))

    async def choose_for_resume(
        self, checkpoint: SessionCheckpoint, excluded: set[str]
    ) -> str | None:
        """The instance a session should move to (§6.8 "selects a new instance as in Section
        6.4"): the choice of :meth:`place` for the checkpoint's prompt blocks, with its prompt
        tail and output as tokens to compute; no directive is sent (the resume loads them).

        Raises:
            KVSPError: the IS could not be asked.
        """
        await self.sweep()  # reads the instance table once (and refreshes after a failure)
        descriptor = await self._index.descriptor(checkpoint.compat_id)
        b = 1 if descriptor is None else descriptor.block_tokens
        keys = checkpoint.prompt_blocks if descriptor is not None else ()
        tokens = len(checkpoint.prompt_blocks) * b + len(checkpoint.prompt_tail)
        request = PlaceRequest(
            scope_id=checkpoint.scope_id,
            compat_id=checkpoint.compat_id,
            block_keys=keys,
            prompt_tokens=tokens + checkpoint.output_offset,
        )
        replicas: Sequence[Sequence[ReplicaRecord]] = ()
        if keys:
            lookup = LookupRequest(
                scope_id=request.scope_id, compat_id=request.compat_id, block_keys=keys
            )
            replicas = await self._index.find(lookup, self._clock.now_ms())
        geometry = await self._geometry(request, len(replicas))
        decision = self._choose(request, replicas, geometry, excluded)
        return None if decision is None else decision.instance

    async def _geometry(self, request: PlaceRequest, matched: int) -> _Geometry:
        descriptor = await self._index.descriptor(request.compat_id)
        if descriptor is None:
            if matched:
                raise Incompatible(
                    f"no descriptor known for compat_id {request.compat_id.hex()}: register it "
                    "(PUT descriptors/{compat}) or start the PC with --descriptor"
                )
            return _Geometry(block_tokens=1, layers=None)  # nothing cached: tokens are tokens
        needed = len(request.block_keys) * descriptor.block_tokens
        if request.prompt_tokens < needed:
            raise BadRequest(
                f"{len(request.block_keys)} block keys of {descriptor.block_tokens} tokens need "
                f"at least {needed} prompt tokens",
                path="$.prompt_tokens",
            )
        return _Geometry(block_tokens=descriptor.block_tokens, layers=descriptor.layers)

    def _choose(
        self,
        request: PlaceRequest,
        replicas: Sequence[Sequence[ReplicaRecord]],
        geometry: _Geometry,
        excluded: set[str],
    ) -> PlacementDecision | None:
        # MUST NOT assign requests to an instance that is not active (§6.3): only the PC's
        # active, unexpired instances are candidates. An instance the PC has just woken may
        # still report its old state; the PC's state is the authority.
        candidates = [
            r
            if r.state is InstanceState.ACTIVE
            else dataclasses.replace(r, state=InstanceState.ACTIVE)
            for r in self.registry.active_instances(self._clock.now_ms())
            if r.instance not in excluded
        ]
        return choose_instance(
            candidates,
            replicas,
            block_tokens=geometry.block_tokens,
            prompt_tokens=request.prompt_tokens,
            service_times=self.service_times,
            layers=geometry.layers,
            max_cost_us=self.config.max_cost_us,
            queue_limit=self.config.queue_limit,
            assumed=self._with_assumed_links(),
        )

    def _with_assumed_links(self) -> AssumedLink | None:
        """The link assumed from an instance to a source it may use but has not measured (a
        holder in its site, its relay; :class:`~kvsp.placement.SourceView`), if any."""
        if self.config.assumed_link_mbit_per_s <= 0:
            return None
        return AssumedLink(
            mbit_per_s=self.config.assumed_link_mbit_per_s,
            rtt_us=self.config.assumed_link_rtt_us,
        )

    def _timing(self, options: DirectiveOptions) -> tuple[int, int]:
        deadline = self.config.deadline_ms if options.deadline_ms is None else options.deadline_ms
        lease = self.config.lease_ms if options.lease_ms is None else options.lease_ms
        return deadline, lease

    async def _direct(
        self,
        decision: PlacementDecision,
        request: PlaceRequest,
        replicas: Sequence[Sequence[ReplicaRecord]],
        options: DirectiveOptions,
    ) -> PrefetchDirective | None:
        estimate = decision.estimate
        entry = self.registry.get(decision.instance)
        if estimate.plan != "fetch" or estimate.sources is None or entry is None:
            return None  # recomputing everything is no slower: nothing to load
        deadline, lease = self._timing(options)
        directive = build_directive(
            directive_id=self._new_id(),
            request=request,
            replicas=replicas,
            sources=estimate.sources,
            status=entry.record,
            deadline_ms=deadline,
            lease_ms=lease,
            assumed=self._with_assumed_links(),
        )
        if directive is not None:
            # §6.3 MUST NOT direct a non-active instance: the decision was taken from the
            # active instances with no await since.
            await self._peers.prefetch(decision.instance, directive)
            self.directives_sent += 1  # metrics
        return directive

    # --- scale-up (§6.4 last paragraph) --------------------------------------------------------

    def _pending_start(self, now: int) -> str | None:
        for name, give_up in list(self._starting.items()):
            if now >= give_up:
                del self._starting[name]
        return next(iter(self._starting), None)

    async def _no_instance(
        self,
        request: PlaceRequest,
        replicas: Sequence[Sequence[ReplicaRecord]],
        options: DirectiveOptions,
        *,
        tried: int,
    ) -> NoInstance:
        retry = self.config.retry_after_s
        active = len(self.registry.active_instances(self._clock.now_ms()))
        reason = (
            "no active instance"
            if not active
            else f"no active instance of {active} has acceptable cost and capacity"
        )
        if tried:
            reason += f" ({tried} unreachable)"
        if self._scale_up is None:
            return NoInstance(reason, retry_after_s=retry)
        pending = self._pending_start(self._clock.now_ms())
        if pending is not None or self._hook_running:
            return NoInstance(
                f"{reason}; an instance is starting", retry_after_s=retry, starting=pending
            )
        context = ScaleUpContext(
            scope_id=request.scope_id,
            compat_id=request.compat_id,
            prompt_tokens=request.prompt_tokens,
            matched=len(replicas),
            request_ref=request.request_ref,
            active=active,
            reason=reason,
        )
        self._hook_running = True
        try:
            uri = await self._scale_up(context)
        except KVSPError as exc:
            _log.error("scale-up hook failed: %s", exc)
            return NoInstance(f"{reason}; starting an instance failed", retry_after_s=retry)
        finally:
            self._hook_running = False
        self._starting[uri] = self._clock.now_ms() + self.config.scale_up_timeout_ms
        directive = await self._direct_new(uri, request, replicas, options)
        return NoInstance(
            f"{reason}; started {uri}, retry after it registers",
            retry_after_s=retry,
            starting=uri,
            directive=None if directive is None else directive.directive,
        )

    async def _direct_new(
        self,
        uri: str,
        request: PlaceRequest,
        replicas: Sequence[Sequence[ReplicaRecord]],
        options: DirectiveOptions,
    ) -> PrefetchDirective | None:
        """Send a just-started instance its directive at once, so that loading overlaps its
        start (§6.4 "SHOULD send it a prefetch directive at once").

        This squares with §6.3 "MUST NOT ... send prefetch directives to an instance that is
        not active": a new instance is in none of the §6.3 states until its first status
        record registers it (as active, the only state a new epoch may report), so it is not
        an instance "that is not active". An instance the PC knows in another state (a hook
        that returned a draining or sleeping one) gets nothing.
        """
        known = self.registry.state_of(uri, self._clock.now_ms())
        if known is not None and known is not InstanceState.ACTIVE:
            _log.warning("scale-up hook returned %s, which is %s: no directive", uri, known)
            return None
        deadline, lease = self._timing(options)
        directive = startup_directive(
            directive_id=self._new_id(),
            request=request,
            replicas=replicas,
            deadline_ms=deadline,
            lease_ms=lease,
        )
        if directive is None:
            return None
        try:
            await self._peers.prefetch(uri, directive)
        except KVSPError as exc:
            _log.warning("directive to starting instance %s failed: %s", uri, exc)
            self.directives_failed += 1  # metrics
            return None
        self.directives_sent += 1  # metrics
        return directive
