"""Placement inputs and cost (spec §6.4), as used by lookups with targets (§6.2).

Pure functions of the records a request sees: no clock, no I/O. Units: 1 Mbit/s is one bit per
microsecond, so moving ``b`` octets at ``r`` Mbit/s takes ``8 * b / r`` µs.

The §6.4 formulas, as computed here for an instance ``i``:

* ``fetch_us(i) = max over used sources s of (rtt_us(i,s) + Σ_p 8 * bytes_p / min(link, r_p))``
  where ``link`` is the rate ``i`` reports for ``s`` and the ``p`` are the tier portions of what
  ``i`` loads from ``s``: a residency entry holding layers ``a..b`` with ``read_mbit_per_s = r``
  contributes ``(b - a + 1) * size / layers`` octets capped at ``r``; layers without a read rate,
  layers no entry covers, and whole replicas without ``residency`` move at the link rate. The
  layer count is ``len(layer_digests)``, else the ``layers`` argument, else one past the highest
  residency layer. A block is resident at ``i`` when one of its replicas has ``holder == i``;
  it costs nothing.
* Usable sources (locality): ``i`` may load from a holder it reports a link to (§6.3 ``links``,
  measured), and, at an :class:`AssumedLink` rate when it has measured none, from a holder in
  its own site (the ``site`` extension members of the status and Replica Records agree, or
  neither has one) and from its own edge relay (the status's ``relay``). Of a block's usable
  holders only those of the best locality are used: same zone, then same site, then the rest.
  A block whose holders ``i`` can use none of is loaded through ``i``'s relay when it has one
  (the relay fetches a miss from whoever announced the scope, DESIGN §4), at the rate of
  ``i``'s link to the relay.
* Usable prefix: a matched block that is neither resident nor available from a usable source
  cannot be loaded, and because Block Keys are chained the blocks after it cannot be used
  either; the plan covers the leading run of blocks ``i`` can get and recomputes the rest.
* Source choice: blocks with the same replica offers (same holders with the same octets and
  tier split) form a group; groups are taken in order of their first block, and each block of a
  group goes to the source that would finish it earliest (``rtt`` on first use, then each block
  adds its transfer time); ties go to the lower holder URI. This greedy is computed per group in
  closed form (``O(sources log sources)``), so an instance costs ``O(groups * sources)``, not
  ``O(blocks)``.
* ``recompute_us(i, tokens) = 1e6 * tokens / prefill_tokens_per_s(i)``: zero tokens cost 0 and a
  zero prefill rate costs ``math.inf``.
* ``wait_us(i) = queued(i) * mean service time at i`` from :class:`ServiceTimeEstimator`.
* ``cost(i) = wait_us(i) + min(fetch_us(i) + recompute_us(unmatched), recompute_us(all))``.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from kvsp.errors import BadRequest
from kvsp.registries import InstanceState

Plan = Literal["fetch", "recompute"]


class ResidencyLike(Protocol):
    """The members of a §4.4 residency entry that placement reads."""

    @property
    def first(self) -> int: ...
    @property
    def last(self) -> int: ...
    @property
    def read_mbit_per_s(self) -> float | None: ...


class ReplicaLike(Protocol):
    """The members of a §4.4 Replica Record that placement reads."""

    @property
    def holder(self) -> str: ...
    @property
    def site(self) -> str | None: ...
    @property
    def zone(self) -> str | None: ...
    @property
    def size(self) -> int: ...
    @property
    def layer_digests(self) -> Sequence[bytes] | None: ...
    @property
    def residency(self) -> Sequence[ResidencyLike] | None: ...


class LinkLike(Protocol):
    """A link an instance reports in its status record (§4.4)."""

    @property
    def holder(self) -> str: ...
    @property
    def mbit_per_s(self) -> float: ...
    @property
    def rtt_us(self) -> float: ...


class InstanceStatusLike(Protocol):
    """The members of a §4.4 Instance Status Record that placement reads."""

    @property
    def instance(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def running(self) -> int: ...
    @property
    def queued(self) -> int: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def prefill_tokens_per_s(self) -> float: ...
    @property
    def links(self) -> Sequence[LinkLike]: ...
    @property
    def site(self) -> str | None: ...
    @property
    def zone(self) -> str | None: ...
    @property
    def relay(self) -> str | None: ...


# --- locality ----------------------------------------------------------------------------------

SAME_ZONE = 0
"""Locality rank of a holder in the instance's site and zone."""
SAME_SITE = 1
"""Locality rank of a holder in the instance's site (or, unlabelled, of a holder without one)."""
OTHER_SITE = 2
"""Locality rank of any other holder: usable over a measured link only."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AssumedLink:
    """The link the PC assumes from an instance to a usable source it has not measured.

    Instances report only links they measured, and they measure a link by fetching over it,
    so without an assumption no directive would reach a fresh instance. It applies to holders
    in the instance's own site and to its own relay, never across sites.
    """

    mbit_per_s: float
    rtt_us: float


def locality(status: InstanceStatusLike, site: str | None, zone: str | None) -> int:
    """:data:`SAME_ZONE`, :data:`SAME_SITE` or :data:`OTHER_SITE` for a holder labelled
    ``site``/``zone`` as seen from ``status``'s instance."""
    if status.site is None:
        return SAME_SITE if site is None else OTHER_SITE
    if site != status.site:
        return OTHER_SITE
    return SAME_ZONE if status.zone is not None and zone == status.zone else SAME_SITE


