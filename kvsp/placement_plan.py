"""The Placement Controller's pure decisions (spec §6.4 service times for ``wait_us``, §6.5
directive contents): values in, values out, no clock and no I/O, so that
:class:`~kvsp.services.pc.service.PlacementController` stays a thin driver around them.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from kvsp.fields import Fields
from kvsp.placement import (
    AssumedLink,
    ServiceTimeEstimator,
    SourceLink,
    SourceView,
    relay_source,
    same_uri,
)
from kvsp.records import (
    DirectiveBlock,
    InstanceStatusRecord,
    PlaceRequest,
    PrefetchDirective,
    ReplicaRecord,
)

MAX_WINDOW_MS = 60_000
"""A busy window without a measurable completion is restarted after this long."""
MAX_DIRECTIVE_MS = 3_600_000
"""Bound on ``deadline_ms``/``lease_ms`` a place request may ask for."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DirectiveOptions:
    """Directive timing for one request: the extension members ``deadline_ms`` and
    ``lease_ms`` of a place body (ignored by peers that do not know them, §4.4)."""

    deadline_ms: int | None = None
    lease_ms: int | None = None

    @classmethod
    def from_json(cls, obj: object) -> DirectiveOptions:
        """Read the optional members of a place body.

        Raises:
            RecordError: a member that is not an integer in range.
        """
        f = Fields(obj)
        return cls(
            deadline_ms=f.integer("deadline_ms", maximum=MAX_DIRECTIVE_MS, optional=True),
            lease_ms=f.integer("lease_ms", minimum=1, maximum=MAX_DIRECTIVE_MS, optional=True),
        )


class _Fallbacks:
    """``chosen``, then a block's other holders the instance may use (:class:`SourceView`:
    best locality first, then fastest, then lowest RTT), then the instance's relay; memoized
    per holder set, since runs of blocks share their holders."""

    __slots__ = ("_memo", "_relay", "_view")

    def __init__(self, status: InstanceStatusRecord, assumed: AssumedLink | None) -> None:
        self._view = SourceView(status, assumed)
        self._relay = relay_source(status)
        self._memo: dict[tuple[str, tuple[str, ...]], tuple[str, ...]] = {}

    def __call__(self, chosen: str, replicas: Sequence[ReplicaRecord]) -> tuple[str, ...]:
        memo_key = (chosen, tuple(r.holder for r in replicas))
        found = self._memo.get(memo_key)
        if found is None:
            links: dict[str, SourceLink] = {}
            for r in replicas:
                if r.holder != chosen and r.holder not in links:
                    link = self._view.link(r.holder, r.site, r.zone)
                    if link is not None:
                        links[r.holder] = link
            ranked = sorted(
                links.values(), key=lambda k: (k.rank, -k.mbit_per_s, k.rtt_us, k.holder)
            )
            found = (chosen, *(link.holder for link in ranked))
            if self._relay is not None and not any(same_uri(h, self._relay) for h in found):
                found = (*found, self._relay)
            self._memo[memo_key] = found
        return found


def build_directive(
    *,
    directive_id: uuid.UUID,
    request: PlaceRequest,
    replicas: Sequence[Sequence[ReplicaRecord]],
    sources: Sequence[str | None],
    status: InstanceStatusRecord,
    deadline_ms: int,
    lease_ms: int,
    assumed: AssumedLink | None = None,
) -> PrefetchDirective | None:
    """The directive that loads the usable prefix planned by §6.4 (``sources`` per block,
    ``None`` for a block already resident), or ``None`` when nothing needs loading.

    Each block lists its chosen source first and then, as fallbacks for a holder that evicted
    it or cannot be reached (§6.1 "treat a 404 as a miss and continue with the next
    replica"), its other holders the instance may use (measured links, and ``assumed`` ones to
    holders in its site; :class:`~kvsp.placement.SourceView`), nearest and fastest first, and
    last the instance's own relay, which fetches a block it does not hold from the publisher
    of its scope. Blocks keep prefix order.
    """
    fallbacks = _Fallbacks(status, assumed)
    blocks = tuple(
        DirectiveBlock(block_key=request.block_keys[i], sources=fallbacks(chosen, replicas[i]))
        for i, chosen in enumerate(sources)
        if chosen is not None
    )
    if not blocks:
        return None
    return PrefetchDirective(
        directive=directive_id,
        request_ref=request.request_ref,
        scope_id=request.scope_id,
        compat_id=request.compat_id,
        blocks=blocks,
        deadline_ms=deadline_ms,
        lease_ms=lease_ms,
    )


