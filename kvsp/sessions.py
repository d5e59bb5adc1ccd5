"""Session checkpoints and resume bookkeeping (spec §6.8; DESIGN.md §2 ``sessions.py``).

Pure rules, ``now_ms`` passed in, so that a store can apply each of them inside one call (the
memory store runs them without awaiting; a Redis store runs the same rules as one script):

* :func:`accept_checkpoint`: the PC takes a checkpoint only from the instance serving the
  session at the checkpoint's epoch; a lower epoch is ``kvsp-stale-epoch`` (§6.8 MUST), a
  higher one is refused too (the PC never handed it out), and the checkpoint with the highest
  ``output_offset`` is kept. A checkpoint may not rewrite tokens an earlier one covered.
* :func:`advance_epoch`: compare-and-set on the expected epoch, so two failovers racing on one
  session bump it once; the loser learns ``kvsp-stale-epoch``.
* :func:`settle`: the PC marks a session serving again (resume acknowledged) or failed.

Session states, with who moves them:

========= ========= ====================================================================
from      to        when
========= ========= ====================================================================
serving   resuming  failover: the PC advanced the epoch to a new instance
resuming  resuming  that instance refused; the PC tries the next with a new epoch
resuming  serving   the new instance acknowledged the resume or sent its first checkpoint
serving,  done      a checkpoint covers ``max_tokens`` output tokens
resuming
serving,  failed    nothing to resume from, or no instance took it before the deadline
resuming
========= ========= ====================================================================

The instance side is here too: :func:`checkpoint_due` (when to checkpoint, §6.8 "whenever a
block of generated tokens completes, and at least every 64 output tokens") and
:class:`ResumePlan` (what a resumed instance loads and what it recomputes, §6.8 steps 1-2).
A checkpoint at ``output_offset`` k covers the tokens g[0..k-1]; the KV of g[k-1] is computed
only when g[k] is, so a resumed instance always recomputes at least g[k-1], whose logits give
g[k] at sampler step k.
"""

from __future__ import annotations

import dataclasses
import enum
import uuid
from dataclasses import dataclass
from typing import Any, Final, Self

from kvsp.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    IllegalTransition,
    RecordError,
    StaleEpoch,
)
from kvsp.fields import Fields
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.records_common import HTTP_SCHEMES, read_uri, read_uuid
from kvsp.records_session import SessionCheckpoint

DEFAULT_CHECKPOINT_EVERY = 64
"""§6.8: "at least every 64 output tokens"."""


class SessionState(enum.StrEnum):
    """Where a session stands at the PC (see the module's table)."""

    SERVING = "serving"
    RESUMING = "resuming"
    DONE = "done"
    FAILED = "failed"


TRANSITIONS: Final[frozenset[tuple[SessionState, SessionState]]] = frozenset(
    {
        (SessionState.SERVING, SessionState.RESUMING),
        (SessionState.RESUMING, SessionState.RESUMING),
        (SessionState.RESUMING, SessionState.SERVING),
        (SessionState.SERVING, SessionState.DONE),
        (SessionState.RESUMING, SessionState.DONE),
        (SessionState.SERVING, SessionState.FAILED),
        (SessionState.RESUMING, SessionState.FAILED),
    }
)
"""(from, to) pairs a session may move along."""
FINAL: Final[frozenset[SessionState]] = frozenset({SessionState.DONE, SessionState.FAILED})


