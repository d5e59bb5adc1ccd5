"""Instance status and lifecycle at the PC (spec §6.3): the state table and the epoch rules.

:class:`~kvsp.registries.InstanceState` lives in the registries module; its transition table is
here, with the actor allowed to make each move:

========== ========== =========== ==========================================================
from       to         by          why
========== ========== =========== ==========================================================
active     draining   pc          the PC accepts a sleep request, or an operator drains it
draining   active     pc          an operator cancels the drain
draining   sleeping   instance    the instance has no sessions left and reports it
sleeping   active     pc          only a state change from the PC wakes an instance
active,    failed     expiry      its status record expired
draining,
sleeping
failed     active     instance    a new epoch (a restart) re-registers it
========== ========== =========== ==========================================================

Epochs are bounded by the receiver's clock. An epoch more than ``max_epoch_skew_ms`` ahead of
it is refused (400 ``kvsp-bad-request`` naming ``$.epoch``): a start time cannot be in the
future by more than the clock skew between hosts, and accepting one would make every later
record of the real instance "lower" (§6.3 discard) until its clock caught up. A stored epoch
beyond the bound (accepted before the rule, or left by the receiver's clock stepping back) is
*poisoned*: the next record within the bound from a principal allowed to report for the
instance replaces it as a first record would (the poisoned epoch ends like a restarted one),
so no operator is needed. An epoch just within the
bound can hold the instance off for at most the bound: the instance re-registers with its
start time on every ``kvsp-stale-epoch`` answer, and that passes the stored epoch once its
clock does.

Sleeping is entered only from draining, so an instance never sleeps with sessions in flight;
there is no active → sleeping edge. The PC is the authority for every other move. An instance
learns of the PC's changes from PUT state or from the answer to its next status PUT, so its
records lag: a reported state that the PC has since moved the instance away from (or one the
instance could have reached from such a state on its own) is a lag, ignored, and answered with
the PC's state. A record can also be older than one the PC already took (records overtake
each other): a reported state from which the instance reaches the PC's state on its own
(draining, when the PC has sleeping) is such a lag too.

The PC's own orders race with the instance's records: the instance reports as soon as it takes
``PUT state``, before the PC has the answer. So an order is noted in the entry before it is
sent (:func:`order_state`), a record reporting the ordered state, or one the instance reaches
from it on its own, is taken as the order's outcome, and :func:`apply_order` records the order
once answered (keeping a state the instance went on to); :func:`cancel_order` forgets an order
that did not reach the instance. An instance that ends its epoch itself (:func:`end_epoch`, a
graceful shutdown) keeps an entry marked ended: neither listed nor placed on, never declared
failed, and refusing late records of that epoch until a higher one registers it again.

Every transition is a pure function of ``(entry, input, now)`` returning the new entry, so a
shared store (:mod:`kvsp.stores.instances`) can apply it as one atomic step per instance;
:class:`InstanceRegistry` applies them to a table in this process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final, Generic, Literal, Protocol, TypeVar

from kvsp.errors import BadRequest, IllegalTransition, NotFound, StaleEpoch
from kvsp.registries import InstanceState

Actor = Literal["pc", "instance", "expiry", "shutdown"]
"""Who makes a move: the PC (or an operator through it), the instance on its own, the record's
expiry, or the instance leaving (SIGTERM), which may only drain itself so that no new work
reaches it; "instance" moves are also what the PC takes as a record's lag, "shutdown" never."""

DEFAULT_MAX_EPOCH_SKEW_MS: Final = 60_000
"""How far an epoch may be ahead of the receiver's clock (ms): one minute, far above the skew
of clocks kept by NTP, and the longest a forged epoch within the bound can lock an instance
out."""


def check_epoch_bound(epoch: int, now_ms: int, max_skew_ms: int) -> None:
    """Refuse an epoch more than ``max_skew_ms`` ahead of ``now_ms`` (see the module text).

    Raises:
        BadRequest: ``epoch`` is beyond ``now_ms + max_skew_ms``; ``path`` is ``$.epoch``.
    """
    bound = now_ms + max_skew_ms
    if epoch > bound:
        raise BadRequest(
            f"epoch {epoch} is more than {max_skew_ms} ms ahead of the receiver's clock "
            f"(at most {bound} now)",
            path="$.epoch",
        )


