"""§6.3 instance lifecycle: the transition table, epochs, expiry and the sleep policy."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from kvsp.errors import BadRequest, IllegalTransition, NotFound, StaleEpoch
from kvsp.lifecycle import (
    TRANSITIONS,
    Actor,
    InstanceRegistry,
    SleepPolicy,
    check_transition,
)
from kvsp.registries import InstanceState

A, D, S, F = (
    InstanceState.ACTIVE,
    InstanceState.DRAINING,
    InstanceState.SLEEPING,
    InstanceState.FAILED,
)
I7, I9 = "https://ii7.example/kvsp/", "https://ii9.example/kvsp/"
ACTORS: tuple[Actor, ...] = ("pc", "instance", "expiry", "shutdown")

# Written out independently of the module's table.
LEGAL = {
    (A, D, "pc"),  # the PC accepts a sleep request, or an operator drains
    (A, D, "shutdown"),  # an instance told to stop (SIGTERM) drains itself first
    (D, A, "pc"),  # an operator cancels the drain
    (D, S, "instance"),  # idle after draining, the instance reports sleeping
    (S, A, "pc"),  # only the PC wakes a sleeping instance
    (A, F, "expiry"),
    (D, F, "expiry"),
    (S, F, "expiry"),
    (F, A, "instance"),  # a new epoch re-registers
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Record:
    instance: str = I7
    epoch: int = 1
    state: str = "active"
    running: int = 0
    queued: int = 0
    requested_state: str | None = None
    ttl_ms: int = 60_000


@pytest.mark.parametrize(
    ("src", "dst", "by"), list(itertools.product(InstanceState, InstanceState, ACTORS))
)
def test_transition_table(src: InstanceState, dst: InstanceState, by: Actor) -> None:
    if (src, dst, by) in LEGAL:
        check_transition(src, dst, by=by)
    else:
        with pytest.raises(IllegalTransition) as info:
            check_transition(src, dst, by=by)
        assert info.value.status == 409 and info.value.problem == "kvsp-conflict"


def test_table_has_exactly_the_legal_moves() -> None:
    assert {(s, d, b) for (s, d), actors in TRANSITIONS.items() for b in actors} == LEGAL


def registry(threshold: float = 2, min_low_ms: int = 10_000) -> InstanceRegistry[Record]:
    return InstanceRegistry(SleepPolicy(threshold_load=threshold, min_low_ms=min_low_ms))


def test_first_record_registers_the_instance() -> None:
    reg = registry()
    accepted = reg.accept_status(Record(epoch=5, running=3), 0)
    assert accepted.state is A and accepted.registered and not accepted.changed
    assert reg.state_of(I7) is A and reg.state_of(I9) is None
    again = reg.accept_status(Record(epoch=5, running=3), 1000)
    assert again.state is A and not again.registered and not again.changed


def test_lower_epoch_is_discarded() -> None:
    reg = registry()
    reg.accept_status(Record(epoch=5, running=7), 0)
    with pytest.raises(StaleEpoch) as info:
        reg.accept_status(Record(epoch=4, running=1), 100)
    assert info.value.problem == "kvsp-stale-epoch"
    entry = reg.get(I7)
    assert entry is not None and entry.epoch == 5 and entry.record.running == 7
    assert entry.received_ms == 0


def test_expiry_marks_failed_and_a_higher_epoch_comes_back() -> None:
    reg = registry()
    reg.accept_status(Record(epoch=1, ttl_ms=3000), 0)
    reg.accept_status(Record(instance=I9, epoch=1, ttl_ms=3000), 1000)
    assert reg.expire(2999) == ()
    assert reg.state_of(I7, 3000) is F  # expired, even before expire() runs
    assert [r.instance for r in reg.active_instances(2999)] == [I7, I9]
    assert [r.instance for r in reg.active_instances(3000)] == [I9]
    assert reg.expire(3000) == (I7,)
    assert reg.state_of(I7) is F
    assert reg.expire(10_000) == (I9,)
    # the failed epoch may not come back; only a restart with a higher epoch does
    with pytest.raises(StaleEpoch):
        reg.accept_status(Record(epoch=1), 11_000)
    accepted = reg.accept_status(Record(epoch=2), 11_000)
    assert accepted.state is A and accepted.registered and accepted.changed
    assert accepted.ended_epoch is None  # expire() already reported epoch 1
    assert [r.instance for r in reg.active_instances(11_000)] == [I7]


def test_late_record_of_an_expired_epoch_is_rejected() -> None:
    reg = registry()
    reg.accept_status(Record(epoch=1, ttl_ms=3000), 0)
    with pytest.raises(StaleEpoch):
        reg.accept_status(Record(epoch=1, ttl_ms=3000), 3000)
    assert reg.expire(3000) == (I7,)  # the failure is still reported once


def test_restart_before_expiry_ends_the_old_epoch() -> None:
    reg = registry()
    reg.accept_status(Record(epoch=1), 0)
    accepted = reg.accept_status(Record(epoch=2), 500)
    assert accepted.registered and accepted.ended_epoch == 1 and accepted.state is A
    with pytest.raises(IllegalTransition):  # a restart enters as active (failed → active)
        reg.accept_status(Record(epoch=3, state="sleeping"), 600)


def test_unknown_instance_adopts_its_reported_state() -> None:
    reg = registry()
    assert reg.accept_status(Record(state="sleeping"), 0).state is S
    assert reg.active_instances(0) == ()


@pytest.mark.parametrize(
    "record",
    [Record(state="failed"), Record(state="busy"), Record(requested_state="draining")],
)
def test_bad_reports(record: Record) -> None:
    with pytest.raises(BadRequest):
        registry().accept_status(record, 0)


def test_sleep_request_granted_only_after_low_load_for_long_enough() -> None:
    reg = registry(threshold=2, min_low_ms=10_000)
    reg.accept_status(Record(running=1), 0)  # load 1 < 2: low since 0
    refused = reg.accept_status(Record(running=1, requested_state="sleeping"), 5000)
    assert refused.state is A  # low for 5000 ms < 10000
    granted = reg.accept_status(Record(queued=1, requested_state="sleeping"), 10_000)
    assert granted.state is D and granted.changed  # low for 10000 ms
    assert reg.active_instances(10_000) == ()


def test_load_spike_restarts_the_low_period() -> None:
    reg = registry(threshold=2, min_low_ms=10_000)
    reg.accept_status(Record(running=1), 0)
    reg.accept_status(Record(running=1, queued=1), 4000)  # load 2: not below the threshold
    reg.accept_status(Record(running=0), 8000)  # low again since 8000
    assert reg.accept_status(Record(requested_state="sleeping"), 15_000).state is A
    assert reg.accept_status(Record(requested_state="sleeping"), 18_000).state is D


def test_drain_then_sleep_then_only_the_pc_wakes() -> None:
    reg = registry(min_low_ms=0)
    reg.accept_status(Record(), 0)
    assert reg.accept_status(Record(requested_state="sleeping"), 100).state is D
    assert reg.accept_status(Record(), 200).state is D  # still reports active: not applied yet
    assert reg.accept_status(Record(state="draining"), 300).state is D
    assert reg.accept_status(Record(state="sleeping"), 400).state is S
    with pytest.raises(IllegalTransition):  # an instance may not wake itself
        reg.accept_status(Record(state="active"), 500)
    assert reg.state_of(I7) is S
    assert reg.set_state(I7, A, 600) is A
    assert reg.accept_status(Record(state="sleeping"), 700).state is A  # not applied yet
    assert reg.accept_status(Record(state="active"), 800).state is A
    with pytest.raises(IllegalTransition):  # now applied: a later "sleeping" is a self-move
        reg.accept_status(Record(state="sleeping"), 900)


def test_wake_restarts_the_low_load_history() -> None:
    reg = registry(min_low_ms=1000)
    reg.accept_status(Record(), 0)
    assert reg.accept_status(Record(requested_state="sleeping"), 1000).state is D
    reg.accept_status(Record(state="sleeping"), 1100)
    reg.set_state(I7, A, 1200)
    reg.accept_status(Record(), 1300)  # low since 1300
    assert reg.accept_status(Record(requested_state="sleeping"), 2000).state is A
    assert reg.accept_status(Record(requested_state="sleeping"), 2300).state is D


def test_cancelled_drain_racing_the_instance_to_sleep() -> None:
    reg = registry()
    reg.accept_status(Record(), 0)
    reg.set_state(I7, D, 100)  # operator drains
    reg.set_state(I7, A, 200)  # and cancels before the instance heard of it
    # the instance drained and slept meanwhile; it will hear "active" in the answer
    assert reg.accept_status(Record(state="sleeping"), 300).state is A
    assert reg.accept_status(Record(state="active"), 400).state is A


def test_operator_changes_follow_the_table() -> None:
    reg = registry()
    with pytest.raises(NotFound):
        reg.set_state(I7, D, 0)
    reg.accept_status(Record(ttl_ms=3000), 0)
    assert reg.set_state(I7, A, 10) is A  # no-op
    with pytest.raises(IllegalTransition):
        reg.set_state(I7, S, 10)  # sleeping is entered only from draining, by the instance
    with pytest.raises(IllegalTransition):
        reg.set_state(I7, F, 10)
    assert reg.set_state(I7, D, 10) is D
    assert reg.set_state(I7, A, 20) is A
    reg.expire(5000)
    with pytest.raises(IllegalTransition):
        reg.set_state(I7, A, 5000)  # a failed instance returns only by re-registering
    assert [e.instance for e in reg.entries()] == [I7]
