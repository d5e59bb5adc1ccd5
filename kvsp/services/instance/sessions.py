"""Sessions that survive failures, at the instance (spec §6.8; DESIGN.md §3 ``generate``,
``sessions/{session}/tokens``, ``sessions/{session}/resume``).

:class:`InstanceSessions` runs each session placed with a ``session`` id as a task of its own,
apart from any HTTP connection: the engine generates into the session's token log, a
checkpointer publishes Session Checkpoints to the PC, and front ends read the released part of
the log from any index (``GET sessions/{session}/tokens?from=N``), so a reader that lost its
stream reattaches without the session noticing. Choices the spec leaves open, made here:

* **Cadence** (§6.8): a checkpoint is due when a block of the sequence completes (its KV is
  whole, so its replica is published first), every ``checkpoint_every`` output tokens (64 by
  default), and at the end. At most one is in flight; the next covers every token generated
  meanwhile.
* **The first checkpoint comes before the first token** is released, in every mode: until the
  PC holds one, it cannot resume the session, so a front end that saw no token may start over.
  With ``replica_holders`` configured, the prompt's blocks are stored there first (§6.7 PUT), so
  that the blocks the checkpoint lists survive this instance; blocks of generated tokens are
  kept and published by the holder face as they complete and stored there too.
* **Release gate**: with a deterministic sampler every token is released as soon as it exists
  (after that first acknowledgement); otherwise a token is released only once the PC has
  acknowledged a checkpoint covering it (§6.8 MUST), and a gated checkpoint waits for
  ``gate_batch`` new tokens (1 by default: send whenever none is in flight).
* **Stale epoch**: a checkpoint answered ``kvsp-stale-epoch`` (or refused otherwise) means the
  session lives elsewhere now: generation stops, nothing more is released, and readers get the
  problem as their last line. When the PC declares this instance failed (its status answered
  ``kvsp-stale-epoch``), every session checkpoints at once to learn its fate.
* **Resume** (§6.8 steps 1-4): the prompt blocks the checkpoint lists are taken from the engine,
  the holder face, or any holder the IS names (configured replica holders first, each with a
  bounded wait); a listed block found nowhere fails the resume (404), since its tokens are not
  known. The blocks of output tokens are found by their keys, which this instance computes with
  the scope key it is configured with, and loaded as far as found; the rest of the context is
  recomputed (:class:`~kvsp.sessions.ResumePlan`). The sampler restarts at
  ``output_offset`` and tokens are labelled with the new epoch from there; indices below it are
  served from the checkpoint. A checkpoint must carry ``max_tokens`` to be resumed.
* **Event log** (``log``): each release is written as ``{"t_ns", "event": "release",
  "session", "epoch", "from", "to"}`` with the same monotonic clock as the PC's log.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import uuid
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvsp.container import Container
from kvsp.engine.api import EngineSequence, Sampling
from kvsp.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    Incompatible,
    KVSPError,
    NotFound,
    StaleEpoch,
    UnsupportedHolder,
)
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.keys import BlockKeyChain
from kvsp.records import LookupRequest, ReplicaRecord, ResumeRequest, SessionCheckpoint
from kvsp.records_session import Sampler as SamplerRecord
from kvsp.services.instance.service import InstanceAgent, Session
from kvsp.services.pc.client import SessionView
from kvsp.sessions import checkpoint_due, fed_tokens, plan_resume
from kvsp.transfer.block_client import source_base
from kvsp.web.events import EventLog

_log = logging.getLogger("kvsp.instance")

RETRY_MAX_S = 2.0
"""Longest wait between tries of a checkpoint the PC could not be reached for."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionConfig:
    """How an instance checkpoints, gates, replicates and resumes sessions."""

    checkpoint_every: int = 64
    """§6.8: a checkpoint at least every this many output tokens."""
    gate_batch: int = 1
    """Non-deterministic samplers: new tokens a gated checkpoint waits for."""
    replica_holders: tuple[str, ...] = ()
    """Holders that keep copies of the session's blocks (so they outlive this instance)."""
    fetch_timeout_s: float = 5.0
    """Longest wait for one block from one source while resuming."""
    retry_s: float = 0.05
    """First wait before trying a checkpoint again when the PC was unreachable."""
    keep_finished_s: float = 30.0
    """How long a finished session's tokens stay readable."""
    log: Path | None = None