def is_poisoned(stored_epoch: int, now_ms: int, max_skew_ms: int) -> bool:
    """Whether a stored epoch lies beyond the bound at ``now_ms``: no record within the bound
    could have set it, so a record within the bound may replace it."""
    return stored_epoch > now_ms + max_skew_ms


TRANSITIONS: Final[Mapping[tuple[InstanceState, InstanceState], frozenset[Actor]]] = {
    (InstanceState.ACTIVE, InstanceState.DRAINING): frozenset({"pc", "shutdown"}),
    (InstanceState.DRAINING, InstanceState.ACTIVE): frozenset({"pc"}),
    (InstanceState.DRAINING, InstanceState.SLEEPING): frozenset({"instance"}),
    (InstanceState.SLEEPING, InstanceState.ACTIVE): frozenset({"pc"}),
    (InstanceState.ACTIVE, InstanceState.FAILED): frozenset({"expiry"}),
    (InstanceState.DRAINING, InstanceState.FAILED): frozenset({"expiry"}),
    (InstanceState.SLEEPING, InstanceState.FAILED): frozenset({"expiry"}),
    (InstanceState.FAILED, InstanceState.ACTIVE): frozenset({"instance"}),
}
"""(from, to) → the actors that may make the move (§6.3)."""


def _allowed(src: InstanceState, dst: InstanceState, by: Actor) -> bool:
    return by in TRANSITIONS.get((src, dst), frozenset())


def check_transition(src: InstanceState, dst: InstanceState, *, by: Actor) -> None:
    """Allow the move ``src → dst`` by ``by`` only if the table has it.

    Raises:
        IllegalTransition: the table has no such move for that actor (409 kvsp-conflict).
    """
    if not _allowed(src, dst, by):
        raise IllegalTransition(f"instance state {src} -> {dst} is not allowed by {by}")


class StatusRecordLike(Protocol):
    """The members of a §4.4 Instance Status Record that the lifecycle reads."""

    @property
    def instance(self) -> str: ...
    @property
    def epoch(self) -> int: ...
    @property
    def state(self) -> str: ...
    @property
    def running(self) -> int: ...
    @property
    def queued(self) -> int: ...
    @property
    def requested_state(self) -> str | None: ...
    @property
    def ttl_ms(self) -> int: ...


R = TypeVar("R", bound=StatusRecordLike)


@dataclass(frozen=True, slots=True, kw_only=True)
class SleepPolicy:
    """When the PC grants a sleep request (§6.3).

    The load of a record is ``running + queued``. A request is granted when every record the PC
    has taken from the current epoch since ``min_low_ms`` ago (and at least one that old) had a
    load below ``threshold_load``.
    """

    threshold_load: float
    min_low_ms: int

    def load(self, record: StatusRecordLike) -> float:
        """The load the threshold applies to: ``running + queued``."""
        return float(record.running + record.queued)

    def is_low(self, record: StatusRecordLike) -> bool:
        """Whether ``record`` shows a load below the threshold."""
        return self.load(record) < self.threshold_load

    def grants(self, low_since_ms: int | None, now_ms: int) -> bool:
        """Whether a load low since ``low_since_ms`` (``None``: not low) allows sleeping now."""
        return low_since_ms is not None and now_ms - low_since_ms >= self.min_low_ms


