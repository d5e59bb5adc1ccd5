"""An instance leaving on SIGTERM (§6.3 draining; the instance app's ``leave``) and the log
line of each directive's outcome (§6.5), in-process against the fake control plane and real
holder processes of ``test_instance``."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from pathlib import Path

import pytest

from kvsp.errors import IllegalTransition, NotActive, StaleEpoch, TransportError
from kvsp.lifecycle import InstanceRegistry, SleepPolicy
from kvsp.records import InstanceStatusRecord, StateAnswer
from kvsp.registries import DirectiveState, InstanceState
from kvsp.services.instance.app import leave
from kvsp.web.clock import ManualClock
from tests.services.instance.test_instance import (  # noqa: F401  (holders: a fixture)
    SCOPE,
    SCOPE_KEY,
    URL,
    FakeControl,
    Holders,
    directive_for,
    generate,
    holders,
    prompt_blocks,
    run,
    running_agent,
)
from tests.support.polling import until
from tests.test_lifecycle import Record


class LeavingControl(FakeControl):
    """The fake control plane with the two routes of a graceful leave (contract 2), logging
    every call in order."""

    def __init__(self, withdraw_fails: bool = False) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.withdraw_fails = withdraw_fails

    async def put_status(self, record: InstanceStatusRecord, /) -> StateAnswer:
        self.calls.append(f"status {record.state}")
        return await super().put_status(record)

    async def withdraw_holder(self, holder: str, /) -> int:
        self.calls.append(f"withdraw {holder}")
        if self.withdraw_fails:
            raise TransportError("the IS is down")
        mine = [r for r in self.published if r.holder == holder]
        self.published = [r for r in self.published if r.holder != holder]
        return len(mine)

    async def end_epoch(self, instance: str, epoch: int, /) -> None:
        self.calls.append(f"end {instance} {epoch}")


def test_leaving_drains_waits_for_sessions_then_withdraws_and_ends_the_epoch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = ManualClock(1_000_000)
    control = LeavingControl()

    async def scenario() -> None:
        async with running_agent(tmp_path, clock, control) as agent:
            await generate(agent, list(range(40)), 2)  # computed blocks, published
            await agent.stop_reporting(settle_s=5)  # (only lets the publications finish here)
            assert any(r.holder == URL for r in control.published)
            session = await agent.open_session(list(range(100, 120)), 3, SCOPE, SCOPE_KEY)
            control.answer = InstanceState.ACTIVE  # a lagging PC answer must not undo draining
            with caplog.at_level(logging.INFO, logger="kvsp.instance"):
                leaving = asyncio.ensure_future(leave(agent, control, control, 30))
                await until(lambda: "status draining" in control.calls, 10, "draining reported")
                assert agent.state is InstanceState.DRAINING
                with pytest.raises(NotActive):  # §6.3: no new sessions
                    await agent.open_session([1, 2], 1, SCOPE, SCOPE_KEY)
                with pytest.raises(IllegalTransition):
                    agent.change_state(InstanceState.ACTIVE)
                assert not leaving.done()  # waiting for the session in flight
                assert [t async for _, t in session.tokens()]
                await leaving
            epoch = agent.epoch
            assert agent.state is InstanceState.DRAINING  # never went on to sleeping
            assert control.calls[-2:] == [f"withdraw {URL}", f"end {URL} {epoch}"]
            assert not any(r.holder == URL for r in control.published)
            assert agent.holder.forget_published() == 0  # closing withdraws nothing more

    run(scenario())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("leaving")]
    assert lines[0].startswith("leaving: state draining reported")
    assert "in-flight sessions and directives finished" in lines[1]
    assert "withdrawing the replicas at the IS: " in lines[2] and "withdrawn" in lines[2]
    assert lines[3].startswith("leaving: ending epoch") and lines[3].endswith("done")


def test_a_failed_step_is_logged_and_the_next_still_tried(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = ManualClock(1_000_000)
    control = LeavingControl(withdraw_fails=True)

    async def scenario() -> None:
        async with running_agent(tmp_path, clock, control) as agent:
            session = await agent.open_session(list(range(20)), 3, SCOPE, SCOPE_KEY)
            with caplog.at_level(logging.INFO, logger="kvsp.instance"):
                await leave(agent, control, control, 0.05)
            assert control.calls[-2:] == [f"withdraw {URL}", f"end {URL} {agent.epoch}"]
            await session.close()

    run(scenario())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("1 sessions and 0 directives still running" in w for w in warnings)
    assert any("withdrawing the replicas at the IS failed: the IS is down" in w for w in warnings)


def test_a_leaving_instance_does_not_register_again(tmp_path: Path) -> None:
    clock = ManualClock(1_000_000)
    control = LeavingControl()

    async def scenario() -> None:
        async with running_agent(tmp_path, clock, control) as agent:
            await agent.begin_leaving()
            control.stale_epochs.add(agent.epoch)
            epoch = agent.epoch
            with pytest.raises(StaleEpoch):
                await agent.report_status()
            assert agent.epoch == epoch and agent.state is InstanceState.DRAINING

    run(scenario())


@pytest.mark.parametrize("pipeline", [True, False])
def test_each_directive_logs_its_outcome(
    tmp_path: Path,
    holders: Holders,  # noqa: F811  (the fixture imported above)
    caplog: pytest.LogCaptureFixture,
    pipeline: bool,
) -> None:
    prompt = list(range(5000, 5016)) if pipeline else list(range(5100, 5116))
    keys, containers = prompt_blocks(prompt)
    control = FakeControl()
    for key, data in zip(keys, containers, strict=True):
        control.records[key] = [holders.put(holders.normal, key, data)]
    clock = ManualClock(1_000_000)
    source = holders.normal.base_url
    other = list(range(6000, 6016)) if pipeline else list(range(6100, 6116))
    other_keys, _ = prompt_blocks(other)

    async def scenario() -> tuple[str, str]:
        async with running_agent(tmp_path, clock, control, pipeline=pipeline) as agent:
            done = agent.accept_directive(directive_for(keys, [[source]] * len(keys)))
            await agent.wait_directive(done)
            assert done.state is DirectiveState.COMPLETE
            good = control.records[keys[0]][0]  # a record of a block the holder lacks: 404
            control.records[other_keys[0]] = [replace(good, block_key=other_keys[0])]
            failed = agent.accept_directive(directive_for(other_keys[:1], [[source]]))
            await agent.wait_directive(failed)
            assert failed.state is DirectiveState.FAILED
            return str(done.directive.directive), str(failed.directive.directive)

    with caplog.at_level(logging.INFO, logger="kvsp.instance"):
        done, failed = run(scenario())
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    (line,) = [m for m in infos if m.startswith(f"directive {done}:")]
    octets = sum(len(c) for c in containers)  # at least the K/V sections of each block
    assert "complete, 4/4 blocks loaded" in line
    moved = int(line.split("blocks loaded, ")[1].split(" octets")[0])
    assert 0 < moved <= octets
    assert f"by source: {source} 4 blocks/{moved} octets" in line
    assert f"by transport: http 4 blocks/{moved} octets" in line
    assert " ms; " in line
    (line,) = [m for m in infos if m.startswith(f"directive {failed}:")]
    assert "failed, 0/1 blocks loaded, 0 octets" in line and "by source: none" in line
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(w.startswith(f"directive {failed} failed: block 0 unavailable") for w in warnings)
    assert any(f"at {source} failed: kvsp-not-found" in w for w in warnings)  # the fetch


def test_the_pc_takes_draining_from_an_instance_that_leaves() -> None:
    from kvsp.lifecycle import InstanceRegistry
    from tests.test_lifecycle import Record

    reg: InstanceRegistry[Record] = InstanceRegistry(SleepPolicy(threshold_load=2, min_low_ms=0))
    reg.accept_status(Record(), 0)
    # an active instance told to stop drains itself: the PC follows (§6.3, no new work)
    assert reg.accept_status(Record(state="draining"), 100).state is InstanceState.DRAINING
    assert reg.accept_status(Record(state="draining"), 200).state is InstanceState.DRAINING
    with pytest.raises(IllegalTransition):  # waking itself is still not allowed
        reg.accept_status(Record(state="active"), 300)
