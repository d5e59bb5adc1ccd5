"""Resharding, sans-I/O (spec §6.9): token ranges, the PC's plans, and the instance's check of
a plan and its pending state.

Both sides of a version change share this module. The PC computes, from versions v and v+1 of
a shard map, each instance's :class:`~kvsp.records_shard.ReshardPlan` (:func:`plan_reshard`);
an instance checks a plan against the ranges it holds (:func:`check_plan`) and walks its
pending plan through :data:`PENDING_TRANSITIONS`. The shells that move the data and send the
messages are :mod:`kvsp.services.pc.reshard` and :mod:`kvsp.services.instance.reshard`.

Ranges are half-open ``(start, end)`` token pairs.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Self

from kvsp.errors import BadRequest, Conflict, IllegalTransition, RecordError
from kvsp.fields import Fields
from kvsp.records_common import TokenRange
from kvsp.records_shard import ReshardFetch, ReshardPlan, Shard, ShardMap

MAX_DEADLINE_MS = 600_000
"""Longest ``deadline_ms`` a version change may ask for."""


# --- ranges and plans -----------------------------------------------------------------------------


# Each instance's ranges in a map are sorted and disjoint (the map is contiguous), so the set
# operations below are two-pointer merges: a plan costs O(shards log shards), not shards².


def _merge(ranges: Sequence[TokenRange]) -> list[TokenRange]:
    merged: list[TokenRange] = []
    for a, b in ranges:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _intersect(xs: Sequence[TokenRange], ys: Sequence[TokenRange]) -> list[TokenRange]:
    found: list[TokenRange] = []
    i = j = 0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if lo < hi:
            found.append((lo, hi))
        if xs[i][1] <= ys[j][1]:
            i += 1
        else:
            j += 1
    return _merge(found)


def _subtract(xs: Sequence[TokenRange], ys: Sequence[TokenRange]) -> list[TokenRange]:
    left: list[TokenRange] = []
    j = 0
    for a, b in xs:
        at = a
        while j < len(ys) and ys[j][1] <= at:
            j += 1
        k = j
        while k < len(ys) and ys[k][0] < b:
            if ys[k][0] > at:
                left.append((at, ys[k][0]))
            at = max(at, ys[k][1])
            k += 1
        if at < b:
            left.append((at, b))
    return _merge(left)


def _covered(ranges: Iterable[TokenRange], a: int, b: int) -> bool:
    """Whether ``ranges`` (in any order, overlapping or not) cover every token of ``[a, b)``."""
    at = a
    for start, end in sorted(ranges):
        if start > at:
            break
        at = max(at, end)
    return at >= b


def _ranges_by_instance(shard_map: ShardMap) -> dict[str, list[TokenRange]]:
    """Each instance's ranges, in token order; instances in order of first appearance."""
    found: dict[str, list[TokenRange]] = {}
    for shard in shard_map.shards:
        found.setdefault(shard.instance, []).append(shard.tokens)
    return found


def members(*maps: ShardMap) -> list[str]:
    """The instances of the maps, each once, in order of first appearance."""
    seen: dict[str, None] = {}
    for shard_map in maps:
        for shard in shard_map.shards:
            seen.setdefault(shard.instance, None)
    return list(seen)


def _sources(
    current: ShardMap, starts: Sequence[int], ranges: Sequence[TokenRange]
) -> list[ReshardFetch]:
    fetch = []
    for a, b in ranges:
        at = bisect.bisect_right(starts, a) - 1
        while at < len(current.shards) and current.shards[at].tokens[0] < b:
            shard = current.shards[at]
            lo, hi = max(a, shard.tokens[0]), min(b, shard.tokens[1])
            if lo < hi:  # split at version v's shard boundaries, each from its owner
                fetch.append(ReshardFetch(tokens=(lo, hi), source=shard.instance))
            at += 1
    return fetch


def span(shard_map: ShardMap) -> TokenRange:
    """The tokens a map covers: from its first shard's start to its last one's end."""
    return shard_map.shards[0].tokens[0], shard_map.shards[-1].tokens[1]


def plan_reshard(current: ShardMap, proposed: ShardMap, deadline_ms: int) -> dict[str, ReshardPlan]:
    """The §6.9 plan of every instance in either version, moving ``current`` (v) to
    ``proposed`` (v+1).

    Raises:
        BadRequest: ``proposed`` is not version v+1 of the same map, or covers other tokens.
    """
    if proposed.map != current.map or proposed.version != current.version + 1:
        raise BadRequest(f"expected version {current.version + 1} of map {current.map!r}")
    if span(proposed) != span(current):
        a, b = span(current)
        raise BadRequest(
            f"version {proposed.version} must cover tokens [{a}, {b}) "
            f"as version {current.version} does",
            path="$.shards",
        )
    before, after = _ranges_by_instance(current), _ranges_by_instance(proposed)
    starts = [shard.tokens[0] for shard in current.shards]
    plans = {}
    for instance in members(current, proposed):
        old, new = before.get(instance, []), after.get(instance, [])
        plans[instance] = ReshardPlan(
            map=current.map,
            from_version=current.version,
            to_version=proposed.version,
            deadline_ms=deadline_ms,
            # §6.9: a range on the same instance in both versions MUST be retained.
            retain=tuple(_intersect(old, new)),
            fetch=tuple(_sources(current, starts, _subtract(new, old))),
            release=tuple(_subtract(old, new)),
        )
    return plans


