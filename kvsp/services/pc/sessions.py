"""Sessions at the Placement Controller (spec §6.8; DESIGN.md §3 ``sessions/…`` resources).

:class:`SessionService` keeps the session records in a
:class:`~kvsp.stores.sessions.SessionStore`, takes checkpoints, and moves the sessions of a
failed instance elsewhere. Choices the spec leaves open, made here:

* **Who creates the session record**: ``POST place`` when it carries ``session`` (epoch 1 at
  the chosen instance). A checkpoint for a session the PC never placed is ``404``, so only a
  session placed through the PC survives failures, and the PC knows from the start which
  instance may checkpoint it.
* **Who may checkpoint**: the instance serving the session at the checkpoint's epoch. The
  checkpoint names it in the extension member ``instance``
  (:class:`~kvsp.records_session.SessionCheckpoint`); the principal must be allowed to report
  for that URI (its ``holders``, or admin) and the store checks it against the epoch's
  instance in the same step that checks the epoch. The answer is
  ``{"session", "epoch", "output_offset", "state"}``: the offset the PC keeps, which is what
  the instance's release gate waits for.
* **Failover**: when an instance fails (its status expired, or it came back with a new epoch),
  each session it served is moved: an instance is chosen by §6.4 as for a placement of the
  checkpoint's prompt (its prompt blocks looked up, the tail and output counted as tokens to
  compute), the epoch is advanced by compare-and-set, and ``POST sessions/{session}/resume``
  carries the latest checkpoint and the new epoch. An instance that refuses is left out and the
  next is tried, with a new epoch each time (so a refusal that was in fact a late acceptance
  cannot leave two instances at one epoch); with none available the PC keeps trying, backing
  off, until ``deadline_ms`` after the failure, and then marks the session failed. A session
  without any checkpoint yet has produced nothing: it is marked failed at once and its front
  end starts over.
* **Event log**: with ``log`` set, each accepted and rejected checkpoint and each move is
  written as one JSON line with a ``CLOCK_MONOTONIC`` time in ns (``t_ns``), which is the same
  clock in every process of one machine, so an instance's release log can be checked against
  the PC's acknowledgements (§6.8 release gate).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from kvsp.errors import (
    BadRequest,
    Forbidden,
    IllegalTransition,
    KVSPError,
    NotFound,
    StaleEpoch,
)
from kvsp.ids import CompatId, ScopeId
from kvsp.records_common import read_uuid
from kvsp.records_session import ResumeRequest, SessionCheckpoint
from kvsp.sessions import SessionRecord, SessionState, new_session
from kvsp.stores.sessions import SessionCensus, SessionStore
from kvsp.web import auth
from kvsp.web.auth import principal_of
from kvsp.web.clock import Clock
from kvsp.web.events import EventLog
from kvsp.web.http import read_json
from kvsp.web.problems import kvsp_json

_log = logging.getLogger("kvsp.services.pc.service")

CHECKPOINT_BODY_LIMIT = 64 << 20
"""Octets of a checkpoint: a million output tokens and 100k prompt block keys fit."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionSettings:
    """How the PC keeps and moves sessions.

    ``deadline_ms`` bounds a failover from the failure to the last try; ``backoff_ms`` is the
    first wait between tries, doubled up to ``backoff_max_ms``. Done and failed sessions are
    kept ``retain_ms``, any session ``idle_ms`` after its last change. ``log`` is the event
    log's path (none by default).
    """

    deadline_ms: int = 30_000
    backoff_ms: int = 100
    backoff_max_ms: int = 2_000
    retain_ms: int = 600_000
    idle_ms: int = 3_600_000
    log: Path | None = None


class ResumePeers(Protocol):
    """How the PC reaches instances to resume a session there."""

    async def resume(self, instance: str, request: ResumeRequest) -> None:
        """POST ``{instance}sessions/{session}/resume``; returns once the instance took it.

        Raises:
            KVSPError: the instance refused or could not be reached.
        """
        ...


class ResumeChooser(Protocol):
    """The §6.4 choice of an instance for a checkpoint (the PC's placement code)."""

    async def choose_for_resume(
        self, checkpoint: SessionCheckpoint, excluded: set[str]
    ) -> str | None:
        """The active instance with the lowest cost, leaving out ``excluded``; ``None`` if
        none can take it."""
        ...


