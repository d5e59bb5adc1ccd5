"""Sessions at the PC (§6.8), in-process: the checkpoint rules of :mod:`kvsp.sessions` as the
memory store applies them (stale epoch, highest offset, compare-and-set on the epoch), the
``sessions/…`` resources of ``kvsp serve control`` with their authorization, and failover
driven by status expiry on a manual clock with recording peers in place of instances."""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kvsp.compat import CompatibilityDescriptor, compat_id
from kvsp.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    IllegalTransition,
    NotFound,
    StaleEpoch,
    TransportError,
)
from kvsp.ids import BlockKey, CompatId, ScopeId, uri_id
from kvsp.index import IndexService
from kvsp.lifecycle import InstanceRegistry, SleepPolicy
from kvsp.records import (
    InstanceStatusRecord,
    PrefetchDirective,
    ReplicaRecord,
    ResumeRequest,
    Sampler,
    SessionCheckpoint,
)
from kvsp.registries import InstanceState
from kvsp.services.control import LocalIndex, create_control_app
from kvsp.services.index.app import IndexConfig
from kvsp.services.pc.service import PCConfig, PlacementController
from kvsp.services.pc.sessions import SessionService, SessionSettings
from kvsp.sessions import (
    SessionState,
    accept_checkpoint,
    advance_epoch,
    checkpoint_due,
    new_session,
    plan_resume,
)
from kvsp.stores.descriptors import DescriptorRegistry
from kvsp.stores.memory import MemoryStore
from kvsp.stores.sessions import MemorySessionStore, SessionStore
from kvsp.web.auth import Principals, principal_entry
from kvsp.web.clock import ManualClock
from kvsp.web.testing import InProcessClient
from tests.support.polling import until

T = TypeVar("T")
SCOPE = ScopeId(b"\x0a" * 16)
OTHER_SCOPE = ScopeId(b"\x0b" * 16)
DESCRIPTOR = CompatibilityDescriptor(
    model="m",
    model_digest=b"\xa1" * 32,
    tokenizer_digest=b"\xb2" * 32,
    layers=4,
    kv_heads=2,
    head_dim=8,
    kv_dtype="bf16",
    positional="rope",
    block_tokens=4,
)
COMPAT = CompatId(compat_id(DESCRIPTOR))
A, B, C = (f"https://ii-{n}.example/kvsp/" for n in "abc")
PROBLEM = "urn:ietf:params:kvsp:problem:"


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def key(i: int) -> BlockKey:
    return BlockKey(hashlib.sha256(b"session-key%d" % i).digest())


SESSION = uuid.UUID("6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11")
GENERATED = (1296, 315, 279, 17, 4, 99, 100, 7, 8, 9)


def checkpoint(
    offset: int,
    *,
    epoch: int = 1,
    instance: str | None = A,
    max_tokens: int | None = 10,
    generated: Sequence[int] = GENERATED,
    session: uuid.UUID = SESSION,
    scope: ScopeId = SCOPE,
) -> SessionCheckpoint:
    return SessionCheckpoint(
        session=session,
        epoch=epoch,
        compat_id=COMPAT,
        scope_id=scope,
        prompt_blocks=(key(0), key(1)),
        prompt_tail=(374, 264),
        generated=tuple(generated[:offset]),
        output_offset=offset,
        sampler=Sampler(method="top-p", params={"p": 0.9}, seed=7, step=offset, deterministic=True),
        instance=instance,
        max_tokens=max_tokens,
    )


def record_at(instance: str = A) -> Any:
    return new_session(SESSION, SCOPE, COMPAT, instance, 1_000)


# --- the rules (kvsp.sessions) -----------------------------------------------------------------


def test_a_lower_epoch_is_stale_and_a_higher_one_is_refused() -> None:
    record = advance_epoch(record_at(), 1, B, 2_000)  # now epoch 2 at B
    with pytest.raises(StaleEpoch) as stale:
        accept_checkpoint(record, checkpoint(3, epoch=1, instance=A), 3_000)
    assert stale.value.problem == "kvsp-stale-epoch" and stale.value.status == 409
    with pytest.raises(Conflict) as ahead:
        accept_checkpoint(record, checkpoint(3, epoch=3, instance=B), 3_000)
    assert not isinstance(ahead.value, StaleEpoch) and ahead.value.path == "$.epoch"