@dataclass(frozen=True, slots=True, kw_only=True)
class InstanceEntry(Generic[R]):
    """What the PC knows of one instance: its state, latest record and load history.

    ``unapplied_from`` holds the states the PC moved the instance away from since it last
    reported the PC's state; ``low_since_ms`` is when the current run of low-load records began;
    ``ordered`` the states the PC is ordering the instance into (PUT state sent, answer not yet
    in), which a record may report before the order is recorded; ``ended`` marks an epoch the
    instance ended itself (:func:`end_epoch`): the entry is kept only so that a late record of
    that epoch is refused, and is neither listed nor failed.
    """

    instance: str
    epoch: int
    state: InstanceState
    record: R
    received_ms: int
    low_since_ms: int | None
    unapplied_from: frozenset[InstanceState]
    ordered: frozenset[InstanceState] = frozenset()
    ended: bool = False

    def expired(self, now_ms: int) -> bool:
        """Whether the record is ``ttl_ms`` or more old at ``now_ms``."""
        return now_ms - self.received_ms >= self.record.ttl_ms

    def state_at(self, now_ms: int) -> InstanceState:
        """The PC's state at ``now_ms``: failed once the record expired."""
        return InstanceState.FAILED if self.expired(now_ms) else self.state


@dataclass(frozen=True, slots=True, kw_only=True)
class Accepted:
    """The outcome of a status record: the body of the PC's answer is ``{"state": state}``.

    ``registered`` is true when the record started an epoch (first record or a restart);
    ``changed`` when the PC's state for the instance moved; ``ended_epoch`` names the epoch a
    restart ended before :func:`expire_entry` reported it failed (its sessions need the §6.8
    failover, as after an expiry) and ``ended_heard_ms`` when the PC took that epoch's last
    record; ``poisoned_epoch`` the stored epoch beyond the skew bound that the record replaced.
    """

    instance: str
    epoch: int
    state: InstanceState
    registered: bool
    changed: bool
    ended_epoch: int | None = None
    ended_heard_ms: int | None = None
    poisoned_epoch: int | None = None


def _reported(record: StatusRecordLike) -> InstanceState:
    try:
        state = InstanceState(record.state)
    except ValueError:
        raise BadRequest(f"unknown state {record.state!r}", path="$.state") from None
    if state is InstanceState.FAILED:
        raise BadRequest("an instance does not report itself failed", path="$.state")
    if record.requested_state not in (None, InstanceState.SLEEPING):
        raise BadRequest("requested_state may only be sleeping", path="$.requested_state")
    return state


# --- transitions: pure functions of (entry, input, now) -> new entry ----------------------------
#
# A store of entries (kvsp.stores.instances) applies each of them to the entry it holds as one
# atomic step per instance; InstanceRegistry below applies them to a dict.