def same_uri(a: str, b: str) -> bool:
    """Whether two base URIs name the same place (a trailing ``/`` aside)."""
    return a.rstrip("/") == b.rstrip("/")


def relay_source(status: InstanceStatusLike) -> str | None:
    """The instance's relay as a directive may name it (a ``moqt://`` URI), else ``None``."""
    relay = status.relay
    if relay is None or relay[:7].lower() != "moqt://":
        return None
    return relay


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceLink:
    """How one instance reaches one source: locality rank, rate, and whether measured."""

    holder: str
    rank: int
    mbit_per_s: float
    rtt_us: float
    measured: bool


class SourceView:
    """The sources one instance may use (see the module docstring), with their links."""

    __slots__ = ("_assumed", "_measured", "_relay", "status")

    def __init__(self, status: InstanceStatusLike, assumed: AssumedLink | None = None) -> None:
        self.status = status
        self._assumed = assumed if assumed is not None and assumed.mbit_per_s > 0 else None
        self._measured: dict[str, LinkLike] = {}
        for reported in status.links:
            if reported.mbit_per_s > 0 and reported.holder not in self._measured:
                self._measured[reported.holder] = reported
        self._relay = relay_source(status)

    def is_relay(self, holder: str) -> bool:
        """Whether ``holder`` is the instance's own relay."""
        return self._relay is not None and same_uri(holder, self._relay)

    def link(self, holder: str, site: str | None, zone: str | None) -> SourceLink | None:
        """The instance's link to ``holder`` (labelled ``site``/``zone``), or ``None`` when it
        may not use it."""
        rank = locality(self.status, site, zone)
        if self.is_relay(holder):
            rank = min(rank, SAME_SITE)  # its own relay is in its site, labelled or not
        measured = self._measured.get(holder)
        if measured is not None:
            return SourceLink(
                holder=holder,
                rank=rank,
                mbit_per_s=measured.mbit_per_s,
                rtt_us=measured.rtt_us,
                measured=True,
            )
        if self._assumed is None or rank > SAME_SITE:
            return None
        return SourceLink(
            holder=holder,
            rank=rank,
            mbit_per_s=self._assumed.mbit_per_s,
            rtt_us=self._assumed.rtt_us,
            measured=False,
        )

    def relay_link(self) -> SourceLink | None:
        """The link to the instance's relay, as a source of blocks it does not hold yet."""
        if self._relay is None:
            return None
        return self.link(self._relay, self.status.site, self.status.zone)


# --- per-request preparation -------------------------------------------------------------------

_Portions = tuple[tuple[float, float], ...]
"""(read cap in Mbit/s, ``math.inf`` for none; octets) per tier portion of one block."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _Offer:
    holder: str
    portions: _Portions
    block_bytes: float


@dataclass(frozen=True, slots=True, kw_only=True)
class _Group:
    indices: tuple[int, ...]
    offers: tuple[_Offer, ...]
    holders: frozenset[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchInputs:
    """The matched blocks of one request, reduced once to groups of interchangeable blocks."""

    matched: int
    groups: tuple[_Group, ...]
    places: Mapping[str, tuple[str | None, str | None]]
    """Each holder's ``(site, zone)``, from its first record."""