class CheckpointSink(Protocol):
    """The PC as the instance's sessions see it (:class:`~kvsp.services.pc.client.PCClient`)."""

    async def put_checkpoint(self, checkpoint: SessionCheckpoint, /) -> SessionView:
        """PUT the checkpoint; the answer carries the offset the PC keeps."""
        ...


class LiveState(enum.StrEnum):
    """A session at this instance: running, finished (all tokens out and acknowledged),
    superseded (it lives elsewhere now) or failed."""

    RUNNING = "running"
    FINISHED = "finished"
    SUPERSEDED = "superseded"
    FAILED = "failed"


@dataclass(slots=True, kw_only=True)
class ResumeOutcome:
    """What a resume did: the answer to ``POST sessions/{session}/resume``."""

    session: uuid.UUID
    epoch: int
    output_offset: int
    prompt_blocks: int
    generated_blocks: int
    recomputed_tokens: int

    def to_json(self) -> dict[str, Any]:
        """Render as JSON."""
        return {
            "session": str(self.session),
            "epoch": self.epoch,
            "output_offset": self.output_offset,
            "loaded_prompt_blocks": self.prompt_blocks,
            "loaded_generated_blocks": self.generated_blocks,
            "recomputed_tokens": self.recomputed_tokens,
        }


@dataclass(eq=False, slots=True, kw_only=True)
class LiveSession:
    """One session this instance serves: its token log, how much of it is released, and the
    checkpoint state (``acked``: output tokens the PC holds a checkpoint for)."""

    session: uuid.UUID
    epoch: int
    compat: CompatId
    scope: ScopeId
    scope_key: bytes
    block_tokens: int
    prompt_blocks: tuple[BlockKey, ...]
    prompt_tail: tuple[int, ...]
    sampling: Sampling
    deterministic: bool
    max_tokens: int
    instance: str
    tokens: list[int] = field(default_factory=list)
    released: int = 0
    acked: int = 0
    sent: int = 0
    checkpoints: int = 0
    confirmed: bool = False
    """Whether the PC holds a checkpoint of the session (so it could resume it)."""
    published: int = 0
    """Blocks of the sequence (from the start) kept and published, or loaded, already."""
    generated_keys: list[BlockKey] = field(default_factory=list)
    """The keys of the blocks after the prompt's, as far as computed."""
    state: LiveState = LiveState.RUNNING
    error: KVSPError | None = None
    generating: bool = True
    force: bool = False
    ready: asyncio.Task[None] | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def prompt_tokens(self) -> int:
        """The prompt's length in tokens (its blocks and its tail)."""
        return len(self.prompt_blocks) * self.block_tokens + len(self.prompt_tail)

    def block_keys_upto(self, blocks: int) -> list[BlockKey]:
        """The keys of the first ``blocks`` blocks after the prompt's (§4.2 chain over the
        prompt tail and the output), computed once each."""
        have = len(self.generated_keys)
        if blocks > have:
            parent = self.generated_keys[-1] if have else (self.prompt_blocks or (None,))[-1]
            chain = BlockKeyChain(self.scope_key, self.compat, self.block_tokens, parent=parent)
            known = self.prompt_tail + tuple(self.tokens)
            b = self.block_tokens
            self.generated_keys += chain.extend(known[have * b : blocks * b])
        return self.generated_keys[:blocks]

    def checkpoint(self, offset: int) -> SessionCheckpoint:
        """The Session Checkpoint covering the first ``offset`` output tokens."""
        sampler = SamplerRecord(
            method=self.sampling.method,
            params=dict(self.sampling.params),
            seed=self.sampling.seed,
            step=offset,
            deterministic=self.deterministic,
        )
        return SessionCheckpoint(
            session=self.session,
            epoch=self.epoch,
            compat_id=self.compat,
            scope_id=self.scope,
            prompt_blocks=self.prompt_blocks,
            prompt_tail=self.prompt_tail,
            generated=tuple(self.tokens[:offset]),
            output_offset=offset,
            sampler=sampler,
            instance=self.instance,
            max_tokens=self.max_tokens,
        )

    def notify(self) -> None:
        """Wake the readers (the released count or the state changed)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def wake(self) -> None:
        """Wake the checkpointer."""
        self._wake.set()

    async def wait_wake(self) -> None:
        """Wait until :meth:`wake`."""
        await self._wake.wait()
        self._wake.clear()

    def view(self) -> dict[str, Any]:
        """``GET sessions/{session}`` at the instance."""
        return {
            "session": str(self.session),
            "epoch": self.epoch,
            "state": str(self.state),
            "generated": len(self.tokens),
            "released": self.released,
            "acknowledged": self.acked,
            "checkpoints": self.checkpoints,
            "max_tokens": self.max_tokens,
            "deterministic": self.deterministic,
        }

    async def stream(self, start: int) -> AsyncIterator[tuple[int, int]]:
        """``(index, token)`` from index ``start`` as they are released; ends when the session
        finished, or raises its error when it was superseded or failed."""
        index = start
        while True:
            changed = self._changed
            while index < self.released:
                yield index, self.tokens[index]
                index += 1
            if self.state is not LiveState.RUNNING and index >= self.released:
                if self.error is not None:
                    raise self.error
                return
            await changed.wait()


class InstanceSessions:
    """The §6.8 sessions of one instance (see the module docstring)."""

    def __init__(
        self, agent: InstanceAgent, control: CheckpointSink, config: SessionConfig
    ) -> None:
        self.agent = agent
        self.control = control
        self.config = config
        self.events = EventLog(config.log)
        self._live: dict[uuid.UUID, LiveSession] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._block_tokens = agent.descriptor.block_tokens
        self._replicas = tuple(h if h.endswith("/") else h + "/" for h in config.replica_holders)
        agent.on_declared_failed(self._declared_failed)

    def get(self, session: uuid.UUID) -> LiveSession:
        """The live session ``session``.

        Raises:
            NotFound: this instance does not serve it (any more).
        """
        live = self._live.get(session)
        if live is None:
            raise NotFound(f"this instance serves no session {session}")
        return live

    async def close(self) -> None:
        """Stop every session's tasks and close the event log."""
        tasks = [t for live in self._live.values() for t in live.tasks]
        tasks += self._background
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.events.close()

    def _url(self) -> str:
        url = self.agent.public_url
        if url is None:
            raise NotFound("the instance does not know its URL yet")
        return url

    def _new(self, **members: Any) -> LiveSession:
        return LiveSession(
            instance=self._url(),
            compat=self.agent.compat,
            block_tokens=self._block_tokens,
            **members,
        )

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- opening and resuming ------------------------------------------------------------------

    async def open(
        self,
        session: uuid.UUID,
        prompt: Sequence[int],
        max_tokens: int,
        scope: ScopeId,
        scope_key: bytes,
        sampling: Sampling,
        deterministic: bool,
    ) -> tuple[LiveSession, Session]:
        """Admit a session placed by the PC and start generating it (epoch 1).

        Raises:
            Conflict: this instance already serves that session.
            KVSPError: as :meth:`InstanceAgent.open_session`.
        """
        if session in self._live:
            raise Conflict(f"session {session} is already served here", path="$.session")
        opened = await self.agent.open_session(prompt, max_tokens, scope, scope_key)
        keys = tuple(opened.keys)
        live = self._new(
            session=session,
            epoch=1,
            scope=scope,
            scope_key=scope_key,
            prompt_blocks=keys,
            prompt_tail=tuple(prompt[len(keys) * self._block_tokens :]),
            sampling=sampling,
            deterministic=deterministic,
            max_tokens=max_tokens,
        )
        live.published = len(keys)  # kept and published by the agent already
        live.ready = asyncio.create_task(self._replicate_prompt(live, opened))
        self._start(live, opened)
        return live, opened

    async def resume(self, request: ResumeRequest) -> ResumeOutcome:
        """Take over a session from a failed instance (§6.8) and start generating it.

        Raises:
            StaleEpoch: this instance serves the session at this or a higher epoch already.
            Incompatible: the checkpoint is of another compat_id.
            BadRequest: no scope key for its scope, no ``max_tokens`` or more than this
                instance serves, or nothing to resume.
            NotFound: a prompt block the checkpoint lists is nowhere to be found.
            KVSPError: as :meth:`InstanceAgent.resume_session`.
        """
        cp = request.checkpoint
        old = self._live.get(cp.session)
        if old is not None and old.epoch >= request.epoch:
            raise StaleEpoch(f"session {cp.session} is served here at epoch {old.epoch}")
        if cp.compat_id != self.agent.compat:
            raise Incompatible("the checkpoint's compat_id is not this instance's", path="$")
        if cp.max_tokens is None:
            raise BadRequest("the checkpoint lacks max_tokens", path="$.checkpoint.max_tokens")
        if cp.max_tokens > self.agent.config.max_tokens:
            limit = self.agent.config.max_tokens
            raise BadRequest(f"at most {limit} tokens", path="$.checkpoint.max_tokens")
        scope_key = self.agent.scope_key_for(cp.scope_id)
        sampling = Sampling(
            method=cp.sampler.method, params=dict(cp.sampler.params), seed=cp.sampler.seed
        )
        plan = plan_resume(cp, self._block_tokens)
        prompt = await self._load(cp.scope_id, cp.prompt_blocks)
        if len(prompt) < len(cp.prompt_blocks):
            missing = cp.prompt_blocks[len(prompt)].hex()
            raise NotFound(f"prompt block {len(prompt)} ({missing}) is nowhere to be found")
        parent = cp.prompt_blocks[-1] if cp.prompt_blocks else None
        chain = BlockKeyChain(scope_key, self.agent.compat, self._block_tokens, parent=parent)
        generated = await self._load(cp.scope_id, chain.extend(plan.generated_block_tokens()))
        prefill, replay = plan.split(len(generated))
        if old is not None:
            self._supersede(old, StaleEpoch(f"session {cp.session} moved to epoch {request.epoch}"))
        opened = await self.agent.resume_session(
            [*prompt, *generated], prefill, replay, cp.max_tokens, request.epoch
        )
        live = self._new(
            session=cp.session,
            epoch=request.epoch,
            scope=cp.scope_id,
            scope_key=scope_key,
            prompt_blocks=cp.prompt_blocks,
            prompt_tail=cp.prompt_tail,
            sampling=sampling,
            deterministic=cp.sampler.deterministic,
            max_tokens=cp.max_tokens,
            tokens=list(cp.generated),
        )
        # The checkpoint's tokens were acknowledged at an earlier epoch: they may go out.
        live.acked = live.sent = live.released = cp.output_offset
        live.confirmed = True
        live.published = len(prompt) + len(generated)
        self._start(live, opened)
        return ResumeOutcome(
            session=cp.session,
            epoch=request.epoch,
            output_offset=cp.output_offset,
            prompt_blocks=len(prompt),
            generated_blocks=len(generated),
            recomputed_tokens=len(prefill) + len(replay),
        )

    def _start(self, live: LiveSession, opened: Session) -> None:
        self._live[live.session] = live
        generate = asyncio.create_task(
            self._generate(live, opened), name=f"kvsp-gen-{live.session}"
        )
        publish = asyncio.create_task(self._checkpoints(live), name=f"kvsp-cp-{live.session}")
        live.tasks = [generate, publish]
        generate.add_done_callback(lambda task: self._task_done(live, task))
        publish.add_done_callback(lambda task: self._task_done(live, task))

    def _task_done(self, live: LiveSession, task: asyncio.Task[None]) -> None:
        error = None if task.cancelled() else task.exception()
        if error is not None:  # a bug: stop the session rather than leave readers waiting
            _log.error("session %s: %s failed", live.session, task.get_name(), exc_info=error)
            self._supersede(live, KVSPError(f"internal error: {error}"), state=LiveState.FAILED)
        self._finish_if_done(live)

    # -- generation ----------------------------------------------------------------------------

    async def _generate(self, live: LiveSession, opened: Session) -> None:
        seq = opened.sequence
        try:
            remaining = live.max_tokens - len(live.tokens)
            if remaining > 0:
                step = len(live.tokens)
                async for token in seq.tokens(remaining, live.sampling, step):
                    live.tokens.append(token)
                    if live.deterministic and live.confirmed:
                        self._release(live, len(live.tokens))
                    live.wake()
                    await self._publish_blocks(live, seq)
        except KVSPError as exc:
            _log.warning("session %s: generation failed: %s", live.session, exc)
            self._supersede(live, exc, state=LiveState.FAILED)
        finally:
            live.generating = False
            live.wake()
            await opened.close()

    async def _publish_blocks(self, live: LiveSession, seq: EngineSequence) -> None:
        """Keep and publish every block whose KV completed (§6.8 "publishes replicas for the
        generated blocks"), keyed by the chain over the prompt and the output."""
        complete = fed_tokens(live.prompt_tokens, len(live.tokens)) // self._block_tokens
        if complete <= live.published:
            return
        first = len(live.prompt_blocks)
        keys = live.block_keys_upto(complete - first)
        for index in range(live.published, complete):
            data = await seq.block(index)
            key = keys[index - first]
            self.agent.keep_block(live.scope, key, data)
            for holder in self._replicas:
                self._spawn(self._replicate(holder, live.scope, key, data), "kvsp-replica")
            live.published = index + 1

    # -- checkpoints and the release gate ------------------------------------------------------

    def _due(self, live: LiveSession, offset: int) -> bool:
        if offset <= live.sent:
            return live.force or (not live.generating and not live.confirmed)
        if live.force or not live.generating:
            return True
        return checkpoint_due(
            prompt_tokens=live.prompt_tokens,
            block_tokens=self._block_tokens,
            last=live.sent,
            offset=offset,
            every=self.config.checkpoint_every,
            batch=None if live.deterministic else self.config.gate_batch,
        )

    async def _checkpoints(self, live: LiveSession) -> None:
        if live.ready is not None:
            await live.ready
        delay = self.config.retry_s
        while live.state is LiveState.RUNNING:
            offset = len(live.tokens)
            if not self._due(live, offset):
                if not live.generating:
                    break
                await live.wait_wake()
                continue
            live.force = False
            try:
                view = await self.control.put_checkpoint(live.checkpoint(offset))
            except (StaleEpoch, Conflict, Forbidden, NotFound) as exc:
                self._supersede(live, exc)
                break
            except KVSPError as exc:  # the PC is unreachable or failing: try again
                _log.warning("session %s: checkpoint failed: %s", live.session, exc)
                await asyncio.sleep(delay)
                delay = min(2 * delay, RETRY_MAX_S)
                continue
            delay = self.config.retry_s
            live.sent = offset
            live.checkpoints += 1
            live.confirmed = True
            live.acked = max(live.acked, min(view.output_offset, len(live.tokens)))
            self._release(live, len(live.tokens) if live.deterministic else live.acked)

    def _release(self, live: LiveSession, upto: int) -> None:
        if upto <= live.released or live.state is not LiveState.RUNNING:
            return
        self.events.write(
            "release", session=str(live.session), epoch=live.epoch, start=live.released, end=upto
        )
        live.released = upto
        live.notify()

    def _supersede(
        self, live: LiveSession, exc: KVSPError, *, state: LiveState = LiveState.SUPERSEDED
    ) -> None:
        """Stop a session that lives elsewhere now (or failed): nothing more is released."""
        if live.state is not LiveState.RUNNING:
            return
        _log.warning("session %s epoch %d stops: %s", live.session, live.epoch, exc)
        live.state = state
        live.error = exc
        live.notify()
        current = asyncio.current_task()
        for task in live.tasks:
            if task is not current:
                task.cancel()
        self._forget_later(live)

    def _finish_if_done(self, live: LiveSession) -> None:
        if live.state is not LiveState.RUNNING or not all(t.done() for t in live.tasks):
            return
        if live.confirmed:  # everything made is covered by the last acknowledgement
            self._release(live, len(live.tokens) if live.deterministic else live.acked)
        live.state = LiveState.FINISHED
        live.notify()
        self._forget_later(live)

    def _forget_later(self, live: LiveSession) -> None:
        def forget() -> None:
            if self._live.get(live.session) is live:
                del self._live[live.session]

        asyncio.get_running_loop().call_later(self.config.keep_finished_s, forget)

    def _declared_failed(self) -> None:
        for live in self._live.values():
            if live.state is LiveState.RUNNING:
                live.force = True  # learn from the PC whether the session moved
                live.wake()

    # -- blocks --------------------------------------------------------------------------------

    async def _replicate_prompt(self, live: LiveSession, opened: Session) -> None:
        """Store the prompt's blocks at the replica holders that lack them, all at once,
        before the first checkpoint lists them; a failure is logged (the session goes on)."""
        if not self._replicas or not live.prompt_blocks:
            return
        wanted = set(self._replicas)
        keys = live.prompt_blocks
        try:
            found = await self._records(live.scope, keys)
            computed = {block.index: block.container for block in opened.sequence.computed}
            loaded = self.agent.engine.lookup(keys[: opened.loaded_blocks])
            work = []
            for index, key in enumerate(keys):
                missing = wanted - {record.holder for record in found.get(key, ())}
                if not missing:
                    continue
                data = computed.get(index)
                if data is None:
                    held = loaded[index] if index < len(loaded) else None
                    data = held.encode() if held is not None else await opened.sequence.block(index)
                work += [self._replicate(h, live.scope, key, data) for h in sorted(missing)]
            await asyncio.gather(*work)
        except KVSPError as exc:
            _log.warning("session %s: replicating the prompt failed: %s", live.session, exc)

    async def _replicate(self, holder: str, scope: ScopeId, key: BlockKey, data: bytes) -> None:
        try:
            await self.agent.block_client.put_block(holder, self.agent.compat, scope, key, data)
        except KVSPError as exc:
            _log.warning("storing block %s at %s failed: %s", key.hex()[:16], holder, exc)

    async def _records(
        self, scope: ScopeId, keys: Sequence[BlockKey]
    ) -> dict[BlockKey, Sequence[ReplicaRecord]]:
        request = LookupRequest(scope_id=scope, compat_id=self.agent.compat, block_keys=tuple(keys))
        answer = await self.agent.index.lookup(request)
        return dict(zip(keys, answer.replicas or (), strict=False))

    async def _load(self, scope: ScopeId, keys: Sequence[BlockKey]) -> list[Container]:
        """The leading blocks of ``keys`` this instance holds or can fetch verified (§6.7),
        up to the first found nowhere."""
        found: list[Container] = list(await self.agent.held_prefix(scope, keys))
        if len(found) == len(keys):
            return found
        rest = keys[len(found) :]
        try:
            records = await self._records(scope, rest)
        except KVSPError as exc:
            _log.warning("lookup for a resume failed: %s", exc)
            return found
        for key in rest:
            block = await self._fetch(records.get(key, ()))
            if block is None:
                break
            found.append(block)
        return found

    def _ordered(self, records: Sequence[ReplicaRecord]) -> list[tuple[str, ReplicaRecord]]:
        """Replica holders first (they outlive instances), this instance never."""
        own = self.agent.public_url
        preferred = set(self._replicas)
        bases = []
        for record in records:
            with contextlib.suppress(UnsupportedHolder):
                base = source_base(record)
                if base != own:
                    bases.append((base not in preferred, base, record))
        return [(base, record) for _, base, record in sorted(bases, key=lambda x: x[0])]

    async def _fetch(self, records: Sequence[ReplicaRecord]) -> Container | None:
        geometry = self.agent.geometry
        for base, record in self._ordered(records):
            try:
                async with asyncio.timeout(self.config.fetch_timeout_s):
                    return await self.agent.block_client.get_block(base, record, geometry=geometry)
            except (KVSPError, TimeoutError) as exc:
                _log.info("block %s from %s: %s", record.block_key.hex()[:16], base, exc)
        return None