# --- the PC's requests ----------------------------------------------------------------------------


def _check_bases(shards: Sequence[Shard], path: str) -> None:
    for i, shard in enumerate(shards):
        if not shard.instance.endswith("/"):
            raise RecordError("an instance base URL ends in '/'", path=f"{path}[{i}].instance")


def read_new_map(obj: object, *, default_name: str) -> ShardMap:
    """Read a ``POST shardmaps`` body; without ``map`` the map is named ``default_name`` (the PC
    passes a fresh random name).

    Raises:
        RecordError: a bad member, a version other than 1, gaps or overlaps between shards.
    """
    f = Fields(obj)
    f.integer("version", minimum=1, maximum=1, optional=True)
    name = f.raw("map", optional=True)
    body = {**f.obj, "map": default_name if name is None else name, "version": 1}
    shard_map = ShardMap.from_json(body)
    _check_bases(shard_map.shards, "$.shards")
    return shard_map


@dataclass(frozen=True, slots=True, kw_only=True)
class VersionRequest:
    """The body of ``POST shardmaps/{map}/versions``: ``{"from": v, "shards": [...],
    "deadline_ms"?}``."""

    from_version: int
    shards: tuple[Shard, ...]
    deadline_ms: int | None

    @classmethod
    def from_json(cls, obj: object, map_name: str) -> Self:
        """Read a version request.

        Raises:
            RecordError: a bad member, gaps or overlaps between shards.
        """
        f = Fields(obj)
        version = f.integer("from", minimum=1, maximum=2**53)
        deadline = f.integer("deadline_ms", minimum=1, maximum=MAX_DEADLINE_MS, optional=True)
        proposed = ShardMap.from_json(
            {"map": map_name, "version": version + 1, "shards": f.raw("shards")}
        )
        _check_bases(proposed.shards, "$.shards")
        return cls(from_version=version, shards=proposed.shards, deadline_ms=deadline)


# --- the instance's side --------------------------------------------------------------------------


def check_plan(plan: ReshardPlan, version: int | None, held: Sequence[TokenRange]) -> None:
    """Check a plan against what an instance holds of its map before anything moves: ``version``
    and the ranges ``held`` of it (none: the instance joins the map with an empty ``retain`` and
    ``release``).

    Raises:
        Conflict: the instance is not at version ``from``, does not hold a ``retain`` or
            ``release`` range, or holds a range the plan neither retains nor releases (the PC's
            view differs).
    """
    if not held:
        if plan.retain or plan.release:
            raise Conflict(f"holds no range of map {plan.map!r} to retain or release")
        return
    if version != plan.from_version:
        # §6.9: a plan moves v to v+1; this instance is not at v.
        raise Conflict(
            f"holds version {version} of map {plan.map!r}, plan is from {plan.from_version}"
        )
    for a, b in (*plan.retain, *plan.release):
        if not _covered(held, a, b):
            raise Conflict(f"does not hold [{a}, {b}) of map {plan.map!r}")
    listed = (*plan.retain, *plan.release)
    for a, b in held:
        if not _covered(listed, a, b):
            raise Conflict(f"holds [{a}, {b}) of map {plan.map!r}, neither retained nor released")


class PendingState(enum.Enum):
    """Where a pending plan is (§6.9): loading its ``fetch`` ranges, loaded (acknowledged), or
    failed. Commit and abort end it; they are not states of their own."""

    FETCHING = "fetching"
    READY = "ready"
    FAILED = "failed"


PENDING_TRANSITIONS: Mapping[PendingState, frozenset[PendingState]] = {
    PendingState.FETCHING: frozenset({PendingState.READY, PendingState.FAILED}),
    PendingState.READY: frozenset(),
    PendingState.FAILED: frozenset({PendingState.FETCHING}),  # the same plan, retried
}


def move_pending(state: PendingState, to: PendingState) -> PendingState:
    """``to``, when a pending plan may move there from ``state``.

    Raises:
        IllegalTransition: the table forbids it.
    """
    if to not in PENDING_TRANSITIONS[state]:
        raise IllegalTransition(f"pending plan: {state.value} -> {to.value}")
    return to


__all__ = [
    "MAX_DEADLINE_MS",
    "PENDING_TRANSITIONS",
    "PendingState",
    "VersionRequest",
    "check_plan",
    "members",
    "move_pending",
    "plan_reshard",
    "read_new_map",
    "span",
]