def _portions(replica: ReplicaLike, layers: int | None) -> _Portions:
    digests = replica.layer_digests
    count = None if digests is None else len(digests)
    try:
        return _cached_portions(replica.size, replica.residency, count, layers)
    except TypeError:  # an unhashable residency sequence: compute it directly
        return _compute_portions(replica.size, replica.residency, count, layers)


@functools.lru_cache(maxsize=4096)
def _cached_portions(size: int, residency: Any, count: int | None, layers: int | None) -> _Portions:
    # Replicas repeat the same few (size, tier split) shapes; computing each anew is most of a
    # placement.
    return _compute_portions(size, residency, count, layers)


def _compute_portions(
    size_octets: int, residency: Any, count: int | None, layers: int | None
) -> _Portions:
    size = float(size_octets)
    if not residency or all(entry.read_mbit_per_s is None for entry in residency):
        return ((math.inf, size),)  # every layer moves at the link rate
    if count is None:
        count = layers if layers is not None else max(entry.last for entry in residency) + 1
    if count <= 0:
        return ((math.inf, size),)
    by_cap: dict[float, int] = {}
    covered = 0
    for entry in residency:
        n = min(entry.last, count - 1) - max(entry.first, 0) + 1
        if n > 0:
            cap = math.inf if entry.read_mbit_per_s is None else float(entry.read_mbit_per_s)
            by_cap[cap] = by_cap.get(cap, 0) + n
            covered += n
    if covered < count:
        by_cap[math.inf] = by_cap.get(math.inf, 0) + count - covered
    return tuple(sorted((cap, size * n / count) for cap, n in by_cap.items()))


def prepare_fetch(
    replicas_per_key: Sequence[Sequence[ReplicaLike]], *, layers: int | None = None
) -> FetchInputs:
    """Group the matched blocks (prefix order, one replica list per key) by their offers.

    Blocks whose replicas have the same holders with the same octets and tier split are
    interchangeable for §6.4, so later steps work per group. Of several replicas naming one
    holder for a block, the first counts.
    """
    by_signature: dict[tuple[tuple[str, _Portions], ...], list[int]] = {}
    places: dict[str, tuple[str | None, str | None]] = {}
    for index, replicas in enumerate(replicas_per_key):
        offers: dict[str, _Portions] = {}
        for replica in replicas:
            if replica.holder not in offers:
                offers[replica.holder] = _portions(replica, layers)
                if replica.holder not in places:
                    places[replica.holder] = (replica.site, replica.zone)
        by_signature.setdefault(tuple(sorted(offers.items())), []).append(index)
    groups = tuple(
        _Group(
            indices=tuple(indices),
            offers=tuple(
                _Offer(holder=h, portions=p, block_bytes=sum(b for _, b in p)) for h, p in sig
            ),
            holders=frozenset(h for h, _ in sig),
        )
        for sig, indices in by_signature.items()  # insertion order = order of first block
    )
    return FetchInputs(matched=len(replicas_per_key), groups=groups, places=places)


# --- source allocation -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class _Source:
    holder: str
    start_us: float  # rtt if unused so far, else its finish time
    block_us: float  # transfer time of one block of the group
    block_bytes: float


def _transfer_us(portions: _Portions, mbit_per_s: float) -> float:
    total = 0.0
    for cap, octets in portions:
        rate = min(mbit_per_s, cap)
        if rate <= 0:
            return math.inf
        total += 8.0 * octets / rate
    return total


def _count_upto(level: float, start: float, step: float, cap: int) -> int:
    """How many ``j >= 1`` with ``start + j * step <= level`` (at most ``cap``)."""
    if level < start + step:
        return 0
    j = min(int((level - start) / step), cap)
    while j > 0 and start + j * step > level:
        j -= 1
    while j < cap and start + (j + 1) * step <= level:
        j += 1
    return j