def check_session_transition(src: SessionState, dst: SessionState) -> None:
    """Allow ``src → dst`` only if the table has it.

    Raises:
        IllegalTransition: it does not (409 ``kvsp-conflict``).
    """
    if (src, dst) not in TRANSITIONS:
        raise IllegalTransition(f"session state {src} -> {dst} is not allowed")


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionRecord:
    """What the PC keeps of one session: where it lives now (instance, epoch, and since when:
    ``assigned_ms``), its state and the latest checkpoint (``None`` before the first)."""

    session: uuid.UUID
    scope_id: ScopeId
    compat_id: CompatId
    instance: str
    epoch: int
    state: SessionState
    checkpoint: SessionCheckpoint | None = None
    created_ms: int
    updated_ms: int
    assigned_ms: int
    detail: str | None = None

    @property
    def output_offset(self) -> int:
        """Output tokens covered by the latest checkpoint (0 before the first)."""
        return 0 if self.checkpoint is None else self.checkpoint.output_offset

    @property
    def max_tokens(self) -> int | None:
        """The output tokens the session asked for, once a checkpoint said so."""
        return None if self.checkpoint is None else self.checkpoint.max_tokens

    def view(self) -> dict[str, Any]:
        """``GET sessions/{session}``: where the session lives now, without the tokens."""
        out: dict[str, Any] = {
            "session": str(self.session),
            "scope_id": self.scope_id.hex(),
            "compat_id": self.compat_id.hex(),
            "instance": self.instance,
            "epoch": self.epoch,
            "state": str(self.state),
            "output_offset": self.output_offset,
        }
        if self.max_tokens is not None:
            out["max_tokens"] = self.max_tokens
        if self.detail is not None:
            out["detail"] = self.detail
        return out

    def to_json(self) -> dict[str, Any]:
        """The whole record as JSON (how a shared store keeps it)."""
        out = self.view()
        out.pop("output_offset")
        out.pop("max_tokens", None)
        out["created_ms"] = self.created_ms
        out["updated_ms"] = self.updated_ms
        out["assigned_ms"] = self.assigned_ms
        if self.checkpoint is not None:
            out["checkpoint"] = self.checkpoint.to_json()
        return out

    @classmethod
    def from_json(cls, obj: object, path: str = "$") -> Self:
        """Read a stored record.

        Raises:
            RecordError: a bad or missing member.
        """
        f = Fields(obj, path)
        state = f.string("state")
        if state not in SessionState.__members__.values():
            raise RecordError(f"unknown session state {state!r}", path=f.at("state"))
        checkpoint = f.raw("checkpoint", optional=True)
        created = f.integer("created_ms")
        assigned = f.integer("assigned_ms", optional=True)  # absent in older records
        return cls(
            session=read_uuid(f.raw("session"), f.at("session")),
            scope_id=ScopeId(f.hex16("scope_id")),
            compat_id=CompatId(f.hex32("compat_id")),
            instance=read_uri(f.raw("instance"), f.at("instance"), HTTP_SCHEMES),
            epoch=f.integer("epoch"),
            state=SessionState(state),
            checkpoint=None
            if checkpoint is None
            else SessionCheckpoint.from_json(checkpoint, f.at("checkpoint")),
            created_ms=created,
            updated_ms=f.integer("updated_ms"),
            assigned_ms=assigned if assigned is not None else created,
            detail=f.string("detail", optional=True),
        )


def new_session(
    session: uuid.UUID, scope_id: ScopeId, compat_id: CompatId, instance: str, now_ms: int
) -> SessionRecord:
    """The record ``POST place`` creates for a session: epoch 1 at the chosen instance."""
    return SessionRecord(
        session=session,
        scope_id=scope_id,
        compat_id=compat_id,
        instance=instance,
        epoch=1,
        state=SessionState.SERVING,
        created_ms=now_ms,
        updated_ms=now_ms,
        assigned_ms=now_ms,
    )


# --- the PC's rules ---------------------------------------------------------------------------


def _same_session(record: SessionRecord, cp: SessionCheckpoint) -> None:
    if cp.scope_id != record.scope_id or cp.compat_id != record.compat_id:
        raise Conflict("the checkpoint names another scope_id or compat_id than the session")