def startup_directive(
    *,
    directive_id: uuid.UUID,
    request: PlaceRequest,
    replicas: Sequence[Sequence[ReplicaRecord]],
    deadline_ms: int,
    lease_ms: int,
) -> PrefetchDirective | None:
    """The directive for an instance being started (§6.4 last paragraph): every matched block
    with all its holders as sources, sorted; the PC knows none of its links yet."""
    if not replicas:
        return None
    return PrefetchDirective(
        directive=directive_id,
        request_ref=request.request_ref,
        scope_id=request.scope_id,
        compat_id=request.compat_id,
        blocks=tuple(
            DirectiveBlock(block_key=key, sources=tuple(sorted({r.holder for r in found})))
            for key, found in zip(request.block_keys, replicas, strict=False)
        ),
        deadline_ms=deadline_ms,
        lease_ms=lease_ms,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class _Window:
    epoch: int
    start_ms: int
    placed: int
    in_system: int


class ObservedServiceTimes(ServiceTimeEstimator):
    """Mean service time per instance for ``wait_us`` (§6.4), measured from status records.

    A queued request waits until the requests ahead of it complete, so the service time that
    multiplies ``queued`` is the time per completion while the instance is busy (for a
    continuously batching engine, the inverse of its throughput, not one request's latency). It
    is measured over windows in which the instance reports a queue at both ends:

        completions = placements by this PC in the window - (in_system_end - in_system_start)

    where ``in_system = running + queued``, and one window with ``c >= 1`` completions over
    ``t`` ms gives the sample ``1000 * t / c`` µs, fed to the EWMA of
    :class:`~kvsp.placement.ServiceTimeEstimator`. Requests the PC placed but that have not yet
    reached the instance shift completions between windows; the windows telescope, so the error
    does not accumulate. An instance never measured uses the mean of those measured, else the
    prior. A new epoch forgets the instance (it may be another machine).
    """

    __slots__ = ("_fleet", "_known", "_placed", "_windows")

    def __init__(self, *, prior_us: float, alpha: float = 0.2) -> None:
        """Raises: BadRequest: a negative prior or ``alpha`` outside (0, 1]."""
        super().__init__(prior_us=prior_us, alpha=alpha)
        self._known: set[str] = set()
        self._fleet: float | None = None
        self._placed: dict[str, int] = {}
        self._windows: dict[str, _Window] = {}

    def observe(self, instance: str, service_us: float) -> None:
        """Feed one sample (see :meth:`ServiceTimeEstimator.observe`)."""
        super().observe(instance, service_us)
        self._known.add(instance)
        self._fleet = None

    def mean_us(self, instance: str) -> float:
        """The instance's mean, else the mean over measured instances, else the prior."""
        if instance in self._known:
            return super().mean_us(instance)
        if self._fleet is None:
            means = [super(ObservedServiceTimes, self).mean_us(i) for i in self._known]
            self._fleet = sum(means) / len(means) if means else super().mean_us(instance)
        return self._fleet

    def measured(self, instance: str) -> bool:
        """Whether ``instance`` has a measured mean of its own."""
        return instance in self._known

    def forget(self, instance: str) -> None:
        """Drop the instance's mean and open window."""
        super().forget(instance)
        if instance in self._known:
            self._known.discard(instance)
            self._fleet = None
        self._windows.pop(instance, None)
        self._placed.pop(instance, None)

    def placed(self, instance: str) -> None:
        """Count one request this PC placed on ``instance``."""
        self._placed[instance] = self._placed.get(instance, 0) + 1

    def on_status(self, record: InstanceStatusRecord, now_ms: int) -> float | None:
        """Take an accepted status record; returns the sample it completed, if any."""
        name = record.instance
        here = _Window(
            epoch=record.epoch,
            start_ms=now_ms,
            placed=self._placed.get(name, 0),
            in_system=record.running + record.queued,
        )
        window = self._windows.get(name)
        if record.queued <= 0:
            self._windows.pop(name, None)  # not busy: its throughput says nothing of capacity
            return None
        elapsed = now_ms - window.start_ms if window is not None else 0
        if window is None or window.epoch != record.epoch or elapsed > MAX_WINDOW_MS:
            self._windows[name] = here
            return None
        completions = (here.placed - window.placed) - (here.in_system - window.in_system)
        if completions < 1 or elapsed <= 0:
            return None  # keep the window open until something completes
        sample = 1000.0 * elapsed / completions
        self.observe(name, sample)
        self._windows[name] = here
        return sample