def _water_level(k: int, sources: Sequence[_Source]) -> float:
    """The level ``L`` with ``Σ max(0, (L - start) / step) = k`` (fractional allocation)."""
    ordered = sorted(sources, key=lambda s: s.start_us)
    inv = weighted = 0.0
    level = math.inf
    for pos, src in enumerate(ordered):
        inv += 1.0 / src.block_us
        weighted += src.start_us / src.block_us
        level = (k + weighted) / inv
        if pos + 1 == len(ordered) or level <= ordered[pos + 1].start_us:
            break
    return level


def _allocate_by_heap(k: int, sources: Sequence[_Source]) -> list[int]:
    """Reference greedy: each block to the source finishing it earliest, ties by holder."""
    counts = [0] * len(sources)
    heap = [(s.start_us + s.block_us, s.holder, n) for n, s in enumerate(sources)]
    heapq.heapify(heap)
    for _ in range(k):
        _, holder, n = heapq.heappop(heap)
        counts[n] += 1
        src = sources[n]
        heapq.heappush(heap, (src.start_us + (counts[n] + 1) * src.block_us, holder, n))
    return counts


def _allocate(k: int, sources: Sequence[_Source]) -> list[int]:
    """Blocks per source under the greedy of :func:`_allocate_by_heap`, in closed form.

    The greedy takes the ``k`` smallest of the finish times ``start + j * step`` (ordered by
    value, then holder). All finish times at or below the fractional water level form a prefix
    of that order and miss ``k`` by at most the number of sources; the heap tops up the rest.
    """
    if any(s.block_us <= 0 for s in sources):
        return _allocate_by_heap(k, sources)
    level = _water_level(k, sources)
    counts = [_count_upto(level, s.start_us, s.block_us, k) for s in sources]
    total = sum(counts)
    if total < k:
        heap = [
            (s.start_us + (c + 1) * s.block_us, s.holder, n)
            for n, (s, c) in enumerate(zip(sources, counts, strict=True))
        ]
        heapq.heapify(heap)
        while total < k:
            _, holder, n = heapq.heappop(heap)
            counts[n] += 1
            total += 1
            src = sources[n]
            heapq.heappush(heap, (src.start_us + (counts[n] + 1) * src.block_us, holder, n))
    while total > k:  # only when rounding put the level a hair high
        n = max(
            (n for n, c in enumerate(counts) if c),
            key=lambda n: (
                sources[n].start_us + counts[n] * sources[n].block_us,
                sources[n].holder,
            ),
        )
        counts[n] -= 1
        total -= 1
    return counts


def _merge_order(sources: Sequence[_Source], counts: Sequence[int]) -> list[str]:
    """The holder of each block of a group, in the order the greedy hands blocks out."""
    finishes = [
        (s.start_us + j * s.block_us, s.holder)
        for s, c in zip(sources, counts, strict=True)
        for j in range(1, c + 1)
    ]
    finishes.sort()
    return [holder for _, holder in finishes]


# --- fetch plan per instance -------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchPlan:
    """How instance ``instance`` would load the usable prefix of the matched blocks (§6.4).

    ``sources`` (only when asked for) names the chosen holder of each usable block, ``None``
    for a block already resident; ``bytes_per_source`` is sorted by holder.
    """

    instance: str
    usable_blocks: int
    resident_blocks: int
    fetch_us: float
    bytes_per_source: tuple[tuple[str, float], ...]
    sources: tuple[str | None, ...] | None


