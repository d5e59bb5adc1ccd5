"""The drain/wake race (spec §6.3): an operator drains an instance through the PC, it reaches
sleeping and reports it, the operator wakes it; the instance reports at once after each change
the PC orders, so its record can reach the PC before the answer to ``PUT state`` does, and
records sent before one another can arrive out of order. The operator's wake always ends
active, and no status record is refused for a transition the PC itself ordered.

Three levels: the pure transitions of :mod:`kvsp.lifecycle`, the controller with an instance
whose report crosses ``PUT state``, and a real control plane with a toy-engine instance."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvsp.errors import IllegalTransition
from kvsp.lifecycle import (
    InstanceEntry,
    SleepPolicy,
    accept_status,
    apply_order,
    cancel_order,
    order_state,
)
from kvsp.records import InstanceStatusRecord
from kvsp.registries import InstanceState
from tests.services.pc.test_pc import A as II_A
from tests.services.pc.test_pc import Setup, status
from tests.support import cluster as cluster_kit
from tests.support.polling import eventually

ACTIVE, DRAINING, SLEEPING = InstanceState.ACTIVE, InstanceState.DRAINING, InstanceState.SLEEPING
I7 = "https://ii7.example/kvsp/"
POLICY = SleepPolicy(threshold_load=1.0, min_low_ms=1_000)


@dataclass(frozen=True, slots=True, kw_only=True)
class Record:
    instance: str = I7
    epoch: int = 1
    state: str = "active"
    running: int = 0
    queued: int = 0
    requested_state: str | None = None
    ttl_ms: int = 60_000


def report(entry: Any, state: str, now: int) -> Any:
    return accept_status(entry, Record(state=state), now, POLICY)


def registered(state: str = "active") -> Any:
    return report(None, state, 0)[0]


# --- pure transitions --------------------------------------------------------------------------


def test_a_sleeping_report_crossing_the_drain_order_is_its_outcome() -> None:
    entry = order_state(registered(), I7, DRAINING, 10)
    entry, accepted = report(entry, "sleeping", 20)  # idle: drained and asleep at once
    assert accepted.state is SLEEPING
    entry = apply_order(entry, I7, DRAINING, 30)  # the answer to PUT state comes in last
    assert entry.state is SLEEPING and entry.ordered == frozenset()


def test_an_active_report_crossing_the_wake_order_is_its_outcome() -> None:
    entry = registered("sleeping")
    entry = order_state(entry, I7, ACTIVE, 10)
    entry, accepted = report(entry, "active", 20)
    assert accepted.state is ACTIVE
    entry = apply_order(entry, I7, ACTIVE, 30)
    assert entry.state is ACTIVE and entry.ordered == frozenset()
    assert report(entry, "active", 40)[1].state is ACTIVE


def test_a_draining_report_overtaken_by_sleeping_is_a_lag() -> None:
    entry = registered()
    entry = apply_order(order_state(entry, I7, DRAINING, 1), I7, DRAINING, 2)
    entry, accepted = report(entry, "sleeping", 3)
    assert accepted.state is SLEEPING
    # the record of "draining" sent before "sleeping" arrives after it
    entry, accepted = report(entry, "draining", 4)
    assert accepted.state is SLEEPING
    # the operator wakes it; records of draining and sleeping still in flight are lags
    entry = apply_order(order_state(entry, I7, ACTIVE, 5), I7, ACTIVE, 6)
    for late in ("draining", "sleeping"):
        entry, accepted = report(entry, late, 7)
        assert accepted.state is ACTIVE
    entry, accepted = report(entry, "active", 8)
    assert accepted.state is ACTIVE and entry.unapplied_from == frozenset()


def test_a_wake_while_it_still_reports_draining_ends_active() -> None:
    entry = registered()
    entry = apply_order(order_state(entry, I7, DRAINING, 1), I7, DRAINING, 2)
    entry = order_state(entry, I7, ACTIVE, 3)
    entry, accepted = report(entry, "draining", 4)  # sent before it took the wake
    assert accepted.state is DRAINING
    entry, accepted = report(entry, "sleeping", 5)  # it finished draining before the wake
    assert accepted.state is SLEEPING
    entry = apply_order(entry, I7, ACTIVE, 6)  # the wake reached it asleep: active
    assert entry.state is ACTIVE
    assert report(entry, "active", 7)[1].state is ACTIVE


def test_without_an_order_the_instance_still_may_not_wake_itself() -> None:
    entry = order_state(registered("sleeping"), I7, ACTIVE, 1)
    entry = cancel_order(entry, ACTIVE)  # the order never reached it
    assert entry is not None and entry.ordered == frozenset()
    with pytest.raises(IllegalTransition):
        report(entry, "active", 2)
    assert cancel_order(entry, ACTIVE) is None  # nothing left to forget


# --- the controller: the instance reports before PUT state is answered -------------------------


class CrossingPeers:
    """Instances that report their new state to the PC while handling PUT state, as the
    instance service does (it wakes its status loop when it changes state); an idle
    instance told to drain reports sleeping."""

    def __init__(self) -> None:
        self.setup: Setup | None = None
        self.answers: list[InstanceState] = []

    async def put_state(self, instance: str, state: InstanceState) -> None:
        assert self.setup is not None
        reached = SLEEPING if state is DRAINING else state
        record = status(instance, state=reached, ttl_ms=60_000)
        self.answers.append((await self.setup.pc.put_status(record)).state)

    async def prefetch(self, instance: str, directive: Any) -> None:
        raise AssertionError("no directive expected")

    async def resume(self, instance: str, request: Any) -> None:
        raise AssertionError("no resume expected")


def test_the_pc_takes_reports_that_cross_its_own_orders() -> None:
    s = Setup()
    peers = CrossingPeers()
    peers.setup = s
    s.pc._peers = peers  # the controller's instances: reporting while PUT state is handled
    s.pc.sessions._peers = peers
    s.report(status(II_A, ttl_ms=60_000))

    async def cycles() -> list[InstanceState]:
        ends = []
        for _ in range(3):
            ends.append(await s.pc.set_state(II_A, DRAINING))
            ends.append(await s.pc.set_state(II_A, ACTIVE))
        return ends

    ends = asyncio.run(cycles())
    assert ends == [SLEEPING, ACTIVE] * 3
    assert peers.answers == [SLEEPING, ACTIVE] * 3
    assert s.state(II_A) is ACTIVE
    entry: InstanceEntry[InstanceStatusRecord] | None = s.pc.registry.get(II_A)
    assert entry is not None and entry.ordered == frozenset()


# --- a real control plane and a toy-engine instance --------------------------------------------


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Any]:
    folder = tmp_path / "cluster"
    folder.mkdir()
    started = cluster_kit.start_cluster(folder, {"a": []}, ["--status-sweep-ms", "100"])
    try:
        yield started
    finally:
        started.stop()
        started.http.close()


@pytest.mark.slow
def test_drain_then_wake_ends_active_and_no_report_is_refused(cluster: Any) -> None:
    for cycle in range(4):
        drained = cluster.set_state("a", "draining")
        assert drained.status_code == 200, drained.text
        assert drained.json()["state"] in ("draining", "sleeping")
        eventually(
            lambda: cluster.row("a")["reported_state"] == "sleeping" or None,
            what=f"a asleep (cycle {cycle})",
        )
        woken = cluster.set_state("a", "active")
        assert woken.status_code == 200, woken.text
        assert woken.json() == {"state": "active"}
        row = eventually(
            lambda: (r := cluster.row("a"))["reported_state"] == "active" and r or None,
            what=f"a awake (cycle {cycle})",
        )
        assert row["state"] == "active"
    placed = cluster.place([1, 2, 3])
    assert placed.status_code == 200 and placed.json()["instance"] == cluster.url("a")
    log = (cluster.folder / "a" / "output.log").read_text(errors="replace")
    assert "not allowed" not in log and "status report failed" not in log, log[-2000:]