def test_only_the_instance_of_the_epoch_may_checkpoint() -> None:
    with pytest.raises(Forbidden):
        accept_checkpoint(record_at(A), checkpoint(3, instance=B), 2_000)
    with pytest.raises(Forbidden):
        accept_checkpoint(record_at(A), checkpoint(3, instance=None), 2_000)
    with pytest.raises(Conflict):
        accept_checkpoint(record_at(A), checkpoint(3, scope=OTHER_SCOPE), 2_000)


def test_the_highest_offset_is_kept_and_covered_tokens_never_change() -> None:
    record = accept_checkpoint(record_at(), checkpoint(5), 2_000)
    assert record.output_offset == 5 and record.updated_ms == 2_000
    older = accept_checkpoint(record, checkpoint(3), 3_000)  # late and lower: kept as is
    assert older is record
    altered = list(GENERATED)
    altered[2] += 1
    with pytest.raises(Conflict) as rewrite:
        accept_checkpoint(record, checkpoint(7, generated=altered), 3_000)
    assert rewrite.value.path == "$.generated"
    resampled = replace(checkpoint(7), sampler=replace(checkpoint(7).sampler, seed=8))
    with pytest.raises(Conflict):
        accept_checkpoint(record, resampled, 3_000)
    assert accept_checkpoint(record, checkpoint(7), 4_000).output_offset == 7


def test_a_checkpoint_covering_max_tokens_ends_the_session() -> None:
    done = accept_checkpoint(record_at(), checkpoint(10), 2_000)
    assert done.state is SessionState.DONE
    assert accept_checkpoint(done, checkpoint(10), 3_000) is done  # a retried PUT
    with pytest.raises(IllegalTransition):
        advance_epoch(done, 1, B, 3_000)


def test_advance_is_a_compare_and_set_that_keeps_the_checkpoint() -> None:
    record = accept_checkpoint(record_at(), checkpoint(4), 2_000)
    moved = advance_epoch(record, 1, B, 3_000)
    assert (moved.epoch, moved.instance, moved.state) == (2, B, SessionState.RESUMING)
    assert moved.checkpoint == record.checkpoint
    with pytest.raises(StaleEpoch):
        advance_epoch(moved, 1, C, 3_000)
    # The new instance's first checkpoint says it serves.
    served = accept_checkpoint(moved, checkpoint(6, epoch=2, instance=B), 4_000)
    assert served.state is SessionState.SERVING and served.output_offset == 6


def test_checkpoint_cadence_block_completion_every_n_and_the_gate() -> None:
    # Prompt of 10 tokens, blocks of 4: KV of 10 + offset - 1 tokens; blocks complete at
    # offsets 3 (12 tokens), 7 (16), 11 (20).
    def due(last: int, offset: int, batch: int | None = None) -> bool:
        return checkpoint_due(
            prompt_tokens=10, block_tokens=4, last=last, offset=offset, every=5, batch=batch
        )

    assert due(0, 1)  # the first token: the PC must be able to resume
    assert not due(1, 2) and due(1, 3)  # a block completed
    assert not due(3, 6) and due(3, 7)
    assert due(7, 12) and not due(8, 10)  # every 5 tokens; nothing new in between
    assert not due(3, 3) and due(3, 4, batch=1)  # the non-deterministic gate's batch


def test_resume_plan_loads_only_blocks_complete_at_the_checkpoint() -> None:
    cp = checkpoint(7)  # tail (2) + 7 output tokens = 9 known tokens after 2 prompt blocks
    plan = plan_resume(cp, 4)
    assert plan.known == (374, 264, *GENERATED[:7])
    assert plan.loadable == 2  # the KV of 8 known tokens existed; the 9th is recomputed
    assert plan.generated_block_tokens() == plan.known[:8]
    assert plan.split(0) == ((374, 264), GENERATED[:7])
    assert plan.split(1) == ((), GENERATED[2:7])
    assert plan.split(2) == ((), GENERATED[6:7])
    with pytest.raises(BadRequest):
        plan.split(3)
    empty = replace(cp, prompt_tail=(), generated=(), output_offset=0)
    with pytest.raises(BadRequest):
        plan_resume(empty, 4)  # the last prompt token is known by its key only


