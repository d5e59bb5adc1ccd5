"""A directive's sources are tried in order (spec §6.5, §6.1 "continue with the next
replica"): a source that cannot be reached, or the instance's relay that cannot deliver, is
logged at warning with its cause and the next source is used. Real holder processes on
127.0.0.1 (the ``holders`` fixture of test_instance)."""

from __future__ import annotations

import logging
import socket
from dataclasses import replace
from pathlib import Path

import pytest

from kvsp.registries import DirectiveState
from kvsp.transfer.block_client import BlockClient
from kvsp.transfer.moqt_client import MoqtBlockClient
from kvsp.web.clock import ManualClock
from tests.services.instance.test_instance import (
    TOKEN,
    FakeControl,
    Holders,
    directive_for,
    holders,
    prompt_blocks,
    run,
    running_agent,
)

__all__ = ["holders"]  # the module-scoped fixture, started for this module too


def closed_port(kind: int = socket.SOCK_STREAM) -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@pytest.mark.parametrize("pipeline", [True, False])
def test_an_unreachable_first_source_falls_through_to_the_next(
    tmp_path: Path, holders: Holders, pipeline: bool, caplog: pytest.LogCaptureFixture
) -> None:
    prompt = list(range(4000, 4012)) if pipeline else list(range(4100, 4112))
    keys, containers = prompt_blocks(prompt)
    dead = f"http://127.0.0.1:{closed_port()}/kvsp/"
    control = FakeControl()
    for key, data in zip(keys, containers, strict=True):
        good = holders.put(holders.normal, key, data)
        control.records[key] = [replace(good, holder=dead, lease_base=None), good]
    gone = "http://gone.test/kvsp/"  # named by the PC, its record withdrawn since
    sources = [[gone, dead, holders.normal.base_url]] * len(keys)

    async def scenario() -> None:
        async with running_agent(
            tmp_path, ManualClock(1_000_000), control, pipeline=pipeline
        ) as agent:
            progress = agent.accept_directive(directive_for(keys, sources))
            await agent.wait_directive(progress)
            assert progress.state is DirectiveState.COMPLETE, progress.detail
            assert progress.loaded == tuple(keys)
            links = {link.holder for link in agent.status_record().links}
            assert links == {holders.normal.base_url}

    with caplog.at_level(logging.WARNING, logger="kvsp.instance"):
        run(scenario())
    failed = [r.getMessage() for r in caplog.records if dead in r.getMessage()]
    assert failed and all("kvsp-unreachable" in line for line in failed), failed
    skipped = [r.getMessage() for r in caplog.records if gone in r.getMessage()]
    assert len(skipped) == len(keys), skipped
    assert all("has no replica record" in line for line in skipped)


def test_the_relay_is_tried_unleased_and_a_failing_relay_falls_through(
    tmp_path: Path, holders: Holders, caplog: pytest.LogCaptureFixture
) -> None:
    """With ``relay`` set, a directive may name the relay for a block it has no record of: the
    instance derives the record (through_relay), takes no lease there, and on failure moves on."""
    prompt = list(range(5000, 5008))
    keys, containers = prompt_blocks(prompt)
    relay = f"moqt://127.0.0.1:{closed_port(socket.SOCK_DGRAM)}/"
    control = FakeControl()
    for key, data in zip(keys, containers, strict=True):
        control.records[key] = [holders.put(holders.normal, key, data)]
    sources = [[relay, holders.normal.base_url]] * len(keys)

    async def scenario() -> None:
        moqt = MoqtBlockClient(verify=False, auth_token=TOKEN, timeout=2)
        client = BlockClient(TOKEN, moqt=moqt)
        async with running_agent(
            tmp_path, ManualClock(1_000_000), control, client=client, relay=relay
        ) as agent:
            assert agent.status_record().relay == relay
            progress = agent.accept_directive(directive_for(keys, sources))
            await agent.wait_directive(progress)
            assert progress.state is DirectiveState.COMPLETE, progress.detail
            assert {link.holder for link in agent.status_record().links} == {
                holders.normal.base_url
            }

    with caplog.at_level(logging.WARNING, logger="kvsp.instance"):
        run(scenario())
    tried = [r.getMessage() for r in caplog.records if relay in r.getMessage()]
    # it was tried (a FETCH, not a lease: the relay has nothing to lease) and failed in transport
    assert tried and all("GET at" in line and "kvsp-unreachable" in line for line in tried), tried
    assert not any("has no replica record" in r.getMessage() for r in caplog.records)
