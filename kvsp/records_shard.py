"""Shard maps and the reshard messages (spec §6.9).

Token ranges are half-open ``[start, end)`` of uint32 positions, written as two-element arrays.
A Shard Map's ranges are non-empty and contiguous: each starts where the previous one ended,
which also makes them sorted and non-overlapping. A reshard plan's ``retain``, ``fetch`` and
``release`` ranges are pairwise disjoint: a range an instance keeps is never also fetched or
released.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Self

from kvsp.errors import RecordError
from kvsp.fields import UINT64_MAX, Fields
from kvsp.records_common import (
    HTTP_SCHEMES,
    TokenRange,
    as_list,
    check_disjoint,
    read_name,
    read_pair,
    read_uri,
)

MAX_SHARDS = 65_536


def _read_tokens(value: object, path: str) -> TokenRange:
    return read_pair(value, path, half_open=True)


def _read_ranges(f: Fields, key: str) -> tuple[TokenRange, ...]:
    items = as_list(f.raw(key), f.at(key))
    if len(items) > MAX_SHARDS:
        raise RecordError(f"at most {MAX_SHARDS} ranges allowed", path=f.at(key))
    return tuple(_read_tokens(v, f"{f.at(key)}[{i}]") for i, v in enumerate(items))


def _ranges_json(ranges: tuple[TokenRange, ...]) -> list[list[int]]:
    return [[a, b] for a, b in ranges]


@dataclass(frozen=True, slots=True, kw_only=True)
class Shard:
    """One shard of a map (§6.9): ``{"tokens": [start, end], "instance"}``."""

    tokens: TokenRange
    instance: str

    @classmethod
    def from_json(cls, obj: object, path: str = "$") -> Self:
        """Read a shard.

        Raises:
            RecordError: an empty or malformed range, or a bad instance URI.
        """
        f = Fields(obj, path)
        return cls(
            tokens=_read_tokens(f.raw("tokens"), f.at("tokens")),
            instance=read_uri(f.raw("instance"), f.at("instance"), HTTP_SCHEMES),
        )

    def to_json(self) -> dict[str, Any]:
        """Render as JSON."""
        return {"tokens": list(self.tokens), "instance": self.instance}


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardMap:
    """A Shard Map (§6.9): ``{"map", "version", "shards": [...]}``.

    ``map`` is an opaque name used in resource paths (URL-unreserved characters); ``shards`` is
    non-empty and contiguous. The first range need not start at 0.
    """

    map: str
    version: int
    shards: tuple[Shard, ...]

    @classmethod
    def from_json(cls, obj: object, path: str = "$") -> Self:
        """Read a shard map.

        Raises:
            RecordError: a bad member, no shards, or a range that does not start where the
                previous one ended (gap or overlap).
        """
        f = Fields(obj, path)
        values = f.array("shards")
        if not values or len(values) > MAX_SHARDS:
            raise RecordError(f"expected 1 to {MAX_SHARDS} shards", path=f.at("shards"))
        shards = tuple(Shard.from_json(v, p) for v, p in f.items("shards"))
        for i in range(1, len(shards)):
            # §6.9: ranges are contiguous and non-overlapping.
            start, end = shards[i].tokens[0], shards[i - 1].tokens[1]
            if start != end:
                what = "overlaps" if start < end else "leaves a gap after"
                where = f"{f.at('shards')}[{i}].tokens"
                raise RecordError(f"{what} the previous shard (ends at {end})", path=where)
        return cls(
            map=read_name(f.raw("map"), f.at("map")), version=f.integer("version"), shards=shards
        )

    def to_json(self) -> dict[str, Any]:
        """Render as JSON."""
        return {
            "map": self.map,
            "version": self.version,
            "shards": [s.to_json() for s in self.shards],
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class ReshardFetch:
    """A range to fetch in a reshard plan (§6.9): ``{"tokens": [start, end], "from": uri}``."""

    tokens: TokenRange
    source: str

    @classmethod
    def from_json(cls, obj: object, path: str = "$") -> Self:
        """Read a fetch entry.

        Raises:
            RecordError: an empty or malformed range, or a bad source URI.
        """
        f = Fields(obj, path)
        return cls(
            tokens=_read_tokens(f.raw("tokens"), f.at("tokens")),
            source=read_uri(f.raw("from"), f.at("from"), HTTP_SCHEMES),
        )

    def to_json(self) -> dict[str, Any]:
        """Render as JSON."""
        return {"tokens": list(self.tokens), "from": self.source}


@dataclass(frozen=True, slots=True, kw_only=True)
class ReshardPlan:
    """A reshard plan (§6.9), the body of POST reshard: ``{"map", "from", "to", "deadline_ms",
    "retain": [[a, b], ...], "fetch": [...], "release": [[a, b], ...]}``.

    ``to`` is ``from + 1``; all three lists are required (empty allowed) and their ranges are
    pairwise disjoint.
    """

    map: str
    from_version: int
    to_version: int
    deadline_ms: int
    retain: tuple[TokenRange, ...]
    fetch: tuple[ReshardFetch, ...]
    release: tuple[TokenRange, ...]

    @classmethod
    def from_json(cls, obj: object, path: str = "$") -> Self:
        """Read a plan.

        Raises:
            RecordError: a bad member, ``to`` other than ``from + 1``, or overlapping ranges.
        """
        f = Fields(obj, path)
        version = f.integer("from", maximum=UINT64_MAX - 1)
        if f.integer("to") != version + 1:
            # §6.9: a plan moves a map from version v to v+1.
            raise RecordError(f"must be from + 1 ({version + 1})", path=f.at("to"))
        retain = _read_ranges(f, "retain")
        fetch = tuple(ReshardFetch.from_json(v, p) for v, p in f.items("fetch"))
        release = _read_ranges(f, "release")
        check_disjoint(
            [(a, b, f"{f.at('retain')}[{i}]") for i, (a, b) in enumerate(retain)]
            + [(*x.tokens, f"{f.at('fetch')}[{i}].tokens") for i, x in enumerate(fetch)]
            + [(a, b, f"{f.at('release')}[{i}]") for i, (a, b) in enumerate(release)]
        )
        return cls(
            map=read_name(f.raw("map"), f.at("map")),
            from_version=version,
            to_version=version + 1,
            deadline_ms=f.integer("deadline_ms"),
            retain=retain,
            fetch=fetch,
            release=release,
        )

    def to_json(self) -> dict[str, Any]:
        """Render as JSON."""
        return {
            "map": self.map,
            "from": self.from_version,
            "to": self.to_version,
            "deadline_ms": self.deadline_ms,
            "retain": _ranges_json(self.retain),
            "fetch": [x.to_json() for x in self.fetch],
            "release": _ranges_json(self.release),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class ReshardCommit:
    """Commit of a new map version (§6.9): ``{"map", "commit": v+1}``."""

    map: str
    commit: int

    @classmethod
    def from_json(cls, obj: object, path: str = "$") -> Self:
        """Read a commit.

        Raises:
            RecordError: a bad map name or version.
        """
        f = Fields(obj, path)
        return cls(map=read_name(f.raw("map"), f.at("map")), commit=f.integer("commit", minimum=1))

    def to_json(self) -> dict[str, Any]:
        """Render as JSON."""
        return {"map": self.map, "commit": self.commit}


@dataclass(frozen=True, slots=True, kw_only=True)
class ReshardAbort:
    """Abort of a new map version (§6.9): ``{"map", "abort": v+1}``."""

    map: str
    abort: int

    @classmethod
    def from_json(cls, obj: object, path: str = "$") -> Self:
        """Read an abort.

        Raises:
            RecordError: a bad map name or version.
        """
        f = Fields(obj, path)
        return cls(map=read_name(f.raw("map"), f.at("map")), abort=f.integer("abort", minimum=1))

    def to_json(self) -> dict[str, Any]:
        """Render as JSON."""
        return {"map": self.map, "abort": self.abort}


ReshardMessage = ReshardPlan | ReshardCommit | ReshardAbort


def parse_reshard_message(obj: object, path: str = "$") -> ReshardMessage:
    """Read a POST reshard body: a plan (``to``), a commit (``commit``) or an abort (``abort``).

    Raises:
        RecordError: not an object, not exactly one of ``to``/``commit``/``abort``, or a bad
            message.
    """
    f = Fields(obj, path)
    kinds = [k for k in ("to", "commit", "abort") if f.has(k)]
    if len(kinds) != 1:
        raise RecordError('expected exactly one of "to", "commit", "abort"', path=path)
    if kinds[0] == "to":
        return ReshardPlan.from_json(obj, path)
    if kinds[0] == "commit":
        return ReshardCommit.from_json(obj, path)
    return ReshardAbort.from_json(obj, path)