# --- the store ------------------------------------------------------------------------------------


@pytest.fixture(params=["memory", "redis"])
def session_store(request: pytest.FixtureRequest) -> Iterator[tuple[SessionStore, Any]]:
    """A fresh session store of each kind and how to run its coroutines (one event loop for
    the test: a Redis store's connections belong to the loop that opened them)."""
    with asyncio.Runner() as runner:
        if request.param == "memory":
            yield MemorySessionStore(), runner.run
            return
        from kvsp.stores.redis_sessions import RedisSessionStore

        store = RedisSessionStore.from_url(request.getfixturevalue("redis_url"))
        try:
            yield store, runner.run
        finally:
            runner.run(store.aclose())


def test_the_store_bumps_a_contested_epoch_once(
    session_store: tuple[SessionStore, Any],
) -> None:
    store, run_here = session_store

    async def scenario() -> None:
        await store.create(record_at())
        with pytest.raises(Conflict):
            await store.create(record_at())
        await store.put_checkpoint(checkpoint(4), 2_000)
        results = await asyncio.gather(
            store.advance_epoch(SESSION, 1, B, 3_000),
            store.advance_epoch(SESSION, 1, C, 3_000),
            return_exceptions=True,
        )
        winners = [r for r in results if not isinstance(r, BaseException)]
        assert len(winners) == 1 and isinstance(results[1], StaleEpoch)
        record = await store.get(SESSION)
        assert record is not None and (record.epoch, record.instance) == (2, B)
        assert await store.live_at(A) == [] and await store.live_at(B) == [record]
        with pytest.raises(StaleEpoch):
            await store.put_checkpoint(checkpoint(6, epoch=1, instance=A), 4_000)
        with pytest.raises(NotFound):
            await store.put_checkpoint(checkpoint(6, session=uuid.uuid4()), 4_000)
        failed = await store.settle(SESSION, 2, SessionState.FAILED, 5_000, "gone")
        assert failed.detail == "gone" and await store.live_at(B) == []
        # Kept for retain_ms after the last change, then dropped.
        assert await store.expire(5_000 + 999, idle_ms=10**9, retain_ms=1_000) == 0
        assert await store.expire(5_000 + 1_000, idle_ms=10**9, retain_ms=1_000) == 1
        assert await store.get(SESSION) is None

    run_here(scenario())


def test_records_round_trip_through_json() -> None:
    record = advance_epoch(accept_checkpoint(record_at(), checkpoint(4), 2_000), 1, B, 3_000)
    again = type(record).from_json(json.loads(json.dumps(record.to_json())))
    assert again == record
    view = record.view()
    assert view["output_offset"] == 4 and view["max_tokens"] == 10 and "checkpoint" not in view


# --- the HTTP face -------------------------------------------------------------------------------

PRINCIPALS = {
    "admin": (["admin"], None, []),
    "ia": (["instance"], [SCOPE], [A]),
    "ib": (["instance"], [SCOPE], [B]),
    "client": (["client"], [SCOPE], []),
    "other": (["client"], [OTHER_SCOPE], []),
}


