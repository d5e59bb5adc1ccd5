"""The PC withdraws the replicas of an instance it no longer counts on (spec §6.3, §6.1): one
it declared failed (its record expired, or a restart ended its epoch) and one that ended its
epoch itself; in the control plane's process, through the in-process IS
(:class:`~kvsp.services.control.LocalIndex`). Replicas of other holders stay, and an ended
epoch is left out of listing and placement and is never declared failed."""

from __future__ import annotations

import pytest

from kvsp.errors import NotFound, StaleEpoch
from tests.services.pc.test_pc import (
    ACTIVE,
    FAILED,
    H1,
    A,
    B,
    Setup,
    place_request,
    replica,
    run,
    status,
)


def holders(s: Setup) -> list[list[str]]:
    found = run(
        s.store.lookup(
            place_request().compat_id,
            place_request().scope_id,
            [replica(0).block_key],
            s.clock.now_ms(),
        )
    )
    return [sorted(r.holder for r, _ in entry) for entry in found]


def seeded() -> Setup:
    s = Setup()
    s.publish(3, holder=A)  # A is an instance and a holder of its own blocks
    s.publish(3, holder=H1)
    s.report(status(A, ttl_ms=1_000))
    s.report(status(B, ttl_ms=60_000))
    assert holders(s) == [sorted([A, H1])]
    return s


def test_an_expired_instance_has_its_replicas_withdrawn() -> None:
    s = seeded()
    s.clock.advance(1_000)
    assert run(s.pc.sweep()) == (A,)
    assert holders(s) == [[H1]]
    assert run(s.store.count()) == 3
    assert s.pc.replicas_withdrawn == 3
    assert run(s.pc.sweep()) == ()  # declared once


def test_a_restart_withdraws_the_old_incarnations_replicas_only() -> None:
    s = seeded()
    s.clock.advance(100)
    s.report(status(A, ttl_ms=1_000))  # the old incarnation's last record
    s.clock.advance(100)
    # the new incarnation publishes what its disk tier kept before its first status
    run(s.store.put(replica(5, A), s.clock.now_ms() + 600_000))
    s.report(status(A, epoch=2, ttl_ms=60_000))
    assert holders(s) == [[H1]]
    assert s.pc.replicas_withdrawn == 3
    found = run(
        s.store.lookup(
            replica(5).compat_id, replica(5).scope_id, [replica(5).block_key], s.clock.now_ms()
        )
    )
    assert [[r.holder for r, _ in entry] for entry in found] == [[A]]
    assert s.state(A) is ACTIVE


def test_an_ended_epoch_leaves_the_registry_and_the_index() -> None:
    s = seeded()
    with pytest.raises(StaleEpoch):
        run(s.pc.end_epoch(A, 0))
    run(s.pc.end_epoch(A, 1))
    assert holders(s) == [[H1]]
    assert [v.instance for v in s.pc.list_instances()] == [B]
    assert s.state(A) is None
    s.clock.advance(5_000)
    assert run(s.pc.sweep()) == ()  # never declared failed
    with pytest.raises(NotFound):
        run(s.pc.end_epoch(A, 1))
    s.report(status(A, epoch=2, ttl_ms=60_000))
    assert s.state(A) is ACTIVE


def test_a_failed_instance_is_still_listed_failed() -> None:
    s = seeded()
    s.clock.advance(1_000)
    run(s.pc.sweep())
    assert {v.instance: v.state for v in s.pc.list_instances()}[A] is FAILED