def accept_status(
    entry: InstanceEntry[R] | None,
    record: R,
    now_ms: int,
    policy: SleepPolicy,
    *,
    max_epoch_skew_ms: int = DEFAULT_MAX_EPOCH_SKEW_MS,
) -> tuple[InstanceEntry[R], Accepted]:
    """Take a status record for the instance whose entry is ``entry`` (``None``: never seen)
    and decide the state the PC answers with; returns the new entry and the outcome.

    A first record, or one with a higher epoch than seen (a restart, which ends the old
    epoch as failed), registers the instance; a first record adopts the reported state, a
    restart must report active. A record replacing a poisoned epoch (beyond
    ``max_epoch_skew_ms`` ahead of ``now_ms``) registers the instance too, ending that epoch,
    and adopts the reported state; so does a record with a higher epoch than one the instance
    ended itself. A ``requested_state`` of sleeping is answered with draining when ``policy``
    grants it, else with the current state.

    Raises:
        StaleEpoch: an epoch lower than the highest seen, the epoch of an instance whose
            record expired (it is failed and must re-register with a higher epoch), or an
            epoch the instance ended.
        IllegalTransition: a reported state the instance may not move to.
        BadRequest: a reported state of failed or an unknown state, or an epoch more than
            ``max_epoch_skew_ms`` ahead of ``now_ms``.
    """
    reported = _reported(record)
    check_epoch_bound(record.epoch, now_ms, max_epoch_skew_ms)
    poisoned = entry is not None and is_poisoned(entry.epoch, now_ms, max_epoch_skew_ms)
    if entry is not None and entry.ended and not poisoned:
        if record.epoch <= entry.epoch:
            raise StaleEpoch(f"{record.instance} ended epoch {entry.epoch}; re-register")
        entry = None  # a new epoch after a graceful end: as a first record
    registered = entry is None or record.epoch > entry.epoch or poisoned
    if entry is not None and poisoned:
        # Nothing known of it is trusted: adopt the reported state, as for a first record.
        state, unapplied = reported, frozenset[InstanceState]()
        ended = None if entry.state is InstanceState.FAILED or entry.ended else entry.epoch
    elif entry is None or record.epoch > entry.epoch:
        state, unapplied, ended = _register(entry, reported)
    elif record.epoch < entry.epoch:
        # MUST discard records with an epoch lower than the highest seen (§6.3).
        raise StaleEpoch(f"epoch {record.epoch} < {entry.epoch} of {record.instance}")
    elif entry.state is InstanceState.FAILED or entry.expired(now_ms):
        # Failed when its record expired (§6.3); the old epoch is rejected (§6.8).
        raise StaleEpoch(f"{record.instance} failed at epoch {entry.epoch}; re-register")
    else:
        state, unapplied = _reconcile(entry, reported)
        ended = None
    low_since = _low_since(policy, None if registered else entry, record, now_ms)
    if (
        record.requested_state is not None
        and state is InstanceState.ACTIVE
        and policy.grants(low_since, now_ms)
    ):
        check_transition(state, InstanceState.DRAINING, by="pc")
        state, unapplied = InstanceState.DRAINING, unapplied | {state}
    new = InstanceEntry(
        instance=record.instance,
        epoch=record.epoch,
        state=state,
        record=record,
        received_ms=now_ms,
        low_since_ms=low_since,
        unapplied_from=unapplied,
        ordered=entry.ordered if entry is not None and not registered else frozenset(),
    )
    accepted = Accepted(
        instance=record.instance,
        epoch=record.epoch,
        state=state,
        registered=registered,
        changed=entry is not None and (registered or entry.state is not state),
        ended_epoch=ended,
        ended_heard_ms=None if ended is None or entry is None else entry.received_ms,
        poisoned_epoch=entry.epoch if entry is not None and poisoned else None,
    )
    return new, accepted


def _register(
    entry: InstanceEntry[R] | None, reported: InstanceState
) -> tuple[InstanceState, frozenset[InstanceState], int | None]:
    if entry is None:
        return reported, frozenset(), None  # nothing known: adopt what it reports
    check_transition(InstanceState.FAILED, reported, by="instance")
    # An epoch that expiry has not yet reported ends here; report it instead.
    ended = None if entry.state is InstanceState.FAILED else entry.epoch
    return reported, frozenset(), ended


def _low_since(
    policy: SleepPolicy, entry: InstanceEntry[R] | None, record: StatusRecordLike, now_ms: int
) -> int | None:
    if not policy.is_low(record):
        return None
    if entry is None or entry.low_since_ms is None:
        return now_ms
    return entry.low_since_ms


def _follows(src: InstanceState, dst: InstanceState) -> bool:
    """Whether the instance reaches ``dst`` from ``src`` on its own (draining → sleeping)."""
    return _allowed(src, dst, "instance")


def _reconcile(
    entry: InstanceEntry[R], reported: InstanceState
) -> tuple[InstanceState, frozenset[InstanceState]]:
    if reported is entry.state:
        return entry.state, frozenset()  # the instance has applied the PC's state
    if any(
        reported is old or _follows(old, reported) or _follows(reported, old)
        for old in entry.unapplied_from
    ) or _follows(reported, entry.state):
        # Lag: it has not seen the PC's change yet, or the record was sent before one that
        # already brought the PC here (records may overtake each other).
        return entry.state, entry.unapplied_from
    if any(reported is dst or _follows(dst, reported) for dst in entry.ordered):
        # The instance applied a state change the PC is ordering and has not recorded yet
        # (its record overtook the answer to PUT state): the order's outcome, not a self-move.
        return reported, frozenset()
    if not _allowed(entry.state, reported, "shutdown"):  # an instance leaving drains itself
        check_transition(entry.state, reported, by="instance")
    return reported, frozenset()