def _reachable(
    inputs: FetchInputs, status: InstanceStatusLike, assumed: AssumedLink | None
) -> tuple[int, list[list[_Source] | None]]:
    """The usable prefix length and, per group before the first gap, its sources: the usable
    holders of the best locality, else the instance's relay."""
    view = SourceView(status, assumed)
    links = {h: view.link(h, site, zone) for h, (site, zone) in inputs.places.items()}
    relay = view.relay_link()
    per_group: list[list[_Source] | None] = []
    for group in inputs.groups:
        if status.instance in group.holders:
            per_group.append(None)  # resident at i: costs nothing
            continue
        usable: list[tuple[int, _Source]] = []
        for offer in group.offers:
            link = links.get(offer.holder)
            if link is None:
                continue
            block_us = _transfer_us(offer.portions, link.mbit_per_s)
            if block_us < math.inf:
                source = _Source(
                    holder=offer.holder,
                    start_us=link.rtt_us,
                    block_us=block_us,
                    block_bytes=offer.block_bytes,
                )
                usable.append((link.rank, source))
        if usable:
            best = min(rank for rank, _ in usable)
            sources = [source for rank, source in usable if rank == best]
        elif relay is not None and group.offers:
            # None of the holders is usable: the relay fetches the block from its publisher.
            octets = min(offer.block_bytes for offer in group.offers)
            sources = [
                _Source(
                    holder=relay.holder,
                    start_us=relay.rtt_us,
                    block_us=_transfer_us(((math.inf, octets),), relay.mbit_per_s),
                    block_bytes=octets,
                )
            ]
        else:
            # Chained keys: nothing after the first unreachable block is usable (§4.2, §6.2).
            return group.indices[0], per_group
        per_group.append(sources)
    return inputs.matched, per_group


def plan_fetch(
    inputs: FetchInputs,
    status: InstanceStatusLike,
    *,
    with_sources: bool = False,
    assumed: AssumedLink | None = None,
) -> FetchPlan:
    """Plan the loads of instance ``status.instance`` and compute its ``fetch_us`` (§6.4).

    ``with_sources`` also lists the holder chosen for each usable block (``O(blocks)``; ask for
    it only for the instance that gets the request). ``assumed`` is the link assumed to a
    usable source the instance has not measured (``None``: measured links only).
    """
    usable, per_group = _reachable(inputs, status, assumed)
    finish: dict[str, float] = {}
    octets: dict[str, float] = {}
    chosen: list[str | None] = [None] * usable if with_sources else []
    resident = 0
    for group, sources in zip(inputs.groups, per_group, strict=False):
        k = bisect.bisect_left(group.indices, usable)
        if k == 0:
            continue
        if sources is None:
            resident += k
            continue
        current = [
            _Source(
                holder=s.holder,
                start_us=finish.get(s.holder, s.start_us),
                block_us=s.block_us,
                block_bytes=s.block_bytes,
            )
            for s in sources
        ]
        counts = _allocate(k, current)
        for src, count in zip(current, counts, strict=True):
            if count:
                finish[src.holder] = src.start_us + count * src.block_us
                octets[src.holder] = octets.get(src.holder, 0.0) + count * src.block_bytes
        if with_sources:
            for index, holder in zip(group.indices[:k], _merge_order(current, counts), strict=True):
                chosen[index] = holder
    return FetchPlan(
        instance=status.instance,
        usable_blocks=usable,
        resident_blocks=resident,
        fetch_us=max(finish.values(), default=0.0),
        bytes_per_source=tuple(sorted(octets.items())),
        sources=tuple(chosen) if with_sources else None,
    )


# --- recompute, wait, cost ---------------------------------------------------------------------


def recompute_us(tokens: int, prefill_tokens_per_s: float) -> float:
    """``1e6 * tokens / prefill_tokens_per_s`` (§6.4); 0 for no tokens, inf for a zero rate."""
    if tokens <= 0:
        return 0.0
    if prefill_tokens_per_s <= 0:
        return math.inf
    return 1e6 * tokens / prefill_tokens_per_s