class SessionService:
    """Session records, checkpoints and failover at the PC (§6.8)."""

    def __init__(
        self,
        store: SessionStore,
        chooser: ResumeChooser,
        peers: ResumePeers,
        clock: Clock,
        settings: SessionSettings,
    ) -> None:
        self.store = store
        self.settings = settings
        self.events = EventLog(settings.log)
        self._chooser = chooser
        self._peers = peers
        self._clock = clock
        self._failed: dict[str, int] = {}  # instance -> when it was found failed (ms)
        self._moving: dict[uuid.UUID, asyncio.Task[None]] = {}

    # -- records and checkpoints ---------------------------------------------------------------

    async def exists(self, session: uuid.UUID) -> bool:
        """Whether the PC has a record of ``session``."""
        return await self.store.get(session) is not None

    async def create(
        self, session: uuid.UUID, scope: ScopeId, compat: CompatId, instance: str
    ) -> SessionRecord:
        """Record a session placed at ``instance`` (epoch 1).

        Raises:
            Conflict: the session exists.
        """
        record = new_session(session, scope, compat, instance, self._clock.now_ms())
        await self.store.create(record)
        self.events.write("placed", session=str(session), instance=instance, epoch=1)
        return record

    async def get(self, session: uuid.UUID) -> SessionRecord:
        """The session's record.

        Raises:
            NotFound: no such session (never placed, or expired).
        """
        record = await self.store.get(session)
        if record is None:
            raise NotFound(f"no session {session}")
        return record

    async def checkpoint(self, cp: SessionCheckpoint) -> SessionRecord:
        """Take a checkpoint (§6.8): the record after it, whose offset the instance may
        release up to.

        Raises:
            NotFound: no such session.
            StaleEpoch: an epoch below the session's (the sender no longer serves it).
            Conflict, Forbidden: as :func:`~kvsp.sessions.accept_checkpoint`.
        """
        try:
            record = await self.store.put_checkpoint(cp, self._clock.now_ms())
        except KVSPError as exc:
            self.events.write(
                "reject",
                session=str(cp.session),
                epoch=cp.epoch,
                output_offset=cp.output_offset,
                instance=cp.instance,
                problem=exc.problem,
            )
            raise
        self.events.write(
            "ack",
            session=str(cp.session),
            epoch=cp.epoch,
            output_offset=record.output_offset,
            instance=cp.instance,
        )
        return record

    async def expire(self) -> int:
        """Drop sessions past their retention; returns how many."""
        s = self.settings
        now = self._clock.now_ms()
        return await self.store.expire(now, idle_ms=s.idle_ms, retain_ms=s.retain_ms)

    # -- failover ------------------------------------------------------------------------------

    def instance_failed(self, instance: str) -> None:
        """Note that ``instance`` failed now; :meth:`recover` moves the sessions it was given
        before then (not those a restarted incarnation at the same URI got since)."""
        self._failed[instance] = self._clock.now_ms()

    async def recover(self) -> int:
        """Start moving the sessions of every instance noted failed; returns how many moves
        started (each runs as its own task)."""
        started = 0
        while self._failed:
            instance, failed_at = self._failed.popitem()
            for record in await self.store.live_at(instance):
                if record.session in self._moving or record.assigned_ms > failed_at:
                    continue  # a move is under way, or the session came after the failure
                name = f"kvsp-failover-{record.session}"
                task = asyncio.create_task(self._move(record), name=name)
                self._moving[record.session] = task
                task.add_done_callback(self._moved(record.session))
                started += 1
        return started

    def _moved(self, session: uuid.UUID) -> Callable[[asyncio.Task[None]], None]:
        def forget(task: asyncio.Task[None]) -> None:
            if self._moving.get(session) is task:
                del self._moving[session]

        return forget

    async def wait_moves(self) -> None:
        """Wait until every move under way has ended (for tests and shutdown)."""
        while self._moving:
            await asyncio.wait(list(self._moving.values()))

    async def aclose(self) -> None:
        """Cancel the moves under way and close the event log."""
        tasks = list(self._moving.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.events.close()

    async def _move(self, record: SessionRecord) -> None:
        try:
            await self._fail_over(record)
        except Exception:
            _log.exception("moving session %s failed", record.session)

    async def _fail_over(self, record: SessionRecord) -> None:
        """Move one session until an instance took it, it ended, or the deadline passed."""
        if record.checkpoint is None:
            await self._settle(
                record, SessionState.FAILED, "its instance failed before the first checkpoint"
            )
            return
        now = self._clock.now_ms()
        deadline = now + self.settings.deadline_ms
        delay = self.settings.backoff_ms
        excluded: set[str] = set()
        while True:
            instance = await self._chooser.choose_for_resume(record.checkpoint, excluded)
            if instance is not None:
                moved = await self._advance(record, instance)
                if moved is None:
                    return  # another move won the epoch, or the session ended
                record = moved
                if await self._resume(record):
                    return
                excluded.add(instance)
                continue  # try the next instance at once, with a new epoch
            if self._clock.now_ms() >= deadline:
                detail = f"no instance took the session within {self.settings.deadline_ms} ms"
                await self._settle(record, SessionState.FAILED, detail)
                return
            excluded.clear()  # after a pause, those that refused may take it
            await asyncio.sleep(delay / 1000)
            delay = min(2 * delay, self.settings.backoff_max_ms)

    async def _advance(self, record: SessionRecord, instance: str) -> SessionRecord | None:
        try:
            moved = await self.store.advance_epoch(
                record.session, record.epoch, instance, self._clock.now_ms()
            )
        except (StaleEpoch, IllegalTransition, NotFound) as exc:
            _log.info("session %s not moved: %s", record.session, exc)
            return None
        self.events.write(
            "move",
            session=str(record.session),
            instance=instance,
            epoch=moved.epoch,
            output_offset=moved.output_offset,
            previous=record.instance,
        )
        return moved

    async def _resume(self, record: SessionRecord) -> bool:
        checkpoint = record.checkpoint
        if checkpoint is None:  # a record with a checkpoint keeps one
            raise RuntimeError("a moved session lost its checkpoint")
        request = ResumeRequest(epoch=record.epoch, checkpoint=checkpoint)
        try:
            await self._peers.resume(record.instance, request)
        except KVSPError as exc:
            _log.warning("%s refused session %s: %s", record.instance, record.session, exc)
            self.events.write(
                "refused", session=str(record.session), instance=record.instance, epoch=record.epoch
            )
            return False
        with contextlib.suppress(StaleEpoch, IllegalTransition, NotFound):
            await self.store.settle(
                record.session, record.epoch, SessionState.SERVING, self._clock.now_ms()
            )
        self.events.write(
            "resumed", session=str(record.session), instance=record.instance, epoch=record.epoch
        )
        return True

    async def _settle(self, record: SessionRecord, state: SessionState, detail: str) -> None:
        with contextlib.suppress(StaleEpoch, IllegalTransition, NotFound):
            await self.store.settle(
                record.session, record.epoch, state, self._clock.now_ms(), detail
            )
            _log.warning("session %s %s: %s", record.session, state, detail)
            self.events.write(str(state), session=str(record.session), detail=detail)


# --- HTTP ---------------------------------------------------------------------------------------


def _session_of(request: Request) -> uuid.UUID:
    return read_uuid(request.path_params["session"], "session")


class _SessionEndpoints:
    def __init__(self, service: SessionService) -> None:
        self.service = service

    async def put_checkpoint(self, request: Request) -> Response:
        principal = principal_of(request)
        session = _session_of(request)
        cp = SessionCheckpoint.from_json(await read_json(request, CHECKPOINT_BODY_LIMIT))
        if cp.session != session:
            raise BadRequest("the checkpoint is of another session than the path", path="$.session")
        if cp.instance is None:
            raise BadRequest("name the instance that took the checkpoint", path="$.instance")
        if not auth.may_publish_for(principal, cp.instance):
            raise Forbidden(f"principal {principal.name!r} may not report for this instance")
        auth.require_scope(principal, cp.scope_id)
        record = await self.service.checkpoint(cp)
        return kvsp_json(
            {
                "session": str(record.session),
                "epoch": record.epoch,
                "output_offset": record.output_offset,
                "state": str(record.state),
            }
        )

    async def get_session(self, request: Request) -> Response:
        principal = principal_of(request)
        record = await self.service.get(_session_of(request))
        auth.require_scope(principal, record.scope_id)
        return kvsp_json(record.view())


SESSION_LIST_LIMIT = 1000
"""The most sessions one ``GET sessions`` lists (``?limit=N``, default 100)."""


def _list_limit(request: Request) -> int:
    text = request.query_params.get("limit", "100")
    if not text.isdigit() or not 1 <= int(text) <= SESSION_LIST_LIMIT:
        raise BadRequest(f"limit must be an integer in 1..{SESSION_LIST_LIMIT}", path="limit")
    return int(text)


def _census_routes(store: SessionStore) -> list[BaseRoute]:
    """``GET sessions`` (admin): the most recently changed sessions as ``GET
    sessions/{session}`` shows each, over a store that can list them
    (:class:`~kvsp.stores.sessions.SessionCensus`); no route otherwise."""
    if not isinstance(store, SessionCensus):
        return []
    census: SessionCensus = store

    async def sessions(request: Request) -> Response:
        principal_of(request)  # admin only: kvsp.web.roles
        records = await census.recent(_list_limit(request))
        return kvsp_json({"sessions": [r.view() for r in records]})

    return [Route("/sessions", sessions, methods=["GET"])]


def session_routes(service: SessionService) -> Sequence[BaseRoute]:
    """``PUT sessions/{session}/checkpoint`` (role instance), ``GET sessions/{session}``
    (roles client, pc, instance; authorized for the session's scope) and ``GET sessions``
    (admin; over a store that lists sessions)."""
    ep = _SessionEndpoints(service)
    return [
        Route("/sessions/{session}/checkpoint", ep.put_checkpoint, methods=["PUT"]),
        Route("/sessions/{session}", ep.get_session, methods=["GET"]),
        *_census_routes(service.store),
    ]


__all__ = [
    "ResumeChooser",
    "ResumePeers",
    "SessionService",
    "SessionSettings",
    "session_routes",
]