def _live_entry(entry: InstanceEntry[R] | None, instance: str, now_ms: int) -> InstanceEntry[R]:
    if entry is None or entry.ended:
        raise NotFound(f"unknown instance {instance}")
    if entry.state is InstanceState.FAILED or entry.expired(now_ms):
        raise IllegalTransition(f"{instance} is failed: its status record expired")
    return entry


def order_state(
    entry: InstanceEntry[R] | None, instance: str, dst: InstanceState, now_ms: int
) -> InstanceEntry[R]:
    """Note that the PC is about to order ``instance`` into ``dst`` (PUT state, §6.3), before
    it sends the order; :func:`apply_order` records the move once the instance took it,
    :func:`cancel_order` forgets it when it did not. Ordering the current state changes
    nothing.

    Raises:
        NotFound: the instance never reported (or ended its epoch).
        IllegalTransition: it is failed, or the table has no such move for the PC.
    """
    entry = _live_entry(entry, instance, now_ms)
    if dst is entry.state:
        return entry
    check_transition(entry.state, dst, by="pc")
    return dataclasses.replace(entry, ordered=entry.ordered | {dst})


def apply_order(
    entry: InstanceEntry[R] | None, instance: str, dst: InstanceState, now_ms: int
) -> InstanceEntry[R]:
    """Record that ``instance`` took the order into ``dst`` (§6.3 PUT state).

    Setting the current state again changes only the pending orders. When the instance has
    already reported the order's outcome or gone on from it on its own (draining → sleeping),
    its state stays. Moving an instance to active restarts its low-load history, so it must
    stay idle for the full time before it may sleep again.

    Raises:
        NotFound: the instance never reported (or ended its epoch).
        IllegalTransition: it failed meanwhile, or the table has no such move for the PC.
    """
    entry = _live_entry(entry, instance, now_ms)
    ordered = entry.ordered - {dst}
    if dst is entry.state or _follows(dst, entry.state):
        return dataclasses.replace(entry, ordered=ordered)
    check_transition(entry.state, dst, by="pc")
    return dataclasses.replace(
        entry,
        state=dst,
        unapplied_from=entry.unapplied_from | {entry.state},
        low_since_ms=None if dst is InstanceState.ACTIVE else entry.low_since_ms,
        ordered=ordered,
    )


def cancel_order(entry: InstanceEntry[R] | None, dst: InstanceState) -> InstanceEntry[R] | None:
    """Forget an order into ``dst`` that did not reach the instance; ``None`` when there was
    nothing to forget."""
    if entry is None or dst not in entry.ordered:
        return None
    return dataclasses.replace(entry, ordered=entry.ordered - {dst})


def expire_entry(entry: InstanceEntry[R], now_ms: int) -> InstanceEntry[R] | None:
    """The entry marked failed when its record expired by ``now_ms`` (§6.3); ``None`` when it
    is not due (live, already failed, or ended).

    A record received at ``t`` with ``ttl_ms`` is live while ``now_ms < t + ttl_ms``.
    """
    if entry.ended or entry.state is InstanceState.FAILED or not entry.expired(now_ms):
        return None
    check_transition(entry.state, InstanceState.FAILED, by="expiry")
    return dataclasses.replace(
        entry, state=InstanceState.FAILED, unapplied_from=frozenset(), ordered=frozenset()
    )


def end_epoch(entry: InstanceEntry[R] | None, instance: str, epoch: int) -> InstanceEntry[R]:
    """The entry after the instance ended ``epoch`` itself (a graceful shutdown): marked
    ended, so it is neither listed, placed on, nor failed, and a late record of that epoch is
    refused; a record with a higher epoch registers the instance again.

    Raises:
        NotFound: the instance never reported, or already ended its epoch.
        StaleEpoch: ``epoch`` is lower than the epoch the PC holds.
    """
    if entry is None or entry.ended:
        raise NotFound(f"unknown instance {instance}")
    if epoch < entry.epoch:
        raise StaleEpoch(f"epoch {epoch} < {entry.epoch} of {instance}")
    return dataclasses.replace(
        entry, epoch=max(epoch, entry.epoch), ended=True, ordered=frozenset()
    )


# --- a table of entries in this process ---------------------------------------------------------