def _consistent(prior: SessionCheckpoint, cp: SessionCheckpoint) -> None:
    """A later checkpoint extends an earlier one: same prompt and sampler, and the tokens the
    earlier one covered unchanged (§6.8: "the output already delivered is never repeated or
    altered")."""
    if prior.prompt_blocks != cp.prompt_blocks or prior.prompt_tail != cp.prompt_tail:
        raise Conflict("the checkpoint's prompt differs from the session's", path="$.prompt_blocks")
    a, b = prior.sampler, cp.sampler
    if (a.method, a.params, a.seed, a.deterministic) != (
        b.method,
        b.params,
        b.seed,
        b.deterministic,
    ):
        raise Conflict("the checkpoint's sampler differs from the session's", path="$.sampler")
    if prior.max_tokens is not None and cp.max_tokens != prior.max_tokens:
        raise Conflict("max_tokens differs from the session's", path="$.max_tokens")
    common = min(prior.output_offset, cp.output_offset)
    if prior.generated[:common] != cp.generated[:common]:
        raise Conflict("the checkpoint alters tokens already covered", path="$.generated")


def _supersedes(cp: SessionCheckpoint, prior: SessionCheckpoint) -> bool:
    """Whether ``cp`` replaces ``prior``: more tokens, or as many from a later epoch."""
    if cp.output_offset != prior.output_offset:
        return cp.output_offset > prior.output_offset
    return cp.epoch > prior.epoch


def accept_checkpoint(record: SessionRecord, cp: SessionCheckpoint, now_ms: int) -> SessionRecord:
    """The record after taking ``cp`` (§6.8): the checkpoint with the highest
    ``output_offset`` is kept; a checkpoint covering ``max_tokens`` makes the session done.

    A repeat of a checkpoint already covered (same epoch, offset not above the kept one) is
    accepted and changes nothing, so an instance may retry a PUT whose answer it lost.

    Raises:
        StaleEpoch: ``cp.epoch`` is below the session's (§6.8 MUST reject).
        Conflict: an epoch above the session's, a session that failed (or is done and the
            checkpoint is not a repeat), another scope, or tokens rewritten.
        Forbidden: ``cp.instance`` is not the instance serving the session at that epoch.
    """
    if cp.epoch < record.epoch:
        raise StaleEpoch(f"session epoch is {record.epoch}; checkpoint of epoch {cp.epoch}")
    if cp.epoch > record.epoch:
        raise Conflict(f"epoch {cp.epoch} is ahead of the session's {record.epoch}", path="$.epoch")
    if cp.instance != record.instance:
        raise Forbidden("only the instance serving the session at this epoch may checkpoint it")
    _same_session(record, cp)
    prior = record.checkpoint
    if prior is not None:
        _consistent(prior, cp)
    repeat = prior is not None and cp.output_offset <= prior.output_offset
    if record.state is SessionState.FAILED or (record.state is SessionState.DONE and not repeat):
        raise Conflict(f"the session is {record.state}")
    kept = cp if prior is None or _supersedes(cp, prior) else prior
    state = record.state
    if state is SessionState.RESUMING:
        state = SessionState.SERVING  # the new instance works: its checkpoint says so
    if kept is not None and kept.max_tokens is not None and kept.output_offset >= kept.max_tokens:
        state = SessionState.DONE
    if kept is prior and state is record.state:
        return record
    return dataclasses.replace(record, checkpoint=kept, state=state, updated_ms=now_ms)


def advance_epoch(
    record: SessionRecord, expected_epoch: int, instance: str, now_ms: int
) -> SessionRecord:
    """The record moved to ``instance`` at the next epoch, state resuming (§6.8 "increments
    the session epoch"); the checkpoint to resume from is the one kept at that moment.

    Raises:
        StaleEpoch: the epoch is no longer ``expected_epoch`` (another failover won).
        IllegalTransition: the session is done or failed.
    """
    if record.epoch != expected_epoch:
        raise StaleEpoch(f"session epoch moved to {record.epoch} (expected {expected_epoch})")
    check_session_transition(record.state, SessionState.RESUMING)
    return dataclasses.replace(
        record,
        epoch=record.epoch + 1,
        instance=instance,
        state=SessionState.RESUMING,
        updated_ms=now_ms,
        assigned_ms=now_ms,
        detail=None,
    )


