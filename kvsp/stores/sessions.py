"""The PC's session state (spec §6.8; DESIGN.md §1: the PC's durable state lives in the store
abstraction, memory or Redis).

:class:`SessionStore` is deliberately narrow and every rule of :mod:`kvsp.sessions` is applied
inside one call, so that a Redis store can run each call as one atomic script: a checkpoint is
checked against the session's epoch and instance and kept (or not) in the same step that reads
them, and a failover's epoch bump is a compare-and-set on the epoch it expects. Racing
failovers (two sweeps, two PC processes) therefore bump a session once; the loser gets
:class:`~kvsp.errors.StaleEpoch`.

Sessions that are done or failed are kept ``retain_ms`` after their last change, so front ends
can still read how they ended; sessions with no change for ``idle_ms`` are dropped whatever
their state (a placement whose generation never started, an abandoned one).
"""

from __future__ import annotations

import uuid
from typing import Protocol, runtime_checkable

from kvsp.errors import Conflict, NotFound
from kvsp.records_session import SessionCheckpoint
from kvsp.sessions import (
    FINAL,
    SessionRecord,
    SessionState,
    accept_checkpoint,
    advance_epoch,
    settle,
)

LIVE = frozenset({SessionState.SERVING, SessionState.RESUMING})


class SessionStore(Protocol):
    """Session records by session id (§6.8); each method is one atomic step."""

    async def create(self, record: SessionRecord) -> None:
        """Add a new session.

        Raises:
            Conflict: a session with that id exists.
        """
        ...

    async def get(self, session: uuid.UUID) -> SessionRecord | None:
        """The session's record, or ``None``."""
        ...

    async def put_checkpoint(self, checkpoint: SessionCheckpoint, now_ms: int) -> SessionRecord:
        """Apply :func:`~kvsp.sessions.accept_checkpoint` and return the record after it.

        Raises:
            NotFound: no such session.
            StaleEpoch, Conflict, Forbidden: as :func:`~kvsp.sessions.accept_checkpoint`.
        """
        ...

    async def advance_epoch(
        self, session: uuid.UUID, expected_epoch: int, instance: str, now_ms: int
    ) -> SessionRecord:
        """Move the session to ``instance`` at the next epoch if it is at ``expected_epoch``
        (compare-and-set); the returned record carries the checkpoint to resume from.

        Raises:
            NotFound: no such session.
            StaleEpoch: the epoch moved on. IllegalTransition: done or failed.
        """
        ...

    async def settle(
        self,
        session: uuid.UUID,
        epoch: int,
        state: SessionState,
        now_ms: int,
        detail: str | None = None,
    ) -> SessionRecord:
        """Set the state if the session is still at ``epoch`` (:func:`~kvsp.sessions.settle`).

        Raises:
            NotFound: no such session. StaleEpoch, IllegalTransition: as ``settle``.
        """
        ...

    async def live_at(self, instance: str) -> list[SessionRecord]:
        """The sessions ``instance`` serves or is being given (serving or resuming)."""
        ...

    async def expire(self, now_ms: int, *, idle_ms: int, retain_ms: int) -> int:
        """Drop finished sessions unchanged for ``retain_ms`` and any unchanged for
        ``idle_ms``; returns how many were dropped."""
        ...


@runtime_checkable
class SessionCensus(Protocol):
    """A store that can list its most recently changed sessions, for operators (``GET
    sessions`` at the PC, ``kvsp status``). Optional: the PC offers the route only over a store
    that has it."""

    async def recent(self, limit: int) -> list[SessionRecord]:
        """At most ``limit`` sessions, the most recently changed first."""
        ...


class MemorySessionStore:
    """A :class:`SessionStore` in this process's memory (single event loop; no method awaits,
    so each runs as one step)."""

    def __init__(self) -> None:
        self._records: dict[uuid.UUID, SessionRecord] = {}
        self._by_instance: dict[str, set[uuid.UUID]] = {}

    def __len__(self) -> int:
        return len(self._records)

    def _found(self, session: uuid.UUID) -> SessionRecord:
        record = self._records.get(session)
        if record is None:
            raise NotFound(f"no session {session}")
        return record

    def _replace(self, record: SessionRecord) -> SessionRecord:
        old = self._records.get(record.session)
        if old is not None and old.instance != record.instance:
            self._unindex(old)
        self._records[record.session] = record
        if record.state in LIVE:
            self._by_instance.setdefault(record.instance, set()).add(record.session)
        else:
            self._unindex(record)
        return record

    def _unindex(self, record: SessionRecord) -> None:
        held = self._by_instance.get(record.instance)
        if held is not None:
            held.discard(record.session)
            if not held:
                del self._by_instance[record.instance]

    async def create(self, record: SessionRecord) -> None:
        """Add a new session.

        Raises:
            Conflict: a session with that id exists.
        """
        if record.session in self._records:
            raise Conflict(f"session {record.session} exists", path="$.session")
        self._replace(record)

    async def get(self, session: uuid.UUID) -> SessionRecord | None:
        """The session's record, or ``None``."""
        return self._records.get(session)

    async def put_checkpoint(self, checkpoint: SessionCheckpoint, now_ms: int) -> SessionRecord:
        """Apply :func:`~kvsp.sessions.accept_checkpoint`.

        Raises:
            NotFound: no such session. StaleEpoch, Conflict, Forbidden: as the rule.
        """
        record = self._found(checkpoint.session)
        return self._replace(accept_checkpoint(record, checkpoint, now_ms))

    async def advance_epoch(
        self, session: uuid.UUID, expected_epoch: int, instance: str, now_ms: int
    ) -> SessionRecord:
        """Compare-and-set the epoch to the next one at ``instance``.

        Raises:
            NotFound: no such session. StaleEpoch, IllegalTransition: as the rule.
        """
        record = self._found(session)
        return self._replace(advance_epoch(record, expected_epoch, instance, now_ms))

    async def settle(
        self,
        session: uuid.UUID,
        epoch: int,
        state: SessionState,
        now_ms: int,
        detail: str | None = None,
    ) -> SessionRecord:
        """Set the state if still at ``epoch``.

        Raises:
            NotFound: no such session. StaleEpoch, IllegalTransition: as the rule.
        """
        record = self._found(session)
        return self._replace(settle(record, epoch, state, now_ms, detail))

    async def live_at(self, instance: str) -> list[SessionRecord]:
        """The serving or resuming sessions of ``instance``, oldest first."""
        ids = self._by_instance.get(instance, set())
        return sorted((self._records[i] for i in ids), key=lambda r: r.created_ms)

    async def recent(self, limit: int) -> list[SessionRecord]:
        """At most ``limit`` sessions, the most recently changed first (:class:`SessionCensus`)."""
        ordered = sorted(self._records.values(), key=lambda r: r.updated_ms, reverse=True)
        return ordered[: max(limit, 0)]

    async def expire(self, now_ms: int, *, idle_ms: int, retain_ms: int) -> int:
        """Drop finished sessions older than ``retain_ms`` and any older than ``idle_ms``."""
        gone = [
            record
            for record in self._records.values()
            if now_ms - record.updated_ms >= (retain_ms if record.state in FINAL else idle_ms)
        ]
        for record in gone:
            self._unindex(record)
            del self._records[record.session]
        return len(gone)