class InstanceRegistry(Generic[R]):
    """The PC's table of instances in this process, fed status records (§6.3); pure, ``now_ms``
    passed in. Each method applies one of the transition functions above."""

    __slots__ = ("_entries", "_policy")

    def __init__(self, policy: SleepPolicy) -> None:
        """Create an empty registry that grants sleep requests under ``policy``."""
        self._policy = policy
        self._entries: dict[str, InstanceEntry[R]] = {}

    @property
    def policy(self) -> SleepPolicy:
        """The sleep policy status records are judged by."""
        return self._policy

    def accept_status(
        self, record: R, now_ms: int, *, max_epoch_skew_ms: int = DEFAULT_MAX_EPOCH_SKEW_MS
    ) -> Accepted:
        """Take a status record (:func:`accept_status`); a rejected record changes nothing."""
        entry, accepted = accept_status(
            self._entries.get(record.instance),
            record,
            now_ms,
            self._policy,
            max_epoch_skew_ms=max_epoch_skew_ms,
        )
        self._entries[record.instance] = entry
        return accepted

    def set_state(self, instance: str, dst: InstanceState, now_ms: int) -> InstanceState:
        """Change an instance's state on the PC's or an operator's order (§6.3 PUT state): the
        order and its outcome in one step (:func:`order_state`, :func:`apply_order`).

        Raises:
            NotFound: the instance never reported.
            IllegalTransition: the table has no such move for the PC (a failed instance comes
                back only by re-registering).
        """
        entry = order_state(self._entries.get(instance), instance, dst, now_ms)
        entry = apply_order(entry, instance, dst, now_ms)
        self._entries[instance] = entry
        return entry.state

    def expire(self, now_ms: int) -> tuple[str, ...]:
        """Mark as failed every live instance whose record expired; return them, sorted (§6.3)."""
        failed = []
        for name, entry in sorted(self._entries.items()):
            new = expire_entry(entry, now_ms)
            if new is not None:
                self._entries[name] = new
                failed.append(name)
        return tuple(failed)

    def put(self, entry: InstanceEntry[R]) -> None:
        """Keep ``entry`` as the instance's entry (for stores built on this table)."""
        self._entries[entry.instance] = entry

    def drop(self, instance: str) -> None:
        """Forget ``instance`` entirely (for stores built on this table)."""
        self._entries.pop(instance, None)

    def load(self, entries: Iterable[InstanceEntry[R]]) -> None:
        """Replace the table by ``entries`` (a copy of a shared store's table)."""
        self._entries = {entry.instance: entry for entry in entries}

    def stored(self, instance: str) -> InstanceEntry[R] | None:
        """The entry of ``instance`` as kept, an ended epoch included; ``None`` if none."""
        return self._entries.get(instance)

    def get(self, instance: str) -> InstanceEntry[R] | None:
        """The entry of ``instance``, or ``None`` if it never reported (or ended its epoch)."""
        entry = self._entries.get(instance)
        return None if entry is None or entry.ended else entry

    def state_of(self, instance: str, now_ms: int | None = None) -> InstanceState | None:
        """The PC's state of ``instance`` (failed if its record expired by ``now_ms``)."""
        entry = self.get(instance)
        if entry is None:
            return None
        return entry.state if now_ms is None else entry.state_at(now_ms)

    def active_instances(self, now_ms: int) -> tuple[R, ...]:
        """The latest records of the instances that are active and unexpired, by URI (§6.3).

        Only these may be given requests or prefetch directives.
        """
        return tuple(
            entry.record
            for entry in self.entries()
            if entry.state is InstanceState.ACTIVE and not entry.expired(now_ms)
        )

    def entries(self) -> tuple[InstanceEntry[R], ...]:
        """Every known instance, sorted by URI (for listing); ended epochs left out."""
        return tuple(entry for _, entry in sorted(self._entries.items()) if not entry.ended)

    def all_entries(self) -> tuple[InstanceEntry[R], ...]:
        """Every entry, ended epochs included, sorted by URI."""
        return tuple(entry for _, entry in sorted(self._entries.items()))