class ServiceTimeEstimator:
    """Mean service time per instance for ``wait_us`` (§6.4): an EWMA of observed times.

    Before an instance's first observation its mean is ``prior_us``; the first observation
    replaces the prior, each later one moves the mean by ``alpha`` of the difference.
    """

    __slots__ = ("_alpha", "_means", "_prior_us")

    def __init__(self, *, prior_us: float, alpha: float = 0.2) -> None:
        """Raises: BadRequest: a negative prior or ``alpha`` outside (0, 1]."""
        if not prior_us >= 0 or not 0 < alpha <= 1:
            raise BadRequest(f"bad estimator settings: prior_us={prior_us}, alpha={alpha}")
        self._prior_us = float(prior_us)
        self._alpha = float(alpha)
        self._means: dict[str, float] = {}

    def observe(self, instance: str, service_us: float) -> None:
        """Feed one completed request's service time at ``instance``.

        Raises:
            BadRequest: a negative or non-finite time.
        """
        if not 0 <= service_us < math.inf:
            raise BadRequest(f"service time must be finite and >= 0, got {service_us}")
        mean = self._means.get(instance)
        self._means[instance] = (
            float(service_us) if mean is None else mean + self._alpha * (service_us - mean)
        )

    def mean_us(self, instance: str) -> float:
        """The current mean service time at ``instance`` (the prior before any observation)."""
        return self._means.get(instance, self._prior_us)

    def wait_us(self, instance: str, queued: int) -> float:
        """``queued * mean service time`` (§6.4)."""
        return max(queued, 0) * self.mean_us(instance)

    def forget(self, instance: str) -> None:
        """Drop what was observed at ``instance`` (for a new epoch: it may be a new machine)."""
        self._means.pop(instance, None)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacementEstimate:
    """The §6.4 estimates and cost of one candidate instance.

    ``plan`` is ``"fetch"`` when loading the usable prefix and recomputing the rest is strictly
    cheaper than recomputing everything, else ``"recompute"``.
    """

    instance: str
    wait_us: float
    fetch_us: float
    recompute_unmatched_us: float
    recompute_all_us: float
    usable_blocks: int
    resident_blocks: int
    bytes_per_source: tuple[tuple[str, float], ...]
    sources: tuple[str | None, ...] | None
    plan: Plan
    cost_us: float


def _check_request(inputs: FetchInputs, block_tokens: int, prompt_tokens: int) -> None:
    if block_tokens <= 0:
        raise BadRequest(f"block_tokens must be positive, got {block_tokens}")
    if prompt_tokens < inputs.matched * block_tokens:
        raise BadRequest(
            f"prompt_tokens {prompt_tokens} < {inputs.matched} matched blocks of {block_tokens}"
        )