def bearer(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer token-of-{name}-0123456789"}


class Peers:
    """Instances as the PC sees them: the resumes they got, and which refuse."""

    def __init__(self) -> None:
        self.resumed: list[tuple[str, ResumeRequest]] = []
        self.refusing: set[str] = set()

    async def prefetch(self, instance: str, directive: PrefetchDirective) -> None:
        return None

    async def put_state(self, instance: str, state: InstanceState) -> None:
        return None

    async def resume(self, instance: str, request: ResumeRequest) -> None:
        if instance in self.refusing:
            raise TransportError(f"{instance}: connection refused")
        self.resumed.append((instance, request))


def status(instance: str, *, epoch: int = 1, ttl_ms: int = 3_000) -> InstanceStatusRecord:
    return InstanceStatusRecord(
        instance=instance,
        epoch=epoch,
        state=InstanceState.ACTIVE,
        running=0,
        queued=0,
        batch_size=8,
        kv_utilization=0.1,
        prefill_tokens_per_s=10_000.0,
        decode_tokens_per_s=1_000.0,
        links=(),
        requested_state=None,
        ttl_ms=ttl_ms,
    )


class Control:
    """``kvsp serve control`` in-process, with a manual clock and recording peers."""

    def __init__(self, tmp_path: Path, settings: SessionSettings | None = None) -> None:
        self.clock = ManualClock(1_000_000)
        self.peers = Peers()
        descriptors = DescriptorRegistry()
        descriptors.add(DESCRIPTOR, persist=False)
        principals = Principals.from_entries(
            [
                principal_entry(name, f"token-of-{name}-0123456789", roles, scopes, holders)
                for name, (roles, scopes, holders) in PRINCIPALS.items()
            ]
        )
        config = PCConfig(sessions=settings or SessionSettings(backoff_ms=1, backoff_max_ms=2))
        self.app = create_control_app(
            IndexConfig(gc_freeze_interval_s=None),  # no gc.collect() in the test process
            store=MemoryStore(),
            principals=principals,
            clock=self.clock,
            descriptors=descriptors,
            peers=self.peers,
            pc_config=config,
        )
        self.http = InProcessClient(self.app)
        self.pc: PlacementController = self.app.state.pc

    def report(self, instance: str) -> None:
        path = f"instances/{uri_id(instance)}/status"
        answer = self.http.put(path, json=status(instance).to_json(), headers=bearer("admin"))
        assert answer.status_code == 200, answer.text

    async def report_now(self, *instances: str) -> None:
        """Status records straight into the controller (inside a running event loop)."""
        for instance in instances:
            await self.pc.put_status(status(instance))

    def place(self, session: uuid.UUID = SESSION, who: str = "client") -> Any:
        body = {
            "scope_id": SCOPE.hex(),
            "compat_id": COMPAT.hex(),
            "block_keys": [],
            "prompt_tokens": 12,
            "session": str(session),
        }
        return self.http.post("place", json=body, headers=bearer(who))

    def put(self, cp: SessionCheckpoint, who: str, body: Any = None) -> Any:
        path = f"sessions/{cp.session}/checkpoint"
        return self.http.put(path, json=body or cp.to_json(), headers=bearer(who))

    def get(self, session: uuid.UUID = SESSION, who: str = "client") -> Any:
        return self.http.get(f"sessions/{session}", headers=bearer(who))


def problem(answer: Any) -> str:
    assert answer.headers["content-type"].startswith("application/problem+json"), answer.text
    kind: str = answer.json()["type"]
    return kind.removeprefix(PROBLEM)


def test_place_with_a_session_creates_it_and_get_says_where_it_lives(tmp_path: Path) -> None:
    control = Control(tmp_path)
    control.report(A)
    placed = control.place()
    assert placed.status_code == 200 and placed.json()["instance"] == A
    assert problem(control.place()) == "kvsp-conflict"  # the same session id again
    view = control.get()
    assert view.status_code == 200
    assert view.json() == {
        "session": str(SESSION),
        "scope_id": SCOPE.hex(),
        "compat_id": COMPAT.hex(),
        "instance": A,
        "epoch": 1,
        "state": "serving",
        "output_offset": 0,
    }
    assert problem(control.get(who="other")) == "kvsp-forbidden"  # another scope
    assert problem(control.get(uuid.uuid4())) == "kvsp-not-found"
    assert problem(control.http.get("sessions/not-a-uuid", headers=bearer("client"))) == (
        "kvsp-bad-request"
    )


def test_checkpoints_over_http_only_from_the_serving_instance(tmp_path: Path) -> None:
    control = Control(tmp_path)
    control.report(A)
    control.report(B)
    assert control.place().status_code == 200
    placed_at = control.get().json()["instance"]
    mine, theirs = ("ia", "ib") if placed_at == A else ("ib", "ia")
    other_uri = B if placed_at == A else A
    cp = checkpoint(3, instance=placed_at)

    # Another instance cannot checkpoint, neither as itself nor by naming the serving one.
    assert problem(control.put(checkpoint(3, instance=other_uri), theirs)) == "kvsp-forbidden"
    assert problem(control.put(cp, theirs)) == "kvsp-forbidden"
    assert problem(control.put(cp, "client")) == "kvsp-forbidden"  # no instance role
    nameless = cp.to_json()
    del nameless["instance"]
    assert problem(control.put(cp, mine, nameless)) == "kvsp-bad-request"
    elsewhere = control.http.put(
        f"sessions/{uuid.uuid4()}/checkpoint", json=cp.to_json(), headers=bearer(mine)
    )
    assert problem(elsewhere) == "kvsp-bad-request"  # the path names another session
    assert problem(control.put(checkpoint(3, session=uuid.uuid4()), mine)) == "kvsp-not-found"
    assert control.get().json()["output_offset"] == 0  # nothing changed

    accepted = control.put(cp, mine)
    assert accepted.status_code == 200, accepted.text
    assert accepted.json() == {
        "session": str(SESSION),
        "epoch": 1,
        "output_offset": 3,
        "state": "serving",
    }
    lower = control.put(checkpoint(2, instance=placed_at), mine)
    assert lower.json()["output_offset"] == 3  # the highest is kept
    stale = control.put(checkpoint(5, epoch=0, instance=placed_at), mine)
    assert stale.status_code == 409 and problem(stale) == "kvsp-stale-epoch"


def test_failover_moves_a_session_to_a_new_instance_at_the_next_epoch(tmp_path: Path) -> None:
    control = Control(tmp_path)
    control.report(A)
    assert control.place().status_code == 200
    assert control.put(checkpoint(4), "ia").status_code == 200
    control.report(B)
    control.peers.refusing.add(C)
    control.report(C)

    async def fail_a() -> None:
        control.clock.advance(2_000)
        await control.report_now(B, C)  # B and C stay live, A does not
        control.clock.advance(1_500)
        assert await control.pc.sweep() == (A,)
        assert await control.pc.sessions.recover() == 1
        await control.pc.sessions.wait_moves()

    run(fail_a())
    # C refused (an unreachable instance), so the session went to B with a new epoch each try.
    [(instance, request)] = control.peers.resumed
    assert instance == B and request.checkpoint == checkpoint(4)
    view = control.get().json()
    assert (view["instance"], view["state"], view["output_offset"]) == (B, "serving", 4)
    assert view["epoch"] == request.epoch and request.epoch in (2, 3)
    # A's late checkpoint is stale; B's is taken.
    assert problem(control.put(checkpoint(6), "ia")) == "kvsp-stale-epoch"
    moved = control.put(checkpoint(6, epoch=request.epoch, instance=B), "ib")
    assert moved.status_code == 200 and moved.json()["output_offset"] == 6


def test_failover_without_instances_fails_the_session_at_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = SessionSettings(deadline_ms=5_000, backoff_ms=1, backoff_max_ms=1)
    control = Control(tmp_path, settings)
    control.report(A)
    assert control.place().status_code == 200
    assert control.put(checkpoint(4), "ia").status_code == 200
    choices: list[str | None] = []
    choose = control.pc.choose_for_resume

    async def noted(cp: SessionCheckpoint, excluded: set[str]) -> str | None:
        choices.append(await choose(cp, excluded))
        return choices[-1]

    monkeypatch.setattr(control.pc, "choose_for_resume", noted)

    async def fail_a() -> None:
        control.clock.advance(3_000)
        await control.pc.sweep()
        await control.pc.sessions.recover()
        # The move found no instance, backed off and asked again: the deadline is what it waits on.
        await until(lambda: len(choices) >= 3, what="three tries to find an instance")
        assert choices[:3] == [None, None, None]
        record = await control.pc.sessions.get(SESSION)
        assert record.state is SessionState.SERVING  # still trying
        control.clock.advance(5_000)
        await control.pc.sessions.wait_moves()

    run(fail_a())
    view = control.get().json()
    assert view["state"] == "failed" and "5000 ms" in view["detail"]
    assert view["output_offset"] == 4 and control.peers.resumed == []


def test_a_session_without_a_checkpoint_fails_at_once(tmp_path: Path) -> None:
    control = Control(tmp_path)
    control.report(A)
    control.report(B)
    assert control.place().status_code == 200
    placed_at = control.get().json()["instance"]

    async def fail() -> None:
        control.clock.advance(2_000)
        await control.report_now(B if placed_at == A else A)
        control.clock.advance(1_500)
        await control.pc.sweep()
        await control.pc.sessions.recover()
        await control.pc.sessions.wait_moves()

    run(fail())
    view = control.get().json()
    assert view["state"] == "failed" and "before the first checkpoint" in view["detail"]
    assert control.peers.resumed == []


def test_racing_failovers_of_two_controllers_bump_the_epoch_once() -> None:
    store = MemorySessionStore()
    peers = Peers()
    clock = ManualClock(1_000_000)

    class Chooser:
        def __init__(self, instance: str) -> None:
            self.instance = instance

        async def choose_for_resume(self, cp: SessionCheckpoint, excluded: set[str]) -> str:
            await asyncio.sleep(0)  # both read the record before either moves it
            return self.instance

    async def scenario() -> None:
        await store.create(record_at())
        await store.put_checkpoint(checkpoint(4), 2_000)
        settings = SessionSettings()
        first = SessionService(store, Chooser(B), peers, clock, settings)
        second = SessionService(store, Chooser(C), peers, clock, settings)
        for service in (first, second):
            service.instance_failed(A)
            assert await service.recover() == 1
        await first.wait_moves()
        await second.wait_moves()

    run(scenario())
    record = run(store.get(SESSION))
    assert record is not None and record.epoch == 2
    assert [(i, r.epoch) for i, r in peers.resumed] == [(record.instance, 2)]


def test_a_restart_seen_in_a_status_record_moves_the_sessions_too(tmp_path: Path) -> None:
    control = Control(tmp_path)
    control.report(A)
    assert control.place().status_code == 200
    assert control.put(checkpoint(2), "ia").status_code == 200
    # A comes back with a new epoch before its record expired: its sessions died with it.
    path = f"instances/{uri_id(A)}/status"
    restarted = status(A, epoch=2).to_json()
    assert control.http.put(path, json=restarted, headers=bearer("admin")).status_code == 200
    # The new incarnation gets a session before the PC moves the old one's: that one stays.
    control.clock.advance(1)
    later = uuid.uuid4()
    assert control.place(later).status_code == 200

    async def recover() -> None:
        await control.pc.sessions.recover()
        await control.pc.sessions.wait_moves()

    run(recover())
    [(instance, request)] = control.peers.resumed
    assert instance == A and request.epoch == 2  # its only candidate: the new incarnation
    assert request.checkpoint.session == SESSION
    assert control.get(later).json()["epoch"] == 1


def replica(i: int, holder: str) -> ReplicaRecord:
    digests = tuple(hashlib.sha256(b"%d/%d" % (i, n)).digest() for n in range(4))
    return ReplicaRecord(
        block_key=key(i),
        compat_id=COMPAT,
        scope_id=SCOPE,
        holder=holder,
        codec=1,
        size=4_000_000,
        digest=hashlib.sha256(b"".join(digests)).digest(),
        layer_digests=digests,
        residency=None,
        ttl_ms=600_000,
    )


def test_the_choice_for_resume_is_the_placement_of_the_checkpoint_prompt() -> None:
    registry: InstanceRegistry[InstanceStatusRecord] = InstanceRegistry(
        SleepPolicy(threshold_load=1, min_low_ms=1_000)
    )
    store = MemoryStore()
    descriptors = DescriptorRegistry()
    descriptors.add(DESCRIPTOR, persist=False)
    index = IndexService(store, max_ttl_ms=600_000, descriptors=descriptors)
    clock = ManualClock(1_000_000)
    config = PCConfig(assumed_link_mbit_per_s=0)  # B has no link to A: it would recompute
    pc = PlacementController(registry, LocalIndex(index, descriptors), Peers(), clock, config)
    for instance in (A, B):
        registry.accept_status(status(instance), clock.now_ms())
    for i in range(2):  # the checkpoint's prompt blocks are resident at A
        run(store.put(replica(i, A), clock.now_ms() + 600_000))
    assert run(pc.choose_for_resume(checkpoint(3), set())) == A
    assert run(pc.choose_for_resume(checkpoint(3), {A})) == B
    assert run(pc.choose_for_resume(checkpoint(3), {A, B})) is None
