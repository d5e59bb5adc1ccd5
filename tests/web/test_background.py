"""Background loops end when cancelled, even when a client library turns the cancel into an
ordinary error (kvsp.web.background): the IS sweeper over a store whose call does what
redis-py's reads under ``asyncio.timeout`` can do."""

from __future__ import annotations

import asyncio

import pytest

from kvsp.errors import StoreUnavailable
from kvsp.services.index.app import IndexConfig, sweep_forever
from kvsp.web.background import raise_if_cancelling
from kvsp.web.clock import ManualClock


class CancelEatingIndex:
    """An index whose sweep, cancelled mid-call, raises StoreUnavailable instead."""

    def __init__(self) -> None:
        self.inside = asyncio.Event()
        self.calls = 0

    async def sweep(self, now_ms: int, max_items: int) -> int:
        self.calls += 1
        self.inside.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if self.calls > 1:
                raise  # only the first cancel is eaten, so that a failing test ends
            raise StoreUnavailable("Redis store: TimeoutError: Timeout reading") from None
        return 0


def test_the_sweeper_ends_when_cancelled_mid_call() -> None:
    async def scenario() -> None:
        index = CancelEatingIndex()
        config = IndexConfig(sweep_interval_s=0.001, gc_freeze_interval_s=None)
        task = asyncio.create_task(sweep_forever(index, ManualClock(0), config))  # type: ignore[arg-type]
        await asyncio.wait_for(index.inside.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)  # without the fix: TimeoutError, the loop went on
        assert index.calls == 1

    asyncio.run(scenario())


def test_raise_if_cancelling_is_quiet_otherwise() -> None:
    async def scenario() -> None:
        raise_if_cancelling()  # a running task with no cancel pending

    asyncio.run(scenario())