def estimate_instance(
    inputs: FetchInputs,
    status: InstanceStatusLike,
    *,
    block_tokens: int,
    prompt_tokens: int,
    service_times: ServiceTimeEstimator,
    with_sources: bool = False,
    assumed: AssumedLink | None = None,
) -> PlacementEstimate:
    """``cost(i)`` and its parts for one instance (§6.4); ``assumed`` as for :func:`plan_fetch`.

    Raises:
        BadRequest: ``block_tokens <= 0`` or a prompt shorter than the matched blocks.
    """
    _check_request(inputs, block_tokens, prompt_tokens)
    fetch = plan_fetch(inputs, status, with_sources=with_sources, assumed=assumed)
    rate = status.prefill_tokens_per_s
    unmatched = recompute_us(prompt_tokens - fetch.usable_blocks * block_tokens, rate)
    everything = recompute_us(prompt_tokens, rate)
    wait = service_times.wait_us(status.instance, status.queued)
    via_fetch = fetch.fetch_us + unmatched
    plan: Plan = "fetch" if fetch.usable_blocks and via_fetch < everything else "recompute"
    return PlacementEstimate(
        instance=status.instance,
        wait_us=wait,
        fetch_us=fetch.fetch_us,
        recompute_unmatched_us=unmatched,
        recompute_all_us=everything,
        usable_blocks=fetch.usable_blocks,
        resident_blocks=fetch.resident_blocks,
        bytes_per_source=fetch.bytes_per_source,
        sources=fetch.sources,
        plan=plan,
        cost_us=wait + min(via_fetch, everything),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class LookupEstimate:
    """What a lookup with ``targets`` reports for one target (§6.2).

    ``recompute_us`` prefills the matched tokens; ``fetch_us`` makes the matched blocks
    resident: ``load_us`` (the §6.4 fetch time of the usable prefix) plus recomputing the
    matched blocks after it, so the two compare like for like. Either may be ``math.inf``.
    """

    instance: str
    fetch_us: float
    recompute_us: float
    load_us: float
    usable_blocks: int


def estimate_targets(
    replicas_per_key: Sequence[Sequence[ReplicaLike]],
    statuses: Iterable[InstanceStatusLike],
    *,
    block_tokens: int,
    layers: int | None = None,
) -> dict[str, LookupEstimate]:
    """Per-target ``fetch_us`` and ``recompute_us`` for a lookup answer (§6.2, §6.4).

    ``statuses`` are the records of the targets the IS has status for; others get no estimate.

    Raises:
        BadRequest: ``block_tokens <= 0``.
    """
    inputs = prepare_fetch(replicas_per_key, layers=layers)
    _check_request(inputs, block_tokens, inputs.matched * block_tokens)
    out: dict[str, LookupEstimate] = {}
    for status in statuses:
        fetch = plan_fetch(inputs, status)
        rate = status.prefill_tokens_per_s
        rest = recompute_us((inputs.matched - fetch.usable_blocks) * block_tokens, rate)
        out[status.instance] = LookupEstimate(
            instance=status.instance,
            fetch_us=fetch.fetch_us + rest,
            recompute_us=recompute_us(inputs.matched * block_tokens, rate),
            load_us=fetch.fetch_us,
            usable_blocks=fetch.usable_blocks,
        )
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacementDecision:
    """The instance chosen for a request, its estimate (with per-block sources), and how many
    active candidates with capacity were compared."""

    instance: str
    estimate: PlacementEstimate
    considered: int


def has_capacity(status: InstanceStatusLike, queue_limit: int | None) -> bool:
    """``running + queued < batch_size + queue_limit``; always true without a limit."""
    if queue_limit is None:
        return True
    return status.running + status.queued < status.batch_size + queue_limit


def choose_instance(
    candidates: Sequence[InstanceStatusLike],
    replicas_per_key: Sequence[Sequence[ReplicaLike]],
    *,
    block_tokens: int,
    prompt_tokens: int,
    service_times: ServiceTimeEstimator,
    layers: int | None = None,
    max_cost_us: float = math.inf,
    queue_limit: int | None = None,
    assumed: AssumedLink | None = None,
) -> PlacementDecision | None:
    """The active candidate with the lowest cost (§6.4), or ``None`` when there is none.

    Each candidate loads from the sources it may use (module docstring: measured links, and
    ``assumed`` to unmeasured holders in its site and to its relay).

    Only candidates whose ``state`` is active are considered (§6.3 MUST NOT). A candidate is
    acceptable when its cost is finite and at most ``max_cost_us`` and it has capacity
    (:func:`has_capacity`). Ties go to the lower ``wait_us``, then to the less busy instance
    (``running / batch_size``: §6.4's wait counts only the queued requests, so between equal
    costs an idle instance is the better guess), then to the lower instance URI.
    ``None`` tells the caller that it may start an instance (§6.4).

    Raises:
        BadRequest: ``block_tokens <= 0`` or a prompt shorter than the matched blocks.
    """
    inputs = prepare_fetch(replicas_per_key, layers=layers)
    _check_request(inputs, block_tokens, prompt_tokens)
    best: PlacementEstimate | None = None
    best_status: InstanceStatusLike | None = None
    best_rank: tuple[float, float, float, str] = (math.inf, math.inf, math.inf, "")
    considered = 0
    for status in candidates:
        # MUST NOT assign new requests to an instance that is not active (§6.3).
        if status.state != InstanceState.ACTIVE or not has_capacity(status, queue_limit):
            continue
        considered += 1
        est = estimate_instance(
            inputs,
            status,
            block_tokens=block_tokens,
            prompt_tokens=prompt_tokens,
            service_times=service_times,
            assumed=assumed,
        )
        if not est.cost_us <= max_cost_us or est.cost_us == math.inf:
            continue
        rank = _rank(est, status)
        if best is None or rank < best_rank:
            best, best_status, best_rank = est, status, rank
    if best is None or best_status is None:
        return None
    detailed = estimate_instance(
        inputs,
        best_status,
        block_tokens=block_tokens,
        prompt_tokens=prompt_tokens,
        service_times=service_times,
        with_sources=True,
        assumed=assumed,
    )
    return PlacementDecision(instance=detailed.instance, estimate=detailed, considered=considered)


def _rank(est: PlacementEstimate, status: InstanceStatusLike) -> tuple[float, float, float, str]:
    busy = status.running / status.batch_size if status.batch_size > 0 else math.inf
    return (est.cost_us, est.wait_us, busy, est.instance)