def settle(
    record: SessionRecord,
    epoch: int,
    state: SessionState,
    now_ms: int,
    detail: str | None = None,
) -> SessionRecord:
    """The record in ``state`` if it is still at ``epoch``; setting the state it is in already
    is a no-op (a resume acknowledged after the new instance's first checkpoint).

    Raises:
        StaleEpoch: the session moved on from ``epoch``.
        IllegalTransition: the table has no such move.
    """
    if record.epoch != epoch:
        raise StaleEpoch(f"session epoch moved to {record.epoch} (expected {epoch})")
    if record.state is state:
        return record
    check_session_transition(record.state, state)
    return dataclasses.replace(record, state=state, updated_ms=now_ms, detail=detail)


# --- the instance's side ----------------------------------------------------------------------


def fed_tokens(prompt_tokens: int, output_offset: int) -> int:
    """Tokens whose KV exists once ``output_offset`` tokens are out: the prompt and every
    output token but the last (its KV is computed with the next one)."""
    return prompt_tokens + max(0, output_offset - 1)


def checkpoint_due(
    *,
    prompt_tokens: int,
    block_tokens: int,
    last: int,
    offset: int,
    every: int,
    batch: int | None = None,
) -> bool:
    """Whether an instance should checkpoint at ``offset`` after one at ``last`` (§6.8).

    Due when a block completed since ``last`` (its KV is whole: it can be published and
    loaded), when ``every`` tokens passed, and before the first token (``last == 0``). With
    ``batch`` (the non-deterministic gate) also once ``batch`` unacknowledged tokens wait.
    """
    if offset <= last:
        return False
    if last == 0 or offset - last >= every:
        return True
    if batch is not None and offset - last >= batch:
        return True
    before = fed_tokens(prompt_tokens, last) // block_tokens
    return fed_tokens(prompt_tokens, offset) // block_tokens > before


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumePlan:
    """What a resumed instance has to do for a checkpoint (§6.8 steps 1-2).

    ``known`` are the tokens after the prompt blocks: ``prompt_tail`` then ``generated``.
    ``loadable`` is how many generated blocks (those after the prompt blocks) may be loaded:
    only blocks whose KV existed at the checkpoint, so the last known token is always
    recomputed. :meth:`split` says what is recomputed once ``loaded`` of them are loaded.
    """

    prompt_blocks: tuple[BlockKey, ...]
    tail: int
    known: tuple[int, ...]
    loadable: int
    block_tokens: int

    def generated_block_tokens(self) -> tuple[int, ...]:
        """The known tokens covered by the loadable generated blocks (for their keys)."""
        return self.known[: self.loadable * self.block_tokens]

    def split(self, loaded: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(prefill, replay) after ``loaded`` generated blocks: the prompt tail still to
        compute as one prefill chunk, then the output tokens to replay by decode steps, as the
        original run computed them.

        Raises:
            BadRequest: ``loaded`` is more than :attr:`loadable`.
        """
        if not 0 <= loaded <= self.loadable:
            raise BadRequest(f"{loaded} generated blocks, at most {self.loadable} loadable")
        rest = self.known[loaded * self.block_tokens :]
        tail_left = max(0, self.tail - loaded * self.block_tokens)
        return rest[:tail_left], rest[tail_left:]


def plan_resume(cp: SessionCheckpoint, block_tokens: int) -> ResumePlan:
    """The :class:`ResumePlan` of ``cp`` for blocks of ``block_tokens``.

    Raises:
        BadRequest: nothing to compute (no output token and no prompt tail: the last prompt
            token, whose logits give the first output token, is known by its block key only),
            or a prompt tail of a whole block or more.
    """
    tail = len(cp.prompt_tail)
    if tail >= block_tokens:
        raise BadRequest("prompt_tail must be shorter than a block", path="$.prompt_tail")
    known = cp.prompt_tail + cp.generated
    if not known:
        raise BadRequest("nothing to resume from: no output token and no prompt tail")
    # Blocks after the prompt blocks whose KV existed at the checkpoint (all but the last token).
    loadable = (len(known) - 1) // block_tokens if cp.output_offset else 0
    return ResumePlan(
        prompt_blocks=cp.prompt_blocks,
        tail=tail,
        known=known,
        loadable=loadable,
        block_tokens=block_tokens,
    )
